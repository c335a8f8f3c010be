"""The compressor's per-block arithmetic on packed 32-bit words (format version 1).

The compression kernels hold a block as two uint16 [64, 4] arrays, `x` (pack-layout rows 2k:
positions 8k..8k+3) and `y` (rows 2k + 1: positions 8k+4..8k+7); a row is four BF16 patterns,
eight bytes. Widened to int32, every pattern costs its own register and its own instruction per
step (about 22 instructions per value in the persistent kernel's SASS, 132 registers a thread).
Here a row stays two 32-bit words (patterns 0, 1 and 2, 3, the first in the low half) and one
`prmt` or one bitwise op handles four bytes:

  low bytes   prmt(w01, w23, 0x6420)                       bytes v0.lo v1.lo v2.lo v3.lo
  high bytes  prmt(w01, w23, 0x7531)                       bytes v0.hi v1.hi v2.hi v3.hi
  codes       (Hx & 0x80808080) | ((Hy & 0x7f7f7f7f) - B) << 4
              | (Hy >> 4) & 0x08080808 | ((Hx & 0x7f7f7f7f) - B)    B = b/2 in every byte

(FORMAT.md §4: code byte q pairs x = position 8 (q // 4) + q % 4 with y = x + 4; a byte of
`H & 0x7f` is the value's exponent >> 1, at least b/2 in an eligible block, so the subtraction
never borrows across bytes and the shift never carries out of one.) The block rule needs only
the extreme magnitudes: with m = pattern & 0x7fff, exponent >> 1 = m >> 8 is monotone in m, so
b/2 = min(m) >> 8 and the block fits [b, b + 15] iff (max(m) >> 8) - b/2 < 8; `min.u16x2` /
`max.u16x2` give two patterns' extremes per instruction.

On a GPU each helper is one `pltr.elementwise_inline_asm` with `pack` = the patterns one
instance reads (Triton packs a thread's consecutive uint16 elements two to a register, the
first in the low half, and four uint8 results to one register); interpreted (CPU), the same
word arithmetic in jnp on the row's words, so the tests run the formulas the PTX spells out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltr

SELECT = {"low": 0x6420, "high": 0x7531}  # prmt selectors: even bytes (low), odd bytes (high)

_CODES_PTX = """{
  .reg .b32 hx, hy, dx, dy, t;
  prmt.b32 hx, $1, $2, 0x7531;
  prmt.b32 hy, $3, $4, 0x7531;
  and.b32 dx, hx, 0x7f7f7f7f;
  sub.u32 dx, dx, $5;
  and.b32 dy, hy, 0x7f7f7f7f;
  sub.u32 dy, dy, $5;
  shl.b32 dy, dy, 4;
  and.b32 hx, hx, 0x80808080;
  shr.u32 hy, hy, 4;
  and.b32 hy, hy, 0x08080808;
  or.b32 t, hx, dy;
  or.b32 t, t, hy;
  or.b32 $0, t, dx;
}"""

# One asm per extreme: the Pallas lowering of a multi-result inline asm returns one value, so the
# two masks are written twice (ptxas may merge them).
_EXTREME_PTX = """{
  .reg .b32 a, b;
  and.b32 a, $1, 0x7fff7fff;
  and.b32 b, $2, 0x7fff7fff;
  %s.u16x2 $0, a, b;
}"""


# Each helper's inline PTX ($0 the result register, then the packed arguments in order);
# tests/test_compress_words.py runs these strings through a small PTX model on numpy.
PTX = {
    "low": f"prmt.b32 $0, $1, $2, {SELECT['low']:#x};",
    "high": f"prmt.b32 $0, $1, $2, {SELECT['high']:#x};",
    "codes": _CODES_PTX,
    "min": _EXTREME_PTX % "min",
    "max": _EXTREME_PTX % "max",
}


def _row_words(v):
  """uint16 [..., 4] -> (uint32 [...], uint32 [...]): patterns 0, 1 and 2, 3 as words, the first in the low half."""
  v = v.astype(jnp.uint32)
  return v[..., 0] | (v[..., 1] << 16), v[..., 2] | (v[..., 3] << 16)


def _word_bytes(w):
  """uint32 [...] -> uint8 [..., 4], byte 0 first."""
  return jnp.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(jnp.uint8)


def _prmt(a, b, select: int):
  """PTX `prmt.b32` (default mode) in jnp: byte i of the result is byte (select >> 4i) & 7 of b:a."""
  both = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = jnp.zeros_like(a)
  for i in range(4):
    k = (select >> (4 * i)) & 7
    out = out | (both[k] << (8 * i))
  return out


def _row_bytes(v, half: str, asm: bool):
  """uint16 [..., 4] -> uint8 [..., 4]: the patterns' `half` ("low" or "high") bytes."""
  if asm:
    [out] = pltr.elementwise_inline_asm(
        PTX[half], args=[v], constraints="=r,r,r", pack=4, result_shape_dtypes=[_like(v, jnp.int8)])
    return out.astype(jnp.uint8)
  return _word_bytes(_prmt(*_row_words(v), SELECT[half]))


def low_bytes(v, asm: bool):
  """uint16 [..., 4] patterns -> uint8 [..., 4] their low bytes."""
  return _row_bytes(v, "low", asm)


def high_bytes(v, asm: bool):
  """uint16 [..., 4] patterns -> uint8 [..., 4] their high bytes (sign, exponent >> 1)."""
  return _row_bytes(v, "high", asm)


def replicated_half_base(hb):
  """int32 b/2 -> uint16 (b/2) * 0x0101: two of them make the word of four b/2 bytes the codes subtract."""
  return (hb * 0x0101).astype(jnp.uint16)


def codes(x, y, hb2, asm: bool):
  """Code bytes of an eligible block's rows.

  Args:
    x, y: uint16 [64, 4], the block's x and y rows.
    hb2: uint16 scalar, `replicated_half_base(b/2)`.

  Returns:
    uint8 [64, 4]: code byte 4k + j pairs x[k, j] with y[k, j] (FORMAT.md §4).
  """
  if asm:
    base = jnp.full(x.shape, hb2, jnp.uint16)
    # One instance per row: x's words $1 $2, y's $3 $4, b/2 replicated in $5 (and the unused $6).
    [out] = pltr.elementwise_inline_asm(
        PTX["codes"], args=[x, y, base], constraints="=r,r,r,r,r,r,r", pack=4,
        result_shape_dtypes=[_like(x, jnp.int8)])
    return out.astype(jnp.uint8)
  hx = _prmt(*_row_words(x), SELECT["high"])
  hy = _prmt(*_row_words(y), SELECT["high"])
  return _word_bytes(code_word(JnpOps, hx, hy, hb2.astype(jnp.uint32) * np.uint32(0x10001)))


class JnpOps:
  """`code_word`'s integer ops on uint32 jnp arrays."""

  and_, or_, shl, shr, sub = jnp.bitwise_and, jnp.bitwise_or, jnp.left_shift, jnp.right_shift, jnp.subtract
  const = staticmethod(np.uint32)


def code_word(ops, hx, hy, base):
  """Four code bytes from the high bytes of positions 8k..8k+3 (`hx`) and 8k+4..8k+7 (`hy`), `base`
  = b/2 in every byte; written against `ops` (jnp here, MLIR in `compress_tma`)."""
  seven = ops.const(0x7F7F7F7F)
  dx, dy = ops.sub(ops.and_(hx, seven), base), ops.sub(ops.and_(hy, seven), base)
  return ops.or_(ops.or_(ops.and_(hx, ops.const(0x80808080)), ops.shl(dy, ops.const(4))),
                 ops.or_(ops.and_(ops.shr(hy, ops.const(4)), ops.const(0x08080808)), dx))


def magnitude_extremes(x, y, asm: bool):
  """uint16 [..., 4] x, y -> uint16 (min, max) over both of pattern & 0x7fff (scalars)."""
  if asm:
    lo, hi = (pltr.elementwise_inline_asm(
        PTX[op], args=[x, y], constraints="=r,r,r", pack=2,
        result_shape_dtypes=[_like(x, jnp.int16)])[0] for op in ("min", "max"))  # < 0x8000
  else:
    mx, my = x & 0x7FFF, y & 0x7FFF
    lo, hi = jnp.minimum(mx, my), jnp.maximum(mx, my)
  # One axis per reduction (the Triton lowering of a two-axis reduction fails under an abstract mesh).
  return jnp.min(jnp.min(lo, axis=-1), axis=-1), jnp.max(jnp.max(hi, axis=-1), axis=-1)


def block_rule(x, y, asm: bool):
  """(eligible bool, b/2 int32) of a block from its rows, as `block.block_half_base`."""
  lowest, highest = magnitude_extremes(x, y, asm)
  hb = lowest.astype(jnp.int32) >> 8
  return (highest.astype(jnp.int32) >> 8) - hb < 8, hb


def _like(v, dtype):
  # Signed result types: the Pallas lowering gives the asm op the aval's MLIR type, and an
  # unsigned one (ui8, ui16) fails the verifier of the Triton ops that consume it.
  return jax.ShapeDtypeStruct(v.shape, dtype)

"""The compressor's packed-word arithmetic (`pallas_kernels/compress_words.py`).

Three views of the same formulas are checked against the format's reference encoder: the jnp words
(what interpret mode runs), the inline PTX strings (run here by a small model of the PTX
instructions they use, on numpy words packed as Triton packs them: element 0 in the low half),
and the persistent kernel with `packed_words=True` end to end.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import zipfusion_jax as zf
from pallas_kernels import compress_words as W
from pallas_kernels.compress import CompressConfig, compress_pallas
from zipfusion_jax.format import block as B

MASK = 0xFFFFFFFF


def _prmt(a, b, select):
  both = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  return sum(both[(select >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _halves(op, a, b):
  lo = op(a & 0xFFFF, b & 0xFFFF)
  hi = op(a >> 16, b >> 16)
  return lo | (hi << 16)


PTX_OPS = {  # the instructions compress_words' PTX uses, on uint64 numpy words (kept to 32 bits)
    "prmt.b32": lambda a, b, s: _prmt(a, b, int(s)),
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "sub.u32": lambda a, b: (a - b) & MASK,
    "shl.b32": lambda a, b: (a << b) & MASK,
    "shr.u32": lambda a, b: a >> b,
    "min.u16x2": lambda a, b: _halves(np.minimum, a, b),
    "max.u16x2": lambda a, b: _halves(np.maximum, a, b),
}


def run_ptx(text: str, *registers: np.ndarray) -> np.ndarray:
  """Run one inline-asm body: `registers` are $1, $2, ... (uint64 arrays holding 32-bit words); returns $0."""
  env = {f"${i + 1}": r.astype(np.uint64) for i, r in enumerate(registers)}
  for line in text.strip().strip("{}").splitlines():
    line = line.strip().rstrip(";")
    if not line or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    dst, *srcs = [a.strip() for a in args.split(",")]
    vals = [np.uint64(int(s, 0)) if re.fullmatch(r"0x[0-9a-f]+|\d+", s) else env[s] for s in srcs]
    env[dst] = PTX_OPS[op](*vals)
  return env["$0"]


def _words(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """uint16 [..., 4] -> the two 32-bit registers Triton packs them into (element 0 in the low half)."""
  v = v.astype(np.uint64)
  return v[..., 0] | (v[..., 1] << 16), v[..., 2] | (v[..., 3] << 16)


def _bytes(w: np.ndarray) -> np.ndarray:
  return np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-1).astype(np.uint8)


@pytest.fixture(scope="module")
def blocks(eligible_rotations, raw_rotations):
  """uint16 [n, 512]: every 16th block of the exhaustive sets and scaled normals (eligible and raw)."""
  rng = np.random.default_rng(3)
  scaled = (rng.normal(size=(64, 512)) * np.exp2(rng.uniform(-20, 20, (64, 1)))).astype(ml_dtypes.bfloat16)
  return np.concatenate([eligible_rotations[::16], raw_rotations[::16], scaled.view(np.uint16)])


def _rows(bits):
  """uint16 [n, 512] -> x, y uint16 [n, 64, 4] (the kernels' pack-layout rows)."""
  pairs = bits.reshape(-1, 64, 2, 4)
  return pairs[:, :, 0], pairs[:, :, 1]


def _reference_planes(bits):
  """(eligible [n], half_base [n], low plane uint8 [n, 512], code plane uint8 [n, 256], high plane [n, 512])."""
  eligible, half_base = (np.asarray(a) for a in B.block_half_base(jnp.asarray(bits)))
  low = (bits & 0xFF).astype(np.uint8)
  high = (bits >> 8).astype(np.uint8)
  c = zf.compress(bits.view(ml_dtypes.bfloat16), impl="reference")
  payload = np.asarray(c.payload).reshape(-1, B.UNIT_BYTES)
  offsets = np.asarray(c.group_meta)[:, 0] & B.OFFSET_MASK
  units = np.asarray(B.block_units(c.meta_bytes)).reshape(-1)
  starts = np.repeat(offsets, B.BLOCKS_PER_GROUP) + (np.cumsum(units.reshape(-1, 4), axis=1) - units.reshape(-1, 4)).reshape(-1)
  codes = np.stack([payload[s + 2] if e else np.zeros(256, np.uint8) for s, e in zip(starts[: len(bits)], eligible)])
  return eligible, half_base, low, codes, high


@pytest.mark.parametrize("impl", ["jnp", "ptx"])
def test_block_rule_equals_block_half_base(blocks, impl):
  x, y = _rows(blocks)
  want_eligible, want_half_base = (np.asarray(a) for a in B.block_half_base(jnp.asarray(blocks)))
  assert 0 < want_eligible.sum() < len(blocks)
  if impl == "jnp":
    eligible, half_base = (np.asarray(a) for a in W.block_rule(jnp.asarray(x), jnp.asarray(y), asm=False))
  else:  # min.u16x2 / max.u16x2 on register pairs, then the rule on the reduced extremes
    xw, yw = _words(x), _words(y)
    # Each result register holds two elements (the kernel reduces them as int16 elements).
    lanes = lambda op: np.concatenate([np.stack([w & 0xFFFF, w >> 16], -1) for w in
                                       (run_ptx(W.PTX[op], xw[i], yw[i]) for i in range(2))], -1)
    lowest = lanes("min").reshape(len(blocks), -1).min(axis=1).astype(np.int64)
    highest = lanes("max").reshape(len(blocks), -1).max(axis=1).astype(np.int64)
    half_base = lowest >> 8
    eligible = (highest >> 8) - half_base < 8
  np.testing.assert_array_equal(eligible, want_eligible)
  np.testing.assert_array_equal(half_base, want_half_base)


@pytest.mark.parametrize("impl", ["jnp", "ptx"])
def test_row_bytes_and_codes_equal_the_reference_planes(blocks, impl):
  eligible, half_base, low, codes, high = _reference_planes(blocks)
  x, y = _rows(blocks)
  hb2 = (half_base * 0x0101).astype(np.uint16)
  if impl == "jnp":
    got_low = [np.asarray(W.low_bytes(jnp.asarray(v), asm=False)) for v in (x, y)]
    got_high = [np.asarray(W.high_bytes(jnp.asarray(v), asm=False)) for v in (x, y)]
    got_codes = np.asarray(jax.vmap(lambda a, b, h: W.codes(a, b, h, asm=False))(
        jnp.asarray(x), jnp.asarray(y), jnp.asarray(hb2)))
  else:
    got_low = [_bytes(run_ptx(W.PTX["low"], *_words(v))) for v in (x, y)]
    got_high = [_bytes(run_ptx(W.PTX["high"], *_words(v))) for v in (x, y)]
    base = np.broadcast_to(hb2.astype(np.uint64)[:, None] * 0x10001, x.shape[:2])
    got_codes = _bytes(run_ptx(W.PTX["codes"], *_words(x), *_words(y), base, base))
  interleave = lambda a, b: np.stack([a, b], axis=2).reshape(len(blocks), 512)  # rows 2k (x), 2k + 1 (y)
  np.testing.assert_array_equal(interleave(*got_low), low)
  np.testing.assert_array_equal(interleave(*got_high), high)
  np.testing.assert_array_equal(got_codes.reshape(len(blocks), 256)[eligible], codes[eligible])


def test_the_ptx_model_can_fail():
  """A swapped register pair or a wrong selector changes the model's answer (the checks above bite)."""
  v = np.array([[0x1234, 0x5678, 0x9ABC, 0xDEF0]], np.uint16)
  a, b = _words(v)
  assert _bytes(run_ptx(W.PTX["low"], a, b)).tolist() == [[0x34, 0x78, 0xBC, 0xF0]]
  assert _bytes(run_ptx(W.PTX["low"], b, a)).tolist() != [[0x34, 0x78, 0xBC, 0xF0]]
  assert _bytes(run_ptx(W.PTX["high"], a, b)).tolist() == [[0x12, 0x56, 0x9A, 0xDE]]


@pytest.mark.parametrize("programs,zero_tail,pair_rows", [(1, True, False), (3, True, False), (200, False, False),
                                                     (1, True, True), (3, False, True)])
def test_persistent_kernel_on_packed_words_is_a_valid_stream_of_the_reference_groups(programs, zero_tail, pair_rows):
  rng = np.random.default_rng(21)
  x = (rng.normal(size=(301, 512)) * np.exp2(rng.uniform(-6, 3, (301, 1)))).astype(np.float32)
  raw = rng.random(301) < 0.3
  x[raw, rng.integers(0, 512, raw.sum())] = 1e-30
  x = x.astype(ml_dtypes.bfloat16)
  cfg = CompressConfig(single_pass=True, ordered=False, tile_groups=1, num_warps=1, persistent_programs=programs,
                       packed_words=True, zero_tail=zero_tail, pair_rows=pair_rows)
  got, want = compress_pallas(x, config=cfg, interpret=True), zf.compress(x, impl="reference")
  zf.validate(got)
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))
  canonical = zf.canonical_order(got)
  used = int(want.payload_units) * B.UNIT_BYTES
  np.testing.assert_array_equal(np.asarray(canonical.group_meta), np.asarray(want.group_meta))
  np.testing.assert_array_equal(np.asarray(canonical.payload)[:used], np.asarray(want.payload)[:used])
  if zero_tail:
    np.testing.assert_array_equal(np.asarray(canonical.payload), np.asarray(want.payload))


def test_packed_words_lower_to_the_inline_ptx_for_an_abstract_h200():
  """The GPU lowering (abstract H200) carries every PTX body, and the int32 path none of them."""
  from benchmarks.kernel_sass import capture_triton_modules

  def modules(**knobs):
    cfg = CompressConfig(single_pass=True, ordered=False, tile_groups=1, num_warps=1, persistent_programs=8, **knobs)

    def f(x):
      c = compress_pallas(x, config=cfg, interpret=False)
      return c.payload, c.group_meta, c.payload_units

    return dict(capture_triton_modules(f, jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)))

  words, plain = modules(packed_words=True), modules()
  name = "zipfusion_compress_single_pass_persistent"
  for key in ("low", "high", "codes", "min", "max"):
    body = W.PTX[key].splitlines()[-2 if key in ("codes", "min", "max") else 0].strip()
    assert body.split()[0] in words[name], key
  assert "prmt.b32" not in plain[name] and "u16x2" not in plain[name]
  with pytest.raises(ValueError, match="packed_words"):
    CompressConfig(single_pass=True, ordered=False, packed_words=True)  # not persistent
  with pytest.raises(ValueError, match="pair_rows"):
    CompressConfig(single_pass=True, ordered=False, persistent_programs=8, pair_rows=True)  # int32 path


@pytest.mark.parametrize("whole", [False, True])
def test_store_pattern_copies_are_exact(whole):
  """`benchmarks.store_pattern`'s two copies (the compressor's half-sector stores, whole-sector stores) copy exactly."""
  from benchmarks.store_pattern import PAIRS_PER_TILE, store_copy

  src = jax.random.bits(jax.random.key(1), (5 * PAIRS_PER_TILE, 2, 4), jnp.uint8)
  out = store_copy(src, programs=3, whole=whole, interpret=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(src))

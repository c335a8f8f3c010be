"""The 12-bit block rule: constants and the per-block encode/decode in jnp.

This module *is* the specification of one block (see docs/FORMAT.md). A block
is 512 BF16 values in *position order* (the page layout in `layout.py` decides
which token and dimension sits at which position). Every function here works
on uint16 bit patterns, never on floating-point values, so NaN payloads, -0.0,
Inf and subnormals pass through unchanged.

Encoded row (always 1024 bytes here; only the first `units * 256` are stored):
  compressed (3 units): [low bytes 512][code bytes 256][unused 256]
  raw        (4 units): [low bytes 512][high bytes 512]

Code byte q pairs positions x = 8*(q//4) + q%4 and y = x + 4:
  bit 7 = sign(x), bits 6..4 = d(y), bit 3 = sign(y), bits 2..0 = d(x)
where d = (exponent >> 1) - half_base. Restoring the high byte is then
  high(x) = (c & 0x87) + half_base
  high(y) = (((c >> 4) & 0x07) | ((c << 4) & 0x80)) + half_base
on four bytes at a time in a 32-bit word; the add never carries out of a byte.

Version 2 adds one exception per block: a block whose exponents fit the window
once its single largest (or smallest) value is set aside is stored in 12 bits
too; that value keeps its low byte and sign in place, with d = 0, and its
`exponent >> 1` and position travel in the group metadata (a 16-bit entry per
slot: position | (exponent >> 1) << 9). Its slot byte is 0x80 | b/2 (b/2 <= 125).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

VALUES_PER_BLOCK = 512
BLOCKS_PER_GROUP = 4
UNIT_BYTES = 256
LOW_PLANE_BYTES = 512
CODE_PLANE_BYTES = 256
COMPRESSED_UNITS = 3  # 768 bytes
RAW_UNITS = 4  # 1024 bytes
ROW_BYTES = RAW_UNITS * UNIT_BYTES
GROUP_META_BYTES = 8  # version 1: offset word + slot-byte word
GROUP_META_BYTES_V2 = 16  # version 2: + two words of 16-bit exception entries
GROUP_RECORD_BYTES = {1: GROUP_META_BYTES, 2: GROUP_META_BYTES_V2}  # format version -> group record size

# Per-block metadata byte.
MAX_HALF_BASE = 127  # 0..127: compressed, the byte is b/2
META_EXCEPTION = 0x80  # version 2: 0x80 | b/2 (b/2 <= 125), compressed with one exception
MAX_EXCEPTION_META = 0xFD
META_RAW = 0xFF
META_ABSENT = 0xFE  # slot past the last block of a partial group
POSITION_BITS = 9  # exception entry: position (bits 0..8) | exponent >> 1 (bits 9..15)

# Group offset word: bits 31..30 version, bits 29..0 offset in 256-byte units.
FORMAT_VERSION = 1
FORMAT_VERSIONS = (1, 2)
VERSION_SHIFT = 30
OFFSET_MASK = (1 << VERSION_SHIFT) - 1

EXPONENT_WINDOW = 16  # exponents b .. b+15 fit in 3 bits of d plus the kept bit


def exponents(bits: jnp.ndarray) -> jnp.ndarray:
  """uint16 [..., n] -> int32 [..., n]: the 8-bit biased exponent field."""
  return (bits.astype(jnp.int32) >> 7) & 0xFF


def block_half_base(bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Decide the block rule for each block.

  Args:
    bits: uint16 [..., 512], BF16 bit patterns of whole blocks.

  Returns:
    (eligible, half_base): bool [...] and int32 [...]. `half_base` is b/2 with
    b = min exponent rounded down to even; `eligible` iff every exponent lies
    in [b, b + 15].
  """
  e = exponents(bits)
  base = jnp.min(e, axis=-1) & ~1
  eligible = jnp.max(e, axis=-1) - base < EXPONENT_WINDOW
  return eligible, base >> 1


def block_meta_byte(eligible: jnp.ndarray, half_base: jnp.ndarray) -> jnp.ndarray:
  """bool [...], int32 [...] -> int32 [...]: b/2, or META_RAW."""
  return jnp.where(eligible, half_base, META_RAW)


def block_rule_v2(bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The version-2 rule: the version-1 window, else the window with one value set aside.

  Args:
    bits: uint16 [..., 512], BF16 bit patterns of whole blocks.

  Returns:
    (meta_byte, exception): int32 [...] each. `meta_byte` is b/2 (no exception), 0x80 | b/2
    (one exception, b/2 <= 125) or META_RAW. `exception` is the 16-bit entry
    `position | (exponent >> 1) << 9` of the set-aside value, 0 when there is none.
    Set aside is the largest value (first position of the largest exponent) when the rest
    fit, else the smallest (first position of the smallest exponent).
  """
  # Written with reductions, compares and selects only, so the compression kernel runs this
  # very function on its tiles (as it runs `block_half_base` for version 1).
  e = exponents(bits)
  position = lax.broadcasted_iota(jnp.int32, e.shape, e.ndim - 1)
  hi1, lo1 = jnp.max(e, axis=-1), jnp.min(e, axis=-1)
  at_hi, at_lo = e == hi1[..., None], e == lo1[..., None]
  count = lambda m: jnp.sum(m.astype(jnp.int32), axis=-1)
  hi2 = jnp.where(count(at_hi) > 1, hi1, jnp.max(jnp.where(at_hi, -1, e), axis=-1))  # second largest
  lo2 = jnp.where(count(at_lo) > 1, lo1, jnp.min(jnp.where(at_lo, 256, e), axis=-1))  # second smallest
  first = lambda m: jnp.min(jnp.where(m, position, VALUES_PER_BLOCK), axis=-1)
  fits = lambda lo, hi: hi - (lo & ~1) < EXPONENT_WINDOW
  room = lambda lo: (lo >> 1) <= MAX_EXCEPTION_META - META_EXCEPTION  # 0x80 | b/2 stays below 0xFE
  plain = fits(lo1, hi1)
  drop_top = fits(lo1, hi2) & room(lo1)
  drop_low = fits(lo2, hi1) & room(lo2)
  has_exception = ~plain & (drop_top | drop_low)
  half_base = jnp.where(plain | drop_top, lo1, lo2) >> 1
  entry = jnp.where(drop_top, first(at_hi) | (hi1 >> 1) << POSITION_BITS, first(at_lo) | (lo1 >> 1) << POSITION_BITS)
  meta = jnp.where(plain, half_base, jnp.where(has_exception, META_EXCEPTION | half_base, META_RAW))
  exception = jnp.where(has_exception, entry, 0)
  return meta.astype(jnp.int32), exception.astype(jnp.int32)


def is_compressed(meta_byte: jnp.ndarray) -> jnp.ndarray:
  """Slots stored in 12 bits: b/2, or (version 2) 0x80 | b/2 with one exception."""
  return meta_byte <= MAX_EXCEPTION_META


def has_exception(meta_byte: jnp.ndarray) -> jnp.ndarray:
  """Slots stored with one exception (version 2's 0x80 | b/2)."""
  return (meta_byte >= META_EXCEPTION) & (meta_byte <= MAX_EXCEPTION_META)


def half_base_of(meta_byte: jnp.ndarray) -> jnp.ndarray:
  """b/2 of a compressed slot's byte (either version); 0 for raw and absent slots."""
  return jnp.where(is_compressed(meta_byte), meta_byte & MAX_HALF_BASE, 0)


def block_units(meta_byte: jnp.ndarray) -> jnp.ndarray:
  """Stored size in 256-byte units of each block slot (0 for absent slots)."""
  return jnp.where(
      is_compressed(meta_byte),
      COMPRESSED_UNITS,
      jnp.where(meta_byte == META_RAW, RAW_UNITS, 0),
  ).astype(jnp.int32)


def _pairs(plane: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """[..., 512] -> x, y of shape [..., 256]: positions (8k + j, 8k + 4 + j)."""
  p = plane.reshape(*plane.shape[:-1], 64, 2, 4)
  flat = lambda a: a.reshape(*plane.shape[:-1], CODE_PLANE_BYTES)
  return flat(p[..., 0, :]), flat(p[..., 1, :])


def encode_codes(high: jnp.ndarray, half_base: jnp.ndarray) -> jnp.ndarray:
  """High bytes of an eligible block -> its 256 code bytes.

  Args:
    high: int32 [..., 512] high bytes (sign << 7 | exponent >> 1).
    half_base: int32 [...], b/2 of each block.

  Returns:
    int32 [..., 256] code bytes in 0..255.
  """
  hx, hy = _pairs(high)
  hb = half_base[..., None]
  dx, dy = (hx & 0x7F) - hb, (hy & 0x7F) - hb
  return (hx & 0x80) | (dy << 4) | ((hy >> 4) & 0x08) | dx


def code_high_bytes(codes, half_base):
  """Code bytes + b/2 (broadcastable) -> (high(x), high(y)) of each code's pair, same shape as `codes`.

  Plain integer ops, so the Pallas decompression kernel runs this very function on its tiles.
  """
  hx = (codes & 0x87) + half_base
  hy = (((codes >> 4) & 0x07) | ((codes << 4) & 0x80)) + half_base
  return hx, hy


def decode_codes(codes: jnp.ndarray, half_base: jnp.ndarray) -> jnp.ndarray:
  """256 code bytes + b/2 -> the 512 high bytes (int32 [..., 512])."""
  hx, hy = code_high_bytes(codes, half_base[..., None])
  lead = codes.shape[:-1]
  both = jnp.stack([hx.reshape(*lead, 64, 4), hy.reshape(*lead, 64, 4)], axis=-2)
  return both.reshape(*lead, VALUES_PER_BLOCK)


def _exception_slot(exception: jnp.ndarray, meta_byte: jnp.ndarray) -> jnp.ndarray:
  """bool [..., 512]: the position of each block's exception (none where the byte has no flag)."""
  flagged = has_exception(meta_byte)
  position = exception & ((1 << POSITION_BITS) - 1)
  return flagged[..., None] & (jnp.arange(VALUES_PER_BLOCK, dtype=jnp.int32) == position[..., None])


def encode_rows(bits: jnp.ndarray, meta_byte: jnp.ndarray, exception: jnp.ndarray | None = None) -> jnp.ndarray:
  """Encode blocks into fixed 1024-byte rows (stored prefix = block_units).

  Args:
    bits: uint16 [..., 512].
    meta_byte: int32 [...] from `block_meta_byte` or `block_rule_v2`.
    exception: int32 [...] entries from `block_rule_v2` (version 2), or None.

  Returns:
    uint8 [..., 1024]. An exception keeps its low byte and sign; its d is 0.
  """
  b = bits.astype(jnp.int32)
  low, high = b & 0xFF, b >> 8
  eligible = is_compressed(meta_byte)[..., None]
  half_base = half_base_of(meta_byte)
  if exception is not None:
    high = jnp.where(_exception_slot(exception, meta_byte), (high & 0x80) | half_base[..., None], high)
  codes = encode_codes(high, half_base)
  codes = jnp.concatenate([codes, jnp.zeros_like(codes)], axis=-1)
  second = jnp.where(eligible, codes, high)
  return jnp.concatenate([low, second], axis=-1).astype(jnp.uint8)


def decode_rows(rows: jnp.ndarray, meta_byte: jnp.ndarray, exception: jnp.ndarray | None = None) -> jnp.ndarray:
  """Inverse of `encode_rows`: uint8 [..., 1024] + meta (+ exception entries) -> uint16 [..., 512].

  Bytes past a block's stored size are ignored. Absent slots decode to 0. A version-2
  exception's high byte is its stored sign with the entry's `exponent >> 1`.
  """
  r = rows.astype(jnp.int32)
  low, second = r[..., :LOW_PLANE_BYTES], r[..., LOW_PLANE_BYTES:]
  eligible = is_compressed(meta_byte)
  restored = decode_codes(second[..., :CODE_PLANE_BYTES], half_base_of(meta_byte))
  if exception is not None:
    patched = (restored & 0x80) | ((exception >> POSITION_BITS) & MAX_HALF_BASE)[..., None]
    restored = jnp.where(_exception_slot(exception, meta_byte), patched, restored)
  high = jnp.where(eligible[..., None], restored, second)
  return ((high << 8) | low).astype(jnp.uint16)


def to_bits(x) -> jnp.ndarray:
  """bfloat16 array -> uint16 bit patterns (exact)."""
  return lax.bitcast_convert_type(jnp.asarray(x), jnp.uint16)


def from_bits(bits: jnp.ndarray) -> jnp.ndarray:
  """uint16 bit patterns -> bfloat16 array (exact)."""
  return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)

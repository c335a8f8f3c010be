"""Exhaustive BF16 test blocks and an independent numpy decoder written from docs/FORMAT.md."""

from __future__ import annotations

import numpy as np
import ml_dtypes

ALL_PATTERNS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def eligible_rotations() -> np.ndarray:
  """uint16 [65536, 512]: every pattern at every position, every block eligible.

  Patterns are split into 16 windows of 16 exponents (b = 0, 16, ..., 240;
  4096 patterns = 8 blocks each), shuffled inside the window so that each
  block spans its window, and rotated by r = 0..511 within the window so that
  each pattern visits every position once.
  """
  rng = np.random.default_rng(1234)
  exponent = (ALL_PATTERNS >> 7) & 0xFF
  out = []
  for w in range(16):
    window = ALL_PATTERNS[(exponent >> 4) == w]
    window = window[rng.permutation(window.size)]
    # block k, position p of rotation r holds window[(k * 512 + p + r) % 4096]
    idx = (np.arange(8)[None, :, None] * 512 + np.arange(512)[None, None, :] + np.arange(512)[:, None, None]) % 4096
    out.append(window[idx].reshape(-1, 512))
  return np.concatenate(out)


def raw_rotations() -> np.ndarray:
  """uint16 [65536, 512]: every pattern at every position, blocks mixing all exponents."""
  rng = np.random.default_rng(4321)
  shuffled = ALL_PATTERNS[rng.permutation(ALL_PATTERNS.size)].reshape(128, 512)
  rows = [np.roll(shuffled.reshape(-1), r).reshape(128, 512) for r in range(512)]
  return np.concatenate(rows)


def as_bf16(bits: np.ndarray) -> np.ndarray:
  return bits.view(ml_dtypes.bfloat16)


def numpy_block_rule(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(eligible, half_base) from the words of docs/FORMAT.md, independent of the jnp code."""
  e = (bits.astype(np.int32) >> 7) & 0xFF
  b = e.min(axis=-1) - (e.min(axis=-1) % 2)
  return (e.max(axis=-1) <= b + 15), b // 2


def numpy_block_rule_v2(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(slot byte, exception entry) per block, from the words of docs/FORMAT.md §9 (sorting, not
  the package's reductions): version 1's window; else the largest value set aside; else the
  smallest; each only with b/2 <= 125; else raw."""
  e = (bits.astype(np.int32) >> 7) & 0xFF
  s = np.sort(e, axis=-1)
  lo1, lo2, hi2, hi1 = s[..., 0], s[..., 1], s[..., -2], s[..., -1]
  fits = lambda lo, hi: hi <= (lo - lo % 2) + 15
  top, low = fits(lo1, hi2) & (lo1 // 2 <= 125), fits(lo2, hi1) & (lo2 // 2 <= 125)
  slot = np.where(fits(lo1, hi1), lo1 // 2, np.where(top, 0x80 | lo1 // 2, np.where(low, 0x80 | lo2 // 2, 0xFF)))
  first = lambda x: np.argmax(e == x[..., None], axis=-1)
  entry = np.where(top, first(hi1) | (hi1 // 2) << 9, first(lo1) | (lo1 // 2) << 9)
  return slot, np.where((slot >= 0x80) & (slot != 0xFF), entry, 0)


SLOT_UNITS = {0xFF: 4, 0xFE: 0}  # raw, absent; b/2 values 0..127 (and version 2's 0x80 | b/2) take 3 units


def numpy_decode(payload: np.ndarray, group_meta: np.ndarray, blocks) -> np.ndarray:
  """Decode the given block indices of CompressedBlocks arrays to uint16 [len(blocks), 512].

  Written from the words of docs/FORMAT.md with byte-level numpy, sharing no
  code with the package: little-endian metadata words (records of 8 bytes, or 16 for
  [G, 4] metadata), version in bits 31..30, offsets in 256-byte units, slot sizes summed
  within the group; version 2: slot byte 0x80 | b/2 flags an exception whose 16-bit entry
  (bytes 8 + 2k) is position | (exponent >> 1) << 9.
  """
  blocks = list(blocks)
  out = np.zeros((len(blocks), 512), np.uint16)
  group_meta = np.asarray(group_meta)
  stride = 4 * group_meta.shape[1]
  meta_le = group_meta.astype("<u4").tobytes()
  payload = np.asarray(payload)
  for row, blk in enumerate(blocks):
    g, slot = divmod(blk, 4)
    record = meta_le[stride * g : stride * (g + 1)]
    word0 = int.from_bytes(record[:4], "little")
    slots = record[4:8]
    version = word0 >> 30
    assert version == 1 or (version == 2 and stride == 16)
    start = (word0 & ((1 << 30) - 1)) * 256
    for k in range(slot):
      start += 256 * SLOT_UNITS.get(slots[k], 3)
    low = payload[start : start + 512].astype(np.uint16)
    m = slots[slot]
    if m == 0xFF:
      high = payload[start + 512 : start + 1024].astype(np.uint16)
    else:
      hb = m & 0x7F
      codes = payload[start + 512 : start + 768].astype(np.uint16)
      high = np.zeros(512, np.uint16)
      q = np.arange(256)
      x = 8 * (q // 4) + q % 4
      high[x] = ((codes >> 7) << 7) | ((codes & 7) + hb)
      high[x + 4] = (((codes >> 3) & 1) << 7) | (((codes >> 4) & 7) + hb)
      if version == 2 and m & 0x80:
        entry = int.from_bytes(record[8 + 2 * slot : 10 + 2 * slot], "little")
        p = entry & 0x1FF
        high[p] = (high[p] & 0x80) | (entry >> 9)
    out[row] = (high << 8) | low
  return out

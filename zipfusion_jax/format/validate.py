"""Host-side structural validation of encoded blocks (corrupted metadata -> clear error)."""

from __future__ import annotations

import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.format.codec import CompressedBlocks


class FormatError(ValueError):
  """Encoded data whose metadata is inconsistent or out of range."""


def _units(meta_bytes: np.ndarray) -> np.ndarray:
  return np.where(
      meta_bytes <= B.MAX_HALF_BASE, B.COMPRESSED_UNITS, np.where(meta_bytes == B.META_RAW, B.RAW_UNITS, 0)
  )


def validate(c: CompressedBlocks) -> CompressedBlocks:
  """Check every structural invariant of `c`; return it unchanged or raise FormatError.

  Checks: metadata shape and dtype; version field; per-block bytes are b/2
  (0..127), raw or absent, with absent slots exactly past the last block;
  every group lies inside the payload and inside `payload_units`; groups do
  not overlap; `payload_units` equals the sum of the stored sizes.
  """
  meta = np.asarray(c.group_meta)
  payload_len = int(np.asarray(c.payload).shape[0])
  units_used = int(np.asarray(c.payload_units))
  n, groups = c.num_blocks, -(-c.num_blocks // B.BLOCKS_PER_GROUP)
  if meta.dtype != np.uint32 or meta.shape != (groups, 2):
    raise FormatError(f"group_meta must be uint32 [{groups}, 2] for {n} blocks, got {meta.dtype} {meta.shape}")
  if groups == 0:
    if units_used != 0:
      raise FormatError(f"no blocks but {units_used=}")
    return c
  version = meta[:, 0] >> B.VERSION_SHIFT
  if np.any(version != B.FORMAT_VERSION):
    g = int(np.argmax(version != B.FORMAT_VERSION))
    raise FormatError(f"group {g}: unsupported format version {int(version[g])} (expected {B.FORMAT_VERSION})")
  slot_bytes = (meta[:, 1:2] >> (np.arange(4, dtype=np.uint32) * 8)) & 0xFF
  present = np.arange(groups * B.BLOCKS_PER_GROUP).reshape(groups, B.BLOCKS_PER_GROUP) < n
  valid_present = (slot_bytes <= B.MAX_HALF_BASE) | (slot_bytes == B.META_RAW)
  bad = np.where(present, ~valid_present, slot_bytes != B.META_ABSENT)
  if np.any(bad):
    g, k = map(int, np.argwhere(bad)[0])
    what = "b/2 (0..127) or raw (0xFF)" if present[g, k] else "absent (0xFE)"
    raise FormatError(f"group {g} slot {k}: metadata byte {int(slot_bytes[g, k]):#04x}, expected {what}")
  start = (meta[:, 0] & B.OFFSET_MASK).astype(np.int64)
  end = start + _units(slot_bytes).sum(axis=1)
  limit = min(units_used, payload_len // B.UNIT_BYTES)
  if np.any(end > limit):
    g = int(np.argmax(end > limit))
    raise FormatError(
        f"group {g}: units [{start[g]}, {end[g]}) out of range (payload_units={units_used}, "
        f"payload holds {payload_len // B.UNIT_BYTES} units)"
    )
  order = np.argsort(start, kind="stable")
  overlap = start[order][1:] < end[order][:-1]
  if np.any(overlap):
    i = int(np.argmax(overlap))
    raise FormatError(f"groups {int(order[i])} and {int(order[i + 1])} overlap in the payload")
  if int((end - start).sum()) != units_used:
    raise FormatError(f"payload_units={units_used} but the groups store {int((end - start).sum())} units")
  return c

"""Host-side structural validation of encoded blocks (corrupted metadata -> clear error)."""

from __future__ import annotations

import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.format.codec import CompressedBlocks, unpack_exceptions


class FormatError(ValueError):
  """Encoded data whose metadata is inconsistent or out of range."""


def _units(meta_bytes: np.ndarray) -> np.ndarray:
  return np.asarray(B.block_units(meta_bytes.astype(np.int32)))


def validate(c: CompressedBlocks) -> CompressedBlocks:
  """Check every structural invariant of `c`; return it unchanged or raise FormatError.

  Checks: payload uint8 [n] and `payload_units` an integer scalar; metadata shape and dtype
  ([G, 2], or [G, 4] for version-2 records); version field (1, or 2 in [G, 4] metadata);
  per-block bytes are b/2 (0..127), in version 2 also 0x80 | b/2 (0x80..0xFD), raw or absent,
  with absent slots exactly past the last block; exception entries zero where a slot has none;
  every group lies inside the payload and inside `payload_units`; groups do not overlap;
  `payload_units` equals the sum of the stored sizes.
  """
  meta = np.asarray(c.group_meta)
  payload = np.asarray(c.payload)
  if payload.dtype != np.uint8 or payload.ndim != 1:
    raise FormatError(f"payload must be uint8 [n], got {payload.dtype} {payload.shape}")
  payload_len = payload.shape[0]
  units_used = np.asarray(c.payload_units)
  if units_used.ndim != 0 or not np.issubdtype(units_used.dtype, np.integer):
    raise FormatError(f"payload_units must be an integer scalar, got {units_used.dtype} {units_used.shape}")
  units_used = int(units_used)
  n, groups = c.num_blocks, -(-c.num_blocks // B.BLOCKS_PER_GROUP)
  if meta.dtype != np.uint32 or meta.shape not in ((groups, 2), (groups, 4)):
    raise FormatError(f"group_meta must be uint32 [{groups}, 2] or [{groups}, 4] for {n} blocks, "
                      f"got {meta.dtype} {meta.shape}")
  if groups == 0:
    if units_used != 0:
      raise FormatError(f"no blocks but {units_used=}")
    return c
  version = meta[:, 0] >> B.VERSION_SHIFT
  known = (1, 2) if meta.shape[1] == 4 else (1,)
  if np.any(~np.isin(version, known)):
    g = int(np.argmax(~np.isin(version, known)))
    raise FormatError(f"group {g}: unsupported format version {int(version[g])} in [G, {meta.shape[1]}] "
                      f"metadata (expected one of {known})")
  slot_bytes = (meta[:, 1:2] >> (np.arange(4, dtype=np.uint32) * 8)) & 0xFF
  present = np.arange(groups * B.BLOCKS_PER_GROUP).reshape(groups, B.BLOCKS_PER_GROUP) < n
  v2 = (version == 2)[:, None]
  flagged = np.asarray(B.has_exception(slot_bytes))
  valid_present = (slot_bytes <= B.MAX_HALF_BASE) | (slot_bytes == B.META_RAW) | (v2 & flagged)
  bad = np.where(present, ~valid_present, slot_bytes != B.META_ABSENT)
  if np.any(bad):
    g, k = map(int, np.argwhere(bad)[0])
    what = ("b/2 (0..127), 0x80 | b/2 (0x80..0xFD)" if v2[g, 0] else "b/2 (0..127)") + " or raw (0xFF)"
    what = what if present[g, k] else "absent (0xFE)"
    raise FormatError(f"group {g} slot {k}: metadata byte {int(slot_bytes[g, k]):#04x}, expected {what}")
  if meta.shape[1] == 4:
    entries = np.asarray(unpack_exceptions(meta))
    stray = (entries != 0) & ~(v2 & flagged)
    if np.any(stray):
      g, k = map(int, np.argwhere(stray)[0])
      raise FormatError(f"group {g} slot {k}: exception entry {int(entries[g, k]):#06x} on a slot without one")
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

"""Reference codec for independent blocks: the spec that the kernels match bit for bit.

`compress(x)` treats each trailing row of 512 BF16 values as one block (in
position order), groups consecutive blocks four at a time, and packs the
stored blocks back to back in a byte payload. Everything is jnp, so it runs
under `jax.jit`; shapes are static, so the payload is allocated at the raw
worst case and `payload_units` says how much of it is used.

Version 2 (`compress_reference(x, version=2)`) uses the version-2 block rule
(one exception per block, `block.block_rule_v2`) and 16-byte group records:
`group_meta` is then uint32 [G, 4], words 2 and 3 holding the four slots'
16-bit exception entries. A [G, 4] array may also hold version-1 records
(words 2 and 3 zero), so both versions can share one metadata array.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from zipfusion_jax.format import block as B


@flax.struct.dataclass
class CompressedBlocks:
  """Blocks in the 12-bit format: payload plus group metadata, one pytree.

  Attributes:
    payload: uint8 [num_blocks * 1024]; stored blocks at the offsets that
      `group_meta` gives, the rest zero.
    group_meta: uint32 [num_groups, 2] (version 1) or [num_groups, 4] (version 2); per group
      of four blocks, word 0 is version << 30 | offset in 256-byte units, word 1 holds the
      four per-block bytes (slot k in bits 8k..8k+7): b/2, 0x80 | b/2 (version 2, one
      exception), META_RAW or META_ABSENT; words 2, 3 (version 2) the 16-bit exception
      entries of slots 0, 1 and 2, 3 (low half first).
    payload_units: int32 []; 256-byte units of `payload` in use.
    batch_shape: static; the leading shape of the original `[..., 512]` array.
  """

  payload: jax.Array
  group_meta: jax.Array
  payload_units: jax.Array
  batch_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)

  @property
  def num_blocks(self) -> int:
    return math.prod(self.batch_shape)

  @property
  def num_groups(self) -> int:
    return self.group_meta.shape[0]

  @property
  def meta_bytes(self) -> jax.Array:
    """int32 [num_groups, 4]: the per-block metadata bytes."""
    return unpack_meta_bytes(self.group_meta[:, 1])

  @property
  def exceptions(self) -> jax.Array | None:
    """int32 [num_groups, 4]: the slots' 16-bit exception entries (None for [G, 2] metadata)."""
    return unpack_exceptions(self.group_meta)

  @property
  def compressible(self) -> jax.Array:
    """bool [*batch_shape]: which blocks are stored in 12 bits."""
    flat = self.meta_bytes.reshape(-1)[: self.num_blocks]
    return B.is_compressed(flat).reshape(self.batch_shape)

  @property
  def nbytes(self):
    """Payload plus metadata bytes (a Python int when concrete)."""
    meta = self.num_groups * self.group_meta.shape[1] * 4
    units = self.payload_units
    if isinstance(units, jax.core.Tracer):
      return units.astype(jnp.int32) * B.UNIT_BYTES + meta
    return int(units) * B.UNIT_BYTES + meta

  @property
  def uncompressed_nbytes(self) -> int:
    return self.num_blocks * B.VALUES_PER_BLOCK * 2


def check_blocks_input(x) -> jax.Array:
  """Validate a `[..., 512]` bfloat16 input and return it as a jax array."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or jnp.dtype(dtype) != jnp.bfloat16:
    raise TypeError(f"compress expects a bfloat16 array, got dtype={dtype}")
  if x.ndim < 1 or x.shape[-1] != B.VALUES_PER_BLOCK:
    raise ValueError(
        f"compress expects shape [..., {B.VALUES_PER_BLOCK}] (one block per row), got {x.shape}"
    )
  return jnp.asarray(x)


def pack_meta_bytes(meta_bytes: jax.Array) -> jax.Array:
  """int32 [..., 4] -> uint32 [...]: slot k in bits 8k..8k+7."""
  m = meta_bytes.astype(jnp.uint32)
  return m[..., 0] | (m[..., 1] << 8) | (m[..., 2] << 16) | (m[..., 3] << 24)


def unpack_meta_bytes(word: jax.Array) -> jax.Array:
  """uint32 [...] -> int32 [..., 4]."""
  shifts = jnp.arange(B.BLOCKS_PER_GROUP, dtype=jnp.uint32) * 8
  return ((word[..., None] >> shifts) & 0xFF).astype(jnp.int32)


def group_meta_bytes(meta_byte: jax.Array, fill: int = B.META_ABSENT) -> jax.Array:
  """int32 [num_blocks] -> int32 [num_groups, 4], padding with `fill` (META_ABSENT)."""
  n = meta_byte.shape[0]
  groups = -(-n // B.BLOCKS_PER_GROUP)
  pad = groups * B.BLOCKS_PER_GROUP - n
  padded = jnp.concatenate([meta_byte, jnp.full((pad,), fill, jnp.int32)])
  return padded.reshape(groups, B.BLOCKS_PER_GROUP)


def block_offsets_in_group(meta_bytes: jax.Array) -> jax.Array:
  """int32 [..., 4] -> int32 [..., 4]: offset of each slot from its group start, in units."""
  units = B.block_units(meta_bytes)
  return jnp.cumsum(units, axis=-1) - units


def pack_groups(meta_bytes: jax.Array, version: int = B.FORMAT_VERSION,
                exceptions: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Place groups back to back from offset 0.

  Args:
    meta_bytes: int32 [num_groups, 4].
    version, exceptions: as for `make_group_meta`.

  Returns:
    (group_offsets int32 [G], group_meta uint32 [G, 2 or 4], total_units int32 []).
  """
  group_units = jnp.sum(B.block_units(meta_bytes), axis=-1)
  offsets = jnp.cumsum(group_units) - group_units
  meta = make_group_meta(offsets, meta_bytes, version, exceptions)
  return offsets, meta, jnp.sum(group_units).astype(jnp.int32)


def make_group_meta(group_offsets: jax.Array, meta_bytes: jax.Array, version: int = B.FORMAT_VERSION,
                    exceptions: jax.Array | None = None) -> jax.Array:
  """Group offsets (units), per-block bytes (and, version 2, int32 [G, 4] exception entries)
  -> uint32 [G, 2] (version 1) or [G, 4] (version 2) metadata words."""
  word0 = (jnp.uint32(version) << B.VERSION_SHIFT) | group_offsets.astype(jnp.uint32)
  words = [word0, pack_meta_bytes(meta_bytes)]
  if version == 2:
    e = jnp.zeros(meta_bytes.shape, jnp.uint32) if exceptions is None else exceptions.astype(jnp.uint32)
    words += [e[..., 0] | (e[..., 1] << 16), e[..., 2] | (e[..., 3] << 16)]
  return jnp.stack(words, axis=-1)


def unpack_exceptions(group_meta: jax.Array) -> jax.Array | None:
  """uint32 [G, 4] -> int32 [G, 4] exception entries; None for version-1-only [G, 2] metadata."""
  if group_meta.shape[-1] < 4:
    return None
  w = group_meta[..., 2:4]
  return jnp.stack([w[..., 0] & 0xFFFF, w[..., 0] >> 16, w[..., 1] & 0xFFFF, w[..., 1] >> 16], axis=-1).astype(jnp.int32)


def block_unit_offsets(group_meta: jax.Array) -> jax.Array:
  """uint32 [G, 2 or 4] -> int32 [G, 4]: offset of each block slot in the payload, in 256-byte units.

  The group offset field is < 2^30, so unit offsets never wrap int32.
  """
  meta_bytes = unpack_meta_bytes(group_meta[:, 1])
  group_units = (group_meta[:, 0] & B.OFFSET_MASK).astype(jnp.int32)
  return group_units[:, None] + block_offsets_in_group(meta_bytes)


def block_byte_offsets(group_meta: jax.Array) -> jax.Array:
  """uint32 [G, 2] -> int32 [G, 4]: byte offset of each block slot in the payload.

  Offsets are computed in int32, so a single payload must stay under 2 GiB;
  callers with larger arenas index in units (`block_unit_offsets`).
  """
  return block_unit_offsets(group_meta) * B.UNIT_BYTES


def canonical_order(c: "CompressedBlocks") -> "CompressedBlocks":
  """The same stream with its groups packed back to back in block order (the reference's bytes).

  The format places each group by its own offset (word 0), so a stream whose groups sit in any
  non-overlapping order is valid and decodes the same (`validate` accepts it); the Pallas
  compressor's `ordered=False` placement writes groups in arrival order. This moves every group to
  the offset `pack_groups` would give it and zeroes the rest: for a valid stream the result equals
  `compress(x, impl="reference")` byte for byte. jit-able; run `validate` first on untrusted data.
  """
  if not c.num_groups:  # no blocks: an empty payload, nothing to move
    return c
  old = (c.group_meta[:, 0] & B.OFFSET_MASK).astype(jnp.int32)  # [G] units
  new, _, total = pack_groups(c.meta_bytes)  # the reference's placement
  units = c.payload.shape[0] // B.UNIT_BYTES
  u = jnp.arange(units, dtype=jnp.int32)
  g = jnp.clip(jnp.searchsorted(new, u, side="right") - 1, 0, c.num_groups - 1)  # the group holding new unit u
  used = u < total
  src = jnp.clip(jnp.where(used, old[g] + u - new[g], 0), 0, units - 1)
  payload = jnp.where(used[:, None], c.payload.reshape(units, B.UNIT_BYTES)[src], 0).reshape(-1)
  word0 = (c.group_meta[:, 0] & ~jnp.uint32(B.OFFSET_MASK)) | new.astype(jnp.uint32)
  group_meta = c.group_meta.at[:, 0].set(word0)
  return c.replace(payload=payload.astype(jnp.uint8), group_meta=group_meta)


def place_rows(rows: jax.Array, meta_byte: jax.Array, starts: jax.Array, capacity: int) -> jax.Array:
  """Scatter each row's stored prefix into a zeroed byte payload.

  Args:
    rows: uint8 [n, 1024] from `encode_rows`.
    meta_byte: int32 [n]; the stored prefix is `block_units(meta_byte)` units.
    starts: int32 [n] byte offset of each block in the payload.
    capacity: payload size in bytes.

  Returns:
    uint8 [capacity].
  """
  col = jnp.arange(B.ROW_BYTES, dtype=jnp.int32)
  stored = col[None, :] < (B.block_units(meta_byte) * B.UNIT_BYTES)[:, None]
  index = jnp.where(stored, starts[:, None] + col[None, :], capacity)
  return jnp.zeros((capacity,), jnp.uint8).at[index.reshape(-1)].set(rows.reshape(-1), mode="drop")


def check_version(version) -> int:
  if version not in B.FORMAT_VERSIONS:
    raise ValueError(f"format {version=} is not one of {B.FORMAT_VERSIONS}")
  return int(version)


def compress_reference(x, version: int = B.FORMAT_VERSION) -> CompressedBlocks:
  """Reference encoder. x: bfloat16 [..., 512] -> CompressedBlocks (format `version` 1 or 2)."""
  version = check_version(version)
  x = check_blocks_input(x)
  batch_shape = tuple(x.shape[:-1])
  bits = B.to_bits(x).reshape(-1, B.VALUES_PER_BLOCK)
  n = bits.shape[0]
  exceptions = None
  if version == 1:
    meta_byte, exception = B.block_meta_byte(*B.block_half_base(bits)), None
  else:
    meta_byte, exception = B.block_rule_v2(bits)
    exceptions = group_meta_bytes(exception, fill=0)
  rows = B.encode_rows(bits, meta_byte, exception)
  meta_bytes = group_meta_bytes(meta_byte)
  _, group_meta, total_units = pack_groups(meta_bytes, version, exceptions)
  starts = block_byte_offsets(group_meta).reshape(-1)[:n]
  payload = place_rows(rows, meta_byte, starts, n * B.ROW_BYTES)
  return CompressedBlocks(payload, group_meta, total_units, batch_shape)


def slot_reads(group_meta: jax.Array, units: jax.Array, payload_units: int) -> jax.Array:
  """bool [G, 4]: which slots the decoders read from the payload (the rest read zero bytes).

  A slot is read when its group's version is known (1, or 2 in [G, 4] metadata) and its read
  (3 units for a 12-bit slot, 4 for any other) lies wholly inside the payload's `payload_units`;
  `units` are the slots' unit offsets (`block_unit_offsets`).
  """
  version = group_meta[:, 0] >> B.VERSION_SHIFT
  known = (version == 1) | ((version == 2) & (group_meta.shape[1] == 4))
  read = jnp.where(B.is_compressed(unpack_meta_bytes(group_meta[:, 1])), B.COMPRESSED_UNITS, B.RAW_UNITS)
  return known[:, None] & (units + read <= payload_units)  # offsets < 2^30: no int32 wrap


def decompress_reference(c: CompressedBlocks) -> jax.Array:
  """Reference decoder: CompressedBlocks -> bfloat16 [*batch_shape, 512], bit-exact.

  Reads are bounded by the payload, so even corrupted metadata cannot read
  out of bounds: a block whose group has an unknown version (or version 2 in
  [G, 2] metadata) or whose read does not lie wholly inside the payload
  decodes from zero bytes (`slot_reads`). `validate` reports both.
  """
  n = c.num_blocks
  # Gather whole 256-byte units (int32 unit indices stay valid for stores past 2 GiB, where
  # byte offsets would not); a trailing partial unit is zero-padded and reads as zeros.
  payload = c.payload
  if payload.shape[0] % B.UNIT_BYTES:
    payload = jnp.pad(payload, (0, B.UNIT_BYTES - payload.shape[0] % B.UNIT_BYTES))
  payload = payload.reshape(-1, B.UNIT_BYTES)
  units = block_unit_offsets(c.group_meta)
  version = c.group_meta[:, 0] >> B.VERSION_SHIFT
  inside = slot_reads(c.group_meta, units, payload.shape[0])
  starts = jnp.where(inside, units, payload.shape[0]).reshape(-1)[:n]
  index = starts[:, None] + jnp.arange(B.RAW_UNITS, dtype=jnp.int32)[None, :]
  rows = jnp.take(payload, index, axis=0, mode="fill", fill_value=0).reshape(n, B.ROW_BYTES)
  exceptions = c.exceptions
  if exceptions is not None:  # version-1 groups of a [G, 4] array carry no exception
    exceptions = jnp.where((version == 2)[:, None], exceptions, 0).reshape(-1)[:n]
  bits = B.decode_rows(rows, c.meta_bytes.reshape(-1)[:n], exceptions)
  return B.from_bits(bits).reshape(*c.batch_shape, B.VALUES_PER_BLOCK)

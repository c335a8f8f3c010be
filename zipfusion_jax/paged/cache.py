"""One layer's paged KV cache: completed pages compressed (or BF16), tail page raw.

A sequence of length L owns `L // 16` completed pages, reached through its
row of the page table, and a tail of `L % 16` tokens held BF16 in its own
tail page. Completed pages live in one of two stores:

* compressed: a byte arena of 256-byte units holding one 4-block group per
  (KV head, physical page, K or V), located by `group_meta` (FORMAT.md §5:
  version/offset word, slot bytes b/2 / raw / absent; version 2, FORMAT.md §9:
  16-byte records with one exception per block). `head_dim` 64 pages have 2
  blocks and 2 absent slots, so every page is one group.
* uncompressed: BF16 pages `[Hkv, P, 16, D]`, the layout of JAX's Pallas
  paged attention.

Both stores are meant for one decode-attention kernel body (design and
status: docs/DECODE_KERNEL.md); the jnp restore here is the reference for
it and the first half of decompress-then-attend.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec, layout

PAGE_SIZE = layout.PAGE_SIZE
KINDS = ("k", "v")


@flax.struct.dataclass
class PagedKVCache:
  """One layer's paged cache (a pytree; `compressed` and the sizes are static).

  Attributes:
    lengths: int32 [B] tokens per sequence.
    page_table: int32 [B, max_pages]; entry i < lengths // 16 is the physical
      page of logical page i, the rest are unused (0).
    k_tail, v_tail: bfloat16 [B, Hkv, 16, D]; tokens [16 * (L // 16), L) of
      each sequence in rows 0 .. L % 16 - 1. Rows past the length must be
      finite (the builder writes zeros).
    arena: uint8 [units, 256] (compressed) or None.
    group_meta: uint32 [Hkv, P, 2, 2] (compressed: [head, page, K/V, word]; format
      version 2: [Hkv, P, 2, 4]) or None.
    k_pages, v_pages: bfloat16 [Hkv, P, 16, D] (uncompressed) or None.
    compressed: static; which store holds the completed pages.
  """

  lengths: jax.Array
  page_table: jax.Array
  k_tail: jax.Array
  v_tail: jax.Array
  arena: jax.Array | None = None
  group_meta: jax.Array | None = None
  k_pages: jax.Array | None = None
  v_pages: jax.Array | None = None
  compressed: bool = flax.struct.field(pytree_node=False, default=True)

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_tail.shape[1]

  @property
  def head_dim(self) -> int:
    return self.k_tail.shape[3]

  @property
  def max_pages(self) -> int:
    return self.page_table.shape[1]

  @property
  def num_pages(self) -> int:
    """Physical completed pages per KV head."""
    return (self.group_meta if self.compressed else self.k_pages).shape[1]

  @property
  def format_version(self) -> int | None:
    """1 or 2: the format the builder wrote (by the record width); None for BF16 pages."""
    return None if not self.compressed else (2 if self.group_meta.shape[-1] == 4 else 1)

  @property
  def max_length(self) -> int:
    """Longest sequence the page table can describe."""
    return self.max_pages * PAGE_SIZE + PAGE_SIZE - 1

  @property
  def nbytes(self) -> int:
    """Bytes held on the device for KV (pages, tails, metadata, page table)."""
    leaves = [self.k_tail, self.v_tail, self.page_table, self.lengths]
    leaves += [self.arena, self.group_meta] if self.compressed else [self.k_pages, self.v_pages]
    return int(sum(x.size * x.dtype.itemsize for x in leaves))


def _check_kv(k, v, lengths):
  for name, x in (("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be [B, S, Hkv, D], got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) != jnp.bfloat16:
      raise TypeError(f"{name} must be bfloat16, got {x.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
  batch, seq, kv_heads, head_dim = k.shape
  layout.check_head_dim(head_dim)
  if kv_heads < 1:
    raise ValueError(f"k and v need at least one KV head, got shape {k.shape}")
  if isinstance(lengths, jax.core.Tracer):
    raise TypeError("paged_cache_from_dense builds a cache on the host: lengths must be concrete")
  lengths = np.asarray(lengths)
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"lengths must be int [{batch}], got {lengths.dtype} {lengths.shape}")
  if lengths.min(initial=0) < 0 or lengths.max(initial=0) > seq:
    raise ValueError(f"lengths must lie in [0, {seq}] (the K/V length), got {lengths.tolist()}")
  return lengths.astype(np.int32)


def paged_cache_from_dense(k, v, lengths, page_size: int = PAGE_SIZE, compressed: bool = True, *, seed: int = 0,
                           version: int = 1) -> PagedKVCache:
  """Build one layer's paged cache from dense K/V.

  Args:
    k, v: bfloat16 [B, S, Hkv, D], D in (64, 128).
    lengths: int [B], 0 <= lengths <= S (concrete).
    page_size: must be 16 (the format's page).
    compressed: store completed pages in the 12-bit format (else BF16 pages).
    seed: shuffles the physical page order (page tables are not identity maps).
    version: format version of the compressed pages (1, or 2: FORMAT.md §9, one exception
      per block; the jnp reference and the fused kernel read both).

  Returns:
    PagedKVCache with `max_pages = ceil(S / 16)`.
  """
  if page_size != PAGE_SIZE:
    raise ValueError(f"page_size must be {PAGE_SIZE} (the format's page), got {page_size}")
  version = codec.check_version(version)
  lengths = _check_kv(k, v, lengths)
  # Pages and tails are cut from the bit patterns: XLA's CPU pad of a bfloat16 array is not
  # bit-exact (it quiets NaN payloads and flushes subnormals), and the cache must be lossless.
  k, v = B.to_bits(k), B.to_bits(v)
  batch, seq, kv_heads, head_dim = k.shape
  max_pages = -(-seq // PAGE_SIZE)
  complete = lengths // PAGE_SIZE
  num_pages = max(1, int(complete.sum()))
  owner_b = np.repeat(np.arange(batch), complete)
  owner_i = np.concatenate([np.arange(n) for n in complete]) if batch else np.zeros(0, int)
  phys = np.random.default_rng(seed).permutation(num_pages)[: owner_b.size]
  page_table = np.zeros((batch, max(1, max_pages)), np.int32)
  page_table[owner_b, owner_i] = phys
  # Physical page p holds logical page (src_b[p], src_i[p]); unused physical pages copy page 0 of row 0.
  src_b = np.zeros(num_pages, np.int32)
  src_i = np.zeros(num_pages, np.int32)
  src_b[phys], src_i[phys] = owner_b, owner_i

  def pages_of(x):  # [B, S, Hkv, D] -> [Hkv, P, 16, D]
    if not batch:  # no sequences: the one physical page is unused, zeros
      return jnp.zeros((kv_heads, num_pages, PAGE_SIZE, head_dim), x.dtype)
    padded = jnp.pad(x, ((0, 0), (0, max_pages * PAGE_SIZE + PAGE_SIZE - seq), (0, 0), (0, 0)))
    paged = padded.reshape(batch, max_pages + 1, PAGE_SIZE, kv_heads, head_dim)
    return paged[src_b, src_i].transpose(2, 0, 1, 3)

  def tail_of(x):  # [B, S, Hkv, D] -> [B, Hkv, 16, D], zeros past the length
    padded = jnp.pad(x, ((0, 0), (0, PAGE_SIZE), (0, 0), (0, 0)))
    rows = complete[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)[None, :]
    tail = padded[np.arange(batch)[:, None], rows]
    keep = (np.arange(PAGE_SIZE)[None, :] < (lengths % PAGE_SIZE)[:, None])[:, :, None, None]
    return jnp.where(keep, tail, jnp.zeros_like(tail)).transpose(0, 2, 1, 3)

  common = dict(lengths=jnp.asarray(lengths), page_table=jnp.asarray(page_table),
                k_tail=B.from_bits(tail_of(k)), v_tail=B.from_bits(tail_of(v)))
  k_pages, v_pages = B.from_bits(pages_of(k)), B.from_bits(pages_of(v))
  if not compressed:
    return PagedKVCache(**common, k_pages=k_pages, v_pages=v_pages, compressed=False)
  arena, group_meta = compress_pages(jnp.stack([k_pages, v_pages], axis=2), version)
  return PagedKVCache(**common, arena=arena, group_meta=group_meta, compressed=True)


def encode_page_blocks(pages: jax.Array, version: int = 1) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Encode K/V pages block by block (no placement).

  Args:
    pages: bfloat16 [..., 2 (K, V), 16, D].
    version: format version (1, or 2: one exception per block).

  Returns:
    (rows uint8 [..., 2, nblocks, 1024] from `encode_rows`, meta_bytes int32
    [..., 2, 4]: the group slot bytes, META_ABSENT past the page's blocks,
    exception entries int32 [..., 2, 4] (version 2; 0 past the page's blocks) or None).
  """
  bits = B.to_bits(kv_page_blocks(pages))  # [..., 2, nblocks, 512]
  if version == 1:
    meta_byte, exception = B.block_meta_byte(*B.block_half_base(bits)), None  # [..., 2, nblocks]
  else:
    meta_byte, exception = B.block_rule_v2(bits)
  exceptions = None if exception is None else pad_absent_slots(exception, fill=0)
  return B.encode_rows(bits, meta_byte, exception), pad_absent_slots(meta_byte), exceptions


def kv_page_blocks(pages: jax.Array) -> jax.Array:
  """bfloat16 [..., 2 (K, V), 16, D] -> [..., 2, D // 32, 512]: each page's blocks in position order."""
  return jnp.stack([layout.pages_to_blocks(pages[..., i, :, :], kind) for i, kind in enumerate(KINDS)], axis=-3)


def pad_absent_slots(meta_byte: jax.Array, fill: int = B.META_ABSENT) -> jax.Array:
  """int32 [..., nblocks] -> [..., 4]: a page's group slot bytes, `fill` (META_ABSENT) past its blocks."""
  absent = jnp.full((*meta_byte.shape[:-1], B.BLOCKS_PER_GROUP - meta_byte.shape[-1]), fill, jnp.int32)
  return jnp.concatenate([meta_byte, absent], axis=-1)


@functools.partial(jax.jit, static_argnums=1)
def _encode_pages(pages: jax.Array, version: int):
  """bfloat16 [Hkv, P, 2, 16, D] -> (payload uint8 [cap], group_meta uint32 [Hkv, P, 2, 2 or 4], units)."""
  kv_heads, num_pages, _, _, head_dim = pages.shape
  nblocks = layout.blocks_per_page(head_dim)
  rows, meta_bytes, exceptions = encode_page_blocks(pages, version)
  if exceptions is not None:
    exceptions = exceptions.reshape(-1, B.BLOCKS_PER_GROUP)
  meta_bytes = meta_bytes.reshape(-1, B.BLOCKS_PER_GROUP)
  _, group_meta, units = codec.pack_groups(meta_bytes, version, exceptions)
  starts = codec.block_byte_offsets(group_meta)[:, :nblocks].reshape(-1)
  rows = rows.reshape(-1, B.ROW_BYTES)
  payload = codec.place_rows(rows, meta_bytes[:, :nblocks].reshape(-1), starts, rows.shape[0] * B.ROW_BYTES)
  return payload, group_meta.reshape(kv_heads, num_pages, 2, group_meta.shape[-1]), units


def compress_pages(pages: jax.Array, version: int = 1) -> tuple[jax.Array, jax.Array]:
  """Compress completed pages into a trimmed arena.

  Args:
    pages: bfloat16 [Hkv, P, 2 (K, V), 16, D].
    version: format version (1, or 2 with one exception per block).

  Returns:
    (arena uint8 [units, 256], group_meta uint32 [Hkv, P, 2, 2], or [.., 4] for version 2);
    groups are packed back to back in (head, page, kind) order.
  """
  payload, group_meta, units = _encode_pages(pages, codec.check_version(version))
  units = max(int(units), 1)
  return payload[: units * B.UNIT_BYTES].reshape(units, B.UNIT_BYTES), group_meta


def restore_pages(cache: PagedKVCache, impl: str | None = None, *, interpret: bool | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """Completed pages as BF16, bit-exact: (k_pages, v_pages) bfloat16 [Hkv, P, 16, D].

  For a compressed cache this decodes every group: `impl` "reference" (jnp, XLA-compiled) or
  "pallas" (the page-decompression kernel, `pallas_kernels.decompress`; interpreted off a GPU
  unless `interpret` says otherwise); None picks "pallas" on a GPU, else "reference". An
  uncompressed cache returns its pages.
  """
  if impl is None:
    impl = "pallas" if jax.default_backend() == "gpu" else "reference"
  if impl not in ("reference", "pallas"):
    raise ValueError(f"{impl=} must be 'reference' or 'pallas'")
  if not cache.compressed:
    return cache.k_pages, cache.v_pages
  if impl == "pallas":
    from pallas_kernels.decompress import restore_pages_pallas  # kernels sit above the format

    return restore_pages_pallas(cache.arena, cache.group_meta, head_dim=cache.head_dim, interpret=interpret)
  if interpret is not None:
    raise TypeError("impl='reference' takes no interpret")
  return _restore_pages(cache.arena, cache.group_meta, cache.head_dim)


@functools.partial(jax.jit, static_argnames="head_dim")
def _restore_pages(arena, group_meta, head_dim):
  nblocks = layout.blocks_per_page(head_dim)
  kv_heads, num_pages, _, width = group_meta.shape
  meta = group_meta.reshape(-1, width)
  c = codec.CompressedBlocks(
      payload=arena.reshape(-1),
      group_meta=meta,
      payload_units=jnp.int32(arena.shape[0]),
      batch_shape=(meta.shape[0], B.BLOCKS_PER_GROUP),
  )
  blocks = codec.decompress_reference(c)[:, :nblocks].reshape(kv_heads, num_pages, 2, nblocks, B.VALUES_PER_BLOCK)
  k = layout.blocks_to_pages(blocks[:, :, 0], "k")
  v = layout.blocks_to_pages(blocks[:, :, 1], "v")
  return k, v

"""Pallas page-decompression kernel: a compressed store -> BF16 K and V pages.

The decompress-then-attend baseline's first half (`zipfusion_jax.restore_pages(cache,
impl="pallas")`): it writes the BF16 copy of every page that the fused kernel never
materialises, so the baseline gets the fastest restore this project has.

One program restores `groups_per_program` consecutive groups. A group is one (KV head, page,
K or V) of `restore_pages`' store (groups packed in (head, page, kind) order, docs/FORMAT.md):
its word 0 gives the group's first unit and format version, word 1 the per-slot bytes. For each
of the page's 2 (head_dim 64) or 4 (head_dim 128) blocks the program loads the low plane and
either the code plane (12-bit block) or the high plane (raw block), restores the high bytes
with `block.code_high_bytes` (the reference's own arithmetic), permutes the 512 BF16 values in
registers into whole page rows and stores them at their page positions (`layout.page_permutation`;
`tile_stores=False` scatters them one by one instead), so no block-order copy is ever written.

Reads are bounded as the reference's (`codec.decompress_reference`): a slot of an unknown
version, or one whose read (3 units for a 12-bit slot, else 4) does not lie wholly inside the
payload, reads zero bytes. Every output value is written exactly once, so the outputs need no zero fill.

Backend: Pallas Triton (gathers, strided rows and scatters, as the compression kernels).

In-kernel views (free reshapes in the wrapper):
  payload uint8 [units, 64, 4]: 64 rows of 4 bytes per unit. Counting rows from a block's first
    unit, rows 2i / 2i + 1 hold the low bytes of positions 8i + j / 8i + 4 + j (j = 0..3, the
    column); code row 128 + i holds the code bytes of the pairs (8i + j, 8i + 4 + j); a raw
    block's high bytes sit at rows 128 + 2i / 129 + 2i like its low bytes.
  group_meta int32 [G, 2 or 4] (the uint32 words, bitcast).
  k_pages, v_pages uint16 [Hkv * P, 16 * head_dim] (bitcast to bfloat16 [Hkv, P, 16, D]).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._platform import resolve_interpret
from pallas_kernels.compress import block_units_int
from zipfusion_jax.format import block as B
from zipfusion_jax.format import layout

ROWS_PER_UNIT = B.UNIT_BYTES // 4  # 64 rows of 4 bytes


@dataclasses.dataclass(frozen=True)
class DecompressConfig:
  """Tuning knobs of the page-decompression kernel.

  Attributes:
    groups_per_program: consecutive groups (one page's K or V each) a program restores.
    num_warps: Triton warps per program.
    tile_stores: write each block's 512 values as strided tiles of whole rows (K: 16 tokens x
      2 runs of 8 dims per half; V: 8 tokens x 32 dims per half), permuted in registers
      (default), instead of scattering 2-byte values by index (`_tile_index`, False). H200,
      2026-12-06, Llama-3.1-8B pages at 32 x 2048 and 8 x 8192: 195.6 / 195.5 us (2.44 TB/s of
      compressed read + BF16 write) against 237.4 / 238.1 us scattered, pages bit-exact both ways.
  """

  groups_per_program: int = 2
  num_warps: int = 4
  tile_stores: bool = True

  def __post_init__(self):
    v = self.groups_per_program
    if v <= 0 or v & (v - 1):
      raise ValueError(f"groups_per_program={v} must be a power of two")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")


def _tile_index(kind: str, slot: int, head_dim: int, high_half: int):
  """int32 [64, 4]: element (token * head_dim + dim) of its page of tile entry [i, j] of block `slot`.

  Entry [i, j] is position 8i + j (`high_half` 0, the x of each code pair) or 8i + 4 + j (1, y).
  Position bits, high to low (layout.py): c | row % 8 (3) | (col % 8) // 2 (2) | col // 8 |
  row // 8 | col % 2, so i = (c, row % 8, (col % 8) // 2) and j = (row // 8, col % 2).
  """
  i = jax.lax.broadcasted_iota(jnp.int32, (64, 4), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (64, 4), 1)
  c, r_lo, c_mid = i >> 5, (i >> 2) & 7, i & 3
  r_hi, c_lo = j >> 1, j & 1
  row, col = r_hi * 8 + r_lo, high_half * 8 + c_mid * 2 + c_lo
  dim0 = slot * layout.DIMS_PER_BLOCK + c * layout.TILE
  if kind == "k":  # M[row, col] = K[token=row, dim=dim0 + col]
    return row * head_dim + dim0 + col
  return col * head_dim + dim0 + row  # V: M[row, col] = V[token=col, dim=dim0 + row]


def _load_plane(payload_ref, unit, first_row, read):
  """int32 [64, 4]: rows first_row + 2i (i = 0..63) counted from unit `unit`, or zeros where `read` is 0.

  Row 2i lies in unit unit + i // 32; indexing units, not rows, keeps every in-kernel index below
  2^31 (the lowering widens pointer offsets to 64 bits for stores past 4 GiB).
  """
  rows = payload_ref[pl.ds(unit, 2), pl.ds(first_row, 32, stride=2), :].astype(jnp.int32)  # [2, 32, 4]
  return jnp.where(read == 1, rows.reshape(64, 4), 0)


def _load_unit(payload_ref, unit, read):
  """int32 [64, 4]: the 64 rows of unit `unit`, or zeros where `read` is 0."""
  return jnp.where(read == 1, payload_ref[unit, :, :].astype(jnp.int32), 0)


def _store_tiles(k_ref, v_ref, g, slot, tiles, *, head_dim):
  """Scatter the x and y tiles (int32 [64, 4] BF16 bits each) of block `slot` to K (g even) or V."""
  for half, bits in enumerate(tiles):
    bits = bits.astype(jnp.uint16)

    @pl.when(g % 2 == 0)
    def _k():
      k_ref[g // 2, _tile_index("k", slot, head_dim, half)] = bits

    @pl.when(g % 2 == 1)
    def _v():
      v_ref[g // 2, _tile_index("v", slot, head_dim, half)] = bits


# A tile entry [i, j] (x half h) is position 8i + 4h + j; as [2, 8, 4, 2, 2] its axes are (c, row % 8,
# (col % 8) // 2, row // 8, col % 2) with col % 16 = 8h + 2 ((col % 8) // 2) + col % 2 (see `_tile_index`).
_K_ROWS = (3, 1, 0, 2, 4)  # -> [row // 8, row % 8, c, (col % 8) // 2, col % 2]: K[token = row, dims c*16 + 8h + 0..7]
_V_ROWS = (2, 4, 0, 3, 1)  # -> [(col % 8) // 2, col % 2, c, row // 8, row % 8]: V[token = 8h + col % 8, dims 0..31]


def _store_tile_rows(k_ref, v_ref, g, slot, tiles):
  """`tile_stores`: the x and y tiles (int32 [64, 4] BF16 bits) of block `slot` of group g as whole
  rows: K (g even) into k_ref uint16 [pages, 16, D / 8, 8] (16-byte runs 4 slot + 2c + h), V into
  v_ref uint16 [pages, 16, D] (tokens 8h .. 8h + 7, dims 32 slot .. 32 slot + 31)."""
  for half, bits in enumerate(tiles):
    split = bits.astype(jnp.uint16).reshape(2, 8, 4, 2, 2)

    @pl.when(g % 2 == 0)
    def _k():
      k_ref[g // 2, :, pl.ds(4 * slot + half, 2, stride=2), :] = jnp.transpose(split, _K_ROWS).reshape(16, 2, 8)

    @pl.when(g % 2 == 1)
    def _v():
      v_ref[g // 2, pl.ds(8 * half, 8), pl.ds(32 * slot, 32)] = jnp.transpose(split, _V_ROWS).reshape(8, 32)


def _restore_group(meta_ref, payload_ref, k_ref, v_ref, g, *, head_dim: int, payload_units: int, exceptions: bool,
                   tile_stores: bool = False):
  """Restore group g (KV head g // (2 * P), page g // 2 % P, K if g is even else V)."""
  w0, w1 = meta_ref[g, 0], meta_ref[g, 1]
  version = (w0 >> B.VERSION_SHIFT) & 3
  known = (version == 1) | (version == 2) if exceptions else version == 1
  unit = w0 & B.OFFSET_MASK
  store = _store_tile_rows if tile_stores else functools.partial(_store_tiles, head_dim=head_dim)
  for slot in range(layout.blocks_per_page(head_dim)):
    mb = (w1 >> (8 * slot)) & 0xFF
    compressed = (mb <= B.MAX_EXCEPTION_META).astype(jnp.int32)
    read_units = B.RAW_UNITS - compressed * (B.RAW_UNITS - B.COMPRESSED_UNITS)
    inside = (known & (unit + read_units <= payload_units)).astype(jnp.int32)  # as codec.slot_reads
    at = jnp.where(inside == 1, unit, 0)  # a slot read as zeros loads (and drops) units 0 .. 3
    low_x, low_y = _load_plane(payload_ref, at, 0, inside), _load_plane(payload_ref, at, 1, inside)
    entry = None
    if exceptions:  # version 2: the exception keeps its sign; its exponent >> 1 is in the entry
      entry = (meta_ref[g, 2 + slot // 2] >> (16 * (slot % 2))) & 0xFFFF
      entry = jnp.where(version == 2, entry, 0)

    @pl.when(compressed == 1)
    def _twelve_bit():
      hb = mb & B.MAX_HALF_BASE
      hx, hy = B.code_high_bytes(_load_unit(payload_ref, at + 2, inside), hb)
      if entry is not None:
        flagged = mb >= B.META_EXCEPTION
        p = jnp.where(flagged, entry & ((1 << B.POSITION_BITS) - 1), -1)
        exp_half = (entry >> B.POSITION_BITS) & B.MAX_HALF_BASE
        pos_x = 8 * jax.lax.broadcasted_iota(jnp.int32, (64, 4), 0) + jax.lax.broadcasted_iota(jnp.int32, (64, 4), 1)
        hx = jnp.where(pos_x == p, (hx & 0x80) | exp_half, hx)
        hy = jnp.where(pos_x + 4 == p, (hy & 0x80) | exp_half, hy)
      store(k_ref, v_ref, g, slot, ((hx << 8) | low_x, (hy << 8) | low_y))

    @pl.when(compressed == 0)
    def _raw():
      hx, hy = _load_plane(payload_ref, at + 2, 0, inside), _load_plane(payload_ref, at + 2, 1, inside)
      store(k_ref, v_ref, g, slot, ((hx << 8) | low_x, (hy << 8) | low_y))

    unit = unit + block_units_int(mb)


def _restore_kernel(meta_ref, payload_ref, k_ref, v_ref, *, groups: int, groups_per_program: int, **kwargs):
  # meta_ref: int32 [G, 2 or 4]; payload_ref: uint8 [units, 64, 4]; k_ref, v_ref: uint16 [Hkv * P, 16 * D]
  for n in range(groups_per_program):
    g = pl.program_id(0) * groups_per_program + n

    @pl.when(g < groups)
    def _one():
      _restore_group(meta_ref, payload_ref, k_ref, v_ref, g, **kwargs)


@functools.partial(jax.jit, static_argnames=("head_dim", "config", "interpret"))
def restore_pages_pallas(arena: jax.Array, group_meta: jax.Array, *, head_dim: int,
                         config: DecompressConfig | None = None, interpret: bool | None = None):
  """Pallas twin of `zipfusion_jax.paged.cache._restore_pages`: bit-exact BF16 pages.

  Args:
    arena: uint8 [units, 256], the store's payload.
    group_meta: uint32 [Hkv, P, 2 (K, V), 2 or 4], one group per (head, page, kind).
    head_dim: 64 or 128.
    config: tuning knobs (default `DecompressConfig()`).
    interpret: run interpreted (default: when the default backend is not a GPU).

  Returns:
    (k_pages, v_pages) bfloat16 [Hkv, P, 16, head_dim].
  """
  layout.check_head_dim(head_dim)
  if arena.dtype != jnp.uint8 or arena.ndim != 2 or arena.shape[1] != B.UNIT_BYTES:
    raise ValueError(f"arena must be uint8 [units, {B.UNIT_BYTES}], got {arena.dtype} {arena.shape}")
  if group_meta.dtype != jnp.uint32 or group_meta.ndim != 4 or group_meta.shape[2] != 2 or group_meta.shape[3] not in (2, 4):
    raise ValueError(f"group_meta must be uint32 [Hkv, P, 2, 2 or 4], got {group_meta.dtype} {group_meta.shape}")
  config = config or DecompressConfig()
  kv_heads, pages, _, width = group_meta.shape
  groups = kv_heads * pages * 2
  meta = jax.lax.bitcast_convert_type(group_meta.reshape(groups, width), jnp.int32)
  payload_units = arena.shape[0]
  if payload_units < B.RAW_UNITS:  # a slot read as zeros loads rows 0 .. 255: keep them in bounds
    arena = jnp.pad(arena, ((0, B.RAW_UNITS - payload_units), (0, 0)))
  page_values = layout.PAGE_SIZE * head_dim
  if config.tile_stores:  # row views of the same pages (free reshapes below)
    out_shapes = [(kv_heads * pages, layout.PAGE_SIZE, head_dim // 8, 8), (kv_heads * pages, layout.PAGE_SIZE, head_dim)]
  else:
    out_shapes = [(kv_heads * pages, page_values)] * 2
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  k, v = pl.pallas_call(
      functools.partial(_restore_kernel, groups=groups, groups_per_program=config.groups_per_program,
                        head_dim=head_dim, payload_units=payload_units, exceptions=width == 4,
                        tile_stores=config.tile_stores),
      grid=(-(-groups // config.groups_per_program),),
      in_specs=[any_spec, any_spec],  # group metadata, payload rows
      out_specs=[any_spec, any_spec],  # K pages, V pages (one row per (head, page))
      out_shape=[jax.ShapeDtypeStruct(shape, jnp.uint16) for shape in out_shapes],
      interpret=resolve_interpret(interpret),
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_restore_pages",
  )(meta, arena.reshape(-1, ROWS_PER_UNIT, 4))
  shape = (kv_heads, pages, layout.PAGE_SIZE, head_dim)
  return B.from_bits(k).reshape(shape), B.from_bits(v).reshape(shape)

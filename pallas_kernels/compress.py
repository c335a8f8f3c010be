"""Pallas compression kernel: BF16 blocks -> the 12-bit format of docs/FORMAT.md.

Two kernels run back to back inside one jitted function:

* `_plan_kernel` reads each block's exponents and decides the block rule:
  b/2 for eligible blocks, META_RAW otherwise (int32 [N]).
* XLA turns those bytes into group offsets (an exclusive cumsum over groups,
  8 bytes of metadata per 4 KiB of input) and the group metadata words.
* `_pack_kernel` (one program per group of four blocks) reads the blocks
  again and writes low bytes, code bytes or raw high bytes at the group's
  offset in the payload, which is aliased in and out, so the same kernel can
  write into an existing arena.

Backend: Pallas Triton. Placement of variable-size blocks needs scalar
address arithmetic and strided/conditional stores, which the Triton lowering
expresses directly; the Mosaic GPU lowering of this jax has no fetch-and-add
(its atomics return nothing) and needs TMA-sized copies. Measured on the
H200: see benchmarks/RESULTS.md (`benchmarks/compress.py`). With
`CompressConfig.chunk_blocks` set, plan and pack run chunk by chunk, so the
pack kernel's second read of a chunk comes from L2 rather than HBM.

In-kernel views (free reshapes done by the wrapper):
  blocks  uint16 [N, 128, 4]: row 2k holds positions 8k..8k+3 (x), row 2k+1
          positions 8k+4..8k+7 (y), so the code pairs (x, y) are rows 2k, 2k+1.
  payload uint8 [units * 64, 4]: one 256-byte unit is 64 rows of 4 bytes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._platform import resolve_interpret
from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec

ROWS_PER_UNIT = B.UNIT_BYTES // 4  # 64 rows of 4 bytes
LOW_ROWS = B.LOW_PLANE_BYTES // 4  # 128


@dataclasses.dataclass(frozen=True)
class CompressConfig:
  """Tuning knobs of the compression kernels.

  Attributes:
    plan_blocks: blocks per program of the plan kernel (power of two).
    num_warps: Triton warps per program for both kernels.
    chunk_blocks: if set, run plan + pack per chunk of this many blocks
      (a multiple of 4 * plan_blocks) so the pack kernel re-reads from L2.
  """

  plan_blocks: int = 16
  num_warps: int = 4
  chunk_blocks: int | None = None

  def __post_init__(self):
    if self.plan_blocks <= 0 or self.plan_blocks & (self.plan_blocks - 1):
      raise ValueError(f"plan_blocks={self.plan_blocks} must be a power of two")
    if self.chunk_blocks is not None and self.chunk_blocks % (4 * self.plan_blocks):
      raise ValueError(f"chunk_blocks={self.chunk_blocks} must be a multiple of {4 * self.plan_blocks}")


def heuristic_config(num_blocks: int) -> CompressConfig:
  """Default config for `num_blocks` blocks.

  Chunks of 16Ki blocks (16 MiB of BF16) fit in the H200's 60 MB L2 with room
  for the payload being written; below that size a single pass is one chunk.
  """
  if num_blocks >= 4 * 16384:
    return CompressConfig(chunk_blocks=16384)
  return CompressConfig()


def _plan_kernel(bits_ref, meta_ref):
  # bits_ref: uint16 [plan_blocks, 512]; meta_ref: int32 [plan_blocks]
  e = (bits_ref[...].astype(jnp.int32) >> 7) & 0xFF
  base = jnp.min(e, axis=1) & ~1
  eligible = jnp.max(e, axis=1) - base < B.EXPONENT_WINDOW
  meta_ref[...] = jnp.where(eligible, base >> 1, B.META_RAW)


def _pack_kernel(meta_ref, offset_ref, bits_ref, _payload_in_ref, payload_ref, *, group0: int):
  # meta_ref:    int32 [groups * 4] (whole array), per-block byte
  # offset_ref:  int32 [groups] (whole array), group offset in units
  # bits_ref:    uint16 [4, 128, 4], this group's four blocks
  # payload_ref: uint8 [units * 64, 4] (whole array, aliased with the input)
  g = pl.program_id(0) + group0
  unit = offset_ref[g]
  for k in range(B.BLOCKS_PER_GROUP):
    mb = meta_ref[g * B.BLOCKS_PER_GROUP + k]
    row = unit * ROWS_PER_UNIT
    x = bits_ref.at[k][pl.ds(0, 64, stride=2), :].astype(jnp.int32)  # [64, 4]
    y = bits_ref.at[k][pl.ds(1, 64, stride=2), :].astype(jnp.int32)

    @pl.when(mb != B.META_ABSENT)
    def _low():
      payload_ref[pl.ds(row, 64, stride=2), :] = (x & 0xFF).astype(jnp.uint8)
      payload_ref[pl.ds(row + 1, 64, stride=2), :] = (y & 0xFF).astype(jnp.uint8)

    @pl.when(mb <= B.MAX_HALF_BASE)
    def _codes():
      hx, hy = x >> 8, y >> 8
      code = (hx & 0x80) | (((hy & 0x7F) - mb) << 4) | ((hy >> 4) & 0x08) | ((hx & 0x7F) - mb)
      payload_ref[pl.ds(row + LOW_ROWS, 64), :] = code.astype(jnp.uint8)

    @pl.when(mb == B.META_RAW)
    def _high():
      payload_ref[pl.ds(row + LOW_ROWS, 64, stride=2), :] = (x >> 8).astype(jnp.uint8)
      payload_ref[pl.ds(row + LOW_ROWS + 1, 64, stride=2), :] = (y >> 8).astype(jnp.uint8)

    unit = unit + jnp.where(mb <= B.MAX_HALF_BASE, B.COMPRESSED_UNITS, jnp.where(mb == B.META_RAW, B.RAW_UNITS, 0))


def _plan(bits2d, block0: int, nblocks: int, config: CompressConfig, interpret: bool):
  t = config.plan_blocks
  return pl.pallas_call(
      _plan_kernel,
      grid=(nblocks // t,),
      in_specs=[pl.BlockSpec((t, B.VALUES_PER_BLOCK), lambda i: (i + block0 // t, 0))],  # bits
      out_specs=pl.BlockSpec((t,), lambda i: (i,)),  # meta bytes
      out_shape=jax.ShapeDtypeStruct((nblocks,), jnp.int32),
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_plan",
  )(bits2d)


def _pack(meta_flat, group_offsets, bits3d, payload_rows, group0: int, ngroups: int, config, interpret):
  return pl.pallas_call(
      functools.partial(_pack_kernel, group0=group0),
      grid=(ngroups,),
      in_specs=[
          pl.BlockSpec(memory_space=pl.ANY),  # meta bytes, whole
          pl.BlockSpec(memory_space=pl.ANY),  # group offsets, whole
          pl.BlockSpec((B.BLOCKS_PER_GROUP, LOW_ROWS, 4), lambda g: (g + group0, 0, 0)),  # bits
          pl.BlockSpec(memory_space=pl.ANY),  # payload in (aliased)
      ],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),  # payload out
      out_shape=jax.ShapeDtypeStruct(payload_rows.shape, jnp.uint8),
      input_output_aliases={3: 0},
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_pack",
  )(meta_flat, group_offsets, bits3d, payload_rows)


@functools.partial(jax.jit, static_argnames=("num_blocks", "config", "interpret"))
def _compress_bits(bits2d: jax.Array, *, num_blocks: int, config: CompressConfig, interpret: bool):
  """bits2d: uint16 [N, 512], N a multiple of 4 * plan_blocks; rows >= num_blocks are padding."""
  n = bits2d.shape[0]
  chunk = config.chunk_blocks or n
  bits3d = bits2d.reshape(n, LOW_ROWS, 4)
  payload_rows = jnp.zeros((n * B.RAW_UNITS * ROWS_PER_UNIT, 4), jnp.uint8)
  metas, offsets = [], []
  base = jnp.int32(0)
  for block0 in range(0, n, chunk):
    nblocks = min(chunk, n - block0)
    meta = _plan(bits2d, block0, nblocks, config, interpret)
    if block0 + nblocks > num_blocks:  # padding rows become absent slots
      index = block0 + jnp.arange(nblocks)
      meta = jnp.where(index < num_blocks, meta, B.META_ABSENT)
    meta_bytes = meta.reshape(-1, B.BLOCKS_PER_GROUP)
    group_units = jnp.sum(B.block_units(meta_bytes), axis=-1)
    group_offsets = base + jnp.cumsum(group_units) - group_units
    base = base + jnp.sum(group_units)
    # The pack kernel indexes whole arrays by absolute group, so pad this
    # chunk's metadata to start at group 0 (a few bytes per chunk).
    g0 = block0 // B.BLOCKS_PER_GROUP
    pad_m = jnp.zeros((block0,), jnp.int32)
    pad_o = jnp.zeros((g0,), jnp.int32)
    payload_rows = _pack(
        jnp.concatenate([pad_m, meta]), jnp.concatenate([pad_o, group_offsets]),
        bits3d, payload_rows, g0, nblocks // B.BLOCKS_PER_GROUP, config, interpret,
    )
    metas.append(meta_bytes)
    offsets.append(group_offsets)
  meta_bytes = jnp.concatenate(metas)
  group_meta = codec.make_group_meta(jnp.concatenate(offsets), meta_bytes)
  groups = -(-num_blocks // B.BLOCKS_PER_GROUP)
  payload = payload_rows.reshape(-1)[: num_blocks * B.ROW_BYTES]
  return payload, group_meta[:groups], base.astype(jnp.int32)


def compress_pallas(x, *, config: CompressConfig | None = None, interpret: bool | None = None) -> codec.CompressedBlocks:
  """Pallas encoder with the contract of `codec.compress_reference` (same bytes).

  Args:
    x: bfloat16 [..., 512].
    config: tuning knobs; `heuristic_config` when None.
    interpret: run interpreted (default: when the default backend is not a GPU).
  """
  x = codec.check_blocks_input(x)
  batch_shape = tuple(x.shape[:-1])
  bits = B.to_bits(x).reshape(-1, B.VALUES_PER_BLOCK)
  n = bits.shape[0]
  config = config or heuristic_config(n)
  quantum = B.BLOCKS_PER_GROUP * config.plan_blocks
  padded = -(-n // quantum) * quantum
  if padded != n:
    bits = jnp.pad(bits, ((0, padded - n), (0, 0)))
  if config.chunk_blocks is not None and config.chunk_blocks >= padded:
    config = dataclasses.replace(config, chunk_blocks=None)
  payload, group_meta, units = _compress_bits(
      bits, num_blocks=n, config=config, interpret=resolve_interpret(interpret)
  )
  return codec.CompressedBlocks(payload, group_meta, units, batch_shape)

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
address arithmetic and strided/masked stores, which the Triton lowering
expresses directly; the Mosaic GPU lowering of this jax has no fetch-and-add
(its atomics return nothing) and needs TMA-sized copies. The payload is not
pre-filled: each pack program zeroes the part of its worst-case window that
lies past the data (a full zero fill cost more than both kernels, measured).
Splitting into L2-sized chunks was measured slower (one launch pair per
chunk). Figures: benchmarks/RESULTS.md (`python -m benchmarks.compress`).

In-kernel views (free reshapes done by the wrapper):
  blocks  uint16 [N * 128, 4]: in block n, row 128n + 2k holds positions 8k..8k+3 (x), row 2k+1
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
  """

  plan_blocks: int = 16
  num_warps: int = 4

  def __post_init__(self):
    if self.plan_blocks <= 0 or self.plan_blocks & (self.plan_blocks - 1):
      raise ValueError(f"plan_blocks={self.plan_blocks} must be a power of two")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")


def heuristic_config(num_blocks: int) -> CompressConfig:
  """Default config for `num_blocks` blocks (the best variant of benchmarks/compress.py)."""
  del num_blocks
  return CompressConfig()


def _plan_kernel(bits_ref, meta_ref):
  # bits_ref: uint16 [plan_blocks, 512]; meta_ref: int32 [plan_blocks]
  e = (bits_ref[...].astype(jnp.int32) >> 7) & 0xFF
  base = jnp.min(e, axis=1) & ~1
  eligible = jnp.max(e, axis=1) - base < B.EXPONENT_WINDOW
  meta_ref[...] = jnp.where(eligible, base >> 1, B.META_RAW)


def _pack_kernel(meta_ref, offset_ref, total_ref, bits_ref, payload_ref):
  # meta_ref:    int32 [groups * 4] (whole array), per-block byte
  # offset_ref:  int32 [groups] (whole array), group offset in units
  # total_ref:   int32 [1], units in use
  # bits_ref:    uint16 [4 * 128, 4], this group's four blocks (block k at rows 128k..)
  # payload_ref: uint8 [groups * 16 * 64, 4] (whole array)
  g = pl.program_id(0)
  # Zero this group's worst-case window [16 g, 16 g + 16) units where it lies past the
  # data: the windows tile the payload, so the tail is zeroed once, with no full fill.
  window = g * B.BLOCKS_PER_GROUP * B.RAW_UNITS * ROWS_PER_UNIT
  window_rows = B.BLOCKS_PER_GROUP * B.RAW_UNITS * ROWS_PER_UNIT
  rows = window + jax.lax.broadcasted_iota(jnp.int32, (window_rows, 4), 0)
  pltr.store(
      payload_ref.at[pl.ds(window, window_rows), :],
      jnp.zeros((window_rows, 4), jnp.uint8),
      mask=rows >= total_ref[0] * ROWS_PER_UNIT,
  )
  unit = offset_ref[g]
  for k in range(B.BLOCKS_PER_GROUP):
    mb = meta_ref[g * B.BLOCKS_PER_GROUP + k]
    row = unit * ROWS_PER_UNIT
    x = bits_ref[pl.ds(k * LOW_ROWS, 64, stride=2), :].astype(jnp.int32)  # [64, 4]
    y = bits_ref[pl.ds(k * LOW_ROWS + 1, 64, stride=2), :].astype(jnp.int32)

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

    # Sizes as integer arithmetic: Triton's lowering of nested scalar selects mixes i1 and i32.
    is_compressed = (mb <= B.MAX_HALF_BASE).astype(jnp.int32)
    is_raw = (mb == B.META_RAW).astype(jnp.int32)
    unit = unit + is_compressed * B.COMPRESSED_UNITS + is_raw * B.RAW_UNITS


def _plan(bits2d, config: CompressConfig, interpret: bool):
  t = config.plan_blocks
  n = bits2d.shape[0]
  return pl.pallas_call(
      _plan_kernel,
      grid=(n // t,),
      in_specs=[pl.BlockSpec((t, B.VALUES_PER_BLOCK), lambda i: (i, 0))],  # bits
      out_specs=pl.BlockSpec((t,), lambda i: (i,)),  # meta bytes
      out_shape=jax.ShapeDtypeStruct((n,), jnp.int32),
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_plan",
  )(bits2d)


def _pack(meta, group_offsets, total_units, bits_rows, config, interpret):
  groups = group_offsets.shape[0]
  payload_rows = groups * B.BLOCKS_PER_GROUP * B.RAW_UNITS * ROWS_PER_UNIT
  return pl.pallas_call(
      _pack_kernel,
      grid=(groups,),
      in_specs=[
          pl.BlockSpec(memory_space=pl.ANY),  # meta bytes, whole
          pl.BlockSpec(memory_space=pl.ANY),  # group offsets, whole
          pl.BlockSpec(memory_space=pl.ANY),  # units in use
          pl.BlockSpec((B.BLOCKS_PER_GROUP * LOW_ROWS, 4), lambda g: (g, 0)),  # bits
      ],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),  # payload, written whole
      out_shape=jax.ShapeDtypeStruct((payload_rows, 4), jnp.uint8),
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_pack",
  )(meta, group_offsets, total_units, bits_rows)


@functools.partial(jax.jit, static_argnames=("num_blocks", "config", "interpret"))
def _compress_bits(bits2d: jax.Array, *, num_blocks: int, config: CompressConfig, interpret: bool):
  """bits2d: uint16 [N, 512], N a multiple of 4 * plan_blocks; rows >= num_blocks are padding."""
  n = bits2d.shape[0]
  meta = _plan(bits2d, config, interpret)
  if n > num_blocks:  # padding rows become absent slots
    meta = jnp.where(jnp.arange(n) < num_blocks, meta, B.META_ABSENT)
  meta_bytes = meta.reshape(-1, B.BLOCKS_PER_GROUP)
  group_offsets, group_meta, total_units = codec.pack_groups(meta_bytes)
  payload_rows = _pack(meta, group_offsets, total_units.reshape(1), bits2d.reshape(n * LOW_ROWS, 4), config, interpret)
  groups = -(-num_blocks // B.BLOCKS_PER_GROUP)
  payload = payload_rows.reshape(-1)[: num_blocks * B.ROW_BYTES]
  return payload, group_meta[:groups], total_units


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
  payload, group_meta, units = _compress_bits(
      bits, num_blocks=n, config=config, interpret=resolve_interpret(interpret)
  )
  return codec.CompressedBlocks(payload, group_meta, units, batch_shape)

"""Plan the balanced schedule's work items on the device: one small Pallas (Triton) kernel.

`decode_attention._work_items` states the plan in jnp: an item size for the batch (the candidate
whose items finish soonest in waves of the GPU's CTA slots), then each sequence cut into equal
items in sequence order. Traced inside a jitted call, XLA ran it as 9-10 small kernels (12-17 us
before the attention kernel, H100, 2026-12-07). This kernel runs the same statements in one
program: the candidates in blocks of a [candidates, B] compare-and-sum, a cumulative sum over the
sequences, and the table in blocks of a [rows, B] one-hot select (a register tensor has no
gather). Its table is int32 [W, 4]: the rows (sequence, first page, end page) of `_work_items`
and a zero column (a power-of-two block store); the attention kernel reads either stride.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._platform import resolve_interpret

TABLE_COLUMNS = 4  # (sequence, first page, end page, 0): a power of two for the row store
BLOCK_ELEMENTS = 4096  # a [rows, B] block's elements: 32 int32 registers per thread of 4 warps


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _plan_kernel(lengths_ref, table_ref, first_ref, *, batch: int, kv_heads: int, num_items: int, candidates: int,
                 slots: int, page_size: int, step_pages: int, min_pages: int, overhead_pages: int):
  """Refs: lengths_ref int32 [B]; table_ref int32 [W, 4]; first_ref int32 [B + 1]."""
  bp = _pow2(batch)
  seq = lax.broadcasted_iota(jnp.int32, (bp,), 0)
  real = seq < batch
  lengths = pltr.load(lengths_ref.at[pl.ds(pl.program_id(0), bp)], mask=real, other=0)  # (traced start: as below)
  pages = (lengths + page_size - 1) // page_size  # [B], the tail page included; lengths >= 0
  ceil_div = lambda x, d: (x + d - 1) // d  # x >= 0, d >= 1
  steps_up = lambda x: ceil_div(x, step_pages) * step_pages
  longest = jnp.max(pages)
  size_of = lambda n: jnp.maximum(min_pages, steps_up(ceil_div(longest, n)))
  huge = jnp.iinfo(jnp.int32).max

  nc = max(1, min(_pow2(candidates), BLOCK_ELEMENTS // bp))  # candidates per block

  def best_of_block(block, carry):  # the first minimum of this block, kept if below the best so far
    best_cost, best_size = carry
    k = lax.broadcasted_iota(jnp.int32, (nc,), 0)
    n = block * nc + 1 + k
    sizes = size_of(n)  # [nc], non-increasing in n
    items = jnp.sum(ceil_div(pages[None, :], sizes[:, None]), axis=1)  # [nc]
    waves = ceil_div(items * kv_heads, slots)
    cost = jnp.where((n <= candidates) & (items <= num_items), waves * (sizes + overhead_pages), huge)
    low = jnp.min(cost)
    first = jnp.min(jnp.where(cost == low, k, nc))
    size = jnp.sum(jnp.where(k == first, sizes, 0))
    better = low < best_cost
    return jnp.where(better, low, best_cost), jnp.where(better, size, best_size)

  blocks = ceil_div(candidates, nc)
  _, chunk = lax.fori_loop(0, blocks, best_of_block, (jnp.int32(huge), size_of(jnp.int32(1))))
  per_item = steps_up(ceil_div(pages, jnp.maximum(ceil_div(pages, chunk), 1)))  # equal items of whole steps
  count = jnp.where(real, ceil_div(pages, jnp.maximum(per_item, 1)), 0)  # 0 for an empty sequence
  ends = jnp.cumsum(count)
  starts = ends - count
  first_ref[0] = jnp.int32(0)
  one = pl.program_id(0) + 1  # a traced start: the masked block runs past the end, which a static slice refuses
  pltr.store(first_ref.at[pl.ds(one, bp)], ends, mask=real)

  rows = max(1, min(_pow2(num_items), BLOCK_ELEMENTS // bp))
  column = lax.broadcasted_iota(jnp.int32, (rows, TABLE_COLUMNS), 1)

  def write_rows(block, _):
    w = block * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
    b = jnp.sum(jnp.where(real[None, :] & (ends[None, :] <= w[:, None]), 1, 0), axis=1)  # sequences ended by w
    used, bc = b < batch, jnp.minimum(b, batch - 1)
    mine = seq[None, :] == bc[:, None]  # [rows, B] one-hot
    start = jnp.sum(jnp.where(mine, starts[None, :], 0), axis=1)
    size = jnp.sum(jnp.where(mine, per_item[None, :], 0), axis=1)
    first = (w - start) * size
    b, first, end = (jnp.where(used, x, fill) for x, fill in ((bc, -1), (first, 0), (first + size, 0)))
    table = jnp.where(column == 0, b[:, None], jnp.where(column == 1, first[:, None],
                                                         jnp.where(column == 2, end[:, None], 0)))
    pltr.store(table_ref.at[pl.ds(block * rows, rows), :], table, mask=(w < num_items)[:, None])
    return _

  lax.fori_loop(0, ceil_div(num_items, rows), write_rows, 0)


@functools.partial(jax.jit, static_argnames=("kv_heads", "num_items", "candidates", "slots", "page_size",
                                             "step_pages", "min_pages", "overhead_pages", "interpret"))
def plan_items(lengths, *, kv_heads: int, num_items: int, candidates: int, slots: int, page_size: int,
               step_pages: int, min_pages: int, overhead_pages: int, interpret: bool | None = None):
  """The balanced schedule's items for `lengths` int32 [B] (each >= 0), as `_work_items` plans
  them (its docstring states the rule; the constants are its own, passed in).

  Returns:
    (table int32 [W, 4]: rows (sequence, first page, end page, 0), unused rows (-1, 0, 0, 0);
     seq_first int32 [B + 1]).
  """
  (batch,) = lengths.shape
  body = functools.partial(_plan_kernel, batch=batch, kv_heads=kv_heads, num_items=num_items, candidates=candidates,
                           slots=slots, page_size=page_size, step_pages=step_pages, min_pages=min_pages,
                           overhead_pages=overhead_pages)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      body,
      grid=(1,),
      in_specs=[any_spec],
      out_specs=[any_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct((num_items, TABLE_COLUMNS), jnp.int32),
                 jax.ShapeDtypeStruct((batch + 1,), jnp.int32)],
      interpret=resolve_interpret(interpret),
      compiler_params=pltr.CompilerParams(num_warps=4),
      name="zipfusion_plan_items",
  )(lengths.astype(jnp.int32))

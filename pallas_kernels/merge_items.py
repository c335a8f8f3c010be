"""Merge the balanced schedule's work-item partials by sequence: one small Pallas (Triton) kernel.

The fused decode kernel's balanced schedule (`decode_attention._work_items`) cuts each sequence
into consecutive work items; item w leaves an O^T partial and its log2-sum-exp. Program (b, h)
walks sequence b's items `[seq_first[b], seq_first[b + 1])` with an online softmax merge (each
item weighted by `exp2(lse - running max)`, 8 items per load), divides once, and writes the G
query heads' final BF16 rows straight into the `[B * Hkv * G, D]` output, so the call ends with
this one kernel (the XLA merge it replaces was seven: 17 us at 32 x 2048, H100, 2026-12-07).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._platform import resolve_interpret


ITEMS_PER_LOAD = 8  # partials read together: the work table's row count is a multiple of this


def _merge_kernel(first_ref, o_ref, lse_ref, out_ref, lse_out_ref, *, consumers: int, group: int):
  """Refs: first_ref int32 [B + 1]; o_ref f32 [W, Hkv, C, D, 8] (O^T partials); lse_ref f32
  [W, Hkv, C, 16, 8] (log2, row 0 read); out_ref bf16 [B * Hkv * G, D]; lse_out_ref f32 [B * Hkv, 8].

  The items are read 8 at a time (aligned blocks of the item axis, masked to the sequence's range):
  one at a time, a 32-item sequence's merge was a chain of dependent loads (41 us, H100)."""
  b, h = pl.program_id(0), pl.program_id(1)
  kv_heads, head_dim = o_ref.shape[1], o_ref.shape[3]
  lo, hi = first_ref[b], first_ref[b + 1]
  n = ITEMS_PER_LOAD

  def merge(block, carry):  # items [block * n, block * n + n), those in [lo, hi)
    top, total, acc = carry
    item = block * n + lax.broadcasted_iota(jnp.int32, (n,), 0)
    inside = (item >= lo) & (item < hi)
    for c in range(consumers):
      at = (pl.ds(block * n, n), h, jnp.int32(c))  # (a Python int index trips the masked load)
      lse = pltr.load(lse_ref.at[*at, jnp.int32(0), :], mask=inside[:, None], other=-jnp.inf)  # [n, 8]
      o = pltr.load(o_ref.at[at], mask=inside[:, None, None], other=0.0)  # [n, D, 8]
      new_top = jnp.maximum(top, jnp.max(lse, axis=0))
      safe = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no partial with mass yet: weights stay 0
      alpha, weight = jnp.exp2(top - safe), jnp.exp2(lse - safe[None, :])  # [8], [n, 8]
      total = total * alpha + jnp.sum(weight, axis=0)
      acc = acc * alpha[None, :] + jnp.sum(o * weight[:, None, :], axis=0)
      top = new_top
    return top, total, acc

  init = (jnp.full((8,), -jnp.inf, jnp.float32), jnp.zeros((8,), jnp.float32), jnp.zeros((head_dim, 8), jnp.float32))
  top, total, acc = lax.fori_loop(lo // n, (hi + n - 1) // n, merge, init)
  empty = total == 0  # a sequence with no tokens: zeros and -inf, as the split merge gives
  out = acc / jnp.where(empty, 1.0, total)[None, :]  # O^T [D, 8]
  lse_out_ref[b * kv_heads + h, :] = jnp.where(empty, -jnp.inf, top + jnp.log2(jnp.where(empty, 1.0, total)))
  heads = lax.broadcasted_iota(jnp.int32, (head_dim, 8), 1)
  for g in range(group):  # head g's row: column g of O^T (a masked sum: register tensors have no column index)
    out_ref[(b * kv_heads + h) * group + g, :] = jnp.sum(jnp.where(heads == g, out, 0.0), axis=1).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("group", "interpret"))
def merge_items(o, lse, seq_first, *, group: int, interpret: bool | None = None):
  """Final attention rows from work-item partials.

  Args:
    o: float32 [W, Hkv, C, D, 8], item w's consumer c's normalised O^T (columns >= `group` unused);
      W a multiple of ITEMS_PER_LOAD.
    lse: float32 [W, Hkv, C, 16, 8], its log2-sum-exp (row 0 read; -inf: no tokens).
    seq_first: int32 [B + 1], sequence b's items are `[seq_first[b], seq_first[b + 1])`
      (non-decreasing; items past `seq_first[B]` are ignored).
    group: query heads per KV head, G <= 8.
    interpret: None = interpret off-GPU.

  Returns:
    (out bfloat16 [B * Hkv * G, D], lse2 float32 [B * Hkv, 8]) rows (b, KV head h, head g); lse2's
    columns >= G are unused.
  """
  num_items, kv_heads, consumers, head_dim, rows = o.shape
  if (rows != 8 or lse.shape != (num_items, kv_heads, consumers, 16, 8) or not 1 <= group <= 8
      or num_items % ITEMS_PER_LOAD):
    raise ValueError(f"partials must be o [W, Hkv, C, D, 8] and lse [W, Hkv, C, 16, 8] with G <= 8 and W a "
                     f"multiple of {ITEMS_PER_LOAD}, got {o.shape}, {lse.shape}, G = {group}")
  batch = seq_first.shape[0] - 1
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_merge_kernel, consumers=consumers, group=group),
      grid=(batch, kv_heads),
      in_specs=[any_spec] * 3,
      out_specs=[any_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct((batch * kv_heads * group, head_dim), jnp.bfloat16),
                 jax.ShapeDtypeStruct((batch * kv_heads, 8), jnp.float32)],
      interpret=resolve_interpret(interpret),
      compiler_params=pltr.CompilerParams(num_warps=4),
      name="zipfusion_merge_items",
  )(seq_first.astype(jnp.int32), o, lse)

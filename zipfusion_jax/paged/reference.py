"""Pure-jnp paged decode attention: the reference the kernels are tested against.

Restores completed pages (bit-exact), gathers each sequence's pages through
its page table, appends the tail page, masks tokens past the length, and
runs softmax attention in fp32 (one query token per sequence, GQA).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from zipfusion_jax.paged.cache import PAGE_SIZE, PagedKVCache, restore_pages


def check_query(q, cache: PagedKVCache) -> None:
  """Raise a clear error when q does not match the cache."""
  if getattr(q, "ndim", None) != 3:
    raise ValueError(f"q must be [B, Hq, D], got shape {getattr(q, 'shape', None)}")
  if jnp.dtype(q.dtype) != jnp.bfloat16:
    raise TypeError(f"q must be bfloat16, got {q.dtype}")
  batch, q_heads, head_dim = q.shape
  if batch != cache.batch:
    raise ValueError(f"q has batch {batch} but the cache holds {cache.batch} sequences")
  if head_dim != cache.head_dim:
    raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache.head_dim}")
  if q_heads % cache.num_kv_heads:
    raise ValueError(f"q heads ({q_heads}) must be a multiple of the cache's KV heads ({cache.num_kv_heads})")
  if q_heads // cache.num_kv_heads > 8:
    raise ValueError(f"at most 8 q heads per KV head are supported, got {q_heads // cache.num_kv_heads}")
  lengths = cache.lengths
  if not isinstance(lengths, jax.core.Tracer) and lengths.size:
    lo, hi = int(jnp.min(lengths)), int(jnp.max(lengths))
    if lo < 0 or hi > cache.max_length:
      raise ValueError(
          f"lengths must lie in [0, {cache.max_length}] for a page table of {cache.max_pages} pages, got [{lo}, {hi}]"
      )


def default_scale(head_dim: int, sm_scale: float | None) -> float:
  """The softmax scale as a Python float (it is a static argument of the compiled paths)."""
  if sm_scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(sm_scale, jax.core.Tracer):
    raise TypeError("sm_scale must be a concrete number (it is static, compiled into the kernel), got a traced value")
  scale = float(sm_scale)
  if not math.isfinite(scale):  # every score would be NaN / inf: a NaN output, and a recompile per call (NaN != NaN)
    raise ValueError(f"sm_scale must be finite, got {scale}")
  return scale


def gather_sequences(cache: PagedKVCache, k_pages: jax.Array, v_pages: jax.Array):
  """Dense per-sequence K/V: bfloat16 [B, Hkv, max_pages * 16 + 16, D] (tail last) and a bool mask [B, T]."""
  def dense(pages, tail):
    seq = pages[:, cache.page_table]  # [Hkv, B, max_pages, 16, D]
    seq = seq.transpose(1, 0, 2, 3, 4).reshape(cache.batch, cache.num_kv_heads, cache.max_pages * PAGE_SIZE,
                                                cache.head_dim)  # no -1: a batch of 0 sequences has size 0
    return jnp.concatenate([seq, tail], axis=2)

  k, v = dense(k_pages, cache.k_tail), dense(v_pages, cache.v_tail)
  t = jnp.arange(k.shape[2])
  complete = cache.lengths // PAGE_SIZE
  in_pages = t[None, :] < (complete * PAGE_SIZE)[:, None]
  tail_row = t[None, :] - cache.max_pages * PAGE_SIZE
  in_tail = (tail_row >= 0) & (tail_row < (cache.lengths % PAGE_SIZE)[:, None])
  return k, v, in_pages | in_tail


def attend_dense(q, k, v, mask, sm_scale: float, return_lse: bool = False):
  """q [B, Hq, D], k/v [B, Hkv, T, D], mask [B, T] -> bfloat16 [B, Hq, D] (fp32 math).

  A sequence with no tokens gets zeros (and lse = -inf).
  """
  batch, q_heads, head_dim = q.shape
  kv_heads = k.shape[1]
  qg = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).astype(jnp.float32)
  # Rows outside the mask (stale pages, a tail past the length) may hold anything, NaN
  # included: zero them, since P = 0 there and 0 * NaN would still poison the sum.
  keep = mask[:, None, :, None]
  k = jnp.where(keep, k.astype(jnp.float32), 0.0)
  v = jnp.where(keep, v.astype(jnp.float32), 0.0)
  s = jnp.einsum("bhgd,bhtd->bhgt", qg, k) * sm_scale
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhgt,bhtd->bhgd", p, v) / jnp.where(l > 0, l, 1.0)
  out = o.reshape(batch, q_heads, head_dim).astype(jnp.bfloat16)
  if return_lse:
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out, lse.reshape(batch, q_heads)
  return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_lse"))
def paged_decode_attention_reference(q, cache: PagedKVCache, sm_scale: float, return_lse: bool = False):
  """Reference decode attention over a paged cache (either store)."""
  k_pages, v_pages = restore_pages(cache, impl="reference")
  k, v, mask = gather_sequences(cache, k_pages, v_pages)
  return attend_dense(q, k, v, mask, sm_scale, return_lse)

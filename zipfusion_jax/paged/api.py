"""Public decode-attention entry points over a `PagedKVCache`."""

from __future__ import annotations

from typing import Literal

import jax

from zipfusion_jax.paged import reference
from zipfusion_jax.paged.cache import PagedKVCache, restore_pages

AttentionImpl = Literal["pallas", "reference"]


# The fused kernel (pallas_kernels/decode_attention.py, docs/DECODE_KERNEL.md) needs a Hopper
# GPU; elsewhere the default is the jnp reference of the same format.
FUSED_KERNEL_AVAILABLE = True


def _resolve_impl(impl: AttentionImpl | None) -> AttentionImpl:
  if impl is None:
    return "pallas" if FUSED_KERNEL_AVAILABLE and jax.default_backend() == "gpu" else "reference"
  if impl not in ("pallas", "reference"):
    raise ValueError(f"{impl=} must be 'pallas' or 'reference'")
  return impl


def paged_decode_attention(
    q,
    cache: PagedKVCache,
    sm_scale: float | None = None,
    *,
    impl: AttentionImpl | None = None,
    config=None,
    return_lse: bool = False,
    interpret: bool | None = None,
    work=None,
):
  """Decode attention of one query token per sequence over a paged cache.

  Args:
    q: bfloat16 [B, Hq, D]; Hq a multiple of the cache's KV heads (<= 8 per KV head).
    cache: from `paged_cache_from_dense` (compressed or not).
    sm_scale: softmax scale, a finite concrete number (static: compiled in); default 1/sqrt(D).
    impl: "pallas" (the fused Mosaic GPU kernel; Hopper GPUs) or "reference"
      (jnp). Default: "pallas" on a GPU, else "reference".
    config: `pallas_kernels.decode_attention.DecodeConfig` or None (heuristic).
    return_lse: also return the natural-log sum-exp float32 [B, Hq].
    interpret: for "pallas": run the kernel body in Mosaic GPU interpret mode
      (default: off-GPU only). Interpreted, the restore is the jnp codec and P goes
      through SMEM; slow (seconds), for tests; not traceable inside jax.jit.
    work: for "pallas" with `config.schedule == "balanced"`: the work items planned on the host,
      `pallas_kernels.decode_attention.host_work_items(lengths, ...)`; None plans them on the device.

  Returns:
    bfloat16 [B, Hq, D] (and float32 [B, Hq] when `return_lse`). The
    compressed and uncompressed caches of the same K/V give bit-identical
    outputs.
  """
  reference.check_query(q, cache)
  scale = reference.default_scale(cache.head_dim, sm_scale)
  if _resolve_impl(impl) == "reference":
    if config is not None or interpret is not None or work is not None:
      raise TypeError("impl='reference' takes no config, interpret or work")
    return reference.paged_decode_attention_reference(q, cache, scale, return_lse)
  from pallas_kernels.decode_attention import decode_attention_pallas  # kernels sit above the format

  return decode_attention_pallas(q, cache, scale, config=config, return_lse=return_lse, interpret=interpret, work=work)


def decompress_then_attend(q, cache: PagedKVCache, sm_scale: float | None = None, *, impl: AttentionImpl | None = None,
                           restore_impl: str | None = None, **kwargs):
  """The lossless baseline of the paper's competitors: restore all pages to BF16, then attend.

  Writes a BF16 copy of every completed page (the buffer the fused kernel never
  materialises) with `restore_pages(cache, restore_impl)` (None: the Pallas page-decompression
  kernel on a GPU, else the jnp restore), then runs the uncompressed paged kernel (`impl`) on it.
  """
  if cache.compressed:
    # The restore reads only the store, so without this XLA may hoist every layer's restore to the
    # start of a decode step and hold all their BF16 buffers at once (CPU, 8 layers: 5x the
    # temporaries); tied to this layer's query, one layer's buffer is alive at a time, which is
    # what the baseline's memory budget counts (`PagedBackend.decompress_buffer_bytes`).
    q, cache = jax.lax.optimization_barrier((q, cache))
    k_pages, v_pages = restore_pages(cache, restore_impl)
    cache = cache.replace(arena=None, group_meta=None, k_pages=k_pages, v_pages=v_pages, compressed=False)
  return paged_decode_attention(q, cache, sm_scale, impl=impl, **kwargs)

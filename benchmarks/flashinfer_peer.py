"""FlashInfer's paged decode kernel next to ours and cuDNN, in one process (Llama-3.1-8B shapes).

  python -m benchmarks.flashinfer_peer [--shapes 32x2048,8x8192,...] [--out FILE]

FlashInfer is not a dependency: it runs where it was carried (GPU-NOTES: the
`flashinfer-python` and `apache-tvm-ffi` wheels installed with `--no-deps`, `CUDA_HOME` from
`nvcc`, `MAX_JOBS=16`; `plan()` JIT-compiles its kernels on first use). Its pages hold the same
K/V as ours (`benchmarks.attention.problem`), split into 16-token pages placed at shuffled
physical slots, in both of its layouts (NHD `[pages, 16, Hkv, D]`, HND `[pages, Hkv, 16, D]`);
`BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")`, the setting the
paper's baseline and SGLang's GQA decode use. Every output is checked against our jnp
reference. Times: CUPTI kernel time for the JAX kernels (as in `benchmarks.attention`), and for
FlashInfer the torch profiler's kernel durations (CUPTI too) of the same back-to-back calls.

Rows: {"kernel", "model", "batch", "context", "time_us", "bytes_read", "layout"?, "max_abs_err"?}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import numpy as np

import zipfusion_jax as zf
from benchmarks.attention import dense_attention, problem
from benchmarks.compress import cupti_us
from benchmarks.generate import save_result
from models.configs import get_config

PAGE = 16


def torch_kernel_us(fn, iterations: int = 10) -> float:
  """Median per-call CUDA kernel time (µs) of `fn()`, from the torch profiler (CUPTI)."""
  import torch
  from torch.profiler import ProfilerActivity, profile

  fn()
  torch.cuda.synchronize()
  per_call = []
  for _ in range(iterations):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      fn()
      torch.cuda.synchronize()
    per_call.append(sum(e.device_time_total for e in prof.key_averages()))  # µs, every kernel of the call
  return statistics.median(per_call)


def flashinfer_paged(q, k, v, scale: float, layout: str, seed: int = 0):
  """(run, pages) for FlashInfer over k, v bf16 [B, S, Hkv, D] (S a multiple of 16) as shuffled pages."""
  import flashinfer
  import torch

  batch, seq, kv_heads, head_dim = k.shape
  n = seq // PAGE
  qt, kt, vt = (torch.from_dlpack(x) for x in (q, k, v))
  perm = torch.randperm(batch * n, generator=torch.Generator().manual_seed(seed)).to(kt.device)

  def paged(x):  # logical page i of the flattened batch lands at physical slot perm[i]
    pages = x.reshape(batch * n, PAGE, kv_heads, head_dim)
    if layout == "HND":
      pages = pages.transpose(1, 2)
    store = torch.empty_like(pages)
    store[perm] = pages
    return store.contiguous()

  k_store, v_store = paged(kt), paged(vt)
  device = kt.device
  indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * n
  last = torch.full((batch,), PAGE, dtype=torch.int32, device=device)
  workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
  wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=True, backend="fa2")
  wrapper.plan(indptr, perm.to(torch.int32), last, q.shape[1], kv_heads, head_dim, PAGE,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
  return (lambda: wrapper.run(qt, (k_store, v_store))), (k_store, v_store)


def time_ours(p, ref, base) -> list[dict]:
  """cuDNN and our kernels on problem `p` (CUPTI through the Mosaic GPU profiler)."""
  rows = []
  ours = jax.jit(lambda q, c: zf.paged_decode_attention(q, c, impl="pallas"))
  q, k, v, scale = p["q"], p["k"], p["v"], p["scale"]
  for kernel, fn, args, nbytes in (
      ("cudnn_dense", dense_attention("cudnn", scale), (q, k, v), p["bf16_bytes"]),
      ("zipfusion_uncompressed", ours, (q, p["plain"]), p["bf16_bytes"]),
      ("zipfusion_compressed", ours, (q, p["comp"]), p["comp_bytes"]),
      ("zipfusion_compressed_v2", ours, (q, p["comp2"]), p["comp2_bytes"])):  # format version 2
    t, _ = cupti_us(fn, *args)
    err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - ref)))
    rows.append(dict(base, kernel=kernel, time_us=t, bytes_read=int(nbytes), max_abs_err=err))
  return rows


def time_flashinfer(p, ref, base) -> list[dict]:
  """FlashInfer in both page layouts on problem `p` (the torch profiler's CUPTI)."""
  import torch

  rows = []
  for layout in ("NHD", "HND"):
    run, pages = flashinfer_paged(p["q"], p["k"], p["v"], p["scale"], layout)
    out = run()
    err = float((out.float().cpu() - torch.from_numpy(ref)).abs().max())
    rows.append(dict(base, kernel="flashinfer_paged", layout=layout, time_us=torch_kernel_us(run),
                     bytes_read=int(p["bf16_bytes"]), max_abs_err=err))
    del run, pages
    torch.cuda.empty_cache()
  return rows


def _print(rows):
  for r in rows:
    print(f"{r['kernel']:24s} {r.get('layout', ''):3s} B={r['batch']:3d} S={r['context']:6d} {r['time_us']:8.1f} us "
          f"{r['bytes_read'] / r['time_us'] / 1e6:5.2f} TB/s  err {r['max_abs_err']:.3g}", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="32x2048,8x8192,64x4096,1x32768,128x1024")
  ap.add_argument("--out", type=pathlib.Path, default=None)
  a = ap.parse_args(argv)
  cfg = get_config("llama3.1-8b")
  # Every JAX timing first: once the torch profiler has subscribed to CUPTI, the Mosaic GPU
  # profiler cannot (one subscriber per process).
  problems = []
  rows = []
  for i, shape in enumerate(a.shapes.split(",")):
    batch, context = map(int, shape.split("x"))
    p = problem(jax.random.key(100 + i), cfg, batch, context)
    ref = np.asarray(zf.paged_decode_attention(p["q"], p["plain"], impl="reference"), np.float32)
    base = dict(model=cfg.name, batch=batch, context=context)
    problems.append(({n: p[n] for n in ("q", "k", "v", "scale", "bf16_bytes")}, ref, base))  # what FlashInfer reads
    new = time_ours(p, ref, base)
    _print(new)
    rows += new
    save_result(a.out, rows)
  for p, ref, base in problems:
    new = time_flashinfer(p, ref, base)
    _print(new)
    rows += new
    save_result(a.out, rows)
  return save_result(a.out, rows)


if __name__ == "__main__":
  main()

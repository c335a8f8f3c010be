"""Tokens resident in a fixed memory budget, compressed vs uncompressed; allocator step overhead.

  python -m benchmarks.capacity [--budget-gib 4] [--out benchmarks/results/capacity.json]
  python -m benchmarks.capacity --overhead [--out benchmarks/results/allocator_overhead.json]
  python -m benchmarks.capacity --admission [--out benchmarks/results/admission.json]

Capacity (host only, exact): for each model the same budget builds a
`ServingConfig.from_budget` store (compressed: chunks plus page metadata;
uncompressed: BF16 page slots), and the allocator is filled page by page
until it refuses, each page taking the size its K/V actually encodes to in
each layer. Tokens are those of completed pages (per-slot tail pages are the
same in both stores and not counted). Writes a list of
{"model", "budget_bytes", "tokens_uncompressed", "tokens_compressed", "capacity_ratio"}.

K/V sources:
* SmolLM2-135M (30 layers, 3 KV heads, head_dim 64): real K/V from the embedded
  model's prefill with fp32 RoPE (`smollm2_real_kv`); where the model package is
  missing, blocks drawn at SmolLM2's measured statistics (87.7% of K blocks and
  92.8% of V blocks eligible, benchmarks/synthetic_kv.py); the model name says which.
* Llama-3.1-8B shapes (32 layers, 8 KV heads, head_dim 128): synthetic blocks
  at the same statistics.

Admission (host only, exact): `benchmarks/e2e.py`'s largest batch without a GPU. The same
store as e2e's (`e2e.backend_for`: budget, offered slots, chunk size), the engine's own scheduler
and allocator, and one warm-up request; then requests of `context` tokens are admitted until
refused, each prefill's pages taking sizes drawn at a block eligibility (per layer, per page).
Rows: {"model", "context", "budget_gib", "system", "eligible", "chunk_pages", "admitted",
"stranded_gib"}.

Overhead: per decode step at batch 64 and 8K context, Llama-3.1-8B shapes,
the host's allocator work (plan, reservation, plan check, commit of the
readback) and the plan upload + readback, against the device time of one
decode step's attention reads, estimated as XLA dense attention over the
same KV (32 layers), measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.synthetic_kv import synthetic_blocks
from models.configs import get_config
from zipfusion_jax.format import block as B
from zipfusion_jax.serving.allocator import ChunkAllocator
from zipfusion_jax.serving.engine import decode_plan
from zipfusion_jax.serving.scheduler import Scheduler
from zipfusion_jax.serving.state import PAGE_SIZE, ServingConfig, check_plan

SMOLLM2_ELIGIBLE = {"k": 0.877, "v": 0.928}  # measured on real SmolLM2 KV, fp32 RoPE


def smollm2_real_kv(num_tokens: int):
  """Real SmolLM2-135M K/V: (k, v) bfloat16 [layers, tokens, kv_heads, head_dim], RoPE'd in fp32.

  The embedded model's prefill (`zipfusion_jax.kvstats.prompt_kv`) over this repository's own
  documentation (English prose, tables and code), cut to `num_tokens`.
  """
  from models.loaders.resolve import from_name
  from zipfusion_jax.kvstats import prompt_kv

  root = pathlib.Path(__file__).resolve().parents[1]
  text = "\n\n".join(p.read_text() for p in (root / "README.md", root / "docs" / "FORMAT.md", root / "docs" / "DECODE_KERNEL.md"))
  m = from_name("smollm2-135m")
  ids = m.tokenizer.encode(text)[:num_tokens]
  k, v = prompt_kv(m.params, m.config, ids)  # [L, H, T, D]
  return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _eligible_pool(key, num_blocks: int, kind: str) -> np.ndarray:
  """bool [num_blocks]: block-rule eligibility of synthetic blocks at SmolLM2's statistics."""
  x = synthetic_blocks(key, num_blocks, SMOLLM2_ELIGIBLE[kind])
  eligible, _ = B.block_half_base(B.to_bits(x))
  return np.asarray(eligible)


def _page_units_from_blocks(eligible_k, eligible_v, cfg: ServingConfig, layers: int, pages: int, rng) -> np.ndarray:
  """int [layers, pages]: units per page per layer, each block drawn from the pools."""
  per = cfg.num_kv_heads * cfg.blocks_per_page
  k = rng.choice(eligible_k, (layers, pages, per))
  v = rng.choice(eligible_v, (layers, pages, per))
  units = lambda e: np.where(e, B.COMPRESSED_UNITS, B.RAW_UNITS).sum(-1)
  return units(k) + units(v)


def _real_page_units(k, v, cfg: ServingConfig) -> np.ndarray:
  """int [layers, pages] from real K/V bfloat16 [layers, tokens, Hkv, D]."""
  from zipfusion_jax.paged.cache import encode_page_blocks

  layers, tokens = k.shape[:2]
  n = tokens // PAGE_SIZE
  pages = jnp.stack([k, v], 2)[:, : n * PAGE_SIZE]  # [L, T, 2, Hkv, D]
  pages = pages.reshape(layers, n, PAGE_SIZE, 2, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1, 4, 3, 2, 5)
  _, meta, _ = encode_page_blocks(pages)
  return np.asarray(B.block_units(meta)).sum(axis=(2, 3, 4))


def fill_until_refusal(cfg: ServingConfig, sizes: np.ndarray) -> int:
  """Pages the allocator accepts, one at a time, page i taking sizes[:, i % n] units per layer."""
  alloc, pages = ChunkAllocator(cfg), 0
  while alloc.check_reserve(1) is None:
    placement = alloc.reserve(1)
    col = pages % sizes.shape[1]
    alloc.commit(placement, sizes[:, col : col + 1])
    pages += 1
  cap = alloc.capacity()
  assert cap.live_bytes + cap.dead_bytes + cap.stranded_bytes + cap.free_bytes == cap.total_bytes
  return pages


def capacity_entry(model: str, budget: int, seed: int = 0, real_kv_tokens: int = 2048) -> dict:
  mc = get_config(model)
  shape = dict(num_layers=mc.layers, num_kv_heads=mc.kv_heads, head_dim=mc.head_dim, num_slots=64, max_pages=512)
  raw_cfg = ServingConfig.from_budget(budget, compressed=False, **shape)
  zip_cfg = ServingConfig.from_budget(budget, compressed=True, **shape)
  source = "synthetic K/V at SmolLM2's measured block statistics"
  sizes = None
  if model.startswith("smollm2"):
    try:
      k, v = smollm2_real_kv(real_kv_tokens)
      sizes, source = _real_page_units(k, v, zip_cfg), f"real SmolLM2 K/V of {k.shape[1]} tokens of this repo's docs, fp32 RoPE"
    except (ImportError, FileNotFoundError):  # no model package (e.g. the GPU machine)
      pass
  if sizes is None:
    key_k, key_v = jax.random.split(jax.random.key(seed))
    pool_k, pool_v = _eligible_pool(key_k, 1 << 16, "k"), _eligible_pool(key_v, 1 << 16, "v")
    sizes = _page_units_from_blocks(pool_k, pool_v, zip_cfg, mc.layers, 4096, np.random.default_rng(seed))
  raw_pages = fill_until_refusal(raw_cfg, np.full((mc.layers, 1), raw_cfg.page_units))
  zip_pages = fill_until_refusal(zip_cfg, sizes)
  return {
      "model": f"{model} ({source})",
      "budget_bytes": budget,
      "tokens_uncompressed": raw_pages * PAGE_SIZE,
      "tokens_compressed": zip_pages * PAGE_SIZE,
      "capacity_ratio": round(zip_pages / raw_pages, 4),
  }


def _median_us(f, iterations):
  times = []
  for _ in range(iterations):
    t = time.perf_counter()
    f()
    times.append((time.perf_counter() - t) * 1e6)
  return statistics.median(times)


def allocator_overhead(batch: int = 64, context: int = 8192, steps: int = 200, seed: int = 0) -> dict:
  """Host allocator time and plan/readback transfer per decode step vs the step's attention reads."""
  mc = get_config("llama3.1-8b")
  new_tokens = 2 * steps + 16
  max_pages = -(-(context + new_tokens) // PAGE_SIZE)
  shape = dict(num_layers=mc.layers, num_kv_heads=mc.kv_heads, head_dim=mc.head_dim, num_slots=batch, max_pages=max_pages)
  chunk_pages = ServingConfig(num_chunks=mc.layers, **shape).chunk_pages
  cfg = ServingConfig(num_chunks=-(-batch * max_pages // chunk_pages) * mc.layers + mc.layers, **shape)
  rng = np.random.default_rng(seed)
  sizes = _page_units_from_blocks(np.array([True] * 9 + [False]), np.array([True] * 13 + [False]), cfg, mc.layers, 512, rng)
  alloc = ChunkAllocator(cfg)
  sched = Scheduler(cfg, alloc)
  for s in range(batch):  # 64 sequences near 8K, staggered so pages complete on different steps
    sched.submit(np.zeros(context - 64 + s, int), new_tokens)
    admitted = sched.admit()
    assert admitted is not None, "store too small for the benchmark batch"
    r, slot, placement = admitted
    alloc.commit(placement, sizes[:, rng.integers(0, 512, placement.num_pages)])
    sched.started(r, slot, placement, 0)
  readback = np.zeros((cfg.num_layers, cfg.plan_width), np.int32)
  tokens = np.zeros(batch, np.int32)

  def host_step():
    done, placement, _ = sched.plan_decode()
    plan = decode_plan(cfg, {s: r.length for s, r in sched.running.items()}, [r.slot for r in done], placement)
    check_plan(cfg, plan)
    n = len(done)  # the device writes the completed pages' units to the first n columns
    readback[:, :n] = sizes[:, rng.integers(0, 512, n)]
    alloc.commit(placement, readback)
    sched.decoded(done, placement, tokens)
    return plan

  host_us = _median_us(host_step, steps)
  plan = host_step()
  dev_readback = jnp.zeros((cfg.num_layers, cfg.plan_width), jnp.int32)
  transfer_us = _median_us(lambda: (jax.block_until_ready(jax.device_put(plan)), jax.device_get(dev_readback)), 50)
  attention_us = _attention_reads_us(batch, context, mc)
  write_us = _kv_write_us(cfg, plan)
  return {
      "model": "llama3.1-8b shapes",
      "batch": batch,
      "context": context,
      "device": str(jax.devices()[0].device_kind),
      "host_scheduler_and_allocator_us": round(host_us, 1),
      "plan_upload_and_readback_us": round(transfer_us, 1),
      "decode_attention_reads_us": round(attention_us, 1),
      "kv_append_and_compress_us": round(write_us, 1),
      "overhead_fraction": round((host_us + transfer_us) / attention_us, 4),
      "target_fraction": 0.03,
  }


def _attention_reads_us(batch, context, mc) -> float:
  """Device time of one decode step's attention over BF16 KV: one layer (XLA dense attention) x layers."""
  shape = (batch, context, mc.kv_heads, mc.head_dim)
  k = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
  v = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
  q = jax.random.normal(jax.random.key(3), (batch, 1, mc.q_heads, mc.head_dim), jnp.bfloat16)
  layer = jax.jit(jax.nn.dot_product_attention)
  jax.block_until_ready(layer(q, k, v))
  return mc.layers * _median_us(lambda: jax.block_until_ready(layer(q, k, v)), 20)


def _kv_write_us(cfg: ServingConfig, plan) -> float:
  """Device time of one decode step's KV writes, all layers: tails, and completed pages encoded and placed."""
  from zipfusion_jax.serving.backend import PagedBackend
  from zipfusion_jax.serving.state import init_state

  backend = PagedBackend(cfg, encoder="pallas" if jax.default_backend() == "gpu" else "reference")
  state = init_state(cfg)
  k = jax.random.normal(jax.random.key(4), (cfg.num_slots, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)

  @functools.partial(jax.jit, donate_argnums=0)
  def write(state, plan, k):
    for layer in range(cfg.num_layers):
      state = backend.append_layer(state, layer, plan, k, k)
    return backend.end_step(state, plan)

  plan = jax.device_put(plan)
  state = jax.block_until_ready(write(state, plan, k))
  times = []
  for _ in range(20):
    t = time.perf_counter()
    state = jax.block_until_ready(write(state, plan, k))
    times.append((time.perf_counter() - t) * 1e6)
  return statistics.median(times)


def admitted_sequences(model: str, system: str, context: int, budget_gib: float = 48.0, eligible: float = 0.952,
                       new_tokens: int = 256 + 2 * PAGE_SIZE + 2, chunk_pages: int | None = None, seed: int = 0) -> dict:
  """How many `context`-token requests e2e's engine admits into `system`'s store (host simulation).

  Page sizes: each block compressed (3 units) with probability `eligible`, else raw (4); BF16
  pages are raw. `chunk_pages` None: e2e's own choice (`generate.chunk_pages_for`).
  """
  from benchmarks import e2e  # the store e2e builds (imported here: e2e pulls in the model stack)

  config = get_config(model)
  offered = e2e.offered_slots(context, 512)
  cfg = e2e.backend_for(config, system, offered, context + new_tokens, int(budget_gib * 2**30), chunk_pages).cfg
  rng = np.random.default_rng(seed)
  alloc = ChunkAllocator(cfg, 1.0)
  sched = Scheduler(cfg, alloc)

  def units(n):  # int [L, n]
    if not cfg.compressed:
      return np.full((cfg.num_layers, n), cfg.page_units)
    blocks = rng.random((cfg.num_layers, n, cfg.groups_per_page * cfg.blocks_per_page)) < eligible
    return np.where(blocks, B.COMPRESSED_UNITS, B.RAW_UNITS).sum(axis=2)

  def run(req, slot, placement):
    alloc.commit(placement, units(placement.num_pages))
    sched.started(req, slot, placement, 0)

  sched.submit([1] * (PAGE_SIZE + 1), 2)  # e2e's warm-up request, finished before the load
  warm = sched.admit()
  run(*warm)
  sched._finish(warm[0])
  for _ in range(offered):
    sched.submit([1] * context, new_tokens)
  admitted = 0
  while (next_one := sched.admit()) is not None:
    run(*next_one)
    admitted += 1
  return {"model": model, "context": context, "budget_gib": budget_gib, "system": system,
          "eligible": eligible if cfg.compressed else None, "chunk_pages": cfg.chunk_pages, "admitted": admitted,
          "stranded_gib": alloc.capacity().stranded_bytes / 2**30}


def admission_table() -> list[dict]:
  """e2e's largest batches (Llama-3.1-8B, 48 GiB) at 16-page chunks and at the automatic size."""
  rows = []
  for context in (2048, 8192, 32768):
    for chunk_pages in (16, None):
      for system, eligible in (("uncompressed", 1.0), ("zipfusion", 0.952), ("zipfusion_v2", 0.999), ("zipfusion", 0.90)):
        rows.append(admitted_sequences("llama3.1-8b", system, context, eligible=eligible, chunk_pages=chunk_pages))
        r = rows[-1]
        print(f"{context:6d} {r['chunk_pages']:3d} pages/chunk {system:13s} eligible {eligible:.3f}: "
              f"{r['admitted']:4d} admitted, {r['stranded_gib']:.2f} GiB stranded", flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--budget-gib", type=float, default=4.0)
  parser.add_argument("--overhead", action="store_true", help="measure the allocator step overhead instead")
  parser.add_argument("--admission", action="store_true", help="e2e's largest batches by host simulation instead")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--context", type=int, default=8192)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--real-kv-tokens", type=int, default=2048, help="SmolLM2 prefill length for real K/V")
  args = parser.parse_args(argv)
  if args.overhead:
    result = allocator_overhead(args.batch, args.context)
    out = args.out or pathlib.Path("benchmarks/results/allocator_overhead.json")
  elif args.admission:
    result = admission_table()
    out = args.out or pathlib.Path("benchmarks/results/admission.json")
  else:
    budget = int(args.budget_gib * (1 << 30))
    result = [capacity_entry(m, budget, real_kv_tokens=args.real_kv_tokens) for m in ("smollm2-135m", "llama3.1-8b")]
    out = args.out or pathlib.Path("benchmarks/results/capacity.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()

"""Decode attention over ragged batches: the grid schedule against the balanced one (one device call).

  python -m benchmarks.ragged [--mixes one_long,uniform,equal_32x2048,equal_8x8192] [--items N]
      [--check-plans] [--out FILE]
  python -m benchmarks.ragged --plan [--mixes ...]   # no kernel: each schedule's items (any machine)

Llama-3.1-8B attention shapes (32 q / 8 KV heads, D = 128, page 16), K/V from
`benchmarks.attention.problem`'s generator at realistic eligibility. Per length mix, the fused
kernel on the 12-bit store (format 1) and on BF16 pages, each under its default config
(`default_config`: the grid schedule, splits from the slot count and `max_pages`) and under the
same config with `schedule="balanced"` (work items planned from the lengths on the device;
`balanced_host`: planned on the host beforehand, `host_work_items`; `balanced_fit`: the host's
table cut to the rows in use, `fit_rows=True`), all timed in the same run
(CUPTI kernel time, median of 10: the device plan's few small jnp ops included).
Every output is checked against the jnp reference first (`attention.BF16_TOL`, as for
`benchmarks.attention`'s rows on the same generator). Mixes:

* `one_long`: one 32K-token sequence among 31 of 1K (a long request in a chat batch);
* `uniform`: 32 sequences of 1..8192 tokens, uniformly drawn (seed 0);
* `equal_32x2048`, `equal_8x8192`: the issue-4 target shapes, where both schedules make the
  same items (the balanced grid carries the unused ones: its overhead).

Writes {"device", "jax", "date", "rows": [{"mix", "kernel", "schedule", "batch", "max_length",
"tokens", "time_us", "bytes_read", "max_error", "splits" (the grid schedule's; unused by the balanced one),
"kernels" (each kernel's time in the last iteration: the attention kernel, the plan, the combine)}]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import zipfusion_jax as zf
from benchmarks.attention import BF16_TOL, synthetic_kv  # the same generator, so its tolerance
from benchmarks.compress import cupti_us
from models.configs import get_config
from pallas_kernels.decode_attention import (DecodeConfig, _device_plan, _work_items, decode_attention_pallas,
                                             default_config, heuristic_config, host_work_items)


MIXES = {
    "one_long": lambda rng: np.array([32768] + [1024] * 31),
    "uniform": lambda rng: rng.integers(1, 8193, size=32),
    "equal_32x2048": lambda rng: np.full(32, 2048),
    "equal_8x8192": lambda rng: np.full(8, 8192),
    "smoke": lambda rng: np.array([300, 20, 0]),  # CPU smoke test (interpreted kernel, tiny model)
}


SCHEDULES = ("grid", "balanced", "balanced_host", "balanced_fit")


def ragged_problem(key, cfg, lengths):
  """q, both caches (12-bit format 1, BF16 pages) and their stored bytes for `lengths`."""
  batch, seq = len(lengths), -(-int(lengths.max()) // 16) * 16  # whole pages: the generator fills pages
  k, v = synthetic_kv(key, batch, seq, cfg.kv_heads, cfg.head_dim)  # the format's blocks at real-KV eligibility
  q = jax.random.normal(jax.random.fold_in(key, 2), (batch, cfg.q_heads, cfg.head_dim), jnp.bfloat16)
  comp = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  plain = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  used_pages = int(np.sum(lengths // 16))  # completed pages each store holds for the sequences
  page_bytes = 2 * cfg.kv_heads * 16 * cfg.head_dim * 2  # K + V, BF16
  tail_bytes = 2 * int(np.count_nonzero(lengths % 16)) * cfg.kv_heads * 16 * cfg.head_dim * 2  # tails the kernel reads
  comp_bytes = comp.arena.size + comp.group_meta.size * 4 + tail_bytes  # arena is sized to the pages
  return q, comp, plain, dict(compressed=comp_bytes, uncompressed=used_pages * page_bytes + tail_bytes)


def _us(kernel: str) -> float:
  """The µs of one `cupti_us` breakdown entry ("name: 12.3 us"); 0 for a CPU run's marker."""
  try:
    return float(kernel.rsplit(": ", 1)[1].split()[0])
  except (IndexError, ValueError):
    return 0.0


def run_mix(name, lengths, cfg, key, items=0):
  q, comp, plain, nbytes = ragged_problem(key, cfg, lengths)
  scale = 1.0 / np.sqrt(cfg.head_dim)
  ref = zf.paged_decode_attention(q, plain, impl="reference").astype(jnp.float32)
  rows = []
  for path, cache in (("zipfusion_compressed", comp), ("zipfusion_uncompressed", plain)):
    for schedule in SCHEDULES:
      c = dataclasses.replace(default_config(cache, schedule.split("_")[0]),
                              items=items if schedule != "grid" else 0)
      # balanced_host: the items planned on the host beforehand (as a serving engine would), so
      # only the kernel and the combine run on the GPU; balanced_fit: the same table cut to the
      # used rows (`fit_rows`), so no unused row launches a CTA
      work = (tuple(map(jnp.asarray, host_work_items(lengths, cfg.kv_heads, cache.max_pages, c,
                                                     fit_rows=schedule == "balanced_fit")))
              if schedule in ("balanced_host", "balanced_fit") else None)
      f = jax.jit(lambda q, cache, work, c=c: decode_attention_pallas(q, cache, scale, config=c, work=work))
      err = float(jnp.max(jnp.abs(f(q, cache, work).astype(jnp.float32) - ref)))
      if not err <= BF16_TOL:
        raise AssertionError(f"{name} {path} {schedule}: max error {err} > {BF16_TOL}")
      t, kernels = cupti_us(f, q, cache, work)  # kernels: the last iteration's per-kernel times (plan, kernel, combine)
      kind = path.split("_")[1]
      rows.append(dict(mix=name, kernel=path, schedule=schedule, batch=len(lengths), max_length=int(lengths.max()),
                       tokens=int(lengths.sum()), time_us=t, bytes_read=int(nbytes[kind]), max_error=err,
                       splits=c.splits, kernels=kernels))
      print(f"{name:14s} {path:23s} {schedule:8s} splits={c.splits:2d} {t:9.1f} us "
            f"{nbytes[kind] / t / 1e6:5.2f} TB/s  err {err:.1e}  ({len(kernels)} kernels, the largest {max(kernels, key=_us, default='')[:60]};"
            f" the rest {t - max(map(_us, kernels), default=0):.1f} us)", flush=True)
  return rows


def plan_rows(name, lengths, cfg, items=0):
  """What each schedule asks of the GPU for `lengths` (no kernel runs): CTAs and the pages of the
  longest one, which bounds the kernel once the other CTAs are done."""
  pages = -(-lengths // 16)
  rows = []
  for schedule in ("grid", "balanced"):
    c = dataclasses.replace(heuristic_config(len(lengths), cfg.kv_heads, int(pages.max()), True, schedule=schedule),
                            items=items if schedule == "balanced" else 0)
    work, _ = _work_items(jnp.asarray(lengths), cfg.kv_heads, int(pages.max()), c)
    work = np.asarray(work)
    b, first, end = work[work[:, 0] >= 0].T
    per = np.maximum(np.minimum(end, pages[b]) - first, 0)
    rows.append(dict(mix=name, schedule=schedule, batch=len(lengths), pages=int(pages.sum()),
                     grid_items=int(work.shape[0]), ctas=int(cfg.kv_heads * len(b)),
                     max_pages_per_cta=int(per.max(initial=0)), mean_pages_per_cta=float(per[per > 0].mean())))
    r = rows[-1]
    print(f"{name:14s} {schedule:8s} CTAs {r['ctas']:4d} (grid {cfg.kv_heads} x {r['grid_items']:3d})  "
          f"longest CTA {r['max_pages_per_cta']:5d} pages  mean {r['mean_pages_per_cta']:7.1f}", flush=True)
  return rows


def check_device_plans(trials: int = 28, seed: int = 0) -> list[dict]:
  """The device plan (`plan_items`, compiled where jax runs: the GPU) against `host_work_items` over
  random ragged batches (B 1..4097, ~20% empty, item budgets, KV heads and consumer counts drawn);
  raises on the first table or `seq_first` that differs. Rows: {"batch", "kv_heads", "max_pages",
  "items", "consumers", "equal"}."""
  rng, rows = np.random.default_rng(seed), []
  on_cpu = jax.default_backend() != "gpu"  # interpreted there (slow: a test-sized smoke run only)
  for trial in range(trials):
    batch = int(rng.choice([1, 2, 3, 7, 8, 37, 64, 65, 128, 129, 300, 1000, 4097]))
    max_pages, kv_heads = int(rng.integers(1, 8193)), int(rng.choice([1, 3, 8]))
    lengths = rng.integers(0, 16 * max_pages + 1, batch).astype(np.int32)
    lengths[rng.random(batch) < 0.2] = 0
    if trial == 0:
      lengths[:] = 0
    config = DecodeConfig(schedule="balanced", items=int(rng.choice([0, 1, 33])), consumers=int(rng.choice([1, 2])))
    table, seq_first = jax.device_get(_device_plan(jnp.asarray(lengths), kv_heads, max_pages, config, on_cpu))
    want_table, want_first = host_work_items(lengths, kv_heads, max_pages, config)
    equal = bool(np.array_equal(table[:, :3], want_table) and not table[:, 3].any()
                 and np.array_equal(seq_first, want_first))
    rows.append(dict(batch=batch, kv_heads=kv_heads, max_pages=max_pages, items=config.items,
                     consumers=config.consumers, equal=equal))
    if not equal:
      raise AssertionError(f"device plan differs from the host plan: {rows[-1]}")
  print(f"device plans: {trials} random batches equal to the host plans ({jax.devices()[0].device_kind})", flush=True)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mixes", default=",".join(MIXES))
  p.add_argument("--model", default="llama3.1-8b")
  p.add_argument("--items", type=int, default=0, help="balanced: work items per KV head (0: target_items)")
  p.add_argument("--plan", action="store_true", help="print each schedule's work items; no kernel runs")
  p.add_argument("--check-plans", action="store_true",
                 help="first compare the device plan's kernel with the host plan over random batches")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  cfg = get_config(a.model)
  if a.plan:
    return [row for name in a.mixes.split(",")
            for row in plan_rows(name, MIXES[name](np.random.default_rng(0)).astype(np.int32), cfg, a.items)]
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                model=a.model, rows=[])
  if a.check_plans:
    result["device_plan_checks"] = check_device_plans()
  for i, name in enumerate(a.mixes.split(",")):
    lengths = MIXES[name](np.random.default_rng(0)).astype(np.int32)
    result["rows"] += run_mix(name, lengths, cfg, jax.random.key(i), a.items)
    if a.out:  # after every mix: a killed call keeps what was measured
      pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
      pathlib.Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
  return result


if __name__ == "__main__":
  main()

"""End-to-end decode under one KV memory budget: ZipFusion vs uncompressed vs decompress-then-attend.

  python -m benchmarks.e2e [--models llama3.1-8b,qwen3-8b] [--contexts 2048,8192,32768]
      [--budget-gib 48[,whole] [--reserve-gib 8]] [--steps 256] [--warmup 32] [--max-slots 512] [--decomposition [--decomposition-shape 32x2048]]
      [--batch-curve 4x8] [--kv-stats random|real] [--decode-knobs '{"consumers": 2, "stages": 4}'] [--out benchmarks/results/e2e_h200.json]

Three systems, all this project's serving engine with random BF16 weights at the model's shapes:
`zipfusion` (12-bit store, fused kernel), `uncompressed` (BF16 store, the same kernel on BF16
pages) and `decompress_then_attend` (12-bit store; each layer's pages restored to a BF16 buffer
before the BF16 kernel; that buffer, `PagedBackend.decompress_buffer_bytes`, is taken out of the
budget); `--systems ...,zipfusion_v2` adds the 12-bit store in format version 2 (one exception
per block, docs/FORMAT.md §9) with the same fused kernel. Largest batch: the store is built from the budget, `--max-slots` requests of `context`
tokens are submitted, and the engine's own admission (capacity with every running request's
generation reserved, at the measured compression ratio) decides how many run; `is_max_batch` is
true when admission, not the slot count, was the limit. `--budget-gib whole` is the second setting
of the comparison: the whole device less the weights and `--reserve-gib` (rows say
`"budget_setting": "whole"` and the GiB it came to). Then `--steps` decode steps are timed
after `--warmup` (wall time per `Engine.step()`: host scheduler, plan, jitted step, readback); a
timed step that compiled (a completion width first seen after the warm-up) is a one-time cost,
listed in `compile_step_ms` and left out of `step_ms` / `decode_tokens_per_s` (sequences decoded per
second over the other timed steps).

Decomposition (`attention_ms`, `decompress_ms`): after the timed steps, on the same state, every
layer's attention alone (fused kernel, or the BF16 kernel on pre-restored pages) and every
layer's page restore alone are timed; the rest of the step is everything else.
`--decomposition` adds the motivating setting: batch 32, 2048-token prompts, no budget limit.

KV statistics (`--kv-stats`): `random` runs on the random model's own KV (~95% of blocks
eligible); `real` first plants outlier channels in the K / V projections
(`benchmarks/kv_outliers.py`) so the KV is at the embedded model's measured real-KV eligibility.

A system that runs out of device memory gets a row with an "error" and null figures, and the
run goes on. Rows: {"model", "system", "context", "batch" (running after admission), "batch_max" (the most a timed
step decoded: admission may add requests as the measured compression ratio frees room), "is_max_batch", "kv_budget_gib", "decode_tokens_per_s",
"step_ms", "step_ms_median", "compiles_in_timing", "compile_step_ms", "attention_ms", "decompress_ms",
"eligible_fraction", "kv_statistics", "decode_knobs", "new_tokens" (generation reserved per request:
warm-up, timed and curve steps), "batch_curve" (tokens/s at 3/4, 1/2, 1/4 of "batch_curve_from", the
batch running after the timed steps, by default: `--batch-curve`; its 24 steps are reserved at
admission too), "phase_s" (wall seconds of compile, admit, warmup_steps, timed_steps,
decomposition, batch_curve)}.
`--decode-knobs` sets fused-kernel knobs over its heuristic config (`PagedBackend.decode_knobs`) for
every system, decompress-then-attend's BF16 kernel included.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import statistics
import time

# The budgeted stores plus 8B weights need more than XLA's default 75% of the GPU: let it take 95%
# (set before jax starts its backend; no effect where it already started, as in the tests).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.compress import cupti_us
from benchmarks.generate import save_result
from benchmarks.kv_outliers import real_kv_params
from models.configs import get_config
from models.params import random_params
from zipfusion_jax.generate import budget_pages_per_layer, chunk_pages_for, eligible_block_fraction, serving_config
from zipfusion_jax.paged.api import paged_decode_attention
from zipfusion_jax.paged.cache import restore_pages
from zipfusion_jax.serving.backend import PagedBackend
from zipfusion_jax.serving.engine import Engine
from zipfusion_jax.serving.model import ModelDecoder
from zipfusion_jax.serving.state import PAGE_SIZE, ServingConfig

SYSTEMS = {  # name -> (compressed store, attention, format version)
    "zipfusion": (True, "fused", 1),
    "uncompressed": (False, "fused", 1),
    "decompress_then_attend": (True, "decompress_then_attend", 1),
    "zipfusion_v2": (True, "fused", 2),  # format version 2 (one exception per block); not in the default list
}
DEFAULT_SYSTEMS = "zipfusion,uncompressed,decompress_then_attend"


def backend_for(config, system: str, slots: int, max_tokens: int, budget_bytes: int | None,
                chunk_pages: int | None = None, decode_knobs: tuple = ()) -> PagedBackend:
  """The system's backend; with a budget, the store fills it (less the decompression buffer).

  `chunk_pages` None: `generate.chunk_pages_for` the budget's raw pages per layer (or, without a
  budget, the slots' pages)."""
  compressed, attention, format_version = SYSTEMS[system]
  encoder = "pallas" if jax.default_backend() == "gpu" else "reference"
  if chunk_pages is None and budget_bytes is not None:
    chunk_pages = chunk_pages_for(budget_pages_per_layer(config, budget_bytes), compressed)
  cfg = serving_config(config, [max_tokens] * slots, 0, slots, compressed, chunk_pages=chunk_pages,
                       format_version=format_version)
  if budget_bytes is not None:
    shape = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("num_chunks", "num_page_ids")}
    def total(chunks):  # store + page metadata + the per-layer BF16 buffer (which grows with the page ids)
      c = ServingConfig(num_chunks=chunks, **shape)
      return c.store_bytes + c.metadata_bytes + PagedBackend(c, attention=attention).decompress_buffer_bytes

    lo, hi = cfg.num_layers, ServingConfig.from_budget(budget_bytes, **shape).num_chunks
    if total(lo) > budget_bytes:
      raise ValueError(f"{budget_bytes} bytes hold no store for {system}")
    while lo < hi:  # the largest chunk count whose total fits
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if total(mid) <= budget_bytes else (lo, mid - 1)
    cfg = ServingConfig(num_chunks=lo, **shape)
  return PagedBackend(cfg, encoder=encoder, attention=attention, decode_knobs=decode_knobs)


def layer_parts(engine: Engine, iterations: int = 5) -> tuple[float, float]:
  """(attention_ms, decompress_ms) of one decode step's layers, on the engine's current state.

  The fused systems: every layer's attention in one jit. Decompress-then-attend: layer by layer
  (restore, then attention on its BF16 pages, both timed), so that one layer's BF16 buffer is alive
  at a time, as in its decode step and its memory budget; all layers' buffers at once need not fit.
  Each of its per-layer calls (restore, attention) is the median of `iterations` CUPTI runs
  (every call starts a profiling session: 2 x num_layers calls of 10 were the slowest part of a run).
  """
  backend, state, cfg, config = engine.backend, engine.state, engine.cfg, engine.model.config
  q = jax.random.normal(jax.random.key(0), (cfg.num_slots, config.q_heads, config.head_dim), jnp.bfloat16)
  views = [backend.layer_view(state, l, state.lengths, state.page_table) for l in range(cfg.num_layers)]
  kwargs = backend.attention_kwargs()
  if backend.attention != "decompress_then_attend":
    attend = jax.jit(lambda q, vs: [paged_decode_attention(q, v, impl=backend.attention_impl, **kwargs) for v in vs])
    attention_us, _ = cupti_us(attend, q, views)
    return attention_us / 1e3, 0.0
  restore = jax.jit(restore_pages)
  attend = jax.jit(lambda q, v: paged_decode_attention(q, v, impl=backend.attention_impl, **kwargs))
  decompress_us = attention_us = 0.0
  for view in views:
    us, _ = cupti_us(restore, view, iterations=iterations)
    decompress_us += us
    k_pages, v_pages = restore(view)
    plain = view.replace(arena=None, group_meta=None, k_pages=k_pages, v_pages=v_pages, compressed=False)
    us, _ = cupti_us(attend, q, plain, iterations=iterations)
    attention_us += us
    del k_pages, v_pages, plain
  return attention_us / 1e3, decompress_us / 1e3


def admitted_engine(config, params, system: str, context: int, slots: int, new_tokens: int,
                    budget: int | None, decode_knobs: tuple = (), phases: dict | None = None) -> Engine:
  """The system's engine (compiled) after offering `slots` requests of `context` random tokens
  (`new_tokens` each) and one step: admitted until capacity (or the slots) refused, decoded once.
  `phases` (optional) receives the wall seconds of "compile" (store, warm-up of every decode
  width, prefill) and "admit" (the requests' prefills and the first decode step)."""
  t0 = time.perf_counter()
  backend = backend_for(config, system, slots, context + new_tokens, budget, decode_knobs=decode_knobs)
  engine = Engine(ModelDecoder(config), backend, params, max_prefills_per_step=slots)
  engine.warm_up()  # decode at every completion width and prefill, compiled on threads: no timed step compiles
  warm = engine.submit([1] * (PAGE_SIZE + 1), 2)  # one prefill and decode run before the clock
  engine.run()
  assert warm.done
  t1 = time.perf_counter()
  rng = np.random.default_rng(context)
  for _ in range(slots):
    engine.submit(rng.integers(0, config.vocab, context).tolist(), new_tokens)
  engine.step()
  if phases is not None:
    phases.update(compile=t1 - t0, admit=time.perf_counter() - t1)
  return engine


def batch_curve(engine: Engine, levels: int, steps_per_level: int) -> list[dict]:
  """Decode speed as the batch shrinks, on the running engine (no new compile: every completion
  width is compiled): the queue is cancelled so nothing more is admitted, then for each level
  k = levels - 1 .. 1 the running batch is cut to k / levels of its size (the highest slots
  cancelled) and `steps_per_level` steps are timed. Returns [{"batch", "decode_tokens_per_s",
  "step_ms_median"}] from the largest batch down (fractions of the batch running when called)."""
  sched = engine.scheduler
  for req in list(sched.waiting):
    engine.cancel(req)
  start = len(sched.running)
  points = []
  if not start:
    return points
  for k in range(levels - 1, 0, -1):
    keep = max(1, round(start * k / levels))
    for req in sorted(sched.running.values(), key=lambda r: r.slot)[keep:]:
      engine.cancel(req)
    timed = []
    for _ in range(steps_per_level):
      t0 = time.perf_counter()
      report = engine.step()
      timed.append((time.perf_counter() - t0, report.decoded))
    points.append(dict(batch=keep, decode_tokens_per_s=sum(n for _, n in timed) / sum(t for t, _ in timed),
                       step_ms_median=1e3 * statistics.median(t for t, _ in timed)))
  return points


def run_system(config, params, system: str, context: int, steps: int, warmup: int, slots: int,
               budget_gib: float | None, decode_knobs: tuple = (), curve: tuple[int, int] = (4, 8)) -> dict:
  """One system at one setting: admission, warm-up, `steps` timed steps at the largest batch, the
  decomposition, then `batch_curve(*curve)` (levels, steps per level; levels 0: none)."""
  levels, steps_per_level = curve
  curve_steps = (levels - 1) * steps_per_level if levels > 1 else 0
  # The prefill's token and the admitting step's decode come first; the curve's steps come last
  # (their tokens are reserved at admission like the rest: 24 more per request by default).
  new_tokens = warmup + steps + 2 + curve_steps
  budget = None if budget_gib is None else int(budget_gib * 2**30)
  phases = {}  # wall seconds of the run's parts: where a device call's time goes
  engine = admitted_engine(config, params, system, context, slots, new_tokens, budget, decode_knobs, phases)
  batch = len(engine.scheduler.running)
  t0 = time.perf_counter()
  for _ in range(warmup):
    engine.step()
  phases["warmup_steps"] = time.perf_counter() - t0
  steady, compile_steps = [], []  # (seconds, sequences decoded) per timed step
  t_timed = time.perf_counter()
  for _ in range(steps):
    compiled = sum(engine.traces.values())
    t0 = time.perf_counter()
    report = engine.step()
    dt = time.perf_counter() - t0
    # A step that traced (a completion width first seen after the warm-up, e.g. once a request
    # admitted later completes a page on its own) is a one-time compile, not serving speed: it is
    # reported on its own and left out of the steady-state figures.
    (compile_steps if sum(engine.traces.values()) > compiled else steady).append((dt, report.decoded))
  phases["timed_steps"] = time.perf_counter() - t_timed
  compiles_in_timing = len(compile_steps)
  if compiles_in_timing:
    print(f"note: {system}: {compiles_in_timing} timed step(s) compiled "
          f"({1e3 * sum(t for t, _ in compile_steps):.0f} ms); left out of the mean", flush=True)
  timed = steady or compile_steps  # every step compiled: no steady state to report apart
  times = [t for t, _ in timed]
  step_s = statistics.mean(times)
  tokens_per_s = sum(n for _, n in timed) / sum(times)  # sequences decoded, should admission add some
  t0 = time.perf_counter()
  attention_ms, decompress_ms = layer_parts(engine)
  phases["decomposition"] = time.perf_counter() - t0
  compressed = SYSTEMS[system][0]
  row = dict(
      model=config.name, system=system, context=context, batch=batch,
      is_max_batch=bool(engine.scheduler.waiting) and budget is not None, kv_budget_gib=budget_gib,
      decode_tokens_per_s=tokens_per_s, step_ms=1e3 * step_s, step_ms_median=1e3 * statistics.median(times),
      batch_max=max(n for _, n in timed),
      attention_ms=attention_ms, decompress_ms=decompress_ms,
      eligible_fraction=eligible_block_fraction(engine.cfg, engine.allocator) if compressed else None,
      kv_store_bytes=engine.cfg.store_bytes + engine.cfg.metadata_bytes,
      decompress_buffer_bytes=engine.backend.decompress_buffer_bytes, weights="random",
      compiles_in_timing=compiles_in_timing, compile_step_ms=[1e3 * t for t, _ in compile_steps],
      decode_knobs=dict(decode_knobs))
  row["new_tokens"] = new_tokens  # reserved per request at admission (the curve's steps included)
  row["batch_curve_from"] = len(engine.scheduler.running)  # the batch the curve's fractions are of
  t0 = time.perf_counter()  # last: it cancels requests (the row's queue and store figures come first)
  row["batch_curve"] = batch_curve(engine, levels, steps_per_level) if curve_steps else []
  phases["batch_curve"] = time.perf_counter() - t0
  row["phase_s"] = {k: round(v, 2) for k, v in phases.items()}
  # The engine and its jitted steps form a reference cycle: collect it now, or the next system's
  # store is allocated while this one's (the whole budget) is still alive.
  del engine
  gc.collect()
  return row


WHOLE = "whole"


def whole_device_budget_gib(reserve_gib: float, device=None) -> float:
  """The KV budget that fills the device: its memory limit less what is in use (the weights, on a
  fresh process) less `reserve_gib` for the decode step's working memory (activations, logits, XLA
  temporaries; decompress-then-attend's BF16 buffer is inside the budget, not the reserve)."""
  device = device or jax.devices()[0]
  stats = device.memory_stats()
  if not stats or "bytes_limit" not in stats:
    raise ValueError(f"--budget-gib {WHOLE} needs a device that reports its memory (a GPU); {device} does not")
  free = (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) / 2**30 - reserve_gib
  if free <= 0:
    raise ValueError(f"{device} has no memory left for KV after the weights and a {reserve_gib} GiB reserve")
  return free


def parse_budgets(text: str) -> list[float | str | None]:
  """`--budget-gib`: comma-separated GiB values and / or `whole` (the device less the weights)."""
  budgets = []
  for item in (t.strip() for t in text.split(",") if t.strip()):
    if item == WHOLE:
      budgets.append(WHOLE)
      continue
    try:
      value = float(item)
    except ValueError:
      raise ValueError(f"--budget-gib {item!r}: a number of GiB or {WHOLE!r}") from None
    if value <= 0:
      raise ValueError(f"--budget-gib {item!r} must be > 0")
    budgets.append(value)
  return budgets


def parse_batch_curve(text: str) -> tuple[int, int]:
  """`--batch-curve`: "LEVELSxSTEPS" (e.g. "4x8"), or "0" for none (argparse reports a ValueError
  as a usage error)."""
  if text.strip() == "0":
    return (0, 0)
  try:
    levels, steps = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise ValueError(f"--batch-curve {text!r}: LEVELSxSTEPS, e.g. 4x8, or 0") from None
  if levels < 2 or steps < 1:
    raise ValueError(f"--batch-curve {text!r}: at least 2 levels and 1 step per level")
  return levels, steps


def offered_slots(context: int, max_slots: int) -> int:
  """Requests offered at `context`: `max_slots`, capped so that the unbudgeted starting config
  (every slot at full length) stays inside the format's 30-bit unit offsets (~1.5M tokens)."""
  return max(1, min(max_slots, 3 * 2**19 // context))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="llama3.1-8b,qwen3-8b")
  p.add_argument("--contexts", default="2048,8192,32768")
  p.add_argument("--budget-gib", type=parse_budgets, default=[48.0],
                 help=f"KV budgets, comma-separated GiB and / or '{WHOLE}' (the device's memory less the weights "
                      "and --reserve-gib), e.g. 48,whole")
  p.add_argument("--reserve-gib", type=float, default=8.0,
                 help=f"with '{WHOLE}': device memory left to the decode step's working set")
  p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, of {', '.join(SYSTEMS)}")
  p.add_argument("--steps", type=int, default=256)
  p.add_argument("--warmup", type=int, default=2 * PAGE_SIZE,
                 help="untimed steps first: two page cycles, so every completion width a step needs is compiled")
  p.add_argument("--batch-curve", type=parse_batch_curve, default="4x8",
                 help="LEVELSxSTEPS: after the timed steps, tokens/s at (LEVELS-1)/LEVELS .. 1/LEVELS of the "
                      "largest batch, STEPS steps each (requests cancelled, no new compile); 0 for none")
  p.add_argument("--max-slots", type=int, default=512, help="requests offered (an upper bound on the batch)")
  p.add_argument("--decomposition", action="store_true", help="also the decomposition setting, no budget limit")
  p.add_argument("--decomposition-shape", default="32x2048", help="batch x prompt tokens of --decomposition")
  p.add_argument("--kv-stats", choices=("random", "real"), default="random",
                 help="real: plant outlier channels so the model's KV is at the embedded model's measured "
                      "eligibility (K 0.877, V 0.928; benchmarks/kv_outliers.py)")
  p.add_argument("--decode-knobs", type=json.loads, default={},
                 help='fused-kernel knobs over its heuristic config, JSON, e.g. \'{"consumers": 2, "stages": 4}\'')
  p.add_argument("--out", type=pathlib.Path, default=None)
  a = p.parse_args(argv)
  knobs = tuple(sorted(a.decode_knobs.items()))
  rows = []
  for name in a.models.split(","):
    config = get_config(name)
    params = None  # the previous model's weights go before this one's are made
    gc.collect()
    params = random_params(config, jax.random.key(0))
    planted = None
    if a.kv_stats == "real":
      params, planted = real_kv_params(params, config, jax.random.key(1))
      print(f"{name}: planted outlier channels, eligible K {planted.before['k']:.3f} -> {planted.after['k']:.3f}, "
            f"V {planted.before['v']:.3f} -> {planted.after['v']:.3f}", flush=True)
    budgets = [(whole_device_budget_gib(a.reserve_gib), WHOLE) if b == WHOLE else (b, "fixed") for b in a.budget_gib]
    settings = [(int(c), offered_slots(int(c), a.max_slots), gib, setting)
                for gib, setting in budgets for c in a.contexts.split(",") if c]
    if a.decomposition:
      batch, context = map(int, a.decomposition_shape.split("x"))
      settings.append((context, batch, None, None))
    for context, slots, budget, setting in settings:
      for system in a.systems.split(","):
        try:
          row = run_system(config, params, system, context, a.steps, a.warmup, slots, budget, knobs, a.batch_curve)
        except jax.errors.JaxRuntimeError as e:  # one system out of device memory must not end the run
          if "RESOURCE_EXHAUSTED" not in str(e):
            raise
          unmeasured = dict.fromkeys(("batch", "is_max_batch", "decode_tokens_per_s", "step_ms", "attention_ms",
                                      "decompress_ms", "eligible_fraction"))  # the fields, all present
          rows.append(dict(model=config.name, system=system, context=context, kv_budget_gib=budget, **unmeasured,
                           budget_setting=setting, error=f"out of device memory: {str(e)[:300]}"))
          print(f"{name:12s} {system:23s} S={context:6d} out of device memory", flush=True)
          gc.collect()
          save_result(a.out, rows)
          continue
        row["kv_statistics"] = a.kv_stats
        row["budget_setting"] = setting
        if planted is not None:
          row["planted_prompt_eligible"] = planted.after
        rows.append(row)
        print(f"{name:12s} {system:23s} S={context:6d} B={row['batch']:4d}{'*' if row['is_max_batch'] else ' '} "
              f"{row['decode_tokens_per_s']:9.1f} tok/s  step {row['step_ms']:8.2f} ms  attention "
              f"{row['attention_ms']:8.2f} ms  decompress {row['decompress_ms']:8.2f} ms  (wall s: "
              + " ".join(f"{k} {v:.0f}" for k, v in row.get("phase_s", {}).items()) + ")", flush=True)
        save_result(a.out, rows)  # after every row: a later failure keeps what was measured
  return save_result(a.out, rows)


if __name__ == "__main__":
  main()

"""End-to-end generation speed through the serving engine: compressed vs BF16 KV, same run.

  python -m benchmarks.generate [--models llama3.1-8b,qwen3-8b,smollm2-135m] [--batch 64]
      [--context 8192] [--lengths equal|uniform] [--schedules grid,balanced]
      [--kv compressed,uncompressed] [--decode-steps 16]
      [--out benchmarks/results/generate_h200.json]

Per model (random BF16 weights at the named shapes; the embedded SmolLM2's real weights need
the GGUF, which does not travel to the GPU machine, so it is random too) and per KV store:
`batch` requests with random prompts are admitted (one prefill each, all before the timed part),
then `decode-steps` engine steps each decode every slot. Prompt lengths: `equal` (`context`
tokens each) or `uniform` (drawn uniformly from 1..`context`, fixed seed): a ragged batch as a
server sees it. `--schedules` runs the fused kernel's work schedules side by side in the engine
(`grid`: the heuristic's split grid; `balanced`: (sequence, page range) items planned on the host
each step, `Engine.with_work`). Reported:
prefill tokens/s (all prompt tokens over the admission time), decode-step time (median wall
time of one `Engine.step()`, which includes the host scheduler, the plan upload and the small
readback) and decode tokens/s = batch / step time. Compile time is excluded (`Engine.warm_up`
compiles the prefill and every completion width's decode step first). Rows: {"model", "kv", "schedule", "batch", "context", "lengths",
"mean_prompt_tokens", "prefill_tokens_per_s", "decode_step_ms", "decode_tokens_per_s",
"kv_store_bytes", "compression_ratio"}.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import pathlib
import statistics
import time

import jax
import numpy as np

from models.configs import get_config
from models.params import random_params
from zipfusion_jax.serving.backend import PagedBackend
from zipfusion_jax.serving.engine import Engine
from zipfusion_jax.serving.model import ModelDecoder
from zipfusion_jax.generate import serving_config
from zipfusion_jax.jsonio import write_json_atomic


SCHEDULES = ("grid", "balanced")


def engine_for(config, params, batch: int, max_tokens: int, compressed: bool, chunk_pages: int = 32,
               tensor_parallel=None, schedule: str = "grid") -> Engine:
  """An engine whose store holds `batch` sequences of `max_tokens` at raw size (no admission waits);
  `schedule` "balanced" runs the fused kernel's balanced schedule, items planned on the host."""
  cfg = serving_config(config, [max_tokens] * batch, 0, batch, compressed, chunk_pages=chunk_pages)
  encoder = "pallas" if jax.default_backend() == "gpu" else "reference"
  knobs = () if schedule == "grid" else (("schedule", schedule),)
  return Engine(ModelDecoder(config), PagedBackend(cfg, encoder=encoder, decode_knobs=knobs), params,
                max_prefills_per_step=batch, tensor_parallel=tensor_parallel)


def prompt_lengths(batch: int, context: int, lengths: str, rng: np.random.Generator) -> list[int]:
  """Prompt tokens per request: all `context` ("equal") or uniform in 1..`context` ("uniform")."""
  if lengths == "equal":
    return [context] * batch
  if lengths == "uniform":
    return rng.integers(1, context + 1, batch).tolist()
  raise ValueError(f"lengths={lengths!r} must be 'equal' or 'uniform'")


def measure(engine: Engine, prompts: list[list[int]], decode_steps: int) -> dict:
  """Warm up (compile the prefill and the decode step at every completion width: a ragged batch
  completes pages a few slots at a time), admit every prompt in one step, then time
  `decode_steps` engine steps.

  Returns {"prefill_s", "step_s" (median), "tokens" (request 0's generated ids)}.
  """
  engine.warm_up()
  reqs = [engine.submit(p, decode_steps + 1) for p in prompts]
  t0 = time.perf_counter()
  engine.step()  # admits (prefills) every request, then the first decode
  prefill_s = time.perf_counter() - t0
  assert all(r.slot is not None or r.done for r in reqs), "not every request was admitted at once"
  times = []
  for _ in range(decode_steps):
    t0 = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t0)
  return dict(prefill_s=prefill_s, step_s=statistics.median(times), tokens=list(reqs[0].generated))


KV_STORES = ("compressed", "uncompressed")


def run_model(name: str, batch: int, context: int, decode_steps: int, seed: int = 0, lengths: str = "equal",
              schedules: tuple[str, ...] = ("grid",), kv_stores: tuple[str, ...] = KV_STORES) -> list[dict]:
  config = get_config(name)
  params = random_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, config.vocab, n).tolist() for n in prompt_lengths(batch, context, lengths, rng)]
  prompt_tokens = sum(map(len, prompts))
  rows = []
  for kv in kv_stores:
    for schedule in schedules:
      engine = engine_for(config, params, batch, context + decode_steps + 2, kv == "compressed", schedule=schedule)
      m = measure(engine, prompts, decode_steps)
      prefill_s, step = m["prefill_s"], m["step_s"]
      cfg, alloc = engine.cfg, engine.allocator
      rows.append(dict(
          model=name, kv=kv, schedule=schedule, batch=batch, context=context, lengths=lengths,
          mean_prompt_tokens=prompt_tokens / batch, prefill_tokens_per_s=prompt_tokens / prefill_s,
          decode_step_ms=1e3 * step, decode_tokens_per_s=batch / step,
          kv_store_bytes=cfg.store_bytes + cfg.metadata_bytes,
          compression_ratio=alloc.ratio if alloc.measured_pages else None, weights="random"))
      print(f"{name:14s} kv={kv:12s} {schedule:8s} B={batch} S={context} ({lengths}): prefill "
            f"{rows[-1]['prefill_tokens_per_s']:9.0f} tok/s, decode step {rows[-1]['decode_step_ms']:8.2f} ms = "
            f"{rows[-1]['decode_tokens_per_s']:8.1f} tok/s", flush=True)
      # The engine and its jitted steps form a reference cycle: collect it now, or the next store is
      # allocated while this one is alive (H100, B = 32 at 8K: two 32 GiB stores ran out of memory).
      del engine
      gc.collect()
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="llama3.1-8b,qwen3-8b,smollm2-135m")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--context", type=int, default=8192)
  p.add_argument("--lengths", choices=("equal", "uniform"), default="equal",
                 help="prompt lengths: all --context, or uniform in 1..--context (a ragged batch)")
  p.add_argument("--schedules", default="grid", help=f"comma-separated fused-kernel schedules, of {', '.join(SCHEDULES)}")
  p.add_argument("--kv", default=",".join(KV_STORES), help=f"comma-separated KV stores, of {', '.join(KV_STORES)}")
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--out", type=pathlib.Path, default=None)
  a = p.parse_args(argv)
  schedules, kv_stores = (tuple(dict.fromkeys(x.split(","))) for x in (a.schedules, a.kv))  # each once, in order
  if unknown := set(kv_stores) - set(KV_STORES):
    p.error(f"--kv: unknown {sorted(unknown)}; choose from {', '.join(KV_STORES)}")
  if unknown := set(schedules) - set(SCHEDULES):
    p.error(f"--schedules: unknown {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
  if schedules != ("grid",) and jax.default_backend() != "gpu":
    p.error("--schedules other than grid need a GPU: off it the engine attends with the jnp reference, "
            "which has no schedules (the interpreted kernel cannot run inside the jitted step)")
  rows = [r for m in a.models.split(",")
          for r in run_model(m, a.batch, a.context, a.decode_steps, lengths=a.lengths, schedules=schedules,
                             kv_stores=kv_stores)]
  return save_result(a.out, rows)


def save_result(out: pathlib.Path | None, rows: list[dict], **extra) -> dict:
  """{"device", "jax", "date", "rows", **extra}, written to `out` (when given) in one piece."""
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                rows=rows, **extra)
  if out:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(str(out), result)
  return result


if __name__ == "__main__":
  main()

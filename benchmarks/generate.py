"""End-to-end generation speed through the serving engine: compressed vs BF16 KV, same run.

  python -m benchmarks.generate [--models llama3.1-8b,qwen3-8b,smollm2-135m] [--batch 64]
      [--context 8192] [--decode-steps 16] [--out benchmarks/results/generate_h200.json]

Per model (random BF16 weights at the named shapes; the embedded SmolLM2's real weights need
the GGUF, which does not travel to the GPU machine, so it is random too) and per KV store:
`batch` requests with random prompts of `context` tokens are admitted (one prefill each, all
before the timed part), then `decode-steps` engine steps each decode every slot. Reported:
prefill tokens/s (all prompt tokens over the admission time), decode-step time (median wall
time of one `Engine.step()`, which includes the host scheduler, the plan upload and the small
readback) and decode tokens/s = batch / step time. Compile time is excluded (one warm-up
request runs first). Rows: {"model", "kv", "batch", "context", "prefill_tokens_per_s",
"decode_step_ms", "decode_tokens_per_s", "kv_store_bytes", "compression_ratio"}.
"""

from __future__ import annotations

import argparse
import datetime
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
from zipfusion_jax.serving.state import PAGE_SIZE


def engine_for(config, params, batch: int, max_tokens: int, compressed: bool, chunk_pages: int = 32,
               tensor_parallel=None) -> Engine:
  """An engine whose store holds `batch` sequences of `max_tokens` at raw size (no admission waits)."""
  cfg = serving_config(config, [max_tokens] * batch, 0, batch, compressed, chunk_pages=chunk_pages)
  encoder = "pallas" if jax.default_backend() == "gpu" else "reference"
  return Engine(ModelDecoder(config), PagedBackend(cfg, encoder=encoder), params, max_prefills_per_step=batch,
                tensor_parallel=tensor_parallel)


def measure(engine: Engine, prompts: list[list[int]], decode_steps: int) -> dict:
  """Warm up (compile), admit every prompt in one step, then time `decode_steps` engine steps.

  Returns {"prefill_s", "step_s" (median), "tokens" (request 0's generated ids)}.
  """
  warm = engine.submit(prompts[0][:PAGE_SIZE + 1], 2)  # compiles prefill and decode
  engine.run()
  assert warm.done
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


def run_model(name: str, batch: int, context: int, decode_steps: int, seed: int = 0) -> list[dict]:
  config = get_config(name)
  params = random_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, config.vocab, context).tolist() for _ in range(batch)]
  rows = []
  for kv in ("compressed", "uncompressed"):
    engine = engine_for(config, params, batch, context + decode_steps + 2, kv == "compressed")
    m = measure(engine, prompts, decode_steps)
    prefill_s, step = m["prefill_s"], m["step_s"]
    cfg, alloc = engine.cfg, engine.allocator
    rows.append(dict(
        model=name, kv=kv, batch=batch, context=context, prefill_tokens_per_s=batch * context / prefill_s,
        decode_step_ms=1e3 * step, decode_tokens_per_s=batch / step, kv_store_bytes=cfg.store_bytes + cfg.metadata_bytes,
        compression_ratio=alloc.ratio if alloc.measured_pages else None, weights="random"))
    print(f"{name:14s} kv={kv:12s} B={batch} S={context}: prefill {rows[-1]['prefill_tokens_per_s']:9.0f} tok/s, "
          f"decode step {rows[-1]['decode_step_ms']:8.2f} ms = {rows[-1]['decode_tokens_per_s']:8.1f} tok/s", flush=True)
    del engine  # free this store before the next one is allocated
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="llama3.1-8b,qwen3-8b,smollm2-135m")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--context", type=int, default=8192)
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--out", type=pathlib.Path, default=None)
  a = p.parse_args(argv)
  rows = [r for m in a.models.split(",") for r in run_model(m, a.batch, a.context, a.decode_steps)]
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

"""Tensor-parallel decode throughput: the serving engine sharded over 1, 2, 4, 8 devices, same run.

  python -m benchmarks.tp [--tp 1,2,4,8] [--model llama3.1-8b] [--batch 32] [--context 8192]
      [--decode-steps 16] [--out benchmarks/results/tp_h200.json]

Per tp degree (those the machine has devices for; others are reported as skipped) and per KV store
(`zipfusion` = compressed, `uncompressed` = BF16 pages, same kernel): random BF16 weights at the
model's shapes sharded by `serving.tensor_parallel`, `batch` random prompts of `context` tokens
admitted before timing, then the median wall time of `decode-steps` engine steps. Request 0's
tokens must be identical at every tp degree (checked; reported as `tokens_identical_across_tp`).
Rows: {"tp", "sharded", "system", "batch", "context", "decode_tokens_per_s", "decode_step_ms"}; tp = 1
runs twice, as the plain engine and as the sharded engine on a 1-device mesh (`sharded`), so the
cost of the `shard_map` path itself is visible. On one GPU this is the tp = 1 point; the multi-GPU
run needs a machine with several.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np

from benchmarks.generate import engine_for, measure, save_result
from models.configs import get_config
from models.params import random_params
from zipfusion_jax.serving.tensor_parallel import TensorParallel

SYSTEMS = {"zipfusion": True, "uncompressed": False}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tp", default="1,2,4,8")
  p.add_argument("--model", default="llama3.1-8b")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--context", type=int, default=8192)
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--systems", default="zipfusion,uncompressed")
  p.add_argument("--out", type=pathlib.Path, default=None)
  a = p.parse_args(argv)
  config = get_config(a.model)
  params = random_params(config, jax.random.key(0))
  prompts = [np.random.default_rng(i).integers(0, config.vocab, a.context).tolist() for i in range(a.batch)]
  rows, skipped, tokens = [], [], {}
  runs = []
  for n in map(int, a.tp.split(",")):
    if n > len(jax.devices()) or config.kv_heads % n:
      skipped.append(dict(tp=n, reason=f"{len(jax.devices())} devices, {config.kv_heads} KV heads"))
      continue
    runs += [(1, False), (1, True)] if n == 1 else [(n, True)]  # tp = 1: the plain engine and a 1-device mesh
  for n, sharded in runs:
    tp = TensorParallel.create(n) if sharded else None
    for system in a.systems.split(","):
      engine = engine_for(config, params, a.batch, a.context + a.decode_steps + 2, SYSTEMS[system], tensor_parallel=tp)
      m = measure(engine, prompts, a.decode_steps)
      del engine
      tokens[(n, sharded, system)] = m["tokens"]
      rows.append(dict(tp=n, sharded=sharded, system=system, batch=a.batch, context=a.context,
                       decode_tokens_per_s=a.batch / m["step_s"], decode_step_ms=1e3 * m["step_s"], model=a.model,
                       weights="random"))
      print(f"tp={n} {'shard_map' if sharded else 'plain':9s} {system:12s} B={a.batch} S={a.context}: step "
            f"{rows[-1]['decode_step_ms']:8.2f} ms = {rows[-1]['decode_tokens_per_s']:8.1f} tok/s", flush=True)
  identical = all(t == next(iter(tokens.values())) for t in tokens.values())
  print(f"tokens identical across tp and systems: {identical}; skipped: {skipped}", flush=True)
  return save_result(a.out, rows, devices=len(jax.devices()), skipped=skipped, tokens_identical_across_tp=identical)


if __name__ == "__main__":
  main()

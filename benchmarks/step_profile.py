"""Where one engine decode step spends its GPU time: per-kernel CUPTI times, grouped, for each system.

  python -m benchmarks.step_profile [--model llama3.1-8b] [--batch 32] [--context 2048]
      [--systems zipfusion,uncompressed] [--top 15] [--out benchmarks/results/step_profile_h200.json]

Builds the e2e benchmark's engine (`benchmarks.e2e`, no budget: `batch` requests of `context`
random tokens, random weights), admits them, and on the next decode step profiles the compiled
step once more without donating the state (so the step itself still runs). Kernel names are
grouped by their stem (digits and suffixes dropped) and the top groups printed with their share
of the step, which says what "everything else" in the e2e decomposition is made of. On CPU there
is no CUPTI: the step's wall time only.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

import jax

from benchmarks.e2e import SYSTEMS, admitted_engine
from benchmarks.generate import save_result
from models.configs import get_config
from models.params import random_params
from zipfusion_jax.serving.engine import Engine


def kernel_stem(name: str) -> str:
  """'loop_add_fusion_12' -> 'loop_add_fusion'; 'input_scatter_fusion.3' -> 'input_scatter_fusion'."""
  return re.sub(r"([._]\d+)+$", "", name.split("(")[0])


def profile_step(engine: Engine) -> tuple[float, list[tuple[str, float]]]:
  """(total µs, [(kernel name, µs)]) of the next decode step (wall time and no kernels on CPU)."""
  undonated = jax.jit(engine._decode_fn)
  captured = {}
  real = engine._decode

  def probe(*args):
    if not captured:
      captured["args"] = args
      if jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        jax.block_until_ready(undonated(*args))  # compile outside the measurement
        _, timings = profiler.measure(undonated, aggregate=False)(*args)
        captured["kernels"] = [(name, ms * 1e3) for name, ms in timings]
      else:
        from benchmarks.compress import wall_us

        captured["kernels"] = [("wall", wall_us(undonated, *args, iterations=2))]
    return real(*args)

  engine._decode = probe
  engine.step()
  engine._decode = real
  kernels = captured["kernels"]
  return sum(us for _, us in kernels), kernels


def run(config, params, system: str, batch: int, context: int) -> dict:
  engine = admitted_engine(config, params, system, context, batch, new_tokens=4, budget=None)
  total, kernels = profile_step(engine)
  groups = collections.defaultdict(lambda: [0.0, 0])
  for name, us in kernels:
    g = groups[kernel_stem(name)]
    g[0] += us
    g[1] += 1
  ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
  return dict(model=config.name, system=system, batch=batch, context=context, step_kernel_us=total,
              kernels=len(kernels), groups=[dict(stem=k, us=v[0], count=v[1]) for k, v in ranked])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="llama3.1-8b")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--systems", default="zipfusion,uncompressed")
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--out", type=pathlib.Path, default=None)
  a = p.parse_args(argv)
  config = get_config(a.model)
  params = random_params(config, jax.random.key(0))
  rows = []
  for system in a.systems.split(","):
    if system not in SYSTEMS:
      raise SystemExit(f"unknown system {system!r}; known: {sorted(SYSTEMS)}")
    row = run(config, params, system, a.batch, a.context)
    rows.append(row)
    print(f"{a.model} {system} B={a.batch} S={a.context}: {row['step_kernel_us'] / 1e3:.2f} ms in {row['kernels']} kernels")
    for g in row["groups"][: a.top]:
      print(f"  {g['us'] / 1e3:8.3f} ms {100 * g['us'] / row['step_kernel_us']:5.1f}%  x{g['count']:<5d} {g['stem'][:90]}")
  return save_result(a.out, rows)


if __name__ == "__main__":
  main()

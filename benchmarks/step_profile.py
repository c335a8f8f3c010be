"""Where one engine decode step spends its GPU time: per-kernel CUPTI times, grouped, for each system.

  python -m benchmarks.step_profile [--model llama3.1-8b] [--batch 32] [--context 2048]
      [--systems zipfusion,uncompressed] [--top 15] [--out benchmarks/results/step_profile_h200.json]

Builds the e2e benchmark's engine (`benchmarks.e2e`, no budget: `batch` requests of `context`
random tokens, random weights), admits them, decodes once more (nothing left to compile), then
profiles the next real `Engine.step()`: CUPTI kernel times and the step's wall time in the same
call, so `step_wall_us - step_kernel_us` is host work (scheduler, plan, dispatch, readback) plus
GPU idle. Kernel names are grouped by their stem (digits and suffixes dropped) and the top groups
printed with their share of the kernel time, which says what "everything else" in the e2e
decomposition is made of. On CPU there is no CUPTI: the step's wall time only.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import re
import time

import jax

from benchmarks.e2e import SYSTEMS, admitted_engine
from benchmarks.generate import save_result
from models.configs import get_config
from models.params import random_params
from zipfusion_jax.serving.engine import Engine


def narrow(config):
  """The model's layer count and head_dim with near-zero widths (hidden 256, 4 q / 1 KV heads,
  MLP 512, vocab 512): a step whose kernels do almost no work, so its wall time is the
  per-step cost of the engine, the runtime and the kernel launches alone."""
  return dataclasses.replace(config, hidden=256, intermediate=512, vocab=512, q_heads=4, kv_heads=1)


def kernel_stem(name: str) -> str:
  """'loop_add_fusion_12' -> 'loop_add_fusion'; 'input_scatter_fusion.3' -> 'input_scatter_fusion'."""
  return re.sub(r"([._]\d+)+$", "", name.split("(")[0])


def profile_step(engine: Engine) -> tuple[float, float, list[tuple[str, float]]]:
  """(wall µs, kernel µs, [(kernel name, µs)]) of the engine's next real step: donated state,
  host scheduling and readback included, so wall - kernels is host work plus GPU idle time.

  On the GPU the kernels come from CUPTI around `Engine.step()` itself (the private extension
  `jax.experimental.mosaic.gpu.profiler.measure` wraps; `measure` would re-run a jitted function
  twice, and an undonated step copies the whole store). On CPU: the wall time only.
  """
  if jax.default_backend() != "gpu":
    t0 = time.perf_counter()
    engine.step()
    wall = 1e6 * (time.perf_counter() - t0)
    return wall, wall, [("wall", wall)]
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

  ext = mosaic_gpu_lib._mosaic_gpu_ext
  ext._cupti_init()
  try:
    t0 = time.perf_counter()
    engine.step()  # returns after its readback: the step's kernels are done
    wall = 1e6 * (time.perf_counter() - t0)
  finally:
    timings = ext._cupti_get_timings(True) or []
  kernels = [(name, ms * 1e3) for name, ms in timings]
  return wall, sum(us for _, us in kernels), kernels


def run(config, params, system: str, batch: int, context: int) -> dict:
  engine = admitted_engine(config, params, system, context, batch, new_tokens=6, budget=None)
  engine.step()  # a second decode step: nothing left to compile
  wall, total, kernels = profile_step(engine)
  groups = collections.defaultdict(lambda: [0.0, 0])
  for name, us in kernels:
    g = groups[kernel_stem(name)]
    g[0] += us
    g[1] += 1
  ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
  return dict(model=config.name, system=system, batch=batch, context=context, step_wall_us=wall, step_kernel_us=total,
              kernels=len(kernels), groups=[dict(stem=k, us=v[0], count=v[1]) for k, v in ranked])


def step_parser(description: str) -> argparse.ArgumentParser:
  """The arguments every step benchmark takes (step_profile, step_timeline, step_flags)."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--model", default="llama3.1-8b")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--systems", default="zipfusion,uncompressed")
  p.add_argument("--narrow", action="store_true", help="the model's layers with near-zero widths (narrow())")
  p.add_argument("--out", type=pathlib.Path, default=None)
  return p


def each_system(a, run_one):
  """Yield (system, run_one(config, params, system, batch, context)) for the parsed `a`."""
  config = narrow(get_config(a.model)) if a.narrow else get_config(a.model)
  params = random_params(config, jax.random.key(0))
  for system in a.systems.split(","):
    if system not in SYSTEMS:
      raise SystemExit(f"unknown system {system!r}; known: {sorted(SYSTEMS)}")
    yield system, run_one(config, params, system, a.batch, a.context)


def main(argv=None):
  p = step_parser(__doc__.splitlines()[0])
  p.add_argument("--top", type=int, default=15)
  a = p.parse_args(argv)
  rows = []
  for system, row in each_system(a, run):
    rows.append(row)
    print(f"{a.model} {system} B={a.batch} S={a.context}: step {row['step_wall_us'] / 1e3:.2f} ms wall, "
          f"{row['step_kernel_us'] / 1e3:.2f} ms in {row['kernels']} kernels")
    for g in row["groups"][: a.top]:
      print(f"  {g['us'] / 1e3:8.3f} ms {100 * g['us'] / row['step_kernel_us']:5.1f}%  x{g['count']:<5d} {g['stem'][:90]}")
  return save_result(a.out, rows)


if __name__ == "__main__":
  main()

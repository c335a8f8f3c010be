"""Where one engine decode step's wall time goes: its host phases, a cProfile, and the jitted step alone.

  python -m benchmarks.step_host [--model llama3.1-8b] [--batch 32] [--context 2048] [--narrow]
      [--systems zipfusion,uncompressed] [--steps 8] [--out benchmarks/results/step_host_h200.json]

`step_profile` found the step's wall time far above its kernels and `step_timeline` the device
busy for only part of its span, so most of the step is host time. This splits real
`Engine.step()` calls into their phases by timing the engine's own calls (instance attributes and
module functions wrapped for the measurement, nothing else changed):

  admit / plan_decode (scheduler), decode_plan + check_plan (plan build and validation),
  dispatch (the jitted decode's call until it returns: argument transfer, launch),
  device (from there until its outputs are ready), readback (`device_get`),
  commit (allocator) and decoded (scheduler bookkeeping); `other` is the rest of the wall time.

Then the jitted decode alone on the engine's last plan (the state is discarded afterwards):
`sync_ms` one call and wait, repeated; `pipelined_ms` calls back to back, one wait at the end (what
a step costs when the host never waits); `pipelined_device_plan_ms` the same with the plan already
on the device. And a cProfile of one step (top functions by own time).
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import io
import pstats
import statistics
import time

import jax

from benchmarks.e2e import admitted_engine
from benchmarks.generate import save_result
from benchmarks.step_profile import each_system, step_parser
from zipfusion_jax.serving import engine as engine_module

PHASES = ("admit", "plan_decode", "decode_plan", "check_plan", "dispatch", "device", "readback", "commit", "decoded")


@contextlib.contextmanager
def patched(obj, name, make):
  """Replace `obj.name` by `make(original)` for the block."""
  original = getattr(obj, name)
  setattr(obj, name, make(original))
  try:
    yield
  finally:
    setattr(obj, name, original)


def timed(fn, phase, acc):
  def wrapper(*args, **kwargs):
    t0 = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      acc[phase] += time.perf_counter() - t0
  return wrapper


def phase_timings(engine, steps: int) -> tuple[list[dict], tuple]:
  """Per step {phase: ms, "wall": ms} of `steps` real steps, and the last decode call's arguments."""
  acc: collections.Counter[str] = collections.Counter()
  last = {}

  def decode_wrapper(original):
    def run(params, state, packed, layout):
      last["args"] = (packed, layout)
      t0 = time.perf_counter()
      out = original(params, state, packed, layout)
      t1 = time.perf_counter()
      jax.block_until_ready(out)
      acc["dispatch"] += t1 - t0
      acc["device"] += time.perf_counter() - t1
      return out
    return run

  sched, alloc = engine.scheduler, engine.allocator
  rows = []
  with contextlib.ExitStack() as stack:
    for obj, name, phase in ((sched, "admit", "admit"), (sched, "plan_decode", "plan_decode"),
                             (sched, "decoded", "decoded"), (alloc, "commit", "commit"),
                             (engine_module, "decode_plan", "decode_plan"), (engine_module, "check_plan", "check_plan"),
                             (jax, "device_get", "readback")):
      stack.enter_context(patched(obj, name, lambda f, p=phase: timed(f, p, acc)))
    stack.enter_context(patched(engine, "_decode", decode_wrapper))
    for _ in range(steps):
      acc.clear()
      t0 = time.perf_counter()
      engine.step()
      wall = time.perf_counter() - t0
      row = {p: 1e3 * acc[p] for p in PHASES}
      row["wall"] = 1e3 * wall
      row["other"] = row["wall"] - sum(row[p] for p in PHASES)
      rows.append(row)
  return rows, last["args"]


def jitted_alone(engine, packed, layout, n: int = 16) -> dict:
  """ms per call of the jitted decode alone (its packed plan and tokens as the engine last passed
  them): waited each call, back to back, and with the packed plan already on the device."""
  state = engine.state

  def loop(packed, wait_each):
    nonlocal state
    t0 = time.perf_counter()
    for _ in range(n):
      readback, state = engine._decode(engine.params, state, packed, layout)
      if wait_each:
        jax.block_until_ready(readback)
    jax.block_until_ready(state)
    return 1e3 * (time.perf_counter() - t0) / n

  out = dict(sync_ms=loop(packed, True), pipelined_ms=loop(packed, False),
             pipelined_device_plan_ms=loop(jax.device_put(packed), False))
  engine.state = state  # donated: the engine's old reference is gone (its contents are now stale)
  return out


def profile_one_step(engine, top: int = 25) -> list[dict]:
  """cProfile of one step: the `top` functions by own time."""
  prof = cProfile.Profile()
  prof.enable()
  engine.step()
  prof.disable()
  stats = pstats.Stats(prof, stream=io.StringIO())
  rows = []
  for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
    rows.append(dict(function=f"{file.split('/')[-1]}:{line}:{fn}", calls=nc, own_ms=1e3 * tt, cumulative_ms=1e3 * ct))
  return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def run(config, params, system: str, batch: int, context: int, steps: int = 8) -> dict:
  engine = admitted_engine(config, params, system, context, batch, new_tokens=steps + 24, budget=None)
  engine.step()  # nothing left to compile
  rows, (packed, layout) = phase_timings(engine, steps)
  median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
  profile = profile_one_step(engine)
  alone = jitted_alone(engine, packed, layout)
  return dict(model=config.name, system=system, batch=batch, context=context, steps=steps,
              phases_ms_median=median, jitted_alone=alone, cprofile_top=profile)


def main(argv=None):
  p = step_parser(__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=8)
  a = p.parse_args(argv)
  rows = []
  for system, row in each_system(a, lambda *args: run(*args, steps=a.steps)):
    rows.append(row)
    m, j = row["phases_ms_median"], row["jitted_alone"]
    print(f"{row['model']} {system} B={a.batch} S={a.context}: step {m['wall']:.2f} ms = "
          + ", ".join(f"{k} {m[k]:.2f}" for k in (*PHASES, "other")), flush=True)
    print(f"  jitted decode alone: sync {j['sync_ms']:.2f} ms, pipelined {j['pipelined_ms']:.2f} ms, "
          f"pipelined with a device plan {j['pipelined_device_plan_ms']:.2f} ms", flush=True)
    for r in row["cprofile_top"][:12]:
      print(f"  {r['own_ms']:8.2f} ms own {r['cumulative_ms']:8.2f} cum x{r['calls']:<5d} {r['function'][:80]}", flush=True)
  return save_result(a.out, rows)


if __name__ == "__main__":
  main()

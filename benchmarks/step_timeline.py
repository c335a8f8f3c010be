"""One engine decode step on a timeline: where the GPU idles and what the host does meanwhile.

  python -m benchmarks.step_timeline [--model llama3.1-8b] [--batch 32] [--context 2048]
      [--systems zipfusion,uncompressed] [--out benchmarks/results/step_timeline_h200.json]

`benchmarks.step_profile` found the step's wall time far above the sum of its kernels (B=32,
2K: 27 ms against 9 ms), with or without XLA's command buffers (`benchmarks.step_flags`),
and about as far for a model of near-zero width, so the gap is not kernel work. This traces
one real `Engine.step()` with `jax.profiler.trace` and reads the trace back
(`jax.profiler.ProfileData`): on the device, the step's span, the time some stream is busy,
and the idle gaps between kernels (count, total, the largest, a histogram); on the host, the
Python calls of the step by inclusive time and the runtime threads' busiest events. On CPU
there is no device plane: the host side only.
"""

from __future__ import annotations

import collections
import glob
import pathlib
import re
import tempfile

import jax

from benchmarks.e2e import admitted_engine
from benchmarks.generate import save_result
from benchmarks.step_profile import each_system, step_parser

GAP_BINS_US = (1, 2, 5, 10, 20, 50, 100, 1000)


def _merge(intervals):
  """Sorted disjoint union of (start, end) intervals."""
  out = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return out


def device_summary(kernels: list[tuple[float, float, str]], top: int = 10) -> dict:
  """kernels: (start_ns, end_ns, name) of every device event -> span, busy time and idle gaps (µs)."""
  if not kernels:
    return {}
  busy = _merge([(s, e) for s, e, _ in kernels])
  gaps = [(b[0] - a[1], a[1]) for a, b in zip(busy, busy[1:])]
  after = {}
  for s, e, name in kernels:  # the kernel that ends a gap names it
    after.setdefault(s, name)
  hist = collections.Counter()
  for g, _ in gaps:
    hist[next((f"<{b}us" for b in GAP_BINS_US if g / 1e3 < b), f">={GAP_BINS_US[-1]}us")] += 1
  largest = sorted(gaps, reverse=True)[:top]
  starts = {a[1]: b[0] for a, b in zip(busy, busy[1:])}
  return dict(
      span_us=(busy[-1][1] - busy[0][0]) / 1e3, busy_us=sum(e - s for s, e in busy) / 1e3,
      idle_us=sum(g for g, _ in gaps) / 1e3, events=len(kernels), gaps=len(gaps),
      gap_histogram=dict(hist), start_ns=busy[0][0], end_ns=busy[-1][1],
      largest_gaps=[dict(us=g / 1e3, at_us=(t - busy[0][0]) / 1e3, start_ns=t, end_ns=starts[t],
                         before=after.get(starts[t], "")[:80])
                    for g, t in largest])


def host_during(lines: dict[str, list[tuple[float, float, str]]], lo: float, hi: float, top: int = 15) -> list[dict]:
  """Host events overlapping [lo, hi] (ns), by overlap: what the host did while the device idled."""
  out = []
  for line, events in lines.items():
    for s, e, name in events:
      overlap = min(e, hi) - max(s, lo)
      if overlap > 0:
        out.append(dict(line=line[:40], name=name[:100], overlap_us=overlap / 1e3, us=(e - s) / 1e3))
  return sorted(out, key=lambda r: -r["overlap_us"])[:top]


def host_summary(lines: dict[str, list[tuple[float, float, str]]], top: int = 15) -> dict:
  """Per host thread line: the event names with the largest total duration (µs)."""
  out = {}
  for line, events in lines.items():
    total = collections.Counter()
    count = collections.Counter()
    for s, e, name in events:
      total[name] += (e - s) / 1e3
      count[name] += 1
    if total:
      out[line] = [dict(name=n[:100], us=us, count=count[n]) for n, us in total.most_common(top)]
  return out


def read_trace(trace_dir: str):
  """(device kernels [(start, end, name)], host lines {line: [(start, end, name)]}) of a trace."""
  from jax.profiler import ProfileData

  (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  data = ProfileData.from_file(path)
  kernels, host = [], {}
  for plane in data.planes:
    for line in plane.lines:
      events = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
      if plane.name.startswith("/device:GPU"):
        if line.name.startswith("Stream"):  # kernels and copies; "XLA Ops"/"XLA Modules" lines repeat them
          kernels += events
      elif plane.name.startswith("/host"):
        host[line.name] = events
  return kernels, host


def run(config, params, system: str, batch: int, context: int) -> dict:
  engine = admitted_engine(config, params, system, context, batch, new_tokens=6, budget=None)
  engine.step()  # nothing left to compile
  options = jax.profiler.ProfileOptions()
  options.host_tracer_level = 3  # the runtime's own events (thunk launches, transfers), not only TraceMes at level 1-2
  options.python_tracer_level = 1
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, profiler_options=options):
      engine.step()
    kernels, host = read_trace(tmp)
  step = [e for evs in host.values() for e in evs if re.search(r"engine\.py:\d+ step$", e[2])]
  if step:  # host events inside the step only (not the profiler's own start and stop)
    lo, hi = step[0][:2]
    host = {line: [e for e in evs if lo <= e[0] and e[1] <= hi] for line, evs in host.items()}
  device = device_summary(kernels)
  windows = {}
  if device:
    if step:
      windows["before_device"] = host_during(host, step[0][0], device["start_ns"])
      windows["after_device"] = host_during(host, device["end_ns"], step[0][1])
    for i, g in enumerate(device["largest_gaps"][:3]):
      windows[f"gap{i}"] = host_during(host, g["start_ns"], g["end_ns"])
  return dict(model=config.name, system=system, batch=batch, context=context,
              step_wall_us=(step[0][1] - step[0][0]) / 1e3 if step else None,
              step_to_device_us=(device["start_ns"] - step[0][0]) / 1e3 if step and device else None,
              device_to_end_us=(step[0][1] - device["end_ns"]) / 1e3 if step and device else None,
              device=device, host=host_summary(host), host_during=windows)


def main(argv=None):
  a = step_parser(__doc__.splitlines()[0]).parse_args(argv)
  rows = []
  for system, row in each_system(a, run):
    rows.append(row)
    d = row["device"]
    print(f"{a.model} {system} B={a.batch} S={a.context}: step {row['step_wall_us']} us wall", flush=True)
    if d:
      print(f"  device span {d['span_us']:.0f} us, busy {d['busy_us']:.0f}, idle {d['idle_us']:.0f} in {d['gaps']} gaps "
            f"{d['gap_histogram']}", flush=True)
      for g in d["largest_gaps"][:5]:
        print(f"    gap {g['us']:8.1f} us at {g['at_us']:8.0f} us before {g['before']}", flush=True)
    print(f"  host before the device span {row['step_to_device_us']} us, after it {row['device_to_end_us']} us", flush=True)
    for window, evs in row["host_during"].items():
      print(f"  host during {window}: " + "; ".join(f"{e['name'][:50]} {e['overlap_us']:.0f}us" for e in evs[:8]), flush=True)
    python = row["host"].get("python", [])
    for e in python[:12]:
      print(f"  host {e['us']:9.1f} us x{e['count']:<4d} {e['name']}", flush=True)
    for line, evs in row["host"].items():
      if line != "python" and evs:
        print(f"  [{line[:40]}] " + ", ".join(f"{e['name'][:40]} {e['us']:.0f}us x{e['count']}" for e in evs[:4]), flush=True)
  return save_result(a.out, rows)


if __name__ == "__main__":
  main()

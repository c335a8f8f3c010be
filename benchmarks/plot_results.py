"""Plots of the H200 results for RESULTS.md (PNGs next to it), read from benchmarks/results/*.json.

  python -m benchmarks.plot_results [--e2e results/a.json,results/b.json [--tag h100]]
      [--ragged results/ragged_h100_merge_8_per_load.json]
      # writes benchmarks/e2e_throughput.png, e2e_batch_curves.png, e2e_breakdown.png,
      # attention_speedup.png (only for the results present); --e2e merges the rows of several
      # e2e runs of one device (default: results/e2e_h200.json) and plots only them, into
      # e2e_*_TAG.png with --tag; --ragged plots a `benchmarks.ragged` run alone, into
      # ragged_schedules.png

The `draw_*` functions draw one figure's content on a given axes; the notebooks use them too.
"""

from __future__ import annotations

import json
import pathlib

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
SYSTEMS = ("zipfusion", "zipfusion_v2", "uncompressed", "decompress_then_attend")
COLORS = {"zipfusion": "tab:green", "zipfusion_v2": "tab:olive", "uncompressed": "tab:blue",
          "decompress_then_attend": "tab:red"}
KERNELS = ("zipfusion_compressed", "zipfusion_compressed_v2", "zipfusion_uncompressed", "pallas_paged", "decompress_then_attend")


def _load(name: str) -> dict | None:
  """A results JSON by name under results/, or by path; None when absent."""
  path = RESULTS / name if (RESULTS / name).exists() else pathlib.Path(name)
  return json.loads(path.read_text()) if path.exists() else None


def _budget_settings(result: dict) -> list[tuple]:
  return sorted({(r["model"], r["context"], r["kv_budget_gib"]) for r in _measured(result) if r["kv_budget_gib"] is not None})


def _measured(result: dict) -> list[dict]:
  """Rows with figures (not a system that ran out of device memory)."""
  return [r for r in result["rows"] if "error" not in r]


def draw_e2e_throughput(ax, result: dict) -> None:
  """Decode tokens/s at each system's largest batch under the budget, per model and context."""
  rows = [r for r in _measured(result) if r["kv_budget_gib"] is not None]
  settings = _budget_settings(result)
  width = 0.8 / len(SYSTEMS)
  for i, system in enumerate(SYSTEMS):
    labelled = False
    for j, key in enumerate(settings):
      r = next((r for r in rows if (r["model"], r["context"], r["kv_budget_gib"]) == key and r["system"] == system), None)
      if r is None:
        continue
      x = j + (i - (len(SYSTEMS) - 1) / 2) * width
      ax.bar(x, r["decode_tokens_per_s"], width, color=COLORS[system], label=None if labelled else system)
      labelled = True
      ax.text(x, r["decode_tokens_per_s"], f"B={r['batch']}", ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(settings)), [f"{m}\n{c // 1024}K, {b:g} GiB" for m, c, b in settings])
  ax.set_ylabel("decode tokens/s")
  ax.set_title(f"Largest batch under one KV budget\n({result['device']}, {result['date']})", fontsize=9)
  ax.legend(fontsize=7)


def draw_e2e_batch_curve(ax, result: dict, setting: tuple) -> None:
  """Decode tokens/s against batch for each system at one (model, context, budget) setting: the
  `batch_curve` points and the largest batch (a star), from one run per system."""
  model, context, budget = setting
  for system in SYSTEMS:
    r = next((r for r in _measured(result) if (r["model"], r["context"], r["kv_budget_gib"], r["system"])
              == (model, context, budget, system)), None)
    if r is None:
      continue
    top = r.get("batch_curve_from", r["batch"])  # the batch of the timed steps, which the curve starts from
    points = sorted([(p["batch"], p["decode_tokens_per_s"]) for p in r.get("batch_curve", [])]
                    + [(top, r["decode_tokens_per_s"])])
    ax.plot([b for b, _ in points], [t for _, t in points], marker="o", ms=3, color=COLORS[system], label=system)
    ax.plot([top], [r["decode_tokens_per_s"]], marker="*", ms=11, color=COLORS[system])
  ax.set_xlabel("batch (sequences decoding)")
  ax.set_ylabel("decode tokens/s")
  ax.set_title(f"{model}, {context // 1024}K, {budget:g} GiB of KV (star: largest batch)", fontsize=8)
  ax.legend(fontsize=7)


def curve_settings(result: dict) -> list[tuple]:
  """The budget settings whose rows carry a batch curve."""
  return [k for k in _budget_settings(result)
          if any(r.get("batch_curve") for r in _measured(result) if (r["model"], r["context"], r["kv_budget_gib"]) == k)]


def merge_e2e(results: list[dict]) -> dict:
  """One result from several e2e runs of one device and jax (their rows in order; the newest
  date). A (model, system, context, budget) measured twice is an error: which would the plot show?"""
  for field in ("device", "jax"):
    values = {r.get(field) for r in results}
    if len(values) != 1:
      raise ValueError(f"e2e results from different {field}s cannot share a plot: {sorted(map(str, values))}")
  rows = [row for r in results for row in r["rows"]]
  keys = [(r["model"], r["system"], r["context"], r["kv_budget_gib"]) for r in _measured({"rows": rows})]
  if len(keys) != len(set(keys)):
    raise ValueError(f"e2e results measure a setting twice: {sorted({k for k in keys if keys.count(k) > 1})}")
  return dict(results[0], date=max(r["date"] for r in results), rows=rows)


def draw_e2e_breakdown(ax, result: dict) -> None:
  """Step time split into attention, decompression and everything else (the unbudgeted setting)."""
  rows = [r for r in _measured(result) if r["kv_budget_gib"] is None]
  labels = []
  for i, r in enumerate(rows):
    rest = r["step_ms"] - r["attention_ms"] - r["decompress_ms"]
    ax.barh(i, r["attention_ms"], color="tab:orange", label="attention" if i == 0 else None)
    ax.barh(i, r["decompress_ms"], left=r["attention_ms"], color="tab:red", label="decompression" if i == 0 else None)
    ax.barh(i, rest, left=r["attention_ms"] + r["decompress_ms"], color="tab:gray", label="everything else" if i == 0 else None)
    labels.append(f"{r['system']}\n{r['model']} B={r['batch']} S={r['context']}")
  ax.set_yticks(range(len(rows)), labels, fontsize=7)
  ax.set_xlabel("decode step (ms)")
  ax.set_title(f"Step-time breakdown ({result['device']}, {result['date']})", fontsize=9)
  ax.legend(fontsize=7)


def draw_attention_speedup(ax, result: dict) -> None:
  """Each kernel's speed relative to cuDNN on dense BF16, per (batch, context)."""
  rows = result["rows"]
  shapes = sorted({(r["batch"], r["context"]) for r in rows}, key=lambda s: s[1])
  base = {(r["batch"], r["context"]): r["time_us"] for r in rows if r["kernel"] == "cudnn_dense"}
  for k in KERNELS:
    pts = [(f"{b}x{c}", base[(b, c)] / r["time_us"]) for (b, c) in shapes for r in rows
           if r["kernel"] == k and (r["batch"], r["context"]) == (b, c) and (b, c) in base]
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
  ax.axhline(1.0, color="black", lw=0.8)
  ax.axhline(4 / 3, color="gray", lw=0.8, ls="--", label="12-bit ceiling (1.33x)")
  ax.set_xlabel("batch x context (Llama-3.1-8B, 32 q / 8 KV heads, D=128)")
  ax.set_ylabel("speed vs cuDNN dense BF16")
  ax.set_title(f"Decode attention ({result['device']}, {result['date']})", fontsize=9)
  ax.legend(fontsize=7)


SCHEDULE_COLORS = {"grid": "tab:gray", "balanced": "tab:cyan", "balanced_host": "tab:green", "balanced_fit": "tab:olive"}


def draw_ragged_schedules(ax, result: dict) -> None:
  """A `benchmarks.ragged` run: each schedule's speed relative to the grid schedule's, per length mix
  and store (the call's total time: kernel, plan kernels, merge), on a log axis."""
  rows = result["rows"]
  mixes = list(dict.fromkeys(r["mix"] for r in rows))
  stores = list(dict.fromkeys(r["kernel"] for r in rows))
  schedules = [s for s in SCHEDULE_COLORS if any(r["schedule"] == s for r in rows) and s != "grid"]
  time = {(r["mix"], r["kernel"], r["schedule"]): r["time_us"] for r in rows}
  groups = [(m, k) for m in mixes for k in stores if (m, k, "grid") in time]
  width = 0.8 / max(1, len(schedules))
  for i, schedule in enumerate(schedules):
    xs, ys = [], []
    for j, (mix, store) in enumerate(groups):
      if (mix, store, schedule) in time:
        xs.append(j + (i - (len(schedules) - 1) / 2) * width)
        ys.append(time[(mix, store, "grid")] / time[(mix, store, schedule)])
    bars = ax.bar(xs, ys, width, color=SCHEDULE_COLORS[schedule], label=schedule)
    ax.bar_label(bars, [f"{y:.2f}" for y in ys], fontsize=6)
  ax.axhline(1.0, color="black", lw=0.8)
  ax.set_yscale("log")
  ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8, 16, 32]))
  ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
  ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  store_name = {"zipfusion_compressed": "12-bit", "zipfusion_uncompressed": "BF16"}
  ax.set_xticks(range(len(groups)), [f"{m.removeprefix('equal_')}\n{store_name.get(k, k)}" for m, k in groups],
                fontsize=7)
  ax.set_ylabel("speed vs the grid schedule")
  ax.set_title(f"Ragged batches: work schedules ({result['device']}, {result['date']})", fontsize=9)
  if schedules:
    ax.legend(fontsize=7)


def save(draw, result: dict, out: pathlib.Path, figsize: tuple[float, float]) -> None:
  fig, ax = plt.subplots(figsize=figsize)
  draw(ax, result)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def save_batch_curves(result: dict, out: pathlib.Path) -> None:
  settings = curve_settings(result)
  fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
  for ax, setting in zip(axes[0], settings):
    draw_e2e_batch_curve(ax, result, setting)
  fig.suptitle(f"Decode throughput against batch ({result['device']}, {result['date']})", fontsize=9)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def main(argv=None) -> None:
  import argparse

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--e2e", default=None, help="comma-separated e2e result files (under results/ or paths); "
                 "default: results/e2e_h200.json if present")
  p.add_argument("--tag", default="", help="suffix of the e2e PNGs' names (e.g. h100: e2e_throughput_h100.png), "
                 "so that another device's figures sit next to the H200 ones")
  p.add_argument("--ragged", default=None, help="a benchmarks.ragged results file: ragged_schedules.png only")
  p.add_argument("--out-dir", type=pathlib.Path, default=HERE, help="where the PNGs go (default: benchmarks/)")
  a = p.parse_args(argv)
  tag, out = (f"_{a.tag}" if a.tag else ""), a.out_dir
  matplotlib.use("Agg")  # files only (here, not at import: the notebooks draw inline with these functions)
  if a.ragged is not None:
    if (ragged := _load(a.ragged)) is None:
      p.error(f"--ragged: no such results file: {a.ragged}")
    save(draw_ragged_schedules, ragged, out / "ragged_schedules.png", (9, 3.6))
    return
  if a.e2e is None:
    found = [r for r in [_load("e2e_h200.json")] if r is not None]
  else:
    names = [name for name in a.e2e.split(",") if name]
    found = [_load(name) for name in names]
    if None in found:
      missing = [n for n, r in zip(names, found) if r is None]
      p.error(f"--e2e: no such results file: {', '.join(missing)}")
  if found:
    e2e = merge_e2e(found)
    save(draw_e2e_throughput, e2e, out / f"e2e_throughput{tag}.png", (1.8 + 2.2 * len(_budget_settings(e2e)), 3.6))
    if curve_settings(e2e):
      save_batch_curves(e2e, out / f"e2e_batch_curves{tag}.png")
    if any(r["kv_budget_gib"] is None for r in e2e["rows"]):
      save(draw_e2e_breakdown, e2e, out / f"e2e_breakdown{tag}.png", (5.5, 3.4))
  if a.e2e is None and (att := _load("attention_h200.json")) is not None:
    save(draw_attention_speedup, att, out / "attention_speedup.png", (6, 3.4))


if __name__ == "__main__":
  main()

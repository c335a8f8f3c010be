"""Why the end-to-end throughput ratio is what it is: batch ratio against attention speedup.

  python -m benchmarks.e2e_ratio [benchmarks/results/e2e_h200.json ...] [--system zipfusion] [--out FILE]

For every setting (model, context, budget) where `system` and `uncompressed` both ran at their
largest batch, the decode tokens/s ratio splits exactly into

    ratio = r * step_u / step_z,    step = attention + other,

with `r` = batch ratio (what the store holds: the compression ratio, rounded to whole requests by
admission), `s` = attention time per sequence, uncompressed over compressed (what the kernel
gains), and `g` = the compressed step's "other" time over the uncompressed one's (the rest of the
step grows with the batch). With `a` the uncompressed step's attention share,

    ratio = r / (a * r / s + (1 - a) * g),

so with `g = 1` the ratio lies between `s` (attention-bound) and `r` (everything else dominant):
it cannot exceed `max(r, s)`, and `g > 1` pulls it lower. A target above `max(r, s)` needs a
denser store or a faster kernel, not a better engine. Rows: {"model", "context", "kv_budget_gib",
"batch_ratio", "attention_speedup", "attention_share", "other_growth", "ratio", "bound"}.
"""

from __future__ import annotations

import argparse
import json
import pathlib

DEFAULT = ["benchmarks/results/e2e_h200.json"]


def _key(row: dict) -> tuple:
  return row["model"], row["context"], row["kv_budget_gib"]


def decompose(rows: list[dict], system: str = "zipfusion", baseline: str = "uncompressed") -> list[dict]:
  """The ratio's parts for each setting where both systems ran at their largest batch.

  Raises ValueError on a row whose parts contradict its own ratio (step or attention missing or
  not positive): a decomposition of bad figures would explain nothing."""
  chosen = {}
  for row in rows:
    if row.get("is_max_batch") and row.get("decode_tokens_per_s") and row["system"] in (system, baseline):
      key = (row["system"], *_key(row))
      if key in chosen:
        raise ValueError(f"{key} is measured twice: which row would the ratio use?")
      chosen[key] = row
  out = []
  for (name, *key), z in chosen.items():
    u = chosen.get((baseline, *key))
    if name != system or u is None:
      continue
    for row in (z, u):
      if not (row.get("step_ms", 0) > 0 and 0 < row.get("attention_ms", 0) < row["step_ms"]):
        raise ValueError(f"{row['system']} at {key}: needs 0 < attention_ms < step_ms, got "
                         f"{row.get('attention_ms')} / {row.get('step_ms')}")
    r = z["batch"] / u["batch"]
    s = (u["attention_ms"] / u["batch"]) / (z["attention_ms"] / z["batch"])
    a = u["attention_ms"] / u["step_ms"]
    g = (z["step_ms"] - z["attention_ms"]) / (u["step_ms"] - u["attention_ms"])
    ratio = z["decode_tokens_per_s"] / u["decode_tokens_per_s"]
    out.append({"model": key[0], "context": key[1], "kv_budget_gib": key[2], "system": system,
                "batch": z["batch"], "baseline_batch": u["batch"], "batch_ratio": r,
                "attention_speedup": s, "attention_share": a, "other_growth": g, "ratio": ratio,
                "ratio_from_parts": r / (a * r / s + (1 - a) * g), "bound": max(r, s)})
  return out


def markdown(parts: list[dict]) -> str:
  lines = ["| model, context, budget | batches | r (batch ratio) | s (attention per sequence) | "
           "attention share (uncompressed) | g (other time) | ratio | max(r, s) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for p in parts:
    budget = "none" if p["kv_budget_gib"] is None else f"{p['kv_budget_gib']:.1f} GiB"
    lines.append(f"| {p['model']}, {p['context'] // 1024}K, {budget} | {p['batch']} / {p['baseline_batch']} | "
                 f"{p['batch_ratio']:.3f} | {p['attention_speedup']:.3f} | {p['attention_share']:.1%} | "
                 f"{p['other_growth']:.3f} | **{p['ratio']:.3f}** | {p['bound']:.3f} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("results", nargs="*", default=DEFAULT)
  p.add_argument("--system", default="zipfusion", help="the compressed system (zipfusion or zipfusion_v2)")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  results = [json.loads(pathlib.Path(f).read_text()) for f in a.results]
  devices = {r.get("device") for r in results}
  if len(devices) != 1:  # a ratio across devices would pair one card's row with another's
    raise SystemExit(f"results from different devices: {sorted(map(str, devices))}")
  rows = [row for r in results for row in r["rows"]]
  parts = decompose(rows, a.system)
  print(markdown(parts))
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps({"sources": a.results, "rows": parts}, indent=1) + "\n")
  return parts


if __name__ == "__main__":
  main()

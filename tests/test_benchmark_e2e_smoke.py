"""CPU smoke tests of the end-to-end benchmark (tiny model, tiny budget): schema, largest batches, decomposition;
and of the per-kernel step profile."""

import json

import jax
import pytest

from benchmarks import e2e

FIELDS = {"model", "system", "context", "batch", "is_max_batch", "kv_budget_gib", "decode_tokens_per_s", "step_ms",
          "attention_ms", "decompress_ms", "eligible_fraction", "batch_max", "compile_step_ms", "step_ms_median"}


def test_e2e_rows(tmp_path):
  out = tmp_path / "e2e.json"
  result = e2e.main(["--models", "tiny-llama3", "--contexts", "48", "--budget-gib", "0.001", "--steps", "2",
                     "--warmup", "1", "--max-slots", "40",
                     "--out", str(out)])
  rows = {(r["system"], r["kv_budget_gib"]): r for r in result["rows"]}
  assert len(rows) == 3 and out.exists()
  for r in rows.values():
    assert FIELDS <= set(r) and r["decode_tokens_per_s"] > 0 and r["attention_ms"] > 0
    assert r["compiles_in_timing"] == 0  # Engine.warm_up compiled every completion width first
    assert set(r["phase_s"]) == {"compile", "admit", "warmup_steps", "timed_steps", "decomposition", "batch_curve"}
    curve = r["batch_curve"]  # 3/4, 1/2, 1/4 of the largest batch
    assert [p["batch"] for p in curve] == [max(1, round(r["batch_curve_from"] * k / 4)) for k in (3, 2, 1)]
    assert r["new_tokens"] == 1 + 2 + 2 + 3 * 8  # warm-up, timed, prefill + admitting step, curve
    assert all(p["decode_tokens_per_s"] > 0 for p in curve)
    assert all(t >= 0 for t in r["phase_s"].values()) and r["phase_s"]["compile"] > 0
  z, u, d = (rows[(s, 0.001)] for s in ("zipfusion", "uncompressed", "decompress_then_attend"))
  assert z["is_max_batch"] and u["is_max_batch"] and d["is_max_batch"]  # admission, not the 40 slots, stopped them
  assert z["batch"] > u["batch"] > d["batch"] >= 1  # 12-bit pages hold more; the BF16 buffer costs the baseline
  assert z["decompress_ms"] == 0 and d["decompress_ms"] > 0 and d["decompress_buffer_bytes"] > 0
  assert 0 < z["eligible_fraction"] <= 1 and u["eligible_fraction"] is None
  _check_batch_curve_plot(result, tmp_path)


def _check_batch_curve_plot(result, tmp_path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from benchmarks import plot_results

  (setting,) = plot_results.curve_settings(result)
  fig, ax = plt.subplots()
  plot_results.draw_e2e_batch_curve(ax, result, setting)
  curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]  # the stars are single points
  assert [line.get_label() for line in curves] == ["zipfusion", "uncompressed", "decompress_then_attend"]
  for line, system in zip(curves, ("zipfusion", "uncompressed", "decompress_then_attend")):
    row = next(r for r in result["rows"] if r["system"] == system)
    assert len(line.get_xdata()) == 4 and max(line.get_xdata()) == row["batch_curve_from"]  # 3 curve points + top
  plt.close(fig)
  plot_results.save_batch_curves(result, tmp_path / "curves.png")
  assert (tmp_path / "curves.png").stat().st_size > 0
  with pytest.raises(ValueError, match="different devices"):
    plot_results.merge_e2e([result, dict(result, device="another")])
  with pytest.raises(ValueError, match="twice"):
    plot_results.merge_e2e([result, result])
  halves = [dict(result, rows=result["rows"][:1]), dict(result, rows=result["rows"][1:], date="2099-01-01")]
  merged = plot_results.merge_e2e(halves)
  assert merged["rows"] == result["rows"] and merged["date"] == "2099-01-01"
  with pytest.raises(SystemExit):
    plot_results.main(["--e2e", str(tmp_path / "absent.json")])
  (tmp_path / "run.json").write_text(json.dumps(result))
  plot_results.main(["--e2e", str(tmp_path / "run.json"), "--tag", "cpu", "--out-dir", str(tmp_path)])
  assert {p.name for p in tmp_path.glob("e2e_*_cpu.png")} == {"e2e_throughput_cpu.png", "e2e_batch_curves_cpu.png"}


def test_batch_curve_option_is_parsed_and_checked():
  assert e2e.parse_batch_curve("4x8") == (4, 8) and e2e.parse_batch_curve("0") == (0, 0)
  for bad in ("4", "1x8", "4x0", "ax8"):
    with pytest.raises(ValueError, match="--batch-curve"):
      e2e.parse_batch_curve(bad)
  with pytest.raises(SystemExit):  # a usage error, not a traceback
    e2e.main(["--batch-curve", "4"])


def test_e2e_decomposition_setting_is_not_budget_limited():
  row = e2e.main(["--models", "tiny-llama3", "--contexts", "", "--systems", "zipfusion", "--steps", "1", "--warmup", "0",
                  "--decomposition", "--decomposition-shape", "3x40"])["rows"][0]
  assert (row["batch"], row["context"], row["kv_budget_gib"], row["is_max_batch"]) == (3, 40, None, False)


def test_e2e_at_real_kv_eligibility_reports_it():
  row = e2e.main(["--models", "tiny-llama3", "--contexts", "", "--systems", "zipfusion", "--steps", "1", "--warmup", "0",
                  "--decomposition", "--decomposition-shape", "2x64", "--kv-stats", "real"])["rows"][0]
  assert row["kv_statistics"] == "real" and set(row["planted_prompt_eligible"]) == {"k", "v"}
  assert 0 < row["eligible_fraction"] < 0.95


def test_step_profile_runs_on_cpu_and_groups_kernel_names():
  from benchmarks import step_profile

  assert step_profile.kernel_stem("input_scatter_fusion.3") == "input_scatter_fusion"
  assert step_profile.kernel_stem("loop_add_fusion_12") == "loop_add_fusion"
  rows = step_profile.main(["--model", "tiny-llama3", "--batch", "2", "--context", "40"])["rows"]
  assert [r["system"] for r in rows] == ["zipfusion", "uncompressed"]
  assert all(r["step_kernel_us"] > 0 and r["groups"] for r in rows)


def test_step_timeline_finds_device_gaps_and_traces_a_step_on_cpu():
  from benchmarks import step_timeline as st

  # Two streams overlapping, then a 10 µs gap, then a 300 µs gap.
  kernels = [(0, 5_000, "a"), (2_000, 8_000, "b"), (18_000, 20_000, "c"), (320_000, 321_000, "d")]
  d = st.device_summary(kernels)
  assert d["span_us"] == 321 and d["busy_us"] == 8 + 2 + 1 and d["idle_us"] == 10 + 300
  assert d["gaps"] == 2 and d["gap_histogram"] == {"<20us": 1, "<1000us": 1}
  assert [g["before"] for g in d["largest_gaps"]] == ["d", "c"] and d["largest_gaps"][0]["us"] == 300
  assert st.device_summary([]) == {}
  host = st.host_summary({"t": [(0, 3_000, "x"), (5_000, 6_000, "x"), (0, 500, "y")]})
  assert host["t"][0] == {"name": "x", "us": 4.0, "count": 2}
  rows = st.main(["--model", "tiny-llama3", "--batch", "2", "--context", "40", "--systems", "zipfusion"])["rows"]
  assert rows[0]["step_wall_us"] > 0 and any("engine.py" in e["name"] for e in rows[0]["host"]["python"])


def test_step_host_splits_a_step_into_phases_on_cpu():
  from benchmarks import step_host

  row = step_host.main(["--model", "tiny-llama3", "--batch", "2", "--context", "40", "--systems", "zipfusion",
                        "--steps", "2"])["rows"][0]
  phases = row["phases_ms_median"]
  assert set(step_host.PHASES) <= set(phases) and phases["wall"] > 0
  assert phases["dispatch"] > 0 and phases["device"] >= 0 and phases["commit"] > 0
  assert sum(phases[p] for p in step_host.PHASES) <= phases["wall"] * 1.01
  assert all(row["jitted_alone"][k] > 0 for k in ("sync_ms", "pipelined_ms", "pipelined_device_plan_ms"))
  assert row["cprofile_top"] and row["cprofile_top"][0]["own_ms"] >= row["cprofile_top"][-1]["own_ms"]


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats

  def __str__(self):
    return "fake device"


def test_whole_device_budget_is_the_memory_left_after_the_weights_and_the_reserve():
  gib = 2**30
  assert e2e.whole_device_budget_gib(8.0, _Device({"bytes_limit": 134 * gib, "bytes_in_use": 16 * gib})) == 110.0
  with pytest.raises(ValueError, match="reports its memory"):
    e2e.whole_device_budget_gib(8.0, _Device(None))  # the CPU backend reports none
  with pytest.raises(ValueError, match="no memory left"):
    e2e.whole_device_budget_gib(8.0, _Device({"bytes_limit": 20 * gib, "bytes_in_use": 16 * gib}))


def test_budget_flag_takes_numbers_and_whole():
  assert e2e.parse_budgets("48,whole") == [48.0, "whole"]
  for bad in ("0", "lots", "-3"):
    with pytest.raises(ValueError):
      e2e.parse_budgets(bad)


def test_whole_budget_rows_say_so(monkeypatch):
  """Both settings reach `run_system` with their GiB (test_e2e_rows runs the real one)."""
  monkeypatch.setattr(e2e, "whole_device_budget_gib", lambda reserve: 0.002)
  seen = []

  def run_system(config, params, system, context, steps, warmup, slots, budget_gib, knobs, curve):
    seen.append(budget_gib)
    return dict(batch=1, is_max_batch=True, kv_budget_gib=budget_gib, decode_tokens_per_s=1.0, step_ms=1.0,
                attention_ms=0.5, decompress_ms=0.0)

  monkeypatch.setattr(e2e, "run_system", run_system)
  rows = e2e.main(["--models", "tiny-llama3", "--contexts", "48", "--budget-gib", "0.001,whole", "--systems", "zipfusion"])["rows"]
  assert seen == [0.001, 0.002]
  assert [(r["budget_setting"], r["kv_budget_gib"]) for r in rows] == [("fixed", 0.001), ("whole", 0.002)]


def test_a_system_out_of_device_memory_gets_an_error_row_and_the_run_goes_on(monkeypatch):
  real = e2e.run_system

  def run_system(config, params, system, *args):
    if system == "decompress_then_attend":
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 980.56MiB")
    return real(config, params, system, *args)

  monkeypatch.setattr(e2e, "run_system", run_system)
  rows = e2e.main(["--models", "tiny-llama3", "--contexts", "48", "--budget-gib", "0.001", "--steps", "1",
                   "--warmup", "1", "--max-slots", "40", "--systems", "decompress_then_attend,zipfusion"])["rows"]
  assert [r["system"] for r in rows] == ["decompress_then_attend", "zipfusion"]
  assert "out of device memory" in rows[0]["error"] and rows[1]["decode_tokens_per_s"] > 0
  assert FIELDS - {"batch_max", "compile_step_ms", "step_ms_median"} <= set(rows[0])  # the row schema
  assert rows[0]["decode_tokens_per_s"] is None
  from benchmarks import plot_results  # the plots skip the error row

  assert [r["system"] for r in plot_results._measured({"rows": rows})] == ["zipfusion"]


def _row(system, batch, tok_s, step_ms, attention_ms, model="m", context=8192, budget=48.0, max_batch=True):
  return {"model": model, "system": system, "context": context, "kv_budget_gib": budget, "batch": batch,
          "is_max_batch": max_batch, "decode_tokens_per_s": tok_s, "step_ms": step_ms, "attention_ms": attention_ms}


def test_e2e_ratio_parts_rebuild_the_ratio():
  from benchmarks import e2e_ratio

  rows = [_row("zipfusion", 59, 59 / 25.83e-3, 25.83, 12.43), _row("uncompressed", 46, 46 / 24.30e-3, 24.30, 11.98),
          _row("zipfusion", 9, 1.0, 2.0, 1.0, max_batch=False),  # not a largest batch: ignored
          _row("zipfusion", 5, 1.0, 2.0, 1.0, context=2048)]  # no baseline at this setting: ignored
  (p,) = e2e_ratio.decompose(rows)
  assert (p["model"], p["context"], p["batch"], p["baseline_batch"]) == ("m", 8192, 59, 46)
  assert p["ratio"] == pytest.approx(p["ratio_from_parts"], rel=1e-12)  # the identity the table rests on
  assert p["batch_ratio"] == pytest.approx(59 / 46) and p["bound"] == max(p["batch_ratio"], p["attention_speedup"])
  assert p["ratio"] < p["bound"]  # other time grew (g > 1): below both r and s here
  assert "| m, 8K, 48.0 GiB | 59 / 46 |" in e2e_ratio.markdown([p])
  # With the rest of the step unchanged the ratio lies between s and r.
  (q,) = e2e_ratio.decompose([_row("zipfusion", 130, 130 / 30e-3, 30.0, 20.0), _row("uncompressed", 100, 100 / 25e-3, 25.0, 15.0)])
  assert q["other_growth"] == pytest.approx(1.0) and min(q["batch_ratio"], q["attention_speedup"]) <= q["ratio"] <= q["bound"]


def test_e2e_ratio_rejects_inconsistent_rows():
  from benchmarks import e2e_ratio

  with pytest.raises(ValueError, match="attention_ms < step_ms"):
    e2e_ratio.decompose([_row("zipfusion", 59, 1.0, 10.0, 12.0), _row("uncompressed", 46, 1.0, 24.3, 11.98)])
  with pytest.raises(ValueError, match="measured twice"):
    e2e_ratio.decompose([_row("zipfusion", 59, 1.0, 25.0, 12.0)] * 2 + [_row("uncompressed", 46, 1.0, 24.3, 11.98)])

"""The attention benchmark runs end to end on CPU (tiny shape) and writes the issue's JSON schema."""

import json

import pytest

from benchmarks import attention


def test_attention_benchmark_smoke(tmp_path):
  out = tmp_path / "attention.json"
  attention.main(["--shapes", "1x32", "--out", str(out)])
  result = json.loads(out.read_text())
  assert {"device", "jax", "date", "rows"} <= set(result)
  for row in result["rows"]:
    assert {"kernel", "model", "batch", "context", "time_us", "bytes_read"} <= set(row)
    assert row["model"] == "llama3.1-8b" and row["batch"] == 1 and row["context"] == 32
  assert result["data"][0]["compressed_equals_uncompressed"]


@pytest.mark.slow  # the interpreted kernel 32 times (the balanced schedule's own test is in the default tier)
def test_ragged_benchmark_rows(tmp_path):
  """benchmarks.ragged on CPU: the interpreted kernel under both schedules (the balanced one planned on
  the device and on the host), checked against the reference."""
  from benchmarks import ragged
  from benchmarks.fused_kernel_check import TOL  # this tiny model's outputs are O(1) random-normal ones

  out = tmp_path / "ragged.json"
  result = ragged.main(["--mixes", "smoke", "--model", "tiny-llama3", "--items", "2", "--out", str(out)])
  rows = result["rows"]
  assert json.loads(out.read_text())["rows"] == rows
  assert {(r["kernel"], r["schedule"]) for r in rows} == {
      (k, s) for k in ("zipfusion_compressed", "zipfusion_uncompressed") for s in ragged.SCHEDULES}
  assert all(r["max_error"] <= TOL and r["time_us"] > 0 and r["tokens"] == 320 for r in rows)
  comp, plain = (next(r for r in rows if r["kernel"] == k) for k in ("zipfusion_compressed", "zipfusion_uncompressed"))
  assert comp["bytes_read"] < plain["bytes_read"]


def test_ragged_plan_spreads_the_long_sequence():
  """benchmarks.ragged --plan (no kernel): the balanced schedule's longest CTA is 16x shorter on one_long."""
  from benchmarks import ragged

  rows = {(r["mix"], r["schedule"]): r for r in ragged.main(["--plan", "--mixes", "one_long,equal_32x2048"])}
  assert rows[("one_long", "grid")]["max_pages_per_cta"] == 32768 // 16
  assert rows[("one_long", "balanced")]["max_pages_per_cta"] * 16 <= 32768 // 16
  assert rows[("equal_32x2048", "balanced")]["ctas"] == rows[("equal_32x2048", "grid")]["ctas"] == 256


def test_ragged_schedules_plot_shows_each_schedules_speed_over_the_grid(tmp_path):
  """`plot_results.draw_ragged_schedules`: one bar per (mix, store) and schedule, its height the grid
  time over the schedule's; a mix without a grid row is left out; `--ragged` writes only its PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from benchmarks import plot_results

  row = lambda mix, kernel, schedule, t: dict(mix=mix, kernel=kernel, schedule=schedule, time_us=t)
  result = dict(device="CPU", date="2026-12-07", rows=[
      row("one_long", "zipfusion_compressed", "grid", 600.0), row("one_long", "zipfusion_compressed", "balanced_host", 80.0),
      row("equal", "zipfusion_compressed", "grid", 75.0), row("equal", "zipfusion_compressed", "balanced_host", 78.0),
      row("no_grid", "zipfusion_compressed", "balanced_host", 1.0)])
  fig, ax = plt.subplots()
  plot_results.draw_ragged_schedules(ax, result)
  heights = [p.get_height() for p in ax.patches]
  assert heights == pytest.approx([600 / 80, 75 / 78])
  assert [t.get_text() for t in ax.get_xticklabels()] == ["one_long\n12-bit", "equal\n12-bit"]
  plt.close(fig)
  (tmp_path / "r.json").write_text(json.dumps(result))
  plot_results.main(["--ragged", str(tmp_path / "r.json"), "--out-dir", str(tmp_path)])
  assert [p.name for p in tmp_path.glob("*.png")] == ["ragged_schedules.png"]
  with pytest.raises(SystemExit):
    plot_results.main(["--ragged", str(tmp_path / "absent.json"), "--out-dir", str(tmp_path)])


def test_device_plan_check_runs_and_reports_each_batch():
  """`benchmarks.ragged --check-plans`' comparison (interpreted here; compiled on a GPU)."""
  from benchmarks import ragged

  rows = ragged.check_device_plans(trials=3, seed=1)
  assert len(rows) == 3 and all(r["equal"] for r in rows)
  assert rows[0]["batch"] >= 1

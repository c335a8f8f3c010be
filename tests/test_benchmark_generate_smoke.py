"""CPU smoke test of the end-to-end generation benchmark (tiny model): it runs and its rows have the schema."""

from benchmarks import generate


def test_generate_benchmark_rows(tmp_path):
  out = tmp_path / "g.json"
  result = generate.main(["--models", "tiny-llama3", "--batch", "2", "--context", "40", "--decode-steps", "3",
                          "--out", str(out)])
  rows = result["rows"]
  assert [r["kv"] for r in rows] == ["compressed", "uncompressed"]
  for r in rows:
    assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["decode_step_ms"] > 0
  assert rows[0]["compression_ratio"] > 1.0  # pages completed and were stored in 12 bits
  assert out.exists()



def test_ragged_prompts(tmp_path):
  """Uniform prompt lengths: one draw of ragged prompts for both stores, pages still completed."""
  result = generate.main(["--models", "tiny-llama3", "--batch", "3", "--context", "40", "--decode-steps", "2",
                          "--lengths", "uniform", "--kv", "compressed,uncompressed"])
  rows = result["rows"]
  assert [(r["kv"], r["schedule"]) for r in rows] == [("compressed", "grid"), ("uncompressed", "grid")]
  assert all(r["lengths"] == "uniform" and 1 <= r["mean_prompt_tokens"] <= 40 for r in rows)
  assert rows[0]["mean_prompt_tokens"] == rows[1]["mean_prompt_tokens"] != 40  # one draw, not all equal
  assert rows[0]["compression_ratio"] > 1.0


def test_bad_schedules_or_lengths_are_refused(capsys):
  """An unknown schedule or store; the balanced schedule off the GPU (the reference path has none); lengths."""
  import jax
  import pytest

  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the balanced schedule runs")
  for flags, message in ((["--schedules", "grid,fastest"], "unknown"), (["--schedules", "grid,balanced"], "need a GPU"),
                         (["--kv", "compressed,fp8"], "unknown ['fp8']")):
    with pytest.raises(SystemExit):
      generate.main(["--models", "tiny-llama3", *flags])
    assert message in capsys.readouterr().err
  with pytest.raises(ValueError, match="lengths"):
    generate.prompt_lengths(2, 8, "zipf", None)

"""The density benchmark on a short prefill of the embedded model: the issue's row schema, both
versions and both RoPE arithmetics; version 2 keeps at least the blocks version 1 keeps."""

import pytest

from benchmarks import density

FIELDS = {"version", "model", "bits_per_value_k", "bits_per_value_v", "bits_per_value"}


@pytest.mark.slow  # 21 s: the embedded model's real KV in both versions (the format tests cover the codec)
def test_density_rows(tmp_path):
  out = tmp_path / "density.json"
  result = density.main(["--tokens", "64", "--out", str(out)])
  rows, alternatives = result["rows"], result["alternatives"]
  assert [(a["rope"], a["kind"]) for a in alternatives] == [("fp32", "k"), ("fp32", "v"), ("bf16", "k"), ("bf16", "v")]
  for a in alternatives:  # each rule keeps at least what the simpler one keeps
    assert a["version1"] <= a["one_exception"] <= a["one_exception_zero_escape"] <= 1
  assert out.exists() and [(r["version"], r["rope"]) for r in rows] == [(1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")]
  for r in rows:
    assert FIELDS <= set(r) and r["tokens"] == 64 and 12.0 < r["bits_per_value"] < 16.1
    assert r["bits_per_value"] == (r["bits_per_value_k"] + r["bits_per_value_v"]) / 2
  for v1, v2 in (rows[0:2], rows[2:4]):
    assert v2["eligible_k"] >= v1["eligible_k"] and v2["eligible_v"] >= v1["eligible_v"]
  # BF16 RoPE changes K (exact zeros), so the two prefills really differ.
  assert rows[2]["bits_per_value_k"] != rows[0]["bits_per_value_k"]

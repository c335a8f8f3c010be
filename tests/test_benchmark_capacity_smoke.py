"""CPU smoke test of the capacity benchmark: JSON schema and a real compression gain."""

from __future__ import annotations

import json

import pytest

from benchmarks import capacity


@pytest.mark.slow  # 18 s on real KV (test_serving's capacity tests cover the accounting)
def test_capacity_json_schema(tmp_path):
  out = tmp_path / "capacity.json"
  capacity.main(["--budget-gib", "0.25", "--real-kv-tokens", "256", "--out", str(out)])
  rows = json.loads(out.read_text())
  assert [r["model"].split()[0] for r in rows] == ["smollm2-135m", "llama3.1-8b"]
  assert "real SmolLM2 K/V of 256 tokens" in rows[0]["model"]
  for r in rows:
    assert set(r) == {"model", "budget_bytes", "tokens_uncompressed", "tokens_compressed", "capacity_ratio"}
    assert r["budget_bytes"] == 1 << 28
    assert 1.1 < r["capacity_ratio"] < 1.33
    assert r["tokens_compressed"] > r["tokens_uncompressed"] > 0

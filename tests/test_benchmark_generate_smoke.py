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

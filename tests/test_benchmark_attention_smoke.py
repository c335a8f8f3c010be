"""The attention benchmark runs end to end on CPU (tiny shape) and writes the issue's JSON schema."""

import json

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

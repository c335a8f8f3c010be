"""Generation through the serving engine: compressed KV gives the same greedy tokens as BF16 KV.

The embedded SmolLM2 model (real weights, real K/V) under both stores, and a tiny random
model under a budget so small that requests wait for each other. The slow tier runs the
issue's full check: several real prompts, 64 new tokens, and again under a tight budget.
"""

import pytest

from zipfusion_jax.generate import parse_args, run

# Greedy continuation of "The capital of France is" by SmolLM2-135M-Instruct (recorded with the
# dense reference backend, tests/test_models_gguf.py): " Paris.\n\nThe answer is:".
FRANCE = [7042, 30, 198, 198, 504, 2988, 314, 42]


def _tokens(argv):
  payload = run(parse_args(argv))
  return [r["token_ids"] for r in payload["results"]], payload["stats"]


def test_embedded_model_compressed_kv_matches_uncompressed_kv():
  argv = ["--prompt", "The capital of France is", "--prompt", "Water boils at", "--max-new-tokens", "20"]
  compressed, stats = _tokens(argv)
  uncompressed, _ = _tokens(argv + ["--kv", "uncompressed"])
  assert compressed == uncompressed
  assert compressed[0][:8] == FRANCE
  assert all(len(t) == 20 for t in compressed)
  # Completed pages were really stored in 12 bits, at the real model's eligibility.
  assert 1.15 < stats["compression_ratio"] < 1.34
  assert 0.6 < stats["eligible_block_fraction"] <= 1.0
  assert stats["compiles"] == {"prefill": 1, "decode": 2}  # two slots: completion widths 0 and 2


@pytest.mark.slow  # a third embedded-model run (~45 s); format 2 is in the default tier through the tiny model
def test_embedded_model_format_version_2_gives_the_same_tokens_with_more_blocks_in_12_bits():
  argv = ["--prompt", "The capital of France is", "--prompt", "Water boils at", "--max-new-tokens", "20"]
  compressed, stats = _tokens(argv)
  v2, v2_stats = _tokens(argv + ["--format-version", "2"])
  assert v2 == compressed and v2_stats["format_version"] == 2
  assert v2_stats["eligible_block_fraction"] > stats["eligible_block_fraction"]


@pytest.mark.parametrize("kv", [["compressed"], ["uncompressed"], ["compressed", "--format-version", "2"]])
def test_tight_budget_makes_requests_wait_without_changing_tokens(kv):
  argv = ["--model", "tiny-llama3", "--random-weights", "--max-new-tokens", "60", "--max-batch", "4", "--kv", *kv]
  for p in ("abc", "hello there", "zzzz zz", "the quick brown fox", "12345", "jax pallas"):
    argv += ["--prompt", p]
  free, free_stats = _tokens(argv)
  tight, tight_stats = _tokens(argv + ["--kv-memory-mib", "0.27"])
  assert tight == free
  assert tight_stats["kv_store_bytes"] < free_stats["kv_store_bytes"] / 2
  assert tight_stats["steps"] > free_stats["steps"]  # someone waited for room


@pytest.mark.slow
def test_embedded_model_64_tokens_several_prompts_and_a_tight_budget():
  prompts = ["The capital of France is", "Photosynthesis is the process", "def fibonacci(n):",
             "Once upon a time, in a small village,"]
  argv = [a for p in prompts for a in ("--prompt", p)] + ["--max-new-tokens", "64"]
  reference, _ = _tokens(argv + ["--kv", "uncompressed"])
  compressed, _ = _tokens(argv)
  assert compressed == reference
  tight, stats = _tokens(argv + ["--kv-memory-mib", "6.5"])
  assert tight == reference
  assert stats["kv_store_bytes"] <= 6.5 * 2**20

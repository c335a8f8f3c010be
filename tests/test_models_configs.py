"""Named model configurations carry the real shapes."""

import pytest

from models import get_config
from zipfusion_jax.format import layout


@pytest.mark.parametrize("name, kv_heads, head_dim", [("smollm2-135m", 3, 64), ("llama3.1-8b", 8, 128), ("qwen3-8b", 8, 128)])
def test_real_shapes_and_supported_head_dims(name, kv_heads, head_dim):
  c = get_config(name)
  assert (c.kv_heads, c.head_dim) == (kv_heads, head_dim)
  assert layout.blocks_per_page(c.head_dim) == head_dim // 32


def test_llama_kv_bytes_per_token():
  assert get_config("llama3.1-8b").kv_bytes_per_token() == 131072  # 128 KiB of BF16 per token


def test_unknown_model_is_a_clear_error():
  with pytest.raises(ValueError, match="known"):
    get_config("gpt-5")


def test_non_positive_sizes_are_refused():
  import dataclasses

  for field in ("kv_heads", "layers", "head_dim"):  # kv_heads=0 used to raise ZeroDivisionError
    with pytest.raises(ValueError, match=f"sizes must be positive.*{field}"):
      dataclasses.replace(get_config("tiny-llama3"), **{field: 0})

"""Named decoder configurations: the real shapes of the models this library serves."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes of a Llama-3.1 / Qwen3-style decoder.

  Attributes:
    name: registry key.
    layers, hidden, intermediate, vocab: transformer sizes.
    q_heads, kv_heads, head_dim: attention heads (grouped-query when kv_heads < q_heads).
    rope_theta: RoPE base; qk_norm: Qwen3's per-head RMSNorm on q and k.
  """

  name: str
  layers: int
  hidden: int
  intermediate: int
  vocab: int
  q_heads: int
  kv_heads: int
  head_dim: int
  rope_theta: float
  rms_eps: float = 1e-5
  qk_norm: bool = False
  tie_embeddings: bool = False

  def __post_init__(self):
    if self.q_heads % self.kv_heads:
      raise ValueError(f"{self.name}: q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}")

  def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
    """K plus V bytes of one token over all layers."""
    return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("smollm2-135m", 30, 576, 1536, 49152, 9, 3, 64, 100000.0, tie_embeddings=True),
        ModelConfig("llama3.1-8b", 32, 4096, 14336, 128256, 32, 8, 128, 500000.0),
        ModelConfig("qwen3-8b", 36, 4096, 12288, 151936, 32, 8, 128, 1000000.0, rms_eps=1e-6, qk_norm=True),
    )
}


def get_config(name: str) -> ModelConfig:
  try:
    return CONFIGS[name]
  except KeyError:
    raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}") from None

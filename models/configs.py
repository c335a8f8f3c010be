"""Named decoder configurations: the real shapes of the models this library serves."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1 RoPE frequency scaling ("rope_type": "llama3" in a Hugging Face config.json).

  Wavelengths longer than `original_max_position / low_freq_factor` are divided by `factor`,
  shorter than `original_max_position / high_freq_factor` kept, the band between interpolated.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    if not (self.factor >= 1.0 and 0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position > 0):
      raise ValueError(f"invalid Llama-3.1 rope scaling {self}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes of a Llama-3.1 / Qwen3-style decoder.

  Attributes:
    name: registry key.
    layers, hidden, intermediate, vocab: transformer sizes.
    q_heads, kv_heads, head_dim: attention heads (grouped-query when kv_heads < q_heads);
      q_heads * head_dim need not equal hidden (Qwen3).
    rope_theta: RoPE base; rope_scaling: Llama-3.1 frequency scaling, or None.
    rms_eps: RMSNorm epsilon; qk_norm: Qwen3's per-head RMSNorm on q and k.
    tie_embeddings: the LM head is the transposed token embedding.
    max_position: context length (longest prompt plus generated tokens).
    tp_axis: set only on the per-shard config that tensor parallelism runs inside `shard_map`
      (`zipfusion_jax.serving.tensor_parallel`): heads and the MLP width are this shard's, and the
      partial sums of the attention output projection and of the MLP down projection are
      all-reduced over this mesh axis. None: one device.
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
  rope_scaling: RopeScaling | None = None
  max_position: int = 8192
  tp_axis: str | None = None

  def __post_init__(self):
    sizes = dict(layers=self.layers, hidden=self.hidden, intermediate=self.intermediate, vocab=self.vocab,
                 q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim, max_position=self.max_position)
    bad = {k: v for k, v in sizes.items() if not v > 0}
    if bad:
      raise ValueError(f"{self.name}: sizes must be positive, got {bad}")
    if self.q_heads % self.kv_heads:
      raise ValueError(f"{self.name}: q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"{self.name}: head_dim={self.head_dim} must be even for RoPE")

  def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
    """K plus V bytes of one token over all layers."""
    return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("smollm2-135m", 30, 576, 1536, 49152, 9, 3, 64, 100000.0, tie_embeddings=True),
        ModelConfig(
            "llama3.1-8b", 32, 4096, 14336, 128256, 32, 8, 128, 500000.0, rope_scaling=RopeScaling(), max_position=131072
        ),
        ModelConfig("qwen3-8b", 36, 4096, 12288, 151936, 32, 8, 128, 1000000.0, rms_eps=1e-6, qk_norm=True, max_position=40960),
        # Tiny test shapes (random weights): Llama-3.1 style with a scaling band that bites at this size,
        # and Qwen3 style with q/k norms and tied embeddings. head_dim 64 so the paged format accepts them;
        # vocab 320 holds every byte (the byte tokenizer of `--random-weights`).
        ModelConfig(
            "tiny-llama3", 2, 96, 192, 320, 4, 2, 64, 10000.0,
            rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64),
            max_position=256,
        ),
        ModelConfig(
            "tiny-qwen3", 2, 96, 160, 320, 6, 2, 64, 1000000.0, rms_eps=1e-6, qk_norm=True, tie_embeddings=True,
            max_position=256,
        ),
    )
}


def get_config(name: str) -> ModelConfig:
  try:
    return CONFIGS[name]
  except KeyError:
    raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}") from None

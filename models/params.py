"""Decoder weights as a frozen pytree of BF16 arrays (no Flax modules: pure functions read them).

Linear weights are stored [in, out] so a layer computes `x @ w`. Loaders (GGUF, safetensors)
and `random_params` all produce this one layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, BFloat16

from models.configs import ModelConfig


@struct.dataclass
class LayerParams:
  """One decoder block. H = hidden, Q = q_heads * head_dim, K = kv_heads * head_dim, I = intermediate.

  Attributes:
    attn_norm: [H] RMSNorm scale before attention.
    wq: [H, Q]; wk, wv: [H, K]; wo: [Q, H]. Heads are contiguous head_dim columns (Hugging Face order).
    q_norm, k_norm: [head_dim] Qwen3 per-head RMSNorm scales, None for Llama.
    mlp_norm: [H] RMSNorm scale before the SwiGLU MLP.
    w_gate, w_up: [H, I]; w_down: [I, H].
  """

  attn_norm: BFloat16[Array, "H"]
  wq: BFloat16[Array, "H Q"]
  wk: BFloat16[Array, "H K"]
  wv: BFloat16[Array, "H K"]
  wo: BFloat16[Array, "Q H"]
  q_norm: BFloat16[Array, "D"] | None
  k_norm: BFloat16[Array, "D"] | None
  mlp_norm: BFloat16[Array, "H"]
  w_gate: BFloat16[Array, "H I"]
  w_up: BFloat16[Array, "H I"]
  w_down: BFloat16[Array, "I H"]


@struct.dataclass
class DecoderParams:
  """All weights. V = vocab.

  Attributes:
    embed: [V, H] token embedding.
    layers: one LayerParams per block (a tuple, so the layer loop unrolls with Python ints).
    final_norm: [H] RMSNorm scale before the LM head.
    lm_head: [H, V], or None when the embedding is tied (logits = h @ embed.T).
  """

  embed: BFloat16[Array, "V H"]
  layers: tuple[LayerParams, ...]
  final_norm: BFloat16[Array, "H"]
  lm_head: BFloat16[Array, "H V"] | None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shape of every LayerParams field for `config` (loaders check against it)."""
  h, q, k, i = config.hidden, config.q_heads * config.head_dim, config.kv_heads * config.head_dim, config.intermediate
  shapes = dict(attn_norm=(h,), wq=(h, q), wk=(h, k), wv=(h, k), wo=(q, h), mlp_norm=(h,), w_gate=(h, i), w_up=(h, i), w_down=(i, h))
  if config.qk_norm:
    shapes.update(q_norm=(config.head_dim,), k_norm=(config.head_dim,))
  return shapes


def random_params(config: ModelConfig, key: jax.Array) -> DecoderParams:
  """Random BF16 weights with O(1) activations (fan-in scaled), for tests and `--random-weights`."""
  def normal(k, shape, scale):
    return (scale * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)

  def norm_scale(k, shape):
    return (1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)

  key_embed, key_head, key_norm, *layer_keys = jax.random.split(key, 3 + config.layers)
  layers = []
  for lk in layer_keys:
    fields = {}
    for (name, shape), k in zip(expected_shapes(config).items(), jax.random.split(lk, 11)):
      fields[name] = norm_scale(k, shape) if len(shape) == 1 else normal(k, shape, shape[0] ** -0.5)
    fields.setdefault("q_norm", None)
    fields.setdefault("k_norm", None)
    layers.append(LayerParams(**fields))
  return DecoderParams(
      embed=normal(key_embed, (config.vocab, config.hidden), 1.0),
      layers=tuple(layers),
      final_norm=norm_scale(key_norm, (config.hidden,)),
      lm_head=None if config.tie_embeddings else normal(key_head, (config.hidden, config.vocab), config.hidden**-0.5),
  )

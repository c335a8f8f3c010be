"""Decoder building blocks shared by prefill and decode: RMSNorm, RoPE, projections, SwiGLU.

Precision: BF16 weights and activations, fp32 accumulation in every matmul, fp32 RMSNorm.
RoPE is computed in fp32 from fp32 angles and rounded to BF16 once: a BF16 elementwise rotation
rounds each product separately and produces exact zeros in K.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, BFloat16, Float32, Int32

from models.configs import ModelConfig, RopeScaling
from models.params import DecoderParams, LayerParams


def rms_norm(x: Array, scale: Array, eps: float) -> BFloat16[Array, "..."]:
  """x [..., N] normalised over N in fp32, times scale [N], rounded to BF16."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * scale.astype(jnp.float32)).astype(jnp.bfloat16)


def linear(x: BFloat16[Array, "... I"], w: BFloat16[Array, "I O"]) -> BFloat16[Array, "... O"]:
  """x @ w with fp32 accumulation, rounded to BF16."""
  return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def row_parallel_linear(x: BFloat16[Array, "... I"], w: BFloat16[Array, "I O"], config: ModelConfig) -> BFloat16[Array, "... O"]:
  """`linear` whose input features may be split over `config.tp_axis`: fp32 partial sums are
  all-reduced before the one rounding to BF16 (so tensor parallelism rounds as one device does)."""
  y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
  if config.tp_axis is not None:
    y = jax.lax.psum(y, config.tp_axis)
  return y.astype(jnp.bfloat16)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """float32 [head_dim // 2] inverse frequencies, with Llama-3.1 scaling when given (HF `llama3` rule)."""
  inv = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)
  if scaling is None:
    return inv
  wavelen = 2 * math.pi / inv
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: BFloat16[Array, "T N D"], positions: Int32[Array, "T"], config: ModelConfig
) -> BFloat16[Array, "T N D"]:
  """Rotate-half RoPE (Hugging Face layout: pairs are (i, i + D/2)), fp32 math, one BF16 rounding."""
  inv = jnp.asarray(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
  angles: Float32[Array, "T half"] = positions.astype(jnp.float32)[:, None] * inv[None, :]
  cos = jnp.cos(angles)[:, None, :]
  sin = jnp.sin(angles)[:, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(jnp.bfloat16)


def qkv(
    layer: LayerParams, x: BFloat16[Array, "T H"], positions: Int32[Array, "T"], config: ModelConfig
) -> tuple[BFloat16[Array, "T Hq D"], BFloat16[Array, "T Hkv D"], BFloat16[Array, "T Hkv D"]]:
  """Normed input -> RoPE'd q [T, Hq, D], RoPE'd k [T, Hkv, D], v [T, Hkv, D] (Qwen3 q/k norms before RoPE)."""
  t = x.shape[0]
  q = linear(x, layer.wq).reshape(t, config.q_heads, config.head_dim)
  k = linear(x, layer.wk).reshape(t, config.kv_heads, config.head_dim)
  v = linear(x, layer.wv).reshape(t, config.kv_heads, config.head_dim)
  if config.qk_norm:
    q = rms_norm(q, layer.q_norm, config.rms_eps)
    k = rms_norm(k, layer.k_norm, config.rms_eps)
  return apply_rope(q, positions, config), apply_rope(k, positions, config), v


def attention_inputs(
    layer: LayerParams, h: BFloat16[Array, "T H"], positions: Int32[Array, "T"], config: ModelConfig
) -> tuple[BFloat16[Array, "T Hq D"], BFloat16[Array, "T Hkv D"], BFloat16[Array, "T Hkv D"]]:
  """First half of a block: RMSNorm of the residual stream, then RoPE'd q, k and v."""
  return qkv(layer, rms_norm(h, layer.attn_norm, config.rms_eps), positions, config)


def block_output(
    layer: LayerParams, h: BFloat16[Array, "T H"], o: BFloat16[Array, "T Hq D"], config: ModelConfig
) -> BFloat16[Array, "T H"]:
  """Second half of a block: output projection of the attention o, residual add, SwiGLU MLP, residual add."""
  h = h + row_parallel_linear(o.reshape(o.shape[0], -1), layer.wo, config)
  return h + mlp(layer, rms_norm(h, layer.mlp_norm, config.rms_eps), config)


def mlp(layer: LayerParams, x: BFloat16[Array, "T H"], config: ModelConfig) -> BFloat16[Array, "T H"]:
  """SwiGLU: down(silu(gate(x)) * up(x)), the product in fp32 (the down projection row-parallel)."""
  gate = jnp.matmul(x, layer.w_gate, preferred_element_type=jnp.float32)
  up = jnp.matmul(x, layer.w_up, preferred_element_type=jnp.float32)
  return row_parallel_linear((jax.nn.silu(gate) * up).astype(jnp.bfloat16), layer.w_down, config)


def embed(params: DecoderParams, tokens: Int32[Array, "T"]) -> BFloat16[Array, "T H"]:
  return params.embed[tokens]


def logits(params: DecoderParams, h: BFloat16[Array, "T H"], config: ModelConfig) -> Float32[Array, "T V"]:
  """Final RMSNorm and LM head (tied: the embedding transposed), fp32 accumulation and output."""
  x = rms_norm(h, params.final_norm, config.rms_eps)
  if params.lm_head is None:
    return jnp.einsum("th,vh->tv", x, params.embed, preferred_element_type=jnp.float32)
  return jnp.matmul(x, params.lm_head, preferred_element_type=jnp.float32)

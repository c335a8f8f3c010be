"""A straightforward fp32 forward pass over a whole sequence (no cache): the spec the decoder is tested against.

Weights are upcast to float32 and every step runs in float32, written out independently of
`models.layers` (explicit GQA repeat, explicit causal mask, its own RoPE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float32, Int32

from models.configs import ModelConfig
from models.layers import rope_inv_freq
from models.params import DecoderParams


def _norm(x, w, eps):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def _rope(x, inv_freq):
  t, half = x.shape[0], x.shape[-1] // 2
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * jnp.concatenate([cos, cos], -1) + rotated * jnp.concatenate([sin, sin], -1)


def forward_reference(params: DecoderParams, config: ModelConfig, tokens: Int32[Array, "T"]) -> Float32[Array, "T V"]:
  """Logits of every position of `tokens` under causal attention, all in float32."""
  f32 = lambda a: a.astype(jnp.float32)
  t, d = tokens.shape[0], config.head_dim
  inv_freq = jnp.asarray(rope_inv_freq(d, config.rope_theta, config.rope_scaling))
  causal = jnp.tril(jnp.ones((t, t), bool))
  h = f32(params.embed)[tokens]
  for layer in params.layers:
    x = _norm(h, layer.attn_norm, config.rms_eps)
    q = (x @ f32(layer.wq)).reshape(t, config.q_heads, d)
    k = (x @ f32(layer.wk)).reshape(t, config.kv_heads, d)
    v = (x @ f32(layer.wv)).reshape(t, config.kv_heads, d)
    if config.qk_norm:
      q, k = _norm(q, layer.q_norm, config.rms_eps), _norm(k, layer.k_norm, config.rms_eps)
    q, k = _rope(q, inv_freq), _rope(k, inv_freq)
    group = config.q_heads // config.kv_heads
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # q head i reads kv head i // group
    s = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(jnp.float32(d))
    p = jax.nn.softmax(jnp.where(causal[None], s, -jnp.inf), axis=-1)
    o = jnp.einsum("hqk,khd->qhd", p, v).reshape(t, -1)
    h = h + o @ f32(layer.wo)
    x = _norm(h, layer.mlp_norm, config.rms_eps)
    h = h + (jax.nn.silu(x @ f32(layer.w_gate)) * (x @ f32(layer.w_up))) @ f32(layer.w_down)
  x = _norm(h, params.final_norm, config.rms_eps)
  head = f32(params.embed).T if params.lm_head is None else f32(params.lm_head)
  return x @ head

"""Llama-3.1 / Qwen3 decoder: pure functions over a `DecoderParams` pytree (no NNX or Linen modules).

`prefill` runs dense causal attention over one prompt and hands each layer's K/V to the backend;
`decode` runs one token per slot with attention done by the backend (`kv_ops.KVBackend`). Both unroll
the layer loop in Python (layer is a Python int) so each compiles to one program; `prefill_jit` and
`decode_jit` are the jitted entry points (config and backend static, KV state donated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Float32, Int32

from models import layers as nn
from models.configs import ModelConfig
from models.params import DecoderParams
from zipfusion_jax.kv_ops import KVBackend, Plan, State


def causal_attention(
    q: BFloat16[Array, "T Hq D"], k: BFloat16[Array, "T Hkv D"], v: BFloat16[Array, "T Hkv D"]
) -> BFloat16[Array, "T Hq D"]:
  """Dense causal GQA attention of a (padded) prompt; fp32 logits and softmax.

  Causal masking alone suffices: padding rows sit after every real row. On GPU the cuDNN fused
  kernel is tried first; the shapes, dtypes or cuDNN versions it refuses (at trace time) fall back
  to XLA, which is also the CPU path.
  """
  if jax.default_backend() == "gpu":
    try:
      return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation="cudnn")[0]
    except (ValueError, NotImplementedError, RuntimeError):
      pass
  return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation="xla")[0]


def prefill(
    params: DecoderParams,
    config: ModelConfig,
    tokens: Int32[Array, "T"],
    length: Int32[Array, ""],
    kv_state: State,
    plan: Plan,
    backend: KVBackend,
) -> tuple[Float32[Array, "V"], State]:
  """Run a prompt (padded to T; the first `length` tokens are real) through the decoder.

  Returns:
    logits: float32 [V] of the last real token; kv_state with the prompt written by
    `backend.prefill_layer` into `plan.prefill_slot`.
  """
  positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
  h = nn.embed(params, tokens)
  for i, layer in enumerate(params.layers):
    q, k, v = nn.attention_inputs(layer, h, positions, config)
    kv_state = backend.prefill_layer(kv_state, i, plan, k, v)
    o = causal_attention(q, k, v)
    h = nn.block_output(layer, h, o, config)
  last = jax.lax.dynamic_slice_in_dim(h, length - 1, 1, axis=0)
  return nn.logits(params, last, config)[0], kv_state


def decode(
    params: DecoderParams,
    config: ModelConfig,
    tokens: Int32[Array, "S"],
    kv_state: State,
    plan: Plan,
    backend: KVBackend,
) -> tuple[Float32[Array, "S V"], State]:
  """One new token per slot at `plan.positions`; attention over the cache by `backend.decode_layer`.

  Returns:
    logits: float32 [S, V] (rows of inactive slots are meaningless); kv_state after `backend.end_step`.
  """
  h = nn.embed(params, tokens)
  for i, layer in enumerate(params.layers):
    q, k, v = nn.attention_inputs(layer, h, plan.positions, config)
    o, kv_state = backend.decode_layer(kv_state, i, plan, q, k, v)
    h = nn.block_output(layer, h, o, config)
  return nn.logits(params, h, config), backend.end_step(kv_state, plan)


prefill_jit = jax.jit(prefill, static_argnames=("config", "backend"), donate_argnames=("kv_state",))
decode_jit = jax.jit(decode, static_argnames=("config", "backend"), donate_argnames=("kv_state",))

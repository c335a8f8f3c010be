"""A deterministic stand-in decoder for the engine's tests and benchmarks.

It speaks the `kv_ops` contract like the real Flax decoder will (per layer:
q/k/v -> `backend.prefill_layer` / `decode_layer`, then `end_step`), but
its K/V and tokens are integer hashes of (token, position, layer, head, dim):

* a token's K/V never depend on the batch or on what else is cached, so a
  request's KV is the same alone, batched, or recomputed after preemption;
* the host can rebuild any sequence's KV bit for bit (`kv_bits(np, ...)`),
  which is the shadow dense copy the invariant checker compares against;
* values look like real BF16 KV to the block rule: per-block exponents spread
  geometrically below a per-layer maximum, and rare outliers 24 binades down
  make about 12% of K blocks and 6% of V blocks raw in layers 0, 3, 6, ...
  (SmolLM2 measured 12.3% and 7.2%, benchmarks/synthetic_kv.py); outliers are
  twice as frequent in layers 1, 4, ... and four times in 2, 5, ..., so
  layers fill the store at different rates.

The decode step's `aux` is float32 [S]: the sum of each slot's attention
output over layers and heads, so attention is computed (not dead code) and
tests can check it against dense attention over the shadow copy.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from zipfusion_jax.serving.state import ServingConfig

_K, _V, _Q, _TOKEN = 0, 1, 2, 3
OUTLIER_LOG2 = (12, 13, 13)  # per kind (K, V, Q): an outlier with probability 2^-n per value in layer 0


def _mix(xp, *words):
  """uint32 hash of integer arrays (broadcast), the same in numpy and jnp (wrapping products)."""
  if xp is np:
    with np.errstate(over="ignore"):
      return _mix_words(xp, words)
  return _mix_words(xp, words)


def _mix_words(xp, words):
  h = xp.asarray(0x9E3779B9, dtype=xp.uint32)
  for w in words:
    h = h ^ xp.asarray(w).astype(xp.uint32)
    h = (h * xp.uint32(0x85EBCA6B)) & xp.uint32(0xFFFFFFFF)
    h = h ^ (h >> xp.uint32(13))
    h = (h * xp.uint32(0xC2B2AE35)) & xp.uint32(0xFFFFFFFF)
    h = h ^ (h >> xp.uint32(16))
  return h


def _trailing_zeros(xp, x, limit):
  tz = xp.zeros(x.shape, xp.uint32)
  for k in range(1, limit + 1):
    tz = tz + ((x & xp.uint32((1 << k) - 1)) == 0).astype(xp.uint32)
  return tz


def value_bits(xp, seed, tokens, positions, layer, kind, heads, head_dim):
  """uint16 [n, heads, head_dim] BF16 bit patterns of one kind (K, V or Q) for n tokens."""
  t = xp.asarray(tokens)[:, None, None]
  p = xp.asarray(positions)[:, None, None]
  h_ = xp.arange(heads)[None, :, None]
  d = xp.arange(head_dim)[None, None, :]
  h = _mix(xp, seed, t, p, layer, kind, h_, d)
  sign = (h >> xp.uint32(31)) << xp.uint32(15)
  frac = (h >> xp.uint32(8)) & xp.uint32(0x7F)
  drop = _trailing_zeros(xp, h & xp.uint32(0xFFF), 12)
  outlier = _trailing_zeros(xp, (h >> xp.uint32(12)) & xp.uint32(0x7FFF), 15) >= OUTLIER_LOG2[kind] - layer % 3
  e = xp.uint32(120 + layer % 5) - drop - outlier.astype(xp.uint32) * xp.uint32(24)
  return (sign | (e << xp.uint32(7)) | frac).astype(xp.uint16)


def next_tokens(xp, seed, tokens, positions, vocab):
  return (_mix(xp, seed, _TOKEN, tokens, positions) % xp.uint32(vocab)).astype(xp.int32)


def _bf16(bits):
  return lax.bitcast_convert_type(bits, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class StandInDecoder:
  """Deterministic decoder with the real one's interface (no parameters: `params` is ignored).

  Attributes:
    cfg: serving geometry (layers, KV heads, head dim).
    q_heads: query heads (a multiple of the KV heads).
    vocab: token ids are in [0, vocab).
    seed: changes every K/V/Q value and token.
  """

  cfg: ServingConfig
  q_heads: int = 0
  vocab: int = 1000
  seed: int = 0

  def __post_init__(self):
    if self.q_heads == 0:
      object.__setattr__(self, "q_heads", self.cfg.num_kv_heads)

  def kv_bits(self, xp, tokens, positions, layer):
    """(k, v) uint16 [n, Hkv, D]: the exact K/V bits of tokens at positions in a layer."""
    cfg = self.cfg
    return tuple(
        value_bits(xp, self.seed, tokens, positions, layer, kind, cfg.num_kv_heads, cfg.head_dim) for kind in (_K, _V)
    )

  def q_bits(self, xp, tokens, positions, layer):
    return value_bits(xp, self.seed, tokens, positions, layer, _Q, self.q_heads, self.cfg.head_dim)

  def prefill(self, params, backend, state, plan, tokens):
    """tokens int32 [T] (padded) -> (next token int32 [], state)."""
    del params
    positions = jnp.arange(tokens.shape[0])
    for layer in range(self.cfg.num_layers):
      k, v = self.kv_bits(jnp, tokens, positions, layer)
      state = backend.prefill_layer(state, layer, plan, _bf16(k), _bf16(v))
    state = backend.end_step(state, plan)
    last = plan.prefill_length - 1
    return next_tokens(jnp, self.seed, tokens[last], last, self.vocab), state

  def decode(self, params, backend, state, plan, tokens):
    """tokens int32 [S] -> (next tokens int32 [S], aux float32 [S], state)."""
    del params
    aux = jnp.zeros(tokens.shape, jnp.float32)
    for layer in range(self.cfg.num_layers):
      k, v = self.kv_bits(jnp, tokens, plan.positions, layer)
      q = self.q_bits(jnp, tokens, plan.positions, layer)
      o, state = backend.decode_layer(state, layer, plan, _bf16(q), _bf16(k), _bf16(v))
      aux = aux + jnp.sum(o.astype(jnp.float32), axis=(1, 2))
    state = backend.end_step(state, plan)
    return next_tokens(jnp, self.seed, tokens, plan.positions, self.vocab), aux, state

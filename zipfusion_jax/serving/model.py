"""The Flax decoder (`models/decoder.py`) as the serving engine's model.

`Engine` wants `prefill(params, backend, state, plan, tokens) -> (next, state)`
and `decode(params, backend, state, plan, tokens) -> (next, aux, state)` with
the next token chosen on the device, so that a step reads back token ids, not
logits. Greedy by default; with a temperature each token is sampled (optionally
within top_k / top_p: `models.sampling.Sampling`) from a key derived from (seed,
position), so a request's tokens do not depend on which slot it runs in or what
shares its steps (the engine may preempt and recompute).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import decoder
from models.configs import ModelConfig
from models.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class ModelDecoder:
  """Hashable adapter (the engine's jitted steps close over it).

  Attributes:
    config: the decoder's shapes.
    temperature: 0 = greedy argmax; else softmax(logits / temperature) sampling.
    seed: sampling seed.
    top_k, top_p: with a temperature, sample among the top_k most likely tokens (0: all) and the
      fewest whose probability reaches top_p (1: all).
  """

  config: ModelConfig
  temperature: float = 0.0
  seed: int = 0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    self.sampling  # validates the sampling fields at construction

  @property
  def sampling(self) -> Sampling:
    return Sampling(self.temperature, self.top_k, self.top_p)

  def _pick(self, logits, positions):
    """logits float32 [..., V] -> token int32 [...] (positions: of the token being generated)."""
    base = jax.random.key(self.seed)
    keys = jax.vmap(lambda p: jax.random.fold_in(base, p))(jnp.atleast_1d(positions))
    tok = self.sampling.pick(jnp.atleast_2d(logits), keys)
    return tok.reshape(jnp.shape(positions))

  def prefill(self, params, backend, state, plan, tokens):
    """tokens int32 [T] (padded) -> (next token int32 [], state)."""
    logits, state = decoder.prefill(params, self.config, tokens, plan.prefill_length, state, plan, backend)
    state = backend.end_step(state, plan)
    return self._pick(logits, plan.prefill_length), state

  def decode(self, params, backend, state, plan, tokens):
    """tokens int32 [S] -> (next int32 [S], aux float32 [S] = the chosen token's logit, state)."""
    logits, state = decoder.decode(params, self.config, tokens, state, plan, backend)
    nxt = self._pick(logits, plan.positions + 1)
    aux = jnp.take_along_axis(logits, nxt[:, None], axis=-1)[:, 0]
    return nxt, aux, state

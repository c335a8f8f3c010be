"""Token choice from logits: greedy, or temperature sampling restricted to the top k tokens and / or
the smallest set of tokens whose probability reaches top_p (nucleus). The serving engine's model
adapter and the dense reference generator apply this one rule (each derives its own random keys:
greedy outputs agree, sampled ones need not).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a token is picked (hashable: jitted functions close over it).

  Attributes:
    temperature: 0 = greedy argmax; else softmax(logits / temperature) sampling.
    top_k: sample among the k most likely tokens only (0 = all); tokens tied with the k-th are kept.
    top_p: sample among the fewest most likely tokens whose probability sums to >= top_p (1 = all);
      with top_k too, top_p applies to the top_k tokens' renormalised probabilities.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not (self.temperature >= 0 and math.isfinite(self.temperature)):
      raise ValueError(f"temperature={self.temperature} must be finite and >= 0")
    if self.top_k != int(self.top_k) or self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be an integer >= 0 (0: no limit)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

  def restrict(self, logits: jax.Array) -> jax.Array:
    """logits float32 [..., V] / temperature, with the tokens outside top_k / top_p set to -inf
    (sampling only: greedy picks need no restriction)."""
    if self.temperature == 0:
      raise ValueError("restrict() is for sampling (temperature > 0); greedy takes the argmax")
    logits = logits.astype(jnp.float32)
    # Shift by the row's maximum first: a tiny temperature then sends the others to -inf, not the
    # maximum to +inf (inf - inf would make NaN probabilities); a subnormal one is raised to the
    # smallest normal float32 (flushed to zero it would divide 0 by 0).
    temperature = max(self.temperature, float(jnp.finfo(jnp.float32).tiny))
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    if self.top_k and self.top_k < logits.shape[-1]:
      kth = jax.lax.top_k(logits, int(self.top_k))[0][..., -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1:
      ordered = jnp.sort(logits, axis=-1)[..., ::-1]
      probs = jax.nn.softmax(ordered, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
      kept = before < self.top_p  # the first token always stays
      threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
      logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits

  def pick(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
    """logits float32 [N, V], keys [N] (one per row) -> token int32 [N]."""
    if self.temperature == 0.0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    restricted = self.restrict(logits)
    return jax.vmap(jax.random.categorical)(keys, restricted).astype(jnp.int32)

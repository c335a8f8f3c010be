"""Random weights whose own KV has the embedded model's real-KV block statistics.

Random-weight projections give Gaussian-like K and V: about 95% of 512-value blocks fit the
12-bit window, against 87.7% (K) and 92.8% (V) measured on the embedded SmolLM2's real KV with
fp32 RoPE (`python -m zipfusion_jax.kvstats`). Real models fail blocks through outlier channels
(one channel far above the rest of its block), so that is what `real_kv_params` plants: in a
chosen share of (layer, KV head) pairs it scales one K rotary pair of output columns of `wk`
(both halves: RoPE mixes them, and each lands in its own block of every page) and one output
column of `wv`. The share is solved from the model's own eligibility on a short random prompt,
measured before and after, so e2e runs can report the fraction they ran at.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.capacity import SMOLLM2_ELIGIBLE
from models.configs import ModelConfig
from models.params import DecoderParams
from zipfusion_jax.kvstats import prompt_kv
from zipfusion_jax.telemetry import eligibility_report

REAL_KV_ELIGIBLE = SMOLLM2_ELIGIBLE  # the embedded model's real KV, fp32 RoPE
OUTLIER_SCALE = 64.0  # x2^6: lifts the block's top exponent past the 16-wide window


@dataclasses.dataclass(frozen=True)
class PlantedKV:
  """What `real_kv_params` did: eligible fractions before / after and the planted head shares."""

  before: dict[str, float]
  after: dict[str, float]
  head_share: dict[str, float]


def measured_eligibility(params: DecoderParams, config: ModelConfig, tokens: int, seed: int = 0) -> dict[str, float]:
  """Eligible-block fraction of the model's K and V over a random prompt of `tokens` tokens."""
  ids = np.random.default_rng(seed).integers(0, config.vocab, tokens).tolist()
  k, v = prompt_kv(params, config, ids)
  return {"k": eligibility_report(k, "k").overall_eligible_fraction,
          "v": eligibility_report(v, "v").overall_eligible_fraction}


def head_share(base: float, target: float, blocks_hit: int, blocks_per_page: int) -> float:
  """Share of (layer, head) pairs to plant so that `base` eligibility drops to about `target`.

  A planted head loses `blocks_hit` of its `blocks_per_page` blocks per page (they go raw);
  the rest keep `base`: target = base * (1 - share * blocks_hit / blocks_per_page).
  """
  if target >= base:
    return 0.0
  return min(1.0, (1.0 - target / base) * blocks_per_page / blocks_hit)


def plant(params: DecoderParams, config: ModelConfig, key: jax.Array, share: dict[str, float],
          scale: float = OUTLIER_SCALE) -> DecoderParams:
  """Scale one K rotary pair (dims d, d + D/2 of `wk`) and one V channel in the chosen heads.

  Exactly round(share * layers * kv_heads) (layer, head) pairs each (at least one for a positive
  share), drawn without replacement; the channel within the head is random (K: d < D/2, so its
  pair partner is d + D/2).
  """
  d, pairs = config.head_dim, config.layers * config.kv_heads
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
  masks = {}
  for kind in ("k", "v"):
    mask = np.ones((config.layers, config.kv_heads * d), np.float32)
    count = max(1, int(round(share[kind] * pairs))) if share[kind] > 0 else 0
    for flat in rng.choice(pairs, count, replace=False):
      layer, head = divmod(int(flat), config.kv_heads)
      channel = int(rng.integers(0, d // 2 if kind == "k" else d))
      cols = [channel, channel + d // 2] if kind == "k" else [channel]
      mask[layer, [head * d + c for c in cols]] = scale
    masks[kind] = mask

  def scaled(w, layer, kind):
    return (w.astype(jnp.float32) * jnp.asarray(masks[kind][layer])).astype(w.dtype)

  layers = tuple(lp.replace(wk=scaled(lp.wk, i, "k"), wv=scaled(lp.wv, i, "v")) for i, lp in enumerate(params.layers))
  return params.replace(layers=layers)


def real_kv_params(params: DecoderParams, config: ModelConfig, key: jax.Array, *, tokens: int = 256,
                   target: dict[str, float] = REAL_KV_ELIGIBLE, rounds: int = 3) -> tuple[DecoderParams, PlantedKV]:
  """`params` with outlier channels planted so the model's KV is about `target` eligible.

  The first share comes from `head_share`; each further round rescales it by the drop still
  missing (not every planted block goes raw, and the head count rounds), up to `rounds` plants.
  """
  blocks_per_page = config.head_dim // 32
  before = measured_eligibility(params, config, tokens)
  hit = {"k": min(2, blocks_per_page), "v": 1}
  share = {kind: head_share(before[kind], target[kind], hit[kind], blocks_per_page) for kind in hit}
  wanted = {kind: before[kind] - target[kind] for kind in hit}
  for round_ in range(rounds):
    planted = plant(params, config, key, share)
    after = measured_eligibility(planted, config, tokens)
    close = all(abs(after[kind] - target[kind]) <= 0.01 or wanted[kind] <= 0 for kind in hit)
    if close or round_ == rounds - 1:
      return planted, PlantedKV(before=before, after=after, head_share=share)
    got = {kind: before[kind] - after[kind] for kind in hit}
    share = {kind: share[kind] if wanted[kind] <= 0 else
             min(1.0, share[kind] * wanted[kind] / got[kind]) if got[kind] > 0 else min(1.0, 2 * share[kind])
             for kind in hit}
  raise ValueError(f"{rounds=} must be >= 1")

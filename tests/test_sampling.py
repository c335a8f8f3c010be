"""Token choice (`models.sampling.Sampling`): greedy, temperature, top-k, top-p; shared by both generators."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sampling import Sampling

# One row of known probabilities: 0.5, 0.25, 0.15, 0.06, 0.04 (tokens 3, 0, 4, 1, 2).
PROBS = np.array([0.25, 0.06, 0.04, 0.5, 0.15])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


def _draws(sampling, n=4000):
  keys = jax.random.split(jax.random.key(0), n)
  return np.asarray(jax.jit(sampling.pick)(jnp.broadcast_to(LOGITS, (n, 5)), keys))


def test_greedy_and_its_equivalents_pick_the_argmax():
  logits = jax.random.normal(jax.random.key(1), (6, 50))
  keys = jax.random.split(jax.random.key(2), 6)
  greedy = Sampling().pick(logits, keys)
  chex.assert_shape(greedy, (6,))
  chex.assert_trees_all_equal(greedy, jnp.argmax(logits, -1).astype(jnp.int32))
  chex.assert_trees_all_equal(Sampling(2.0, top_k=1).pick(logits, keys), greedy)  # one candidate left
  chex.assert_trees_all_equal(Sampling(2.0, top_p=1e-6).pick(logits, keys), greedy)


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_a_tiny_temperature_picks_the_argmax_without_nan(temperature):
  # Dividing first overflowed the maximum to +inf: inf - inf made every probability NaN.
  logits = jax.random.normal(jax.random.key(4), (6, 50)) * 30
  keys = jax.random.split(jax.random.key(5), 6)
  sampling = Sampling(temperature, top_p=0.9)
  assert not np.isnan(np.asarray(sampling.restrict(logits))).any()
  chex.assert_trees_all_equal(sampling.pick(logits, keys), jnp.argmax(logits, -1).astype(jnp.int32))


def test_top_k_keeps_the_k_most_likely_tokens_only():
  drawn = _draws(Sampling(1.0, top_k=2))
  assert set(drawn) == {3, 0}
  # Renormalised over the two: 0.5 / 0.75 = 2/3 for token 3 (4000 draws: +-0.03 is > 4 sigma).
  assert abs(np.mean(drawn == 3) - 2 / 3) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
  assert set(_draws(Sampling(1.0, top_p=0.5))) == {3}  # 0.5 alone reaches 0.5
  assert set(_draws(Sampling(1.0, top_p=0.7))) == {3, 0}  # 0.5 < 0.7 <= 0.75
  assert set(_draws(Sampling(1.0, top_p=0.85))) == {3, 0, 4}  # 0.75 < 0.85 <= 0.9
  assert set(_draws(Sampling(1.0))) == {0, 1, 2, 3, 4}


def test_restrict_matches_a_numpy_reference():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(4, 32)).astype(np.float32)
  s = Sampling(0.7, top_k=10, top_p=0.8)
  got = np.asarray(s.restrict(jnp.asarray(logits)))
  for row, out in zip((logits - logits.max(-1, keepdims=True)) / 0.7, got):  # shifted: max 0
    order = np.argsort(-row)[:10]  # top_k first, then top_p over what it kept (renormalised)
    probs = np.exp(row[order] - row[order].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep = set(order[before < 0.8])
    assert set(np.flatnonzero(np.isfinite(out))) == keep
    np.testing.assert_allclose(out[sorted(keep)], row[sorted(keep)], rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_k=2.5), "top_k")])
def test_bad_settings_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Sampling(**kwargs)


def test_restrict_is_for_sampling_only():
  with pytest.raises(ValueError, match="greedy"):
    Sampling().restrict(LOGITS)


def test_the_serving_adapter_and_the_cli_take_top_k_and_top_p():
  from models.configs import get_config
  from zipfusion_jax.generate import parse_args
  from zipfusion_jax.serving.model import ModelDecoder

  config = get_config("tiny-llama3")
  assert ModelDecoder(config, temperature=1.0, top_k=5, top_p=0.9).sampling == Sampling(1.0, 5, 0.9)
  with pytest.raises(ValueError, match="top_p"):
    ModelDecoder(config, temperature=1.0, top_p=2.0)
  args = parse_args(["--prompt", "hi", "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95"])
  assert (args.top_k, args.top_p) == (40, 0.95)
  for bad in (["--top-k", "-1"], ["--top-p", "0"]):
    with pytest.raises(SystemExit):
      parse_args(["--prompt", "hi", *bad])

"""Planted outlier channels bring a random model's own KV to the embedded model's real-KV eligibility."""

import dataclasses

import jax
import numpy as np
import pytest

from benchmarks import kv_outliers as ko
from models.configs import get_config
from models.params import random_params


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3"])
def test_real_kv_params_reach_the_measured_fractions(name):
  config = dataclasses.replace(get_config(name), layers=8, q_heads=8, kv_heads=4, head_dim=128)
  params = random_params(config, jax.random.key(0))
  planted, info = ko.real_kv_params(params, config, jax.random.key(1), tokens=256)
  assert info.before["k"] > 0.93 and info.before["v"] > 0.93  # random weights alone: too compressible
  for kind in ("k", "v"):
    assert abs(info.after[kind] - ko.REAL_KV_ELIGIBLE[kind]) <= 0.02, (kind, info)
  # Only wk / wv changed, and only by whole columns scaled by OUTLIER_SCALE.
  for old, new in zip(params.layers, planted.layers):
    np.testing.assert_array_equal(np.asarray(old.wq), np.asarray(new.wq))
    for w_old, w_new in ((old.wk, new.wk), (old.wv, new.wv)):
      ratio = np.asarray(new.wk if w_old is old.wk else new.wv, np.float32) / np.where(
          np.asarray(w_old, np.float32) == 0, 1, np.asarray(w_old, np.float32))
      col = np.median(ratio, axis=0)
      assert set(np.round(col, 3)) <= {1.0, ko.OUTLIER_SCALE}


def test_head_share_formula_and_bounds():
  assert ko.head_share(0.95, 0.96, 2, 4) == 0.0  # already below target: plant nothing
  assert ko.head_share(0.95, 0.95 * (1 - 0.25), 2, 4) == pytest.approx(0.5)
  assert ko.head_share(0.95, 0.1, 1, 4) == 1.0  # capped


def test_plant_picks_exact_head_counts_and_rotary_pairs():
  config = dataclasses.replace(get_config("tiny-llama3"), layers=4, kv_heads=2, q_heads=4, head_dim=64)
  params = random_params(config, jax.random.key(0))
  planted = ko.plant(params, config, jax.random.key(3), {"k": 0.5, "v": 0.25})
  d = config.head_dim
  k_heads = v_heads = 0
  for old, new in zip(params.layers, planted.layers):
    for head in range(config.kv_heads):
      cols = slice(head * d, (head + 1) * d)
      k_changed = np.flatnonzero(np.any(np.asarray(old.wk[:, cols]) != np.asarray(new.wk[:, cols]), axis=0))
      v_changed = np.flatnonzero(np.any(np.asarray(old.wv[:, cols]) != np.asarray(new.wv[:, cols]), axis=0))
      if k_changed.size:
        k_heads += 1
        assert k_changed.size == 2 and k_changed[1] - k_changed[0] == d // 2  # one rotary pair
      if v_changed.size:
        v_heads += 1
        assert v_changed.size == 1
  assert (k_heads, v_heads) == (4, 2)  # round(0.5 * 8), round(0.25 * 8)

"""The decoder's prefill and cached decode steps match the fp32 full-sequence reference.

Tolerance: BF16 activations with fp32 accumulation against an all-fp32 forward pass; we require
max |logits - reference| <= 2% of max |reference| per position (measured ~0.5%) and the same
argmax where the reference's top two logits are clearly apart.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import get_config
from models.decoder import decode_jit, prefill_jit
from models.dense_backend import DenseKVBackend, decode_plan, prefill_plan
from models.layers import apply_rope, rope_inv_freq
from models.params import random_params
from models.reference import forward_reference

REL_TOL = 2e-2


def assert_logits_close(got, want, where):
  got, want = np.asarray(got), np.asarray(want)
  err = np.abs(got - want).max()
  assert err <= REL_TOL * np.abs(want).max(), f"{where}: max error {err} vs max |logit| {np.abs(want).max()}"
  top2 = np.sort(want)[-2:]
  if top2[1] - top2[0] > 4 * err:
    assert got.argmax() == want.argmax(), where


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3"])
def test_prefill_and_each_decode_step_match_reference(name):
  config = get_config(name)
  params = random_params(config, jax.random.key(0))
  seqs = [np.asarray(jax.random.randint(jax.random.key(s + 1), (n,), 0, config.vocab)) for s, n in enumerate((15, 27))]
  refs = [np.asarray(forward_reference(params, config, jnp.asarray(s, jnp.int32))) for s in seqs]
  prompt_lens = (5, 13)  # ragged: slot 0 decodes from position 5, slot 1 from 13
  backend = DenseKVBackend()
  state = backend.init_state(config.layers, 2, 48, config.kv_heads, config.head_dim)
  for slot, (seq, n) in enumerate(zip(seqs, prompt_lens)):
    padded = jnp.zeros((16,), jnp.int32).at[:n].set(jnp.asarray(seq[:n]))
    logits, state = prefill_jit(params, config, padded, jnp.int32(n), state, prefill_plan(2, slot, n), backend)
    chex.assert_shape(logits, (config.vocab,))
    assert logits.dtype == jnp.float32
    assert_logits_close(logits, refs[slot][n - 1], f"{name} prefill slot {slot}")
  chex.assert_trees_all_equal(state.lengths, jnp.array(prompt_lens, jnp.int32))

  for step in range(14):
    positions = [n + step for n in prompt_lens]
    active = [positions[0] < len(seqs[0]), True]  # slot 0 stops early: inactive slots must not disturb
    feed = [int(seqs[s][positions[s]]) if active[s] else 0 for s in range(2)]
    logits, state = decode_jit(params, config, jnp.asarray(feed, jnp.int32), state, decode_plan(positions, active), backend)
    chex.assert_shape(logits, (2, config.vocab))
    for s in range(2):
      if active[s]:
        assert_logits_close(logits[s], refs[s][positions[s]], f"{name} decode step {step} slot {s}")
  assert state.lengths.tolist() == [len(seqs[0]), prompt_lens[1] + 14]


def test_rope_is_fp32_rounded_once():
  config = get_config("tiny-llama3")
  x = jax.random.normal(jax.random.key(0), (40, 2, config.head_dim), jnp.float32).astype(jnp.bfloat16)
  pos = jnp.arange(1000, 1040, dtype=jnp.int32)
  got = np.asarray(apply_rope(x, pos, config).astype(jnp.float32))
  inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
  ang = (np.arange(1000, 1040, dtype=np.float32)[:, None] * inv)[:, None, :]
  xf = np.asarray(x.astype(jnp.float32))
  x1, x2 = np.split(xf, 2, axis=-1)
  want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
  want = np.asarray(jnp.asarray(want).astype(jnp.bfloat16).astype(jnp.float32))
  # One rounding of the fp32 result: equal up to fp32 cos/sin ulps flipping a BF16 rounding.
  assert np.mean(got != want) < 1e-3
  assert not np.any(got == 0.0)  # a BF16 elementwise rotation cancels to exact zeros here
  np.testing.assert_array_equal(apply_rope(x, jnp.zeros(40, jnp.int32), config), x)


def test_llama31_rope_scaling_bands():
  config = get_config("llama3.1-8b")
  plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
  scaled = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
  wavelen = 2 * np.pi / plain
  high = wavelen < 8192 / 4
  low = wavelen > 8192 / 1
  np.testing.assert_array_equal(scaled[high], plain[high])
  np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
  mid = ~high & ~low
  assert mid.any() and np.all((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8))


def test_inactive_slot_cache_is_untouched():
  config = get_config("tiny-qwen3")
  backend = DenseKVBackend()
  state = backend.init_state(config.layers, 2, 16, config.kv_heads, config.head_dim)
  q = jnp.ones((2, config.q_heads, config.head_dim), jnp.bfloat16)
  kv = jnp.full((2, config.kv_heads, config.head_dim), 3.0, jnp.bfloat16)
  plan = decode_plan([4, 7], [False, True])
  o, new = backend.decode_layer(state, 1, plan, q, kv, kv)
  chex.assert_shape(o, q.shape)
  assert not np.asarray(new.k[:, 0]).any() and not np.asarray(new.k[0]).any()
  assert np.asarray(new.k[1, 1, 7] == 3.0).all() and not np.asarray(new.k[1, 1, :7]).any()
  assert backend.end_step(new, plan).lengths.tolist() == [0, 8]

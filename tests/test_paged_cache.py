"""Paged KV caches: the builder, bit-exact page restore, and reference decode attention."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import zipfusion_jax as zf

PAGE = 16


def _bf16(shape, seed=0, scale=1.0):
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale
  return x.astype(ml_dtypes.bfloat16)


def _bits(x):
  return np.asarray(x).view(np.uint16)


def _kv(batch, seq, kv_heads, head_dim, seed=0):
  return _bf16((batch, seq, kv_heads, head_dim), seed), _bf16((batch, seq, kv_heads, head_dim), seed + 1)


def _numpy_attention(q, k, v, lengths, sm_scale):
  """float64 softmax(q k^T * scale) v over the first lengths[b] tokens; GQA by q head // group."""
  q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
  batch, q_heads, head_dim = q.shape
  group = q_heads // k.shape[2]
  out = np.zeros((batch, q_heads, head_dim))
  lse = np.full((batch, q_heads), -np.inf)
  for b in range(batch):
    n = int(lengths[b])
    if n == 0:
      continue
    for h in range(q_heads):
      kh, vh = k[b, :n, h // group], v[b, :n, h // group]
      s = kh @ q[b, h] * sm_scale
      m = s.max()
      p = np.exp(s - m)
      out[b, h] = p @ vh / p.sum()
      lse[b, h] = m + np.log(p.sum())
  return out, lse


# (lengths, seq, kv_heads, gqa, head_dim): the full ragged batch once, smaller batches for the rest.
_ATTN_CASES = [
    ((1, 15, 16, 17, 513, 1023), 1024, 2, 2, 128),
    ((1, 17, 40), 48, 3, 1, 64),
    ((16, 33), 48, 1, 3, 128),
    ((15, 32), 40, 2, 4, 64),
    ((17, 1), 32, 1, 8, 128),
]


@pytest.mark.parametrize("compressed", [True, False])
@pytest.mark.parametrize("lengths,seq,kv_heads,gqa,head_dim", _ATTN_CASES)
def test_matches_numpy_attention(lengths, seq, kv_heads, gqa, head_dim, compressed):
  batch = len(lengths)
  k, v = _kv(batch, seq, kv_heads, head_dim, seed=seq + head_dim)
  q = _bf16((batch, kv_heads * gqa, head_dim), seed=7)
  cache = zf.paged_cache_from_dense(k, v, np.array(lengths), compressed=compressed)
  out, lse = zf.paged_decode_attention(q, cache, impl="reference", return_lse=True)
  chex.assert_shape(out, (batch, kv_heads * gqa, head_dim))
  chex.assert_shape(lse, (batch, kv_heads * gqa))
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  want, want_lse = _numpy_attention(q, k, v, lengths, 1.0 / np.sqrt(head_dim))
  chex.assert_trees_all_close(np.asarray(out, np.float64), want, atol=2e-2, rtol=2e-2)
  chex.assert_trees_all_close(np.asarray(lse, np.float64), want_lse, atol=1e-3, rtol=0)


@pytest.mark.parametrize("compressed", [True, False])
def test_non_default_scale(compressed):
  lengths = np.array([5, 37, 64])
  k, v = _kv(3, 64, 2, 64, seed=3)
  q = _bf16((3, 4, 64), seed=4)
  cache = zf.paged_cache_from_dense(k, v, lengths, compressed=compressed)
  out, lse = zf.paged_decode_attention(q, cache, sm_scale=0.3, impl="reference", return_lse=True)
  want, want_lse = _numpy_attention(q, k, v, lengths, 0.3)
  chex.assert_trees_all_close(np.asarray(out, np.float64), want, atol=2e-2, rtol=2e-2)
  chex.assert_trees_all_close(np.asarray(lse, np.float64), want_lse, atol=1e-3, rtol=0)


def test_compressed_and_uncompressed_outputs_are_bit_identical(head_dim=128):
  lengths = np.array([0, 16, 47, 100])
  k, v = _kv(4, 112, 2, head_dim, seed=11)
  k[1, 3, 0, 5] = ml_dtypes.bfloat16(1e30)  # one raw block among compressed ones
  q = _bf16((4, 6, head_dim), seed=12)
  outs = []
  for compressed in (True, False):
    cache = zf.paged_cache_from_dense(k, v, lengths, compressed=compressed)
    outs.append(zf.paged_decode_attention(q, cache, impl="reference", return_lse=True))
  np.testing.assert_array_equal(_bits(outs[0][0]), _bits(outs[1][0]))
  np.testing.assert_array_equal(np.asarray(outs[0][1]).view(np.uint32), np.asarray(outs[1][1]).view(np.uint32))
  via_restore = zf.decompress_then_attend(q, zf.paged_cache_from_dense(k, v, lengths), impl="reference")
  np.testing.assert_array_equal(_bits(via_restore), _bits(outs[1][0]))


def _special_kv(head_dim):
  """K/V with special values, outliers (raw blocks) and all-zero pages, 4 complete pages a sequence."""
  k, v = _kv(2, 70, 2, head_dim, seed=21)
  u16 = lambda bits: np.array(bits, np.uint16).view(ml_dtypes.bfloat16)
  specials = u16([0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 0x7F81, 0x0001, 0x807F, 0x0040])
  k[0, 0, 0, : specials.size] = specials  # page 0 head 0 of sequence 0: raw
  v[1, 20, 1, 3] = u16([0x7FFF])[0]  # NaN with a full payload
  v[1, 21, 1, :4] = u16([0x0001, 0x8001, 0x0012, 0x0000])  # subnormals
  k[0, 40, 1, 7] = ml_dtypes.bfloat16(3e38)  # a big outlier
  v[0, 50, 0, 0] = ml_dtypes.bfloat16(-1e-30)
  k[1, 32:48] = 0  # a page of all zeros (both heads)
  v[0, 16:32, 1] = ml_dtypes.bfloat16(-0.0)  # a page of negative zeros
  return k, v


@pytest.mark.parametrize("head_dim", [64, 128])
def test_restore_pages_is_bit_exact(head_dim):
  k, v = _special_kv(head_dim)
  lengths = np.array([67, 64])
  packed = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  plain = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  np.testing.assert_array_equal(np.asarray(packed.page_table), np.asarray(plain.page_table))
  k_pages, v_pages = zf.restore_pages(packed)
  chex.assert_shape((k_pages, v_pages), (2, 8, PAGE, head_dim))
  assert k_pages.dtype == v_pages.dtype == jnp.bfloat16
  np.testing.assert_array_equal(_bits(k_pages), _bits(plain.k_pages))
  np.testing.assert_array_equal(_bits(v_pages), _bits(plain.v_pages))
  pk, pv = zf.restore_pages(plain)
  assert pk is plain.k_pages and pv is plain.v_pages

  word1 = np.asarray(packed.group_meta)[..., 1]
  slots = np.stack([(word1 >> (8 * i)) & 0xFF for i in range(4)], axis=-1)
  nblocks = 4 if head_dim == 128 else 2
  used = slots[..., :nblocks]
  assert np.all((used <= 127) | (used == 0xFF)), np.unique(used)
  assert np.any(used == 0xFF) and np.any(used <= 127)
  if head_dim == 64:
    assert np.all(slots[..., 2:] == 0xFE)


def test_page_table_is_a_shuffled_bijection_and_gathers_the_tokens():
  lengths = np.array([67, 0, 16, 150, 9, 48])
  seq, kv_heads, head_dim = 160, 2, 64
  k, v = _kv(len(lengths), seq, kv_heads, head_dim, seed=31)
  cache = zf.paged_cache_from_dense(k, v, lengths, compressed=False, seed=5)
  table = np.asarray(cache.page_table)
  assert table.shape == (len(lengths), seq // PAGE)
  complete = lengths // PAGE
  used = np.concatenate([table[b, :n] for b, n in enumerate(complete)])
  assert cache.num_pages == complete.sum()
  np.testing.assert_array_equal(np.sort(used), np.arange(complete.sum()))
  assert not np.array_equal(used, np.arange(complete.sum())), "page table should be shuffled"
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
  k_pages, v_pages = np.asarray(cache.k_pages), np.asarray(cache.v_pages)
  k_tail, v_tail = np.asarray(cache.k_tail), np.asarray(cache.v_tail)
  for b, n in enumerate(lengths):
    for i in range(n // PAGE):
      tokens = slice(PAGE * i, PAGE * (i + 1))
      np.testing.assert_array_equal(_bits(k_pages[:, table[b, i]]), _bits(k[b, tokens].transpose(1, 0, 2)))
      np.testing.assert_array_equal(_bits(v_pages[:, table[b, i]]), _bits(v[b, tokens].transpose(1, 0, 2)))
    start, rem = PAGE * (n // PAGE), n % PAGE
    for tail, x in ((k_tail, k), (v_tail, v)):
      np.testing.assert_array_equal(_bits(tail[b, :, :rem]), _bits(x[b, start:n].transpose(1, 0, 2)))
      np.testing.assert_array_equal(_bits(tail[b, :, rem:]), 0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("version", [1, 2])
def test_pages_and_tails_keep_every_bf16_bit_pattern(head_dim, version):
  """Every BF16 pattern (NaN payloads, subnormals, -0.0) in K and V comes back bit for bit.

  XLA's CPU pad of a bfloat16 array is not bit-exact (it quiets NaN payloads and flushes
  subnormals in the last column), so the builder must move bit patterns, not BF16 values.
  """
  seq = 65536 // head_dim
  k = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(1, seq, 1, head_dim)
  v = k[:, ::-1, :, ::-1].copy()
  lengths = np.array([seq - 5])  # complete pages, then an 11-token tail
  start, rem = seq - PAGE, PAGE - 5
  for compressed in (True, False):
    cache = zf.paged_cache_from_dense(k.view(ml_dtypes.bfloat16), v.view(ml_dtypes.bfloat16), lengths,
                                      compressed=compressed, version=version)
    table = np.asarray(cache.page_table)[0, : start // PAGE]
    for pages, tail, x in zip(zf.restore_pages(cache, "reference"), (cache.k_tail, cache.v_tail), (k, v)):
      np.testing.assert_array_equal(_bits(pages)[0, table].reshape(start, head_dim), x[0, :start, 0])
      np.testing.assert_array_equal(_bits(tail)[0, 0, :rem], x[0, start:start + rem, 0])


def test_seed_changes_the_page_order_not_the_output():
  lengths = np.array([80, 48])
  k, v = _kv(2, 80, 1, 64, seed=41)
  q = _bf16((2, 2, 64), seed=42)
  a = zf.paged_cache_from_dense(k, v, lengths, compressed=False, seed=0)
  b = zf.paged_cache_from_dense(k, v, lengths, compressed=False, seed=1)
  assert not np.array_equal(np.asarray(a.page_table), np.asarray(b.page_table))
  np.testing.assert_array_equal(
      _bits(zf.paged_decode_attention(q, a, impl="reference")), _bits(zf.paged_decode_attention(q, b, impl="reference"))
  )


class TestBadInputs:

  def setup_method(self):
    self.k, self.v = _kv(2, 32, 2, 64, seed=51)
    self.lengths = np.array([20, 32])
    self.cache = zf.paged_cache_from_dense(self.k, self.v, self.lengths)
    self.q = _bf16((2, 4, 64), seed=52)

  def test_head_dim_96(self):
    k, v = _kv(1, 16, 1, 96)
    with pytest.raises(ValueError, match="head_dim"):
      zf.paged_cache_from_dense(k, v, np.array([16]))

  def test_kv_shape_mismatch(self):
    with pytest.raises(ValueError, match="shapes differ"):
      zf.paged_cache_from_dense(self.k, self.v[:, :16], self.lengths)

  def test_non_bf16_k(self):
    with pytest.raises(TypeError, match="bfloat16"):
      zf.paged_cache_from_dense(self.k.astype(np.float32), self.v, self.lengths)

  @pytest.mark.parametrize("lengths", [[20, 33], [-1, 5]])
  def test_lengths_out_of_range(self, lengths):
    with pytest.raises(ValueError, match="lengths must lie"):
      zf.paged_cache_from_dense(self.k, self.v, np.array(lengths))

  def test_no_kv_heads(self):
    with pytest.raises(ValueError, match="KV head"):
      zf.paged_cache_from_dense(self.k[:, :, :0], self.v[:, :, :0], self.lengths)

  @pytest.mark.parametrize("compressed", [True, False])
  def test_empty_batch_builds_and_attends(self, compressed):
    cache = zf.paged_cache_from_dense(self.k[:0], self.v[:0], np.zeros(0, int), compressed=compressed)
    assert cache.batch == 0 and cache.num_pages == 1
    k_pages, _ = zf.restore_pages(cache, "reference")
    chex.assert_shape(k_pages, (2, 1, PAGE, 64))
    chex.assert_shape(zf.paged_decode_attention(self.q[:0], cache, impl="reference"), (0, 4, 64))

  def test_page_size_32(self):
    with pytest.raises(ValueError, match="page_size"):
      zf.paged_cache_from_dense(self.k, self.v, self.lengths, page_size=32)

  def test_q_wrong_head_dim(self):
    with pytest.raises(ValueError, match="head_dim"):
      zf.paged_decode_attention(_bf16((2, 4, 128)), self.cache, impl="reference")

  def test_q_heads_not_a_multiple(self):
    with pytest.raises(ValueError, match="multiple"):
      zf.paged_decode_attention(_bf16((2, 3, 64)), self.cache, impl="reference")

  def test_q_batch_mismatch(self):
    with pytest.raises(ValueError, match="batch"):
      zf.paged_decode_attention(_bf16((3, 4, 64)), self.cache, impl="reference")

  def test_too_many_q_heads_per_kv_head(self):
    with pytest.raises(ValueError, match="at most 8"):
      zf.paged_decode_attention(_bf16((2, 18, 64)), self.cache, impl="reference")

  def test_non_bf16_q(self):
    with pytest.raises(TypeError, match="bfloat16"):
      zf.paged_decode_attention(self.q.astype(np.float32), self.cache, impl="reference")

  def test_lengths_past_the_page_table(self):
    bad = dataclasses.replace(self.cache, lengths=jnp.array([20, 48], jnp.int32))
    with pytest.raises(ValueError, match="lengths must lie"):
      zf.paged_decode_attention(self.q, bad, impl="reference")
    also_bad = self.cache.replace(lengths=jnp.array([-1, 5], jnp.int32))
    with pytest.raises(ValueError, match="lengths must lie"):
      zf.paged_decode_attention(self.q, also_bad, impl="reference")


@pytest.mark.parametrize("compressed", [True, False])
def test_jit_matches_eager(compressed):
  lengths = np.array([3, 40, 64])
  k, v = _kv(3, 64, 2, 128, seed=61)
  q = jnp.asarray(_bf16((3, 4, 128), seed=62))
  cache = zf.paged_cache_from_dense(k, v, lengths, compressed=compressed)
  eager = zf.paged_decode_attention(q, cache, impl="reference")
  jitted = jax.jit(lambda q, c: zf.paged_decode_attention(q, c, impl="reference"))(q, cache)
  np.testing.assert_array_equal(_bits(jitted), _bits(eager))


@pytest.mark.parametrize("compressed", [True, False])
def test_empty_sequence_gives_zeros_and_leaves_others_alone(compressed):
  k, v = _kv(3, 48, 1, 64, seed=71)
  q = _bf16((3, 2, 64), seed=72)
  with_empty = zf.paged_cache_from_dense(k, v, np.array([33, 0, 48]), compressed=compressed)
  out, lse = map(np.asarray, zf.paged_decode_attention(q, with_empty, impl="reference", return_lse=True))
  np.testing.assert_array_equal(_bits(out[1]), 0)
  assert np.all(np.isneginf(np.asarray(lse[1])))
  assert np.all(np.isfinite(np.asarray(lse[[0, 2]])))
  # The other sequences match a batch built without the empty one.
  alone = zf.paged_cache_from_dense(k[[0, 2]], v[[0, 2]], np.array([33, 48]), compressed=compressed)
  out2, lse2 = map(np.asarray, zf.paged_decode_attention(q[[0, 2]], alone, impl="reference", return_lse=True))
  np.testing.assert_array_equal(_bits(out[[0, 2]]), _bits(out2))
  np.testing.assert_array_equal(np.asarray(lse[[0, 2]]), np.asarray(lse2))


def test_reference_ignores_nan_in_rows_past_the_length():
  """Stale tail rows and pages past a sequence (the serving state keeps them) never reach the output."""
  rng = np.random.default_rng(5)
  k = jnp.asarray(rng.normal(size=(2, 40, 2, 64)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(2, 40, 2, 64)), jnp.bfloat16)
  q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.bfloat16)
  cache = zf.paged_cache_from_dense(k, v, np.array([21, 35]), compressed=False)
  want = zf.paged_decode_attention(q, cache, impl="reference")
  poisoned = cache.replace(
      k_tail=cache.k_tail.at[:, :, 14:].set(jnp.nan), v_tail=cache.v_tail.at[:, :, 14:].set(jnp.inf),
      # A stale page-table entry pointing at a page of NaNs that no live sequence owns.
      k_pages=jnp.concatenate([cache.k_pages, jnp.full_like(cache.k_pages[:, :1], jnp.nan)], axis=1),
      v_pages=jnp.concatenate([cache.v_pages, jnp.full_like(cache.v_pages[:, :1], jnp.nan)], axis=1),
      page_table=cache.page_table.at[0, 1:].set(cache.num_pages))
  got = zf.paged_decode_attention(q, poisoned, impl="reference")
  assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_decompress_then_attend_holds_one_layers_buffer_at_a_time():
  """A decode step of 8 layers through `decompress_then_attend`: each layer's restore waits for that
  layer's query, so the step's temporaries stay near one layer's BF16 buffer; the same restores
  left free (the unbarriered composition) let XLA hold several at once."""
  from zipfusion_jax.paged import api

  batch, seq, heads, head_dim, layers = 4, 512, 2, 128, 8
  rng = np.random.default_rng(0)
  caches = []
  for _ in range(layers):
    k = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.bfloat16)
    caches.append(zf.paged_cache_from_dense(k, k, np.full(batch, seq), compressed=True))
  q = jnp.ones((batch, heads * 4, head_dim), jnp.bfloat16)

  def free_restore(q, cache):  # the composition without the barrier
    k_pages, v_pages = zf.restore_pages(cache, "reference")
    plain = cache.replace(arena=None, group_meta=None, k_pages=k_pages, v_pages=v_pages, compressed=False)
    return api.paged_decode_attention(q, plain, impl="reference")

  def step(q, caches, attend):
    for cache in caches:
      q = (attend(q, cache) * 0.5 + q).astype(jnp.bfloat16)
    return q

  def temp_bytes(attend):
    lowered = jax.jit(lambda q, cs: step(q, cs, attend)).lower(q, caches)
    return lowered.compile().memory_analysis().temp_size_in_bytes

  barriered = temp_bytes(lambda q, c: api.decompress_then_attend(q, c, impl="reference", restore_impl="reference"))
  free = temp_bytes(free_restore)
  one_layer = 2 * caches[0].num_pages * heads * 16 * head_dim * 2  # K and V BF16 pages
  assert barriered < free / 2, (barriered, free)
  assert barriered <= 6 * one_layer, (barriered, one_layer)

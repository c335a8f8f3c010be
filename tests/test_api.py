"""The public codec contract: compress / decompress / compressible / nbytes and its errors."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import zipfusion_jax as zf


def _blocks(shape, seed=0, scale=1.0):
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale
  return x.astype(ml_dtypes.bfloat16)


def _bits(x):
  return np.asarray(x).view(np.uint16)


class RoundTripTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("reference", "pallas")
  def test_round_trip_with_and_without_jit(self, impl):
    x = _blocks((2, 3, 512))
    x[0, 1, 7] = ml_dtypes.bfloat16(1e30)  # one outlier: that block is raw
    c = self.variant(lambda a: zf.compress(a, impl=impl))(jnp.asarray(x))
    chex.assert_shape(c.compressible, (2, 3))
    assert c.compressible.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(c.compressible), [[True, False, True], [True, True, True]])
    back = self.variant(zf.decompress)(c)
    chex.assert_shape(back, (2, 3, 512))
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(back), _bits(x))
    # Lossless, so the float comparison at zero tolerance must pass as well.
    chex.assert_trees_all_close(back.astype(jnp.float32), jnp.asarray(x, jnp.float32), rtol=0, atol=0)


def test_numpy_and_jax_inputs_give_identical_bytes():
  x = _blocks((5, 512), seed=1)
  a, b = zf.compress(x), zf.compress(jnp.asarray(x))
  chex.assert_trees_all_equal(a, b)


def test_nbytes_counts_payload_and_metadata():
  x = _blocks((6, 512), seed=2)
  x[4, 0] = ml_dtypes.bfloat16(np.float32(2.0**-100))
  c = zf.compress(x)
  np.testing.assert_array_equal(np.asarray(c.compressible), [True, True, True, True, False, True])
  assert c.nbytes == 5 * 768 + 1024 + 2 * 8  # two groups of metadata
  assert c.uncompressed_nbytes == 6 * 1024


def test_nbytes_under_jit_is_traced():
  x = jnp.asarray(_blocks((4, 512)))
  assert int(jax.jit(lambda a: zf.compress(a).nbytes)(x)) == 4 * 768 + 8


def test_single_block_and_leading_batch_of_one():
  x = _blocks((1, 1, 512))
  c = zf.compress(x)
  assert c.num_groups == 1 and c.num_blocks == 1
  np.testing.assert_array_equal(_bits(zf.decompress(c)), _bits(x))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16, np.int32])
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_wrong_dtype_is_a_type_error(dtype, impl):
  with pytest.raises(TypeError, match="bfloat16"):
    zf.compress(np.zeros((2, 512), dtype), impl=impl)


def test_python_list_is_a_type_error():
  with pytest.raises(TypeError, match="bfloat16"):
    zf.compress([[0.0] * 512])


@pytest.mark.parametrize("shape", [(2, 256), (512, 2), (1024,), (3, 513)])
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_wrong_trailing_size_is_a_value_error(shape, impl):
  with pytest.raises(ValueError, match=r"\[\.\.\., 512\]"):
    zf.compress(np.zeros(shape, ml_dtypes.bfloat16), impl=impl)


def test_scalar_is_a_value_error():
  with pytest.raises(ValueError, match="512"):
    zf.compress(np.zeros((), ml_dtypes.bfloat16))


def test_unknown_impl_and_stray_options():
  x = _blocks((1, 512))
  with pytest.raises(ValueError, match="impl"):
    zf.compress(x, impl="cuda")
  with pytest.raises(TypeError, match="no options"):
    zf.compress(x, impl="reference", interpret=True)


# --- the decode-attention contract: paged_decode_attention / decompress_then_attend -----------------


def _paged(batch=2, seq=32, kv_heads=1, head_dim=64, lengths=(20, 32), compressed=True):
  k, v = _blocks((2, batch, seq, kv_heads, head_dim), seed=9)
  return zf.paged_cache_from_dense(k, v, np.array(lengths, np.int32), compressed=compressed)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("sm_scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_non_finite_sm_scale_is_a_value_error(impl, sm_scale):
  """A NaN / inf scale made every output NaN, silently (and, a static jit argument unequal to itself,
  compiled the reference again on every call)."""
  cache = _paged()
  q = jnp.asarray(_blocks((2, 2, 64), seed=10))
  with pytest.raises(ValueError, match="sm_scale must be finite"):
    zf.paged_decode_attention(q, cache, sm_scale, impl=impl)
  with pytest.raises(ValueError, match="sm_scale must be finite"):
    zf.decompress_then_attend(q, cache, sm_scale, impl=impl)


def test_traced_sm_scale_is_a_clear_type_error():
  cache = _paged()
  q = jnp.asarray(_blocks((2, 2, 64), seed=10))
  with pytest.raises(TypeError, match="sm_scale must be a concrete number"):
    jax.jit(lambda q, c, s: zf.paged_decode_attention(q, c, s, impl="reference"))(q, cache, 0.3)
  # Concrete scales of any numeric type (and negative ones) are fine.
  want = zf.paged_decode_attention(q, cache, -0.3, impl="reference")
  got = zf.paged_decode_attention(q, cache, np.float32(-0.3), impl="reference")
  np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("compressed", [True, False])
def test_empty_batch_and_no_heads_through_the_kernel_match_the_reference(compressed):
  """The kernel wrapper divided by zero (an empty grid, G = 0) where the reference returns empty outputs."""
  empty_batch = _paged(batch=0, lengths=(), compressed=compressed)
  cache = _paged(compressed=compressed)
  for q, c in ((jnp.zeros((0, 4, 64), jnp.bfloat16), empty_batch), (jnp.zeros((2, 0, 64), jnp.bfloat16), cache)):
    want, want_lse = zf.paged_decode_attention(q, c, impl="reference", return_lse=True)
    got, lse = zf.paged_decode_attention(q, c, impl="pallas", interpret=True, return_lse=True)
    assert got.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    chex.assert_shape((got, lse), (want.shape, want_lse.shape))
    chex.assert_shape(zf.paged_decode_attention(q, c, impl="pallas", interpret=True), q.shape)

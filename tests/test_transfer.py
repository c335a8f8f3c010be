"""The step's one-buffer host<->device transfer (`zipfusion_jax/serving/transfer.py`): exact round trips."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zipfusion_jax.serving.state import ServingConfig
from zipfusion_jax.serving.transfer import Layout, pack_device, pack_host

DTYPES = (np.int32, np.uint32, np.float32, np.bool_)


@st.composite
def trees(draw):
  """A dict of 0-6 leaves of 32-bit or bool dtypes, shapes with zero-size and scalar cases."""
  leaves = {}
  for i in range(draw(st.integers(0, 6))):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    raw = draw(st.binary(min_size=4 * int(np.prod(shape)), max_size=4 * int(np.prod(shape))))
    words = np.frombuffer(raw, np.uint32).reshape(shape)
    leaves[f"x{i}"] = (words & 1).astype(bool) if dtype is np.bool_ else words.view(dtype)
  return leaves


def assert_same_bits(a, b):
  chex.assert_trees_all_equal_shapes_and_dtypes(a, b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != np.bool_:  # bit for bit: NaN payloads and -0.0 of float leaves included
      x, y = x.view(np.uint32), y.view(np.uint32)
    np.testing.assert_array_equal(x, y)


@given(trees())
def test_host_pack_unpack_is_exact(tree):
  flat, layout = pack_host(tree)
  assert flat.dtype == np.int32 and flat.shape == (layout.size,)
  assert_same_bits(layout.unpack(flat, np), tree)


@given(trees())
def test_device_unpack_of_a_host_pack_and_back_is_exact(tree):
  flat, layout = pack_host(tree)

  @jax.jit
  def roundtrip(flat):
    back, device_layout = pack_device(layout.unpack(flat, jnp))
    assert device_layout == layout
    return back

  np.testing.assert_array_equal(np.asarray(roundtrip(flat)), flat)


def test_layout_is_a_static_key_and_refuses_other_widths_and_sizes():
  tree = {"a": np.zeros((2, 3), np.int32), "b": np.ones(4, bool)}
  flat, layout = pack_host(tree)
  assert hash(layout) == hash(Layout.of(tree)) and layout == Layout.of(tree) and layout.size == 10
  with pytest.raises(TypeError, match="32-bit"):
    Layout.of({"a": np.zeros(3, np.int64)})
  with pytest.raises(TypeError, match="32-bit"):
    Layout.of({"a": np.zeros(3, np.float16)})
  with pytest.raises(ValueError, match="layout wants"):
    layout.unpack(flat[:-1], np)


def test_a_step_plan_travels_as_one_buffer():
  """The engine's real plan pytree (ints, bools, the static config) packs and unpacks exactly."""
  from zipfusion_jax.serving.engine import decode_plan
  from zipfusion_jax.serving.allocator import ChunkAllocator

  cfg = ServingConfig.from_budget(1 << 20, num_layers=2, num_kv_heads=1, head_dim=64, num_slots=4, max_pages=8)
  plan = decode_plan(cfg, {0: 20, 2: 15}, [2], ChunkAllocator(cfg).reserve(1))
  tokens = np.arange(cfg.num_slots, dtype=np.int32)
  flat, layout = pack_host((plan, tokens))
  back_plan, back_tokens = layout.unpack(flat, np)
  assert_same_bits((back_plan, back_tokens), (plan, tokens))

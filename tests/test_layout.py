"""Page layout: blocks per page, bijection, and MMA-fragment contiguity."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from zipfusion_jax.format import layout


@pytest.mark.parametrize("head_dim, nblocks", [(64, 2), (128, 4)])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_permutation_is_a_bijection_with_32_dims_per_block(kind, head_dim, nblocks):
  perm = layout.page_permutation(kind, head_dim)
  assert perm.shape == (nblocks, 512)
  np.testing.assert_array_equal(np.sort(perm.reshape(-1)), np.arange(16 * head_dim))
  dims = perm % head_dim
  for j in range(nblocks):  # block j holds dims [32 j, 32 j + 32) of all 16 tokens
    np.testing.assert_array_equal(np.unique(dims[j]), np.arange(32 * j, 32 * j + 32))
    np.testing.assert_array_equal(np.unique(perm[j] // head_dim), np.arange(16))
  inv = layout.inverse_page_permutation(kind, head_dim)
  np.testing.assert_array_equal(perm.reshape(-1)[inv], np.arange(16 * head_dim))


def test_tile_positions_follow_the_mma_a_fragment():
  """Lane l holds a0..a7 = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1), then the same at col + 8."""
  for lane in range(32):
    g, t = lane // 4, lane % 4
    rows = np.array([g, g, g + 8, g + 8, g, g, g + 8, g + 8])
    cols = np.array([2 * t, 2 * t + 1] * 2 + [2 * t + 8, 2 * t + 9] * 2)
    np.testing.assert_array_equal(layout.tile_position(rows, cols), lane * 8 + np.arange(8))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_k_tiles_are_token_by_dim_and_v_tiles_dim_by_token(head_dim):
  pos = layout.tile_position(np.array([3]), np.array([10]))[0]
  k, v = layout.page_permutation("k", head_dim), layout.page_permutation("v", head_dim)
  assert k[1, 256 + pos] == 3 * head_dim + (32 + 16 + 10)  # K[token 3, dim 58]
  assert v[1, 256 + pos] == 10 * head_dim + (32 + 16 + 3)  # V[token 10, dim 51]


@pytest.mark.parametrize("kind", ["k", "v"])
def test_pages_round_trip(kind):
  x = np.arange(2 * 16 * 128, dtype=np.float32).reshape(2, 16, 128).astype(ml_dtypes.bfloat16)
  blocks = layout.pages_to_blocks(x, kind)
  assert blocks.shape == (2, 4, 512)
  np.testing.assert_array_equal(np.asarray(layout.blocks_to_pages(blocks, kind)).view(np.uint16), x.view(np.uint16))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_transposes_equal_the_permutation_table(kind, head_dim):
  """pages <-> blocks run as reshape + transpose; they must match the spec's table exactly."""
  x = np.arange(3 * 2 * 16 * head_dim, dtype=np.int32).reshape(3, 2, 16, head_dim)
  want = np.take(x.reshape(3, 2, -1), layout.page_permutation(kind, head_dim), axis=-1)
  np.testing.assert_array_equal(np.asarray(layout.pages_to_blocks(x, kind)), want)
  np.testing.assert_array_equal(np.asarray(layout.blocks_to_pages(want, kind)), x)


def test_bad_layout_inputs():
  with pytest.raises(ValueError, match="head_dim"):
    layout.blocks_per_page(96)
  with pytest.raises(ValueError, match="kind"):
    layout.page_permutation("q", 64)
  with pytest.raises(ValueError, match="16 tokens"):
    layout.pages_to_blocks(np.zeros((2, 8, 64), ml_dtypes.bfloat16), "k")
  with pytest.raises(ValueError, match="kind"):
    layout.pages_to_blocks(np.zeros((2, 16, 64), ml_dtypes.bfloat16), "q")
  with pytest.raises(ValueError, match="head_dim"):
    layout.blocks_to_pages(np.zeros((2, 3, 512), ml_dtypes.bfloat16), "v")

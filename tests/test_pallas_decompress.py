"""The Pallas page-decompression kernel (interpreted) restores exactly the reference's bits.

Covers both head dims and format versions, pages mixing 12-bit and raw blocks, every special
BF16 class (±0, Inf, NaN payloads, subnormals), corrupted metadata (unknown versions, slots
past the payload: both decoders read zero bytes there), bad inputs, and the lowering for an
abstract H200 to one Pallas Triton call with no block-order BF16 intermediate.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import zipfusion_jax as zf
from pallas_kernels.decompress import DecompressConfig, restore_pages_pallas
from zipfusion_jax.format import block as B

PAGE = 16


def _bits(x) -> np.ndarray:
  return np.asarray(x).view(np.uint16)


def _kv(head_dim: int, seq: int = 83, kv_heads: int = 2, seed: int = 0):
  """k, v bf16 [2, seq, kv_heads, head_dim] with raw blocks, special values and exception candidates."""
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(2, seq, kv_heads, head_dim)).astype(ml_dtypes.bfloat16)
  v = rng.normal(size=(2, seq, kv_heads, head_dim)).astype(ml_dtypes.bfloat16)
  u16 = lambda a: np.asarray(a, np.uint16).view(ml_dtypes.bfloat16)
  k[0, 0, 0, :9] = u16([0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFA5, 0x7F81, 0x0001, 0x807F, 0x0040])  # raw block
  v[1, 20, 1, :4] = u16([0x7FFF, 0x0001, 0x8001, 0x0000])  # a NaN payload, subnormals, +0
  k[:, ::5, :, 3] = ml_dtypes.bfloat16(3e4)  # one outlier per block of channel 3: version 2's exceptions
  v[0, 16:32, 1] = ml_dtypes.bfloat16(-0.0)  # a page of negative zeros
  return jnp.asarray(k), jnp.asarray(v)


def _check_same(cache, **kwargs):
  want = zf.restore_pages(cache, impl="reference")
  got = restore_pages_pallas(cache.arena, cache.group_meta, head_dim=cache.head_dim, interpret=True, **kwargs)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("tile_stores", [False, True])
def test_pallas_restore_is_bit_exact(head_dim, version, tile_stores):
  k, v = _kv(head_dim)
  cache = zf.paged_cache_from_dense(k, v, jnp.array([83, 40], jnp.int32), compressed=True, version=version)
  meta = np.asarray(cache.group_meta)
  slots = (meta[..., 1:2] >> np.arange(0, 32, 8, dtype=np.uint32)) & 0xFF
  used = slots[..., : head_dim // 32]
  assert np.any(used == B.META_RAW) and np.any(used <= B.MAX_EXCEPTION_META)  # both kinds of block
  if version == 2:
    assert np.any((used >= B.META_EXCEPTION) & (used <= B.MAX_EXCEPTION_META))  # exceptions restored too
  _check_same(cache, config=DecompressConfig(tile_stores=tile_stores))
  if tile_stores != DecompressConfig().tile_stores:
    return
  # The public entry point (default config), and the restored pages equal the uncompressed cache's.
  plain = zf.paged_cache_from_dense(k, v, jnp.array([83, 40], jnp.int32), compressed=False)
  for got, want in zip(zf.restore_pages(cache, impl="pallas", interpret=True), (plain.k_pages, plain.v_pages)):
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.slow  # interpreted; the default tier runs the 2-group programs above
@pytest.mark.parametrize("config", [DecompressConfig(groups_per_program=1), DecompressConfig(groups_per_program=8)])
def test_every_program_size_covers_every_group(config):
  k, v = _kv(128, seq=50, kv_heads=3, seed=1)  # 3 heads x 6 pages x 2 kinds = 36 groups, not a multiple of 8
  _check_same(zf.paged_cache_from_dense(k, v, jnp.array([50, 17], jnp.int32)), config=config)


@pytest.mark.parametrize("word, value", [(0, (3 << 30) | 1),
                                         pytest.param(0, 0, marks=pytest.mark.slow),
                                         pytest.param(0, (1 << 30) | (2**30 - 1), marks=pytest.mark.slow)])
def test_corrupted_groups_read_zero_bytes_like_the_reference(word, value):
  """Unknown versions (3, 0) and a slot past the payload: both decoders read zero bytes there."""
  k, v = _kv(128, seq=40, seed=2)
  cache = zf.paged_cache_from_dense(k, v, jnp.array([40, 33], jnp.int32))
  meta = np.asarray(cache.group_meta).copy()
  meta[1, 1, 0, word] = value
  bad = cache.replace(group_meta=jnp.asarray(meta))
  _check_same(bad)
  # A payload cut one unit short: the last slot no longer fits and reads zeros in both decoders.
  _check_same(cache.replace(arena=cache.arena[:-1]))


def test_the_last_slot_must_fit_wholly_in_the_payload():
  """`codec.slot_reads`: a 12-bit slot needs its 3 units inside, any other 4."""
  from zipfusion_jax.format import codec

  meta = jnp.array([[1 << 30 | 5, 0x00FF0010]], jnp.uint32)  # slots 0..3: b/2 = 16, b/2 = 0, raw, b/2 = 0
  units = codec.block_unit_offsets(meta)
  np.testing.assert_array_equal(np.asarray(units), [[5, 8, 11, 15]])
  reads = lambda payload_units: np.asarray(codec.slot_reads(meta, units, payload_units)).tolist()
  assert reads(18) == [[True, True, True, True]]
  assert reads(15) == [[True, True, True, False]]
  assert reads(14) == [[True, True, False, False]]  # the raw slot's 4th unit is missing
  assert reads(10) == [[True, False, False, False]]
  assert reads(18) == [[True] * 4] and not np.any(np.asarray(codec.slot_reads(meta.at[0, 0].set(5), units, 18)))


def test_bad_inputs_are_clear_errors():
  k, v = _kv(64, seq=40)
  cache = zf.paged_cache_from_dense(k, v, jnp.array([40, 20], jnp.int32))
  with pytest.raises(ValueError, match="head_dim"):
    restore_pages_pallas(cache.arena, cache.group_meta, head_dim=96, interpret=True)
  with pytest.raises(ValueError, match="arena must be uint8"):
    restore_pages_pallas(cache.arena.reshape(-1), cache.group_meta, head_dim=64, interpret=True)
  with pytest.raises(ValueError, match="group_meta must be"):
    restore_pages_pallas(cache.arena, cache.group_meta[..., :1], head_dim=64, interpret=True)
  with pytest.raises(ValueError, match="group_meta must be uint32"):
    restore_pages_pallas(cache.arena, cache.group_meta.astype(jnp.int32), head_dim=64, interpret=True)
  with pytest.raises(ValueError, match="impl="):
    zf.restore_pages(cache, impl="cuda")
  with pytest.raises(TypeError, match="interpret"):
    zf.restore_pages(cache, impl="reference", interpret=True)
  with pytest.raises(ValueError, match="groups_per_program"):
    DecompressConfig(groups_per_program=3)


H200 = AbstractMesh(
    (1,), ("x",), (AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


@pytest.mark.parametrize("head_dim, width", [(64, 2), (128, 4)])
@pytest.mark.parametrize("tile_stores", [False, True])
def test_lowers_for_an_abstract_h200_to_one_triton_call(head_dim, width, tile_stores):
  kv_heads, pages, units = 8, 64, 3 * 2 * 64 * 8 * head_dim // 32 // 4 * 4
  arena = jax.ShapeDtypeStruct((units, 256), jnp.uint8)
  meta = jax.ShapeDtypeStruct((kv_heads, pages, 2, width), jnp.uint32)
  f = lambda a, m: restore_pages_pallas(a, m, head_dim=head_dim, config=DecompressConfig(tile_stores=tile_stores),
                                        interpret=False)
  with jax.sharding.use_abstract_mesh(H200):
    text = jax.jit(f).trace(arena, meta).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"stablehlo.custom_call @([\w$.]+)", text)
  assert calls == ["__gpu$xla.gpu.triton"], calls
  assert "zipfusion_restore_pages" in text
  # The kernel writes the pages' layout itself: no transpose of a BF16 page buffer follows it.
  assert "stablehlo.transpose" not in text

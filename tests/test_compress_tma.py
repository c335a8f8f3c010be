"""The TMA compressor (`pallas_kernels/compress_tma.py`).

Its per-lane arithmetic is written once against an `ops` object: here it runs on numpy words over
every lane of a warp (the `redux.sync` reductions as numpy min / max over the lanes), against the
format's reference planes. The kernel itself runs interpreted (its tile bytes from the jnp encoder,
the ring, tiles, partial tiles and placement as on the GPU) and lowers for an abstract H200 with
every PTX instruction it spells out.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType

import bf16_patterns
import test_format_v2
from test_compress_words import _halves, _prmt
import zipfusion_jax as zf
from pallas_kernels import compress_tma as CT
from pallas_kernels import compress_words as W
from pallas_kernels.compress import CompressConfig, compress_pallas
from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec

class NumpyOps(test_format_v2.NumpyOps):
  """The ops of `compress_tma.LaneOps` on numpy uint32 / bool arrays (the restore tests' ops and more)."""

  or_, xor, minu, maxu = np.bitwise_or, np.bitwise_xor, np.minimum, np.maximum
  ult = np.less
  prmt = staticmethod(lambda a, b, select: _prmt(a, b, select))
  min16 = staticmethod(lambda a, b: _halves(np.minimum, a, b))
  max16 = staticmethod(lambda a, b: _halves(np.maximum, a, b))


def _blocks(n=96, seed=0):
  """bf16 blocks: eligible ones at every b/2 in reach, raw ones (one outlier), and the special patterns."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, B.VALUES_PER_BLOCK)).astype(np.float32) * np.exp2(rng.integers(-100, 100, (n, 1)))
  x[1::7, 5] *= 2.0**40  # outliers: raw
  x[2] = 0.0
  x[3, ::2] = -0.0
  x[4, 9] = np.inf
  x[5, 3] = np.nan
  x[6] = np.float32(1e-40)  # subnormals
  x[7] = np.float32(3e38)
  return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def _lane_words(bits):
  """uint16 [n, 512] -> [n, 32 lanes, 2 fragments, 4 words]: fragment k = 32c + lane holds positions 8k .. 8k+7."""
  w = bits.astype(np.uint32).reshape(-1, 2, 32, 4, 2)
  return np.transpose(w[..., 0] | (w[..., 1] << np.uint32(16)), (0, 2, 1, 3))


def check_lanes(bits):
  """Run the lane functions over every lane of every block (`redux.sync` = min / max over the lanes)
  and compare the slot bytes with the independent numpy rule and the planes with the reference rows."""
  eligible, hb = bf16_patterns.numpy_block_rule(bits)
  want_meta = np.where(eligible, hb, B.META_RAW)
  want_rows = np.asarray(B.encode_rows(jnp.asarray(bits), jnp.asarray(want_meta))).view(np.uint32)
  words = _lane_words(bits)
  lo, hi = CT.lane_extremes(NumpyOps, [words[:, :, c, j] for c in range(2) for j in range(4)])
  slot = CT.slot_byte(NumpyOps, lo.min(axis=1), hi.max(axis=1), True)
  np.testing.assert_array_equal(slot, want_meta)
  raw = slot == B.META_RAW
  for c in range(2):
    k = 32 * c + np.arange(32)
    lx, ly, high, hy = CT.fragment_planes(NumpyOps, [words[:, :, c, j] for j in range(4)], slot[:, None])
    np.testing.assert_array_equal(lx, want_rows[:, 2 * k])
    np.testing.assert_array_equal(ly, want_rows[:, 2 * k + 1])
    np.testing.assert_array_equal(high[raw], want_rows[raw][:, 128 + 2 * k])
    np.testing.assert_array_equal(hy[raw], want_rows[raw][:, 128 + 2 * k + 1])
    np.testing.assert_array_equal(high[~raw], want_rows[~raw][:, 128 + k])
  return raw


def test_lane_rule_and_planes_equal_the_reference_rows(eligible_rotations, raw_rotations):
  """Every 16th block of the exhaustive pattern sets, and scaled normals with special values (the
  whole sets, ~5 s, below)."""
  raw = check_lanes(np.concatenate([eligible_rotations[::16], raw_rotations[::16], _blocks()]))
  assert 0 < raw.sum() < len(raw) - 1000
  assert int(CT.slot_byte(NumpyOps, np.uint32(0), np.uint32(0), False)) == B.META_ABSENT


def test_lanes_on_every_pattern_in_every_position(eligible_rotations, raw_rotations):
  for bits in (eligible_rotations, raw_rotations):
    for chunk in np.split(bits, 8):
      check_lanes(chunk)


def test_group_units_count_every_slot_kind():
  rng = np.random.default_rng(3)
  slots = rng.choice([0, 1, 0x3F, 0x7F, B.META_RAW, B.META_ABSENT], size=(500, 4))
  word1 = sum(slots[:, j].astype(np.uint32) << np.uint32(8 * j) for j in range(4))
  want = np.asarray(B.block_units(jnp.asarray(slots))).sum(axis=1)
  np.testing.assert_array_equal(CT.group_units(NumpyOps, word1), want)


def test_the_lane_check_can_fail(monkeypatch):
  """Swapping the low and high selectors, or an off-by-one rule, fails `check_lanes`."""
  bits = _blocks(16)
  monkeypatch.setitem(W.SELECT, "low", W.SELECT["high"])
  with pytest.raises(AssertionError):
    check_lanes(bits)
  monkeypatch.undo()
  monkeypatch.setattr(CT, "slot_byte", lambda ops, lo, hi, present: ops.shr(lo, ops.const(8)))  # never raw
  with pytest.raises(AssertionError):
    check_lanes(bits)


@pytest.mark.parametrize("n,tile_groups,stages,zero_tail,ordered,per_lane", [
    (53, 4, 2, True, False, 1), (64, 2, 3, False, False, 1), (37, 1, 1, True, False, 1), (130, 8, 2, True, False, 1),
    (53, 4, 2, True, True, 1), (37, 1, 1, False, True, 4)])
def test_interpreted_kernel_is_a_valid_stream_of_the_reference_groups(n, tile_groups, stages, zero_tail, ordered,
                                                                      per_lane):
  x = _blocks(n, seed=n).view(ml_dtypes.bfloat16)
  cfg = CompressConfig(tma=True, tile_groups=tile_groups, tma_stages=stages, zero_tail=zero_tail, ordered=ordered,
                       look_back_states=per_lane)
  got, want = compress_pallas(x, config=cfg, interpret=True), zf.compress(x)
  if ordered:  # block order: the reference's offsets as written
    np.testing.assert_array_equal(np.asarray(got.group_meta), np.asarray(want.group_meta))
  zf.validate(got)
  canonical = codec.canonical_order(got)
  assert int(got.payload_units) == int(want.payload_units)
  np.testing.assert_array_equal(np.asarray(canonical.group_meta), np.asarray(want.group_meta))
  used = int(want.payload_units) * B.UNIT_BYTES
  np.testing.assert_array_equal(np.asarray(canonical.payload)[:used], np.asarray(want.payload)[:used])
  if zero_tail:  # the kernel's own bytes past the units in use (interpreted outputs start as 0xFF)
    assert not np.asarray(got.payload)[used:].any()
    np.testing.assert_array_equal(np.asarray(canonical.payload), np.asarray(want.payload))
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))


class WarpOps(NumpyOps):
  """NumpyOps plus `redux.sync` over a warp: arrays [..., 32 lanes], the result on every lane."""

  redux_max = staticmethod(lambda a: np.broadcast_to(a.max(axis=-1, keepdims=True), a.shape))
  redux_add = staticmethod(lambda a: np.broadcast_to(a.sum(axis=-1, keepdims=True, dtype=np.uint32), a.shape))


def _walk(states, tile, per_lane=1):
  """The look-back loop of `_look_back` on numpy (its `look_back_step`s): windows of 32 * per_lane
  states ending at `tile` until a prefix is found; None where it would read a window again (the
  states here never change)."""
  lane = np.arange(32, dtype=np.uint32)
  end, acc = np.full(32, tile, np.uint32), np.zeros(32, np.uint32)
  while True:
    window = []
    for j in range(per_lane):
      index = end.astype(np.int64) - 32 * per_lane + per_lane * lane + j
      window.append(np.where(index < 0, np.uint32(CT.PREFIX), states[np.maximum(index, 0)]).astype(np.uint32))
    end, acc, found, retry = CT.look_back_step(WarpOps, window, lane, end, acc)
    if retry[0]:
      return None
    if found[0]:
      return int(acc[0])


@pytest.mark.parametrize("per_lane", [1, 4])
def test_look_back_finds_every_tiles_prefix(per_lane):
  rng = np.random.default_rng(0)
  units = rng.integers(0, 65, 300).astype(np.uint32)  # 0..64: a tile of 4 groups, absent blocks included
  prefix = np.concatenate([[0], np.cumsum(units)]).astype(np.uint32)
  for trial in range(20):
    # Each tile posted as its aggregate, or as its inclusive prefix, at random; never unposted.
    inclusive = rng.random(300) < [0.0, 0.05, 0.5, 1.0][trial % 4]
    states = np.where(inclusive, CT.PREFIX | prefix[1:], CT.AGGREGATE | units).astype(np.uint32)
    for tile in [0, 1, 31, 32, 33, 64, 150, 299]:
      assert _walk(states, tile, per_lane) == prefix[tile], (trial, tile)
  # An unposted state above the nearest prefix makes the window be read again; below it, it does not matter.
  states = (CT.AGGREGATE | units).astype(np.uint32)
  states[100] = CT.PREFIX | prefix[101]
  states[110] = 0
  assert _walk(states, 120, per_lane) is None
  states[105] = 0
  states[110] = CT.AGGREGATE | units[110]
  states[99] = 0
  assert _walk(states, 120, per_lane) is None  # 105 is above the prefix at 100
  states[105] = CT.AGGREGATE | units[105]
  assert _walk(states, 120, per_lane) == prefix[120]  # 99 lies below the prefix at 100


def test_config_checks():
  assert not CompressConfig(tma=True, tile_groups=4, ordered=False).block_order
  assert CompressConfig(tma=True, tile_groups=4).block_order
  with pytest.raises(ValueError, match="shared memory"):
    CompressConfig(tma=True)  # 16-group tiles (the single pass's default) do not fit
  with pytest.raises(ValueError, match="resident"):
    CT.compress_rows(jnp.zeros((64, 512), jnp.uint16), 64, tile_groups=4, stages=4, ctas=265, ordered=True)
  with pytest.raises(ValueError, match="tma"):
    CompressConfig(tma=True, single_pass=True, ordered=False)
  with pytest.raises(ValueError, match="tma_stages"):
    CompressConfig(tma=True, tile_groups=4, tma_stages=9)
  with pytest.raises(ValueError, match="shared memory"):
    CT.compress_rows(jnp.zeros((64, 512), jnp.uint16), 64, tile_groups=16, stages=4)
  with pytest.raises(ValueError, match="version 1"):
    compress_pallas(_blocks(8).view(ml_dtypes.bfloat16), config=CompressConfig(tma=True, tile_groups=4), interpret=True,
                    version=2)


@pytest.mark.parametrize("zero_tail,ordered", [(False, False), (True, False), (True, True)])
def test_lowers_for_an_abstract_h200_with_its_ptx(zero_tail, ordered):
  h200 = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                      abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))

  def f(x):
    c = compress_pallas(x, config=CompressConfig(tma=True, tile_groups=4, zero_tail=zero_tail, ordered=ordered),
                        interpret=False)
    return c.payload, c.group_meta, c.payload_units

  with jax.sharding.use_abstract_mesh(h200):
    text = jax.jit(f).trace(jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1  # the tail zeros too: no second kernel
  look_back = ("redux_add", "load_state", "post_state")  # the ordered placement's; the counter is unordered's
  for name, ptx in CT.PTX.items():
    assert (ptx.split()[0] in text) == (ordered if name in look_back else name != "atomic_add" or not ordered), name

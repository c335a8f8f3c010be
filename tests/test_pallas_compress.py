"""The Pallas compression kernel: same bytes as the reference, configs, and GPU lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType

import zipfusion_jax as zf
from benchmarks.synthetic_kv import synthetic_blocks
from pallas_kernels.compress import CompressConfig, compress_pallas, heuristic_config
from zipfusion_jax.format import block as B


def _mixed_blocks(n, seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(n, 512)) * np.exp2(rng.uniform(-6, 3, (n, 1)))).astype(np.float32)
  raw = rng.random(n) < 0.3
  x[raw, rng.integers(0, 512, raw.sum())] = 1e-30
  return x.astype(ml_dtypes.bfloat16)


def _assert_same(got, want):
  for name in ("payload", "group_meta", "payload_units"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
  assert got.batch_shape == want.batch_shape


@pytest.mark.parametrize("n", [1, 3, 4, 5, 63, 64, 65, 130])
def test_bytes_equal_reference_for_any_block_count(n):
  x = _mixed_blocks(n, seed=n)
  _assert_same(compress_pallas(x, interpret=True), zf.compress(x))


@pytest.mark.parametrize(
    "config",
    [CompressConfig(single_pass=True), CompressConfig(single_pass=True, tile_groups=4),
     CompressConfig(single_pass=True, tile_groups=1, scalar_look_back=True), CompressConfig(plan_blocks=4),
     CompressConfig(single_pass=True, tile_groups=1, num_warps=1, look_back_states=4)],
)
def test_retuned_configs_give_the_same_bytes(config):
  x = _mixed_blocks(200, seed=7)
  _assert_same(compress_pallas(x, config=config, interpret=True), zf.compress(x))


def _shuffle_groups(c, seed):
  """The same stream with its groups moved to a random non-overlapping order (as `ordered=False` may place them)."""
  meta = np.asarray(c.group_meta).copy()
  sizes = np.asarray(jnp.sum(B.block_units(c.meta_bytes), axis=-1))
  old = meta[:, 0] & B.OFFSET_MASK
  order = np.random.default_rng(seed).permutation(len(sizes))
  new = np.zeros_like(old)
  new[order] = np.cumsum(sizes[order]) - sizes[order]
  src = np.asarray(c.payload).reshape(-1, B.UNIT_BYTES)
  payload = np.zeros_like(src)
  for g in range(len(sizes)):
    payload[new[g] : new[g] + sizes[g]] = src[old[g] : old[g] + sizes[g]]
  meta[:, 0] = (meta[:, 0] & ~np.uint32(B.OFFSET_MASK)) | new.astype(np.uint32)
  return c.replace(payload=jnp.asarray(payload.reshape(-1)), group_meta=jnp.asarray(meta)), order


@pytest.mark.parametrize("version", [1, 2])
def test_canonical_order_restores_the_reference_bytes_of_a_shuffled_stream(version):
  x = _exception_blocks(37, seed=3) if version == 2 else _mixed_blocks(37, seed=3)
  want = zf.compress(x, version=version)
  shuffled, order = _shuffle_groups(want, seed=version)
  assert not np.array_equal(order, np.arange(order.size))
  assert not np.array_equal(np.asarray(shuffled.payload), np.asarray(want.payload))  # a real move
  zf.validate(shuffled)  # any non-overlapping order is a valid stream ...
  np.testing.assert_array_equal(np.asarray(zf.decompress(shuffled)).view(np.uint16), x.view(np.uint16))  # ... same bits
  _assert_same(zf.canonical_order(shuffled), want)
  _assert_same(jax.jit(zf.canonical_order)(shuffled), want)
  _assert_same(zf.canonical_order(want), want)  # already canonical: unchanged


def test_unordered_single_pass_is_a_valid_stream_of_the_reference_groups():
  """`ordered=False` (offsets from an atomic counter): valid, bit-exact, the reference's bytes once
  canonicalised. Interpret mode runs the tiles in order, so the placement itself is checked
  on the GPU (benchmarks/compress.py canonicalises before comparing)."""
  x = _mixed_blocks(200, seed=11)
  cfg = CompressConfig(single_pass=True, tile_groups=2, num_warps=1, ordered=False)
  got = compress_pallas(x, config=cfg, interpret=True)
  zf.validate(got)
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))
  _assert_same(zf.canonical_order(got), zf.compress(x))
  with pytest.raises(ValueError, match="single_pass"):
    CompressConfig(ordered=False)


def test_rule_from_the_pack_layout_equals_block_half_base(eligible_rotations, raw_rotations):
  """`_pack_half_base` on a block's x, y rows (as `_load_block` gives them) == `B.block_half_base`, on
  the exhaustive pattern sets (every 8th block: -0.0, NaN, Inf and subnormals among them) and on
  blocks of scaled normals (odd minimum exponents, spans around 15)."""
  from pallas_kernels.compress import _pack_half_base

  mixed = _mixed_blocks(300, seed=5).view(np.uint16)
  bits = np.concatenate([eligible_rotations[::8], raw_rotations[::8], mixed])
  pairs = bits.astype(np.int32).reshape(-1, 64, 2, 4)  # row 2k: positions 8k..8k+3 (x), row 2k+1: y
  eligible, half_base = _pack_half_base(jnp.asarray(pairs[:, :, 0]), jnp.asarray(pairs[:, :, 1]))
  want_eligible, want_half_base = B.block_half_base(jnp.asarray(bits))
  assert 0 < int(np.sum(want_eligible)) < len(bits)
  np.testing.assert_array_equal(np.asarray(eligible), np.asarray(want_eligible))
  np.testing.assert_array_equal(np.asarray(half_base), np.asarray(want_half_base))


@pytest.mark.parametrize("programs,tile_groups,offset_ahead", [(1, 1, False), (2, 1, False), (2, 2, False),
                                                               (200, 2, False), (1, 1, True), (2, 1, True),
                                                               (3, 2, True), (200, 2, True)])
def test_persistent_unordered_single_pass_is_a_valid_stream_of_the_reference_groups(programs, tile_groups,
                                                                                     offset_ahead):
  """`persistent_programs` (each program loops over tiles p, p + P, ..., loading the next tile while it
  stores this one; with `offset_ahead`, placing the next tile before storing this one): valid,
  bit-exact, the reference's bytes once canonicalised. 301 blocks: a partial last group and tile;
  P = 200 exceeds the tiles (the grid is clamped); P = 3 leaves programs with unequal tile counts."""
  x = _mixed_blocks(301, seed=21)
  cfg = CompressConfig(single_pass=True, ordered=False, tile_groups=tile_groups, num_warps=1,
                       persistent_programs=programs, offset_ahead=offset_ahead)
  got, want = compress_pallas(x, config=cfg, interpret=True), zf.compress(x, impl="reference")
  zf.validate(got)
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))
  _assert_same(zf.canonical_order(got), want)
  offsets = np.asarray(got.group_meta)[:, 0] & B.OFFSET_MASK
  if programs == 2:  # interpret mode runs program 0's tiles, then program 1's: not block order
    assert np.any(np.diff(offsets.astype(np.int64)) < 0)


@pytest.mark.parametrize("programs,packed_words", [(1, False), (3, True), (200, True)])
def test_tiles_from_the_tile_counter_give_a_valid_stream_of_the_reference_groups(programs, packed_words):
  """`tile_counter` (a program's tiles after its first come from a second counter): valid, bit-exact,
  the reference's bytes once canonicalised; the counter hands out each tile once (interpret mode runs
  program 0 first, which then takes every tile past the first P, so the others stop after their first)."""
  x = _mixed_blocks(301, seed=22)
  cfg = CompressConfig(single_pass=True, ordered=False, tile_groups=1, num_warps=1, persistent_programs=programs,
                       packed_words=packed_words, tile_counter=True)
  got, want = compress_pallas(x, config=cfg, interpret=True), zf.compress(x, impl="reference")
  zf.validate(got)
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))
  _assert_same(zf.canonical_order(got), want)
  with pytest.raises(ValueError, match="tile_counter"):
    CompressConfig(single_pass=True, ordered=False, persistent_programs=8, offset_ahead=True, tile_counter=True)
  with pytest.raises(ValueError, match="tile_counter"):
    CompressConfig(single_pass=True, ordered=False, tile_counter=True)


def test_persistent_single_pass_configs_are_checked():
  with pytest.raises(ValueError, match="persistent_programs"):
    CompressConfig(single_pass=True, ordered=False, persistent_programs=-1)
  with pytest.raises(ValueError, match="ordered=False"):
    CompressConfig(single_pass=True, persistent_programs=4)
  with pytest.raises(ValueError, match="single_pass"):
    CompressConfig(ordered=False, persistent_programs=4)
  with pytest.raises(ValueError, match="offset_ahead"):
    CompressConfig(single_pass=True, ordered=False, offset_ahead=True)
  cfg = CompressConfig(single_pass=True, ordered=False, tile_groups=1, num_warps=1, persistent_programs=2)
  with pytest.raises(ValueError, match="version 1 only"):
    compress_pallas(_exception_blocks(8), config=cfg, interpret=True, version=2)


@pytest.mark.parametrize("config", [CompressConfig(zero_tail=False),
                                    CompressConfig(single_pass=True, tile_groups=2, num_warps=1, zero_tail=False)])
def test_without_tail_zeroing_the_used_prefix_is_the_reference_s(config):
  """zero_tail=False: metadata and the used prefix are the reference's; the kernel writes nothing past it."""
  x = _mixed_blocks(90, seed=13)
  got, want = compress_pallas(x, config=config, interpret=True), zf.compress(x)
  np.testing.assert_array_equal(np.asarray(got.group_meta), np.asarray(want.group_meta))
  assert int(got.payload_units) == int(want.payload_units) and int(want.payload_units) * 256 < got.payload.size
  used = int(want.payload_units) * 256
  np.testing.assert_array_equal(np.asarray(got.payload)[:used], np.asarray(want.payload)[:used])
  np.testing.assert_array_equal(np.asarray(zf.decompress(zf.validate(got))).view(np.uint16), x.view(np.uint16))


def test_batch_shape_is_kept():
  x = _mixed_blocks(12).reshape(3, 4, 512)
  c = zf.compress(x, impl="pallas")
  assert c.compressible.shape == (3, 4)
  np.testing.assert_array_equal(np.asarray(zf.decompress(c)).view(np.uint16), x.view(np.uint16))


def test_config_validation_and_heuristic():
  with pytest.raises(ValueError, match="power of two"):
    CompressConfig(plan_blocks=12)
  with pytest.raises(ValueError, match="tile_groups"):
    CompressConfig(tile_groups=3)
  with pytest.raises(ValueError, match="num_warps"):
    CompressConfig(num_warps=3)
  with pytest.raises(ValueError, match="look_back_states"):
    CompressConfig(look_back_states=6)
  assert heuristic_config(1000) == CompressConfig()


H200 = AbstractMesh(
    (1,), ("x",), (AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


@pytest.mark.parametrize("config,version", [(CompressConfig(), 1), (CompressConfig(single_pass=True), 1),
                                            (CompressConfig(single_pass=True, num_warps=1, look_back_states=8), 1),
                                            (CompressConfig(single_pass=True, num_warps=1, ordered=False), 1),
                                            (CompressConfig(single_pass=True, num_warps=1, ordered=False), 2),
                                            (CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False,
                                                            persistent_programs=8), 1),
                                            (CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False,
                                                            persistent_programs=8, offset_ahead=True), 1),
                                            (CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False,
                                                            persistent_programs=8, packed_words=True,
                                                            tile_counter=True), 1),
                                            (CompressConfig(), 2)])
def test_lowers_for_an_abstract_h200_to_pallas_triton_calls(config, version):
  def f(x):
    c = compress_pallas(x, config=config, interpret=False, version=version)
    return c.payload, c.group_meta, c.payload_units

  with jax.sharding.use_abstract_mesh(H200):
    text = jax.jit(f).trace(jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)
    ).as_text()
  calls = re.findall(r"stablehlo.custom_call @([\w$.]+)", text)
  assert calls.count("__gpu$xla.gpu.triton") == 2, calls
  names = ("single_pass", "zero_tail") if config.single_pass else ("plan", "pack")
  if config.persistent_programs:
    names += ("single_pass_persistent",)
  for name in names:
    assert f"zipfusion_compress_{name}" in text


def _exception_blocks(n, seed=0):
  """bf16 [n, 512]: in-window blocks (exponents 112..127) with 0, 1 or 2 values outside, anywhere."""
  rng = np.random.default_rng(seed)
  e = rng.integers(112, 128, (n, 512))
  bits = ((rng.integers(0, 2, (n, 512)) << 15) | (e << 7) | rng.integers(0, 128, (n, 512))).astype(np.uint16)
  outliers = rng.integers(0, 3, n)
  for i in np.flatnonzero(outliers):
    bits[i, rng.integers(0, 512, outliers[i])] = rng.integers(0, 1 << 16, outliers[i])  # any pattern, ±0 and NaN too
  return bits.view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("n", [1, 5, 64, 130])
def test_version_2_bytes_equal_reference(n):
  x = _exception_blocks(n, seed=n)
  got, want = compress_pallas(x, interpret=True, version=2), zf.compress(x, version=2)
  _assert_same(got, want)
  assert np.asarray(want.group_meta).shape[1] == 4 and np.any(np.asarray(want.meta_bytes) & 0x80)
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))


@pytest.mark.parametrize("config", [CompressConfig(single_pass=True, tile_groups=2, num_warps=1),
                                    CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False)])
def test_version_2_single_pass_bytes_equal_reference(config):
  x = _exception_blocks(70, seed=5)
  got, want = compress_pallas(x, config=config, interpret=True, version=2), zf.compress(x, version=2)
  _assert_same(zf.canonical_order(got), want)
  if config.ordered:
    _assert_same(got, want)
  np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), x.view(np.uint16))


@pytest.mark.slow  # ~60 s interpreted; test_version_2_bytes_equal_reference stays in the default tier
def test_version_2_kernel_on_every_pattern_as_the_exception():
  """Every BF16 pattern once as the one out-of-window value (at a rotating position), in chunks."""
  from test_format_v2 import background

  rng = np.random.default_rng(17)
  patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
  bits = background(rng, patterns.size)
  rows, position = np.arange(patterns.size), np.arange(patterns.size) % 512
  bits[rows, np.where(np.isin(position, (1, 2)), 0, position)] = patterns
  for start in range(0, patterns.size, 8192):
    x = bits[start : start + 8192].view(ml_dtypes.bfloat16)
    _assert_same(compress_pallas(x, interpret=True, version=2), zf.compress(x, version=2))


@pytest.mark.parametrize("window", [128, 256])  # 4 warps x 1 state (the default), 1 warp x 8
@pytest.mark.parametrize("t,inclusive_at", [(1, None), (31, None), (32, None), (33, None), (100, None), (100, 40), (100, 98),
                                            (300, None), (300, 44)])
def test_look_back_sums_aggregates_across_windows_back_to_the_newest_inclusive_prefix(t, inclusive_at, window):
  """`_look_back` as tile t sees a state array where its predecessors posted aggregates only
  (tile 0 is always inclusive) or, from `inclusive_at`, an inclusive prefix; entries past t hold
  posts of later tiles, which must be ignored. Interpret-mode runs of the whole kernel always find
  tile t - 1 inclusive, so the multi-window path is only reached here."""
  from pallas_kernels import compress as C

  rng = np.random.default_rng(t)
  sizes = rng.integers(12, 17, t + window + 8)
  flags = np.full(sizes.shape, C.FLAG_AGGREGATE)
  flags[0] = C.FLAG_INCLUSIVE
  values = sizes.copy()
  if inclusive_at is not None:
    flags[inclusive_at], values[inclusive_at] = C.FLAG_INCLUSIVE, sizes[: inclusive_at + 1].sum()
  flags[t:] = C.FLAG_INCLUSIVE  # later tiles (and the padding) look finished: never counted
  state = jnp.asarray((values << 2) | flags, jnp.int32)

  def kernel(state_ref, out_ref):
    out_ref[0] = C._look_back(state_ref, jnp.int32(t), jnp.int32(0), window)[0]

  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), interpret=True,
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY))(state)
  assert int(got[0]) == int(sizes[:t].sum())


def test_look_back_gives_up_after_max_probes_when_a_predecessor_never_posts():
  """The diagnostic bound: tile 40 waits on tile 39, which posted nothing; unbounded this spins
  forever, with `max_probes` it returns after exactly that many probes."""
  from pallas_kernels import compress as C

  state = np.full(40 + C.LOOK_BACK, (13 << 2) | C.FLAG_AGGREGATE, np.int32)
  state[0], state[39] = (13 << 2) | C.FLAG_INCLUSIVE, 0

  def kernel(state_ref, out_ref):
    out_ref[0], out_ref[1] = C._look_back(state_ref, jnp.int32(40), jnp.int32(0), max_probes=5)

  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2,), jnp.int32), interpret=True,
                       in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY))(
                           jnp.asarray(state))
  assert int(got[1]) == 5


def test_single_pass_diagnostics_report_a_complete_chain():
  from pallas_kernels.compress import single_pass_diagnostics

  x = synthetic_blocks(jax.random.key(3), 4 * 4 * 8 + 4)  # 9 tiles of 4 groups, the last partial
  d = single_pass_diagnostics(x, CompressConfig(single_pass=True, tile_groups=4, plan_blocks=4, max_probes=64),
                              interpret=True)
  assert d["ticket"] == d["tiles"] == 9 and d["flags"] == {"none": 0, "aggregate": 0, "inclusive": 9}
  assert d["inclusive_prefix_ok"] and d["metadata_match"] and 1 <= d["probes_max"] <= 64


@pytest.mark.parametrize("groups,total_units", [(3, 0), (3, 17), (3, 47), (3, 48), (40, 5 * 16 + 3), (1100, 1050 * 16)])
def test_zero_payload_tail_zeroes_exactly_the_rows_past_the_data(groups, total_units):
  from pallas_kernels.compress import ROWS_PER_UNIT, WINDOW_ROWS, zero_payload_tail

  payload = jnp.full((groups * WINDOW_ROWS, 4), 0xA5, jnp.uint8)  # stands for the kernel's unwritten bytes
  out = np.asarray(zero_payload_tail(payload, jnp.array([total_units], jnp.int32), interpret=True))
  used = total_units * ROWS_PER_UNIT
  assert np.all(out[:used] == 0xA5), "a row holding data was overwritten"
  assert np.all(out[used:] == 0), "a row past the data was left unzeroed"


def test_single_pass_bad_configs_are_refused():
  x = jnp.zeros((64, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="max_probes"):
    CompressConfig(max_probes=-1)
  from pallas_kernels.compress import single_pass_diagnostics

  with pytest.raises(ValueError, match="bounded look-back"):  # diagnosing on a GPU needs the bound
    single_pass_diagnostics(x, CompressConfig(single_pass=True), interpret=False)


@pytest.mark.parametrize("config,want", [
    (CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False, persistent_programs=8), {"relaxed"}),
    (CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False), {"relaxed"}),
    (CompressConfig(single_pass=True, tile_groups=1, num_warps=1, ordered=False, persistent_programs=8,
                    fenced_counter=True), {"acq_rel"}),
    (CompressConfig(single_pass=True, num_warps=1), {"acq_rel"}),  # the ordered look-back publishes states
])
def test_the_unordered_counter_is_a_relaxed_atomic(config, want):
  """The Triton module the GPU compiles (captured from the lowering for an abstract H200): the unit
  counter's fetch-and-add orders nothing, so it carries no acquire-release fence (a MEMBAR.ALL.GPU
  per tile in SASS); the A/B knob and the look-back's state posts keep theirs."""
  from benchmarks.kernel_sass import capture_triton_modules

  def f(x):
    return compress_pallas(x, config=config, interpret=False).payload

  modules = dict(capture_triton_modules(f, jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)))
  main = next(text for name, text in modules.items() if "single_pass" in name)
  semantics = set(re.findall(r"tt\.atomic_rmw \w+, (\w+),", main))
  assert semantics == want, semantics


def test_relaxed_counter_config_errors():
  with pytest.raises(ValueError, match="fenced_counter"):
    CompressConfig(single_pass=True, fenced_counter=True)  # ordered: the look-back, not a counter

"""The fused decode-attention kernel off-GPU: it lowers for an H200, fused, with no BF16 copy.

The kernel's numerics are checked on the GPU by `python -m benchmarks.fused_kernel_check`
(ragged lengths, GQA 1-8, head_dim 64/128, splits, raw blocks; compressed == uncompressed
bit for bit). Here: the same kernel body in Mosaic GPU interpret mode against the jnp
reference (its restore is the jnp codec, since inline PTX cannot be interpreted), Mosaic GPU
lowering of both stores for an abstract H200 (this runs the inline restore's MLIR builders),
the HLO structure, the split combine, the heuristic.
"""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType

import zipfusion_jax as zf
from pallas_kernels import decode_attention as da
from pallas_kernels.merge_items import merge_items
from zipfusion_jax.paged import reference

H200 = AbstractMesh(
    (1,), ("x",), (AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


def _kv(batch, seq, kv_heads, head_dim, seed=0):
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.bfloat16)
  return k, v


def _lower_text(fn, *args):
  avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  with jax.sharding.use_abstract_mesh(H200):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def _bf16_sizes(text):
  """Element counts of every bf16 tensor type in lowered StableHLO text."""
  return [int(np.prod([int(d) for d in dims.rstrip("x").split("x")])) for dims in re.findall(r"tensor<((?:\d+x)+)bf16>", text)]


@pytest.mark.parametrize(
    "compressed,head_dim,group,splits",
    [(True, 128, 4, 1), (False, 128, 4, 2), (True, 64, 3, 2), (False, 64, 3, 1), (True, 128, 8, 3)],
)
@pytest.mark.parametrize(
    "variant", [{}, {"stages": 4}, {"timing_probe": "compute"}, {"warp_issue": False}, {"consumer_registers": 168},
                {"consumer_registers": 232, "warp_issue": False}, {"consumers": 2}, {"consumers": 2, "stages": 4},
                {"v_after_qk": True}, {"max_registers": 128, "v_after_qk": True}])
def test_lowers_to_one_mosaic_gpu_kernel_for_an_abstract_h200(compressed, head_dim, group, splits, variant):
  kv_heads = 3 if group == 3 else 2
  k, v = _kv(2, 100, kv_heads, head_dim)
  cache = zf.paged_cache_from_dense(k, v, np.array([100, 37]), compressed=compressed)
  q = jnp.zeros((2, kv_heads * group, head_dim), jnp.bfloat16)
  text = _lower_text(lambda q, c: da._decode_attention(q, c, 0.125, da.DecodeConfig(splits=splits, **variant), True), q, cache)
  assert text.count("mosaic_gpu") >= 1
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_a_register_cap_reaches_the_outlined_kernel(monkeypatch):
  """DecodeConfig.max_registers: the kernel is outlined before serialization with `nvvm.maxnreg`
  on its gpu.func (PTX `.maxnreg`), its arguments still plain pointers; uncapped kernels are untouched."""
  from pallas_kernels import register_cap_mgpu as RC

  kernels = []

  def spy(module):
    caps = apply_marks(module)
    kernels.append((caps, [dict(type=str(f.attributes["function_type"]),
                                cap=str(f.attributes["nvvm.maxnreg"]) if "nvvm.maxnreg" in f.attributes else None)
                           for f in RC._ops_named(module, "gpu.func")], len(RC._ops_named(module, "gpu.launch"))))
    return caps

  apply_marks = RC.apply_marks
  monkeypatch.setattr(RC, "apply_marks", spy)
  k, v = _kv(2, 100, 2, 128)
  cache = zf.paged_cache_from_dense(k, v, np.array([100, 37]), version=2)
  q = jnp.zeros((2, 8, 128), jnp.bfloat16)
  for cap in (128, 0):
    cfg = da.DecodeConfig(stages=2, v_after_qk=True, max_registers=cap)
    text = _lower_text(lambda q, c: da._decode_attention(q, c, 0.125, cfg, True), q, cache)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert ("nvvm.maxnreg" in text) == bool(cap)
  (caps, funcs, launches), (no_caps, no_funcs, kept) = kernels
  assert caps == [128] and launches == 0 and len(funcs) == 1 and funcs[0]["cap"] == "128 : i32"
  args = funcs[0]["type"].split(") -> ")[0].strip("(").split(", ")
  assert set(args) <= {"!llvm.ptr", "!llvm.array<1024 x i8>"}, args  # pointers (+ the TMA descriptors' bytes)
  assert no_caps == [] and no_funcs == [] and kept == 1  # uncapped: the compile pipeline outlines it
  with pytest.raises(ValueError, match="max_registers"):
    da.DecodeConfig(max_registers=130)
  with pytest.raises(RuntimeError, match="not inside a Mosaic GPU kernel"):
    from jax._src.interpreters import mlir as jmlir
    from jaxlib.mlir import ir

    with jmlir.make_ir_context(), ir.Location.unknown():
      module = ir.Module.create()
      with ir.InsertionPoint(module.body):
        RC.request_max_registers(128)


def test_the_register_cap_hook_installs_once_even_across_a_reload():
  import importlib

  from jax.experimental.mosaic.gpu import core
  from pallas_kernels import register_cap_mgpu as RC

  RC.install()
  hook = core._run_serde_pass
  importlib.reload(RC)
  RC.install()
  assert core._run_serde_pass is hook  # not wrapped twice (a wrapper calling itself would recurse)


@pytest.mark.parametrize("fold", da.EXCEPTION_FOLDS)
@pytest.mark.parametrize("head_dim,group,splits,warp_issue", [(128, 4, 1, True), (64, 3, 2, False)])
def test_version_2_cache_lowers_to_one_mosaic_gpu_kernel(head_dim, group, splits, warp_issue, fold):
  """Format version 2: 32-byte page records in the gather, exception patches in both restores
  (folded by each consumer thread, or once per step by the producer)."""
  kv_heads = 3 if group == 3 else 2
  k, v = _kv(2, 100, kv_heads, head_dim)
  cache = zf.paged_cache_from_dense(k, v, np.array([100, 37]), version=2)
  q = jnp.zeros((2, kv_heads * group, head_dim), jnp.bfloat16)
  cfg = da.DecodeConfig(splits=splits, stages=3, warp_issue=warp_issue, exception_fold=fold)
  text = _lower_text(lambda q, c: da._decode_attention(q, c, 0.125, cfg, True), q, cache)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_two_consumers_lower_to_three_warpgroups_and_twice_the_partials():
  k, v = _kv(2, 100, 2, 128)
  cache = zf.paged_cache_from_dense(k, v, np.array([100, 37]), compressed=True)
  q = jnp.zeros((2, 8, 128), jnp.bfloat16)
  for consumers, threads in ((1, 256), (2, 384)):
    cfg = da.DecodeConfig(splits=3, stages=2, consumers=consumers)
    text = _lower_text(lambda q, c, cfg=cfg: da._decode_attention(q, c, 0.125, cfg, True), q, cache)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    # the kernel's partial outputs [items = B * splits, Hkv, consumers, D, 8]: splits x consumers per (sequence, KV head)
    assert re.search(rf"tensor<6x2x{consumers}x128x8xf32>", text), f"no {3 * consumers}-partial O output"


def test_compressed_pages_are_never_materialised_as_bf16():
  """The fused path holds no BF16 buffer the size of the pages; decompress-then-attend does."""
  batch, seq, kv_heads, head_dim = 2, 1024, 2, 128
  k, v = _kv(batch, seq, kv_heads, head_dim)
  cache = zf.paged_cache_from_dense(k, v, np.array([1024, 1000]), compressed=True)
  q = jnp.zeros((batch, kv_heads * 4, head_dim), jnp.bfloat16)
  page_elems = kv_heads * cache.num_pages * 16 * head_dim
  fused = _lower_text(lambda q, c: zf.paged_decode_attention(q, c, impl="pallas", interpret=False), q, cache)
  assert "mosaic_gpu" in fused
  assert max(_bf16_sizes(fused)) < page_elems // 8, "a BF16 buffer of page size exists in the fused path"
  baseline = _lower_text(lambda q, c: zf.decompress_then_attend(q, c, impl="reference"), q, cache)
  assert max(_bf16_sizes(baseline)) >= page_elems  # the check can fail


INTERPRET_CASES = [
    # batch, seq, kv_heads, group, head_dim, lengths, splits, stages, warp_issue
    (2, 100, 2, 4, 64, [100, 37], 1, 2, False),
    (3, 90, 1, 3, 64, [0, 16, 90], 2, 2, True),  # one KV head: 45 s interpreted at three (2026-12-06)
    (2, 80, 1, 8, 128, [80, 17], 1, 3, False),
    pytest.param(2, 2200, 1, 2, 64, [2200, 2100], 1, 2, True,  # past one 128-page metadata chunk
                 marks=pytest.mark.slow),  # 39 s interpreted (the GPU check covers chunk crossings every run)
]


def _interpreted_problem(batch, seq, kv_heads, group, head_dim, lengths):
  """(q, k, v, lengths): random K/V with raw blocks next to compressed ones, and queries."""
  k, v = _kv(batch, seq, kv_heads, head_dim, seed=seq)
  k = k.at[:, ::29, :, 5].set(4e4)  # raw blocks next to compressed ones
  q = jnp.asarray(np.random.default_rng(1).normal(size=(batch, kv_heads * group, head_dim)), jnp.bfloat16)
  return q, k, v, np.array(lengths)


def _interpreted_outputs(q, caches, plain, cfg):
  """Each cache's interpreted kernel output (uint16 view), after checking it and its log-sum-exp
  against the jnp reference on the BF16 pages `plain`."""
  ref, ref_lse = zf.paged_decode_attention(q, plain, impl="reference", return_lse=True)
  finite = np.isfinite(np.asarray(ref_lse))
  outs = []
  for cache in caches:
    out, lse = zf.paged_decode_attention(q, cache, impl="pallas", config=cfg, return_lse=True, interpret=True)
    chex.assert_shape(out, q.shape)
    chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    chex.assert_trees_all_close(jnp.asarray(lse)[finite], ref_lse[finite], atol=1e-2)
    outs.append(np.asarray(out).view(np.uint16))
  return outs


@pytest.mark.parametrize("batch,seq,kv_heads,group,head_dim,lengths,splits,stages,warp_issue", INTERPRET_CASES)
def test_interpreted_kernel_matches_the_reference_and_both_stores_agree_bitwise(
    batch, seq, kv_heads, group, head_dim, lengths, splits, stages, warp_issue):
  """The kernel body on CPU (Mosaic GPU interpret mode; jnp restore and P through SMEM)."""
  q, k, v, lengths = _interpreted_problem(batch, seq, kv_heads, group, head_dim, lengths)
  comp = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  comp2 = zf.paged_cache_from_dense(k, v, lengths, compressed=True, version=2)  # the raw blocks' outliers as exceptions
  plain = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  cfg = da.DecodeConfig(splits=splits, stages=stages, warp_issue=warp_issue)
  outs = _interpreted_outputs(q, (comp, plain, comp2), plain, cfg)
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_array_equal(outs[2], outs[1])
  assert np.all(outs[0][lengths == 0] == 0)  # an empty sequence attends to nothing: zeros
  if lengths.max() >= 16:
    assert np.any(np.asarray(comp2.group_meta[..., 1]) & 0x80808080)  # version 2 did store exceptions


@pytest.mark.parametrize("lengths,splits,stages", [([150, 37, 0], 1, 2),
                                                   pytest.param([150, 70, 16], 2, 4, marks=pytest.mark.slow)])
def test_two_consumers_interpreted_match_the_reference_and_both_stores_agree_bitwise(lengths, splits, stages):
  """Consumer c takes steps c, c + 2, ...: odd step counts, a consumer with no step (37 tokens: one
  step) and an empty sequence; each consumer's partial is merged by the split combine."""
  q, k, v, lengths = _interpreted_problem(3, 150, 2, 4, 64, lengths)
  comp = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  plain = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  outs = _interpreted_outputs(q, (comp, plain), plain, da.DecodeConfig(splits=splits, stages=stages, consumers=2))
  np.testing.assert_array_equal(outs[0], outs[1])
  assert np.all(outs[0][lengths == 0] == 0)


def _item_pages_oracle(pages, kv_heads, max_pages, num_items):
  """The balanced item size by its rule, in plain Python: the longest sequence cut into n equal
  whole-step items (>= 16 pages) for every n; of the sizes whose items fit `num_items`, the one with
  the fewest waves of 264 CTA slots times (size + 16 pages), the largest on ties."""
  best = None
  for n in range(1, -(-(max_pages + 1) // 16) + 1):
    size = max(16, -(-(-(-int(pages.max(initial=0)) // n)) // 4) * 4)
    items = sum(-(-int(p) // size) for p in pages)
    if items > num_items:
      continue
    cost = -(-items * kv_heads // 264) * (size + 16)
    if best is None or cost < best[0] or (cost == best[0] and size > best[1]):
      best = (cost, size)
  return best[1]


@pytest.mark.parametrize("lengths,kv_heads,items", [
    ([131072] + [1000] * 31, 8, 0),  # one long sequence among short ones
    ([2048] * 32, 8, 0), ([8192] * 8, 8, 0), ([0, 0, 5], 2, 0), ([0] * 4, 8, 0), ([700, 37, 0], 1, 4),
    ("random", 8, 0), ("random", 3, 7)])
def test_balanced_items_cover_every_page_once_in_equal_whole_steps(lengths, kv_heads, items):
  if lengths == "random":
    lengths = np.random.default_rng(kv_heads).integers(0, 40000, size=48)
  lengths = np.asarray(lengths, np.int32)
  batch, pages = len(lengths), -(-lengths // 16)
  cfg = da.DecodeConfig(schedule="balanced", items=items)
  work, seq_first = jax.jit(da._work_items, static_argnums=(1, 2, 3))(jnp.asarray(lengths), kv_heads, 8192, cfg)
  work, seq_first = np.asarray(work), np.asarray(seq_first)
  rows = -(-((items or da.target_items(kv_heads)) + batch) // 8) * 8  # budget + B, in whole blocks of 8
  chex.assert_shape((work, seq_first), ((rows, 3), (batch + 1,)))
  assert seq_first[0] == 0 and np.all(np.diff(seq_first) >= 0)
  used = np.arange(rows) < seq_first[-1]  # used items first, in sequence order
  np.testing.assert_array_equal(work[~used], np.broadcast_to([-1, 0, 0], work[~used].shape))  # unused: no page
  b, first, end = work[used].T
  np.testing.assert_array_equal(b, np.repeat(np.arange(batch), np.diff(seq_first)))  # b's items: [first[b], first[b + 1])
  assert np.all(first % da.STEP_PAGES == 0) and np.all(end - first >= 1) and np.all((end - first) % da.STEP_PAGES == 0)
  assert np.all(first < pages[b])  # no item lies wholly past its sequence
  covered = np.zeros((batch, pages.max(initial=0) + 1), int)
  for bi, f, e in zip(b, first, end):
    covered[bi, f: min(e, pages[bi])] += 1
  np.testing.assert_array_equal(covered, np.arange(covered.shape[1])[None] < pages[:, None])  # every page once
  chunk = _item_pages_oracle(pages, kv_heads, 8192, rows)
  assert int(da._item_pages(jnp.asarray(pages), kv_heads, 8192, rows)) == chunk
  assert np.all(end - first <= chunk)  # no item longer than the planned size
  for bi in set(b):  # a sequence's items are equal (the last one clamped by the length)
    assert len(set((end - first)[b == bi])) == 1
  if len(set(lengths)) == 1 and lengths[0] > 0:  # equal lengths: as many items as the grid heuristic's splits
    assert used.sum() == batch * da.heuristic_config(batch, kv_heads, int(pages[0])).splits


def test_host_plan_is_the_device_plan_over_random_batches():
  """numpy runs `_work_items`' statements on the host: the same table as jnp (the reference the
  plan kernel is also checked against) for random ragged batches (1-230 sequences, empty ones included), item budgets and KV head counts."""
  rng = np.random.default_rng(7)
  plan = jax.jit(da._work_items, static_argnums=(1, 2, 3))
  for trial in range(24):
    batch, kv_heads = int(rng.integers(1, 231)), int(rng.choice([1, 3, 8]))
    max_pages = int(rng.integers(1, 2049))
    lengths = rng.integers(0, 16 * max_pages + 1, batch).astype(np.int32)
    lengths[rng.random(batch) < 0.2] = 0
    cfg = da.DecodeConfig(schedule="balanced", items=int(rng.choice([0, 1, 33])))
    table, seq_first = da.host_work_items(lengths, kv_heads, max_pages, cfg)
    want = plan(jnp.asarray(lengths), kv_heads, max_pages, cfg)
    assert table.dtype == seq_first.dtype == np.int32, trial
    np.testing.assert_array_equal(table, want[0], err_msg=f"trial {trial}")
    np.testing.assert_array_equal(seq_first, want[1], err_msg=f"trial {trial}")
  for lengths, cfg in ((np.array([5]), da.DecodeConfig()), (np.zeros((0,), np.int32), da.DecodeConfig(schedule="balanced")),
                       (np.zeros((2, 2), np.int32), da.DecodeConfig(schedule="balanced"))):
    with pytest.raises(ValueError, match="balanced schedule for lengths"):
      da.host_work_items(lengths, 8, 40, cfg)


def test_the_plan_kernel_interpreted_makes_the_host_plans_items():
  """`plan_items` (one Triton program: the candidates, the cumulative sum and the rows in blocks)
  against `host_work_items` over random ragged batches: batches past one candidate block's and one
  row block's width (B up to 300), every KV head count, both consumer counts, item budgets, empty
  sequences and an all-empty batch; the zero fourth column; lowered, it is one Triton call."""
  rng = np.random.default_rng(11)
  cases = [(np.zeros(5, np.int32), 8, 40, da.DecodeConfig(schedule="balanced"))]
  for _ in range(6):
    batch, max_pages = int(rng.integers(1, 301)), int(rng.integers(1, 8193))
    lengths = rng.integers(0, 16 * max_pages + 1, batch).astype(np.int32)
    lengths[rng.random(batch) < 0.2] = 0
    cfg = da.DecodeConfig(schedule="balanced", items=int(rng.choice([0, 1, 33])), consumers=int(rng.choice([1, 2])))
    cases.append((lengths, int(rng.choice([1, 3, 8])), max_pages, cfg))
  for lengths, kv_heads, max_pages, cfg in cases:
    table, seq_first = da._device_plan(jnp.asarray(lengths), kv_heads, max_pages, cfg, True)
    want_table, want_first = da.host_work_items(lengths, kv_heads, max_pages, cfg)
    chex.assert_shape(table, (want_table.shape[0], 4))
    np.testing.assert_array_equal(np.asarray(table)[:, :3], want_table)
    np.testing.assert_array_equal(np.asarray(table)[:, 3], 0)
    np.testing.assert_array_equal(seq_first, want_first)
  text = _lower_text(lambda n: da._device_plan(n, 8, 2048, da.DecodeConfig(schedule="balanced"), False),
                     jnp.zeros((37,), jnp.int32))
  assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1 and "zipfusion_plan_items" in text


@pytest.mark.parametrize("lengths", [[32768] + [1024] * 31, [2048] * 32, [0, 0, 5], [700, 37, 0]])
def test_host_planned_items_equal_the_device_plan_and_skip_it(lengths):
  """`host_work_items` (numpy, for a caller that knows the lengths) is the jnp plan; passed as
  `work=`, the jitted call has no plan kernel left in it, only the attention and the merge."""
  lengths = np.asarray(lengths, np.int32)
  cfg = da.DecodeConfig(schedule="balanced")
  max_pages = int(lengths.max()) // 16
  table, seq_first = da.host_work_items(lengths, 8, max_pages, cfg)
  assert isinstance(table, np.ndarray) and table.dtype == np.int32
  want = jax.jit(da._work_items, static_argnums=(1, 2, 3))(jnp.asarray(lengths), 8, max_pages, cfg)
  np.testing.assert_array_equal(table, want[0])
  np.testing.assert_array_equal(seq_first, want[1])
  if lengths.max() < 1000:
    return
  k, v = _kv(len(lengths), 16, 8, 128)  # only the shapes matter for the lowering
  cache = zf.paged_cache_from_dense(k, v, np.minimum(lengths, 16), compressed=True)
  cache = dataclasses.replace(cache, page_table=jnp.zeros((len(lengths), max_pages), jnp.int32))
  q = jnp.zeros((len(lengths), 32, 128), jnp.bfloat16)
  lowered = lambda work: _lower_text(lambda q, c, w: da._decode_attention(q, c, 0.125, cfg, False, work=w), q, cache, work)
  with_plan, without = lowered(None), lowered((table, seq_first))
  assert len(re.findall(r"custom_call @mosaic_gpu", without)) == 1
  assert "zipfusion_plan_items" in with_plan and "zipfusion_plan_items" not in without
  with pytest.raises(ValueError, match="balanced"):
    da.decode_attention_pallas(q, cache, 0.125, config=da.DecodeConfig(), work=(table, seq_first))
  with pytest.raises(TypeError, match="work"):
    zf.paged_decode_attention(q, cache, impl="reference", work=(table, seq_first))
  bad_first = seq_first.copy()
  bad_first[1] = seq_first[-1] + 1  # past the table's rows
  for bad, match in (((table[:-1], seq_first), "multiple of"), ((table, seq_first[:-1]), "multiple of"),
                     ((table, bad_first), "rise from 0")):
    with pytest.raises(ValueError, match=match):
      da.decode_attention_pallas(q, cache, 0.125, config=cfg, work=bad)



def test_work_items_of_other_lengths_are_refused():
  """A `work=` plan must be the plan of the cache's lengths: one of other lengths (same batch, valid
  shapes) ran and gave a wrong answer without a word (here the 20-token sequence got no item: zeros)."""
  k, v = _kv(2, 48, 1, 64)
  lengths = np.array([40, 20])
  cache = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  q = jnp.zeros((2, 2, 64), jnp.bfloat16)
  cfg = da.DecodeConfig(schedule="balanced")
  table, first = da.host_work_items(lengths, 1, cache.max_pages, cfg)
  da.check_work_items((table, first), 2, lengths)  # the right plan passes, as numpy or as jax arrays
  da.check_work_items((jnp.asarray(table), jnp.asarray(first)), 2, jnp.asarray(lengths))
  stray = table.copy()
  stray[-1] = (5, 0, 4)  # an "unused" row naming a sequence past the batch (the kernel would read lengths[5])
  short = table.copy()
  short[0, 2] = 1  # sequence 0's item stops before its last page
  for bad in (da.host_work_items(np.array([16, 0]), 1, cache.max_pages, cfg), (stray, first), (short, first)):
    for work in (bad, tuple(map(jnp.asarray, bad))):
      with pytest.raises(ValueError, match="cover each sequence"):
        zf.paged_decode_attention(q, cache, impl="pallas", config=cfg, work=work, interpret=True)
  bad_first = jnp.asarray(first).at[1].set(first[-1] + 1)  # concrete jax arrays are checked like numpy ones
  with pytest.raises(ValueError, match="rise from 0"):
    da.check_work_items((jnp.asarray(table), bad_first), 2)
  # Under jit the pair is traced: only its shapes can be checked.
  jax.jit(lambda t, f: da.check_work_items((t, f), 2, lengths))(*bad)


def test_the_balanced_schedule_spreads_a_long_sequence_over_the_gpu():
  lengths = jnp.asarray([131072] + [1000] * 31, jnp.int32)
  grid_cfg = da.heuristic_config(32, 8, 131072 // 16, compressed=True)
  assert grid_cfg.splits == 1  # 256 CTAs fill the GPU, so the static grid gives the long one 1 CTA per head
  work, _ = da._work_items(lengths, 8, 131072 // 16, da.DecodeConfig(schedule="balanced"))
  longest = np.asarray(work[:, 2] - work[:, 1]).max()
  assert longest * 20 <= 131072 // 16  # the long sequence's critical path is >= 20x shorter


def test_item_merge_kernel_equals_attention_over_all_tokens():
  """Partials of token ranges, consecutive items per sequence, merged by the `merge_items` kernel
  (interpreted): each sequence's rows are attention over the union of its items' ranges, also
  where a sequence's items span two of the kernel's 8-item loads or start in the second."""
  rng = np.random.default_rng(4)
  batch, kv_heads, group, head_dim, seq = 4, 2, 3, 16, 40
  q = jnp.asarray(rng.normal(size=(batch, kv_heads, group, head_dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)

  def exact(b, lo, hi):  # -> o [Hkv, G, D], lse2 [Hkv, G]; empty -> 0, -inf
    if hi <= lo:
      return jnp.zeros((kv_heads, group, head_dim)), jnp.full((kv_heads, group), -jnp.inf)
    s = jnp.einsum("hgd,shd->hgs", q[b], k[b, lo:hi])
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("hgs,shd->hgd", jnp.exp(s - lse[..., None]), v[b, lo:hi]), lse / np.log(2.0)

  def attend(b, lo, hi):  # -> O^T [Hkv, D, 8], lse2 [Hkv, 16, 8] as the kernel writes them
    o, lse2 = exact(b, lo, hi)
    o_t = jnp.full((kv_heads, head_dim, 8), jnp.nan).at[:, :, :group].set(jnp.swapaxes(o, 1, 2))  # unused columns: NaN
    return o_t, jnp.broadcast_to(jnp.full((kv_heads, 8), jnp.nan).at[:, :group].set(lse2)[:, None], (kv_heads, 16, 8))

  # sequence 0: three items (one empty), sequence 1: none (no tokens), sequence 2: eight (items 3-10,
  # across the first 8-item load's end), sequence 3: one (item 11, in the second load); four unused
  items = [(0, 0, 10), (0, 10, 10), (0, 10, 40)] + [(2, 5 * i, 5 * i + 5) for i in range(8)] + [(3, 0, 17)] + [None] * 4
  seq_first = jnp.asarray([0, 3, 3, 11, 12], jnp.int32)
  # two consumers: item 2's tokens split between them as partials (10, 25) and (25, 40)
  first = [attend(*it) if it else (jnp.full((kv_heads, head_dim, 8), jnp.nan), jnp.full((kv_heads, 16, 8), jnp.nan)) for it in items]
  second = [attend(0, 0, 0) if it else f for it, f in zip(items, first)]  # unused items: NaN, never read
  first[2], second[2] = attend(0, 10, 25), attend(0, 25, 40)
  o = jnp.stack([jnp.stack([p[0] for p in first]), jnp.stack([p[0] for p in second])], axis=2)  # [W, Hkv, C=2, D, 8]
  lse2 = jnp.stack([jnp.stack([p[1] for p in first]), jnp.stack([p[1] for p in second])], axis=2)
  out, got_lse2 = merge_items(o, lse2, seq_first, group=group, interpret=True)
  chex.assert_shape((out, got_lse2), ((batch * kv_heads * group, head_dim), (batch * kv_heads, 8)))
  assert out.dtype == jnp.bfloat16
  out, got_lse2 = out.reshape(batch, kv_heads, group, head_dim), got_lse2.reshape(batch, kv_heads, 8)[..., :group]
  for b, (lo, hi) in enumerate([(0, 40), (0, 0), (0, 40), (0, 17)]):
    want, want_lse2 = exact(b, lo, hi)
    chex.assert_trees_all_close(out[b].astype(jnp.float32), want, atol=1e-2, rtol=1e-2)  # BF16 rows: <= 1 ulp
    chex.assert_trees_all_close(got_lse2[b], want_lse2, atol=1e-5, rtol=1e-5)


def test_item_merge_kernel_refuses_bad_partials():
  o, lse = jnp.zeros((8, 2, 1, 64, 8)), jnp.zeros((8, 2, 1, 16, 8))
  with pytest.raises(ValueError, match="partials"):
    merge_items(o[..., :4], lse, jnp.zeros((3,), jnp.int32), group=2, interpret=True)
  with pytest.raises(ValueError, match="multiple of 8"):
    merge_items(o[:3], lse[:3], jnp.zeros((3,), jnp.int32), group=2, interpret=True)
  with pytest.raises(ValueError, match="G <= 8"):
    merge_items(o, lse, jnp.zeros((3,), jnp.int32), group=9, interpret=True)


@pytest.mark.parametrize("compressed", [True, False])
def test_balanced_schedule_lowers_to_one_mosaic_gpu_kernel(compressed):
  """Planned on the device, the call is three kernels: the plan and the merge (Triton), the
  attention (Mosaic GPU); no XLA op computes the plan (no reduction, no cumulative sum)."""
  k, v = _kv(3, 300, 2, 128)
  cache = zf.paged_cache_from_dense(k, v, np.array([300, 37, 0]), compressed=compressed)
  q = jnp.zeros((3, 8, 128), jnp.bfloat16)
  cfg = da.DecodeConfig(schedule="balanced", stages=2, v_after_qk=compressed)
  text = _lower_text(lambda q, c: da._decode_attention(q, c, 0.125, cfg, True), q, cache)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
  assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 2  # the plan and the merge
  assert "zipfusion_plan_items" in text and "zipfusion_merge_items" in text
  assert not re.search(r"= stablehlo\.reduce", text) and "@cumsum" not in text  # (inside the kernels' payloads only)
  items = -(-(da.target_items(2) + 3) // 8) * 8
  assert re.search(rf"tensor<{items}x2x1x128x8xf32>", text), "the grid is not (KV heads, target + B items)"


@pytest.mark.parametrize("kv_heads,consumers", [(1, 1), (2, 2)])
def test_balanced_schedule_interpreted_matches_the_reference_and_both_stores_agree_bitwise(kv_heads, consumers):
  """Ragged lengths cut into several items (a 44-page sequence into 16-page items), an empty one."""
  q, k, v, lengths = _interpreted_problem(3, 700, kv_heads, 4, 64, [700, 37, 0])
  comp = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  plain = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  cfg = da.DecodeConfig(schedule="balanced", items=4, stages=2, consumers=consumers)
  work, _ = da._work_items(jnp.asarray(lengths), kv_heads, comp.max_pages, cfg)
  assert [tuple(r) for r in np.asarray(work)] == [(0, 0, 16), (0, 16, 32), (0, 32, 48), (1, 0, 4)] + [(-1, 0, 0)] * 4
  outs = _interpreted_outputs(q, (comp, plain), plain, cfg)
  np.testing.assert_array_equal(outs[0], outs[1])
  assert np.all(outs[0][lengths == 0] == 0)


def test_fitted_tables_keep_every_used_row_in_few_sizes():
  """`host_work_items(..., fit_rows=True)`: the full table's first rows, every used item among them,
  a multiple of the merge's 8 loads, one of B, 2B, 4B, ... (rounded to 8) or the full table; equal
  lengths at 32 x 2048 launch 32 rows instead of 104."""
  rng = np.random.default_rng(5)
  for trial in range(40):
    batch, kv_heads, max_pages = int(rng.integers(1, 200)), int(rng.choice([1, 3, 8])), int(rng.integers(1, 2049))
    lengths = rng.integers(0, 16 * max_pages + 1, batch).astype(np.int32)
    lengths[rng.random(batch) < 0.2] = 0
    cfg = da.DecodeConfig(schedule="balanced", items=int(rng.choice([0, 1, 33])))
    full, first = da.host_work_items(lengths, kv_heads, max_pages, cfg)
    fit, fit_first = da.host_work_items(lengths, kv_heads, max_pages, cfg, fit_rows=True)
    np.testing.assert_array_equal(fit_first, first)
    np.testing.assert_array_equal(fit, full[:len(fit)], err_msg=f"trial {trial}")
    assert first[-1] <= len(fit) and len(fit) % 8 == 0 and np.all(full[len(fit):, 0] == -1), trial
    sizes = {-(-batch // 8) * 8 * 2 ** i for i in range(12)} | {len(full)}
    assert len(fit) in sizes and len(fit) <= len(full), trial
  equal = np.full(32, 2048, np.int32)
  cfg = da.DecodeConfig(schedule="balanced")
  assert [len(da.host_work_items(equal, 8, 128, cfg, fit_rows=f)[0]) for f in (False, True)] == [104, 32]
  assert da.fitted_rows(0, 3, 24) == 8 and da.fitted_rows(9, 3, 24) == 16 and da.fitted_rows(17, 3, 24) == 24


def test_a_fitted_table_gives_the_full_tables_output_bit_for_bit():
  """The interpreted kernel over the fitted table (8 rows) and over the full one (24): same bits."""
  q, k, v, lengths = _interpreted_problem(3, 700, 1, 4, 64, [700, 37, 0])
  comp = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  cfg = da.DecodeConfig(schedule="balanced", items=20, stages=2)
  outs = []
  for fit in (False, True):
    work = da.host_work_items(lengths, 1, comp.max_pages, cfg, fit_rows=fit)
    assert len(work[0]) == (8 if fit else 24)
    outs.append(np.asarray(da.decode_attention_pallas(q, comp, 0.125, config=cfg, work=work, interpret=True)).view(np.uint16))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_bad_impl_is_refused():
  k, v = _kv(1, 32, 1, 64)
  cache = zf.paged_cache_from_dense(k, v, np.array([20]))
  with pytest.raises(ValueError, match="impl"):
    zf.paged_decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), cache, impl="triton")
  with pytest.raises(TypeError, match="must be a DecodeConfig"):
    zf.paged_decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), cache, impl="pallas", config={"stages": 2})


@pytest.mark.parametrize("cuts", [(40, 40), tuple(range(0, 91, 9))])  # 3 partials (unrolled), 12 (reduced)
def test_split_combine_equals_attention_over_all_tokens(cuts):
  """Attention over token ranges plus their lse, merged by `_combine`, is attention over the union
  (some ranges empty), whether the merge is unrolled over the partials or a reduction."""
  rng = np.random.default_rng(3)
  batch, kv_heads, group, head_dim, seq = 2, 2, 3, 64, 90
  q = jnp.asarray(rng.normal(size=(batch, kv_heads * group, head_dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
  scale = 0.125

  def attend(lo, hi):  # -> o [B, Hkv, G, D], lse2 [B, Hkv, G] (log2), empty range -> 0, -inf
    qg = q.reshape(batch, kv_heads, group, head_dim)
    s = jnp.einsum("bhgd,bshd->bhgs", qg, k[:, lo:hi]) * scale
    if hi <= lo:
      return jnp.zeros((batch, kv_heads, group, head_dim)), jnp.full((batch, kv_heads, group), -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhgs,bshd->bhgd", jnp.exp(s - lse[..., None]), v[:, lo:hi])
    return o, lse / np.log(2.0)

  bounds = (0, *cuts, seq)
  parts = [attend(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
  assert (len(parts) <= da.UNROLLED_COMBINE_SPLITS) == (len(cuts) == 2)
  o = jnp.stack([p[0] for p in parts], axis=2)
  lse2 = jnp.stack([p[1] for p in parts], axis=2)
  got, got_lse2 = da._combine(o, lse2)
  want, want_lse2 = attend(0, seq)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(got_lse2, want_lse2, atol=1e-5, rtol=1e-5)
  empty_o, empty_lse = da._combine(jnp.zeros((1, 1, 2, 1, 4)), jnp.full((1, 1, 2, 1), -jnp.inf))
  assert np.all(np.asarray(empty_o) == 0) and np.all(np.isneginf(np.asarray(empty_lse)))


@pytest.mark.parametrize("batch,kv_heads,max_pages,splits", [(32, 8, 128, 1), (8, 8, 512, 4), (1, 8, 2048, 32), (128, 8, 64, 1), (2, 3, 8, 1), (4, 8, 512, 8), (16, 8, 128, 2)])
def test_heuristic_fills_the_gpu_without_tiny_splits(batch, kv_heads, max_pages, splits):
  cfg = da.heuristic_config(batch, kv_heads, max_pages)
  assert cfg.splits == splits
  steps_per_split = -(-max_pages // da.STEP_PAGES) / cfg.splits
  assert cfg.splits == 1 or steps_per_split >= 4
  assert (cfg.stages, cfg.consumers, cfg.v_after_qk) == (2, 1, False)
  # format 1: V^T restored after the QK wgmma (122 registers: still 2 CTAs per SM, same splits)
  v1 = da.heuristic_config(batch, kv_heads, max_pages, compressed=True)
  assert (v1.stages, v1.consumers, v1.v_after_qk, v1.splits) == (2, 1, True, splits)
  # format 2: format 1's layout with ptxas capped at 128 registers (131 uncapped), so 2 CTAs per SM
  v2 = da.heuristic_config(batch, kv_heads, max_pages, compressed=True, version=2)
  assert v2 == dataclasses.replace(v1, max_registers=128)
  # an explicit consumers=2: one CTA per SM, so never more splits
  two = da.heuristic_config(batch, kv_heads, max_pages, compressed=True, version=2, consumers=2)
  assert two == da.heuristic_config(batch, kv_heads, max_pages, compressed=True, consumers=2)
  assert (two.consumers, two.stages, two.max_registers) == (2, 4, 0) and two.splits <= splits
  assert two.splits == 1 or -(-max_pages // da.STEP_PAGES) / two.splits >= 4


def test_config_validates():
  with pytest.raises(ValueError, match="splits"):
    da.DecodeConfig(splits=0)
  with pytest.raises(ValueError, match="schedule"):
    da.DecodeConfig(schedule="dynamic")
  with pytest.raises(ValueError, match="items"):
    da.DecodeConfig(items=-1)
  with pytest.raises(ValueError, match="stages"):
    da.DecodeConfig(stages=9)
  with pytest.raises(ValueError, match="consumer_registers"):
    da.DecodeConfig(consumer_registers=100)
  with pytest.raises(ValueError, match="timing_probe"):
    da.DecodeConfig(timing_probe="fast")
  with pytest.raises(ValueError, match="exception_fold"):
    da.DecodeConfig(exception_fold="both")
  with pytest.raises(ValueError, match="consumers"):
    da.DecodeConfig(consumers=3)
  with pytest.raises(ValueError, match="multiple"):  # a stage shared by two consumers would skip barrier phases
    da.DecodeConfig(consumers=2, stages=3)



@pytest.mark.parametrize("knob", ["splits", "stages", "consumers", "items", "max_registers", "consumer_registers"])
def test_config_refuses_non_integer_knobs(knob):
  """splits=2.0 passed validation and failed deep in the kernel's shapes ("Shapes must be 1D sequences
  of concrete values of integer type"); stages=1.5 blamed the consumers."""
  with pytest.raises(TypeError, match=f"DecodeConfig.{knob} must be an int"):
    da.DecodeConfig(**{knob: 2.0})
  assert da.DecodeConfig(splits=np.int64(2)).splits == 2  # numpy integers are integers


def test_reference_scale_default_matches_kernel_contract():
  assert reference.default_scale(128, None) == pytest.approx(128 ** -0.5)


def test_the_restore_recognises_version_2_by_the_record_the_producer_writes():
  from pallas_kernels import page_prefetch_mgpu as P
  from pallas_kernels import restore_mgpu as R

  assert P.info_words(1) == 3 == P.info_words(1, producer_fold=True)
  assert P.info_words(2) == R.INFO_WORDS_V2 and P.info_words(2, producer_fold=True) == R.RECORD_WORDS_V2
  assert 1 + len(P.info_fields(2)) == R.INFO_WORDS_V2 <= R.FOLDED_BASE  # the interpreter's words come first
  assert R.folded_word(1, 3, 2) == R.RECORD_WORDS_V2 - 1  # V's last block's target is the record's last word
  assert P.CHUNK_PAGES >= R.PAGES_PER_STEP * R.RECORD_WORDS_V2  # one word per producer thread


def _kernel_primitives(fn, *args):
  """Names of every primitive inside the Pallas Mosaic GPU kernel(s) that `fn` traces to."""
  from jax._src import core

  def walk(jaxpr, names):
    for eqn in jaxpr.eqns:
      names.add(eqn.primitive.name)
      for sub in core.jaxprs_in_params(eqn.params):
        walk(sub, names)
    return names

  def kernels(jaxpr, found):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "mpmd_map":
        found |= {name for body in eqn.params["jaxprs"] for name in walk(getattr(body, "jaxpr", body), set())}
      for sub in core.jaxprs_in_params(eqn.params):
        kernels(sub, found)
    return found

  return kernels(jax.make_jaxpr(fn)(*args).jaxpr, set())


@pytest.mark.parametrize("compressed", [True, False])
@pytest.mark.parametrize("consumers", [1, 2])
def test_the_kernel_makes_no_pallas_cross_warp_reduction(compressed, consumers):
  """Pallas lowers reduce_max / reduce_sum over warps through one CTA-wide SMEM scratch: two consumer
  warpgroups reducing at once race on it (the wrong outputs of consumers=2, H100, 2026-12-06). The kernel
  reduces through each consumer's own scratch instead (`_reduce_over_tokens`); this fails if a Pallas
  reduction comes back."""
  k, v = _kv(2, 100, 2, 128)
  cache = zf.paged_cache_from_dense(k, v, np.array([100, 37]), compressed=compressed)
  q = jnp.zeros((2, 8, 128), jnp.bfloat16)
  cfg = da.DecodeConfig(stages=2, consumers=consumers)
  names = _kernel_primitives(lambda q, c: da._decode_attention(q, c, 0.125, cfg, False), q, cache)
  assert "inline_mgpu_p" in names and "wgmma_ref" in names  # the walk reached the kernel body
  assert not names & {"reduce_max", "reduce_sum", "reduce_min"}, names & {"reduce_max", "reduce_sum", "reduce_min"}


def test_default_config_is_the_heuristic_for_the_caches_store():
  k, v = _kv(2, 100, 2, 128)
  lengths = np.array([100, 37])
  for kwargs, want in (({"compressed": False}, (1, False, 0)), ({}, (1, True, 0)), ({"version": 2}, (1, True, 128))):
    cache = zf.paged_cache_from_dense(k, v, lengths, **kwargs)
    cfg = da.default_config(cache)
    assert (cfg.consumers, cfg.v_after_qk, cfg.max_registers, cfg.schedule) == (*want, "grid"), kwargs
    assert da.default_config(cache, "balanced") == dataclasses.replace(cfg, schedule="balanced")  # only the schedule moves

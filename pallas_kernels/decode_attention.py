"""Fused paged decode attention over the 12-bit KV format (Mosaic GPU, Hopper).

One kernel body serves both stores of `zipfusion_jax.paged.PagedKVCache`. Per
4-page step (64 tokens) of one (sequence, KV head, split):

* a producer warpgroup issues exactly one TMA per page and K/V: the stored bytes
  of a compressed group (its 3*nb-unit prefix and raw units, one copy), a BF16
  page, or the raw tail page. Page-table entries and group metadata come from
  SMEM, gathered 128 pages at a time by all producer threads
  (`page_prefetch_mgpu`), so no step waits on a dependent global load;
* the consumer warpgroup computes `S^T = K Q^T` (M = 64 tokens, N = 8 query rows),
  the online softmax down the token axis (log2 domain), and `O^T += V^T P^T`
  (M = D). K and V^T are the wgmma A operands: compressed, they are restored from
  the byte stage straight into A-operand registers (`restore_mgpu`; the format's
  fragment order is the A-operand order), so restored values never touch SMEM;
  uncompressed, they are read from the BF16 SMEM tiles (V^T as a transposed A).

The two paths run the same wgmmas on the same values, so a compressed and an
uncompressed cache of the same K/V give bit-identical outputs.

Grid: (KV heads, sequences, splits); CTA = 1 (or 2) consumer + 1 producer warpgroup.
A split covers a contiguous range of pages; split outputs are normalised
partials plus their log2-sum-exp, combined by `_combine` (jnp).

Design notes and measurements: docs/DECODE_KERNEL.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _platform
from pallas_kernels import decode_interpret as I
from pallas_kernels import page_prefetch_mgpu as P
from pallas_kernels import register_cap_mgpu as RC
from pallas_kernels import restore_mgpu as R
from pallas_kernels.merge_items import ITEMS_PER_LOAD, merge_items
from pallas_kernels.plan_items import plan_items
from zipfusion_jax.paged.cache import PAGE_SIZE, PagedKVCache

STEP_PAGES = R.PAGES_PER_STEP
STEP_TOKENS = STEP_PAGES * PAGE_SIZE  # 64: one wgmma N for S, K for P V
CHUNK_STEPS = P.CHUNK_PAGES // STEP_PAGES  # steps per metadata prefetch
LOAD_ARRIVALS = 2 * STEP_PAGES + 1  # one per (slot, K/V): a copy or a plain arrival; + the info record
QROWS = 8  # query rows copied per CTA (>= heads per KV head)
LSE_ROWS = 16  # rows of the (row-broadcast) log-sum-exp tile copied out: 512 B, a legal TMA
LOG2E = 1.4426950408889634
REDUCE_SCRATCH = 2 * 4 * 32 * 2  # f32 words: two [8]-column reductions (4 warps x 32 lanes x 2 values) at once
CTAS_PER_SM = 2  # the split heuristic's one-consumer target: two CTAs fit while ptxas needs <= 128 registers
NUM_SMS = 132
MIN_ITEM_PAGES = 4 * STEP_PAGES  # the balanced schedule's item size is never planned below 4 steps (16 pages)
SCHEDULES = ("grid", "balanced")
EXCEPTION_FOLDS = ("consumer", "producer")  # DecodeConfig.exception_fold


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tuning knobs of the fused kernel.

  Attributes:
    splits: CTAs per (sequence, KV head), each over a contiguous page range
      (split-K); partials are combined with their log-sum-exp.
    stages: depth of the producer -> consumer ring (TMA runs that many steps ahead).
    warp_issue: each of the producer's 4 warps issues one page slot's copies (TMA from
      warp-level code, `plgpu.warp_map`) instead of one thread issuing all 8 in turn; the
      compressed path's per-slot work is 6 predicated branches. On by default: the one-thread
      issue was the compressed kernel's bound (H200, 2026-12-04, 32 x 2048 with
      consumer_registers=0: 56.8 us with it; the copies probe alone 59.8 us without it).
    consumer_registers: `setmaxnreg` of the consumer warpgroup (the producer keeps 40). Two
      CTAs per SM (the compressed path needs ~93 KB of SMEM at D = 128, 2 stages) need
      (consumer + 40) * 128 * 2 <= 65536, i.e. <= 216; the consumer holds K and V^T (64
      registers), the accumulators (16) and the decode temporaries. 0 (default): no
      `setmaxnreg` at all (ptxas sizes one register count for both warpgroups), which is what
      gets 2 CTAs/SM; 232, 208 and 168 all measured at one (H200, 2026-12-04: 32 x 2048
      compressed 78.7 us at 208 with warp_issue, 56.8 us at 0).
    consumers: consumer warpgroups per CTA (1 or 2), sharing one producer and one ring: consumer
      c takes steps c, c + consumers, ... with its own softmax state and writes its own partial
      (a virtual split, merged by the split combine). With 2, a CTA has 384 threads, so ptxas
      caps every thread at 168 registers and two consumers always share an SM; with 1, two CTAs
      share an SM only while ptxas needs <= 128 registers (format 1 needed 150 on 2026-12-05: one
      CTA per SM, the H200's consumer-bound figure). `stages` must be a multiple of it (each
      consumer then waits on every phase of its own stages' barriers). Each consumer reduces over
      tokens through its own SMEM scratch (`_reduce_over_tokens`): with Pallas's CTA-wide reduction
      scratch the two raced (wrong outputs in 9 of 14 cases, H100, 2026-12-06); fixed, correct in
      all 14 cases (H100 and H200, 2026-12-06). Format version 2's default until the register
      cap (below) beat it.
    v_after_qk: restore V^T only once S^T = K Q^T is done (K's 32 operand registers are then
      dead) instead of while that wgmma runs: less overlap, a lower register peak (a way for one
      consumer to fit ptxas's 128 again: 122 registers at 2 stages, H100, 2026-12-06, and 2 CTAs
      per SM; correct there in all 14 cases). The heuristic's choice for both formats (version 2 also capped).
    max_registers: cap ptxas at this many registers per thread (PTX `.maxnreg`, through
      `register_cap_mgpu`: Mosaic GPU has no option for it); with one consumer (256 threads),
      128 lets two CTAs share an SM whatever ptxas would pick (format 2 with `v_after_qk` needs
      131-133). Not with `consumer_registers`. 0: no cap. H100, 2026-12-06 (later): ptxas honours
      it (format 2 `v_after_qk` 131 -> 114 registers), correct in all 14 `--quick` cases for
      both formats, and format 2 at 2 stages goes to 73.4 us at 32 x 2048 (81.7 with two
      consumers): the heuristic's choice for format version 2 (128).
    schedule: how (sequence, page range) work items are laid out over CTAs. "grid" (default):
      every sequence gets `splits` equal page ranges of the cache's `max_pages` (a static grid
      (KV heads, B * splits); a short sequence's CTAs exit at once, a long one's take as long
      as its own range). "balanced": the wrapper plans the items from the lengths on the
      device (one Pallas Triton kernel, `plan_items`; or the caller on the host,
      `host_work_items` passed as `work=`), like a paged-attention scheduler: one item size for the batch (`_item_pages`:
      the size whose items finish soonest in waves of the GPU's CTA slots, never below 4
      steps), each sequence cut into as many equal items as that needs, so a 128K sequence
      among short ones is spread over the GPU instead of `splits` CTAs (`splits` is then
      unused). The grid is (KV heads, `items` + B) (`items` 0: `target_items`, two waves of
      CTA slots per KV head); unused items do nothing.
    items: the balanced schedule's item budget per KV head beyond one per sequence (0: `target_items`).
    exception_fold: format version 2 only: who folds a block's exception into the decode's bias
      words. "consumer" (default, correct on the H100 and H200): each consumer thread, for every
      block it decodes, under a branch taken when one of its blocks has one (~20 integer ops a
      block, for one or two fragments a block). "producer": the producer, once per step, into
      32-word slot records (`restore_mgpu.block_exception_words`); the consumer then loads three
      words a block and selects per fragment. Lowers for an H200 and its arithmetic is tested
      on every BF16 pattern off-GPU; not yet run on a GPU (2026-12-08), hence not the default.
    timing_probe: diagnostics only, the outputs are garbage: "copies" = the consumer only
      waits for and releases each stage (the producer's copy rate), "compute" = the producer
      issues no copies (the consumer's rate on whatever SMEM holds). "" = off.
  """

  splits: int = 1
  stages: int = 2
  timing_probe: str = ""
  warp_issue: bool = True
  consumer_registers: int = 0
  consumers: int = 1
  v_after_qk: bool = False
  max_registers: int = 0
  schedule: str = "grid"
  items: int = 0
  exception_fold: str = "consumer"

  def __post_init__(self):
    for name in ("splits", "stages", "consumer_registers", "consumers", "max_registers", "items"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):  # 2.0 would reach a shape
        raise TypeError(f"DecodeConfig.{name} must be an int, got {value!r}")
    if self.splits < 1:
      raise ValueError(f"{self.splits=} must be >= 1")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"{self.schedule=} must be one of {SCHEDULES}")
    if self.items < 0:
      raise ValueError(f"{self.items=} must be >= 0 (0: target_items)")
    if not 1 <= self.stages <= 4:
      raise ValueError(f"{self.stages=} must be in [1, 4]")
    if self.consumer_registers and (self.consumer_registers % 8 or not 64 <= self.consumer_registers <= 256):
      raise ValueError(f"{self.consumer_registers=} must be 0 or a multiple of 8 in [64, 256]")
    if self.max_registers:  # 0: no cap
      RC.check_count(self.max_registers)
    if self.max_registers and self.consumer_registers:  # setmaxnreg past the cap could wait forever
      raise ValueError("max_registers and consumer_registers are alternatives: set one of them")
    if self.exception_fold not in EXCEPTION_FOLDS:
      raise ValueError(f"{self.exception_fold=} must be one of {EXCEPTION_FOLDS}")
    if self.timing_probe not in ("", "copies", "compute"):
      raise ValueError(f"{self.timing_probe=} must be '', 'copies' or 'compute'")
    if self.consumers not in (1, 2):
      raise ValueError(f"{self.consumers=} must be 1 or 2")
    if self.stages % self.consumers:
      raise ValueError(f"{self.stages=} must be a multiple of {self.consumers=} (each consumer owns whole stages)")


def heuristic_config(batch: int, kv_heads: int, max_pages: int, compressed: bool = False,
                     consumers: int = 1, version: int = 1, schedule: str = "grid") -> DecodeConfig:
  """Pick splits so the grid about fills every CTA slot while each split keeps >= 4 steps, and
  the consumer layout and ring depth by store.

  Decode attention is bandwidth bound: what matters is that every SM streams. One consumer per
  CTA runs 2 CTAs per SM while ptxas needs <= 128 registers, so fewer than ~264 (Hkv x B) CTAs
  leave slots idle: split the page range until the grid covers 90% of them, but never below 4
  steps (256 tokens) per split, where the per-split prologue, epilogue and combine cost more
  than they hide. Past that, more splits only add combine traffic (H200, 2026-12-04,
  Llama-3.1-8B shapes, compressed: 8 x 8192 runs 138.6 / 77.8 / 60.2 us at 1 / 2 / 4 splits
  (64 / 128 / 256 CTAs); 32 x 2048 (256 CTAs) 56.8 us unsplit, 64.9 at 2, 71.7 at 4).

  Per store (H100, 2026-12-06, same run, B x S = 32 x 2048 / 8 x 8192, cuDNN 91.6 / 93.1 us;
  benchmarks/RESULTS.md):
  * BF16 pages: one consumer, 2 stages (56-62 registers, 2 CTAs per SM).
  * Format version 1: one consumer, V^T restored after the QK wgmma (`v_after_qk`), 2 stages:
    122 registers (ptxas), so 2 CTAs per SM again; 76.7 / 78.6 us, against 80.2 / 83.3 for
    the overlapped restore at 3 stages (163 registers, one CTA per SM).
  * Format version 2: like version 1, with ptxas capped at 128 registers (`max_registers`;
    131 uncapped, 114 capped, no spill cost seen) so 2 CTAs share an SM: 73.4 / 76.7 us
    (H100, 2026-12-06, later; format 1 74.2 / 76.6, cuDNN 88.9 / 91.1 in that run), against
    81.7 / 77.4 for two consumers at 4 stages (157 registers, one 384-thread CTA per SM), 86.4 /
    88.5 for one consumer at 3 stages (175 registers) and 88.4 / 93.2 uncapped `v_after_qk`.
  On the H200 (2026-12-06, morning): format 1 53.4 / 56.6 us (cuDNN 62.5 / 65.3; 62.2 / 66.2 at
  3 stages), format 2 with two consumers 63.9 / 59.1 us (83.4 / 85.1 at one consumer, 3 stages).
  That evening, these defaults: format 1 54.3 / 57.3 us, format 2 (capped) 58.2 / 62.3 us, cuDNN
  64.0 / 66.4 us: per compressed byte format 2 takes 1.10x / 1.12x format 1 on the H200.
  `consumers`: 1 (every store's choice) or 2. Two consumers share
  one CTA, so the grid then targets one CTA per SM, and the ring is 4 deep for 12-bit pages
  (each consumer owns 2 stages; ~157 KB of SMEM at D = 128), 2 for BF16 pages.
  """
  ctas = batch * kv_heads
  steps = -(-max(max_pages, 1) // STEP_PAGES)
  slots = _cta_slots(consumers)
  splits = 1
  while ctas * splits < 0.9 * slots and steps // (2 * splits) >= 4:
    splits *= 2
  if consumers == 2:
    return DecodeConfig(splits=splits, stages=4 if compressed else 2, consumers=2, schedule=schedule)
  # Format 2 needs 131 registers uncapped: capped at 128, two CTAs share an SM.
  cap = 128 if compressed and version >= 2 else 0
  return DecodeConfig(splits=splits, stages=2, v_after_qk=compressed, max_registers=cap, schedule=schedule)


def default_config(cache: PagedKVCache, schedule: str = "grid") -> DecodeConfig:
  """The config `decode_attention_pallas` uses for `cache` when none is given (`schedule`: see
  DecodeConfig; "balanced" for ragged batches)."""
  return heuristic_config(cache.batch, cache.num_kv_heads, cache.max_pages, cache.compressed,
                          version=cache.format_version or 1, schedule=schedule)


def _kernel(q_ref, lengths_ref, page_table_ref, k_tail_ref, v_tail_ref, *refs,
            compressed, version, head_dim, kv_heads, row_stride, max_pages, grid_pages, scale, stages,
            timing_probe, warp_issue, consumer_registers, consumers, v_after_qk, max_registers, interpret,
            work_stride=3, producer_fold=False):  # producer_fold: exception_fold="producer" on a version-2 store  # work_stride: 3 (`host_work_items` rows) or 4 (`plan_items` rows)
  """Refs (GMEM):
    q_ref: bf16 [rows, D]: the G query heads of (b, kvh) are rows (b * Hkv + kvh) * row_stride
      + [0, G), row_stride = G (G divides 8) or 8 (padded); 8 rows are copied, TMA zero-fills
      rows past the end; lengths_ref: i32 [B]; page_table_ref: i32 [B, MP];
    k_tail_ref, v_tail_ref: bf16 [B, Hkv, 16, D], or (compressed, restored in registers) the
      same bytes as uint8 [B, Hkv, 4 * nb, 256]: one byte-stage slot, where the tail page lands;
    compressed: arena_ref u8 [U, 256], meta_ref u32 [Hkv, P, 2, 2] (format version 2: [Hkv, P, 2, 4]);
    else: k_pages_ref, v_pages_ref bf16 [Hkv, P, 16, D];
    work_ref (balanced schedule only): i32 [3 W] or [4 W]: work item w is (sequence b, first page,
      end page) at 3w or 4w (`_work_items` / `host_work_items` rows of 3, the device plan's
      `plan_items` rows of 4; flat: scalar loads with one dynamic index, as `lengths_ref[b]`);
      b = -1 marks an unused item: its CTA returns at once and writes no partial. The grid
      schedule (`grid_pages`, its pages per split) has no table: the kernel computes the row from
      its program id (item s * B + b), so no load stands before its first copies;
    o_ref: f32 [W, Hkv, consumers, D, 8] (O^T; columns >= G unused);
    lse_ref: f32 [W, Hkv, consumers, 16, 8] (log2 domain, every row the same).
  Consumer c of work item w writes partial (w, c).
  """
  store_a, store_b, *work, o_ref, lse_ref, scoped = refs  # work: [] (grid) or [work_ref] (balanced)
  nb = head_dim // 32
  kvh, item = lax.axis_index("h"), lax.axis_index("w")
  if grid_pages:  # grid schedule: item = split * B + b
    batch = lengths_ref.shape[0]
    b, used = lax.rem(item, batch), True
    first_page = lax.div(item, batch) * grid_pages
    item_end = first_page + grid_pages
  else:
    (work_ref,) = work
    b = work_ref[work_stride * item]  # -1: an unused item (balanced schedule), which does nothing at all
    used = b >= 0
    b = jnp.maximum(b, 0)
    first_page, item_end = work_ref[work_stride * item + 1], work_ref[work_stride * item + 2]
  wg = lax.axis_index("wg")
  (q_smem, stream_or_epilogue, info_smem, chunk_smem, pt_smem, reduce_smem), (q_bar, load_bars, consumed_bars) = scoped
  in_registers = compressed and not interpret  # restore straight into wgmma A fragments
  stream, (o_smem, lse_smem) = stream_or_epilogue  # one consumer: one SMEM region, the ring then O and LSE
  stream = iter(stream)
  k_smem, v_smem = (None, None) if in_registers else (next(stream), next(stream))
  byte_smem = next(stream) if compressed else None
  tails_in_tiles = not in_registers  # else the tail page lands in its slot of the byte stage

  length = lengths_ref[b]
  full_pages = length // PAGE_SIZE
  total_pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
  end_page = jnp.minimum(item_end, total_pages)
  n_steps = jnp.maximum(end_page - first_page + STEP_PAGES - 1, 0) // STEP_PAGES

  kind_words = P.KIND_WORDS[version]
  # The consumer's splat words per slot: the flags and word1s, and for version 2 the exception
  # entries, unless the producer folded them (then the GPU restore reads the folded words from the
  # record itself; the interpreter's restore always takes the entries).
  splat_words = R.INFO_WORDS_V2 if version == 2 and not (in_registers and producer_fold) else 3

  def slot_infos(stage):
    return [tuple(info_smem[stage, s, i] for i in range(splat_words)) for s in range(STEP_PAGES)]

  @pl.when(used & (wg < consumers))
  def _consumer():
    c = wg  # this consumer: steps c, c + consumers, ...
    if consumer_registers:
      plgpu.set_max_registers(consumer_registers, action="increase")

    @pl.when(c == 0)
    def _():
      plgpu.copy_gmem_to_smem(q_ref.at[pl.ds((b * kv_heads + kvh) * row_stride, QROWS)], q_smem, q_bar)

    plgpu.barrier_wait(q_bar)
    q_t = q_smem.transpose((1, 0))  # B operand [D, 8]
    pt_mine = pt_smem.at[c]
    pt_b = pt_mine.transpose((1, 0))  # B operand [64 tokens, 8]
    if interpret:
      over_tokens = lambda x, op: x.max(axis=0) if op == "max" else x.sum(axis=0)
    else:  # cross-warp reductions through this consumer's own SMEM scratch (see `_reduce_over_tokens`)
      over_tokens = functools.partial(_reduce_over_tokens, scratch=reduce_smem.at[c])
    m_i = plgpu.layout_cast(jnp.full((QROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
    l_rows = plgpu.layout_cast(jnp.full((STEP_TOKENS, QROWS), 0, jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.layout_cast(jnp.full((head_dim, QROWS), 0, jnp.float32), plgpu.Layout.WGMMA)

    def step(j, carry):
      acc, m_i, l_rows = carry
      i = j * consumers + c
      stage = lax.rem(i, stages)
      plgpu.barrier_wait(load_bars.at[stage])
      if timing_probe == "copies":
        plgpu.barrier_arrive(consumed_bars.at[stage])
        return acc, m_i, l_rows
      infos = slot_infos(stage)
      if in_registers:
        if producer_fold:  # the byte stage and the step's records (the blocks' folded exceptions)
          operands = (byte_smem.at[stage], info_smem.at[stage])
          with_record = lambda fn: lambda byte_ref, record_ref, infos, head_dim: fn(
              byte_ref, infos, head_dim=head_dim, record_ref=record_ref)
          restore_k_fn, restore_vt_fn = with_record(R.restore_k), with_record(R.restore_vt)
        else:
          operands, restore_k_fn, restore_vt_fn = (byte_smem.at[stage],), R.restore_k, R.restore_vt
        ref_types = (_BYTES,) * len(operands)
        k = _inline(restore_k_fn, ref_types, operands, infos, head_dim, (STEP_TOKENS, head_dim))

        restore_vt = lambda: _inline(restore_vt_fn, ref_types, operands, infos, head_dim, (head_dim, STEP_TOKENS))

        def qk(acc_ref):  # V^T is restored while S^T = K Q^T runs, unless v_after_qk
          plgpu.wgmma(acc_ref, k, q_t)
          vt = None if v_after_qk else restore_vt()
          return acc_ref[...], vt  # the read waits for the wgmma

        s, v_operand = pl.run_scoped(qk, plgpu.ACC((STEP_TOKENS, QROWS), jnp.float32))
        if v_after_qk:
          v_operand = restore_vt()
        plgpu.barrier_arrive(consumed_bars.at[stage])  # the bytes are in registers: refill now
      else:
        if interpret:  # inline PTX is not interpretable: the jnp restore of the same bytes
          I.restore_tiles(byte_smem, k_smem, v_smem, stage, infos, head_dim, compressed)
        else:
          _inline(R.zero_absent_v, (_TILE,), (v_smem.at[stage],), infos, head_dim)
        plgpu.commit_smem()

        def qk_smem(acc_ref):
          plgpu.wgmma(acc_ref, k_smem.at[stage], q_t)
          return acc_ref[...]

        s = pl.run_scoped(qk_smem, plgpu.ACC((STEP_TOKENS, QROWS), jnp.float32))
        v_operand = v_smem.at[stage].transpose((1, 0))  # A operand [D, 64 tokens] from SMEM

      tok = (first_page + i * STEP_PAGES) * PAGE_SIZE + plgpu.broadcasted_iota(
          jnp.int32, (STEP_TOKENS, QROWS), 0, layout=plgpu.Layout.WGMMA)
      s = jnp.where(tok < jnp.minimum(length, end_page * PAGE_SIZE), s * (scale * LOG2E), -jnp.inf)
      m_new = jnp.maximum(m_i, over_tokens(s, "max"))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
      l_rows = l_rows * lax.broadcast_in_dim(alpha, l_rows.shape, [1]) + p
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
      p16 = p.astype(jnp.bfloat16)
      if interpret:
        pt_mine[...] = p16.T
      else:
        _inline_store_pt(p16, pt_mine)
      plgpu.commit_smem()

      if interpret:  # run_state over an ACC leaves a wgmma effect the interpreter cannot lower
        def pv_interpret(acc_ref):
          plgpu.wgmma(acc_ref, v_operand, pt_b)
          return acc_ref[...]

        acc = acc + pl.run_scoped(pv_interpret, plgpu.ACC((head_dim, QROWS), jnp.float32))
      else:
        def pv(acc_ref):
          plgpu.wgmma(acc_ref, v_operand, pt_b)

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      if not in_registers:
        plgpu.barrier_arrive(consumed_bars.at[stage])
      return acc, m_new, l_rows

    my_steps = jnp.maximum(n_steps - c + consumers - 1, 0) // consumers
    acc, m_i, l_rows = lax.fori_loop(0, my_steps, step, (acc, m_i, l_rows))
    l_i = over_tokens(l_rows, "add")
    empty = l_i == 0
    l_safe = jnp.where(empty, 1.0, l_i)
    o_mine, lse_mine = o_smem.at[c], lse_smem.at[c]
    o_mine[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])
    lse = jnp.where(empty, -jnp.inf, m_i + jnp.log2(l_safe))
    lse_mine[...] = lax.broadcast_in_dim(lse, lse_mine.shape, [1])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_mine, o_ref.at[item, kvh, c])
    plgpu.copy_smem_to_gmem(lse_mine.at[pl.ds(0, LSE_ROWS)], lse_ref.at[item, kvh, c])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(used & (wg == consumers))
  def _producer():
    if consumer_registers:
      plgpu.set_max_registers(40, action="decrease")
    if max_registers and not interpret:  # marks the whole kernel (emits no instruction)
      plgpu.inline_mgpu()(lambda ctx: RC.request_max_registers(max_registers))()

    num_pages = store_b.shape[1]
    row_end = (b + 1) * max_pages  # flat page-table rows of this sequence end here

    def prefetch(i):  # page-table entries and metadata of steps i .. i + CHUNK_STEPS - 1
      row_start = b * max_pages + first_page + i * STEP_PAGES
      if interpret:  # inline PTX is not interpretable: the same gather, one entry at a time
        I.gather_pages(page_table_ref, store_b, chunk_smem, row_start, row_end, kvh, max_pages=max_pages,
                       num_pages=num_pages, nblocks=nb, compressed=compressed, version=version)
        return
      splat = plgpu.Layout.WG_SPLAT(shape=())
      plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), splat, splat, splat))(
          lambda ctx, *args: P.gather_pages(*args, num_pages=num_pages, nblocks=nb, compressed=compressed,
                                            version=version))(
              page_table_ref, store_b, chunk_smem, row_start, row_end, kvh)

    def issue(i):
      stage = lax.rem(i, stages)

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(consumed_bars.at[stage])

      bar = load_bars.at[stage]
      local = lax.rem(i, CHUNK_STEPS) * STEP_PAGES  # step i's first entry in the chunk

      def slot_flags(s):  # s: a static slot or a (traced) warp index
        page = first_page + i * STEP_PAGES + s
        in_split = page < end_page
        return in_split & (page < full_pages), in_split & (page == full_pages)

      def copies(s, kind):  # [(predicate, src, dst)] of slot s's K or V: at most one holds
        is_page, is_tail = slot_flags(s)
        rows = pl.ds(s * PAGE_SIZE, PAGE_SIZE)
        tail_ref, tile = ((k_tail_ref, k_smem), (v_tail_ref, v_smem))[kind]
        tail_dst = tile.at[stage, rows] if tails_in_tiles else byte_smem.at[stage, kind, s]
        out = [(is_tail, tail_ref.at[b, kvh], tail_dst)]
        if compressed:  # the group's 3*nb-unit prefix and its n_raw raw units: one copy
          fields = 1 + kind_words * kind  # this kind's (offset, word1, raw count[, word2, word3])
          offset, n_raw = chunk_smem[local + s, fields], chunk_smem[local + s, fields + 2]
          dst = byte_smem.at[stage, kind, s]
          out += [(is_page & (n_raw == r), store_a.at[pl.ds(offset, 3 * nb + r)], dst.at[pl.ds(0, 3 * nb + r)])
                  for r in range(nb + 1)]
        else:
          out.append((is_page, (store_a, store_b)[kind].at[kvh, chunk_smem[local + s, 0]], tile.at[stage, rows]))
        return [] if timing_probe == "compute" else out

      flags = [jnp.where(is_page, R.FLAG_PAGE, jnp.where(is_tail, R.FLAG_TAIL, 0)).astype(jnp.int32)
               for is_page, is_tail in map(slot_flags, range(STEP_PAGES))]
      # The consumer's per-slot record: flags, then the chunk words of P.info_fields (word1s,
      # version 2: exception words), one word per producer thread.
      if interpret:  # inline PTX is not interpretable: the same record, one scalar store at a time
        for s in range(STEP_PAGES):
          info_smem[stage, s, 0] = flags[s]
          for w, field in enumerate(P.info_fields(version)):
            info_smem[stage, s, 1 + w] = chunk_smem[local + s, field] if compressed else jnp.int32(0)
      else:
        splat = plgpu.Layout.WG_SPLAT(shape=())
        plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), *(splat,) * (2 + STEP_PAGES)))(
            lambda ctx, *args: P.write_step_info(*args, version=version, compressed=compressed,
                                                 producer_fold=producer_fold))(
                chunk_smem, info_smem, stage, local, *flags)
      plgpu.commit_smem()  # every producer thread's info stores land before the arrival below
      plgpu.barrier_arrive(bar)

      if warp_issue:  # warp w issues slot w's two copies: 4 warps walk their branches in parallel
        def per_warp(w):
          for kind in range(2):
            _one_copy_or_arrive(copies(w, kind), bar)

        plgpu.warp_map(per_warp)
      else:
        for s in range(STEP_PAGES):
          for kind in range(2):
            _one_copy_or_arrive(copies(s, kind), bar)

    def issue_step(i, _):
      @pl.when(lax.rem(i, CHUNK_STEPS) == 0)
      def _():
        prefetch(i)

      issue(i)
      return ()

    lax.fori_loop(0, n_steps, issue_step, ())

    def drain(i, _):  # observe the last `stages` releases too (every barrier phase is waited on)
      plgpu.barrier_wait(consumed_bars.at[lax.rem(i, stages)])
      return ()

    lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, drain, ())


def _inline(fn, ref_types, refs, infos, head_dim, out_shape=None):
  """Run a `restore_mgpu` function `fn(*refs, infos, head_dim=)` on this warpgroup via `inline_mgpu`.

  ref_types: `_BYTES` for a plain SMEM ref, `_TILE` for a swizzled BF16 tile; infos: per slot
  the 3 (format version 2 with the consumer fold: 7) info words (scalars, passed as splat
  arrays); out_shape: the bf16 WGMMA-layout array `fn` returns (None: it returns nothing).
  """
  info_types = tuple((plgpu.Layout.WG_SPLAT(shape=()),) * len(info) for info in infos)
  ret = None if out_shape is None else plgpu.ShapeDtypeStruct(out_shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)
  return plgpu.inline_mgpu(arg_types=(*ref_types, info_types), return_type=ret)(
      lambda ctx, *args: fn(*args, head_dim=head_dim))(*refs, tuple(infos))


def _reduce_over_tokens(x, op, scratch):
  """x f32 [64 tokens, 8] (WGMMA layout) reduced over tokens ("max" or "add") -> [8] (WGMMA.reduce(0)).

  The token axis spans the 4 warps, so the reduction goes through SMEM. Pallas's own reduction
  lowering uses one CTA-wide scratch region, which two consumer warpgroups reducing at once
  overwrite under each other (the `consumers=2` race: wrong maxima and sums, H100, 2026-12-06);
  here each consumer passes its own `scratch` (f32 [REDUCE_SCRATCH]), guarded by warpgroup barriers.
  """
  out = plgpu.ShapeDtypeStruct((QROWS,), jnp.float32, layout=plgpu.Layout.WGMMA.reduce(0))
  return plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, _BYTES), return_type=out)(
      lambda ctx, x, ref: x.reduce(op, 0, scratch=ref))(x, scratch)


def _inline_store_pt(p16, pt_smem):
  """P^T into the [8, 64] B-operand tile (`restore_mgpu.store_pt`)."""
  plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, _TILE))(lambda ctx, p, ref: R.store_pt(p, ref))(p16, pt_smem)


def _one_copy_or_arrive(copies, barrier):
  """Issue the one TMA whose predicate holds, else a plain arrival: always one arrival on `barrier`.

  copies: [(predicate, src, dst)] with mutually exclusive predicates. (The `predicate=` form of
  `copy_gmem_to_smem` skips the arrival too; one op per slot instead of one per candidate copy
  keeps the producer's issue work at 8 ops per step.)
  """
  for predicate, src, dst in copies:
    @pl.when(predicate)
    def _():
      plgpu.copy_gmem_to_smem(src, dst, barrier)

  if not copies:
    plgpu.barrier_arrive(barrier)
    return

  @pl.when(jnp.logical_not(functools.reduce(jnp.logical_or, [c[0] for c in copies])))
  def _():
    plgpu.barrier_arrive(barrier)


_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_BYTES = plgpu.RefType()  # a plain SMEM ref (the byte stage)
_TILE = plgpu.RefType(transforms=_TRANSFORMS)  # a [64, D] BF16 tile


def _decode_attention(q, cache: PagedKVCache, scale: float, config: DecodeConfig, return_lse: bool,
                      interpret: bool = False, work=None):
  batch, q_heads, head_dim = q.shape
  kv_heads = cache.num_kv_heads
  group = q_heads // kv_heads
  nb = head_dim // 32
  stages, consumers = config.stages, config.consumers
  max_pages = cache.max_pages
  work_stride = 3
  if config.schedule == "grid":  # the kernel derives its rows from the program id: no table
    work, num_items = (), batch * config.splits
  else:
    table, seq_first = _device_plan(cache.lengths, kv_heads, max_pages, config, interpret) if work is None else work
    work, num_items, work_stride = (table.reshape(-1),), table.shape[0], table.shape[1]
  stores = (cache.arena, cache.group_meta) if cache.compressed else (cache.k_pages, cache.v_pages)
  version = cache.format_version or 1
  in_registers = cache.compressed and not interpret
  producer_fold = config.exception_fold == "producer" and cache.compressed and version == 2
  tile = lambda shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=_TRANSFORMS)
  # With one consumer the stage ring (BF16 tiles and / or the byte stage) is dead once its step loop
  # ends, so the epilogue's O and LSE reuse its SMEM (6 KB at D = 128); with two, one consumer
  # may finish while the other still reads the ring, so each gets its own.
  stream = (() if in_registers else (tile((stages, STEP_TOKENS, head_dim)),) * 2) + (
      (plgpu.SMEM((stages, 2, STEP_PAGES, 4 * nb, R.UNIT), jnp.uint8),) if cache.compressed else ())
  epilogue = (plgpu.SMEM((consumers, head_dim, QROWS), jnp.float32),
              plgpu.SMEM((consumers, STEP_TOKENS, QROWS), jnp.float32))
  scratch = (
      (
          tile((QROWS, head_dim)),
          plgpu.RefUnion(stream, epilogue) if consumers == 1 else (stream, epilogue),
          plgpu.SMEM((stages, STEP_PAGES, P.info_words(version, producer_fold)), jnp.int32),
          plgpu.SMEM((P.CHUNK_PAGES, P.entry_words(version)), jnp.int32),
          tile((consumers, QROWS, STEP_TOKENS)),  # each consumer's P^T
          plgpu.SMEM((consumers, REDUCE_SCRATCH), jnp.float32),  # each consumer's reduction scratch
      ),
      (
          plgpu.Barrier(num_barriers=1),
          plgpu.Barrier(num_arrivals=LOAD_ARRIVALS, num_barriers=stages),
          plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      ),
  )
  tails = (cache.k_tail, cache.v_tail)
  if in_registers:  # the tail page's bytes as one byte-stage slot: [16, D] bf16 = [4 * nb, 256] u8
    tails = tuple(lax.bitcast_convert_type(t, jnp.uint8).reshape(batch, kv_heads, 4 * nb, R.UNIT) for t in tails)
  if QROWS % group == 0 and (batch * q_heads) % QROWS == 0:
    q_rows, row_stride = q.reshape(batch * q_heads, head_dim), group  # free reshape
  else:  # e.g. 3 heads per KV head: pad each group to 8 rows so every 8-row TMA box is its own
    q_rows = jnp.pad(q.reshape(batch, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, QROWS - group), (0, 0)))
    q_rows, row_stride = q_rows.reshape(batch * kv_heads * QROWS, head_dim), QROWS

  body = functools.partial(
      _kernel, compressed=cache.compressed, version=version, head_dim=head_dim, kv_heads=kv_heads, row_stride=row_stride,
      max_pages=max_pages, grid_pages=_grid_pages(max_pages, config) if config.schedule == "grid" else 0,
      scale=scale, stages=stages,
      timing_probe=config.timing_probe, warp_issue=config.warp_issue,
      consumer_registers=config.consumer_registers, consumers=consumers, v_after_qk=config.v_after_qk,
      max_registers=config.max_registers, interpret=interpret, work_stride=work_stride,
      producer_fold=producer_fold)

  def entry(*refs):
    pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch, collective_axes="wg")

  o, lse = plgpu.kernel(
      entry,
      out_type=(
          jax.ShapeDtypeStruct((num_items, kv_heads, consumers, head_dim, QROWS), jnp.float32),
          jax.ShapeDtypeStruct((num_items, kv_heads, consumers, LSE_ROWS, QROWS), jnp.float32),
      ),
      grid=(kv_heads, num_items),  # KV heads fastest, then items: the grid schedule's (h, b, s) order
      grid_names=("h", "w"),
      num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
  )(q_rows, cache.lengths, cache.page_table, *tails, *stores, *work)
  if config.schedule == "balanced":  # one merge kernel writes the final rows
    out, lse2 = merge_items(o, lse, seq_first, group=group, interpret=interpret)
    out, lse2 = out.reshape(batch, q_heads, head_dim), lse2[:, :group]
  else:  # grid: item s * B + b -> partials [B, Hkv, splits * C] (split-major), merged by XLA
    o, lse2 = jnp.swapaxes(o, 3, 4)[..., :group, :], lse[..., 0, :group]  # [W, Hkv, C, G, D], [W, Hkv, C, G]
    regroup = lambda x: jnp.moveaxis(x.reshape(config.splits, batch, *x.shape[1:]), 0, 2).reshape(
        batch, kv_heads, config.splits * consumers, *x.shape[3:])
    out, lse2 = _combine(regroup(o), regroup(lse2))
    out = out.reshape(batch, q_heads, head_dim).astype(jnp.bfloat16)
  if return_lse:
    return out, (lse2 * math.log(2.0)).reshape(batch, q_heads)
  return out


def _work_items(lengths, kv_heads: int, max_pages: int, config: DecodeConfig, xp=jnp):
  """The kernel's work items: (int32 [W, 3] rows (sequence, first page, end page), and for the
  balanced schedule int32 [B + 1] `seq_first`: sequence b's items are `[seq_first[b],
  seq_first[b + 1])`; None for the grid schedule).

  grid: item s * B + b is split s of sequence b, `pages_per_split` pages of the cache's
  `max_pages + 1` (static, as before: B * splits items). The kernel computes these rows from its
  program id; the table is what `benchmarks.ragged --plan` and the tests read.
  balanced (from `lengths`; this is the plan's statement: `host_work_items` runs it in numpy, and
  the device runs the same statements as one kernel, `plan_items`): an item size c
  (`_item_pages`: whole steps, >= 16 pages, the size whose items finish soonest in waves of the
  GPU's CTA slots), and sequence b cut into n_b = ceil(p_b / c) items of equal size (rounded up
  to whole steps), in sequence order. The static item count is W = `config.items` (0:
  `target_items`, two waves' worth per KV head) + B, rounded up to a multiple of
  `ITEMS_PER_LOAD`, and c is chosen among the sizes whose items fit it; the rest are unused:
  (-1, 0, 0), whose CTAs return at once (no Q copy, no output write; an unused CTA costs its
  launch and one load), and `merge_items` never reads them.

  `xp`: the array namespace the plan is computed in: `numpy` (`host_work_items`) or `jnp` (the
  tests' and `benchmarks.ragged --plan`'s reference).
  """
  batch = lengths.shape[0]
  if config.schedule == "grid":
    pages_per_split = _grid_pages(max_pages, config)
    split, b = xp.divmod(xp.arange(batch * config.splits, dtype=xp.int32), batch)
    first = split * pages_per_split
    return xp.stack([b, first, first + pages_per_split], axis=1), None
  steps_up = lambda x: -(-x // STEP_PAGES) * STEP_PAGES
  pages = (lengths.astype(xp.int32) + PAGE_SIZE - 1) // PAGE_SIZE  # [B], the tail page included
  num_items = _table_rows(batch, kv_heads, config)
  chunk = _item_pages(pages, kv_heads, max_pages, num_items, config.consumers, xp)
  per_item = steps_up(-(-pages // xp.maximum(-(-pages // chunk), 1)))  # equal items of whole steps
  count = -(-pages // xp.maximum(per_item, 1))  # [B], 0 for an empty sequence
  ends = xp.cumsum(count, dtype=xp.int32)
  w = xp.arange(num_items, dtype=xp.int32)
  # Sequence of item w: how many sequences end at or before it (B past the last used item): a
  # compare-and-count, as `plan_items` does it in registers.
  b = xp.sum(ends[None, :] <= w[:, None], axis=1, dtype=xp.int32)
  used = b < batch
  bc = xp.minimum(b, batch - 1)
  first = (w - (ends[bc] - count[bc])) * per_item[bc]
  unused = xp.array([-1, 0, 0], xp.int32)
  work = xp.where(used[:, None], xp.stack([bc, first, first + per_item[bc]], axis=1), unused).astype(xp.int32)
  return work, xp.concatenate([xp.zeros((1,), xp.int32), ends]).astype(xp.int32)


def _device_plan(lengths, kv_heads: int, max_pages: int, config: DecodeConfig, interpret: bool):
  """`_work_items`' balanced plan as one Pallas kernel (`plan_items`: table rows of 4), for a call
  without `work=`: XLA ran the jnp statements as 9-10 small kernels."""
  return plan_items(
      lengths, kv_heads=kv_heads, num_items=_table_rows(lengths.shape[0], kv_heads, config),
      candidates=_size_candidates(max_pages), slots=_cta_slots(config.consumers), page_size=PAGE_SIZE,
      step_pages=STEP_PAGES, min_pages=MIN_ITEM_PAGES, overhead_pages=ITEM_OVERHEAD_PAGES, interpret=interpret)


def _table_rows(batch: int, kv_heads: int, config: DecodeConfig) -> int:
  """The balanced schedule's static work-table rows per KV head: `config.items` (0: `target_items`)
  + B, rounded up to whole blocks of the merge's loads."""
  rows = (config.items or target_items(kv_heads, config.consumers)) + batch
  return -(-rows // ITEMS_PER_LOAD) * ITEMS_PER_LOAD


def _size_candidates(max_pages: int) -> int:
  """How many item sizes `_item_pages` weighs: the longest sequence cut into n = 1, 2, ... items."""
  return min(-(-(max_pages + 1) // MIN_ITEM_PAGES), 1024)


def _cta_slots(consumers: int) -> int:
  """CTAs the GPU runs at once: two per SM with one consumer warpgroup, one with two."""
  return (CTAS_PER_SM if consumers == 1 else 1) * NUM_SMS


def _grid_pages(max_pages: int, config: DecodeConfig) -> int:
  """The grid schedule's pages per split: `max_pages + 1` (the tail page) over `splits`, whole steps."""
  return -(-(max_pages + 1) // (config.splits * STEP_PAGES)) * STEP_PAGES


def target_items(kv_heads: int, consumers: int = 1) -> int:
  """The balanced schedule's item budget per KV head beyond one per sequence: two waves of the GPU's
  CTA slots (the static grid is this + B items per KV head)."""
  return max(1, math.ceil(2 * _cta_slots(consumers) / kv_heads))


ITEM_OVERHEAD_PAGES = 4 * STEP_PAGES  # an item's fixed cost (prologue, pipeline fill, epilogue, its combine
# share) in pages streamed: H200, 2026-12-04, 32 x 2048 at 1 / 2 / 4 splits (1 / 2 / 4 waves of 128 / 64 /
# 32-page items) ran 56.8 / 64.9 / 71.7 us, which a wave model fits with 12-20 pages per item.


def _item_pages(pages, kv_heads: int, max_pages: int, num_items: int, consumers: int = 1, xp=jnp):
  """The balanced schedule's item size in pages (an int32 scalar, in `xp`: see `_work_items`) for
  sequences of `pages` int32 [B] pages. Candidates: the longest sequence cut into n equal whole-step items, n =
  1, 2, ... (sizes >= MIN_ITEM_PAGES); the choice is the one whose items finish soonest if each
  wave of the GPU's CTA slots takes (size + ITEM_OVERHEAD_PAGES): cost = ceil(Hkv * items /
  slots) * (size + overhead), items = sum_b ceil(p_b / size) <= `num_items`; ties go to the larger
  size (fewer items). One fusion of a [candidates, B] compare-and-sum: no loop.

  Equal lengths get the grid heuristic's items (32 x 2048: one 128-page item per sequence; 8 x
  8192: four of 128 pages); one 32K sequence among 31 of 1K gets 64-page items, not one CTA per
  KV head."""
  steps_up = lambda x: -(-x // STEP_PAGES) * STEP_PAGES
  n = xp.arange(1, _size_candidates(max_pages) + 1, dtype=xp.int32)  # static candidates
  sizes = xp.maximum(MIN_ITEM_PAGES, steps_up(-(-xp.max(pages, initial=0) // n)))  # [n], non-increasing
  items = xp.sum(-(-pages[None, :] // sizes[:, None]), axis=1)  # [n]
  waves = -(-items * kv_heads // _cta_slots(consumers))
  cost = xp.where(items <= num_items, waves * (sizes + ITEM_OVERHEAD_PAGES), xp.iinfo(xp.int32).max)
  return sizes[xp.argmin(cost)]  # the first minimum: the largest size among equals


UNROLLED_COMBINE_SPLITS = 8  # up to this many partials per row, `_combine` is elementwise over them


def _combine(o, lse2):
  """Merge split partials: o f32 [B, Hkv, S, G, D], lse2 f32 [B, Hkv, S, G] -> ([B, Hkv, G, D], [B, Hkv, G]).

  For S <= UNROLLED_COMBINE_SPLITS the maxima and sums run over the S slices as elementwise
  ops (no reduction over the split axis), so XLA can fuse the whole merge, with the partials'
  transpose, into one loop kernel: as reductions over S it took three kernels (exponential, reduce,
  convert: 4.1 us at 8 x 8192 on the H100, 2026-12-07, 5% of the call)."""
  splits = o.shape[2]
  if splits == 1:
    return o[:, :, 0], lse2[:, :, 0]
  if splits <= UNROLLED_COMBINE_SPLITS:
    parts = [lse2[:, :, s] for s in range(splits)]
    top = functools.reduce(jnp.maximum, parts)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    w = [jnp.exp2(x - top_safe) for x in parts]
    total = functools.reduce(jnp.add, w)
    acc = functools.reduce(jnp.add, [ws[..., None] * o[:, :, s] for s, ws in enumerate(w)])
  else:
    top = jnp.max(lse2, axis=2)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse2 - top_safe[:, :, None])
    total = jnp.sum(w, axis=2)
    acc = jnp.sum(w[..., None] * o, axis=2)
  empty = total == 0
  out = acc / jnp.where(empty, 1.0, total)[..., None]
  return out, jnp.where(empty, -jnp.inf, top_safe + jnp.log2(jnp.where(empty, 1.0, total)))


def decode_attention_pallas(q, cache: PagedKVCache, scale: float, *, config: DecodeConfig | None = None,
                            return_lse: bool = False, interpret: bool | None = None, work=None):
  """Fused paged decode attention (see module docstring). Inputs are validated by the caller.

  Args:
    q: bfloat16 [B, Hq, D]; cache: a PagedKVCache (compressed or not).
    scale: softmax scale. config: None picks `default_config(cache)` (`heuristic_config` for its store).
    work: the balanced schedule's items planned beforehand, `host_work_items(lengths, ...)` (int32
      [W, 3] rows, int32 [B + 1] first item of each sequence); None plans them on the device from
      `cache.lengths` (one small Triton kernel before the attention kernel, `plan_items`). Only with
      `config.schedule == "balanced"`; they must be the plan of `cache.lengths`.
    interpret: None = interpret off-GPU. Interpret mode runs this kernel body on the
      CPU with static substitutions for what inline PTX does on the GPU: the jnp codec
      restores the same byte stage into BF16 SMEM tiles (`decode_interpret`; a register
      wgmma operand is not interpretable), so K and V^T are read as on the uncompressed
      path; P^T is stored with a jnp transpose; the metadata gather runs one entry at a
      time. It runs un-jitted.
  """
  if config is None:
    config = default_config(cache)
  if not isinstance(config, DecodeConfig):
    raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}")
  if work is not None and config.schedule != "balanced":
    raise ValueError(f"work items are the balanced schedule's; config.schedule is {config.schedule!r}")
  if work is not None:
    check_work_items(work, cache.lengths.shape[0], cache.lengths)
  if q.size == 0:  # no sequences or no heads: nothing to attend (a grid of 0 items, or G = 0, cannot launch)
    out = jnp.zeros(q.shape, jnp.bfloat16)
    return (out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else out
  if _platform.resolve_interpret(interpret):
    return _decode_attention(q, cache, float(scale), config, bool(return_lse), interpret=True, work=work)
  return _decode_attention_jit(q, cache, float(scale), config, bool(return_lse), work=work)


def check_work_items(work, batch: int, lengths=None) -> None:
  """Refuse a `work=` pair that `_work_items` cannot have made (ValueError): integer arrays of
  shapes [W, 3] (W a multiple of ITEMS_PER_LOAD) and [B + 1] always; and, when concrete (not
  traced; a traced pair is the caller's to get right), a `seq_first` that rises from 0 within the
  table. With `lengths` int [B] (concrete, as is the pair): the items must also cover each
  sequence's pages (tail included) once, as consecutive items of that sequence from page 0, and
  every row past them be unused, (-1, 0, 0); a plan of other lengths would attend over the
  wrong pages (or none) without a word. The serving plan check (`check_plan`) runs this."""
  table, seq_first = work
  if (len(table.shape) != 2 or table.shape[1] != 3 or table.shape[0] % ITEMS_PER_LOAD
      or tuple(seq_first.shape) != (batch + 1,)
      or not (np.issubdtype(table.dtype, np.integer) and np.issubdtype(seq_first.dtype, np.integer))):
    raise ValueError(f"work must be (int32 [W, 3] with W a multiple of {ITEMS_PER_LOAD}, int32 [{batch + 1}]) "
                     f"from host_work_items, got {table.dtype} {tuple(table.shape)}, "
                     f"{seq_first.dtype} {tuple(seq_first.shape)}")
  if isinstance(seq_first, jax.core.Tracer) or isinstance(table, jax.core.Tracer):
    return
  seq_first = np.asarray(seq_first)
  if seq_first[0] != 0 or np.any(np.diff(seq_first) < 0) or seq_first[-1] > table.shape[0]:
    raise ValueError(f"work's seq_first={seq_first.tolist()} must rise from 0 to at most W = {table.shape[0]}")
  if lengths is None or isinstance(lengths, jax.core.Tracer):
    return
  table, lengths = np.asarray(table), np.asarray(lengths, np.int64)
  used = int(seq_first[-1])
  seq, start, end = table[:used].T
  pages = -(-lengths // PAGE_SIZE)
  has = np.diff(seq_first) > 0
  ok = np.array_equal(has, pages > 0) and np.all(table[used:] == [-1, 0, 0])
  if ok and used:
    last = seq_first[1:][has] - 1  # each sequence's last item reaches its last page
    prev_end = np.concatenate([[0], end[:-1]])
    first_of_seq = np.concatenate([[True], seq[1:] != seq[:-1]])
    ok = (np.array_equal(seq, np.repeat(np.arange(batch), np.diff(seq_first))) and np.all(end > start)
          and np.all(np.where(first_of_seq, start == 0, start == prev_end)) and np.all(start[last] < pages[has])
          and np.all(end[last] >= pages[has]))
  if not ok:
    raise ValueError(f"work does not cover each sequence's pages once for lengths={lengths.tolist()}: plan it with "
                     "host_work_items(cache.lengths, ...)")


def host_work_items(lengths, kv_heads: int, max_pages: int, config: DecodeConfig, fit_rows: bool = False):
  """The balanced schedule's items planned on the host: `_work_items`' own statements run by numpy
  (no jax dispatch, no compile per shape). Returns numpy (int32 [W, 3], int32 [B + 1]) for
  `decode_attention_pallas(..., work=...)`, so a caller that knows the lengths (a serving
  engine's scheduler, each step) keeps the plan off the GPU.

  fit_rows: keep only `fitted_rows(...)` rows of the table (the used items, rounded up to a few
  sizes), so fewer unused rows launch a CTA each: W = B = 32 instead of 104 at 32 x 2048. Each
  distinct W compiles its own kernel; the sizes double from B, so a batch width has at most
  log2(W / B) + 2 of them."""
  lengths = np.asarray(lengths, np.int32)
  if config.schedule != "balanced" or lengths.ndim != 1 or not lengths.size:
    raise ValueError(f"host_work_items plans the balanced schedule for lengths int [B >= 1]; got schedule "
                     f"{config.schedule!r}, lengths of shape {lengths.shape}")
  table, seq_first = _work_items(lengths, kv_heads, max_pages, config, xp=np)
  if fit_rows:
    table = table[:fitted_rows(int(seq_first[-1]), lengths.size, table.shape[0])]
  return np.ascontiguousarray(table, np.int32), np.ascontiguousarray(seq_first, np.int32)


def fitted_rows(used: int, batch: int, rows: int) -> int:
  """The table rows `host_work_items(..., fit_rows=True)` keeps for `used` items of a batch of
  `batch` sequences in a static table of `rows`: the first of B, 2B, 4B, ... (each rounded up to
  whole blocks of the merge's loads) that holds them, at most `rows`."""
  size = -(-max(batch, 1) // ITEMS_PER_LOAD) * ITEMS_PER_LOAD
  while size < min(used, rows):
    size *= 2
  return min(size, rows)


# Compiled path. Interpret mode runs un-jitted: the interpreter's kernel leaves a wgmma effect
# that jax.jit cannot lower (jax 0.11.2).
_decode_attention_jit = jax.jit(_decode_attention, static_argnames=("scale", "config", "return_lse", "interpret"))

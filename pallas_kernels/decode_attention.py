"""Fused paged decode attention over the 12-bit KV format (Mosaic GPU, Hopper).

One kernel body serves both stores of `zipfusion_jax.paged.PagedKVCache`:

* compressed: each step a producer warpgroup TMA-copies exactly the stored
  bytes of 4 pages' K and V groups (the fixed 3*nb-unit prefix of each group
  plus one unit per raw block), the consumer warpgroup restores them to BF16
  in registers (`restore_mgpu.restore_step`) and writes the swizzled SMEM tiles
  the wgmmas read;
* uncompressed: the producer TMA-copies the BF16 pages into the same tiles.

The raw tail page of each sequence is TMA-copied as BF16 into its slot on
both paths. After the tiles are filled both paths run the same code: `S = Q K^T`
with the (<= 8) query heads of one KV head as the wgmma A operand (M = 64,
padded), online softmax in the log2 domain, `O += P V` with P in registers;
so a compressed and an uncompressed cache of the same K/V give bit-identical
outputs.

Grid: (KV heads, sequences, splits); CTA = 1 consumer + 1 producer warpgroup.
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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _platform
from pallas_kernels import restore_mgpu as R
from zipfusion_jax.format import block as FB
from zipfusion_jax.paged.cache import PAGE_SIZE, PagedKVCache

STEP_PAGES = R.PAGES_PER_STEP
STEP_TOKENS = STEP_PAGES * PAGE_SIZE  # 64: one wgmma N for S, K for P V
QROWS = 8  # query rows copied per CTA (>= heads per KV head)
MROWS = 64  # wgmma M
LOG2E = 1.4426950408889634
NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tuning knobs of the fused kernel.

  Attributes:
    splits: CTAs per (sequence, KV head), each over a contiguous page range
      (split-K); partials are combined with their log-sum-exp.
    stages: depth of the producer -> consumer ring (TMA runs that many steps ahead).
    split_restore: compressed path: the producer warpgroup restores V while the
      consumer restores K and computes S (else the consumer restores both). Off by
      default: it delays the producer's copies, which bound the kernel (H200,
      2026-12-03, 32 x 2048 at Llama-3.1-8B shapes: 281 us on vs 228 us off).
    pipeline_metadata: the producer loads page-table entries two steps ahead and
      group metadata one step ahead, so no global-load latency sits between two
      steps' copies. Off by default until measured on a GPU (it lowers for an
      abstract H200 and passes the interpret-mode tests).
  """

  splits: int = 1
  stages: int = 2
  split_restore: bool = False
  pipeline_metadata: bool = False

  def __post_init__(self):
    if self.splits < 1:
      raise ValueError(f"{self.splits=} must be >= 1")
    if not 1 <= self.stages <= 4:
      raise ValueError(f"{self.stages=} must be in [1, 4]")


def heuristic_config(batch: int, kv_heads: int, max_pages: int) -> DecodeConfig:
  """Pick splits so the grid fills every SM while each split keeps >= 4 steps.

  Decode attention is bandwidth bound: what matters is that every SM streams.
  Fewer than 132 (Hkv x B) CTAs leave SMs idle, so split the page range until
  the grid has a full wave, but never below 4 steps (256 tokens) per split, where
  the per-split prologue, epilogue and combine cost more than they hide. Past
  one wave, more splits only add combine traffic (H200, 2026-12-03: 32 x 2048
  at Llama-3.1-8B shapes ran 7% slower with 2 splits than with 1).
  """
  ctas = batch * kv_heads
  steps = -(-max(max_pages, 1) // STEP_PAGES)
  splits = 1
  while ctas * splits < NUM_SMS and steps // (2 * splits) >= 4:
    splits *= 2
  return DecodeConfig(splits=splits)


def _kernel(q_ref, lengths_ref, page_table_ref, k_tail_ref, v_tail_ref, *refs,
            compressed, head_dim, kv_heads, row_stride, pages_per_split, max_pages, scale, stages,
            split_restore, pipeline_metadata, interpret):
  """Refs (GMEM):
    q_ref: bf16 [rows, D]: the G query heads of (b, kvh) are rows (b * Hkv + kvh) * row_stride
      + [0, G), row_stride = G (G divides 8) or 8 (padded); 8 rows are copied, TMA zero-fills
      rows past the end; lengths_ref: i32 [B]; page_table_ref: i32 [B, MP];
    k_tail_ref, v_tail_ref: bf16 [B, Hkv, 16, D];
    compressed: arena_ref u8 [U, 256], meta_ref u32 [Hkv, P, 2, 2];
    else: k_pages_ref, v_pages_ref bf16 [Hkv, P, 16, D];
    o_ref: f32 [B, Hkv, splits, 8, D] (rows >= G unused); lse_ref: f32 [B, Hkv, splits, 64] (log2 domain).
  """
  store_a, store_b, o_ref, lse_ref, scoped = refs
  nb = head_dim // 32
  kvh, b, split = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("s")
  wg = lax.axis_index("wg")
  (q_smem, k_smem, v_smem, byte_smem, info_smem, o_smem, lse_smem, p_smem), (q_bar, load_bars, consumed_bars, v_ready_bars) = scoped

  length = lengths_ref[b]
  full_pages = length // PAGE_SIZE
  total_pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
  first_page = split * pages_per_split
  end_page = jnp.minimum(first_page + pages_per_split, total_pages)
  n_steps = jnp.maximum(end_page - first_page + STEP_PAGES - 1, 0) // STEP_PAGES

  def slot_infos(stage):
    return [tuple(info_smem[stage, s, i] for i in range(3)) for s in range(STEP_PAGES)]

  @pl.when(wg == 0)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds((b * kv_heads + kvh) * row_stride, QROWS)], q_smem.at[pl.ds(0, QROWS)], q_bar)
    plgpu.barrier_wait(q_bar)
    m_i = plgpu.layout_cast(jnp.full((MROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((MROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((MROWS, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)

    def step(i, carry):
      acc, m_i, l_i = carry
      stage = lax.rem(i, stages)
      plgpu.barrier_wait(load_bars.at[stage])
      infos = slot_infos(stage)
      byte_ref, k_ref, v_ref = byte_smem.at[stage], k_smem.at[stage], v_smem.at[stage]
      if interpret:  # inline PTX is not interpretable: the jnp restore of the same bytes
        _restore_interpret(byte_smem, k_smem, v_smem, stage, infos, head_dim, compressed)
      elif compressed and split_restore:
        _inline(R.restore_k, (_BYTES, _TILE), (byte_ref, k_ref), infos, head_dim)
      elif compressed:
        _inline(R.restore_step, (_BYTES, _TILE, _TILE), (byte_ref, k_ref, v_ref), infos, head_dim)
      else:
        _inline(R.zero_absent_v, (_TILE,), (v_ref,), infos, head_dim)
      plgpu.commit_smem()

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[stage].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((MROWS, STEP_TOKENS), jnp.float32))
      tok = (first_page + i * STEP_PAGES) * PAGE_SIZE + plgpu.broadcasted_iota(
          jnp.int32, (MROWS, STEP_TOKENS), 1, layout=plgpu.Layout.WGMMA)
      s = jnp.where(tok < jnp.minimum(length, end_page * PAGE_SIZE), s * (scale * LOG2E), -jnp.inf)
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l_new = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(jnp.bfloat16)

      if compressed and split_restore and not interpret:
        plgpu.barrier_wait(v_ready_bars.at[stage])

      if interpret:  # a register A operand is not interpretable: P goes through SMEM
        p_smem[...] = p16

        def pv_interpret(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, v_smem.at[stage])
          return acc_ref[...]

        acc = acc + pl.run_scoped(pv_interpret, plgpu.ACC((MROWS, head_dim), jnp.float32))
      else:
        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[stage])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(consumed_bars.at[stage])
      return acc, m_new, l_new

    acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))
    empty = l_i == 0
    l_safe = jnp.where(empty, 1.0, l_i)
    o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(l_safe))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, QROWS)], o_ref.at[b, kvh, split])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kvh, split])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _producer():
    plgpu.set_max_registers(96 if compressed and split_restore else 40, action="decrease")

    num_pages = store_b.shape[1]

    def pages_of(i):  # physical pages of step i's slots; entries past a sequence may be stale: clamp
      return tuple(
          jnp.clip(page_table_ref[b, jnp.minimum(first_page + i * STEP_PAGES + s, max_pages - 1)], 0, num_pages - 1)
          for s in range(STEP_PAGES))

    def meta_of(phys):  # per slot: (K word0, K word1, V word0, V word1) of its group metadata
      if not compressed:
        return ()
      return tuple(tuple(store_b[kvh, p, kind, w] for kind in range(2) for w in range(2)) for p in phys)

    def issue(i, phys, meta):
      stage = lax.rem(i, stages)

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(consumed_bars.at[stage])

      bar = load_bars.at[stage]
      for s in range(STEP_PAGES):
        page = first_page + i * STEP_PAGES + s
        in_split = page < end_page
        is_page = in_split & (page < full_pages)
        is_tail = in_split & (page == full_pages)
        rows = pl.ds(s * PAGE_SIZE, PAGE_SIZE)
        words = []
        for kind, (tail_ref, stage_smem) in enumerate(((k_tail_ref, k_smem), (v_tail_ref, v_smem))):
          _copy_or_arrive(tail_ref.at[b, kvh], stage_smem.at[stage, rows], bar, is_tail)
          if compressed:
            word0, word1 = meta[s][2 * kind], meta[s][2 * kind + 1]
            offset = (word0 & 0x3FFFFFFF).astype(jnp.int32)
            n_raw = sum(((word1 >> (8 * j)) & 0xFF == R.RAW).astype(jnp.int32) for j in range(nb))
            dst = byte_smem.at[stage, kind, s]
            _copy_or_arrive(store_a.at[pl.ds(offset, 3 * nb)], dst.at[pl.ds(0, 3 * nb)], bar, is_page)
            for j in range(nb):
              _copy_or_arrive(store_a.at[pl.ds(offset + 3 * nb + j, 1)], dst.at[pl.ds(3 * nb + j, 1)], bar,
                              is_page & (j < n_raw))
            words.append(lax.bitcast_convert_type(word1, jnp.int32))
          else:
            pages_ref = (store_a, store_b)[kind]
            _copy_or_arrive(pages_ref.at[kvh, phys[s]], stage_smem.at[stage, rows], bar, is_page)
            words.append(jnp.int32(0))
        info_smem[stage, s, 0] = jnp.where(is_page, R.FLAG_PAGE, jnp.where(is_tail, R.FLAG_TAIL, 0)).astype(jnp.int32)
        info_smem[stage, s, 1] = words[0]
        info_smem[stage, s, 2] = words[1]
      plgpu.commit_smem()  # every producer thread's info stores land before the arrival below
      plgpu.barrier_arrive(bar)

    def issue_now(i, _):  # page table, then metadata, then copies: two dependent loads per step
      phys = pages_of(i)
      issue(i, phys, meta_of(phys))
      return ()

    if pipeline_metadata and not (compressed and split_restore):
      # Iteration i issues step i's copies from metadata loaded in iteration i - 1, loads step
      # i + 1's group words (its pages were loaded in iteration i - 1) and step i + 2's page-table
      # entries; loads block only at first use, one iteration later.
      def issue_pipelined(i, carry):
        phys, meta, phys_next = carry
        issue(i, phys, meta)
        return phys_next, meta_of(phys_next), pages_of(i + 2)

      phys0 = pages_of(0)
      lax.fori_loop(0, n_steps, issue_pipelined, (phys0, meta_of(phys0), pages_of(1)))
      return

    if not (compressed and split_restore) or interpret:
      lax.fori_loop(0, n_steps, issue_now, ())
      return

    # Split restore: issue step i + 1, then restore V of step i while the consumer does K.
    @pl.when(n_steps > 0)
    def _():
      issue_now(0, ())

    def restore_v(i, _):
      @pl.when(i + 1 < n_steps)
      def _():
        issue_now(i + 1, ())

      stage = lax.rem(i, stages)
      plgpu.barrier_wait(load_bars.at[stage])
      _inline(R.restore_v, (_BYTES, _TILE), (byte_smem.at[stage], v_smem.at[stage]), slot_infos(stage), head_dim)
      plgpu.commit_smem()
      plgpu.barrier_arrive(v_ready_bars.at[stage])
      return ()

    lax.fori_loop(0, n_steps, restore_v, ())


def _restore_interpret(byte_smem, k_smem, v_smem, stage, infos, head_dim, compressed):
  """Interpret-mode stand-in for `restore_mgpu`: the jnp codec on the same byte stage.

  Decodes each page slot's groups (block starts from the slot bytes, as the inline
  restore finds them) and stores the pages into the BF16 tiles; zeroes V of absent slots.
  """
  nb = head_dim // 32
  for s in range(STEP_PAGES):
    flags = infos[s][0]

    @pl.when(flags == 0)
    def _():
      v_smem[stage, pl.ds(s * PAGE_SIZE, PAGE_SIZE), :] = jnp.zeros((PAGE_SIZE, head_dim), jnp.bfloat16)

    if not compressed:
      continue
    for kind, tile in enumerate((k_smem, v_smem)):
      word1 = infos[s][1 + kind]

      @pl.when(flags == R.FLAG_PAGE)
      def _():
        flat = byte_smem[stage, kind, s].reshape(-1)
        slot_bytes = [(word1 >> (8 * j)) & 0xFF for j in range(nb)]
        rows, start = [], jnp.int32(0)
        for byte in slot_bytes:
          rows.append(lax.dynamic_slice(flat, (start * R.UNIT,), (4 * R.UNIT,)))
          start = start + jnp.where(byte == R.RAW, 4, 3)
        bits = FB.decode_rows(jnp.stack(rows), jnp.stack(slot_bytes))  # [nb, 512] in position order
        tile[stage, pl.ds(s * PAGE_SIZE, PAGE_SIZE), :] = FB.from_bits(_page_from_blocks(bits, kind, head_dim))


def _page_from_blocks(bits, kind, head_dim):
  """uint16 [nb, 512] -> [16, D]: FORMAT.md §3's tile positions, computed from iotas.

  (`layout.blocks_to_pages` gathers with a numpy permutation, and a kernel body may not
  close over array constants.)
  """
  token = lax.broadcasted_iota(jnp.int32, (PAGE_SIZE, head_dim), 0)
  dim = lax.broadcasted_iota(jnp.int32, (PAGE_SIZE, head_dim), 1)
  j, c, sub = dim // 32, (dim % 32) // 16, dim % 16
  row, col = (token, sub) if kind == 0 else (sub, token)  # K: rows are tokens; V: rows are dims
  lane = (row % 8) * 4 + (col % 8) // 2
  position = c * 256 + lane * 8 + (col // 8) * 4 + (row // 8) * 2 + col % 2
  return bits[j, position]


def _inline(fn, ref_types, refs, infos, head_dim):
  """Run a `restore_mgpu` function `fn(*refs, infos, head_dim=)` on this warpgroup via `inline_mgpu`.

  ref_types: `_BYTES` for the byte stage, `_TILE` for a swizzled BF16 tile; infos: per slot
  the 3 info words (scalars, passed as splat arrays).
  """
  info_types = tuple((plgpu.Layout.WG_SPLAT(shape=()),) * 3 for _ in range(STEP_PAGES))
  plgpu.inline_mgpu(arg_types=(*ref_types, info_types))(
      lambda ctx, *args: fn(*args, head_dim=head_dim))(*refs, tuple(infos))


def _copy_or_arrive(src, dst, barrier, predicate):
  """A conditional TMA copy that always counts one arrival on `barrier` (the copy's, or a plain one)."""
  @pl.when(predicate)
  def _():
    plgpu.copy_gmem_to_smem(src, dst, barrier)

  @pl.when(jnp.logical_not(predicate))
  def _():
    plgpu.barrier_arrive(barrier)


_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_BYTES = plgpu.RefType()  # the byte stage (no transforms)
_TILE = plgpu.RefType(transforms=_TRANSFORMS)  # a [64, D] BF16 tile


def _arrivals(compressed: bool, nb: int) -> int:
  per_slot_kind = 1 + (1 + nb if compressed else 1)  # tail + (prefix + raw units | page)
  return 2 * STEP_PAGES * per_slot_kind + 1  # + the producer's info arrival


def _decode_attention(q, cache: PagedKVCache, scale: float, config: DecodeConfig, return_lse: bool,
                      interpret: bool = False):
  batch, q_heads, head_dim = q.shape
  kv_heads = cache.num_kv_heads
  group = q_heads // kv_heads
  nb = head_dim // 32
  splits, stages = config.splits, config.stages
  max_pages = cache.max_pages
  pages_per_split = -(-(max_pages + 1) // (splits * STEP_PAGES)) * STEP_PAGES
  stores = (cache.arena, cache.group_meta) if cache.compressed else (cache.k_pages, cache.v_pages)
  tile = lambda shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=_TRANSFORMS)
  f32_tile = plgpu.SMEM((MROWS, head_dim), jnp.float32, transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
  byte_units = 4 * nb
  scratch = (
      (
          tile((MROWS, head_dim)),
          tile((stages, STEP_TOKENS, head_dim)),
          tile((stages, STEP_TOKENS, head_dim)),
          plgpu.SMEM((stages, 2, STEP_PAGES, byte_units if cache.compressed else 1, R.UNIT), jnp.uint8),
          plgpu.SMEM((stages, STEP_PAGES, 3), jnp.int32),
          f32_tile,
          plgpu.SMEM((MROWS,), jnp.float32),
          tile((MROWS, STEP_TOKENS)) if interpret else None,
      ),
      (
          plgpu.Barrier(num_barriers=1),
          plgpu.Barrier(num_arrivals=_arrivals(cache.compressed, nb), num_barriers=stages),
          plgpu.Barrier(num_arrivals=1, num_barriers=stages),
          plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      ),
  )
  if QROWS % group == 0 and (batch * q_heads) % QROWS == 0:
    q_rows, row_stride = q.reshape(batch * q_heads, head_dim), group  # free reshape
  else:  # e.g. 3 heads per KV head: pad each group to 8 rows so every 8-row TMA box is its own
    q_rows = jnp.pad(q.reshape(batch, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, QROWS - group), (0, 0)))
    q_rows, row_stride = q_rows.reshape(batch * kv_heads * QROWS, head_dim), QROWS

  body = functools.partial(
      _kernel, compressed=cache.compressed, head_dim=head_dim, kv_heads=kv_heads, row_stride=row_stride,
      pages_per_split=pages_per_split, max_pages=max_pages, scale=scale, stages=stages,
      split_restore=config.split_restore, pipeline_metadata=config.pipeline_metadata, interpret=interpret)

  def entry(*refs):
    pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch, collective_axes="wg")

  o, lse = plgpu.kernel(
      entry,
      out_type=(
          jax.ShapeDtypeStruct((batch, kv_heads, splits, QROWS, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, kv_heads, splits, MROWS), jnp.float32),
      ),
      grid=(kv_heads, batch, splits),
      grid_names=("h", "b", "s"),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
  )(q_rows, cache.lengths, cache.page_table, cache.k_tail, cache.v_tail, *stores)
  out, lse2 = _combine(o[:, :, :, :group], lse[:, :, :, :group])
  out = out.reshape(batch, q_heads, head_dim).astype(jnp.bfloat16)
  if return_lse:
    return out, (lse2 * math.log(2.0)).reshape(batch, q_heads)
  return out


def _combine(o, lse2):
  """Merge split partials: o f32 [B, Hkv, S, G, D], lse2 f32 [B, Hkv, S, G] -> ([B, Hkv, G, D], [B, Hkv, G])."""
  if o.shape[2] == 1:
    return o[:, :, 0], lse2[:, :, 0]
  top = jnp.max(lse2, axis=2, keepdims=True)
  top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp2(lse2 - top_safe)
  total = jnp.sum(w, axis=2)
  out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(total == 0, 1.0, total)[..., None]
  lse = jnp.where(total == 0, -jnp.inf, top_safe[:, :, 0] + jnp.log2(jnp.where(total == 0, 1.0, total)))
  return out, lse


def decode_attention_pallas(q, cache: PagedKVCache, scale: float, *, config: DecodeConfig | None = None,
                            return_lse: bool = False, interpret: bool | None = None):
  """Fused paged decode attention (see module docstring). Inputs are validated by the caller.

  Args:
    q: bfloat16 [B, Hq, D]; cache: a PagedKVCache (compressed or not).
    scale: softmax scale. config: None picks `heuristic_config`.
    interpret: None = interpret off-GPU. Interpret mode runs this kernel body on the
      CPU with two static substitutions: the inline-PTX restore becomes the jnp codec
      on the same byte stage (`_restore_interpret`) and P is staged through SMEM (a
      register wgmma operand is not interpretable). It runs un-jitted.
  """
  if config is None:
    config = heuristic_config(cache.batch, cache.num_kv_heads, cache.max_pages)
  if _platform.resolve_interpret(interpret):
    return _decode_attention(q, cache, float(scale), config, bool(return_lse), interpret=True)
  return _decode_attention_jit(q, cache, float(scale), config, bool(return_lse))


# Compiled path. Interpret mode runs un-jitted: the interpreter's kernel leaves a wgmma effect
# that jax.jit cannot lower (jax 0.11.2).
_decode_attention_jit = jax.jit(_decode_attention, static_argnames=("scale", "config", "return_lse", "interpret"))

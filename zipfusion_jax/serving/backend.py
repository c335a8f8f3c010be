"""The KV backend of `zipfusion_jax.kv_ops`: pure per-layer updates of a `ServingState`.

`PagedBackend(cfg)` implements `kv_ops.KVBackend` for both stores
(`cfg.compressed`): a decode step appends each active slot's token to its
tail page, and a page that this completes is encoded (compressed store: the
jnp reference encoder, or the Pallas kernel with `encoder="pallas"`) and
placed in the chunk the plan names, at that chunk's bump pointer, in the same
jitted call. Attention builds a `PagedKVCache` view of one layer (arena
shared, the layer's group_meta / tails, the step's page table and lengths)
and calls `paged_decode_attention` on it.

Placement rule (the host allocator relies on it): the completed pages of one
layer in one step are taken in plan order; the pages bound for one chunk are
consecutive and packed back to back from the chunk's bump pointer, each page
as its 2 * Hkv groups in (head, K/V) order; the bump pointer advances by
what they actually took, which the step reports in `state.step_units` (a page's
column is its place in plan order: logical page in a prefill, `plan.completing` in a decode).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec
from zipfusion_jax.paged.api import decompress_then_attend, paged_decode_attention
from zipfusion_jax.paged.cache import PagedKVCache, encode_page_blocks, kv_page_blocks, pad_absent_slots
from zipfusion_jax.serving import packing
from zipfusion_jax.serving.state import PAGE_SIZE, Plan, ServingConfig, ServingState

Encoder = Literal["reference", "pallas"]
Attention = Literal["fused", "decompress_then_attend"]


def _valid(index: jax.Array, size: int) -> jax.Array:
  """Index for a `mode="drop"` scatter: -1 (or anything outside [0, size)) becomes `size`."""
  return jnp.where((index >= 0) & (index < size), index, size)


def _encode(pages: jax.Array, encoder: Encoder, version: int = 1):
  """bfloat16 [N, Hkv, 2, 16, D] -> (rows uint8 [N, Hkv, 2, nb, 1024], meta_bytes int32 [N, Hkv, 2, 4],
  exception entries int32 [N, Hkv, 2, 4] (format version 2) or None)."""
  if encoder == "reference":
    return encode_page_blocks(pages, version)
  if encoder != "pallas":
    raise ValueError(f"{encoder=} must be 'reference' or 'pallas'")
  from pallas_kernels.compress import compress_pallas, heuristic_config  # kernels sit above the format

  blocks = kv_page_blocks(pages)  # [N, Hkv, 2, nb, 512]
  flat = blocks.reshape(-1, B.VALUES_PER_BLOCK)
  # Only each block's stored units are read back (and scattered), so the payload's unused tail
  # need not be zeroed.
  config = dataclasses.replace(heuristic_config(flat.shape[0]), zero_tail=False)
  c = compress_pallas(flat, config=config, version=version)
  # The kernel packs blocks back to back; read each block's 1024-byte window back as its row.
  starts = codec.block_byte_offsets(c.group_meta).reshape(-1)[: c.num_blocks]
  index = starts[:, None] + jnp.arange(B.ROW_BYTES, dtype=jnp.int32)[None, :]
  rows = jnp.take(c.payload, index, mode="fill", fill_value=0).reshape(*blocks.shape[:-1], B.ROW_BYTES)
  per_block = lambda x: x.reshape(-1)[: c.num_blocks].reshape(blocks.shape[:-1])
  exceptions = None if version == 1 else pad_absent_slots(per_block(c.exceptions), fill=0)
  return rows, pad_absent_slots(per_block(c.meta_bytes)), exceptions


@dataclasses.dataclass(frozen=True)
class PagedBackend:
  """`kv_ops.KVBackend` over a `ServingState` (hashable; close over it in the jitted step).

  Attributes:
    cfg: the static geometry (its `compressed` picks the store).
    encoder: "reference" (jnp, the spec; CPU) or "pallas" (the compression kernel).
    attention_impl: passed to `paged_decode_attention` (None: its default).
    attention: "fused" (restore inside the attention kernel) or "decompress_then_attend" (the
      lossless baseline: each layer's pages restored to a BF16 buffer, then the BF16 kernel).
    reduce_axis: mesh axis of tensor parallelism when the backend runs inside `shard_map`
      (page placement then agrees across devices), else None.
    decode_knobs: fused-kernel knobs over its heuristic config for this geometry, as sorted
      (name, value) pairs of `DecodeConfig` fields, e.g. (("consumers", 2), ("stages", 4)); ()
      keeps the heuristic's config. For A/B runs of the kernel inside the engine.
  """

  cfg: ServingConfig
  encoder: Encoder = "reference"
  attention_impl: str | None = None
  attention: Attention = "fused"
  reduce_axis: str | None = None
  decode_knobs: tuple[tuple[str, object], ...] = ()

  def __post_init__(self):
    if self.attention not in ("fused", "decompress_then_attend"):
      raise ValueError(f"attention={self.attention!r} must be 'fused' or 'decompress_then_attend'")
    if self.decode_knobs:
      self.attention_kwargs()  # unknown knobs or values fail here, not inside a jitted step

  def attention_kwargs(self) -> dict:
    """Keyword arguments of the attention call: {"config": ...} when `decode_knobs` are set."""
    if not self.decode_knobs:
      return {}
    from pallas_kernels.decode_attention import heuristic_config  # kernels sit above the serving state

    knobs, c = dict(self.decode_knobs), self.cfg
    pages_compressed = c.compressed and self.attention == "fused"  # decompress-then-attend reads BF16 pages
    base = heuristic_config(c.num_slots, c.num_kv_heads, c.max_pages, pages_compressed,
                            consumers=knobs.get("consumers", 1), version=c.format_version)
    return {"config": dataclasses.replace(base, **knobs)}

  def host_work(self, lengths) -> tuple[np.ndarray, np.ndarray] | None:
    """The fused kernel's work items for a decode step attending `lengths` int [S] tokens per
    slot, planned on the host (`host_work_items`): (int32 [W, 3], int32 [S + 1]) when the kernel
    runs its balanced schedule (`decode_knobs` with ("schedule", "balanced")), else None. The
    engine puts them in the step's plan, so no planning kernels run inside the step."""
    config = self.attention_kwargs().get("config")
    if config is None or config.schedule != "balanced":
      return None
    from pallas_kernels.decode_attention import host_work_items  # kernels sit above the serving state

    return host_work_items(np.asarray(lengths, np.int32), self.cfg.num_kv_heads, self.cfg.max_pages, config)

  @property
  def decompress_buffer_bytes(self) -> int:
    """BF16 bytes decompress-then-attend materialises per layer (every page id's K and V), 0 when fused."""
    if self.attention == "fused" or not self.cfg.compressed:
      return 0
    c = self.cfg
    return 2 * c.num_kv_heads * c.num_page_ids * PAGE_SIZE * c.head_dim * 2

  # --- kv_ops.KVBackend -------------------------------------------------------------

  def prefill_layer(self, state: ServingState, layer: int, plan: Plan, k: jax.Array, v: jax.Array) -> ServingState:
    """Write a prompt's K/V (bfloat16 [T, Hkv, D], T <= max_length) as slot `plan.prefill_slot`'s first tokens."""
    cfg = self.cfg
    pad = cfg.max_length + PAGE_SIZE - k.shape[0]
    if pad < PAGE_SIZE:
      raise ValueError(f"prefill of {k.shape[0]} tokens exceeds max_length={cfg.max_length}")

    def paged(x):  # [T, Hkv, D] -> [max_pages + 1, Hkv, 16, D]
      # Padded as bit patterns: XLA's CPU pad of bfloat16 is not bit-exact (it flushed subnormals
      # and quieted NaN payloads at [T, 1, 64]), and the store must keep every bit.
      x = B.from_bits(jnp.pad(B.to_bits(x), ((0, pad), (0, 0), (0, 0))))
      return x.reshape(cfg.max_pages + 1, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)

    kp, vp = paged(k), paged(v)
    n_full = plan.prefill_length // PAGE_SIZE
    page_ids = jnp.where(jnp.arange(cfg.max_pages) < n_full, plan.new_pages, -1)
    pages = jnp.stack([kp[: cfg.max_pages], vp[: cfg.max_pages]], axis=2)  # [max_pages, Hkv, 2, 16, D]
    state = self._place(state, layer, plan, pages, page_ids)
    # Tail: tokens [16 * n_full, length) of the prompt, zeros past them.
    row = jnp.arange(PAGE_SIZE)
    keep = (row < plan.prefill_length % PAGE_SIZE)[None, :, None]
    take = lambda x: jnp.where(keep, jnp.take(x, n_full, axis=0), 0).astype(jnp.bfloat16)
    slot = plan.prefill_slot
    return state.replace(
        k_tail=state.k_tail.at[layer, slot].set(take(kp)),
        v_tail=state.v_tail.at[layer, slot].set(take(vp)),
    )

  def decode_layer(self, state: ServingState, layer: int, plan: Plan, q, k, v):
    """Append each active slot's k/v (bfloat16 [S, Hkv, D]) and attend q (bfloat16 [S, Hq, D]).

    Returns:
      (o bfloat16 [S, Hq, D], state); inactive slots attend over no tokens (o = 0).
    """
    state = self.append_layer(state, layer, plan, k, v)
    lengths = jnp.where(plan.active, plan.positions + 1, 0)
    view = self.layer_view(state, layer, lengths, self.next_page_table(state, plan))
    attend = paged_decode_attention if self.attention == "fused" else decompress_then_attend
    kwargs = self.attention_kwargs()
    if plan.work_table is not None:  # the host's plan of the balanced schedule's items
      kwargs["work"] = (plan.work_table, plan.work_first)
    return attend(q, view, impl=self.attention_impl, **kwargs), state

  def append_layer(self, state: ServingState, layer: int, plan: Plan, k, v) -> ServingState:
    """The write half of `decode_layer`: tails, and the pages this completes encoded and placed."""
    cfg = self.cfg
    slots = jnp.arange(cfg.num_slots)
    row = plan.positions % PAGE_SIZE
    write = lambda tail, x: tail.at[slots, :, row].set(
        jnp.where(plan.active[:, None, None], x, tail[slots, :, row]).astype(jnp.bfloat16)
    )
    k_tail, v_tail = write(state.k_tail[layer], k), write(state.v_tail[layer], v)
    completes = plan.active & (row == PAGE_SIZE - 1)
    if plan.completing.shape[0]:  # static: a width-0 step completes no page and encodes nothing
      # The plan's completing slots (width M, -1 padded), not all S: encode and placement
      # work follows the pages that complete.
      slot = jnp.clip(plan.completing, 0, cfg.num_slots - 1)
      pages = jnp.stack([k_tail[slot], v_tail[slot]], axis=2)  # [M, Hkv, 2, 16, D]
      page_ids = jnp.where(plan.completing >= 0, plan.new_pages[slot], -1)
      state = self._place(state, layer, plan, pages, page_ids)
    clear = lambda tail: jnp.where(completes[:, None, None, None], jnp.zeros_like(tail), tail)
    return state.replace(
        k_tail=state.k_tail.at[layer].set(clear(k_tail)), v_tail=state.v_tail.at[layer].set(clear(v_tail))
    )

  def end_step(self, state: ServingState, plan: Plan) -> ServingState:
    """Commit the step's page table and lengths (after all layers)."""
    if plan.kind == "prefill":
      slot = plan.prefill_slot
      lengths = state.lengths.at[slot].set(plan.prefill_length)
    else:
      lengths = jnp.where(plan.active, plan.positions + 1, 0)
    return state.replace(page_table=self.next_page_table(state, plan), lengths=lengths)

  # --- views ----------------------------------------------------------------------

  def next_page_table(self, state: ServingState, plan: Plan) -> jax.Array:
    """int32 [S, max_pages]: the page table with this step's completed pages entered."""
    cfg = self.cfg
    if plan.kind == "prefill":
      rows = jnp.full((cfg.max_pages,), plan.prefill_slot)
      cols = jnp.arange(cfg.max_pages)
    else:
      rows = jnp.arange(cfg.num_slots)
      cols = jnp.minimum(plan.positions // PAGE_SIZE, cfg.max_pages - 1)
    rows = jnp.where(plan.new_pages >= 0, rows, cfg.num_slots)
    return state.page_table.at[rows, cols].set(plan.new_pages, mode="drop")

  def layer_view(self, state: ServingState, layer: int, lengths: jax.Array, page_table: jax.Array) -> PagedKVCache:
    """One layer as a `PagedKVCache` (the shared store plus this layer's metadata and tails)."""
    common = dict(lengths=lengths, k_tail=state.k_tail[layer], v_tail=state.v_tail[layer])
    if self.cfg.compressed:
      return PagedKVCache(
          **common, page_table=page_table, arena=state.arena, group_meta=state.group_meta[layer], compressed=True
      )
    slot_table = state.page_slot[layer][jnp.clip(page_table, 0, self.cfg.num_page_ids - 1)]
    return PagedKVCache(**common, page_table=slot_table, k_pages=state.k_pages, v_pages=state.v_pages, compressed=False)

  # --- placement --------------------------------------------------------------------

  def _pack(self, state: ServingState, layer: int, plan: Plan, page_units: jax.Array, completes: jax.Array):
    """int32 [N]: the chunk of each completed page (-1 elsewhere), by `packing.page_bins` on its size.

    Under tensor parallelism every device packs by the largest device's sizes and fill (the
    host replays exactly that), so a page id's chunk is the same on every device.
    """
    cfg = self.cfg
    current = plan.current_chunk[layer]
    current_fill = state.chunk_fill[jnp.clip(current, 0, cfg.num_chunks - 1)]
    if self.reduce_axis is not None:
      both = jax.lax.pmax(jnp.concatenate([page_units, current_fill[None]]), self.reduce_axis)  # one all-reduce
      page_units, current_fill = both[:-1], both[-1]
    room = jnp.where(current >= 0, cfg.chunk_units - current_fill, 0)
    grants = plan.grants[layer]
    bins = packing.page_bins(page_units[None], room[None], cfg.page_units, cfg.chunk_units, grants.shape[0], jnp,
                             all_raw=not cfg.compressed)[0]
    fresh = grants[jnp.clip(bins, 0, grants.shape[0] - 1)]
    return jnp.where(completes, jnp.where(bins < 0, current, fresh), -1)

  def _place(self, state: ServingState, layer: int, plan: Plan, pages: jax.Array, page_ids: jax.Array):
    """Encode `pages` (bfloat16 [N, Hkv, 2, 16, D]) and write those with a page id (int32 [N],
    -1: none) to the store; their units go to `step_units[layer, :N]`."""
    cfg = self.cfg
    n = pages.shape[0]
    C, P = cfg.num_chunks, cfg.num_page_ids
    completes = page_ids >= 0
    if cfg.compressed:
      rows, meta_bytes, exceptions = _encode(pages, self.encoder, cfg.format_version)  # [N, Hkv, 2, nb, 1024], [N, Hkv, 2, 4] x2
      group_units = jnp.sum(B.block_units(meta_bytes), axis=-1)  # [N, Hkv, 2]
    else:
      group_units = jnp.full((n, cfg.num_kv_heads, 2), cfg.page_units // cfg.groups_per_page, jnp.int32)
    page_units = jnp.where(completes, jnp.sum(group_units, axis=(1, 2)), 0)  # [N]
    dest = self._pack(state, layer, plan, page_units, completes)
    fill = state.chunk_fill.at[_valid(plan.grants[layer], C)].set(0, mode="drop")
    before = jnp.cumsum(page_units) - page_units
    safe_dest = _valid(dest, C)
    run_start = jnp.full((C + 1,), jnp.iinfo(jnp.int32).max, jnp.int32).at[safe_dest].min(before)[safe_dest]
    start = jnp.clip(dest, 0) * cfg.chunk_units + fill[jnp.clip(dest, 0, C - 1)] + before - run_start  # [N] units
    fill = fill.at[safe_dest].add(page_units, mode="drop")
    width = cfg.plan_width
    step_units = state.step_units.at[layer].set(jnp.pad(page_units, (0, width - n)))
    state = state.replace(chunk_fill=fill, step_units=step_units)
    safe_ids = _valid(page_ids, P)
    if not cfg.compressed:
      pool = start // cfg.page_units
      k_src, v_src = pages[:, :, 0].transpose(1, 0, 2, 3), pages[:, :, 1].transpose(1, 0, 2, 3)
      slot = jnp.where(completes, pool, cfg.num_chunks * cfg.chunk_pages)
      return state.replace(
          k_pages=state.k_pages.at[:, slot].set(k_src, mode="drop"),
          v_pages=state.v_pages.at[:, slot].set(v_src, mode="drop"),
          page_slot=state.page_slot.at[layer, safe_ids].set(pool, mode="drop"),
      )
    flat_units = group_units.reshape(n, -1)
    group_start = start[:, None] + jnp.cumsum(flat_units, axis=1) - flat_units  # [N, 2 Hkv]
    group_start = group_start.reshape(n, cfg.num_kv_heads, 2)
    flat = lambda x: None if x is None else x.reshape(-1, B.BLOCKS_PER_GROUP)
    meta = codec.make_group_meta(group_start.reshape(-1), flat(meta_bytes), cfg.format_version, flat(exceptions))
    # (layer, :, ids) indexing puts the page axis first: the update is [N, Hkv, 2, words].
    group_meta = state.group_meta.at[layer, :, safe_ids].set(meta.reshape(n, cfg.num_kv_heads, 2, cfg.meta_words),
                                                             mode="drop")
    # Rows as 4 units each; a unit is stored iff it lies inside the block's stored size.
    nb = cfg.blocks_per_page
    block_start = group_start[..., None] + codec.block_offsets_in_group(meta_bytes)[..., :nb]  # [N, Hkv, 2, nb]
    unit = jnp.arange(B.RAW_UNITS)
    stored = (unit < B.block_units(meta_bytes[..., :nb])[..., None]) & completes[:, None, None, None, None]
    target = jnp.where(stored, block_start[..., None] + unit, cfg.store_units)
    arena = state.arena.at[target.reshape(-1)].set(rows.reshape(-1, B.UNIT_BYTES), mode="drop")
    return state.replace(arena=arena, group_meta=group_meta)

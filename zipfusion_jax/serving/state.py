"""Serving state: the geometry (host, static) and the device pytrees (arrays only).

Three layers, as in SGLang / vLLM capacity code:

* request -> page map: `page_table` int32 [S, max_pages] maps a sequence
  slot's logical page to a *page id* (a descriptor, shared by all layers:
  every layer of a sequence has the same number of pages).
* allocator: host-side (`allocator.py`); it hands out page ids and fixed-size
  *chunks* of the store to layers, and mirrors the device bump pointers.
* physical pool: one store shared by all layers, `num_chunks` chunks of
  `chunk_units` 256-byte units. A layer owns whole chunks and bumps a pointer
  (`chunk_fill`) inside them; a chunk returns to the pool when every page in
  it has been freed. Compressed: a page is 2 * Hkv variable-size 4-block
  groups (FORMAT.md §5) located by `group_meta`. Uncompressed: a page is one
  BF16 page slot of `k_pages` / `v_pages` (raw size, `chunk_pages` per chunk),
  located by `page_slot`.

Completed pages live in the store; the last `L % 16` tokens of each sequence
live raw in the layer's tail page (`k_tail` / `v_tail`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec
from zipfusion_jax.format import layout

PAGE_SIZE = layout.PAGE_SIZE
NO_PAGE = -1  # padding in page-id and chunk-id plan fields


@dataclasses.dataclass(frozen=True)
class ServingConfig:
  """Static geometry of one engine (hashable: a jit static argument).

  Attributes:
    num_layers, num_kv_heads, head_dim: the decoder's KV shape (head_dim 64 or 128).
    num_slots: S, sequence slots of the compiled step.
    max_pages: completed pages a sequence may hold (its length is at most
      `max_pages * 16`; that is also the padded prefill length).
    num_chunks: chunks in the shared store.
    chunk_pages: raw pages of one layer per chunk (chunk size = chunk_pages * page_units).
    num_page_ids: page descriptors (<= num_slots * max_pages is always enough).
    compressed: completed pages in the 12-bit format (else BF16).
    format_version: of the compressed pages (docs/FORMAT.md): 1, or 2 (one exception per
      block, 16-byte group records).
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  num_slots: int
  max_pages: int
  num_chunks: int
  chunk_pages: int = 32  # measured: 16 -> 1.250x, 32 -> 1.275x, 64 -> 1.281x tokens at Llama-3.1-8B shapes, 4 GiB (ideal 1.292x)
  num_page_ids: int = 0  # 0: derived (see __post_init__)
  compressed: bool = True
  format_version: int = B.FORMAT_VERSION

  def __post_init__(self):
    layout.check_head_dim(self.head_dim)
    codec.check_version(self.format_version)
    for name in ("num_layers", "num_kv_heads", "num_slots", "max_pages", "num_chunks", "chunk_pages"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.num_chunks < self.num_layers:
      raise ValueError(f"num_chunks={self.num_chunks} < num_layers={self.num_layers}: no page fits in every layer")
    if self.num_page_ids == 0:
      object.__setattr__(self, "num_page_ids", self.max_live_pages)
    if self.num_page_ids < 1:
      raise ValueError(f"num_page_ids={self.num_page_ids} must be >= 1")
    if self.num_chunks * self.chunk_units >= 1 << 30:
      raise ValueError(f"store of {self.num_chunks * self.chunk_units} units exceeds the 30-bit offset field")

  @functools.cached_property
  def blocks_per_page(self) -> int:
    return layout.blocks_per_page(self.head_dim)

  @functools.cached_property
  def groups_per_page(self) -> int:
    """Groups of one page id in one layer: K and V of every KV head."""
    return 2 * self.num_kv_heads

  @functools.cached_property
  def page_units(self) -> int:
    """Raw (worst-case) units of one page in one layer."""
    return self.groups_per_page * self.blocks_per_page * B.RAW_UNITS

  @functools.cached_property
  def min_page_units(self) -> int:
    """Units of one page in one layer when every block is compressed."""
    return self.groups_per_page * self.blocks_per_page * (B.COMPRESSED_UNITS if self.compressed else B.RAW_UNITS)

  @functools.cached_property
  def chunk_units(self) -> int:
    return self.chunk_pages * self.page_units

  @functools.cached_property
  def chunk_bytes(self) -> int:
    return self.chunk_units * B.UNIT_BYTES

  @functools.cached_property
  def store_units(self) -> int:
    return self.num_chunks * self.chunk_units

  @functools.cached_property
  def max_length(self) -> int:
    """Longest sequence (tokens with KV) a slot holds; also the padded prefill length."""
    return self.max_pages * PAGE_SIZE

  @property
  def max_live_pages(self) -> int:
    """Most page ids that can be live at once (slots' page tables, and the store at best ratio)."""
    by_store = self.store_units // (self.num_layers * self.min_page_units)
    return max(1, min(self.num_slots * self.max_pages, by_store))

  @functools.cached_property
  def plan_width(self) -> int:
    """N of the per-page plan fields and of the readback: max(S, max_pages)."""
    return max(self.num_slots, self.max_pages)

  @functools.cached_property
  def completion_widths(self) -> tuple[int, ...]:
    """The static page counts a decode step can encode and place: 0 (no page completes: the
    step skips the encoder), a small width (twice the mean when the slots' pages complete on
    spread-out steps, S / 16, rounded up to a power of two) and S (every slot at once). Each
    width is its own compiled decode step; a step is planned at the smallest that holds its
    completing pages, so encode and placement work follows the pages that complete, not S."""
    S = self.num_slots
    small = 1 << max(0, (2 * -(-S // PAGE_SIZE) - 1).bit_length())
    return tuple(sorted({0, min(small, S), S}))

  def completion_width(self, pages: int) -> int:
    """The smallest of `completion_widths` that holds `pages` completing pages."""
    if not 0 <= pages <= self.num_slots:
      raise ValueError(f"{pages} completing pages for {self.num_slots} slots")
    return next(w for w in self.completion_widths if w >= pages)

  def max_grants(self, pages: int) -> int:
    """Chunks one layer may take in a step that completes `pages` pages."""
    return -(-pages // self.chunk_pages) + 1

  @property
  def metadata_bytes(self) -> int:
    """Device bytes locating pages (group_meta, or page_slot)."""
    per = self.num_kv_heads * 2 * B.GROUP_RECORD_BYTES[self.format_version] if self.compressed else 4
    return self.num_layers * self.num_page_ids * per

  @property
  def meta_words(self) -> int:
    """uint32 words of one group record: 2 (version 1) or 4 (version 2)."""
    return B.GROUP_RECORD_BYTES[self.format_version] // 4

  @property
  def store_bytes(self) -> int:
    return self.num_chunks * self.chunk_bytes

  @property
  def tail_bytes(self) -> int:
    return 2 * self.num_layers * self.num_slots * self.num_kv_heads * PAGE_SIZE * self.head_dim * 2

  @classmethod
  def from_budget(cls, budget_bytes: int, **kwargs) -> "ServingConfig":
    """The largest store whose chunks plus page metadata fit in `budget_bytes` (tails are extra).

    Page metadata depends on the page-id count, which depends on the store, so
    this iterates down from the metadata-free chunk count.
    """
    probe = cls(num_chunks=kwargs["num_layers"], **kwargs)
    chunks = budget_bytes // probe.chunk_bytes
    while chunks >= probe.num_layers:
      cfg = cls(num_chunks=chunks, **kwargs)
      if cfg.store_bytes + cfg.metadata_bytes <= budget_bytes:
        return cfg
      over = cfg.store_bytes + cfg.metadata_bytes - budget_bytes
      chunks -= max(1, math.ceil(over / cfg.chunk_bytes))
    raise ValueError(f"{budget_bytes=} holds fewer chunks of {probe.chunk_bytes} bytes than the {probe.num_layers} layers")


@flax.struct.dataclass
class ServingState:
  """Device KV state of all layers and slots (a pytree of arrays; donated to each step).

  Attributes:
    page_table: int32 [S, max_pages]; entry i < lengths // 16 is the page id
      of logical page i (the same id in every layer); the rest are stale.
    lengths: int32 [S] tokens with KV per running slot; a slot the host frees
      keeps its last length until the next decode step zeroes inactive slots.
    k_tail, v_tail: bfloat16 [L, S, Hkv, 16, D]; tokens [16 * (n // 16), n)
      of each slot in rows 0 .. n % 16 - 1, zeros past them.
    chunk_fill: int32 [C] bump pointer (units used) of each chunk; only
      meaningful for chunks a layer owns (a grant resets it to 0).
    step_units: int32 [L, N] units each page written in the last step took
      (N = max(S, max_pages); 0 where no page completed): the readback.
    arena: uint8 [C * chunk_units, 256] (compressed) or None.
    group_meta: uint32 [L, Hkv, P, 2, 2] (compressed: [layer, head, page id,
      K/V, word], FORMAT.md §5 with offsets into `arena`) or None.
    k_pages, v_pages: bfloat16 [Hkv, C * chunk_pages, 16, D] (uncompressed)
      or None; pool slot j lies in chunk j // chunk_pages.
    page_slot: int32 [L, P] (uncompressed) pool slot of each page id, or None.
  """

  page_table: jax.Array
  lengths: jax.Array
  k_tail: jax.Array
  v_tail: jax.Array
  chunk_fill: jax.Array
  step_units: jax.Array
  arena: jax.Array | None = None
  group_meta: jax.Array | None = None
  k_pages: jax.Array | None = None
  v_pages: jax.Array | None = None
  page_slot: jax.Array | None = None


def init_state(cfg: ServingConfig) -> ServingState:
  """An empty state: every slot free, every chunk unowned (the host allocator agrees)."""
  L, S, H, D, P = cfg.num_layers, cfg.num_slots, cfg.num_kv_heads, cfg.head_dim, cfg.num_page_ids
  tail = lambda: jnp.zeros((L, S, H, PAGE_SIZE, D), jnp.bfloat16)  # distinct buffers: the state is donated
  common = dict(
      page_table=jnp.zeros((S, cfg.max_pages), jnp.int32),
      lengths=jnp.zeros((S,), jnp.int32),
      k_tail=tail(),
      v_tail=tail(),
      chunk_fill=jnp.zeros((cfg.num_chunks,), jnp.int32),
      step_units=jnp.zeros((L, cfg.plan_width), jnp.int32),
  )
  if cfg.compressed:
    return ServingState(
        **common,
        arena=jnp.zeros((cfg.store_units, B.UNIT_BYTES), jnp.uint8),
        group_meta=jnp.zeros((L, H, P, 2, cfg.meta_words), jnp.uint32),
    )
  pool = lambda: jnp.zeros((H, cfg.num_chunks * cfg.chunk_pages, PAGE_SIZE, D), jnp.bfloat16)
  return ServingState(**common, k_pages=pool(), v_pages=pool(), page_slot=jnp.zeros((L, P), jnp.int32))


@flax.struct.dataclass
class Plan:
  """What the host scheduler hands one jitted step (a pytree of small arrays).

  Attributes:
    positions: int32 [S] position of each slot's new token (= tokens cached).
    active: bool [S] slots that decode this step.
    prefill_slot: int32 [] slot a prefill writes (-1 in decode plans).
    prefill_length: int32 [] prompt tokens of the prefill (0 in decode plans).
    new_pages: int32 [N] page id of each page this step completes, -1 where
      none: decode N = S (indexed by slot), prefill N = max_pages (by logical page).
    completing: int32 [M] (decode) the slots whose page completes, in slot order, -1
      padding; M = `cfg.completion_width(count)` is static, the width the step encodes
      and places (and of `grants` and the step's page columns of `step_units`). Prefill: [0].
    current_chunk: int32 [L] chunk each layer fills first (-1: none); the
      step packs its completed pages into it, then into `grants` in order, by
      their encoded sizes (`packing.page_bins`).
    grants: int32 [L, G] fresh chunks each layer may take this step (their
      bump pointer starts at 0; the worst case, unused ones go back), -1 padding.
    work_table, work_first: (decode, when the fused kernel runs its balanced schedule) the
      kernel's work items for this step's lengths, planned on the host
      (`PagedBackend.host_work`): int32 [W, 3] and int32 [S + 1]; None otherwise (the kernel
      derives its items from the lengths).
    kind: static, "decode" or "prefill".
  """

  positions: jax.Array
  active: jax.Array
  prefill_slot: jax.Array
  prefill_length: jax.Array
  new_pages: jax.Array
  current_chunk: jax.Array
  grants: jax.Array
  completing: jax.Array
  work_table: jax.Array | None = None
  work_first: jax.Array | None = None
  kind: str = flax.struct.field(pytree_node=False, default="decode")


class PlanError(ValueError):
  """A plan the device step must not run (out-of-range or inconsistent ids)."""


def check_plan(cfg: ServingConfig, plan: Plan) -> None:
  """Validate a host-built plan (numpy leaves) before it reaches the device.

  Raises:
    PlanError: wrong shapes; a page id outside [0, num_page_ids) or repeated;
      a chunk id outside [0, num_chunks); a completed page without a page id
      or destination (or one where no page completes); `completing` not the completing
      slots in order at a planned width; a bad prefill slot or length.
  """
  import numpy as np

  S, L = cfg.num_slots, cfg.num_layers
  if plan.kind not in ("decode", "prefill"):
    raise PlanError(f"plan.kind={plan.kind!r} must be 'decode' or 'prefill'")
  n = S if plan.kind == "decode" else cfg.max_pages
  completing = np.asarray(plan.completing)
  widths = cfg.completion_widths if plan.kind == "decode" else (0,)
  if completing.ndim != 1 or completing.shape[0] not in widths:
    raise PlanError(f"plan.completing has shape {completing.shape}, expected one of {[(w,) for w in widths]}")
  g = cfg.max_grants(completing.shape[0] if plan.kind == "decode" else n)
  positions, active = np.asarray(plan.positions), np.asarray(plan.active)
  new_pages, current, grants = np.asarray(plan.new_pages), np.asarray(plan.current_chunk), np.asarray(plan.grants)
  for name, x, shape in (
      ("positions", positions, (S,)), ("active", active, (S,)), ("new_pages", new_pages, (n,)),
      ("current_chunk", current, (L,)), ("grants", grants, (L, g)),
  ):
    if x.shape != shape:
      raise PlanError(f"plan.{name} has shape {x.shape}, expected {shape} for a {plan.kind} plan")
  ids = new_pages[new_pages != NO_PAGE]
  if np.any((ids < 0) | (ids >= cfg.num_page_ids)):
    raise PlanError(f"plan.new_pages holds page ids {sorted(set(ids.tolist()))} outside [0, {cfg.num_page_ids})")
  if len(set(ids.tolist())) != ids.size:
    raise PlanError("plan.new_pages repeats a page id")
  for name, x in (("current_chunk", current), ("grants", grants)):
    bad = x[(x != NO_PAGE) & ((x < 0) | (x >= cfg.num_chunks))]
    if bad.size:
      raise PlanError(f"plan.{name} holds chunk ids {sorted(set(bad.tolist()))} outside [0, {cfg.num_chunks})")
  if plan.kind == "decode":
    if np.any(active & ((positions < 0) | (positions >= cfg.max_length))):
      raise PlanError(f"plan.positions of active slots must lie in [0, {cfg.max_length})")
    completes = active & (positions % PAGE_SIZE == PAGE_SIZE - 1)
  else:
    slot, length = int(plan.prefill_slot), int(plan.prefill_length)
    if not 0 <= slot < S:
      raise PlanError(f"plan.prefill_slot={slot} outside [0, {S})")
    if not 0 < length <= cfg.max_length:
      raise PlanError(f"plan.prefill_length={length} outside [1, {cfg.max_length}]")
    completes = np.arange(n) < length // PAGE_SIZE
  if np.any(completes != (new_pages != NO_PAGE)):
    raise PlanError("plan.new_pages must name a page id exactly where a page completes")
  if plan.kind == "decode":
    slots = np.flatnonzero(completes)
    if slots.size > completing.size or np.any(completing != np.pad(slots, (0, completing.size - slots.size), constant_values=NO_PAGE)):
      raise PlanError(f"plan.completing={completing.tolist()} must list the completing slots {slots.tolist()} in order, "
                      "then -1")
  fresh = grants[grants != NO_PAGE]
  if len(set(fresh.tolist())) != fresh.size or np.any(np.isin(current[current != NO_PAGE], fresh)):
    raise PlanError("plan.grants repeats a chunk or names a current chunk")
  _check_work(plan, np.where(active, positions + 1, 0) if plan.kind == "decode" else None)


def _check_work(plan: Plan, lengths) -> None:
  """The work items (if any) cover each slot's pages, `lengths` int [S] (the step's attended
  tokens), exactly once, as consecutive items of that slot: a wrong table would attend over the
  wrong pages."""
  import numpy as np

  if plan.work_table is None and plan.work_first is None:
    return
  if lengths is None or plan.work_table is None or plan.work_first is None:
    raise PlanError("plan.work_table and plan.work_first come together, in decode plans only")
  from pallas_kernels.decode_attention import check_work_items  # kernels sit above the serving state

  table, first = np.asarray(plan.work_table), np.asarray(plan.work_first)
  try:  # shapes, integer arrays, `work_first` rising from 0, and each slot's pages covered once
    check_work_items((table, first), lengths.shape[0], lengths)
  except ValueError as e:
    raise PlanError(f"plan.work_table / work_first: {e}") from e

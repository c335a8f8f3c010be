"""Host-side capacity: page ids and chunks of the shared store, in Python ints and numpy.

The store is `num_chunks` fixed-size chunks shared by all layers. A layer
writes its completed pages at the bump pointer of its *current* chunk, and
opens a fresh chunk when a raw page would no longer fit (next-fit,
`packing.page_bins`). A chunk goes back to the pool when every page in it
has been freed, whatever layer owned it.

The host learns a compressed page's size only from the step's readback, so
`reserve(n)` is all-or-nothing at the worst case: it takes the page ids and
the fresh chunks that n raw pages would need in every layer, or raises
`AllocationRefused` (with the reason) before changing anything. The device
packs the pages by their real sizes; `commit(placement, step_units)` replays
that packing on the readback, advances the bump pointers exactly as the
device did, and returns the fresh chunks nothing went to.

Tensor parallelism (`devices` > 1): every device holds its own shard of each
page (its KV heads) in the chunk of the same id, so ownership, page ids and
free lists are shared, but each device's bump pointer advances by its own
shard's size. Every device packs by the largest device's page sizes and
fill, so a page lands in the same chunk everywhere, and capacity is that of
the fullest device: the store admits only what fits everywhere.

Byte accounting, per chunk owned by a layer (per device):
  live (pages in use) + dead (freed pages, held until the chunk frees)
  + room (chunk_units - fill). Room of a layer's current chunk is *free*;
  room of an older chunk is *stranded* (less than a raw page was left).
  total = live + dead + stranded + free, exactly.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.serving.packing import page_bins, worst_case_bins
from zipfusion_jax.serving.state import PAGE_SIZE, ServingConfig


class AllocationRefused(Exception):
  """The store cannot hold what was asked; nothing was changed. `reason` says why."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class Placement:
  """The room `reserve` holds for n new pages (host numpy; the plan's page fields are built from it).

  The device packs the pages by their real sizes (`packing`); `ChunkAllocator.commit` replays
  that and returns where each page went.

  Attributes:
    page_ids: int32 [n] new page ids, in page order.
    current_chunk: int32 [L] each layer's current chunk (-1: none), where its first pages go.
    grants: tuple of L tuples: fresh chunks each layer holds for these pages at worst (raw).
  """

  page_ids: np.ndarray
  current_chunk: np.ndarray
  grants: tuple[tuple[int, ...], ...]

  @property
  def num_pages(self) -> int:
    return int(self.page_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class Capacity:
  """What the store holds and can still take, in bytes and in tokens of completed pages.

  `worst_case_tokens` is exact: `reserve` succeeds for exactly
  `worst_case_tokens // 16` more pages (every block raw). `expected_tokens`
  assumes the measured mean page size (`ratio` = raw / measured).
  Tail pages are per slot and are not part of the store.
  """

  total_bytes: int
  live_bytes: int
  dead_bytes: int
  stranded_bytes: int
  free_bytes: int
  worst_case_tokens: int
  expected_tokens: int
  ratio: float
  free_page_ids: int


class ChunkAllocator:
  """Page ids and chunk accounting of one `ServingConfig` (mirrors the device bump pointers).

  Args:
    cfg: the geometry of one device's store (its KV heads).
    prior_ratio: compression ratio assumed for `expected_tokens` before any page is measured.
    devices: tensor-parallel devices sharing the page ids and chunk ids (module docstring).
  """

  def __init__(self, cfg: ServingConfig, prior_ratio: float = 1.0, devices: int = 1):
    if devices < 1:
      raise ValueError(f"{devices=} must be >= 1")
    if not prior_ratio > 0:
      raise ValueError(f"{prior_ratio=} must be > 0")
    self.cfg = cfg
    self.prior_ratio = float(prior_ratio)
    self.devices = devices
    L, C, P, D = cfg.num_layers, cfg.num_chunks, cfg.num_page_ids, devices
    self.owner = np.full(C, -1, np.int32)  # layer owning each chunk, -1 free
    self.device_fill = np.zeros((D, C), np.int64)  # units bumped, per device
    self.live_pages = np.zeros(C, np.int64)
    self.device_live_units = np.zeros((D, C), np.int64)
    self.current = np.full(L, -1, np.int32)  # each layer's current chunk
    self.free_chunks: collections.deque[int] = collections.deque(range(C))
    self.free_ids: collections.deque[int] = collections.deque(range(P))
    self.page_chunk = np.full((L, P), -1, np.int32)
    self.device_page_size = np.zeros((D, L, P), np.int64)
    self.device_measured_units = np.zeros((D, L), np.int64)  # per layer, all pages ever committed: the ratio
    self.measured_pages = 0
    self._pending: Placement | None = None

  # --- per-device views -------------------------------------------------------------

  @property
  def fill(self) -> np.ndarray:
    """int [C]: units bumped in each chunk on its fullest device (what limits placement)."""
    return self.device_fill.max(axis=0)

  @property
  def live_units(self) -> np.ndarray:
    """int [C]: live units of each chunk on its fullest device (exact with one device)."""
    return self.device_live_units.max(axis=0)

  @property
  def page_size(self) -> np.ndarray:
    """int [L, P]: units of each live page on its largest device shard (exact with one device)."""
    return self.device_page_size.max(axis=0)

  @property
  def measured_units(self) -> np.ndarray:
    """int [L]: units of every page ever committed, summed over devices."""
    return self.device_measured_units.sum(axis=0)

  def live_bytes_all_devices(self) -> int:
    """Bytes of live pages summed over every device's store."""
    return int(self.device_live_units.sum()) * B.UNIT_BYTES

  def shard(self, device: int) -> "ChunkAllocator":
    """A one-device copy holding only `device`'s accounting (for per-shard invariant checks)."""
    if not 0 <= device < self.devices:
      raise ValueError(f"{device=} outside [0, {self.devices})")
    view = copy.copy(self)
    view.devices = 1
    for name in ("device_fill", "device_live_units", "device_page_size", "device_measured_units"):
      setattr(view, name, getattr(self, name)[device : device + 1].copy())
    return view

  # --- reserve / commit / release -------------------------------------------------

  def _rooms(self, current: np.ndarray | None = None) -> np.ndarray:
    """int [L]: units left in each layer's current chunk (`current`, default `self.current`; 0 without one)."""
    current = self.current if current is None else current
    return np.where(current >= 0, self.cfg.chunk_units - self.fill[np.maximum(current, 0)], 0)

  def _new_chunks(self, n: int) -> np.ndarray:
    """int [L]: fresh chunks each layer needs for n more raw pages."""
    here = np.minimum(n, self._rooms() // self.cfg.page_units)
    return worst_case_bins(n - here, self.cfg.chunk_pages)

  def check_reserve(self, n: int) -> str | None:
    """Why `reserve(n)` would be refused, or None when it would succeed (changes nothing)."""
    if self._pending is not None:
      return "a placement is reserved but not committed"
    if n > len(self.free_ids):
      return f"{n} pages need {n} page ids, {len(self.free_ids)} free"
    need = int(self._new_chunks(n).sum())
    if need > len(self.free_chunks):
      return f"{n} pages need {need} new chunks of {self.cfg.chunk_bytes} bytes over all layers, {len(self.free_chunks)} free"
    return None

  def reserve(self, n: int) -> Placement:
    """Page ids and fresh chunks for n new pages in every layer at raw size (the worst case); all or nothing.

    Raises:
      AllocationRefused: not enough page ids or chunks (nothing changed).
    """
    reason = self.check_reserve(n)
    if reason is not None:
      raise AllocationRefused(reason)
    ids = np.array([self.free_ids.popleft() for _ in range(n)], np.int32)
    new = self._new_chunks(n)
    fresh = [self.free_chunks.popleft() for _ in range(int(new.sum()))]
    first = np.cumsum(new) - new
    grants = tuple(tuple(fresh[first[l] : first[l] + new[l]]) for l in range(self.cfg.num_layers))
    for g in grants:
      for c in g:
        self.device_fill[:, c] = 0
    self._pending = Placement(ids, self.current.copy(), grants)
    return self._pending

  def commit(self, placement: Placement, step_units: np.ndarray) -> np.ndarray:
    """Record the units each reserved page took: int [L, n] (one device) or [devices, L, n], the step's readback.

    Replays the device's packing (`packing.page_bins` on the largest device's sizes), returns the
    fresh chunks no page went to, and returns int32 [L, n]: the chunk of each page in each layer.
    """
    if placement is not self._pending:
      raise ValueError("commit() takes the placement of the last reserve()")
    cfg = self.cfg
    units = np.asarray(step_units)
    units = units[None] if units.ndim == 2 else units
    if units.ndim != 3 or units.shape[:2] != (self.devices, cfg.num_layers):
      raise ValueError(f"step_units of shape {np.shape(step_units)} for {self.devices} device(s) and {cfg.num_layers} layers")
    self._pending = None
    units = units[:, :, : placement.num_pages].astype(np.int64)  # [D, L, n]
    lo, hi = cfg.min_page_units, cfg.page_units
    if placement.num_pages and (units.min() < lo or units.max() > hi):
      raise ValueError(f"page sizes {units.min()}..{units.max()} units lie outside [{lo}, {hi}]: device and host disagree")
    dest = self._replay(placement, units.max(axis=0))
    ids = placement.page_ids
    np.add.at(self.live_pages, dest.ravel(), 1)
    for d in range(self.devices):
      np.add.at(self.device_fill[d], dest.ravel(), units[d].ravel())
      np.add.at(self.device_live_units[d], dest.ravel(), units[d].ravel())
    self.page_chunk[:, ids], self.device_page_size[:, :, ids] = dest, units
    if np.any(self.device_fill > cfg.chunk_units):
      raise ValueError("a chunk overflowed: device and host disagree")
    self.device_measured_units += units.sum(axis=2)
    self.measured_pages += placement.num_pages
    return dest.astype(np.int32)

  def _replay(self, placement: Placement, units: np.ndarray) -> np.ndarray:
    """int64 [L, n] chunk of each page (as the device packed them); frees unused grants, moves `current`."""
    cfg = self.cfg
    bins = page_bins(units, self._rooms(placement.current_chunk), cfg.page_units, cfg.chunk_units,
                     max(map(len, placement.grants), default=0), all_raw=not cfg.compressed)  # [L, n]
    dest = np.full(units.shape, -1, np.int64)
    unused = []
    for l, g in enumerate(placement.grants):
      used = int(bins[l].max(initial=-1)) + 1
      if used > len(g):
        raise ValueError(f"layer {l} packed into {used} fresh chunks, {len(g)} reserved: device and host disagree")
      dest[l] = np.where(bins[l] < 0, placement.current_chunk[l], np.asarray(g + (-1,), np.int64)[np.maximum(bins[l], 0)])
      for c in g[:used]:
        self.owner[c] = l
      if used:
        self.current[l] = g[used - 1]
      unused += g[used:]
    for c in reversed(unused):
      self.device_fill[:, c] = 0
      self.free_chunks.appendleft(c)
    return dest

  def cancel(self, placement: Placement) -> None:
    """Undo a reserve whose step did not run (returns its ids and fresh chunks)."""
    if placement is not self._pending:
      raise ValueError("cancel() takes the placement of the last reserve()")
    self._pending = None
    taken = [c for fresh in placement.grants for c in fresh]  # in the order reserve() took them
    for c in reversed(taken):
      self.owner[c], self.device_fill[:, c] = -1, 0
      self.free_chunks.appendleft(c)
    for pid in reversed(placement.page_ids.tolist()):
      self.free_ids.appendleft(pid)

  def release(self, page_ids) -> None:
    """Free pages (a finished or preempted sequence's); chunks left with no live page return to the pool."""
    ids = np.asarray(list(page_ids), np.int64)
    if not ids.size:
      return
    if np.any(self.page_chunk[0, ids] < 0) or len(set(ids.tolist())) != ids.size:
      raise ValueError(f"page ids {ids.tolist()} are not all live (or repeat)")
    chunks = self.page_chunk[:, ids].astype(np.int64)  # [L, m]
    np.subtract.at(self.live_pages, chunks.ravel(), 1)
    for d in range(self.devices):
      np.subtract.at(self.device_live_units[d], chunks.ravel(), self.device_page_size[d][:, ids].ravel())
    self.page_chunk[:, ids], self.device_page_size[:, :, ids] = -1, 0
    for c in np.unique(chunks).tolist():
      if self.live_pages[c] == 0:
        self._free_chunk(c)
    self.free_ids.extend(ids.tolist())

  def _free_chunk(self, c: int) -> None:
    l = int(self.owner[c])
    if self.current[l] == c:
      self.current[l] = -1
    self.owner[c], self.device_fill[:, c] = -1, 0
    self.free_chunks.append(c)

  # --- capacity ---------------------------------------------------------------------

  @property
  def ratio(self) -> float:
    """Raw page size over the measured mean page size, all layers (prior until something is measured)."""
    if self.measured_pages == 0:
      return self.prior_ratio
    raw = self.cfg.page_units * self.measured_pages * self.cfg.num_layers * self.devices
    return raw / int(self.measured_units.sum())

  def _mean_page_units(self) -> np.ndarray:
    """float [L]: measured mean units of a page in each layer on its largest device (raw / prior before any)."""
    if self.measured_pages == 0:
      return np.full(self.cfg.num_layers, self.cfg.page_units / self.prior_ratio)
    return self.device_measured_units.max(axis=0) / self.measured_pages

  def _max_pages(self, fits, per_chunk) -> int:
    """Largest n with sum_l ceil((n - fits[l]) / per_chunk[l]) <= free chunks (and free page ids)."""
    free = len(self.free_chunks)

    def need(n):
      return sum(-(-max(0, n - f) // p) for f, p in zip(fits, per_chunk))

    lo, hi = 0, min(len(self.free_ids), min(fits) + free * max(per_chunk))
    while lo < hi:
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if need(mid) <= free else (lo, mid - 1)
    return lo

  def worst_case_pages(self) -> int:
    """Exactly how many more pages `reserve` accepts (every block raw)."""
    cfg = self.cfg
    fits = (self._rooms() // cfg.page_units).tolist()
    return self._max_pages(fits, [cfg.chunk_pages] * cfg.num_layers)

  def expected_pages(self) -> int:
    """More pages the store should take at each layer's measured mean page size.

    A page is placed while a raw page still fits, so a fresh chunk takes
    about floor((chunk - raw) / mean) + 1 pages and a current chunk with room
    r >= raw about floor((r - raw) / mean) + 1.
    """
    cfg = self.cfg
    mean = self._mean_page_units()
    per_chunk = [int((cfg.chunk_units - cfg.page_units) // m) + 1 for m in mean]
    rooms = self._rooms().tolist()
    fits = [int((r - cfg.page_units) // m) + 1 if r >= cfg.page_units else 0 for r, m in zip(rooms, mean)]
    return max(self.worst_case_pages(), self._max_pages(fits, per_chunk))

  def empty_worst_case_pages(self) -> int:
    """Pages an empty store accepts at raw size: the most one sequence can ever be given."""
    per_layer = self.cfg.num_chunks // self.cfg.num_layers * self.cfg.chunk_pages
    return min(self.cfg.num_page_ids, per_layer)

  def capacity(self) -> Capacity:
    """The store's bytes on its fullest device (least free, then most bumped); tokens count what fits on every device."""
    cfg = self.cfg
    owned = self.owner >= 0
    current = set(int(c) for c in self.current if c >= 0)
    is_cur = np.zeros(cfg.num_chunks, bool)
    is_cur[list(current)] = True
    u = B.UNIT_BYTES
    free = [(len(self.free_chunks) * cfg.chunk_units + int(np.where(is_cur, cfg.chunk_units - f, 0).sum())) for f in self.device_fill]
    d = min(range(self.devices), key=lambda i: (free[i], -int(self.device_fill[i].sum())))  # ties: most bumped
    fill, live = self.device_fill[d], self.device_live_units[d]
    room = np.where(owned, cfg.chunk_units - fill, 0)
    return Capacity(
        total_bytes=cfg.store_bytes,
        live_bytes=int(live.sum()) * u,
        dead_bytes=int((fill - live)[owned].sum()) * u,
        stranded_bytes=int(room[owned & ~is_cur].sum()) * u,
        free_bytes=free[d] * u,
        worst_case_tokens=self.worst_case_pages() * PAGE_SIZE,
        expected_tokens=self.expected_pages() * PAGE_SIZE,
        ratio=self.ratio,
        free_page_ids=len(self.free_ids),
    )

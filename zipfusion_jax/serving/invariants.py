"""Invariant checker: the list of violations of one engine's host and device state (empty = healthy).

Checked:
* chunks: every chunk is free exactly once (in the pool) or owned by one
  layer; an owned chunk holds a live page (no leaks); fill and live units
  per chunk agree with the pages recorded in it;
* page ids: free or live, never both; the live ones are exactly the running
  requests' pages, each owned once, in the chunk of its layer;
* capacity: live + dead + stranded + free bytes = total, exactly;
* device mirror: bump pointers, lengths and page tables equal the host's; every
  live group's metadata is version 1 and its units lie inside its chunk's
  filled prefix without overlapping another group;
* data (with `shadow`): every running sequence's pages and tail decode bit
  for bit to the shadow dense copy, and tail rows past the length are zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec
from zipfusion_jax.paged import reference
from zipfusion_jax.paged.cache import restore_pages
from zipfusion_jax.serving.allocator import ChunkAllocator
from zipfusion_jax.serving.backend import PagedBackend
from zipfusion_jax.serving.scheduler import Request
from zipfusion_jax.serving.state import PAGE_SIZE, ServingState

# shadow(request) -> (k, v) uint16 [L, length, Hkv, D]: the KV bits the request should have cached.
Shadow = Callable[[Request], tuple[np.ndarray, np.ndarray]]


@functools.partial(jax.jit, static_argnums=0)
def _dense_kv(backend: PagedBackend, state: ServingState):
  """uint16 [L, S, Hkv, max_pages * 16 + 16, D] (k, v): pages through the page table, then the tail."""
  ks, vs = [], []
  for layer in range(backend.cfg.num_layers):
    view = backend.layer_view(state, layer, state.lengths, state.page_table)
    k, v, _ = reference.gather_sequences(view, *restore_pages(view, impl="reference"))
    ks.append(k), vs.append(v)
  bits = lambda x: jax.lax.bitcast_convert_type(jnp.stack(x), jnp.uint16)
  return bits(ks), bits(vs)


def _chunk_violations(alloc: ChunkAllocator) -> list[str]:
  cfg, out = alloc.cfg, []
  free = list(alloc.free_chunks)
  if len(free) != len(set(free)):
    out.append("a chunk is in the free pool twice")
  free_set = set(free)
  for c in range(cfg.num_chunks):
    owned = alloc.owner[c] >= 0
    if owned == (c in free_set):
      out.append(f"chunk {c} is {'owned and free' if owned else 'neither owned nor free'}")
    if owned and alloc.live_pages[c] == 0:
      out.append(f"chunk {c} (layer {alloc.owner[c]}) holds no live page: leaked")
    if not owned and (alloc.fill[c] or alloc.live_pages[c] or alloc.live_units[c]):
      out.append(f"free chunk {c} still has fill/live pages")
    if not 0 <= alloc.live_units[c] <= alloc.fill[c] <= cfg.chunk_units:
      out.append(f"chunk {c}: live {alloc.live_units[c]} / fill {alloc.fill[c]} / size {cfg.chunk_units} units")
  for l, c in enumerate(alloc.current):
    if c >= 0 and alloc.owner[c] != l:
      out.append(f"layer {l}'s current chunk {c} is owned by {alloc.owner[c]}")
  live = alloc.page_chunk >= 0
  pages = np.zeros(cfg.num_chunks, np.int64)
  units = np.zeros(cfg.num_chunks, np.int64)
  np.add.at(pages, alloc.page_chunk[live], 1)
  np.add.at(units, alloc.page_chunk[live], alloc.page_size[live])
  if not np.array_equal(pages, alloc.live_pages) or not np.array_equal(units, alloc.live_units):
    out.append("per-chunk live pages/units differ from the pages recorded in them")
  layer_of = np.broadcast_to(np.arange(cfg.num_layers)[:, None], live.shape)
  if np.any(alloc.owner[alloc.page_chunk[live]] != layer_of[live]):
    out.append("a page lies in a chunk its layer does not own")
  return out


def _page_violations(alloc: ChunkAllocator, running: list[Request]) -> list[str]:
  cfg, out = alloc.cfg, []
  live = alloc.page_chunk >= 0
  if np.any(live.any(axis=0) != live.all(axis=0)):
    out.append("a page id is live in some layers only")
  live_ids = set(np.flatnonzero(live[0]).tolist())
  free = list(alloc.free_ids)
  if len(free) != len(set(free)) or live_ids & set(free) or len(live_ids) + len(free) != cfg.num_page_ids:
    out.append(f"page ids: {len(live_ids)} live + {len(free)} free do not partition {cfg.num_page_ids}")
  held = [p for r in running for p in r.pages]
  if len(held) != len(set(held)):
    out.append("a page id is held by two sequences (or twice)")
  if set(held) != live_ids:
    out.append(f"live page ids {sorted(live_ids ^ set(held))} are not exactly the running sequences' pages")
  cap = alloc.capacity()
  if cap.live_bytes + cap.dead_bytes + cap.stranded_bytes + cap.free_bytes != cap.total_bytes:
    out.append(f"bytes: live + dead + stranded + free != total ({cap})")
  return out


def _device_violations(backend: PagedBackend, host: dict, alloc: ChunkAllocator, running: list[Request]) -> list[str]:
  cfg, out = backend.cfg, []
  owned = alloc.owner >= 0
  if not np.array_equal(host["chunk_fill"][owned], alloc.fill[owned]):
    out.append("device bump pointers differ from the host allocator's")
  lengths = np.zeros(cfg.num_slots, np.int64)
  for r in running:
    lengths[r.slot] = r.length
    if not np.array_equal(host["page_table"][r.slot, : len(r.pages)], r.pages):
      out.append(f"slot {r.slot}: device page table differs from request {r.rid}'s pages")
    if len(r.pages) != r.length // PAGE_SIZE:
      out.append(f"request {r.rid}: {len(r.pages)} pages for {r.length} tokens")
  slots = [r.slot for r in running]  # a freed slot's length is stale until the next decode step zeroes it
  if not np.array_equal(host["lengths"][slots], lengths[slots]):
    out.append(f"device lengths {host['lengths'].tolist()} != host {lengths.tolist()} in running slots {slots}")
  ids = np.flatnonzero(alloc.page_chunk[0] >= 0)
  if not ids.size:
    return out
  chunk = alloc.page_chunk[:, ids]  # [L, n]
  if not cfg.compressed:
    if np.any(host["page_slot"][:, ids] // cfg.chunk_pages != chunk):
      out.append("a page's pool slot lies outside its chunk")
    return out
  meta = host["group_meta"][:, :, ids]  # [L, Hkv, n, 2, 2 or 4]
  if np.any(meta[..., 0] >> B.VERSION_SHIFT != cfg.format_version):
    out.append(f"a live group's metadata is not version {cfg.format_version}")
  start = (meta[..., 0] & B.OFFSET_MASK).astype(np.int64)
  size = np.asarray(B.block_units(codec.unpack_meta_bytes(jnp.asarray(meta[..., 1])))).sum(-1)
  if not np.array_equal(size.sum(axis=(1, 3)), alloc.page_size[:, ids]):
    out.append("live groups' sizes differ from the page sizes the host recorded")
  c = np.broadcast_to(chunk[:, None, :, None], start.shape)
  lo = c * cfg.chunk_units
  if np.any(start < lo) or np.any(start + size > lo + alloc.fill[c]):
    out.append("a live group lies outside its chunk's filled prefix")
  order = np.argsort(start.reshape(-1), kind="stable")
  s, e = start.reshape(-1)[order], (start + size).reshape(-1)[order]
  if np.any(s[1:] < e[:-1]):
    out.append("two live groups overlap in the arena")
  return out


def _data_violations(backend: PagedBackend, state: ServingState, running: list[Request], shadow: Shadow) -> list[str]:
  cfg, out = backend.cfg, []
  k, v = jax.device_get(_dense_kv(backend, state))  # [L, S, Hkv, T, D]
  tail0 = cfg.max_pages * PAGE_SIZE
  for r in running:
    want_k, want_v = shadow(r)
    full, rest = r.length // PAGE_SIZE * PAGE_SIZE, r.length % PAGE_SIZE
    for name, got, want in (("K", k, want_k), ("V", v, want_v)):
      g = got[:, r.slot].transpose(0, 2, 1, 3)  # [L, T, Hkv, D]
      seq = np.concatenate([g[:, :full], g[:, tail0 : tail0 + rest]], axis=1)
      if seq.shape != want.shape or not np.array_equal(seq, want):
        bad = np.argwhere(seq != want)[:1].tolist() if seq.shape == want.shape else seq.shape
        out.append(f"request {r.rid} (slot {r.slot}, {r.length} tokens): {name} differs from its shadow at {bad}")
      if np.any(g[:, tail0 + rest :]):
        out.append(f"request {r.rid}: {name} tail rows past the length are not zero")
  return out


def check_invariants(
    backend: PagedBackend,
    state: ServingState,
    allocator: ChunkAllocator,
    running: Iterable[Request],
    shadow: Shadow | None = None,
    tp=None,
) -> list[str]:
  """Every violated invariant as a sentence; [] when healthy.

  Args:
    backend, state: the device side (read back whole: this is a test and debug tool).
    allocator: the host accounting.
    running: the running requests (slot, length and pages set).
    shadow: the KV each request should hold, over all KV heads (None: skip the data check).
    tp: the `TensorParallel` of a sharded engine (`backend` is then its one-device backend,
      `engine.backend`): every device's shard is checked on its own, violations prefixed "device d:".
  """
  running = list(running)
  if tp is not None:
    heads, out = backend.cfg.num_kv_heads, []
    for d in range(tp.size):
      local = tp.device_shard(state, d, backend.cfg.compressed)
      sliced = None if shadow is None else (lambda r, d=d: tuple(x[:, :, d * heads : (d + 1) * heads] for x in shadow(r)))
      out += [f"device {d}: {v}" for v in check_invariants(backend, local, allocator.shard(d), running, sliced)]
    return out
  names = ["page_table", "lengths", "chunk_fill"] + (["group_meta"] if backend.cfg.compressed else ["page_slot"])
  host = {n: np.asarray(x) for n, x in zip(names, jax.device_get([getattr(state, n) for n in names]))}
  out = _chunk_violations(allocator) + _page_violations(allocator, running)
  out += _device_violations(backend, host, allocator, running)
  if shadow is not None:
    out += _data_violations(backend, state, running, shadow)
  return out


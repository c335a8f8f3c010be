"""Next-fit page packing (`zipfusion_jax.serving.packing`): host and device agree, and the
worst-case reservation always suffices; the allocator hands back the chunks nothing went to."""

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from zipfusion_jax.serving.allocator import ChunkAllocator
from zipfusion_jax.serving.packing import page_bins, worst_case_bins
from zipfusion_jax.serving.state import ServingConfig

RAW = 48


def next_fit(units, room, chunk):
  """Sequential reference: the chunk index of each page (-1 current), None where none completes."""
  cur, off, out = -1, chunk - room, []
  for u in units:
    if u == 0:
      out.append(None)
      continue
    if off + RAW > chunk:
      cur, off = cur + 1, 0
    out.append(cur)
    off += u
  return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_host_and_device_pack_like_sequential_next_fit(data):
  chunk_pages = data.draw(st.sampled_from([2, 4]))  # 2: over 16 grants, the device's loop
  chunk = RAW * chunk_pages
  n = data.draw(st.integers(0, 40))
  units = np.array(data.draw(st.lists(st.sampled_from([0, 36, 37, 40, 45, 47, 48]), min_size=n, max_size=n)), np.int64)
  room = data.draw(st.integers(0, chunk))
  grants = int(worst_case_bins((units > 0).sum() - min((units > 0).sum(), room // RAW), chunk_pages))
  host = page_bins(units[None], np.array([room]), RAW, chunk, grants)[0]
  device = np.asarray(page_bins(jnp.asarray(units[None], jnp.int32), jnp.array([room], jnp.int32), RAW, chunk,
                                grants, jnp))[0]
  ref = next_fit(units.tolist(), room, chunk)
  done = units > 0
  assert [int(b) if d else None for b, d in zip(host, done)] == ref
  np.testing.assert_array_equal(device[done], host[done])
  assert max([r for r in ref if r is not None], default=-1) < grants  # the reservation sufficed
  raw = np.where(units > 0, RAW, 0)  # a BF16 store: the closed form equals next-fit
  fast = page_bins(raw[None], np.array([room]), RAW, chunk, grants, all_raw=True)[0]
  fast_device = np.asarray(page_bins(jnp.asarray(raw[None], jnp.int32), jnp.array([room], jnp.int32), RAW, chunk,
                                     grants, jnp, all_raw=True))[0]
  ref_raw = next_fit(raw.tolist(), room, chunk)
  assert [int(b) if d else None for b, d in zip(fast, done)] == ref_raw
  np.testing.assert_array_equal(fast_device[done], fast[done])


def test_compressed_pages_share_chunks_and_unused_grants_come_back():
  cfg = ServingConfig(num_layers=2, num_kv_heads=1, head_dim=64, num_slots=2, max_pages=64, num_chunks=16,
                      chunk_pages=4)
  alloc = ChunkAllocator(cfg)
  raw, small = cfg.page_units, cfg.min_page_units  # 16 and 12 units: 5 compressed pages fit a 4-page chunk
  p = alloc.reserve(20)
  assert [len(g) for g in p.grants] == [5, 5] and len(alloc.free_chunks) == 6  # worst case held
  dest = alloc.commit(p, np.stack([np.full(20, small), np.full(20, raw)]))
  assert len(set(dest[0].tolist())) == 4 and len(set(dest[1].tolist())) == 5  # 20 * 12 units pack into 4 chunks
  assert len(alloc.free_chunks) == 7  # layer 0's fifth grant went back
  cap = alloc.capacity()
  assert cap.live_bytes + cap.dead_bytes + cap.stranded_bytes + cap.free_bytes == cap.total_bytes

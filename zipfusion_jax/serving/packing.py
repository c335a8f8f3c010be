"""Where a step's completed pages go in each layer's chunks, decided from their encoded sizes.

A compressed page's size is known only after the jitted step encoded it, so the host reserves
fresh chunks for the worst case (every block raw: `ceil(pages / chunk_pages)`), the device packs
the pages by their real sizes, and the host replays the same rule on the step's readback of page
sizes (`step_units`) to learn where every page went and to return the chunks nothing went to.
One function serves both sides (`xp` is numpy or jax.numpy), so they cannot drift apart.

The rule is next-fit over the step's pages in order (decode: slot order; prefill: page order):
a page goes to the chunk being filled while a raw page would still fit at its offset, else it
opens the next chunk (first the layer's current chunk, then the fresh grants in order). Every
chunk but the last then holds at least `chunk_pages` pages whatever their sizes, so the
worst-case reservation is always enough, and a chunk strands less than one raw page.
"""

from __future__ import annotations

import jax
import numpy as np

_UNROLL = 16  # grants up to which the device loop is unrolled
_BIG = 1 << 30  # past any offset (stores are < 2^30 units), and _BIG + a chunk stays inside int32


def page_bins(units, room, raw: int, chunk_units: int, num_bins: int, xp=np, all_raw: bool = False):
  """int [L, n]: -1 for a page placed in the current chunk, else the index of its fresh chunk.

  Args:
    units: int [L, n] each page's size in units, 0 where no page completes (the result is
      meaningless there).
    room: int [L] units left in each layer's current chunk (0 without one).
    raw: units of a raw page; chunk_units: units of a chunk.
    num_bins: fresh chunks granted per layer (the loop's length; pages never need more).
    all_raw: every page is raw (a BF16 store): next-fit is then a division, no loop.
  """
  before = xp.cumsum(units, axis=-1) - units
  in_current = before + raw <= room[:, None]
  spill = xp.min(xp.where(in_current | (units == 0), _BIG, before), axis=-1, keepdims=True, initial=_BIG)
  e = xp.where(in_current, -1, before - xp.minimum(spill, before))  # offset past the first spilled page
  if all_raw:  # pages at e = 0, raw, 2 raw, ...: exactly chunk_units // raw to a chunk
    return xp.where(in_current, -1, xp.maximum(e, 0) // chunk_units)
  limit = chunk_units - raw  # a page fits a chunk iff it starts at most `limit` units in
  padded = xp.concatenate([e, xp.full((e.shape[0], 1), _BIG, e.dtype)], axis=1)

  def next_start(start):  # int [L]: where the chunk after the one starting at `start` starts
    idx = xp.sum(e <= (start + limit)[:, None], axis=-1)  # e is sorted: a searchsorted by counting
    return xp.take_along_axis(padded, idx[:, None], axis=1)[:, 0]

  starts = [xp.zeros(e.shape[0], e.dtype)]
  if xp is np or num_bins <= _UNROLL:  # decode grants a few chunks: unrolled, one small fusion each
    for _ in range(num_bins - 1):
      starts.append(next_start(starts[-1]))
    starts = xp.stack(starts, axis=1)
  else:  # a long prefill: a loop
    init = xp.full((e.shape[0], num_bins), _BIG, e.dtype).at[:, 0].set(0)
    starts = jax.lax.fori_loop(1, num_bins, lambda j, s: s.at[:, j].set(next_start(s[:, j - 1])), init)
  bins = xp.sum(starts[:, None, :] <= e[:, :, None], axis=-1) - 1
  return xp.where(in_current, -1, xp.maximum(bins, 0))


def worst_case_bins(m, chunk_pages: int):
  """Fresh chunks that m pages past the current chunk need at most (int or int array)."""
  return -(-np.maximum(np.asarray(m), 0) // chunk_pages)

"""Pallas compression kernel: BF16 blocks -> the 12-bit format of docs/FORMAT.md.

Default (`single_pass=False`): `_plan_kernel` decides each block's rule (b/2
or raw), XLA computes group offsets with a cumsum, and `_pack_kernel` reads the
blocks again and writes low bytes, code bytes or raw high bytes at the group's
offset, zeroing the unused tail of the worst-case payload as it goes. Format
version 2 (docs/FORMAT.md §9): the plan kernel (or the single pass's tile) runs the
version-2 rule (`block.block_rule_v2`, also giving each block's exception
entry) and the stores write the exception's code with d = 0.

`single_pass=True`: one kernel per tile of `tile_groups` groups reads its
blocks from HBM once (one vector load), decides their rules and in-tile offsets
with vector reductions, posts the tile's size, finds its payload offset by a
decoupled look-back over earlier tiles (a ticket counter hands out tiles in
launch order, so waiting cannot deadlock; each probe reads `look_back_states`
predecessor states per thread, with volatile loads), then re-reads each block (L2) and writes it with
unrolled, independent stores; a write-only kernel zeroes the tail. Both format versions. With
`ordered=False` a tile takes its offset from one atomic fetch-and-add instead (groups land in
arrival order, which the format allows; `codec.canonical_order` gives the reference's bytes):
938 us per GiB on the H100 with the tail zeroed, against 1076 ordered and 1111 two-pass (2026-12-06). Correct on
the H100 and the H200 (2026-12-05: bytes == reference, 1 GiB round trip bit-exact) but slower
than two-pass there (H200, 1 GiB: 0.99 ms at best vs 0.84 ms; with the strided tail zeroing it
ties two-pass on the H100, 1.08 vs 1.11 ms, 2026-12-06): the look-back chain, not HBM, bounds it
(benchmarks/RESULTS.md). Its first GPU runs hung: the window was read with a vector
atomic add of zeros, which erased the posted states on the GPU (interpret mode never showed it).
`persistent_programs=P` (unordered, version 1): P programs loop over the tiles, each loading its next
tile's blocks before placing and storing the current one (loads overlap the rule, the atomic and the
stores) and deciding the rule from those loads, so each block is read once: 807 us + 81 us tail
zeroing per GiB at 16 programs per SM on the H100 and 749 + 57 us on the H200 (1.33 TB/s of
input; 1.43 without the tail), the fastest compressor on both (2026-12-06); `offset_ahead` (the
next tile's atomic before this tile's stores) is not faster on the H200 (763 us at 8 per SM).
Every unordered placement takes its offsets with a relaxed fetch-and-add (`relaxed_atomic`):
the counter only hands out disjoint ranges, and `pltr.atomic_add`'s acquire-release semantics
cost a `MEMBAR.ALL.GPU` per tile (`benchmarks/kernel_sass.py`; every figure above had that
fence: `fenced_counter=True` keeps it for the A/B). Three further knobs of the persistent kernel
(2026-12-07; H100 only so far, benchmarks/RESULTS.md): `packed_words` does the rule and the stores
on packed 32-bit words through inline PTX (`compress_words`; 744 vs 777 us on the H100),
`pair_rows` stores the low and raw high bytes a row pair at a time (whole sectors per warp store)
and `tile_counter` hands out tiles from a counter (no second wave when programs outnumber the
SM's room).

`tma=True` (version 1, `ordered=False`): the Mosaic GPU kernel of `compress_tma`, whose tiles arrive by
TMA and leave as one bulk copy of exactly their units (size in a register), with the fetch-and-add,
`redux.sync` and the packed-word arithmetic as inline PTX: 651 us per GiB on the H100 (2.93 TB/s
r+w, 98% of the copy rate; 737 us with the tail zeroed by a second kernel, 1.13x the best Triton
kernel), 2026-12-07. It now zeroes the tail itself (each tile reserves its slack at the payload's
end with the same fetch-and-add and bulk-stores zeros there), so with the tail it moves the bytes
of one copy: read 1 GiB, write 1 GiB (H100, later that day: 741 us, 1.04x the copy; 655 us with the
tail unspecified). With `ordered=True` the same kernel places tiles in block order by a decoupled
look-back, so its bytes are the reference's: correct on the H100, but 1.55x slower there (1124 us
at 8-group tiles), the walk and not HBM bounding it.

Backend: Pallas Triton for the ordered kernels and version 2 (their placement needs scalar address
arithmetic and strided/masked stores, which the Triton lowering expresses directly), Mosaic GPU
for `tma` (measured faster, above: the Triton kernels' per-thread loads and stores held them at
~83% of the copy rate). Mosaic GPU's own atomics return nothing, so its fetch-and-add is inline
PTX; the dynamic-size bulk store too. The payload is not
pre-filled: each pack program zeroes the part of its worst-case window that
lies past the data (a full zero fill cost more than both kernels, measured).
Splitting into L2-sized chunks was measured slower (one launch pair per
chunk). Figures: benchmarks/RESULTS.md (`python -m benchmarks.compress`).

In-kernel views (free reshapes done by the wrapper):
  blocks  uint16 [N * 128, 4]: in block n, row 128n + 2k holds positions 8k..8k+3 (x), row 2k+1
          positions 8k+4..8k+7 (y), so the code pairs (x, y) are rows 2k, 2k+1.
  payload uint8 [units * 64, 4]: one 256-byte unit is 64 rows of 4 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import compress_tma
from pallas_kernels import compress_words as W
from pallas_kernels._platform import resolve_interpret
from pallas_kernels.relaxed_atomic import relaxed_atomic_add
from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec

ROWS_PER_UNIT = B.UNIT_BYTES // 4  # 64 rows of 4 bytes
LOW_ROWS = B.LOW_PLANE_BYTES // 4  # 128


@dataclasses.dataclass(frozen=True)
class CompressConfig:
  """Tuning knobs of the compression kernels.

  Attributes:
    single_pass: one kernel that reads the input once and places groups by a
      decoupled look-back; False runs plan (exponents) then pack (reads again).
    tile_groups: groups (of 4 blocks) per program of the single-pass kernel (power of two).
    plan_blocks: blocks per program of the plan kernel (power of two).
    num_warps: Triton warps per program.
    max_probes: single pass: a tile stops looking back after this many probes (0: never). A
      diagnostic bound: a tile that stops early writes wrong offsets, and
      `single_pass_diagnostics` reports it; keep 0 for real use.
    scalar_look_back: single pass: read one predecessor state per probe with a scalar atomic
      instead of a window of volatile loads (one per thread); slower (more probes), kept as the A/B.
    look_back_states: single pass: predecessor states each thread reads per probe (power of two),
      so a probe covers 32 * num_warps * look_back_states tiles. Every single-pass variant moves
      1 GiB in 1.0-1.2 ms whatever its tile size (H100, 2026-12-06), 1.5x the two-pass pack
      kernel's time per byte: a tile spends most of its life spinning through probes (~16 at one
      state per thread), holding one of the SM's program slots and no loads in flight. More
      states per thread cut the probes without the cross-warp reductions of more warps; measured
      (H100, 2026-12-06, fourth session) 8 states per thread were slower, 1449 vs 995 us per GiB.
      `tma` ordered: states each lane of the walking warp reads per pass (a window of
      32 * look_back_states tiles; 1, the default, measured fastest on the H100).
    ordered: single pass: True places groups in block order (the reference's bytes; the look-back
      above). False places each tile where one atomic fetch-and-add on a unit counter says, in
      the order tiles get there: no look-back, so no tile waits on another. The format allows it
      (every group's offset is its own, docs/FORMAT.md §6: any non-overlapping order is valid);
      the stream decodes to the same bits and `codec.canonical_order` turns it into the
      reference's bytes, but which offset a group gets changes from run to run on a GPU. H100,
      1 GiB (2026-12-06): 855 us for 4-group tiles at 4 warps + 79 us tail zeroing, the fastest
      compressor there (two-pass 1111 us), still 1.2x the copy (benchmarks/RESULTS.md).
    persistent_programs: unordered single pass only (`ordered=False`), format version 1: with P > 0
      the grid is min(P, tiles) persistent programs, program p taking tiles p, p + P, p + 2P, ... in
      a loop that loads tile t + P's blocks before it places and stores tile t (the loads in flight
      under the rule, the atomic and the stores), and decides the rule from those pack-layout
      blocks, so each block is read from HBM once. 0 (default): one program per tile.
      H100, 1 GiB (2026-12-06, sixth session): 16 programs per SM 807 us + 81 us tail zeroing (8 per
      SM: 888 us), against 855 us for the one-program-per-tile kernel: the tile's atomic, whose
      answer the stores wait on, is the suspect.
    offset_ahead: persistent programs only: take tile t + P's offset (its rule and the atomic) before
      storing tile t, so the atomic's round trip runs under tile t's stores and tile t + 2P's loads
      instead of stalling them. Costs a third tile of registers (the blocks being stored, the blocks
      whose offset is in flight and the blocks being loaded).
    zero_tail: zero the payload past the units in use (docs/FORMAT.md §6: "rest zero"), so the
      whole array equals the reference's. False leaves those bytes unspecified (whatever the
      buffer held) and saves writing them (~0.45 B per value at 90% eligibility, a quarter of
      the single pass's writes): for callers that read only the used prefix, as the serving
      engine and `compress_pages` do. Every byte before `payload_units * 256` is unchanged.
    fenced_counter: unordered placement only: take offsets with `pltr.atomic_add`, whose
      acquire-release semantics put a `MEMBAR.ALL.GPU` before every atomic (each tile waits for
      all of its program's earlier stores to land), instead of the default relaxed fetch-and-add
      (`relaxed_atomic`: the counter orders nothing, so no fence). The A/B of that fence.
    packed_words: persistent kernel only: keep each block as uint16 rows and do the rule and the
      stores on packed 32-bit words (`compress_words`: one `prmt` gives four low or high bytes,
      ten word ops four code bytes, `min.u16x2` / `max.u16x2` two patterns' extremes) instead of
      one int32 per pattern: 888 SASS instructions and 101 registers against 1576 and 132 (Triton
      3.9 for sm_90, `benchmarks/kernel_sass.py`).
    pair_rows: packed words only: load each block as 64 pairs of pack-layout rows (an x row and its
      y row, 16 contiguous bytes) and store its low and raw high bytes a pair at a time (8
      contiguous bytes per thread), so every warp store covers whole 32-byte sectors; without it
      the x rows and the y rows are stored in two passes that each write every other 4 bytes
      (half of each sector: the L2 merges the halves, at twice the write transactions).
    tile_counter: persistent kernel only: after its first tile p, a program takes its next tiles
      from a second relaxed counter (P, P + 1, ... in the order programs ask) instead of the fixed
      p + P, p + 2P, ...: a program that is not resident at launch (more programs than the SM's
      registers allow) finds the tiles taken and exits, instead of running its whole share after
      the others (a second wave). The index of the tile after next is fetched while this tile is
      placed and stored, so the next tile's loads never wait on it.
    tma: the Mosaic GPU kernel of `compress_tma` (format version 1): tiles of `tile_groups`
      groups arrive and leave by bulk copies (the copy engine walks the addresses), threads touch
      only shared memory; `tma_stages` tiles in flight per CTA; `zero_tail` zeroes the unused tail
      inside the same kernel. `ordered=False` places tiles by a fetch-and-add (`persistent_programs`
      CTAs, 0: two per SM); `ordered=True` in block order by a decoupled look-back over per-tile
      states (the reference's bytes; 0: one CTA per SM, and never more than surely fit at once,
      since a tile waits on its predecessors). The other knobs do not apply.
    tma_stages: `tma` only: input tiles in flight per CTA (1-8).
  """

  single_pass: bool = False
  tile_groups: int = 16
  plan_blocks: int = 16
  num_warps: int = 4
  max_probes: int = 0
  scalar_look_back: bool = False
  look_back_states: int = 1
  ordered: bool = True
  zero_tail: bool = True
  persistent_programs: int = 0
  offset_ahead: bool = False
  fenced_counter: bool = False
  packed_words: bool = False
  tile_counter: bool = False
  pair_rows: bool = False
  tma: bool = False
  tma_stages: int = 4

  @property
  def block_order(self) -> bool:
    """Whether groups land in block order (the reference's bytes); else in the order tiles take a counter."""
    return self.ordered

  def __post_init__(self):
    for name in ("plan_blocks", "tile_groups", "look_back_states"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
    if not self.ordered and not (self.single_pass or self.tma):
      raise ValueError("ordered=False is a placement of the single-pass and tma kernels (single_pass=True or tma=True)")
    if self.max_probes < 0:
      raise ValueError(f"max_probes={self.max_probes} must be >= 0 (0: unbounded)")
    if self.persistent_programs < 0:
      raise ValueError(f"persistent_programs={self.persistent_programs} must be >= 1 (or 0: off)")
    if self.persistent_programs and not self.tma and (not self.single_pass or self.ordered):
      raise ValueError("persistent_programs > 0 is a variant of the unordered single pass "
                       "(single_pass=True, ordered=False)")
    if self.offset_ahead and not self.persistent_programs:
      raise ValueError("offset_ahead is a schedule of the persistent kernel (persistent_programs > 0)")
    if self.fenced_counter and self.ordered:
      raise ValueError("fenced_counter is a placement knob of the unordered single pass (ordered=False)")
    if self.packed_words and not self.persistent_programs:
      raise ValueError("packed_words is an arithmetic of the persistent kernel (persistent_programs > 0)")
    if self.pair_rows and not self.packed_words:
      raise ValueError("pair_rows is a store layout of the packed-word persistent kernel (packed_words=True)")
    if self.tma and (self.single_pass or self.packed_words or self.tile_counter):
      raise ValueError("tma is its own kernel: leave single_pass, packed_words and tile_counter off")
    if not 1 <= self.tma_stages <= 8:
      raise ValueError(f"tma_stages={self.tma_stages} must be in [1, 8]")
    if self.tma:  # raises when the tiles do not fit shared memory
      compress_tma.smem_bytes(self.tile_groups, self.tma_stages, self.zero_tail)
    if self.tile_counter and (not self.persistent_programs or self.offset_ahead):
      raise ValueError("tile_counter is a schedule of the persistent kernel (persistent_programs > 0, "
                       "without offset_ahead)")


def heuristic_config(num_blocks: int) -> CompressConfig:
  """Default config for `num_blocks` blocks: the best variant of benchmarks/compress.py
  on the H200 (two-pass, 16 blocks per plan program, 4 warps; 1 GiB in 834 us)."""
  del num_blocks
  return CompressConfig()


def _plan_kernel(bits_ref, meta_ref):
  # bits_ref: uint16 [plan_blocks, 512]; meta_ref: int32 [plan_blocks]
  meta_ref[...] = B.block_meta_byte(*B.block_half_base(bits_ref[...]))  # the reference rule, in-kernel


def _plan_kernel_v2(bits_ref, meta_ref, exception_ref):
  # bits_ref: uint16 [plan_blocks, 512]; meta_ref, exception_ref: int32 [plan_blocks]
  meta_ref[...], exception_ref[...] = B.block_rule_v2(bits_ref[...])  # the reference rule, in-kernel


def block_units_int(mb):
  """`block.block_units` for Triton kernels (the decompression kernel uses it too): integer
  arithmetic, because Triton's lowering of nested scalar selects mixes i1 and i32."""
  is_compressed = (mb <= B.MAX_EXCEPTION_META).astype(jnp.int32)  # b/2, or version 2's 0x80 | b/2
  is_raw = (mb == B.META_RAW).astype(jnp.int32)
  return is_compressed * B.COMPRESSED_UNITS + is_raw * B.RAW_UNITS


def _load_block(bits_ref, row0, widen: bool = True):
  """Rows row0.. of a uint16 [*, 4] ref holding one block -> x, y int32 [64, 4] (uint16 without `widen`)."""
  x = bits_ref[pl.ds(row0, 64, stride=2), :]
  y = bits_ref[pl.ds(row0 + 1, 64, stride=2), :]
  return (x.astype(jnp.int32), y.astype(jnp.int32)) if widen else (x, y)


def _pack_half_base(x, y):
  """`B.block_half_base` of blocks in the pack layout of `_load_block`.

  Args:
    x, y: int32 [..., 64, 4], a block's 512 BF16 patterns (rows 2k and 2k + 1 of `_load_block`).

  Returns:
    (eligible, half_base): bool [...] and int32 [...], as `B.block_half_base` over the 512 values
    (the exponent min and max over both arrays are those of the block).
  """
  ex, ey = B.exponents(x), B.exponents(y)
  # One axis per reduction: the Triton lowering of a two-axis reduction fails under an abstract mesh.
  lowest = jnp.min(jnp.min(jnp.minimum(ex, ey), axis=-1), axis=-1)
  highest = jnp.max(jnp.max(jnp.maximum(ex, ey), axis=-1), axis=-1)
  base = lowest & ~1
  return highest - base < B.EXPONENT_WINDOW, base >> 1


def _store_block(payload_ref, unit, mb, x, y, exception=None):
  """Write one block (metadata byte mb; version 2: its exception entry) at `unit` of the uint8 [*, 4] payload."""
  row = unit * ROWS_PER_UNIT

  @pl.when(mb != B.META_ABSENT)
  def _low():
    payload_ref[pl.ds(row, 64, stride=2), :] = (x & 0xFF).astype(jnp.uint8)
    payload_ref[pl.ds(row + 1, 64, stride=2), :] = (y & 0xFF).astype(jnp.uint8)

  @pl.when(mb <= B.MAX_EXCEPTION_META)
  def _codes():
    hb = mb & B.MAX_HALF_BASE
    hx, hy = x >> 8, y >> 8
    if exception is not None:  # the exception keeps its sign, with d = 0 (FORMAT.md §9)
      flagged = (mb > B.MAX_HALF_BASE).astype(jnp.int32)
      p = exception & ((1 << B.POSITION_BITS) - 1)
      pos_x = 8 * jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
      hx = jnp.where((pos_x == p) & (flagged == 1), (hx & 0x80) | hb, hx)
      hy = jnp.where((pos_x + 4 == p) & (flagged == 1), (hy & 0x80) | hb, hy)
    code = (hx & 0x80) | (((hy & 0x7F) - hb) << 4) | ((hy >> 4) & 0x08) | ((hx & 0x7F) - hb)
    payload_ref[pl.ds(row + LOW_ROWS, 64), :] = code.astype(jnp.uint8)

  @pl.when(mb == B.META_RAW)
  def _high():
    payload_ref[pl.ds(row + LOW_ROWS, 64, stride=2), :] = (x >> 8).astype(jnp.uint8)
    payload_ref[pl.ds(row + LOW_ROWS + 1, 64, stride=2), :] = (y >> 8).astype(jnp.uint8)


def _store_block_words(payload_ref, unit, mb, x, y, *, asm: bool):
  """`_store_block` (version 1) from uint16 x, y [64, 4] on packed words (`compress_words`)."""
  row = unit * ROWS_PER_UNIT

  @pl.when(mb != B.META_ABSENT)
  def _low():
    payload_ref[pl.ds(row, 64, stride=2), :] = W.low_bytes(x, asm)
    payload_ref[pl.ds(row + 1, 64, stride=2), :] = W.low_bytes(y, asm)

  @pl.when(mb <= B.MAX_HALF_BASE)
  def _codes():
    payload_ref[pl.ds(row + LOW_ROWS, 64), :] = W.codes(x, y, W.replicated_half_base(mb), asm)

  @pl.when(mb == B.META_RAW)
  def _high():
    payload_ref[pl.ds(row + LOW_ROWS, 64, stride=2), :] = W.high_bytes(x, asm)
    payload_ref[pl.ds(row + LOW_ROWS + 1, 64, stride=2), :] = W.high_bytes(y, asm)


def _store_block_pairs(payload_ref, unit, mb, x, y, v, *, asm: bool):
  """`_store_block_words` into the payload as uint8 [*, 2, 4] (one 8-byte row pair per index): codes
  from x, y uint16 [64, 4], low and raw high bytes from the same block as row pairs v uint16 [64, 2, 4]
  (row pair k: x row k, y row k; threads holding an x row and its y row are neighbours, so each
  warp store covers whole sectors)."""
  pair = unit * ROWS_PER_UNIT // 2
  low_pairs = LOW_ROWS // 2

  @pl.when(mb != B.META_ABSENT)
  def _low():
    payload_ref[pl.ds(pair, 64), :, :] = W.low_bytes(v, asm)

  @pl.when(mb <= B.MAX_HALF_BASE)
  def _codes():
    codes = W.codes(x, y, W.replicated_half_base(mb), asm)
    payload_ref[pl.ds(pair + low_pairs, 32), :, :] = codes.reshape(32, 2, 4)

  @pl.when(mb == B.META_RAW)
  def _high():
    payload_ref[pl.ds(pair + low_pairs, 64), :, :] = W.high_bytes(v, asm)


WINDOW_ROWS = B.BLOCKS_PER_GROUP * B.RAW_UNITS * ROWS_PER_UNIT  # a group's worst case, 4 KiB


def _zero_tail(payload_ref, g, total_units):
  """Zero group g's worst-case window where it lies past the data.

  The windows tile the payload, so the tail is zeroed exactly once, without
  a full fill (which cost more than the kernels themselves, measured).
  """
  window = g * WINDOW_ROWS
  rows = window + jax.lax.broadcasted_iota(jnp.int32, (WINDOW_ROWS, 4), 0)
  pltr.store(
      payload_ref.at[pl.ds(window, WINDOW_ROWS), :],
      jnp.zeros((WINDOW_ROWS, 4), jnp.uint8),
      mask=rows >= total_units * ROWS_PER_UNIT,
  )


def _pack_kernel(*refs, version: int, zero_tail: bool = True):
  # meta_ref:      int32 [groups * 4] (whole array), per-block byte
  # exception_ref: int32 [groups * 4] (whole array; version 2 only), per-block exception entry
  # offset_ref:    int32 [groups] (whole array), group offset in units
  # total_ref:     int32 [1], units in use
  # bits_ref:      uint16 [4 * 128, 4], this group's four blocks (block k at rows 128k..)
  # payload_ref:   uint8 [groups * 16 * 64, 4] (whole array)
  if version == 1:
    (meta_ref, offset_ref, total_ref, bits_ref, payload_ref), exception_ref = refs, None
  else:
    meta_ref, exception_ref, offset_ref, total_ref, bits_ref, payload_ref = refs
  g = pl.program_id(0)
  if zero_tail:
    _zero_tail(payload_ref, g, total_ref[0])
  unit = offset_ref[g]
  for k in range(B.BLOCKS_PER_GROUP):
    mb = meta_ref[g * B.BLOCKS_PER_GROUP + k]
    exception = None if exception_ref is None else exception_ref[g * B.BLOCKS_PER_GROUP + k]
    x, y = _load_block(bits_ref, k * LOW_ROWS)
    _store_block(payload_ref, unit, mb, x, y, exception)
    unit = unit + block_units_int(mb)


FLAG_AGGREGATE, FLAG_INCLUSIVE = 1, 2  # look-back states; value << 2 | flag, 0 = not yet


def look_back_window(num_warps: int, states_per_thread: int = 1) -> int:
  """Predecessor states read per look-back probe: `states_per_thread` per thread of the program.

  A racy read (other tiles post while we look) must be made once per state: were the window
  smaller than the program, Triton would replicate it across warps, each warp would read at its
  own moment, and warps could disagree on whether the window is complete, so their loop trip
  counts (and the barriers of the reductions inside) would diverge. A whole number of states per
  thread (the window a multiple of the program's threads) gives every state to exactly one
  thread, and every reduction over the window is program-wide, so all threads see one answer.
  """
  return 32 * num_warps * states_per_thread


LOOK_BACK = look_back_window(4)  # the window at the default 4 warps


def _tile_sizes(meta):
  """meta int32 [n] (a tile's block bytes) -> (units [n], exclusive in-tile offsets [n])."""
  units = block_units_int(meta)
  n = meta.shape[0]
  before = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1) < jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  return units, jnp.sum(jnp.where(before, units[None, :], 0), axis=1)


def _look_back(state_ref, t, first, window: int = LOOK_BACK, max_probes: int = 0):
  """(units of tiles 0 .. t - 1, probes made), by decoupled look-back over `state_ref` (value << 2 | flag).

  Reads `window` predecessors per probe (one volatile vector load): sums every aggregate after
  the latest inclusive prefix in the window and stops there; re-probes the same window while
  a tile after that prefix has posted nothing yet; else moves the window back. With
  `max_probes` > 0 it gives up after that many probes (diagnostics only: the sum is then wrong).
  """
  lanes = jax.lax.broadcasted_iota(jnp.int32, (window,), 0)

  def cond(carry):
    searching = carry[2] == 0
    return searching & (carry[3] < max_probes) if max_probes else searching

  def scalar_body(carry):  # window 1: one state per probe, a scalar atomic (one thread, broadcast)
    j, excl, _, probes = carry
    s = pltr.atomic_add(state_ref, (j,), j * 0)  # an atomic read (a traced 0: no loop consts)
    flag = s & 3
    ready = (flag != 0).astype(jnp.int32)
    return j - ready, excl + ready * (s >> 2), (flag == FLAG_INCLUSIVE).astype(jnp.int32), probes + 1

  def body(carry):
    hi, excl, _, probes = carry  # the window: tiles lo .. hi (state_ref is padded by `window` entries)
    lo = jnp.maximum(hi - (window - 1), 0)
    index = lo + lanes
    valid = index <= hi
    # A volatile load (L2, never a stale L1 line): each 32-bit state is one consistent word. (A
    # vector atomic add of zeros here erased the posted states on an H100: 2026-12-05 diagnosis.)
    s = pltr.load(state_ref.at[pl.ds(lo, window)], volatile=True)
    flag = jnp.where(valid, s & 3, 0)
    newest = jnp.max(jnp.where(valid & (flag == FLAG_INCLUSIVE), index, -1))
    counted = valid & (index >= newest)
    complete = jnp.min(jnp.where(counted, (flag != 0).astype(jnp.int32), 1))
    add = jnp.sum(jnp.where(counted, s >> 2, 0))
    done = complete * (newest >= 0).astype(jnp.int32)
    return hi - complete * (hi - lo + 1), excl + complete * add, done, probes + 1

  loop_body = scalar_body if window == 1 else body
  _, excl, _, probes = jax.lax.while_loop(cond, loop_body, (jnp.maximum(t - 1, 0), t * 0, first, t * 0))
  return excl, probes


def _single_pass_kernel(bits_ref, blocks_ref, _ticket_in, _state_in, payload_ref, meta_ref, offset_ref, ticket_ref,
                        state_ref, probes_ref, *exception_ref, num_blocks: int, tile_groups: int, window: int,
                        max_probes: int, ordered: bool = True, fenced_counter: bool = False):
  # bits_ref:    uint16 [groups * 4 * 128, 4] (whole array; the pack layout of the blocks)
  # blocks_ref:  uint16 [groups * 4, 512] (whole array; the same bytes, one block per row)
  # payload_ref: uint8 [groups * 16 * 64, 4] (whole array; the tail is zeroed by _zero_kernel)
  # meta_ref:    int32 [groups * 4], offset_ref: int32 [groups] (written for this tile's groups)
  # ticket_ref:  int32 [1], state_ref: int32 [tiles + window] (zero on entry, aliased in and out)
  # probes_ref:  int32 [tiles], look-back probes per tile (telemetry for `single_pass_diagnostics`)
  # exception_ref: (format version 2 only) int32 [groups * 4], each block's exception entry
  #
  # Decoupled look-back over tiles of `tile_groups` groups, taken in ticket order (a ticket
  # holder only waits on holders of smaller tickets, which are already running: no deadlock).
  # A tile reads its blocks in one vector load, decides their rules and in-tile offsets with
  # vector reductions, posts its size, sums its predecessors' sizes (`_look_back`), then re-reads
  # each block (L2) and writes it: every load and store of the tile is independent, so they
  # are all in flight together.
  #
  # Unordered (`ordered=False`): tile t is program t, and `ticket_ref` counts units in use: one
  # fetch-and-add gives the tile its offset (state_ref and probes_ref stay zero).
  n = tile_groups * B.BLOCKS_PER_GROUP
  t = pltr.atomic_add(ticket_ref, (jnp.int32(0),), jnp.int32(1)) if ordered else pl.program_id(0)
  b0 = t * n
  present = _present(b0, n, num_blocks)
  tile = blocks_ref[pl.ds(b0, n), :]
  if exception_ref:  # format version 2: the version-2 rule, and each block's exception entry
    rule, exception = B.block_rule_v2(tile)
    exception = jnp.where(present, exception, 0)
    exception_ref[0][pl.ds(b0, n)] = exception
  else:
    rule, exception = B.block_meta_byte(*B.block_half_base(tile)), None
  meta = jnp.where(present, rule, B.META_ABSENT)
  units, starts = _tile_sizes(meta)
  size = jnp.sum(units)
  meta_ref[pl.ds(b0, n)] = meta
  if ordered:
    first = (t == 0).astype(jnp.int32)
    posted = (size << 2) | (FLAG_AGGREGATE + first)  # tile 0's size is its inclusive prefix
    pltr.atomic_add(state_ref, (t,), posted)  # from 0 (adds: interpret mode has no exchange)
    excl, probes = _look_back(state_ref, t, first, window, max_probes)
    probes_ref[t] = probes
    pltr.atomic_add(state_ref, (t,), (((excl + size) << 2) | FLAG_INCLUSIVE) - posted)
  else:
    excl = _counter_add(ticket_ref, size, fenced_counter)
  block_xy = lambda k: _load_block(bits_ref, (b0 + k) * LOW_ROWS)  # re-read (L2)
  _write_tile(payload_ref, offset_ref, t, excl, meta, units, starts, block_xy, exception)


TICKET_WORDS, TILE_TICKET = 64, 32  # the persistent kernel's counters: units at word 0, tiles at word 32


def _counter_add(ticket_ref, units, fenced: bool, index: int = 0):
  """Counter `index`'s old value, `units` added: a relaxed fetch-and-add (the counter only hands
  out disjoint ranges), or with `fenced` the acquire-release `pltr.atomic_add`."""
  add = pltr.atomic_add if fenced else relaxed_atomic_add
  return add(ticket_ref, (np.int32(index),), units)


def _present(b0, n, num_blocks):
  """bool [n]: which blocks b0 .. b0 + n - 1 of a tile exist (the rest are padding, META_ABSENT)."""
  return b0 + jax.lax.broadcasted_iota(jnp.int32, (n,), 0) < num_blocks


def _write_tile(payload_ref, offset_ref, t, excl, meta, units, starts, block_xy, exception=None):
  """Write tile t's group offsets and blocks, the tile starting at unit `excl`.

  meta, units, starts, exception (version 2, or None): int32 [n], per block of the tile (its byte,
  size, in-tile offset); block_xy(k) -> x, y int32 [64, 4] of block k (loaded or re-read).
  """
  n = meta.shape[0]
  tile_groups = n // B.BLOCKS_PER_GROUP
  group_of = jax.lax.broadcasted_iota(jnp.int32, (tile_groups, n), 0)
  in_earlier = jax.lax.broadcasted_iota(jnp.int32, (tile_groups, n), 1) < B.BLOCKS_PER_GROUP * group_of
  offset_ref[pl.ds(t * tile_groups, tile_groups)] = excl + jnp.sum(jnp.where(in_earlier, units[None, :], 0), axis=1)
  lane = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
  for k in range(n):  # unrolled: independent loads and stores
    pick = lambda v: jnp.sum(jnp.where(lane == k, v, 0))
    x, y = block_xy(k)
    _store_block(payload_ref, excl + pick(starts), pick(meta), x, y, None if exception is None else pick(exception))


def _as_lanes(scalars):
  """k int32 scalars -> int32 [k], lane i holding scalars[i] (Triton has no vector from scalars)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (len(scalars),), 0)
  out = jnp.zeros((len(scalars),), jnp.int32)
  for i, v in enumerate(scalars):
    out = jnp.where(lane == i, v, out)
  return out


def _persistent_kernel(bits_ref, _ticket_in, payload_ref, meta_ref, offset_ref, ticket_ref, *, num_blocks: int,
                       tile_groups: int, tiles: int, programs: int, offset_ahead: bool = False,
                       fenced_counter: bool = False, words: str = "", tile_counter: bool = False,
                       pair_rows: bool = False):
  # bits_ref:    uint16 [groups * 4 * 128, 4] (whole array; the pack layout, read once)
  # payload_ref: uint8 [groups * 16 * 64, 4] (whole array; the tail is zeroed by _zero_kernel)
  # meta_ref:    int32 [groups * 4], offset_ref: int32 [groups] (written for each tile's groups)
  # ticket_ref:  int32 [TICKET_WORDS], the unit counter at 0 and the tile counter at TILE_TICKET (zero
  #              on entry, aliased in and out; a line apart, so the two atomics do not share one)
  #
  # The unordered single pass as `programs` persistent programs: program p takes tiles p, p + P,
  # ... (P = programs). Each iteration first loads the next tile's blocks (clamped to the last
  # tile past the end: values that go unused), then decides the current tile's rules
  # from its loaded blocks, takes its offset from the counter and stores it, so the next tile's
  # loads are in flight under this tile's rule, atomic and stores. With `offset_ahead` the
  # iteration storing tile t has taken t's offset one iteration earlier: it loads tile t + 2P,
  # places tile t + P (rule and atomic; the answer is first used one iteration later) and stores t.
  n = tile_groups * B.BLOCKS_PER_GROUP
  p = pl.program_id(0)

  # words: "" (one int32 per pattern), "asm" or "jnp" (packed words, `compress_words`; "jnp" interpreted).
  # pair_rows: bits_ref and payload_ref are the same arrays as [*, 2, 4] (row pairs). A block is
  # loaded as x, y rows (the rule, the codes) and read again as row pairs v [64, 2, 4] when it is
  # stored (L1 hits, not carried across the iteration: registers). Splitting v into x and y in
  # registers instead costs layout conversions through shared memory (Triton 3.9 SASS).
  asm = words == "asm"
  rule = (lambda x, y: W.block_rule(x, y, asm)) if words else _pack_half_base

  def store_block(row0, unit, mb, x, y):  # the block at pack row row0
    if pair_rows:
      _store_block_pairs(payload_ref, unit, mb, x, y, bits_ref[pl.ds(row0 // 2, 64), :, :], asm=asm)
    elif words:
      _store_block_words(payload_ref, unit, mb, x, y, asm=asm)
    else:
      _store_block(payload_ref, unit, mb, x, y)

  def load_block(row0):
    if pair_rows:
      pairs = pl.ds(row0 // 2, 64)
      return bits_ref[pairs, 0, :], bits_ref[pairs, 1, :]
    return _load_block(bits_ref, row0, widen=not words)

  def load_tile(t):  # -> (x, y) [64, 4] per block of tile t: int32, or uint16 with words; past the end: the last tile's, unused
    t = jnp.minimum(t, tiles - 1)
    return tuple(load_block((t * n + k) * LOW_ROWS) for k in range(n))

  def place(t, blocks):  # -> (meta bytes, tile offset) of tile t (nothing, past the end)
    b0, exists = t * n, t < tiles
    # Per-block scalars throughout (a block's rule is a scalar after its reductions): no lane
    # vector to pick from again, so no extra cross-lane reductions per block.
    meta = tuple(jnp.where((b0 + k < num_blocks) & exists, B.block_meta_byte(*rule(x, y)), B.META_ABSENT)
                 for k, (x, y) in enumerate(blocks))

    @pl.when(exists)
    def _():
      meta_ref[pl.ds(b0, n)] = _as_lanes(meta)

    return meta, _counter_add(ticket_ref, sum(block_units_int(mb) for mb in meta), fenced_counter)

  def store(t, blocks, placed):
    meta, unit = placed
    for k, (x, y) in enumerate(blocks):  # unrolled: independent stores
      if k % B.BLOCKS_PER_GROUP == 0:
        offset_ref[t * tile_groups + k // B.BLOCKS_PER_GROUP] = unit
      store_block((t * n + k) * LOW_ROWS, unit, meta[k], x, y)
      unit = unit + block_units_int(meta[k])

  if tile_counter:  # tiles p, then P + (the tile counter's old value), asked for one tile ahead
    one = p * 0 + 1  # traced: interpret mode's discharge turns a literal increment into a loop constant

    def next_index():
      return programs + _counter_add(ticket_ref, one, fenced=False, index=TILE_TICKET)

    def dynamic_body(carry):
      t, blocks, t1 = carry
      upcoming = load_tile(t1)  # t1 came back during the previous tile's stores
      t2 = next_index()  # used by the next iteration's loads
      store(t, blocks, place(t, blocks))
      return t1, upcoming, t2

    jax.lax.while_loop(lambda carry: carry[0] < tiles, dynamic_body, (p, load_tile(p), next_index()))
    return

  def body(i, carry):
    t = p + i * programs
    if not offset_ahead:
      upcoming = load_tile(t + programs)
      store(t, carry, place(t, carry))
      return upcoming
    blocks, placed, next_blocks = carry
    upcoming = load_tile(t + 2 * programs)
    next_placed = place(t + programs, next_blocks)  # the atomic's answer is used next iteration
    store(t, blocks, placed)
    return next_blocks, next_placed, upcoming

  count = (tiles - p + programs - 1) // programs  # >= 1: the grid has at most `tiles` programs
  first = load_tile(p)
  init = (first, place(p, first), load_tile(p + programs)) if offset_ahead else first
  jax.lax.fori_loop(0, count, body, init)


ZERO_PROGRAMS = 1024  # programs of the tail-zeroing kernel (a few per SM), each looping over windows


def _zero_kernel(total_ref, _payload_in_ref, payload_ref, *, groups: int, programs: int):
  # total_ref: int32 [1]; payload_ref: uint8 [groups * 16 * 64, 4] (aliased in and out)
  # Windows from the one holding the first unused row to the end, strided over the programs: a
  # program per window (the previous grid) cost 174 us at 1 GiB (H200), almost all of it programs
  # whose window holds data and store nothing.
  total = total_ref[0]
  first = total * ROWS_PER_UNIT // WINDOW_ROWS + pl.program_id(0)
  count = jnp.maximum(groups - first + programs - 1, 0) // programs

  def body(k, carry):
    _zero_tail(payload_ref, first + k * programs, total)
    return carry

  jax.lax.fori_loop(0, count, body, 0)


def zero_payload_tail(payload, total_units, *, num_warps: int = 4, interpret: bool = False):
  """Zero the rows of `payload` (uint8 [groups * 16 * 64, 4]) from unit `total_units` (int32 [1]) on,
  in place (aliased); the rows before it are left as they are."""
  groups = payload.shape[0] // WINDOW_ROWS
  programs = min(groups, ZERO_PROGRAMS)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_zero_kernel, groups=groups, programs=programs),
      grid=(programs,),
      in_specs=[any_spec, any_spec],  # units in use, payload in
      out_specs=any_spec,
      out_shape=jax.ShapeDtypeStruct(payload.shape, jnp.uint8),
      input_output_aliases={1: 0},
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=num_warps),
      name="zipfusion_compress_zero_tail",
  )(total_units, payload)


def _single_pass(bits2d, num_blocks: int, config, interpret, version: int = 1):
  """bits2d uint16 [N, 512] -> (payload uint8 [groups * 16 * 64, 4], meta bytes int32 [N], group offsets
  int32 [groups], units in use int32 [], look-back info, exception entries int32 [N] or None)."""
  tiles = bits2d.shape[0] // B.BLOCKS_PER_GROUP // config.tile_groups
  if config.persistent_programs:
    if version != 1:
      raise ValueError(f"persistent_programs > 0 writes format version 1 only (got version={version})")
    payload, meta, offsets, ticket = _persistent_call(bits2d, num_blocks, config, interpret)
    state = probes = jnp.zeros((tiles,), jnp.int32)
    exceptions = []
  else:
    payload, meta, offsets, ticket, state, probes, *exceptions = _single_pass_call(
        bits2d, num_blocks, config, interpret, version)
  # Units in use: the last tile's inclusive prefix, or (unordered) the unit counter.
  total = (state[tiles - 1 : tiles] >> 2).astype(jnp.int32) if config.ordered else ticket
  if config.zero_tail:
    payload = zero_payload_tail(payload, total, num_warps=config.num_warps, interpret=interpret)
  info = {"ticket": ticket[0], "state": state[:tiles], "probes": probes}
  return payload, meta, offsets, total[0], info, (exceptions[0] if exceptions else None)


def _persistent_call(bits2d, num_blocks: int, config, interpret):
  """The persistent unordered kernel -> (payload, meta bytes, group offsets, unit counter int32 [1])."""
  groups = bits2d.shape[0] // B.BLOCKS_PER_GROUP
  tiles = groups // config.tile_groups
  programs = min(config.persistent_programs, tiles)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  rows = (-1, 2, 4) if config.pair_rows else (-1, 4)  # row pairs, or rows (free reshapes of the same bytes)
  payload, meta, offsets, counters = pl.pallas_call(
      functools.partial(_persistent_kernel, num_blocks=num_blocks, tile_groups=config.tile_groups, tiles=tiles,
                        programs=programs, offset_ahead=config.offset_ahead, fenced_counter=config.fenced_counter,
                        words=("jnp" if interpret else "asm") if config.packed_words else "",
                        tile_counter=config.tile_counter, pair_rows=config.pair_rows),
      grid=(programs,),
      in_specs=[any_spec] * 2,  # bits (pack rows), counters
      out_specs=[any_spec] * 4,  # payload, meta bytes, group offsets, counters (units, tiles)
      out_shape=[
          jax.ShapeDtypeStruct((groups * WINDOW_ROWS * 4 // math.prod(rows[1:]), *rows[1:]), jnp.uint8),
          jax.ShapeDtypeStruct((groups * B.BLOCKS_PER_GROUP,), jnp.int32),
          jax.ShapeDtypeStruct((groups,), jnp.int32),
          jax.ShapeDtypeStruct((TICKET_WORDS,), jnp.int32),
      ],
      input_output_aliases={1: 3},
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_single_pass_persistent",
  )(bits2d.reshape(rows), jnp.zeros((TICKET_WORDS,), jnp.int32))
  return payload.reshape(-1, 4), meta, offsets, counters[:1]


def _single_pass_call(bits2d, num_blocks: int, config, interpret, version: int):
  """The one-program-per-tile kernel -> (payload, meta bytes, group offsets, ticket, state, probes
  (, version 2: exception entries))."""
  groups = bits2d.shape[0] // B.BLOCKS_PER_GROUP
  tiles = groups // config.tile_groups
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  params = pltr.CompilerParams(num_warps=config.num_warps)
  window = 1 if config.scalar_look_back else look_back_window(config.num_warps, config.look_back_states)
  per_block = jax.ShapeDtypeStruct((groups * B.BLOCKS_PER_GROUP,), jnp.int32)
  return pl.pallas_call(
      functools.partial(_single_pass_kernel, num_blocks=num_blocks, tile_groups=config.tile_groups, window=window,
                        max_probes=config.max_probes, ordered=config.ordered,
                        fenced_counter=config.fenced_counter),
      grid=(tiles,),
      in_specs=[any_spec] * 4,  # bits (pack rows), bits (block rows), ticket, look-back state
      # payload, meta bytes, group offsets, ticket, state, probes (, version 2: exception entries)
      out_specs=[any_spec] * (6 if version == 1 else 7),
      out_shape=[
          jax.ShapeDtypeStruct((groups * WINDOW_ROWS, 4), jnp.uint8),
          per_block,
          jax.ShapeDtypeStruct((groups,), jnp.int32),
          jax.ShapeDtypeStruct((1,), jnp.int32),
          jax.ShapeDtypeStruct((tiles + window,), jnp.int32),
          jax.ShapeDtypeStruct((tiles,), jnp.int32),
          *([] if version == 1 else [per_block]),
      ],
      input_output_aliases={2: 3, 3: 4},
      interpret=interpret,
      compiler_params=params,
      name="zipfusion_compress_single_pass",
  )(bits2d.reshape(-1, 4), bits2d, jnp.zeros((1,), jnp.int32), jnp.zeros((tiles + window,), jnp.int32))


def _plan(bits2d, config: CompressConfig, interpret: bool, version: int):
  """Per-block bytes int32 [N] (version 2: and exception entries int32 [N])."""
  t = config.plan_blocks
  n = bits2d.shape[0]
  outputs = 1 if version == 1 else 2
  return pl.pallas_call(
      _plan_kernel if version == 1 else _plan_kernel_v2,
      grid=(n // t,),
      in_specs=[pl.BlockSpec((t, B.VALUES_PER_BLOCK), lambda i: (i, 0))],  # bits
      out_specs=[pl.BlockSpec((t,), lambda i: (i,))] * outputs,  # meta bytes (, exception entries)
      out_shape=[jax.ShapeDtypeStruct((n,), jnp.int32)] * outputs,
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_plan",
  )(bits2d)


def _pack(meta, exceptions, group_offsets, total_units, bits_rows, config, interpret):
  groups = group_offsets.shape[0]
  whole = pl.BlockSpec(memory_space=pl.ANY)
  extra = [] if exceptions is None else [exceptions]
  return pl.pallas_call(
      functools.partial(_pack_kernel, version=1 if exceptions is None else 2, zero_tail=config.zero_tail),
      grid=(groups,),
      in_specs=[
          whole,  # meta bytes
          *[whole] * len(extra),  # exception entries (version 2)
          whole,  # group offsets
          whole,  # units in use
          pl.BlockSpec((B.BLOCKS_PER_GROUP * LOW_ROWS, 4), lambda g: (g, 0)),  # bits
      ],
      out_specs=whole,  # payload, written whole
      out_shape=jax.ShapeDtypeStruct((groups * WINDOW_ROWS, 4), jnp.uint8),
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=config.num_warps),
      name="zipfusion_compress_pack",
  )(meta, *extra, group_offsets, total_units, bits_rows)


@functools.partial(jax.jit, static_argnames=("num_blocks", "config", "interpret", "version"))
def _compress_bits(bits2d: jax.Array, *, num_blocks: int, config: CompressConfig, interpret: bool, version: int):
  """bits2d: uint16 [N, 512], N a multiple of 4 * max(plan_blocks, tile_groups); rows >= num_blocks are padding."""
  n = bits2d.shape[0]
  groups = -(-num_blocks // B.BLOCKS_PER_GROUP)
  if config.tma:
    if version != 1:
      raise ValueError(f"tma=True writes format version 1 only (got version={version})")
    payload, word1, offsets, total = compress_tma.compress_rows(
        bits2d, num_blocks, tile_groups=config.tile_groups, stages=config.tma_stages,
        ctas=config.persistent_programs, zero_tail=config.zero_tail, ordered=config.ordered,
        look_back_states=config.look_back_states, interpret=interpret)
    group_meta = codec.make_group_meta(offsets, codec.unpack_meta_bytes(word1.astype(jnp.uint32)), version)
    return payload.reshape(-1)[: num_blocks * B.ROW_BYTES], group_meta[:groups], total[0]
  if config.single_pass:
    payload_rows, meta, offsets, total_units, _, exceptions = _single_pass(bits2d, num_blocks, config, interpret, version)
    group_meta = codec.make_group_meta(offsets, meta.reshape(-1, B.BLOCKS_PER_GROUP), version,
                                       None if exceptions is None else exceptions.reshape(-1, B.BLOCKS_PER_GROUP))
    return payload_rows.reshape(-1)[: num_blocks * B.ROW_BYTES], group_meta[:groups], total_units
  planned = _plan(bits2d, config, interpret, version)  # [meta bytes] or [meta bytes, exception entries]
  meta, exceptions = planned[0], (planned[1] if version == 2 else None)
  if n > num_blocks:  # padding rows become absent slots
    meta = jnp.where(jnp.arange(n) < num_blocks, meta, B.META_ABSENT)
  group_offsets, group_meta, total_units = codec.pack_groups(
      meta.reshape(-1, B.BLOCKS_PER_GROUP), version, None if exceptions is None else exceptions.reshape(-1, B.BLOCKS_PER_GROUP))
  payload_rows = _pack(meta, exceptions, group_offsets, total_units.reshape(1), bits2d.reshape(n * LOW_ROWS, 4),
                       config, interpret)
  payload = payload_rows.reshape(-1)[: num_blocks * B.ROW_BYTES]
  return payload, group_meta[:groups], total_units


def _block_rows(x, config: CompressConfig):
  """bf16 [..., 512] -> (uint16 [N', 512] padded to the kernels' quantum, N blocks)."""
  bits = B.to_bits(x).reshape(-1, B.VALUES_PER_BLOCK)
  n = bits.shape[0]
  quantum = B.BLOCKS_PER_GROUP * max(config.plan_blocks, config.tile_groups)
  padded = -(-n // quantum) * quantum
  if padded != n:
    bits = jnp.pad(bits, ((0, padded - n), (0, 0)))
  return bits, n


def compress_pallas(x, *, config: CompressConfig | None = None, interpret: bool | None = None,
                    version: int = B.FORMAT_VERSION) -> codec.CompressedBlocks:
  """Pallas encoder with the contract of `codec.compress_reference` (same bytes; with
  `config.block_order` False (`ordered=False`) the same groups in another order, with `config.zero_tail=False` the
  bytes past `payload_units * 256` unspecified).

  Args:
    x: bfloat16 [..., 512].
    config: tuning knobs; `heuristic_config` when None.
    interpret: run interpreted (default: when the default backend is not a GPU).
    version: format version, 1 or 2.
  """
  version = codec.check_version(version)
  x = codec.check_blocks_input(x)
  batch_shape = tuple(x.shape[:-1])
  config = config or heuristic_config(x.size // B.VALUES_PER_BLOCK)
  interpret = resolve_interpret(interpret)
  bits, n = _block_rows(x, config)
  payload, group_meta, units = _compress_bits(
      bits, num_blocks=n, config=config, interpret=interpret, version=version
  )
  return codec.CompressedBlocks(payload, group_meta, units, batch_shape)


def single_pass_diagnostics(x, config: CompressConfig, *, interpret: bool | None = None) -> dict:
  """Run the single-pass kernel once on bf16 `x` [N, 512] and report its look-back bookkeeping.

  Returns a dict of numpy-friendly values: `tiles`, `ticket` (tickets handed out; == tiles when
  every program ran), `flags` (how many tiles ended with state flag 0 / aggregate / inclusive),
  `inclusive_prefix_ok` (every tile's inclusive value is the running sum of the sizes),
  `probes_max`, `probes_mean`, and `metadata_match` (group metadata and units in use equal the
  reference's; the payload bytes are checked by `compress_pallas`'s tests and the benchmark).
  With `config.max_probes` > 0 a stuck look-back ends, so a GPU run returns instead of hanging.
  """
  if not config.single_pass or not config.ordered:
    raise ValueError("diagnostics are the ordered single pass's look-back bookkeeping (single_pass=True, ordered=True)")
  interpret = resolve_interpret(interpret)
  if not interpret and not config.max_probes:
    raise ValueError("on a GPU, diagnose with a bounded look-back (CompressConfig(max_probes=...)): a stuck "
                     "chain would otherwise hang the device")
  x = codec.check_blocks_input(x)
  bits, n = _block_rows(x, config)
  run = jax.jit(functools.partial(_single_pass, num_blocks=n, config=config, interpret=interpret))
  _, meta, offsets, total, info, _ = run(bits)
  state = jax.device_get(info["state"])
  flags = state & 3
  units = jax.device_get(block_units_int(meta)).reshape(-1, B.BLOCKS_PER_GROUP * config.tile_groups).sum(axis=1)
  inclusive_ok = bool(np.all((flags == FLAG_INCLUSIVE) & ((state >> 2) == np.cumsum(units))))
  want = codec.compress_reference(x)
  group_meta = codec.make_group_meta(offsets, meta.reshape(-1, B.BLOCKS_PER_GROUP))[: want.group_meta.shape[0]]
  probes = jax.device_get(info["probes"])
  return {
      "tiles": int(state.shape[0]), "ticket": int(info["ticket"]),
      "flags": {"none": int(np.sum(flags == 0)), "aggregate": int(np.sum(flags == FLAG_AGGREGATE)),
                "inclusive": int(np.sum(flags == FLAG_INCLUSIVE))},
      "inclusive_prefix_ok": inclusive_ok, "total_units": int(total),
      "probes_max": int(probes.max()), "probes_mean": float(probes.mean()),
      "metadata_match": bool(np.array_equal(jax.device_get(group_meta), jax.device_get(want.group_meta))
                          and int(total) == int(want.payload_units)),
  }

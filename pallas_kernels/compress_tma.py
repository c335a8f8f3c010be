"""Streaming compression through the TMA (Mosaic GPU, Hopper): format version 1.

Why a second design: every Triton compressor so far moves about 2.5 TB/s (read + write) on the
H100 and the H200 alike, although the H200's HBM is 1.4x faster and Triton's own copies reach
4.19 TB/s there (benchmarks/RESULTS.md): the SM side (addresses, loads and stores one thread
word at a time) bounds them, not HBM. Here the bytes move as bulk copies, whose addresses the copy
engine walks, and threads touch only shared memory.

One CTA is one warpgroup, persistent over tiles `cta, cta + C, ...` of `T` groups (4T blocks,
4 KiB of BF16 each). Per tile:

* the tile's 4T block rows arrive by one bulk copy (`cp.async.bulk`, no descriptor) into a ring of
  `stages` shared-memory slots, issued `stages` tiles ahead;
* warp w takes block w of every group (a group's 4 blocks are the 4 warps), a lane the block's
  fragments k = lane and lane + 32 (positions 8k .. 8k + 7: one 16-byte shared load each). The
  rule comes from `min.u16x2` / `max.u16x2` over the lane's eight words of `pattern & 0x7fff`
  and one `redux.sync` min and max per block (b/2 = min >> 8; eligible iff (max >> 8) - b/2 < 8);
  `prmt` picks four low or high bytes, ten word ops four code bytes (`compress_words`' formulas);
* warp w's lane 0 puts its slot byte in byte w of the group's word1 (shared memory); after one
  warpgroup barrier every thread knows every group's size, places its block in the tile's staging
  buffer (the tile's groups back to back, as they will lie in the payload) and writes its low bytes
  and codes (a raw block: its high bytes) there;
* the tile's offset, in one of two placements:
  - unordered: thread 0 takes it with one relaxed fetch-and-add on the unit counter, issued
    before its staging stores so the round trip runs under them;
  - ordered (block order, the reference's bytes): thread 0 posts the tile's units as its state
    (AGGREGATE) before the staging stores; after them, warp 0 walks back over the predecessors'
    states 32 * look_back_states at a time to the nearest inclusive PREFIX (decoupled look-back, `look_back_window`)
    while warps 1-3 start the next tile, then posts the tile's own PREFIX. A tile waits on
    others, so every CTA must be resident at once (`max_resident_ctas`);
* after a second barrier thread 0 stores the whole tile with one bulk copy of exactly its units
  (`cp.async.bulk.global.shared::cta`, the size in a register). Two staging buffers alternate: a
  tile's store drains under the next tile;
* with `zero_tail`, thread 0 bulk-stores zeros from a zeroed shared buffer over the tile's slack
  (16T units less its own), taken from the payload's end: unordered, the same fetch-and-add (64
  bits: the low word counts units in use from the start, the high word units zeroed from the
  end) reserves both; ordered, the earlier tiles' slack is `16T * tile - offset`. The slacks sum
  to the payload less the units in use, so the zeros cover exactly the unused tail (FORMAT.md §6,
  "rest zero") with no second kernel and no grid-wide wait;
* warp 0's lanes 0 .. T-1 write the group records (offset, slot bytes).

The per-lane arithmetic is written once against an `ops` object (`LaneOps` here builds MLIR; the
tests pass numpy ops and run the same functions over every lane). Interpreted (CPU), the tile's
bytes come from the format's jnp encoder instead (inline MLIR does not interpret), placed by a
running offset in a grid of one CTA, so the ring, the tile indexing and the partial tiles run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compress_words as W
from pallas_kernels.restore_mgpu import (MlirOps, _branch, _c, _eq, _gep, _i32, _load32, _scalar, block_starts_word,
                                         raw_byte_flags)
from zipfusion_jax.format import block as B
from zipfusion_jax.format import codec

NUM_SMS = 132
ROW_U16 = 256  # block rows are copied as [2 * blocks, 256] uint16 (a bulk copy's dims stay <= 256)
BLOCK_BYTES = B.VALUES_PER_BLOCK * 2  # 1 KiB of BF16
GROUP_UNITS = B.BLOCKS_PER_GROUP * B.RAW_UNITS  # 16: a group's worst case
ZERO_CHUNKS = 4  # a tile's slack (<= 16T units) is zeroed in at most 4 bulk stores of <= 4T units
SMEM_BYTES = 227 * 1024  # a Hopper CTA's shared memory

MAGNITUDE = 0x7FFF7FFF
# Ordered placement: a tile's state word (GMEM int32, zero before the kernel) is its flag in the top
# two bits and a unit count below: 0 not yet posted, AGGREGATE | its own units, PREFIX | the units
# of every tile up to and including it.
AGGREGATE, PREFIX, STATE_VALUE = 1 << 30, 2 << 30, (1 << 30) - 1

PTX = {  # the instructions this kernel spells out ($0 the result, then the operands)
    "redux_min": "redux.sync.min.u32 $0, $1, 0xffffffff;",
    "redux_max": "redux.sync.max.u32 $0, $1, 0xffffffff;",
    "min16": "min.u16x2 $0, $1, $2;",
    "max16": "max.u16x2 $0, $1, $2;",
    "atomic_add": "atom.global.relaxed.gpu.add.u64 $0, [$1], $2;",
    "redux_add": "redux.sync.add.u32 $0, $1, 0xffffffff;",
    "load_state": "ld.relaxed.gpu.global.u32 $0, [$1];",
    "post_state": "st.relaxed.gpu.global.u32 [$0], $1;",
    "bulk_store": "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
    "commit": "cp.async.bulk.commit_group;",
    "wait_read_1": "cp.async.bulk.wait_group.read 1;",
    "wait_all": "cp.async.bulk.wait_group 0;",
}


# ---------------------------------------------------------------------------------------------
# Per-lane arithmetic, once for MLIR and numpy.

class LaneOps(MlirOps):
  """MLIR i32 ops for the functions below (`restore_mgpu.MlirOps` plus what the encoder needs)."""

  or_, xor = staticmethod(arith.ori), staticmethod(arith.xori)
  minu = staticmethod(arith.minui)
  maxu = staticmethod(arith.maxui)

  @staticmethod
  def ult(a, b):
    return arith.cmpi(arith.CmpIPredicate.ult, a, b)

  @staticmethod
  def prmt(a, b, select):
    return mu.prmt(a, b, _c(select))

  @staticmethod
  def min16(a, b):
    return mu.inline_ptx(PTX["min16"], a, b, result_types=_i32())

  @staticmethod
  def max16(a, b):
    return mu.inline_ptx(PTX["max16"], a, b, result_types=_i32())

  @staticmethod
  def redux_max(a):
    return mu.inline_ptx(PTX["redux_max"], a, result_types=_i32(), convergent=True)

  @staticmethod
  def redux_add(a):
    return mu.inline_ptx(PTX["redux_add"], a, result_types=_i32(), convergent=True)


def lane_extremes(ops, words):
  """The lane's min and max of `pattern & 0x7fff` over its fragments' words (2 patterns each)."""
  m = [ops.and_(w, ops.const(MAGNITUDE)) for w in words]
  lo, hi = functools.reduce(ops.min16, m), functools.reduce(ops.max16, m)
  half = ops.const(0xFFFF)
  return (ops.minu(ops.and_(lo, half), ops.shr(lo, ops.const(16))),
          ops.maxu(ops.and_(hi, half), ops.shr(hi, ops.const(16))))


def slot_byte(ops, lowest, highest, present):
  """A block's word1 byte from its extreme magnitudes: b/2 if eligible, 0xFF raw, 0xFE absent."""
  hb = ops.shr(lowest, ops.const(8))
  eligible = ops.ult(ops.sub(ops.shr(highest, ops.const(8)), hb), ops.const(8))
  return ops.select(present, ops.select(eligible, hb, ops.const(B.META_RAW)), ops.const(B.META_ABSENT))


def fragment_planes(ops, w, slot):
  """A fragment's 4 words (positions 8k .. 8k+7, two per word) -> (low x, low y, high x or code,
  high y): the two low words at byte 8k, then a compressed block's code word (at 512 + 4k) or a
  raw block's two high words (at 512 + 8k). `slot`: the block's word1 byte."""
  low, high = W.SELECT["low"], W.SELECT["high"]
  lx, ly = ops.prmt(w[0], w[1], low), ops.prmt(w[2], w[3], low)
  hx, hy = ops.prmt(w[0], w[1], high), ops.prmt(w[2], w[3], high)
  code = W.code_word(ops, hx, hy, ops.mul(ops.and_(slot, ops.const(B.MAX_HALF_BASE)), ops.const(0x01010101)))
  raw = ops.eq(slot, ops.const(B.META_RAW))
  return lx, ly, ops.select(raw, hx, code), hy


def group_units(ops, word1):
  """Units a group's 4 slot bytes take: 3 per compressed block, 4 per raw one, 0 per absent one."""
  def count(f):  # flagged bytes (0x80 each) summed into the top byte
    return ops.shr(ops.mul(ops.shr(f, ops.const(7)), ops.const(0x01010101)), ops.const(24))

  # Absent bytes (0xFE) are the raw ones (0xFF) of word1 ^ 0x01010101, which maps 0xFF to 0xFE and
  # keeps every compressed byte <= 0x7F.
  raw = count(raw_byte_flags(ops, word1))
  absent = count(raw_byte_flags(ops, ops.xor(word1, ops.const(0x01010101))))
  return ops.add(ops.mul(ops.sub(ops.const(4), absent), ops.const(3)), raw)


def look_back_window(ops, states, lane, acc):
  """One step of the ordered placement's look-back (decoupled look-back, as in single-pass scans),
  over a warp's window of 32K predecessor states: `states` is K lane arrays, and element j of lane l
  holds the state of tile `end - 32K + K*l + j` (a tile before 0 reads as PREFIX | 0).

  The nearest PREFIX (the highest position holding one) ends the walk: the units of it and of every
  AGGREGATE above it, plus `acc`, are the tile's exclusive prefix. Without one, every state must be
  an AGGREGATE: their sum joins `acc` and the walk goes on 32K tiles further back. A state not yet
  posted (0) above the nearest prefix means the window is read again.

  Returns warp-uniform (retry, found, acc'): retry 1 to read the same window again (acc' then
  meaningless); else found 1 when acc' is the prefix, 0 when acc' is the sum so far.
  """
  c = ops.const
  flags = [ops.shr(s, c(30)) for s in states]
  after = [ops.add(ops.mul(lane, c(len(states))), c(j + 1)) for j in range(len(states))]  # position + 1
  mine = c(0)  # this lane's highest prefix position + 1, 0: none
  for f, a in zip(flags, after):
    mine = ops.select(ops.eq(f, c(PREFIX >> 30)), a, mine)
  top = ops.redux_max(mine)  # the nearest prefix's position + 1 over the warp, 0: none
  missing, total = c(0), c(0)
  for s, f, a in zip(states, flags, after):
    below = ops.ult(a, top)  # below the nearest prefix: not counted
    missing = ops.or_(missing, ops.select(below, c(0), ops.select(ops.eq(f, c(0)), c(1), c(0))))
    total = ops.add(total, ops.select(below, c(0), ops.and_(s, c(STATE_VALUE))))
  return ops.redux_max(missing), ops.select(ops.ult(c(0), top), c(1), c(0)), ops.add(acc, ops.redux_add(total))


def look_back_step(ops, states, lane, end, acc):
  """One pass of the look-back loop over the window of 32K states (`states`: K lane arrays) ending
  at tile `end` (exclusive): -> (end', acc', found', retry). Read the same window again on `retry`,
  the one 32K tiles further back when neither `retry` nor `found'`; `acc'` is the prefix once
  `found'`. The loop of every backend (MLIR on the GPU, jnp interpreted, numpy in the tests) runs
  this step."""
  c = ops.const
  retry, found, summed = look_back_window(ops, states, lane, acc)
  again = ops.eq(retry, c(1))
  moved = ops.select(ops.eq(ops.or_(retry, found), c(1)), end, ops.sub(end, c(32 * len(states))))
  return moved, ops.select(again, acc, summed), ops.select(again, c(0), found), retry


class JnpWarpOps:
  """`look_back_step`'s ops on jnp uint32 [32] (a warp's lanes; `redux.sync` as a reduction over them)."""

  and_, or_, shr, add, sub, mul = jnp.bitwise_and, jnp.bitwise_or, jnp.right_shift, jnp.add, jnp.subtract, jnp.multiply
  select, eq, ult = jnp.where, jnp.equal, jnp.less
  const = staticmethod(jnp.uint32)
  redux_max = staticmethod(lambda a: jnp.broadcast_to(jnp.max(a), a.shape))
  redux_add = staticmethod(lambda a: jnp.broadcast_to(jnp.sum(a, dtype=jnp.uint32), a.shape))


# ---------------------------------------------------------------------------------------------
# The tile, as inline Mosaic GPU code (GPU only).

def _ptx(name, *args, result=True, convergent=False):
  return mu.inline_ptx(PTX[name], *args, result_types=_i32() if result else None,
                       has_side_effects=not result, convergent=convergent)


def _when(cond, fn):
  """Run `fn` (side effects only) under `cond` (an i1)."""
  op = scf.IfOp(cond)
  with ir.InsertionPoint(op.then_block):
    fn()
    scf.yield_([])


def _store(ptr, offset, value):
  """Store `value` (any type) at byte `offset` of `ptr`."""
  llvm.store(value, _gep(ptr, offset))


def _word_ptr(ref, index):
  """The address of int32 word `index` (an i32) of GMEM `ref`."""
  return mu.getelementptr(mu.memref_ptr(ref), [arith.extui(ir.IntegerType.get_signless(64), index)], _i32())


def _look_back(states_ref, tile, lane, per_lane):
  """Warp 0: tile `tile`'s exclusive prefix (units), walking the predecessors' states 32 * per_lane
  at a time (one relaxed load per state; on the H100 a lane's loads ran one after another, so
  per_lane > 1 was slower: `compress_rows`)."""
  i32 = _i32()
  loop = scf.WhileOp([i32, i32, i32], [tile, _c(0), _c(0)])  # (window end, units so far, found)
  before = loop.before.blocks.append(i32, i32, i32)
  with ir.InsertionPoint(before):
    scf.condition(_eq(before.arguments[2], _c(0)), list(before.arguments))
  after = loop.after.blocks.append(i32, i32, i32)
  with ir.InsertionPoint(after):
    end, acc, _ = after.arguments
    first = arith.addi(arith.subi(end, _c(32 * per_lane)), arith.muli(lane, _c(per_lane)))  # lane's first tile
    states = []
    for j in range(per_lane):
      index = arith.addi(first, _c(j))
      before_first = arith.cmpi(arith.CmpIPredicate.slt, index, _c(0))
      loaded = mu.inline_ptx(PTX["load_state"], _word_ptr(states_ref, arith.maxsi(index, _c(0))), result_types=i32,
                             has_side_effects=True)  # read again on every pass: never hoisted or merged
      states.append(arith.select(before_first, LaneOps.const(PREFIX), loaded))
    scf.yield_(list(look_back_step(LaneOps, states, lane, end, acc)[:3]))
  return loop.results[1]


def _vec(*words):
  ty = ir.VectorType.get((len(words),), _i32())
  vec = llvm.mlir_undef(ty)
  for i, w in enumerate(words):
    vec = llvm.insertelement(vec, w, _c(i))
  return vec


def compress_tile(in_ref, staging_ref, word1_smem, zeros_smem, payload_ref, word1_out, offset_out, counter_ref,
                  states_ref, tile, parity, *, tile_groups, num_blocks, zero_tail, ordered, num_tiles, look_back_states):
  """Compress tile `tile` (its rows in `in_ref`, uint16 [8T, 256]) into `staging_ref[parity]`,
  take its offset, store it with one bulk copy (and, with `zero_tail`, zeros over its slack at the
  payload's end), and write its group records.

  Args:
    in_ref: SMEM uint16 [8T, 256] (4T blocks of 512); staging_ref: SMEM uint8 [2, 16T, 256];
    word1_smem: SMEM int32 [>= T]; zeros_smem: SMEM uint8 [4T, 256] of zeros; payload_ref: GMEM
    uint8 [U, 256]; word1_out, offset_out: GMEM int32 [tiles * T]; counter_ref: GMEM int32 [2]
    (units in use, units zeroed; one 8-byte word); states_ref: GMEM int32 [tiles] (`ordered`: the
    look-back states, zeros in); tile, parity: i32 splats.
  """
  T = tile_groups
  ops = LaneOps
  tile, parity = _scalar(tile), _scalar(parity)
  tid = arith.remui(mu.thread_idx(), _c(128))
  warp, lane = arith.shrui(tid, _c(5)), arith.andi(tid, _c(31))
  in_ptr, w1_ptr = mu.memref_ptr(in_ref), mu.memref_ptr(word1_smem)
  first_block = arith.muli(tile, _c(4 * T))
  # 1. The rule of block w of every group, from this lane's two fragments.
  blocks = []
  for g in range(T):
    row = arith.addi(_c(4 * g), warp)
    words = []
    for c in range(2):
      at = arith.addi(arith.muli(row, _c(BLOCK_BYTES)), arith.shli(arith.addi(lane, _c(32 * c)), _c(4)))
      vec = llvm.load(ir.VectorType.get((4,), _i32()), _gep(in_ptr, at))
      words.append([llvm.extractelement(vec, _c(i)) for i in range(4)])
    lowest, highest = lane_extremes(ops, words[0] + words[1])
    lowest = _ptx("redux_min", lowest, convergent=True)
    highest = _ptx("redux_max", highest, convergent=True)
    present = arith.cmpi(arith.CmpIPredicate.ult, arith.addi(first_block, row), _c(num_blocks))
    slot = slot_byte(ops, lowest, highest, present)
    blocks.append((words, slot, present))

    _when(_eq(lane, _c(0)), functools.partial(
        _store, w1_ptr, arith.addi(_c(4 * g), warp), arith.trunci(ir.IntegerType.get_signless(8), slot)))
  leader = _eq(tid, _c(0))
  # The bulk store of tile i - 2 read this staging buffer: it must be done reading.
  _when(leader, lambda: _ptx("wait_read_1", result=False))
  mu.warpgroup_barrier()
  # 2. Every group's size, the tile's offset, this thread's stores into staging.
  word1 = [_load32(w1_ptr, _c(4 * g)) for g in range(T)]
  units = [group_units(ops, w) for w in word1]
  prefix = [_c(0)]
  for u in units:
    prefix.append(arith.addi(prefix[-1], u))
  total = prefix[-1]
  slack = arith.subi(_c(GROUP_UNITS * T), total) if zero_tail else _c(0)
  i64 = ir.IntegerType.get_signless(64)

  def reserve():  # one 64-bit fetch-and-add: units in use += total, units zeroed += slack
    add = arith.ori(arith.shli(arith.extui(i64, slack), mu.c(32, i64)), arith.extui(i64, total))
    old = mu.inline_ptx(PTX["atomic_add"], mu.memref_ptr(counter_ref), add, result_types=i64, has_side_effects=True)
    return [arith.trunci(_i32(), old), arith.trunci(_i32(), arith.shrui(old, mu.c(32, i64)))]

  if ordered:  # post this tile's own units now; its offset comes from the look-back below
    _when(leader, lambda: _ptx("post_state", _word_ptr(states_ref, tile), arith.ori(total, _c(AGGREGATE)),
                               result=False))
  else:
    base, zeroed = _branch(leader, 2, reserve, lambda: [_c(0), _c(0)])
  staging = _gep(mu.memref_ptr(staging_ref), arith.muli(parity, _c(GROUP_UNITS * T * B.UNIT_BYTES)))
  shift = arith.shli(warp, _c(3))
  for g, (words, slot, present) in enumerate(blocks):
    start = arith.addi(prefix[g], arith.andi(arith.shrui(block_starts_word(ops, word1[g]), shift), _c(0xFF)))
    dst = arith.muli(start, _c(B.UNIT_BYTES))

    def put(words=words, slot=slot, dst=dst):
      raw = _eq(slot, _c(B.META_RAW))
      for c in range(2):
        k = arith.addi(lane, _c(32 * c))
        lx, ly, hx_or_code, hy = fragment_planes(ops, words[c], slot)
        _store(staging, arith.addi(dst, arith.shli(k, _c(3))), _vec(lx, ly))
        high = arith.addi(dst, _c(B.LOW_PLANE_BYTES))
        _when(raw, functools.partial(_store, staging, arith.addi(high, arith.shli(k, _c(3))), _vec(hx_or_code, hy)))
        _when(arith.xori(raw, _c(1, ir.IntegerType.get_signless(1))),
              functools.partial(_store, staging, arith.addi(high, arith.shli(k, _c(2))), hx_or_code))

    _when(present, put)
  mu.commit_shared()  # the staging stores reach the async proxy; warpgroup barrier
  if ordered:  # warp 0 walks back to the tile's offset while the other warps start the next tile
    (base,) = _branch(_eq(warp, _c(0)), 1, lambda: [_look_back(states_ref, tile, lane, look_back_states)], lambda: [_c(0)])
    end = arith.addi(base, total)
    _when(leader, lambda: _ptx("post_state", _word_ptr(states_ref, tile), arith.ori(end, LaneOps.const(PREFIX)),
                               result=False))
    _when(arith.andi(leader, _eq(tile, _c(num_tiles - 1))),  # the last tile's prefix: the units in use
          lambda: llvm.store(end, mu.memref_ptr(counter_ref)))
    zeroed = arith.subi(arith.muli(tile, _c(GROUP_UNITS * T)), base)  # earlier tiles' slack, in tile order
  # 3. One bulk store of the tile's units; the group records.
  payload = mu.memref_ptr(payload_ref)

  def store_tile():
    dst = _gep(payload, arith.muli(arith.extui(i64, base), mu.c(B.UNIT_BYTES, i64)))  # 64-bit: no wrap
    _ptx("bulk_store", dst, staging, arith.muli(total, _c(B.UNIT_BYTES)), result=False)

  _when(arith.andi(leader, arith.cmpi(arith.CmpIPredicate.ugt, total, _c(0))), store_tile)
  if zero_tail:
    chunk = 4 * T  # units per zero store (the zeros buffer)
    start = arith.subi(_c(ir.MemRefType(payload_ref.type).shape[0]), arith.addi(zeroed, slack))  # the slack's first unit

    def store_zeros(k):
      size = arith.minsi(arith.subi(slack, _c(k * chunk)), _c(chunk))
      dst = _gep(payload, arith.muli(arith.extui(i64, arith.addi(start, _c(k * chunk))), mu.c(B.UNIT_BYTES, i64)))
      _when(arith.cmpi(arith.CmpIPredicate.sgt, size, _c(0)), lambda: _ptx(
          "bulk_store", dst, mu.memref_ptr(zeros_smem), arith.muli(size, _c(B.UNIT_BYTES)), result=False))

    for k in range(ZERO_CHUNKS):
      _when(leader, functools.partial(store_zeros, k))
  _when(leader, lambda: _ptx("commit", result=False))  # a group per tile (empty for a tile of padding)
  group_base = mu._warp_bcast(base)  # lane 0 of warp 0 holds it; warp 0 uses it

  def records():
    mine_word1, mine_prefix = word1[0], prefix[0]
    for g in range(1, T):
      is_g = _eq(lane, _c(g))
      mine_word1, mine_prefix = arith.select(is_g, word1[g], mine_word1), arith.select(is_g, prefix[g], mine_prefix)
    index = arith.addi(arith.muli(tile, _c(T)), lane)
    llvm.store(arith.addi(group_base, mine_prefix), _word_ptr(offset_out, index))
    llvm.store(mine_word1, _word_ptr(word1_out, index))

  _when(arith.andi(_eq(warp, _c(0)), arith.cmpi(arith.CmpIPredicate.ult, lane, _c(T))), records)


def fill_zeros(zeros_smem):
  """Every thread zeroes its 16-byte words of `zeros_smem` (uint8 [rows, 256]), then the buffer is
  made visible to the bulk copies (fence + warpgroup barrier)."""
  size = ir.MemRefType(zeros_smem.type).shape[0] * B.UNIT_BYTES
  tid = arith.remui(mu.thread_idx(), _c(128))
  zero = _vec(*[_c(0)] * 4)
  for k in range(-(-size // (128 * 16))):
    at = arith.addi(arith.shli(tid, _c(4)), _c(k * 128 * 16))
    _when(arith.cmpi(arith.CmpIPredicate.ult, at, _c(size)),
          functools.partial(_store, mu.memref_ptr(zeros_smem), at, zero))
  mu.commit_shared()


def drain_stores():
  """Thread 0 waits for its bulk stores to finish (the CTA's shared memory must outlive them)."""
  _when(_eq(arith.remui(mu.thread_idx(), _c(128)), _c(0)), lambda: _ptx("wait_all", result=False))


# ---------------------------------------------------------------------------------------------
# Interpreted tile (CPU): the same placement, the bytes from the format's jnp encoder.

def _look_back_interpret(states_ref, tile, per_lane):
  """`_look_back` in jnp: the same loop of `look_back_step`s over the states as they stand."""
  lane = jnp.arange(32, dtype=jnp.uint32)

  def body(carry):
    end, acc, _ = carry
    states = lax.bitcast_convert_type(states_ref[...], jnp.uint32)
    window = []
    for j in range(per_lane):
      index = end.astype(jnp.int32) - 32 * per_lane + per_lane * lane.astype(jnp.int32) + j
      window.append(jnp.where(index < 0, jnp.uint32(PREFIX), states[jnp.maximum(index, 0)]))
    end, acc, found, _ = look_back_step(JnpWarpOps, window, lane, jnp.broadcast_to(end, (32,)),
                                        jnp.broadcast_to(acc, (32,)))
    return end[0], acc[0], found[0]

  start = (tile.astype(jnp.uint32), jnp.uint32(0), jnp.uint32(0))
  return lax.while_loop(lambda carry: carry[2] == 0, body, start)[1].astype(jnp.int32)


def _tile_interpret(in_ref, payload_ref, word1_out, offset_out, counter_ref, states_ref, tile, *, tile_groups,
                    num_blocks, zero_tail, ordered, num_tiles, look_back_states):
  """What `compress_tile` does to GMEM, in jnp: tiles run in order (one CTA), so the counters are a
  plain read-modify-write (ordered: the tile posts its state, walks back with the GPU's loop steps
  and posts its prefix), and the tile's units are stored as a fixed 16T-unit window whose slack
  the next tile (or the tail zeros) overwrites. That window never reaches zeros already stored: a
  tile's window ends at most where the earlier tiles' zeros begin (what they used and zeroed sums
  to 16T per tile)."""
  T = tile_groups
  bits = in_ref[...].reshape(4 * T, B.VALUES_PER_BLOCK)
  index = tile * 4 * T + jnp.arange(4 * T)
  eligible, hb = B.block_half_base(bits)
  meta = jnp.where(index < num_blocks, B.block_meta_byte(eligible, hb), B.META_ABSENT)
  rows = B.encode_rows(bits, meta).reshape(4 * T * B.RAW_UNITS, B.UNIT_BYTES)
  sizes = B.block_units(meta)
  ends = jnp.cumsum(sizes)
  unit = jnp.arange(GROUP_UNITS * T)
  owner = jnp.minimum(jnp.sum(unit[:, None] >= ends[None, :], axis=1), 4 * T - 1)  # the block holding each unit
  within = jnp.clip(unit - (ends - sizes)[owner], 0, B.RAW_UNITS - 1)
  window = GROUP_UNITS * T
  if ordered:
    states_ref[pl.ds(tile, 1)] = jnp.full((1,), AGGREGATE, jnp.int32) | ends[-1]
    base = _look_back_interpret(states_ref, tile, look_back_states)
    states_ref[pl.ds(tile, 1)] = lax.bitcast_convert_type(jnp.full((1,), PREFIX, jnp.uint32) | (base + ends[-1]).astype(
        jnp.uint32), jnp.int32)
    counter_ref[0] = jnp.where(tile == num_tiles - 1, base + ends[-1], counter_ref[0])
    zeroed = tile * window - base  # the earlier tiles' slack
  else:
    base, zeroed = counter_ref[0], counter_ref[1]
    counter_ref[0] = base + ends[-1]
  payload_ref[pl.ds(base, window)] = rows[owner * B.RAW_UNITS + within]
  if zero_tail:  # zeros over [capacity - zeroed - slack, capacity - zeroed), as a masked 16T-unit window
    capacity = payload_ref.shape[0]
    zeroed = zeroed + window - ends[-1]
    first = capacity - zeroed
    start = jnp.minimum(first, capacity - window)
    unit = start + jnp.arange(window)
    payload_ref[pl.ds(start, window)] = jnp.where((unit >= first)[:, None], jnp.uint8(0),
                                                  payload_ref[pl.ds(start, window)])
    counter_ref[1] = zeroed
  group_meta = meta.reshape(T, B.BLOCKS_PER_GROUP)
  word1_out[pl.ds(tile * T, T)] = codec.pack_meta_bytes(group_meta).astype(jnp.int32)
  group_ends = ends.reshape(T, B.BLOCKS_PER_GROUP)[:, -1]
  offset_out[pl.ds(tile * T, T)] = base + group_ends - sizes.reshape(T, -1).sum(axis=1)


# ---------------------------------------------------------------------------------------------
# The kernel.

def _kernel(bits_ref, counter_ref, states_ref, payload_ref, word1_out, offset_out, in_smem, staging, word1_smem,
            zeros_smem, bars, *, tiles, ctas, tile_groups, stages, num_blocks, zero_tail, ordered, look_back_states,
            interpret):
  """bits_ref: GMEM uint16 [tiles * 8T, 256] (block rows); counter_ref: GMEM int32 [2], zeros in,
  (units in use, units zeroed) out (a mutable ref); states_ref: GMEM int32 [tiles] (`ordered`; else
  [1], unused), zeros in; payload_ref: GMEM uint8 [tiles * 16T, 256];
  word1_out, offset_out: GMEM int32 [tiles * T]. Scratch: in_smem uint16 [stages, 8T, 256], staging
  uint8 [2, 16T, 256], word1_smem int32 [max(T, 4)], zeros_smem uint8 [4T, 256], bars: `stages`
  barriers."""
  rows = 8 * tile_groups
  cta = lax.axis_index("c")
  my_tiles = (tiles - cta + ctas - 1) // ctas

  def load(i):
    plgpu.copy_gmem_to_smem(bits_ref.at[pl.ds((cta + i * ctas) * rows, rows)], in_smem.at[lax.rem(i, stages)],
                            bars.at[lax.rem(i, stages)])

  for i in range(stages):
    pl.when(i < my_tiles)(functools.partial(load, i))

  splat = plgpu.Layout.WG_SPLAT(shape=())
  ref = plgpu.RefType()
  if zero_tail and not interpret:
    plgpu.inline_mgpu(arg_types=(ref,))(lambda ctx, zeros: fill_zeros(zeros))(zeros_smem)

  def body(i, carry):
    stage = lax.rem(i, stages)
    plgpu.barrier_wait(bars.at[stage])
    tile = cta + i * ctas
    if interpret:
      _tile_interpret(in_smem.at[stage], payload_ref, word1_out, offset_out, counter_ref, states_ref, tile,
                      tile_groups=tile_groups, num_blocks=num_blocks, zero_tail=zero_tail, ordered=ordered,
                      num_tiles=tiles, look_back_states=look_back_states)
    else:
      plgpu.inline_mgpu(arg_types=(ref,) * 9 + (splat, splat))(
          lambda ctx, *args: compress_tile(*args, tile_groups=tile_groups, num_blocks=num_blocks,
                                           zero_tail=zero_tail, ordered=ordered, num_tiles=tiles,
                                           look_back_states=look_back_states))(
              in_smem.at[stage], staging, word1_smem, zeros_smem, payload_ref, word1_out, offset_out, counter_ref,
              states_ref, tile, lax.rem(i, 2))
    pl.when(i + stages < my_tiles)(functools.partial(load, i + stages))  # every thread is past the stage's reads
    return carry

  lax.fori_loop(0, my_tiles, body, 0)
  if not interpret:
    plgpu.inline_mgpu()(lambda ctx: drain_stores())()


def smem_bytes(tile_groups: int, stages: int, zero_tail: bool = True) -> int:
  """Shared memory a CTA's buffers take (the ring, two staging buffers and the zeros); raises
  ValueError when it passes a Hopper CTA's."""
  T = tile_groups
  smem = (stages + 2) * T * B.BLOCKS_PER_GROUP * BLOCK_BYTES + (4 * T if zero_tail else 1) * B.UNIT_BYTES
  if smem > SMEM_BYTES:
    raise ValueError(f"tile_groups={T} with stages={stages} needs {smem} bytes of shared memory per CTA "
                     f"(> {SMEM_BYTES}): fewer groups per tile (4 measured best with 4 stages) or fewer stages")
  return smem


def max_resident_ctas(smem: int, num_sms: int = NUM_SMS) -> int:
  """CTAs whose buffers take `smem` bytes that are surely resident at once: per SM, as many as its
  228 KiB of shared memory holds with 4 KiB to spare each (the group words, barriers, alignment
  and the 1 KiB the driver reserves), at most two (128 threads at up to 255 registers take half of
  the SM's 65,536)."""
  return num_sms * min(2, (228 * 1024) // (smem + 4096))


def _num_sms() -> int:
  """The GPU's SM count (132 on the H100 SXM and the H200; also off-GPU, for lowering)."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return NUM_SMS
  return getattr(device, "core_count", None) or NUM_SMS


def compress_rows(bits2d, num_blocks: int, *, tile_groups: int = 4, stages: int = 4, ctas: int = 0,
                  zero_tail: bool = True, ordered: bool = False, look_back_states: int = 1, interpret: bool = False):
  """bits2d uint16 [N, 512] (N a multiple of 4 * tile_groups; rows >= num_blocks are padding) ->
  (payload uint8 [N // 4 * 16, 256], word1 int32 [N // 4], group offsets int32 [N // 4], units in use int32 [1]).

  Unordered, groups lie in the payload in the order their tiles took the counter (any order is
  valid, FORMAT.md §6). `ordered`: in block order, the reference's bytes: each tile posts its
  units and walks back over its predecessors' states for its offset (decoupled look-back), so
  every CTA must be resident at once (it waits on the others): at most `max_resident_ctas`.
  Bytes past the units in use are zero with `zero_tail`, else unspecified. ctas: persistent CTAs
  (0: two per SM unordered, one per SM ordered); interpreted, always one, so tiles run in order.
  look_back_states: `ordered`: states each lane of the walking warp reads per pass (a power of
  two). More than one per lane were slower on the H100 (2026-12-07: 8 per lane 1916 against 1124 us
  per GiB): each lane's relaxed loads ran one after another, not together.
  """
  T = tile_groups
  groups = bits2d.shape[0] // B.BLOCKS_PER_GROUP
  if not 1 <= T <= 32:
    raise ValueError(f"tile_groups={T} must be in [1, 32] (warp 0's lanes write the group records)")
  if groups % T:
    raise ValueError(f"{bits2d.shape[0]} block rows are not whole tiles of {T} groups")
  tiles = groups // T
  smem = smem_bytes(T, stages, zero_tail)
  sms = _num_sms()
  if ordered and ctas > max_resident_ctas(smem, sms):
    raise ValueError(f"ordered placement waits on every CTA: ctas={ctas} exceeds the "
                     f"{max_resident_ctas(smem, sms)} surely resident at once")
  ctas = 1 if interpret else min(ctas or (1 if ordered else 2) * sms, tiles)
  if look_back_states <= 0 or look_back_states & (look_back_states - 1):
    raise ValueError(f"look_back_states={look_back_states} must be a power of two")
  rows = 8 * T
  counter = jax.new_ref(jnp.zeros((2,), jnp.int32))
  states = jax.new_ref(jnp.zeros((tiles if ordered else 1,), jnp.int32))
  payload, word1, offsets = plgpu.kernel(
      functools.partial(_kernel, tiles=tiles, ctas=ctas, tile_groups=T, stages=stages, num_blocks=num_blocks,
                        zero_tail=zero_tail, ordered=ordered, look_back_states=look_back_states, interpret=interpret),
      out_type=(
          jax.ShapeDtypeStruct((groups * GROUP_UNITS, B.UNIT_BYTES), jnp.uint8),
          jax.ShapeDtypeStruct((groups,), jnp.int32),
          jax.ShapeDtypeStruct((groups,), jnp.int32),
      ),
      scratch_types=(
          plgpu.SMEM((stages, rows, ROW_U16), jnp.uint16),
          plgpu.SMEM((2, GROUP_UNITS * T, B.UNIT_BYTES), jnp.uint8),
          plgpu.SMEM((max(T, 4),), jnp.int32),
          plgpu.SMEM((4 * T if zero_tail else 1, B.UNIT_BYTES), jnp.uint8),
          plgpu.Barrier(num_barriers=stages),
      ),
      grid=(ctas,),
      grid_names=("c",),
      kernel_name="zipfusion_compress_tma",
      # Ordered, warp 0 walks back after the staging stores: without the barrier Pallas puts before
      # each TMA load, warps 1-3 go on to the next tile's rule meanwhile. The slot a load refills
      # was last read before the tile's first warpgroup barrier, which every thread has passed.
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                           unsafe_no_auto_barriers=ordered),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
  )(bits2d.reshape(-1, ROW_U16), counter, states)
  return payload, word1, offsets, counter[...][:1]

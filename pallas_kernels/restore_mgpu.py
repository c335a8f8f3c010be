"""In-register restore of 12-bit KV groups into the BF16 SMEM tiles the attention wgmmas read.

Mosaic GPU code for `plgpu.inline_mgpu`, run by the consumer warpgroup of
`decode_attention.py` once per 4-page step. Everything here is per-thread
integer work on 32-bit words (docs/FORMAT.md §3-§4):

* thread (warp w, lane) owns, for a 16x16 fragment tile `c` of block `j`, the
  fragment index `k = 32c + lane`: its 8 low bytes are the two words at byte
  `8k`, its code word is at `512 + 4k` (raw block: high words at `512 + 8k`);
* `Hx = (w & 0x87878787) + hb * 0x01010101`,
  `Hy = ((w >> 4) & 0x07070707 | (w << 4) & 0x80808080) + hb * 0x01010101`,
  and `prmt(L, H, 0x5140 / 0x7362)` interleave low and high bytes into the
  BF16 pairs `{a0 a1}, {a2 a3}` (and `{a4 a5}, {a6 a7}` from `Ly, Hy`);
* K pairs are (token, 2 adjacent dims): one 32-bit store each into the
  (8, 64)-tiled, 128-byte-swizzled `[64, D]` K stage; warp w restores page slot w.
* V pairs are (dim, 2 adjacent tokens): two 16-bit stores into the V stage of
  the same layout; warp w restores dims `16w + 64m` of every page slot.

Slots that hold the raw tail page (copied as BF16 by TMA) are skipped; slots
past the sequence get zero V (masked probabilities are 0 and 0 * garbage could
be NaN). The uncompressed path calls `zero_absent_v` only, so both paths run
the same attention on the same tile layout.
"""

from __future__ import annotations

import functools

import jax.experimental.mosaic.gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf
from jax.experimental.mosaic.gpu import utils as mu

PAGES_PER_STEP = 4
TILE_ROWS, TILE_COLS = 8, 64  # bf16 SMEM tiling; 128-byte swizzle
TILE_BYTES = TILE_ROWS * TILE_COLS * 2
UNIT = 256
RAW = 0xFF
# Per-slot flag bits in the info words the producer writes.
FLAG_PAGE = 1  # a completed (compressed / BF16) page
FLAG_TAIL = 2  # the raw tail page, already BF16 in the stage
# neither: the slot lies past the sequence (or the split)


def _i32():
  return ir.IntegerType.get_signless(32)


def _c(v):
  return mu.c(v, _i32())


def _add(*xs):
  return functools.reduce(arith.addi, xs)


def _swizzled_offset(row, dim, head_dim):
  """Byte offset of bf16 element (row, dim) in a [64, D] (8, 64)-tiled, 128B-swizzled tile.

  `row` and `dim` are i32 values or ints; the 16-byte chunk index is XORed
  with the row inside its 8-row tile (Mosaic's 128-byte swizzle).
  """
  tiles_per_row = head_dim // TILE_COLS
  tile = arith.addi(arith.muli(arith.shrui(row, _c(3)), _c(tiles_per_row)), arith.shrui(dim, _c(6)))
  r = arith.andi(row, _c(7))
  col = arith.andi(dim, _c(63))
  chunk = arith.xori(arith.shrui(col, _c(3)), r)
  return _add(arith.muli(tile, _c(TILE_BYTES)), arith.muli(r, _c(128)), arith.muli(chunk, _c(16)),
              arith.muli(arith.andi(col, _c(7)), _c(2)))


def _gep(ptr, offset):
  return mu.getelementptr(ptr, [offset], ir.IntegerType.get_signless(8))


def _load32(ptr, offset):
  return llvm.load(_i32(), _gep(ptr, offset))


def _if(cond):
  op = scf.IfOp(cond)
  return op


def _decode_fragment(block_ptr, k, slot_byte):
  """The 4 BF16 pairs (as i32) of fragment `k` of the block at `block_ptr`.

  slot_byte: i32 0..127 (compressed, = b/2) or 0xFF (raw).
  Returns [{a0a1}, {a2a3}, {a4a5}, {a6a7}].
  """
  lo_off = arith.muli(k, _c(8))
  lx = _load32(block_ptr, lo_off)
  ly = _load32(block_ptr, arith.addi(lo_off, _c(4)))
  code = _load32(block_ptr, _add(_c(512), arith.muli(k, _c(4))))
  bias = arith.muli(arith.andi(slot_byte, _c(0x7F)), _c(0x01010101))
  hx_c = arith.addi(arith.andi(code, _c(0x87878787 - (1 << 32))), bias)
  hy_c = arith.addi(
      arith.ori(arith.andi(arith.shrui(code, _c(4)), _c(0x07070707)),
                arith.andi(arith.shli(code, _c(4)), _c(0x80808080 - (1 << 32)))),
      bias,
  )
  raw_off = _add(_c(512), lo_off)
  hx_r = _load32(block_ptr, raw_off)
  hy_r = _load32(block_ptr, arith.addi(raw_off, _c(4)))
  is_raw = arith.cmpi(arith.CmpIPredicate.eq, slot_byte, _c(RAW))
  hx = arith.select(is_raw, hx_r, hx_c)
  hy = arith.select(is_raw, hy_r, hy_c)
  lo_sel, hi_sel = _c(0x5140), _c(0x7362)
  return [mu.prmt(lx, hx, lo_sel), mu.prmt(lx, hx, hi_sel), mu.prmt(ly, hy, lo_sel), mu.prmt(ly, hy, hi_sel)]


def _block_starts(word1, nblocks):
  """Unit offsets of the blocks of a group inside its stage slot (raw: 4 units, else 3)."""
  starts, acc = [], _c(0)
  for j in range(nblocks):
    starts.append(acc)
    byte = arith.andi(arith.shrui(word1, _c(8 * j)), _c(0xFF))
    size = arith.select(arith.cmpi(arith.CmpIPredicate.eq, byte, _c(RAW)), _c(4), _c(3))
    acc = arith.addi(acc, size)
  return starts


def _slot_byte(word1, j):
  return arith.andi(arith.shrui(word1, _c(8 * j)), _c(0xFF))


def _store32(ptr, offset, value):
  llvm.store(value, _gep(ptr, offset))


def _store16(ptr, offset, value):
  llvm.store(arith.trunci(ir.IntegerType.get_signless(16), value), _gep(ptr, offset))


def _thread():
  tid = arith.remui(mu.thread_idx(), _c(128))
  return arith.shrui(tid, _c(5)), arith.andi(tid, _c(31))


def _scalar(x):
  """The i32 value of a splat FragmentedArray scalar argument."""
  if isinstance(x, ir.Value):
    return x
  (reg,) = x.registers.flat
  return reg


def restore_step(byte_ref, k_ref, v_ref, infos, *, head_dim):
  """Restore one step's compressed pages into the K and V stages.

  Args:
    byte_ref: memref uint8 [2 (K, V), 4 slots, 4 * nb units, 256], this step's groups.
    k_ref, v_ref: memrefs bf16 [64, D] ((8, 64) tiles, 128B swizzle).
    infos: per slot (flags, k_word1, v_word1) i32 values (splat arrays).
  """
  nblocks = head_dim // 32
  warp, lane = _thread()
  g, t = arith.shrui(lane, _c(2)), arith.andi(lane, _c(3))
  byte_ptr, k_ptr, v_ptr = mu.memref_ptr(byte_ref), mu.memref_ptr(k_ref), mu.memref_ptr(v_ref)
  slot_bytes = 4 * nblocks * UNIT
  infos = [tuple(_scalar(x) for x in info) for info in infos]

  # K: warp w restores page slot w. Select this warp's slot info.
  flags = infos[0][0]
  kw1 = infos[0][1]
  for s in range(1, PAGES_PER_STEP):
    is_s = arith.cmpi(arith.CmpIPredicate.eq, warp, _c(s))
    flags = arith.select(is_s, infos[s][0], flags)
    kw1 = arith.select(is_s, infos[s][1], kw1)
  is_page = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(flags, _c(FLAG_PAGE)), _c(0))
  op = scf.IfOp(is_page)
  with ir.InsertionPoint(op.then_block):
    slot_ptr = _gep(byte_ptr, arith.muli(warp, _c(slot_bytes)))  # kind 0 (K), slot w
    starts = _block_starts(kw1, nblocks)
    row0 = _add(arith.muli(warp, _c(16)), g)
    for j in range(nblocks):
      block_ptr = _gep(slot_ptr, arith.muli(starts[j], _c(UNIT)))
      hb = _slot_byte(kw1, j)
      for c in range(2):
        k = arith.addi(_c(32 * c), lane)
        pairs = _decode_fragment(block_ptr, k, hb)
        dim0 = arith.addi(_c(32 * j + 16 * c), arith.muli(t, _c(2)))
        for i, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
          off = _swizzled_offset(arith.addi(row0, _c(dr)), arith.addi(dim0, _c(dc)), head_dim)
          _store32(k_ptr, off, pairs[i])
    scf.yield_([])

  # V: warp w restores dims 16w + 64m (+0..15) of every slot: block j = 2m + w // 2, tile c = w % 2.
  c_tile = arith.andi(warp, _c(1))
  for s in range(PAGES_PER_STEP):
    flags, _, vw1 = infos[s]
    is_page = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(flags, _c(FLAG_PAGE)), _c(0))
    absent = arith.cmpi(arith.CmpIPredicate.eq, flags, _c(0))
    op = scf.IfOp(arith.ori(is_page, absent))
    with ir.InsertionPoint(op.then_block):
      slot_ptr = _gep(byte_ptr, _c((PAGES_PER_STEP + s) * slot_bytes))  # kind 1 (V), slot s
      starts = _block_starts(vw1, nblocks)
      k = arith.addi(arith.muli(c_tile, _c(32)), lane)
      tok0 = _add(_c(16 * s), arith.muli(t, _c(2)))
      for m in range(head_dim // 64):
        j_dyn = arith.addi(_c(2 * m), arith.shrui(warp, _c(1)))
        start = starts[0]
        hb = _slot_byte(vw1, 0)
        for j in range(1, nblocks):
          is_j = arith.cmpi(arith.CmpIPredicate.eq, j_dyn, _c(j))
          start = arith.select(is_j, starts[j], start)
          hb = arith.select(is_j, _slot_byte(vw1, j), hb)
        block_ptr = _gep(slot_ptr, arith.muli(start, _c(UNIT)))
        pairs = _decode_fragment(block_ptr, k, hb)
        pairs = [arith.select(absent, _c(0), p) for p in pairs]
        dim = _add(_c(64 * m), arith.muli(warp, _c(16)), g)
        for i, (dd, dt) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
          d = arith.addi(dim, _c(dd))
          tok = arith.addi(tok0, _c(dt))
          _store16(v_ptr, _swizzled_offset(tok, d, head_dim), pairs[i])
          _store16(v_ptr, _swizzled_offset(arith.addi(tok, _c(1)), d, head_dim), arith.shrui(pairs[i], _c(16)))
      scf.yield_([])


def zero_absent_v(v_ref, infos, *, head_dim):
  """Zero the V rows of slots past the sequence (uncompressed path; TMA never wrote them)."""
  warp, lane = _thread()
  v_ptr = mu.memref_ptr(v_ref)
  infos = [tuple(_scalar(x) for x in info) for info in infos]
  for s in range(PAGES_PER_STEP):
    absent = arith.cmpi(arith.CmpIPredicate.eq, infos[s][0], _c(0))
    op = scf.IfOp(absent)
    with ir.InsertionPoint(op.then_block):
      # 16 tokens x D dims = 16 * D / 2 words; 128 threads store 4-byte zeros.
      tid = arith.addi(arith.muli(warp, _c(32)), lane)
      for it in range(16 * head_dim // 2 // 128):
        word = arith.addi(tid, _c(128 * it))
        tok = arith.addi(_c(16 * s), arith.divui(word, _c(head_dim // 2)))
        dim = arith.muli(arith.remui(word, _c(head_dim // 2)), _c(2))
        _store32(v_ptr, _swizzled_offset(tok, dim, head_dim), _c(0))
      scf.yield_([])

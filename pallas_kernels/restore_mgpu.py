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


def _decode_fragment(block_ptr, lane, c, slot_byte):
  """The 4 BF16 pairs (as i32) of fragment `k = 32c + lane` of the block at `block_ptr`.

  slot_byte: i32 0..127 (compressed, = b/2) or 0xFF (raw); uniform across the warp.
  Returns [{a0a1}, {a2a3}, {a4a5}, {a6a7}].
  """
  i32 = _i32()
  lo_off = arith.addi(arith.shli(lane, _c(3)), _c(256 * c))  # 8k
  lx = _load32(block_ptr, lo_off)
  ly = _load32(block_ptr, arith.addi(lo_off, _c(4)))
  is_raw = arith.cmpi(arith.CmpIPredicate.eq, slot_byte, _c(RAW))
  op = scf.IfOp(is_raw, [i32, i32], has_else=True)
  with ir.InsertionPoint(op.then_block):  # raw: the high bytes are stored verbatim at 512 + 8k
    raw_off = arith.addi(lo_off, _c(512))
    scf.yield_([_load32(block_ptr, raw_off), _load32(block_ptr, arith.addi(raw_off, _c(4)))])
  with ir.InsertionPoint(op.else_block):  # compressed: one code word at 512 + 4k
    code = _load32(block_ptr, arith.addi(arith.shli(lane, _c(2)), _c(512 + 128 * c)))
    bias = arith.muli(slot_byte, _c(0x01010101))
    hx = arith.addi(arith.andi(code, _c(0x87878787 - (1 << 32))), bias)
    hy = arith.addi(
        arith.ori(arith.andi(arith.shrui(code, _c(4)), _c(0x07070707)),
                  arith.andi(arith.shli(code, _c(4)), _c(0x80808080 - (1 << 32)))),
        bias,
    )
    scf.yield_([hx, hy])
  hx, hy = op.results
  lo_sel, hi_sel = _c(0x5140), _c(0x7362)
  return [mu.prmt(lx, hx, lo_sel), mu.prmt(lx, hx, hi_sel), mu.prmt(ly, hy, lo_sel), mu.prmt(ly, hy, hi_sel)]


def _decode_fragment_dyn_c(block_ptr, lane, c_dyn, slot_byte):
  """`_decode_fragment` with the tile index `c` a (warp-uniform) i32 value."""
  return _decode_fragment(block_ptr, arith.addi(lane, arith.shli(c_dyn, _c(5))), 0, slot_byte)


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
  """Restore one step's compressed pages into the K and V stages (one warpgroup does both).

  Args:
    byte_ref: memref uint8 [2 (K, V), 4 slots, 4 * nb units, 256], this step's groups.
    k_ref, v_ref: memrefs bf16 [64, D] ((8, 64) tiles, 128B swizzle).
    infos: per slot (flags, k_word1, v_word1) i32 values (splat arrays).
  """
  restore_k(byte_ref, k_ref, infos, head_dim=head_dim)
  restore_v(byte_ref, v_ref, infos, head_dim=head_dim)


def _setup(byte_ref, out_ref, infos, head_dim):
  warp, lane = _thread()
  g, t = arith.shrui(lane, _c(2)), arith.andi(lane, _c(3))
  infos = [tuple(_scalar(x) for x in info) for info in infos]
  return warp, lane, g, t, mu.memref_ptr(byte_ref), mu.memref_ptr(out_ref), 4 * (head_dim // 32) * UNIT, infos


def restore_k(byte_ref, k_ref, infos, *, head_dim):
  """K half of `restore_step`: warp w restores page slot w into the K stage."""
  nblocks = head_dim // 32
  warp, lane, g, t, byte_ptr, k_ptr, slot_bytes, infos = _setup(byte_ref, k_ref, infos, head_dim)
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
    # Byte offset of (token 16w + g + 8h, dim 32j + 16c + 2t + 8e) in the swizzled tile:
    # thread part w*2*tpr*1024 + g*128 + 4t, static part, and the swizzle term (chunk*16) ^ (g*16).
    tpr = head_dim // TILE_COLS
    base = _add(arith.muli(warp, _c(2 * tpr * TILE_BYTES)), arith.shli(g, _c(7)), arith.shli(t, _c(2)))
    g16 = arith.shli(g, _c(4))
    for j in range(nblocks):
      block_ptr = _gep(slot_ptr, arith.muli(starts[j], _c(UNIT)))
      hb = _slot_byte(kw1, j)
      for c in range(2):
        pairs = _decode_fragment(block_ptr, lane, c, hb)
        for i, (h, e) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
          dim = 32 * j + 16 * c + 8 * e
          static = (h * tpr + dim // TILE_COLS) * TILE_BYTES
          chunk16 = ((dim % TILE_COLS) // 8) * 16
          off = _add(base, _c(static), arith.xori(g16, _c(chunk16)))
          _store32(k_ptr, off, pairs[i])
    scf.yield_([])



def restore_v(byte_ref, v_ref, infos, *, head_dim):
  """V half of `restore_step` (slots past the sequence get zeros)."""
  nblocks = head_dim // 32
  warp, lane, g, t, byte_ptr, v_ptr, slot_bytes, infos = _setup(byte_ref, v_ref, infos, head_dim)
  # V: warp w restores dims 16w + 64m (+0..15) of every slot: block j = 2m + w // 2, tile c = w % 2.
  # Byte offset of (token 16s + 2t + 8e + u, dim 64m + 16w + g + 8h): rows r = 2t + u, chunk
  # 2w + h, so the swizzle term is 32 (w ^ t) + 16 (h ^ u); thread part 2g + 256t + 32 (w ^ t).
  c_tile = arith.andi(warp, _c(1))
  tpr = head_dim // TILE_COLS
  v_base = _add(arith.shli(g, _c(1)), arith.shli(t, _c(8)), arith.shli(arith.xori(warp, t), _c(5)))
  for s in range(PAGES_PER_STEP):
    flags, _, vw1 = infos[s]
    is_page = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(flags, _c(FLAG_PAGE)), _c(0))
    absent = arith.cmpi(arith.CmpIPredicate.eq, flags, _c(0))
    op = scf.IfOp(arith.ori(is_page, absent))
    with ir.InsertionPoint(op.then_block):
      slot_ptr = _gep(byte_ptr, _c((PAGES_PER_STEP + s) * slot_bytes))  # kind 1 (V), slot s
      starts = _block_starts(vw1, nblocks)
      for m in range(head_dim // 64):
        j_dyn = arith.addi(_c(2 * m), arith.shrui(warp, _c(1)))
        start = starts[0]
        hb = _slot_byte(vw1, 0)
        for j in range(1, nblocks):
          is_j = arith.cmpi(arith.CmpIPredicate.eq, j_dyn, _c(j))
          start = arith.select(is_j, starts[j], start)
          hb = arith.select(is_j, _slot_byte(vw1, j), hb)
        block_ptr = _gep(slot_ptr, arith.muli(start, _c(UNIT)))
        pairs = _decode_fragment_dyn_c(block_ptr, lane, c_tile, hb)
        pairs = [arith.select(absent, _c(0), p) for p in pairs]
        for i, (h, e) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
          for u in range(2):  # the pair's two tokens: 2t + 8e + u
            static = ((2 * s + e) * tpr + m) * TILE_BYTES + 128 * u + 16 * (h ^ u)
            value = pairs[i] if u == 0 else arith.shrui(pairs[i], _c(16))
            _store16(v_ptr, arith.addi(v_base, _c(static)), value)
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

"""In-register restore of 12-bit KV groups into the wgmma A-operand fragments of decode attention.

Mosaic GPU code for `plgpu.inline_mgpu`, run by the consumer warpgroup of
`decode_attention.py` once per 4-page step. The format's fragment order
(docs/FORMAT.md §3) is the A-operand order of a register wgmma, so restored
values never touch shared memory: the kernel computes `S^T = K Q^T` with K
`[64 tokens, D]` and `O^T += V^T P^T` with V^T `[D, 64 tokens]` as register
A operands. Everything here is per-thread integer work on 32-bit words
(docs/FORMAT.md §3-§4):

* thread (warp w, lane) owns, for a 16x16 fragment tile `c` of block `j`, the
  fragment index `k = 32c + lane`: its 8 low bytes are the two words at byte
  `8k`, its code word is at `512 + 4k` (raw block: high words at `512 + 8k`);
* `Hx = (w & 0x87878787) + hb * 0x01010101`,
  `Hy = ((w >> 4) & 0x07070707 | (w << 4) & 0x80808080) + hb * 0x01010101`,
  and `prmt(L, H, 0x5140 / 0x7362)` interleave low and high bytes into the
  BF16 pairs `{a0 a1}, {a2 a3}` (and `{a4 a5}, {a6 a7}` from `Ly, Hy`), which
  are the fragment's four A registers in wgmma order;
* K: warp w holds the 16 tokens of page slot w (rows 16w..16w+15 of K);
  V^T: warp w holds dims `64m + 16w + (0..15)` of every slot (M-group m).

A slot holding the sequence's raw tail page has it TMA-copied as BF16 bytes, in
natural `[16, D]` order, into its own byte-stage slot (a slot holds 4 * nb units =
16 * D * 2 bytes, exactly one BF16 page), and reads it from there; a slot past the sequence gives
zeros in V (masked probabilities are 0, and 0 * garbage could be NaN) and whatever its stale bytes
decode to in K (those scores are masked by a select). Every branch is warp-uniform.
"""

from __future__ import annotations

import functools

import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf, vector
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mu

from zipfusion_jax.format import block as FB

PAGES_PER_STEP = 4
PAGE = 16
TILE_ROWS, TILE_COLS = 8, 64  # bf16 SMEM tiling; 128-byte swizzle
TILE_BYTES = TILE_ROWS * TILE_COLS * 2
UNIT = 256
RAW = FB.META_RAW  # the slot byte of a raw block
# Per-slot flag bits in the info words the producer writes.
FLAG_PAGE = 1  # a completed (compressed / BF16) page
FLAG_TAIL = 2  # the raw tail page, BF16 in its byte-stage slot (or the tile)
# neither: the slot lies past the sequence (or the split)
# Info record words per slot (page_prefetch_mgpu.info_words): 3 in version 1 (flags, K word1, V word1);
INFO_WORDS_V2 = 7  # version 2 adds K word2, K word3, V word2, V word3 (exception entries)
# With `DecodeConfig(exception_fold="producer")` version 2's record then holds, from word FOLDED_BASE, each block's exception folded into bias
# words (`block_exception_words`: hit_x, hit_y, target), per kind (K, V) and block j (0..3): the
# producer computes them once per step, so the consumer's version-2 surcharge is three shared loads
# per block and one compare and two selects per fragment.
FOLDED_BASE = 8
FOLDED_PER_BLOCK = 3
RECORD_WORDS_V2 = FOLDED_BASE + 2 * 4 * FOLDED_PER_BLOCK  # 32: one word per producer thread per slot


def folded_position(ops, word):
  """The inverse of `folded_word` for a record word index (`ops`: MLIR or numpy): (is_folded,
  kind, j, which); words below FOLDED_BASE give is_folded false and block 0's position."""
  c = ops.const
  is_folded = ops.lt(c(FOLDED_BASE - 1), word)
  k = ops.select(is_folded, ops.sub(word, c(FOLDED_BASE)), c(0))
  block, which = ops.div(k, c(FOLDED_PER_BLOCK)), ops.rem(k, c(FOLDED_PER_BLOCK))
  return is_folded, ops.shr(block, c(2)), ops.and_(block, c(3)), which


def folded_word(kind: int, j, which: int = 0):
  """Index in a version-2 slot record of block j's (K: kind 0, V: 1) folded word `which` (0: hit_x,
  1: hit_y, 2: target); j an int or an i32 value."""
  if isinstance(j, int):
    return FOLDED_BASE + (4 * kind + j) * FOLDED_PER_BLOCK + which
  return arith.addi(arith.muli(j, _c(FOLDED_PER_BLOCK)), _c(FOLDED_BASE + 4 * kind * FOLDED_PER_BLOCK + which))


def _i32():
  return ir.IntegerType.get_signless(32)


def _c(v, ty=None):
  return mu.c(v, ty or _i32())


def _add(*xs):
  return functools.reduce(arith.addi, xs)


def _eq(a, b):
  return arith.cmpi(arith.CmpIPredicate.eq, a, b)


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


def _load64(ptr, offset):
  """Two i32 words from an 8-byte-aligned address (one 64-bit shared load)."""
  pair = llvm.load(ir.VectorType.get((2,), _i32()), _gep(ptr, offset))
  return [llvm.extractelement(pair, _c(i)) for i in range(2)]


def _load16(ptr, offset):
  return arith.extui(_i32(), llvm.load(ir.IntegerType.get_signless(16), _gep(ptr, offset)))


def _store16(ptr, offset, value):
  llvm.store(arith.trunci(ir.IntegerType.get_signless(16), value), _gep(ptr, offset))


def _store32(ptr, offset, value):
  llvm.store(value, _gep(ptr, offset))


def _load_words(block_ptr, frag):
  """The loads of fragment `frag` (= 32c + lane, an i32) of the block at `block_ptr`: (lx, ly, code,
  rx, ry), the low words at `8k`, the code word at `512 + 4k` and the raw high words at
  `512 + 8k` (past a compressed block's end, still inside the stage slot).

  Branch-free, so the loads of all of a step's fragments can be in flight together;
  `_finish_fragment` selects raw or compressed high words.
  """
  lx, ly = _load64(block_ptr, arith.shli(frag, _c(3)))  # low bytes at 8k
  rx, ry = _load64(block_ptr, arith.addi(arith.shli(frag, _c(3)), _c(512)))
  code = _load32(block_ptr, arith.addi(arith.shli(frag, _c(2)), _c(512)))
  return lx, ly, code, rx, ry


def _decode_high(code, bias_x, bias_y):
  """High words (Hx, Hy) from the code word: sign bits and d fields in place, plus a per-byte bias
  (hb in every byte for a version-1 block, `exception_biases` for version 2)."""
  hx = arith.addi(arith.andi(code, _c(0x87878787 - (1 << 32))), bias_x)
  hy = arith.addi(
      arith.ori(arith.andi(arith.shrui(code, _c(4)), _c(0x07070707)),
                arith.andi(arith.shli(code, _c(4)), _c(0x80808080 - (1 << 32)))),
      bias_y,
  )
  return hx, hy


def _finish_fragment(lx, ly, hx, hy, rx, ry, slot_byte):
  """The 4 BF16 pairs (as i32) [{a0a1}, {a2a3}, {a4a5}, {a6a7}]: raw or compressed high words by
  `slot_byte`, interleaved with the low words."""
  is_raw = _eq(slot_byte, _c(RAW))
  hx, hy = arith.select(is_raw, rx, hx), arith.select(is_raw, ry, hy)
  lo_sel, hi_sel = _c(0x5140), _c(0x7362)
  return [mu.prmt(lx, hx, lo_sel), mu.prmt(lx, hx, hi_sel), mu.prmt(ly, hy, lo_sel), mu.prmt(ly, hy, hi_sel)]


def _decode_fragment(block_ptr, frag, slot_byte):
  """Format version 1: slot_byte i32 0..127 (compressed, = b/2) or 0xFF (raw)."""
  lx, ly, code, rx, ry = _load_words(block_ptr, frag)
  bias = arith.muli(slot_byte, _c(0x01010101))
  return _finish_fragment(lx, ly, *_decode_high(code, bias, bias), rx, ry, slot_byte)


class MlirOps:
  """The integer ops of the version-2 fold (`exception_words`, `block_exception_words`, ...) and
  `folded_position`, on i32 / i1 MLIR values (tests pass numpy ones)."""

  and_, shl, shr = staticmethod(arith.andi), staticmethod(arith.shli), staticmethod(arith.shrui)
  add, sub, mul, select = staticmethod(arith.addi), staticmethod(arith.subi), staticmethod(arith.muli), staticmethod(arith.select)
  eq = staticmethod(_eq)
  div, rem = staticmethod(arith.divui), staticmethod(arith.remui)

  @staticmethod
  def lt(a, b):  # unsigned
    return arith.cmpi(arith.CmpIPredicate.ult, a, b)

  @staticmethod
  def const(v):
    return _c(v - (1 << 32) if v >= 1 << 31 else v)


def exception_words(ops, entry, flagged, half_base):
  """Version 2: a block's exception folded into bias words: (hit_x, hit_y, target) for a block with
  b/2 = `half_base` and exception entry `entry` (`flagged`: the block has one).

  The biases of `_decode_high` are hb in every byte, except the exception's: its code has d = 0
  (docs/FORMAT.md §9), so putting its `e >> 1` in that byte of the bias decodes it exactly (sign
  from the code, no carry: e >> 1 <= 127). That byte is hb + (e >> 1 - hb): adding `(e >> 1 - hb)
  << 8 (p & 3)` to the bias word (32-bit wrap) borrows nothing, since the byte only drops to
  e >> 1 >= 0. Position p is byte p & 3 of Hx (p & 4 == 0) or Hy of fragment `target` = p >> 3
  (none: 0xFFFFFFFF); `fold_biases` picks them per fragment. Written against `ops` (MLIR or
  numpy) so the same code is tested off-GPU.
  """
  return _words_over_bias(ops, entry, flagged, half_base, ops.mul(half_base, ops.const(0x01010101)))


def _words_over_bias(ops, entry, flagged, half_base, bias):
  """`exception_words` given the block's plain bias word (hb in every byte)."""
  c = ops.const
  p = ops.and_(entry, c((1 << FB.POSITION_BITS) - 1))
  patched = ops.add(bias, ops.shl(ops.sub(ops.shr(entry, c(FB.POSITION_BITS)), half_base),
                                  ops.shl(ops.and_(p, c(3)), c(3))))
  in_x = ops.eq(ops.and_(p, c(4)), c(0))
  target = ops.select(flagged, ops.shr(p, c(3)), c(0xFFFFFFFF))  # the exception's fragment, or none
  return ops.select(in_x, patched, bias), ops.select(in_x, bias, patched), target


def exception_flagged(ops, slot_byte):
  """Version 2: whether a block's slot byte flags an exception (0x80 | b/2: 0x80..0xFD)."""
  c = ops.const
  return ops.and_(ops.eq(ops.shr(slot_byte, c(7)), c(1)), ops.lt(slot_byte, c(FB.META_ABSENT)))


def exception_entry(ops, word2, word3, j):
  """Block j's 16-bit exception entry from a group record's words 2, 3 (j an int or a per-thread
  value, 0..3)."""
  c = ops.const
  if isinstance(j, int):
    return ops.and_(ops.shr((word2, word3)[j // 2], c(16 * (j % 2))), c(0xFFFF))
  word = ops.select(ops.lt(j, c(2)), word2, word3)
  return ops.and_(ops.shr(word, ops.shl(ops.and_(j, c(1)), c(4))), c(0xFFFF))


def block_exception_words(ops, word1, word2, word3, j):
  """`exception_words` of block j (an int or a per-thread value, 0..3) of a version-2 group
  record's words 1 (slot bytes), 2, 3 (exception entries): what the producer stores at
  `folded_word(kind, j, 0..2)`."""
  c = ops.const
  shift = ops.shl(j, c(3)) if not isinstance(j, int) else c(8 * j)
  slot = ops.and_(ops.shr(word1, shift), c(0xFF))
  return exception_words(ops, exception_entry(ops, word2, word3, j), exception_flagged(ops, slot),
                         ops.and_(slot, c(FB.MAX_HALF_BASE)))


def fold_biases(ops, frag, bias, hit_x, hit_y, target):
  """The biases (Bx, By) of `_decode_high` for fragment `frag`: the folded words where it holds
  the exception, else `bias` (hb in every byte): one compare and two selects."""
  hit = ops.eq(frag, target)
  return ops.select(hit, hit_x, bias), ops.select(hit, hit_y, bias)


def exception_biases(ops, frag, entry, flagged, half_base):
  """`exception_words` and `fold_biases` in one: the biases (Bx, By) of fragment `frag`."""
  bias = ops.mul(half_base, ops.const(0x01010101))
  return fold_biases(ops, frag, bias, *_words_over_bias(ops, entry, flagged, half_base, bias))


def _folded_words(record_ptr, index):
  """The 3 folded words of a block from the stage's record SMEM (`index`: its hit_x word, an i32)."""
  return [_load32(record_ptr, arith.shli(arith.addi(index, _c(w)), _c(2))) for w in range(FOLDED_PER_BLOCK)]


def _decode_fragments_v2(parts):
  """Version 2: `parts` = [(block_ptr, frag, slot_byte, fold)] of one thread -> their words, flat.

  The loads of every part are issued first (branch-free). `fold` is either the block's folded
  words (hit_x, hit_y, target) from the producer's record (`DecodeConfig.exception_fold =
  "producer"`): then each fragment's biases are one compare and two selects, no branch; or
  (`"consumer"`) a function building the block's exception entry, and this thread folds it
  (`exception_biases`) under one warp-uniform branch taken only when one of the parts' blocks
  has an exception, so it runs while the loads are in flight. The decode itself is version 1's."""
  loaded = [_load_words(ptr, frag) for ptr, frag, _, _ in parts]
  half_bases = [arith.andi(slot, _c(FB.MAX_HALF_BASE)) for _, _, slot, _ in parts]
  if callable(parts[0][3]):  # the consumer folds
    flagged = [exception_flagged(MlirOps, slot) for _, _, slot, _ in parts]

    def folded():
      return [b for (_, frag, _, entry_fn), f, hb in zip(parts, flagged, half_bases)
              for b in exception_biases(MlirOps, frag, entry_fn(), f, hb)]

    def plain():
      return [b for hb in half_bases for b in (arith.muli(hb, _c(0x01010101)),) * 2]

    biases = _branch(functools.reduce(arith.ori, flagged), 2 * len(parts), folded, plain)
  else:  # the producer folded
    biases = [b for (_, frag, _, words), hb in zip(parts, half_bases)
              for b in fold_biases(MlirOps, frag, arith.muli(hb, _c(0x01010101)), *words)]
  words = []
  for i, ((_, _, slot, _), (lx, ly, code, rx, ry)) in enumerate(zip(parts, loaded)):
    words += _finish_fragment(lx, ly, *_decode_high(code, biases[2 * i], biases[2 * i + 1]), rx, ry, slot)
  return words


assert (RAW, FB.META_ABSENT, FB.MAX_EXCEPTION_META) == (0xFF, 0xFE, 0xFD)  # what block_starts_word assumes


def block_starts_word(ops, word1):
  """Unit offsets of a group's 4 blocks inside its stage slot, one per byte (block j in byte j),
  from the group's slot bytes `word1`, in 7 integer ops (SWAR; `ops`: MLIR or numpy).

  Block j starts at 3j units plus one per raw block before it (raw: 4 units, else 3). A byte is
  raw iff it is 0xFF (FORMAT.md: compressed b/2 <= 0x7F, version 2's flagged 0x80 | b/2 <= 0xFD,
  absent 0xFE): its low 7 bits plus one carry into bit 7 only at 0x7F, and bit 7 must be set.
  Multiplying the per-byte raw flags by 0x01010100 sums each byte's predecessors (<= 3: no carry).
  """
  c = ops.const
  return ops.add(ops.mul(ops.shr(raw_byte_flags(ops, word1), c(7)), c(0x01010100)), c(0x09060300))


def raw_byte_flags(ops, word):
  """0x80 in every byte of `word` that is 0xFF, else 0, for bytes <= 0x7F, 0xFE or 0xFF (SWAR, 4 ops;
  see `block_starts_word`)."""
  c = ops.const
  return ops.and_(ops.and_(ops.add(ops.and_(word, c(0x7F7F7F7F)), c(0x01010101)), word), c(0x80808080))


def _byte(word, shift):
  """Byte `shift // 8` of `word` (shift an i32 value or an int)."""
  shift = shift if isinstance(shift, ir.Value) else _c(shift)
  return arith.andi(arith.shrui(word, shift), _c(0xFF))


def _block_starts(word1, nblocks):
  """Unit offsets of the blocks of a group inside its stage slot (raw: 4 units, else 3)."""
  starts = block_starts_word(MlirOps, word1)
  return [_byte(starts, 8 * j) for j in range(nblocks)]


def _slot_byte(word1, j):
  return _byte(word1, 8 * j)


def _thread():
  tid = arith.remui(mu.thread_idx(), _c(128))
  return arith.shrui(tid, _c(5)), arith.andi(tid, _c(31))


def _scalar(x):
  """The i32 value of a splat FragmentedArray scalar argument."""
  if isinstance(x, ir.Value):
    return x
  (reg,) = x.registers.flat
  return reg


def _branch(cond, n, then_fn, else_fn):
  """`n` i32 results of a warp-uniform if/else whose arms return lists of i32 values."""
  op = scf.IfOp(cond, [_i32()] * n, has_else=True)
  with ir.InsertionPoint(op.then_block):
    scf.yield_(then_fn())
  with ir.InsertionPoint(op.else_block):
    scf.yield_(else_fn())
  return list(op.results)


def _is(flags, flag):
  return _eq(arith.andi(flags, _c(flag)), _c(flag))


def _select_slots(slots, zero_absent=True):
  """Flat words of page slots, each `(flags, page_words, tail_fn)`: `page_words` (decoded
  unconditionally), zeros for a slot past the sequence (`zero_absent`), or `tail_fn()`'s words
  for the slot holding the tail page.

  Only a split's last steps hold the tail page or slots past the sequence, so the selects run
  under one branch (uniform: every thread reads the same flags) that other steps skip.
  K need not zero absent slots: their scores are replaced by -inf (a select, so NaN from stale
  bytes is dropped) before anything reads them. V must: their probabilities are 0, and 0 * NaN
  is NaN in the PV product."""
  differs = (lambda f: arith.cmpi(arith.CmpIPredicate.ne, f, _c(FLAG_PAGE))) if zero_absent else (lambda f: _is(f, FLAG_TAIL))
  irregular = functools.reduce(arith.ori, [differs(f) for f, _, _ in slots])  # K: only the tail page matters
  n = sum(len(words) for _, words, _ in slots)

  def selected():
    out = []
    for f, words, tail_fn in slots:
      is_tail, is_page = _is(f, FLAG_TAIL), _is(f, FLAG_PAGE)
      for w, tw in zip(words, tail_fn()):
        out.append(arith.select(is_tail, tw, arith.select(is_page, w, _c(0)) if zero_absent else w))
    return out

  return _branch(irregular, n, selected, lambda: [w for _, words, _ in slots for w in words])


def _fragments(words, shape):
  """i32 words (flat register order) -> a bf16 WGMMA-layout FragmentedArray of `shape`."""
  vec = ir.VectorType.get((2,), ir.BF16Type.get())
  one = ir.VectorType.get((1,), _i32())
  regs = [vector.bitcast(vec, vector.broadcast(one, w)) for w in words]
  regs = np.asarray(regs, dtype=object).reshape(fa.WGMMA_LAYOUT.registers_shape(shape))
  return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def _setup(byte_ref, infos):
  warp, lane = _thread()
  g, t = arith.shrui(lane, _c(2)), arith.andi(lane, _c(3))
  infos = [tuple(_scalar(x) for x in info) for info in infos]
  return warp, lane, g, t, mu.memref_ptr(byte_ref), infos


def restore_k(byte_ref, infos, *, head_dim, record_ref=None):
  """K `[64 tokens, D]` of one step as a register A operand; warp w restores page slot w.

  Args:
    byte_ref: memref uint8 [2 (K, V), 4 slots, 4 * nb units, 256], this step's groups; a slot
      flagged FLAG_TAIL holds the BF16 tail page `[16, D]` in natural order instead.
    infos: per slot (flags, k_word1, v_word1) i32 values (splat arrays); format version 2 with
      the consumer's fold: (flags, k_word1, v_word1, k_word2, k_word3, v_word2, v_word3), words
      2, 3 holding the blocks' exception entries (FORMAT.md §9).
    record_ref: format version 2 with the producer's fold only: the step's info records, memref
      i32 [4 slots, RECORD_WORDS_V2], whose folded words (`folded_word`) carry the exceptions.
  Returns: a bf16 [64, D] WGMMA-layout FragmentedArray (register i = 8j + 4c + pair).
  """
  nblocks = head_dim // 32
  warp, lane, g, t, byte_ptr, infos = _setup(byte_ref, infos)
  picked = list(infos[0])  # this warp's slot's info words
  for s in range(1, PAGES_PER_STEP):
    is_s = _eq(warp, _c(s))
    picked = [arith.select(is_s, new, old) for new, old in zip(infos[s], picked)]
  flags, kw1 = picked[0], picked[1]
  slot_bytes = 4 * nblocks * UNIT
  slot_ptr = _gep(byte_ptr, arith.muli(warp, _c(slot_bytes)))  # kind 0 (K), slot w

  def from_bytes():
    starts = _block_starts(kw1, nblocks)
    ptrs = [_gep(slot_ptr, arith.muli(starts[j], _c(UNIT))) for j in range(nblocks)]
    if record_ref is not None:  # version 2: slot w's K blocks' folded words
      record_ptr, first = mu.memref_ptr(record_ref), arith.muli(warp, _c(RECORD_WORDS_V2))
      folded = [_folded_words(record_ptr, arith.addi(first, _c(folded_word(0, j)))) for j in range(nblocks)]
      return _decode_fragments_v2([(ptrs[j], arith.addi(lane, _c(32 * c)), _slot_byte(kw1, j), folded[j])
                                   for j in range(nblocks) for c in range(2)])
    if len(picked) == INFO_WORDS_V2:  # version 2, the consumer folds
      return _decode_fragments_v2([(ptrs[j], arith.addi(lane, _c(32 * c)), _slot_byte(kw1, j),
                                    functools.partial(exception_entry, MlirOps, picked[3], picked[4], j))
                                   for j in range(nblocks) for c in range(2)])
    words = []
    for j in range(nblocks):
      for c in range(2):
        words += _decode_fragment(ptrs[j], arith.addi(lane, _c(32 * c)), _slot_byte(kw1, j))
    return words

  def from_tail():  # pair (h, e) of fragment (j, c): token g + 8h, dims 32j + 16c + 8e + 2t (+1)
    base = arith.addi(arith.muli(g, _c(2 * head_dim)), arith.shli(t, _c(2)))
    return [_load32(slot_ptr, arith.addi(base, _c(2 * (8 * h * head_dim + 32 * j + 16 * c + 8 * e))))
            for j in range(nblocks) for c in range(2) for e in range(2) for h in range(2)]

  return _fragments(_select_slots([(flags, from_bytes(), from_tail)], zero_absent=False), (4 * PAGE, head_dim))


def restore_vt(byte_ref, infos, *, head_dim, record_ref=None):
  """V^T `[D, 64 tokens]` of one step as a register A operand (see `restore_k` for the args).

  Warp w of M-group m holds dims 64m + 16w + (0..15): block j = 2m + w // 2, tile c = w % 2 of
  every slot's V group. Register m * 16 + 4s + pair.
  """
  nblocks = head_dim // 32
  groups = head_dim // 64
  warp, lane, g, t, byte_ptr, infos = _setup(byte_ref, infos)
  frag = arith.addi(lane, arith.shli(arith.andi(warp, _c(1)), _c(5)))  # 32c + lane
  slot_bytes = 4 * nblocks * UNIT
  record_ptr = None if record_ref is None else mu.memref_ptr(record_ref)
  per_slot = []
  for s in range(PAGES_PER_STEP):
    flags, vw1 = infos[s][0], infos[s][2]
    slot_ptr = _gep(byte_ptr, _c((PAGES_PER_STEP + s) * slot_bytes))  # kind 1 (V), slot s

    def from_bytes(slot_ptr=slot_ptr, vw1=vw1, s=s, info=infos[s]):
      starts = block_starts_word(MlirOps, vw1)
      parts = []
      for m in range(groups):
        j_dyn = arith.addi(_c(2 * m), arith.shrui(warp, _c(1)))
        shift = arith.shli(j_dyn, _c(3))  # byte j of the starts and slot-byte words
        start, hb = _byte(starts, shift), _byte(vw1, shift)
        if record_ptr is not None:  # version 2, the producer folded
          fold = _folded_words(record_ptr, arith.addi(folded_word(1, j_dyn), _c(s * RECORD_WORDS_V2)))
        elif len(info) == INFO_WORDS_V2:  # version 2, the consumer folds
          fold = functools.partial(exception_entry, MlirOps, info[5], info[6], j_dyn)
        else:
          fold = None
        parts.append((_gep(slot_ptr, arith.muli(start, _c(UNIT))), frag, hb, fold))
      if parts[0][3] is not None:  # version 2
        return _decode_fragments_v2(parts)
      return [w for ptr, frag_, hb, _ in parts for w in _decode_fragment(ptr, frag_, hb)]

    def from_tail(v_tail=slot_ptr):  # pair (h, e): dim 64m + 16w + g + 8h, tokens 8e + 2t + (0, 1)
      base = arith.addi(arith.shli(arith.addi(arith.shli(warp, _c(4)), g), _c(1)),
                        arith.muli(t, _c(4 * head_dim)))
      words = []
      for m in range(groups):
        for e in range(2):
          for h in range(2):
            off = arith.addi(base, _c(2 * (64 * m + 8 * h) + 2 * 8 * e * head_dim))
            lo = _load16(v_tail, off)
            hi = _load16(v_tail, arith.addi(off, _c(2 * head_dim)))
            words.append(arith.ori(lo, arith.shli(hi, _c(16))))
      return words

    per_slot.append((flags, from_bytes(), from_tail))
  flat = _select_slots(per_slot)  # slot-major; registers are m * 16 + 4s + pair
  words = [flat[s * 4 * groups + 4 * m + i] for m in range(groups) for s in range(PAGES_PER_STEP) for i in range(4)]
  return _fragments(words, (head_dim, 4 * PAGE))


def store_pt(p, pt_ref):
  """Store P^T: p bf16 [64 tokens, 8 heads] (WGMMA layout) -> pt_ref bf16 [8 heads, 64 tokens].

  pt_ref is one (8, 64) tile with the 128-byte swizzle: element (head r, token x) sits at
  byte 128 r + 16 ((x // 8) ^ r) + 2 (x % 8). Thread (w, g, t) holds tokens 16w + g + 8h and
  heads 2t, 2t + 1 in register h.
  """
  warp, lane = _thread()
  g, t = arith.shrui(lane, _c(2)), arith.andi(lane, _c(3))
  ptr = mu.memref_ptr(pt_ref)
  one = ir.VectorType.get((1,), _i32())
  for h, reg in enumerate(p.registers.flat):
    word = llvm.extractelement(vector.bitcast(one, reg), _c(0))
    chunk = arith.addi(arith.shli(warp, _c(1)), _c(h))
    for u in range(2):
      head = arith.addi(arith.shli(t, _c(1)), _c(u))
      off = _add(arith.shli(head, _c(7)), arith.shli(arith.xori(chunk, head), _c(4)), arith.shli(g, _c(1)))
      _store16(ptr, off, word if u == 0 else arith.shrui(word, _c(16)))


def zero_absent_v(v_ref, infos, *, head_dim):
  """Zero the V rows of slots past the sequence (uncompressed path; TMA never wrote them)."""
  warp, lane = _thread()
  v_ptr = mu.memref_ptr(v_ref)
  infos = [tuple(_scalar(x) for x in info) for info in infos]
  for s in range(PAGES_PER_STEP):
    op = scf.IfOp(_eq(infos[s][0], _c(0)))
    with ir.InsertionPoint(op.then_block):
      # 16 tokens x D dims = 16 * D / 2 words; 128 threads store 4-byte zeros.
      tid = arith.addi(arith.muli(warp, _c(32)), lane)
      for it in range(16 * head_dim // 2 // 128):
        word = arith.addi(tid, _c(128 * it))
        tok = arith.addi(_c(16 * s), arith.divui(word, _c(head_dim // 2)))
        dim = arith.muli(arith.remui(word, _c(head_dim // 2)), _c(2))
        _store32(v_ptr, _swizzled_offset(tok, dim, head_dim), _c(0))
      scf.yield_([])

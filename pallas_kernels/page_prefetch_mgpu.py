"""Cooperative prefetch of a split's page-table entries and group metadata into SMEM.

Mosaic GPU code for `plgpu.inline_mgpu`, run by the producer warpgroup of
`decode_attention.py`: `gather_pages` once per `CHUNK_PAGES` pages, `write_step_info`
once per step. Read one scalar at a time,
each step's copies waited on two dependent global loads (page table, then the
page's metadata words), about 1 µs each under full HBM load; here the 128
producer threads load one page each in parallel (a 16-byte vector load for the
metadata), so a chunk costs one round trip instead of two per step.
"""

from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf
from jax.experimental.mosaic.gpu import utils as mu

from pallas_kernels import restore_mgpu as R
from pallas_kernels.restore_mgpu import RAW, _c, _eq, _i32, _scalar, _slot_byte

CHUNK_PAGES = 128  # one page per producer thread
KIND_WORDS = {1: 3, 2: 5}  # per K / V: arena unit offset, word1 (slot bytes), raw blocks (, words 2, 3)


def entry_words(version: int) -> int:
  """Words of a chunk entry: the physical page, then K's and V's fields."""
  return 1 + 2 * KIND_WORDS[version]


def gather_pages(page_table_ref, meta_ref, chunk_ref, row_start, row_end, kvh, *, num_pages, nblocks, compressed,
                 version=1):
  """chunk_ref[p] = (phys, K offset, K word1, K raw count, V offset, V word1, V raw count) of
  page-table entries row_start + p (the producer's per-copy scalar work, done 128 pages at once);
  format version 2 adds each kind's words 2, 3 (exception entries) after its raw count.

  Args:
    page_table_ref: GMEM i32 [B * max_pages] (flat); meta_ref: GMEM u32 [Hkv * P * 2 * W] (flat;
      W = 2 record words in version 1, 4 in version 2).
    chunk_ref: SMEM i32 [CHUNK_PAGES, entry_words(version)].
    row_start, row_end: i32 splats, flat page-table indices; entries at or past `row_end`
      repeat the last valid one (their slots lie past the sequence; any in-bounds page does).
    kvh: i32 splat, the KV head. num_pages: P (physical ids are clamped to [0, P)).
  """
  i64 = ir.IntegerType.get_signless(64)
  row_start, row_end, kvh = (_scalar(x) for x in (row_start, row_end, kvh))
  tid = arith.remui(mu.thread_idx(), _c(128))
  mu.warpgroup_barrier()  # every producer thread is done with the previous chunk
  row = arith.minsi(arith.addi(row_start, tid), arith.subi(row_end, _c(1)))
  pt = mu.memref_ptr(page_table_ref)
  phys = llvm.load(_i32(), mu.getelementptr(pt, [arith.extui(i64, row)], _i32()))
  phys = arith.maxsi(arith.minsi(phys, _c(num_pages - 1)), _c(0))
  out = mu.memref_ptr(chunk_ref)
  entry = arith.muli(tid, _c(entry_words(version)))
  llvm.store(phys, mu.getelementptr(out, [entry], _i32()))
  if compressed:
    meta = mu.memref_ptr(meta_ref)
    record = 2 * (2 if version == 1 else 4)  # words per (head, page): K's and V's records
    word = arith.muli(arith.addi(arith.muli(arith.extui(i64, kvh), _c(num_pages, i64)), arith.extui(i64, phys)),
                      _c(record, i64))
    words = []
    for v in range(record // 4):  # 16-byte loads: [K w0, K w1, V w0, V w1], or K's record then V's
      vec = llvm.load(ir.VectorType.get((4,), _i32()), mu.getelementptr(meta, [arith.addi(word, _c(4 * v, i64))], _i32()))
      words += [llvm.extractelement(vec, _c(i)) for i in range(4)]
    per_kind = record // 2
    for kind in range(2):
      word0, word1, *exceptions = words[per_kind * kind : per_kind * (kind + 1)]
      n_raw = _c(0)
      for j in range(nblocks):
        n_raw = arith.addi(n_raw, arith.extui(_i32(), _eq(_slot_byte(word1, j), _c(RAW))))
      fields = (arith.andi(word0, _c(0x3FFFFFFF)), word1, n_raw, *exceptions)
      for f, value in enumerate(fields):
        llvm.store(value, mu.getelementptr(out, [arith.addi(entry, _c(1 + KIND_WORDS[version] * kind + f))], _i32()))
  mu.warpgroup_barrier()  # the chunk is visible to every producer thread


def info_fields(version: int) -> tuple[int, ...]:
  """Chunk-entry column of each info word after the flags: K word1, V word1 (version 2: then
  K words 2, 3 and V words 2, 3)."""
  kw = KIND_WORDS[version]
  fields = (2, 2 + kw)
  if version == 2:
    fields += (4, 5, 4 + kw, 5 + kw)
  return fields


def info_words(version: int, producer_fold: bool = False) -> int:
  """Words of a slot's info record: the flags, then the `info_fields` words (version 2 with
  `producer_fold`: then an unused word and the blocks' folded exception words,
  `restore_mgpu.folded_word`)."""
  return R.RECORD_WORDS_V2 if version == 2 and producer_fold else 1 + len(info_fields(version))


def write_step_info(chunk_ref, info_ref, stage, local, *flags, version, compressed, producer_fold=False):
  """info_ref[stage, s] = (flags[s], chunk words of `info_fields`) for the step's 4 slots.

  One word per producer thread, all stored at once. (A Pallas scalar store costs two
  warpgroup barriers and a load of the old value: 12 such stores per step in version 1
  and 28 in version 2 serialized the producer.) The caller's `commit_smem` (fence + warpgroup
  barrier) orders the stores before the step's arrival. Version 2 with `producer_fold`
  (`DecodeConfig.exception_fold="producer"`): threads 8..31 of each slot
  store the slot's folded exception words (`restore_mgpu.block_exception_words` of K's and V's
  blocks), so each block's exception is worked out once per step instead of by every consumer
  thread that decodes one of its fragments.

  Args:
    chunk_ref: SMEM i32 [CHUNK_PAGES, entry_words(version)]; info_ref: SMEM i32 [stages, 4, W],
      W = info_words(version, producer_fold).
    stage, local: i32 splats, the ring stage and the step's first chunk entry.
    flags: 4 i32 splats, each slot's FLAG_PAGE / FLAG_TAIL / 0.
  """
  fields = info_fields(version)
  words = info_words(version, producer_fold)
  stage, local, *flags = (_scalar(x) for x in (stage, local, *flags))
  tid = arith.remui(mu.thread_idx(), _c(128))
  slot, word = arith.divui(tid, _c(words)), arith.remui(tid, _c(words))
  flag = flags[0]
  for s in range(1, len(flags)):
    flag = arith.select(_eq(slot, _c(s)), flags[s], flag)
  column = _c(fields[0])
  for w in range(1, len(fields)):
    column = arith.select(_eq(word, _c(1 + w)), _c(fields[w]), column)
  op = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, tid, _c(len(flags) * words)))
  with ir.InsertionPoint(op.then_block):
    if compressed:
      chunk_ptr = mu.memref_ptr(chunk_ref)
      row = arith.muli(arith.addi(local, slot), _c(entry_words(version)))
      load = lambda col: llvm.load(_i32(), mu.getelementptr(chunk_ptr, [arith.addi(row, col)], _i32()))
      value = arith.select(_eq(word, _c(0)), flag, load(column))
      if version == 2 and producer_fold:  # word FOLDED_BASE + 3 (4 kind + j) + which
        is_folded, kind, j, which = R.folded_position(R.MlirOps, word)
        first = arith.muli(kind, _c(KIND_WORDS[version]))  # V's fields are K's, one kind's words later
        w1, w2, w3 = (load(arith.addi(first, _c(fields[i]))) for i in (0, 2, 3))  # K word1, words 2, 3
        hit_x, hit_y, target = R.block_exception_words(R.MlirOps, w1, w2, w3, j)
        folded = arith.select(_eq(which, _c(0)), hit_x, arith.select(_eq(which, _c(1)), hit_y, target))
        value = arith.select(is_folded, folded, value)
    else:
      value = arith.select(_eq(word, _c(0)), flag, _c(0))
    dest = arith.addi(arith.muli(stage, _c(len(flags) * words)), tid)
    llvm.store(value, mu.getelementptr(mu.memref_ptr(info_ref), [dest], _i32()))
    scf.yield_([])

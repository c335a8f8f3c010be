"""Format version 2 (one exception per block, docs/FORMAT.md §9): reference codec, validation, density.

Exhaustive: version 2 on both version-1 pattern sets, and every BF16 pattern as the one
out-of-window value of a block at a rotating position. Then one and two outliers, ±0 in every
slot, the b/2 limit of a flagged slot, version-1 and version-2 groups in one metadata array,
corrupted version-2 metadata, hypothesis pages, and jit / no-jit agreement.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from hypothesis import given
from test_properties import blocks as random_blocks

import zipfusion_jax as zf
from bf16_patterns import ALL_PATTERNS, as_bf16, numpy_block_rule_v2, numpy_decode
from zipfusion_jax.format import block as B
from pallas_kernels import restore_mgpu
from zipfusion_jax.format.codec import CompressedBlocks

BACKGROUND_MIN_EXP = 112  # background blocks span exponents 112..127 (b = 112, b/2 = 56)


def background(rng: np.random.Generator, n: int) -> np.ndarray:
  """uint16 [n, 512]: blocks spanning exactly the window [112, 127], random signs and fractions."""
  e = rng.integers(BACKGROUND_MIN_EXP, BACKGROUND_MIN_EXP + 16, (n, 512))
  e[:, 1], e[:, 2] = BACKGROUND_MIN_EXP, BACKGROUND_MIN_EXP + 15
  return ((rng.integers(0, 2, (n, 512)) << 15) | (e << 7) | rng.integers(0, 128, (n, 512))).astype(np.uint16)


def round_trip(bits: np.ndarray, version: int = 2) -> CompressedBlocks:
  c = zf.compress(as_bf16(bits), version=version)
  zf.validate(c)
  np.testing.assert_array_equal(np.asarray(zf.decompress(c)).view(np.uint16), bits)
  return c


def exception_entries(c: CompressedBlocks) -> np.ndarray:
  return np.asarray(c.exceptions).reshape(-1)[: c.num_blocks]


def slot_bytes(c: CompressedBlocks) -> np.ndarray:
  return np.asarray(c.meta_bytes).reshape(-1)[: c.num_blocks]


@pytest.mark.parametrize("which", ["eligible_rotations", "raw_rotations"])
def test_version_1_pattern_sets_give_version_1_decisions(which, request):
  bits = request.getfixturevalue(which)
  v1, v2 = zf.compress(as_bf16(bits)), round_trip(bits)
  chex.assert_shape(v2.group_meta, (bits.shape[0] // 4, 4))
  # No block of either set has exactly one out-of-window value: same slots, same payload, no entries.
  np.testing.assert_array_equal(np.asarray(v2.group_meta[:, 1]), np.asarray(v1.group_meta[:, 1]))
  np.testing.assert_array_equal(np.asarray(v2.payload), np.asarray(v1.payload))
  assert not np.any(np.asarray(v2.group_meta[:, 2:]))
  assert np.asarray(v2.group_meta[:, 0] >> B.VERSION_SHIFT).tolist() == [2] * (bits.shape[0] // 4)
  assert v2.nbytes == v1.nbytes + 8 * v1.num_groups  # 16-byte records


def test_every_pattern_as_the_exception_at_every_position_round_trips():
  """65,536 blocks: pattern i at position i % 512 on an in-window background."""
  rng = np.random.default_rng(7)
  bits = background(rng, ALL_PATTERNS.size)
  rows, position = np.arange(ALL_PATTERNS.size), np.arange(ALL_PATTERNS.size) % 512
  position = np.where(np.isin(position, (1, 2)), 0, position)  # keep both window ends in the background
  bits[rows, position] = ALL_PATTERNS
  c = round_trip(bits)
  assert bool(np.all(np.asarray(c.compressible)))  # every pattern fits the window or is the exception
  exponent = (ALL_PATTERNS.astype(np.int32) >> 7) & 0xFF
  outside = (exponent < BACKGROUND_MIN_EXP) | (exponent > BACKGROUND_MIN_EXP + 15)
  meta, entries = slot_bytes(c), exception_entries(c)
  np.testing.assert_array_equal(meta, np.where(outside, 0x80 | 56, 56))
  np.testing.assert_array_equal(entries, np.where(outside, position | (exponent >> 1) << 9, 0))
  sample = np.arange(0, bits.shape[0], 331)
  np.testing.assert_array_equal(numpy_decode(c.payload, c.group_meta, sample), bits[sample])


@pytest.mark.parametrize("variant", ["jit", "nojit"])
def test_one_outlier_above_or_below_and_two_outliers(variant):
  rng = np.random.default_rng(3)
  bits = background(rng, 6)
  bits[0, 100] = 0x7F80  # +Inf: the largest value is set aside, b stays 112
  bits[1, 300] = 0x0001  # a subnormal: the smallest is set aside, b = 112 from the next smallest
  bits[2, 5], bits[2, 6] = 0x7F80, 0x7F81  # two above: raw
  bits[3, 7], bits[3, 400] = 0x7F80, 0x0001  # one above, one below: raw
  bits[4, 9] = 0x4F00  # exponent 158, fraction 0: just one value far above
  compress = jax.jit(lambda x: zf.compress(x, version=2)) if variant == "jit" else (lambda x: zf.compress(x, version=2))
  c = compress(as_bf16(bits))
  zf.validate(c)
  np.testing.assert_array_equal(np.asarray(zf.decompress(c)).view(np.uint16), bits)
  assert slot_bytes(c).tolist() == [0x80 | 56, 0x80 | 56, B.META_RAW, B.META_RAW, 0x80 | 56, 56]
  assert exception_entries(c).tolist() == [100 | 127 << 9, 300 | 0 << 9, 0, 0, 9 | 79 << 9, 0]
  assert int(c.payload_units) == 4 * 3 + 2 * 4  # four blocks in 12 bits, two raw
  v1 = zf.compress(as_bf16(bits))
  assert np.asarray(v1.compressible).tolist() == [False, False, False, False, False, True]


def test_signed_zero_in_every_slot_is_the_exception_and_two_zeros_are_raw():
  rng = np.random.default_rng(5)
  bits = background(rng, 1024)
  p = np.arange(512)
  bits[p, p] = 0x0000
  bits[512 + p, p] = 0x8000
  c = round_trip(bits)
  assert bool(np.all(np.asarray(c.compressible)))
  entries = exception_entries(c)
  np.testing.assert_array_equal(entries & 0x1FF, np.concatenate([p, p]))
  assert not np.any(entries >> 9)  # the set-aside exponent is 0
  two = background(rng, 2)
  two[0, [10, 20]] = 0x0000
  two[1, [10, 20]] = (0x8000, 0x0000)
  c = round_trip(two)
  assert slot_bytes(c).tolist() == [B.META_RAW, B.META_RAW]


def test_flagged_slots_stop_at_half_base_125():
  """0x80 | b/2 must stay below the absent and raw markers: b/2 126, 127 with an exception go raw."""
  bits = np.full((3, 512), 0x7E80, np.uint16)  # exponent 253
  bits[0, 0], bits[1, 0], bits[2, 0] = 0x0001, 0x0001, 0x0001
  bits[0, 1:], bits[2, 1:] = 0x7D00, 0x7C00  # exponent 250 (b/2 125) and 248 (b/2 124)
  bits[0, 2:] = 0x7E80
  c = round_trip(bits)
  assert slot_bytes(c).tolist() == [0x80 | 125, B.META_RAW, 0x80 | 124]


def test_top_is_set_aside_when_either_end_would_do():
  """Exponents 120 (once), 127, 137 (once): span 17; without 137 the window is [120, 127], without
  120 it is [126, 137]. The rule sets the largest aside."""
  bits = np.full((1, 512), 127 << 7, np.uint16)
  bits[0, 0], bits[0, 1] = 120 << 7, 137 << 7
  c = round_trip(bits)
  assert slot_bytes(c).tolist() == [0x80 | 60] and exception_entries(c).tolist() == [1 | 68 << 9]


def test_version_1_and_2_groups_share_one_metadata_array():
  rng = np.random.default_rng(11)
  bits = background(rng, 8)
  bits[:, 17] = 0x7F80  # every block needs its exception in version 2
  v1, v2 = zf.compress(as_bf16(bits[:4])), zf.compress(as_bf16(bits[4:]), version=2)
  meta1 = np.concatenate([np.asarray(v1.group_meta), np.zeros((1, 2), np.uint32)], axis=1)
  meta2 = np.asarray(v2.group_meta).copy()
  units1 = int(v1.payload_units)
  meta2[:, 0] += units1  # the version-2 group follows the version-1 group in one payload
  payload = np.concatenate([np.asarray(v1.payload)[: units1 * 256], np.asarray(v2.payload)])
  mixed = CompressedBlocks(jax.numpy.asarray(payload), jax.numpy.asarray(np.concatenate([meta1, meta2])),
                           jax.numpy.int32(units1 + int(v2.payload_units)), (8,))
  zf.validate(mixed)
  np.testing.assert_array_equal(np.asarray(zf.decompress(mixed)).view(np.uint16), bits)
  np.testing.assert_array_equal(numpy_decode(mixed.payload, mixed.group_meta, range(8)), bits)
  assert np.asarray(mixed.compressible).tolist() == [False] * 4 + [True] * 4


def test_corrupted_version_2_metadata_is_reported():
  rng = np.random.default_rng(13)
  bits = background(rng, 4)
  bits[0, 9] = 0x7F80
  c = zf.compress(as_bf16(bits), version=2)
  meta = np.asarray(c.group_meta)

  def with_meta(m):
    return c.replace(group_meta=jax.numpy.asarray(m))

  narrow = meta[:, :2]
  with pytest.raises(zf.FormatError, match="version 2"):
    zf.validate(with_meta(narrow))  # a version-2 record needs 16 bytes
  stray = meta.copy()
  stray[0, 3] = 5  # an entry on slot 2, which has no exception
  with pytest.raises(zf.FormatError, match="slot 2: exception entry"):
    zf.validate(with_meta(stray))
  v1_flag = meta.copy()
  v1_flag[0, 0] = (1 << 30) | (v1_flag[0, 0] & B.OFFSET_MASK)  # the flagged slot inside a version-1 group
  with pytest.raises(zf.FormatError, match="slot 0: metadata byte 0xb8"):
    zf.validate(with_meta(v1_flag))
  v3 = meta.copy()
  v3[0, 0] = (3 << 30) | (v3[0, 0] & B.OFFSET_MASK)
  with pytest.raises(zf.FormatError, match="unsupported format version 3"):
    zf.validate(with_meta(v3))
  # Decoding corrupted metadata stays in bounds: the unknown-version group reads zero bytes
  # (every stored low byte comes back 0; high bytes are then b/2 alone).
  assert not np.any(np.asarray(zf.decompress(with_meta(v3))).view(np.uint16) & 0xFF)


def test_api_refuses_unknown_versions():
  x = as_bf16(np.zeros((4, 512), np.uint16))
  with pytest.raises(ValueError, match="version=3"):
    zf.compress(x, version=3)
  with pytest.raises(ValueError, match="version=3"):
    zf.compress(x, impl="pallas", version=3)


@given(random_blocks())
def test_version_2_pages_round_trip_and_never_store_more_payload(bits):
  c2, c1 = round_trip(bits), round_trip(bits, version=1)
  slot, entry = numpy_block_rule_v2(bits)  # an independent reading of the rule
  np.testing.assert_array_equal(slot_bytes(c2), slot)
  np.testing.assert_array_equal(exception_entries(c2), entry)
  assert int(c2.payload_units) <= int(c1.payload_units)
  v1_ok = np.asarray(c1.compressible)
  np.testing.assert_array_equal(slot_bytes(c2)[v1_ok], slot_bytes(c1)[v1_ok])  # version 1's choice where it had one
  np.testing.assert_array_equal(numpy_decode(c2.payload, c2.group_meta, range(bits.shape[0])), bits)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_cache_in_version_2_attends_like_version_1(head_dim):
  """Outlier channels make many blocks need their exception; both versions restore the same pages and
  give the same attention bits; version 2 stores fewer units. (The fused kernel on version 2:
  tests/test_decode_kernel.py.)"""
  rng = np.random.default_rng(head_dim)
  batch, seq, kv_heads, group = 3, 100, 2, 3
  k = rng.normal(size=(batch, seq, kv_heads, head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, seq, kv_heads, head_dim)).astype(np.float32)
  k[:, ::7, :, 5] *= 3e4  # one outlier per 7 tokens in one channel: one per block of that channel's pages
  k, v = (jax.numpy.asarray(x, jax.numpy.bfloat16) for x in (k, v))
  q = jax.numpy.asarray(rng.normal(size=(batch, kv_heads * group, head_dim)), jax.numpy.bfloat16)
  lengths = np.array([100, 37, 16], np.int32)
  c1 = zf.paged_cache_from_dense(k, v, lengths)
  c2 = zf.paged_cache_from_dense(k, v, lengths, version=2)
  assert (c1.format_version, c2.format_version) == (1, 2)
  chex.assert_shape(c2.group_meta, (kv_heads, c1.num_pages, 2, 4))
  assert c2.arena.shape[0] < c1.arena.shape[0]
  for a, b in zip(zf.restore_pages(c1), zf.restore_pages(c2)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
  out1, out2 = (zf.paged_decode_attention(q, c, impl="reference") for c in (c1, c2))
  np.testing.assert_array_equal(np.asarray(out1).view(np.uint16), np.asarray(out2).view(np.uint16))
  dta = zf.decompress_then_attend(q, c2, impl="reference")
  np.testing.assert_array_equal(np.asarray(dta).view(np.uint16), np.asarray(out1).view(np.uint16))
  with pytest.raises(ValueError, match="version"):
    zf.paged_cache_from_dense(k, v, lengths, version=0)


class NumpyOps:
  """`restore_mgpu.MlirOps` on numpy uint32 / bool arrays."""

  and_, shl, shr = np.bitwise_and, np.left_shift, np.right_shift
  add, sub, mul, select, eq, lt = np.add, np.subtract, np.multiply, np.where, np.equal, np.less
  div, rem = np.floor_divide, np.remainder

  @staticmethod
  def const(v):
    return np.asarray(v, np.uint32)


def producer_words(c: CompressedBlocks, dynamic_j: bool) -> np.ndarray:
  """Each block's folded exception words (hit_x, hit_y, target) as the kernel's producer computes
  them from its group record (`restore_mgpu.block_exception_words`, numpy ops; block j as a
  constant or, `dynamic_j`, as a per-thread value): uint32 [N, 3]."""
  meta = np.asarray(c.group_meta).astype(np.uint32)
  out = []
  for j in range(4):
    jj = np.full(meta.shape[0], j, np.uint32) if dynamic_j else j
    out.append(np.stack(restore_mgpu.block_exception_words(NumpyOps, meta[:, 1], meta[:, 2], meta[:, 3], jj), -1))
  return np.stack(out, 1).reshape(-1, 3)[: c.num_blocks].astype(np.uint32)


def register_decode(c: CompressedBlocks, fold: bool = True, via_producer: bool = False,
                    dynamic_j: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Every block through the fused kernel's in-register arithmetic (numpy): per fragment k, the
  words at 8k / 512 + 4k, the high words `code bits + bias` with the version-2 biases of
  `restore_mgpu.exception_biases` (the kernel's own function, numpy ops), the bytes interleaved
  as prmt 0x5140 / 0x7362 do (`fold=False`: as if no block had an exception). `via_producer`:
  the biases as the GPU kernel forms them, the producer's `block_exception_words` from the group
  records then the consumer's `fold_biases`. Returns (uint16 [N, 512], compressed bool [N]); raw
  blocks, which the kernel reads as BF16, are left zero."""
  meta = np.asarray(c.group_meta).astype(np.uint32)
  payload = np.asarray(c.payload)
  slots = slot_bytes(c).astype(np.uint32).reshape(-1, 4)
  units = np.where(slots == B.META_RAW, 4, np.where(slots == B.META_ABSENT, 0, 3))
  starts = 256 * ((meta[:, :1] & ((1 << 30) - 1)) + np.cumsum(units, axis=1) - units)
  starts, slots = starts.reshape(-1)[: c.num_blocks], slots.reshape(-1)[: c.num_blocks]
  words = lambda offsets: payload[offsets[..., None] + np.arange(4)].astype(np.uint32) @ (1 << 8 * np.arange(4, dtype=np.uint32))
  k = np.arange(64, dtype=np.uint32)
  lx, ly = words(starts[:, None] + 8 * k), words(starts[:, None] + 8 * k + 4)
  code = words(starts[:, None] + 512 + 4 * k)
  flagged = ((slots >> 7) == 1) & (slots < B.META_ABSENT) & fold
  entry = exception_entries(c).astype(np.uint32)
  if via_producer:
    hit_x, hit_y, target = (w[:, None] for w in producer_words(c, dynamic_j).T)
    bias = (slots & np.uint32(0x7F)) * np.uint32(0x01010101)
    bx, by = restore_mgpu.fold_biases(NumpyOps, k[None], bias[:, None], hit_x, hit_y, target)
  else:
    bx, by = restore_mgpu.exception_biases(NumpyOps, k[None], entry[:, None], flagged[:, None], (slots & 0x7F)[:, None])
  hx = (code & np.uint32(0x87878787)) + bx
  hy = (((code >> 4) & np.uint32(0x07070707)) | ((code << 4) & np.uint32(0x80808080))) + by
  out = np.zeros((c.num_blocks, 64, 8), np.uint16)
  for i in range(4):
    byte = lambda w: ((w >> np.uint32(8 * i)) & np.uint32(0xFF)).astype(np.uint16)
    out[:, :, i] = byte(hx) << 8 | byte(lx)
    out[:, :, 4 + i] = byte(hy) << 8 | byte(ly)
  return out.reshape(c.num_blocks, 512), slots != B.META_RAW


def test_the_kernels_register_decode_folds_every_exception_into_its_bias():
  """The fused kernel's version-2 decode (exception in the bias, no patch) on 65,536 blocks with
  every BF16 pattern as the exception at every position, next to plain and raw blocks."""
  rng = np.random.default_rng(11)
  bits = background(rng, ALL_PATTERNS.size + 8)
  rows, position = np.arange(ALL_PATTERNS.size), (np.arange(ALL_PATTERNS.size) * 7) % 512
  position = np.where(np.isin(position, (1, 2)), 0, position)
  bits[rows, position] = ALL_PATTERNS
  bits[-4:, 3], bits[-4:, 4] = 0x7F80, 0x0001  # raw
  c = zf.compress(as_bf16(bits), version=2)
  restored, compressed = register_decode(c)
  assert compressed[:-4].all() and not compressed[-4:].any()
  meta = slot_bytes(c)
  exceptions = ((meta & 0x80) != 0) & (meta < B.META_ABSENT)
  assert exceptions.sum() > 0.9 * ALL_PATTERNS.size  # patterns outside the [112, 127] window
  np.testing.assert_array_equal(restored[compressed], bits[compressed])
  # The GPU kernel's split: the producer folds each block's exception once, the consumer selects.
  for dynamic_j in (False, True):
    via_producer, _ = register_decode(c, via_producer=True, dynamic_j=dynamic_j)
    np.testing.assert_array_equal(via_producer[compressed], bits[compressed])
  # The check can fail: without the fold exactly the exception blocks break (an exception's e >> 1
  # lies outside the window, so it never equals hb = 56).
  unfolded, _ = register_decode(c, fold=False)
  np.testing.assert_array_equal(np.any(unfolded != bits, axis=1)[compressed], exceptions[compressed])


def test_the_producers_record_words_map_one_to_one_onto_the_folded_words():
  """`folded_position` (the producer thread's word -> kind, block, which) inverts `folded_word` (the
  consumer's addresses): each of K's and V's 4 blocks' 3 words is written by exactly one thread of
  the slot, below the record's end, above the words the interpreter reads."""
  words = np.arange(restore_mgpu.RECORD_WORDS_V2, dtype=np.uint32)
  is_folded, kind, j, which = restore_mgpu.folded_position(NumpyOps, words)
  np.testing.assert_array_equal(is_folded, words >= restore_mgpu.FOLDED_BASE)
  got = {(int(a), int(b), int(c)): int(w) for w, f, a, b, c in zip(words, is_folded, kind, j, which) if f}
  want = {(a, b, c): restore_mgpu.folded_word(a, b, c) for a in range(2) for b in range(4) for c in range(3)}
  assert got == want
  assert restore_mgpu.INFO_WORDS_V2 <= restore_mgpu.FOLDED_BASE

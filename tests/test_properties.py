"""Property tests (hypothesis) of the block rule and the codec on whole pages.

Blocks are drawn with a chosen minimum exponent and exponent span (so odd and
even minima and spans of exactly 15 and 16 are hit deliberately) and salted
with special values: -0.0, +-Inf, NaN with arbitrary payloads, subnormals.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st

import zipfusion_jax as zf
from bf16_patterns import as_bf16, numpy_block_rule, numpy_decode
from pallas_kernels.compress import compress_pallas
from zipfusion_jax.format import layout

SPECIALS = {
    "neg_zero": lambda rng, n: np.full(n, 0x8000, np.uint16),
    "pos_zero": lambda rng, n: np.zeros(n, np.uint16),
    "inf": lambda rng, n: (0x7F80 | (rng.integers(0, 2, n) << 15)).astype(np.uint16),
    "nan": lambda rng, n: (0x7F80 | rng.integers(1, 128, n) | (rng.integers(0, 2, n) << 15)).astype(np.uint16),
    "subnormal": lambda rng, n: (rng.integers(1, 128, n) | (rng.integers(0, 2, n) << 15)).astype(np.uint16),
}


def block_with_span(rng: np.random.Generator, min_exp: int, span: int) -> np.ndarray:
  """uint16 [512]: exponents in [min_exp, min_exp + span], both ends present."""
  e = rng.integers(min_exp, min_exp + span + 1, 512)
  e[rng.integers(0, 512)] = min_exp
  e[rng.integers(0, 512)] = min_exp + span
  sign = rng.integers(0, 2, 512) << 15
  mantissa = rng.integers(0, 128, 512)
  return (sign | (e << 7) | mantissa).astype(np.uint16)


@st.composite
def blocks(draw, max_blocks=12):
  n = draw(st.integers(1, max_blocks))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  out = []
  for _ in range(n):
    span = draw(st.sampled_from([0, 1, 7, 14, 15, 16, 17, 40]) | st.integers(0, 30))
    min_exp = draw(st.integers(0, 255 - span))
    b = block_with_span(rng, min_exp, span)
    for kind in draw(st.lists(st.sampled_from(sorted(SPECIALS)), max_size=2)):
      where = rng.integers(0, 512, draw(st.integers(1, 4)))
      b[where] = SPECIALS[kind](rng, where.size)
    out.append(b)
  return np.stack(out)


def expected_eligible(bits: np.ndarray) -> np.ndarray:
  e = (bits.astype(np.int32) >> 7) & 0xFF
  return e.max(-1) - (e.min(-1) // 2 * 2) <= 15


@given(blocks())
def test_block_rule_matches_the_words_of_the_spec(bits):
  c = zf.compress(as_bf16(bits))
  want, half_base = numpy_block_rule(bits)
  np.testing.assert_array_equal(want, expected_eligible(bits))
  np.testing.assert_array_equal(np.asarray(c.compressible), want)
  meta = np.asarray(c.meta_bytes).reshape(-1)[: bits.shape[0]]
  np.testing.assert_array_equal(meta, np.where(want, half_base, 0xFF))


@given(blocks())
def test_round_trip_is_bit_exact_and_decodable_independently(bits):
  c = zf.validate(zf.compress(as_bf16(bits)))
  np.testing.assert_array_equal(np.asarray(zf.decompress(c)).view(np.uint16), bits)
  np.testing.assert_array_equal(numpy_decode(c.payload, c.group_meta, range(bits.shape[0])), bits)


@given(st.integers(0, 238), st.integers(0, 2**32 - 1))
def test_span_of_15_from_an_even_minimum_fits_and_16_does_not(min_exp, seed):
  rng = np.random.default_rng(seed)
  even = min_exp // 2 * 2
  fits, spills = block_with_span(rng, even, 15), block_with_span(rng, even, 16)
  odd = block_with_span(rng, even + 1, 15)  # min rounds down: the window is one short
  odd14 = block_with_span(rng, even + 1, 14)
  c = zf.compress(as_bf16(np.stack([fits, spills, odd, odd14])))
  np.testing.assert_array_equal(np.asarray(c.compressible), [True, False, False, True])


@given(
    st.sampled_from(["k", "v"]),
    st.sampled_from([64, 128]),
    st.integers(1, 3),
    st.integers(0, 2**32 - 1),
    st.floats(2.0**-8, 2.0**4),
)
def test_whole_pages_round_trip_through_the_page_layout(kind, head_dim, pages, seed, scale):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(pages, layout.PAGE_SIZE, head_dim)) * scale).astype(np.float32)
  bits = x.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
  specials = rng.integers(0, bits.size, 6)
  bits.reshape(-1)[specials] = [0x8000, 0x7F80, 0xFF81, 0x0001, 0x7FC0, 0x8000]
  page = as_bf16(bits)
  blk = layout.pages_to_blocks(page, kind)
  c = zf.compress(blk)
  note(f"eligible={np.asarray(c.compressible).mean()}")
  back = layout.blocks_to_pages(zf.decompress(c), kind)
  np.testing.assert_array_equal(np.asarray(back).view(np.uint16), bits)


@given(blocks(max_blocks=8))
def test_pallas_interpret_matches_reference_bytes(bits):
  x = as_bf16(np.pad(bits, ((0, 8 - bits.shape[0]), (0, 0))))  # one shape: one compile
  got, want = compress_pallas(x, interpret=True), zf.compress(x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""Every BF16 bit pattern in every slot position of a block round-trips bit for bit.

Two sets of 65,536 blocks each visit all 65,536 patterns at all 512 positions:
one where every block is eligible (16 exponent windows, including b = 0 with
subnormals and b = 240 with Inf/NaN payloads), one where every block is raw.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import zipfusion_jax as zf
from bf16_patterns import ALL_PATTERNS, as_bf16, numpy_decode
from pallas_kernels.compress import compress_pallas

PALLAS_CHUNK = 1024  # interpret mode is fast only on small calls


def test_pattern_sets_cover_every_pattern_at_every_position(eligible_rotations, raw_rotations):
  for bits in (eligible_rotations, raw_rotations):
    assert bits.shape == (65536, 512)
    for pos in (0, 3, 4, 7, 255, 256, 511):
      np.testing.assert_array_equal(np.sort(bits[:, pos]), ALL_PATTERNS)


@pytest.mark.parametrize("which, eligible", [("eligible_rotations", True), ("raw_rotations", False)])
def test_reference_round_trip_all_patterns(which, eligible, request):
  bits = request.getfixturevalue(which)
  c = zf.compress(as_bf16(bits), impl="reference")
  assert bool(np.all(np.asarray(c.compressible) == eligible))
  assert c.nbytes == bits.shape[0] * (768 if eligible else 1024) + bits.shape[0] // 4 * 8
  zf.validate(c)
  back = np.asarray(zf.decompress(c)).view(np.uint16)
  np.testing.assert_array_equal(back, bits)
  # An independent byte-level decoder agrees on a sample spread over the whole set.
  sample = np.arange(0, bits.shape[0], 997)
  np.testing.assert_array_equal(numpy_decode(c.payload, c.group_meta, sample), bits[sample])


@pytest.mark.parametrize("which", ["eligible_rotations", "raw_rotations"])
def test_pallas_interpret_bytes_equal_reference_all_patterns(which, request):
  bits = request.getfixturevalue(which)
  ref = jax.jit(zf.compress)
  for start in range(0, bits.shape[0], PALLAS_CHUNK):
    x = as_bf16(bits[start : start + PALLAS_CHUNK])
    got, want = compress_pallas(x, interpret=True), ref(x)
    for name in ("payload", "group_meta", "payload_units"):
      np.testing.assert_array_equal(
          np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=f"{name} at block {start}"
      )
    np.testing.assert_array_equal(np.asarray(zf.decompress(got)).view(np.uint16), bits[start : start + PALLAS_CHUNK])

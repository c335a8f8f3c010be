"""The fused kernel's per-group integer arithmetic (`pallas_kernels/restore_mgpu.py`), run on numpy
with the kernel's own functions: the same code builds the MLIR on the GPU."""

from __future__ import annotations

import itertools

import numpy as np

from pallas_kernels import restore_mgpu
from test_format_v2 import NumpyOps
from zipfusion_jax.format import block as B

# Every kind of slot byte: compressed b/2 (version 1 up to 0x7F), version 2's flagged 0x80 | b/2
# (up to 0xFD), absent, raw.
SLOT_BYTES = np.array([0x00, 0x01, 0x3F, 0x7E, 0x7F, 0x80, 0x81, 0xBF, 0xFC, 0xFD, B.META_ABSENT, B.META_RAW], np.uint32)


def test_block_starts_word_is_the_prefix_sum_of_block_units_for_every_slot_byte_combination():
  combos = np.array(list(itertools.product(SLOT_BYTES, repeat=4)), np.uint32)  # [N, 4], block j = byte j
  word1 = (combos << (8 * np.arange(4, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
  got = restore_mgpu.block_starts_word(NumpyOps, word1)
  units = np.where(combos == B.META_RAW, B.RAW_UNITS, np.where(combos == B.META_ABSENT, 0, B.COMPRESSED_UNITS))
  starts = np.cumsum(units, axis=1) - units
  for j in range(4):
    want = starts[:, j]
    # Absent slots only ever follow the last block, so their own size never precedes a real block.
    real = (combos[:, :j] != B.META_ABSENT).all(axis=1)
    np.testing.assert_array_equal((got[real] >> np.uint32(8 * j)) & np.uint32(0xFF), want[real])

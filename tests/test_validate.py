"""validate() turns every kind of corrupted metadata into a FormatError; decode never reads out of bounds."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import zipfusion_jax as zf
from zipfusion_jax.format import block as B


@pytest.fixture
def c():
  x = np.random.default_rng(0).normal(size=(10, 512)).astype(ml_dtypes.bfloat16)
  x[2, 0] = ml_dtypes.bfloat16(1e20)  # block 2 raw
  return zf.validate(zf.compress(x))  # 3 groups, the last holds 2 blocks


def _with_meta(c, g, word, value):
  meta = np.asarray(c.group_meta).copy()
  meta[g, word] = value
  return c.replace(group_meta=jnp.asarray(meta))


def _slot(c, g, k, byte):
  word = int(np.asarray(c.group_meta)[g, 1])
  word = (word & ~(0xFF << (8 * k))) | (byte << (8 * k))
  return _with_meta(c, g, 1, word)


def test_valid_data_passes(c):
  assert zf.validate(c) is c
  assert int(c.payload_units) == 9 * 3 + 4


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda c: _with_meta(c, 1, 0, (2 << 30) | 12), "unsupported format version 2"),
        (lambda c: _with_meta(c, 1, 0, (1 << 30) | 10**6), "out of range"),
        (lambda c: _with_meta(c, 2, 0, (1 << 30) | 0), "overlap"),
        (lambda c: _slot(c, 0, 1, 0x80), "slot 1: metadata byte 0x80"),
        (lambda c: _slot(c, 1, 3, B.META_ABSENT), "expected b/2"),
        (lambda c: _slot(c, 2, 3, 0x05), "expected absent"),
        (lambda c: _slot(c, 0, 0, B.META_RAW), "out of range|overlap|payload_units"),
        (lambda c: c.replace(payload_units=jnp.int32(5)), "out of range"),
        (lambda c: c.replace(payload_units=jnp.int32(40)), "payload_units=40"),
        (lambda c: c.replace(group_meta=c.group_meta[:2]), "uint32 \\[3, 2\\]"),
        (lambda c: c.replace(group_meta=c.group_meta.astype(jnp.int32)), "uint32"),
        (lambda c: c.replace(payload=c.payload[:2048]), "out of range"),
        # Containers of the wrong type: a wider payload decodes its values >= 256 as garbage bytes.
        (lambda c: c.replace(payload=c.payload.astype(jnp.uint16) << 8), "payload must be uint8"),
        (lambda c: c.replace(payload=c.payload.reshape(-1, 256)), "payload must be uint8 \\[n\\]"),
        (lambda c: c.replace(payload_units=jnp.float32(31.5)), "payload_units must be an integer scalar"),
        (lambda c: c.replace(payload_units=jnp.array([31, 0], jnp.int32)), "payload_units must be an integer scalar"),
    ],
)
def test_corruption_is_reported(c, corrupt, message):
  with pytest.raises(zf.FormatError, match=message):
    zf.validate(corrupt(c))


@pytest.mark.parametrize("g, value", [(1, (1 << 30) | (2**30 - 1)), (0, (3 << 30) | 5), (2, 0xFFFFFFFF)])
def test_decode_of_corrupted_offsets_stays_in_bounds(c, g, value):
  bad = _with_meta(c, g, 0, value)
  out = np.asarray(zf.decompress(bad)).view(np.uint16)
  good = np.asarray(zf.decompress(c)).view(np.uint16)
  untouched = [i for i in range(10) if i // 4 != g]
  np.testing.assert_array_equal(out[untouched], good[untouched])
  # The corrupted group reads zero bytes: a 12-bit block restores to its base, a raw block to 0.
  hit = [i for i in range(10) if i // 4 == g]
  meta = np.asarray(c.meta_bytes).reshape(-1)[hit]
  np.testing.assert_array_equal(out[hit], np.where(meta <= 127, meta << 8, 0)[:, None].repeat(512, 1))


def test_format_error_is_a_value_error():
  assert issubclass(zf.FormatError, ValueError)

"""Eligibility telemetry against an independent numpy count and against compress()."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import zipfusion_jax as zf
from bf16_patterns import numpy_block_rule
from zipfusion_jax.format import layout


def _kv(layers=2, heads=3, tokens=70, head_dim=64, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(layers, heads, tokens, head_dim)).astype(np.float32)
  mask = rng.random(x.shape) < 2e-3  # sparse outliers make some blocks raw
  x[mask] *= 1e6
  return x.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fractions_and_bits_match_numpy_and_compress(kind, head_dim):
  x = _kv(head_dim=head_dim, seed=head_dim)
  r = zf.eligibility_report(x, kind)
  L, H, T, D = x.shape
  pages = T // 16
  assert r.pages == pages and r.kind == kind
  assert r.eligible_fraction.shape == (L, H) and r.bits_per_value.shape == (L, H)
  perm = layout.page_permutation(kind, D)
  for l in range(L):
    for h in range(H):
      paged = x[l, h, : pages * 16].view(np.uint16).reshape(pages, 16 * D)
      blocks = paged[:, perm].reshape(-1, 512)  # [pages * blocks_per_page, 512]
      eligible, _ = numpy_block_rule(blocks)
      assert r.eligible_fraction[l, h] == pytest.approx(eligible.mean())
      c = zf.compress(blocks.view(ml_dtypes.bfloat16))
      assert r.bits_per_value[l, h] == pytest.approx(c.nbytes * 8 / (pages * 16 * D))
  assert 0.0 < r.overall_eligible_fraction < 1.0
  assert 12.0 < r.overall_bits_per_value < 16.2
  assert r.compression_ratio == pytest.approx(16.0 / r.overall_bits_per_value)


def test_all_eligible_tensor_costs_12_bits_plus_metadata():
  x = np.ones((1, 1, 64, 128), ml_dtypes.bfloat16)
  r = zf.eligibility_report(x, "k")
  assert r.eligible_fraction[0, 0] == 1.0
  assert r.bits_per_value[0, 0] == pytest.approx(12.0 + 4 * 8 * 8 / (64 * 128))


def test_bad_inputs():
  with pytest.raises(TypeError, match="bfloat16"):
    zf.eligibility_report(np.zeros((1, 1, 16, 64), np.float32), "k")
  with pytest.raises(ValueError, match="layers, kv_heads"):
    zf.eligibility_report(np.zeros((1, 16, 64), ml_dtypes.bfloat16), "k")
  with pytest.raises(ValueError, match="complete"):
    zf.eligibility_report(np.zeros((1, 1, 15, 64), ml_dtypes.bfloat16), "v")
  with pytest.raises(ValueError, match="head_dim"):
    zf.eligibility_report(np.zeros((1, 1, 16, 80), ml_dtypes.bfloat16), "v")


@pytest.mark.parametrize("kind", ["k", "v"])
def test_version_2_report_matches_compress(kind):
  x = _kv(head_dim=128, seed=7)
  r1, r2 = zf.eligibility_report(x, kind), zf.eligibility_report(x, kind, version=2)
  assert r2.version == 2 and np.all(r2.eligible_fraction >= r1.eligible_fraction)
  pages, D = x.shape[2] // 16, x.shape[3]
  perm = layout.page_permutation(kind, D)
  for l in range(x.shape[0]):
    for h in range(x.shape[1]):
      blocks = x[l, h, : pages * 16].view(np.uint16).reshape(pages, 16 * D)[:, perm].reshape(-1, 512)
      c = zf.compress(blocks.view(ml_dtypes.bfloat16), version=2)
      assert r2.eligible_fraction[l, h] == pytest.approx(float(np.mean(c.compressible)))
      assert r2.bits_per_value[l, h] == pytest.approx(c.nbytes * 8 / (pages * 16 * D))
  with pytest.raises(ValueError, match="version"):
    zf.eligibility_report(x, kind, version=3)

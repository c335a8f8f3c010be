"""Bits per value of format versions 1 and 2 on the embedded model's real K/V (CPU).

  python -m benchmarks.density [--tokens 2048] [--rope fp32,bf16] [--out benchmarks/results/density.json]

K and V come from SmolLM2-135M-Instruct's prefill over this repository's documentation
(`benchmarks.capacity.smollm2_real_kv`). `--rope fp32` is the decoder as it is (RoPE in fp32,
rounded to BF16 once); `bf16` recomputes K with RoPE as BF16 elementwise ops, what many
implementations do, which leaves exact ±0 in K. Each row: the format version's rule and
metadata (`zipfusion_jax.eligibility_report`), K and V separately and K+V.

Rows: {"version", "model", "rope", "tokens", "bits_per_value_k", "bits_per_value_v", "bits_per_value",
"eligible_k", "eligible_v"}. The JSON's "alternatives" holds the rules measured before version 2's
layout was fixed (docs/FORMAT.md §9): per RoPE and K/V, the share of blocks each rule keeps in 12
bits (version 1; one exception; one exception + a zero escape that takes ±0 out of the window),
and how the version-1 failures break down.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.capacity import smollm2_real_kv
from benchmarks.generate import save_result
from models import layers
from zipfusion_jax.format import block as B
from zipfusion_jax.format import layout
from zipfusion_jax.format.block import FORMAT_VERSIONS
from zipfusion_jax.telemetry import eligibility_report


def apply_rope_bf16(x, positions, config):
  """RoPE as BF16 elementwise ops (cos/sin rounded to BF16, every product and sum in BF16)."""
  inv = jnp.asarray(layers.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling))
  angles = positions.astype(jnp.float32)[:, None] * inv[None, :]
  cos = jnp.cos(angles)[:, None, :].astype(jnp.bfloat16)
  sin = jnp.sin(angles)[:, None, :].astype(jnp.bfloat16)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@contextlib.contextmanager
def rope_arithmetic(kind: str):
  """The decoder's RoPE for the block: "fp32" (as shipped) or "bf16" (elementwise BF16)."""
  if kind == "fp32":
    yield
    return
  original = layers.apply_rope
  layers.apply_rope = apply_rope_bf16
  jax.clear_caches()  # a prefill already traced with the shipped RoPE must be traced again
  try:
    yield
  finally:
    layers.apply_rope = original
    jax.clear_caches()


def rule_shares(x, kind: str) -> dict:
  """Shares of the blocks of x bfloat16 [layers, tokens, kv_heads, head_dim] that candidate rules keep."""
  blocks = layout.pages_to_blocks(layout.split_pages(jnp.asarray(x).transpose(0, 2, 1, 3)), kind)
  bits = np.asarray(B.to_bits(blocks)).reshape(-1, B.VALUES_PER_BLOCK)
  e = ((bits.astype(np.int32) >> 7) & 0xFF)
  zero = (bits & 0x7FFF) == 0
  fits = lambda lo, hi: hi - (lo & ~1) < B.EXPONENT_WINDOW

  def one_exception(s, count):  # s: sorted exponents, the first `count` of each row in play
    n = np.arange(len(s))
    hi1, hi2 = s[n, np.maximum(count - 1, 0)], s[n, np.maximum(count - 2, 0)]
    return (count <= 2) | fits(s[:, 0], hi1) | fits(s[:, 0], hi2) | fits(s[:, 1], hi1)

  s = np.sort(e, axis=1)
  v1 = fits(s[:, 0], s[:, -1])
  exc = one_exception(s, np.full(len(e), B.VALUES_PER_BLOCK))
  zx = one_exception(np.sort(np.where(zero, 1 << 20, e), axis=1), (~zero).sum(1))  # zero escape: ±0 sorted last, out of play
  fail = ~v1
  return dict(version1=float(v1.mean()), one_exception=float(exc.mean()), one_exception_zero_escape=float(zx.mean()),
              failing_with_a_zero=float((zero.any(1) & fail).sum() / max(fail.sum(), 1)),
              failing_fixed_by_one_exception=float((exc & fail).sum() / max(fail.sum(), 1)))


def rows_for(k, v, rope: str) -> list[dict]:
  """k, v: bfloat16 [layers, tokens, kv_heads, head_dim] -> one row per format version."""
  to_lhtd = lambda x: x.transpose(0, 2, 1, 3)
  out = []
  for version in FORMAT_VERSIONS:
    rk, rv = eligibility_report(to_lhtd(k), "k", version), eligibility_report(to_lhtd(v), "v", version)
    bk, bv = rk.overall_bits_per_value, rv.overall_bits_per_value
    out.append(dict(version=version, model="smollm2-135m", rope=rope, tokens=int(k.shape[1]), bits_per_value_k=bk,
                    bits_per_value_v=bv, bits_per_value=(bk + bv) / 2, eligible_k=rk.overall_eligible_fraction,
                    eligible_v=rv.overall_eligible_fraction))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--rope", default="fp32,bf16")
  p.add_argument("--out", type=pathlib.Path, default=None)
  a = p.parse_args(argv)
  rows, alternatives = [], []
  for rope in a.rope.split(","):
    with rope_arithmetic(rope):
      k, v = smollm2_real_kv(a.tokens)
    for kind, x in (("k", k), ("v", v)):
      alternatives.append(dict(rope=rope, kind=kind, **rule_shares(x, kind)))
      print(f"rope {rope} {kind.upper()}: blocks kept " + ", ".join(f"{n} {x:.4f}" for n, x in alternatives[-1].items()
                                                                     if isinstance(x, float)), flush=True)
    for r in rows_for(k, v, rope):
      rows.append(r)
      print(f"version {r['version']} rope {rope}: K {r['bits_per_value_k']:.3f} ({100 * r['eligible_k']:.1f}% eligible) "
            f"V {r['bits_per_value_v']:.3f} ({100 * r['eligible_v']:.1f}%) K+V {r['bits_per_value']:.3f} bits/value "
            f"({16 / r['bits_per_value']:.3f}x)", flush=True)
  return save_result(a.out, rows, alternatives=alternatives)


if __name__ == "__main__":
  main()

"""Main job until the decoder lands: compress a SmolLM2-shaped KV cache and prove it lossless.

  python -m zipfusion_jax.demo [--tokens 2048] [--impl reference|pallas]

K and V of [30 layers, 3 KV heads, tokens, head_dim 64] (SmolLM2-135M's shapes)
are drawn with per-channel scales and rare single outliers, the statistics
measured on real KV. Prints eligibility per layer, bits per value, the
compression ratio and a bit-exact check of the round trip.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

import zipfusion_jax as zf
from zipfusion_jax.format import layout

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M


def demo_kv(key: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
  """bfloat16 K, V [LAYERS, KV_HEADS, tokens, HEAD_DIM] with real-KV-like exponent statistics."""
  shape = (LAYERS, KV_HEADS, tokens, HEAD_DIM)
  out = []
  for kind_key in jax.random.split(key, 2):
    k_val, k_scale, k_out = jax.random.split(kind_key, 3)
    channel_scale = jnp.exp2(jax.random.uniform(k_scale, (LAYERS, KV_HEADS, 1, HEAD_DIM), minval=-1.0, maxval=1.0))
    x = jax.random.normal(k_val, shape) * channel_scale
    tiny = jax.random.uniform(k_out, shape) < 1.5e-4  # ~7% of blocks hold one far-off value
    out.append(jnp.where(tiny, x * 2.0**-18, x).astype(jnp.bfloat16))
  return out[0], out[1]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=2048)
  ap.add_argument("--impl", choices=["reference", "pallas"], default="reference")
  args = ap.parse_args(argv)
  if args.tokens < layout.PAGE_SIZE:
    ap.error(f"--tokens must be >= {layout.PAGE_SIZE} (one complete page), got {args.tokens}")
  console = Console()
  console.print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; impl={args.impl}")
  k, v = demo_kv(jax.random.key(0), args.tokens)
  reports = {"k": zf.eligibility_report(k, "k"), "v": zf.eligibility_report(v, "v")}

  table = Table(title=f"Eligible blocks per layer ({args.tokens} tokens, mean over {KV_HEADS} KV heads)")
  table.add_column("layer", justify="right")
  for kind in "kv":
    table.add_column(f"{kind.upper()} eligible", justify="right")
    table.add_column(f"{kind.upper()} bits/value", justify="right")
  for layer in range(0, LAYERS, 5):
    cells = [str(layer)]
    for r in reports.values():
      cells += [f"{r.eligible_fraction[layer].mean():.3f}", f"{r.bits_per_value[layer].mean():.2f}"]
    table.add_row(*cells)
  console.print(table)

  ok = True
  for kind, x in (("k", k), ("v", v)):
    paged = layout.split_pages(x)  # [L, H, P, 16, D]
    blocks = layout.pages_to_blocks(paged, kind)  # [L, H, P, 2, 512]
    t = time.perf_counter()
    c = zf.validate(jax.block_until_ready(zf.compress(blocks, impl=args.impl)))
    seconds = time.perf_counter() - t
    back = layout.blocks_to_pages(zf.decompress(c), kind)
    exact = bool(jnp.array_equal(jax.lax.bitcast_convert_type(back, jnp.uint16),
                                 jax.lax.bitcast_convert_type(paged, jnp.uint16)))
    ok &= exact
    console.print(
        f"{kind.upper()}: {c.num_blocks} blocks, {float(np.mean(c.compressible)):.3f} eligible, "
        f"{c.uncompressed_nbytes / 2**20:.1f} MiB -> {c.nbytes / 2**20:.1f} MiB "
        f"({8 * c.nbytes / (c.num_blocks * 512):.2f} bits/value, ratio {c.uncompressed_nbytes / c.nbytes:.3f}), "
        f"compress {seconds:.2f} s, round trip bit-exact: {'yes' if exact else 'NO'}"
    )
  console.print("[bold green]lossless[/]" if ok else "[bold red]MISMATCH[/]")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())

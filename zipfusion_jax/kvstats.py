"""Eligibility of a real KV cache: `python -m zipfusion_jax.kvstats --text FILE [--max-tokens N] [--gguf PATH] [--json OUT]`.

Runs the embedded SmolLM2-135M-Instruct (or `--gguf PATH`) prefill over the text with fp32 RoPE, takes
the RoPE'd K and the V of every layer and KV head from the dense reference cache, and reports per layer
and head the share of 512-value blocks the 12-bit format stores compressed and the bits per value
(`zipfusion_jax.eligibility_report`; complete 16-token pages only), for format version 1, then the
totals of version 2 (one exception per block).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

from zipfusion_jax.format.layout import PAGE_SIZE
from zipfusion_jax.jsonio import write_json_atomic
from zipfusion_jax.telemetry import EligibilityReport, eligibility_report


def prompt_kv(params, config, ids: list[int]):
  """K and V of a prompt: bfloat16 [layers, kv_heads, tokens, head_dim] each, as the cache would hold them."""
  from models.decoder import prefill_jit
  from models.dense_backend import DenseKVBackend, prefill_plan

  backend = DenseKVBackend()
  t = len(ids)
  state = backend.init_state(config.layers, 1, t, config.kv_heads, config.head_dim)
  _, state = prefill_jit(params, config, jnp.asarray(ids, jnp.int32), jnp.int32(t), state, prefill_plan(1, 0, t), backend)
  to_lhtd = lambda x: x[:, 0].transpose(0, 2, 1, 3)  # [L, 1, T, H, D] -> [L, H, T, D]
  return to_lhtd(state.k), to_lhtd(state.v)


def format_reports(k: EligibilityReport, v: EligibilityReport) -> str:
  """One line per layer: eligible % and bits/value of each KV head, for K then V; totals last."""
  heads = k.eligible_fraction.shape[1]
  cell = lambda r, l, h: f"{100 * r.eligible_fraction[l, h]:5.1f}% {r.bits_per_value[l, h]:5.2f}b"
  head_cols = "  ".join(f"h{h:<12d}" for h in range(heads))
  lines = [f"{k.pages} complete pages of {PAGE_SIZE} tokens per (layer, head); cells: eligible blocks, bits/value",
           f"layer | K {head_cols} | V {head_cols}"]
  for layer in range(k.eligible_fraction.shape[0]):
    ks = "  ".join(cell(k, layer, h) for h in range(heads))
    vs = "  ".join(cell(v, layer, h) for h in range(heads))
    lines.append(f"{layer:5d} | K {ks} | V {vs}")
  for r in (k, v):
    lines.append(
        f"{r.kind.upper()}: {100 * r.overall_eligible_fraction:.1f}% of blocks eligible, "
        f"{r.overall_bits_per_value:.2f} bits/value ({r.compression_ratio:.3f}x)"
    )
  both = (k.overall_bits_per_value + v.overall_bits_per_value) / 2
  lines.append(f"K+V: {both:.2f} bits/value ({16 / both:.3f}x)")
  return "\n".join(lines)


def _as_json(r: EligibilityReport) -> dict:
  return {"eligible_fraction": np.round(r.eligible_fraction, 6).tolist(),
          "bits_per_value": np.round(r.bits_per_value, 6).tolist(), "pages": r.pages}


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m zipfusion_jax.kvstats", description=__doc__.split("\n")[0])
  p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to prefill")
  p.add_argument("--max-tokens", type=int, default=2048, help="truncate the text to this many tokens")
  p.add_argument("--gguf", default=None, metavar="PATH", help="a GGUF model instead of the embedded one")
  p.add_argument("--json", default=None, metavar="OUT", help="also write the per-layer/head figures as JSON")
  args = p.parse_args(argv)
  try:
    with open(args.text, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    print(f"error: {args.text}: {e}", file=sys.stderr)
    return 2
  from models.loaders import resolve

  try:
    model = resolve.from_gguf(args.gguf) if args.gguf else resolve.from_name("smollm2-135m")
    ids = model.tokenizer.encode(text)[: min(args.max_tokens, model.config.max_position)]
    if len(ids) < PAGE_SIZE:
      raise ValueError(f"{args.text}: {len(ids)} tokens hold no complete {PAGE_SIZE}-token page")
    k, v = prompt_kv(model.params, model.config, ids)
    reports = eligibility_report(k, "k"), eligibility_report(v, "v")
    reports_v2 = eligibility_report(k, "k", version=2), eligibility_report(v, "v", version=2)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{model.config.name}: {len(ids)} tokens of {args.text}")
  print(format_reports(*reports))
  print("format version 2 (one exception per block, 16-byte group records):")
  print("\n".join(format_reports(*reports_v2).splitlines()[-3:]))
  if args.json:
    write_json_atomic(args.json, {
        "model": model.config.name, "tokens": len(ids),
        **{r.kind: _as_json(r) for r in reports}, "version2": {r.kind: _as_json(r) for r in reports_v2},
    })
  return 0


if __name__ == "__main__":
  sys.exit(main())

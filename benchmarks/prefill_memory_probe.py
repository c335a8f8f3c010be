"""Does prefill attention take the cuDNN path at 8B shapes, and what does one prefill layer allocate?

  python -m benchmarks.prefill_memory_probe [--tokens 8192]

Prints whether `jax.nn.dot_product_attention(implementation="cudnn")` accepts Llama-3.1-8B's
GQA shapes at the padded prefill length, and XLA's memory analysis (temp bytes) of
`models.decoder.causal_attention` there: a fallback to XLA materialises [Hq, T, T] fp32 logits.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from models.configs import get_config
from models.decoder import causal_attention


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--model", default="llama3.1-8b")
  a = p.parse_args(argv)
  c = get_config(a.model)
  q = jax.ShapeDtypeStruct((a.tokens, c.q_heads, c.head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((a.tokens, c.kv_heads, c.head_dim), jnp.bfloat16)
  try:
    jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                         implementation="cudnn")[0]).lower(q, kv, kv).compile()
    print("cudnn: accepted")
  except Exception as e:  # the decoder falls back to XLA on any of these
    print(f"cudnn: refused: {type(e).__name__}: {str(e)[:300]}")
  m = jax.jit(causal_attention).lower(q, kv, kv).compile().memory_analysis()
  print(f"causal_attention at T={a.tokens}: temp {m.temp_size_in_bytes / 2**30:.2f} GiB, "
        f"logits [Hq, T, T] fp32 would be {c.q_heads * a.tokens**2 * 4 / 2**30:.2f} GiB")


if __name__ == "__main__":
  main()

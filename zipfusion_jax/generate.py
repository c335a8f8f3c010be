"""Generate text: `python -m zipfusion_jax.generate --prompt TEXT [--prompt TEXT ...]`.

    [--max-new-tokens N] [--kv compressed|uncompressed] [--kv-memory-mib M] [--max-batch N]
    [--model NAME | --gguf PATH | --safetensors DIR] [--random-weights] [--chat]
    [--temperature T] [--seed S] [--json OUT]

Defaults: the embedded SmolLM2-135M-Instruct, compressed KV, greedy. One prompt streams its tokens
to stdout; the summary (tokens/s) goes to stderr. `--json` writes
`{"results": [{"prompt", "prompt_ids", "token_ids", "text"}], "stats": {...}}` (token_ids: generated
tokens only) through a temporary file and a rename, so a failed run leaves nothing behind.
Errors (unknown model, prompt longer than the context, corrupted checkpoint) print one line on
stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from zipfusion_jax.jsonio import write_json_atomic

DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m zipfusion_jax.generate", description=__doc__.split("\n")[0])
  p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--kv", choices=("compressed", "uncompressed"), default="compressed", help="KV cache format")
  p.add_argument("--kv-memory-mib", type=float, default=None, help="KV cache memory budget in MiB")
  p.add_argument("--max-batch", type=int, default=8, help="prompts decoded together")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--model", default=None, help=f"registry name (default {DEFAULT_MODEL})")
  src.add_argument("--gguf", default=None, metavar="PATH", help="a Llama/Qwen3 GGUF file")
  src.add_argument("--safetensors", default=None, metavar="DIR", help="a Hugging Face checkpoint directory")
  p.add_argument("--random-weights", action="store_true", help="with --model: random weights, byte tokenizer")
  p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, metavar="OUT", help="write results and stats as JSON")
  args = p.parse_args(argv)
  if args.max_new_tokens < 0:
    p.error("--max-new-tokens must be >= 0")
  if args.max_batch < 1:
    p.error("--max-batch must be >= 1")
  if args.temperature < 0:
    p.error("--temperature must be >= 0")
  if args.random_weights and (args.gguf or args.safetensors):
    p.error("--random-weights goes with --model")
  return args


def _load(args):
  from models.loaders import resolve

  if args.gguf:
    return resolve.from_gguf(args.gguf)
  if args.safetensors:
    return resolve.from_safetensors(args.safetensors)
  return resolve.from_name(args.model or DEFAULT_MODEL, random_weights=args.random_weights, seed=args.seed)


def _check_kv_memory(config, slots: int, max_len: int, mib: float | None) -> None:
  """The dense cache holds K and V of every slot at full length; refuse before allocating it."""
  if mib is None:
    return
  need = config.kv_bytes_per_token() * slots * max_len
  if need > mib * 2**20:
    raise ValueError(
        f"KV cache for {slots} prompts x {max_len} tokens needs {need / 2**20:.1f} MiB > --kv-memory-mib {mib:g}"
    )


class _Streamer:
  """Prints one prompt's text as tokens arrive (re-decoding so multi-byte characters come out whole)."""

  def __init__(self, tokenizer, out):
    self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], ""

  def __call__(self, slot: int, token: int) -> None:
    self.ids.append(token)
    text = self.tokenizer.decode(self.ids)
    if not text.endswith("\ufffd"):
      self.out.write(text[len(self.shown):])
      self.out.flush()
      self.shown = text


def run(args: argparse.Namespace, out=None, err=None) -> dict:
  """Load, generate, print (to `out`/`err`, default stdout/stderr); returns the JSON payload (written when `--json` is given)."""
  out, err = out or sys.stdout, err or sys.stderr
  from models.generate_simple import cache_len, check_fits, generate

  model = _load(args)
  tok = model.tokenizer
  prompt_ids = [tok.encode_chat(p) if args.chat else tok.encode(p) for p in args.prompt]
  for ids in prompt_ids:
    check_fits(model.config, len(ids), args.max_new_tokens)
  results, totals = [], dict(prefill_s=0.0, decode_s=0.0, new_tokens=0, prompt_tokens=0)
  stream = len(args.prompt) == 1
  for start in range(0, len(prompt_ids), args.max_batch):
    batch = prompt_ids[start : start + args.max_batch]
    _check_kv_memory(model.config, len(batch), cache_len([len(b) for b in batch], args.max_new_tokens), args.kv_memory_mib)
    # TODO(integrator): swap in the serving engine (paged, compressed when --kv compressed); this
    # path runs the reference DenseKVBackend for both --kv settings.
    gen = generate(
        model.params, model.config, batch, args.max_new_tokens, eos_ids=tok.eos_ids,
        temperature=args.temperature, seed=args.seed + start, on_token=_Streamer(tok, out) if stream else None,
    )
    for i, ids in enumerate(gen.token_ids):
      prompt = args.prompt[start + i]
      text = tok.decode(ids)
      results.append(dict(prompt=prompt, prompt_ids=batch[i], token_ids=ids, text=text))
      if not stream:
        out.write(f"--- {prompt}\n{text}\n")
    totals["prefill_s"] += gen.prefill_s
    totals["decode_s"] += gen.decode_s
    totals["new_tokens"] += gen.new_tokens
    totals["prompt_tokens"] += sum(len(b) for b in batch)
  if stream:
    out.write("\n")
  elapsed = totals["prefill_s"] + totals["decode_s"]
  stats = dict(
      model=model.config.name, source=model.source, kv=args.kv, kv_backend="dense-reference",
      prompts=len(args.prompt), **totals,
      tokens_per_s=totals["new_tokens"] / elapsed if elapsed > 0 else 0.0,
  )
  err.write(
      f"{stats['new_tokens']} tokens in {elapsed:.2f} s ({stats['tokens_per_s']:.1f} tokens/s; prefill "
      f"{totals['prefill_s']:.2f} s, decode {totals['decode_s']:.2f} s; compile time included) "
      f"[{model.config.name}, kv={args.kv} via the dense reference backend]\n"
  )
  payload = dict(results=results, stats=stats)
  if args.json:
    write_json_atomic(args.json, payload)
  return payload


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    run(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())

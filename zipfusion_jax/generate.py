"""Generate text: `python -m zipfusion_jax.generate --prompt TEXT [--prompt TEXT ...]`.

    [--max-new-tokens N] [--kv compressed|uncompressed] [--kv-memory-mib M] [--max-batch N]
    [--model NAME | --gguf PATH | --safetensors DIR] [--random-weights] [--chat]
    [--temperature T [--top-k K] [--top-p P]] [--seed S] [--json OUT]

Defaults: the embedded SmolLM2-135M-Instruct, compressed KV, greedy. The prompts run as one
continuously batched workload through the serving engine (`zipfusion_jax/serving`: paged KV,
completed pages in the 12-bit format with `--kv compressed`, a store of `--kv-memory-mib`,
`--max-batch` sequence slots); decode attention is the fused kernel on a GPU and the jnp
reference elsewhere. One prompt streams its tokens to stdout, several show a progress bar; the
summary (tokens/s, KV bytes, compression ratio, eligible-block fraction) goes to stderr. `--json`
writes `{"results": [{"prompt", "prompt_ids", "token_ids", "text"}], "stats": {...}}` (token_ids:
generated tokens only, ending with the end-of-sequence token if one came) through a temporary file and a
rename, so a failed run leaves nothing behind. Errors (unknown model, prompt longer than the
context, a budget smaller than one request, corrupted checkpoint) print one line on stderr and
exit with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys

from zipfusion_jax.jsonio import write_json_atomic

DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m zipfusion_jax.generate", description=__doc__.split("\n")[0])
  p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--kv", choices=("compressed", "uncompressed"), default="compressed", help="KV cache format")
  p.add_argument("--format-version", type=int, choices=(1, 2), default=1,
                 help="format of the compressed pages: 1, or 2 (one exception per block; docs/FORMAT.md)")
  p.add_argument("--kv-memory-mib", type=float, default=None,
                 help="KV cache memory budget in MiB (with --tensor-parallel N: over all N devices, 1/N each)")
  p.add_argument("--max-batch", type=int, default=8, help="prompts decoded together")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--model", default=None, help=f"registry name (default {DEFAULT_MODEL})")
  src.add_argument("--gguf", default=None, metavar="PATH", help="a Llama/Qwen3 GGUF file")
  src.add_argument("--safetensors", default=None, metavar="DIR", help="a Hugging Face checkpoint directory")
  p.add_argument("--random-weights", action="store_true", help="with --model: random weights, byte tokenizer")
  p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="with --temperature: sample among the k most likely tokens (0: all)")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="with --temperature: sample among the fewest tokens whose probability reaches P (1: all)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, metavar="OUT", help="write results and stats as JSON")
  p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                 help="shard heads, MLP and KV over N devices (N must divide the KV heads)")
  args = p.parse_args(argv)
  if args.max_new_tokens < 0:
    p.error("--max-new-tokens must be >= 0")
  if args.max_batch < 1:
    p.error("--max-batch must be >= 1")
  if args.kv_memory_mib is not None and not (math.isfinite(args.kv_memory_mib) and args.kv_memory_mib > 0):
    p.error(f"--kv-memory-mib must be a finite number > 0 (got {args.kv_memory_mib:g})")
  from models.sampling import Sampling  # here: `--help` and argparse's own errors need no jax

  try:  # --temperature, --top-k, --top-p: the sampler's own checks, as usage errors
    Sampling(args.temperature, args.top_k, args.top_p)
  except ValueError as e:
    p.error(str(e))
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


MIN_CHUNK_PAGES, MAX_CHUNK_PAGES = 16, 64  # raw pages of one layer per store chunk
CHUNKS_PER_LAYER = 32  # the finest granularity worth keeping: a layer's store in at least this many chunks


def chunk_pages_for(pages_per_layer: int, compressed: bool = True) -> int:
  """Chunk size (raw pages of one layer) for a store of `pages_per_layer` raw pages per layer.

  A layer opens a fresh chunk when a raw page no longer fits its current one, so each chunk
  strands up to one raw page less one compressed page: ~4.6% of a 12-bit store at 16 pages a
  chunk, ~1.1% at 64. Larger chunks pin more dead space of finished sequences, and a store must
  keep enough chunks per layer to share them: the largest power of two in [16, 64] that leaves
  >= 32 chunks per layer. Host simulation of `benchmarks/e2e.py`'s admission (Llama-3.1-8B, 48
  GiB, 95% eligible): 16 -> 64 pages a chunk admits 57 -> 59 sequences at 8K (format 2: 58 ->
  60), 209 -> 217 at 2K, 14 -> 15 at 32K (`python -m benchmarks.capacity --admission`).
  A BF16 store strands nothing, and its budget rounds to fewer whole chunks when they are larger
  (168 -> 167 sequences at 2K): it keeps 16.
  """
  if not compressed:
    return MIN_CHUNK_PAGES
  c = MIN_CHUNK_PAGES
  while c * 2 <= MAX_CHUNK_PAGES and pages_per_layer // (c * 2) >= CHUNKS_PER_LAYER:
    c *= 2
  return c


def budget_pages_per_layer(config, budget_bytes: int) -> int:
  """Raw (BF16) pages of every layer that `budget_bytes` holds: K and V of every KV head, 16 tokens."""
  from zipfusion_jax.serving.state import PAGE_SIZE

  return int(budget_bytes) // (config.layers * 2 * config.kv_heads * PAGE_SIZE * config.head_dim * 2)


def serving_config(config, prompt_lens, max_new_tokens: int, max_batch: int, compressed: bool, kv_memory_mib=None,
                   chunk_pages: int | None = None, format_version: int = 1):
  """The engine's geometry: slots, longest sequence, and a store from `--kv-memory-mib` (or room for all slots).

  `chunk_pages` None: `chunk_pages_for` the store's raw pages per layer.
  """
  from zipfusion_jax.serving.state import PAGE_SIZE, ServingConfig

  max_pages = -(-(max(prompt_lens) + max_new_tokens) // PAGE_SIZE)
  num_slots = min(max_batch, len(prompt_lens))
  if chunk_pages is None:
    if kv_memory_mib is None:
      pages_per_layer = num_slots * max_pages
    else:
      pages_per_layer = budget_pages_per_layer(config, int(kv_memory_mib * 2**20))
    chunk_pages = chunk_pages_for(pages_per_layer, compressed)
  shape = dict(num_layers=config.layers, num_kv_heads=config.kv_heads, head_dim=config.head_dim,
               num_slots=num_slots, max_pages=max_pages, chunk_pages=chunk_pages,
               compressed=compressed, format_version=format_version)
  if kv_memory_mib is not None:
    try:
      return ServingConfig.from_budget(int(kv_memory_mib * 2**20), **shape)
    except ValueError as e:
      raise ValueError(f"--kv-memory-mib {kv_memory_mib:g} is too small for {config.name}: {e}") from None
  per_layer = -(-shape["num_slots"] * max_pages // chunk_pages) + 1
  return ServingConfig(num_chunks=config.layers * per_layer, **shape)


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
  """Load, generate through the serving engine, print (to `out`/`err`, default stdout/stderr).

  Every prompt is one request of a continuously batched workload (`zipfusion_jax/serving`):
  admitted while the KV store has room for it and for every running request's remaining
  tokens, preempted and recomputed under pressure. A request ends after `--max-new-tokens`
  or at the tokenizer's end-of-sequence token (kept as its last token). Returns the JSON
  payload (written when `--json` is given).
  """
  out, err = out or sys.stdout, err or sys.stderr
  import time

  import jax

  from models.generate_simple import check_fits
  from zipfusion_jax.serving.backend import PagedBackend
  from zipfusion_jax.serving.engine import Engine
  from zipfusion_jax.serving.model import ModelDecoder

  from zipfusion_jax.serving.tensor_parallel import TensorParallel

  tp = TensorParallel.create(args.tensor_parallel) if args.tensor_parallel != 1 else None
  model = _load(args)
  if tp is not None:
    tp.check(model.config)
  tok = model.tokenizer
  prompt_ids = [tok.encode_chat(p) if args.chat else tok.encode(p) for p in args.prompt]
  for ids in prompt_ids:
    check_fits(model.config, len(ids), args.max_new_tokens)
  compressed = args.kv == "compressed"
  cfg = serving_config(model.config, [len(p) for p in prompt_ids], args.max_new_tokens, args.max_batch, compressed,
                       args.kv_memory_mib, format_version=args.format_version)
  on_gpu = jax.default_backend() == "gpu"
  decoder = ModelDecoder(model.config, temperature=args.temperature, seed=args.seed, top_k=args.top_k, top_p=args.top_p)
  engine = Engine(decoder,
                  PagedBackend(cfg, encoder="pallas" if on_gpu else "reference"), model.params, tensor_parallel=tp)
  stream = len(args.prompt) == 1
  t0 = time.perf_counter()
  from zipfusion_jax.serving.scheduler import RequestTooLarge

  try:
    requests = [engine.submit(ids, args.max_new_tokens, stop_ids=tok.eos_ids) for ids in prompt_ids] if args.max_new_tokens else []
  except RequestTooLarge as e:
    budget = f"--kv-memory-mib {args.kv_memory_mib:g}" if args.kv_memory_mib is not None else "the KV store"
    raise ValueError(f"a request can never fit {budget}: {e}") from None
  streamer, shown = (_Streamer(tok, out), 0) if stream else (None, 0)
  progress = None if stream or not requests else _progress(len(requests) * args.max_new_tokens, err)
  peak_live, preemptions, steps = 0, 0, 0
  while requests and not engine.idle:
    report = engine.step()
    steps += 1
    preemptions += len(report.preempted)
    peak_live = max(peak_live, engine.allocator.live_bytes_all_devices())
    if streamer is not None:
      ids = requests[0].generated  # a request ends at its first end-of-sequence token
      for t in ids[shown:]:
        streamer(0, t)
      shown = len(ids)
    elif progress is not None:
      progress.update(sum(len(r.generated) for r in requests) - progress.n)
  elapsed = time.perf_counter() - t0
  if progress is not None:
    progress.close()
  results = []
  for i, ids in enumerate(prompt_ids):
    gen = list(requests[i].generated) if requests else []
    text = tok.decode(gen)
    results.append(dict(prompt=args.prompt[i], prompt_ids=list(ids), token_ids=gen, text=text))
    if not stream:
      out.write(f"--- {args.prompt[i]}\n{text}\n")
  if stream:
    out.write("\n")
  new_tokens = sum(len(r.generated) for r in requests)
  alloc = engine.allocator
  stats = dict(
      model=model.config.name, source=model.source, kv=args.kv, kv_backend="serving-engine",
      format_version=args.format_version if compressed else None,
      tensor_parallel=args.tensor_parallel,
      attention="fused Pallas kernel" if on_gpu else "jnp reference", prompts=len(args.prompt),
      prompt_tokens=sum(len(p) for p in prompt_ids), new_tokens=new_tokens, elapsed_s=elapsed,
      tokens_per_s=new_tokens / elapsed if elapsed > 0 else 0.0, steps=steps, preemptions=preemptions,
      compiles=dict(engine.traces), kv_store_bytes=cfg.store_bytes + cfg.metadata_bytes,
      kv_live_bytes_peak=peak_live, compression_ratio=alloc.ratio if alloc.measured_pages else None,
      eligible_block_fraction=eligible_block_fraction(cfg, alloc) if compressed else None,
  )
  ratio = f"{stats['compression_ratio']:.3f}x" if stats["compression_ratio"] else "n/a (no page completed)"
  elig = f", {stats['eligible_block_fraction']:.1%} of blocks in 12 bits" if stats["eligible_block_fraction"] is not None else ""
  err.write(
      f"{new_tokens} tokens in {elapsed:.2f} s ({stats['tokens_per_s']:.1f} tokens/s, compile time included; "
      f"{steps} steps, {preemptions} preemptions) [{model.config.name}, kv={args.kv}]\n"
      f"KV: store {stats['kv_store_bytes'] / 2**20:.1f} MiB, peak resident {peak_live / 2**20:.2f} MiB of completed "
      f"pages, compression {ratio}{elig}\n"
  )
  payload = dict(results=results, stats=stats)
  if args.json:
    write_json_atomic(args.json, payload)
  return payload


def eligible_block_fraction(cfg, alloc) -> float | None:
  """Blocks stored in 12 bits among all completed pages (a compressed block is 3 units, raw 4)."""
  if not alloc.measured_pages:
    return None
  blocks = alloc.measured_pages * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.blocks_per_page
  return 4.0 - float(alloc.measured_units.sum()) / blocks


def _progress(total: int, err):
  try:
    from tqdm import tqdm
  except ImportError:  # the GPU machine has no tqdm
    return None
  return tqdm(total=total, unit="tok", file=err, leave=False)


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

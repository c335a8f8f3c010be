"""Batched generation over the reference `DenseKVBackend`: prefill each prompt into its slot, then
decode all slots together (greedy, or sampled at a temperature) until EOS or `max_new_tokens`.

Host side in Python ints; the jitted `prefill_jit` / `decode_jit` steps compile once per prefill
bucket (powers of two from 16) and once for decode.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from models.configs import ModelConfig
from models.decoder import decode_jit, prefill_jit
from models.dense_backend import DenseKVBackend, decode_plan, prefill_plan
from models.params import DecoderParams
from models.sampling import Sampling

_MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Generation:
  """Generated token ids per prompt (EOS included when it ended the prompt) and wall times in seconds."""

  token_ids: list[list[int]]
  prefill_s: float
  decode_s: float
  decode_steps: int

  @property
  def new_tokens(self) -> int:
    return sum(len(t) for t in self.token_ids)


def check_fits(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  """ValueError when a prompt is empty or it and its new tokens exceed the model's context."""
  if prompt_len == 0:
    raise ValueError("empty prompt: it needs at least one token")
  if prompt_len + max_new_tokens > config.max_position:
    raise ValueError(
        f"prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds the context of "
        f"{config.name} ({config.max_position} tokens)"
    )


def cache_len(prompt_lens: Sequence[int], max_new_tokens: int) -> int:
  """Tokens per slot of the dense cache: the longest prompt plus new tokens, rounded up to 16."""
  need = max(prompt_lens) + max_new_tokens
  return -(-need // _MIN_BUCKET) * _MIN_BUCKET


def prefill_bucket(prompt_len: int, max_len: int) -> int:
  """Padded prefill length: the next power of two from 16, at most max_len."""
  return min(max(_MIN_BUCKET, 1 << (prompt_len - 1).bit_length()), max_len)


@functools.partial(jax.jit, static_argnames=("sampling",))
def _pick(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """logits float32 [..., V] -> int32 [...]: argmax, or a sample (`Sampling`), one key per row."""
  rows = jnp.atleast_2d(logits)
  return sampling.pick(rows, jax.random.split(key, rows.shape[0])).reshape(logits.shape[:-1])


def generate(
    params: DecoderParams,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_ids: Sequence[int] = (),
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    on_token: Callable[[int, int], None] | None = None,
) -> Generation:
  """Generate up to `max_new_tokens` per prompt, one slot per prompt.

  Args:
    prompts: token ids per prompt (each non-empty, fitting the context with the new tokens).
    eos_ids: ids that end a prompt's generation (kept as its last token).
    temperature: 0 for greedy, else the sampling temperature; top_k / top_p: sample within the
      k most likely tokens (0: all) / the fewest whose probability reaches top_p (1: all);
      seed: the PRNG seed.
    on_token: called as on_token(prompt_index, token_id) for every generated token, in order.
  """
  if max_new_tokens < 0:
    raise ValueError(f"{max_new_tokens=} must be >= 0")
  sampling = Sampling(temperature, top_k, top_p)
  for p in prompts:
    check_fits(config, len(p), max_new_tokens)
  slots = len(prompts)
  backend = DenseKVBackend()
  max_len = cache_len([len(p) for p in prompts], max_new_tokens)
  state = backend.init_state(config.layers, slots, max_len, config.kv_heads, config.head_dim)
  key = jax.random.key(seed)
  out: list[list[int]] = [[] for _ in prompts]
  done = [max_new_tokens == 0] * slots
  eos = set(eos_ids)

  def take(slot: int, token: int) -> None:
    out[slot].append(token)
    if on_token is not None:
      on_token(slot, token)
    done[slot] = token in eos or len(out[slot]) >= max_new_tokens

  start = time.perf_counter()
  for slot, prompt in enumerate(prompts):
    if done[slot]:
      continue
    bucket = prefill_bucket(len(prompt), max_len)
    tokens = jnp.zeros((bucket,), jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt, jnp.int32))
    plan = prefill_plan(slots, slot, len(prompt))
    logits, state = prefill_jit(params, config, tokens, jnp.int32(len(prompt)), state, plan, backend)
    key, sub = jax.random.split(key)
    take(slot, int(_pick(logits, sub, sampling)))
  prefill_s = time.perf_counter() - start

  start, steps = time.perf_counter(), 0
  while not all(done):
    active = [not d for d in done]
    positions = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]  # where each slot's last token goes
    feed = [o[-1] if a else 0 for o, a in zip(out, active)]
    plan = decode_plan([p if a else 0 for p, a in zip(positions, active)], active)
    logits, state = decode_jit(params, config, jnp.asarray(feed, jnp.int32), state, plan, backend)
    key, sub = jax.random.split(key)
    picked = [int(t) for t in _pick(logits, sub, sampling)]
    steps += 1
    for slot in range(slots):
      if active[slot]:
        take(slot, picked[slot])
  return Generation(token_ids=out, prefill_s=prefill_s, decode_s=time.perf_counter() - start, decode_steps=steps)

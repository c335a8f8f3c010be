"""The contract between a decoder and the KV state it threads through jitted steps.

A decoder (``models/``) computes q/k/v per layer and never touches KV memory
itself; a KV backend owns the state (a frozen pytree of arrays) and the
per-layer operations on it. The serving engine hands each step a small plan
pytree built by the host scheduler; the decoder passes it to the backend
untouched except for the fields it reads (`positions`).

Shapes: S = sequence slots (fixed for one compiled step), T = prefill tokens
(padded), Hq / Hkv / D = query heads, KV heads, head dim.

A backend implements (all pure, jit-able, `layer` is a Python int so a
decoder unrolls its layer loop):

* ``prefill_layer(state, layer, plan, k, v) -> state``
  k, v: bfloat16 [T, Hkv, D], the RoPE'd keys and values of one prompt,
  rows past ``plan.prefill_length`` are padding. Writes them as the first
  tokens of slot ``plan.prefill_slot`` (completed pages are compressed in
  the same call when the backend is compressed). The decoder computes the
  prompt's attention itself (dense causal).
* ``decode_layer(state, layer, plan, q, k, v) -> (o, state)``
  q: bfloat16 [S, Hq, D]; k, v: bfloat16 [S, Hkv, D], the new token of each
  slot. Appends k/v at position ``plan.positions[s]`` of every active slot
  (``plan.active[s]``), compresses a page that this completes, and returns
  o: bfloat16 [S, Hq, D], attention of q over the slot's
  ``plan.positions[s] + 1`` tokens (inactive slots: any finite value).
* ``end_step(state, plan) -> state``
  Bookkeeping after all layers (lengths advance, freed chunks return).

Plans carry at least ``positions`` int32 [S] (the RoPE position of the new
token = tokens already cached) and ``active`` bool [S]; prefill plans carry
``prefill_slot`` int32 [] and ``prefill_length`` int32 [].
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

State = Any
Plan = Any


class KVBackend(Protocol):
  def prefill_layer(self, state: State, layer: int, plan: Plan, k: jax.Array, v: jax.Array) -> State: ...

  def decode_layer(
      self, state: State, layer: int, plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array
  ) -> tuple[jax.Array, State]: ...

  def end_step(self, state: State, plan: Plan) -> State: ...

"""A reference KV backend: an uncompressed dense per-slot cache implementing `kv_ops.KVBackend`.

For tests and the CPU path of the CLI; the serving engine's paged, compressed backend follows the
same contract. Attention over the cache is the paged module's jnp reference (`attend_dense`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, BFloat16, Bool, Int32

from zipfusion_jax.paged.reference import attend_dense


@struct.dataclass
class DenseKVState:
  """Per-slot dense K/V. L = layers, S = slots, M = max_len tokens per slot.

  Attributes:
    k, v: bfloat16 [L, S, M, Hkv, D], RoPE'd keys and values; rows at or past `lengths` are stale.
    lengths: int32 [S], tokens cached per slot.
  """

  k: BFloat16[Array, "L S M Hkv D"]
  v: BFloat16[Array, "L S M Hkv D"]
  lengths: Int32[Array, "S"]

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


@struct.dataclass
class StepPlan:
  """What one jitted step needs to know (built on the host, Python ints -> arrays).

  Attributes:
    positions: int32 [S], RoPE position of each slot's new token (= tokens already cached).
    active: bool [S], slots that take part in this decode step.
    prefill_slot: int32 [], the slot a prefill writes (ignored by decode).
    prefill_length: int32 [], real prompt tokens of that prefill (ignored by decode).
  """

  positions: Int32[Array, "S"]
  active: Bool[Array, "S"]
  prefill_slot: Int32[Array, ""]
  prefill_length: Int32[Array, ""]


def decode_plan(positions, active) -> StepPlan:
  """Plan for one decode step over all slots."""
  return StepPlan(
      positions=jnp.asarray(positions, jnp.int32),
      active=jnp.asarray(active, jnp.bool_),
      prefill_slot=jnp.int32(0),
      prefill_length=jnp.int32(0),
  )


def prefill_plan(slots: int, slot: int, length: int) -> StepPlan:
  """Plan for writing a `length`-token prompt into `slot` (no slot decodes)."""
  return StepPlan(
      positions=jnp.zeros((slots,), jnp.int32),
      active=jnp.zeros((slots,), jnp.bool_),
      prefill_slot=jnp.int32(slot),
      prefill_length=jnp.int32(length),
  )


@dataclasses.dataclass(frozen=True)
class DenseKVBackend:
  """`kv_ops.KVBackend` over a `DenseKVState` (hashable: pass it as a static jit argument)."""

  def init_state(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int) -> DenseKVState:
    shape = (layers, slots, max_len, kv_heads, head_dim)
    return DenseKVState(
        k=jnp.zeros(shape, jnp.bfloat16), v=jnp.zeros(shape, jnp.bfloat16), lengths=jnp.zeros((slots,), jnp.int32)
    )

  def prefill_layer(self, state: DenseKVState, layer: int, plan: StepPlan, k, v) -> DenseKVState:
    """k, v: bfloat16 [T, Hkv, D] (T <= max_len) become the first tokens of `plan.prefill_slot`."""
    if k.shape[0] > state.max_len:
      raise ValueError(f"prefill of {k.shape[0]} tokens does not fit max_len={state.max_len}")
    start = (layer, plan.prefill_slot, 0, 0, 0)
    return state.replace(
        k=jax.lax.dynamic_update_slice(state.k, k[None, None], start),
        v=jax.lax.dynamic_update_slice(state.v, v[None, None], start),
        # Idempotent over layers: the slot's length is the prompt's once any layer is written.
        lengths=state.lengths.at[plan.prefill_slot].set(plan.prefill_length),
    )

  def decode_layer(self, state: DenseKVState, layer: int, plan: StepPlan, q, k, v):
    """q: [S, Hq, D]; k, v: [S, Hkv, D] appended at `plan.positions` of active slots -> o [S, Hq, D]."""
    slots = jnp.arange(state.k.shape[1])
    pos = jnp.clip(plan.positions, 0, state.max_len - 1)

    def append(cache, new):
      old = cache[layer, slots, pos]
      row = jnp.where(plan.active[:, None, None], new, old)
      return cache.at[layer, slots, pos].set(row)

    k_cache, v_cache = append(state.k, k), append(state.v, v)
    mask = jnp.arange(state.max_len)[None, :] <= plan.positions[:, None]  # [S, M]
    o = attend_dense(
        q, k_cache[layer].transpose(0, 2, 1, 3), v_cache[layer].transpose(0, 2, 1, 3), mask, q.shape[-1] ** -0.5
    )
    return o, state.replace(k=k_cache, v=v_cache)

  def end_step(self, state: DenseKVState, plan: StepPlan) -> DenseKVState:
    return state.replace(lengths=jnp.where(plan.active, plan.positions + 1, state.lengths))

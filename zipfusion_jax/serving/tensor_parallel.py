"""Tensor parallelism over KV heads: one 1-D `tp` mesh axis, the decoder step under `shard_map`.

Megatron-style split, as in vLLM / SGLang: device d of N holds q heads
[d Hq/N, (d+1) Hq/N), the KV heads they read, [d Hkv/N, (d+1) Hkv/N), and
1/N of the MLP width. Column-parallel weights (wq, wk, wv, w_gate, w_up) are
split by output columns, row-parallel ones (wo, w_down) by input rows, and the
fp32 partial sums of each row-parallel product are all-reduced once
(`layers.row_parallel_linear`): two all-reduces per block. Embedding, norms and
the LM head are replicated, so the logits and the chosen tokens are the same
on every device.

The KV state follows the heads. The compressed format is per KV head, so each
device's store is an ordinary one-device `ServingState` of its heads
(`local_serving_config`): its own arena, group metadata, tails and bump
pointers; the page table and lengths are replicated. Globally
(`state_specs`) the head axes (tails, group_meta, BF16 pools) are sharded
where they are, and the per-device arrays without a head axis (arena,
chunk_fill, step_units, page_slot) are the N local arrays stacked on axis 0.
The host allocator shares page ids and chunk ids across devices and keeps
one bump pointer per device (`ChunkAllocator(devices=N)`).

Multi-host: call `jax.distributed.initialize()` on every host before building
the mesh; `TensorParallel.create(n)` then spans `jax.devices()` of all hosts.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.configs import ModelConfig
from models.params import DecoderParams, LayerParams
from zipfusion_jax.serving.state import ServingConfig, ServingState, init_state

AXIS = "tp"

_COLUMN = P(None, AXIS)  # [in, out]: split the output features
_ROW = P(AXIS, None)  # [in, out]: split the input features
_LAYER_SPECS = dict(wq=_COLUMN, wk=_COLUMN, wv=_COLUMN, wo=_ROW, w_gate=_COLUMN, w_up=_COLUMN, w_down=_ROW)


class TensorParallelError(ValueError):
  """A tensor-parallel degree the model or the machine cannot take."""


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """A 1-D device mesh over axis "tp" and the shardings of weights and KV state on it (hashable).

  Build with `TensorParallel.create(n)`.
  """

  mesh: Mesh

  @property
  def size(self) -> int:
    return self.mesh.shape[AXIS]

  @classmethod
  def create(cls, n: int, devices=None) -> "TensorParallel":
    """A mesh of the first n devices (default `jax.devices()`).

    Raises:
      TensorParallelError: n < 1, or more devices asked for than are present.
    """
    devices = list(jax.devices() if devices is None else devices)
    if n < 1:
      raise TensorParallelError(f"--tensor-parallel {n} must be >= 1")
    if n > len(devices):
      raise TensorParallelError(
          f"--tensor-parallel {n} needs {n} devices, {len(devices)} present"
          f"{f' ({devices[0].platform})' if devices else ''}; on CPU, "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={n} provides them"
      )
    return cls(Mesh(np.array(devices[:n]), (AXIS,)))

  # --- configs -------------------------------------------------------------------------

  def check(self, config: ModelConfig) -> None:
    """Raises TensorParallelError unless N divides the KV heads (hence the q heads) and the MLP width."""
    n = self.size
    if config.kv_heads % n:
      raise TensorParallelError(f"--tensor-parallel {n} does not divide {config.name}'s {config.kv_heads} KV heads")
    if config.intermediate % n:
      raise TensorParallelError(f"--tensor-parallel {n} does not divide {config.name}'s MLP width {config.intermediate}")

  def local_model_config(self, config: ModelConfig) -> ModelConfig:
    """The shapes one device computes: its heads and MLP columns, reducing over the tp axis."""
    self.check(config)
    n = self.size
    return dataclasses.replace(config, q_heads=config.q_heads // n, kv_heads=config.kv_heads // n,
                               intermediate=config.intermediate // n, tp_axis=AXIS)

  def local_serving_config(self, cfg: ServingConfig) -> ServingConfig:
    """One device's store: its KV heads, the same slots, pages, page ids and chunk count (1/N the bytes)."""
    n = self.size
    if cfg.num_kv_heads % n:
      raise TensorParallelError(f"--tensor-parallel {n} does not divide the store's {cfg.num_kv_heads} KV heads")
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // n)

  # --- shardings -----------------------------------------------------------------------

  def param_specs(self, params: DecoderParams) -> DecoderParams:
    """A PartitionSpec per weight (a pytree prefix of `params`)."""
    def layer(lp: LayerParams) -> LayerParams:
      specs = {f.name: _LAYER_SPECS.get(f.name, P()) for f in dataclasses.fields(LayerParams)}
      return LayerParams(**{k: (None if getattr(lp, k) is None else v) for k, v in specs.items()})

    return DecoderParams(embed=P(), layers=tuple(layer(lp) for lp in params.layers), final_norm=P(),
                         lm_head=None if params.lm_head is None else P())

  @staticmethod
  def state_specs(compressed: bool) -> ServingState:
    """A PartitionSpec per `ServingState` field (module docstring)."""
    heads_at_2 = P(None, None, AXIS)  # [L, S, Hkv, 16, D]
    stacked = P(AXIS)  # N local arrays along axis 0
    common = dict(page_table=P(), lengths=P(), k_tail=heads_at_2, v_tail=heads_at_2, chunk_fill=stacked,
                  step_units=stacked)
    if compressed:
      return ServingState(**common, arena=stacked, group_meta=P(None, AXIS))  # group_meta [L, Hkv, P, 2, 2]
    return ServingState(**common, k_pages=P(AXIS), v_pages=P(AXIS), page_slot=stacked)  # pools [Hkv, ...]

  def shard_params(self, params: DecoderParams) -> DecoderParams:
    """`params` placed on the mesh (each device keeps its slice)."""
    shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.param_specs(params))
    return jax.device_put(params, shardings)

  def init_state(self, local_cfg: ServingConfig) -> ServingState:
    """An empty sharded state: on every device the empty one-device state of `local_cfg`."""
    specs = self.state_specs(local_cfg.compressed)
    f = jax.shard_map(lambda: init_state(local_cfg), mesh=self.mesh, in_specs=(), out_specs=specs, check_vma=False)
    return jax.jit(f)()

  def device_shard(self, state: ServingState, device: int, compressed: bool) -> ServingState:
    """Device `device`'s local state (host numpy), as a one-device engine would hold it."""
    specs = self.state_specs(compressed)

    def take(x, spec):
      x = np.asarray(jax.device_get(x))
      for axis, name in enumerate(spec):
        if name == AXIS:
          size = x.shape[axis] // self.size
          x = np.take(x, np.arange(device * size, (device + 1) * size), axis=axis)
      return x

    return jax.tree.map(take, state, specs)

  # --- the sharded step --------------------------------------------------------------------

  def decoder(self, model):
    """`model` (a `serving.model.ModelDecoder`) with each step run per shard under `shard_map`."""
    return ShardedDecoder(dataclasses.replace(model, config=self.local_model_config(model.config)), self)


@dataclasses.dataclass(frozen=True)
class ShardedDecoder:
  """The engine's model interface (`serving.engine.Decoder`) over a tp mesh.

  `inner` is the per-shard decoder (its config from `local_model_config`); the backend the engine
  passes in is the one-device backend of `local_serving_config`. Tokens, plans and outputs other
  than the state are replicated.
  """

  inner: object
  tp: TensorParallel

  def _sharded(self, fn, params, backend, n_out: int):
    specs = self.tp.state_specs(backend.cfg.compressed)
    out_specs = (P(),) * n_out + (specs,)
    return jax.shard_map(fn, mesh=self.tp.mesh, in_specs=(self.tp.param_specs(params), specs, P(), P()),
                         out_specs=out_specs, check_vma=False)

  def prefill(self, params, backend, state, plan, tokens):
    fn = lambda p, s, pl, t: self.inner.prefill(p, backend, s, pl, t)
    return self._sharded(fn, params, backend, 1)(params, state, plan, tokens)

  def decode(self, params, backend, state, plan, tokens):
    fn = lambda p, s, pl, t: self.inner.decode(p, backend, s, pl, t)
    return self._sharded(fn, params, backend, 2)(params, state, plan, tokens)

"""The serving loop: scheduler -> plan pytree -> jitted step (state donated) -> small readback.

`Engine(model, backend)` owns the device state, the host allocator and the
scheduler. One `step()`:

1. admits waiting requests while capacity allows (at most
   `max_prefills_per_step`): each runs one jitted prefill step;
2. runs one jitted decode step for every running sequence.

Each step reads back a fixed, small set of arrays: the next tokens, the
model's `aux` (decode) and `state.step_units` int32 [L, max(S, max_pages)]
(the units each completed page took), from which the host allocator advances
its mirror of the bump pointers. There is no other host-device traffic, and it
is one transfer each way (`transfer.py`): the plan and tokens go down as one
int32 buffer, the readback comes up as one.

The model interface (what the Flax decoder provides; `standin.StandInDecoder`
is the test double):

  model.prefill(params, backend, state, plan, tokens int32 [max_length]) -> (next int32 [], state)
  model.decode(params, backend, state, plan, tokens int32 [S]) -> (next int32 [S], aux, state)

Both call `backend.prefill_layer` / `decode_layer` per layer and then
`backend.end_step`. The slot count and padded prefill length are fixed, so
prefill compiles once and decode at most once per `cfg.completion_widths` entry (how many
pages the step encodes and places: 0, a small width, S; the host plans each step at the
smallest that holds its completing pages), for any batch composition (`Engine.traces` counts).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from zipfusion_jax.serving.allocator import ChunkAllocator, Placement
from zipfusion_jax.serving.backend import PagedBackend
from zipfusion_jax.serving.scheduler import Request, Scheduler
from zipfusion_jax.serving.state import NO_PAGE, Plan, ServingConfig, ServingState, check_plan, init_state
from zipfusion_jax.serving.tensor_parallel import AXIS, TensorParallel
from zipfusion_jax.serving.transfer import Layout, pack_device, pack_host


class Decoder(Protocol):
  def prefill(self, params, backend, state, plan, tokens): ...

  def decode(self, params, backend, state, plan, tokens): ...


@dataclasses.dataclass
class StepReport:
  """What one `Engine.step()` did (request ids)."""

  prefilled: list[int] = dataclasses.field(default_factory=list)
  preempted: list[int] = dataclasses.field(default_factory=list)
  finished: list[int] = dataclasses.field(default_factory=list)
  decoded: int = 0
  readback_bytes: int = 0


def _grants(cfg: ServingConfig, placement: Placement, width: int) -> np.ndarray:
  g = np.full((cfg.num_layers, cfg.max_grants(width)), NO_PAGE, np.int32)
  for l, fresh in enumerate(placement.grants):
    g[l, : len(fresh)] = fresh
  return g


def prefill_plan(cfg: ServingConfig, slot: int, length: int, placement: Placement) -> Plan:
  """Host plan of one prefill (numpy leaves): the prompt's completed pages at `placement`."""
  n = placement.num_pages
  new_pages = np.full(cfg.max_pages, NO_PAGE, np.int32)
  new_pages[:n] = placement.page_ids
  return Plan(
      positions=np.zeros(cfg.num_slots, np.int32),
      active=np.zeros(cfg.num_slots, bool),
      prefill_slot=np.int32(slot),
      prefill_length=np.int32(length),
      new_pages=new_pages,
      current_chunk=placement.current_chunk.astype(np.int32),
      grants=_grants(cfg, placement, cfg.max_pages),
      completing=np.zeros(0, np.int32),
      kind="prefill",
  )


def decode_plan(cfg: ServingConfig, lengths: dict[int, int], completing: list[int], placement: Placement) -> Plan:
  """Host plan of one decode step: `lengths` {slot: cached tokens} of the running slots,
  `completing` the slots (in order) whose page completes, placed at `placement`."""
  S = cfg.num_slots
  positions = np.zeros(S, np.int32)
  active = np.zeros(S, bool)
  for s, n in lengths.items():
    positions[s], active[s] = n, True
  new_pages = np.full(S, NO_PAGE, np.int32)
  if list(completing) != sorted(completing):
    raise ValueError(f"completing slots {completing} must be in slot order (the device packs pages in slot order)")
  for i, s in enumerate(completing):
    new_pages[s] = placement.page_ids[i]
  width = cfg.completion_width(len(completing))
  slots = np.full(width, NO_PAGE, np.int32)
  slots[: len(completing)] = completing
  return Plan(
      positions=positions,
      active=active,
      prefill_slot=np.int32(-1),
      prefill_length=np.int32(0),
      new_pages=new_pages,
      current_chunk=placement.current_chunk.astype(np.int32),
      grants=_grants(cfg, placement, width),
      completing=slots,
      kind="decode",
  )


def idle_decode_plan(cfg: ServingConfig, width: int) -> Plan:
  """A decode plan of completion width `width` that does no work (no active slot, no page): it
  compiles the step for that width (`Engine.warm_up`)."""
  if width not in cfg.completion_widths:
    raise ValueError(f"width {width} is not one of {cfg.completion_widths}")
  S, L = cfg.num_slots, cfg.num_layers
  return Plan(
      positions=np.zeros(S, np.int32),
      active=np.zeros(S, bool),
      prefill_slot=np.int32(-1),
      prefill_length=np.int32(0),
      new_pages=np.full(S, NO_PAGE, np.int32),
      current_chunk=np.full(L, NO_PAGE, np.int32),  # no current chunk
      grants=np.full((L, cfg.max_grants(width)), NO_PAGE, np.int32),
      completing=np.full(width, NO_PAGE, np.int32),
      kind="decode",
  )


def idle_prefill_plan(cfg: ServingConfig) -> Plan:
  """A prefill plan of no pages (slot 0, length 0) with the shapes of every prefill: only lowered
  and compiled by `Engine.warm_up`, never run."""
  L = cfg.num_layers
  empty = Placement(np.zeros(0, np.int32), np.full(L, NO_PAGE, np.int32), ((),) * L)
  return prefill_plan(cfg, 0, 0, empty)


class Engine:
  """Continuous-batching engine over one `PagedBackend` (compressed or not).

  Args:
    model: a `Decoder` (prefill / decode as in the module docstring).
    backend: the KV backend; its `cfg` fixes slots, pages and the store.
    params: model parameters, passed through to the model.
    max_prefills_per_step: admissions per `step()`.
    prior_ratio: compression ratio assumed before any page is measured.
    overcommit: the scheduler's admission factor (1.0: reserve exactly).
    tensor_parallel: run every step sharded over this mesh (`tensor_parallel.py`): `model` and
      `backend` are given as for one device and are split here; `self.backend` / `self.cfg` are
      then one device's, and the allocator admits only what fits on every device.
  """

  def __init__(self, model: Decoder, backend: PagedBackend, params: Any = None, *, max_prefills_per_step: int = 1,
               prior_ratio: float = 1.0, overcommit: float = 1.0, tensor_parallel: TensorParallel | None = None):
    if max_prefills_per_step < 1:
      raise ValueError(f"{max_prefills_per_step=} must be >= 1 (no request could ever start)")
    self.tp = tensor_parallel
    if tensor_parallel is None:
      self.model, self.backend, self.params = model, backend, params
    else:
      self.model = tensor_parallel.decoder(model)
      self.backend = dataclasses.replace(backend, cfg=tensor_parallel.local_serving_config(backend.cfg), reduce_axis=AXIS)
      self.params = tensor_parallel.shard_params(params)
    self.cfg = self.backend.cfg
    self.devices = 1 if tensor_parallel is None else tensor_parallel.size
    self.allocator = ChunkAllocator(self.cfg, prior_ratio, devices=self.devices)
    vocab = getattr(model, "vocab", None) or getattr(getattr(model, "config", None), "vocab", None)  # stand-in, Flax
    self.scheduler = Scheduler(self.cfg, self.allocator, overcommit, vocab)
    self.state: ServingState = init_state(self.cfg) if tensor_parallel is None else tensor_parallel.init_state(self.cfg)
    self.max_prefills_per_step = max_prefills_per_step
    self.traces: collections.Counter[str] = collections.Counter()
    self.last_aux = None
    self.steps = 0
    self._readback_layouts: dict[Layout, Layout] = {}  # the step's input layout -> its readback's
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=1, static_argnums=3)
    self._decode = jax.jit(self._decode_fn, donate_argnums=1, static_argnums=3)

  # The jitted steps take (params, state, packed plan and tokens int32 [n], their static layout) and
  # return (packed readback int32 [m], state); the readback's layout is recorded when they trace.
  # Under tensor parallelism `step_units` is sharded (one block of rows per device): it stays out of
  # the packed buffer, which would otherwise need an all-gather, and is read back on its own.

  def _readback(self, layout: Layout, outputs: tuple, state: ServingState) -> jax.Array:
    tree = outputs + ((state.step_units,) if self.tp is None else ())
    readback, self._readback_layouts[layout] = pack_device(tree)
    return readback

  def _prefill_fn(self, params, state, packed, layout: Layout):
    self.traces["prefill"] += 1
    plan, tokens = layout.unpack(packed)
    nxt, state = self.model.prefill(params, self.backend, state, plan, tokens)
    return self._readback(layout, (nxt,), state), state

  def _decode_fn(self, params, state, packed, layout: Layout):
    self.traces["decode"] += 1
    plan, tokens = layout.unpack(packed)
    nxt, aux, state = self.model.decode(params, self.backend, state, plan, tokens)
    return self._readback(layout, (nxt, aux), state), state

  def with_work(self, plan: Plan) -> Plan:
    """`plan` with the fused kernel's work items for its lengths, planned here on the host, when
    the backend's kernel runs its balanced schedule (`PagedBackend.host_work`); else `plan`."""
    work = self.backend.host_work(np.where(plan.active, plan.positions + 1, 0))
    return plan if work is None else plan.replace(work_table=work[0], work_first=work[1])

  def lower_decode(self, plan: Plan, tokens: np.ndarray):
    """The jitted decode step lowered for this plan (`jax.stages.Lowered`: HLO, compile)."""
    return self._lower(self._decode, plan, tokens)

  def _lower(self, jitted, plan: Plan, tokens: np.ndarray):
    packed, layout = pack_host((plan, np.asarray(tokens, np.int32)))
    return jitted.lower(self.params, self.state, packed, layout)

  def _call(self, jitted, plan: Plan, tokens: np.ndarray):
    """Run a jitted step on (plan, tokens): one transfer down, one up; returns the readback's leaves."""
    packed, layout = pack_host((plan, tokens))
    readback, self.state = jitted(self.params, self.state, packed, layout)
    if self.tp is not None:
      readback, units = jax.device_get((readback, self.state.step_units))
      return (*self._readback_layouts[layout].unpack(readback, np), units)
    return self._readback_layouts[layout].unpack(np.asarray(jax.device_get(readback)), np)

  # --- requests ---------------------------------------------------------------------

  def submit(self, prompt, max_new_tokens: int, priority: int = 0, stop_ids=()) -> Request:
    """Queue a request (raises `RequestTooLarge` when it can never fit); `stop_ids` end it early."""
    return self.scheduler.submit(prompt, max_new_tokens, priority, stop_ids)

  def cancel(self, req: Request) -> None:
    """Withdraw a waiting or running request between steps (its pages freed, its tokens so far
    kept); the other requests go on unchanged. Raises ValueError for a request that already ended."""
    self.scheduler.cancel(req)

  @property
  def idle(self) -> bool:
    return not self.scheduler.waiting and not self.scheduler.running

  # --- steps --------------------------------------------------------------------------

  def run_prefill(self, plan: Plan, tokens: np.ndarray):
    """Validate and run one prefill plan; returns the readback (next token, step_units)."""
    check_plan(self.cfg, plan)
    padded = np.zeros(self.cfg.max_length, np.int32)
    padded[: len(tokens)] = tokens
    nxt, units = self._call(self._prefill, plan, padded)
    return nxt, self._per_device(units)

  def run_decode(self, plan: Plan, tokens: np.ndarray):
    """Validate and run one decode plan; returns the readback (next tokens, aux, step_units)."""
    check_plan(self.cfg, plan)
    nxt, aux, units = self._call(self._decode, plan, np.asarray(tokens, np.int32))
    return nxt, aux, self._per_device(units)

  def _per_device(self, step_units: np.ndarray) -> np.ndarray:
    """The readback's int32 [devices * L, N] (stacked per device) as [devices, L, N]."""
    return step_units.reshape(self.devices, self.cfg.num_layers, -1)

  def step(self) -> StepReport:
    """Admit, then decode every running sequence once."""
    report = StepReport()
    sched, cfg = self.scheduler, self.cfg
    for _ in range(self.max_prefills_per_step):
      admitted = sched.admit()
      if admitted is None:
        break
      req, slot, placement = admitted
      tokens = req.prefill_tokens()
      with self._cancel_on_error(placement):
        nxt, units = self.run_prefill(prefill_plan(cfg, slot, len(tokens), placement), np.asarray(tokens, np.int32))
      report.readback_bytes += nxt.nbytes + units.nbytes
      self.allocator.commit(placement, units)
      sched.started(req, slot, placement, int(nxt))
      report.prefilled.append(req.rid)
      if req.done:
        report.finished.append(req.rid)
    placement = None
    if sched.running:
      done, placement, preempted = sched.plan_decode()
      report.preempted = [r.rid for r in preempted]
    if sched.running:
      lengths = {s: r.length for s, r in sched.running.items()}
      tokens = np.zeros(cfg.num_slots, np.int32)
      for s, r in sched.running.items():
        tokens[s] = r.generated[-1]
      with self._cancel_on_error(placement):
        plan = self.with_work(decode_plan(cfg, lengths, [r.slot for r in done], placement))
        nxt, aux, units = self.run_decode(plan, tokens)
      report.readback_bytes += nxt.nbytes + aux.nbytes + units.nbytes
      self.allocator.commit(placement, units)  # the completed pages' columns come first, in slot order
      report.decoded = len(lengths)
      self.last_aux = aux
      report.finished += [r.rid for r in sched.decoded(done, placement, nxt)]
    elif placement is not None:  # everything was preempted: nothing to decode
      self.allocator.commit(placement, np.zeros((self.devices, cfg.num_layers, 0), np.int32))
    self.steps += 1
    return report

  @contextlib.contextmanager
  def _cancel_on_error(self, placement: Placement):
    """A step that fails before its readback gives its reservation back (the requests keep their
    places), so the next step can reserve again instead of being refused for ever."""
    try:
      yield
    except BaseException:
      self.allocator.cancel(placement)
      raise

  def warm_up(self, threads: int | None = None) -> None:
    """Compile the decode step at every completion width, and the prefill, now (a server's
    start-up), so that no serving step stops to compile when a width first occurs (e.g. a request
    admitted late that completes a page on its own). The steps are traced in turn and compiled
    on `threads` threads (default: one per step; XLA compiles without the GIL), then one idle
    decode step runs per width. Only on an engine with nothing running (an idle step ends every
    slot's sequence)."""
    if self.scheduler.running:
      raise RuntimeError("warm_up() runs idle steps, which end running sequences: call it before serving")
    cfg = self.cfg
    tokens = np.zeros(cfg.num_slots, np.int32)
    decode_plans = [self.with_work(idle_decode_plan(cfg, width)) for width in cfg.completion_widths]
    steps = [(self._decode, plan, tokens) for plan in decode_plans]
    steps.append((self._prefill, idle_prefill_plan(cfg), np.zeros(cfg.max_length, np.int32)))
    lowered = [self._lower(*step) for step in steps]  # tracing holds the GIL: in turn
    with concurrent.futures.ThreadPoolExecutor(threads or len(lowered)) as pool:
      list(pool.map(lambda low: low.compile(), lowered))  # the jitted steps' cache keeps them
    for plan in decode_plans:  # runs (no compile): the device-side first-call work is done here too
      self.run_decode(plan, tokens)

  def run(self, max_steps: int = 100_000) -> list[Request]:
    """Step until no request waits or runs; returns the finished ones in finishing order
    (cancelled requests are in `scheduler.cancelled`)."""
    for _ in range(max_steps):
      if self.idle:
        return self.scheduler.finished
      self.step()
    raise RuntimeError(f"requests still pending after {max_steps} steps")

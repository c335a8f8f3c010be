"""Continuous batching on the host: admission, reservations, preemption. Plain Python over ints.

Policy:
* Order: (priority, arrival), lowest first; FIFO when priorities are equal.
  Only the head of the queue is admitted (no overtaking).
* Admission: a free slot, and the store's expected capacity (at the measured
  compression ratio) covers the head request's final pages plus the pages
  every running sequence still has to complete (its reservation). The
  prompt's pages are then reserved at raw size, all or nothing.
* Each decode step reserves, at raw size, the pages it completes. When that
  is refused, the lowest-ordered running sequence is preempted (its pages
  freed, the request requeued to recompute its KV later) until it fits:
  never truncated, never corrupted.
* Fragmentation: a chunk frees only when all its pages have, so a live page
  pins the dead space of finished neighbours. Even the last running sequence
  may then not fit; it is preempted too and its recompute prefill packs it
  into fresh chunks. In an empty store every admitted request fits, because
  `submit` rejects one whose final KV exceeds an empty store at raw size.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator

from zipfusion_jax.serving.allocator import ChunkAllocator, Placement
from zipfusion_jax.serving.state import PAGE_SIZE, ServingConfig


class RequestTooLarge(ValueError):
  """A request that can never fit (raised by `submit`; nothing is queued)."""


class Status(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  FINISHED = "finished"
  CANCELLED = "cancelled"


@dataclasses.dataclass(eq=False)
class Request:
  """One generation request and its progress (host object; never enters a jitted step).

  Attributes:
    prompt: token ids.
    max_new_tokens: tokens to generate (>= 1), unless a stop token comes first.
    priority: lower runs first; ties in arrival order.
    rid, arrival: set by `submit`.
    generated: tokens generated so far.
    slot: sequence slot while running, else None.
    pages: page ids of the completed pages while running.
    length: tokens with KV cached (running), else 0.
    preemptions: how many times it was preempted.
    stop_ids: token ids that finish the request when generated (kept as its last token);
      reservations still assume `max_new_tokens`, so stopping early only frees space sooner.
  """

  prompt: tuple[int, ...]
  max_new_tokens: int
  priority: int = 0
  rid: int = -1
  arrival: int = -1
  status: Status = Status.WAITING
  generated: list[int] = dataclasses.field(default_factory=list)
  slot: int | None = None
  pages: list[int] = dataclasses.field(default_factory=list)
  length: int = 0
  preemptions: int = 0
  stop_ids: tuple[int, ...] = ()

  @property
  def final_length(self) -> int:
    """Tokens with KV when it finishes (the last generated token is never fed back)."""
    return len(self.prompt) + self.max_new_tokens - 1

  @property
  def final_pages(self) -> int:
    return self.final_length // PAGE_SIZE

  @property
  def remaining_pages(self) -> int:
    return self.final_pages - len(self.pages)

  @property
  def key(self) -> tuple[int, int]:
    return (self.priority, self.arrival)

  def prefill_tokens(self) -> list[int]:
    """Tokens whose KV a prefill writes: the prompt, or prompt + generated[:-1] to recompute."""
    return list(self.prompt) + self.generated[:-1]

  @property
  def done(self) -> bool:
    if len(self.generated) >= self.max_new_tokens:
      return True
    return bool(self.generated) and self.generated[-1] in self.stop_ids


class Scheduler:
  """Queues and slots of one engine; asks its `ChunkAllocator` for pages.

  Args:
    cfg, allocator: the geometry and its accounting.
    overcommit: admit while reservations stay under `overcommit` times the
      expected capacity; 1.0 reserves exactly, more trades preemptions for
      fuller batches (a request is always admitted when nothing runs).
    vocab: token ids must lie in [0, vocab) (None: [0, 2^31), what a step's int32 tokens hold).
  """

  def __init__(self, cfg: ServingConfig, allocator: ChunkAllocator, overcommit: float = 1.0, vocab: int | None = None):
    if overcommit <= 0:
      raise ValueError(f"{overcommit=} must be > 0")
    self.cfg = cfg
    self.vocab = vocab
    self.allocator = allocator
    self.overcommit = float(overcommit)
    self.waiting: list[Request] = []
    self.running: dict[int, Request] = {}
    self.finished: list[Request] = []
    self.cancelled: list[Request] = []
    self._ids = itertools.count()

  # --- submission ---------------------------------------------------------------------

  def submit(self, prompt, max_new_tokens: int, priority: int = 0, stop_ids=()) -> Request:
    """Queue a request, or raise `RequestTooLarge` / `ValueError` when it can never run."""
    prompt = tuple(prompt)
    if not prompt:
      raise ValueError("prompt must hold at least one token")
    limit = self.vocab or 2**31
    try:  # an integer type (no silent truncation of 1.5), in range: a bad id would fail, or be clamped, inside a step
      prompt = tuple(operator.index(t) for t in prompt)
    except TypeError as e:
      raise ValueError(f"token ids must be integers: {e}") from None
    bad = [t for t in prompt if not 0 <= t < limit]
    if bad:
      raise ValueError(f"token id(s) {bad[:5]} outside [0, {limit})")
    if max_new_tokens < 1:
      raise ValueError(f"{max_new_tokens=} must be >= 1")
    req = Request(prompt, int(max_new_tokens), int(priority), stop_ids=tuple(int(t) for t in stop_ids))
    if req.final_length > self.cfg.max_length:
      raise RequestTooLarge(
          f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) - 1 = {req.final_length} tokens "
          f"exceeds a slot's max_length of {self.cfg.max_length}"
      )
    budget = self.allocator.empty_worst_case_pages()
    if req.final_pages > budget:
      raise RequestTooLarge(
          f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) needs {req.final_pages} pages per layer, "
          f"beyond the whole store ({budget} pages per layer at raw size)"
      )
    req.rid = req.arrival = next(self._ids)
    self.waiting.append(req)
    return req

  # --- admission --------------------------------------------------------------------

  def reserved_pages(self) -> int:
    """Pages the running sequences still have to complete."""
    return sum(r.remaining_pages for r in self.running.values())

  def head(self) -> Request | None:
    return min(self.waiting, key=lambda r: r.key) if self.waiting else None

  def admit(self) -> tuple[Request, int, Placement] | None:
    """The head request with a slot and its prompt pages reserved, or None when it must wait."""
    req = self.head()
    if req is None or len(self.running) == self.cfg.num_slots:
      return None
    # With nothing running the store is empty and `submit` checked that the request fits it, so it
    # is admitted whatever `overcommit` (below 1 it would otherwise wait forever).
    if self.running and self.allocator.expected_pages() * self.overcommit < self.reserved_pages() + req.final_pages:
      return None
    n = len(req.prefill_tokens()) // PAGE_SIZE
    if self.allocator.check_reserve(n) is not None:
      return None
    slot = min(set(range(self.cfg.num_slots)) - set(self.running))
    return req, slot, self.allocator.reserve(n)

  def started(self, req: Request, slot: int, placement: Placement, next_token: int) -> None:
    """The prefill ran: the request holds `slot` and the prompt's pages."""
    self.waiting.remove(req)
    req.status, req.slot = Status.RUNNING, slot
    req.pages = placement.page_ids.tolist()
    req.length = len(req.prefill_tokens())
    if not req.generated:
      req.generated.append(int(next_token))
    self.running[slot] = req
    if req.done:
      self._finish(req)

  # --- decode -------------------------------------------------------------------------

  def completing(self) -> list[Request]:
    """Running requests whose next token completes a page, in slot order."""
    return [self.running[s] for s in sorted(self.running) if self.running[s].length % PAGE_SIZE == PAGE_SIZE - 1]

  def plan_decode(self) -> tuple[list[Request], Placement, list[Request]]:
    """Reserve this step's completed pages, preempting until they fit (possibly every running request).

    Returns:
      (completing requests in slot order, their placement, requests preempted now).
    """
    preempted = []
    while True:
      done = self.completing()
      if self.allocator.check_reserve(len(done)) is None:
        return done, self.allocator.reserve(len(done)), preempted
      victim = max(self.running.values(), key=lambda r: r.key)  # the last one too: see the module docstring
      self.preempt(victim)
      preempted.append(victim)

  def cancel(self, req: Request) -> None:
    """Withdraw a waiting or running request between steps: it leaves the queue or its slot, its
    pages (and reservation) are freed, and it keeps the tokens generated so far. Cancelling a
    request that already ended, or one of another scheduler, raises ValueError."""
    if req.status is Status.WAITING and any(r is req for r in self.waiting):
      self.waiting.remove(req)
    elif req.status is Status.RUNNING and self.running.get(req.slot) is req:
      self._vacate(req)
    else:
      raise ValueError(f"request {req.rid} is {req.status.value} here: only waiting or running requests can be cancelled")
    req.status = Status.CANCELLED
    self.cancelled.append(req)

  def preempt(self, req: Request) -> None:
    """Free a running request's KV and requeue it (its generated tokens are kept)."""
    self._vacate(req)
    req.status = Status.WAITING
    req.preemptions += 1
    self.waiting.append(req)

  def decoded(self, done: list[Request], placement: Placement, tokens) -> list[Request]:
    """The decode step ran: append tokens, enter completed pages, finish requests. Returns the finished."""
    for req, pid in zip(done, placement.page_ids.tolist()):
      req.pages.append(pid)
    finished = []
    for slot, req in list(self.running.items()):
      req.length += 1
      req.generated.append(int(tokens[slot]))
      if req.done:
        self._finish(req)
        finished.append(req)
    return finished

  def _finish(self, req: Request) -> None:
    self._vacate(req)
    req.status = Status.FINISHED
    self.finished.append(req)

  def _vacate(self, req: Request) -> None:
    self.allocator.release(req.pages)
    del self.running[req.slot]
    req.slot, req.pages, req.length = None, [], 0

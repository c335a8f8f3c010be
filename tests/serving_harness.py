"""Shared setup of the serving tests: tiny geometries, the stand-in model, its shadow KV, a random driver."""

from __future__ import annotations

import numpy as np

from zipfusion_jax.serving.backend import PagedBackend
from zipfusion_jax.serving.engine import Engine
from zipfusion_jax.serving.invariants import check_invariants
from zipfusion_jax.serving.scheduler import RequestTooLarge
from zipfusion_jax.serving.standin import StandInDecoder, next_tokens
from zipfusion_jax.serving.state import ServingConfig

# (name, geometry): small enough for 2 CPU cores, tight enough that requests wait and get preempted.
TINY = dict(num_layers=3, num_kv_heads=1, head_dim=64, num_slots=4, max_pages=4, num_chunks=9, chunk_pages=2)
WIDE = dict(num_layers=2, num_kv_heads=2, head_dim=128, num_slots=3, max_pages=3, num_chunks=8, chunk_pages=2)


def make_engine(compressed: bool = True, overcommit: float = 1.0, **geometry) -> Engine:
  cfg = ServingConfig(**{**TINY, **geometry}, compressed=compressed)
  return Engine(StandInDecoder(cfg, q_heads=2 * cfg.num_kv_heads), PagedBackend(cfg), overcommit=overcommit)


def shadow_for(engine: Engine):
  """shadow(request) -> (k, v) uint16 [L, length, Hkv, D], rebuilt from the request's tokens."""
  model, cfg = engine.model, engine.cfg

  def shadow(r):
    toks = np.asarray((list(r.prompt) + r.generated)[: r.length], np.int64)
    kv = [model.kv_bits(np, toks, np.arange(r.length), layer) for layer in range(cfg.num_layers)]
    return np.stack([k for k, _ in kv]), np.stack([v for _, v in kv])

  return shadow


def expected_tokens(engine: Engine, r) -> list[int]:
  """The tokens the stand-in model generates for r's prompt (no batch, no preemption)."""
  model, toks, pos = engine.model, [r.prompt[-1]], len(r.prompt) - 1
  while len(toks) <= r.max_new_tokens:
    toks.append(int(next_tokens(np, model.seed, np.int64(toks[-1]), np.int64(pos), model.vocab)))
    pos += 1
  return toks[1:]


def soak(engine: Engine, steps: int, seed: int, arrival: float = 0.35, check_every: int = 1) -> dict:
  """Random arrivals for `steps` steps, then drain; the invariant checker after every step.

  Returns counts; raises AssertionError on the first violation or a wrong token.
  """
  rng = np.random.default_rng(seed)
  shadow = shadow_for(engine)
  cfg = engine.cfg
  stats = dict(submitted=0, rejected=0, preempted=0, finished=0, steps=0)
  step = 0
  while step < steps or not engine.idle:
    if step < steps and rng.random() < arrival:
      prompt = rng.integers(0, engine.model.vocab, int(rng.integers(1, cfg.max_length)))
      try:
        engine.submit(prompt, int(rng.integers(1, cfg.max_length // 2)), priority=int(rng.integers(0, 2)))
        stats["submitted"] += 1
      except RequestTooLarge:
        stats["rejected"] += 1
    report = engine.step()
    stats["preempted"] += len(report.preempted)
    step += 1
    if step % check_every == 0 or engine.idle:
      violations = check_invariants(
          engine.backend, engine.state, engine.allocator, engine.scheduler.running.values(), shadow
      )
      assert violations == [], f"step {step}: {violations}"
    assert step < steps + 10_000, "the queue did not drain"
  for r in engine.scheduler.finished:
    assert r.generated == expected_tokens(engine, r), f"request {r.rid}: tokens lost or corrupted"
  stats["finished"] = len(engine.scheduler.finished)
  stats["steps"] = step
  assert stats["finished"] == stats["submitted"]
  return stats

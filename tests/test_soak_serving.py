"""Randomized soak of the serving engine: arrivals, finishes, preemptions, tight budgets, all layers.

The invariant checker (chunk ownership, no leaks, exact byte accounting,
device/host agreement, every live sequence bit-exact against its shadow KV)
runs after every step; at the end every request's tokens must equal what
the model generates for it alone. `pytest -m soak` runs >= 10,000 steps per
store; the default tier runs a short version.
"""

from __future__ import annotations

import pytest

from serving_harness import make_engine, soak


@pytest.mark.parametrize("compressed", [True, False])
def test_short_soak(compressed):
  stats = soak(make_engine(compressed, overcommit=2.0), steps=150, seed=int(compressed))
  assert stats["preempted"] > 0 and stats["finished"] > 5


@pytest.mark.soak
@pytest.mark.parametrize("compressed", [True, False])
def test_soak_10k_steps(compressed):
  stats = soak(make_engine(compressed, overcommit=2.0), steps=10_000, seed=100 + int(compressed))
  print(stats)
  assert stats["steps"] >= 10_000 and stats["preempted"] > 0 and stats["rejected"] > 0

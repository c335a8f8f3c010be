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


def test_short_soak_format_version_2():
  """The 12-bit store in format version 2 (the stand-in's rare outliers become exceptions)."""
  engine = make_engine(True, overcommit=2.0, format_version=2)
  stats = soak(engine, steps=150, seed=2)
  assert stats["preempted"] > 0 and stats["finished"] > 5
  assert engine.allocator.measured_pages and engine.state.group_meta.shape[-1] == 4


@pytest.mark.soak
@pytest.mark.parametrize("compressed,format_version", [(True, 1), (False, 1), (True, 2)])
def test_soak_10k_steps(compressed, format_version):
  engine = make_engine(compressed, overcommit=2.0, format_version=format_version)
  stats = soak(engine, steps=10_000, seed=100 + int(compressed) + 10 * format_version)
  print(stats)
  assert stats["steps"] >= 10_000 and stats["preempted"] > 0 and stats["rejected"] > 0

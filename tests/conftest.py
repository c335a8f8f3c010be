"""Shared test setup: hypothesis profiles and the exhaustive pattern sets (built once)."""

from __future__ import annotations

import os

# Four CPU devices for the tensor-parallel tests (must precede the first jax import; other tests use device 0).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import bf16_patterns

settings.register_profile(
    "default", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "slow", deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def eligible_rotations() -> np.ndarray:
  return bf16_patterns.eligible_rotations()


@pytest.fixture(scope="session")
def raw_rotations() -> np.ndarray:
  return bf16_patterns.raw_rotations()

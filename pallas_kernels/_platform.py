"""Where kernels run: on a GPU they compile; anywhere else they run interpreted."""

from __future__ import annotations

import jax


def default_interpret() -> bool:
  """True unless the default JAX backend is a GPU (then kernels compile for it)."""
  return jax.default_backend() != "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
  return default_interpret() if interpret is None else bool(interpret)

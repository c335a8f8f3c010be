"""A step's host-device traffic as one transfer each way.

Every numpy array a jitted call receives is its own host-to-device copy, and every array
`device_get` reads back its own device-to-host copy: on the H200 host about 0.1 ms each
(`benchmarks/step_host.py`), so a decode step's nine plan arrays and three readback arrays cost
more than a millisecond of host time per step. Here a pytree of small 32-bit or bool arrays
travels as one flat int32 buffer; a `Layout` (static: a jit argument or the host's record) splits
it again, on the device (`unpack(flat, jnp)`) or on the host (`unpack(flat, np)`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf of a packed pytree lies in its int32 buffer (hashable: a static jit argument).

  Attributes:
    treedef: the pytree's structure (static fields included).
    shapes: each leaf's shape, in leaf order.
    dtypes: each leaf's dtype name: bool (stored 0/1) or a 32-bit type (stored bitcast).
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]

  @staticmethod
  def of(tree) -> Layout:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dtypes = tuple(np.dtype(x.dtype).name for x in leaves)
    for name in dtypes:
      if name != "bool" and np.dtype(name).itemsize != 4:
        raise TypeError(f"only bool and 32-bit leaves pack into an int32 buffer, got {name}")
    return Layout(treedef, tuple(tuple(np.shape(x)) for x in leaves), dtypes)

  @property
  def size(self) -> int:
    """int32 words of the buffer."""
    return sum(math.prod(s) for s in self.shapes)

  def unpack(self, flat, xp=jnp):
    """The pytree from its int32 [size] buffer (`xp`: jax.numpy inside a jitted step, numpy on the host)."""
    if tuple(flat.shape) != (self.size,):
      raise ValueError(f"packed buffer has shape {tuple(flat.shape)}, layout wants ({self.size},)")
    leaves, start = [], 0
    for shape, name in zip(self.shapes, self.dtypes):
      n = math.prod(shape)
      words = flat[start : start + n].reshape(shape)
      start += n
      if name == "bool":
        leaves.append(words != 0)
      elif name == "int32":
        leaves.append(words)
      elif xp is np:
        leaves.append(np.array(words).view(name))  # np.array keeps 0-d leaves 0-d
      else:
        leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(name)))
    return jax.tree_util.tree_unflatten(self.treedef, leaves)


def pack_host(tree) -> tuple[np.ndarray, Layout]:
  """(int32 [size] buffer, layout) of a pytree of numpy (or scalar) leaves."""
  layout = Layout.of(tree)
  parts = [np.asarray(x).astype(np.int32).ravel() if name == "bool" else np.ascontiguousarray(x).view(np.int32).ravel()
           for x, name in zip(jax.tree_util.tree_leaves(tree), layout.dtypes)]
  return (np.concatenate(parts) if parts else np.zeros(0, np.int32)), layout


def pack_device(tree) -> tuple[jax.Array, Layout]:
  """(int32 [size] buffer, layout) of a pytree of traced or device arrays (inside a jitted step)."""
  layout = Layout.of(tree)
  parts = [jnp.asarray(x).astype(jnp.int32).ravel() if name == "bool"
           else jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.int32).ravel()
           for x, name in zip(jax.tree_util.tree_leaves(tree), layout.dtypes)]
  return (jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)), layout

"""A relaxed atomic fetch-and-add for Pallas Triton kernels: a counter, not a synchronisation point.

`pltr.atomic_add` always lowers with acquire-release semantics at GPU scope, which ptxas turns
into `MEMBAR.ALL.GPU` (plus error barriers) before every `ATOMG`: the warp waits until all of its
earlier stores are visible device-wide before the atomic may issue. The compressor's unordered
kernels use their atomic only to hand out disjoint output ranges (nothing in the kernel reads
what another tile wrote), so that fence buys nothing and costs a store drain per tile
(SASS of the persistent compressor, Triton 3.9 for sm_90: `benchmarks/kernel_sass.py`).

`relaxed_atomic_add` is the same primitive otherwise: the same abstract evaluation, the same
discharge rule (interpret mode) and the same lowering rule, run with `semantic=RELAXED` for the
`tt.atomic_rmw` it emits. Pinned to jax 0.11.2's Pallas Triton internals, like the rest of
`pallas_kernels`.
"""

from __future__ import annotations

import functools

from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import primitives as tp
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives

relaxed_atomic_rmw_p = jax_core.Primitive("zipfusion_relaxed_atomic_rmw")
relaxed_atomic_rmw_p.def_effectful_abstract_eval(tp._atomic_abstract_eval)
state_discharge.register_discharge_rule(relaxed_atomic_rmw_p)(tp._atomic_rmw_discharge_rule)


@lowering.register_lowering(relaxed_atomic_rmw_p)
def _relaxed_lowering_rule(ctx, *args_flat, args_tree, atomic_type):
  # The stock rule, with the one helper it calls for the tt.atomic_rmw bound to RELAXED.
  stock = lowering._atomic_rmw
  lowering._atomic_rmw = functools.partial(stock, semantic=tt_dialect.MemSemantic.RELAXED)
  try:
    return tp._atomic_lowering_rule(ctx, *args_flat, args_tree=args_tree, atomic_type=atomic_type)
  finally:
    lowering._atomic_rmw = stock


def relaxed_atomic_add(x_ref_or_view, idx, val):
  """`x_ref_or_view[idx] += val` atomically, returning the old value, with no memory ordering
  (`pltr.atomic_add` without its acquire-release fence)."""
  x_ref, transforms = state_primitives.get_ref_and_transforms(x_ref_or_view, idx, "atomic_rmw")
  args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, None))
  return relaxed_atomic_rmw_p.bind(*args_flat, args_tree=args_tree, atomic_type=tp.AtomicOpType.ADD)

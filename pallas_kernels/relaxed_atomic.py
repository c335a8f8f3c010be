"""A relaxed atomic fetch-and-add for Pallas Triton kernels: a counter, not a synchronisation point.

`pltr.atomic_add` always lowers with acquire-release semantics at GPU scope, which ptxas turns
into `MEMBAR.ALL.GPU` (plus error barriers) before every `ATOMG`: the warp waits until all of its
earlier stores are visible device-wide before the atomic may issue. The compressor's unordered
kernels use their atomic only to hand out disjoint output ranges (nothing in the kernel reads
what another tile wrote), so that fence buys nothing and costs a store drain per tile
(SASS of the persistent compressor, Triton 3.9 for sm_90: `benchmarks/kernel_sass.py`).

`relaxed_atomic_add` is the same primitive otherwise: the same abstract evaluation, the same
discharge rule (interpret mode), and the stock lowering's pointer handling for an integer add,
emitting `tt.atomic_rmw` with `semantic=RELAXED`. Pinned to jax 0.11.2's Pallas Triton internals, like the rest of
`pallas_kernels`.
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src import state
from jax._src import tree_util
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import primitives as tp
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives

relaxed_atomic_rmw_p = jax_core.Primitive("zipfusion_relaxed_atomic_rmw")
relaxed_atomic_rmw_p.def_effectful_abstract_eval(tp._atomic_abstract_eval)
state_discharge.register_discharge_rule(relaxed_atomic_rmw_p)(tp._atomic_rmw_discharge_rule)


@lowering.register_lowering(relaxed_atomic_rmw_p)
def _relaxed_lowering_rule(ctx, *args_flat, args_tree, atomic_type):
  # The stock rule's pointer and value handling (integer add only), with RELAXED semantics. Not a
  # swap of `lowering._atomic_rmw` around the stock rule: lowerings can run on several threads
  # (`Engine.warm_up`), and a swapped module global would leak into another kernel's atomics.
  if atomic_type != tp.AtomicOpType.ADD:
    raise NotImplementedError(f"relaxed {atomic_type}")
  block_info, *_ = ctx.block_infos
  ptr, indexers, val, mask = args_tree.unflatten(args_flat)
  *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
  indexers = list(indexers)
  if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
    ref_aval = state.transform_type(indexers, ctx.avals_in[0])
    indexers.append(indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
  if len(indexers) != 1:
    raise NotImplementedError("Only a single indexer is supported.")
  ptr = lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
  val = lowering._ensure_ir_value(val, value_aval)
  if not isinstance(val.type, ir.IntegerType):
    raise NotImplementedError(f"relaxed_atomic_add of {val.type}: integer counters only")
  mask = None if mask is None else lowering._ensure_ir_value(mask, mask_aval)
  return lowering._atomic_rmw(tt_dialect.RMWOp.ADD, ptr, val, mask=mask,
                              semantic=tt_dialect.MemSemantic.RELAXED)


def relaxed_atomic_add(x_ref_or_view, idx, val):
  """`x_ref_or_view[idx] += val` atomically, returning the old value, with no memory ordering
  (`pltr.atomic_add` without its acquire-release fence)."""
  x_ref, transforms = state_primitives.get_ref_and_transforms(x_ref_or_view, idx, "atomic_rmw")
  args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, None))
  return relaxed_atomic_rmw_p.bind(*args_flat, args_tree=args_tree, atomic_type=tp.AtomicOpType.ADD)

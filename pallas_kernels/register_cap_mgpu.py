"""A per-thread register cap (PTX `.maxnreg`) for one Mosaic GPU kernel.

Why: two CTAs of 256 threads share an SM only while ptxas gives the kernel <= 128 registers
per thread. Mosaic GPU (jax 0.11.2) offers no way to ask for that: its pipeline passes ptxas
no options, and it sets `nvvm.minctasm = 1` on every kernel. The PTX directive comes from an
`nvvm.maxnreg` attribute on the kernel's `gpu.func`, which the GPU-to-NVVM lowering copies to
the LLVM function; but the `gpu.func` only appears when the compile pipeline outlines the
`gpu.launch` op, and outlining drops the launch op's attributes.

How: `request_max_registers(n)`, called while a kernel body is lowered (inside an
`inline_mgpu` body), marks the kernel's `gpu.launch` op. A hook on Mosaic GPU's serialization
step (`core._run_serde_pass`, installed once, idempotent) then outlines marked kernels itself,
as the compile pipeline would (first sinking the constant memref-descriptor chains into the
launch, the pipeline's own first step), and puts `nvvm.maxnreg = n` on the outlined
`gpu.func`. The pipeline's outlining then finds no launch op left and changes nothing.
Unmarked kernels go through untouched.

Experimental (DecodeConfig.max_registers, off by default): it reaches into Mosaic GPU's
private serialization hook and reproduces one of its C++ passes; the register count ptxas
reports (`benchmarks.kernel_resources`) and `benchmarks.fused_kernel_check` decide whether it
is used.
"""

from __future__ import annotations

import threading

from jax.experimental.mosaic.gpu import core as mosaic_core
from jaxlib.mlir import ir, passmanager
from jaxlib.mlir._mlir_libs import _mlirGPUPasses  # noqa: F401  (registers gpu-kernel-outlining)

MARK = "zipfusion.maxnreg"
# Ops the compile pipeline sinks into a launch before outlining (memref descriptors built from
# constants), so that the outlined kernel takes pointers, not descriptor structs.
_SINKABLE = frozenset({"arith.constant", "llvm.mlir.constant", "llvm.mlir.zero", "llvm.mlir.undef",
                       "llvm.mlir.poison", "llvm.insertvalue", "builtin.unrealized_conversion_cast"})
_INSTALLED = "_zipfusion_register_cap"  # attribute that marks the installed wrapper
_install_lock = threading.Lock()


def check_count(count: int) -> None:
  """A `.maxnreg` this module accepts: a multiple of 8 in [64, 248]."""
  if count % 8 or not 64 <= count <= 248:
    raise ValueError(f"max_registers={count} must be a multiple of 8 in [64, 248]")


def request_max_registers(count: int) -> None:
  """Mark the Mosaic GPU kernel being lowered (the current insertion point lies in its
  `gpu.launch`) for `.maxnreg count`, and install the serialization hook that applies it."""
  check_count(count)
  install()
  op = ir.InsertionPoint.current.block.owner.operation
  while op is not None and op.name != "gpu.launch":
    op = op.parent
  if op is None:
    raise RuntimeError("request_max_registers: not inside a Mosaic GPU kernel body")
  op.attributes[MARK] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), count)


def install() -> None:
  """Wrap `mosaic_core._run_serde_pass` so that marked kernels are capped. Idempotent (also
  across a reload of this module: the wrapper is recognised by an attribute) and thread-safe."""
  with _install_lock:
    original = mosaic_core._run_serde_pass
    if getattr(original, _INSTALLED, False):
      return

    def run_serde_pass(module, *, serialize, ir_version=None):
      if serialize:
        apply_marks(module)
      return original(module, serialize=serialize, ir_version=ir_version)

    setattr(run_serde_pass, _INSTALLED, True)
    mosaic_core._run_serde_pass = run_serde_pass


def apply_marks(module: ir.Module) -> list[int]:
  """Outline the module's marked `gpu.launch` ops and put `nvvm.maxnreg` on their kernels.
  Returns the caps applied ([] when nothing is marked: the module is left as it is)."""
  launches = _ops_named(module, "gpu.launch")
  marked = [op for op in launches if MARK in op.attributes]
  if not marked:
    return []
  caps = sorted({ir.IntegerAttr(op.attributes[MARK]).value for op in marked})
  if len(launches) != 1 or len(caps) != 1:
    raise ValueError(f"a register cap needs one kernel per module; found {len(launches)} with caps {caps}")
  (launch,) = marked
  del launch.attributes[MARK]
  _sink_descriptor_chains(launch)
  passmanager.PassManager.parse("builtin.module(gpu-kernel-outlining)", module.context).run(module.operation)
  i32 = ir.IntegerType.get_signless(32, module.context)
  for func in _ops_named(module, "gpu.func"):
    func.attributes["nvvm.maxnreg"] = ir.IntegerAttr.get(i32, caps[0])
  return caps


def _ops_named(module: ir.Module, name: str) -> list[ir.Operation]:
  found = []

  def visit(op):
    if op.name == name:
      found.append(op.operation)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  return found


def _inside(op: ir.Operation, ancestor: ir.Operation) -> bool:
  while op is not None:
    if op == ancestor:
      return True
    op = op.parent
  return False


def _defining_op(value: ir.Value) -> ir.Operation | None:
  owner = value.owner
  return owner.operation if isinstance(owner, (ir.Operation, ir.OpView)) else None  # None: a block argument


def _sink_descriptor_chains(launch: ir.Operation) -> None:
  """Clone into the launch body the `_SINKABLE` chains that define values it uses from above,
  and point its uses at the clones (what Mosaic GPU's sink-memref-descriptors pass does)."""
  used_above = []

  def collect_operands(op):
    for value in op.operands:
      owner = _defining_op(value)
      if owner is not None and not _inside(owner, launch) and value not in used_above:
        used_above.append(value)
    return ir.WalkResult.ADVANCE

  for block in launch.regions[0].blocks:
    for op in block.operations:
      op.operation.walk(collect_operands)
  chain = []

  def add(op):  # operands first, so clones can be remapped in order
    if op is None or op in chain or op.name not in _SINKABLE:
      return
    for value in op.operands:
      add(_defining_op(value))
    chain.append(op)

  for value in used_above:
    add(_defining_op(value))
  first = launch.regions[0].blocks[0].operations[0]
  clones = {}
  for op in chain:
    clone = op.clone(ip=ir.InsertionPoint(first))
    for i, value in enumerate(clone.operands):
      if value in clones:
        clone.operands[i] = clones[value]
    for old, new in zip(op.results, clone.results):
      clones[old] = new
      for use in list(old.uses):
        user = use.owner.operation
        if _inside(user, launch) and user != clone.operation:
          user.operands[use.operand_number] = new

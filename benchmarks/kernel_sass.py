"""SASS of the Pallas Triton kernels without a GPU: registers, instruction mix, fences.

  python -m benchmarks.kernel_sass --triton-python /path/to/python [--variants a,b] [--out FILE]

Lowers each compressor variant for an abstract H200 on the CPU, captures the Triton module that
jax's Pallas Triton lowering builds (the text of the `tt` dialect), and compiles it for sm_90 with a
separately installed Triton (`--triton-python`: an interpreter with `pip install triton`, whose
wheel carries ptxas and cuobjdump; the jax venv keeps none of it). Prints per kernel: registers per
thread, resident one-warp programs per SM that those allow, SASS instruction count, and the
counts that matter for the compressor (global loads / stores, memory fences, atomics, barriers).

The compiler is not the one the GPU machine's XLA bundles (the Triton inside jaxlib), so the
figures are a proxy for what runs there: relative changes between variants are the point
(2026-12-06: the fetch-and-add of `pltr.atomic_add` costs a `MEMBAR.ALL.GPU` per tile, which
`CompressConfig(fenced_counter=False)`, the default, removes).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import subprocess
import tempfile

COMPILE = r"""
import json, sys, pathlib, triton
from triton.backends.compiler import GPUTarget
src, warps, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
out.write_bytes(k.asm["cubin"])
bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
print(json.dumps({"cuobjdump": str(bin_dir / "cuobjdump")}))
"""

REGISTERS_PER_SM = 65536
MAX_CTAS_PER_SM = 32  # Hopper


def capture_triton_modules(fn, *args) -> list[tuple[str, str]]:
  """(kernel name, tt-dialect text) of every Pallas Triton call in `fn`, lowered for an abstract H200."""
  import jax
  from jax._src.mesh import AbstractDevice
  from jax._src.pallas.triton import pallas_call_registration as registration
  from jax.sharding import AbstractMesh, AxisType

  h200 = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                      abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  captured = []
  stock = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    result = stock(*a, **k)
    text = result.module.operation.get_asm(enable_debug_info=False)
    captured.append((re.search(r"module @(\w+)", text).group(1), text))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    with jax.sharding.use_abstract_mesh(h200):
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = stock
  return captured


def sass_summary(triton_python: str, name: str, ttir: str, num_warps: int) -> dict:
  """Compile one module with the external Triton and summarise its SASS."""
  with tempfile.TemporaryDirectory() as tmp:
    src, cubin = pathlib.Path(tmp, f"{name}.ttir"), pathlib.Path(tmp, f"{name}.cubin")
    src.write_text(ttir)
    done = subprocess.run([triton_python, "-c", COMPILE, str(src), str(num_warps), str(cubin)],
                          capture_output=True, text=True, check=True)
    cuobjdump = json.loads(done.stdout.strip().splitlines()[-1])["cuobjdump"]
    usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
  registers = int(re.search(r"REG:(\d+)", usage).group(1))
  ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
  mix = collections.Counter(ops)
  warp_registers = -(-registers * 32 // 256) * 256  # allocated per warp in units of 256
  return {
      "kernel": name, "num_warps": num_warps, "registers": registers,
      "programs_per_sm": min(MAX_CTAS_PER_SM, REGISTERS_PER_SM // (warp_registers * num_warps)),
      "instructions": len(ops),
      **{key: sum(mix[o] for o in group) for key, group in (
          ("global_loads", ("LDG",)), ("global_stores", ("STG",)), ("fences", ("MEMBAR",)),
          ("atomics", ("ATOMG", "RED", "ATOM")), ("barriers", ("BAR",)))},
      "top_ops": dict(mix.most_common(8)),
  }


def compressor_variants(names: list[str]) -> dict:
  from benchmarks.compress import variant_configs  # the benchmark's own configs, by name

  configs = variant_configs()
  missing = [n for n in names if n not in configs]
  if missing:
    raise SystemExit(f"unknown variants {missing}; known: {sorted(configs)}")
  return {n: configs[n] for n in names}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--triton-python", required=True, help="a python with `pip install triton` (ptxas included)")
  p.add_argument("--variants", default="single_pass_unordered_tile1_w1_p2112_fenced,single_pass_unordered_tile1_w1_p2112")
  p.add_argument("--blocks", type=int, default=1 << 21, help="input blocks of 512 values (1 GiB: 2**21)")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  from pallas_kernels.compress import compress_pallas

  rows = []
  for variant, config in compressor_variants(a.variants.split(",")).items():
    def f(x, config=config):
      c = compress_pallas(x, config=config, interpret=False)
      return c.payload, c.group_meta, c.payload_units

    for name, ttir in capture_triton_modules(f, jax.ShapeDtypeStruct((a.blocks, 512), jnp.bfloat16)):
      row = {"variant": variant, **sass_summary(a.triton_python, name, ttir, config.num_warps)}
      rows.append(row)
      print(f"{variant:48s} {name:45s} regs {row['registers']:3d} ({row['programs_per_sm']:2d}/SM) "
            f"instr {row['instructions']:5d} LDG {row['global_loads']:3d} STG {row['global_stores']:3d} "
            f"MEMBAR {row['fences']} atomics {row['atomics']} BAR {row['barriers']}", flush=True)
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps({"compiler": "triton (pip) for sm_90, from jax's Pallas Triton lowering",
                                               "rows": rows}, indent=1) + "\n")
  return rows


if __name__ == "__main__":
  main()

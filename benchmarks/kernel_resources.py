"""Registers and shared memory of the fused decode kernel's variants, from ptxas (GPU machine).

  python -m benchmarks.kernel_resources [--out benchmarks/results/kernel_resources_h200.json]

Occupancy decides whether two CTAs (two consumer warpgroups) share an SM, which the consumer's
latency hiding depends on (H200, 2026-12-04: consumer alone 44 µs at two CTAs per SM, 61 µs at
one). Each variant (format 1 / format 2 / BF16 pages x ring depth 2, 3) is compiled once at
Llama-3.1-8B shapes with Mosaic GPU's dump switches (`MOSAIC_GPU_DUMP_PTXAS`,
`MOSAIC_GPU_DUMP_RESOURCES`, `MOSAIC_GPU_DUMP_TO`; names found in the CUDA plugin's binary, their
output format not yet seen), and the files each compile adds are searched for ptxas's "Used N
registers" and shared-memory byte counts (ptxas counts static shared memory only; Mosaic GPU's
scratch is dynamic, so the SMEM column is whatever the resource dump reports, possibly 0: the
kernel's declared scratch is in docs/DECODE_KERNEL.md). Nothing is timed. Writes
{"device", "jax", "rows": [{"variant", "registers", "smem_bytes", "dump_files"}]}; a variant
whose dump has no match keeps None and the first lines of its dump, so the format can be read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import tempfile

VARIANTS = {  # name -> (cache, DecodeConfig knobs)
    "format1_stages2": ("comp", {"stages": 2}),
    "format1_stages3": ("comp", {"stages": 3}),
    "format2_stages2": ("comp2", {"stages": 2}),
    "format2_stages3": ("comp2", {"stages": 3}),
    "bf16_stages2": ("plain", {"stages": 2}),
    "bf16_stages3": ("plain", {"stages": 3}),
    # two consumer warpgroups (384 threads): ptxas must stay <= 168 registers
    "format1_consumers2_stages2": ("comp", {"stages": 2, "consumers": 2}),
    "format1_consumers2_stages4": ("comp", {"stages": 4, "consumers": 2}),
    "format2_consumers2_stages4": ("comp2", {"stages": 4, "consumers": 2}),
    "bf16_consumers2_stages2": ("plain", {"stages": 2, "consumers": 2}),
    # one consumer, V^T restored after the QK wgmma: does the peak drop to <= 128 (two CTAs per SM)?
    "format1_v_after_qk_stages2": ("comp", {"stages": 2, "v_after_qk": True}),
    "format1_v_after_qk_stages3": ("comp", {"stages": 3, "v_after_qk": True}),
    # format 2 with V^T after QK: 131 registers uncapped (H100, 2026-12-06), so one CTA per SM
    "format2_v_after_qk_stages2": ("comp2", {"stages": 2, "v_after_qk": True}),
    # ptxas capped at 128 (PTX .maxnreg, register_cap_mgpu): 114 for format 2 (H100, 2026-12-06); spills?
    "format2_v_after_qk_stages2_maxnreg128": ("comp2", {"stages": 2, "v_after_qk": True, "max_registers": 128}),
    "format1_stages3_maxnreg128": ("comp", {"stages": 3, "max_registers": 128}),
    "format2_stages3_maxnreg128": ("comp2", {"stages": 3, "max_registers": 128}),
}
REGISTERS = re.compile(r"Used (\d+) registers")
SMEM = re.compile(r"(\d+) bytes smem|smem[^0-9\n]{0,24}(\d+)", re.IGNORECASE)
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_dump(text: str) -> tuple[int | None, int | None]:
  """(registers, shared-memory bytes) from ptxas / resource dump text, the largest of each seen."""
  regs = [int(m) for m in REGISTERS.findall(text)]
  smem = [int(a or b) for a, b in SMEM.findall(text)]
  return (max(regs) if regs else None), (max(smem) if smem else None)


def parse_spills(text: str) -> tuple[int | None, int | None]:
  """(spill store bytes, spill load bytes) from ptxas's function properties, the largest of each
  seen (a capped kernel pays for its cap here); None where ptxas printed none."""
  found = [(int(a), int(b)) for a, b in SPILLS.findall(text)]
  return (max(a for a, _ in found), max(b for _, b in found)) if found else (None, None)


def compile_with_dumps(name: str, build, dump_root: pathlib.Path) -> dict:
  """Compile `build()` (a lowered jit); the dump files it adds under `dump_root` are its own."""
  before = set(dump_root.rglob("*"))
  build().compile()
  files = sorted(p for p in set(dump_root.rglob("*")) - before if p.is_file())
  text = "\n".join(p.read_text(errors="replace") for p in files)
  registers, smem = parse_dump(text)
  spill_stores, spill_loads = parse_spills(text)
  row = {"variant": name, "registers": registers, "smem_bytes": smem, "spill_store_bytes": spill_stores,
         "spill_load_bytes": spill_loads, "dump_files": [p.name for p in files]}
  if registers is None:
    row["dump_head"] = text[:2000]
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--out", default="benchmarks/results/kernel_resources_h200.json")
  args = p.parse_args(argv)
  dump_root = pathlib.Path(tempfile.mkdtemp(prefix="mosaic_dump_"))
  os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")  # set before jax starts: read by the GPU plugin
  os.environ.setdefault("MOSAIC_GPU_DUMP_RESOURCES", "1")
  os.environ.setdefault("MOSAIC_GPU_DUMP_TO", str(dump_root))

  import jax

  from benchmarks.attention import problem
  from models.configs import get_config
  from pallas_kernels.decode_attention import DecodeConfig, decode_attention_pallas

  prob = problem(jax.random.key(0), get_config("llama3.1-8b"), args.batch, args.context)
  rows = []
  root = pathlib.Path(os.environ["MOSAIC_GPU_DUMP_TO"])
  root.mkdir(parents=True, exist_ok=True)
  for name, (cache_key, knobs) in VARIANTS.items():
    cfg = DecodeConfig(splits=1, **knobs)
    f = jax.jit(lambda q, c, cfg=cfg: decode_attention_pallas(q, c, prob["scale"], config=cfg))
    try:
      row = compile_with_dumps(name, lambda: f.lower(prob["q"], prob[cache_key]), root)
    except Exception as e:  # one variant that does not compile must not hide the others
      row = {"variant": name, "error": repr(e)[:500]}
    rows.append(row)
    print(f"{name:18s} registers {row.get('registers')}  smem {row.get('smem_bytes')}  spills "
          f"{row.get('spill_store_bytes')}/{row.get('spill_load_bytes')}  files {len(row.get('dump_files', []))}", flush=True)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "batch": args.batch, "context": args.context, "rows": rows}
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()

"""The decode step's wall time against its kernel time under XLA runtime flag sets (one subprocess each).

  python -m benchmarks.step_flags [--batch 32] [--context 2048] [--systems zipfusion,uncompressed]
      [--out benchmarks/results/step_flags_h200.json]

`benchmarks.step_profile` shows a step's wall time far above the sum of its kernels when the
step has many small kernels: the GPU waits on the host launching them one by one. XLA can
record a step's kernels into CUDA graphs (command buffers) instead; which op kinds it
records, and the smallest graph worth making, are runtime flags, read once at start-up, so
each flag set runs `step_profile` in its own process (this one never starts JAX: it would
take the GPU's memory from them). Rows are step_profile's, plus `flags`.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks.step_profile import step_parser  # imports jax, which starts no backend


ALL_KINDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
FLAG_SETS = {
    "xla_default": "",
    "no_command_buffers": "--xla_gpu_enable_command_buffer=",
    "command_buffers_min1": f"--xla_gpu_enable_command_buffer={ALL_KINDS} --xla_gpu_graph_min_graph_size=1",
}


def main(argv=None):
  p = step_parser(__doc__.splitlines()[0])
  p.add_argument("--sets", default=",".join(FLAG_SETS), help=f"names from {sorted(FLAG_SETS)}")
  p.add_argument("--timeout", type=int, default=240, help="seconds per flag set")
  a = p.parse_args(argv)
  result = dict(rows=[])
  for name in a.sets.split(","):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG_SETS[name]).strip())
    with tempfile.TemporaryDirectory() as tmp:
      out = pathlib.Path(tmp) / "rows.json"
      cmd = [sys.executable, "-m", "benchmarks.step_profile", "--model", a.model, "--batch", str(a.batch),
             "--context", str(a.context), "--systems", a.systems, "--top", "0", "--out", str(out)]
      cmd += ["--narrow"] if a.narrow else []
      try:
        subprocess.run(cmd, env=env, timeout=a.timeout, check=True, capture_output=True, text=True)
      except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"{name}: failed: {(getattr(e, 'stderr', '') or '')[-400:]}", flush=True)
        continue
      child = json.loads(out.read_text())
      result.update({k: child[k] for k in ("device", "jax", "date")})
      for row in child["rows"]:
        row.update(flags=name, xla_flags=FLAG_SETS[name])
        result["rows"].append(row)
        print(f"{name:22s} {row['system']:14s} step {row['step_wall_us'] / 1e3:7.2f} ms wall "
              f"{row['step_kernel_us'] / 1e3:7.2f} ms kernels ({row['kernels']})", flush=True)
    if a.out:
      a.out.parent.mkdir(parents=True, exist_ok=True)
      a.out.write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()

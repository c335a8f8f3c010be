"""Where does a jitted engine step allocate store-sized temporaries on this backend?

  python -m benchmarks.store_copy_probe [--model llama3.1-8b] [--budget-gib 8] [--system zipfusion]

Builds the e2e benchmark's engine under a KV budget, compiles its prefill and decode steps and
prints XLA's memory analysis (temp bytes against the store's bytes) and every instruction of the
optimised HLO whose result is at least `--min-mib` (a store-sized copy shows up there).
"""

from __future__ import annotations

import argparse
import re

import jax
import numpy as np

from benchmarks.e2e import backend_for
from models.configs import get_config
from models.params import random_params
from zipfusion_jax.serving.engine import Engine
from zipfusion_jax.serving.model import ModelDecoder
from zipfusion_jax.serving.state import PAGE_SIZE

_DTYPE_BYTES = {"u8": 1, "s8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "pred": 1}
_SHAPE = re.compile(r"\b(u8|s8|bf16|f16|s32|u32|f32|pred)\[([0-9,]*)\]")


def big_instructions(hlo: str, min_bytes: int) -> list[str]:
  out = []
  for line in hlo.splitlines():
    m = _SHAPE.search(line.split("=", 1)[1] if "=" in line else "")
    if not m or "parameter(" in line:
      continue
    size = _DTYPE_BYTES[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))
    if size >= min_bytes:
      out.append(f"{size / 2**20:10.0f} MiB  {line.strip()[:260]}")
  return out


def report(name: str, jitted, *args, min_bytes: int):
  compiled = jitted.lower(*args).compile()
  m = compiled.memory_analysis()
  print(f"{name}: temp {m.temp_size_in_bytes / 2**30:.2f} GiB, args {m.argument_size_in_bytes / 2**30:.2f} GiB, "
        f"alias {m.alias_size_in_bytes / 2**30:.2f} GiB, out {m.output_size_in_bytes / 2**30:.2f} GiB")
  for line in big_instructions(compiled.as_text(), min_bytes):
    print("   ", line)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="llama3.1-8b")
  p.add_argument("--budget-gib", type=float, default=8.0)
  p.add_argument("--system", default="zipfusion")
  p.add_argument("--min-mib", type=float, default=256.0)
  a = p.parse_args(argv)
  config = get_config(a.model)
  backend = backend_for(config, a.system, 8, 4096, int(a.budget_gib * 2**30))
  print(f"store {backend.cfg.store_bytes / 2**30:.2f} GiB, metadata {backend.cfg.metadata_bytes / 2**30:.2f} GiB")
  engine = Engine(ModelDecoder(config), backend, random_params(config, jax.random.key(0)))
  min_bytes = int(a.min_mib * 2**20)
  calls = {}
  for name in ("_prefill", "_decode"):
    jitted = getattr(engine, name)
    def probe(*args, _name=name, _jitted=jitted):
      if _name not in calls:
        calls[_name] = True
        report(_name, _jitted, *args, min_bytes=min_bytes)
      return _jitted(*args)
    setattr(engine, name, probe)
  engine.submit([1] * (PAGE_SIZE + 1), 2)
  engine.run()


if __name__ == "__main__":
  main()

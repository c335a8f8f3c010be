"""What the compressor's store pattern costs on its own: copies that write like it (one device call).

  python -m benchmarks.store_pattern [--gib 1] [--out FILE]

The compressor's kernels store a block's low (and raw high) bytes as x rows, then y rows: each
warp store writes 4 bytes of every 8 (`pl.ds(row, 64, stride=2)`), half of each 32-byte sector,
and the other half arrives with the next store. Two persistent one-warp Pallas Triton copies of
the same uint8 rows time that pattern against whole-sector stores, with the compressor's program
count and loop shape and no arithmetic:

  half_sectors:  read 64 row pairs, write the even rows, then the odd rows (stride-2 stores);
  whole_sectors: read the same 64 row pairs and write them as they are ([64, 2, 4]: a warp store
                 covers 128 contiguous bytes).

Both copies are checked equal to their input. On CPU the kernels run interpreted on a small array
(a smoke run, not a figure).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from benchmarks.compress import cupti_us
from pallas_kernels._platform import default_interpret

PAIRS_PER_TILE = 256  # a compressor tile: one group, 4 blocks of 64 row pairs (4 KiB)


def _copy_kernel(src_ref, dst_ref, *, tiles: int, programs: int, whole: bool):
  # src_ref, dst_ref: uint8 [tiles * PAIRS_PER_TILE, 2, 4] (row pairs of 8 bytes; whole arrays)
  p = pl.program_id(0)

  def body(i, carry):
    t = p + i * programs
    for k in range(PAIRS_PER_TILE // 64):  # per block, as the compressor stores
      pairs = pl.ds(t * PAIRS_PER_TILE + 64 * k, 64)
      if whole:
        dst_ref[pairs, :, :] = src_ref[pairs, :, :]
      else:
        x, y = src_ref[pairs, 0, :], src_ref[pairs, 1, :]
        dst_ref[pairs, 0, :] = x
        dst_ref[pairs, 1, :] = y
    return carry

  jax.lax.fori_loop(0, (tiles - p + programs - 1) // programs, body, 0)


@functools.partial(jax.jit, static_argnames=("programs", "whole", "interpret"))
def store_copy(src, *, programs: int, whole: bool, interpret: bool = False):
  """uint8 [tiles * 256, 2, 4] -> a copy written with whole-sector or half-sector stores."""
  tiles = src.shape[0] // PAIRS_PER_TILE
  programs = min(programs, tiles)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_copy_kernel, tiles=tiles, programs=programs, whole=whole),
      grid=(programs,),
      in_specs=[any_spec],
      out_specs=any_spec,
      out_shape=jax.ShapeDtypeStruct(src.shape, src.dtype),
      interpret=interpret,
      compiler_params=pltr.CompilerParams(num_warps=1),
      name="zipfusion_store_pattern_" + ("whole" if whole else "half"),
  )(src)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--programs-per-sm", default="8,16")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  interpret = default_interpret()
  nbytes = int(a.gib * 2**30) if not interpret else 2**20
  tiles = nbytes // (PAIRS_PER_TILE * 8)
  moved = 2 * tiles * PAIRS_PER_TILE * 8  # bytes read + written
  src = jax.random.bits(jax.random.key(0), (tiles * PAIRS_PER_TILE, 2, 4), jnp.uint8)
  rows = []
  for per_sm in (int(v) for v in a.programs_per_sm.split(",")):
    for whole in (False, True):
      f = functools.partial(store_copy, programs=132 * per_sm, whole=whole, interpret=interpret)
      out = f(src)
      equal = bool(np.array_equal(np.asarray(out), np.asarray(src)))
      t, kernels = cupti_us(f, src)
      name = "whole_sectors" if whole else "half_sectors"
      rows.append({"pattern": name, "programs_per_sm": per_sm, "time_us": t, "bytes": moved,
                   "rw_tbps": moved / t / 1e6, "equal": equal, "kernel_times": kernels})
      print(f"{name:14s} {per_sm:2d}/SM {t:8.1f} us {rows[-1]['rw_tbps']:5.2f} TB/s r+w  equal={equal}", flush=True)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "input_bytes": tiles * PAIRS_PER_TILE * 8, "rows": rows}
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
  return result


if __name__ == "__main__":
  main()

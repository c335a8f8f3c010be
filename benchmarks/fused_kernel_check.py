"""GPU check of the fused decode kernel: correctness sweep, then CUPTI timing (one device call).

  python -m benchmarks.fused_kernel_check [--quick] [--out FILE]

Correctness: ragged lengths, GQA groups, both head dims, several split counts,
compressed and uncompressed caches; each output against the jnp reference
(stated tolerance) and compressed == uncompressed bit for bit. Timing: both
paths and cuDNN at Llama-3.1-8B shapes, same run: first each store under its default config
(`decode_attention.default_config`, what `config=None` picks; rows with `default_config`), then the variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import zipfusion_jax as zf
from benchmarks.attention import dense_attention, problem
from benchmarks.compress import cupti_us
from models.configs import get_config
from pallas_kernels.decode_attention import DecodeConfig, decode_attention_pallas, default_config, heuristic_config

TOL = 2e-2  # |out - reference| for O(1) outputs: bf16 P and output rounding


PATHS = ("compressed", "uncompressed")


KNOB_SETS = (("", {}), ("_stages3", {"stages": 3}), ("_stages4", {"stages": 4}),
             ("_thread_issue", {"warp_issue": False}), ("_cr168", {"consumer_registers": 168}))


def case(key, batch, seq, kv_heads, group, head_dim, lengths, splits, knob_sets=KNOB_SETS):
  kk, kv, kq = jax.random.split(key, 3)
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
  # A few raw blocks: outliers in some pages.
  k = k.at[:, ::37, :, 3].set(3e4)
  q = jax.random.normal(kq, (batch, kv_heads * group, head_dim), jnp.bfloat16)
  lengths = np.asarray(lengths, np.int32)
  comp = zf.paged_cache_from_dense(k, v, lengths, compressed=True)
  comp2 = zf.paged_cache_from_dense(k, v, lengths, compressed=True, version=2)  # the outliers become exceptions
  plain = zf.paged_cache_from_dense(k, v, lengths, compressed=False)
  scale = 1.0 / np.sqrt(head_dim)
  ref, ref_lse = zf.paged_decode_attention(q, plain, impl="reference", return_lse=True)
  outs, failures = {}, []
  # Format version 2 under every knob set too; each output is compared bit for bit with the BF16
  # pages' output under the same knobs (knobs such as `consumers` change the summation order).
  paths = (("compressed", comp), ("uncompressed", plain), ("compressed_v2", comp2))
  variants = [(path + suffix, cache, knobs) for path, cache in paths for suffix, knobs in knob_sets]
  err = 0.0
  for name, cache, knobs in variants:
    if name.split("_")[0] not in PATHS:
      continue
    try:  # one failing variant (e.g. a knob that does not compile) must not hide the others
      cfg = DecodeConfig(splits=splits, **knobs)
      out, lse = decode_attention_pallas(q, cache, scale, config=cfg, return_lse=True)
      v_err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
      finite = np.isfinite(np.asarray(ref_lse))
      lse_err = float(np.max(np.abs(np.asarray(lse)[finite] - np.asarray(ref_lse)[finite]), initial=0.0))
      assert v_err <= TOL and lse_err <= 1e-2, f"err {v_err} lse_err {lse_err}"
      outs[name], err = np.asarray(out), max(err, v_err)
    except Exception as e:
      failures.append(f"{name}: {repr(e)[:300]}")
  for suffix, _ in knob_sets:
    plain_out = outs.get("uncompressed" + suffix)
    for path in ("compressed", "compressed_v2"):
      name = path + suffix
      if plain_out is not None and name in outs and not np.array_equal(outs[name].view(np.uint16), plain_out.view(np.uint16)):
        failures.append(f"{name} != uncompressed{suffix} bitwise")
  if failures:
    raise AssertionError("; ".join(failures) + f" (passed: {sorted(outs)})")
  return err


CASES = [
    # batch, seq, kv_heads, group, head_dim, lengths, splits
    (2, 64, 1, 1, 128, [64, 64], 1),
    (2, 100, 2, 4, 128, [100, 37], 1),
    (3, 1030, 2, 4, 128, [1, 513, 1023], 1),
    (3, 1030, 2, 4, 128, [16, 17, 1030], 3),
    (2, 300, 3, 3, 64, [15, 300], 1),
    (2, 300, 3, 3, 64, [0, 299], 2),
    (2, 520, 8, 4, 128, [520, 250], 2),
    (1, 2048, 1, 8, 64, [2048], 4),
    (2, 700, 2, 2, 128, [700, 699], 1),
    (2, 256, 3, 3, 64, [256, 256], 1),
    (2, 300, 1, 1, 64, [15, 300], 1),
    (2, 300, 3, 3, 128, [15, 300], 1),
    (2, 256, 3, 1, 64, [256, 256], 1),
    (2, 256, 1, 3, 64, [256, 256], 1),
]


def sweep_knob_sets(sweep):
  """The correctness knob sets of a --sweep: the defaults, then each distinct knob dict less
  `splits` (the cases fix their own) and timing probes (their outputs are garbage)."""
  sets = {"": {}}
  for knobs in sweep:
    if not knobs.get("timing_probe"):
      knobs = {n: x for n, x in knobs.items() if n != "splits"}
      sets.setdefault("".join(f"_{n}{x}" for n, x in sorted(knobs.items())), knobs)
  return tuple(sets.items())


def correctness(only=None, knob_sets=KNOB_SETS):
  results = []
  for i, c in enumerate(CASES):
    if only is not None and i != only:
      continue
    try:
      err = case(jax.random.key(i), *c, knob_sets=knob_sets)
      results.append(dict(case=str(c), ok=True, err=err))
      print(f"PASS {c} err={err:.2e}", flush=True)
    except Exception as e:  # report every case, keep going
      results.append(dict(case=str(c), ok=False, error=repr(e)[:2000]))
      print(f"FAIL {c}: {repr(e)[:600]}", flush=True)
      traceback.print_exc(limit=3)
  return results


def timing(shapes, splits_list, lean=False, sweep=None, on_row=lambda rows: None):
  """CUPTI time of both paths per shape: split counts, stages=4, and the two timing probes
  (lean: the heuristic's splits, stages 2 and 4, and the copies probe only). sweep: a list of
  DecodeConfig knob dicts (a "splits" key, else the heuristic's for that many consumers) timed
  instead. `on_row(rows)` runs after every row (the caller saves them: a killed call keeps them)."""
  model = get_config("llama3.1-8b")
  rows = []
  for i, (batch, context) in enumerate(shapes):
    p = problem(jax.random.key(100 + i), model, batch, context)
    q, k, v, comp, plain, scale = (p[n] for n in ("q", "k", "v", "comp", "plain", "scale"))
    bf16_bytes, comp_bytes = p["bf16_bytes"], p["comp_bytes"]
    t, _ = cupti_us(dense_attention("cudnn", scale), q, k, v)
    rows.append(dict(kernel="cudnn_dense", batch=batch, context=context, time_us=t, bytes_read=bf16_bytes))
    print(f"cudnn_dense            B={batch} S={context} {t:8.1f} us", flush=True)
    heur = heuristic_config(batch, model.kv_heads, plain.max_pages)
    variants = [(s, {}) for s in sorted(set(([] if lean else splits_list) + [heur.splits]))]
    variants += [(heur.splits, {"stages": 4}), (heur.splits, {"warp_issue": True})]
    variants += [(heur.splits, {"consumer_registers": r}) for r in (168, 0)]
    variants += [(heur.splits, {"consumer_registers": 168, "warp_issue": True})]
    # Where the time goes: the producer's copies alone, the consumer's work alone.
    variants += [(heur.splits, {"timing_probe": "copies"}), (heur.splits, {"timing_probe": "copies", "warp_issue": True})]
    variants += [] if lean else [(heur.splits, {"timing_probe": "compute"})]
    if sweep is not None:
      split_default = lambda kn: heuristic_config(batch, model.kv_heads, plain.max_pages,
                                                  consumers=kn.get("consumers", 1)).splits
      variants = [(kn.get("splits", split_default(kn)), {k: x for k, x in kn.items() if k != "splits"})
                  for kn in sweep]
    caches = (("zipfusion_compressed", comp, comp_bytes), ("zipfusion_uncompressed", plain, bf16_bytes),
              ("zipfusion_compressed_v2", p["comp2"], p["comp2_bytes"]))
    for name, cache, nbytes in caches:  # what a caller gets with config=None
      cfg = default_config(cache)
      t, _ = cupti_us(jax.jit(lambda q, c, cfg=cfg: decode_attention_pallas(q, c, scale, config=cfg)), q, cache)
      rows.append(dict(kernel=name, batch=batch, context=context, default_config=True, time_us=t,
                       bytes_read=int(nbytes), **dataclasses.asdict(cfg)))
      print(f"{name:22s} B={batch} S={context} default {cfg}  {t:8.1f} us {nbytes / t / 1e6:5.2f} TB/s", flush=True)
      on_row(rows)
    for splits, knobs in variants:
      for name, cache, nbytes in caches:
        cfg = DecodeConfig(splits=splits, **knobs)
        f = jax.jit(lambda q, c, cfg=cfg: decode_attention_pallas(q, c, scale, config=cfg))
        try:
          t, _ = cupti_us(f, q, cache)
        except Exception as e:
          print(f"{name} {cfg}: {repr(e)[:300]}", flush=True)
          continue
        rows.append(dict(kernel=name, batch=batch, context=context, splits=splits, **knobs,
                         heuristic=splits == heur.splits, time_us=t, bytes_read=int(nbytes)))
        print(f"{name:22s} B={batch} S={context} splits={splits:2d} {str(knobs):28s} {t:8.1f} us "
              f"{nbytes / t / 1e6:5.2f} TB/s", flush=True)
        on_row(rows)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true")
  p.add_argument("--out", default=None)
  p.add_argument("--skip-correctness", action="store_true")
  p.add_argument("--skip-timing", action="store_true")
  p.add_argument("--only", type=int, default=None)
  p.add_argument("--paths", default="compressed,uncompressed")
  p.add_argument("--lean", action="store_true", help="fewer timing variants (see timing())")
  p.add_argument("--sweep", default=None, help='JSON list of knob dicts, e.g. \'[{"splits": 2, "warp_issue": true}]\'')
  a = p.parse_args(argv)
  global PATHS
  PATHS = tuple(a.paths.split(","))
  res = dict(device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat())

  def save():  # after the correctness sweep and after every timing row
    if a.out:
      pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
      pathlib.Path(a.out).write_text(json.dumps(res, indent=1))

  sweep = json.loads(a.sweep) if a.sweep else None
  if not a.skip_correctness:
    knob_sets = KNOB_SETS if sweep is None else sweep_knob_sets(sweep)
    res["correctness"] = correctness(a.only, knob_sets)
    save()
  shapes = [(32, 2048), (8, 8192)] if a.quick else [(32, 2048), (8, 8192), (64, 4096), (1, 32768), (128, 1024)]
  if not a.skip_timing:
    res["timing"] = timing(shapes, [1, 2, 4], lean=a.lean, sweep=sweep,
                           on_row=lambda rows: (res.__setitem__("timing", rows), save()))
  save()


if __name__ == "__main__":
  main()

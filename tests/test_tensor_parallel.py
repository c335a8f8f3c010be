"""Tensor parallelism over KV heads on 4 CPU devices (conftest sets the device count).

tp = 2 and 4 against tp = 1 on tiny Llama / Qwen3 with 4 KV heads (tokens identical, logits within
TOL), the embedded SmolLM2 at tp = 3, per-shard invariants, shardings kept across steps, the
lowered step's collectives, the per-device allocator and bad inputs.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest

from models.configs import get_config
from models.params import random_params
from zipfusion_jax.generate import main, serving_config
from zipfusion_jax.serving.allocator import ChunkAllocator
from zipfusion_jax.serving.backend import PagedBackend
from zipfusion_jax.serving.engine import Engine
from zipfusion_jax.serving.invariants import check_invariants
from zipfusion_jax.serving.model import ModelDecoder
from zipfusion_jax.serving.state import ServingConfig
from zipfusion_jax.serving.tensor_parallel import TensorParallel, TensorParallelError

# fp32 partial sums all-reduced, then one BF16 rounding: the only differences from tp = 1 are fp32
# summation order and the BF16 roundings it flips downstream. The random tiny models' logits reach
# |z| ~ 90, so the tolerance is relative to the largest: 0.2% of max |z| (one BF16 ulp is 0.4-0.8%).
TOL = 2e-3
PROMPTS = [list(range(1, 40)), list(range(7, 30)), [5]]
NEW_TOKENS = 10

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")


@dataclasses.dataclass(frozen=True)
class LogitsDecoder(ModelDecoder):
  """ModelDecoder whose decode aux is every slot's full logits (float32 [S, V]), for comparison."""

  def decode(self, params, backend, state, plan, tokens):
    from models import decoder

    logits, state = decoder.decode(params, self.config, tokens, state, plan, backend)
    return self._pick(logits, plan.positions + 1), logits, state


def four_kv_heads(name):
  base = get_config(name)
  group = base.q_heads // base.kv_heads
  return dataclasses.replace(base, name=f"{name}-4kv", kv_heads=4, q_heads=4 * group)


def run_engine(config, params, tp_size, compressed=True, check=True):
  """Generate PROMPTS; returns (tokens per request, logits of every decode step [steps, S, V], engine)."""
  cfg = serving_config(config, [len(p) for p in PROMPTS], NEW_TOKENS, 2, compressed)
  tp = TensorParallel.create(tp_size) if tp_size > 1 else None
  engine = Engine(LogitsDecoder(config), PagedBackend(cfg), params, tensor_parallel=tp)
  reqs = [engine.submit(p, NEW_TOKENS) for p in PROMPTS]
  logits = []
  while not engine.idle:
    report = engine.step()
    if report.decoded:
      logits.append(np.asarray(engine.last_aux))
    if check and tp is not None:
      running = engine.scheduler.running.values()
      assert check_invariants(engine.backend, engine.state, engine.allocator, running, tp=tp) == []
  return [r.generated for r in reqs], np.stack(logits), engine


@pytest.mark.parametrize("name, compressed, degrees", [
    ("tiny-llama3", True, (2, 4)),
    pytest.param("tiny-qwen3", True, (2, 4), marks=pytest.mark.slow),  # 22 s; llama covers the sharding
    ("tiny-llama3", False, (2,))])
def test_tp_matches_one_device(name, compressed, degrees):
  config = four_kv_heads(name)
  params = random_params(config, jax.random.key(3))
  want_tokens, want_logits, _ = run_engine(config, params, 1, compressed)
  for n in degrees:
    tokens, logits, engine = run_engine(config, params, n, compressed)
    assert tokens == want_tokens, f"tp={n}"
    chex.assert_shape(logits, want_logits.shape)
    chex.assert_trees_all_close(logits, want_logits, atol=TOL * float(np.abs(want_logits).max()), rtol=0)
    assert engine.traces["prefill"] == 1 and 1 <= engine.traces["decode"] <= len(engine.cfg.completion_widths)


def test_state_stays_sharded_and_collectives_are_two_all_reduces_per_layer():
  config = four_kv_heads("tiny-llama3")
  params = random_params(config, jax.random.key(0))
  _, _, engine = run_engine(config, params, 2, check=False)
  tp = engine.tp
  specs = tp.state_specs(True)
  for field in ("arena", "group_meta", "k_tail", "v_tail", "chunk_fill", "step_units", "page_table"):
    sharding = getattr(engine.state, field).sharding
    assert sharding.is_equivalent_to(jax.NamedSharding(tp.mesh, getattr(specs, field)), getattr(engine.state, field).ndim), field
  layer = engine.params.layers[0]
  assert layer.wq.sharding.shard_shape(layer.wq.shape) == (config.hidden, config.q_heads * config.head_dim // 2)
  # The decode step as compiled: no K/V (or anything) gathered, one all-reduce per attention and MLP block
  # and, when a page completes, one for the page sizes (a width-0 step places nothing).
  from zipfusion_jax.serving.engine import decode_plan

  tokens = np.zeros(engine.cfg.num_slots, np.int32)
  for lengths, completing, reduces in (({0: 20}, [], 2), ({0: 15}, [0], 3)):
    plan = decode_plan(engine.cfg, lengths, completing, engine.allocator.reserve(len(completing)))
    hlo = engine.lower_decode(plan, tokens).compile().as_text()
    engine.allocator.cancel(engine.allocator._pending)
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo
    assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") == reduces * config.layers, completing


@pytest.mark.slow  # ~34 s (the 30-layer model at tp 3); test_tp_matches_one_device covers tp 2 / 4 in the default tier
def test_embedded_smollm2_tp3_greedy_tokens(capsys, tmp_path):
  out = tmp_path / "tp3.json"
  rc = main(["--prompt", "The capital of France is", "--max-new-tokens", "8", "--tensor-parallel", "3",
             "--json", str(out)])
  assert rc == 0, capsys.readouterr().err
  import json

  payload = json.loads(out.read_text())
  assert payload["results"][0]["token_ids"] == [7042, 30, 198, 198, 504, 2988, 314, 42]  # tp = 1's greedy tokens
  assert payload["stats"]["tensor_parallel"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel", "3"], "does not divide tiny-llama3's 2 KV heads"),
    (["--tensor-parallel", "8"], "needs 8 devices, 4 present"),
    (["--tensor-parallel", "0"], "must be >= 1"),
])
def test_bad_tensor_parallel_degree(capsys, argv, message):
  rc = main(["--model", "tiny-llama3", "--random-weights", "--prompt", "hi", "--max-new-tokens", "2", *argv])
  assert rc == 2
  assert message in capsys.readouterr().err


def test_local_configs_and_errors():
  tp = TensorParallel.create(2)
  llama = get_config("llama3.1-8b")
  local = tp.local_model_config(llama)
  assert (local.q_heads, local.kv_heads, local.intermediate, local.tp_axis) == (16, 4, 7168, "tp")
  cfg = ServingConfig(num_layers=2, num_kv_heads=4, head_dim=64, num_slots=2, max_pages=4, num_chunks=8)
  local_cfg = tp.local_serving_config(cfg)
  assert local_cfg.num_kv_heads == 2 and local_cfg.num_chunks == cfg.num_chunks
  assert local_cfg.store_bytes * 2 == cfg.store_bytes
  with pytest.raises(TensorParallelError, match="does not divide"):
    TensorParallel.create(3).local_serving_config(cfg)
  with pytest.raises(TensorParallelError, match="MLP width"):
    TensorParallel.create(4).check(dataclasses.replace(llama, intermediate=14338))


def test_allocator_places_by_the_fullest_device():
  cfg = ServingConfig(num_layers=1, num_kv_heads=1, head_dim=64, num_slots=2, max_pages=8, num_chunks=3, chunk_pages=2)
  alloc = ChunkAllocator(cfg, devices=2)
  small, raw = cfg.min_page_units, cfg.page_units
  p = alloc.reserve(1)
  chunk = int(alloc.commit(p, np.array([[[small]], [[raw]]]))[0, 0])  # device 1's shard stayed raw
  assert alloc.fill[chunk] == raw and alloc.device_fill[:, chunk].tolist() == [small, raw]
  # Room is that of device 1: one more raw page fits the current chunk, not two.
  q = alloc.reserve(2)
  dest = alloc.commit(q, np.full((2, 1, 2), small))
  assert dest[0, 0] == chunk and dest[0, 1] != chunk
  cap = alloc.capacity()
  assert cap.live_bytes == (raw + 2 * small) * 256  # the fullest device's store
  assert cap.live_bytes + cap.dead_bytes + cap.stranded_bytes + cap.free_bytes == cap.total_bytes
  assert alloc.live_bytes_all_devices() == (raw + 5 * small) * 256
  assert alloc.shard(0).fill[chunk] == 2 * small and alloc.shard(1).fill[chunk] == raw + small
  with pytest.raises(ValueError, match="step_units of shape"):
    r = alloc.reserve(1)
    alloc.commit(r, np.full((1, 2), small))  # [L, n] from one device, but there are two
  alloc.commit(r, np.full((2, 1, 1), small))
  alloc.release(p.page_ids.tolist() + q.page_ids.tolist() + r.page_ids.tolist())
  assert alloc.fill.sum() == 0 and alloc.live_bytes_all_devices() == 0


def test_tp_benchmark_smoke(tmp_path):
  from benchmarks import tp as tp_bench

  out = tmp_path / "tp.json"
  result = tp_bench.main(["--model", "tiny-llama3", "--tp", "1,2,4", "--batch", "2", "--context", "40",
                          "--decode-steps", "2", "--systems", "zipfusion", "--out", str(out)])
  assert [(r["tp"], r["sharded"], r["system"]) for r in result["rows"]] == [
      (1, False, "zipfusion"), (1, True, "zipfusion"), (2, True, "zipfusion")]
  assert all(r["decode_tokens_per_s"] > 0 for r in result["rows"])
  assert result["skipped"][0]["tp"] == 4  # tiny-llama3 has 2 KV heads
  assert result["tokens_identical_across_tp"] and out.exists()

#!/usr/bin/env bash
# Every GPU measurement of the project in one device call (the H200 machine's python3, source tree):
#   bash benchmarks/run_h200.sh            # JSON under $OUT (default benchmarks/results), short tables on stdout
# Order: kernel correctness + variant timing first (cheapest, most informative), then the attention
# table with same-run peers, then end-to-end generation and the allocator overhead.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
# 1. Correctness of the restore changes not yet run on a GPU (SWAR block starts, slot selects under
# one branch, K's absent slots unzeroed: commits 42c66b2, 9ecd08d, 2782ef6), then the ring depth on this card in the
# same run (H100 2026-12-05: 3 stages beat 2 for format 1; the H200's only 3-stage run, 67.1 us at
# 32 x 2048, was slower than its 2-stage figure of 2026-12-04, 56.8 us). Stop on any FAIL.
timeout -s KILL 420 python3 -m benchmarks.fused_kernel_check --quick --sweep '[{"stages":2},{"stages":3},{"stages":2,"timing_probe":"compute"},{"stages":3,"timing_probe":"compute"}]' --out "$out/fused_kernel_stages_h200.json" 2>&1 | grep --line-buffered -E "PASS|FAIL|cudnn|zipfusion" | tee /tmp/stages_check.txt
if grep -q FAIL /tmp/stages_check.txt; then echo "kernel check failed: stopping"; exit 1; fi
# 1b. Registers and SMEM per variant from ptxas (does the 3-stage ring, or register growth, cost the
# second CTA per SM?). Compile only.
timeout -s KILL 200 python3 -m benchmarks.kernel_resources --out "$out/kernel_resources_h200.json" 2>&1 | grep --line-buffered -E "registers|Error"
# 2. Why the single-pass compressor hangs: a bounded look-back on a small input (returns even when stuck);
# the scalar look-back (the previous design's read, which ran) first, as the A/B.
timeout -s KILL 150 python3 -m benchmarks.compress --diagnose --gib 0.02 --variants single_pass_tile4_w4_scalar,single_pass_tile4_w4,single_pass_tile1_w4 --out "$out/compress_diagnose_h200.json" 2>&1 | grep --line-buffered -vE "Warning|^\s*$"
# Format version 2 next to version 1, split into producer (copies) and consumer (compute) time;
# stop on any FAIL.
python3 -m benchmarks.fused_kernel_check --quick --sweep '[{"stages":3}, {"stages":3,"timing_probe":"copies"}, {"stages":3,"timing_probe":"compute"}]' --out "$out/fused_kernel_v2_h200.json" 2>&1 | grep -E "PASS|FAIL|cudnn|zipfusion" | tee /tmp/v2_check.txt
if grep -q FAIL /tmp/v2_check.txt; then echo "kernel check failed: stopping"; exit 1; fi
python3 -m benchmarks.fused_kernel_check --out "$out/fused_kernel_h200.json" 2>&1 | grep -E "PASS|FAIL|cudnn|zipfusion"
# The compression kernels (issue 3): the vectorized single pass against two-pass and a copy, same run.
# (Only once --diagnose shows the single pass completes; a hung kernel ignores SIGINT / SIGTERM.)
timeout -s KILL 400 python3 -m benchmarks.compress --out "$out/compress_h200.json" 2>&1 | tail -12
python3 -m benchmarks.attention --out "$out/attention_h200.json" 2>&1 | grep -vE "^\s*$|Warning"
python3 -m benchmarks.generate --batch 32 --context 8192 --out "$out/generate_h200.json" 2>&1 | tail -8
python3 -m benchmarks.capacity --overhead --out "$out/allocator_overhead_h200.json" 2>&1 | tail -5
python3 -m benchmarks.tp --tp 1 --out "$out/tp_h200.json" 2>&1 | tail -6
# End-to-end under one KV budget (long: run on its own call, one model per call if needed).
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m benchmarks.e2e --models llama3.1-8b,qwen3-8b --contexts 8192 --steps 256 --decomposition --out "$out/e2e_h200.json" 2>&1 | grep "tok/s"
# Format version 2's store next to version 1's and BF16 pages (one model per call).
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m benchmarks.e2e --models llama3.1-8b --contexts 8192 --systems zipfusion,zipfusion_v2,uncompressed --steps 256 --out "$out/e2e_v2_h200.json" 2>&1 | grep "tok/s"
# FlashInfer next to the fused kernel and cuDNN (carry the two wheels: docs in benchmarks/flashinfer_peer.py).
# python3 -m benchmarks.flashinfer_peer --out "$out/attention_flashinfer_h200.json"
# The same at the embedded model's real-KV eligibility (outlier channels planted in the random weights).
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m benchmarks.e2e --models llama3.1-8b --contexts 8192 --steps 256 --kv-stats real --out "$out/e2e_h200_real_kv.json" 2>&1 | grep "tok/s"
# What the decode step's non-attention time is made of (per-kernel CUPTI, grouped), zipfusion vs uncompressed.
python3 -m benchmarks.step_profile --batch 32 --context 2048 --out "$out/step_profile_h200.json" 2>&1 | grep -vE "Warning|^\s*$" | tail -34
# Where the step's non-kernel time goes: a profiler trace of one step (device gaps, host events).
python3 -m benchmarks.step_timeline --batch 32 --context 2048 --out "$out/step_timeline_h200.json" 2>&1 | grep -vE "Warning|^W|^I0"
python3 -m benchmarks.step_timeline --narrow --batch 32 --context 2048 --out "$out/step_timeline_narrow_h200.json" 2>&1 | grep -vE "Warning|^W|^I0"
python3 -m benchmarks.step_flags --batch 32 --context 2048 --out "$out/step_flags_h200.json"

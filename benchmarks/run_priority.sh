#!/usr/bin/env bash
# The first device call of a session, most important check first (thirteenth session, 2026-12-07).
# run_h200.sh is the whole list; this is its head, ordered by what each card can settle:
#   H200: issue 3's compressor figure (~100 s), the work-table kernel's correctness (both
#         schedules, ~200 s), then the attention table at the two target shapes (~150 s).
#   H100: the work-table kernel's correctness, then ragged batches under both schedules.
# `bash benchmarks/run_priority.sh 2` is the second call on a warm machine (carry [".carry"] for
# FlashInfer): FlashInfer at the two target shapes, then where format 2's time goes (issue 10).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "device: $gpu"
tag=h100; [[ "$gpu" == *H200* ]] && tag=h200
correctness() {
  timeout -s KILL 240 python3 -m benchmarks.fused_kernel_check --quick --skip-timing \
    --sweep '[{"schedule":"balanced"}]' --out "$out/fused_kernel_schedule_check_$tag.json" 2>&1 \
    | grep -E "PASS|FAIL|Error" | cut -c1-300
}
if [[ "${1:-1}" == 2 ]]; then
  OUT="$out" timeout -s KILL 200 bash benchmarks/run_flashinfer.sh --shapes 32x2048,8x8192 \
    --out "$out/attention_flashinfer_$tag.json" 2>&1 | grep -vE "INFO|warn"
  timeout -s KILL 150 python3 -m benchmarks.fused_kernel_check --quick --skip-correctness --sweep \
    '[{"stages":2,"v_after_qk":true,"max_registers":128,"timing_probe":"copies"},{"stages":2,"v_after_qk":true,"max_registers":128,"timing_probe":"compute"},{"stages":2,"v_after_qk":true,"timing_probe":"compute"},{"stages":2,"v_after_qk":true,"timing_probe":"copies"}]' \
    --out "$out/fused_kernel_probes_$tag.json" 2>&1 | grep -E "cudnn|zipfusion"
  exit 0
fi
if [[ $tag == h200 ]]; then
  timeout -s KILL 110 python3 -m benchmarks.compress --variants tma_t4_s4_c264_nozero,tma_t4_s4_c264,tma_ordered_t8_s2_c132 \
    --out "$out/compress_h200_tma.json" 2>&1 | grep -vE "Warning|^\s*$|compiling|compiled"
  correctness
  timeout -s KILL 150 python3 -m benchmarks.attention --shapes 32x2048,8x8192 \
    --out "$out/attention_h200_target_shapes.json" 2>&1 | grep -vE "^\s*$|Warning"
else
  correctness
  timeout -s KILL 230 python3 -m benchmarks.ragged --out "$out/ragged_$tag.json" 2>&1 | grep -vE "Warning|^\s*$"
fi

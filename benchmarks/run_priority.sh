#!/usr/bin/env bash
# A session's device calls, most important check first (seventeenth session, 2026-12-08).
# run_h200.sh is the whole list; this runs named steps of it, in the order given:
#   bash benchmarks/run_priority.sh [STEP ...]     # JSON under $OUT (default benchmarks/results)
# Steps: compress (issue 3's figure; H200 only, skipped elsewhere), fold (format 2's exceptions
# folded by the producer once per step, `DecodeConfig(exception_fold="producer")`, never yet run on
# a GPU: its 14 correctness cases, then both folds timed in full and as the consumer alone), correctness (the work-table
# kernel, both schedules, 14 cases), ragged (both schedules over four length mixes), attention
# (the table at the two target shapes), flashinfer (carry [".carry"]), probes (format 2's copies /
# compute split), serving (the engine on a ragged batch, grid against balanced schedule), items
# (the balanced schedule with one wave of spare items per KV head, not two: fewer unused CTAs at
# equal lengths, where it is 2.5-5.4% behind the grid on the H100). No step: compress attention
# flashinfer on an H200 with fold after compress (issues 3, 4 and 10 wait on those figures; pass
# carry [".carry"]), fold attention on an H100. If the producer's fold passes and is faster, make
# it format 2's default (`heuristic_config`). `ragged` and `serving` (12-bit store unless KV=compressed,uncompressed) ran on the
# H100 in the sixteenth session (benchmarks/RESULTS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "device: $gpu ($(date -u +%FT%TZ))"
tag=h100; [[ "$gpu" == *H200* ]] && tag=h200
steps=("$@")
if [[ ${#steps[@]} == 0 ]]; then
  if [[ $tag == h200 ]]; then steps=(compress fold attention flashinfer); else steps=(fold attention); fi
fi
for step in "${steps[@]}"; do
  case $step in
    compress)
      [[ $tag == h200 ]] || { echo "compress: not an H200, skipped"; continue; }
      timeout -s KILL 110 python3 -m benchmarks.compress --variants tma_t4_s4_c264_nozero,tma_t4_s4_c264,tma_ordered_t8_s2_c132 \
        --out "$out/compress_h200_tma.json" 2>&1 | grep -vE "Warning|^\s*$|compiling|compiled" ;;
    fold)  # format 2's exception fold, consumer (default) against producer: correctness, then time
      timeout -s KILL 260 python3 -m benchmarks.fused_kernel_check --quick --skip-timing \
        --sweep '[{"stages":2,"v_after_qk":true,"max_registers":128,"exception_fold":"producer"},{"exception_fold":"producer"},{"consumers":2,"stages":4,"exception_fold":"producer"}]' \
        --out "$out/fused_kernel_fold_check_$tag.json" 2>&1 | grep -E "PASS|FAIL|Error" | cut -c1-300
      timeout -s KILL 150 python3 -m benchmarks.fused_kernel_check --quick --skip-correctness --sweep \
        '[{"stages":2,"v_after_qk":true,"max_registers":128},{"stages":2,"v_after_qk":true,"max_registers":128,"exception_fold":"producer"},{"stages":2,"v_after_qk":true,"max_registers":128,"timing_probe":"compute"},{"stages":2,"v_after_qk":true,"max_registers":128,"timing_probe":"compute","exception_fold":"producer"}]' \
        --out "$out/fused_kernel_fold_$tag.json" 2>&1 | grep -E "cudnn|zipfusion" ;;
    correctness)
      timeout -s KILL 240 python3 -m benchmarks.fused_kernel_check --quick --skip-timing \
        --sweep '[{"schedule":"balanced"}]' --out "$out/fused_kernel_schedule_check_$tag.json" 2>&1 \
        | grep -E "PASS|FAIL|Error" | cut -c1-300 ;;
    serving)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -s KILL 330 python3 -m benchmarks.generate --models llama3.1-8b \
        --batch 32 --context 8192 --lengths uniform --schedules grid,balanced --kv "${KV:-compressed}" \
        --decode-steps 32 \
        --out "$out/generate_ragged_$tag.json" 2>&1 | grep -E "tok/s|Error" | cut -c1-300 ;;
    items)
      timeout -s KILL 260 python3 -m benchmarks.ragged --items 33 --out "$out/ragged_items33_$tag.json" 2>&1 \
        | grep -vE "Warning|^\s*$" | cut -c1-250 ;;
    ragged)
      timeout -s KILL 300 python3 -m benchmarks.ragged --check-plans --out "$out/ragged_$tag.json" 2>&1 | grep -vE "Warning|^\s*$" | cut -c1-250 ;;
    attention)
      timeout -s KILL 200 python3 -m benchmarks.attention --shapes 32x2048,8x8192 \
        --out "$out/attention_${tag}_target_shapes.json" 2>&1 | grep -vE "^\s*$|Warning" | cut -c1-250 ;;
    flashinfer)
      OUT="$out" timeout -s KILL 200 bash benchmarks/run_flashinfer.sh --shapes 32x2048,8x8192 \
        --out "$out/attention_flashinfer_$tag.json" 2>&1 | grep -vE "INFO|warn" ;;
    probes)
      timeout -s KILL 150 python3 -m benchmarks.fused_kernel_check --quick --skip-correctness --sweep \
        '[{"stages":2,"v_after_qk":true,"max_registers":128,"timing_probe":"copies"},{"stages":2,"v_after_qk":true,"max_registers":128,"timing_probe":"compute"},{"stages":2,"v_after_qk":true,"timing_probe":"compute"},{"stages":2,"v_after_qk":true,"timing_probe":"copies"}]' \
        --out "$out/fused_kernel_probes_$tag.json" 2>&1 | grep -E "cudnn|zipfusion" ;;
    *) echo "unknown step $step" ;;
  esac
done

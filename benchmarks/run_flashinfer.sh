#!/usr/bin/env bash
# FlashInfer's paged decode next to ours and cuDNN, on the GPU machine, in its own device call:
#   (here)  mkdir -p .carry /tmp/wheels /tmp/fi_site && pip download --no-deps --only-binary=:all: \
#             --python-version 3.12 -d /tmp/wheels flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
#           for w in /tmp/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/fi_site; done
#           tar cJf .carry/flashinfer_site.tar.xz -C /tmp/fi_site .
#   (device, carry [".carry"])  bash benchmarks/run_flashinfer.sh [--shapes 32x2048,8x8192]
# The two wheels are 62.3 MiB: with the tree they pass the 64 MiB carry, so they travel as one
# xz archive of their unpacked files (19 MB; wheels in .carry/ are installed as they are).
# FlashInfer JIT-compiles its kernels with the machine's nvcc on first use (~15 s).
set -uo pipefail
cd "$(dirname "$0")/.."
site=/tmp/flashinfer_site
mkdir -p "$site"
if [ -f .carry/flashinfer_site.tar.xz ]; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .carry/flashinfer_site.tar.xz "$site"
else
  for w in .carry/*.whl; do python3 -m zipfile -e "$w" "$site"; done  # a wheel is a zip of site-packages
fi
nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
export CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}" MAX_JOBS=16
export PYTHONPATH=".:$site" PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}"
timeout -s KILL 400 python3 -m benchmarks.flashinfer_peer --out "$out/attention_flashinfer_h200.json" "$@" 2>&1 \
  | grep -vE "^\s*$|Warning"

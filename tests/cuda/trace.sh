#!/bin/bash
# Latency trace of the CUDA decode launches (one device call): builds fmkv_cuda_bench with
# -DFMKV_CUDA_TRACE=ON (default grid) in /tmp/bt and prints, per case, the per-CTA phase statistics
# of the last attention call and of the last fused decode step (JSON lines, kind "trace"; phases in
# src/cuda/decode_attention.cuh and fused_step.cuh, FMKV_TRACE). Run from the repository root:
#   tests/cuda/trace.sh ["B ctx kb vb [W]" ...]  (default: "1 4096 3 3" "1 131072 3 3"; W: fp16 window, B = 1)
set -u
cmake -S . -B /tmp/bt -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_TRACE=ON -DFMKV_BUILD_TESTS=OFF -DFMKV_BUILD_CLI=OFF \
  -DCMAKE_BUILD_TYPE=Release > /tmp/bt.log 2>&1 && ninja -C /tmp/bt fmkv_cuda_bench >> /tmp/bt.log 2>&1 \
  || { echo "trace build failed"; tail -20 /tmp/bt.log; exit 1; }
[ $# -eq 0 ] && set -- "1 4096 3 3" "1 131072 3 3"
for c in "$@"; do
  # shellcheck disable=SC2086
  timeout 120 /tmp/bt/fmkv_cuda_bench --trace $c | grep -E '"kind":"(trace|decode|step)"'
done

#!/bin/bash
# Profile one decode case with Nsight Compute (stall reasons, source-level hot spots, scheduler and
# memory statistics): tests/cuda/profile_decode.sh [B ctx kb vb]   (default: 1 131072 3 3)
# Writes $OUT/ncu_decode.txt (the full report as text).
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
CASE=${*:-1 131072 3 3}
cmake -S . -B /tmp/bp -G Ninja -DFMKV_CUDA=ON -DFMKV_BUILD_CLI=OFF -DFMKV_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS=-lineinfo > /tmp/bp.log 2>&1
ninja -C /tmp/bp -j16 fmkv_cuda_bench >> /tmp/bp.log 2>&1 || { echo "build failed"; tail -20 /tmp/bp.log; exit 1; }
timeout 300 ncu --clock-control none --kernel-name regex:attn_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters --print-details all \
  /tmp/bp/fmkv_cuda_bench --only $CASE > $OUT/ncu_decode.txt 2>&1
echo "ncu rc=$?"

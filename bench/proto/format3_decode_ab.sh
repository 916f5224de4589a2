#!/bin/bash
# One device call (~6 minutes on an H200 machine): the format-3 candidate in the real CUDA decode loop
# (bench/proto/format3_decode_loop.patch: every k3v3 kernel reads the code regions as format-3 tile blocks)
# against format 2, same run.
#
#   OUT=$OUT bash bench/proto/format3_decode_ab.sh BASE.tar      (BASE.tar: `git archive` of a commit, carried)
#
# 1. tests/cuda/ab.sh builds three fmkv_cuda_bench variants side by side -- base (BASE.tar), tree (the working
#    tree, format 2) and f3 (the tree with the patch) -- and runs the cases below in rounds. The f3 variant times
#    its loop over pages the format-2 append wrote (same bytes per token, valid scale rows; the code bytes read
#    as format-3 blocks are random codes), so its outputs are meaningless there and its speed is the loop's.
# 2. bench/proto/format3_decode_check.cpp linked to the f3 build: pages written in the format-3 layout on the
#    host, fmkv_attention on CUDA, each output against a float64 attention over the same values.
# 3. ncu counters (instructions, issue, pipes, DRAM) of the tree's and f3's decode kernel at 128k, k3v3.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${1:?usage: format3_decode_ab.sh BASE.tar}
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
cases=$OUT/f3.cases
cat > "$cases" <<'EOF'
--only 1 4096 3 3
--only 1 32768 3 3
--only 1 131072 3 3
--only 1 1048576 3 3
--only 64 32768 3 3
--only 8 4096 3 3
FMKV_BENCH_KV_HEADS=1 --only 1 131072 3 3
--only 1 131072 4 4
--only 1 1048576 4 4
--window 64 4096 32768
EOF
OUT=$OUT bash tests/cuda/ab.sh -r 4 -t 330 -c "$cases" base="$BASE" tree=. f3=bench/proto/format3_decode_loop.patch 2>&1 | tail -n 40
echo "ab done at $((SECONDS - T0)) s"

CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
python3 tests/cuda/tile_loop_check.py --cuobjdump "$CUOBJDUMP" /tmp/ab_f3/CMakeFiles/fmkv.dir/src/cuda/decode_k3.cu.o \
  > "$OUT/f3_tile_loops.log" 2>&1; grep "d128 k3v3 page 64" "$OUT/f3_tile_loops.log"

nvcc -O2 -std=c++17 -I /tmp/ab_src_f3/include -I /tmp/ab_src_f3/src bench/proto/format3_decode_check.cpp \
  /tmp/ab_f3/libfmkv.a -o /tmp/f3check > "$OUT/f3check_build.log" 2>&1 || { echo "check build failed"; tail -5 "$OUT/f3check_build.log"; }
[ -x /tmp/f3check ] && { timeout 120 /tmp/f3check | tee "$OUT/f3check.jsonl"; echo "check rc=${PIPESTATUS[0]}"; }

NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
if [ -n "$NCU" ]; then
  for v in tree f3; do
    timeout 90 "$NCU" --clock-control none -k regex:attn_kernel -c 1 --metrics "$M" /tmp/ab_$v/fmkv_cuda_bench --only 1 131072 3 3 \
      > "$OUT/ncu_$v.txt" 2>&1; echo "ncu $v rc=$?"; grep -E "attn_kernel|gpu__time|inst_executed|issue_active|pipe_|dram__|warps_active" "$OUT/ncu_$v.txt" | head -12
  done
fi
echo "done at $((SECONDS - T0)) s"

#!/bin/bash
# Stall reasons (cycles per issued instruction, by reason), executed instructions, occupancy limits of
# the decode-attention kernel for a few cases: tests/cuda/stall_profile.sh /path/to/fmkv_cuda_bench [step]
# (one line per metric; run on the device).
BIN=$1
[ "$2" = step ] || for c in "1 131072 3 3" "1 4096 3 3" "1 131072 4 4"; do
  echo "== B ctx kb vb = $c"
  timeout 120 ncu --clock-control none --kernel-name regex:attn_kernel --launch-skip 3 --launch-count 1 \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio',smsp__inst_executed.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,launch__shared_mem_config_size,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
    $BIN --only $c 2>&1 | grep -E "^\s+(smsp|gpu|sm__|launch)" | awk '$NF != "0" && $NF != "0.00"'
done
# the fused decode step's sink/window CTA alone (a 64-token context leaves the split CTAs nothing to do)
for ctx in 64 4096; do
  echo "== fused step B=1 ctx=$ctx k3v3"
  timeout 120 ncu --clock-control none --kernel-name regex:attn_kernel --launch-skip 2 --launch-count 1 \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_elapsed.avg.per_second \
    $BIN --step-only 1 $ctx 3 3 2>&1 | grep -E "gpu__time|inst_executed|Location|0x|stall|Stall" | head -40
done

#!/bin/bash
# A few decode cases of the CUDA benchmark binary, one line each (for tuning runs; the full table is
# bench/cuda_bench.py):  tests/cuda/decode_cases.sh /path/to/fmkv_cuda_bench [label]
BIN=$1; LABEL=${2:-}
for c in "1 4096 3 3" "1 131072 3 3" "1 1048576 3 3" "64 32768 3 3" "1 131072 4 4" "64 32768 4 4" "1 131072 4 2"; do
  echo "$LABEL B ctx kb vb = $c: $($BIN --only $c | grep '"kind":"decode"' | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("%.2f us %.0f GB/s %.1f%% nonfinite=%s" % (r["time_us"], r["gbps"], r["pct_copy_bw"], r["nonfinite_out"]))')"
done

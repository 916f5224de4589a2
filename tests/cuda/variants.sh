#!/bin/bash
# Tuning experiment: FMKV_ATTN_MIN_BLOCKS 4 vs 5 (and 3), a few decode cases each, plus the tests on variant 5.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
GT=""; [ -f /usr/include/gtest/gtest.h ] || GT="-DCMAKE_PREFIX_PATH=/tmp/gti"
for mb in 4 5 3; do
  cmake -S . -B /tmp/b$mb -G Ninja -DFMKV_CUDA=ON -DFMKV_BUILD_CLI=OFF -DFMKV_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS=-DFMKV_ATTN_MIN_BLOCKS=$mb > $OUT/b$mb.log 2>&1
  ninja -C /tmp/b$mb fmkv_cuda_bench >> $OUT/b$mb.log 2>&1 || { echo "build $mb failed"; tail -5 $OUT/b$mb.log; continue; }
  for c in "1 131072 3 3" "64 32768 3 3" "1 131072 4 4" "1 1048576 3 3"; do
    echo "minblocks=$mb case=$c $(/tmp/b$mb/fmkv_cuda_bench --only $c | grep decode | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["time_us"], r["gbps"], r["pct_copy_bw"], r["nonfinite_out"])')"
  done
done 2>&1 | tee $OUT/variants.log

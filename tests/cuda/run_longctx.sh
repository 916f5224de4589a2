#!/bin/bash
# One device call for issue 7: 4M- and 1M-token 32-layer k3v3 decode through fmkv, then the largest
# fp16 cache that fits through torch SDPA. Uses a prebuilt fmkv_longctx when carried in .longctx/
# (built here with nvcc; static libstdc++ + cudart), else builds it in /tmp.
#   tests/cuda/run_longctx.sh COMMIT COPY_GBPS
COMMIT=${1:-unknown}; COPY=${2:-0}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
BIN=.longctx/fmkv_longctx
if ! $BIN --help >/dev/null 2>&1 && [ ! -x $BIN ]; then
  cmake -S . -B /tmp/lb -G Ninja -DFMKV_CUDA=ON -DFMKV_BUILD_TESTS=OFF > $OUT/build.log 2>&1 && ninja -C /tmp/lb fmkv_longctx >> $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
  BIN=/tmp/lb/bench/fmkv_longctx
fi
J=$OUT/cuda_longctx.jsonl
$BIN --backend cuda --context 4194304 --layers 32 --reps 5 --check-kv-heads 2 --copy-gbps $COPY --commit $COMMIT --jsonl $J 2>&1 | tee $OUT/longctx.log
$BIN --backend cuda --context 1048576 --layers 32 --reps 5 --check-kv-heads 2 --copy-gbps $COPY --commit $COMMIT --jsonl $J 2>&1 | tee -a $OUT/longctx.log
python3 bench/longctx_sdpa.py --layers 32 --copy-gbps $COPY --commit $COMMIT --jsonl $J 2>&1 | tee -a $OUT/longctx.log
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >> $OUT/longctx.log 2>&1

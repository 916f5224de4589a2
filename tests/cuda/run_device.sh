#!/bin/bash
# One device call: build (tests + bench) in /tmp, run the CUDA tests, optional memcheck, benchmark.
#   tests/cuda/run_device.sh [tests|bench|all] [commit]   (SKIP_MEMCHECK=1: no compute-sanitizer run;
#   SKIP_PDL_AB=1: no programmatic-launch on/off comparison)
# Builds the full grid of decode-attention combinations (-DFMKV_CUDA_FULL_GRID=ON) so every one is tested
# (FULL_GRID=OFF: the default grid, a faster build).
# Needs the GoogleTest sources in .gtest-src (carried) when the image has no gtest.
MODE=${1:-all}; COMMIT=${2:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
GT=""
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  cmake -S .gtest-src -B /tmp/gtb -G Ninja -DCMAKE_INSTALL_PREFIX=/tmp/gti -DBUILD_GMOCK=OFF > $OUT/gtest_build.log 2>&1 \
    && ninja -C /tmp/gtb install >> $OUT/gtest_build.log 2>&1 || { echo "gtest build failed"; tail -20 $OUT/gtest_build.log; }
  GT="-DCMAKE_PREFIX_PATH=/tmp/gti"
fi
cmake -S . -B /tmp/b -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_FULL_GRID=${FULL_GRID:-ON} -DFMKV_BUILD_CLI=OFF $GT > $OUT/build.log 2>&1
ninja -C /tmp/b -j16 fmkv_tests fmkv_cuda_tests fmkv_half_cuda_test fmkv_cuda_bench >> $OUT/build.log 2>&1 || { echo BUILD FAILED; grep -E "error|FAILED" $OUT/build.log | head -30; exit 1; }
echo "build ok"
# static check: no register spills (local memory) inside any decode tile loop
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
python3 tests/cuda/tile_loop_check.py --cuobjdump $CUOBJDUMP /tmp/b/CMakeFiles/fmkv.dir/*/cuda/decode_k*.cu.o > $OUT/tile_loops.log 2>&1
echo "tile loop check rc=$? ($(tail -n 1 $OUT/tile_loops.log))"
if [ "$MODE" != bench ]; then
  timeout 240 /tmp/b/tests/fmkv_tests --gtest_filter='*cuda*:Golden*:Errors*' > $OUT/cuda_tests.log 2>&1
  echo "tests rc=$?"
  timeout 120 /tmp/b/fmkv_cuda_tests >> $OUT/cuda_tests.log 2>&1
  echo "cuda error tests rc=$?"
  timeout 60 /tmp/b/fmkv_half_cuda_test >> $OUT/cuda_tests.log 2>&1
  echo "device fp16 conversions rc=$? ($(tail -n 1 $OUT/cuda_tests.log))"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|rel|differ|Expected|Which is|error" $OUT/cuda_tests.log | head -60
  if [ "$MODE" = all ] && [ -z "$SKIP_MEMCHECK" ] && command -v compute-sanitizer >/dev/null; then
    timeout 150 compute-sanitizer --tool memcheck /tmp/b/tests/fmkv_tests --gtest_filter='Golden*:*FusedAppendAttention*/cuda:*AppendBitExact/cuda' > $OUT/memcheck.log 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" $OUT/memcheck.log | head -5
    timeout 100 compute-sanitizer --tool memcheck /tmp/b/fmkv_cuda_tests > $OUT/memcheck_errors.log 2>&1
    echo "memcheck (device-detected errors) rc=$?"; grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" $OUT/memcheck_errors.log | head -5
    timeout 150 compute-sanitizer --tool racecheck /tmp/b/tests/fmkv_tests --gtest_filter='*FusedAppendAttention/cuda:Golden*' > $OUT/racecheck.log 2>&1
    echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|PASSED|FAILED" $OUT/racecheck.log | head -5
  fi
fi
if [ "$MODE" != tests ] && [ -z "$SKIP_PDL_AB" ]; then
  # programmatic dependent launch on / off (FMKV_CUDA_PDL=0), same binary, same run
  for c in "1 4096 3 3" "1 131072 3 3" "64 32768 3 3"; do
    for pdl in 1 0; do
      echo "pdl=$pdl B ctx kb vb = $c: $(FMKV_CUDA_PDL=$pdl /tmp/b/fmkv_cuda_bench --only $c | grep '"kind":"decode"' | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("%.2f us" % r["time_us"])')"
    done
  done | tee $OUT/pdl_ab.log
fi
if [ "$MODE" = all ] && command -v ncu >/dev/null; then
  # per-kernel durations of one 4k decode call (attention + merge), serialised by ncu
  timeout 60 ncu --clock-control none --launch-skip 6 --launch-count 4 --section SpeedOfLight \
    /tmp/b/fmkv_cuda_bench --only 1 4096 3 3 > $OUT/ncu_4k.log 2>&1
  echo "ncu 4k rc=$?"; grep -E "attn_kernel|merge_kernel|Duration" $OUT/ncu_4k.log | head -12
  timeout 120 ncu --clock-control none --kernel-name regex:attn_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    /tmp/b/fmkv_cuda_bench --only 1 131072 3 3 > $OUT/ncu.log 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Throughput|Warp Cycles|Stall|Achieved Occupancy|Registers|Issued|Eligible|No Eligible|One or More" $OUT/ncu.log | head -40
fi
if [ "$MODE" != tests ]; then
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/cuda_bench.py --bin /tmp/b/fmkv_cuda_bench --out $OUT --commit "$COMMIT" > $OUT/bench.log 2>&1
  echo "bench rc=$?"; cat $OUT/bench.log | tail -40
fi

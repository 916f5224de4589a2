#!/bin/bash
# final device check of the balanced plan: build (tree only), the plan and backend tests on CUDA, and the
# plan's cost on uniform small batches (the tree against itself with FMKV_CUDA_BALANCE=0)
cmake -S . -B /tmp/b -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_FULL_GRID=OFF -DFMKV_BUILD_CLI=OFF > $OUT/build.log 2>&1 &&
  ninja -C /tmp/b -j16 fmkv_tests fmkv_balanced_plan_cuda_test fmkv_cuda_bench >> $OUT/build.log 2>&1 ||
  { echo BUILD FAILED; grep -E "error" $OUT/build.log | head; exit 1; }
echo "build done at $SECONDS s"
/tmp/b/fmkv_balanced_plan_cuda_test > $OUT/plan.txt 2>&1; echo "plan test rc=$? ($(tail -n 1 $OUT/plan.txt))"
timeout 120 /tmp/b/tests/fmkv_tests --gtest_filter='*Backends*cuda*:Golden*' > $OUT/tests.txt 2>&1; echo "backend tests rc=$?"
grep -E "^\[  (PASSED|FAILED) " $OUT/tests.txt | head
echo "tests done at $SECONDS s"
mkdir -p /tmp/ab_tree && ln -sf /tmp/b/fmkv_cuda_bench /tmp/ab_tree/
printf -- "--only 2 4096 3 3\n--only 8 4096 3 3\n--only 16 4096 3 3\n--only 64 8192 3 3\n--only 2 32768 3 3\n--ragged 3 3 1k-16kx64\n--ragged 3 3 64k,1kx15\n" > $OUT/final.cases
AB_REUSE=1 OUT=$OUT bash tests/cuda/ab.sh -r 3 -t 50 -c $OUT/final.cases tree=. env=@tree:FMKV_CUDA_BALANCE=0 2>&1 | tail -n 10
echo "done at $SECONDS s"

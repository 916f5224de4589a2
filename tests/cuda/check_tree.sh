#!/bin/bash
# One device call (~9 minutes on an H200 machine): the working tree's CUDA tests and a same-run A/B of its
# decode, decode-step and quantize-append benchmarks against another commit.
#
#   OUT=$OUT [AB_CASES=CASEFILE] [AB_EXTRA=CASEFILE [AB_EXTRA_ENV=VAR=value]] bash tests/cuda/check_tree.sh BASE.tar [ROUNDS]
#   (BASE.tar: `git archive <commit>`, carried; AB_CASES: the A/B's cases instead of the default set (decode + quantize);
#   AB_EXTRA: cases only the tree runs, alone or against the tree with the environment AB_EXTRA_ENV; TESTS_FILTER:
#   the harness's gtest filter instead of the CUDA, golden, error and reliability suites)
#
# 1. Builds, in parallel: the tree's tests and benchmark (default grid of decode kernels, -DFMKV_CUDA=ON, in
#    /tmp/b) and the base's benchmark (tests/cuda/ab.sh's build of BASE.tar, in /tmp/ab_base).
# 2. The tree's static tile-loop check (tile_loop_check.py) and CUDA tests: the cross-backend harness and
#    golden vectors on CUDA, the device-error tests, the device fp16 conversions for every input, the
#    Metal kernel core run as CUDA (bit-exact vs the reference).
# 3. tests/cuda/ab.sh with the base first: the default decode cases plus quantize-append of a 32k-token
#    chunk, ROUNDS rounds (default 2), within what is left of 540 s; the table printed last.
# Needs the GoogleTest sources in .gtest-src (carried) when the image has none.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${1:?usage: check_tree.sh BASE.tar [ROUNDS]}; ROUNDS=${2:-2}
T0=$SECONDS; el() { echo "$((SECONDS - T0)) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
GT=""
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  cmake -S .gtest-src -B /tmp/gtb -G Ninja -DCMAKE_INSTALL_PREFIX=/tmp/gti -DBUILD_GMOCK=OFF > "$OUT/gtest_build.log" 2>&1 &&
    ninja -C /tmp/gtb install >> "$OUT/gtest_build.log" 2>&1 || echo "gtest build failed"
  GT="-DCMAKE_PREFIX_PATH=/tmp/gti"
fi
base_src=/tmp/ab_src_base; rm -rf "$base_src"; mkdir -p "$base_src"; tar -xf "$BASE" -C "$base_src"
( cmake -S . -B /tmp/b -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_FULL_GRID=OFF -DFMKV_BUILD_CLI=OFF $GT > "$OUT/build.log" 2>&1 &&
    ninja -C /tmp/b -j10 fmkv_tests fmkv_cuda_tests fmkv_half_cuda_test fmkv_balanced_plan_cuda_test fmkv_metal_core_cuda_test fmkv_cuda_bench >> "$OUT/build.log" 2>&1
  echo "tree: build rc=$? at $(el)" ) &
( cmake -S "$base_src" -B /tmp/ab_base -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_FULL_GRID=OFF -DFMKV_BUILD_CLI=OFF \
    -DFMKV_BUILD_TESTS=OFF > "$OUT/build_base.log" 2>&1 && ninja -C /tmp/ab_base -j6 fmkv_cuda_bench >> "$OUT/build_base.log" 2>&1
  echo "base: build rc=$? at $(el)" ) &
wait
[ -x /tmp/b/fmkv_cuda_bench ] || { echo "BUILD FAILED"; grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }

CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
python3 tests/cuda/tile_loop_check.py --cuobjdump "$CUOBJDUMP" /tmp/b/CMakeFiles/fmkv.dir/*/cuda/decode_k*.cu.o > "$OUT/tile_loops.log" 2>&1
echo "tile loop check rc=$? ($(tail -n 1 "$OUT/tile_loops.log"))"
L=$OUT/cuda_tests.log
timeout 240 /tmp/b/tests/fmkv_tests --gtest_filter="${TESTS_FILTER:-*cuda*:Golden*:Errors*:Reliability*}" > "$L" 2>&1; echo "tests rc=$?"
timeout 120 /tmp/b/fmkv_cuda_tests >> "$L" 2>&1; echo "cuda error tests rc=$?"
timeout 60 /tmp/b/fmkv_half_cuda_test >> "$L" 2>&1; echo "device fp16 conversions rc=$?"
timeout 60 /tmp/b/fmkv_balanced_plan_cuda_test >> "$L" 2>&1; echo "balanced split plan on the device rc=$?"
timeout 90 /tmp/b/fmkv_metal_core_cuda_test >> "$L" 2>&1; echo "metal kernel core as CUDA rc=$?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|mismatches|PASSED|FAILED" "$L" | head -30
echo "tests done at $(el)"

# A/B: the tree's bench binary is reused (AB_REUSE), the base's was built above.
mkdir -p /tmp/ab_tree && ln -sf /tmp/b/fmkv_cuda_bench /tmp/ab_tree/fmkv_cuda_bench
cases=$OUT/ab.cases
if [ -n "${AB_CASES:-}" ]; then cp "$AB_CASES" "$cases"  # AB_CASES: a case file instead of the default set
else { bash tests/cuda/ab.sh -p; echo "--quant-only 3 3"; echo "--quant-only 4 4"; } > "$cases"; fi
budget=540; [ -z "${AB_EXTRA:-}" ] || budget=440  # (AB_EXTRA: 100 s kept for it)
left=$((budget - (SECONDS - T0))); [ $left -gt 60 ] || left=60
AB_REUSE=1 AB_DIR=/tmp OUT=$OUT bash tests/cuda/ab.sh -r "$ROUNDS" -t "$left" -c "$cases" base="$BASE" tree=. 2>&1 | tail -n 40
# AB_EXTRA: cases the tree's binary alone may run (e.g. --ragged), the tree alone or against itself with the
# environment AB_EXTRA_ENV (VAR=value[,VAR=value...]), into $OUT/ab_extra/
if [ -n "${AB_EXTRA:-}" ]; then
  left=$((560 - (SECONDS - T0))); [ $left -gt 30 ] || left=30
  mkdir -p "$OUT/ab_extra"
  AB_REUSE=1 AB_DIR=/tmp OUT=$OUT/ab_extra bash tests/cuda/ab.sh -r "$ROUNDS" -t "$left" -c "$AB_EXTRA" tree=. \
    ${AB_EXTRA_ENV:+env=@tree:$AB_EXTRA_ENV} 2>&1 | tail -n 20
fi
echo "done at $(el)"

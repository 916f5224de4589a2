#!/usr/bin/env bash
# One device call on an H200 machine (python3 with torch 2.11+cu130, transformers, nanobind,
# scikit-build-core, cmake, ninja, nvcc, pytest; no internet): build the CUDA extension, run the
# static-cache tests on CUDA, then the end-to-end decode benchmark -- all under ~9 minutes.
#
#   bash tests/python/run_device_e2e.sh [build] [tests] [bench]        # default: all three
#
# Run from the repository root (or anywhere: it cds there). Outputs (flat) in $OUT (default /tmp/fmkv-out):
#   e2e_build.log  e2e_env.log  e2e_tests.log  e2e_bench.log  e2e_decode.jsonl  e2e_decode.png  e2e_summary.txt
# * build: `pip install . --no-build-isolation --no-deps -C cmake.define.FMKV_CUDA=ON` into /tmp (the
#   default grid of decode kernels: FULL_GRID=ON for all), else plain CMake; the package is
#   /tmp/fmkv-e2e-pkg (PYTHONPATH) with the current python/fmkv sources. A build of the same C++/CUDA
#   sources on the same machine (a warm machine) is reused.
# * tests: tests/python/test_hf_static.py -- on CUDA: one eager decode step captured in a
#   torch.cuda.CUDAGraph replays to the eager tokens and bytes under torch.cuda.set_sync_debug_mode
#   ("error"); torch.compile(mode="reduce-overhead", fullgraph=True) captures the step without a
#   cudagraph skip and gives the eager tokens; transformers' compiled generate() gives the eager tokens;
#   plus the CPU tests of the file (FmkvCache equality, padded batches, no host sync, bytes, errors).
# * bench: bench/e2e_decode.py with --time-budget = what is left of BUDGET_S (default 540 s) after the
#   first two steps; BENCH_ARGS adds arguments (e.g. "--quick", "--no-compile").
# Every step prints its exit status and the script goes on after a failed step; the last line is the summary.
set -u
cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
OUT=${OUT:-/tmp/fmkv-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # absolute: the tests run from /tmp
PKG=/tmp/fmkv-e2e-pkg
FULL_GRID=${FULL_GRID:-OFF}
CUDA_BUILD=${FMKV_CUDA_BUILD:-ON}  # OFF only to try this script on a machine without nvcc (BENCH_ARGS="--device cpu --tiny")
BUDGET_S=${BUDGET_S:-540}
BENCH_ARGS=${BENCH_ARGS:-}
COMMIT=${FMKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build tests bench)
SUMMARY=()
T0=$SECONDS

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 t=$2
  shift 2
  echo "=== step $name: $* (timeout ${t}s, at $((SECONDS - T0))s) ==="
  local t1=$SECONDS
  if declare -F "$1" >/dev/null; then timeout "$t" bash -c '"$@"' _ "$@"; else timeout "$t" "$@"; fi
  local rc=$?
  echo "=== step $name: rc=$rc ($((SECONDS - t1))s) ==="
  SUMMARY+=("$name rc=$rc $((SECONDS - t1))s")
  return $rc
}

src_hash() {  # what the extension is built from (C++/CUDA sources, CMake, the binding) + the grid option
  { find include src python/src cmake CMakeLists.txt python/CMakeLists.txt pyproject.toml -type f -print0 2>/dev/null \
      | sort -z | xargs -0 md5sum; echo "FULL_GRID=$FULL_GRID CUDA=$CUDA_BUILD"; } | md5sum | cut -d' ' -f1
}

do_build() {
  local h
  h=$(src_hash)
  if [ -f "$PKG/.srchash" ] && [ "$(cat "$PKG/.srchash")" = "$h" ] && ls "$PKG"/fmkv/_fmkv*.so >/dev/null 2>&1; then
    echo "reusing $PKG (same sources, $h)"
    return 0
  fi
  echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  local so=""
  if "$PY" -c "import scikit_build_core" 2>/dev/null; then
    rm -rf /tmp/fmkv-e2e-site /tmp/fmkv-e2e-skbuild
    "$PY" -m pip install --no-build-isolation --no-deps --no-index --target /tmp/fmkv-e2e-site \
      -C cmake.define.FMKV_CUDA=$CUDA_BUILD -C cmake.define.FMKV_CUDA_FULL_GRID=$FULL_GRID -C build-dir=/tmp/fmkv-e2e-skbuild \
      -C cmake.build-type=Release . && so=$(ls /tmp/fmkv-e2e-site/fmkv/_fmkv*.so 2>/dev/null | head -1)
  fi
  if [ -z "$so" ]; then
    echo "--- pip build unavailable or failed: plain CMake"
    cmake -S "$REPO" -B /tmp/fmkv-e2e-cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DFMKV_PYTHON=ON -DFMKV_CUDA=$CUDA_BUILD \
      -DFMKV_CUDA_FULL_GRID=$FULL_GRID -DFMKV_BUILD_TESTS=OFF -DFMKV_BUILD_CLI=OFF -DFMKV_CUDA_BENCH=OFF \
      -DPython_EXECUTABLE="$(command -v "$PY")" || return 1
    ninja -C /tmp/fmkv-e2e-cmake -j"$CMAKE_BUILD_PARALLEL_LEVEL" _fmkv || return 1
    so=$(ls /tmp/fmkv-e2e-cmake/python/_fmkv*.so | head -1)
  fi
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$REPO/python/fmkv" "$PKG/" && cp "$so" "$PKG/fmkv/" && echo "$h" > "$PKG/.srchash"
}

sync_sources() {  # the current Python sources next to the built extension
  ls "$PKG"/fmkv/_fmkv*.so >/dev/null 2>&1 || return 1
  find "$PKG/fmkv" -name '*.py' -delete
  rm -rf "$PKG/fmkv/eval" "$PKG/fmkv/hf"
  cp -r "$REPO/python/fmkv/"*.py "$REPO/python/fmkv/eval" "$REPO/python/fmkv/hf" "$PKG/fmkv/"
}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 | head -3
  nvcc --version 2>&1 | tail -1
  PYTHONPATH=$PKG "$PY" - <<'EOF'
import torch, transformers, fmkv
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
print("transformers", transformers.__version__, "fmkv", fmkv.__version__, fmkv.__file__)
print("fmkv.backends()", fmkv.backends())
assert fmkv.backends()["cuda"]["available"], "the built extension has no usable cuda backend"
EOF
}

export REPO OUT PY PKG FULL_GRID CUDA_BUILD
export -f do_build src_hash env_report

for s in "${STEPS[@]}"; do
  case $s in
    build)
      step build 330 do_build > "$OUT/e2e_build.log" 2>&1
      tail -3 "$OUT/e2e_build.log"
      sync_sources && step env 60 env_report > "$OUT/e2e_env.log" 2>&1
      cat "$OUT/e2e_env.log" ;;
    tests)
      if ! sync_sources; then SUMMARY+=("tests skipped: no built package in $PKG"); continue; fi
      (cd /tmp && step tests 240 env PYTHONPATH=$PKG "$PY" -m pytest -q -rs -p no:cacheprovider \
        "$REPO/tests/python/test_hf_static.py") > "$OUT/e2e_tests.log" 2>&1
      SUMMARY+=("$(grep -E '^=== step tests: rc=' "$OUT/e2e_tests.log" | tail -1)")
      tail -15 "$OUT/e2e_tests.log" ;;
    bench)
      if ! sync_sources; then SUMMARY+=("bench skipped: no built package in $PKG"); continue; fi
      left=$((BUDGET_S - (SECONDS - T0)))
      [ $left -lt 90 ] && left=90
      # shellcheck disable=SC2086
      step bench $((left + 30)) env PYTHONPATH=$PKG OUT="$OUT" "$PY" "$REPO/bench/e2e_decode.py" --commit "$COMMIT" \
        --time-budget "$left" $BENCH_ARGS > "$OUT/e2e_bench.log" 2>&1
      grep -v -E "USDT|profiler_st" "$OUT/e2e_bench.log" | tail -45 ;;
    *) echo "unknown step '$s' (build tests bench)"; SUMMARY+=("$s unknown") ;;
  esac
done

{
  echo "fmkv e2e device run, commit $COMMIT, $(date -u +%FT%TZ), $((SECONDS - T0)) s"
  for l in "${SUMMARY[@]}"; do echo "  $l"; done
} | tee "$OUT/e2e_summary.txt"

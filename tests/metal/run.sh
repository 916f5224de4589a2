#!/usr/bin/env bash
# Metal backend checks that run on Linux without a Mac (docs/METAL.md says what they prove):
#   1. MSL type-check: clang compiles the exact text of src/metal/*.metal, and the full sources MLX
#      generates around the bodies in python/fmkv/mlx/kernels.py, against tests/metal/shim/metal_stdlib
#      (address spaces, no double, no C/C++ library, no lambdas / exceptions), plus negative controls
#      showing the shim rejects what MSL rejects.
#   2. CUDA compile of the shared kernel core (nvcc -arch=sm_90), when nvcc is installed.
#   3. python/fmkv/mlx/kernels.py imports without MLX, and packs parameter blocks byte-identical to the C++ host.
#   4. The CPU emulator (ASan + UBSan) runs the exact MSL kernel text and compares with src/ref:
#      quantize-append bit-exact, attention within 1e-5 relative (fp32 out).
# Usage: tests/metal/run.sh   (env: CXX, CLANG, NVCC, FMKV_METAL_SEED, FMKV_METAL_BUILD)
# Prints one PASS/FAIL/SKIP line per check and a final "metal: N passed, M failed"; exit 1 on failure.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
OUT=${FMKV_METAL_BUILD:-build/metal-tests}
mkdir -p "$OUT"
passed=0
failed=0
LOG="$OUT/step.log"

step() {  # step NAME CMD...: PASS when CMD succeeds
  local name=$1
  shift
  if "$@" >"$LOG" 2>&1; then
    echo "PASS $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name"
    tail -n 40 "$LOG" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
}
step_fails() {  # step_fails NAME CMD...: PASS when CMD fails (negative control)
  local name=$1
  shift
  if "$@" >"$LOG" 2>&1; then
    echo "FAIL $name (was accepted)"
    failed=$((failed + 1))
  else
    echo "PASS $name"
    passed=$((passed + 1))
  fi
}

# ---- tools ---------------------------------------------------------------------------------------
CLANG=${CLANG:-$(command -v clang++ || true)}
if [ -z "$CLANG" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -qq clang >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq clang >/dev/null; }
  CLANG=$(command -v clang++ || true)
fi
CXX=${CXX:-g++}
NVCC=${NVCC:-$(command -v nvcc || true)}
PY=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the source tree

# ---- 1. MSL type-check ---------------------------------------------------------------------------
msl_check() {  # msl_check FILE METAL_VERSION
  local v=$2
  "$CLANG" -target arm64-apple-macos13 -x c++ -std=c++17 -fsyntax-only -nostdinc -nostdinc++ -fno-exceptions \
    -fno-rtti -D__METAL_VERSION__="$v" -isystem tests/metal/shim -Wall -Wextra -Werror -Wno-unknown-attributes \
    -Wno-unused-parameter -Wno-unknown-pragmas "$1"
}
no_lambdas() {  # the AST of FILE has no lambda, throw or try
  local ast
  ast=$("$CLANG" -target arm64-apple-macos13 -x c++ -std=c++17 -fsyntax-only -nostdinc -nostdinc++ -fno-rtti \
    -D__METAL_VERSION__=310 -isystem tests/metal/shim -Wno-unknown-attributes -Xclang -ast-dump "$1" 2>&1) || return 1
  if grep -E "LambdaExpr|CXXThrowExpr|CXXTryStmt" <<<"$ast" >/dev/null; then
    grep -nE "LambdaExpr|CXXThrowExpr|CXXTryStmt" <<<"$ast" | head -5
    return 1
  fi
}
if [ -z "$CLANG" ]; then
  echo "FAIL MSL type-check: clang++ not found (apt-get install -y clang)"
  failed=$((failed + 1))
else
  for f in src/metal/quantize.metal src/metal/decode_attention.metal tests/metal/core_test.metal; do
    for v in 310 320; do step "MSL type-check $f (MSL $((v / 100)).$((v % 100 / 10)), shim)" msl_check "$f" "$v"; done
    step "MSL rules $f: no lambdas, exceptions" no_lambdas "$f"
  done
  # Negative controls: the shim rejects what MSL rejects.
  neg="$OUT/neg"
  mkdir -p "$neg"
  printf '#include <metal_stdlib>\nusing namespace metal;\nkernel void f(device float* o [[buffer(0)]]) { o[0] = 1.0f; }\n' >"$neg/ok.metal"
  printf '#include <metal_stdlib>\nusing namespace metal;\nkernel void f(device float* o [[buffer(0)]]) { double x = o[0]; o[0] = (float)x; }\n' >"$neg/double.metal"
  printf '#include <metal_stdlib>\nusing namespace metal;\ninline void g(threadgroup float* p) { p[0] = 0.0f; }\nkernel void f(device float* o [[buffer(0)]]) { g(o); }\n' >"$neg/aspace.metal"
  printf '#include <metal_stdlib>\n#include <stdint.h>\nkernel void f(device float* o [[buffer(0)]]) { o[0] = 1.0f; }\n' >"$neg/stdlib.metal"
  printf '#include <metal_stdlib>\nkernel void f(device float* o [[buffer(0)]]) { auto l = [](float x) { return x; }; o[0] = l(1.0f); }\n' >"$neg/lambda.metal"
  step "shim control: a valid kernel is accepted" msl_check "$neg/ok.metal" 310
  step_fails "shim control: double is rejected" msl_check "$neg/double.metal" 310
  step_fails "shim control: device pointer as threadgroup pointer is rejected" msl_check "$neg/aspace.metal" 310
  step_fails "shim control: C/C++ library headers are unavailable" msl_check "$neg/stdlib.metal" 310
  step_fails "shim control: a lambda is rejected" no_lambdas "$neg/lambda.metal"

  # MLX: the full source mx.fast.metal_kernel generates (header + signature + body, with the
  # template arguments fmkv.mlx passes) per kernel, K/V/Q dtype and format, with a stand-in for MLX's
  # own prelude (metal::utils()).
  mlx_gen() {
    rm -f "$OUT"/mlx_*.metal
    "$PY" - "$OUT" <<'EOF'
import importlib.util, os, re, sys
out = sys.argv[1]
spec = importlib.util.spec_from_file_location("fmkv_mlx_kernels", os.path.join("python", "fmkv", "mlx", "kernels.py"))
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
prelude = ("#include <metal_stdlib>\nusing namespace metal;\ntypedef half float16_t;\n"
           "struct bfloat16_t { ushort bits; };\n")
formats = [(128, 4, 4), (64, 3, 2), (256, 16, 3), (128, 5, 5)]
for dt in ("float32", "float16", "bfloat16"):
    common = {"params": "int32", "pages": "uint8", "fp16_k": "uint16", "fp16_v": "uint16", "k": dt, "v": dt, "q": dt,
              "seq_lens": "int64", "row_offsets": "int64", "block_table": "int32", "slots": "int32", "ws": "float32",
              "status": "uint32", "after": "uint32"}
    outs = {"done": "uint32", "ws": "float32", "out": dt}
    for name in m.KERNELS:
        for d, kb, vb in formats:
            src = m.generated_source(name, common, outs, "metal", m.template_args(name, d, kb, vb))
            # MLX instantiates templated kernels as `template [[host_name("..")]] [[kernel]] decltype(f<..>) f<..>;`,
            # which Apple's compiler accepts and clang's C++ mode does not (attributes on an explicit
            # instantiation): the shim checks the instantiation without them.
            src, n = re.subn(r'^template \[\[host_name\("[^"]*"\)\]\] \[\[kernel\]\] ', "template ", src, flags=re.M)
            assert n == (1 if m.template_args(name, d, kb, vb) else 0), name
            with open(os.path.join(out, "mlx_%s_%s_d%dk%dv%d.metal" % (name, dt, d, kb, vb)), "w") as f:
                f.write(prelude + src)
EOF
  }
  step "MLX sources generated by python/fmkv/mlx/kernels.py (without mlx)" mlx_gen
  mlx_all() {
    local f
    for f in "$OUT"/mlx_*.metal; do msl_check "$f" 320 || { echo "in $f"; return 1; }; done
    ls "$OUT"/mlx_*.metal | wc -l
  }
  step "MSL type-check of the MLX-generated kernel sources (4 kernels x 3 dtypes x 4 formats)" mlx_all
fi

# Host code: backend.mm parses as Objective-C++ against stand-in Metal/Foundation declarations
# (tests/metal/objc_stub; Apple's real API is checked by the macOS workflow only).
objc_parse() {
  "$CLANG" -x objective-c++ -std=c++17 -fsyntax-only -fobjc-arc -fobjc-runtime=gnustep-2.0 -D__APPLE__ \
    -DFMKV_METAL_SOURCE_DIR='"/src"' -DFMKV_METALLIB_DIR_BUILT='"/lib"' -isystem tests/metal/objc_stub -Iinclude \
    -Wall -Wextra -Werror -Wno-unused-parameter src/metal/backend.mm
}
if [ -n "$CLANG" ]; then
  step "src/metal/backend.mm parses as Objective-C++ (stub Metal headers, not Apple's)" objc_parse
fi

# ---- 2. CUDA compile of the shared core -----------------------------------------------------------
if [ -n "$NVCC" ]; then
  step "CUDA compile of the kernel core (nvcc -arch=sm_90)" \
    "$NVCC" -arch=sm_90 -std=c++17 -c tests/metal/cuda_check.cu -o "$OUT/cuda_check.o"
else
  echo "SKIP CUDA compile of the kernel core (nvcc not found)"
fi

# ---- 4 (build). Emulator + reference, ASan + UBSan ------------------------------------------------
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
BASE="-std=c++17 -g -U_FORTIFY_SOURCE -ffp-contract=off -fno-fast-math -Wall -Wextra -Wno-unused-parameter $SAN"
build_emulator() {
  local jobs=()
  # no binary of an earlier build survives a failed one (the later steps run whatever $OUT/test_metal is)
  rm -rf "$OUT/obj" "$OUT/test_metal" && mkdir -p "$OUT/obj"
  local s
  # The reference backend and the C API (plus src/io when present: the C API may call it).
  for s in src/core/*.cpp src/ref/*.cpp src/api/*.cpp $(ls src/io/*.cpp 2>/dev/null); do
    jobs+=("$CXX $BASE -O1 -Iinclude -Isrc -c $s -o $OUT/obj/$(basename "$s").o")
  done
  jobs+=("$CXX $BASE -O2 -Iinclude -Isrc -Itests/metal -c tests/metal/emulator.cpp -o $OUT/obj/emulator.o")
  jobs+=("$CXX $BASE -O1 -Iinclude -Isrc -Itests/metal -c tests/metal/test_metal.cpp -o $OUT/obj/test_metal.o")
  # The exact MSL kernel text as host C++: <metal_stdlib> is the emulator's.
  jobs+=("$CXX $BASE -O2 -Wno-attributes -DFMKV_EMULATOR=1 -Itests/metal/emu -Iinclude -Isrc -c tests/metal/kernels_emu.cpp -o $OUT/obj/kernels_emu.o")
  printf '%s\n' "${jobs[@]}" | xargs -P "$(nproc)" -I{} sh -c '{}' || return 1
  "$CXX" $SAN "$OUT"/obj/*.o -o "$OUT/test_metal" -lpthread
}
step "build the emulator tests (g++, -fsanitize=address,undefined, -ffp-contract=off)" build_emulator

# ---- 3. Python: import without MLX, parameter packing == C++ host ---------------------------------
py_params() {
  local dump
  dump=$("$OUT/test_metal" --dump-params) || return 1
  "$PY" - "$dump" <<'EOF'
import importlib.util, os, struct, sys
spec = importlib.util.spec_from_file_location("fmkv_mlx_kernels", os.path.join("python", "fmkv", "mlx", "kernels.py"))
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
assert "mlx" not in sys.modules and "mlx.core" not in sys.modules, "fmkv.mlx.kernels imported mlx"
want_append, want_attn = sys.argv[1].split()
# page_bytes comes from the binding (fmkv.Config.page_bytes) in real use: take the C++ value here.
page_bytes = struct.unpack_from("<q", bytes.fromhex(want_append), 120)[0]
cfg = dict(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=4, page_size=16, sink_tokens=2, window_tokens=8,
           scale_rule=0, seed=0x1234567890abcdef, format_version=3, scale_group=64)
a = m.pack_append_params(cfg, page_bytes, 77, 3, 5, 2, True, 9, "float16", "bfloat16", (256, 128), (256, 128), 4).hex()
t = m.pack_attention_params(cfg, page_bytes, 77, 3, 5, 2, True, 9, 8, "float32", (1024, 128), "float16", (1024, 128),
                            3, 100, 0.0, 30.0, 4, 3).hex()
assert a == want_append, "append params differ:\n py  %s\n c++ %s" % (a, want_append)
assert t == want_attn, "attention params differ:\n py  %s\n c++ %s" % (t, want_attn)
print("ok")
EOF
}
if [ -x "$OUT/test_metal" ]; then
  step "python/fmkv/mlx/kernels.py imports without mlx; its parameter blocks (fields read from params_msl.h) equal the C++ host's byte for byte" py_params
fi

# ---- 4 (controls). The emulator enforces the SIMD-group / barrier rules it claims to ------------------
selftest_aborts() {  # selftest_aborts SCENARIO MESSAGE: the scenario must abort with MESSAGE
  if ASAN_OPTIONS=abort_on_error=0 "$OUT/test_metal" --emulator-selftest "$1" >"$OUT/selftest.log" 2>&1; then
    return 1
  fi
  grep -q "metal emulator: .*$2" "$OUT/selftest.log"
}
if [ -x "$OUT/test_metal" ]; then
  step "emulator control: shuffles, ballots, barrier of a valid kernel" "$OUT/test_metal" --emulator-selftest ok
  step "emulator control: divergent SIMD operations abort" selftest_aborts divergent "divergent SIMD operations"
  step "emulator control: SIMD operation with exited lanes aborts" selftest_aborts exited "have exited"
  step "emulator control: shuffle from a missing lane of a partial SIMD group aborts" selftest_aborts partial "missing lane"
  step "emulator control: barrier not reached by every thread aborts" selftest_aborts barrier "deadlock"
  step "emulator control: threadgroup memory above 32 KiB aborts" selftest_aborts tgmem "above 32 KiB"
fi

# ---- 4 (run). Emulator vs reference --------------------------------------------------------------
if [ -x "$OUT/test_metal" ]; then
  echo "---- emulator tests (exact MSL kernel text on CPU fibers vs src/ref) ----"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$OUT/test_metal" >"$OUT/emulator.log" 2>&1
  rc=$?
  sed 's/^/  /' "$OUT/emulator.log"
  if [ "$rc" = 0 ] && tail -n 1 "$OUT/emulator.log" | grep -q " 0 failed$"; then
    echo "PASS emulator: $(tail -n 1 "$OUT/emulator.log") (full log: $OUT/emulator.log)"
    passed=$((passed + 1))
  else
    echo "FAIL emulator (log: $OUT/emulator.log)"
    grep -E "^FAIL|emulator:|ERROR|runtime error" "$OUT/emulator.log" | head -20 | sed 's/^/    /'
    failed=$((failed + 1))
  fi
fi

echo "metal: $passed passed, $failed failed ($(($(date +%s) - start)) s)"
[ "$failed" = 0 ]

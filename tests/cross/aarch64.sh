#!/usr/bin/env bash
# Cross test of the CPU backend's AArch64 NEON kernels on an x86-64 host: cross-compiles the library
# and the GoogleTest suite for aarch64 (aarch64-linux-gnu-g++, static), runs them under qemu-aarch64
# with FMKV_CPU_ISA=neon and =scalar, plus NEON-only checks (FCVTN fp32 -> fp16 rounding against
# fmkv::f32_to_f16, NEON default, append bit-exact over ~200k groups). Prints one summary line; exit status non-zero on any failure.
#   tests/cross/aarch64.sh [build-dir]      (default build-aarch64; JOBS=n to limit parallelism)
# Debian/Ubuntu packages: g++-aarch64-linux-gnu qemu-user (installed when missing and root).
# See docs/CPU-NEON.md for what emulation does and does not show.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=$(mkdir -p "${1:-$ROOT/build-aarch64}" && cd "${1:-$ROOT/build-aarch64}" && pwd)
JOBS=${JOBS:-$(nproc)}
# Whole suite except the test that execs the aarch64
# gen_codebooks binary through std::system (no binfmt_misc assumed) and the fork test: qemu-user (Debian 12's
# 7.2) cannot start a thread in a forked child of a multithreaded guest -- the child aborts in qemu itself
# ("qemu_plugin_vcpu_init_hook: assertion failed", exit 127; a 20-line program with one thread, fork and a
# thread in the child does the same), so the test runs natively only (ctest). Override with FMKV_CROSS_FILTER.
# The codebook generator's own tests (Codebook.DistortionMatchesMax1960, Codebook.Fp16LevelsAreNearestToExact,
# IntegerLevels.*: the Lloyd-Max and integer-grid searches in portable double precision, no kernel involved) are
# left out too: ~100 s per ISA emulated, and they run natively in ctest.
FILTER=${FMKV_CROSS_FILTER:-'-Codebook.CommittedTableEqualsGenerator:Reliability.CpuThreadPoolAfterFork:Codebook.DistortionMatchesMax1960:Codebook.Fp16LevelsAreNearestToExact:IntegerLevels.*'}
# The Backends shapes of more than this many tokens in all are left out under qemu (tests/test_backends.cpp,
# FMKV_TEST_SHAPE_TOKENS): they exist for CUDA's split counts and balanced plans and were most of the emulated time
# (~550 s per ISA); the NEON and scalar kernels meet every code path in the shorter shapes (up to ~6,000 tokens), and
# the CPU backend's chunking of longer sequences is portable code the native runs check. Override with
# FMKV_CROSS_SHAPE_TOKENS (a large number runs them all).
SHAPE_TOKENS=${FMKV_CROSS_SHAPE_TOKENS:-6500}
start=$(date +%s)

QEMU=$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)
if ! command -v aarch64-linux-gnu-g++ >/dev/null || [ -z "$QEMU" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
    QEMU=$(command -v qemu-aarch64 || command -v qemu-aarch64-static)
  else
    echo "aarch64 cross: FAIL (need aarch64-linux-gnu-g++ and qemu-aarch64: apt-get install g++-aarch64-linux-gnu qemu-user)"
    exit 2
  fi
fi
GTEST_SRC=${GTEST_SRC:-/usr/src/googletest}
[ -f "$GTEST_SRC/CMakeLists.txt" ] || { echo "aarch64 cross: FAIL (no GoogleTest sources in $GTEST_SRC: apt-get install googletest)"; exit 2; }
GEN=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")

cat > "$B/toolchain.cmake" <<TC
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")
set(CMAKE_CROSSCOMPILING_EMULATOR $QEMU)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu $B/gtest)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
TC

# 1. GoogleTest for aarch64 (once per build dir).
if [ ! -f "$B/gtest/lib/libgtest.a" ]; then
  cmake -S "$GTEST_SRC" -B "$B/gtest-build" -G "$GEN" -DCMAKE_TOOLCHAIN_FILE="$B/toolchain.cmake" \
    -DCMAKE_BUILD_TYPE=Release -Wno-author -Wno-deprecated -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON -DCMAKE_INSTALL_PREFIX="$B/gtest" >/dev/null
  cmake --build "$B/gtest-build" -j "$JOBS" >/dev/null
  cmake --install "$B/gtest-build" >/dev/null
fi

# 2. fmkv (library + tests) for aarch64.
cmake -S "$ROOT" -B "$B/fmkv" -G "$GEN" -DCMAKE_TOOLCHAIN_FILE="$B/toolchain.cmake" -DCMAKE_BUILD_TYPE=Release \
  -DFMKV_CUDA=OFF -DFMKV_BUILD_CLI=OFF -DFMKV_PYTHON=OFF -DGTest_DIR="$B/gtest/lib/cmake/GTest" \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >/dev/null
cmake --build "$B/fmkv" -j "$JOBS" --target fmkv_tests fmkv >/dev/null

# 3. NEON-only checks (fmkv_neon_tests): FCVT/FCVTN fp32 -> fp16 (NeonT::h_from_f, to_f16_neon) equal
#    fmkv::f32_to_f16 for every finite value class; NEON is the default kernel set; append bit-exact
#    on many groups (rare rounding differences, e.g. a wrong tree_sum32 order, show up only there).
cat > "$B/neon_tests.cpp" <<'CPP'
#include <arm_neon.h>
#include <cstring>
#include <string>
#include "harness.h"
namespace fmkv::test {
namespace {
TEST(NeonCross, DefaultKernelSetIsNeon) {
  if (std::getenv("FMKV_CPU_ISA")) GTEST_SKIP() << "FMKV_CPU_ISA set";
  EXPECT_NE(std::string(fmkv_backend_device(FMKV_BACKEND_CPU)).find("(neon,"), std::string::npos)
      << fmkv_backend_device(FMKV_BACKEND_CPU);
}
TEST(NeonCross, FcvtnMatchesF32ToF16) {
  uint64_t n = 0, bad = 0;
  auto check = [&](uint32_t u0) {
    uint32_t u[4] = {u0, u0 ^ 0x80000000u, u0 + 1, (u0 + 1) ^ 0x80000000u};
    float f[4];
    std::memcpy(f, u, 16);
    uint16_t h[4];
    vst1_u16(h, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(f))));
    for (int i = 0; i < 4; ++i) {
      if ((u[i] & 0x7f800000u) == 0x7f800000u && (u[i] & 0x7fffffu)) continue;  // NaN
      ++n;
      if (h[i] != f32_to_f16(f[i]) && bad++ < 10) ADD_FAILURE() << std::hex << u[i] << ": " << h[i] << " vs " << f32_to_f16(f[i]);
    }
  };
  for (uint64_t u = 0; u < 0x7f800001u; u += 509) check((uint32_t)u);  // all magnitudes, sampled
  for (uint32_t u = 0x32800000u; u < 0x39000000u; u += 2) check(u);   // fp16 subnormal range, dense
  for (uint32_t u = 0x477fc000u; u < 0x47800400u; u += 2) check(u);   // around 65504 / 65520 / inf
  for (uint32_t u = 0x3f800000u; u < 0x3f900000u; u += 2) check(u);   // [1, 1.125): every tie
  check(0x7f7fffffu);
  check(0x7f800000u);
  EXPECT_EQ(bad, 0u) << "of " << n << " values";
  std::printf("fcvtn vs f32_to_f16: %llu values, %llu mismatches\n", (unsigned long long)n, (unsigned long long)bad);
}
TEST(NeonCross, AppendBitExactManyGroups) {
  for (int d : {64, 128, 256})
    for (int rule : {FMKV_SCALE_RMS, FMKV_SCALE_LSQ})
      for (fmkv_dtype in : {FMKV_F16, FMKV_F32, FMKV_BF16}) {
        const int kb = 2 + (d / 64 + rule) % 3, vb = 2 + (d / 64 + rule + 1) % 3;
        fmkv_config c = config(d, kb, vb, 2, 64, 0, 0, rule);
        const int64_t n = 8192 / (d / 64);
        Scenario s = make_scenario(c, {0}, {n});
        auto k = random_tensor(in, n, 2, d, 3.0), v = random_tensor(in, n, 2, d);
        fmkv_tensor kt = make_tensor(k.data(), in, n, 2, d), vt = make_tensor(v.data(), in, n, 2, d);
        EXPECT_TRUE(run_append(FMKV_BACKEND_CPU, s, kt, vt).pages == run_append(FMKV_BACKEND_REF, s, kt, vt).pages)
            << "d=" << d << " k" << kb << "v" << vb << " rule " << rule << " dtype " << in;
      }
}
}  // namespace
}  // namespace fmkv::test
CPP
aarch64-linux-gnu-g++ -std=c++17 -O2 -ffp-contract=off -static -I"$ROOT/include" -I"$ROOT/src" -I"$ROOT/tests" \
  -I"$B/gtest/include" "$B/neon_tests.cpp" "$B/fmkv/libfmkv.a" "$B/gtest/lib/libgtest_main.a" "$B/gtest/lib/libgtest.a" \
  -lpthread -o "$B/fmkv_neon_tests" 2>&1 | grep -v -e getaddrinfo -e 'in function .*MakeConnection' || true
[ -x "$B/fmkv_neon_tests" ]

# 4. Run under qemu, the three runs side by side (each is one emulated process; their logs are
#    summarised in a fixed order after all have ended).
fail=0
summary=""
launch() {  # name, command...: runs in the background, its exit status and seconds to $B/name.rc
  local name=$1
  shift
  ( t0=$SECONDS; rc=0; "$@" >"$B/$name.log" 2>&1 || rc=$?; echo "$rc $((SECONDS - t0))" >"$B/$name.rc" ) &
}
collect() {  # name
  local name=$1 rc secs
  read -r rc secs <"$B/$name.rc" || { rc=1; secs=0; }
  grep -E 'tests? from .* ran|^\[  (PASSED|FAILED)  \]|^\[  SKIPPED \] [0-9]+ test|fcvtn vs' "$B/$name.log" \
    | sed "s/^/[$name] /" || true
  summary="$summary $name=$([ "$rc" = 0 ] && echo ok || echo FAIL)(${secs}s)"
  [ "$rc" = 0 ] || fail=1
}
rm -f "$B"/*.rc
launch neon-extra env -u FMKV_CPU_ISA "$QEMU" "$B/fmkv_neon_tests"
for isa in neon scalar; do
  launch "tests-$isa" env FMKV_CPU_ISA=$isa FMKV_TEST_SHAPE_TOKENS="$SHAPE_TOKENS" "$QEMU" "$B/fmkv/tests/fmkv_tests" \
    --gtest_filter="$FILTER"
done
wait
for name in neon-extra tests-neon tests-scalar; do collect "$name"; done
echo "aarch64 cross (qemu): $([ $fail = 0 ] && echo PASS || echo FAIL) -$summary; total $(( $(date +%s) - start )) s"
exit $fail

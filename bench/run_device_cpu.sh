#!/usr/bin/env bash
# One device call: the CPU backend on the device machine's host CPU (docs/results/README.md "CPU").
#
#   OUT=$OUT bash bench/run_device_cpu.sh [BASE.tar] [ROUNDS]
#   (BASE.tar: `git archive <commit>`, carried, for a same-run A/B of the decode; .gtest-src: the GoogleTest
#   sources, carried, when the image has none)
#
# 1. Builds the tree's CPU backend with its tests (no CUDA) and, given BASE.tar, the base's cpu_bench.
# 2. The CPU tests of this CPU's kernel sets (ctest: the cross-backend harness on the default set, format 3 and the
#    golden vectors on every x86 set).
# 3. Given BASE.tar: ROUNDS (default 3) interleaved rounds of the k3v3 decode, formats 2 and 3, base vs tree
#    on every kernel set the tree has here, two threads on two pinned cores -> $OUT/cpu_ab.jsonl.
# 4. bench/cpu_bench.py (every width, fmkv vs torch SDPA, copy bandwidth) on the avx512vnni, avx512 and avx2 sets ->
#    $OUT/results/cpu_decode.jsonl, cpu_quantize.jsonl, cpu_decode.png (CPU_BENCH_ARGS: more arguments, e.g.
#    --contexts 32768,131072).
# $OUT gets at most 8 files (the device tool's limit): machine.txt (lscpu, fmkv info), build.log, ctest.log,
# cpu_bench.log, cpu_ab.jsonl and results/cpu_decode.jsonl, cpu_quantize.jsonl, cpu_decode.png.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
BASE=${1:-}; ROUNDS=${2:-3}
CORES=${FMKV_BENCH_CORES:-2,3}
T0=$SECONDS; el() { echo "$((SECONDS - T0)) s"; }
lscpu > "$OUT/machine.txt" 2>&1
GT=""
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  cmake -S .gtest-src -B /tmp/gtb -G Ninja -DCMAKE_INSTALL_PREFIX=/tmp/gti -DBUILD_GMOCK=OFF > /tmp/gtest_build.log 2>&1 &&
    ninja -C /tmp/gtb install >> /tmp/gtest_build.log 2>&1 || echo "gtest build failed"
  GT="-DCMAKE_PREFIX_PATH=/tmp/gti"
fi
( cmake -S . -B /tmp/bcpu -G Ninja -DFMKV_CUDA=OFF -DCMAKE_BUILD_TYPE=Release $GT > "$OUT/build.log" 2>&1 &&
    ninja -C /tmp/bcpu -j10 >> "$OUT/build.log" 2>&1
  echo "tree: build rc=$? at $(el)" ) &
if [ -n "$BASE" ]; then
  ( rm -rf /tmp/cpu_base_src && mkdir -p /tmp/cpu_base_src && tar -xf "$BASE" -C /tmp/cpu_base_src &&
      cmake -S /tmp/cpu_base_src -B /tmp/bcpu_base -G Ninja -DFMKV_CUDA=OFF -DFMKV_BUILD_TESTS=OFF > /tmp/build_base.log 2>&1 &&
      ninja -C /tmp/bcpu_base -j6 cpu_bench >> /tmp/build_base.log 2>&1
    echo "base: build rc=$? at $(el)" ) &
fi
wait
[ -f /tmp/build_base.log ] && { echo "== base build"; cat /tmp/build_base.log; } >> "$OUT/build.log"
[ -x /tmp/bcpu/bench/cpu_bench ] || { echo "BUILD FAILED"; grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }

(cd /tmp/bcpu && ctest -j 8 -E "cuda|metal" > "$OUT/ctest.log" 2>&1)
echo "ctest: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log") at $(el)"
/tmp/bcpu/cli/fmkv info | tee -a "$OUT/machine.txt"

if [ -n "$BASE" ] && [ -x /tmp/bcpu_base/bench/cpu_bench ]; then
  : > "$OUT/cpu_ab.jsonl"
  for round in $(seq 1 "$ROUNDS"); do
    for fv in 2 3; do
      for run in base:avx512 tree:avx512 tree:avx512vnni; do
        side=${run%%:*}; isa=${run#*:}
        bin=/tmp/bcpu/bench/cpu_bench; [ "$side" = base ] && bin=/tmp/bcpu_base/bench/cpu_bench
        FMKV_CPU_ISA=$isa FMKV_NUM_THREADS=2 taskset -c "$CORES" "$bin" --contexts 32768,131072 --format-version $fv \
          --kbits 3 --skip-quant 2>/dev/null | grep '"decode_attention"' |
          sed "s/^{/{\"ab_side\": \"$side\", \"ab_isa\": \"$isa\", \"round\": $round, \"format_version\": $fv, /" >> "$OUT/cpu_ab.jsonl"
      done
    done
  done
  echo "A/B: $(wc -l < "$OUT/cpu_ab.jsonl") rows at $(el)"
  python3 - "$OUT/cpu_ab.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
key = lambda r: (r["format_version"], r["head_dim"], r["context"])
for k in sorted({key(r) for r in rows}):
    med = {}
    for side in ("base:avx512", "tree:avx512", "tree:avx512vnni"):
        t = [r["time_us"] for r in rows if key(r) == k and "%s:%s" % (r["ab_side"], r["ab_isa"]) == side]
        med[side] = statistics.median(t) if t else float("nan")
    b = med["base:avx512"]
    print("format %d d%d %6d tokens: base avx512 %8.0f us | tree avx512 %8.0f (%.3fx) | tree avx512vnni %8.0f (%.3fx)" % (
        k[0], k[1], k[2], b, med["tree:avx512"], b / med["tree:avx512"], med["tree:avx512vnni"], b / med["tree:avx512vnni"]))
PY
fi

FMKV_NUM_THREADS=2 taskset -c "$CORES" python3 bench/cpu_bench.py --bin /tmp/bcpu/bench/cpu_bench --isas avx512vnni,avx512,avx2 \
  --format-versions 2,3 --out "$OUT/results" ${CPU_BENCH_ARGS:-} > "$OUT/cpu_bench.log" 2>&1
echo "cpu_bench.py rc=$? at $(el)"
tail -n 30 "$OUT/cpu_bench.log"

#!/usr/bin/env bash
# Builds the snapshot-loader fuzzer (libFuzzer + ASan + UBSan) straight from the sources and runs
# it for a number of seconds (default 20) from a freshly generated seed corpus.
# Exits non-zero when the fuzzer finds a crash, a sanitizer error, a leak or a timeout.
#
#   tests/fuzz/run.sh [SECONDS] [extra libFuzzer flags...]
#   FMKV_FUZZ_DIR=/path  (build + corpus directory; default build-fuzz/ in the repository)
#   FMKV_FUZZ_JOBS=N     (parallel fuzzing processes; default 1)
#
# Longer runs: docs/FILE-FORMAT.md, "Fuzzing".
set -euo pipefail
SECS="${1:-20}"
shift || true
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${FMKV_FUZZ_DIR:-$ROOT/build-fuzz}"
JOBS="${FMKV_FUZZ_JOBS:-1}"
cd "$ROOT"

if ! command -v clang++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run.sh: installing clang (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
  else
    echo "run.sh: clang++ not found (install clang with libFuzzer)" >&2
    exit 2
  fi
fi

mkdir -p "$OUT/corpus" "$OUT/seeds" "$OUT/artifacts"
SRCS=(src/core/*.cpp src/ref/*.cpp src/api/*.cpp src/io/*.cpp)
FLAGS=(-std=c++17 -O1 -g -ffp-contract=off -fno-fast-math -fno-omit-frame-pointer -Iinclude -Isrc)
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)

echo "run.sh: building $OUT/fuzz_load"
clang++ "${FLAGS[@]}" "${SAN[@]}" -fsanitize=fuzzer "${SRCS[@]}" tests/fuzz/fuzz_load.cpp -o "$OUT/fuzz_load"
clang++ "${FLAGS[@]}" "${SAN[@]}" "${SRCS[@]}" tests/fuzz/make_corpus.cpp -o "$OUT/make_corpus"
rm -f "$OUT/seeds"/*
"$OUT/make_corpus" "$OUT/seeds"
cp tests/golden/format1_*.fmkv "$OUT/seeds/"  # format-1 files: the loader's conversion path

echo "run.sh: fuzzing for ${SECS}s"
# First directory: the evolving corpus (kept between runs); second: the seeds (read only).
PAR=()
if [ "$JOBS" -gt 1 ]; then PAR=(-fork="$JOBS"); fi
cd "$OUT"
"$OUT/fuzz_load" -max_total_time="$SECS" -timeout=20 -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$OUT/artifacts/" "${PAR[@]}" \
  "$@" "$OUT/corpus" "$OUT/seeds"
echo "run.sh: no crash in ${SECS}s"

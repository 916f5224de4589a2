#!/bin/bash
# Same-run A/B of CUDA decode builds, for one device call: builds every variant's fmkv_cuda_bench (default grid,
# in parallel, under $AB_DIR, default /tmp), runs the cases in rounds (every variant once per round, so drift
# hits all alike) and prints tests/cuda/ab_table.py's table (best of the rounds, base / variant ratios). Lines
# go to $OUT/ab.jsonl as {"variant": NAME, "r": <a "decode", "step" or "quantize" line of fmkv_cuda_bench>}.
#
#   OUT=$OUT bash tests/cuda/ab.sh [-r ROUNDS] [-t SECONDS] [-c CASEFILE] NAME=SPEC ...   (-p: print the cases, exit)
#
# SPEC: .            the working tree
#       FILE.tar     a `git archive` of another commit (carry it, e.g. in .devtmp/)
#       FILE.patch   the working tree with the patch applied
#       @NAME[:ENV]  NAME's build, run with the environment ENV (VAR=value[,VAR=value...]), e.g. forced split
#                    counts: s48=@tree:FMKV_CUDA_SPLITS=48
# The first NAME is the table's base. Cases: one per line of CASEFILE, "[VAR=value ...] <fmkv_cuda_bench
# arguments>", "#" comments (a case's own FMKV_CUDA_SPLITS=n tags its lines NAME:sn, a column of the table: forced
# counts per case); without -c the set below (the cases of the 0c3fbe5-f2c759d A/Bs,
# docs/history/cuda-occupancy.md). A round starts only while fewer than SECONDS (default 420) have passed
# since the script started. AB_REUSE=1 keeps an existing
# $AB_DIR/ab_NAME/fmkv_cuda_bench instead of building (a second call on a warm machine, or binaries built off the
# device: -DCMAKE_CUDA_ARCHITECTURES=90-real leaves out the PTX, ~34 MB, ~11 MB as xz, so two fit one call's carry);
# AB_DIR: /tmp.
set -u
ROUNDS=3 SECONDS_MAX=420 CASEFILE="" PRINT_CASES=""
while getopts "r:t:c:p" o; do
  case $o in r) ROUNDS=$OPTARG ;; t) SECONDS_MAX=$OPTARG ;; c) CASEFILE=$OPTARG ;; p) PRINT_CASES=1 ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || [ -n "$PRINT_CASES" ] || { sed -n '2,20p' "$0"; exit 2; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$(pwd); T0=$(date +%s); el() { echo "$(( $(date +%s) - T0 )) s"; }
ABD=${AB_DIR:-/tmp}  # builds in $ABD/ab_NAME, patched sources in $ABD/ab_src_NAME

DEFAULT_CASES='--only 1 4096 3 3 --step
--only 1 32768 3 3 --step
--only 1 131072 3 3 --step
--only 1 4096 4 4 --step
--only 1 131072 4 4
--only 1 1048576 3 3
--only 2 4096 3 3
--only 8 4096 3 3
--only 64 8192 3 3
--only 64 32768 3 3
--window 64 4096 32768
FMKV_BENCH_KV_HEADS=1 --only 1 131072 3 3
FMKV_BENCH_Q_LEN=4 --only 1 32768 3 3'
if [ -n "$CASEFILE" ]; then CASES=$(grep -v '^[[:space:]]*\(#\|$\)' "$CASEFILE"); else CASES=$DEFAULT_CASES; fi
[ -z "$PRINT_CASES" ] || { echo "$CASES"; exit 0; }  # -p: print the cases (a case file to extend) and exit

# variants: NAMES in order; BIN_OF / ENV_OF per name; builds for the ones with a source
NAMES=(); declare -A BIN_OF ENV_OF SRC_OF
for arg in "$@"; do
  name=${arg%%=*}; spec=${arg#*=}
  [ "$name" != "$arg" ] && [ -n "$name" ] || { echo "bad variant '$arg' (NAME=SPEC)"; exit 2; }
  NAMES+=("$name")
  case $spec in
    @*) ref=${spec#@}; ENV_OF[$name]=""
        if [ "${ref#*:}" != "$ref" ]; then ENV_OF[$name]=${ref#*:}; ENV_OF[$name]=${ENV_OF[$name]//,/ }; ref=${ref%%:*}; fi
        [ -n "${SRC_OF[$ref]:-}" ] || { echo "variant $name: $ref is not a built variant named before it"; exit 2; }
        BIN_OF[$name]=$ABD/ab_$ref/fmkv_cuda_bench ;;
    .) SRC_OF[$name]=$REPO; BIN_OF[$name]=$ABD/ab_$name/fmkv_cuda_bench; ENV_OF[$name]="" ;;
    *.tar|*.patch)
        [ -f "$spec" ] || { echo "variant $name: no file $spec"; exit 2; }
        case $spec in /*) ;; *) spec=$REPO/$spec ;; esac
        src=$ABD/ab_src_$name; rm -rf "$src"; mkdir -p "$src"
        if [ "${spec%.tar}" != "$spec" ]; then tar -xf "$spec" -C "$src"
        else
          tar -c --exclude=./.git --exclude=./.devtmp --exclude='./build*' -f - . | tar -x -C "$src"
          (cd "$src" && { git apply "$spec" 2>/dev/null || patch -s -p1 < "$spec"; }) ||
            { echo "variant $name: $spec does not apply"; exit 1; }
        fi
        SRC_OF[$name]=$src; BIN_OF[$name]=$ABD/ab_$name/fmkv_cuda_bench; ENV_OF[$name]="" ;;
    *) echo "variant $name: unknown spec '$spec' (., FILE.tar, FILE.patch, @NAME[:ENV])"; exit 2 ;;
  esac
done

nb=0; for n in "${NAMES[@]}"; do [ -n "${SRC_OF[$n]:-}" ] && nb=$((nb + 1)); done
jobs=$(( $(nproc) / (nb > 0 ? nb : 1) )); [ $jobs -ge 1 ] || jobs=1
for n in "${NAMES[@]}"; do
  [ -n "${SRC_OF[$n]:-}" ] || continue
  [ -n "${AB_REUSE:-}" ] && [ -x "${BIN_OF[$n]}" ] && { echo "$n: reusing ${BIN_OF[$n]}"; continue; }
  ( cmake -S "${SRC_OF[$n]}" -B $ABD/ab_$n -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_FULL_GRID=OFF -DFMKV_BUILD_CLI=OFF \
      -DFMKV_BUILD_TESTS=OFF > "$OUT/build_$n.log" 2>&1 && ninja -C $ABD/ab_$n -j$jobs fmkv_cuda_bench >> "$OUT/build_$n.log" 2>&1
    echo "$n: build rc=$? at $(el)" ) &
done
wait
for n in "${NAMES[@]}"; do [ -x "${BIN_OF[$n]}" ] || echo "$n: no binary (${BIN_OF[$n]}); left out"; done

F=$OUT/ab.jsonl
for ((round = 1; round <= ROUNDS; round++)); do
  [ $(( $(date +%s) - T0 )) -lt "$SECONDS_MAX" ] || { echo "round $round not started at $(el) (-t $SECONDS_MAX)"; break; }
  for n in "${NAMES[@]}"; do
    [ -x "${BIN_OF[$n]}" ] || continue
    while IFS= read -r line; do
      envs=(); tag=$n; set -- $line
      while [ $# -gt 0 ] && [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; do
        envs+=("$1"); [[ $1 == FMKV_CUDA_SPLITS=* ]] && tag="$n:s${1#*=}"; shift
      done
      env ${ENV_OF[$n]} "${envs[@]}" timeout 60 "${BIN_OF[$n]}" "$@" < /dev/null | grep -E '"kind":"(decode|step|quantize)"' |
        sed "s/^/{\"variant\":\"$tag\",\"r\":/; s/\$/}/" >> "$F"
    done <<< "$CASES"
  done
  echo "round $round done at $(el)"
done
python3 "$REPO/tests/cuda/ab_table.py" "$F" --base "${NAMES[0]}"

#!/usr/bin/env python3
"""Same-run A/B of CPU decode builds: two (or more) cpu_bench binaries run the same cases in interleaved
rounds (every build once per case and round, so the machine's drift hits all alike), one thread pinned to
one core by default. Writes the decode lines as JSON lines (BENCHMARKS.md fields plus `variant`, `round`,
`isa`) and prints each case's median per build and the ratios to the first build.

    python3 bench/cpu_ab.py --out docs/results/cpu_ab_NAME.jsonl base=/tmp/cpu_bench_base new=build-cpu/bench/cpu_bench
        [--rounds 5] [--contexts 32768] [--isas avx512,avx2] [--format-versions 2,3] [--kbits 3,4] [--geoms 0,1]
        [--threads 1] [--pin 1] [--commits SHA_BASE,SHA_NEW]

--geoms: cpu_bench's --geom (0: 32 q / 8 kv heads, d = 128; 1: 9 q / 3 kv heads, d = 64; 2: 64 q / 8 kv heads,
d = 128). The first NAME is the base of the ratios. A ratio base / variant above 1 means the variant is faster.
    python3 bench/cpu_ab.py --table FILE.jsonl   # the table of an existing file
"""
import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys


def run_case(binary, isa, fv, kbits, geom, contexts, threads, pin):
    env = dict(os.environ, FMKV_NUM_THREADS=str(threads))
    if isa != "best":
        env["FMKV_CPU_ISA"] = isa
    cmd = [binary, "--contexts", contexts, "--format-version", str(fv), "--skip-quant", "--kbits", str(kbits),
           "--geom", str(geom)]
    if pin:
        cmd = ["taskset", "-c", pin] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("%s failed (rc %d): %s" % (" ".join(cmd), out.returncode, out.stderr.strip()[-400:]))
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    info = next((r for r in rows if r.get("op") == "info"), {})
    return info, [r for r in rows if r.get("op") == "decode_attention"]


def print_table(times, names):
    base = names[0]
    hdr = "%-8s %3s %5s %4s %8s " % ("isa", "fv", "kv", "d", "ctx") + " ".join("%12s" % n for n in names)
    print(hdr + "".join("  %s/%s" % (base, n) for n in names[1:]))
    for key in sorted(times):
        med = {n: statistics.median(v) for n, v in times[key].items()}
        isa, fv, kb, d, ctx = key
        line = "%-8s %3d  k%dv%d %4d %8d " % (isa, fv, kb, kb, d, ctx) + " ".join("%10.1f us" % med[n] for n in names)
        print(line + "".join("  %8.3f" % (med[base] / med[n]) for n in names[1:]))


def add_time(times, r):
    key = (r["isa"], r["format_version"], r["k_bits"], r["head_dim"], r["context"])
    times.setdefault(key, {}).setdefault(r["variant"], []).append(r["time_us"])


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        times, names = {}, []
        for line in open(sys.argv[2]):
            r = json.loads(line)
            add_time(times, r)
            if r["variant"] not in names:
                names.append(r["variant"])
        return print_table(times, names)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="+", help="NAME=PATH of a cpu_bench binary; the first is the base")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--isas", default="best")
    ap.add_argument("--format-versions", default="2,3")
    ap.add_argument("--kbits", default="3")
    ap.add_argument("--geoms", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pin", default="1", help="taskset CPU list ('' for none)")
    ap.add_argument("--commits", default="", help="each build's commit, in build order (recorded on its rows)")
    a = ap.parse_args()
    builds = []
    for b in a.builds:
        name, sep, path = b.partition("=")
        if not sep or not name or not os.path.isfile(path):
            sys.exit("build %r: give NAME=PATH of an existing cpu_bench binary" % b)
        builds.append((name, path))
    commits = a.commits.split(",") if a.commits else [""] * len(builds)
    if len(commits) != len(builds):
        sys.exit("--commits names %d commits for %d builds" % (len(commits), len(builds)))
    if a.rounds < 1 or a.rounds > 100:
        sys.exit("--rounds must be in [1, 100], got %d" % a.rounds)
    cases = list(itertools.product(a.isas.split(","), [int(x) for x in a.format_versions.split(",")],
                                   [int(x) for x in a.kbits.split(",")], [int(x) for x in a.geoms.split(",")]))
    times = {}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        for rnd in range(1, a.rounds + 1):
            for (isa, fv, kb, geom) in cases:
                for (name, path), sha in zip(builds, commits):
                    info, rows = run_case(path, isa, fv, kb, geom, a.contexts, a.threads, a.pin)
                    for r in rows:
                        r.update(suite="cpu_decode", backend="cpu", device=info.get("device", platform.processor()),
                                 variant=name, round=rnd, isa=isa, commit=sha)
                        f.write(json.dumps(r) + "\n")
                        add_time(times, r)
                print("round %d done" % rnd, flush=True)
    print_table(times, [n for n, _ in builds])


if __name__ == "__main__":
    main()

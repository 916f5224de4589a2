#!/usr/bin/env python3
"""CPU benchmark: fmkv decode attention / quantize-append vs torch SDPA on the same shapes, same run.

Runs bench/cpu_bench (C++; prints JSON lines), times torch.nn.functional.scaled_dot_product_attention
on CPU (fp32 and bf16, GQA via enable_gqa) for the same decode shapes, prints a table and writes
  docs/results/cpu_decode.jsonl, docs/results/cpu_quantize.jsonl, docs/results/cpu_decode.png
with the fields of BENCHMARKS.md ("baseline" = the faster torch dtype; the fp32 time is kept too).

Usage: python3 bench/cpu_bench.py [--bin build-cpu/bench/cpu_bench] [--contexts 4096,32768,131072]
       [--format-versions 2,3] [--scale-groups 32,64] [--isas best,avx512,avx2] [--out docs/results] [--quick]
Each (ISA, format version) pair is one run of the binary (FMKV_CPU_ISA selects the kernel set; "best" is
the library's own choice); rows carry `format_version` and `isa`. torch SDPA is timed once per shape and round.
--rounds N repeats the whole measurement N times, fmkv and SDPA in turn (a shared machine drifts between the two):
each row then carries the medians of the rounds' times and the median of the per-round ratios (`speedup`), with
`speedup_min` / `speedup_max` and `rounds`.
Threads: both sides use all cores (FMKV_NUM_THREADS / torch.set_num_threads override).
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["suite", "backend", "device", "commit", "op", "batch", "q_len", "context", "head_dim", "q_heads",
          "kv_heads", "layers", "k_bits", "v_bits", "page_size", "time_us", "bytes", "gbps", "copy_gbps",
          "pct_copy_bw", "baseline", "baseline_time_us", "speedup"]


def find_bin(arg):
    cands = [arg] if arg else [os.path.join(ROOT, p) for p in
                               ("build-cpu/bench/cpu_bench", "build/bench/cpu_bench", "build-cpu/cpu_bench")]
    for c in cands:
        if c and os.path.exists(c):
            return c
    sys.exit("cpu_bench binary not found (build it: add_subdirectory(bench) + ninja cpu_bench); tried %s" % cands)


def commit():
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def torch_times(shapes, threads, quick):
    """Median SDPA time (us) per (q_heads, kv_heads, d, ctx) and dtype, best of two GQA formulations:
    enable_gqa=True, and the q heads of a group laid out as query rows ([1, kv, group, d] against
    [1, kv, ctx, d], exact for q_len = 1, no K/V repetition)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    out = {}
    for (hq, hkv, d, ctx) in shapes:
        res = {}
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            g = torch.Generator().manual_seed(0)
            k = torch.randn(1, hkv, ctx, d, generator=g).to(dt)
            v = torch.randn(1, hkv, ctx, d, generator=g).to(dt)
            variants = {"gqa": torch.randn(1, hq, 1, d, generator=g).to(dt),
                        "grouped": torch.randn(1, hkv, hq // hkv, d, generator=g).to(dt)}
            reps = 3 if quick else (5 if ctx >= 100000 else 9 if ctx >= 30000 else 25)
            best = None
            for vname, q in variants.items():
                kw = {"enable_gqa": True} if vname == "gqa" else {}
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, **kw)
                    ts = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        F.scaled_dot_product_attention(q, k, v, **kw)
                        ts.append((time.perf_counter() - t0) * 1e6)
                m = statistics.median(ts)
                if best is None or m < best[0]:
                    best = (m, vname)
            res[name] = best
            del k, v, variants
        out[(hq, hkv, d, ctx)] = res
    return out, torch.__version__


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--format-versions", default="2,3", help="fmkv format versions, one binary run each")
    ap.add_argument("--scale-groups", default="32", help="the caches' scale groups (32, 64), one binary run each")
    ap.add_argument("--replot", nargs=2, metavar=("JSONL", "PNG"), help="only redraw PNG from a cpu_decode.jsonl")
    ap.add_argument("--isas", default="best", help="CPU kernel sets (FMKV_CPU_ISA): best, avx512vnni, avx512, avx2vnni, avx2, scalar, neon")
    ap.add_argument("--rounds", type=int, default=1, help="repeat fmkv and SDPA in turn; medians of the rounds")
    a = ap.parse_args()
    if not 1 <= a.rounds <= 100:
        sys.exit("--rounds must be in [1, 100]")
    if a.replot:
        with open(a.replot[0]) as f:
            plot([json.loads(l) for l in f if l.strip()], a.replot[1])
        return
    binp = find_bin(a.bin)
    threads = int(os.environ.get("FMKV_NUM_THREADS", "0")) or os.cpu_count() or 1
    versions = [int(v) for v in a.format_versions.split(",")]
    sgs = [int(v) for v in a.scale_groups.split(",")]
    isas = a.isas.split(",")
    for isa in isas:
        if isa not in ("best", "avx512vnni", "avx512", "avx2vnni", "avx2", "scalar", "neon"):
            sys.exit("--isas: unknown kernel set %r (best, avx512vnni, avx512, avx2vnni, avx2, scalar, neon)" % isa)

    def one_round():
        decode, quant, infos, seen = [], [], [], set()
        for isa in isas:
            for fv, sg in itertools.product(versions, sgs):
                cmd = ([binp, "--contexts", a.contexts, "--format-version", str(fv), "--scale-group", str(sg)]
                       + (["--reps", "3"] if a.quick else []))
                env = dict(os.environ)
                env.pop("FMKV_CPU_ISA", None)
                if isa != "best":
                    env["FMKV_CPU_ISA"] = isa
                print("running", ("FMKV_CPU_ISA=%s " % isa if isa != "best" else "") + " ".join(cmd), flush=True)
                lines = [json.loads(l) for l in subprocess.check_output(cmd, text=True, env=env).splitlines()
                         if l.startswith("{")]
                info = next(l for l in lines if l["op"] == "info")
                got = info["device"].split("(")[-1].split(",")[0]  # "AMD EPYC (avx2, 2 threads)" -> avx2
                if isa != "best" and got != isa:
                    print("  (%s is not available here: the library ran %s; skipped)" % (isa, got))
                    continue
                if (got, fv, sg) in seen:
                    print("  (%s, format %d, scale group %d already measured; skipped)" % (got, fv, sg))
                    continue
                seen.add((got, fv, sg))
                info_end = next((l for l in lines if l["op"] == "info_end"), {})
                info["loadavg_start_end"] = [info.get("loadavg"), info_end.get("loadavg")]
                infos.append(info)
                for l in lines:
                    l["isa"], l["device"] = got, info["device"]
                    l["loadavg_start_end"] = info["loadavg_start_end"]
                decode += [l for l in lines if l["op"] == "decode_attention"]
                quant += [l for l in lines if l["op"].startswith("quantize_append")]
        if not infos:
            sys.exit("no requested kernel set ran")
        shapes = sorted({(l["q_heads"], l["kv_heads"], l["head_dim"], l["context"]) for l in decode})
        tt, tver = torch_times(shapes, threads, a.quick)
        return decode, quant, infos, tt, tver

    rounds = [one_round() for _ in range(a.rounds)]
    decode, quant, infos, tt, tver = rounds[0]
    info = infos[0]
    load = [i["loadavg_start_end"] for r in rounds for i in r[2]]
    device, rev = info["device"].split(" (")[0], commit()

    def key(l):
        return (l["isa"], l["format_version"], l.get("scale_group", 32), l["q_heads"], l["kv_heads"], l["head_dim"],
                l["context"], l["k_bits"], l["v_bits"])

    med = statistics.median
    rows_d, rows_q = [], []
    for l in decode:
        shape = (l["q_heads"], l["kv_heads"], l["head_dim"], l["context"])
        per = []  # this case in every round: (fmkv time, its round's SDPA times)
        for dec, _, _, tt_r, _ in rounds:
            same = [x for x in dec if key(x) == key(l)]
            if same:
                per.append((same[0], tt_r[shape]))
        fm = med([x["time_us"] for x, _ in per])
        t32, t16 = med([t["fp32"][0] for _, t in per]), med([t["bf16"][0] for _, t in per])
        best = "bf16" if t16 < t32 else "fp32"
        ratios = [min(t["fp32"][0], t["bf16"][0]) / x["time_us"] for x, t in per]
        t = tt[shape]
        r = {k: l.get(k) for k in FIELDS}
        r.update(time_us=round(fm, 1), gbps=round(med([x["gbps"] for x, _ in per]), 3),
                 pct_copy_bw=round(med([x["pct_copy_bw"] for x, _ in per]), 2),
                 copy_gbps=round(med([x["copy_gbps"] for x, _ in per]), 2))
        r.update(suite="cpu_decode", backend="cpu", device=l["device"], commit=rev, format_version=l["format_version"], scale_group=l.get("scale_group", 32),
                 isa=l["isa"],
                 baseline="torch_sdpa_%s_%s" % (best, t[best][1]), baseline_time_us=round(min(t32, t16), 1),
                 speedup=round(med(ratios), 3))
        r.update(threads=l["threads"], torch_version=tver, torch_fp32_time_us=round(t32, 1),
                 torch_bf16_time_us=round(t16, 1), speedup_vs_fp32=round(med([t["fp32"][0] / x["time_us"] for x, t in per]), 3),
                 cpu_us=l.get("cpu_us"), loadavg_start_end=l["loadavg_start_end"])
        if a.rounds > 1:
            r.update(rounds=len(per), speedup_min=round(min(ratios), 3), speedup_max=round(max(ratios), 3))
        rows_d.append(r)
    for l in quant:
        r = {k: l.get(k) for k in FIELDS}
        r.update(suite="cpu_quantize", backend="cpu", device=l["device"], commit=rev, format_version=l["format_version"], scale_group=l.get("scale_group", 32),
                 isa=l["isa"], baseline=None,
                 baseline_time_us=None, speedup=None, threads=l["threads"], gbps_per_core=l["gbps_per_core"],
                 input_dtype="f32", loadavg_start_end=l["loadavg_start_end"],
                 note="bytes = fp32 K+V input; quantize_append_api includes the C API's per-value input validation")
        rows_q.append(r)

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cpu_decode.jsonl"), "w") as f:
        for r in rows_d:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(a.out, "cpu_quantize.jsonl"), "w") as f:
        for r in rows_q:
            f.write(json.dumps(r) + "\n")

    print("\ndevice: %s   copy bandwidth (read+write, per run): %s GB/s   torch %s, %d threads   load avg %s" %
          (device, ", ".join("%.2f" % i["copy_gbps"] for i in infos), tver, threads, load))
    print("%-12s %-6s %-3s %-3s %-5s %7s %10s %8s %7s %10s %10s %8s %8s%s" %
          ("shape", "isa", "fv", "sg", "fmt", "ctx", "fmkv_us", "GB/s", "%copy", "sdpa32_us", "sdpa16_us", "x_fp32", "x_best",
           "  x_best range (%d rounds)" % a.rounds if a.rounds > 1 else ""))
    for r in rows_d:
        print("%-12s %-6s %-3d %-3d %-5s %7d %10.1f %8.2f %7.1f %10.1f %10.1f %8.2f %8.2f%s" %
              ("%dq/%dkv d%d" % (r["q_heads"], r["kv_heads"], r["head_dim"]), r["isa"], r["format_version"], r["scale_group"],
               "k%dv%d" % (r["k_bits"], r["v_bits"]), r["context"], r["time_us"], r["gbps"], r["pct_copy_bw"],
               r["torch_fp32_time_us"], r["torch_bf16_time_us"], r["speedup_vs_fp32"], r["speedup"],
               "  %.2f-%.2f" % (r["speedup_min"], r["speedup_max"]) if "speedup_min" in r else ""))
    print("\n%-20s %-6s %-3s %-3s %-5s %10s %8s %10s" % ("quantize (4096 tok)", "isa", "fv", "sg", "fmt", "time_us", "GB/s",
                                                        "GB/s/core"))
    for r in rows_q:
        print("%-20s %-6s %-3d %-3d %-5s %10.1f %8.3f %10.3f" % (r["op"], r["isa"], r["format_version"], r["scale_group"],
                                                         "k%dv%d" % (r["k_bits"], r["v_bits"]), r["time_us"],
                                                         r["gbps"], r["gbps_per_core"]))

    plot(rows_d, os.path.join(a.out, "cpu_decode.png"))


def plot(rows_d, png):
    """One panel per (geometry, ISA): fmkv decode time per format (version 3 solid, 2 dashed) and torch SDPA."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install matplotlib): no plot")
        return
    geoms = sorted({(r["q_heads"], r["kv_heads"], r["head_dim"]) for r in rows_d}, reverse=True)
    isas = sorted({r.get("isa", "?") for r in rows_d}, reverse=True)
    fig, axes = plt.subplots(len(isas), len(geoms), figsize=(6 * len(geoms), 4.2 * len(isas)), squeeze=False)
    colors = {(4, 4): "C0", (3, 3): "C3", (2, 2): "C2", (16, 4): "C4"}
    for row, isa in enumerate(isas):
        for ax, g in zip(axes[row], geoms):
            rs = [r for r in rows_d if (r["q_heads"], r["kv_heads"], r["head_dim"]) == g and r.get("isa", "?") == isa]
            key = lambda r: (r["k_bits"], r["v_bits"], r.get("format_version", 2), r.get("scale_group", 32))
            keys = {key(r) for r in rs}
            for (kb, vb, fv, sg) in sorted(keys, reverse=True):
                if fv >= 3 and 3 not in (kb, vb) and (kb, vb, 2, sg) in keys:
                    continue  # version 3 changes only 3-bit sections: those rows repeat version 2's (a noise check)
                pts = sorted((r["context"], r["time_us"]) for r in rs if key(r) == (kb, vb, fv, sg))
                ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts],
                        ":" if sg != 32 else "o-" if fv >= 3 else "s--", marker="^" if sg != 32 else None,
                        color=colors.get((kb, vb)), lw=1.2, ms=4,
                        label="fmkv k%dv%d, format %d" % (kb, vb, fv) + (", scale group %d" % sg if sg != 32 else ""))
            for key, style in (("torch_fp32_time_us", "k--"), ("torch_bf16_time_us", "k:")):
                pts = sorted({(r["context"], r[key]) for r in rs})
                ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], style, label="torch SDPA " + key.split("_")[1])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode attention time (ms, median)")
            ax.set_title("%dq/%dkv d=%d, batch 1, q_len 1, %s" % (g + (isa,)), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    device = rows_d[0]["device"].split(" (")[0] if rows_d else ""
    fig.suptitle("fmkv CPU backend vs torch SDPA, 2 threads: %s" % device, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print("\nwrote", png)


if __name__ == "__main__":
    main()

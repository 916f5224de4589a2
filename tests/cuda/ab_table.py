#!/usr/bin/env python3
"""Same-run A/B table of fmkv_cuda_bench results (the docs/history/results/cuda_ab_*.jsonl files written by
tests/cuda/ab.sh): one line per case, best (minimum) time per variant, and base / variant ratios.

    python3 tests/cuda/ab_table.py docs/history/results/cuda_ab_window_second_cta.jsonl [--base VARIANT]

Input lines: {"variant": name, "r": <a "decode", "step" or "quantize" line of fmkv_cuda_bench>}. A step
line gives two cases (fused and separate); a quantize line (a prefill chunk's quantize-append) is keyed by
its token count. Cases are keyed by format version too. The base is the first variant seen unless --base names one.
"""
import argparse
import collections
import json


def cases(path):
    """{case key: {variant: [times]}}, variants in order of appearance."""
    table, order = collections.defaultdict(lambda: collections.defaultdict(list)), []
    for line in open(path):
        if not line.strip():
            continue
        rec = json.loads(line)
        v, r = rec["variant"], rec["r"]
        if v not in order:
            order.append(v)
        fmt = "f%d" % r.get("format_version", 2)  # lines before the field existed are format 2
        if r["kind"] == "quantize":
            table[("quantize", "k%dv%d" % (r["k_bits"], r["v_bits"]), fmt, r["tokens"], r.get("head_dim", 128))][v].append(r["time_us"])
            continue
        key = (r["kind"], "k%dv%d" % (r["k_bits"], r["v_bits"]), fmt, r["batch"], r["context"], r.get("window", 0))
        if r.get("kv_heads", 8) != 8:  # FMKV_BENCH_KV_HEADS runs (the default shape has 8)
            key += ("kv%d" % r["kv_heads"],)
        if r.get("q_len", 1) != 1:  # FMKV_BENCH_Q_LEN runs
            key += ("q%d" % r["q_len"],)
        if r.get("head_dim", 128) != 128:  # FMKV_BENCH_HEAD_DIM runs
            key += ("d%d" % r["head_dim"],)
        if r.get("scale_group", 32) != 32:  # scale group 64 (FMKV_BENCH_SCALE_GROUP, --formats kb:vb:64)
            key += ("g%d" % r["scale_group"],)
        if r.get("case") == "ragged":  # --ragged runs: context is the mean length
            key += ("ragged:" + r["lengths_spec"],)
        if r["kind"] == "decode":
            table[key][v].append(r["time_us"])
        else:
            table[key + ("fused",)][v].append(r["fused_us"])
            table[key + ("separate",)][v].append(r["separate_us"])
    return table, order


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--base")
    a = ap.parse_args()
    table, order = cases(a.jsonl)
    base = a.base or order[0]
    others = [v for v in order if v != base]
    w = max([12] + [len(v) for v in order])
    print("%-46s %*s" % ("case (kind widths format B context window [kvH] [qN] [step])", w, base) +
          "".join(" %*s %7s" % (w, v, "ratio") for v in others))
    for key in sorted(table, key=str):
        row = table[key]
        if base not in row:
            continue
        b = min(row[base])
        line = "%-46s %*.2f" % (" ".join(str(x) for x in key), w, b)
        for v in others:
            line += " %*.2f %7.3f" % (w, min(row[v]), b / min(row[v])) if v in row else " %*s %7s" % (w, "-", "-")
        print(line)


if __name__ == "__main__":
    main()

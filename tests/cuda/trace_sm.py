#!/usr/bin/env python3
"""Where the split CTAs of one decode call ran, and how long their tile loops took, by SM.

    FMKV_TRACE_CTAS=ctas.jsonl fmkv_cuda_bench --trace 1 131072 3 3     (a -DFMKV_CUDA_TRACE=ON build)
    python3 tests/cuda/trace_sm.py ctas.jsonl [--label attention] [--context 131072]

Reads the per-CTA lines fmkv_cuda_bench writes when FMKV_TRACE_CTAS is set (SM id, entry / exit, the
phases in us from the CTA's entry) and prints, for the split CTAs of each traced call: the loop time
(phase 6 - phase 4: first tile landed .. loop done) by the number of split CTAs that shared the SM,
the spread within an SM against the spread between SMs, the SMs whose last CTA left last, and the
slowest SM pairs (TPCs). Answers whether the spread of equal-work CTAs is per SM (placement, a slower
SM: dynamic tile scheduling would balance it) or within each SM (the SM's issue rate shared unevenly
by its CTAs: then the time follows the largest number of CTAs any SM holds). At 59a4426 the latter
(docs/history/cuda-split-count.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def summarize(rows, out=None):
    out = out or sys.stdout
    split = [r for r in rows if r["role"] == "split" and r["kernel"] == 0 and "6" in r["phase_us"]]
    if not split:
        print("no split CTAs with a tile loop in these rows", file=out)
        return {}
    loop = {r["cta"]: r["phase_us"]["6"] - r["phase_us"].get("4", 0.0) for r in split}
    by_sm = defaultdict(list)
    for r in split:
        by_sm[r["sm"]].append(r)
    lt = list(loop.values())
    print(f"{len(split)} split CTAs on {len(by_sm)} SMs; loop us min/median/p90/max "
          f"{min(lt):.1f} / {statistics.median(lt):.1f} / {pct(lt, 0.9):.1f} / {max(lt):.1f}", file=out)
    by_count = defaultdict(list)
    for sm, rs in by_sm.items():
        for r in rs:
            by_count[len(rs)].append(loop[r["cta"]])
    for n in sorted(by_count):
        v = by_count[n]
        print(f"  SMs holding {n} split CTAs: {len(v) // n:3d} SMs, loop us median {statistics.median(v):.1f} "
              f"(min {min(v):.1f}, max {max(v):.1f})", file=out)
    # Within-SM spread vs across-SM spread: if SMs differ, CTAs of one SM are alike.
    sm_mean = {sm: statistics.mean(loop[r["cta"]] for r in rs) for sm, rs in by_sm.items()}
    within = [abs(loop[r["cta"]] - sm_mean[sm]) for sm, rs in by_sm.items() for r in rs]
    across = [abs(m - statistics.mean(sm_mean.values())) for m in sm_mean.values()]
    print(f"  mean |CTA - its SM's mean| {statistics.mean(within):.2f} us; mean |SM mean - all| "
          f"{statistics.mean(across):.2f} us", file=out)
    last = sorted(((max(r["exit_us"] for r in rs), sm, len(rs)) for sm, rs in by_sm.items()), reverse=True)
    print("  last SMs to finish (exit us, sm, CTAs): " +
          ", ".join(f"{e:.1f}/{sm}/{n}" for e, sm, n in last[:8]), file=out)
    print("  first SMs to finish: " + ", ".join(f"{e:.1f}/{sm}/{n}" for e, sm, n in last[-4:]), file=out)
    tpc = defaultdict(list)
    for sm, m in sm_mean.items():
        tpc[sm // 2].append(m)
    slow = sorted(((statistics.mean(v), t) for t, v in tpc.items()), reverse=True)
    print("  slowest TPCs (mean loop us, tpc): " + ", ".join(f"{m:.1f}/{t}" for m, t in slow[:6]), file=out)
    # split CTAs sharing their SM with a sink/window or fused-step CTA of the same call, against the rest
    other_sms = {r["sm"] for r in rows if r["kernel"] == 0 and r["role"] in ("fused", "fp16_part")}
    if other_sms:
        for name, grp in (("sharing an SM with a sink/window or fused CTA", [r for r in split if r["sm"] in other_sms]),
                          ("on the other SMs", [r for r in split if r["sm"] not in other_sms])):
            if grp:
                pro = [r["phase_us"].get("4", 0.0) for r in grp]
                ex = [r["exit_us"] for r in grp]
                print(f"  split CTAs {name}: {len(grp)}, entry to phase 4 (Q ready) us median / max "
                      f"{statistics.median(pro):.2f} / {max(pro):.2f}, exit us median / max "
                      f"{statistics.median(ex):.2f} / {max(ex):.2f}", file=out)
    entry = [r["entry_us"] for r in split]
    print(f"  entry us min/median/max {min(entry):.1f} / {statistics.median(entry):.1f} / {max(entry):.1f}", file=out)
    return {"ctas": len(split), "sms": len(by_sm), "loop_median": statistics.median(lt), "loop_max": max(lt),
            "within": statistics.mean(within), "across": statistics.mean(across)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--label", default=None)
    ap.add_argument("--context", type=int, default=None)
    a = ap.parse_args(argv)
    for key, rows in calls(a.path):
        label, b, ctx, bits = key
        if (a.label and label != a.label) or (a.context and ctx != a.context):
            continue
        print(f"== {label} B={b} context={ctx} {bits}")
        summarize(rows)


def calls(path):
    """[(key, rows)] per traced call, in file order: fmkv_cuda_bench appends each call's CTAs in grid
    order (kernel 0, then the merge), so a call starts where (kernel, cta) stops increasing."""
    out, prev = [], None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            key = (r["label"], r["batch"], r["context"], f"k{r.get('k_bits', '?')}v{r.get('v_bits', '?')}")
            pos = (r["kernel"], r["cta"])
            if prev is None or key != prev[0] or pos <= prev[1]:
                out.append((key, []))
            out[-1][1].append(r)
            prev = (key, pos)
    return out


if __name__ == "__main__":
    main()

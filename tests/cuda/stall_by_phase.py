#!/usr/bin/env python3
"""Where the decode tile loop's warps stall, by phase and by instruction, from ncu's source page.

    ncu --kernel-name regex:attn_kernel --launch-skip 3 --launch-count 1 --section SourceCounters \
        --section WarpStateStats -o rep fmkv_cuda_bench --only 1 131072 3 3
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 tests/cuda/stall_by_phase.py src.csv [--prologue N]

The tile loop is the shortest backward branch whose body holds at least 8 HMMA. Phases (heuristic,
by the loop's landmarks): loop top (page entries, copies, waits) up to 30 instructions before the
first HMMA; K decode + mma up to the 8th HMMA; scales + softmax up to the VOTE of the running-max
test; V decode + mma to the end. Percentages are of all warp-state samples of the kernel. Also the
samples before the loop (prologue: batch arrays, checks, Q rotation, first copies), in it and after it
(combine, partial stores); --prologue N lists the prologue's N most sampled instructions."""
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tile_loop_check import loop_span  # noqa: E402


def reasons_of(seg, tot, n):
    """(share of all samples in %, the n most frequent stall reasons as 'reason points')"""
    c = collections.Counter()
    for x in seg:
        c.update(x[3])
    return 100 * sum(x[2] for x in seg) / tot, ", ".join("%s %.1f" % (k[6:], 100 * v / tot) for k, v in c.most_common(n))


def print_top(seg, n, tot):
    for x in sorted(seg, key=lambda x: -x[2])[:n]:
        reasons = ", ".join("%s %d" % (k[6:], v) for k, v in sorted(x[3].items(), key=lambda kv: -kv[1])[:3] if v)
        print("%6x %5.2f%%  %-50s %s" % (x[0] & 0xfffff, 100 * x[2] / tot, x[1][:50], reasons))


def main(path, n_prologue=0):
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    ins = []
    for r in rows[2:]:
        if len(r) < len(hdr):
            continue
        try:
            a = int(r[ix["Address"]], 16)
        except ValueError:
            continue
        ins.append((a, r[ix["Source"]], int(r[ix["Warp Stall Sampling (All Samples)"]] or 0),
                    {k: int(r[ix[k]] or 0) for k in stall_cols}))
    tot = sum(x[2] for x in ins) or 1
    loop = loop_span(ins, min_hmma=8)
    if loop is None:
        sys.exit("no tile loop (a backward branch over >= 8 HMMA) in " + path)
    print("kernel instructions %d, warp-state samples %d" % (len(ins), tot))
    print("tile loop: %d instructions, %.1f%% of the samples" % (len(loop), 100 * sum(x[2] for x in loop) / tot))
    every = collections.Counter()
    for x in ins:
        every.update(x[3])
    print("all samples: " + ", ".join("%s %.1f%%" % (k[6:], 100 * v / tot) for k, v in every.most_common(10)))
    a0, a1 = loop[0][0], loop[-1][0]
    parts = [("prologue", [x for x in ins if x[0] < a0]), ("tile loop", loop), ("after the loop", [x for x in ins if x[0] > a1])]
    for name, seg in parts:
        share, reasons = reasons_of(seg, tot, 8)
        print("%-14s %5d instructions %5.1f%% of samples: %s" % (name, len(seg), share, reasons))
    if n_prologue:
        print("top %d prologue instructions (address offset, share, SASS, main reasons):" % n_prologue)
        print_top(parts[0][1], n_prologue, tot)
    hm = [i for i, x in enumerate(loop) if "HMMA" in x[1]]
    vote = [i for i, x in enumerate(loop) if "VOTE" in x[1]]
    k0 = max(0, hm[0] - 30)
    v0 = vote[0] if vote else hm[8]
    phases = [("loop top (entries, copies, waits)", loop[:k0]), ("K decode + mma", loop[k0:hm[7] + 1]),
              ("scales + softmax", loop[hm[7] + 1:v0 + 1]), ("V decode + mma", loop[v0 + 1:])]
    for name, seg in phases:
        share, reasons = reasons_of(seg, tot, 6)
        print("%-34s %4d instructions %5.1f%% of samples  %s" % (name, len(seg), share, reasons))
    print("top 25 instructions of the loop by samples (address offset, share, SASS, main reasons):")
    print_top(loop, 25, tot)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 4) or (len(sys.argv) == 4 and sys.argv[2] != "--prologue"):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[3]) if len(sys.argv) == 4 else 0)

#!/usr/bin/env python3
"""Timeline of one short decode call from the CUDA latency trace (the JSON lines of
tests/cuda/trace.sh): per CTA role, the median time of each phase stacked from the role's
median entry, for the attention call and the fused decode step of one (batch, context).

    python3 bench/plot_trace.py docs/history/results/cuda_trace_56cfcc1.jsonl --batch 1 --context 4096 --out docs/history/results/cuda_trace_4k_56cfcc1.png
"""
import argparse
import json

# phase names per role (FMKV_TRACE numbering in src/cuda/decode_attention.cuh and fused_step.cuh; phase
# i = time since the previous recorded phase). The fused role's numbering is that of the validation
# overlapped with the compression (cuda_trace.jsonl); the traces of 77254d1 and 6206e0c had
# 3 = validation, 4 = compression.
PHASES = {
    "split": {1: "wait + error word", 2: "sequence arrays", 3: "code tables", 4: "tile prologue + Q",
              5: "first tile lands", 6: "tiles", 7: "combine + partials"},
    "fused": {1: "wait + error word", 2: "sequence arrays", 3: "loads issued + compression", 4: "validation",
              5: "ring writes", 6: "fp16 part", 7: "exit"},
    "fp16_part": {1: "wait + error word", 2: "sequence arrays", 7: "fp16 part"},
    "merge": {1: "wait for attention", 2: "(m, l) loads", 3: "partial loads", 7: "un-rotate + store"},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    recs = [json.loads(l) for l in open(a.trace) if l.startswith("{")]
    recs = [r for r in recs if r.get("kind") == "trace" and r["batch"] == a.batch and r["context"] == a.context]
    if not recs:
        raise SystemExit("no trace records for batch %d context %d in %s" % (a.batch, a.context, a.trace))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [l for l in ("attention", "fused_step") if any(r["label"] == l for r in recs)]
    fig, axes = plt.subplots(len(labels), 1, figsize=(11, 2.2 + 1.1 * len(labels) * 2), squeeze=False)
    cmap = plt.get_cmap("tab20")
    names = sorted({n for p in PHASES.values() for n in p.values()})
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    used = set()
    for ax, label in zip(axes[:, 0], labels):
        rows = [r for r in recs if r["label"] == label and r["role"] in PHASES]
        rows.sort(key=lambda r: ["split", "fp16_part", "fused", "merge"].index(r["role"]))
        for y, r in enumerate(rows):
            t = r["entry_us"][1]
            for key, (med, _lo, _hi) in sorted(((int(k), (v[1], v[0], v[2])) for k, v in r["phase_us"].items())):
                name = PHASES[r["role"]].get(key, str(key))
                ax.barh(y, med, left=t, color=color[name], edgecolor="white",
                        label=name if name not in used else None)
                used.add(name)
                t += med
            ax.plot([r["exit_us"][2]], [y], "k|", markersize=14)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(["%s (%d CTAs)" % (r["role"], r["ctas"]) for r in rows])
        ax.set_title("%s, k3v3 B=%d context %d: median phases from median entry; | = last exit" %
                     (label.replace("_", " "), a.batch, a.context), fontsize=10)
        ax.set_xlabel("µs from the first attention CTA's entry")
        ax.grid(axis="x", alpha=0.3)
    handles, lbls = [], []
    for ax in axes[:, 0]:
        h, l = ax.get_legend_handles_labels()
        handles += h
        lbls += l
    fig.legend(handles, lbls, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(a.out, dpi=120)
    print("wrote", a.out)


if __name__ == "__main__":
    main()

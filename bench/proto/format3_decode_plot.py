"""Plot of the format-3 real-loop A/B (bench/proto/format3_decode_ab.sh's ab.jsonl): the share of measured copy
bandwidth of format 2's k3v3 decode and of the format-3 candidate per case (best of the rounds), k4v4 beside.

    python bench/proto/format3_decode_plot.py docs/history/results/format3_decode_loop.jsonl OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def best(path):
    b = {}
    for line in open(path):
        d = json.loads(line)
        r = d["r"]
        if r["kind"] != "decode" or r.get("window", 0):
            continue
        key = (d["variant"], r["k_bits"], r["batch"], r["context"], r["kv_heads"])
        if key not in b or r["time_us"] < b[key]["time_us"]:
            b[key] = r
    return b


def main(src, out):
    b = best(src)
    cases = sorted({k[2:] for k in b if k[0] == "tree" and k[1] == 3}, key=lambda c: (c[2] != 8, c[0], c[1]))
    label = lambda c: f"B={c[0]} {c[1] // 1024}k" + ("" if c[2] == 8 else f" kv{c[2]}")  # noqa: E731
    x = range(len(cases))
    w = 0.27
    series = [("format 2 k3v3", "tree", 3), ("format-3 candidate k3v3", "f3", 3), ("format 2 k4v4", "tree", 4)]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for i, (name, v, kb) in enumerate(series):
        ys = [b[(v, kb) + c]["pct_copy_bw"] if (v, kb) + c in b else 0 for c in cases]
        bars = ax.bar([j + (i - 1) * w for j in x], ys, w, label=name)
        for r, y in zip(bars, ys):
            if y:
                ax.text(r.get_x() + r.get_width() / 2, y + 0.6, f"{y:.0f}", ha="center", fontsize=7)
    ax.axhline(80, color="grey", ls="--", lw=0.8)
    ax.text(len(cases) - 0.6, 81, "target 80%", fontsize=7, ha="right", color="grey")
    ax.set_xticks(list(x))
    ax.set_xticklabels([label(c) for c in cases], fontsize=8)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title("H200 decode, 32 q / 8 kv heads, d=128, graph-captured, same run (bench/proto/format3_decode_ab.sh)",
                 fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

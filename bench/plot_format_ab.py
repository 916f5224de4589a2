"""Plot of a same-run format A/B of the CUDA decode (tests/cuda/check_tree.sh with AB_EXTRA and
AB_EXTRA_ENV=FMKV_BENCH_FORMAT_VERSION=3: variant "tree" is format 2, "env" format 3): the share of measured
copy bandwidth of each k3v3 decode case in both formats (best of the rounds), format 3's speed-up on top.

    python3 bench/plot_format_ab.py docs/results/cuda_format3_vs_format2.jsonl docs/results/cuda_format3_vs_format2.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def best(path):
    """(variant, case) -> the fastest decode record of the case; case = (batch, context, kv_heads, lengths)."""
    b = {}
    for line in open(path):
        d = json.loads(line)
        r = d["r"]
        if r["kind"] != "decode" or r.get("window", 0):
            continue
        key = (d["variant"], r["batch"], r["context"], r["kv_heads"], str(r.get("lengths", "")))
        if key not in b or r["time_us"] < b[key]["time_us"]:
            b[key] = r
    return b


def main(src, out):
    b = best(src)
    cases = sorted({k[1:] for k in b if k[0] == "tree"}, key=lambda c: (c[3] != "", c[2] != 8, c[0], c[1]))
    label = lambda c: ("ragged 16x1k-64k" if c[3] else f"B={c[0]} {c[1] // 1024}k") + ("" if c[2] == 8 else f" kv{c[2]}")  # noqa: E731
    fig, ax = plt.subplots(figsize=(9, 4.2))
    w = 0.38
    for i, (name, v) in enumerate((("format 2", "tree"), ("format 3", "env"))):
        ys = [b[(v,) + c]["pct_copy_bw"] if (v,) + c in b else 0 for c in cases]
        ax.bar([j + (i - 0.5) * w for j in range(len(cases))], ys, w, label=f"k3v3, {name}")
    for j, c in enumerate(cases):
        if ("tree",) + c in b and ("env",) + c in b:
            s = b[("tree",) + c]["time_us"] / b[("env",) + c]["time_us"]
            ax.text(j + w / 2, b[("env",) + c]["pct_copy_bw"] + 0.8, f"{s:.2f}x", ha="center", fontsize=7)
    ax.axhline(80, color="grey", ls="--", lw=0.8)
    ax.text(len(cases) - 0.6, 81, "target 80%", fontsize=7, ha="right", color="grey")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([label(c) for c in cases], fontsize=8)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title("H200 decode, 32 q / 8 kv heads, d=128, page 64, graph-captured, same run (format 3 / format 2 on top)",
                 fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

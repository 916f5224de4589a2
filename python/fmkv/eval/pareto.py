"""The bytes / quality Pareto front of measured configurations: fmkv against the other KV-cache quantizers.

Input rows are the JSON lines ``fmkv-eval ppl`` and ``fmkv-eval plan`` write (``suite`` "ppl" or
"plan-check"): a config name, ``bytes_per_token_per_head`` and the quality metrics ``ppl_ratio`` and ``kld``
(lower is better for both). Rows are compared only inside one *measurement set*: the same model, text,
context, token count, suite (``plan-check`` rows are measured on held-out windows, not the windows of a
``ppl`` run) and device (the model runs in float32 on a CPU, float16 on a GPU). Within a set each config keeps its last row.

For every budget B (bytes per token per kv head) the table names the best fmkv row and the best row of any
other quantizer with at most B bytes, and which of the two is better; a row is on the front when no other
row of its set is at most as large and strictly better (fp16, the reference, is not a row of the front).

    python -m fmkv.eval pareto docs/results/ppl.jsonl docs/results/ppl.format3.jsonl \
        --budgets 36:128:4 --out docs/results/pareto.jsonl
"""
from __future__ import annotations

import json
import math
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

METRICS = ("ppl_ratio", "kld")
_SET_KEYS = ("model", "text", "ctx", "tokens", "suite", "device")
_SUITES = ("ppl", "plan-check")


def quantizer_family(row: dict) -> str:
    """'fmkv', 'fp16' or the other quantizer's kind (kivi, quanto, turbo, fp8, ...)."""
    kind = row.get("options", {}).get("kind", "")
    if kind:
        return kind
    name = str(row["config"])
    if name.startswith("plan-") or re.match(r"k\d+v\d+", name):  # budget plans and fmkv widths (k<b>v<b>...)
        return "fmkv"
    return name.split("-")[0]


def set_key(row: dict) -> Tuple:
    return tuple(row.get(k) for k in _SET_KEYS)


def load_rows(paths: Sequence[str]) -> List[dict]:
    """The configuration rows of the given JSONL files (other suites, single-layer ablations and rows without
    the metrics are skipped). Raises ValueError naming the file and line of a line that is not JSON."""
    rows: List[dict] = []
    for path in paths:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
                if r.get("suite") not in _SUITES or "config" not in r:
                    continue
                if r.get("options", {}).get("only_layer", -1) >= 0:  # one layer quantized: an ablation
                    continue
                if not all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
                           for k in ("bytes_per_token_per_head",) + METRICS):
                    continue
                rows.append(r)
    return rows


def measurement_sets(rows: Iterable[dict]) -> Dict[Tuple, List[dict]]:
    """Rows grouped by measurement set; within a set the last row of each config name wins."""
    sets: Dict[Tuple, Dict[str, dict]] = {}
    for r in rows:
        sets.setdefault(set_key(r), {})[r["config"]] = r
    return {k: list(v.values()) for k, v in sets.items()}


def front(rows: Sequence[dict], metric: str) -> List[dict]:
    """The rows no other row dominates (at most as many bytes and strictly lower metric, or fewer bytes and an
    equal metric), sorted by bytes."""
    out = []
    for r in rows:
        b, m = r["bytes_per_token_per_head"], r[metric]
        if not any((o["bytes_per_token_per_head"] <= b and o[metric] < m)
                   or (o["bytes_per_token_per_head"] < b and o[metric] <= m) for o in rows if o is not r):
            out.append(r)
    return sorted(out, key=lambda r: (r["bytes_per_token_per_head"], r[metric]))


def best_within(rows: Sequence[dict], budget: float, metric: str) -> Optional[dict]:
    """The row with the lowest metric among those with at most `budget` bytes (fewer bytes break ties)."""
    fit = [r for r in rows if r["bytes_per_token_per_head"] <= budget + 1e-9]
    return min(fit, key=lambda r: (r[metric], r["bytes_per_token_per_head"])) if fit else None


def parse_budgets(text: str) -> List[float]:
    """'36,52,91' or 'LO:HI:STEP' (HI included); every budget finite and > 0."""
    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"budgets {text!r}: a range is LO:HI:STEP")
        lo, hi, step = (float(p) for p in parts)
        if not all(math.isfinite(v) for v in (lo, hi, step)) or step <= 0 or lo <= 0 or hi < lo:
            raise ValueError(f"budgets {text!r}: need 0 < LO <= HI and STEP > 0")
        n = int(math.floor((hi - lo) / step + 1e-9)) + 1
        if n > 10000:
            raise ValueError(f"budgets {text!r}: {n} budgets (at most 10000)")
        return [round(lo + i * step, 6) for i in range(n)]
    out = []
    for t in text.split(","):
        if not t.strip():
            continue
        v = float(t)
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"budget {t!r} must be finite and > 0")
        out.append(v)
    if not out:
        raise ValueError("no budgets given")
    return sorted(set(out))


def _brief(r: Optional[dict], metric: str) -> Optional[dict]:
    if r is None:
        return None
    return {"config": r["config"], "family": quantizer_family(r), "bytes": r["bytes_per_token_per_head"],
            metric: r[metric]}


def budget_table(rows: Sequence[dict], budgets: Sequence[float], metric: str) -> List[dict]:
    """Per budget: the best fmkv row, the best row of the other quantizers (fp16 excluded: it is the
    reference) and the winner ('fmkv', 'other', 'tie', or None when neither has a row that fits)."""
    mine = [r for r in rows if quantizer_family(r) == "fmkv"]
    others = [r for r in rows if quantizer_family(r) not in ("fmkv", "fp16")]
    out = []
    for b in budgets:
        f, o = best_within(mine, b, metric), best_within(others, b, metric)
        if f is None and o is None:
            win = None
        elif o is None or (f is not None and f[metric] < o[metric]):
            win = "fmkv"
        elif f is None or o[metric] < f[metric]:
            win = "other"
        else:
            win = "tie"
        out.append({"budget": b, "metric": metric, "fmkv": _brief(f, metric), "other": _brief(o, metric),
                    "winner": win})
    return out


def report(rows: Sequence[dict], budgets: Sequence[float]) -> List[dict]:
    """JSON rows: per measurement set and metric, the front and the budget table."""
    out = []
    for key, rs in sorted(measurement_sets(rows).items(), key=lambda kv: str(kv[0])):
        info = dict(zip(_SET_KEYS, key))
        quantized = [r for r in rs if quantizer_family(r) != "fp16"]  # fp16 is the reference (ratio 1, KLD 0)
        for metric in METRICS:
            fr = front(quantized, metric)
            out.append({"suite": "pareto-front", **{"set_" + k: v for k, v in info.items()}, "metric": metric,
                        "configs": len(rs), "front": [_brief(r, metric) for r in fr]})
            for t in budget_table(rs, budgets, metric):
                out.append({"suite": "pareto-budget", **{"set_" + k: v for k, v in info.items()}, **t})
    return out


def format_table(rep: Sequence[dict]) -> str:
    """The budget tables as text, one block per measurement set and metric."""
    lines: List[str] = []
    last = None
    for r in rep:
        if r["suite"] != "pareto-budget":
            continue
        head = (r["set_model"], r["set_text"], r["set_ctx"], r["set_tokens"], r["set_suite"], r["set_device"], r["metric"])
        if head != last:
            lines.append(f"\n{head[0]}, {head[1]}, ctx {head[2]}, {head[3]} tokens ({head[4]}, {head[5]}): {head[6]}")
            lines.append(f"{'budget':>7}  {'best fmkv':<28} {'':>9}  {'best other':<28} {'':>9}  winner")
            last = head
        m = r["metric"]

        def cell(x):
            return (f"{x['config'] + ' (%.4g B)' % x['bytes']:<28} {x[m]:>9.5g}" if x else f"{'-':<28} {'':>9}")

        lines.append(f"{r['budget']:>7.5g}  {cell(r['fmkv'])}  {cell(r['other'])}  {r['winner'] or '-'}")
    return "\n".join(lines).lstrip("\n")


def plot(rows: Sequence[dict], path: str, title: str = "") -> None:
    """One row of panels per measurement set (ppl ratio - 1, KLD; log axes): every config, the front as a step
    line. fp16, the reference, is not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted(measurement_sets(rows).items(), key=lambda kv: str(kv[0]))
    fig, axes = plt.subplots(len(sets), 2, figsize=(13, 4.8 * len(sets)), squeeze=False)
    styles = {"fmkv": ("o", "C0"), "kivi": ("s", "C1"), "quanto": ("^", "C2"), "turbo": ("D", "C3"),
              "fp8": ("P", "C4"), "fp16": ("*", "k")}
    for i, (key, rs) in enumerate(sets):
        info = dict(zip(_SET_KEYS, key))
        for j, metric in enumerate(METRICS):
            ax = axes[i][j]
            # the ppl ratio is drawn as its excess over fp16 (ratio - 1) so that 1.002 and 1.006 stay apart on a log axis
            yv = (lambda r: max(r[metric] - 1.0, 1e-5)) if metric == "ppl_ratio" else (lambda r: r[metric])
            shown = [r for r in rs if quantizer_family(r) != "fp16"]  # fp16 is the reference, not a point
            for fam in sorted({quantizer_family(r) for r in shown}):
                fr = [r for r in shown if quantizer_family(r) == fam]
                mk, col = styles.get(fam, ("x", "C5"))
                ax.scatter([r["bytes_per_token_per_head"] for r in fr], [yv(r) for r in fr], marker=mk,
                           color=col, s=22, label=fam, zorder=3, facecolors="none" if fam != "fmkv" else col)
            fr = front(shown, metric)
            if fr:
                xs = [r["bytes_per_token_per_head"] for r in fr]
                ys = [yv(r) for r in fr]
                ax.step(xs + [max(r["bytes_per_token_per_head"] for r in shown)], ys + [ys[-1]], where="post",
                        color="0.3", linewidth=1, label="front", zorder=2)
                for r in fr:
                    ax.annotate(r["config"], (r["bytes_per_token_per_head"], yv(r)), fontsize=6,
                                xytext=(3, 3), textcoords="offset points")
            ax.set_yscale("log")
            ax.set_xlabel("bytes per token per kv head (K+V; fp16 window amortised at ctx)")
            ax.set_ylabel(("perplexity / fp16 - 1" if metric == "ppl_ratio" else "KLD vs fp16") + " (log; lower is better)")
            ax.set_title(f"{info['model']}, {info['text']}, ctx {info['ctx']}, {info['tokens']} tokens "
                         f"({info['suite']}, {info['device']}): {metric}", fontsize=8)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

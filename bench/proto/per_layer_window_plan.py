"""Prototype: an fp16 window size per layer in the budget planner, predicted from stored sensitivities.

fmkv-eval plan (fmkv/eval/plan.py) chooses one window W for every layer and a (k_bits, v_bits) pair per layer.
Its sensitivity rows (suite "plan-sensitivity") hold, for every W of its menu, the KLD of quantizing only one
layer's K (or V) with that layer keeping W fp16 tokens -- which is also what a layer-specific window costs, so a
window per layer can be planned from the same rows: the same exact knapsack with options (k_bits, v_bits, W) per
layer, each costing its bytes with the window amortised over ctx (units of 1/64 byte: windows are multiples of
32 tokens and ctx 2048). Prints, per budget, the predicted KLD of the best single window and of windows per layer.
Prediction only (not built into the caches): docs/history/per-head-widths.md.

  python bench/proto/per_layer_window_plan.py docs/results/plan.jsonl --budgets 56,64,72,91
"""
import argparse
import json
import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

from fmkv import format as fmt
from fmkv.eval import plan as PL

UNIT = 64  # cost units per byte


def read_sensitivity(path: str) -> Tuple[Dict[Tuple[int, str, int], np.ndarray], int]:
    """{(W, side, bits): KLD per layer} of a plan JSONL's sensitivity rows, and the number of layers."""
    sens = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            if r.get("suite") == "plan-sensitivity" and "kld_per_layer" in r:
                sens[(int(r["window_tokens"]), r["side"], int(r["bits"]))] = np.asarray(r["kld_per_layer"], float)
    if not sens:
        raise SystemExit(f"{path}: no per-layer sensitivity rows")
    return sens, len(next(iter(sens.values())))


def plan(sens, layers: int, budget: float, windows: Sequence[int], k_menu=None, v_menu=None, d: int = 64,
         ctx: int = 2048):
    """(predicted KLD, bytes per token per head, [(k_bits, v_bits, W)] per layer) minimising the summed KLD, or
    None when nothing fits. Menus default to the format's widths (K also fp16)."""
    k_menu = tuple(k_menu or (*fmt.CODE_BITS, fmt.FP16_BITS))
    v_menu = tuple(v_menu or fmt.CODE_BITS)
    def kld(w, side, i, b):
        return 0.0 if b == 16 else float(sens[(w, side, b)][i])

    options = []
    for w in windows:
        for kb in k_menu:
            for vb in v_menu:
                q = PL.side_bytes(d, kb) + PL.side_bytes(d, vb)
                cost = (q * (ctx - w) + 4 * d * w) * UNIT / ctx
                if abs(cost - round(cost)) > 1e-9:
                    raise SystemExit(f"window {w}: not a whole number of 1/{UNIT} bytes at ctx {ctx}")
                options.append((int(round(cost)), kb, vb, w))
    slots = [[(c, kld(w, "k", i, kb) + kld(w, "v", i, vb), (kb, vb, w)) for c, kb, vb, w in options]
             for i in range(layers)]
    picks = PL._knapsack(slots, int(math.floor(budget * layers * UNIT + 1e-9)))
    if picks is None:
        return None
    return sum(p[1] for p in picks), sum(p[0] for p in picks) / UNIT / layers, [p[2] for p in picks]


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", help="a fmkv-eval plan JSONL with per-layer sensitivity rows")
    ap.add_argument("--budgets", default="56,64,72,91")
    a = ap.parse_args(argv)
    sens, layers = read_sensitivity(a.jsonl)
    windows = sorted({w for w, _, _ in sens})
    for budget in (float(b) for b in a.budgets.split(",")):
        single = [(r[0], w) for w in windows for r in [plan(sens, layers, budget, [w])] if r is not None]
        per = plan(sens, layers, budget, windows)
        if not single or per is None:
            print(f"{budget:g} B: nothing fits")
            continue
        best, w = min(single)
        chosen = {}
        for _, _, wl in per[2]:
            chosen[wl] = chosen.get(wl, 0) + 1
        print(f"{budget:g} B: one window ({w}) {best:.5f}; a window per layer {per[0]:.5f} ({per[0] / best - 1:+.1%}, "
              f"{per[1]:.2f} B; layers per window {dict(sorted(chosen.items()))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

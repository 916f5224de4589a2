"""Budget planner: the per-layer K/V bit widths and fp16 window that minimise the measured KLD at a byte budget.

    python -m fmkv.eval plan --budgets 56,60,64,72 --calib-tokens 8192 --check-tokens 131072 --device cuda

1. **Sensitivity** (calibration windows, the first ``calib_tokens`` of the text): for every fp16 window W of the
   menu, every layer i and every width b of the menus, the mean KL(fp16 || config) per token when only layer
   i's K (or only its V) is quantized at b bits and every other K/V stays fp16 -- ``sens[W][side][i][b]``.
2. **Allocation**: per budget, for each W, the (k_bits, v_bits) per layer minimising the sum of the layers'
   K and V sensitivities subject to the mean bytes per token per kv head (K + V over all layers, fp16 window
   tokens amortised over ``ctx`` as the ppl table counts them) <= the budget. A multiple-choice knapsack over
   integer bytes, solved exactly by dynamic programming. The W with the smallest predicted KLD wins.
3. **Check** (windows after the calibration text, never seen by steps 1-2): ppl ratio, KLD and top-1 of the
   plan next to every uniform configuration of the menus that fits the budget, so the plan is judged
   against the best uniform choice on the same held-out tokens.

The additive model (a layer's and a side's KLD add up) is an approximation; the check reports the plan's
measured KLD next to its prediction. The plan's ``layer_bits`` are what fmkv.hf.FmkvCache(layer_bits=...,
window_tokens=W) takes.
"""
from __future__ import annotations

import itertools
import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .quantizers import KVQuantizer


def planned_quantizer(name: str, layer_bits: Sequence[Tuple[int, int]], window: int, format_version: int = 0,
                      seed: int = 0) -> KVQuantizer:
    """An fmkv quantizer with one (k_bits, v_bits) per layer (16: that side of that layer in fp16)."""
    pairs = tuple((int(k), int(v)) for k, v in layer_bits)
    q = KVQuantizer(name, "fmkv", max(k for k, _ in pairs), max(v for _, v in pairs), residual=int(window),
                    format_version=int(format_version), layer_bits=pairs, seed=seed, num_layers=len(pairs))
    q.options = {"scale_rule": q.scale_rule, "rotation": True, "sink_tokens": 0, "window_tokens": int(window),
                 "group": 32, "layer_bits": [list(p) for p in pairs]}
    if format_version:
        q.options["format_version"] = int(format_version)
    return q


def load_plans(path: str, num_layers: int = 0, seed: int = 0) -> List[KVQuantizer]:
    """The budget plans of a `fmkv-eval plan` JSONL file (its rows with suite "plan") as quantizers named as the
    plan named them (plan-<budget>B), to evaluate them on other text. num_layers > 0: each plan must have that
    many layers (ValueError naming the plan otherwise)."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("suite") != "plan":
                continue
            bits = r.get("layer_bits")
            if isinstance(bits, str):
                bits = json.loads(bits)
            if not bits or any(len(p) != 2 for p in bits):
                raise ValueError(f"{path}:{i}: plan {r.get('config')!r} has no (k_bits, v_bits) pair per layer")
            if num_layers and len(bits) != num_layers:
                raise ValueError(f"{path}:{i}: plan {r.get('config')!r} has {len(bits)} layers, the model {num_layers}")
            out.append(planned_quantizer(str(r["config"]), bits, int(r.get("window_tokens", 0)),
                                         int(r.get("format_version", 0)), seed=seed))
    if not out:
        raise ValueError(f"{path}: no plan rows (suite 'plan'; write them with fmkv-eval plan)")
    return out


def sensitivity_configs(num_layers: int, k_menu: Sequence[int], v_menu: Sequence[int],
                        windows: Sequence[int]) -> Dict[str, Tuple[int, str, int, int]]:
    """{config name: (window, side, layer, bits)}: one quantizer per (W, side, layer, width < 16), every other
    K/V of the model in fp16."""
    out = {}
    for w in windows:
        for side, menu in (("k", k_menu), ("v", v_menu)):
            for i in range(num_layers):
                for b in menu:
                    if b == 16:
                        continue
                    name = f"sens-w{w}-{side}{b}-L{i}"
                    out[name] = (w, side, i, b)
    return out


def side_bytes(d: int, bits: int) -> int:
    """Bytes per token per kv head of one side at ``bits`` (16: fp16), the format's count."""
    if bits == 16:
        return 2 * d
    import fmkv

    return int(fmkv.bytes_per_token_head(d, bits))


def allocate(sens_k: np.ndarray, sens_v: np.ndarray, k_menu: Sequence[int], v_menu: Sequence[int], d: int,
             budget: float, window: int = 0, ctx: int = 2048) -> Optional[Tuple[List[Tuple[int, int]], float, float]]:
    """Exact minimum of sum_i sens_k[i, k_i] + sens_v[i, v_i] with mean bytes <= budget.

    sens_k [layers, len(k_menu)], sens_v [layers, len(v_menu)]: predicted KLD per choice (0 for fp16).
    Returns (layer_bits, predicted KLD, bytes per token per head at ctx), or None when nothing fits."""
    n = sens_k.shape[0]
    if window >= ctx:
        return None
    # mean quantized bytes q per layer allowed: (q (ctx - W) + 4 d W) / ctx <= budget
    q_max = (budget * ctx - 4.0 * d * window) / (ctx - window)
    cap = int(math.floor(q_max * n + 1e-9))
    if cap < 0:
        return None
    choices = [(kb, vb, side_bytes(d, kb) + side_bytes(d, vb)) for kb in k_menu for vb in v_menu]
    inf = float("inf")
    dp = np.full(cap + 1, inf)
    dp[0] = 0.0
    picks = []  # per layer: argmin choice index per total cost
    for i in range(n):
        new = np.full(cap + 1, inf)
        arg = np.full(cap + 1, -1, dtype=np.int64)
        for c, (kb, vb, cost) in enumerate(choices):
            if cost > cap:
                continue
            val = sens_k[i, list(k_menu).index(kb)] + sens_v[i, list(v_menu).index(vb)]
            cand = np.full(cap + 1, inf)
            cand[cost:] = dp[:cap + 1 - cost] + val
            better = cand < new
            new[better] = cand[better]
            arg[better] = c
        dp = new
        picks.append(arg)
    if not np.isfinite(dp).any():
        return None
    total = int(np.argmin(dp))
    best = float(dp[total])
    bits: List[Tuple[int, int]] = []
    for i in reversed(range(n)):
        c = int(picks[i][total])
        kb, vb, cost = choices[c]
        bits.append((kb, vb))
        total -= cost
    bits.reverse()
    q = sum(side_bytes(d, kb) + side_bytes(d, vb) for kb, vb in bits) / n
    return bits, best, (q * (ctx - window) + 4.0 * d * window) / ctx


def uniform_candidates(k_menu: Sequence[int], v_menu: Sequence[int], windows: Sequence[int], d: int, budget: float,
                       ctx: int) -> List[Tuple[str, float]]:
    """Uniform fmkv configs (every layer the same widths) of the menus that fit the budget, with their bytes."""
    out = []
    for kb, vb, w in itertools.product(k_menu, v_menu, windows):
        if kb == 16 and vb == 16:
            continue
        q = side_bytes(d, kb) + side_bytes(d, vb)
        b = (q * (ctx - w) + 4.0 * d * w) / ctx
        if b <= budget + 1e-9:
            out.append((f"k{kb}v{vb}" + (f"-w{w}" if w else ""), b))
    return out

"""Budget planner: the per-layer K/V bit widths and fp16 window that minimise the measured KLD at a byte budget.

    python -m fmkv.eval plan --budgets 56,60,64,72 --calib-tokens 8192 --check-tokens 131072 --device cuda

1. **Sensitivity** (calibration windows, the first ``calib_tokens`` of the text): for every fp16 window W (and
   sink count, ``--sinks``) of the menu, every layer i and every width b of the menus, the mean KL(fp16 || config) per token when only layer
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

Options of the command (fmkv.eval.cli): ``--per-head`` measures the sensitivity per (layer, kv head) and allocates
a pair per kv head (the plan's ``head_bits``, for FmkvCache(head_bits=...)); ``--max-groups G`` allows at most G
distinct pairs among a layer's heads (each is one more call per decode step); ``--from-sensitivity FILE`` reads the
sensitivity rows of an earlier run instead of measuring them; ``--memory SIZE --context N [--batch B]`` turns a
KV-cache size into the budget per token per kv head (fp16 windows then amortised over N tokens, and the plan's
bytes stated at N; the check rows keep the evaluation's ``--ctx``); ``--plans FILE`` checks stored plans on the
same held-out windows. ``--backend NAME`` plans only with the (k_bits, v_bits) pairs whose decode attention that
backend has in this build (:func:`attention_pairs`; a CUDA build compiles a grid of pairs); by default the backend
fmkv's torch ops use for ``--device`` (``cuda`` on a CUDA device; on the CPU the host backend, which has every pair),
``any`` for every pair of the menus.
"""
from __future__ import annotations

import itertools
import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import format as fmt
from .quantizers import KVQuantizer


def planned_quantizer(name: str, layer_bits: Sequence[Tuple[int, int]], window: int, format_version: int = 0,
                      seed: int = 0, head_bits: Optional[Sequence[Sequence[Tuple[int, int]]]] = None,
                      key_offset: bool = False, sinks: int = 0, scale_group: int = 0) -> KVQuantizer:
    """An fmkv quantizer with one (k_bits, v_bits) per layer (16: that side of that layer in fp16); with
    ``head_bits`` (a list of (k_bits, v_bits) per kv head for each layer) one pair per (layer, kv head), and
    ``layer_bits`` the per-layer maxima (what a cache that takes one width per layer would need). ``key_offset``:
    keys minus their mean over the first 128 tokens before quantizing (the caches' ``key_offset=True``); ``sinks``:
    the first tokens kept in fp16 (the caches' ``sink_tokens``); ``scale_group``: coordinates per fp16 scale (0: the
    format's default; the caches' ``scale_group``)."""
    heads = tuple(tuple((int(k), int(v)) for k, v in layer) for layer in head_bits) if head_bits else ()
    if heads:
        layer_bits = [(max(k for k, _ in layer), max(v for _, v in layer)) for layer in heads]
    pairs = tuple((int(k), int(v)) for k, v in layer_bits)
    q = KVQuantizer(name, "fmkv", max(k for k, _ in pairs), max(v for _, v in pairs), residual=int(window),
                    format_version=int(format_version), layer_bits=pairs, head_bits=heads, seed=seed,
                    num_layers=len(pairs), key_mean=bool(key_offset), sinks=int(sinks), scale_group=int(scale_group))
    q.options = {"scale_rule": q.scale_rule, "rotation": True, "sink_tokens": int(sinks), "window_tokens": int(window),
                 "group": fmt.GROUP_SIZE, "scale_group": fmt.resolved_scale_group(q.scale_group),
                 "layer_bits": [list(p) for p in pairs]}
    if heads:
        q.options["head_bits"] = [[list(p) for p in layer] for layer in heads]
    if format_version:
        q.options["format_version"] = int(format_version)
    if key_offset:
        q.options["key_offset"] = True
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
            heads = r.get("head_bits")
            if isinstance(heads, str):
                heads = json.loads(heads)
            if heads is not None:
                if (not heads or any(not layer or any(len(p) != 2 for p in layer) for layer in heads)
                        or len({len(layer) for layer in heads}) != 1):
                    raise ValueError(f"{path}:{i}: plan {r.get('config')!r} has no (k_bits, v_bits) pair per kv head "
                                     "in every layer (head_bits)")
                bits = [[max(p[0] for p in layer), max(p[1] for p in layer)] for layer in heads]
            if not bits or any(len(p) != 2 for p in bits):
                raise ValueError(f"{path}:{i}: plan {r.get('config')!r} has no (k_bits, v_bits) pair per layer")
            if num_layers and len(bits) != num_layers:
                raise ValueError(f"{path}:{i}: plan {r.get('config')!r} has {len(bits)} layers, the model {num_layers}")
            out.append(planned_quantizer(str(r["config"]), bits, int(r.get("window_tokens", 0)),
                                         int(r.get("format_version") or 0), seed=seed, head_bits=heads,
                                         key_offset=bool(r.get("key_offset", False)),
                                         sinks=int(r.get("sink_tokens", 0)), scale_group=int(r.get("scale_group") or 0)))
    if not out:
        raise ValueError(f"{path}: no plan rows (suite 'plan'; write them with fmkv-eval plan)")
    return out


def fp16_regions(windows: Sequence[int], sinks: Sequence[int] = (0,)) -> List[Tuple[int, int]]:
    """The (window, sinks) menu: every pair of an fp16 window size and a sink count."""
    return [(int(w), int(s)) for w in windows for s in sinks]


def sensitivity_configs(num_layers: int, k_menu: Sequence[int], v_menu: Sequence[int],
                        regions: Sequence[Tuple[int, int]], kv_heads: int = 0) -> Dict[str, tuple]:
    """{config name: ((window, sinks), side, layer, head, bits)}: one quantizer per (region, side, layer, width <
    16), every other K/V of the model in fp16; with ``kv_heads`` > 0 one per (region, side, layer, kv head, width)
    -- only that head's side quantized -- and head -1 otherwise. A region is a (window, sinks) pair
    (fp16_regions)."""
    out = {}
    for w, sk in regions:
        for side, menu in (("k", k_menu), ("v", v_menu)):
            for i in range(num_layers):
                for h in (range(kv_heads) if kv_heads else (-1,)):
                    for b in menu:
                        if b == 16:
                            continue
                        name = f"sens-w{w}" + (f"-s{sk}" if sk else "") + f"-{side}{b}-L{i}" + (f"-H{h}" if h >= 0 else "")
                        out[name] = ((w, sk), side, i, h, b)
    return out


def sensitivity_quantizer(name: str, num_layers: int, kv_heads: int, region: Tuple[int, int], side: str, layer: int,
                          head: int, bits: int, format_version: int = 0, seed: int = 0,
                          key_offset: bool = False, scale_group: int = 0) -> KVQuantizer:
    """The quantizer of one sensitivity config: ``side`` of ``layer`` (only kv head ``head`` when >= 0) at
    ``bits`` with the (window, sinks) ``region`` in fp16, every other K/V in fp16 (``key_offset``: the quantized keys
    minus their offset, as the plan's)."""
    pair = (bits, 16) if side == "k" else (16, bits)
    window, sinks = region
    if head < 0:
        layer_bits = [(16, 16)] * num_layers
        layer_bits[layer] = pair
        return planned_quantizer(name, layer_bits, window, format_version, seed, key_offset=key_offset, sinks=sinks,
                                 scale_group=scale_group)
    heads = [[(16, 16)] * kv_heads for _ in range(num_layers)]
    heads[layer][head] = pair
    return planned_quantizer(name, [], window, format_version, seed, head_bits=heads, key_offset=key_offset,
                             sinks=sinks, scale_group=scale_group)


def load_sensitivity(path: str, configs: Dict[str, tuple], k_menu: Sequence[int],
                     v_menu: Sequence[int], units: int, calib_tokens: int,
                     key_offset: bool = False, scale_group: int = 0) -> Tuple[Dict[tuple, np.ndarray], int]:
    """The sensitivity matrices ({((W, sinks), side): [units, menu]}) of every config of ``configs`` (sensitivity_configs)
    from the "plan-sensitivity" rows of an earlier plan JSONL, and their calibration token count (which must be
    ``calib_tokens``); rows measured with the key offset are used only with ``key_offset`` and the others only
    without it, and likewise rows of another scale group (``scale_group``, 0: the default) are not used; ValueError
    naming what is missing or different."""
    rows, other, other_sg = {}, 0, 0
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r.get("suite") == "plan-sensitivity":
                    if bool(r.get("key_offset", False)) != bool(key_offset):
                        other += 1
                        continue
                    if fmt.resolved_scale_group(int(r.get("scale_group") or 0)) != fmt.resolved_scale_group(int(scale_group)):
                        other_sg += 1
                        continue
                    rows[((int(r["window_tokens"]), int(r.get("sink_tokens", 0))), r["side"], int(r["bits"]))] = r
    if not rows:
        raise ValueError(f"{path}: no sensitivity rows (suite 'plan-sensitivity')" + (
            f"; its {other} rows were measured " + ("without" if key_offset else "with") + " the key offset"
            + (" (drop --key-offset)" if key_offset else " (pass --key-offset)") if other else "")
            + (f"; {other_sg} rows were measured with another scale group (--scale-group)" if other_sg else ""))
    per_head = any(h >= 0 for (_, _, _, h, _) in configs.values())
    out: Dict[tuple, np.ndarray] = {}
    counts = set()
    for w, side, i, h, b in configs.values():
        r = rows.get((w, side, b))
        if r is None:
            raise ValueError(f"{path}: no sensitivity of {side.upper()} at {b} bits with window {w[0]}"
                             + (f" and {w[1]} sinks" if w[1] else ""))
        vals = r.get("kld_per_head" if per_head else "kld_per_layer")
        if vals is None:
            raise ValueError(f"{path}: the rows are per " + ("layer; --per-head needs rows per kv head" if per_head
                                                              else "kv head; pass --per-head"))
        flat = np.asarray(vals, dtype=float).reshape(-1)
        if flat.size != units:
            raise ValueError(f"{path}: {flat.size} sensitivity entries per row, the model has {units}")
        menu = k_menu if side == "k" else v_menu
        m = out.setdefault((w, side), np.zeros((units, len(menu))))
        m[:, menu.index(b)] = np.maximum(flat, 0.0)
        counts.add(int(r["calib_tokens"]))
    if counts != {int(calib_tokens)}:
        raise ValueError(f"{path}: calibrated on {sorted(counts)} tokens, --calib-tokens gives {calib_tokens}")
    return out, int(calib_tokens)


def budget_from_memory(memory_bytes: float, context: int, num_layers: int, kv_heads: int, batch: int = 1) -> float:
    """Bytes per token per kv head (K + V, the planner's budget) that fit ``memory_bytes`` of KV cache for
    ``batch`` sequences of ``context`` tokens in a model of ``num_layers`` layers and ``kv_heads`` kv heads."""
    for what, v in (("memory", memory_bytes), ("context", context), ("layers", num_layers),
                    ("kv heads", kv_heads), ("batch", batch)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{what} must be a positive finite number, got {v!r}")
    return float(memory_bytes) / (float(context) * num_layers * kv_heads * batch)


def side_bytes(d: int, bits: int, scale_group: int = 0) -> int:
    """Bytes per token per kv head of one side at ``bits`` (16: fp16) with ``scale_group``, the format's count."""
    if bits == 16:
        return 2 * d
    import fmkv

    return int(fmkv.bytes_per_token_head(d, bits, scale_group))


def attention_pairs(backend: str, d: int, k_menu: Sequence[int], v_menu: Sequence[int], format_version: int = 0,
                    scale_group: int = 0) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]], str]:
    """The (k_bits, v_bits) pairs of the menus whose decode attention ``backend`` runs at head_dim ``d`` in this build
    (:func:`fmkv.check_attention`), the pairs it refuses, and the first refusal's message ('' when none). Raises
    ValueError when the backend cannot run caches of this head_dim / format version / scale group at all (not
    compiled, no device, an option it lacks)."""
    import fmkv

    def config(kb: int, vb: int) -> "fmkv.Config":
        return fmkv.Config(head_dim=d, k_bits=kb, v_bits=vb, format_version=format_version, scale_group=scale_group)

    try:
        fmkv.check_backend(backend, config(min(v_menu), min(v_menu)))
    except fmkv.FmkvError as e:
        raise ValueError(f"backend {backend}: {e}") from None
    ok, refused, why = [], [], ""
    for kb in k_menu:
        for vb in v_menu:
            try:
                fmkv.check_attention(backend, config(kb, vb))
                ok.append((kb, vb))
            except fmkv.FmkvError as e:
                refused.append((kb, vb))
                why = why or str(e)
    return ok, refused, why


def allocate(sens_k: np.ndarray, sens_v: np.ndarray, k_menu: Sequence[int], v_menu: Sequence[int], d: int,
             budget: float, window: int = 0, ctx: int = 2048, heads: int = 1,
             max_groups: int = 0, sinks: int = 0, scale_group: int = 0,
             pairs: Optional[Sequence[Tuple[int, int]]] = None) -> Optional[Tuple[List[Tuple[int, int]], float, float]]:
    """Exact minimum of sum_i sens_k[i, k_i] + sens_v[i, v_i] with mean bytes <= budget.

    sens_k [units, len(k_menu)], sens_v [units, len(v_menu)]: predicted KLD per choice (0 for fp16); a unit is a
    layer, or with ``heads`` > 1 a (layer, kv head), layer-major. ``max_groups`` (with heads > 1; 0: no limit): at
    most that many distinct (k_bits, v_bits) pairs among a layer's heads (each is a call per step: the decode-speed
    price of widths per head). ``window`` + ``sinks`` tokens are fp16 (4 d bytes each, amortised over ctx). Returns
    (bits per unit, predicted KLD, bytes per token per head at ctx), or None when nothing fits. ``pairs``: only these
    (k_bits, v_bits) pairs (:func:`attention_pairs`); None: every pair of the menus."""
    n = sens_k.shape[0]
    window = int(window) + int(sinks)  # fp16 tokens
    if window >= ctx or n % max(1, heads):
        return None
    # mean quantized bytes q per unit allowed: (q (ctx - F) + 4 d F) / ctx <= budget, F fp16 tokens
    q_max = (budget * ctx - 4.0 * d * window) / (ctx - window)
    cap = int(math.floor(q_max * n + 1e-9))
    if cap < 0:
        return None
    allowed = None if pairs is None else {(int(k), int(v)) for k, v in pairs}
    choices = [(kb, vb, side_bytes(d, kb, scale_group) + side_bytes(d, vb, scale_group)) for kb in k_menu for vb in v_menu
               if allowed is None or (kb, vb) in allowed]
    if not choices:
        return None
    value = np.array([[sens_k[u, list(k_menu).index(kb)] + sens_v[u, list(v_menu).index(vb)] for kb, vb, _ in choices]
                      for u in range(n)])
    if heads > 1 and 0 < max_groups < heads:
        slots = [_layer_options(value[L * heads:(L + 1) * heads], choices, max_groups) for L in range(n // heads)]
    else:
        slots = [[(cost, value[u, c], (c,)) for c, (_, _, cost) in enumerate(choices)] for u in range(n)]
    picks = _knapsack(slots, cap)
    if picks is None:
        return None
    flat = [c for p in picks for c in p[2]]
    bits = [(choices[c][0], choices[c][1]) for c in flat]
    best = float(sum(p[1] for p in picks))
    q = sum(choices[c][2] for c in flat) / n
    return bits, best, (q * (ctx - window) + 4.0 * d * window) / ctx


def _knapsack(slots: List[List[Tuple[int, float, tuple]]], cap: int) -> Optional[List[Tuple[int, float, tuple]]]:
    """Multiple-choice knapsack: one option (cost, value, payload) per slot, total cost <= cap, least total value
    (dynamic programming over integer costs, exact)."""
    inf = float("inf")
    dp = np.full(cap + 1, inf)
    dp[0] = 0.0
    args = []
    for options in slots:
        new = np.full(cap + 1, inf)
        arg = np.full(cap + 1, -1, dtype=np.int64)
        for o, (cost, val, _) in enumerate(options):
            if cost > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[cost:] = dp[:cap + 1 - cost] + val
            better = cand < new
            new[better] = cand[better]
            arg[better] = o
        dp = new
        args.append(arg)
    if not np.isfinite(dp).any():
        return None
    total = int(np.argmin(dp))
    out = []
    for options, arg in zip(reversed(slots), reversed(args)):
        o = options[int(arg[total])]
        out.append(o)
        total -= o[0]
    return out[::-1]


def _layer_options(value: np.ndarray, choices: Sequence[Tuple[int, int, int]], max_groups: int
                   ) -> List[Tuple[int, float, tuple]]:
    """One layer's assignments of a choice to each of its heads using at most ``max_groups`` distinct choices: for
    every total cost the least summed value (the cheapest-first Pareto front), exact (every set of <= max_groups
    choices, a small knapsack over the heads within each set)."""
    heads = value.shape[0]
    best: Dict[int, Tuple[float, tuple]] = {}
    for r in range(1, max_groups + 1):
        for subset in itertools.combinations(range(len(choices)), r):
            states: Dict[int, Tuple[float, tuple]] = {0: (0.0, ())}
            for h in range(heads):
                nxt: Dict[int, Tuple[float, tuple]] = {}
                for cost, (val, picks) in states.items():
                    for c in subset:
                        k, v = cost + choices[c][2], val + value[h, c]
                        if k not in nxt or v < nxt[k][0]:
                            nxt[k] = (v, picks + (c,))
                states = nxt
            for cost, (val, picks) in states.items():
                if cost not in best or val < best[cost][0]:
                    best[cost] = (val, picks)
    front, low = [], float("inf")
    for cost in sorted(best):
        val, picks = best[cost]
        if val < low:
            front.append((cost, val, picks))
            low = val
    return front


def uniform_candidates(k_menu: Sequence[int], v_menu: Sequence[int], regions: Sequence[Tuple[int, int]], d: int,
                       budget: float, ctx: int, scale_group: int = 0,
                       pairs: Optional[Sequence[Tuple[int, int]]] = None) -> List[Tuple[str, float]]:
    """Uniform fmkv configs (every layer the same widths) of the menus (only ``pairs`` when given) and (window, sinks)
    regions that fit the budget, with their bytes."""
    out = []
    allowed = None if pairs is None else {(int(k), int(v)) for k, v in pairs}
    for kb, vb, (w, sk) in itertools.product(k_menu, v_menu, regions):
        if kb == 16 and vb == 16 or (allowed is not None and (kb, vb) not in allowed):
            continue
        q = side_bytes(d, kb, scale_group) + side_bytes(d, vb, scale_group)
        f = w + sk
        b = (q * (ctx - f) + 4.0 * d * f) / ctx
        if b <= budget + 1e-9:
            out.append((f"k{kb}v{vb}" + (f"-w{w}" if w else "") + (f"-s{sk}" if sk else "")
                        + (f"-g{scale_group}" if scale_group and scale_group != fmt.SCALE_GROUP else ""), b))
    return out

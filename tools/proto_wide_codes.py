"""Prototype (not the format): 5- and 6-bit Lloyd-Max codes in the perplexity evaluation, to measure whether a
wider code width buys accuracy at 80-100 B per token per kv head (issue 36: <= 1.002 at <= 91 B) before any
kernel is written. The codes are computed like the format's (rotation, fp16 scale per 32 coordinates, the
least-squares scale, midpoint thresholds) by fmkv.torch_quant with a research codebook (``levels=``); the
levels are the N(0,1) Lloyd-Max levels rounded to fp16, as the format's 4-bit table is.

    python tools/proto_wide_codes.py --device cpu --threads 2 --tokens 8192 \
        --configs fp16,k4v4-fmt3,k5v4,k5v5,k5v4-w128,k4v5-w128 --out F.jsonl

Config names: those of fmkv-eval ppl, plus k{5,6}v{4,5,6}[-w<N>][-km][-s<N>] (the prototype widths).
Results and the decision: docs/history/wide-codes.md.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

import numpy as np
import torch

import fmkv.format as fmt
import fmkv.torch_quant as tq
from fmkv.eval import ppl as P
from fmkv.eval.cli import DEFAULT_TEXT
from fmkv.eval.quantizers import KVQuantizer, parse_config


def lloyd_max_positive_levels(bits: int, iters: int = 20000) -> np.ndarray:
    """The 2^(bits-1) positive Lloyd-Max levels of N(0,1), float64 ascending (Lloyd iteration)."""
    n = 1 << (bits - 1)
    lv = np.linspace(0.5, 3.0, n) * (1.0 if bits < 6 else 1.2)
    phi = lambda x: np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2)))  # noqa: E731
    for _ in range(iters):
        t = np.concatenate([[0.0], 0.5 * (lv[:-1] + lv[1:]), [np.inf]])
        a, b = t[:-1], t[1:]
        pb = np.where(np.isinf(b), 0.0, phi(np.where(np.isinf(b), 0.0, b)))
        cb = np.where(np.isinf(b), 1.0, cdf(np.where(np.isinf(b), 0.0, b)))
        new = (phi(a) - pb) / (cb - cdf(a))
        if np.max(np.abs(new - lv)) < 1e-13:
            lv = new
            break
        lv = new
    return lv


def distortion(pos: np.ndarray) -> float:
    """E[(X - Q(X))^2], X ~ N(0,1), for the symmetric quantizer with positive levels ``pos`` (numeric)."""
    x = np.linspace(0, 12, 2_000_001)
    t = 0.5 * (pos[:-1] + pos[1:])
    q = pos[np.searchsorted(t, x)]
    f = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return float(2 * np.trapezoid((x - q) ** 2 * f, x))


_LEVELS = {}


def levels(bits: int) -> torch.Tensor:
    if bits not in _LEVELS:
        lv = lloyd_max_positive_levels(bits)
        _LEVELS[bits] = torch.tensor(lv.astype(np.float16).astype(np.float32))
    return _LEVELS[bits]


class WideQuantizer(KVQuantizer):
    """fmkv with code widths beyond the format's (the research codebook above for widths > 4)."""

    def _quant(self, x: torch.Tensor, layer: int, bits: int, side: str) -> torch.Tensor:
        if bits <= fmt.CODEBOOK_MAX_BITS or bits == 16:
            return super()._quant(x, layer, bits, side)
        dt = x.dtype
        x = x.float()
        mu = self._offset(x, side)
        if mu is not None:
            x = x - mu
        old = fmt.CODEBOOK_MAX_BITS
        tq._format.CODEBOOK_MAX_BITS = 8  # quantize_rotated checks the width against the format's tables
        try:
            out = tq.fake_quantize(x, bits, self.seed, layer, self.scale_rule, self.rotate, levels=levels(bits),
                                   side=side)
        finally:
            tq._format.CODEBOOK_MAX_BITS = old
        return (out if mu is None else out + mu).to(dt)

    def _side_bytes(self, d: int, bits: int, side: str) -> float:
        if bits in (5, 6):
            return d * bits / 8 + 2 * (d // 32)
        return super()._side_bytes(d, bits, side)


def parse(name: str) -> KVQuantizer:
    base, _, rest = name.partition("-")
    m = re.match(r"^k(\d+)v(\d+)$", base)
    if m:
        kb, vb = int(m.group(1)), int(m.group(2))
        if max(kb, vb) > 4 and kb != 16:
            proxy = parse_config("k4v4" + ("-" + rest if rest else ""))
            q = WideQuantizer(name, "fmkv", kb, vb)
            for f in ("residual", "sinks", "key_mean", "key_mean_skip", "scale_rule", "rotate"):
                setattr(q, f, getattr(proxy, f))
            q.options = dict(proxy.options, prototype_widths=True)
            return q
    return parse_config(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ids", default="")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-seconds", type=float, default=0, help="stop after the window that passes this time")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for b in (4, 5, 6):
        print(f"{b}-bit Lloyd-Max (fp16 levels): distortion {distortion(levels(b).double().numpy()):.6f}",
              file=sys.stderr)
    configs = [parse(c) for c in a.configs.split(",") if c]
    if "fp16" not in [c.name for c in configs]:
        configs.insert(0, parse_config("fp16"))
    model, tok = P.load_model(a.model, device=a.device)
    P.register()
    P.set_attn(model, P.ATTN_NAME)
    ids = torch.load(a.ids).long().reshape(-1) if a.ids else P.tokenize_file(tok, a.text)
    n_win = max(1, min(a.tokens // a.ctx, ids.numel() // a.ctx))
    nl = int(model.config.num_hidden_layers)
    d = int(getattr(model.config, "head_dim", 0) or model.config.hidden_size // model.config.num_attention_heads)
    for c in configs:
        c.num_layers = nl
    sums = {c.name: {"nll": 0.0, "kld": 0.0, "agree": 0, "n": 0} for c in configs}
    t0 = time.time()
    for w in range(n_win):
        win = ids[w * a.ctx:(w + 1) * a.ctx].unsqueeze(0).to(a.device)
        for k, v in P.eval_window(model, win, configs).items():
            for f in ("nll", "kld", "agree", "n"):
                sums[k][f] += v[f]
        print(f"window {w + 1}/{n_win} {time.time() - t0:.0f}s", file=sys.stderr)
        if a.max_seconds and time.time() - t0 > a.max_seconds:
            n_win = w + 1
            break
    summ = P.summarize(sums)
    with open(a.out, "w") as f:
        for c in configs:
            s = summ[c.name]
            row = {"suite": "ppl", "prototype": "wide_codes", "model": P.model_label(a.model), "ctx": a.ctx,
                   "tokens": s["n"], "windows": n_win, "commit": a.commit, "config": c.name,
                   "bytes_per_token_per_head": round(c.bytes_per_token_per_head(d, a.ctx), 3),
                   "ppl": round(s["ppl"], 5), "ppl_ratio": round(s["ppl_ratio"], 5), "kld": round(s["kld"], 6),
                   "top1_agree": round(s["top1_agree"], 5), "device": a.device}
            f.write(json.dumps(row) + "\n")
            print(f"{c.name:24s} {row['bytes_per_token_per_head']:7.2f} B  ppl/fp16 {row['ppl_ratio']:.5f}  "
                  f"KLD {row['kld']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

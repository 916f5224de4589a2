"""Kernel-level needle retrieval through fmkv.Cache (no model).

N random Gaussian keys; one planted "needle" key whose score q.k exceeds the largest other score
by ``margin`` x sigma (sigma = std of the scores). The attention runs with a sharp softmax
(scale = 40 / sigma, nearly a hard max), so its output is the value of the key that scores highest
*on the compressed cache*; a trial retrieves the needle when cos(output, v_needle) > 0.8.
Quantization noise on a score is about sigma * sqrt(D_b) (D_b: Lloyd-Max distortion; 0.34, 0.19,
0.10 relative std for 2, 3, 4 bits), so retrieval falls when the margin nears that noise.
fp16 keys (k_bits 16) are the control.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def _trial(fmkv, cfg, n, margin, rng, backend, chunk=16384):
    d = cfg.head_dim
    q = rng.standard_normal(d).astype(np.float32)
    qn = q / np.linalg.norm(q)
    k = rng.standard_normal((n, 1, d)).astype(np.float32)
    v = rng.standard_normal((n, 1, d)).astype(np.float32)
    scores = k[:, 0] @ q
    sigma = float(np.linalg.norm(q))
    p = int(rng.integers(n))
    others = np.delete(scores, p)
    target = float(others.max()) + margin * sigma
    k[p, 0] += qn * np.float32((target - scores[p]) / sigma)  # needle score: target (+ rounding)
    cache = fmkv.Cache(cfg, 1, (n + cfg.page_size - 1) // cfg.page_size + 1, 1, backend=backend)
    s = cache.add_sequence()
    for i in range(0, n, chunk):
        cache.append(0, s, k[i:i + chunk], v[i:i + chunk])
    out = cache.attention(0, s, q.reshape(1, 1, d), softmax_scale=40.0 / sigma)[0, 0]
    vn = v[p, 0]
    cos = float(out @ vn / (np.linalg.norm(out) * np.linalg.norm(vn) + 1e-30))
    return cos > 0.8, cache.resident_bytes


def run_needle(a) -> int:
    import fmkv

    ctxs = [c for c in (1024, 8192, 32768, 131072) if c <= a.max_ctx]
    bits = [int(b) for b in a.bits.split(",")] + [16]
    margins = [0.1, 0.25, 0.5, 1.0]
    rows = []
    t0 = time.time()
    for n in ctxs:
        trials = a.trials if n <= 32768 else max(2, a.trials // 2)
        for b in bits:
            cfg = fmkv.Config(head_dim=a.head_dim, num_kv_heads=1, k_bits=b, v_bits=4, page_size=64)
            for m in margins:
                rng = np.random.default_rng(1000 * n + int(m * 100))  # same trials for every bit width
                hits = 0
                for _ in range(trials):
                    ok, resident = _trial(fmkv, cfg, n, m, rng, a.backend)
                    hits += ok
                row = {"suite": "needle", "ctx": n, "k_bits": b, "v_bits": 4, "head_dim": a.head_dim,
                       "margin_sigma": m, "trials": trials, "retrieved": hits, "rate": hits / trials,
                       "bytes_per_token_per_head_k": cfg.k_bytes_per_token_per_head,
                       "backend": a.backend or fmkv.default_backend()}
                rows.append(row)
                print(f"ctx {n:>6} k{b:<2} margin {m:4.2f} sigma: {hits}/{trials} retrieved "
                      f"({time.time() - t0:.0f}s)", file=sys.stderr)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    # table: rate per (bits, margin) at the largest ctx
    print(f"{'k_bits':>6} " + " ".join(f"m={m:<5}" for m in margins) + "   (retrieval rate, per ctx)")
    for n in ctxs:
        print(f"ctx {n}")
        for b in bits:
            rs = [r for r in rows if r["ctx"] == n and r["k_bits"] == b]
            print(f"{b:>6} " + " ".join(f"{r['rate']:<7.2f}" for r in rs))
    return 0

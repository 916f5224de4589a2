"""Kernel-level needle retrieval through fmkv.Cache (no model).

N random Gaussian keys; one planted "needle" key whose score q.k exceeds the largest other score
by ``margin`` x sigma (sigma = std of the scores). The attention runs with a sharp softmax
(scale = 40 / sigma, nearly a hard max), so its output is the value of the key that scores highest
*on the compressed cache*; a trial retrieves the needle when cos(output, v_needle) > 0.8.
Quantization noise on a score is about sigma * sqrt(D_b) (D_b: Lloyd-Max distortion; 0.34, 0.19,
0.10 relative std for 2, 3, 4 bits), so retrieval falls when the margin nears that noise.
fp16 keys (k_bits 16) are the control.

Two paths, same trial:
* default (``--device`` unset): numpy inputs through ``fmkv.Cache`` (host memory, 'cpu' / 'ref'
  backend), contexts 1k-128k;
* ``--device cuda`` (or ``cpu``): torch tensors generated on that device, stored in a
  ``fmkv.torch_ops.TorchCache`` there and run by the torch ops ('cuda' backend on device memory),
  contexts up to 1,048,576 (``--max-ctx``). Device-detected errors are checked after every cell.

JSON lines (suite ``needle``, docs/results/README.md): ``ctx`` / ``context``, ``k_bits`` / ``bits``,
``rate`` / ``retrieval_rate``, trials, margin, bytes, ``backend``, ``device``, ``commit``.
"""
from __future__ import annotations

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


def _trial_torch(torch, cache, cfg, n, margin, rng, gen, device, chunk=65536):
    """One trial on torch tensors in a TorchCache on ``device`` (same recipe as _trial)."""
    d = cfg.head_dim
    q_np = rng.standard_normal(d).astype(np.float32)
    sigma = float(np.linalg.norm(q_np))
    p = int(rng.integers(n))
    q = torch.from_numpy(q_np).to(device)
    k = torch.randn(n, 1, d, generator=gen, device=device)
    v = torch.randn(n, 1, d, generator=gen, device=device)
    scores = k[:, 0] @ q
    target = scores.index_fill(0, torch.tensor([p], device=device), float("-inf")).max() + margin * sigma
    k[p, 0] += (q / sigma) * ((target - scores[p]) / sigma)  # needle score: target (+ rounding)
    s = cache.add_sequence()
    try:
        for i in range(0, n, chunk):
            cache.append(0, s, k[i:i + chunk], v[i:i + chunk])
        out = cache.attention(0, s, q.reshape(1, 1, d), softmax_scale=40.0 / sigma)[0, 0]
        vn = v[p, 0]
        cos = float((out @ vn) / (out.norm() * vn.norm() + 1e-30))
    finally:
        cache.remove_sequence(s)
    return cos > 0.8


def _device_name(torch, device: str, backend: str) -> str:
    import fmkv

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return fmkv.backends()[backend]["device"]


def run_needle(a) -> int:
    import fmkv

    device = getattr(a, "device", None)
    use_torch = bool(device)
    if use_torch:
        import torch

        from fmkv import torch_ops

        if device.startswith("cuda") and not torch.cuda.is_available():
            print("needle: --device cuda but torch.cuda is not available", file=sys.stderr)
            return 2
        backend = torch_ops.backend_for_device(device, a.backend, "needle")
        dev_name = _device_name(torch, device, backend)
        all_ctx = (1024, 8192, 32768, 131072, 262144, 524288, 1048576)
    else:
        backend = a.backend or fmkv.default_backend()
        dev_name = fmkv.backends()[backend]["device"]
        all_ctx = (1024, 8192, 32768, 131072)
    ctxs = [c for c in all_ctx if c <= a.max_ctx]
    from .. import format as fmt
    from ..format import FP16_BITS

    cfg_of = lambda b: fmkv.Config(head_dim=a.head_dim, num_kv_heads=1, k_bits=b, v_bits=4, page_size=64)  # noqa: E731
    if a.bits is None:  # every K width the backend runs
        bits = [b for b in fmt.CODE_BITS if fmkv.backend_supports(backend, cfg_of(b))] + [FP16_BITS]
    else:
        bits = list(a.bits) + [FP16_BITS]
        for b in bits:
            try:
                fmkv.check_backend(backend, cfg_of(b))
            except fmkv.FmkvError as e:
                print(f"needle: --bits {b}: {e}", file=sys.stderr)
                return 2
    margins = [0.1, 0.25, 0.5, 1.0]
    from .cli import _commit, write_jsonl  # the eval CLI's helpers (cli imports this module lazily, no cycle)

    commit = getattr(a, "commit", "") or _commit()
    rows = []
    t0 = time.time()
    for n in ctxs:
        trials = a.trials if (n <= 32768 or use_torch) else max(2, a.trials // 2)
        for b in bits:
            cfg = cfg_of(b)
            num_pages = (n + cfg.page_size - 1) // cfg.page_size + 1
            cache = torch_ops.TorchCache(cfg, 1, num_pages, 1, backend=backend, device=device) if use_torch else None
            for m in margins:
                seed = 1000 * n + int(m * 100)  # same trials for every bit width
                rng = np.random.default_rng(seed)
                hits = 0
                resident = 0
                if use_torch:
                    gen = torch.Generator(device=device).manual_seed(seed)
                    for _ in range(trials):
                        hits += _trial_torch(torch, cache, cfg, n, m, rng, gen, device)
                    if device.startswith("cuda"):
                        torch_ops.cuda_check(device)  # device-detected errors of this cell
                    resident = cache.resident_bytes
                else:
                    for _ in range(trials):
                        ok, resident = _trial(fmkv, cfg, n, m, rng, backend)
                        hits += ok
                row = {"suite": "needle", "ctx": n, "context": n, "k_bits": b, "bits": b, "v_bits": 4,
                       "head_dim": a.head_dim, "margin_sigma": m, "trials": trials, "retrieved": hits,
                       "rate": hits / trials, "retrieval_rate": hits / trials,
                       "bytes_per_token_per_head_k": cfg.k_bytes_per_token_per_head,
                       "bytes_per_token_per_head": cfg.bytes_per_token_per_head, "resident_bytes": resident,
                       "backend": backend, "device": dev_name, "tensors": "torch:" + device if use_torch else "numpy",
                       "commit": commit}
                rows.append(row)
                print(f"ctx {n:>7} k{b:<2} margin {m:4.2f} sigma: {hits}/{trials} retrieved "
                      f"({time.time() - t0:.0f}s)", file=sys.stderr)
            del cache
    if a.out:
        write_jsonl(a.out, rows)
    # table: rate per (bits, margin) at each ctx
    print(f"needle retrieval rate, backend {backend} ({dev_name}), {time.time() - t0:.0f}s")
    print(f"{'k_bits':>6} " + " ".join(f"m={m:<5}" for m in margins) + "   (retrieval rate, per ctx)")
    for n in ctxs:
        print(f"ctx {n}")
        for b in bits:
            rs = [r for r in rows if r["ctx"] == n and r["k_bits"] == b]
            print(f"{b:>6} " + " ".join(f"{r['rate']:<7.2f}" for r in rs))
    return 0


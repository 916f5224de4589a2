#!/usr/bin/env python3
"""End-to-end decode of a Llama-3-8B-geometry model, graph-captured: transformers' fp16 StaticCache
against fmkv.hf.FmkvStaticCache (k4v4 / k3v3 with the default 64-token fp16 window).

    python3 bench/e2e_decode.py --out docs/results/e2e_decode.jsonl      # H200, one call (bounded by --time-budget)
    python3 bench/e2e_decode.py --quick --time-budget 300 ...             # fewer steps, no compiled rows
    python3 bench/e2e_decode.py --device cpu --tiny --out /tmp/e2e.jsonl  # the whole script on a CPU, tiny geometry
    python3 bench/e2e_decode.py --plot docs/results/e2e_decode.jsonl      # redraw the PNG + table from a file

Model: LlamaConfig with 32 layers, 32 q / 8 kv heads, head_dim 128, hidden 4096, MLP 14336, vocab
128256, bfloat16, random weights built on the device (no download); --tiny: 2 layers, hidden 256,
8 q / 2 kv heads of 64, MLP 512, vocab 1024 (and contexts / batches scaled down).

Caches (one object per case, max_cache_len = context + 64):
  fp16        transformers StaticCache; attention = transformers' SDPA path with the grouped query heads
              folded into the query length for one-token steps (q [B, 8, 4, d] against K/V [B, 8, L, d],
              exact; what transformers 5.24 does eagerly) -- no repeat_kv copy of the cache per step
  k4v4-w64,   fmkv.hf.FmkvStaticCache: one torch.ops.fmkv.append_attention per layer and step
  k3v3-w64
The decode step -- model forward (logits of the last token only), argmax, the token and position fed
back in place -- is captured in one torch.cuda.CUDAGraph after two eager warm-up steps and replayed
("capture": "cuda_graph"; on a CPU the eager step, "none"). Optionally (not with --quick) the same step
compiled by torch.compile(mode="reduce-overhead", fullgraph=True) at B=1 32k ("torch_compile").

Long contexts are not prefilled through the model: each cache is filled directly -- K ~ N(0,1) times a
per-(kv head, channel) scale 1 + |N(0,1)| (heavy-tailed channels, like real keys), V ~ N(0,1), the same
tensors for every cache -- fmkv's through FmkvStaticCache.write (the append op a prompt chunk uses:
compressed pages + the fp16 window), fp16's into StaticCache's tensors ("fill": "direct").

Cases: fixed B=1 at 4k / 32k / 128k and B=16 at 32k; capacity: the largest batch at 32k whose cache
fits beside the weights (free GPU memory after the weights, less a reserve, over the bytes one
sequence's cache allocates: StaticCache's tensors, FmkvStaticCache.bytes_per_sequence), then run at
that batch (5% smaller after an out-of-memory error); prefill of a 32k prompt through the model in
chunks of 4096 and in one chunk (the first chunk attended at full precision while written compressed;
later chunks read the compressed cache); the split of one captured step from torch.profiler (kernel
names: "weights" = GEMM/GEMV kernels, "attention" = attention kernels and cache writes: fmkv::*,
flash / fmha / cudnn / sdpa, index_copy; "other" = the rest) and the host gap: 100 * (step time - GPU
busy time) / step time, busy = the union of the step's kernel intervals (host_gap_vs_kernel_sum_pct: against
the plain sum of the kernels' times, which counts overlapping kernels twice).

Output: one JSON line per case (shared/BENCHMARKS.md "End-to-end decode (e2e_decode)"; extra fields:
capture, fill, k_bits, v_bits, window_tokens, max_cache_len, kernel_ms, busy_ms, host_gap_pct, ...;
prefill rows have case "prefill" with prefill_ms), written to --out and to $OUT/e2e_decode.jsonl when
$OUT is set, a PNG next to each, and a short table printed last. Every case runs in its own try/except:
an error (e.g. out of memory) is recorded in the case's line ("error") and the run goes on.
--time-budget S skips cases (recorded as "skipped") that would start after S seconds minus their
estimated time, and stops a running case at S.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback

FULL = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256)
TINY = dict(layers=2, hidden=256, heads=8, kv_heads=2, head_dim=64, mlp=512, vocab=1024)
BASE_ATTN = "sdpa_folded_gqa"
CACHES = ("fp16", "k4v4-w64", "k3v3-w64")
HEADROOM = 64  # tokens past the context: warm-up, capture and timed steps


def parse_cache(name):
    """'fp16' -> None; 'k4v4-w64' -> (4, 4, 64, ((4, 4),), ()); per-layer widths cycled over the layers:
    'k4v4/k3v3-w64' -> (4, 4, 64, ((4, 4), (3, 3)), ()) (layer i takes pair i mod 2; k_bits / v_bits of the row
    are the first pair's, `layer_bits` the cycle); per-kv-head widths cycled over the heads of every layer:
    'k4v4|k3v3-w64' -> (4, 4, 64, ((4, 4),), ((4, 4), (3, 3))) (kv head h takes pair h mod 2: `head_bits`);
    a '-ko' suffix adds a sixth element True: the key offset (`key_offset=True`), e.g. 'k3v3-ko', 'k4v4-w64-ko'."""
    if name == "fp16":
        return None
    key_offset = name.endswith("-ko")
    kv, _, w = name[:-3].partition("-w") if key_offset else name.partition("-w")
    if "/" in kv and "|" in kv:
        raise ValueError(f"cache {name!r}: widths per layer (/) or per kv head (|), not both")
    cycle = []
    for pair in kv.replace("|", "/").split("/"):
        if not (pair.startswith("k") and "v" in pair):
            raise ValueError(f"cache {name!r}: expected fp16, k<b>v<b>[-w<N>], k<b>v<b>/k<b>v<b>...[-w<N>] (per "
                             f"layer) or k<b>v<b>|k<b>v<b>...[-w<N>] (per kv head)")
        k, v = pair[1:].split("v")
        cycle.append((int(k), int(v)))
    if "|" in kv:
        return cycle[0][0], cycle[0][1], int(w or 0), (cycle[0],), tuple(cycle), key_offset
    return cycle[0][0], cycle[0][1], int(w or 0), tuple(cycle), (), key_offset


def layer_bits_of(bits, layers):
    """The caches' layer_bits for a parsed name (None for one width everywhere or widths per head)."""
    cycle = bits[3]
    return None if len(cycle) == 1 else [cycle[i % len(cycle)] for i in range(layers)]


def head_bits_of(bits, layers, kv_heads):
    """The caches' head_bits for a parsed name (None unless it has widths per kv head)."""
    cycle = bits[4]
    return None if not cycle else [[cycle[h % len(cycle)] for h in range(kv_heads)] for _ in range(layers)]


# ------------------------------------------------------------------------------------------- model
def folded_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The fp16 baseline's attention: transformers' SDPA, except that a one-token step attends its grouped
    query heads as rows of their kv head (no repeat_kv of the cache); exact."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, hq, n, d = query.shape
    hkv = key.shape[1]
    if n == 1 and hq != hkv:
        q = query.reshape(b, hkv, hq // hkv, d)
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, 1, hq, d), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register_baseline():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BASE_ATTN, folded_gqa_attention)
    AttentionMaskInterface.register(BASE_ATTN, sdpa_mask)


def build_model(geo, dtype, device):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=geo["vocab"], hidden_size=geo["hidden"],
                                   intermediate_size=geo["mlp"], num_hidden_layers=geo["layers"],
                                   num_attention_heads=geo["heads"], num_key_value_heads=geo["kv_heads"],
                                   head_dim=geo["head_dim"], max_position_embeddings=1 << 18, rope_theta=500000.0)
    with torch.device(device):  # built where it runs: no host copy of 16 GB
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # the weights, explicitly: N(0, 0.02) matrices (transformers' init), unit norms
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    return model


def use_baseline_attention(model):
    model.config._attn_implementation = BASE_ATTN


# ------------------------------------------------------------------------------------------- caches
def kv_block(b, geo, n, dtype, device, seed):
    """Random K/V [b, kv_heads, n, d] with the statistics of the module docstring, laid out [b, n, h, d]
    in memory as transformers' projections are (fmkv's append reads them without a copy)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, d = geo["kv_heads"], geo["head_dim"]
    chan = (1.0 + torch.randn(1, 1, h, d, generator=g, device=device).abs()).to(dtype)
    k = torch.randn(b, n, h, d, generator=g, device=device, dtype=dtype).mul_(chan)
    v = torch.randn(b, n, h, d, generator=g, device=device, dtype=dtype)
    return k.transpose(1, 2), v.transpose(1, 2)


def fp16_cache_bytes(geo, batch, max_len, elem=2):
    return 2 * geo["layers"] * batch * geo["kv_heads"] * max_len * geo["head_dim"] * elem


def make_cache(name, model, geo, batch, ctx, dtype, device, fill=True, seed=0):
    """A cache of `batch` sequences for `ctx` tokens each (max_cache_len = ctx + HEADROOM), filled with ctx
    random tokens each unless fill=False."""
    import torch
    import transformers
    import fmkv.hf as fhf

    L = ctx + HEADROOM
    bits = parse_cache(name)
    if bits is None:
        use_baseline_attention(model)
        cache = transformers.StaticCache(config=model.config, max_cache_len=L)
        cache.early_initialization(batch, geo["kv_heads"], geo["head_dim"], dtype, torch.device(device))
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    else:
        k, v, w = bits[:3]
        cache = fhf.FmkvStaticCache(model.config, max_cache_len=L, k_bits=k, v_bits=v, window_tokens=w,
                                    batch_size=batch, device=device, dtype=dtype,  # sets the "fmkv" attention
                                    layer_bits=layer_bits_of(bits, geo["layers"]),
                                    head_bits=head_bits_of(bits, geo["layers"], geo["kv_heads"]), key_offset=bits[5])
        nbytes = cache.device_bytes
    if fill and ctx > 0:
        step = max(1, min(batch, (1 << 27) // max(1, geo["kv_heads"] * ctx * geo["head_dim"])))  # 2^27-value blocks
        with torch.no_grad():
            for s0 in range(0, batch, step):
                b = min(step, batch - s0)
                kb, vb = kv_block(b, geo, ctx, dtype, device, seed + s0)
                for li in range(geo["layers"]):
                    if bits is None:
                        layer = cache.layers[li]
                        layer.keys[s0:s0 + b, :, :ctx].copy_(kb)
                        layer.values[s0:s0 + b, :, :ctx].copy_(vb)
                    else:
                        cache.write(li, kb, vb, first_seq=s0)
                del kb, vb
            if bits is None:
                for layer in cache.layers:
                    layer.cumulative_length.fill_(ctx)
    return cache, nbytes


# ------------------------------------------------------------------------------------------- steps
def make_step(model, cache, batch, ctx, vocab, device):
    """One decode step on static buffers: forward of the last token, argmax fed back, position + 1."""
    import torch
    import fmkv.hf as fhf

    ids = torch.randint(0, vocab, (batch, 1), device=device)
    pos = torch.full((batch, 1), ctx, dtype=torch.long, device=device)
    kw = fhf.cache_kwargs(cache)

    def step():
        out = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
        ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)
    return step, ids, pos


class Captured:
    """The step captured in one CUDA graph (CUDA), or the eager step (CPU)."""

    def __init__(self, step, device):
        import torch

        self.cuda = str(device).startswith("cuda")
        self.step, self.graph = step, None
        with torch.no_grad():
            if not self.cuda:
                step()
                return
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up: cuBLAS handles, fmkv's device error word, allocator
                    step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                step()
            torch.cuda.synchronize()

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.eager()

    def eager(self):
        import torch
        with torch.no_grad():
            self.step()

    def close(self):
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


def time_steps(run, n, cuda):
    """Median ms of one call of run() over n calls (CUDA events per call; perf_counter on a CPU)."""
    import torch

    for _ in range(3):
        run()
    if cuda:
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        ts = [a.elapsed_time(b) for a, b in ev]
    else:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), min(ts), max(ts)


def classify(name):
    n = name.lower()
    if any(s in n for s in ("fmkv::", "flash", "fmha", "attention", "sdpa", "cudnn", "index_copy",
                            "scaled_dot_product")):
        return "attention"
    if any(s in n for s in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "aten::mm",
                            "aten::addmm", "aten::linear", "aten::bmm", "aten::matmul")):
        return "weights"
    return "other"


def profile_split(run, reps, cuda, step_ms):
    """Per-step split (ms) of `reps` calls of run() from torch.profiler, and the host gap. CUDA: the
    kernels of the captured graph (their names; the eager step's if the profiler sees none inside the
    graph); CPU: the self time of the top-level ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            run()
        if cuda:
            torch.cuda.synchronize()
    split = {"attention": 0.0, "weights": 0.0, "other": 0.0}
    res = {}
    if cuda:
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        iv = sorted((e.time_range.start, e.time_range.end) for e in kern)
        for e in kern:
            split[classify(e.name)] += (e.time_range.end - e.time_range.start) / 1e3 / reps
        busy, cur = 0.0, None
        for a, b in iv:
            if cur is None or a > cur[1]:
                if cur is not None:
                    busy += cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        if cur is not None:
            busy += cur[1] - cur[0]
        res.update(kernels_per_step=round(len(kern) / reps, 1), kernel_ms=round(sum(split.values()), 4),
                   busy_ms=round(busy / 1e3 / reps, 4))
        if kern:  # GPU idle share of the step (union of kernel intervals); and against the plain sum of kernel times
            res["host_gap_pct"] = round(100.0 * (step_ms - res["busy_ms"]) / step_ms, 2)
            res["host_gap_vs_kernel_sum_pct"] = round(100.0 * (step_ms - res["kernel_ms"]) / step_ms, 2)
    else:
        for e in prof.key_averages():
            if e.key.startswith(("aten::", "fmkv::")):
                split[classify(e.key)] += e.self_cpu_time_total / 1e3 / reps
    res.update({f"{k}_ms": round(v, 4) for k, v in split.items()})
    res["split_source"] = "cuda_graph_kernels" if cuda else "cpu_op_self_time"
    return res, bool(res.get("kernels_per_step"))


# ------------------------------------------------------------------------------------------- cases
class Budget:
    def __init__(self, seconds):
        self.t0, self.s = time.time(), float(seconds or 0)

    def left(self):
        return math.inf if self.s <= 0 else self.s - (time.time() - self.t0)

    @contextlib.contextmanager
    def guard(self):
        """Stop a case that runs past the budget (TimeoutError raised in the main thread)."""
        left = self.left()
        if math.isinf(left) or not hasattr(signal, "SIGALRM"):
            yield
            return

        def on_alarm(*_):
            raise TimeoutError("time budget exhausted during the case")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(max(1, int(left)))
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def free_memory(cuda):
    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def decode_case(a, ctx_, model, geo, name, batch, ctx, compiled=False):
    import torch
    import fmkv.hf as fhf

    cuda = ctx_["cuda"]
    cache, nbytes = make_cache(name, model, geo, batch, ctx, ctx_["dtype"], a.device)
    step, ids, pos = make_step(model, cache, batch, ctx, geo["vocab"], a.device)
    rec = dict(cache_bytes=int(nbytes), fill="direct" if ctx > 0 else "none", max_cache_len=ctx + HEADROOM)
    cap = None
    try:
        if compiled:
            torch._dynamo.reset()
            kw = fhf.cache_kwargs(cache)

            def fwd(tok, p):
                out = model(input_ids=tok, position_ids=p, use_cache=True, logits_to_keep=1, **kw)
                return out.logits[:, -1].argmax(-1, keepdim=True)
            cf = torch.compile(fwd, mode="reduce-overhead", fullgraph=True)
            state = {"tok": ids.clone(), "pos": pos.clone()}
            t0 = time.time()

            def run():
                with torch.no_grad():
                    torch.compiler.cudagraph_mark_step_begin()
                    state["tok"] = cf(state["tok"], state["pos"]).clone()
                    state["pos"] = state["pos"] + 1
            for _ in range(3):  # compile, record, replay
                run()
            if cuda:
                torch.cuda.synchronize()
            rec.update(capture="torch_compile", graph=cuda, compile_s=round(time.time() - t0, 1))
        else:
            cap = Captured(step, a.device)
            run = cap
            rec.update(capture="cuda_graph" if cuda else "none", graph=cuda)
        med, lo, hi = time_steps(run, a.steps, cuda)
        rec.update(ms_per_step=round(med, 4), ms_min=round(lo, 4), ms_max=round(hi, 4),
                   tokens_per_s=round(batch / (med / 1e3), 2), steps=a.steps)
        if not a.no_profile:
            split, seen = profile_split(run, a.profile_steps, cuda, med)
            if cuda and not seen and not compiled:  # the profiler saw no kernel inside the graph: the eager step's
                split, _ = profile_split(cap.eager, 2, cuda, med)
                split["split_source"] = "eager_step_kernels"
            rec.update(split)
        if hasattr(cache, "check"):
            cache.check()
        if parse_cache(name) is not None:
            lens = cache.lengths()
            rec["lengths_after"] = f"{min(lens)}-{max(lens)}"
    finally:
        if cap is not None:
            cap.close()
        del cache, step, ids, pos, cap
        if compiled:
            torch._dynamo.reset()
        free_memory(cuda)
    return rec


def capacity_case(a, ctx_, model, geo, name, ctx):
    """The largest batch whose cache fits beside the weights, from bytes; then run at it."""
    import torch
    import fmkv.hf as fhf
    from fmkv import torch_ops

    cuda = ctx_["cuda"]
    L = ctx + HEADROOM
    bits = parse_cache(name)
    if bits is None:
        per_seq = fp16_cache_bytes(geo, 1, L, ctx_["elem"])
    else:
        k, v, w = bits[:3]
        per_seq = fhf.FmkvStaticCache.bytes_per_sequence(model.config, L, k_bits=k, v_bits=v, window_tokens=w,
                                                         layer_bits=layer_bits_of(bits, geo["layers"]),
                                                         head_bits=head_bits_of(bits, geo["layers"], geo["kv_heads"]))
    # per-sequence activations of a step: logits (bf16 + fp32 argmax input), hidden / MLP rows, attention
    # workspace (fmkv: its planned splits), with a 2x margin
    act = 2 * (geo["vocab"] * 6 + geo["mlp"] * 8 + geo["hidden"] * 16)
    if bits is not None and cuda:
        import fmkv
        cfg = fmkv.Config(head_dim=geo["head_dim"], num_kv_heads=geo["kv_heads"], k_bits=bits[0], v_bits=bits[1],
                          window_tokens=bits[2])
        ws = torch_ops.attention_workspace_bytes(cfg, geo["heads"], 64, 64, "cuda") / 64
        act += 2 * int(ws)
    free_memory(cuda)
    if cuda:
        free = torch.cuda.mem_get_info()[0]
        reserve = a.reserve_gib * (1 << 30)
    else:
        free = int(a.cpu_memory_gib * (1 << 30)) - sum(p.numel() * p.element_size() for p in model.parameters())
        reserve = 0
    fit = max(0, int((free - reserve) // (per_seq + act)))
    if a.max_capacity_batch:
        fit = min(fit, a.max_capacity_batch)
    rec = dict(fit=dict(free_bytes=int(free), reserve_bytes=int(reserve), per_seq_cache_bytes=int(per_seq),
                        per_seq_activation_bytes=int(act)), max_batch=fit)
    if fit < 1:
        raise RuntimeError(f"no sequence of {L} tokens fits: free {free} B, reserve {reserve} B, {per_seq} B each")
    tried, batch = [], fit
    for _ in range(4):
        tried.append(batch)
        try:
            rec.update(decode_case(a, ctx_, model, geo, name, batch, ctx))
            rec.update(batch=batch, tried=tried)
            return rec
        except (torch.OutOfMemoryError, RuntimeError) as e:  # (an OOM inside a graph capture is a RuntimeError)
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
                raise
            free_memory(cuda)
            batch = max(1, int(batch * 0.95))
    raise RuntimeError(f"out of memory at batches {tried}")


def prefill_case(a, ctx_, model, geo, name, ctx, chunk):
    """Prefill of one ctx-token prompt in chunks through the model (logits of the last token only)."""
    import torch
    import fmkv.hf as fhf

    cuda = ctx_["cuda"]
    ids = torch.randint(0, geo["vocab"], (1, ctx), generator=torch.Generator().manual_seed(7)).to(a.device)

    def run(n_tokens):
        cache, nbytes = make_cache(name, model, geo, 1, ctx, ctx_["dtype"], a.device, fill=False)
        kw = fhf.cache_kwargs(cache)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for s in range(0, n_tokens, chunk):
                e = min(n_tokens, s + chunk)
                pos = torch.arange(s, e, device=a.device)[None]
                out = model(input_ids=ids[:, s:e], position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
            out.logits[:, -1].argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if hasattr(cache, "check"):
            cache.check()
        lens = cache.lengths() if hasattr(cache, "lengths") else [n_tokens]
        del cache, out
        free_memory(cuda)
        return dt, lens, nbytes

    run(min(ctx, 2 * chunk))  # warm-up: kernels and cuBLAS / SDPA plans of the chunk shapes
    dt, lens, nbytes = run(ctx)
    if lens != [ctx]:
        raise RuntimeError(f"prefill left {lens} tokens, expected {ctx}")
    return dict(prefill_ms=round(dt * 1e3, 2), tokens_per_s=round(ctx / dt, 1), chunk=chunk, graph=False,
                capture="none", fill="prefill", cache_bytes=int(nbytes), max_cache_len=ctx + HEADROOM,
                ms_per_step=None)


def plan(a):
    geo = TINY if a.tiny else FULL
    if a.tiny:
        fixed = [(1, 256), (1, 1024), (1, 2048), (4, 1024)]
        cap_ctx, pre_ctx, chunks, comp = 1024, 1024, [256, 1024], (1, 1024)
    else:
        fixed = [(1, 4096), (1, 32768), (1, 131072), (16, 32768)]
        cap_ctx, pre_ctx, chunks, comp = 32768, 32768, [4096, 32768], (1, 32768)
    if a.fixed:
        fixed = [tuple(int(x) for x in bc.split(":")) for bc in a.fixed.split(",") if bc]
    if a.prefill_chunks:
        chunks = [int(c) for c in a.prefill_chunks.split(",") if c]
    caches = [c for c in a.caches.split(",") if c]
    only = set(k for k in a.only.split(",") if k) or {"fixed", "capacity", "prefill", "compiled"}
    cases = []
    for b, c in fixed:
        for name in caches:
            cases.append(("fixed", name, dict(batch=b, ctx=c), 10))
    if not a.skip_capacity:
        for name in caches:
            cases.append(("capacity", name, dict(ctx=cap_ctx), 40))
    if not a.skip_prefill:
        for chunk in chunks:
            for name in caches:
                cases.append(("prefill", name, dict(batch=1, ctx=pre_ctx, chunk=chunk), 25))
    if a.compile:
        for name in caches[:2]:
            cases.append(("compiled", name, dict(batch=comp[0], ctx=comp[1]), 150))
    return geo, [c for c in cases if c[0] in only]


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def add_speedups(rows):
    """speedup = tokens_per_s / the fp16 row's of the same case and capture (capacity: fp16's capacity row,
    its best batch at that context); batch_ratio for capacity rows."""
    def key(r):
        if r["case"] == "capacity":
            return ("capacity", r["context"], r.get("capture"))
        if r["case"] == "prefill":
            return ("prefill", r["context"], r.get("chunk"))
        return (r["case"], r["batch"], r["context"], r.get("capture"))
    base = {key(r): r for r in rows if r.get("cache") == "fp16" and r.get("tokens_per_s")}
    for r in rows:
        b = base.get(key(r))
        if b is not None and r.get("tokens_per_s"):
            r["speedup"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3)
            if r["case"] == "capacity":
                r["batch_ratio"] = round(r["batch"] / b["batch"], 2)
        else:
            r.setdefault("speedup", None)


def write_rows(rows, paths):
    for p in paths:
        d = os.path.dirname(os.path.abspath(p))
        os.makedirs(d, exist_ok=True)
        with open(p, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def label(r):
    if r["case"] == "capacity":
        return f"capacity {r['context'] // 1024}k"
    if r["case"] == "prefill":
        c = r["chunk"]
        return f"prefill {r['context'] // 1024}k/{f'{c // 1024}k' if c >= 1024 else c}"
    tag = " compiled" if r.get("capture") == "torch_compile" else ""
    ctx = r["context"]
    return f"B={r['batch']} {ctx // 1024}k{tag}" if ctx >= 1024 else f"B={r['batch']} {ctx}{tag}"


def plot(rows, out_png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("tokens_per_s") and r["case"] != "prefill"]
    if not ok:
        return
    caches = list(dict.fromkeys(r["cache"] for r in ok))
    groups = list(dict.fromkeys(label(r) for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    w = 0.8 / len(caches)
    for i, c in enumerate(caches):
        xs, ys, lab = [], [], []
        for j, g in enumerate(groups):
            r = next((r for r in ok if r["cache"] == c and label(r) == g), None)
            if r is not None:
                xs.append(j + i * w)
                ys.append(r["tokens_per_s"])
                lab.append(r)
        bars = ax.bar(xs, ys, w, label=c)
        for bar, r in zip(bars, lab):
            txt = f"B={r['batch']}" if r["case"] == "capacity" else ""
            if r.get("speedup") and r["cache"] != "fp16":
                txt = (txt + " " if txt else "") + f"{r['speedup']:.2f}x"
            if txt:
                ax.annotate(txt, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                            fontsize=7, rotation=90)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (decode, all sequences)")
    r0 = ok[0]
    ax.set_title(f"{r0['model']}, {r0['device']}: decode step as a CUDA graph" if r0.get("graph")
                 else f"{r0['model']}, {r0['device']}: eager decode step", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    sp = [r for r in ok if r.get("weights_ms") is not None and r.get("capture") != "torch_compile"]
    names = [f"{label(r)} {r['cache']}" for r in sp]
    left = [0.0] * len(sp)
    parts = (("weights_ms", "tab:blue", "weight GEMMs"), ("attention_ms", "tab:orange", "attention + cache write"),
             ("other_ms", "tab:gray", "other kernels"))
    for part, col, lab in parts:
        vals = [100.0 * r[part] / r["ms_per_step"] for r in sp]
        ax.barh(range(len(sp)), vals, left=left, color=col, label=lab)
        left = [a + v for a, v in zip(left, vals)]
    for i, r in enumerate(sp):
        ax.annotate(f"{r['ms_per_step']:.2f} ms", (max(left[i], 100.0) + 1, i), va="center", fontsize=6)
    ax.axvline(100.0, color="k", lw=0.6)
    ax.set_yticks(range(len(sp)))
    ax.set_yticklabels(names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, 125)
    ax.set_xlabel("% of the step's time (profile; the rest up to 100%: GPU idle = host gaps)", fontsize=8)
    ax.set_title("where a step's time goes", fontsize=9, pad=22)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.06), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def human(n):
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def table(rows):
    lines = [f"{'case':<18} {'cache':<9} {'B':>4} {'ms/step':>9} {'tok/s':>10} {'vs fp16':>8} "
             f"{'weights/attn/other ms':>22} {'gap%':>6}  note"]
    for r in rows:
        if r.get("skipped") or r.get("error"):
            lines.append(f"{label(r):<18} {r['cache']:<9} {r.get('batch') or '-':>4} "
                         f"{'skipped: ' + r['skipped'] if r.get('skipped') else 'error: ' + r['error'][:80]}")
            continue
        ms = "-" if r.get("ms_per_step") is None else f"{r['ms_per_step']:.3f}"
        if r["case"] == "prefill":
            ms = f"{r['prefill_ms']:.0f} total"
        sp = "-" if not r.get("speedup") else f"{r['speedup']:.2f}x"
        split = ("-" if r.get("weights_ms") is None else
                 f"{r['weights_ms']:.2f}/{r['attention_ms']:.2f}/{r['other_ms']:.2f}")
        gap = "-" if r.get("host_gap_pct") is None else f"{r['host_gap_pct']:.1f}"
        note = ""
        if r["case"] == "capacity":
            note = f"max batch {r['max_batch']}, cache {human(r['cache_bytes'])}"
            if r.get("batch_ratio"):
                note += f", {r['batch_ratio']:.2f}x fp16's batch"
        lines.append(f"{label(r):<18} {r['cache']:<9} {str(r.get('batch')):>4} {ms:>9} {r['tokens_per_s']:>10.1f} {sp:>8} "
                     f"{split:>22} {gap:>6}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry and contexts (tests the script)")
    ap.add_argument("--quick", action="store_true", help="fewer timed steps, no compiled rows")
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--steps", type=int, default=0, help="timed steps per case (default 30, --quick 10)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--fixed", default="", help="fixed cases as B:context,... (default: 1:4096,1:32768,1:131072,16:32768)")
    ap.add_argument("--prefill-chunks", default="", help="prefill chunk sizes (default: 4096,32768)")
    ap.add_argument("--only", default="", help="comma-separated case kinds to run: fixed, capacity, prefill, compiled")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None,
                    help="add torch.compile(mode='reduce-overhead') rows at B=1 32k (default on CUDA without --quick)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="GPU memory kept free in the capacity fit")
    ap.add_argument("--cpu-memory-gib", type=float, default=0.03,
                    help="memory the capacity fit assumes on a CPU (with --tiny: a few dozen sequences)")
    ap.add_argument("--max-capacity-batch", type=int, default=0, help="cap on the capacity batch (0: none)")
    ap.add_argument("--time-budget", type=float, default=0.0, help="seconds for the whole run (0: none)")
    ap.add_argument("--out", default=None, help="JSON lines file (also $OUT/e2e_decode.jsonl when $OUT is set)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--plot", default=None, metavar="JSONL", help="only redraw the PNG and table of a results file")
    ap.add_argument("--head-groups-serial", action="store_true",
                    help="A/B: run the width groups of per-head caches one after another on one stream (the library "
                         "forks them onto side streams on CUDA); rows get head_groups='serial'")
    a = ap.parse_args(argv)
    if a.plot:
        rows = [json.loads(line) for line in open(a.plot) if line.strip()]
        plot(rows, os.path.splitext(a.plot)[0] + ".png")
        print(table(rows))
        return 0
    budget = Budget(a.time_budget)
    import torch
    import transformers
    import fmkv
    import fmkv.hf  # noqa: F401  (registers the "fmkv" attention and torch.ops.fmkv)

    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("e2e_decode: --device cuda but torch.cuda is not available (use --device cpu --tiny)")
    if a.compile is None:
        a.compile = cuda and not a.quick
    a.steps = a.steps or (10 if a.quick else 30)
    if a.head_groups_serial:
        from fmkv.hf.head_groups import HeadGroups
        HeadGroups._concurrently = staticmethod(lambda device, calls: [c() for c in calls])
    dtype = torch.bfloat16 if cuda else torch.float32
    ctx_ = dict(cuda=cuda, dtype=dtype, elem=torch.tensor([], dtype=dtype).element_size())
    register_baseline()
    geo, cases = plan(a)
    t0 = time.time()
    model = build_model(geo, dtype, a.device)
    use_baseline_attention(model)  # also the fallback the fmkv caches remember (their first chunks)
    if cuda:
        torch.cuda.synchronize()
    build_s = time.time() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    common = dict(suite="e2e_decode", device=device_name, commit=a.commit or git_commit(),
                  model=("llama-3-8b-geometry" if not a.tiny else "tiny-llama") + f"-random-{str(dtype)[6:]}",
                  layers=geo["layers"], q_heads=geo["heads"], kv_heads=geo["kv_heads"], head_dim=geo["head_dim"],
                  weight_bytes=weight_bytes, torch=torch.__version__, transformers=transformers.__version__,
                  fmkv=fmkv.__version__, fp16_attention=BASE_ATTN)
    print(f"e2e_decode: {common['model']} on {device_name}: {weight_bytes / 2**30:.1f} GiB of weights built in "
          f"{build_s:.1f} s; {len(cases)} cases; steps {a.steps}; budget "
          f"{'none' if math.isinf(budget.left()) else f'{budget.left():.0f} s'}", flush=True)
    outs = [p for p in (a.out, os.path.join(os.environ["OUT"], "e2e_decode.jsonl") if os.environ.get("OUT") else None)
            if p]
    rows = []
    for kind, name, p, est in cases:
        bits = parse_cache(name)
        r = dict(common, cache=name, case="capacity" if kind == "capacity" else ("prefill" if kind == "prefill" else "fixed"),
                 batch=p.get("batch"), context=p["ctx"], k_bits=16 if bits is None else bits[0],
                 v_bits=16 if bits is None else bits[1], window_tokens=0 if bits is None else bits[2],
                 page_size=0 if bits is None else 64, max_batch=None,
                 cache_dtype=str(dtype)[6:] if bits is None else f"fmkv k{bits[0]}v{bits[1]} pages + fp16 window",
                 attention_ms=None, weights_ms=None, other_ms=None)
        if bits is not None and len(bits[3]) > 1:
            r["layer_bits"] = layer_bits_of(bits, geo["layers"])
            r["cache_dtype"] = "fmkv per-layer widths %s (cycled) pages + fp16 window" % "/".join(
                f"k{k}v{v}" for k, v in bits[3])
        if bits is not None and bits[4]:
            r["head_groups"] = "serial" if a.head_groups_serial else "concurrent (side streams)"
            r["head_bits"] = [list(p) for p in head_bits_of(bits, geo["layers"], geo["kv_heads"])[0]]  # every layer
            r["cache_dtype"] = "fmkv per-kv-head widths %s (cycled over the heads of every layer) pages + fp16 window" % (
                "|".join(f"k{k}v{v}" for k, v in bits[4]))
        if bits is not None and bits[5]:
            r["key_offset"] = True
            r["cache_dtype"] += ", key offset"
        if kind == "prefill":
            r["chunk"] = p["chunk"]
        if budget.left() < est:
            r["skipped"] = f"time budget ({budget.left():.0f} s left, case needs ~{est} s)"
            rows.append(r)
            print(f"  skip {kind} {name} {p}: {r['skipped']}", flush=True)
            continue
        t1 = time.time()
        try:
            with budget.guard():
                if kind in ("fixed", "compiled"):
                    r.update(decode_case(a, ctx_, model, geo, name, p["batch"], p["ctx"], compiled=(kind == "compiled")))
                elif kind == "capacity":
                    r.update(capacity_case(a, ctx_, model, geo, name, p["ctx"]))
                else:
                    r.update(prefill_case(a, ctx_, model, geo, name, p["ctx"], p["chunk"]))
        except Exception as e:  # one failed case (OOM, a missing kernel, the budget) does not lose the run
            r["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
            print(f"  {kind} {name} {p}: ERROR {r['error'][:300]}", flush=True)
            if os.environ.get("E2E_TRACEBACK"):
                traceback.print_exc()
            free_memory(cuda)
        r["case_s"] = round(time.time() - t1, 1)
        rows.append(r)
        if "error" not in r:
            ms = r.get("ms_per_step") or r.get("prefill_ms")
            print(f"  {kind:<9} {name:<9} B={r['batch']} ctx={r['context']}: {ms} ms, {r['tokens_per_s']} tok/s "
                  f"({r['case_s']} s)", flush=True)
        add_speedups(rows)
        write_rows(rows, outs)  # after every case: a later failure or kill keeps the earlier lines
    for p in outs:
        try:
            plot(rows, os.path.splitext(p)[0] + ".png")
        except Exception as e:  # the JSON is what counts; say why the picture is missing
            print(f"plot {p}: {type(e).__name__}: {e}")
    print(f"\ne2e_decode: {common['model']} on {device_name}, commit {common['commit']}, "
          f"{time.time() - budget.t0:.0f} s; outputs: {', '.join(outs) or '(none: pass --out)'}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

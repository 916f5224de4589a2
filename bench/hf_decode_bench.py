"""Per-token decode latency of a Hugging Face model with fmkv's cache, against transformers' fp16 cache.

    python3 bench/hf_decode_bench.py --contexts 4096,32768 --steps 32 --out docs/results/hf_decode.jsonl
    python3 bench/hf_decode_bench.py --plot docs/results/hf_decode_registration_ab.jsonl docs/results/hf_decode.png

A randomly initialised Llama with the attention shape of the issue (32 q / 8 kv heads, head_dim 128,
hidden 4096) and a small MLP (--intermediate, default 1024) so that attention and the cache are a
visible part of a step; --layers layers (default 8). For each context the model prefills a prompt of
that many tokens once per cache, then decodes --steps tokens one at a time (eager forward calls, greedy
next token fed back), timed per step with torch.cuda.synchronize(); median and p90 of the per-step
times. Caches:
  fp16          transformers' DynamicCache, attention "sdpa" restricted to torch's flash / memory-efficient
                kernels (the baseline)
  fp16_default  the same with the SDPA kernel torch picks itself: on the H200 (torch 2.11) that is cuDNN,
                which plans again whenever the key length changes (~5 ms of CPU per layer and step,
                measured by --profile), so it is reported but not used as the baseline
  fmkv          fmkv.hf.FmkvCache (k3v3, 64-token fp16 window), fused=True: one
                torch.ops.fmkv.append_attention per layer and step
  fmkv_2calls   the same with fused=False: torch.ops.fmkv.append in update(), then attention
Eager mode: each step also pays transformers' Python and the other layers' kernels, so the numbers are
the latency a user of generate() sees, not kernel times (bench/cuda_bench.py has those). Prints a table
and writes one JSON line per (context, cache) when --out is given.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def build_model(layers: int, intermediate: int, vocab: int, dtype, device):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=4096, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=1 << 21, rope_theta=500000.0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def make_cache(name: str, model, ctx: int, steps: int, bits):
    import transformers
    import fmkv.hf as fhf
    if name in ("fp16", "fp16_default"):
        model.config._attn_implementation = "sdpa"
        return transformers.DynamicCache(config=model.config)
    kb, vb = bits
    return fhf.FmkvCache(model.config, k_bits=kb, v_bits=vb, max_cache_len=ctx + steps + 16,
                         fused=(name == "fmkv"))  # sets the model's attention to "fmkv"


def sdpa_backends(name: str):
    """The SDPA kernels a case may use (a context manager)."""
    import contextlib
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if name == "fp16":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return contextlib.nullcontext()


def run_case(model, name: str, ctx: int, steps: int, bits, vocab: int, seed: int, profile: bool = False):
    with sdpa_backends(name):
        return _run_case(model, name, ctx, steps, bits, vocab, seed, profile)


def _run_case(model, name: str, ctx: int, steps: int, bits, vocab: int, seed: int, profile: bool):
    import torch
    import fmkv.hf as fhf
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, ctx), generator=g).to(model.device)
    cache = make_cache(name, model, ctx, steps, bits)
    with torch.no_grad():
        out = model(prompt, use_cache=True, **fhf.cache_kwargs(cache))
        tok = out.logits[:, -1:].argmax(-1)
        del out
        times = []
        for i in range(steps + 3):  # 3 warm-up steps (first-call allocations, kernel loads)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(tok, use_cache=True, **fhf.cache_kwargs(cache))
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e6)
        if profile:  # one more step under torch.profiler: where a step's time goes
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = model(tok, use_cache=True, **fhf.cache_kwargs(cache))
                torch.cuda.synchronize()
            print(f"--- profile: {name}, context {ctx}, one step")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if hasattr(cache, "check"):
        cache.check()  # device-side errors surface here
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def plot(jsonl: str, out: str) -> None:
    """Per-token time per context and cache from a hf_decode JSON-lines file (grouped bars; one group of
    bars per context, one colour per cache; a `variant` field, if present, is part of the label; of
    several runs of a case the fastest)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(jsonl) if line.strip()]
    label = lambda r: r["cache"] + (f" ({r['variant']})" if "variant" in r else "")
    labels = list(dict.fromkeys(label(r) for r in rows))
    ctxs = sorted({r["context"] for r in rows})
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, lab in enumerate(labels):
        t = {}  # the fastest of the file's runs per (cache, context): host-bound eager timings are noisy
        for r in rows:
            if label(r) == lab:
                t[r["context"]] = min(t.get(r["context"], float("inf")), r["time_us"] / 1000)
        xs = [j + i * width for j, c in enumerate(ctxs) if c in t]
        ax.bar(xs, [t[c] for c in ctxs if c in t], width, label=lab)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ctxs))])
    ax.set_xticklabels([f"{c // 1024}k" for c in ctxs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per token (median; best run)")
    r0 = rows[0]
    ax.set_title(f"HF decode step, eager, {r0['layers']}-layer Llama (32q/8kv, d=128), {r0['device']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--bits", default="3,3", help="K,V bits of the fmkv caches")
    ap.add_argument("--caches", default="fp16,fp16_default,fmkv,fmkv_2calls")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per case")
    ap.add_argument("--plot", nargs=2, metavar=("JSONL", "PNG"), help="only draw PNG from a results file")
    args = ap.parse_args(argv)
    if args.plot:
        plot(*args.plot)
        return 0
    import torch
    import fmkv  # noqa: F401  (registers torch.ops.fmkv)
    if not torch.cuda.is_available():
        raise SystemExit("hf_decode_bench needs a CUDA device")
    bits = tuple(int(b) for b in args.bits.split(","))
    model = build_model(args.layers, args.intermediate, args.vocab, torch.float16, "cuda")
    rows = []
    print(f"{'context':>8} {'cache':>12} {'median us/token':>16} {'p90':>10} {'vs fp16':>8}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        base = None
        for name in args.caches.split(","):
            try:
                med, p90 = run_case(model, name, ctx, args.steps, bits, args.vocab, seed=ctx, profile=args.profile)
            except RuntimeError as e:  # e.g. no SDPA kernel of the allowed ones takes the shape
                print(f"{ctx:>8} {name:>12} failed: {str(e).splitlines()[0]}", flush=True)
                continue
            torch.cuda.empty_cache()
            base = med if name == "fp16" else base
            ratio = (base / med) if base else float("nan")
            print(f"{ctx:>8} {name:>12} {med:>16.1f} {p90:>10.1f} {ratio:>7.2f}x", flush=True)
            fp16 = name.startswith("fp16")
            rows.append(dict(suite="hf_decode", backend="torch" if fp16 else "cuda",
                             device=torch.cuda.get_device_name(), commit=args.commit, op="hf_decode_step",
                             batch=1, q_len=1, context=ctx, head_dim=128, q_heads=32, kv_heads=8,
                             layers=args.layers, intermediate=args.intermediate,
                             k_bits=16 if fp16 else bits[0], v_bits=16 if fp16 else bits[1],
                             page_size=0 if fp16 else 64, cache=name, window_tokens=0 if fp16 else 64, time_us=round(med, 1),
                             p90_us=round(p90, 1), steps=args.steps, baseline="hf_dynamic_cache_fp16_sdpa_flash",
                             baseline_time_us=None if base is None else round(base, 1),
                             speedup=None if base is None else round(base / med, 3)))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

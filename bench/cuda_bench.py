#!/usr/bin/env python3
"""Driver of the fmkv CUDA benchmark: runs bench/cuda_bench.cu's binary, times torch SDPA (fp16, CUDA
graph, same shapes; the fastest of eight formulations: GQA folded into the query length (exact for
q_len=1) or enable_gqa, x flash / cuDNN / efficient / SDPA's own choice, every variant logged to
cuda_sdpa_variants.jsonl), merges, prints a table and writes docs/results/cuda_decode.jsonl, cuda_quantize.jsonl, cuda_step.jsonl
(one decode step per layer: append + attention, separate calls vs fmkv_append_attention) and a PNG.

    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results [--commit SHA] [--quick]
    python3 bench/cuda_bench.py --out docs/results --replot      # redraw the PNG from the committed JSON
    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results --quantize-only  # cuda_quantize.jsonl
    ... --quantize-only --formats 5:4,5:5 --tag T  # those widths' rows, cuda_quantize_T.jsonl
    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results --latency  # cuda_latency.jsonl
    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results --kv-heads-sweep  # cuda_kv_heads.jsonl
    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results --shape-sweep     # cuda_shapes.jsonl
    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results --ragged  # cuda_decode_ragged.jsonl
    python3 bench/cuda_bench.py --bin build/fmkv_cuda_bench --out docs/results --formats 4:4,5:4,5:5 --tag code_width5
    ... --format-version 3: every fmkv case in format version 3 (the records say format_version)
"""
import argparse
import json
import os
import subprocess
import sys


SDPA_VARIANTS = [
    # (name, GQA layout, backend): "fold" = q [B, H, g, d] against k/v [B, H, S, d] (exact for q_len = 1);
    # "gqa" = q [B, HQ, 1, d] with enable_gqa=True. Backend None = SDPA's own choice.
    ("fold_flash", "fold", "FLASH_ATTENTION"),
    ("fold_cudnn", "fold", "CUDNN_ATTENTION"),
    ("fold_efficient", "fold", "EFFICIENT_ATTENTION"),
    ("fold_auto", "fold", None),
    ("gqa_flash", "gqa", "FLASH_ATTENTION"),
    ("gqa_cudnn", "gqa", "CUDNN_ATTENTION"),
    ("gqa_efficient", "gqa", "EFFICIENT_ATTENTION"),
    ("gqa_auto", "gqa", None),
]


def sdpa_variant_us(B, ctx, layout, backend, HQ=32, H=8, d=128, l2_bytes=60 << 20):
    """Median time of one SDPA fp16 decode call (CUDA graph holding `copies` calls on distinct tensors,
    so the K/V bytes exceed 4x L2, the same way the fmkv benchmark times its kernels)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev = "cuda"
    g = HQ // H
    kv_bytes = 2 * B * H * ctx * d * 2
    copies = 1
    while copies < 8 and copies * kv_bytes < 4 * l2_bytes:
        copies += 1
    qshape = (B, H, g, d) if layout == "fold" else (B, HQ, 1, d)
    qs = [torch.randn(*qshape, device=dev, dtype=torch.float16) for _ in range(copies)]
    ks = [torch.randn(B, H, ctx, d, device=dev, dtype=torch.float16) for _ in range(copies)]
    vs = [torch.randn(B, H, ctx, d, device=dev, dtype=torch.float16) for _ in range(copies)]
    outs = [None] * copies
    kw = {} if layout == "fold" else {"enable_gqa": True}
    import contextlib
    ctx_mgr = contextlib.nullcontext if backend is None else (lambda: sdpa_kernel([getattr(SDPBackend, backend)]))

    def run():
        for i in range(copies):
            outs[i] = F.scaled_dot_product_attention(qs[i], ks[i], vs[i], **kw)

    try:
        with ctx_mgr():
            run()
            torch.cuda.synchronize()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20 if ctx >= 1 << 20 else 50):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3 / copies)
        ts.sort()
        return ts[len(ts) // 2]
    finally:
        for tensors in (qs, ks, vs, outs):  # free the copies before the next shape (run() holds the lists)
            tensors.clear()
        torch.cuda.empty_cache()


def sdpa_time_us(B, ctx, l2_bytes=60 << 20, log=None, HQ=32, H=8, d=128):
    """Fastest of the SDPA formulations (every variant's time goes to `log`): (time_us, variant)."""
    best = (float("nan"), "failed")
    for name, layout, backend in SDPA_VARIANTS:
        try:
            t = sdpa_variant_us(B, ctx, layout, backend, HQ=HQ, H=H, d=d, l2_bytes=l2_bytes)
        except Exception as e:  # a backend that does not take these shapes
            t = float("nan")
            print("SDPA %s B=%d ctx=%d: %s" % (name, B, ctx, str(e).splitlines()[0][:120]), file=sys.stderr)
        if log is not None:
            log.append(dict(batch=B, context=ctx, head_dim=d, variant=name, time_us=None if t != t else round(t, 3)))
        if t == t and not (best[0] <= t):
            best = (t, name)
    return best


def print_table(head_fmt, names, row_fmt, rows, values):
    """A header line, then one line per row (values(row): the row's fields for row_fmt)."""
    print(head_fmt % names)
    for r in rows:
        print(row_fmt % values(r))


def write_jsonl(path, recs):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def quantize_record(r, copy, device, commit):
    """A cuda_quantize.jsonl line from the binary's quantize record and the same run's copy bandwidth."""
    return dict(suite="cuda_quantize", backend="cuda", device=device, commit=commit, op="quantize_append",
                batch=1, q_len=r["tokens"], context=r["tokens"], head_dim=r["head_dim"], q_heads=0,
                kv_heads=r["kv_heads"], layers=1, k_bits=r["k_bits"], v_bits=r["v_bits"],
                page_size=r["page_size"], time_us=r["time_us"], bytes=r["bytes"], gbps=r["gbps"],
                copy_gbps=copy["gbps"], pct_copy_bw=round(100 * r["gbps"] / copy["gbps"], 1),
                mtok_per_s=r["mtok_per_s"], format_version=r.get("format_version", 2),
                scale_group=r.get("scale_group", 32))


def fmt_name(r):
    """k<K>v<V>, with -g64 for scale group 64 (the eval's config names)."""
    return "k%dv%d%s" % (r["k_bits"], r["v_bits"], "-g64" if r.get("scale_group", 32) == 64 else "")


def print_quantize(qua):
    for r in qua:
        print("quantize %s %d tokens: %.1f us, %.0f GB/s, %.1f%% of copy bw, %.1f Mtok/s" % (
              fmt_name(r), r["context"], r["time_us"], r["gbps"], r["pct_copy_bw"], r["mtok_per_s"]))


def quantize_only(a, sfx=""):
    """--quantize-only: the prefill-chunk quantize timing of each format (binary --quant-only kb vb, which
    measures the copy bandwidth in the same process); rewrites cuda_quantize.jsonl only (cuda_quantize_TAG.jsonl
    with --tag). The widths: --formats K:V,... (scale group 32), else k3v3, k4v4, k4v2."""
    pairs = ((3, 3), (4, 4), (4, 2))
    if a.formats:
        pairs = []
        for f in a.formats.split(","):
            w = [int(x) for x in f.split(":")]
            if len(w) != 2:
                sys.exit("--quantize-only --formats: K:V pairs without a scale group (got %s)" % f)
            pairs.append((w[0], w[1]))
    qua = []
    for kb, vb in pairs:
        res = subprocess.run([a.bin, "--quant-only", str(kb), str(vb)], capture_output=True, text=True)
        sys.stderr.write(res.stderr)
        recs = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
        copy = next(r for r in recs if r["kind"] == "copy")
        qua += [quantize_record(r, copy, copy["device"], a.commit) for r in recs if r["kind"] == "quantize"]
    write_jsonl(os.path.join(a.out, "cuda_quantize%s.jsonl" % sfx), qua)
    print_quantize(qua)


def decode_record(r, bt, be, device, commit, suite="cuda_decode"):
    """A cuda_decode.jsonl-style line from the binary's decode record and the same run's SDPA time."""
    return dict(suite=suite, backend="cuda", device=device, commit=commit, op="decode_attention",
                batch=r["batch"], q_len=r.get("q_len", 1), context=r["context"], head_dim=r["head_dim"], q_heads=r["q_heads"],
                kv_heads=r["kv_heads"], layers=1, k_bits=r["k_bits"], v_bits=r["v_bits"],
                page_size=r["page_size"], time_us=r["time_us"], bytes=r["bytes"], gbps=r["gbps"],
                copy_gbps=r["copy_gbps"], pct_copy_bw=r["pct_copy_bw"], baseline="torch_sdpa_fp16_" + be,
                baseline_time_us=round(bt, 3), speedup=round(bt / r["time_us"], 3),
                nonfinite_out=r["nonfinite_out"], window_tokens=r.get("window", 0),
                format_version=r.get("format_version", 2), scale_group=r.get("scale_group", 32),
                max_seq_len=r.get("max_seq_len", 0))  # the call's length bound (0: none; the bench passes the context)


KV_HEADS_SWEEP = (1, 2, 4, 8)
KV_HEADS_CONTEXTS = (4096, 32768, 131072, 1048576)


def same_shape_sdpa(r, copy, cache):
    """The fastest SDPA formulation (time_us, variant) of decode record r's shape (batch, context, heads, head_dim),
    timed once per shape (cache) with the L2 size of the run's copy record."""
    key = (r["batch"], r["context"], r["q_heads"], r["kv_heads"], r["head_dim"])
    if key not in cache:
        cache[key] = sdpa_time_us(r["batch"], r["context"], l2_bytes=copy["l2_bytes"], HQ=r["q_heads"], H=r["kv_heads"],
                                  d=r["head_dim"])
    return cache[key]


def only_records(a, runs):
    """The binary's JSON records of one --only case per run (env: overrides of the environment, B, ctx, kb, vb)."""
    recs = []
    for env, B, ctx, kb, vb in runs:
        res = subprocess.run([a.bin, "--only", str(B), str(ctx), str(kb), str(vb)], capture_output=True, text=True,
                             env=dict(os.environ, **env))
        sys.stderr.write(res.stderr)
        recs += [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    return recs


def kv_heads_sweep(a):
    """--kv-heads-sweep: B=1 decode with 1, 2, 4, 8 kv heads (4 q heads each: one GPU's share of a
    tensor-parallel model, or a small model), k3v3 and k4v4, 4k-1M, against SDPA of the same shapes in the
    same run; writes cuda_kv_heads.jsonl."""
    recs = only_records(a, [({"FMKV_BENCH_KV_HEADS": str(H)}, 1, ctx, kb, vb) for H in KV_HEADS_SWEEP
                            for kb, vb in ((3, 3), (4, 4)) for ctx in KV_HEADS_CONTEXTS])
    copy = next(r for r in recs if r["kind"] == "copy")
    sdpa = {}
    out = [decode_record(r, *same_shape_sdpa(r, copy, sdpa), copy["device"], a.commit, suite="cuda_kv_heads")
           for r in recs if r["kind"] == "decode"]
    write_jsonl(os.path.join(a.out, "cuda_kv_heads.jsonl"), out)
    plot_kv_heads(out, os.path.join(a.out, "cuda_kv_heads.png"))
    print("device: %s   copy bandwidth (read+write): %.0f GB/s" % (copy["device"], copy["gbps"]))
    print("%-5s %8s %8s %8s %10s %8s %6s %10s %8s" % ("fmt", "kv_heads", "q_heads", "context", "fmkv_us", "GB/s",
                                                      "%copy", "sdpa_us", "speedup"))
    for r in out:
        print("k%dv%d %8d %8d %8d %10.2f %8.0f %6.1f %10.2f %8.2f" % (
            r["k_bits"], r["v_bits"], r["kv_heads"], r["q_heads"], r["context"], r["time_us"], r["gbps"],
            r["pct_copy_bw"], r["baseline_time_us"], r["speedup"]))


# --shape-sweep: (head_dim, q heads per kv head) at 8 kv heads; (128, 4) is the headline shape
SHAPE_SWEEP = tuple((128, g) for g in (1, 2, 4, 5, 7, 8, 12, 16)) + ((64, 4), (64, 7), (64, 16), (256, 2), (256, 4),
                                                                      (256, 8))
SHAPE_CONTEXTS = (131072, 1048576)
SHAPE_SDPA_CONTEXT = 131072  # SDPA is timed at this context only (eight formulations per shape)


def shape_sweep(a):
    """--shape-sweep: B=1 decode, 8 kv heads, k3v3 and k4v4 at 128k and 1M tokens, for every (head_dim, GQA group)
    of SHAPE_SWEEP (non-power-of-two groups and groups over 8 query vectors among them), each with its percent of
    copy bandwidth relative to the headline shape's (d = 128, 4 q heads per kv head) of the same run, and SDPA of the
    same shape at 128k; groups over 8 at head_dim <= 128 run twice, as the library picks the kernel (the wide one,
    16 vectors per pass, where compiled: cuda_wide "default") and with FMKV_CUDA_WIDE=0 (passes of 8: "off"), the
    default row's vs_wide_off the time ratio of the two. Writes cuda_shapes.jsonl and cuda_shapes.png (default rows)."""
    def run(env_extra, tag):
        recs = only_records(a, [(dict({"FMKV_BENCH_HEAD_DIM": str(d), "FMKV_BENCH_Q_PER_KV": str(g)}, **env_extra), 1,
                                 ctx, kb, vb)
                                for d, g in SHAPE_SWEEP if tag == "default" or (g > 8 and d <= 128)
                                for kb, vb in ((3, 3), (4, 4)) for ctx in SHAPE_CONTEXTS])
        for r in recs:
            r["cuda_wide"] = tag
        return recs
    recs = run({}, "default") + run({"FMKV_CUDA_WIDE": "0"}, "off")
    copy = next(r for r in recs if r["kind"] == "copy")
    sdpa, out = {}, []
    for r in recs:
        if r["kind"] != "decode":
            continue
        bt, be = same_shape_sdpa(r, copy, sdpa) if r["context"] == SHAPE_SDPA_CONTEXT else (float("nan"), "not_timed")
        rec = decode_record(r, bt, be, copy["device"], a.commit, suite="cuda_shapes")
        rec["cuda_wide"] = r["cuda_wide"]
        if bt != bt:
            rec.update(baseline=None, baseline_time_us=None, speedup=None)
        out.append(rec)
    key = lambda r: (r["head_dim"], r["q_heads"], r["kv_heads"], r["k_bits"], r["v_bits"], r["context"])
    off = {key(r): r["time_us"] for r in out if r["cuda_wide"] == "off"}
    head = {(r["k_bits"], r["v_bits"], r["context"]): r["pct_copy_bw"] for r in out
            if r["head_dim"] == 128 and r["q_heads"] == 4 * r["kv_heads"] and r["cuda_wide"] == "default"}
    for r in out:
        h = head.get((r["k_bits"], r["v_bits"], r["context"]))
        r["vs_headline_bw"] = round(r["pct_copy_bw"] / h, 3) if h else None
        t_off = off.get(key(r)) if r["cuda_wide"] == "default" else None
        r["vs_wide_off"] = round(t_off / r["time_us"], 3) if t_off else None
    write_jsonl(os.path.join(a.out, "cuda_shapes.jsonl"), out)
    plot_shapes([r for r in out if r["cuda_wide"] == "default"], os.path.join(a.out, "cuda_shapes.png"))
    print("device: %s   copy bandwidth (read+write): %.0f GB/s" % (copy["device"], copy["gbps"]))
    print("%-5s %4s %8s %8s %8s %8s %10s %8s %6s %9s %10s %8s %9s" % (
        "fmt", "d", "q_heads", "kv_heads", "context", "wide", "fmkv_us", "GB/s", "%copy", "/headline", "sdpa_us",
        "speedup", "/wide_off"))
    for r in out:
        print("k%dv%d %4d %8d %8d %8d %8s %10.2f %8.0f %6.1f %9s %10s %8s %9s" % (
            r["k_bits"], r["v_bits"], r["head_dim"], r["q_heads"], r["kv_heads"], r["context"], r["cuda_wide"],
            r["time_us"], r["gbps"], r["pct_copy_bw"], "%.3f" % r["vs_headline_bw"] if r["vs_headline_bw"] else "-",
            "%.2f" % r["baseline_time_us"] if r["baseline_time_us"] else "-",
            "%.2f" % r["speedup"] if r["speedup"] else "-", "%.3f" % r["vs_wide_off"] if r["vs_wide_off"] else "-"))


RAGGED_CASES = ("1k-64kx16", "64k,1kx15", "1k-16kx64", "128k,4kx7", "1k-256kx4")


def ragged(a):
    """--ragged: decode over ragged batches (RAGGED_CASES, k3v3 and k4v4), each beside fmkv's uniform batch of
    the same bytes (B sequences of the mean length) and SDPA fp16's uniform batch of the same bytes, all in
    one run; writes cuda_decode_ragged.jsonl (suite cuda_decode, case "ragged", "ragged_uniform_plan" (the same batch
    with FMKV_CUDA_BALANCE=0: every sequence the grid's split count) or "uniform_same_bytes") and a PNG."""
    recs, copy = [], None
    for spec in RAGGED_CASES:
        for kb, vb in ((3, 3), (4, 4)):
            res = subprocess.run([a.bin, "--ragged", str(kb), str(vb), spec], capture_output=True, text=True)
            sys.stderr.write(res.stderr)
            got = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
            copy = copy or next((r for r in got if r["kind"] == "copy"), None)
            rag = [r for r in got if r["kind"] == "decode"]
            recs += rag
            # the same batch with the uniform split plan (FMKV_CUDA_BALANCE=0: nsplit splits for every sequence)
            res = subprocess.run([a.bin, "--ragged", str(kb), str(vb), spec], capture_output=True, text=True,
                                 env=dict(os.environ, FMKV_CUDA_BALANCE="0"))
            sys.stderr.write(res.stderr)
            recs += [dict(json.loads(l), case="ragged_uniform_plan") for l in res.stdout.splitlines()
                     if l.startswith("{") and '"decode"' in l]
            for r in rag:  # fmkv's uniform batch of the same bytes
                res = subprocess.run([a.bin, "--only", str(r["batch"]), str(r["context"]), str(kb), str(vb)],
                                     capture_output=True, text=True)
                sys.stderr.write(res.stderr)
                recs += [dict(json.loads(l), case="uniform_same_bytes", lengths_spec=spec)
                         for l in res.stdout.splitlines() if l.startswith("{") and '"decode"' in l]
    sdpa, out = {}, []
    for r in recs:
        key = (r["batch"], r["context"])
        if key not in sdpa:
            sdpa[key] = sdpa_time_us(r["batch"], r["context"], l2_bytes=copy["l2_bytes"], d=r["head_dim"])
        bt, be = sdpa[key]
        rec = decode_record(r, bt, be, copy["device"], a.commit)
        rec.update(case=r["case"], lengths_spec=r["lengths_spec"])
        if r["case"] != "uniform_same_bytes":
            rec["lengths"] = r["lengths"]
        sdpa_bytes = 2.0 * r["batch"] * r["kv_heads"] * r["context"] * r["head_dim"] * 2 + 4.0 * r["batch"] * r["q_heads"] * r["head_dim"]
        rec["baseline_pct_copy_bw"] = round(100.0 * sdpa_bytes / bt / 1e3 / copy["gbps"], 1)
        out.append(rec)
    write_jsonl(os.path.join(a.out, "cuda_decode_ragged.jsonl"), out)
    print("device: %s   copy bandwidth (read+write): %.0f GB/s" % (copy["device"], copy["gbps"]))
    print_table("%-5s %-12s %-19s %3s %8s %10s %6s %10s %6s %8s",
                ("fmt", "lengths", "case", "B", "mean", "fmkv_us", "%copy", "sdpa_us", "%copy", "speedup"),
                "k%dv%d %-12s %-19s %3d %8d %10.2f %6.1f %10.2f %6.1f %8.2f", out,
                lambda r: (r["k_bits"], r["v_bits"], r["lengths_spec"], r["case"], r["batch"], r["context"], r["time_us"],
                           r["pct_copy_bw"], r["baseline_time_us"], r["baseline_pct_copy_bw"], r["speedup"]))
    plot_ragged(out, copy["device"], os.path.join(a.out, "cuda_decode_ragged.png"))


def plot_ragged(out, device, path):
    """Grouped bars: % of copy bandwidth per ragged case, fmkv ragged / fmkv uniform of the same bytes / SDPA."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    specs = [s for s in RAGGED_CASES if any(r["lengths_spec"] == s for r in out)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, (kb, vb) in zip(axes, ((3, 3), (4, 4))):
        def pct(spec, case, field="pct_copy_bw"):
            r = [x for x in out if x["lengths_spec"] == spec and x["case"] == case and x["k_bits"] == kb and x["v_bits"] == vb]
            return r[0][field] if r else 0.0
        xs = range(len(specs))
        w = 0.2
        ax.bar([x - 1.5 * w for x in xs], [pct(s, "ragged_uniform_plan") for s in specs], w,
               label="fmkv, ragged batch, uniform split plan")
        ax.bar([x - 0.5 * w for x in xs], [pct(s, "ragged") for s in specs], w, label="fmkv, ragged batch, balanced plan")
        ax.bar([x + 0.5 * w for x in xs], [pct(s, "uniform_same_bytes") for s in specs], w,
               label="fmkv, uniform batch of the same bytes")
        ax.bar([x + 1.5 * w for x in xs], [pct(s, "ragged", "baseline_pct_copy_bw") for s in specs], w,
               label="SDPA fp16, uniform batch of the same bytes")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(specs, rotation=20)
        ax.set_title("k%dv%d decode, ragged batches (%s)" % (kb, vb, device))
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("% of measured copy bandwidth")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", help="the fmkv_cuda_bench binary (not needed with --replot)")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw cuda_decode.png (and cuda_kv_heads.png) from the JSON already in --out")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--latency", action="store_true",
                    help="k3v3 B=1 4k/32k/128k and B=64 8k only, attention and decode step, with SDPA; writes "
                         "cuda_latency.jsonl (decode and step records) instead of the full files")
    ap.add_argument("--quantize-only", action="store_true",
                    help="only the quantize-append timing (rewrites cuda_quantize.jsonl, nothing else)")
    ap.add_argument("--ragged", action="store_true",
                    help="decode over ragged batches (RAGGED_CASES) beside uniform batches of the same bytes (fmkv and "
                         "SDPA); writes cuda_decode_ragged.jsonl and its PNG only")
    ap.add_argument("--kv-heads-sweep", action="store_true",
                    help="B=1 decode with 1/2/4/8 kv heads (4 q heads each), k3v3 and k4v4, with SDPA of the same "
                         "shapes; writes cuda_kv_heads.jsonl only")
    ap.add_argument("--shape-sweep", action="store_true",
                    help="B=1 decode, k3v3 and k4v4 at 128k and 1M, head_dim 64/128/256 and 1-16 q heads per kv head "
                         "(SHAPE_SWEEP), %% of copy bandwidth against the headline shape's; writes cuda_shapes.jsonl")
    ap.add_argument("--formats", default=None,
                    help="the (K, V) widths of the default run, e.g. 4:4,5:4,5:5, each with an optional scale group "
                         "(4:4:64; default 32) (FMKV_BENCH_FORMATS of the binary; no window run); with --tag the files "
                         "are named cuda_decode_TAG.jsonl etc.")
    ap.add_argument("--tag", default=None, help="suffix of the output files (cuda_decode_TAG.jsonl, ...)")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="head_dim of every case (FMKV_BENCH_HEAD_DIM of the binary, which refuses one the format "
                         "does not have; default 128)")
    ap.add_argument("--format-version", type=int, choices=(2, 3), default=None,
                    help="the cache format version of every fmkv case (FMKV_BENCH_FORMAT_VERSION of the binary; "
                         "format 3 changes the 3-bit codes only)")
    a = ap.parse_args()
    if a.format_version:
        os.environ["FMKV_BENCH_FORMAT_VERSION"] = str(a.format_version)
    if a.head_dim:
        os.environ["FMKV_BENCH_HEAD_DIM"] = str(a.head_dim)
    if a.formats:
        os.environ["FMKV_BENCH_FORMATS"] = ";".join(f.replace(":", ",") for f in a.formats.split(","))
    sfx = "_" + a.tag if a.tag else ""
    if a.replot:
        dec = [json.loads(l) for l in open(os.path.join(a.out, "cuda_decode.jsonl"))]
        plot_decode(dec, dec[0]["copy_gbps"], dec[0]["device"], os.path.join(a.out, "cuda_decode.png"))
        kvp = os.path.join(a.out, "cuda_kv_heads.jsonl")
        if os.path.exists(kvp):
            plot_kv_heads([json.loads(l) for l in open(kvp)], os.path.join(a.out, "cuda_kv_heads.png"))
        return
    if not a.bin:
        ap.error("--bin is required")
    os.makedirs(a.out, exist_ok=True)
    if a.quantize_only:
        quantize_only(a, sfx)
        return
    if a.ragged:
        ragged(a)
        return
    if a.kv_heads_sweep:
        kv_heads_sweep(a)
        return
    if a.shape_sweep:
        shape_sweep(a)
        return
    cmd = [a.bin] + (["--quick"] if a.quick else []) + (["--latency"] if a.latency else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(res.stderr)
    recs = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
    if not a.quick and not a.latency and not a.formats:  # k3v3 B=1, 64-token fp16 window (fmkv.hf.FmkvCache's default)
        resw = subprocess.run([a.bin, "--window", "64"], capture_output=True, text=True)
        sys.stderr.write(resw.stderr)
        recs += [r for r in (json.loads(l) for l in resw.stdout.splitlines() if l.startswith("{"))
                 if r["kind"] != "copy"]
    raw_name = "cuda_latency_raw.jsonl" if a.latency else "cuda_bench_raw%s.jsonl" % sfx
    with open(os.path.join(a.out, raw_name), "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    if res.returncode != 0:
        print("benchmark binary failed with", res.returncode, file=sys.stderr)
    copy = next((r for r in recs if r["kind"] == "copy"), {"gbps": float("nan"), "device": "?", "l2_bytes": 60 << 20})
    device = copy["device"]
    sdpa, sdpa_log = {}, []
    for r in recs:
        if r["kind"] == "decode" and (r["batch"], r["context"]) not in sdpa:
            sdpa[(r["batch"], r["context"])] = sdpa_time_us(r["batch"], r["context"], l2_bytes=copy["l2_bytes"], d=r["head_dim"],
                                                            log=sdpa_log)
    with open(os.path.join(a.out, "cuda_latency_sdpa.jsonl" if a.latency else "cuda_sdpa_variants%s.jsonl" % sfx), "w") as f:
        for r in sdpa_log:
            f.write(json.dumps(dict(suite="cuda_sdpa_variants", device=device, commit=a.commit, **r)) + "\n")
    dec, qua, steps = [], [], []
    for r in recs:
        if r["kind"] == "decode":
            bt, be = sdpa[(r["batch"], r["context"])]
            dec.append(decode_record(r, bt, be, device, a.commit))
        elif r["kind"] == "step":
            bt, be = sdpa[(r["batch"], r["context"])]
            steps.append(dict(suite="cuda_step", backend="cuda", device=device, commit=a.commit,
                              op="decode_step_append_attention", batch=r["batch"], q_len=r.get("q_len", 1), context=r["context"],
                              head_dim=r["head_dim"], q_heads=r["q_heads"], kv_heads=r["kv_heads"], layers=1,
                              k_bits=r["k_bits"], v_bits=r["v_bits"], page_size=r["page_size"],
                              time_us=r["fused_us"], separate_us=r["separate_us"],
                              attention_only_us=r["attention_only_us"], graph="cuda_graph",
                              baseline="torch_sdpa_fp16_" + be + "_attention_only", baseline_time_us=round(bt, 3),
                              speedup=round(bt / r["fused_us"], 3), window_tokens=r.get("window", 0),
                              format_version=r.get("format_version", 2), scale_group=r.get("scale_group", 32)))
        elif r["kind"] == "quantize":
            qua.append(quantize_record(r, copy, device, a.commit))
    if a.latency:
        write_jsonl(os.path.join(a.out, "cuda_latency.jsonl"), [dict(r, suite="cuda_latency") for r in dec + steps])
    else:
        write_jsonl(os.path.join(a.out, "cuda_decode%s.jsonl" % sfx), dec)
        write_jsonl(os.path.join(a.out, "cuda_quantize%s.jsonl" % sfx), qua)
        write_jsonl(os.path.join(a.out, "cuda_step%s.jsonl" % sfx), steps)
    print("device: %s   copy bandwidth (read+write): %.0f GB/s" % (device, copy["gbps"]))
    print_table("%-8s %3s %8s %6s %10s %8s %6s %10s %8s %s",
                ("fmt", "B", "context", "window", "fmkv_us", "GB/s", "%copy", "sdpa_us", "speedup", "sdpa_variant"),
                "%-8s %3d %8d %6d %10.2f %8.0f %6.1f %10.2f %8.2f %s", dec,
                lambda r: (fmt_name(r), r["batch"], r["context"], r["window_tokens"], r["time_us"], r["gbps"],
                           r["pct_copy_bw"], r["baseline_time_us"], r["speedup"], r["baseline"]))
    print("decode step per layer (append 1 token + attention), CUDA graph:")
    print("%-8s %3s %8s %6s %10s %12s %10s %10s" % ("fmt", "B", "context", "window", "fused_us", "separate_us",
                                                    "attn_us", "sdpa_us"))
    for r in steps:
        print("%-8s %3d %8d %6d %10.2f %12.2f %10.2f %10.2f" % (fmt_name(r), r["batch"], r["context"],
              r["window_tokens"], r["time_us"], r["separate_us"], r["attention_only_us"], r["baseline_time_us"]))
    print_quantize(qua)
    if a.latency:
        return
    plot_decode(dec, copy["gbps"], device, os.path.join(a.out, "cuda_decode%s.png" % sfx))


def _context_axes(axes, xlabel, time_axis):
    """Log2 context on the x axes, log time on the time axis."""
    for a_ in axes:
        a_.set_xscale("log", base=2)
        a_.set_xlabel(xlabel)
    time_axis.set_yscale("log")


def plot_decode(dec, copy_gbps, device, path):
    """GB/s vs context at B=1 (no window) for each format and the SDPA baseline of the same records."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, at) = plt.subplots(1, 2, figsize=(12, 4.5))
        b1 = [r for r in dec if r["batch"] == 1 and not r.get("window_tokens")]
        for name in sorted({fmt_name(r) for r in b1}):
            xs = [r for r in b1 if fmt_name(r) == name]
            ax.plot([r["context"] for r in xs], [r["gbps"] for r in xs], "o-", label="fmkv " + name)
            at.plot([r["context"] for r in xs], [r["time_us"] for r in xs], "o-", label="fmkv " + name)
        base = {}
        for r in b1:
            base.setdefault(r["context"], r["baseline_time_us"])
        xs = sorted(base)
        label = "torch SDPA fp16 (fastest of 8 formulations)"
        d = b1[0]["head_dim"] if b1 else 128
        ax.plot(xs, [2 * c * 8 * d * 2 / base[c] / 1e3 for c in xs], "s--", label=label)
        at.plot(xs, [base[c] for c in xs], "s--", label=label)
        ax.axhline(copy_gbps, color="gray", ls=":", label="D2D copy")
        _context_axes((ax, at), "context (tokens), B=1, 32q/8kv heads, d=%d" % d, at)
        ax.set_ylabel("GB/s (bytes that must move / time)")
        at.set_ylabel("time per decode call (µs, CUDA graph)")
        ax.set_title("decode attention on %s: bandwidth" % device)
        at.set_title("decode attention on %s: time" % device)
        ax.legend(fontsize=8)
        at.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:
        print("plot failed:", e, file=sys.stderr)


def plot_kv_heads(recs, path):
    """--kv-heads-sweep: time vs context per kv-head count (k3v3, k4v4) with SDPA of the same shapes, and
    the speedup over SDPA."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (at, asp) = plt.subplots(1, 2, figsize=(12, 4.5))
        heads = sorted({r["kv_heads"] for r in recs})
        colors = dict(zip(heads, ["C0", "C1", "C2", "C3", "C4", "C5"]))
        for h in heads:
            for (kb, vb), style in (((3, 3), "o-"), ((4, 4), "^:")):
                xs = sorted((r for r in recs if r["kv_heads"] == h and (r["k_bits"], r["v_bits"]) == (kb, vb)),
                            key=lambda r: r["context"])
                if not xs:
                    continue
                lab = "fmkv k%dv%d, %d kv heads" % (kb, vb, h)
                at.plot([r["context"] for r in xs], [r["time_us"] for r in xs], style, color=colors[h], label=lab)
                asp.plot([r["context"] for r in xs], [r["speedup"] for r in xs], style, color=colors[h], label=lab)
            base = sorted({(r["context"], r["baseline_time_us"]) for r in recs if r["kv_heads"] == h})
            at.plot([c for c, _ in base], [t for _, t in base], "s--", color=colors[h], alpha=0.5,
                    label="torch SDPA fp16, %d kv heads" % h)
        asp.axhline(1.0, color="gray", ls=":")
        _context_axes((at, asp), "context (tokens), B=1, 4 q heads per kv head, d=128", at)
        at.set_ylabel("time per decode call (µs, CUDA graph)")
        asp.set_ylabel("speedup over the fastest SDPA formulation")
        dev = recs[0]["device"] if recs else "?"
        at.set_title("decode attention on %s, few kv heads" % dev)
        asp.set_title("fmkv vs SDPA (same run, same shapes)")
        at.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:
        print("plot failed:", e, file=sys.stderr)


def plot_shapes(recs, path):
    """--shape-sweep: percent of copy bandwidth per (head_dim, q heads per kv head), k3v3 and k4v4 at each context,
    with the band 0.85x the headline shape's."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ctxs = sorted({r["context"] for r in recs})
        fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 4.5), squeeze=False)
        shapes = sorted({(r["head_dim"], r["q_heads"] // r["kv_heads"]) for r in recs})
        for ax, ctx in zip(axes[0], ctxs):
            for i, ((kb, vb), color) in enumerate((((3, 3), "C0"), ((4, 4), "C1"))):
                by = {(r["head_dim"], r["q_heads"] // r["kv_heads"]): r for r in recs
                      if r["context"] == ctx and (r["k_bits"], r["v_bits"]) == (kb, vb)}
                xs = [j + 0.4 * i for j, s in enumerate(shapes) if s in by]
                ax.bar(xs, [by[s]["pct_copy_bw"] for s in shapes if s in by], width=0.4, color=color,
                       label="fmkv k%dv%d" % (kb, vb))
                head = by.get((128, 4))
                if head:
                    ax.axhline(0.85 * head["pct_copy_bw"], color=color, ls=":", lw=1,
                               label="0.85 x k%dv%d at d=128, GQA 4" % (kb, vb))
            ax.set_xticks([j + 0.2 for j in range(len(shapes))])
            ax.set_xticklabels(["d%d\nG%d" % s for s in shapes], fontsize=8)
            ax.set_ylabel("% of copy bandwidth")
            ax.set_title("B=1, 8 kv heads, %dk tokens (%s)" % (ctx // 1024, recs[0]["device"] if recs else "?"))
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:
        print("plot failed:", e, file=sys.stderr)


if __name__ == "__main__":
    main()

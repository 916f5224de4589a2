#!/usr/bin/env python3
"""Context-parallel decode (suite ``cp_decode``, shared/BENCHMARKS.md): one sequence of ``gpus x tokens_per_gpu``
tokens sharded by token range over the ranks (fmkv.distributed.ContextParallelCache with device shards:
fmkv.torch_ops.TorchCache on each rank's GPU, NCCL), Llama-3-8B geometry by default (32 q / 8 kv heads, d = 128, 32 layers),
k3v3 in format 3.

    torchrun --nproc-per-node N bench/cp_decode.py --out docs/results/cp_decode.jsonl --commit SHA
    python3 bench/cp_decode.py --out F ...            # one process: gpus = 1 (no torchrun needed)
    python3 bench/cp_decode.py --plot F --png P       # redraw the plot, print the table
    python3 bench/cp_decode.py --device cpu --tokens-per-gpu 4096 --layers 2 --out /tmp/cp.jsonl   # a CPU try

Per decode step (all layers; host-timed, every rank synchronised before and after, median over steps):
* ``time_us``: the context-parallel attention step -- every layer's local (out, lse) over the rank's shard, one
  all_gather of the partials, the float64 merge on the device;
* ``comm_us``: the all_gather and merge alone (fixed partials, the same collectives and merge per layer);
* ``single_gpu_time_us``: the same ranks' attention over their own shard alone (``TorchCache.attention``, no
  collective) -- one GPU's step at context / gpus, in the same run; ``ratio`` = time_us / single_gpu_time_us;
* ``append_us``: appending the step's token to every layer (the owning rank compresses it; every rank checks
  the rows and agrees by one all_reduce).
``check_rel_err``: the merged output of sampled layers against the merge of every rank's partial computed by
the CPU backend (within 1e-5 of float64 by its tests) on a host copy of the shard, the largest relative error
over the sampled steps (``check_bound``: the CUDA attention bound).
The fill writes random fp16 K/V (the same on every rank: seeded per layer and chunk) in 32k-token chunks.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON lines file to append the result to (rank 0)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--tokens-per-gpu", type=int, default=4 << 20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bits", default="3:3", help="K:V code widths (default 3:3)")
    ap.add_argument("--format-version", type=int, default=3)
    ap.add_argument("--window", type=int, default=0, help="fp16 window tokens (on the last rank)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=32768, help="tokens per fill append")
    ap.add_argument("--check-layers", default="0,-1", help="layers whose merged output is checked on the CPU")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--plot", help="draw this JSON lines file (no run)")
    ap.add_argument("--png", help="with --plot: the PNG to write")
    a = ap.parse_args(argv)
    if a.plot is None and a.out is None:
        ap.error("--out is required (or --plot)")
    for name in ("tokens_per_gpu", "layers", "steps", "chunk"):
        if getattr(a, name) < 1 or getattr(a, name) > (1 << 40):
            ap.error(f"--{name.replace('_', '-')} must be in [1, 2^40]")
    if a.warmup < 0 or a.window < 0:
        ap.error("--warmup and --window must be >= 0")
    return a


def init_group(device_kind):
    import torch
    import torch.distributed as dist

    backend = "nccl" if device_kind == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        local = int(os.environ.get("LOCAL_RANK", 0))
        if device_kind == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    else:
        import tempfile

        store = tempfile.mktemp(prefix="fmkv_cp_store_")
        if device_kind == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    dev = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else torch.device("cpu")
    return dist, dev


def rows(gen_seed, n, heads, d, dev, scale=1.0):
    import torch

    g = torch.Generator(device=dev)
    g.manual_seed(gen_seed)
    return (torch.randn(n, heads, d, generator=g, device=dev, dtype=torch.float32) * scale).to(torch.float16)


def sync(dist, dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def timed(dist, dev, fn, reps):
    out = []
    for _ in range(reps):
        sync(dist, dev)
        t0 = time.perf_counter()
        fn()
        sync(dist, dev)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def cpu_partial(shard, layer, seq, q):
    """The shard's (out, lse) for q by the CPU backend, on host copies of its tensors."""
    import torch

    from fmkv import torch_ops

    n = shard.length(layer, seq)
    table = shard.block_table(seq)
    return torch_ops.attention_lse(shard.pages[layer].cpu(), shard.fp16_k[layer].cpu(), shard.fp16_v[layer].cpu(),
                                   q.float().cpu(), torch.tensor([seq], dtype=torch.int32),
                                   torch.tensor([n], dtype=torch.int64), torch.tensor([0, q.shape[0]], dtype=torch.int64),
                                   torch.tensor([table if table else [0]], dtype=torch.int32),
                                   torch_ops.config_to_list(shard.config), layer, backend="cpu")


def run(a):
    import torch

    import fmkv
    import fmkv.distributed as fd

    kind = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dist, dev = init_group(kind)
    rank, world = dist.get_rank(), dist.get_world_size()
    kb, vb = (int(x) for x in a.bits.split(":"))
    cfg = fmkv.Config(head_dim=a.head_dim, num_kv_heads=a.kv_heads, k_bits=kb, v_bits=vb, page_size=64,
                      window_tokens=a.window, format_version=a.format_version)
    extra = -(-(a.warmup + 2 * a.steps + 1) // world)  # the decode steps' tokens: room in every shard
    cp = fd.ContextParallelCache(cfg, a.layers, a.tokens_per_gpu + extra, backend="cuda" if kind == "cuda" else None,
                                 device=dev)
    total = world * a.tokens_per_gpu
    say = (lambda *m, end="\n": print(*m, file=sys.stderr, flush=True, end=end)) if rank == 0 else (lambda *m, end="": None)
    t0 = time.perf_counter()
    chunks = -(-total // a.chunk)
    for layer in range(a.layers):
        for c in range(chunks):
            n = min(a.chunk, total - c * a.chunk)
            seed = (layer * 1_000_003 + c) * 2
            cp.append(layer, rows(seed, n, a.kv_heads, a.head_dim, dev, 2.0), rows(seed + 1, n, a.kv_heads, a.head_dim, dev))
        done = (layer + 1) / a.layers
        say(f"\rfill [{'#' * int(30 * done):<30}] {layer + 1}/{a.layers} layers, {total} tokens each, "
            f"{time.perf_counter() - t0:.0f} s", end="" if layer + 1 < a.layers else "\n")
    shard, seq = cp.local_cache, 0
    qs = [rows(9_000_000 + s, 1, a.q_heads, a.head_dim, dev) for s in range(a.warmup + 2 * a.steps + 1)]
    news = [(rows(8_000_000 + 2 * s, 1, a.kv_heads, a.head_dim, dev, 2.0),
             rows(8_000_001 + 2 * s, 1, a.kv_heads, a.head_dim, dev)) for s in range(len(qs))]
    step = iter(range(len(qs)))

    def append_step():
        s = next(step)
        for layer in range(a.layers):
            cp.append(layer, *news[s])
        return s

    cur = [0]

    def attention_step():
        for layer in range(a.layers):
            cp.attention(layer, qs[cur[0]])

    def single_step():
        for layer in range(a.layers):
            shard.attention(layer, seq, qs[cur[0]])

    parts = [cp.local_partial(layer, qs[0]) for layer in range(a.layers)]

    def comm_step():
        for layer in range(a.layers):
            fd.merge_partials(*cp.gather_partials(*parts[layer]), check=False)  # as cp.attention merges

    app, att, single, comm = [], [], [], []
    check_layers = sorted({int(x) % a.layers for x in a.check_layers.split(",") if x.strip()})
    worst = 0.0
    for i in range(a.warmup + a.steps):
        app += timed(dist, dev, lambda: cur.__setitem__(0, append_step()), 1)
        att += timed(dist, dev, attention_step, 1)
        single += timed(dist, dev, single_step, 1)
        comm += timed(dist, dev, comm_step, 1)
        if i >= a.warmup and i < a.warmup + 2:  # check two steps' merged outputs against the CPU backend
            for layer in check_layers:
                merged = cp.attention(layer, qs[cur[0]])
                o, l = cpu_partial(shard, layer, seq, qs[cur[0]]) if cp.local_range(layer)[1] > cp.local_range(layer)[0] \
                    else (torch.zeros(1, a.q_heads, a.head_dim), torch.full((1, a.q_heads), -float("inf")))
                outs, lses = cp.gather_partials(o.to(dev), l.to(dev))
                ref = fd.merge_partials([x.cpu() for x in outs], [x.cpu() for x in lses]).double()
                err = float((merged.cpu().double() - ref).norm() / ref.norm())
                worst = max(worst, err)
    cp.check()
    med = lambda xs: statistics.median(xs[a.warmup:])
    if rank == 0:
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        rec = dict(suite="cp_decode", backend="cuda" if kind == "cuda" else fmkv.default_backend(), device=gpu,
                   commit=a.commit, op="decode_attention", gpus=world, context=total + a.warmup + a.steps,
                   tokens_per_gpu=a.tokens_per_gpu, layers=a.layers, batch=1, q_len=1, head_dim=a.head_dim,
                   q_heads=a.q_heads, kv_heads=a.kv_heads, k_bits=kb, v_bits=vb, format_version=a.format_version,
                   page_size=64, window=a.window, steps=a.steps, time_us=med(att), comm_us=med(comm),
                   single_gpu_time_us=med(single), append_us=med(app), ratio=med(att) / med(single),
                   comm_pct=100 * med(comm) / med(att), per_layer_us=med(att) / a.layers,
                   check_rel_err=worst, check_bound=4e-3 if kind == "cuda" else 1e-5,
                   process_group=dist.get_backend(), timing="host, synchronised per step, median")
        line = json.dumps(rec)
        print(line)
        with open(a.out, "a") as f:
            f.write(line + "\n")
        if worst > rec["check_bound"]:
            say(f"check failed: merged output {worst:.3g} from the CPU backend's merge (bound {rec['check_bound']})")
            dist.destroy_process_group()
            sys.exit(1)
    dist.destroy_process_group()


def plot(path, png):
    recs = [json.loads(x) for x in open(path) if x.strip()]
    recs.sort(key=lambda r: (r["gpus"], r["context"]))
    print(f"{'gpus':>4} {'context':>10} {'layers':>6} {'step ms':>9} {'comm ms':>8} {'one GPU ms':>10} {'ratio':>6} "
          f"{'append ms':>9} {'check':>8}")
    for r in recs:
        print(f"{r['gpus']:>4} {r['context']:>10} {r['layers']:>6} {r['time_us'] / 1e3:>9.3f} {r['comm_us'] / 1e3:>8.3f} "
              f"{r['single_gpu_time_us'] / 1e3:>10.3f} {r['ratio']:>6.3f} {r['append_us'] / 1e3:>9.3f} "
              f"{r['check_rel_err']:>8.1e}")
    if not png:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(recs))
    w = 0.28
    ax.bar(x - w, [r["single_gpu_time_us"] / 1e3 for r in recs], w, label="one GPU, its shard alone")
    ax.bar(x, [r["time_us"] / 1e3 for r in recs], w, label="context parallel step")
    ax.bar(x + w, [r["comm_us"] / 1e3 for r in recs], w, label="all_gather + merge")
    ax.set_xticks(x, [f"{r['gpus']} x {r['tokens_per_gpu'] / 2**20:g}M\n{r['device']}" for r in recs], fontsize=8)
    ax.set_ylabel(f"ms per decode step ({recs[0]['layers']} layers)")
    ax.set_title("fmkv context-parallel decode (k%dv%d, d = %d)" % (recs[0]["k_bits"], recs[0]["v_bits"],
                                                                    recs[0]["head_dim"]))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    a = parse_args(argv)
    if a.plot:
        plot(a.plot, a.png)
    else:
        run(a)


if __name__ == "__main__":
    main()

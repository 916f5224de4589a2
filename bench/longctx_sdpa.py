"""fp16 baseline for the long-context run (issue 7): the largest fp16 KV cache of a
32-layer, 8-kv-head, d=128 model that fits next to nothing else on the GPU, timed the same way
as bench/longctx.cpp (one decode step = SDPA over every layer, median of reps, synchronised).

  python3 bench/longctx_sdpa.py --layers 32 --jsonl docs/results/cuda_longctx.jsonl --commit SHA
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-gbps", type=float, default=0.0)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--jsonl", default="")
    a = ap.parse_args()
    free, total = torch.cuda.mem_get_info()
    per_token = a.layers * a.kv_heads * a.head_dim * 2 * 2  # K and V, fp16
    ctx = int(free * 0.97 - 256e6) // per_token // 1024 * 1024
    ks, vs = [], []
    for _ in range(a.layers):
        ks.append(torch.randn(1, a.kv_heads, ctx, a.head_dim, device="cuda", dtype=torch.float16))
        vs.append(torch.randn(1, a.kv_heads, ctx, a.head_dim, device="cuda", dtype=torch.float16))
    q = torch.randn(1, a.q_heads, 1, a.head_dim, device="cuda", dtype=torch.float16)

    def step():
        for k, v in zip(ks, vs):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()

    step()
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e6)
    times.sort()
    us = times[len(times) // 2]
    nbytes = per_token * ctx
    gbps = nbytes / us / 1e3
    rec = {"suite": "cuda_longctx", "backend": "torch_sdpa_fp16", "device": torch.cuda.get_device_name(),
           "commit": a.commit, "op": "decode_attention", "batch": 1, "q_len": 1, "context": ctx,
           "head_dim": a.head_dim, "q_heads": a.q_heads, "kv_heads": a.kv_heads, "layers": a.layers,
           "k_bits": 16, "v_bits": 16, "page_size": 0, "time_us": round(us, 1), "bytes": nbytes,
           "gbps": round(gbps, 1), "copy_gbps": a.copy_gbps,
           "pct_copy_bw": round(100 * gbps / a.copy_gbps, 1) if a.copy_gbps else 0,
           "alloc_bytes": nbytes, "note": "largest fp16 context that fits (free memory %.1f GB of %.1f GB)"
           % (free / 1e9, total / 1e9), "data": "random normal fp16"}
    print("torch SDPA fp16: %d layers x %d tokens (largest that fits, %.1f GB): %.3f ms per step, %.0f GB/s"
          % (a.layers, ctx, nbytes / 1e9, us / 1e3, gbps))
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()

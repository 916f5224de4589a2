"""Host cost per call of the fmkv torch ops on CUDA tensors (what eager PyTorch / transformers pay per layer).

    python3 bench/torch_op_bench.py [--calls 2000] [--context 4096] [--out results.jsonl] [--label NAME]

One layer's cache (k3v3, 32 q / 8 kv heads, d=128, page 64, 64-token fp16 window) holding --context
tokens; then --calls calls of each op back to back, one decode token each, without a synchronisation
between them, and one at the end. When the device finishes each call's kernels before the host has
issued the next call (decode kernels take 15-25 us), the wall time per call is the host's cost per call:
argument checks, DLPack export, the extension call and the launches. For scale, the same loop over
``torch.add`` of two [1, 32, 128] fp16 tensors (one small aten op). The lengths are not advanced, so
every fused call appends into the same token slot (the cache stays valid). Prints a table; --out appends
JSON lines (suite "torch_op_overhead": host_us_per_call = issue time / calls, wall_us_per_call =
until the device finished / calls).
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="loops per op; the fastest is reported")
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default="", help="recorded with each line (e.g. the torch_ops version)")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test of this script)")
    args = ap.parse_args(argv)
    import torch
    import fmkv
    from fmkv import torch_ops
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("torch_op_bench needs a CUDA device (or --device cpu for a smoke test)")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    H, HQ, D, P, W = 8, 32, 128, 64, 64
    cfg = fmkv.Config(head_dim=D, num_kv_heads=H, k_bits=3, v_bits=3, page_size=P, window_tokens=W)
    c = torch_ops.config_to_list(cfg)
    npages = (args.context + 16) // P + 2
    pages = torch.zeros(npages, cfg.page_bytes, dtype=torch.uint8, device=dev)
    fk = torch.zeros(1, H, W, D, dtype=torch.float16, device=dev)
    fv = torch.zeros_like(fk)
    bt = torch.arange(npages, dtype=torch.int32, device=dev).view(1, npages)
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    lens = torch.zeros(1, dtype=torch.int64, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    k = torch.randn(args.context, H, D, generator=g, device=dev, dtype=torch.float16)
    v = torch.randn(args.context, H, D, generator=g, device=dev, dtype=torch.float16)
    torch.ops.fmkv.append(pages, fk, fv, k, v, slots, lens, torch.tensor([0, args.context], device=dev), bt, c, 0)
    lens += args.context
    ro = torch.tensor([0, 1], dtype=torch.int64, device=dev)
    q = torch.randn(1, HQ, D, generator=g, device=dev, dtype=torch.float16)
    k1, v1 = k[:1].clone(), v[:1].clone()
    lens_q = lens.clone()  # attention: lengths include the query token (the last one appended)
    ops = {
        "append_attention": lambda: torch.ops.fmkv.append_attention(pages, fk, fv, k1, v1, q, slots, lens, ro, bt, c, 0),
        "attention": lambda: torch.ops.fmkv.attention(pages, fk, fv, q, slots, lens_q, ro, bt, c, 0),
        "append": lambda: torch.ops.fmkv.append(pages, fk, fv, k1, v1, slots, lens, ro, bt, c, 0),
        "torch.add (reference)": lambda: torch.add(q, q),
    }
    rows = []
    print(f"{'op':>24} {'host us/call':>13} {'wall us/call':>13}")
    with torch.no_grad():
        for name, fn in ops.items():
            for _ in range(20):
                fn()
            sync()
            best = best_wall = float("inf")
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                t_issue = time.perf_counter() - t0
                sync()
                t_wall = time.perf_counter() - t0
                best = min(best, t_issue / args.calls * 1e6)
                best_wall = min(best_wall, t_wall / args.calls * 1e6)
            if cuda:
                fmkv.synchronize("cuda")  # raises if a kernel reported an error
            print(f"{name:>24} {best:>13.1f} {best_wall:>13.1f}", flush=True)
            rows.append(dict(suite="torch_op_overhead", backend="cuda" if cuda else "cpu",
                             device=torch.cuda.get_device_name() if cuda else "cpu",
                             label=args.label, op=name, context=args.context, k_bits=3, v_bits=3, q_heads=HQ,
                             kv_heads=H, head_dim=D, page_size=P, window_tokens=W, calls=args.calls,
                             host_us_per_call=round(best, 2), wall_us_per_call=round(best_wall, 2)))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

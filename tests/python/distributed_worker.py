"""One rank of tests/python/test_distributed.py (run as a script: rank world store_file out_file backend shards
[process_group_backend]; shards "host" (fmkv.Cache shards, numpy) or a torch device (fmkv.torch_ops.TorchCache shards on it,
torch tensors); the process group gloo unless named (nccl)).

Fills a ContextParallelCache (2 layers, prefill in chunks that cross shard boundaries, then decode steps:
append one token, attend), records every step's merged output and the gathered partials, checks that
bad calls raise on every rank and change nothing, and saves the record to out_file (.npz)."""
import sys

import numpy as np
import torch
import torch.distributed as dist

import fmkv
import fmkv.distributed as fd

from distributed_case import CASE, case_data


def main() -> None:
    rank, world, store, out, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    shards, pg = sys.argv[6], (sys.argv[7] if len(sys.argv) > 7 else "gloo")
    dist.init_process_group(pg, init_method=f"file://{store}", rank=rank, world_size=world)
    cfg, k, v, q = case_data()
    device = None if shards == "host" else torch.device(shards)
    if device is not None:  # the same data as torch tensors on the shard's device; results back as numpy
        k, v, q = (torch.from_numpy(x).to(device) for x in (k, v, q))
    host = (lambda x: x) if device is None else (lambda x: x.cpu().numpy())
    zeros = np.zeros if device is None else (lambda shape, dtype: torch.zeros(shape, dtype=torch.float32, device=device))
    cp = fd.ContextParallelCache(cfg, CASE["layers"], CASE["capacity"] // world, backend=backend, device=device)
    merged, p_out, p_lse, errors = [], [], [], []
    n = 0
    for chunk in CASE["chunks"]:
        for layer in range(CASE["layers"]):
            cp.append(layer, k[layer, n:n + chunk], v[layer, n:n + chunk])
        n += chunk
    for step in range(CASE["steps"]):
        for layer in range(CASE["layers"]):
            cp.append(layer, k[layer, n:n + 1], v[layer, n:n + 1])
            o, l = cp.local_partial(layer, q[layer, step:step + 1])
            outs, lses = cp.gather_partials(o, l)
            merged.append(host(cp.attention(layer, q[layer, step:step + 1])))
            p_out.append(np.stack([host(x) for x in outs]))
            p_lse.append(np.stack([host(x) for x in lses]))
        n += 1
    # bad calls: the same error on every rank, nothing changed
    bad_k = k[0, :3].clone() if device is not None else k[0, :3].copy()
    bad_k[2, 1, 5] = float("nan")
    for name, call in (("nan", lambda: cp.append(0, bad_k, v[0, :3])),
                       ("shape", lambda: cp.append(0, k[0, :3, :1], v[0, :3, :1])),
                       ("capacity", lambda: cp.append(1, zeros((cp.capacity, cfg.num_kv_heads, cfg.head_dim), np.float32),
                                                      zeros((cp.capacity, cfg.num_kv_heads, cfg.head_dim), np.float32))),
                       ("two rows", lambda: cp.attention(0, q[0, :2])),
                       ("layer", lambda: cp.attention(5, q[0, :1]))):
        try:
            call()
            errors.append(f"{name}: accepted")
        except fmkv.FmkvError as e:
            errors.append(f"{name}: {e.status}")
    cp.check()  # nothing recorded on any rank
    after = host(cp.attention(0, q[0, CASE["steps"] - 1:CASE["steps"]]))  # still answers as at the last step
    np.savez(out, merged=np.stack(merged), p_out=np.stack(p_out), p_lse=np.stack(p_lse), errors=np.array(errors),
             lengths=np.array([cp.length(l) for l in range(CASE["layers"])]), after=after,
             local=np.array([cp.local_range(l) for l in range(CASE["layers"])]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

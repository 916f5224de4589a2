"""One rank of tests/python/test_distributed.py (run as a script: rank world store_file out_file backend).

Fills a ContextParallelCache (2 layers, prefill in chunks that cross shard boundaries, then decode steps:
append one token, attend), records every step's merged output and the gathered partials, checks that
bad calls raise on every rank and change nothing, and saves the record to out_file (.npz)."""
import sys

import numpy as np
import torch.distributed as dist

import fmkv
import fmkv.distributed as fd

from distributed_case import CASE, case_data


def main() -> None:
    rank, world, store, out, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg, k, v, q = case_data()
    cp = fd.ContextParallelCache(cfg, CASE["layers"], CASE["capacity"] // world, backend=backend)
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
            merged.append(cp.attention(layer, q[layer, step:step + 1]))
            p_out.append(np.stack(outs))
            p_lse.append(np.stack(lses))
        n += 1
    # bad calls: the same error on every rank, nothing changed
    bad_k = k[0, :3].copy()
    bad_k[2, 1, 5] = np.nan
    for name, call in (("nan", lambda: cp.append(0, bad_k, v[0, :3])),
                       ("shape", lambda: cp.append(0, k[0, :3, :1], v[0, :3, :1])),
                       ("capacity", lambda: cp.append(1, np.zeros((cp.capacity, cfg.num_kv_heads, cfg.head_dim), np.float32),
                                                      np.zeros((cp.capacity, cfg.num_kv_heads, cfg.head_dim), np.float32))),
                       ("two rows", lambda: cp.attention(0, q[0, :2])),
                       ("layer", lambda: cp.attention(5, q[0, :1]))):
        try:
            call()
            errors.append(f"{name}: accepted")
        except fmkv.FmkvError as e:
            errors.append(f"{name}: {e.status}")
    after = cp.attention(0, q[0, CASE["steps"] - 1:CASE["steps"]])  # still answers as at the last step
    np.savez(out, merged=np.stack(merged), p_out=np.stack(p_out), p_lse=np.stack(p_lse), errors=np.array(errors),
             lengths=np.array([cp.length(l) for l in range(CASE["layers"])]), after=after,
             local=np.array([cp.local_range(l) for l in range(CASE["layers"])]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The data of tests/python/test_distributed.py, shared by the test and its ranks (distributed_worker.py)."""
import numpy as np

import fmkv

CASE = dict(layers=2, chunks=[37, 100, 64, 49], steps=3, capacity=280, seed=5)


def case_data():
    cfg = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=4, v_bits=2, page_size=16, sink_tokens=4, window_tokens=16,
                      seed=3)
    n = sum(CASE["chunks"]) + CASE["steps"]
    rng = np.random.default_rng(CASE["seed"])
    k = rng.standard_normal((CASE["layers"], n, 2, 64)).astype(np.float32) * 2
    v = rng.standard_normal((CASE["layers"], n, 2, 64)).astype(np.float32)
    q = rng.standard_normal((CASE["layers"], CASE["steps"], 8, 64)).astype(np.float32)
    return cfg, k, v, q

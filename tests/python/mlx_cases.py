"""Shared cases of the fmkv.mlx tests: a layer filled through MlxLayer in chunks, and the oracle --
the same tokens appended by the C reference backend ('ref') into numpy storage in one call -- plus
the float64 attention reference. Used by test_mlx_host.py (MLX's CPU device) and test_mlx_gpu.py
(Metal / CUDA through MLX)."""
from __future__ import annotations

import math

import numpy as np

import fmkv
from fmkv import _fmkv, reference


def random_kv(rng, tokens, heads, d, dtype=np.float32):
    chan = 1.0 + np.abs(rng.standard_normal(d))
    return (rng.standard_normal((tokens, heads, d)) * chan).astype(dtype)


def poison_storage(layer, seed: int = 12345):
    """Random bytes in every storage array of ``layer`` (MlxLayer, length 0); returns numpy copies."""
    rng = np.random.default_rng(seed)
    pages = rng.integers(0, 256, layer.pages.size, dtype=np.uint8)
    fk = rng.integers(0, 65536, layer.fp16_k.size, dtype=np.uint16)
    fv = rng.integers(0, 65536, layer.fp16_v.size, dtype=np.uint16)
    layer.load_storage(_mx().array(pages), _mx().array(fk), _mx().array(fv), 0)
    return pages, fk, fv


def reference_append(layer, poisoned, k_rows: np.ndarray, v_rows: np.ndarray):
    """The storage the reference backend produces from the same poisoned bytes when it appends
    k_rows / v_rows ([T, H, d], the layer's only sequence) in one call."""
    pages, fk, fv = (a.copy() for a in poisoned)
    _fmkv.append_raw("ref", layer.config._raw(), layer.layer, pages, fk, fv, np.zeros(1, np.int32),
                     np.zeros(1, np.int64), np.array([0, k_rows.shape[0]], np.int64), layer.table_host,
                     k_rows, v_rows)
    return pages, fk, fv


def assert_storage_equal(layer, ref) -> None:
    """Every byte of the layer's storage equals the reference's (pages, fp16 K, fp16 V)."""
    for name, got, want in zip(("pages", "fp16_k", "fp16_v"), layer.storage(), ref):
        got = np.array(got)
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise AssertionError(f"{name}: {bad.size} bytes differ from the reference (first at {bad[0]})")


def _mx():
    import mlx.core as mx

    return mx


def attention_reference(cfg, layer: int, k_rows, v_rows, q_rows) -> np.ndarray:
    return reference.attention(cfg, layer, k_rows, v_rows, q_rows)


def bhld(x: np.ndarray):
    """[T, H, d] numpy -> [1, H, T, d] MLX array (mlx-lm's layout)."""
    import mlx.core as mx

    return mx.array(np.ascontiguousarray(x.transpose(1, 0, 2))[None])


CASES = [
    # d, kv heads, q heads, k_bits, v_bits, page, sink, window, scale_rule, dtype
    (128, 2, 8, 4, 4, 16, 0, 0, "lsq", np.float16),
    (64, 3, 9, 3, 3, 16, 0, 32, "lsq", np.float32),
    (128, 1, 4, 4, 2, 32, 2, 8, "rms", np.float16),
    (256, 2, 4, 16, 3, 16, 0, 0, "lsq", np.float32),
    (64, 2, 2, 2, 4, 64, 4, 0, "lsq", "bfloat16"),
]

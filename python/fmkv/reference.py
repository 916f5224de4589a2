"""Pure-numpy float64 reference of fmkv attention, for tests.

It rebuilds what the cache stores from the raw token rows using only the format primitives of
the binding (:func:`fmkv.quantize_vector` / :func:`fmkv.dequantize_vector`), then computes
``softmax(Q K^T * scale) V`` in float64 with a causal mask:

* every K/V value is first rounded to fp16 (the format's input);
* tokens in the fp16 regions (the first ``sink_tokens`` and the last ``window_tokens``) are used
  as those fp16 values; K with ``k_bits == 16`` is kept as fp16 too;
* every other token is quantized and dequantized with the cache's seed, the layer index, format version
  and scale group.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import Config, FmkvError, dequantize_vector, quantize_vector
from . import format as _format


def to_float32(x: Any) -> np.ndarray:
    """numpy array, or a CPU torch tensor of any float dtype (bfloat16 included) -> float32 numpy."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    if hasattr(x, "detach") and hasattr(x, "float"):  # torch.Tensor without importing torch
        return x.detach().cpu().float().numpy()
    return np.asarray(x, dtype=np.float32)


def stored_values(config: Config, layer: int, x: Any, is_v: bool, seq_len: Optional[int] = None) -> np.ndarray:
    """float64 [tokens, heads, head_dim]: what attention reads back for token rows ``x`` that are
    the first tokens of a sequence of (current) length ``seq_len`` (default: len(x))."""
    x16 = to_float32(x).astype(np.float16)  # float32 -> fp16, round to nearest even
    T, H, d = x16.shape
    if seq_len is None:
        seq_len = T
    bits = config.v_bits if is_v else config.k_bits
    comp_end = _format.compressed_end(config.sink_tokens, config.window_tokens, seq_len)
    out = x16.astype(np.float64)
    if bits == 16:
        return out
    for p in range(min(T, comp_end)):
        if p < config.sink_tokens:
            continue
        for h in range(H):
            side = "v" if is_v else "k"
            codes, scales = quantize_vector(x16[p, h], bits, config.seed, layer, config.scale_rule, config.format_version, side,
                                            config.scale_group)
            out[p, h] = dequantize_vector(codes, scales, bits, config.seed, layer, config.format_version,
                                          side, config.scale_group).astype(np.float64)
    return out


def attention(config: Config, layer: int, k: Any, v: Any, q: Any, softmax_scale: Optional[float] = None,
              softcap: float = 0.0) -> np.ndarray:
    """Reference of ``Cache.attention`` for a sequence whose tokens are exactly ``k``/``v``
    ([T, num_kv_heads, head_dim], all appended to ``layer``) and queries ``q`` [R, q_heads,
    head_dim] at positions T-R .. T-1. Returns float64 [R, q_heads, head_dim]."""
    kf = stored_values(config, layer, k, is_v=False)
    vf = stored_values(config, layer, v, is_v=True)
    qf = to_float32(q).astype(np.float64)
    T, H, d = kf.shape
    R, HQ, dq = qf.shape
    if dq != d or HQ % H != 0 or R > T:
        raise FmkvError(f"reference.attention: q shape {qf.shape} does not fit k shape {kf.shape}")
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    group = HQ // H
    out = np.empty((R, HQ, d), dtype=np.float64)
    for hq in range(HQ):
        h = hq // group
        s = (qf[:, hq, :] @ kf[:, h, :].T) * scale  # [R, T]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        pos = T - R + np.arange(R)
        s = np.where(np.arange(T)[None, :] <= pos[:, None], s, -np.inf)
        s = s - s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[:, hq, :] = p @ vf[:, h, :]
    return out


def rel_error(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64 (inf when anything is non-finite)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))

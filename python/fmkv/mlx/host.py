"""fmkv's host path on MLX: the C library's host backends ('cpu', else 'ref') on MLX arrays.

For MLX on its CPU device (``mlx[cpu]`` on Linux, or ``mx.cpu`` anywhere). The storage of a layer
(pages, fp16 regions) is MLX arrays that the library writes in place through their buffers, and K, V,
Q are passed as they are -- the binding imports an MLX array through DLPack with its strides and
reads the [1, heads, n, d] arrays of an mlx-lm model (any strides) without a copy or an MLX op; only
a batch of several sequences is packed first (MLX has no strided view for it). Each call evaluates
its inputs (an MLX graph cannot call into the library lazily) and runs at once; errors raise
:class:`fmkv.FmkvError` before any byte is written, as with :class:`fmkv.Cache`.
"""
from __future__ import annotations

import numpy as np

from .. import _fmkv


def _mx():
    import mlx.core as mx
    return mx


def _dl(x):
    """A DLPack capsule of an MLX array's memory as host (CPU) memory: MLX exports its arrays as
    Metal tensors by default on Apple silicon, whose unified memory the host reads directly."""
    return x.__dlpack__(dl_device=(1, 0))


def _rows(x):
    """[B, heads, n, d] -> what the raw ops read as [B * n, heads, d] rows: the array itself when
    B == 1 (the binding takes [1, heads, n, d] as that view), else a packed copy."""
    B, Hh, n, d = x.shape
    if B == 1:
        return x
    return x.transpose(0, 2, 1, 3).reshape(B * n, Hh, d)


class HostOps:
    """Append and attention of an MlxLayer through fmkv's C API on host memory."""

    def __init__(self, backend: str):
        self.backend = backend

    def append(self, layer, k, v) -> None:
        mx = _mx()
        n = int(k.shape[2])
        kr, vr = _rows(k), _rows(v)
        mx.eval(kr, vr)
        _fmkv.append_raw(self.backend, layer.raw, layer.layer, _dl(layer.pages), _dl(layer.fp16_k), _dl(layer.fp16_v),
                         layer.slots_host, np.full(layer.batch, layer.length, np.int64),
                         np.arange(layer.batch + 1, dtype=np.int64) * n, layer.table_host, _dl(kr), _dl(vr))

    def attention(self, layer, q, softmax_scale: float = 0.0, softcap: float = 0.0, splits=None, simdgroups=None):
        """q [B, q_heads, n, d] -> [B * n, q_heads, d] in q's dtype (a fresh MLX array, NaN until the
        library fills it in place)."""
        mx = _mx()
        B, HQ, n, d = q.shape
        qr = _rows(q)
        out = mx.full((B * n, HQ, d), float("nan"), dtype=q.dtype)
        mx.eval(qr, out)
        _fmkv.attention_raw(self.backend, layer.raw, layer.layer, _dl(layer.pages), _dl(layer.fp16_k),
                            _dl(layer.fp16_v), layer.slots_host, np.full(layer.batch, layer.length, np.int64),
                            np.arange(layer.batch + 1, dtype=np.int64) * n, layer.table_host, _dl(qr), _dl(out),
                            float(softmax_scale), float(softcap), max_seq_len=layer.length)
        return out

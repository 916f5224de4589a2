"""fmkv's GPU path on MLX: the kernel core launched through ``mx.fast.metal_kernel`` (Apple GPUs) or
``mx.fast.cuda_kernel`` (MLX's CUDA backend), one launch path for both.

What is shared: the kernels' inputs and outputs (kernels.KERNELS), array binding (every storage
array is a flat, row-contiguous MLX array of >= 8 elements; pages, fp16 regions and status words are
written in place), parameter blocks (kernels.pack_*_params, cached per shape: a decode step makes no
host-to-device copy), grid and threadgroup sizes, template arguments (head_dim and bit widths as
compile-time constants) and the ordering of kernels through each one's ``after`` input. What differs:
the body's thread ids (kernels.body) and the MLX constructor.

Kernels are lazy MLX operations like any other: nothing synchronises here. The status words of a layer
record kernel-detected errors; :meth:`fmkv.mlx.MlxLayer.check` evaluates and raises them.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from . import kernels

_KERNELS: Dict[Tuple[str, str], object] = {}


def _mx():
    import mlx.core as mx
    return mx


def dtype_name(dt) -> str:
    """'float16' for mx.float16, etc."""
    return str(dt).rsplit(".", 1)[-1]


def kernel(dialect: str, name: str):
    """The MLX kernel object of KERNELS[name] for ``dialect`` (created once per process)."""
    key = (dialect, name)
    if key not in _KERNELS:
        mx = _mx()
        inputs, outputs, _, _ = kernels.KERNELS[name]
        args = dict(name="fmkv_" + name, input_names=inputs, output_names=outputs, source=kernels.body(name, dialect),
                    header=kernels.header(), ensure_row_contiguous=True)
        if dialect == "metal":
            try:  # MLX >= 0.32: IEEE math (the format's bytes need it; also the pragmas in portability.h)
                _KERNELS[key] = mx.fast.metal_kernel(**args, compile_options={"math_mode": "safe"})
            except TypeError:
                _KERNELS[key] = mx.fast.metal_kernel(**args)
        elif dialect == "cuda":
            _KERNELS[key] = mx.fast.cuda_kernel(**args)
        else:
            raise ValueError(f"dialect {dialect!r} is not one of {kernels.DIALECTS}")
    return _KERNELS[key]


def int_array(values, dtype) -> object:
    """A persistent MLX array of ``values`` padded to >= 8 elements (Metal binds smaller arrays as
    ``constant``, which the bodies do not expect), evaluated."""
    mx = _mx()
    a = np.zeros(max(8, len(values)), dtype=dtype)
    a[: len(values)] = values
    x = mx.array(a)
    mx.eval(x)
    return x


def params_array(blob: bytes):
    mx = _mx()
    x = mx.array(np.frombuffer(blob, dtype=np.int32).copy())
    mx.eval(x)
    return x


def _rows_view(x, what: str):
    """[B, heads, n, d] -> (array the kernel reads, (row_stride, head_stride)) with packed rows
    r = b * n + t. B == 1: the array itself (row-contiguous [1, heads, n, d]: row stride d, head
    stride n * d, no copy); B > 1: a transposed copy [B * n, heads, d]."""
    B, Hh, n, d = x.shape
    if B == 1:
        return x, (d, n * d)
    return x.transpose(0, 2, 1, 3).reshape(B * n, Hh, d), (Hh * d, d)


class GpuOps:
    """Append and attention of an MlxLayer on one dialect."""

    def __init__(self, dialect: str, threads: int = 128, simdgroups: int = 4, target_groups: int = 512,
                 min_split_keys: int = 256, merge_simdgroups: int = 2):
        if dialect not in kernels.DIALECTS:
            raise ValueError(f"dialect {dialect!r} is not one of {kernels.DIALECTS}")
        if threads % 32 or threads < 32:
            raise ValueError("threads must be a positive multiple of 32")
        self.dialect = dialect
        self.threads = int(threads)
        self.simdgroups = int(simdgroups)
        self.target_groups = int(target_groups)
        self.min_split_keys = int(min_split_keys)
        self.merge_simdgroups = int(merge_simdgroups)

    # -------------------------------------------------------------------------------- planning
    def plan(self, layer, rows_per_seq: int, q_heads: int, length: int, splits: Optional[int] = None,
             simdgroups: Optional[int] = None) -> Tuple[int, int, int]:
        """(length bound, key splits, SIMD groups per threadgroup) of an attention call. The bound is
        the next power of two >= length (at least 1024), so the parameter block of a decode step is
        reused until the length doubles; splits fill ``target_groups`` threadgroups, with at least
        ``min_split_keys`` keys each."""
        c = layer.config
        bound = max(1024, 1 << max(0, int(length) - 1).bit_length())
        sg = int(simdgroups or self.simdgroups)
        if splits is None:
            group = q_heads // c.num_kv_heads
            tiles = max(1, -(-rows_per_seq * group // kernels.define("FMKV_METAL_QTILE")))
            per_split = layer.batch * c.num_kv_heads * tiles
            splits = max(1, min(-(-self.target_groups // per_split), -(-bound // self.min_split_keys)))
        return bound, int(splits), sg

    # -------------------------------------------------------------------------------- append
    def append(self, layer, k, v) -> None:
        mx = _mx()
        c = layer.config
        B, H, n, d = k.shape
        kk, ks = _rows_view(k, "k")
        vv, vs = _rows_view(v, "v")
        kd, vd = dtype_name(k.dtype), dtype_name(v.dtype)
        key = ("append", n, kd, vd, ks, vs)
        params = layer.params.get(key)
        if params is None:
            blob = kernels.pack_append_params(layer.cfg_fields, c.page_bytes, layer.num_pages, layer.num_slots,
                                              layer.layer, B, True, layer.pages_per_seq, kd, vd, ks, vs, B * n)
            params = layer.params[key] = params_array(blob)
        offs = layer.row_offsets(n)
        items = B * n * H * 2
        nsg = self.threads // 32
        groups = -(-items // nsg)
        (done,) = kernel(self.dialect, "append_compress")(
            inputs=[params, layer.pages, layer.fp16_k, layer.fp16_v, kk, vv, layer.lens, offs, layer.table,
                    layer.slots, layer.status, layer.after],
            output_shapes=[(8,)], output_dtypes=[mx.uint32], grid=(groups * self.threads, 1, 1),
            threadgroup=(self.threads, 1, 1),
            template=kernels.template_args("append_compress", c.head_dim, c.k_bits, c.v_bits))
        if c.sink_tokens + c.window_tokens > 0:  # pass 2 overwrites ring slots pass 1 reads: after=done
            total = items * d
            (done,) = kernel(self.dialect, "append_fp16")(
                inputs=[params, layer.fp16_k, layer.fp16_v, kk, vv, layer.lens, offs, layer.slots, done],
                output_shapes=[(8,)], output_dtypes=[mx.uint32], grid=(-(-total // 256) * 256, 1, 1),
                threadgroup=(256, 1, 1))
        layer.after = done
        layer.lens = layer.lens + n  # device-side lengths: no host copy

    # -------------------------------------------------------------------------------- attention
    def attention(self, layer, q, softmax_scale: float = 0.0, softcap: float = 0.0, splits: Optional[int] = None,
                  simdgroups: Optional[int] = None):
        """Attention of q [B, q_heads, n, d] (the last n cached tokens of each sequence, causal)
        -> [B * n, q_heads, d] in q's dtype."""
        mx = _mx()
        c = layer.config
        B, HQ, n, d = q.shape
        qq, qs = _rows_view(q, "q")
        qd = dtype_name(q.dtype)
        bound, splits, sg = self.plan(layer, n, HQ, layer.length, splits, simdgroups)
        key = ("attention", n, HQ, qd, qs, bound, splits, sg, float(softmax_scale), float(softcap))
        params = layer.params.get(key)
        if params is None:
            blob = kernels.pack_attention_params(layer.cfg_fields, c.page_bytes, layer.num_pages, layer.num_slots,
                                                 layer.layer, B, True, layer.pages_per_seq, HQ, qd, qs, qd,
                                                 (HQ * d, d), n, bound, softmax_scale, softcap, sg, splits)
            plan = kernels.attention_plan_fields(blob)
            params = layer.params[key] = (params_array(blob), plan)
        params, plan = params
        items = B * c.num_kv_heads * plan["tiles"] * kernels.define("FMKV_METAL_QTILE")
        offs = layer.row_offsets(n)
        (ws,) = kernel(self.dialect, "attention_partial")(
            inputs=[params, layer.pages, layer.fp16_k, layer.fp16_v, qq, layer.lens, offs, layer.table, layer.slots,
                    layer.status, layer.after],
            output_shapes=[(items * plan["parts"] * (2 + d),)], output_dtypes=[mx.float32],
            grid=(B * c.num_kv_heads * plan["tiles"] * splits * sg * 32, 1, 1), threadgroup=(sg * 32, 1, 1),
            template=kernels.template_args("attention_partial", c.head_dim, c.k_bits, c.v_bits))
        msg = self.merge_simdgroups
        (out,) = kernel(self.dialect, "attention_merge")(
            inputs=[params, offs, ws, layer.status], output_shapes=[(B * n, HQ, d)], output_dtypes=[q.dtype],
            grid=(-(-items // msg) * msg * 32, 1, 1), threadgroup=(msg * 32, 1, 1),
            template=kernels.template_args("attention_merge", c.head_dim, c.k_bits, c.v_bits))
        layer.after = out  # the next append waits for this read of the pages
        return out

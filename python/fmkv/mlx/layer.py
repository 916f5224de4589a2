"""One attention layer's compressed KV cache in MLX arrays, on whichever runtime MLX offers.

Runtimes (:func:`resolve_runtime`):

* ``'metal'`` -- Apple GPU: the kernel core through ``mx.fast.metal_kernel`` (fmkv.mlx.gpu);
* ``'cuda'``  -- MLX's CUDA backend: the same kernel core and launch path through ``mx.fast.cuda_kernel``;
* ``'host'``  -- MLX's CPU device: the C library's host backend on the arrays' memory (fmkv.mlx.host).

Storage: a page pool (uint8, ``pages_per_seq`` pages per sequence for ``max_tokens`` tokens; sequence
b owns pages [b * pages_per_seq, (b + 1) * pages_per_seq)), the fp16 sink/window regions (uint16
bits) and, on the GPU runtimes, eight uint32 status words. Bytes are those of the format
(docs/FORMAT.md), identical on every runtime; ``layer`` selects the rotation signs (FORMAT.md
section 3), so a model's layers stored here hold the bytes of one multi-layer fmkv cache. The config's
``format_version`` (0 = the default, 2 or 3) and ``scale_group`` (0 = the default ``fmkv.format.SCALE_GROUP``, or
64: one fp16 scale per 64 coordinates) go to every runtime: the GPU kernels read them from their parameter block
(format 3's 3-bit sections: integer levels, tile blocks; a scale group of 64 spans two code groups), the host
backends from the config. Every code width of the format (``fmkv.format.CODE_BITS``, and fp16 K) and every scale
group (``fmkv.format.SCALE_GROUPS``) runs on every runtime.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np

import fmkv
from .. import FmkvError, _fmkv
from . import kernels

_SCALE_RULES = {"lsq": _fmkv.SCALE_LSQ, "rms": _fmkv.SCALE_RMS}
RUNTIMES = ("metal", "cuda", "host")


def _mx():
    try:
        import mlx.core as mx
    except ImportError as e:  # pragma: no cover
        raise ImportError("fmkv.mlx needs MLX (pip install mlx; on Linux also mlx-cpu or mlx-cuda-13)") from e
    return mx


def resolve_runtime(runtime: Optional[str] = None) -> str:
    """The runtime for ``runtime`` (None / 'auto': MLX's default device -- its GPU through Metal or
    CUDA when that is the default, else the host path)."""
    mx = _mx()
    if runtime in (None, "", "auto"):
        if mx.default_device().type == mx.gpu:
            if mx.metal.is_available():
                return "metal"
            if hasattr(mx, "cuda") and mx.cuda.is_available():
                return "cuda"
        return "host"
    if runtime not in RUNTIMES:
        raise FmkvError(f"runtime {runtime!r} is not one of {RUNTIMES} (or 'auto')")
    if runtime == "metal" and not mx.metal.is_available():
        raise FmkvError("runtime 'metal': this MLX has no Metal device (Apple silicon only)")
    if runtime == "cuda" and not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        raise FmkvError("runtime 'cuda': this MLX has no CUDA device (pip install mlx-cuda-13 on a machine with a GPU)")
    return runtime


def _ops(runtime: str, backend: Optional[str], options: Dict):
    if runtime == "host":
        from .host import HostOps

        b = backend or fmkv.default_backend()
        if b not in ("cpu", "ref"):
            raise FmkvError(f"runtime 'host' runs the host backends 'cpu' or 'ref', not {b!r}")
        if not fmkv.backends()[b]["available"]:
            raise FmkvError(f"backend {b!r} is not compiled into this fmkv build")
        return HostOps(b)
    from .gpu import GpuOps

    if backend not in (None, "", runtime):
        raise FmkvError(f"runtime {runtime!r} runs fmkv's kernel core through MLX; backend {backend!r} does not apply")
    return GpuOps(runtime, **options)


class MlxLayer:
    """Compressed K/V of one attention layer for ``batch`` sequences of equal length.

    ``append(k, v)`` takes [batch, kv_heads, n, head_dim] MLX arrays (mlx-lm's layout; float32,
    float16 or bfloat16), ``attention(q)`` [batch, q_heads, n, head_dim] and returns
    [batch * n, q_heads, head_dim] in q's dtype: the attention of the last n cached tokens' queries
    over everything cached (causal among the n). On the GPU runtimes both are lazy MLX operations;
    kernel-detected errors are recorded in the status words and raised by :meth:`check`.
    ``gpu_options`` tune the GPU launch (fmkv.mlx.gpu.GpuOps: threads, simdgroups, target_groups...).
    """

    def __init__(self, config: "fmkv.Config", layer: int = 0, batch: int = 1, max_tokens: int = 4096,
                 runtime: Optional[str] = None, backend: Optional[str] = None, **gpu_options):
        mx = _mx()
        if not isinstance(config, fmkv.Config):
            raise FmkvError(f"config must be an fmkv.Config, got {type(config).__name__}")
        if batch < 1 or max_tokens < 1 or layer < 0:
            raise FmkvError("MlxLayer: need batch >= 1, max_tokens >= 1, layer >= 0")
        self.config = config
        self.layer = int(layer)
        self.batch = int(batch)
        self.max_tokens = int(max_tokens)
        self.runtime = resolve_runtime(runtime)
        self.ops = _ops(self.runtime, backend, gpu_options)
        self.raw = config._raw()
        self.cfg_fields = dict(head_dim=config.head_dim, num_kv_heads=config.num_kv_heads, k_bits=config.k_bits,
                               v_bits=config.v_bits, page_size=config.page_size, sink_tokens=config.sink_tokens,
                               window_tokens=config.window_tokens, scale_rule=_SCALE_RULES[config.scale_rule],
                               seed=config.seed, format_version=config.format_version,
                               scale_group=config.scale_group)
        c = config
        R = c.sink_tokens + c.window_tokens
        self.pages_per_seq = max(1, math.ceil(max(0, self.max_tokens - c.sink_tokens) / c.page_size))
        self.num_pages = self.batch * self.pages_per_seq
        self.num_slots = self.batch if R > 0 else 1
        region = self.batch * c.num_kv_heads * R * c.head_dim
        self.pages = mx.zeros((self.num_pages * c.page_bytes,), dtype=mx.uint8)
        self.fp16_k = mx.zeros((max(region, 8),), dtype=mx.uint16)  # >= 8: Metal binds smaller arrays as constant
        self.fp16_v = mx.zeros((max(region, 8),), dtype=mx.uint16)
        self.length = 0
        self.table_host = np.arange(self.num_pages, dtype=np.int32).reshape(self.batch, self.pages_per_seq)
        self.slots_host = np.arange(self.batch, dtype=np.int32)
        self.params: Dict = {}
        self._offsets: Dict[int, object] = {}
        if self.runtime == "host":
            mx.eval(self.pages, self.fp16_k, self.fp16_v)
        else:
            from .gpu import int_array

            self.table = int_array(self.table_host.reshape(-1), np.int32)
            self.slots = int_array(self.slots_host, np.int32)
            self.lens = int_array([0] * self.batch, np.int64)
            self.status = mx.zeros((8,), dtype=mx.uint32)
            self.after = mx.zeros((8,), dtype=mx.uint32)
            mx.eval(self.pages, self.fp16_k, self.fp16_v, self.status, self.after)

    # ------------------------------------------------------------------------------------ helpers
    def row_offsets(self, n: int):
        """[0, n, 2n, ..., batch * n] (padded), kept per chunk length n (GPU runtimes)."""
        t = self._offsets.get(n)
        if t is None:
            from .gpu import int_array

            t = self._offsets[n] = int_array([b * n for b in range(self.batch + 1)], np.int64)
        return t

    def _check_input(self, what: str, x, heads: int, rows: Optional[int] = None) -> int:
        mx = _mx()
        if not isinstance(x, mx.array):
            raise FmkvError(f"{what} must be an mlx.core.array, got {type(x).__name__}")
        if x.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise FmkvError(f"{what}: dtype {x.dtype} is not supported (expected float32, float16 or bfloat16)")
        if x.ndim != 4 or x.shape[0] != self.batch or x.shape[1] != heads or x.shape[3] != self.config.head_dim:
            raise FmkvError(f"{what}: expected shape [batch={self.batch}, heads={heads}, tokens, "
                            f"head_dim={self.config.head_dim}], got {tuple(x.shape)}")
        if rows is not None and x.shape[2] != rows:
            raise FmkvError(f"{what}: {x.shape[2]} tokens, expected {rows}")
        return int(x.shape[2])

    # ------------------------------------------------------------------------------------ ops
    def append(self, k, v) -> None:
        """Compress n new tokens of every sequence (k, v: [batch, kv_heads, n, head_dim])."""
        n = self._check_input("k", k, self.config.num_kv_heads)
        self._check_input("v", v, self.config.num_kv_heads, n)
        if n == 0:
            return
        if self.length + n > self.max_tokens:
            raise FmkvError(f"cache full: {self.length} + {n} tokens > max_tokens {self.max_tokens}")
        self.ops.append(self, k, v)
        self.length += n

    def attention(self, q, softmax_scale: float = 0.0, softcap: float = 0.0, splits: Optional[int] = None,
                  simdgroups: Optional[int] = None):
        """Attention of q [batch, q_heads, n, head_dim] -> [batch * n, q_heads, head_dim] (q's dtype).
        softmax_scale 0: 1/sqrt(head_dim); softcap 0: off. ``splits`` / ``simdgroups``: GPU plan
        override (default: GpuOps.plan)."""
        mx = _mx()
        if not isinstance(q, mx.array) or q.ndim != 4:
            raise FmkvError(f"q must be a 4-D mlx.core.array [batch, q_heads, tokens, head_dim], got "
                            f"{getattr(q, 'shape', type(q).__name__)}")
        hq = int(q.shape[1])
        if hq < 1 or hq % self.config.num_kv_heads:
            raise FmkvError(f"q: {hq} query heads is not a positive multiple of num_kv_heads {self.config.num_kv_heads}")
        n = self._check_input("q", q, hq)
        if n < 1 or n > self.length:
            raise FmkvError(f"q: {n} query tokens but {self.length} tokens cached (append the queries' tokens first)")
        if not (softmax_scale >= 0 and math.isfinite(softmax_scale)) or not (softcap >= 0 and math.isfinite(softcap)):
            raise FmkvError("softmax_scale and softcap must be finite and >= 0 (0: default / off)")
        return self.ops.attention(self, q, float(softmax_scale), float(softcap), splits, simdgroups)

    def trim(self, n: int) -> int:
        """Forget the last n tokens (exact only without an fp16 window: the window's oldest tokens
        were already compressed). Returns the number of tokens removed."""
        if self.config.window_tokens > 0:
            raise FmkvError("trim: a cache with an fp16 window cannot be trimmed exactly (window_tokens > 0)")
        n = max(0, min(int(n), self.length))
        if n and self.runtime != "host":
            self.lens = self.lens - n
        self.length -= n
        return n

    def set_length(self, length: int) -> None:
        """Set the cached length (restoring a saved cache whose storage was loaded)."""
        self.length = int(length)
        if self.runtime != "host":
            from .gpu import int_array

            self.lens = int_array([self.length] * self.batch, np.int64)

    # ------------------------------------------------------------------------------------ state
    def check(self) -> None:
        """Evaluate every pending kernel of this layer and raise the errors they recorded (block-table
        entry out of range, bad launch) as FmkvError; clears them. Host runtime: nothing to do."""
        if self.runtime == "host":
            return
        mx = _mx()
        mx.eval(self.after, self.lens)
        st = np.array(self.status)
        if st.any():
            self.status = mx.zeros((8,), dtype=mx.uint32)
            mx.eval(self.status)
            what = []
            if st[0] & kernels.define("FMKV_METAL_ERR_BLOCK_TABLE"):
                what.append("a block-table entry outside the page pool (nothing written for that token)")
            if st[1] & kernels.define("FMKV_METAL_ERR_LAUNCH"):
                what.append("a kernel launch whose threadgroup size or compile-time constants do not match its "
                            "parameter block (the kernel did nothing)")
            raise FmkvError(f"fmkv MLX kernels ({self.runtime}) reported: {'; '.join(what) or st.tolist()}")

    def storage(self):
        """(pages, fp16_k, fp16_v) after every pending kernel ran."""
        self.check()
        return self.pages, self.fp16_k, self.fp16_v

    def load_storage(self, pages, fp16_k, fp16_v, length: int) -> None:
        """Replace the storage with saved arrays (copied into arrays this layer owns) and set the length."""
        mx = _mx()
        for name, a, want in (("pages", pages, self.pages), ("fp16_k", fp16_k, self.fp16_k), ("fp16_v", fp16_v, self.fp16_v)):
            if a.shape != want.shape or a.dtype != want.dtype:
                raise FmkvError(f"{name}: saved array {tuple(a.shape)} {a.dtype} does not fit this cache "
                                f"({tuple(want.shape)} {want.dtype})")
        self.pages, self.fp16_k, self.fp16_v = (mx.array(np.array(a)) for a in (pages, fp16_k, fp16_v))
        mx.eval(self.pages, self.fp16_k, self.fp16_v)
        if not 0 <= int(length) <= self.max_tokens:
            raise FmkvError(f"length {length} outside [0, max_tokens={self.max_tokens}]")
        self.set_length(length)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the storage: page pool + fp16 regions."""
        return int(self.pages.nbytes + self.fp16_k.nbytes + self.fp16_v.nbytes)

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages holding compressed tokens plus the fp16 regions (as fmkv.Cache.used_bytes)."""
        c = self.config
        comp = max(0, self.length - c.sink_tokens - c.window_tokens)
        return self.batch * (math.ceil(comp / c.page_size) * c.page_bytes + c.fp16_slot_bytes)

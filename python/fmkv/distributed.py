"""Context-parallel decode: one sequence's compressed cache sharded by token range across the ranks of a
``torch.distributed`` process group, attention merged from every rank's partial result.

Rank ``r`` of ``world`` ranks owns positions ``[r * shard_tokens, (r + 1) * shard_tokens)`` and keeps them
in its own :class:`fmkv.Cache` (its own page pool and block table). Rank 0 keeps the configuration's fp16
sink tokens, the last rank its fp16 window (the newest tokens), every other token is compressed exactly
as in one cache: the same codes, scales and fp16 rows, whichever rank holds them.

A decode step's attention: every rank runs fmkv attention of the query over its shard and returns the
partial ``(out, lse)`` -- the normalised output and the log of its softmax denominator
(:meth:`fmkv.Cache.attention_lse`) -- one ``all_gather`` exchanges the partials, and every rank merges them
in rank order with :func:`merge_partials` (float64), so all ranks return the same bits, equal to a
single-process merge of the same partials.

Every rank calls every method with the same arguments (the model is replicated; K/V/Q of the new tokens
are the same everywhere): ``append`` keeps the rows the rank owns, after the whole input has been checked
on every rank, so that an error is raised on all ranks and no rank has changed its shard.

Shards: without ``device`` each rank's shard is a host :class:`fmkv.Cache` (``ref`` / ``cpu`` backends;
K/V/Q as numpy arrays, results as numpy arrays). With ``device`` (a torch device: ``"cuda:R"`` for rank R's GPU, or
``"cpu"``) it is a :class:`fmkv.torch_ops.TorchCache` on that device (K/V/Q as torch tensors on it, results as float32
tensors on it; ``TorchCache.attention_lse`` gives the partials on any backend that has ``fmkv_attention_lse``:
ref, cpu, cuda), and the partials are merged on that device. The collectives run on CPU tensors with gloo and
on CUDA tensors with NCCL: the shard's GPU, or the current device for host and CPU shards (whose partials are
copied there and back). With CUDA shards a device-detected error surfaces at :meth:`ContextParallelCache.check`
(on every rank), as for fmkv.torch_ops.TorchCache.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import Cache, Config, _args

_FP16_LIMIT = 65520.0  # values rounding beyond float16 (fmkv's input rule)


def _is_torch(x: Any) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def merge_partials(outs: Sequence[Any], lses: Sequence[Any], check: bool = True) -> Any:
    """Attention over the union of disjoint token sets from each set's ``(out, lse)``.

    outs[i]: [rows, heads, head_dim], lses[i]: [rows, heads] (``-inf`` for an empty set, whose out is
    ignored). Returns float32 ``sum_i w_i out_i`` with ``w_i = exp(lse_i - log sum_j exp(lse_j))``,
    accumulated in float64 (deterministic: the same inputs give the same bits). numpy arrays give a numpy array; torch
    tensors (all on one device) a tensor on that device, computed there by a fixed number of ops whatever the number
    of sets. Raises FmkvError when a row has no tokens in any set; ``check=False`` skips that test, which reads the
    result on the host (a device synchronisation), for callers that know every row has tokens (such a row would come
    out NaN).
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise _args.error(f"merge_partials: {len(outs)} outputs and {len(lses)} lse arrays (need the same, >= 1)")
    torch_in = _is_torch(outs[0])
    if torch_in:
        import torch as xp

        if not all(_is_torch(x) and x.device == outs[0].device for x in (*outs, *lses)):
            raise _args.error(f"merge_partials: every out and lse must be a torch tensor on {outs[0].device} "
                              f"(as the first out)")
    else:
        xp = np
    for x, y in zip(outs, lses):
        if x.ndim != 3 or tuple(y.shape) != tuple(x.shape[:2]) or tuple(x.shape) != tuple(outs[0].shape):
            raise _args.error(f"merge_partials: out {tuple(x.shape)} and lse {tuple(y.shape)} do not match "
                              f"[rows, heads, head_dim] / [rows, heads] of the first {tuple(outs[0].shape)}")
    if torch_in:  # [sets, rows, heads(, head_dim)] in float64
        o, s = xp.stack(list(outs)).to(xp.float64), xp.stack(list(lses)).to(xp.float64)
        m = s.amax(0)
    else:
        o, s = np.stack([np.asarray(x, np.float64) for x in outs]), np.stack([np.asarray(x, np.float64) for x in lses])
        m = s.max(0)
    if check and not bool(xp.isfinite(m).all()):
        raise _args.error("merge_partials: a query row has no visible token in any partial (every lse is -inf)")
    with np.errstate(invalid="ignore", divide="ignore"):  # (check=False, a row without tokens: NaN, no warning)
        w = xp.exp(s - m)  # exp(-inf) = 0: an empty partial adds nothing
        num = (w[..., None] * xp.where(xp.isfinite(s)[..., None], o, xp.zeros_like(o))).sum(0)
        res = num / w.sum(0)[..., None]
    return res.to(xp.float32) if torch_in else res.astype(np.float32)


class ContextParallelCache:
    """One sequence of ``num_layers`` layers, sharded by token range over the process group's ranks.

    config: the cache's fmkv.Config (its sink tokens live on rank 0, its window on the last rank).
    shard_tokens: positions per rank; the capacity is ``world * shard_tokens`` tokens (an append past it
    is refused on every rank before anything is written). backend: the shards' fmkv backend (default: as
    fmkv.Cache, or the device's as fmkv.torch_ops.TorchCache). group: a torch.distributed process group (default: the
    world). device: None for host shards (numpy in and out), else the torch device of this rank's
    :class:`fmkv.torch_ops.TorchCache` shard (torch tensors on it in and out).
    """

    def __init__(self, config: Config, num_layers: int, shard_tokens: int, backend: Optional[str] = None,
                 group: Any = None, device: Any = None):
        import torch
        import torch.distributed as dist

        if not isinstance(config, Config):
            raise _args.type_error("config", "an fmkv.Config", config)
        if not dist.is_available() or not dist.is_initialized():
            raise _args.error("ContextParallelCache: torch.distributed is not initialised "
                              "(torch.distributed.init_process_group first)", "UNSUPPORTED")
        self._dist, self._group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.num_layers = _args.integer("num_layers", num_layers, 1, 2**31 - 1)
        fp16 = config.sink_tokens + config.window_tokens
        self.shard_tokens = _args.integer("shard_tokens", shard_tokens, max(1, fp16), 2**40)
        self.config = config
        first, last = self.rank == 0, self.rank == self.world - 1
        self._local_config = dataclasses.replace(config, sink_tokens=config.sink_tokens if first else 0,
                                                 window_tokens=config.window_tokens if last else 0)
        pages = -(-self.shard_tokens // config.page_size) + 1
        self._nccl = dist.get_backend(group) == "nccl"
        if self._nccl and not torch.cuda.is_available():
            raise _args.error("ContextParallelCache: the process group is NCCL but torch sees no CUDA device",
                              "UNSUPPORTED")
        if device is None:
            self.device = None
            self._cache: Any = Cache(self._local_config, self.num_layers, pages, 1, backend)
        else:
            from .torch_cache import TorchCache

            self._cache = TorchCache(self._local_config, self.num_layers, pages, 1, backend, device=device)
            self.device = self._cache.device
        # the collectives' tensors: for NCCL the shard's GPU (else the current one), for gloo the CPU
        if not self._nccl:
            self._comm = torch.device("cpu")
        elif self.device is not None and self.device.type == "cuda":
            self._comm = self.device
        else:
            self._comm = torch.device("cuda", torch.cuda.current_device())
        self._seq = self._cache.add_sequence()
        self._lengths = [0] * self.num_layers  # global tokens per layer (the same on every rank)

    @property
    def local_cache(self) -> Any:
        """This rank's shard (an fmkv.Cache, or an fmkv.torch_ops.TorchCache with ``device``)."""
        return self._cache

    @property
    def capacity(self) -> int:
        return self.world * self.shard_tokens

    def length(self, layer: int) -> int:
        """Tokens appended to ``layer`` (all ranks together)."""
        return self._lengths[self._layer(layer)]

    def local_range(self, layer: int) -> Tuple[int, int]:
        """Global positions [start, end) this rank holds in ``layer``."""
        start = self.rank * self.shard_tokens
        n = self._lengths[self._layer(layer)]
        return (min(start, n), min(start + self.shard_tokens, n))

    def append(self, layer: int, k: Any, v: Any) -> None:
        """Append token rows k, v ([tokens, num_kv_heads, head_dim], the same on every rank; torch tensors on
        the shard's device with ``device``) to ``layer``; the rank keeps those whose positions it owns.
        All-or-nothing on every rank: the whole input is checked first (shape, finiteness, the fp16 range, the
        capacity; every rank reaches the same verdict on the same input)."""
        layer = self._layer(layer)
        c = self.config
        k, v = self._rows_in("k", k), self._rows_in("v", v)
        want = (c.num_kv_heads, c.head_dim)
        if k.ndim != 3 or tuple(v.shape) != tuple(k.shape) or tuple(k.shape[1:]) != want:
            raise _args.error(f"append: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                              f"[tokens, {want[0]}, {want[1]}]")
        for name, x in (("k", k), ("v", v)):
            if not self._finite_fp16(x):
                raise _args.error(f"append: {name} holds NaN, Inf or values beyond the float16 range", "NON_FINITE")
        n0, rows = self._lengths[layer], int(k.shape[0])
        if n0 + rows > self.capacity:
            raise _args.error(f"append: {n0} + {rows} tokens exceed the capacity {self.capacity} "
                              f"({self.world} ranks x shard_tokens {self.shard_tokens})", "OUT_OF_RANGE")
        lo = max(self.rank * self.shard_tokens, n0)
        hi = min((self.rank + 1) * self.shard_tokens, n0 + rows)
        failed = 0
        if hi > lo:
            try:
                self._cache.append(layer, self._seq, k[lo - n0:hi - n0], v[lo - n0:hi - n0])
            except Exception:
                failed = 1
                self._agree(failed)
                raise
        if self._agree(failed):
            raise _args.error("append: another rank's shard refused its rows (see that rank's error); "
                              "this cache is no longer consistent across ranks", "INTERNAL")
        self._lengths[layer] = n0 + rows

    def attention(self, layer: int, q: Any, softmax_scale: Optional[float] = None, softcap: float = 0.0) -> Any:
        """Decode attention of one query row q ([1, q_heads, head_dim], the same on every rank: the newest
        token, already appended) over every rank's shard; the merged float32 [1, q_heads, head_dim] (numpy, or
        a tensor on the shard's device with ``device``), the same bits on every rank."""
        out, lse = self.local_partial(layer, q, softmax_scale, softcap)
        outs, lses = self.gather_partials(out, lse)
        # local_partial refused a layer without tokens, and a decode row sees every token: no host-side check
        return merge_partials(outs, lses, check=False)

    def local_partial(self, layer: int, q: Any, softmax_scale: Optional[float] = None,
                      softcap: float = 0.0) -> Tuple[Any, Any]:
        """This rank's (out, lse) for one query row, float32 (zeros and -inf when the rank holds no token
        yet). With ``device`` the query is taken in float32, so the partial output is not rounded to q's
        dtype before the merge."""
        layer = self._layer(layer)
        q = self._rows_in("q", q)
        c = self.config
        if q.ndim != 3 or q.shape[0] != 1 or q.shape[2] != c.head_dim or q.shape[1] % c.num_kv_heads:
            raise _args.error(f"attention: q {tuple(q.shape)} must be [1, q_heads, {c.head_dim}] (one decode row; "
                              f"q_heads a multiple of {c.num_kv_heads})")
        if self._lengths[layer] == 0:
            raise _args.error("attention: the layer holds no token")
        lo, hi = self.local_range(layer)
        if self.device is None:
            if hi == lo:
                return (np.zeros(q.shape, np.float32), np.full(q.shape[:2], -np.inf, np.float32))
            return self._cache.attention_lse(layer, self._seq, q, softmax_scale, softcap)
        import torch

        if hi == lo:
            return (torch.zeros(tuple(q.shape), dtype=torch.float32, device=self.device),
                    torch.full(tuple(q.shape[:2]), -float("inf"), dtype=torch.float32, device=self.device))
        return self._cache.attention_lse(layer, self._seq, q.float(), softmax_scale, softcap)

    def gather_partials(self, out: Any, lse: Any) -> Tuple[List[Any], List[Any]]:
        """Every rank's (out, lse), in rank order (one all_gather of the packed float32 partials), as numpy
        arrays for host shards, tensors on the shard's device with ``device``."""
        import torch

        if self.device is None:
            packed = torch.from_numpy(np.concatenate([np.asarray(out, np.float32).reshape(-1),
                                                      np.asarray(lse, np.float32).reshape(-1)]))
        else:
            packed = torch.cat([out.reshape(-1).float(), lse.reshape(-1).float()])
        packed = packed.to(self._comm)
        parts = [torch.empty_like(packed) for _ in range(self.world)]
        self._dist.all_gather(parts, packed, group=self._group)
        n, shape_o, shape_l = int(np.prod(tuple(out.shape))), tuple(out.shape), tuple(lse.shape)
        if self.device is None:
            host = [p.cpu().numpy() for p in parts]
            return [h[:n].reshape(shape_o) for h in host], [h[n:].reshape(shape_l) for h in host]
        parts = [p.to(self.device) for p in parts]
        return [p[:n].reshape(shape_o) for p in parts], [p[n:].reshape(shape_l) for p in parts]

    # ------------------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        return _args.integer("layer", layer, 0, self.num_layers - 1, "OUT_OF_RANGE")

    def check(self) -> None:
        """Wait for every rank's shard and raise on every rank if any of them recorded an error
        (:meth:`fmkv.torch_ops.TorchCache.check`: CUDA's device-detected errors surface there, not at the call; host
        shards raise at the call and have nothing to find). One all_reduce of a flag."""
        failed = 0
        if self.device is not None:
            try:
                self._cache.check()
            except Exception:
                failed = 1
                self._agree(failed)
                raise
        if self._agree(failed):
            raise _args.error("check: another rank's shard recorded a device error (see that rank's error)", "BACKEND")

    def _rows_in(self, name: str, x: Any) -> Any:
        """x as this cache takes it: a numpy array for host shards, a float torch tensor on the shard's device."""
        if self.device is None:
            x = np.asarray(x)
            if x.dtype.kind != "f":
                raise _args.type_error(name, "a floating-point array", x)
            return x
        import torch

        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise _args.type_error(name, f"a floating-point torch.Tensor on {self.device}", x)
        if x.device != self.device:
            raise _args.error(f"{name} is on device '{x.device}' but this rank's shard is on '{self.device}' "
                              f"(fmkv never copies between devices)")
        return x

    def _finite_fp16(self, x: Any) -> bool:
        """Every value finite and inside the float16 range (one device reduction and one read with ``device``)."""
        if self.device is None:
            return x.size == 0 or bool(np.all(np.isfinite(x)) and np.max(np.abs(x.astype(np.float64))) < _FP16_LIMIT)
        return x.numel() == 0 or float(x.abs().max()) < _FP16_LIMIT  # exact in x's dtype; a NaN maximum compares false

    def _agree(self, failed: int) -> int:
        """All ranks learn whether any rank failed (one all_reduce of a flag)."""
        import torch

        flag = torch.tensor([failed], dtype=torch.int32, device=self._comm)
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())


__all__ = ["ContextParallelCache", "merge_partials"]

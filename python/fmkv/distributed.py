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

The shards are host caches (``ref`` / ``cpu`` backends): with the gloo backend the collective runs on
CPU tensors; with NCCL the partials travel as CUDA tensors of the current device. The C API's
``fmkv_attention_lse`` also runs on the CUDA backend (the same output bits as ``fmkv_attention``); shards held in
device memory would need a device-memory cache here, which this module does not have.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import Cache, Config, _args

_FP16_LIMIT = 65520.0  # values rounding beyond float16 (fmkv's input rule)


def merge_partials(outs: Sequence[np.ndarray], lses: Sequence[np.ndarray]) -> np.ndarray:
    """Attention over the union of disjoint token sets from each set's ``(out, lse)``.

    outs[i]: [rows, heads, head_dim], lses[i]: [rows, heads] (``-inf`` for an empty set, whose out is
    ignored). Returns float32 ``sum_i w_i out_i`` with ``w_i = exp(lse_i - log sum_j exp(lse_j))``,
    accumulated in float64 in the order given (deterministic). Raises FmkvError when a row has no
    tokens in any set.
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise _args.error(f"merge_partials: {len(outs)} outputs and {len(lses)} lse arrays (need the same, >= 1)")
    o = [np.asarray(x, dtype=np.float64) for x in outs]
    s = [np.asarray(x, dtype=np.float64) for x in lses]
    for x, y in zip(o, s):
        if x.ndim != 3 or y.shape != x.shape[:2] or x.shape != o[0].shape:
            raise _args.error(f"merge_partials: out {x.shape} and lse {y.shape} do not match "
                              f"[rows, heads, head_dim] / [rows, heads] of the first {o[0].shape}")
    m = np.max(np.stack(s), axis=0)
    if not np.all(np.isfinite(m)):
        raise _args.error("merge_partials: a query row has no visible token in any partial (every lse is -inf)")
    num = np.zeros(o[0].shape)
    den = np.zeros(s[0].shape)
    for x, y in zip(o, s):
        w = np.exp(y - m)  # exp(-inf) = 0: an empty partial adds nothing
        den += w
        num += w[..., None] * np.where(np.isfinite(y)[..., None], x, 0.0)
    return (num / den[..., None]).astype(np.float32)


class ContextParallelCache:
    """One sequence of ``num_layers`` layers, sharded by token range over the process group's ranks.

    config: the cache's fmkv.Config (its sink tokens live on rank 0, its window on the last rank).
    shard_tokens: positions per rank; the capacity is ``world * shard_tokens`` tokens (an append past it
    is refused on every rank before anything is written). backend: the shards' fmkv backend (default as
    fmkv.Cache). group: a torch.distributed process group (default: the world).
    """

    def __init__(self, config: Config, num_layers: int, shard_tokens: int, backend: Optional[str] = None,
                 group: Any = None):
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
        self._cache = Cache(self._local_config, self.num_layers, pages, 1, backend)
        self._seq = self._cache.add_sequence()
        self._lengths = [0] * self.num_layers  # global tokens per layer (the same on every rank)
        self._nccl = dist.get_backend(group) == "nccl"

    @property
    def local_cache(self) -> Cache:
        """This rank's shard."""
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
        """Append token rows k, v ([tokens, num_kv_heads, head_dim], the same on every rank) to ``layer``;
        the rank keeps those whose positions it owns. All-or-nothing on every rank: the whole input is
        checked first (shape, finiteness, the fp16 range, the capacity)."""
        layer = self._layer(layer)
        c = self.config
        k, v = np.asarray(k), np.asarray(v)
        want = (c.num_kv_heads, c.head_dim)
        if k.ndim != 3 or v.shape != k.shape or k.shape[1:] != want:
            raise _args.error(f"append: k {k.shape} and v {v.shape} must both be [tokens, {want[0]}, {want[1]}]")
        for name, x in (("k", k), ("v", v)):
            if x.dtype.kind != "f":
                raise _args.type_error(name, "a floating-point array", x)
            if x.size and not (np.all(np.isfinite(x)) and np.max(np.abs(x.astype(np.float64))) < _FP16_LIMIT):
                raise _args.error(f"append: {name} holds NaN, Inf or values beyond the float16 range", "NON_FINITE")
        n0, rows = self._lengths[layer], k.shape[0]
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

    def attention(self, layer: int, q: Any, softmax_scale: Optional[float] = None,
                  softcap: float = 0.0) -> np.ndarray:
        """Decode attention of one query row q ([1, q_heads, head_dim], the same on every rank: the newest
        token, already appended) over every rank's shard; the merged float32 [1, q_heads, head_dim], the
        same bits on every rank."""
        out, lse = self.local_partial(layer, q, softmax_scale, softcap)
        outs, lses = self.gather_partials(out, lse)
        return merge_partials(outs, lses)

    def local_partial(self, layer: int, q: Any, softmax_scale: Optional[float] = None,
                      softcap: float = 0.0) -> Tuple[np.ndarray, np.ndarray]:
        """This rank's (out, lse) for one query row (zeros and -inf when the rank holds no token yet)."""
        layer = self._layer(layer)
        q = np.asarray(q)
        c = self.config
        if q.ndim != 3 or q.shape[0] != 1 or q.shape[2] != c.head_dim or q.shape[1] % c.num_kv_heads:
            raise _args.error(f"attention: q {q.shape} must be [1, q_heads, {c.head_dim}] (one decode row; q_heads a "
                              f"multiple of {c.num_kv_heads})")
        if self._lengths[layer] == 0:
            raise _args.error("attention: the layer holds no token")
        lo, hi = self.local_range(layer)
        if hi == lo:
            return (np.zeros(q.shape, np.float32), np.full(q.shape[:2], -np.inf, np.float32))
        return self._cache.attention_lse(layer, self._seq, q, softmax_scale, softcap)

    def gather_partials(self, out: np.ndarray, lse: np.ndarray) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """Every rank's (out, lse), in rank order (one all_gather of the packed float32 partials)."""
        import torch

        packed = torch.from_numpy(np.concatenate([out.reshape(-1), lse.reshape(-1)]).astype(np.float32))
        if self._nccl:
            packed = packed.cuda()
        parts = [torch.empty_like(packed) for _ in range(self.world)]
        self._dist.all_gather(parts, packed, group=self._group)
        n = out.size
        outs = [p.cpu().numpy()[:n].reshape(out.shape) for p in parts]
        lses = [p.cpu().numpy()[n:].reshape(lse.shape) for p in parts]
        return outs, lses

    # ------------------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        return _args.integer("layer", layer, 0, self.num_layers - 1, "OUT_OF_RANGE")

    def _agree(self, failed: int) -> int:
        """All ranks learn whether any rank failed (one all_reduce of a flag)."""
        import torch

        flag = torch.tensor([failed], dtype=torch.int32)
        if self._nccl:
            flag = flag.cuda()
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())


__all__ = ["ContextParallelCache", "merge_partials"]

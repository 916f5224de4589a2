"""Widths per kv head: a layer whose kv heads have different (k_bits, v_bits) pairs is stored as one fmkv layer per
distinct pair, each over its own kv heads (``head_bits``, e.g. a ``fmkv-eval plan --per-head`` plan).

A group is an ordinary fmkv cache layer with fewer kv heads (the same layer seed, so a head's pages are the bytes
a one-width layer would write for it); its query heads are the GQA group of its kv heads. A step puts the K/V and
query heads in group order (one ``index_select`` per tensor, none when the groups are contiguous head ranges), hands
each group its slice, runs the groups' calls -- on CUDA the groups after the first on side streams, joined before
the merge -- and concatenates their outputs back into head order. A layer whose heads all have one pair is the
plain layer. Each extra group is its own launches per step: the decode-speed price is measured in docs/EVAL.md
section 14.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

import fmkv

from .._args import width_pair
from .compat import layer_bit_widths

Pair = Tuple[int, int]
_SIDE_STREAMS: Dict[str, List["torch.cuda.Stream"]] = {}  # per CUDA device, shared by every group layer


def layer_head_widths(n: int, kv_heads: int, head_bits, layer_bits=None, boundary_layers: int = 0) -> List[List[Pair]]:
    """The (k_bits, v_bits) of each kv head of each of the ``n`` layers from ``head_bits`` (a list of pairs per kv
    head for every layer); ValueError naming the first malformed entry. The widths themselves are checked by
    fmkv.Config."""
    if layer_bits is not None or boundary_layers:
        raise ValueError("head_bits and " + ("layer_bits" if layer_bits is not None else "boundary_layers")
                         + " both choose the widths; pass one of them")
    layers = list(head_bits)
    if len(layers) != n:
        raise ValueError(f"head_bits has {len(layers)} entries for a model of {n} layers")
    out = []
    for i, heads in enumerate(layers):
        pairs = list(heads)
        if len(pairs) != kv_heads:
            raise ValueError(f"head_bits[{i}] has {len(pairs)} pairs for {kv_heads} kv heads")
        out.append([width_pair(f"head_bits[{i}][{h}]", p) for h, p in enumerate(pairs)])
    return out


def cache_widths(n: int, kv_heads: int, k_bits: int, v_bits: int, boundary_layers: int, boundary_k_bits: int,
                 boundary_v_bits: int, layer_bits, head_bits) -> tuple:
    """A cache's widths from its options: (pairs per kv head per layer, or None without ``head_bits``; the
    (k_bits, v_bits) of each layer, with ``head_bits`` the widest of its heads')."""
    if head_bits is None:
        return None, layer_bit_widths(n, k_bits, v_bits, boundary_layers, boundary_k_bits, boundary_v_bits, layer_bits)
    heads = layer_head_widths(n, kv_heads, head_bits, layer_bits, boundary_layers)
    return heads, [(max(k for k, _ in h), max(v for _, v in h)) for h in heads]


def width_groups(pairs: Sequence[Pair]) -> List[Tuple[Pair, List[int]]]:
    """[(pair, kv heads with that pair)] in the order of each pair's first head."""
    groups: Dict[Pair, List[int]] = {}
    for h, p in enumerate(pairs):
        groups.setdefault(tuple(p), []).append(h)
    return list(groups.items())


class HeadGroups:
    """The split and merge of a layer stored as width groups: ``parts`` is [(layer, kv heads)]. The kv heads are
    put in group order by one gather per tensor (none when the groups are already contiguous ranges of heads), each
    group takes a slice (a view), and the groups' outputs are concatenated and put back in head order."""

    def __init__(self, layer_idx: int, parts: List[Tuple[object, List[int]]], num_kv_heads: int, q_per_kv: int):
        super().__init__()
        self.layer_idx = int(layer_idx)
        self._init_groups(parts, num_kv_heads, q_per_kv)

    def __repr__(self) -> str:
        groups = ", ".join(f"k{p.k_bits}v{p.v_bits}: heads {h}" for p, h in self.parts)
        return f"{type(self).__name__}(layer={self.layer_idx}, {groups})"

    @property
    def layers(self) -> list:
        """The width groups' layers, in group order."""
        return [p for p, _ in self.parts]

    @property
    def key_offset(self) -> bool:
        """Whether the groups store keys minus their offset (the cache's ``key_offset``: all groups alike)."""
        return any(layer.key_offset for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate each group's layer for its heads of key_states / value_states."""
        self._check_heads(key_states, "K")
        for layer, k, v in zip(self.layers, self._split(key_states), self._split(value_states)):
            layer.lazy_initialization(k, v)
        self.is_initialized = True

    def _init_groups(self, parts: List[Tuple[object, List[int]]], num_kv_heads: int, q_per_kv: int) -> None:
        self.parts = parts
        self.num_kv_heads, self.q_per_kv = int(num_kv_heads), int(q_per_kv)
        self._order = [h for _, heads in parts for h in heads]
        if sorted(self._order) != list(range(self.num_kv_heads)):
            raise ValueError(f"fmkv layer {self.layer_idx}: the width groups' heads {self._order} are not each of "
                             f"the {self.num_kv_heads} kv heads once")
        self._bounds, a = [], 0
        for _, heads in parts:
            self._bounds.append((a, a + len(heads)))
            a += len(heads)
        self._in_order = self._order == list(range(self.num_kv_heads))
        self._perm: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv heads in group order, query heads in group order, the inverse of the latter) on ``device``, made
        once per device (at allocation for a static cache, so that no captured step copies them)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._perm.get(str(device))
        if t is None:
            g = self.q_per_kv
            q_order = [h * g + j for h in self._order for j in range(g)]
            inv = [0] * len(q_order)
            for i, h in enumerate(q_order):
                inv[h] = i
            t = tuple(torch.tensor(x, dtype=torch.int64, device=device) for x in (self._order, q_order, inv))
            self._perm[str(device)] = t
        return t

    def _split(self, x: torch.Tensor, query: bool = False) -> List[torch.Tensor]:
        """x [b, heads, n, d] -> each group's heads [b, heads of the group, n, d] (slices of one gather)."""
        if not self._in_order:
            x = x.index_select(1, self._tables(x.device)[1 if query else 0])
        g = self.q_per_kv if query else 1
        return [x[:, a * g:b * g] for a, b in self._bounds]

    def _merge(self, outs: List[torch.Tensor]) -> torch.Tensor:
        """The groups' outputs [b, n, query heads of the group, d] -> [b, n, hq, d] in head order."""
        out = torch.cat(outs, dim=2)
        return out if self._in_order else out.index_select(2, self._tables(out.device)[2])

    @staticmethod
    def _concurrently(device: torch.device, calls: List[Callable[[], object]]) -> List[object]:
        """Run each group's call; on CUDA (not while torch.compile traces) the groups after the first on side
        streams forked from the current one and joined back before returning, so their kernels overlap (in a
        captured graph: parallel branches) instead of paying each group's launch latency in turn."""
        if device.type != "cuda" or len(calls) == 1 or torch.compiler.is_compiling():
            return [c() for c in calls]
        cur = torch.cuda.current_stream(device)
        side = _SIDE_STREAMS.setdefault(str(device), [])
        while len(side) < len(calls) - 1:
            side.append(torch.cuda.Stream(device=device))
        outs: List[object] = [None] * len(calls)
        try:
            for i, s in enumerate(side[:len(calls) - 1], 1):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    outs[i] = calls[i]()
            outs[0] = calls[0]()
        finally:
            for s in side[:len(calls) - 1]:
                cur.wait_stream(s)
        for o in outs[1:]:
            if isinstance(o, torch.Tensor):
                o.record_stream(cur)  # made on a side stream, read on this one
        return outs

    def _check_heads(self, x: torch.Tensor, what: str, heads: int = 0) -> None:
        heads = heads or self.num_kv_heads
        if x.dim() != 4 or x.shape[1] != heads:
            raise ValueError(f"fmkv layer {self.layer_idx}: {what} of shape {tuple(x.shape)}; the layer's head_bits "
                             f"name {self.num_kv_heads} kv heads ({self.num_kv_heads * self.q_per_kv} query heads), "
                             f"[batch, heads, tokens, head_dim] expected")

    def _check_values(self, x: torch.Tensor, what: str, fp16: bool) -> None:
        """Host storage: NaN / Inf (K/V: beyond fp16) anywhere in ``x`` is refused before any group is touched, so
        that a failed step leaves every group as it was (each group's call would refuse its own heads, but the
        groups before it would already have advanced). CUDA reports such inputs at check() (the layer's contents
        are then undefined, as for any layer), so nothing is read back here."""
        if x.device.type == "cuda":
            return
        bad = ~torch.isfinite(x.to(torch.float16) if fp16 else x)
        if bool(bad.any()):
            h = int(bad.nonzero()[0, 1])
            raise fmkv.FmkvError(f"fmkv layer {self.layer_idx}: {what} head {h} holds NaN, Inf"
                                 + (" or a value beyond the fp16 range" if fp16 else ""))

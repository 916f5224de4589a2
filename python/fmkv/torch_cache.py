"""TorchCache: a paged compressed KV cache whose storage is torch tensors on one device (CPU or
CUDA), driven by the custom ops of :mod:`fmkv.torch_ops` (also importable as
``fmkv.torch_ops.TorchCache``).

Importing this module registers the ops (it needs torch; fmkv itself does not).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from . import Config, FmkvError
from .torch_ops import backend_for_device, config_to_list

__all__ = ["TorchCache"]


class TorchCache:
    """Paged compressed KV cache whose storage is torch tensors on one device (CPU or CUDA),
    driven by the custom ops.

    ``pages[layer]`` uint8 [num_pages, page_bytes], ``fp16_k[layer]`` / ``fp16_v[layer]`` float16
    [max_seqs, num_kv_heads, sink + window, head_dim]; all layers of a sequence share one block
    table (as in fmkv::HostCache). ``device`` (default: CUDA when ``backend='cuda'``, else CPU)
    holds the storage; inputs must be on it. ``backend`` defaults to the device's (host backend on
    the CPU, 'cuda' on a GPU).

    Bookkeeping: page allocation and lengths are kept in host mirrors (Python ints); the device
    holds the block table [max_seqs, num_pages] int32, per-layer lengths [num_layers, max_seqs]
    int64 and the slot indices. On CUDA an append updates the device lengths with an in-place add
    and copies newly assigned block-table entries from pinned host memory asynchronously, so no call
    synchronises the host with the device. Device-detected errors surface at :func:`cuda_check`;
    the failed op wrote nothing but the lengths had already advanced, so remove the sequence
    (or rebuild the cache) after such an error.
    """

    def __init__(self, config: Config, num_layers: int, num_pages: int, max_seqs: int, backend: Optional[str] = None,
                 device=None):
        if not isinstance(config, Config):
            raise FmkvError(f"config must be an fmkv.Config, got {type(config).__name__}")
        if num_layers < 1 or num_pages < 0 or max_seqs < 1:
            raise FmkvError("TorchCache: need num_layers >= 1, num_pages >= 0, max_seqs >= 1")
        if device is None:
            device = "cuda" if backend == "cuda" else "cpu"
        dev = torch.device(device)
        self.backend = backend_for_device(dev, backend, "TorchCache")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.config = config
        self._cfg = config_to_list(config)
        R = config.sink_tokens + config.window_tokens
        H, d = config.num_kv_heads, config.head_dim
        self.pages = [torch.zeros(num_pages, config.page_bytes, dtype=torch.uint8, device=dev) for _ in range(num_layers)]
        self.fp16_k = [torch.zeros(max_seqs, H, R, d, dtype=torch.float16, device=dev) for _ in range(num_layers)]
        self.fp16_v = [torch.zeros(max_seqs, H, R, d, dtype=torch.float16, device=dev) for _ in range(num_layers)]
        self._free = list(range(num_pages - 1, -1, -1))
        self._tables: List[List[int]] = [[] for _ in range(max_seqs)]
        self._lens = [[-1] * max_seqs for _ in range(num_layers)]
        # Device-side batch arrays of one-sequence calls (views of these are passed to the ops).
        self._bt = torch.zeros(max_seqs, max(num_pages, 1), dtype=torch.int32, device=dev)
        self._lens_dev = torch.zeros(num_layers, max_seqs, dtype=torch.int64, device=dev)
        self._slots = torch.arange(max_seqs, dtype=torch.int32, device=dev)
        self._offsets: Dict[int, Tensor] = {}

    @property
    def num_layers(self) -> int:
        return len(self.pages)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the cache storage allocated on the device: page pools and fp16 sink/window
        regions of every layer (the same count as fmkv.Cache.resident_bytes)."""
        return sum(t.untyped_storage().nbytes() for ts in (self.pages, self.fp16_k, self.fp16_v) for t in ts)

    @property
    def index_bytes(self) -> int:
        """Bytes of the device-side bookkeeping (block table, lengths, slots, row offsets)."""
        return sum(t.untyped_storage().nbytes() for t in [self._bt, self._lens_dev, self._slots, *self._offsets.values()])

    @property
    def used_bytes(self) -> int:
        """Bytes of pages held by live sequences plus their fp16 regions (as fmkv.Cache.used_bytes)."""
        live = [s for s in range(len(self._tables)) if self._lens[0][s] >= 0]
        pages = sum(len(self._tables[s]) for s in live)
        return self.num_layers * (pages * self.config.page_bytes + self.config.fp16_slot_bytes * len(live))

    def _seq(self, s: int) -> int:
        if not 0 <= s < len(self._tables) or self._lens[0][s] < 0:
            raise FmkvError(f"TorchCache: sequence {s} does not exist")
        return s

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise FmkvError(f"TorchCache: layer {layer} outside [0, {self.num_layers})")
        return layer

    def add_sequence(self) -> int:
        for s in range(len(self._tables)):
            if self._lens[0][s] < 0:
                for lens in self._lens:
                    lens[s] = 0
                self._lens_dev[:, s].zero_()
                self._tables[s] = []
                return s
        raise FmkvError(f"TorchCache: all {len(self._tables)} sequence slots are in use")

    def remove_sequence(self, s: int) -> None:
        self._seq(s)
        self._free.extend(reversed(self._tables[s]))
        self._tables[s] = []
        for lens in self._lens:
            lens[s] = -1

    def length(self, layer: int, s: int) -> int:
        return self._lens[self._layer(layer)][self._seq(s)]

    def block_table(self, s: int) -> List[int]:
        return list(self._tables[self._seq(s)])

    def _row_offsets(self, rows: int) -> Tensor:
        t = self._offsets.get(rows)
        if t is None:  # [0, rows], computed on the device: no host-to-device copy
            t = torch.arange(2, dtype=torch.int64, device=self.device) * rows
            self._offsets[rows] = t
        return t

    def _store_table(self, s: int, first: int) -> None:
        new = self._tables[s][first:]
        if not new:
            return
        src = torch.tensor(new, dtype=torch.int32)
        if self.device.type == "cuda":
            src = src.pin_memory()  # asynchronous copy: the caching host allocator keeps it alive
            self._bt[s, first:first + len(new)].copy_(src, non_blocking=True)
        else:
            self._bt[s, first:first + len(new)].copy_(src)

    def append(self, layer: int, s: int, k: Tensor, v: Tensor) -> None:
        layer, s = self._layer(layer), self._seq(s)
        c = self.config
        n = int(k.shape[0]) if k.dim() >= 1 else 0
        length = self._lens[layer][s]
        comp = max(0, length + n - c.window_tokens - c.sink_tokens)
        need = -(-comp // c.page_size) - len(self._tables[s])
        if need > len(self._free):
            raise FmkvError(f"TorchCache: out of pages ({len(self._free)} free, sequence needs {need} more)")
        first = len(self._tables[s])
        for _ in range(max(0, need)):
            self._tables[s].append(self._free.pop())
        self._store_table(s, first)
        torch.ops.fmkv.append(self.pages[layer], self.fp16_k[layer], self.fp16_v[layer], k, v,
                              self._slots[s:s + 1], self._lens_dev[layer, s:s + 1], self._row_offsets(n),
                              self._bt[s:s + 1], self._cfg, layer, self.backend)
        self._lens_dev[layer, s:s + 1].add_(n)
        self._lens[layer][s] = length + n

    def attention(self, layer: int, s: int, q: Tensor, softmax_scale: Optional[float] = None,
                  softcap: float = 0.0) -> Tensor:
        layer, s = self._layer(layer), self._seq(s)
        if softmax_scale is not None and not softmax_scale > 0:
            raise FmkvError("softmax_scale must be > 0 (None means 1/sqrt(head_dim))")
        # the host mirror knows the length: the call is planned for it (max_seq_len)
        return torch.ops.fmkv.attention(self.pages[layer], self.fp16_k[layer], self.fp16_v[layer], q,
                                        self._slots[s:s + 1], self._lens_dev[layer, s:s + 1],
                                        self._row_offsets(int(q.shape[0])), self._bt[s:s + 1], self._cfg, layer,
                                        float(softmax_scale or 0.0), float(softcap), self.backend,
                                        max(int(self._lens[layer][s]), 1))

"""TorchCache: a paged compressed KV cache whose storage is torch tensors on one device (CPU or
CUDA), driven by the custom ops of :mod:`fmkv.torch_ops` (also importable as
``fmkv.torch_ops.TorchCache``).

Importing this module registers the ops (it needs torch; fmkv itself does not).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import torch
from torch import Tensor

from . import Config, FmkvError, _args, _fmkv
from .key_offset import check_softcap, first_tokens_mean
from .torch_ops import _FLOAT_DTYPES, backend_for_device, config_to_list, cuda_check

__all__ = ["TorchCache"]

# Bytes of host bookkeeping (Python lists and ints) per sequence, per (layer, sequence) and per page:
# a generous bound, for the allocation check only.
_HOST_BYTES_PER_SEQ, _HOST_BYTES_PER_LAYER_SEQ, _HOST_BYTES_PER_PAGE = 128, 8, 40


class TorchCache:
    """Paged compressed KV cache whose storage is torch tensors on one device (CPU or CUDA),
    driven by the custom ops.

    ``pages[layer]`` uint8 [num_pages, page_bytes], ``fp16_k[layer]`` / ``fp16_v[layer]`` float16
    [max_seqs, num_kv_heads, sink + window, head_dim]; all layers of a sequence share one block
    table (as in fmkv::HostCache). ``device`` (default: CUDA when ``backend='cuda'``, else CPU)
    holds the storage; inputs must be on it. ``backend`` defaults to the device's (host backend on
    the CPU, 'cuda' on a GPU). The format options -- ``format_version``, ``scale_group`` (fp16 scales per 32 or
    64 rotated coordinates, ``fmkv.format.SCALE_GROUPS``) -- come with ``config``; a backend that does not have
    one (``fmkv.check_backend``) refuses every op on it by name and writes nothing.

    Bookkeeping: page allocation and lengths are kept in host mirrors (Python ints); the device
    holds the block table [max_seqs, num_pages] int32, per-layer lengths [num_layers, max_seqs]
    int64 and the slot indices. On CUDA an append updates the device lengths with an in-place add
    and copies newly assigned block-table entries from pinned host memory asynchronously, so no call
    synchronises the host with the device.

    Guarantees (docs/RELIABILITY.md):

    * **All-or-nothing.** A call that raises leaves the pages, the block table, the lengths and the
      sequence slots -- host mirrors and device tables -- as they were: arguments are checked
      first, the pages an append needs are reserved, and the reservation is committed only when the
      op has returned (given back otherwise). The allocation is sized up front and refused when it
      exceeds the device's memory (CPU: the host's, ``fmkv_host_memory_bytes``).
    * **Threads.** Calls on different sequences may run concurrently from several threads (the
      bookkeeping is under a lock; an op touches only its sequence's pages, fp16 slot and
      block-table row). Concurrent attentions on one sequence are fine; a call that would change a
      sequence (append, reset, remove) while another thread uses it raises :class:`fmkv.FmkvError`
      ("sequence N is in use by another thread"), as does an attention on a sequence another thread
      is appending to: an error, never a silent interleaving.
    * **CUDA device errors** (NaN/Inf in K/V/Q, and what only the device sees) surface at
      :meth:`check` (which waits for the device), not at the op. The failed op wrote nothing
      visible, but later fmkv CUDA ops were skipped while the lengths advanced, so every sequence
      changed since the previous :meth:`check` is marked failed: its appends and attentions raise
      FmkvError until :meth:`reset_sequence` (length 0, pages returned) or :meth:`remove_sequence`;
      the other sequences stay valid -- no need to rebuild the cache. Use :meth:`check` rather than
      ``fmkv.cuda_check`` for a TorchCache's calls (both clear the device's error word). On the CPU
      errors are raised by the op itself and :meth:`check` has nothing to find.

    ``key_offset=True``: each (layer, sequence)'s keys are stored minus their mean over its first 128 tokens
    (fmkv.key_offset), fixed by its first append (kept only once that append succeeded; cleared by
    :meth:`reset_sequence` / :meth:`remove_sequence`). Softmax ignores the offset: attention is unchanged up to
    quantization, which sees centred keys. Not with a softcap (the cap acts on the shifted scores): attention with
    ``softcap > 0`` on such a cache raises FmkvError.
    """

    def __init__(self, config: Config, num_layers: int, num_pages: int, max_seqs: int, backend: Optional[str] = None,
                 device=None, key_offset: bool = False):
        if not isinstance(config, Config):
            raise _args.type_error("config", "an fmkv.Config", config)
        num_layers = _args.integer("num_layers", num_layers, 1, _args.INT32_MAX)
        num_pages = _args.integer("num_pages", num_pages, 0, _args.INT32_MAX)
        max_seqs = _args.integer("max_seqs", max_seqs, 1, _args.INT32_MAX)
        if backend is not None:
            _args.string("backend", backend)
        if device is None:
            device = "cuda" if backend == "cuda" else "cpu"
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise FmkvError(f"TorchCache: device {device!r} is not a torch device ({e})") from None
        self.backend = backend_for_device(dev, backend, "TorchCache")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.config = config
        self._cfg = config_to_list(config)
        R = config.sink_tokens + config.window_tokens
        H, d = config.num_kv_heads, config.head_dim
        self._check_memory(num_layers, num_pages, max_seqs)
        try:
            self.pages = [torch.zeros(num_pages, config.page_bytes, dtype=torch.uint8, device=dev) for _ in range(num_layers)]
            self.fp16_k = [torch.zeros(max_seqs, H, R, d, dtype=torch.float16, device=dev) for _ in range(num_layers)]
            self.fp16_v = [torch.zeros(max_seqs, H, R, d, dtype=torch.float16, device=dev) for _ in range(num_layers)]
            # Device-side batch arrays of one-sequence calls (views of these are passed to the ops).
            self._bt = torch.zeros(max_seqs, max(num_pages, 1), dtype=torch.int32, device=dev)
            self._lens_dev = torch.zeros(num_layers, max_seqs, dtype=torch.int64, device=dev)
            self._slots = torch.arange(max_seqs, dtype=torch.int32, device=dev)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise _args.error(f"TorchCache: allocating the cache on '{dev}' failed: {e}", "OUT_OF_RANGE") from None
        self._free = list(range(num_pages - 1, -1, -1))
        self._tables: List[List[int]] = [[] for _ in range(max_seqs)]
        self._lens = [[-1] * max_seqs for _ in range(num_layers)]
        self._offsets: Dict[int, Tensor] = {}
        self._lock = threading.Lock()
        self._writing: Set[int] = set()    # sequences an append / reset / remove is changing
        self._reading: Dict[int, int] = {}  # sequence -> attentions running on it
        self._failed: Dict[int, str] = {}   # sequence -> the device error that invalidated it
        self._changed: Set[int] = set()     # sequences appended to since the last check()
        self.key_offset = bool(key_offset)
        self._key_mu: Dict[tuple, Tensor] = {}  # (layer, sequence) -> [num_kv_heads, head_dim] (key_offset)

    def _check_memory(self, num_layers: int, num_pages: int, max_seqs: int) -> None:
        """Refuse, before allocating, a cache larger than its device's memory."""
        c = self.config
        dev_bytes = (num_layers * (num_pages * c.page_bytes + max_seqs * c.fp16_slot_bytes + 8 * max_seqs)
                     + 4 * max_seqs * max(num_pages, 1) + 4 * max_seqs)
        host_bytes = (_HOST_BYTES_PER_SEQ * max_seqs + _HOST_BYTES_PER_LAYER_SEQ * num_layers * max_seqs
                      + _HOST_BYTES_PER_PAGE * num_pages)
        host_have = int(_fmkv.host_memory_bytes())
        what = f"TorchCache: {num_layers} layers x {num_pages} pages, {max_seqs} sequences"
        if self.device.type == "cuda":
            have = int(torch.cuda.mem_get_info(self.device)[1])
            if dev_bytes > have:
                raise _args.error(f"{what} need {dev_bytes} bytes on '{self.device}', more than its {have}", "OUT_OF_RANGE")
        else:
            host_bytes += dev_bytes
        if host_have > 0 and host_bytes > host_have:
            raise _args.error(f"{what} need {host_bytes} bytes of host memory, more than this host's {host_have}",
                              "OUT_OF_RANGE")

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
        with self._lock:
            live = [s for s in range(len(self._tables)) if self._lens[0][s] >= 0]
            pages = sum(len(self._tables[s]) for s in live)
        return self.num_layers * (pages * self.config.page_bytes + self.config.fp16_slot_bytes * len(live))

    @property
    def failed_sequences(self) -> Dict[int, str]:
        """Sequences a device error invalidated (see :meth:`check`) and the error's message."""
        with self._lock:
            return dict(self._failed)

    # ---- argument checks (no state read) --------------------------------------------------------
    def _seq_index(self, s: Any) -> int:
        return _args.index("seq", s, "sequence")

    def _layer(self, layer: Any) -> int:
        layer = _args.index("layer", layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise _args.error(f"TorchCache: layer {layer} outside [0, {self.num_layers})", "OUT_OF_RANGE")
        return layer

    def _rows(self, name: str, t: Any, heads: Optional[int]) -> int:
        """A [rows, heads, head_dim] float tensor on the cache's device; returns rows."""
        if not isinstance(t, Tensor):
            raise _args.type_error(name, "a torch.Tensor", t)
        if t.dtype not in _FLOAT_DTYPES:
            raise _args.error(f"{name}: dtype {t.dtype} is not supported (expected float32, float16 or bfloat16)")
        c = self.config
        if t.dim() != 3 or (heads is not None and t.shape[1] != heads) or t.shape[2] != c.head_dim:
            want = f"[tokens, num_kv_heads={c.num_kv_heads}" if heads is not None else \
                f"[query_tokens, q_heads (a multiple of num_kv_heads={c.num_kv_heads})"
            raise _args.error(f"{name}: shape {tuple(t.shape)} does not match {want}, head_dim={c.head_dim}]")
        if t.device != self.device:
            raise _args.error(f"{name} is on device '{t.device}' but the cache is on '{self.device}' "
                              f"(fmkv never copies between devices)")
        return int(t.shape[0])

    # ---- state, under the lock ------------------------------------------------------------------
    def _live(self, s: int) -> None:
        if not 0 <= s < len(self._tables) or self._lens[0][s] < 0:
            raise _args.error(f"TorchCache: sequence {s} does not exist", "OUT_OF_RANGE")

    def _usable(self, s: int) -> None:
        self._live(s)
        if s in self._failed:
            raise _args.error(f"TorchCache: sequence {s} failed on the device ({self._failed[s]}); "
                              f"reset_sequence({s}) or remove_sequence({s}) to reuse it", "BACKEND")

    def _claim_write(self, s: int) -> None:
        if s in self._writing or self._reading.get(s):
            raise _args.error(f"TorchCache: sequence {s} is in use by another thread (one call at a time may change "
                              f"a sequence)")
        self._writing.add(s)

    @contextlib.contextmanager
    def _reader(self, s: int) -> Iterator[None]:
        with self._lock:
            self._usable(s)
            if s in self._writing:
                raise _args.error(f"TorchCache: sequence {s} is in use by another thread (being appended to)")
            self._reading[s] = self._reading.get(s, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[s] -= 1
                if not self._reading[s]:
                    del self._reading[s]

    # ---- public calls ---------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Claim a free sequence slot (length 0 in every layer); returns its id."""
        with self._lock:
            return self._claim_slot()

    def _claim_slot(self) -> int:  # under the lock
        for s in range(len(self._tables)):
            if self._lens[0][s] < 0 and s not in self._writing:
                self._lens_dev[:, s].zero_()
                for lens in self._lens:
                    lens[s] = 0
                self._tables[s] = []
                return s
        raise _args.error(f"TorchCache: all {len(self._tables)} sequence slots are in use", "OUT_OF_RANGE")

    def key_mu(self, layer: int, s: int) -> Optional[Tensor]:
        """The key offset [num_kv_heads, head_dim] of sequence ``s`` in ``layer`` (None before its first append, or
        without ``key_offset``)."""
        layer, s = self._layer(layer), self._seq_index(s)
        with self._lock:
            return self._key_mu.get((layer, s))

    def _release(self, s: int) -> None:
        for key in [key for key in self._key_mu if key[1] == s]:
            del self._key_mu[key]
        self._free.extend(reversed(self._tables[s]))
        self._tables[s] = []
        self._failed.pop(s, None)
        self._changed.discard(s)

    def remove_sequence(self, s: int) -> None:
        """Release a sequence and its pages (also the way out for a failed sequence)."""
        s = self._seq_index(s)
        with self._lock:
            self._live(s)
            self._claim_write(s)
            try:
                self._release(s)
                for lens in self._lens:
                    lens[s] = -1
            finally:
                self._writing.discard(s)

    def reset_sequence(self, s: int) -> None:
        """Empty a sequence (length 0 in every layer, its pages returned) and keep its id; clears a
        device failure (see :meth:`check`)."""
        s = self._seq_index(s)
        with self._lock:
            self._live(s)
            self._claim_write(s)
            try:
                self._lens_dev[:, s].zero_()
                self._release(s)
                for lens in self._lens:
                    lens[s] = 0
            finally:
                self._writing.discard(s)

    def length(self, layer: int, s: int) -> int:
        layer, s = self._layer(layer), self._seq_index(s)
        with self._lock:
            self._live(s)
            return self._lens[layer][s]

    def block_table(self, s: int) -> List[int]:
        s = self._seq_index(s)
        with self._lock:
            self._live(s)
            return list(self._tables[s])

    def _row_offsets(self, rows: int) -> Tensor:
        t = self._offsets.get(rows)
        if t is None:  # [0, rows], computed on the device: no host-to-device copy
            t = torch.arange(2, dtype=torch.int64, device=self.device) * rows
            self._offsets[rows] = t
        return t

    def _store_table(self, s: int, first: int, new: List[int]) -> None:
        if not new:
            return
        src = torch.tensor(new, dtype=torch.int32)
        if self.device.type == "cuda":
            src = src.pin_memory()  # asynchronous copy: the caching host allocator keeps it alive
            self._bt[s, first:first + len(new)].copy_(src, non_blocking=True)
        else:
            self._bt[s, first:first + len(new)].copy_(src)

    def append(self, layer: int, s: int, k: Tensor, v: Tensor) -> None:
        """Append token rows ``k``, ``v`` ([tokens, num_kv_heads, head_dim], on the cache's device)
        to sequence ``s`` of ``layer``. On error nothing changes (pages, table, lengths)."""
        layer, s = self._layer(layer), self._seq_index(s)
        c = self.config
        n = self._rows("k", k, c.num_kv_heads)
        if self._rows("v", v, c.num_kv_heads) != n:
            raise _args.error(f"k has {n} tokens but v has {int(v.shape[0])}")
        with self._lock:
            self._usable(s)
            self._claim_write(s)
            length = self._lens[layer][s]
            comp = max(0, length + n - c.window_tokens - c.sink_tokens)
            need = -(-comp // c.page_size) - len(self._tables[s])
            if need > len(self._free):
                self._writing.discard(s)
                raise _args.error(f"TorchCache: out of pages ({len(self._free)} free, sequence needs {need} more)",
                                  "OUT_OF_RANGE")
            first = len(self._tables[s])
            new = [self._free.pop() for _ in range(max(0, need))]
            self._tables[s].extend(new)
            mu = self._key_mu.get((layer, s))
        new_mu = None
        try:
            if self.key_offset:  # the first append fixes the offset; kept only once it has succeeded
                if mu is None:
                    mu = new_mu = first_tokens_mean(k.transpose(0, 1).unsqueeze(0))[0, :, 0].to(k.dtype)
                k = k - mu
            self._store_table(s, first, new)
            torch.ops.fmkv.append(self.pages[layer], self.fp16_k[layer], self.fp16_v[layer], k, v,
                                  self._slots[s:s + 1], self._lens_dev[layer, s:s + 1], self._row_offsets(n),
                                  self._bt[s:s + 1], self._cfg, layer, self.backend)
            self._lens_dev[layer, s:s + 1].add_(n)
        except BaseException:
            with self._lock:  # give the reservation back: the table is as before the call
                del self._tables[s][first:]
                self._free.extend(reversed(new))
                self._writing.discard(s)
            raise
        with self._lock:
            self._lens[layer][s] = length + n
            if new_mu is not None:
                self._key_mu[(layer, s)] = new_mu
            self._changed.add(s)
            self._writing.discard(s)

    def attention(self, layer: int, s: int, q: Tensor, softmax_scale: Optional[float] = None,
                  softcap: float = 0.0) -> Tensor:
        """Attention of the last ``q.shape[0]`` tokens of ``s`` (already appended; causal) over
        ``layer``; q [query_tokens, q_heads, head_dim] on the cache's device. Returns a tensor like q."""
        return self._attend(torch.ops.fmkv.attention, layer, s, q, softmax_scale, softcap)

    def attention_lse(self, layer: int, s: int, q: Tensor, softmax_scale: Optional[float] = None,
                      softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
        """:meth:`attention` (the same output, bit for bit) and lse, float32 [query_tokens, q_heads]: the natural
        log of each row's softmax denominator (``torch.ops.fmkv.attention_lse``), what a merge of partial
        attentions over disjoint token sets weights them by (:func:`fmkv.distributed.merge_partials`).

        With ``key_offset=True`` the pages hold the keys minus their mean mu, which shifts every score of a row
        by q . mu x softmax_scale: the returned lse adds that back (float32), so it is the log-denominator of
        the keys as appended."""
        return self._attend(torch.ops.fmkv.attention_lse, layer, s, q, softmax_scale, softcap, lse=True)

    def _attend(self, op, layer: int, s: int, q: Tensor, softmax_scale: Optional[float], softcap: float,
                lse: bool = False):
        layer, s = self._layer(layer), self._seq_index(s)
        if softmax_scale is not None:
            softmax_scale = _args.real("softmax_scale", softmax_scale)
            if not softmax_scale > 0:
                raise _args.error("softmax_scale must be > 0 (None means 1/sqrt(head_dim))")
        softcap = _args.real("softcap", softcap)
        if softcap < 0:
            raise _args.error("softcap must be finite and >= 0 (0 disables it)")
        if self.key_offset:
            check_softcap(softcap)
        n = self._rows("q", q, None)
        if q.shape[1] < self.config.num_kv_heads or q.shape[1] % self.config.num_kv_heads:
            raise _args.error(f"q: {int(q.shape[1])} heads is not a multiple of num_kv_heads={self.config.num_kv_heads}")
        with self._reader(s):
            length = self._lens[layer][s]
            if n > length:
                raise _args.error(f"q has {n} query rows but sequence {s} holds only {length} tokens in layer "
                                  f"{layer} (append first)")
            mu = self._key_mu.get((layer, s)) if lse and self.key_offset else None
            # the host mirror knows the length: the call is planned for it (max_seq_len)
            res = op(self.pages[layer], self.fp16_k[layer], self.fp16_v[layer], q, self._slots[s:s + 1],
                     self._lens_dev[layer, s:s + 1], self._row_offsets(n), self._bt[s:s + 1], self._cfg, layer,
                     float(softmax_scale or 0.0), softcap, self.backend, max(length, 1))
        if mu is None:
            return res
        out, lse_t = res  # every score of (row, q head h) is shifted by q . mu[h // group] x scale
        H, d = self.config.num_kv_heads, self.config.head_dim
        scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
        qmu = (q.float().reshape(n, H, -1, d) * mu.float().reshape(1, H, 1, d)).sum(-1).reshape(n, -1)
        return out, lse_t + scale * qmu

    # ---- snapshots (fmkv.snapshot, docs/FILE-FORMAT.md) ------------------------------------------
    def save(self, path: Any, seqs: Any, num_tokens: int = -1, allow_dequantized: bool = False) -> None:
        """Save sequences ``seqs`` (an id or a list) to the snapshot file ``path`` (written atomically): the same
        file :meth:`fmkv.Cache.save` writes for the same tokens. The sequences' pages and fp16 rows are copied to
        host memory first (on CUDA after :meth:`check`: a pending device error is raised, not saved).
        ``num_tokens``: a prefix (-1: every cached token)."""
        from .snapshot import path_of

        self._save(path_of(path), seqs, num_tokens, allow_dequantized)

    def save_bytes(self, seqs: Any, num_tokens: int = -1, allow_dequantized: bool = False) -> bytes:
        """:meth:`save` into bytes (the same file image)."""
        return self._save(None, seqs, num_tokens, allow_dequantized)

    def _save(self, path: Optional[str], seqs: Any, num_tokens: Any, allow_dequantized: bool) -> Optional[bytes]:
        from .snapshot import save_arrays, seq_list

        seqs = seq_list(seqs)
        num_tokens = _args.integer("num_tokens", num_tokens, -1)
        if self.key_offset:
            raise _args.error("TorchCache.save: a key_offset cache's key means are not part of the snapshot format",
                              "UNSUPPORTED")
        if len(set(seqs)) != len(seqs):
            raise _args.error(f"save: sequence ids {seqs} repeat")
        if self.device.type == "cuda":
            self.check()
        with contextlib.ExitStack() as readers:  # no append may change them while their bytes are copied
            for s in seqs:
                readers.enter_context(self._reader(s))
            with self._lock:
                tables = [list(self._tables[s]) for s in seqs]
                lens = [[self._lens[layer][s] for layer in range(self.num_layers)] for s in seqs]
            flat = [p for t in tables for p in t]
            index = torch.tensor(flat, dtype=torch.int64, device=self.device)
            slots = torch.tensor(seqs, dtype=torch.int64, device=self.device)
            fp16 = self.config.sink_tokens + self.config.window_tokens > 0
            layers = []
            for layer in range(self.num_layers):
                pages = self.pages[layer].index_select(0, index).cpu().numpy()
                fk = self.fp16_k[layer].index_select(0, slots).cpu().numpy() if fp16 else None
                fv = self.fp16_v[layer].index_select(0, slots).cpu().numpy() if fp16 else None
                layers.append((layer, pages, fk, fv))
        records, start = [], 0
        for i, (t, ln) in enumerate(zip(tables, lens)):
            records.append((i, ln, num_tokens, list(range(start, start + len(t)))))
            start += len(t)
        return save_arrays(path, self.config, layers, records, allow_dequantized)

    def restore(self, source: Any, file_seq: int = 0) -> int:
        """Copy sequence ``file_seq`` of a snapshot (a file path, mapped; or bytes) in as a new sequence on this
        cache's device; returns its id. The snapshot's config (every field) and layer count must equal this
        cache's; it needs a free sequence slot and the sequence's pages. On error nothing changes."""
        from .snapshot import Snapshot

        if self.key_offset:
            raise _args.error("TorchCache.restore: a key_offset cache's key means are not part of the snapshot format",
                              "UNSUPPORTED")
        snap = Snapshot.load(source, expect_config=self.config, expect_num_layers=self.num_layers)
        fs = _args.integer("file_seq", file_seq, 0, _args.INT32_MAX, "OUT_OF_RANGE")
        if fs >= snap.num_seqs:
            raise _args.error(f"restore: file_seq {fs} outside the snapshot's {snap.num_seqs} sequences", "OUT_OF_RANGE")
        q = snap.sequence(fs)
        for layer in range(self.num_layers):
            if snap.layer(layer)[0] != layer:
                raise _args.error(f"restore: snapshot layer {layer} was saved as rotation layer {snap.layer(layer)[0]}")
        with self._lock:  # the slot and the pages, claimed together (a new sequence nobody else writes)
            if len(q.block_table) > len(self._free):
                raise _args.error(f"TorchCache: out of pages ({len(self._free)} free, the snapshot's sequence needs "
                                  f"{len(q.block_table)})", "OUT_OF_RANGE")
            s = self._claim_slot()
            self._writing.add(s)
            new = [self._free.pop() for _ in q.block_table]
            self._tables[s] = list(new)
        try:
            src_index = np.asarray(q.block_table, dtype=np.int64)
            dst_index = torch.tensor(new, dtype=torch.int64, device=self.device)
            for layer in range(self.num_layers):
                _, pages, fk, fv = snap.layer(layer)
                if len(new):
                    self.pages[layer].index_copy_(0, dst_index, torch.from_numpy(pages[src_index]).to(self.device))
                if fk is not None:
                    self.fp16_k[layer][s].copy_(torch.from_numpy(fk[q.slot].copy()))
                    self.fp16_v[layer][s].copy_(torch.from_numpy(fv[q.slot].copy()))
            self._store_table(s, 0, new)
            self._lens_dev[:, s].fill_(q.num_tokens)
        except BaseException:
            with self._lock:
                self._release(s)
                for lens in self._lens:
                    lens[s] = -1
                self._writing.discard(s)
            raise
        with self._lock:
            for lens in self._lens:
                lens[s] = q.num_tokens
            self._writing.discard(s)
        return s

    @classmethod
    def from_snapshot(cls, source: Any, backend: Optional[str] = None, device=None, extra_pages: int = 0,
                      extra_seqs: int = 0) -> "TorchCache":
        """A new cache on ``device`` with the snapshot's config and layer count holding every sequence of it (ids 0,
        1, ... in file order), with ``extra_pages`` free pages per layer and ``extra_seqs`` free sequence slots."""
        from .snapshot import filled_from

        return filled_from(source, lambda c, n, p, s: cls(c, n, p, s, backend, device), extra_pages, extra_seqs)

    def check(self) -> None:
        """Wait for the device and raise the first error fmkv's kernels recorded there since the last
        check (CUDA; see the class notes): the sequences appended to since then are marked failed
        (:attr:`failed_sequences`) before the FmkvError propagates. A no-op on the CPU."""
        with self._lock:
            changed, self._changed = self._changed, set()
        try:
            if self.device.type == "cuda":
                cuda_check(self.device)
            else:
                _fmkv.synchronize(self.backend)
        except FmkvError as e:
            with self._lock:
                for s in changed:
                    if self._lens[0][s] >= 0:
                        self._failed[s] = str(e)
            raise

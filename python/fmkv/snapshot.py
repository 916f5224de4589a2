"""Snapshots: sequences of a compressed cache saved to a versioned, checksummed, memory-mappable file (or to
bytes) and restored into a cache -- prompt and prefix caching across processes. The file is
docs/FILE-FORMAT.md's; the C API is include/fmkv/io.h, which every number and check here goes through.

    cache.save(path, [s])                # fmkv.Cache or fmkv.torch_ops.TorchCache: every cached token of s
    cache.save(path, [s], num_tokens=n)  # a prefix of n tokens
    s2 = cache.restore(path)             # a new sequence, in a cache of the same config and layer count
    c = fmkv.Cache.from_snapshot(path)   # a new host cache holding every sequence of the file (TorchCache too)
    snap = fmkv.Snapshot.load(path)      # the file's config, sequences and layers (numpy views)

A file is checked whole (magic, versions, checksums, sizes, geometry, block tables) before anything is
used, and a restore checks the snapshot's config (every field, seed included) and layer count against the
cache before it changes anything. ``allow_dequantized``: a prefix that ends inside the fp16 window keeps
window tokens that were already compressed; the file then restores them from their codes (flagged per
sequence as ``dequantized_tokens``), which saving refuses unless allowed (FILE-FORMAT.md, "prefixes and the
fp16 window").
"""
from __future__ import annotations

import os
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from . import _args, _fmkv

__all__ = ["Snapshot", "SnapshotSequence", "FILE_VERSION"]

FILE_VERSION = _fmkv.FILE_VERSION  # the snapshot container's version (docs/FILE-FORMAT.md)


class SnapshotSequence(NamedTuple):
    num_tokens: int           # tokens of the sequence
    slot: int                 # its fp16 region slot in the snapshot's layers
    dequantized_tokens: int   # window tokens restored from codes (0: exact)
    block_table: List[int]    # its pages in the snapshot's layers


def source_of(source: Any) -> Tuple[str, Any]:
    """("path", str) for a path-like, ("bytes", bytes) for a bytes-like object; FmkvTypeError otherwise."""
    if isinstance(source, (str, os.PathLike)):
        return "path", os.fspath(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "bytes", bytes(source)
    raise _args.type_error("source", "a path (str, os.PathLike) or bytes-like snapshot", source)


def path_of(path: Any) -> str:
    """A save target: a path-like as str; FmkvTypeError otherwise."""
    if not isinstance(path, (str, os.PathLike)):
        raise _args.type_error("path", "a path (str or os.PathLike)", path)
    return os.fspath(path)


def filled_from(source: Any, make: Any, extra_pages: int, extra_seqs: int) -> Any:
    """A new cache ``make(config, num_layers, num_pages, max_seqs)`` holding every sequence of the snapshot ``source``
    (ids 0, 1, ... in file order), with ``extra_pages`` free pages per layer and ``extra_seqs`` free slots."""
    _, src = source_of(source)
    snap = Snapshot.load(src)
    pages = sum(len(q.block_table) for q in snap.sequences) + _args.integer("extra_pages", extra_pages, 0,
                                                                           _args.INT32_MAX)
    cache = make(snap.config, snap.num_layers, pages,
                 snap.num_seqs + _args.integer("extra_seqs", extra_seqs, 0, _args.INT32_MAX))
    for i in range(snap.num_seqs):
        cache.restore(src, i)
    return cache


def seq_list(seqs: Any) -> List[int]:
    """One sequence id or a sequence of them, as a non-empty list of ints."""
    if isinstance(seqs, (int, np.integer)) and not isinstance(seqs, bool):
        items = [seqs]
    elif isinstance(seqs, (list, tuple, range, np.ndarray)):
        items = list(seqs)
    else:
        raise _args.type_error("seqs", "a sequence id or a list of them", seqs)
    if not items:
        raise _args.error("save: no sequence given")
    return [_args.index("seq", s, "sequence") for s in items]


class Snapshot:
    """A loaded, validated snapshot. ``load`` maps a file (``mmap=True``, zero copy, copy-on-write) or reads
    bytes; ``expect_config`` / ``expect_num_layers`` refuse a file of another geometry with an error naming the
    fields that differ; ``reject_dequantized`` refuses one whose window holds tokens restored from codes."""

    def __init__(self, raw: Any):
        self._raw = raw

    @classmethod
    def load(cls, source: Any, mmap: bool = True, expect_config: Any = None, expect_num_layers: int = 0,
             reject_dequantized: bool = False) -> "Snapshot":
        from . import Config

        if expect_config is not None and not isinstance(expect_config, Config):
            raise _args.type_error("expect_config", "an fmkv.Config or None", expect_config)
        raw_cfg = expect_config._raw() if expect_config is not None else None
        layers = _args.integer("expect_num_layers", expect_num_layers, 0, _args.INT32_MAX)
        kind, src = source_of(source)
        if kind == "path":
            return cls(_fmkv.snapshot_load_file(src, bool(mmap), raw_cfg, layers, bool(reject_dequantized)))
        return cls(_fmkv.snapshot_load_bytes(src, raw_cfg, layers, bool(reject_dequantized)))

    @property
    def config(self):
        """The cache's fmkv.Config (format version and scale group as the file records them)."""
        from . import Config

        return Config._from_raw(self._raw.raw_config)

    @property
    def num_layers(self) -> int:
        return self._raw.num_layers

    @property
    def num_seqs(self) -> int:
        return self._raw.num_seqs

    @property
    def file_pages(self) -> int:
        """Pages per layer stored in the file."""
        return self._raw.file_pages

    @property
    def mapped(self) -> bool:
        """True when the layers are a zero-copy mapping of the file."""
        return self._raw.mapped

    @property
    def file_version(self) -> int:
        return self._raw.file_version

    @property
    def format_version(self) -> int:
        """The cache format's version (a version-1 file loads as 2)."""
        return self._raw.format_version

    @property
    def has_dequantized(self) -> bool:
        """Some sequence's window holds tokens restored from codes."""
        return self._raw.has_dequantized

    def sequence(self, i: int) -> SnapshotSequence:
        return SnapshotSequence(*self._raw.sequence(_args.integer("i", i)))

    @property
    def sequences(self) -> List[SnapshotSequence]:
        return [self.sequence(i) for i in range(self.num_seqs)]

    def layer(self, i: int) -> Tuple[int, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
        """(rotation layer, pages uint8 [file pages, page_bytes], fp16_k / fp16_v float16 [num_seqs, num_kv_heads,
        sink + window, head_dim] or None without fp16 tokens): read-only views that keep the snapshot alive."""
        rl, pages, fk, fv = self._raw.layer(_args.integer("i", i))
        for a in (pages, fk, fv):
            if a is not None:
                a.flags.writeable = False
        return rl, pages, fk, fv

    def __repr__(self) -> str:
        return (f"fmkv.Snapshot(num_layers={self.num_layers}, sequences={[s.num_tokens for s in self.sequences]}, "
                f"mapped={self.mapped}, config={self.config!r})")


def save_arrays(path: Optional[str], config: Any, layers: Sequence[tuple], seqs: Sequence[tuple],
                allow_dequantized: bool) -> Optional[bytes]:
    """Save host arrays (what a device cache stages its pages in): layers [(rotation layer, pages uint8 [n,
    page_bytes], fp16_k, fp16_v float16 [slots, heads, sink + window, head_dim] or None)], seqs [(slot, per-layer
    lengths, num_tokens (-1: all), block table)]; to ``path`` (atomically) or to bytes when path is None."""
    dense = [(rl, np.ascontiguousarray(p), None if fk is None else np.ascontiguousarray(fk),
              None if fv is None else np.ascontiguousarray(fv)) for rl, p, fk, fv in layers]
    return _fmkv.snapshot_save_arrays(path, config._raw(), dense, list(seqs), bool(allow_dequantized))

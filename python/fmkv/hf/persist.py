"""Saving an :class:`FmkvCache` or :class:`FmkvStaticCache` to a directory and loading it back (prompt caching
across processes).

    cache.save("prompt_cache")                                  # after a prefill (or any step)
    cache = fmkv.hf.FmkvCache.load("prompt_cache", model.config)  # the same options, the same tokens
    out = model.generate(more_ids, **fmkv.hf.cache_kwargs(cache), max_new_tokens=32)

A static cache saves each sequence's own length (left-padded prompts hold different counts), the timeline
(``cumulative_length``), the batch size and dtype it was allocated with; ``FmkvStaticCache.load`` allocates a cache
of that batch size at once and fills it in place, so a compiled or captured step can be made on it as on a fresh one.

The directory holds ``fmkv_cache.json`` (the cache's options, the model geometry, each fmkv layer's length, batch,
dtype and storage device) and one snapshot file per fmkv layer, width groups included (``layer_NNN.fmkv``, the
format of docs/FILE-FORMAT.md: each batch row is a sequence; a layer's config, its seed included, is checked when it
is loaded), plus ``layer_NNN.key_mu.pt`` for ``key_offset`` caches (the keys' means, which the snapshot format does
not hold) and ``sliding_NNN.pt`` for transformers' fp16 sliding-window layers (their window of K/V). It is written into a temporary directory renamed over the target when complete. Loading builds a new
cache with the saved options (``device=`` overrides where the storage goes) and restores every layer before it
returns; a directory of another model geometry, or a damaged file, raises ``fmkv.FmkvError`` naming it.

A fused step's kept K/V is appended before the save (``check``). A directory is loaded by the class that saved it
(the manifest's ``kind``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict, List

import numpy as np
import torch

import fmkv
from fmkv.snapshot import Snapshot, save_arrays

MANIFEST = "fmkv_cache.json"
KIND = "fmkv.hf.FmkvCache"
STATIC_KIND = "fmkv.hf.FmkvStaticCache"
VERSION = 1


def _kind(cls: Any) -> str:
    from .static_cache import FmkvStaticCache

    return STATIC_KIND if issubclass(cls, FmkvStaticCache) else KIND


def _layer_file(k: int) -> str:
    return f"layer_{k:03d}.fmkv"


def save_cache(cache: Any, path: Any) -> None:
    """Write ``cache`` (an FmkvCache or FmkvStaticCache) to the directory ``path`` (created; an existing one is
    replaced whole)."""
    from .cache import FmkvHeadGroupLayer, FmkvLayer
    from .static_cache import FmkvStaticHeadGroupLayer, FmkvStaticLayer

    path = os.fspath(path)
    kind = _kind(type(cache))
    static = kind == STATIC_KIND
    own = (FmkvLayer, FmkvHeadGroupLayer, FmkvStaticLayer, FmkvStaticHeadGroupLayer)
    cache.check()  # appends a kept fused-step chunk; on CUDA raises a pending device error instead of saving it
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise fmkv.FmkvError(f"FmkvCache.save: the directory {parent!r} does not exist")
    tmp = tempfile.mkdtemp(prefix=".fmkv_cache.", dir=parent)
    try:
        entries = []
        for k, layer in enumerate(cache.fmkv_layers):
            e: Dict[str, Any] = dict(layer_idx=layer.layer_idx, k_bits=layer.k_bits, v_bits=layer.v_bits,
                                     initialized=layer.pages is not None)
            if layer.pages is not None:
                e.update(file=_layer_file(k), dtype=str(layer.dtype).replace("torch.", ""),
                         kv_heads=layer.config.num_kv_heads, head_dim=layer.config.head_dim)
                if static:  # each sequence's own length, the timeline, which sequences have their key offset
                    lengths = layer.lengths()
                    e.update(lengths=lengths, batch=len(lengths), storage=layer.device.type,
                             timeline=int(layer.cumulative_length), filled=bool(layer.filled),
                             mu_set=[bool(x) for x in layer._mu_set])
                else:
                    lengths = [int(layer.length)] * int(layer.batch)
                    e.update(length=int(layer.length), batch=int(layer.batch), storage=layer.storage_device.type)
                _save_layer(layer, os.path.join(tmp, e["file"]), lengths)
                if layer.key_mu is not None:
                    e["key_mu"] = f"layer_{k:03d}.key_mu.pt"
                    torch.save(layer.key_mu.detach().cpu(), os.path.join(tmp, e["key_mu"]))
            entries.append(e)
        sliding = []  # transformers' fp16 sliding-window layers: their window of K/V as tensors
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, own):
                continue
            e = dict(layer_idx=i, initialized=bool(getattr(layer, "is_initialized", False)))
            if e["initialized"]:
                e.update(file=f"sliding_{i:03d}.pt", length=int(layer.cumulative_length), storage=layer.keys.device.type)
                if hasattr(layer, "cumulative_length_int"):  # transformers' static sliding layer's host copy
                    e["length_int"] = int(layer.cumulative_length_int)
                torch.save(dict(keys=layer.keys.detach().cpu(), values=layer.values.detach().cpu()),
                           os.path.join(tmp, e["file"]))
            sliding.append(e)
        manifest = dict(kind=kind, version=VERSION, fmkv_version=fmkv.__version__, max_cache_len=cache.max_cache_len,
                        num_layers=len(cache.layers), model=cache.geometry, options=saved_options(cache),
                        fmkv_layers=entries, sliding_layers=sliding)
        if static:  # what the loaded cache is allocated with at once
            first = next((e for e in entries if e["initialized"]), None)
            manifest["allocation"] = None if first is None else dict(batch=first["batch"], dtype=_model_dtype(cache),
                                                                      storage=first["storage"])
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.lexists(path):
            if not os.path.isdir(path) or not os.path.exists(os.path.join(path, MANIFEST)):
                raise fmkv.FmkvError(f"FmkvCache.save: {path!r} exists and is not a saved FmkvCache (not replaced)")
            old = path + ".old." + os.path.basename(tmp)
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def saved_options(cache: Any) -> Dict[str, Any]:
    """The constructor options that rebuild ``cache``: its widths as ``layer_bits`` (one pair per layer) unless it has
    ``head_bits``, so that the boundary-layer options need not be repeated."""
    opts = dict(cache.options)
    if opts.get("head_bits") is None:
        opts.update(layer_bits=[list(w) for w in cache.layer_widths], boundary_layers=0)
    return opts


def _model_dtype(cache: Any) -> str:
    """The dtype of the K/V the cache was given (its sliding-window layers' dtype)."""
    layer = next(layer for layer in cache.fmkv_layers if layer.pages is not None)
    return str(layer.dtype).replace("torch.", "")


def _save_layer(layer: Any, file: str, lengths: List[int]) -> None:
    """One fmkv layer's batch rows (row r holding lengths[r] tokens in its pages [r * pages_per_seq, ...)) as the
    sequences of one snapshot (their pages gathered into host memory)."""
    c = layer.config
    fp16 = c.sink_tokens + c.window_tokens > 0
    counts = [-(-max(0, n - c.sink_tokens - c.window_tokens) // c.page_size) for n in lengths]  # pages each row holds
    pool = layer.pages.view(len(lengths), layer.pages_per_seq, -1)
    pages = torch.cat([pool[r, :counts[r]] for r in range(len(lengths))])
    arrays = [(0, pages.cpu().numpy(), layer.fp16_k.cpu().numpy() if fp16 else None,
               layer.fp16_v.cpu().numpy() if fp16 else None)]
    starts = np.cumsum([0] + counts)
    seqs = [(r, [int(n)], -1, list(range(int(starts[r]), int(starts[r + 1])))) for r, n in enumerate(lengths)]
    save_arrays(file, c, arrays, seqs, False)


def load_cache(cls: Any, path: Any, config: Any, device: Any = None, set_attention: bool = True) -> Any:
    """A new ``cls`` (FmkvCache or FmkvStaticCache, the class that saved ``path``) for the model ``config`` with the
    options and tokens saved in ``path``."""
    path = os.fspath(path)
    mf = os.path.join(path, MANIFEST)
    try:
        with open(mf) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise fmkv.FmkvError(f"{cls.__name__}.load: {mf!r} not found (not a directory written by "
                             f"{cls.__name__}.save)") from None
    except (OSError, ValueError) as e:
        raise fmkv.FmkvError(f"{cls.__name__}.load: {mf!r} cannot be read ({e})") from None
    kind = _kind(cls)
    if isinstance(m, dict) and m.get("kind") in (KIND, STATIC_KIND) and m.get("kind") != kind:
        raise fmkv.FmkvError(f"{cls.__name__}.load: {path!r} holds a saved {m['kind']} (load it with that class)")
    if not isinstance(m, dict) or m.get("kind") != kind or m.get("version") != VERSION:
        raise fmkv.FmkvError(f"{cls.__name__}.load: {mf!r} is not a version-{VERSION} {kind} manifest")
    opts = dict(m["options"])
    static = kind == STATIC_KIND
    alloc = m.get("allocation") if static else None
    if static and alloc is not None:  # allocated at once, with the saved batch size and dtype
        opts.update(batch_size=alloc["batch"], dtype=getattr(torch, alloc["dtype"]),
                    device=_storage_device(device, alloc["storage"], cls.__name__))
    elif device is not None and not static:
        opts["device"] = str(device)
    from .compat import layer_types, text_config

    n = len(layer_types(text_config(config)))
    if n != m["num_layers"]:
        raise fmkv.FmkvError(f"{cls.__name__}.load: the model has {n} layers, the saved cache {m['num_layers']}")
    try:
        cache = cls(config, max_cache_len=m["max_cache_len"], set_attention=set_attention, **opts)
    except ValueError as e:  # FmkvError included
        raise fmkv.FmkvError(f"{cls.__name__}.load: the saved options do not fit this model ({e})") from None
    for key, want in m["model"].items():
        if cache.geometry.get(key) != want:
            raise fmkv.FmkvError(f"{cls.__name__}.load: the model has {key} = {cache.geometry.get(key)}, the saved cache "
                                 f"{want}")
    if len(cache.layers) != m["num_layers"] or len(cache.fmkv_layers) != len(m["fmkv_layers"]):
        raise fmkv.FmkvError(f"{cls.__name__}.load: the model has {len(cache.layers)} layers ({len(cache.fmkv_layers)} fmkv "
                             f"layers), the saved cache {m['num_layers']} ({len(m['fmkv_layers'])})")
    for layer, e in zip(cache.fmkv_layers, m["fmkv_layers"]):
        if (layer.layer_idx, layer.k_bits, layer.v_bits) != (e["layer_idx"], e["k_bits"], e["v_bits"]):
            raise fmkv.FmkvError(f"{cls.__name__}.load: fmkv layer {layer.layer_idx} k{layer.k_bits}v{layer.v_bits} does not "
                                 f"match the saved layer {e['layer_idx']} k{e['k_bits']}v{e['v_bits']}")
        if e["initialized"] and static:
            _load_static_layer(layer, path, e)
        elif e["initialized"]:
            _load_layer(layer, path, e, device)
    from .cache import FmkvHeadGroupLayer, FmkvLayer
    from .static_cache import FmkvStaticHeadGroupLayer, FmkvStaticLayer

    own = (FmkvLayer, FmkvHeadGroupLayer, FmkvStaticLayer, FmkvStaticHeadGroupLayer)
    plain = [(i, layer) for i, layer in enumerate(cache.layers) if not isinstance(layer, own)]
    if [i for i, _ in plain] != [e["layer_idx"] for e in m["sliding_layers"]]:
        raise fmkv.FmkvError(f"{cls.__name__}.load: the model's sliding-window layers are not the saved cache's")
    for (i, layer), e in zip(plain, m["sliding_layers"]):
        if e["initialized"]:
            kv = torch.load(os.path.join(path, e["file"]), map_location="cpu")
            if static:  # allocated at construction: filled in place (its tensors' addresses stay)
                if tuple(layer.keys.shape) != tuple(kv["keys"].shape):
                    raise fmkv.FmkvError(f"{cls.__name__}.load: sliding layer {i} holds {tuple(kv['keys'].shape)} "
                                         f"K, the cache allocates {tuple(layer.keys.shape)}")
                layer.keys.copy_(kv["keys"])
                layer.values.copy_(kv["values"])
                layer.cumulative_length.fill_(int(e["length"]))
                if hasattr(layer, "cumulative_length_int"):
                    layer.cumulative_length_int = int(e.get("length_int", e["length"]))
                continue
            dev = _storage_device(device, e["storage"], cls.__name__)
            layer.lazy_initialization(kv["keys"].to(dev), kv["values"].to(dev))
            layer.keys, layer.values = kv["keys"].to(dev), kv["values"].to(dev)
            layer.cumulative_length = int(e["length"])
    for layer in cache.layers:  # width-group layers are initialised once their groups are
        parts = getattr(layer, "layers", None)
        if parts and all(p.pages is not None for p in parts):
            layer.is_initialized = True
    return cache


def _copy_row(layer: Any, r: int, q: Any, pages: np.ndarray, fk: Any, fv: Any) -> None:
    """Snapshot sequence q's pages into batch row r's page range of ``layer`` (its first pages_per_seq pages from
    r * pages_per_seq), and its fp16 regions when the snapshot has them."""
    if q.block_table:
        pps = layer.pages_per_seq
        src = torch.from_numpy(pages[np.asarray(q.block_table, dtype=np.int64)])
        layer.pages[r * pps:r * pps + len(q.block_table)].copy_(src)
    if fk is not None:
        layer.fp16_k[r].copy_(torch.from_numpy(fk[q.slot].copy()))
        layer.fp16_v[r].copy_(torch.from_numpy(fv[q.slot].copy()))


def _load_static_layer(layer: Any, path: str, e: Dict[str, Any]) -> None:
    """One FmkvStaticLayer (allocated at construction) filled in place from its snapshot: each sequence's pages
    into its own page range, fp16 regions, lengths, the timeline, the key offsets."""
    name = type(layer).__name__
    snap = Snapshot.load(os.path.join(path, e["file"]), expect_config=layer.config, expect_num_layers=1)
    lengths = [int(x) for x in e["lengths"]]
    b, pps = layer.batch_size, layer.pages_per_seq
    if snap.num_seqs != b or len(lengths) != b:
        raise fmkv.FmkvError(f"FmkvStaticCache.load: {e['file']} holds {snap.num_seqs} sequences for a batch of {b}")
    _, pages, fk, fv = snap.layer(0)
    c = layer.config
    if c.sink_tokens + c.window_tokens == 0 and fk is not None:
        raise fmkv.FmkvError(f"FmkvStaticCache.load: {e['file']} has fp16 regions the layer's config does not")
    for r in range(b):
        q = snap.sequence(r)
        if q.num_tokens != lengths[r] or len(q.block_table) > pps or lengths[r] > layer.max_cache_len:
            raise fmkv.FmkvError(f"FmkvStaticCache.load: {e['file']} sequence {r} holds {q.num_tokens} tokens in "
                                 f"{len(q.block_table)} pages (expected {lengths[r]} in at most {pps}; {name} "
                                 f"max_cache_len {layer.max_cache_len})")
    for r in range(b):  # every check passed: nothing is written before
        _copy_row(layer, r, snap.sequence(r), pages, fk, fv)
    layer.lens.copy_(torch.tensor(lengths, dtype=layer.lens.dtype))
    layer.cumulative_length.fill_(int(e["timeline"]))
    layer.filled = bool(e["filled"])
    if layer.key_offset:
        if not e.get("key_mu") and any(e["mu_set"]):
            raise fmkv.FmkvError(f"FmkvStaticCache.load: fmkv layer {layer.layer_idx} uses key_offset but its key means "
                                 f"were not saved")
        if e.get("key_mu"):
            layer.key_mu.copy_(torch.load(os.path.join(path, e["key_mu"]), map_location="cpu"))
        layer._mu_set = [bool(x) for x in e["mu_set"]]


def _storage_device(device: Any, saved: str, who: str = "FmkvCache") -> "torch.device":
    """``device`` if given, else where the layer was saved from (CUDA: the current device); ``who`` loads."""
    if device is not None:
        return torch.device(device)
    if saved == "cuda":
        if not torch.cuda.is_available():
            raise fmkv.FmkvError(f"{who}.load: the cache was saved from CUDA storage and torch sees no CUDA device "
                                 "(pass device='cpu' to load it into host memory)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load_layer(layer: Any, path: str, e: Dict[str, Any], device: Any) -> None:
    dtype = getattr(torch, e["dtype"])
    dev = _storage_device(device, e["storage"])
    b, h, d = e["batch"], e["kv_heads"], e["head_dim"]
    empty = torch.empty(b, h, 0, d, dtype=dtype, device=dev)
    layer.lazy_initialization(empty, empty)  # allocates the pools and fixes the config for this geometry
    snap = Snapshot.load(os.path.join(path, e["file"]), expect_config=layer.config, expect_num_layers=1)
    if snap.num_seqs != b:
        raise fmkv.FmkvError(f"FmkvCache.load: {e['file']} holds {snap.num_seqs} sequences for a batch of {b}")
    c = layer.config
    _, pages, fk, fv = snap.layer(0)
    pps = layer.pages_per_seq
    for r in range(b):
        q = snap.sequence(r)
        if q.num_tokens != e["length"] or len(q.block_table) > pps:
            raise fmkv.FmkvError(f"FmkvCache.load: {e['file']} sequence {r} holds {q.num_tokens} tokens in "
                                 f"{len(q.block_table)} pages (expected {e['length']} in at most {pps})")
        _copy_row(layer, r, q, pages, fk, fv)
    if c.sink_tokens + c.window_tokens == 0 and fk is not None:
        raise fmkv.FmkvError(f"FmkvCache.load: {e['file']} has fp16 regions the layer's config does not")
    layer.lens.fill_(e["length"])
    layer.length = int(e["length"])
    if e.get("key_mu"):
        layer.key_mu = torch.load(os.path.join(path, e["key_mu"]), map_location=layer.storage_device).to(dtype)
    elif layer.key_offset and layer.length > 0:
        raise fmkv.FmkvError(f"FmkvCache.load: fmkv layer {layer.layer_idx} uses key_offset but its key means were not "
                             f"saved")

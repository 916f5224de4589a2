"""torch.library custom ops over fmkv: ``torch.ops.fmkv.append``, ``torch.ops.fmkv.attention`` (and
``torch.ops.fmkv.attention_lse``: the same output and each row's softmax log-denominator) and the
fused decode step ``torch.ops.fmkv.append_attention`` (append the new tokens' K/V and attend their
queries in one call; on CUDA one attention launch instead of an append and an attention).

The cache state of one layer lives in caller-owned torch tensors, so the ops are visible to
torch.compile / AOT autograd (``append`` declares its in-place writes; both have fake (meta)
implementations that only compute output metadata):

* ``pages``  uint8, ``num_pages * config.page_bytes`` bytes (e.g. shape [num_pages, page_bytes]);
* ``fp16_k`` / ``fp16_v`` float16, ``[num_slots, num_kv_heads, sink + window, head_dim]`` (may be
  empty when sink_tokens + window_tokens == 0);
* a batch of sequences: ``slots`` int32 [n], ``seq_lens`` int64 [n], ``row_offsets`` int64 [n+1],
  ``block_table`` int32 [n, stride] (see include/fmkv/params.h, fmkv_batch);
* ``config``: :func:`config_to_list` of an :class:`fmkv.Config` (its ``CONFIG_INTS`` = 11 ints, the scale group
  last: a scale group the backend does not have is refused by name, nothing written; every backend has 32 and 64).

**Devices.** All tensors of one call live on one device, and the backend follows it: CPU tensors
run on the host backend (``'cpu'`` when compiled, else ``'ref'``), CUDA tensors on the ``'cuda'``
backend, directly on device memory (no copy). ``backend=""`` picks it from the device; a backend
that does not match the device (``'cpu'`` with CUDA tensors, ``'cuda'`` with CPU tensors) raises
:class:`fmkv.FmkvError` naming the tensor and its device, as does a CUDA tensor when the extension
was built without CUDA (``fmkv.backends()['cuda']``; build with
``pip install . -C cmake.define.FMKV_CUDA=ON``, see python/README.md).

**CUDA semantics.** The ops are enqueued on the current torch stream of the tensors' device and
never synchronise with the host: no ``.item()``, no host copies, and the only allocations are the
output and a workspace from torch's caching allocator, so ``attention`` (and ``append``) can be
captured in a ``torch.cuda.CUDAGraph`` (run each op once before capturing: the first CUDA call of a
process allocates fmkv's device error word). Errors that only the device can see -- a block-table
entry outside the page pool, a slot or length out of range, NaN/Inf in K/V/Q -- are recorded by the
kernels in a device error word (the failed op leaves the visible cache unchanged -- an append or a fused step may have
written the token slots it was filling, past the sequence's length -- and later fmkv CUDA ops are skipped)
and raised by :func:`cuda_check` (``fmkv.synchronize('cuda')``), which waits for the device.
Shape, dtype and device errors are raised by the op itself.

**Output precision.** The output has q's dtype. With float16 it is +-inf where the exact value
exceeds the fp16 range (|x| > 65504), as for any float16 torch op: that happens only when the
cached V holds values near +-65504 (the decompression can push them past it). Checking would cost a
device synchronisation, so the ops do not; :class:`fmkv.Cache` (host memory) refuses such an output.

**Raw bookkeeping.** The ops trust ``seq_lens``, ``slots`` and the block table: they are the
caller's. A length beyond the tokens actually written reads whatever the pages hold (host backends
check every block-table entry and slot against the storage; CUDA records such errors for
:func:`cuda_check`). :class:`TorchCache` keeps these arrays consistent itself.

:class:`TorchCache` (``fmkv.torch_cache``, importable from here as ``fmkv.torch_ops.TorchCache``)
manages those tensors (page allocation, block tables, lengths) for ``num_layers`` layers, like
:class:`fmkv.Cache` but with torch-owned storage on a CPU or CUDA device.

Importing this module registers the ops (it needs torch; fmkv itself does not).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

try:
    import torch
    from torch import Tensor
except ImportError as _e:  # pragma: no cover
    raise ImportError("fmkv.torch_ops needs PyTorch (pip install torch); the rest of fmkv does not") from _e

from . import Config, FmkvError, _args, _fmkv, default_backend

__all__ = ["append", "attention", "append_attention", "FUSED_MAX_ROWS", "config_to_list", "CONFIG_INTS", "TorchCache", "backend_for_device", "cuda_check",
           "attention_workspace_bytes"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCALE = {"lsq": _fmkv.SCALE_LSQ, "rms": _fmkv.SCALE_RMS}
_HOST_BACKENDS = ("ref", "cpu")
_AVAILABLE: Dict[str, bool] = {}
_RAW_CONFIGS: Dict[tuple, "_fmkv.RawConfig"] = {}
_to_dlpack = torch.utils.dlpack.to_dlpack
_increment_version = torch.autograd.graph.increment_version
# Length of config_to_list's list: head_dim, num_kv_heads, k_bits, v_bits, page_size, sink_tokens, window_tokens,
# scale_rule, seed, format_version, scale_group.
CONFIG_INTS = 11


def config_to_list(config: Config) -> List[int]:
    """The 11 ints the ops take for a Config (the uint64 seed as a signed int64, then the format version and the
    scale group)."""
    seed = config.seed - 2**64 if config.seed >= 2**63 else config.seed
    return [config.head_dim, config.num_kv_heads, config.k_bits, config.v_bits, config.page_size,
            config.sink_tokens, config.window_tokens, _SCALE[config.scale_rule], seed, config.format_version,
            config.scale_group]


def _raw_config(cfg: List[int]) -> "_fmkv.RawConfig":
    """The validated RawConfig of the 11 ints (cached: a decode step passes the same list every call)."""
    key = tuple(cfg)
    c = _RAW_CONFIGS.get(key)
    if c is None:
        if len(_RAW_CONFIGS) >= 4096:  # bounded: a caller cycling through many configs (seeds) does not grow it
            _RAW_CONFIGS.clear()
        c = _RAW_CONFIGS[key] = _make_raw_config(cfg)
    return c


def _make_raw_config(cfg: List[int]) -> "_fmkv.RawConfig":
    if len(cfg) != CONFIG_INTS:
        raise FmkvError(f"config: expected the {CONFIG_INTS} ints of fmkv.torch_ops.config_to_list, got {len(cfg)}")
    c = _fmkv.RawConfig()
    (c.head_dim, c.num_kv_heads, c.k_bits, c.v_bits, c.page_size, c.sink_tokens, c.window_tokens,
     c.scale_rule) = (int(x) for x in cfg[:8])
    c.seed = int(cfg[8]) % 2**64
    c.format_version = int(cfg[9])
    c.scale_group = int(cfg[10])
    _fmkv.config_validate(c)
    return c


def _available(backend: str) -> bool:
    if backend not in _AVAILABLE:
        _AVAILABLE[backend] = bool(_fmkv.backend_available(backend))
    return _AVAILABLE[backend]


def backend_for_device(device, backend: Optional[str] = None, what: str = "fmkv") -> str:
    """The fmkv backend for tensors on ``device``: the given one after checking it matches the
    device, else 'cuda' for CUDA devices and the default host backend for the CPU."""
    dev = torch.device(device)
    if backend:
        if backend in _HOST_BACKENDS and dev.type != "cpu":
            raise FmkvError(f"{what}: backend {backend!r} works on CPU tensors, but the tensors are on '{dev}' "
                            f"(use backend 'cuda' or leave it empty; fmkv never copies between devices)")
        if backend == "cuda" and dev.type != "cuda":
            raise FmkvError(f"{what}: backend 'cuda' works on CUDA tensors, but the tensors are on '{dev}' "
                            f"(move them to the GPU, or use a host backend)")
        if backend not in _HOST_BACKENDS and backend != "cuda":
            raise FmkvError(f"{what}: backend {backend!r} is not available for torch tensors (use 'ref', 'cpu' or 'cuda')")
        if not _available(backend):
            raise FmkvError(f"{what}: backend {backend!r} is not compiled into this build or has no usable device"
                            + (" (build the extension with CUDA: pip install . -C cmake.define.FMKV_CUDA=ON)"
                               if backend == "cuda" else ""))
        return backend
    if dev.type == "cpu":
        return default_backend()
    if dev.type == "cuda":
        if not _available("cuda"):
            info = _fmkv.backends()["cuda"]
            raise FmkvError(f"{what}: tensors are on '{dev}' but this fmkv build has no usable 'cuda' backend "
                            f"(fmkv.backends()['cuda'] = {info}); build the extension with CUDA "
                            f"(pip install . -C cmake.define.FMKV_CUDA=ON, see python/README.md) or use CPU tensors")
        return "cuda"
    raise FmkvError(f"{what}: tensors on device '{dev}' are not supported (CPU or CUDA)")


def _check_device(op: str, fake: bool, **tensors: Tensor) -> torch.device:
    """All tensors are torch tensors on one device; returns it."""
    dev, first = None, None
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise _args.type_error(f"fmkv::{op}: {name}", "a torch.Tensor", t)
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            raise FmkvError(f"fmkv::{op}: {name} is on device '{t.device}' but {first} is on '{dev}'; all tensors "
                            f"of one call must be on the same device (fmkv never copies between devices)")
    if not fake and dev.type not in ("cpu", "cuda"):
        raise FmkvError(f"fmkv::{op}: tensors on device '{dev}' are not supported (CPU or CUDA)")
    return dev


def _check_float(op: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in _FLOAT_DTYPES:
            raise FmkvError(f"fmkv::{op}: {name}: dtype {t.dtype} is not supported (expected float32, float16 or bfloat16)")
        if t.dim() != 3:
            raise FmkvError(f"fmkv::{op}: {name}: expected a 3-D tensor [tokens, heads, head_dim], got shape {tuple(t.shape)}")


def _on_device(dev: torch.device):
    """Make ``dev`` the current CUDA device for the call (fmkv's CUDA backend works on the current
    device; torch exports DLPack only from it)."""
    if dev.index is None or dev.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(dev)


def _dl(t: Tensor):
    """A DLPack capsule of a CUDA tensor without any stream synchronisation: the op is ordered on the
    current stream itself, and a cross-stream wait would break graph capture. ``to_dlpack`` exports
    without a stream handshake (as ``__dlpack__(stream=-1)`` does) at ~1/7 of its Python cost."""
    return _to_dlpack(t)


def _written(*tensors: Tensor) -> None:
    """Bump the version counters of the tensors an op wrote in place, as the dispatcher does for aten's
    in-place ops (autograd's check that a tensor saved for backward was not modified relies on it)."""
    for t in tensors:
        _increment_version(t)


def _dense_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def attention_workspace_bytes(config: Config, q_heads: int, max_rows: int, num_seqs: int, backend: str = "cuda") -> int:
    """Bytes of the workspace ``fmkv_attention`` needs on ``backend`` (0 for host backends)."""
    if not isinstance(config, Config):
        raise _args.type_error("config", "an fmkv.Config", config)
    return int(_fmkv.attention_workspace_bytes(_args.string("backend", backend), config._raw(),
                                               _args.integer("q_heads", q_heads), _args.integer("max_rows", max_rows),
                                               _args.integer("num_seqs", num_seqs), 0))


def cuda_check(device=None) -> None:
    """Wait for the CUDA device and raise the first error fmkv's kernels detected there since the
    last check (bad block-table entry, slot, length, NaN/Inf input) as :class:`fmkv.FmkvError`.
    ``device``: a CUDA device (default: the current one)."""
    if device is None:
        _fmkv.synchronize("cuda")
        return
    with torch.cuda.device(torch.device(device)):
        _fmkv.synchronize("cuda")


def _workspace_and_stream(dev: torch.device, backend: str, raw, q: Tensor, slots: Tensor, max_seq_len: int = 0):
    """The attention workspace (from torch's caching allocator, graph-safe) for the call's plan (its
    length bound, 0: none) and the current stream handle of a CUDA call."""
    ws_bytes = _fmkv.attention_workspace_bytes(backend, raw, int(q.shape[1]), int(q.shape[0]), int(slots.shape[0]),
                                               int(max_seq_len))
    ws = torch.empty(max(int(ws_bytes), 1), dtype=torch.uint8, device=dev)
    return _dl(ws), torch.cuda.current_stream(dev).cuda_stream


def _append_impl(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, k: Tensor, v: Tensor, slots: Tensor,
                 seq_lens: Tensor, row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int,
                 backend: str = "") -> None:
    """torch.ops.fmkv.append (see :func:`append`)."""
    dev = _check_device("append", False, pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, slots=slots,
                        seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table)
    _check_float("append", k=k, v=v)
    b = backend_for_device(dev, backend, "fmkv::append")
    raw = _raw_config(config)
    if dev.type != "cuda":
        _fmkv.append_raw(b, raw, layer, pages, fp16_k, fp16_v, slots, seq_lens, row_offsets, block_table,
                         k.detach(), v.detach())
    else:
        with _on_device(dev):
            stream = torch.cuda.current_stream(dev).cuda_stream
            _fmkv.append_raw(b, raw, layer, _dl(pages), _dl(fp16_k), _dl(fp16_v), _dl(slots), _dl(seq_lens),
                             _dl(row_offsets), _dl(block_table), _dl(_dense_last(k.detach())),
                             _dl(_dense_last(v.detach())), stream)
    _written(pages, fp16_k, fp16_v)


def _append_fake(pages, fp16_k, fp16_v, k, v, slots, seq_lens, row_offsets, block_table, config, layer, backend=""):
    _check_device("append", True, pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, slots=slots,
                  seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table)
    _check_float("append", k=k, v=v)
    return None


def _attend(op: str, pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, q: Tensor, slots: Tensor, seq_lens: Tensor,
            row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int, softmax_scale: float,
            softcap: float, backend: str, max_seq_len: int, lse: Optional[Tensor] = None) -> Tensor:
    """The body of torch.ops.fmkv.attention / attention_lse (``op``): the output like q; ``lse`` [rows, q_heads]
    float32, when given, is written too (fmkv_attention_lse)."""
    dev = _check_device(op, False, pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, q=q, slots=slots,
                        seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table)
    _check_float(op, q=q)
    b = backend_for_device(dev, backend, f"fmkv::{op}")
    raw = _raw_config(config)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if dev.type != "cuda":
        _fmkv.attention_raw(b, raw, layer, pages, fp16_k, fp16_v, slots, seq_lens, row_offsets, block_table,
                            q.detach(), out, softmax_scale, softcap, max_seq_len=max_seq_len, lse=lse)
        return out
    with _on_device(dev):
        ws, stream = _workspace_and_stream(dev, b, raw, q, slots, max_seq_len)
        _fmkv.attention_raw(b, raw, layer, _dl(pages), _dl(fp16_k), _dl(fp16_v), _dl(slots), _dl(seq_lens),
                            _dl(row_offsets), _dl(block_table), _dl(_dense_last(q.detach())), _dl(out),
                            softmax_scale, softcap, ws, stream, max_seq_len, None if lse is None else _dl(lse))
    return out


def _attention_impl(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, q: Tensor, slots: Tensor, seq_lens: Tensor,
                    row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int,
                    softmax_scale: float = 0.0, softcap: float = 0.0, backend: str = "",
                    max_seq_len: int = 0) -> Tensor:
    """torch.ops.fmkv.attention (see :func:`attention`)."""
    return _attend("attention", pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                   softmax_scale, softcap, backend, max_seq_len)


def _attention_fake(pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                    softmax_scale=0.0, softcap=0.0, backend="", max_seq_len=0, op="attention"):
    _check_device(op, True, pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, q=q, slots=slots,
                  seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table)
    _check_float(op, q=q)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _attention_lse_impl(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, q: Tensor, slots: Tensor, seq_lens: Tensor,
                        row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int,
                        softmax_scale: float = 0.0, softcap: float = 0.0, backend: str = "",
                        max_seq_len: int = 0) -> Tuple[Tensor, Tensor]:
    """torch.ops.fmkv.attention_lse (see :func:`attention_lse`)."""
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    out = _attend("attention_lse", pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                  softmax_scale, softcap, backend, max_seq_len, lse)
    return out, lse


def _attention_lse_fake(pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                        softmax_scale=0.0, softcap=0.0, backend="", max_seq_len=0):
    out = _attention_fake(pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                          softmax_scale, softcap, backend, max_seq_len, op="attention_lse")
    return out, torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)


def _append_attention_impl(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, k: Tensor, v: Tensor, q: Tensor,
                           slots: Tensor, seq_lens: Tensor, row_offsets: Tensor, block_table: Tensor,
                           config: List[int], layer: int, softmax_scale: float = 0.0, softcap: float = 0.0,
                           backend: str = "", max_seq_len: int = 0) -> Tensor:
    """torch.ops.fmkv.append_attention (see :func:`append_attention`)."""
    dev = _check_device("append_attention", False, pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, q=q,
                        slots=slots, seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table)
    _check_float("append_attention", k=k, v=v, q=q)
    b = backend_for_device(dev, backend, "fmkv::append_attention")
    raw = _raw_config(config)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if dev.type != "cuda":
        _fmkv.append_attention_raw(b, raw, layer, pages, fp16_k, fp16_v, slots, seq_lens, row_offsets, block_table,
                                   k.detach(), v.detach(), q.detach(), out, softmax_scale, softcap,
                                   max_seq_len=max_seq_len)
    else:
        with _on_device(dev):
            ws, stream = _workspace_and_stream(dev, b, raw, q, slots, max_seq_len)
            _fmkv.append_attention_raw(b, raw, layer, _dl(pages), _dl(fp16_k), _dl(fp16_v), _dl(slots),
                                       _dl(seq_lens), _dl(row_offsets), _dl(block_table),
                                       _dl(_dense_last(k.detach())), _dl(_dense_last(v.detach())),
                                       _dl(_dense_last(q.detach())), _dl(out), softmax_scale, softcap, ws, stream,
                                       max_seq_len)
    _written(pages, fp16_k, fp16_v)
    return out


def _append_attention_fake(pages, fp16_k, fp16_v, k, v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                           softmax_scale=0.0, softcap=0.0, backend="", max_seq_len=0):
    _check_device("append_attention", True, pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, q=q, slots=slots,
                  seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table)
    _check_float("append_attention", k=k, v=v, q=q)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# Registration: torch.library.Library define + impl rather than the torch.library.custom_op decorator.
# Same schemas (the arguments an op writes are declared: Tensor(a!)), same fake kernels, but
# custom_op's Python wrapper costs ~110 us per call of an op that mutates arguments and ~20 us of one
# that does not (torch 2.13, the 2-core development machine), against ~8 us for a kernel registered
# here; on the H200 machine the fused decode step's host cost went from 105 to 40 us per call
# (bench/torch_op_bench.py, docs/results/torch_op_overhead.jsonl) for 15-25 us of GPU time.
# One implementation for every device (CompositeExplicitAutograd): the impls pick the backend and
# bump the written tensors' version counters themselves (_written), as custom_op did.
_LIB = torch.library.Library("fmkv", "FRAGMENT")
_OPS = {
    "append": ("append(Tensor(a0!) pages, Tensor(a1!) fp16_k, Tensor(a2!) fp16_v, Tensor k, Tensor v, "
               "Tensor slots, Tensor seq_lens, Tensor row_offsets, Tensor block_table, SymInt[] config, "
               "SymInt layer, str backend=\"\") -> ()", _append_impl, _append_fake),
    "attention": ("attention(Tensor pages, Tensor fp16_k, Tensor fp16_v, Tensor q, Tensor slots, Tensor seq_lens, "
                  "Tensor row_offsets, Tensor block_table, SymInt[] config, SymInt layer, float softmax_scale=0., "
                  "float softcap=0., str backend=\"\", SymInt max_seq_len=0) -> Tensor", _attention_impl, _attention_fake),
    "attention_lse": ("attention_lse(Tensor pages, Tensor fp16_k, Tensor fp16_v, Tensor q, Tensor slots, "
                      "Tensor seq_lens, Tensor row_offsets, Tensor block_table, SymInt[] config, SymInt layer, "
                      "float softmax_scale=0., float softcap=0., str backend=\"\", SymInt max_seq_len=0) "
                      "-> (Tensor, Tensor)", _attention_lse_impl, _attention_lse_fake),
    "append_attention": ("append_attention(Tensor(a0!) pages, Tensor(a1!) fp16_k, Tensor(a2!) fp16_v, Tensor k, "
                         "Tensor v, Tensor q, Tensor slots, Tensor seq_lens, Tensor row_offsets, Tensor block_table, "
                         "SymInt[] config, SymInt layer, float softmax_scale=0., float softcap=0., "
                         "str backend=\"\", SymInt max_seq_len=0) -> Tensor", _append_attention_impl,
                         _append_attention_fake),
}
for _name, (_schema, _impl, _fake) in _OPS.items():
    _LIB.define(_schema)
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fmkv::{_name}", _fake, lib=_LIB)


def _check_call(op: str, tensors: Dict[str, Any], config: Any, layer: Any, backend: Any, softmax_scale: Any = 0.0,
                softcap: Any = 0.0, max_seq_len: Any = 0) -> None:
    """The non-tensor arguments of an op wrapper (torch's schema would reject them with its own error
    types, or convert them silently)."""
    _check_device(op, True, **tensors)
    if not isinstance(config, (list, tuple)) or len(config) != CONFIG_INTS:
        raise _args.type_error(f"fmkv::{op}: config", f"the {CONFIG_INTS} ints of fmkv.torch_ops.config_to_list", config)
    for i, x in enumerate(config):
        _args.integer(f"fmkv::{op}: config[{i}]", x)
    _args.integer(f"fmkv::{op}: layer", layer, 0, _args.INT32_MAX)
    _args.string(f"fmkv::{op}: backend", backend)
    _args.real(f"fmkv::{op}: softmax_scale", softmax_scale)
    _args.real(f"fmkv::{op}: softcap", softcap)
    _args.integer(f"fmkv::{op}: max_seq_len", max_seq_len, 0)


def append(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, k: Tensor, v: Tensor, slots: Tensor, seq_lens: Tensor,
           row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int, backend: str = "") -> None:
    """``torch.ops.fmkv.append``: compress rows of k / v ([rows, num_kv_heads, head_dim]) into one
    layer's pages / fp16 regions, in place. seq_lens: tokens already cached per sequence (not updated
    here). backend "" follows the tensors' device (CPU: host backend, CUDA: 'cuda')."""
    _check_call("append", dict(pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, slots=slots, seq_lens=seq_lens,
                               row_offsets=row_offsets, block_table=block_table), config, layer, backend)
    torch.ops.fmkv.append(pages, fp16_k, fp16_v, k, v, slots, seq_lens, row_offsets, block_table, config, layer,
                          backend)


def attention(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, q: Tensor, slots: Tensor, seq_lens: Tensor,
              row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int, softmax_scale: float = 0.0,
              softcap: float = 0.0, backend: str = "", max_seq_len: int = 0) -> Tensor:
    """``torch.ops.fmkv.attention``: attention of q ([rows, q_heads, head_dim]; causal, the last rows
    of each sequence) over one layer. seq_lens include the query tokens. Returns a new tensor shaped
    and typed like q, on q's device. softmax_scale 0 means 1/sqrt(head_dim). backend "" follows the
    tensors' device. max_seq_len > 0: no sequence is longer (an error otherwise; on CUDA raised by
    :func:`cuda_check`); CUDA plans the call for it (fewer splits at short contexts). 0: no bound.

    The op trusts ``seq_lens`` and the block table (they are the caller's bookkeeping): a length
    beyond the tokens actually written reads whatever those pages hold. On the host backends every
    block-table entry is checked against the pool; :class:`TorchCache` passes lengths it tracks itself."""
    _check_call("attention", dict(pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, q=q, slots=slots, seq_lens=seq_lens,
                                  row_offsets=row_offsets, block_table=block_table), config, layer, backend,
                softmax_scale, softcap, max_seq_len)
    return torch.ops.fmkv.attention(pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config,
                                    layer, softmax_scale, softcap, backend, max_seq_len)


def attention_lse(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, q: Tensor, slots: Tensor, seq_lens: Tensor,
                  row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int, softmax_scale: float = 0.0,
                  softcap: float = 0.0, backend: str = "", max_seq_len: int = 0) -> Tuple[Tensor, Tensor]:
    """``torch.ops.fmkv.attention_lse``: :func:`attention` (the same output, bit for bit) and ``lse``, float32
    [rows, q_heads]: the natural log of each row's softmax denominator, log sum exp of the scaled (and
    softcapped) scores over the tokens the row sees (``fmkv_attention_lse``). Attention over disjoint token sets
    merges from their (out, lse) pairs with weights exp(lse_i - log sum_j exp(lse_j))
    (:func:`fmkv.distributed.merge_partials`)."""
    _check_call("attention_lse", dict(pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, q=q, slots=slots,
                                      seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table),
                config, layer, backend, softmax_scale, softcap, max_seq_len)
    return torch.ops.fmkv.attention_lse(pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config,
                                        layer, softmax_scale, softcap, backend, max_seq_len)


def append_attention(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, k: Tensor, v: Tensor, q: Tensor, slots: Tensor,
                     seq_lens: Tensor, row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int,
                     softmax_scale: float = 0.0, softcap: float = 0.0, backend: str = "",
                     max_seq_len: int = 0) -> Tensor:
    """``torch.ops.fmkv.append_attention``: one decode step -- append the rows of k / v ([rows,
    num_kv_heads, head_dim], at most ``FUSED_MAX_ROWS`` per sequence) and return the attention of q
    ([rows, q_heads, head_dim], one query row per new token, causal) over the cache including them;
    the same as :func:`append` followed by :func:`attention` with seq_lens + rows, in one call (one
    attention launch on CUDA). seq_lens: tokens cached per sequence BEFORE the append (not updated).
    max_seq_len as in :func:`attention`, a bound on the lengths after the append."""
    _check_call("append_attention", dict(pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, q=q, slots=slots,
                                         seq_lens=seq_lens, row_offsets=row_offsets, block_table=block_table),
                config, layer, backend, softmax_scale, softcap, max_seq_len)
    return torch.ops.fmkv.append_attention(pages, fp16_k, fp16_v, k, v, q, slots, seq_lens, row_offsets,
                                           block_table, config, layer, softmax_scale, softcap, backend, max_seq_len)


FUSED_MAX_ROWS = int(_fmkv.FUSED_MAX_ROWS)


def __getattr__(name: str):
    """``fmkv.torch_ops.TorchCache``: the cache class lives in fmkv.torch_cache (imported on first use:
    it imports this module, so a plain import here would be circular)."""
    if name == "TorchCache":
        from .torch_cache import TorchCache
        return TorchCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

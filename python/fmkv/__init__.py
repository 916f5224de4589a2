"""fmkv: compressed LLM KV cache (Hadamard rotation + Lloyd-Max 2/3/4-bit codes in pages) with
attention computed directly on the compressed cache.

Tensors may be numpy arrays or any DLPack-capable CPU tensor (torch tensors included) of dtype
float32, float16 or bfloat16 (:class:`Cache` holds host memory). CUDA tensors go through
``fmkv.torch_ops`` (torch custom ops, ``TorchCache``) and ``fmkv.hf.FmkvCache`` on the 'cuda'
backend; device-detected errors of those surface at :func:`synchronize` / :func:`cuda_check`. Every error raised by the library, or detected here (shape, dtype,
device), is an :class:`FmkvError` (a ``ValueError``) with ``.code`` / ``.status`` set; an argument
of the wrong type (a float or string for an integer, a numpy array for a torch tensor) is an
:class:`FmkvTypeError`, both an FmkvError and a ``TypeError``. Guarantees (all-or-nothing calls,
thread and fork safety): docs/RELIABILITY.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _args, _fmkv
from ._args import UINT64_MAX
from ._fmkv import FmkvError, FmkvTypeError

__all__ = [
    "__version__",
    "FmkvError",
    "FmkvTypeError",
    "Config",
    "Cache",
    "format_version",
    "backends",
    "check_backend",
    "backend_supports",
    "check_attention",
    "attention_supported",
    "default_backend",
    "synchronize",
    "cuda_check",
    "codebook",
    "codebook_levels",
    "bytes_per_token_head",
    "quantize_vector",
    "dequantize_vector",
    "Snapshot",
    "SnapshotSequence",
]

__version__: str = _fmkv.version()

_SCALE_RULES = {"lsq": _fmkv.SCALE_LSQ, "rms": _fmkv.SCALE_RMS}
_OUT_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def format_version() -> int:
    """Version of the compressed byte format (docs/FORMAT.md)."""
    return _fmkv.format_version()


def backends() -> Dict[str, Dict[str, Any]]:
    """``{name: {"available": bool, "device": str}}`` for ref, cpu, cuda, metal."""
    return _fmkv.backends()


def check_backend(backend: str, config: "Config") -> None:
    """Raise :class:`FmkvError` when ``backend`` cannot run caches of ``config`` -- not usable here, or an option its
    ops do not read and write (a format version, scale group or code width: FMKV_ERR_UNSUPPORTED naming the option
    and the backends that have it); the same error every op of the backend would raise (``fmkv_backend_check_config``)."""
    _fmkv.backend_check_config(backend, config._raw())


def _accepts(check, backend: str, config: "Config") -> bool:
    try:
        check(backend, config)
        return True
    except FmkvError:
        return False


def backend_supports(backend: str, config: "Config") -> bool:
    """Whether :func:`check_backend` accepts ``backend`` for ``config``."""
    return _accepts(check_backend, backend, config)


def check_attention(backend: str, config: "Config") -> None:
    """Raise :class:`FmkvError` when ``backend``'s decode attention (and fused decode step) cannot run caches of
    ``config``: what :func:`check_backend` raises, or FMKV_ERR_UNSUPPORTED naming the (head_dim, K, V) combination when
    this build has no kernel for it (a CUDA build compiles a grid of combinations; appends are not affected); the
    error the attention ops would raise (``fmkv_backend_check_attention``)."""
    _fmkv.backend_check_attention(backend, config._raw())


def attention_supported(backend: str, config: "Config") -> bool:
    """Whether :func:`check_attention` accepts ``backend`` for ``config``."""
    return _accepts(check_attention, backend, config)


def default_backend() -> str:
    """'cpu' when the SIMD backend is compiled in, else the scalar reference 'ref'."""
    return "cpu" if backends()["cpu"]["available"] else "ref"


def synchronize(backend: str = "cuda") -> None:
    """Wait for a backend's device and raise, as :class:`FmkvError`, the first error its kernels
    detected since the last call (``fmkv_device_synchronize``).

    The CUDA backend checks the batch arrays it cannot read from the host -- block-table entries,
    slots, lengths, row offsets -- and NaN/Inf in K/V/Q on the device: a failed op leaves the visible
    cache unchanged (an append or a fused step may have written the token slots it was filling, past the sequence's
    length), records the error in a device error word, and later fmkv CUDA ops are skipped until this call
    reads and clears it. The ops themselves never synchronise (they can be captured in a CUDA
    graph), so such errors surface here, not at the op. Reads the calling thread's current CUDA
    device. A no-op for the host backends ('ref', 'cpu'), whose ops raise at once."""
    _fmkv.synchronize(_args.string("backend", backend))


def cuda_check() -> None:
    """``synchronize('cuda')``: raise device-detected errors of fmkv's CUDA ops (see synchronize)."""
    _fmkv.synchronize("cuda")


def bytes_per_token_head(head_dim: int, bits: int, scale_group: int = 0) -> int:
    """Bytes of one token of one kv head for K or V at ``bits`` (a width of ``fmkv.format.CODE_BITS``; 16 = fp16 K),
    codes plus head_dim / scale_group fp16 scales (``scale_group``: 0 = ``fmkv.format.SCALE_GROUP``, or one of
    ``fmkv.format.SCALE_GROUPS``)."""
    return _fmkv.bytes_per_token_head(_args.integer("head_dim", head_dim), _args.integer("bits", bits),
                                      _args.integer("scale_group", scale_group))


def _seq(seq: Any) -> int:
    return _args.index("seq", seq, "sequence")


def _layer(layer: Any) -> int:
    return _args.index("layer", layer, "layer")


def _as_array(x: Any, dtype: Any = None) -> Any:
    """numpy arrays and DLPack objects pass through; anything else (lists, scalars, objects with
    __array__) becomes a numpy array of ``dtype`` (float32 for token data)."""
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):
        return x
    try:
        return np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise FmkvError(f"cannot convert {type(x).__name__} to an array: {e}") from None


def _dtype_name(dt: Any) -> str:
    if isinstance(dt, str):
        name = dt.replace("torch.", "")
    else:
        name = str(dt).replace("torch.", "")
        try:
            name = np.dtype(dt).name
        except TypeError:
            pass
    aliases = {"float": "float32", "half": "float16", "f4": "float32", "f2": "float16", "bf16": "bfloat16"}
    name = aliases.get(name, name)
    if name not in _OUT_DTYPES:
        raise FmkvError(f"out_dtype {dt!r} is not supported (expected float32, float16 or bfloat16)")
    return name


@dataclasses.dataclass(frozen=True)
class Config:
    """Cache-wide format parameters (fixed for a cache's life); validated on construction.

    head_dim: 64, 128 or 256. k_bits: a width of ``fmkv.format.CODE_BITS`` or 16 (K kept in fp16). v_bits: a
    width of ``fmkv.format.CODE_BITS``.
    page_size: tokens per page, a power of two in [16, 256]. sink_tokens / window_tokens: first /
    last tokens kept in fp16. scale_rule: 'lsq' (default) or 'rms'. seed: rotation seed.
    format_version: 0 (the library's default, :func:`format_version`), 2, or 3 (3-bit codes in tile blocks:
    integer levels; docs/FORMAT.md; a backend that does not have it refuses it by name).
    scale_group: rotated coordinates per fp16 scale -- 0 (the default, ``fmkv.format.SCALE_GROUP``) or one of
    ``fmkv.format.SCALE_GROUPS`` (64: one scale per two code groups, e.g. 36 instead of 40 bytes per token per
    head for k2v2 at head_dim 64); every backend reads and writes both (:func:`check_backend`).
    """

    head_dim: int = 128
    num_kv_heads: int = 8
    k_bits: int = 3
    v_bits: int = 3
    page_size: int = 64
    sink_tokens: int = 0
    window_tokens: int = 0
    scale_rule: str = "lsq"
    seed: int = 0
    format_version: int = 0
    scale_group: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.scale_rule, str) or self.scale_rule not in _SCALE_RULES:
            raise FmkvError(f"scale_rule {self.scale_rule!r} is not supported (expected 'lsq' or 'rms')")
        for f in ("head_dim", "num_kv_heads", "k_bits", "v_bits", "page_size", "sink_tokens", "window_tokens", "seed",
                  "format_version", "scale_group"):
            v = getattr(self, f)
            lo, hi, what = (0, 2**64 - 1, "an integer in [0, 2^64)") if f == "seed" else (-(2**31), 2**31 - 1, "a 32-bit integer")
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise _args.error(f"{f} must be {what}, got {type(v).__name__} {v!r}", cls=FmkvTypeError)
            if not lo <= int(v) <= hi:
                raise _args.error(f"{f} must be {what}, got {v!r}")
            object.__setattr__(self, f, int(v))
        _fmkv.config_validate(self._raw())

    @classmethod
    def _from_raw(cls, c: "_fmkv.RawConfig") -> "Config":
        """The Config of a RawConfig (the inverse of _raw)."""
        rule = {v: k for k, v in _SCALE_RULES.items()}[c.scale_rule]
        return cls(head_dim=c.head_dim, num_kv_heads=c.num_kv_heads, k_bits=c.k_bits, v_bits=c.v_bits,
                   page_size=c.page_size, sink_tokens=c.sink_tokens, window_tokens=c.window_tokens, scale_rule=rule,
                   seed=c.seed, format_version=c.format_version, scale_group=c.scale_group)

    def _raw(self) -> "_fmkv.RawConfig":
        c = _fmkv.RawConfig()
        c.head_dim = self.head_dim
        c.num_kv_heads = self.num_kv_heads
        c.k_bits = self.k_bits
        c.v_bits = self.v_bits
        c.page_size = self.page_size
        c.sink_tokens = self.sink_tokens
        c.window_tokens = self.window_tokens
        c.scale_rule = _SCALE_RULES[self.scale_rule]
        c.seed = self.seed
        c.format_version = self.format_version
        c.scale_group = self.scale_group
        return c

    @property
    def k_bytes_per_token_per_head(self) -> int:
        """Compressed bytes of one token of one kv head for K (codes + scales, or fp16)."""
        return bytes_per_token_head(self.head_dim, self.k_bits, self.scale_group)

    @property
    def v_bytes_per_token_per_head(self) -> int:
        """Compressed bytes of one token of one kv head for V."""
        return bytes_per_token_head(self.head_dim, self.v_bits, self.scale_group)

    @property
    def bytes_per_token_per_head(self) -> int:
        """Compressed bytes of one token of one kv head, K and V together."""
        return self.k_bytes_per_token_per_head + self.v_bytes_per_token_per_head

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: page_size tokens of one layer, all kv heads, K and V."""
        return _fmkv.config_page_bytes(self._raw())

    @property
    def fp16_slot_bytes(self) -> int:
        """Bytes of the fp16 sink + window region of one sequence in one layer (K and V)."""
        return _fmkv.config_fp16_slot_bytes(self._raw())


def codebook(bits: int) -> np.ndarray:
    """The 2^(bits-1) positive Lloyd-Max levels (ascending, fp16 values as float32) for bits 1..4."""
    return _fmkv.codebook(_args.integer("bits", bits))


def codebook_levels(format_version: int, bits: int, side: str) -> np.ndarray:
    """The 2^(bits-1) positive levels (ascending, float32) that b-bit codes of K (side 'k') or V ('v') stand for
    in a format version (0: the default): format 3's 3-bit codes use integer levels times an fp16 step."""
    return _fmkv.codebook_levels(_args.integer("format_version", format_version), _args.integer("bits", bits), _side(side))


def _side(side: str) -> bool:
    if side not in ("k", "v"):
        raise FmkvError(f"side {side!r} is not 'k' or 'v'")
    return side == "v"


def quantize_vector(x: Any, bits: int, seed: int = 0, layer: int = 0, scale_rule: str = "lsq",
                    format_version: int = 0, side: str = "k", scale_group: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Quantize one head vector (length head_dim; rounded to fp16 first, like the cache does).

    Returns ``(codes, scales)``: codes uint8 [head_dim] (sign-magnitude, in rotated order),
    scales float16 [head_dim / scale_group] (``scale_group`` as :class:`Config`'s: 0 = ``fmkv.format.SCALE_GROUP``).
    ``format_version`` (0: the default) and ``side`` ('k' or 'v') pick the codebook (:func:`codebook_levels`).
    """
    if not isinstance(scale_rule, str) or scale_rule not in _SCALE_RULES:
        raise FmkvError(f"scale_rule {scale_rule!r} is not supported (expected 'lsq' or 'rms')")
    codes, scale_bits = _fmkv.quantize_vector(_as_array(x, np.float32), _args.integer("bits", bits),
                                              _args.integer("seed", seed, 0, UINT64_MAX),
                                              _args.integer("layer", layer), _SCALE_RULES[scale_rule],
                                              _args.integer("format_version", format_version), _side(side),
                                              _args.integer("scale_group", scale_group))
    return codes, scale_bits.view(np.float16)


def dequantize_vector(codes: Any, scales: Any, bits: int, seed: int = 0, layer: int = 0, format_version: int = 0,
                      side: str = "k", scale_group: int = 0) -> np.ndarray:
    """Inverse of :func:`quantize_vector`: float32 [head_dim] in the original (unrotated) basis. ``scales``:
    head_dim / scale_group entries (the ``scale_group`` they were quantized with; 0 = ``fmkv.format.SCALE_GROUP``)."""
    codes = _as_array(codes, np.uint8)
    scales = _as_array(scales, np.float16)
    if isinstance(scales, np.ndarray) and scales.dtype == np.float16:
        scales = np.ascontiguousarray(scales).view(np.uint16)
    elif isinstance(scales, np.ndarray) and scales.dtype != np.uint16:
        raise FmkvError(f"scales: dtype {scales.dtype} is not supported (expected float16, or uint16 bits)")
    elif not isinstance(scales, np.ndarray):  # a DLPack tensor: take its fp16 bits through numpy
        try:
            scales = np.from_dlpack(scales)
        except Exception as e:  # noqa: BLE001
            raise FmkvError(f"scales: cannot read tensor ({e}); pass a numpy float16 array") from None
        return dequantize_vector(codes, scales, bits, seed, layer, format_version, side, scale_group)
    return _fmkv.dequantize_vector(codes, scales, _args.integer("bits", bits), _args.integer("seed", seed, 0, UINT64_MAX),
                                   _args.integer("layer", layer), _args.integer("format_version", format_version), _side(side),
                                   _args.integer("scale_group", scale_group))


class Cache:
    """Paged compressed KV cache in host memory for ``num_layers`` layers (fmkv::HostCache).

    ``num_pages`` pages per layer are shared by up to ``max_seqs`` sequences; all layers of a
    sequence share one block table. Append K/V token rows per (layer, sequence), then run
    attention of the last query rows (causal) over that layer.

    Every call is all-or-nothing: after an error the pages, lengths, block tables and sequence
    slots are as they were. The allocation (pages, fp16 regions, bookkeeping) is made up front and
    refused when larger than the host's memory (``FmkvError`` OUT_OF_RANGE). Thread-safe: calls
    may come from any thread; the calls on one cache are serialised by a mutex (held with the GIL
    released), so concurrent calls -- on different sequences or the same one -- each run whole.
    """

    def __init__(self, config: Config, num_layers: int, num_pages: int, max_seqs: int, backend: Optional[str] = None):
        if not isinstance(config, Config):
            raise _args.type_error("config", "an fmkv.Config", config)
        self._config = config
        self._impl = _fmkv.Cache(config._raw(), _args.integer("num_layers", num_layers),
                                 _args.integer("num_pages", num_pages), _args.integer("max_seqs", max_seqs),
                                 default_backend() if backend is None else _args.string("backend", backend))

    def __repr__(self) -> str:
        return (f"fmkv.Cache(num_layers={self.num_layers}, free_pages={self.free_pages}, "
                f"backend={self.backend!r}, config={self._config!r})")

    @property
    def config(self) -> Config:
        return self._config

    @property
    def backend(self) -> str:
        return self._impl.backend

    @property
    def num_layers(self) -> int:
        return self._impl.num_layers

    @property
    def free_pages(self) -> int:
        return self._impl.free_pages

    @property
    def resident_bytes(self) -> int:
        """Bytes allocated: pages of all layers plus the fp16 sink/window regions."""
        return self._impl.resident_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of pages held by live sequences plus their fp16 regions."""
        return self._impl.used_bytes

    def add_sequence(self) -> int:
        """Claim a free sequence slot (length 0 in every layer); returns its id."""
        return self._impl.add_sequence()

    def remove_sequence(self, seq: int) -> None:
        """Release a sequence and its pages."""
        self._impl.remove_sequence(_seq(seq))

    def length(self, layer: int, seq: int) -> int:
        """Tokens appended so far to ``seq`` in ``layer``."""
        return self._impl.length(_layer(layer), _seq(seq))

    def block_table(self, seq: int) -> List[int]:
        """Pages (indices into each layer's pool) holding the compressed tokens of ``seq``."""
        return self._impl.block_table(_seq(seq))

    def append(self, layer: int, seq: int, k: Any, v: Any) -> None:
        """Append token rows ``k``, ``v`` of shape [tokens, num_kv_heads, head_dim].

        Values are rounded to fp16 and compressed. On error nothing is appended.
        """
        self._impl.append(_layer(layer), _seq(seq), _as_array(k, np.float32), _as_array(v, np.float32))

    def attention(self, layer: int, seq: int, q: Any, softmax_scale: Optional[float] = None,
                  softcap: float = 0.0, out_dtype: Any = "float32") -> np.ndarray:
        """Attention of the last ``q.shape[0]`` tokens of ``seq`` (already appended; causal).

        q: [query_tokens, q_heads, head_dim] with q_heads a multiple of num_kv_heads (GQA).
        softmax_scale: None for 1/sqrt(head_dim). softcap > 0 applies cap * tanh(score / cap).
        out_dtype: precision the kernel writes (float32, float16 or bfloat16); the result is
        always returned as a float32 numpy array [query_tokens, q_heads, head_dim]. An output that
        overflows float16 (V values near +-65504, pushed past the range by the decompression) is
        refused with an FmkvError (NON_FINITE) naming the element, never returned as inf.
        """
        return self._impl.attention(_layer(layer), _seq(seq), _as_array(q, np.float32),
                                    None if softmax_scale is None else _args.real("softmax_scale", softmax_scale, False),
                                    _args.real("softcap", softcap, False), _dtype_name(out_dtype))

    def attention_lse(self, layer: int, seq: int, q: Any, softmax_scale: Optional[float] = None,
                      softcap: float = 0.0) -> Tuple[np.ndarray, np.ndarray]:
        """``attention`` in float32, and the log of each row's softmax denominator.

        Returns (out [query_tokens, q_heads, head_dim], lse [query_tokens, q_heads]): lse =
        log sum_p exp(s_p) over the visible tokens, s_p the scores as the softmax sees them (scaled,
        softcapped). Attention over disjoint token sets merges exactly from these pairs
        (``fmkv.distributed.merge_partials``). Backends ``ref`` and ``cpu``.
        """
        return self._impl.attention_lse(_layer(layer), _seq(seq), _as_array(q, np.float32),
                                        None if softmax_scale is None else _args.real("softmax_scale", softmax_scale, False),
                                        _args.real("softcap", softcap, False))

    # ---- snapshots (fmkv.snapshot, docs/FILE-FORMAT.md) ------------------------------------------
    def save(self, path: Any, seqs: Any, num_tokens: int = -1, allow_dequantized: bool = False) -> None:
        """Save sequences ``seqs`` (an id or a list; file sequence i is seqs[i]) to the snapshot file ``path``,
        written atomically (a temporary file renamed over it). ``num_tokens``: a prefix of that many tokens of each
        (-1: every cached token). See :mod:`fmkv.snapshot` for ``allow_dequantized``."""
        from .snapshot import path_of, seq_list

        self._impl.save(path_of(path), seq_list(seqs), _args.integer("num_tokens", num_tokens, -1),
                        bool(allow_dequantized))

    def save_bytes(self, seqs: Any, num_tokens: int = -1, allow_dequantized: bool = False) -> bytes:
        """:meth:`save` into bytes (the same file image)."""
        from .snapshot import seq_list

        return self._impl.save(None, seq_list(seqs), _args.integer("num_tokens", num_tokens, -1), bool(allow_dequantized))

    def restore(self, source: Any, file_seq: int = 0) -> int:
        """Copy sequence ``file_seq`` of a snapshot (a file path, mapped; or bytes) in as a new sequence; returns
        its id. The snapshot's config (every field) and layer count must equal this cache's; it needs a free
        sequence slot and the sequence's pages. On error nothing changes."""
        from .snapshot import source_of

        kind, src = source_of(source)
        fs = _args.integer("file_seq", file_seq, 0, _args.INT32_MAX, "OUT_OF_RANGE")
        return self._impl.restore_file(src, fs) if kind == "path" else self._impl.restore_bytes(src, fs)

    @classmethod
    def from_snapshot(cls, source: Any, backend: Optional[str] = None, extra_pages: int = 0,
                      extra_seqs: int = 0) -> "Cache":
        """A new cache with the snapshot's config and layer count holding every sequence of it (ids 0, 1, ...
        in file order), with ``extra_pages`` free pages per layer and ``extra_seqs`` free sequence slots for what
        comes next."""
        from .snapshot import filled_from

        return filled_from(source, lambda c, n, p, s: cls(c, n, p, s, backend), extra_pages, extra_seqs)


from .snapshot import Snapshot, SnapshotSequence  # noqa: E402  (after Config and Cache, which it uses)

"""torch.library custom ops over fmkv: ``torch.ops.fmkv.append`` and ``torch.ops.fmkv.attention``.

The cache state of one layer lives in caller-owned torch tensors, so the ops are visible to
torch.compile / AOT autograd (``append`` declares its in-place writes; both have fake (meta)
implementations that only compute output metadata):

* ``pages``  uint8, ``num_pages * config.page_bytes`` bytes (e.g. shape [num_pages, page_bytes]);
* ``fp16_k`` / ``fp16_v`` float16, ``[num_slots, num_kv_heads, sink + window, head_dim]`` (may be
  empty when sink_tokens + window_tokens == 0);
* a batch of sequences: ``slots`` int32 [n], ``seq_lens`` int64 [n], ``row_offsets`` int64 [n+1],
  ``block_table`` int32 [n, stride] (see include/fmkv/params.h, fmkv_batch);
* ``config``: :func:`config_to_list` of an :class:`fmkv.Config`.

Only CPU tensors are supported by this build (the ``ref`` or ``cpu`` backend); tensors on any
other device, or of an unsupported dtype, raise :class:`fmkv.FmkvError`.

:class:`TorchCache` manages those tensors (page allocation, block tables, lengths) for
``num_layers`` layers, like :class:`fmkv.Cache` but with torch-owned storage.

Importing this module registers the ops (it needs torch; fmkv itself does not).
"""
from __future__ import annotations

from typing import List, Optional

try:
    import torch
    from torch import Tensor
except ImportError as _e:  # pragma: no cover
    raise ImportError("fmkv.torch_ops needs PyTorch (pip install torch); the rest of fmkv does not") from _e

from . import Config, FmkvError, _fmkv, default_backend

__all__ = ["append", "attention", "config_to_list", "TorchCache"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCALE = {"lsq": _fmkv.SCALE_LSQ, "rms": _fmkv.SCALE_RMS}


def config_to_list(config: Config) -> List[int]:
    """The 9 ints the ops take for a Config (the uint64 seed as a signed int64)."""
    seed = config.seed - 2**64 if config.seed >= 2**63 else config.seed
    return [config.head_dim, config.num_kv_heads, config.k_bits, config.v_bits, config.page_size,
            config.sink_tokens, config.window_tokens, _SCALE[config.scale_rule], seed]


def _raw_config(cfg: List[int]) -> "_fmkv.RawConfig":
    if len(cfg) != 9:
        raise FmkvError(f"config: expected the 9 ints of fmkv.torch_ops.config_to_list, got {len(cfg)}")
    c = _fmkv.RawConfig()
    (c.head_dim, c.num_kv_heads, c.k_bits, c.v_bits, c.page_size, c.sink_tokens, c.window_tokens,
     c.scale_rule) = (int(x) for x in cfg[:8])
    c.seed = int(cfg[8]) % 2**64
    _fmkv.config_validate(c)
    return c


def _check_device(op: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise FmkvError(f"fmkv::{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cpu", "meta"):
            raise FmkvError(f"fmkv::{op}: {name} is on device '{t.device}', but this fmkv build runs on CPU "
                            f"tensors only (backends 'ref' / 'cpu'); move the cache and inputs to the CPU")


def _check_float(op: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in _FLOAT_DTYPES:
            raise FmkvError(f"fmkv::{op}: {name}: dtype {t.dtype} is not supported (expected float32, float16 or bfloat16)")
        if t.dim() != 3:
            raise FmkvError(f"fmkv::{op}: {name}: expected a 3-D tensor [tokens, heads, head_dim], got shape {tuple(t.shape)}")


def _backend(backend: str) -> str:
    return backend or default_backend()


@torch.library.custom_op("fmkv::append", mutates_args=("pages", "fp16_k", "fp16_v"))
def append(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, k: Tensor, v: Tensor, slots: Tensor, seq_lens: Tensor,
           row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int, backend: str = "") -> None:
    """Compress rows of k / v ([rows, num_kv_heads, head_dim]) into one layer's pages / fp16
    regions, in place. seq_lens: tokens already cached per sequence (not updated here)."""
    _check_device("append", pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v, slots=slots, seq_lens=seq_lens,
                  row_offsets=row_offsets, block_table=block_table)
    _check_float("append", k=k, v=v)
    _fmkv.append_raw(_backend(backend), _raw_config(config), layer, pages, fp16_k, fp16_v, slots, seq_lens,
                     row_offsets, block_table, k.detach(), v.detach())


@append.register_fake
def _append_fake(pages, fp16_k, fp16_v, k, v, slots, seq_lens, row_offsets, block_table, config, layer, backend=""):
    _check_device("append", pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, k=k, v=v)
    _check_float("append", k=k, v=v)
    return None


@torch.library.custom_op("fmkv::attention", mutates_args=())
def attention(pages: Tensor, fp16_k: Tensor, fp16_v: Tensor, q: Tensor, slots: Tensor, seq_lens: Tensor,
              row_offsets: Tensor, block_table: Tensor, config: List[int], layer: int, softmax_scale: float = 0.0,
              softcap: float = 0.0, backend: str = "") -> Tensor:
    """Attention of q ([rows, q_heads, head_dim]; causal, the last rows of each sequence) over one
    layer. seq_lens include the query tokens. Returns a new tensor shaped and typed like q.
    softmax_scale 0 means 1/sqrt(head_dim)."""
    _check_device("attention", pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, q=q, slots=slots, seq_lens=seq_lens,
                  row_offsets=row_offsets, block_table=block_table)
    _check_float("attention", q=q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _fmkv.attention_raw(_backend(backend), _raw_config(config), layer, pages, fp16_k, fp16_v, slots, seq_lens,
                        row_offsets, block_table, q.detach(), out, softmax_scale, softcap)
    return out


@attention.register_fake
def _attention_fake(pages, fp16_k, fp16_v, q, slots, seq_lens, row_offsets, block_table, config, layer,
                    softmax_scale=0.0, softcap=0.0, backend=""):
    _check_device("attention", pages=pages, fp16_k=fp16_k, fp16_v=fp16_v, q=q)
    _check_float("attention", q=q)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


class TorchCache:
    """Paged compressed KV cache whose storage is torch CPU tensors, driven by the custom ops.

    ``pages[layer]`` uint8 [num_pages, page_bytes], ``fp16_k[layer]`` / ``fp16_v[layer]`` float16
    [max_seqs, num_kv_heads, sink + window, head_dim]; all layers of a sequence share one block
    table (as in fmkv::HostCache).
    """

    def __init__(self, config: Config, num_layers: int, num_pages: int, max_seqs: int, backend: Optional[str] = None):
        if not isinstance(config, Config):
            raise FmkvError(f"config must be an fmkv.Config, got {type(config).__name__}")
        if num_layers < 1 or num_pages < 0 or max_seqs < 1:
            raise FmkvError("TorchCache: need num_layers >= 1, num_pages >= 0, max_seqs >= 1")
        self.config = config
        self.backend = backend or default_backend()
        if self.backend not in ("ref", "cpu") or not _fmkv.backends()[self.backend]["available"]:
            raise FmkvError(f"TorchCache: backend {self.backend!r} is not available for CPU tensors")
        self._cfg = config_to_list(config)
        R = config.sink_tokens + config.window_tokens
        H, d = config.num_kv_heads, config.head_dim
        self.pages = [torch.zeros(num_pages, config.page_bytes, dtype=torch.uint8) for _ in range(num_layers)]
        self.fp16_k = [torch.zeros(max_seqs, H, R, d, dtype=torch.float16) for _ in range(num_layers)]
        self.fp16_v = [torch.zeros(max_seqs, H, R, d, dtype=torch.float16) for _ in range(num_layers)]
        self._free = list(range(num_pages - 1, -1, -1))
        self._tables: List[List[int]] = [[] for _ in range(max_seqs)]
        self._lens = [[-1] * max_seqs for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.pages)

    @property
    def free_pages(self) -> int:
        return len(self._free)

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

    def _batch(self, s: int, length: int, rows: int):
        t = self._tables[s]
        return (torch.tensor([s], dtype=torch.int32), torch.tensor([length], dtype=torch.int64),
                torch.tensor([0, rows], dtype=torch.int64), torch.tensor([t], dtype=torch.int32).reshape(1, len(t)))

    def append(self, layer: int, s: int, k: Tensor, v: Tensor) -> None:
        layer, s = self._layer(layer), self._seq(s)
        c = self.config
        n = int(k.shape[0]) if k.dim() >= 1 else 0
        length = self._lens[layer][s]
        comp = max(0, length + n - c.window_tokens - c.sink_tokens)
        need = -(-comp // c.page_size) - len(self._tables[s])
        if need > len(self._free):
            raise FmkvError(f"TorchCache: out of pages ({len(self._free)} free, sequence needs {need} more)")
        for _ in range(max(0, need)):
            self._tables[s].append(self._free.pop())
        torch.ops.fmkv.append(self.pages[layer], self.fp16_k[layer], self.fp16_v[layer], k, v,
                              *self._batch(s, length, n), self._cfg, layer, self.backend)
        self._lens[layer][s] = length + n

    def attention(self, layer: int, s: int, q: Tensor, softmax_scale: Optional[float] = None,
                  softcap: float = 0.0) -> Tensor:
        layer, s = self._layer(layer), self._seq(s)
        length = self._lens[layer][s]
        if softmax_scale is not None and not softmax_scale > 0:
            raise FmkvError("softmax_scale must be > 0 (None means 1/sqrt(head_dim))")
        return torch.ops.fmkv.attention(self.pages[layer], self.fp16_k[layer], self.fp16_v[layer], q,
                                        *self._batch(s, length, int(q.shape[0])), self._cfg, layer,
                                        float(softmax_scale or 0.0), float(softcap), self.backend)

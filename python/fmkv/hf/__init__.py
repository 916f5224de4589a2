"""Hugging Face transformers integration: a compressed KV cache and the attention that reads it.

    import fmkv.hf
    cache = fmkv.hf.FmkvCache(model.config, k_bits=3, v_bits=3)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    print(cache.resident_bytes, cache.fp16_equivalent_bytes())

or load the model with ``attn_implementation="fmkv"`` (registered in transformers'
``AttentionInterface`` when this module is imported) and pass an FmkvCache.

* Each full-attention layer stores its K/V in a real ``fmkv.Cache`` (compressed pages plus the
  optional fp16 sink/window regions): the tensors are not kept in fp16 anywhere.
* Prefill (a chunk with no cached past) attends the chunk at full precision while writing the
  compressed cache; every later step (decode, or a prefill chunk with a cached past) runs the fused
  kernel ``fmkv.Cache.attention`` on the compressed cache (causal for multi-row queries).
  ``prefill="compressed"`` makes the first chunk read the compressed cache too.
* Sliding-window layers (Gemma 3, Mistral with a window, ...) keep transformers' fp16
  ``DynamicSlidingWindowLayer``: their size is bounded by the window.
* Options: asymmetric ``k_bits`` / ``v_bits`` (K may be 16 = fp16), ``window_tokens`` (recent
  tokens kept in fp16: measured to matter most, see docs/EVAL.md), ``sink_tokens``,
  ``boundary_layers`` (first/last N layers at ``boundary_k_bits`` / ``boundary_v_bits``),
  ``scale_rule`` ('lsq' default, or 'rms'), rotation ``seed``.

Limits: host backends (tensors on CPU; CUDA tensors are copied to the host), batches must not be
padded (the kernel takes no padding mask), no beam search / cache cropping.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import numpy as np
import torch

import fmkv

__all__ = ["FmkvCache", "FmkvLayer", "fmkv_attention", "register", "ATTN_NAME"]

ATTN_NAME = "fmkv"
_M64 = (1 << 64) - 1
_LAYER_MUL = 0xD6E8FEB86659FD93

try:  # transformers >= 4.56 (layered caches)
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer
except ImportError as e:  # pragma: no cover
    raise ImportError(f"fmkv.hf needs transformers >= 4.56 with layered caches ({e})") from None


def layer_seed(seed: int, layer: int) -> int:
    """Seed whose layer-0 rotation signs equal those of (seed, layer) (FORMAT.md section 3).

    Each FmkvLayer owns a one-layer fmkv.Cache; this keeps its bytes identical to a
    multi-layer cache with ``seed`` (and to fmkv.torch_quant with (seed, layer))."""
    return (int(seed) ^ ((int(layer) & 0xFFFFFFFF) * _LAYER_MUL)) & _M64


class FmkvLayer(CacheLayerMixin):
    """One decoder layer's compressed K/V: an ``fmkv.Cache`` with one layer, one sequence per batch row."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, k_bits: int = 3, v_bits: int = 3, max_cache_len: int = 4096,
                 page_size: int = 64, sink_tokens: int = 0, window_tokens: int = 0,
                 scale_rule: str = "lsq", seed: int = 0, backend: Optional[str] = None,
                 prefill: str = "full"):
        super().__init__()
        self.layer_idx = int(layer_idx)
        self.k_bits, self.v_bits = int(k_bits), int(v_bits)
        self.max_cache_len = int(max_cache_len)
        self.page_size = int(page_size)
        self.sink_tokens, self.window_tokens = int(sink_tokens), int(window_tokens)
        self.scale_rule = scale_rule
        self.seed = int(seed)
        self.backend = backend
        self.prefill = prefill
        self.cache: Optional[fmkv.Cache] = None
        self.seqs: List[int] = []
        self.length = 0
        self.dtype = torch.float32

    def __repr__(self) -> str:
        return (f"FmkvLayer(layer={self.layer_idx}, k{self.k_bits}v{self.v_bits}, len={self.length}, "
                f"sink={self.sink_tokens}, window={self.window_tokens})")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.config = fmkv.Config(head_dim=d, num_kv_heads=h, k_bits=self.k_bits, v_bits=self.v_bits,
                                  page_size=self.page_size, sink_tokens=self.sink_tokens,
                                  window_tokens=self.window_tokens, scale_rule=self.scale_rule,
                                  seed=layer_seed(self.seed, self.layer_idx))
        pages_per_seq = max(1, math.ceil(max(0, self.max_cache_len - self.sink_tokens) / self.page_size))
        self.cache = fmkv.Cache(self.config, 1, pages_per_seq * b, b, backend=self.backend)
        self.seqs = [self.cache.add_sequence() for _ in range(b)]
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _, n, _ = key_states.shape
        if b != len(self.seqs):
            raise fmkv.FmkvError(f"batch size changed from {len(self.seqs)} to {b}")
        if self.length + n > self.max_cache_len:
            raise fmkv.FmkvError(f"cache full: {self.length} + {n} tokens > max_cache_len {self.max_cache_len}")
        with torch.no_grad():
            k = key_states.detach().to("cpu").transpose(1, 2).contiguous()  # [b, n, h, d]
            v = value_states.detach().to("cpu").transpose(1, 2).contiguous()
            for i, s in enumerate(self.seqs):
                self.cache.append(0, s, k[i], v[i])
        past = self.length
        self.length += n
        # The chunk's own K/V go to the attention function, tagged with this layer: it attends them
        # directly on prefill and calls the fused kernel on the compressed cache otherwise.
        key_states = key_states.view_as(key_states)
        key_states._fmkv_layer = (self, past)
        return key_states, value_states

    def attention(self, query: torch.Tensor, scaling: Optional[float], softcap: Optional[float]) -> torch.Tensor:
        """Fused attention of query [b, hq, n, d] (the last n appended tokens) -> [b, n, hq, d]."""
        q = query.detach().to("cpu", torch.float32).transpose(1, 2).contiguous()  # [b, n, hq, d]
        outs = [torch.from_numpy(np.asarray(self.cache.attention(
            0, s, q[i], softmax_scale=None if scaling is None else float(scaling),
            softcap=float(softcap or 0.0)))) for i, s in enumerate(self.seqs)]
        return torch.stack(outs, 0).to(device=query.device, dtype=query.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    @property
    def resident_bytes(self) -> int:
        return 0 if self.cache is None else int(self.cache.resident_bytes)

    @property
    def used_bytes(self) -> int:
        return 0 if self.cache is None else int(self.cache.used_bytes)

    def reset(self) -> None:
        if self.cache is not None:
            for s in self.seqs:
                self.cache.remove_sequence(s)
            self.seqs = [self.cache.add_sequence() for _ in self.seqs]
        self.length = 0

    def offload(self):  # host memory already
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("FmkvCache cannot be cropped (compressed tokens are not removable)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("FmkvCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("FmkvCache does not support batch expansion")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("FmkvCache does not support batch selection")


def _layer_types(config) -> List[str]:
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        sw = getattr(config, "sliding_window", None)
        use = getattr(config, "use_sliding_window", True)
        return ["sliding_attention" if (sw and use) else "full_attention"] * n
    return list(types)[:n]


class FmkvCache(Cache):
    """transformers Cache whose full-attention layers hold compressed fmkv storage."""

    def __init__(self, config, k_bits: int = 3, v_bits: int = 3, max_cache_len: int = 4096,
                 page_size: int = 64, sink_tokens: int = 0, window_tokens: int = 0,
                 boundary_layers: int = 0, boundary_k_bits: int = 16, boundary_v_bits: int = 4,
                 scale_rule: str = "lsq", seed: int = 0, backend: Optional[str] = None,
                 prefill: str = "full", set_attention: bool = True):
        if prefill not in ("full", "compressed"):
            raise ValueError("prefill must be 'full' or 'compressed'")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        types = _layer_types(text)
        n = len(types)
        layers = []
        for i, t in enumerate(types):
            if t == "sliding_attention" and getattr(text, "sliding_window", None):
                layers.append(DynamicSlidingWindowLayer(sliding_window=int(text.sliding_window)))
                continue
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"layer {i}: type {t!r} is not supported by FmkvCache")
            boundary = boundary_layers > 0 and (i < boundary_layers or i >= n - boundary_layers)
            layers.append(FmkvLayer(i, boundary_k_bits if boundary else k_bits,
                                    boundary_v_bits if boundary else v_bits, max_cache_len, page_size,
                                    sink_tokens, window_tokens, scale_rule, seed, backend, prefill))
        super().__init__(layers=layers)
        self.max_cache_len = int(max_cache_len)
        self.options = dict(k_bits=k_bits, v_bits=v_bits, page_size=page_size, sink_tokens=sink_tokens,
                            window_tokens=window_tokens, boundary_layers=boundary_layers,
                            scale_rule=scale_rule, seed=seed, prefill=prefill)
        if set_attention:
            use_fmkv_attention(config)

    @property
    def fmkv_layers(self) -> List[FmkvLayer]:
        return [layer for layer in self.layers if isinstance(layer, FmkvLayer)]

    @property
    def resident_bytes(self) -> int:
        """Allocated bytes: compressed page pools + fp16 regions, plus fp16 sliding-window layers."""
        total = sum(layer.resident_bytes for layer in self.fmkv_layers)
        for layer in self.layers:
            if not isinstance(layer, FmkvLayer) and getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    @property
    def used_bytes(self) -> int:
        """Bytes of pages held by the sequences + fp16 regions (+ sliding layers)."""
        total = sum(layer.used_bytes for layer in self.fmkv_layers)
        for layer in self.layers:
            if not isinstance(layer, FmkvLayer) and getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    def fp16_equivalent_bytes(self) -> int:
        """Bytes the same tokens would take in an fp16 DynamicCache (K and V, all layers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, FmkvLayer) and layer.cache is not None:
                c = layer.config
                total += 2 * 2 * c.num_kv_heads * c.head_dim * layer.length * len(layer.seqs)
            elif getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * 2 * 2
        return total


# ----------------------------------------------------------------------------- attention
def _fallback(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(getattr(module, "config", None), "_fmkv_fallback", None) or "sdpa"
    if name in ("eager", ATTN_NAME) or name not in ALL_ATTENTION_FUNCTIONS:
        name = "sdpa"
    if kwargs.get("softcap") and name == "sdpa":
        return _eager(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[name](module, query, key, value, attention_mask, **kwargs)


def _eager(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, dim=1) if g > 1 else key
    v = value.repeat_interleave(g, dim=1) if g > 1 else value
    s = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is not None:
        m = attention_mask[:, :, :, : k.shape[-2]]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    elif query.shape[2] > 1:
        n_q, n_k = query.shape[2], k.shape[2]
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~causal, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return (p @ v).transpose(1, 2).contiguous(), None


def fmkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                   **kwargs):
    """Attention function registered as "fmkv": fused kernel on the compressed cache for layers of an
    FmkvCache (decode / chunks with a past), the fallback implementation for everything else."""
    tag = getattr(key, "_fmkv_layer", None)
    if tag is None:
        return _fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                         softcap=softcap, **kwargs)
    layer, past = tag
    if past == 0 and layer.prefill == "full":
        # First chunk: attend it at full precision (the compressed copy is already written).
        return _fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                         softcap=softcap, **kwargs)
    return layer.attention(query, scaling, softcap), None


_REGISTERED = False


def register() -> None:
    """Register "fmkv" in transformers' AttentionInterface and its mask in AttentionMaskInterface."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, fmkv_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _REGISTERED = True


def use_fmkv_attention(config) -> None:
    """Switch a model config (and its text sub-config) to the "fmkv" attention, remembering the old one."""
    register()
    for c in {id(config): config, id(_text(config)): _text(config)}.values():
        prev = getattr(c, "_attn_implementation", None)
        if prev and prev != ATTN_NAME:
            c._fmkv_fallback = prev
        c._attn_implementation = ATTN_NAME


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


register()

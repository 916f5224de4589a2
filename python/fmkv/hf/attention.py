"""The "fmkv" attention function: transformers' AttentionInterface entry that reads fmkv caches.

A layer of an fmkv cache tags the key tensor its ``update`` returns; the attention function finds
the tag and runs the layer's compressed attention (FmkvLayer.attention, FmkvStaticLayer.attention).
Untagged calls (prefill chunks attended at full precision, layers of other caches, models without
an fmkv cache) go to the attention the config had before (sdpa by default).
"""
from __future__ import annotations

import torch

from .compat import text_config
from ..key_offset import check_softcap

__all__ = ["ATTN_NAME", "fmkv_attention", "register", "use_fmkv_attention"]

ATTN_NAME = "fmkv"


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
    FmkvCache or FmkvStaticCache (decode / chunks with a past), the fallback implementation for
    everything else (and for a first chunk attended at full precision)."""
    static = getattr(key, "_fmkv_static", None)
    tag = getattr(key, "_fmkv_layer", None)
    owner = static if static is not None else tag[0] if tag is not None else None
    if owner is not None and owner.key_offset:
        check_softcap(softcap)  # the offset cancels in softmax only without a softcap
    if static is not None:
        out = static.attention(query, key, value, attention_mask, scaling, softcap)
        if out is not None:
            return out, None
        return _fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                         softcap=softcap, **kwargs)
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
    for c in {id(config): config, id(text_config(config)): text_config(config)}.values():
        prev = getattr(c, "_attn_implementation", None)
        if prev and prev != ATTN_NAME:
            c._fmkv_fallback = prev
        c._attn_implementation = ATTN_NAME

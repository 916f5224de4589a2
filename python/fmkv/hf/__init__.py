"""Hugging Face transformers integration: compressed KV caches and the attention that reads them.

    import fmkv.hf
    cache = fmkv.hf.FmkvCache(model.config, k_bits=3, v_bits=3)     # window_tokens=64 by default
    out = model.generate(ids, cache=cache, max_new_tokens=32)        # transformers < 5.24: past_key_values=
    # version-independent: model.generate(ids, **fmkv.hf.cache_kwargs(cache), max_new_tokens=32)
    print(cache.resident_bytes, cache.fp16_equivalent_bytes())

or load the model with ``attn_implementation="fmkv"`` (registered in transformers'
``AttentionInterface`` when this module is imported) and pass an fmkv cache.

Modules:
* ``cache``: :class:`FmkvCache` / :class:`FmkvLayer`, the dynamic cache for eager use (the host
  tracks each layer's length; unpadded batches).
* ``static_cache``: :class:`FmkvStaticCache` / :class:`FmkvStaticLayer`, static shapes allocated up
  front, lengths on the device: the decode step is capturable in one CUDA graph (torch.compile
  ``mode="reduce-overhead"``, transformers' compiled generation, ``torch.cuda.CUDAGraph``);
  left-padded batches of prompts of different lengths.
* ``attention``: the "fmkv" attention function and its registration.
* ``compat``: names that differ between transformers versions (:data:`CACHE_KWARG`,
  :func:`cache_kwargs`, :func:`output_cache`).

On CUDA, errors only the device can detect surface at ``fmkv.cuda_check()`` (or the cache's
``check()``), not at the step that caused them; the cache's contents are then undefined and
``cache.reset()`` empties it (storage kept: no need to rebuild it). On the CPU a failed step raises at
once and leaves the cache as it was.
"""
from __future__ import annotations

from .attention import ATTN_NAME, fmkv_attention, register, use_fmkv_attention
from .cache import DEFAULT_WINDOW_TOKENS, FmkvCache, FmkvLayer, layer_seed, pages_per_sequence
from .compat import CACHE_KWARG, cache_kwargs, output_cache
from .static_cache import FmkvStaticCache, FmkvStaticLayer

__all__ = ["FmkvCache", "FmkvLayer", "FmkvStaticCache", "FmkvStaticLayer", "fmkv_attention", "register", "ATTN_NAME", "CACHE_KWARG", "cache_kwargs",
           "output_cache", "DEFAULT_WINDOW_TOKENS", "layer_seed", "use_fmkv_attention", "pages_per_sequence"]

register()

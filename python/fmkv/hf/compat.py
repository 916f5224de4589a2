"""Names that differ between transformers versions, and model-config helpers shared by the caches."""
from __future__ import annotations

from typing import Any, Dict, List

try:  # transformers >= 4.56 (layered caches)
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError(f"fmkv.hf needs transformers >= 4.56 with layered caches ({e})") from None

# The keyword under which generate() and the models' forward() take a KV cache: transformers 5.24
# renamed `past_key_values` to `cache` (the old name is deprecated: forward drops it in 5.40, generate
# in 6.0) and model outputs carry `.cache`.
try:
    from transformers.generation.utils import ALL_CACHE_NAMES as _ALL_CACHE_NAMES
except ImportError:  # pragma: no cover
    _ALL_CACHE_NAMES = ["past_key_values"]
CACHE_KWARG = "cache" if _ALL_CACHE_NAMES[0] == "cache" else "past_key_values"


def cache_kwargs(cache) -> Dict[str, Any]:
    """``{CACHE_KWARG: cache}``: pass a cache to generate() / forward() under this transformers' name."""
    return {CACHE_KWARG: cache}


def output_cache(out):
    """The cache a model forward returned (``out.cache``, or ``out.past_key_values`` before 5.24)."""
    return getattr(out, CACHE_KWARG)


def text_config(config):
    """The text sub-config of a (multimodal) model config, or the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> List[str]:
    """``config.layer_types`` (e.g. "full_attention" / "sliding_attention" per layer), derived from
    ``sliding_window`` for configs that do not list them."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        sw = getattr(config, "sliding_window", None)
        use = getattr(config, "use_sliding_window", True)
        return ["sliding_attention" if (sw and use) else "full_attention"] * n
    return list(types)[:n]


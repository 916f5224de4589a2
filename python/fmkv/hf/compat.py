"""Names that differ between transformers versions, and model-config helpers shared by the caches."""
from __future__ import annotations

from typing import Any, Dict, List

from .._args import width_pair

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


def require_attention(backend: str, config, what: str) -> None:
    """Raise :class:`fmkv.FmkvError` (prefixed with ``what``, e.g. the layer) when ``backend``'s decode attention has
    no kernel for ``config`` -- a CUDA build compiles a grid of (head_dim, K, V) pairs (``fmkv.check_attention``).
    The caches ask it when a layer allocates, so a width outside the grid fails at the first forward, before that
    layer writes anything, not at the first decode step after a long prefill."""
    import fmkv

    try:
        fmkv.check_attention(backend, config)
    except fmkv.FmkvError as e:
        raise fmkv.FmkvError(f"{what}: {e}") from None


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



class FixedLayerOps:
    """The transformers layer operations an fmkv layer does not have: its storage stays where it was allocated
    (offload / prefetch do nothing) and compressed tokens are neither removable nor reorderable. ``_cache_name``
    names the cache in the errors."""

    _cache_name = "FmkvCache"

    def offload(self):
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{self._cache_name} cannot be cropped (compressed tokens are not removable)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(f"{self._cache_name} does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{self._cache_name} does not support batch expansion")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError(f"{self._cache_name} does not support batch selection")


def layer_bit_widths(n: int, k_bits: int, v_bits: int, boundary_layers: int = 0, boundary_k_bits: int = 16,
                     boundary_v_bits: int = 4, layer_bits=None) -> List[tuple]:
    """(k_bits, v_bits) of each of the ``n`` layers: ``layer_bits`` (one (k, v) pair per layer, e.g. a budget
    plan from ``fmkv-eval plan``) when given, else k_bits / v_bits with the first and last ``boundary_layers``
    layers at boundary_k_bits / boundary_v_bits. The widths themselves are checked by fmkv.Config."""
    if layer_bits is None:
        return [(boundary_k_bits, boundary_v_bits) if boundary_layers > 0 and (i < boundary_layers or i >= n - boundary_layers)
                else (k_bits, v_bits) for i in range(n)]
    pairs = list(layer_bits)
    if len(pairs) != n:
        raise ValueError(f"layer_bits has {len(pairs)} entries for a model of {n} layers")
    pairs = [width_pair(f"layer_bits[{i}]", p) for i, p in enumerate(pairs)]
    if boundary_layers:
        raise ValueError("layer_bits and boundary_layers both choose the layers' widths; pass one of them")
    return pairs

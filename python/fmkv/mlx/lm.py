"""An mlx-lm KV cache backed by fmkv, and fmkv attention in the model's attention.

    import mlx_lm, fmkv.mlx.lm
    cache = fmkv.mlx.lm.make_prompt_cache(model, k_bits=4, v_bits=4, window_tokens=32)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=64, prompt_cache=cache)

:class:`FmkvKVCache` has the interface of ``mlx_lm.models.cache`` (written against mlx-lm 0.32):
``update_and_fetch``, ``offset``, ``state`` (arrays and scalars, as QuantizedKVCache's), ``meta_state``
(the scalars as strings, for mlx-lm versions that save them separately), ``from_state``, ``is_trimmable`` /
``trim``, ``make_mask``, ``size``, ``empty``, ``nbytes``; mlx-lm's ``save_prompt_cache`` /
``load_prompt_cache`` round-trip it (:func:`install` registers the class where the loader looks).

Attention hooks in the way mlx-lm's quantized cache does: mlx-lm models call
``mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)``
with what ``update_and_fetch`` returned, and that function picks the quantized kernel for a
QuantizedKVCache. :func:`install` wraps it (in ``mlx_lm.models.base`` and in every loaded model module
that imported it) so that, for an FmkvKVCache layer, it runs fmkv attention on the compressed cache.
The first chunk (no cached past) attends its own K/V at full precision while the compressed copy is
written (``prefill="full"``, as fmkv.hf does); every later call -- decode steps, and prompt chunks
after the first -- attends the compressed cache (causal). ``prefill="compressed"`` makes the first
chunk read the compressed cache too.

Limits: a batch of sequences of equal length (mlx-lm's default generation; no padding masks: an
array mask raises), full-attention models whose attention goes through
``base.scaled_dot_product_attention`` (llama, qwen, mistral, ...); models whose ``make_cache`` asks
for other cache types (sliding windows, recurrent layers) are refused.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional

from .. import Config, FmkvError, _args, format_version as fmkv_format_version
from ..key_offset import first_tokens_mean
from .layer import MlxLayer

__all__ = ["FmkvKVCache", "make_prompt_cache", "install", "DEFAULT_WINDOW_TOKENS"]

# The fp16 window of fmkv.hf (docs/EVAL.md: the most recent tokens matter most).
DEFAULT_WINDOW_TOKENS = 64

try:
    from mlx_lm.models import base as _base
    from mlx_lm.models import cache as _cache
    from mlx_lm.models.cache import _BaseCache
except ImportError as e:  # pragma: no cover
    raise ImportError(f"fmkv.mlx.lm needs mlx-lm (pip install mlx-lm): {e}") from None


class _Compressed:
    """What FmkvKVCache.update_and_fetch returns in place of keys / values when attention must read
    the compressed cache; the wrapped scaled_dot_product_attention recognises it."""

    __slots__ = ("cache",)

    def __init__(self, cache: "FmkvKVCache"):
        self.cache = cache


_STATE_SCALARS = ("offset", "k_bits", "v_bits", "page_size", "sink_tokens", "window_tokens", "scale_rule", "seed",
                  "layer", "batch", "max_tokens", "prefill", "num_kv_heads", "head_dim", "format_version", "key_offset",
                  "scale_group")
# Older states: saved before the scale group (those scalars less the last, then the offset array: scale group 0),
# before the key offset (less the last two, no offset array) and before the cache recorded its format version (less
# the last three, always format version 2).
_STATE_SCALARS_NO_SCALE_GROUP = _STATE_SCALARS[:-1]
_STATE_SCALARS_NO_OFFSET = _STATE_SCALARS[:-2]
_STATE_SCALARS_V2 = _STATE_SCALARS[:-3]


class FmkvKVCache(_BaseCache):
    """One layer's KV cache for mlx-lm, stored compressed by fmkv (fmkv.mlx.MlxLayer).

    k_bits 2/3/4/5/16, v_bits 2/3/4/5 (``fmkv.format.CODE_BITS``, on every runtime); ``window_tokens`` recent tokens (and ``sink_tokens`` first ones)
    kept in fp16; ``max_tokens`` per sequence (pages are allocated up front at the first update);
    ``layer`` selects the layer's rotation signs; ``format_version`` 0 (the library's default), 2 or 3
    (fmkv.Config's); ``scale_group`` 0 (the default, ``fmkv.format.SCALE_GROUP`` coordinates per fp16 scale) or one
    of ``fmkv.format.SCALE_GROUPS`` (fmkv.Config's, on every runtime; saved with the state, older states load
    with 0); ``key_offset``: keys minus their mean over each sequence's first 128 tokens, fixed by the first chunk
    (fmkv.key_offset; softmax ignores it);
    ``runtime`` 'metal' / 'cuda' / 'host' (default: MLX's default device); ``gpu_options`` go to fmkv.mlx.gpu.GpuOps.
    """

    def __init__(self, k_bits: int = 4, v_bits: int = 4, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                 sink_tokens: int = 0, page_size: int = 64, max_tokens: int = 4096, scale_rule: str = "lsq",
                 seed: int = 0, layer: int = 0, runtime: Optional[str] = None, prefill: str = "full",
                 format_version: int = 0, key_offset: bool = False, scale_group: int = 0, **gpu_options):
        if prefill not in ("full", "compressed"):
            raise FmkvError("prefill must be 'full' or 'compressed'")
        # checked now (not at the first update): the widths, the version the cache will write and save, its scale group
        checked = Config(k_bits=int(k_bits), v_bits=int(v_bits), format_version=format_version, scale_group=scale_group)
        self.format_version = checked.format_version or fmkv_format_version()
        self.scale_group = checked.scale_group
        self.k_bits, self.v_bits = int(k_bits), int(v_bits)
        self.window_tokens, self.sink_tokens = int(window_tokens), int(sink_tokens)
        self.page_size, self.max_tokens = int(page_size), int(max_tokens)
        self.scale_rule, self.seed, self.layer = scale_rule, int(seed), int(layer)
        self.runtime, self.prefill = runtime, prefill
        self.gpu_options = gpu_options
        self.key_offset = bool(key_offset)
        self.key_mu = None  # [batch, kv_heads, 1, head_dim] float32 (key_offset): set by the first chunk
        self.offset = 0
        self.batch = 0
        self.num_kv_heads = self.head_dim = 0
        self.fmkv: Optional[MlxLayer] = None

    def __repr__(self) -> str:
        return (f"FmkvKVCache(layer={self.layer}, k{self.k_bits}v{self.v_bits}, format {self.format_version}, offset={self.offset}, "
                f"window={self.window_tokens}, runtime={self.fmkv.runtime if self.fmkv else self.runtime}"
                + (f", scale_group {self.scale_group}" if self.scale_group else "")
                + (", key_offset" if self.key_offset else "") + ")")

    def _allocate(self, batch: int, heads: int, head_dim: int) -> None:
        cfg = Config(head_dim=head_dim, num_kv_heads=heads, k_bits=self.k_bits, v_bits=self.v_bits,
                     page_size=self.page_size, sink_tokens=self.sink_tokens, window_tokens=self.window_tokens,
                     scale_rule=self.scale_rule, seed=self.seed, format_version=self.format_version,
                     scale_group=self.scale_group)
        self.fmkv = MlxLayer(cfg, layer=self.layer, batch=batch, max_tokens=self.max_tokens, runtime=self.runtime,
                             **self.gpu_options)
        self.batch, self.num_kv_heads, self.head_dim = batch, heads, head_dim

    # ---------------------------------------------------------------------------- mlx-lm interface
    def update_and_fetch(self, keys, values):
        """Append keys / values [B, kv_heads, n, head_dim]; returns them for the first chunk (attended
        at full precision), else markers telling the attention to read the compressed cache."""
        B, H, n, d = keys.shape
        if self.fmkv is None:
            self._allocate(B, H, d)
        elif (B, H, d) != (self.batch, self.num_kv_heads, self.head_dim):
            raise FmkvError(f"FmkvKVCache: keys {tuple(keys.shape)} do not match the cache's "
                            f"[batch={self.batch}, kv_heads={self.num_kv_heads}, *, head_dim={self.head_dim}]")
        past = self.offset
        new_mu, stored = None, keys
        if self.key_offset:  # the first chunk fixes the offset; it is kept only once that chunk is stored
            if self.key_mu is None:
                new_mu = first_tokens_mean(keys)
            stored = (keys - (new_mu if new_mu is not None else self.key_mu)).astype(keys.dtype)
        self.fmkv.append(stored, values)
        if new_mu is not None:
            self.key_mu = new_mu
        self.offset += n
        if past == 0 and self.prefill == "full":
            return keys, values
        marker = _Compressed(self)
        return marker, marker

    def attention(self, queries, scale: float, mask=None, sinks=None):
        """fmkv attention of queries [B, q_heads, n, head_dim] over the compressed cache -> [B, q_heads, n, head_dim]."""
        import mlx.core as mx

        if sinks is not None:
            raise FmkvError("FmkvKVCache: attention sinks are not supported")
        if mask is not None and not isinstance(mask, str):
            raise FmkvError("FmkvKVCache: array attention masks (padding, sliding windows) are not supported; "
                            "fmkv attention is causal over the whole cache")
        if isinstance(mask, str) and mask != "causal":
            raise FmkvError(f"FmkvKVCache: mask {mask!r} is not supported (only 'causal')")
        B, HQ, n, d = queries.shape
        out = self.fmkv.attention(queries, softmax_scale=float(scale))
        return mx.reshape(out, (B, n, HQ, d)).transpose(0, 2, 1, 3)

    def make_mask(self, *args, **kwargs):
        return _cache.create_attention_mask(*args, offset=self.offset, **kwargs)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.fmkv is None

    @property
    def nbytes(self) -> int:
        """Bytes of the compressed storage (page pool + fp16 regions) allocated for this layer."""
        return 0 if self.fmkv is None else self.fmkv.resident_bytes

    def is_trimmable(self) -> bool:
        """Trimming is exact without an fp16 window (window tokens that left it were compressed)."""
        return self.window_tokens == 0

    def trim(self, n: int) -> int:
        if self.fmkv is None:
            return 0
        n = self.fmkv.trim(n)
        self.offset -= n
        if self.offset == 0:
            self.key_mu = None  # an emptied cache takes its offset from its next first chunk
        return n

    def check(self) -> None:
        """Raise errors the GPU kernels recorded (see MlxLayer.check)."""
        if self.fmkv is not None:
            self.fmkv.check()

    # ---------------------------------------------------------------------------- save / load
    def _scalars(self) -> List[Any]:
        return [self.offset, self.k_bits, self.v_bits, self.page_size, self.sink_tokens, self.window_tokens,
                self.scale_rule, str(self.seed), self.layer, self.batch, self.max_tokens, self.prefill,
                self.num_kv_heads, self.head_dim, self.format_version, int(self.key_offset), self.scale_group]

    @property
    def state(self):
        """(pages, fp16_k, fp16_v, *scalars, key offset) -- the arrays after every pending kernel ran (raising
        the errors they recorded); an empty cache has no arrays (None in their places), a cache without the key
        offset None in its place."""
        arrays = (None, None, None) if self.fmkv is None else self.fmkv.storage()
        return (*arrays, *self._scalars(), self.key_mu)

    @state.setter
    def state(self, v) -> None:
        pages, fk, fv, *scalars = v
        key_mu = None
        if len(scalars) == len(_STATE_SCALARS) + 1:
            scalars, key_mu = scalars[:-1], scalars[-1]
        elif len(scalars) == len(_STATE_SCALARS_NO_SCALE_GROUP) + 1:
            scalars, key_mu = [*scalars[:-1], 0], scalars[-1]
        elif len(scalars) == len(_STATE_SCALARS_NO_OFFSET):
            scalars = [*scalars, 0, 0]
        elif len(scalars) == len(_STATE_SCALARS_V2):
            scalars = [*scalars, 2, 0, 0]
        if len(scalars) != len(_STATE_SCALARS):
            raise FmkvError(f"FmkvKVCache state: {len(scalars)} scalars, expected {len(_STATE_SCALARS)}")
        vals = dict(zip(_STATE_SCALARS, scalars))
        FmkvKVCache.__init__(self, k_bits=int(vals["k_bits"]), v_bits=int(vals["v_bits"]),
                             window_tokens=int(vals["window_tokens"]), sink_tokens=int(vals["sink_tokens"]),
                             page_size=int(vals["page_size"]), max_tokens=int(vals["max_tokens"]),
                             scale_rule=str(vals["scale_rule"]), seed=int(vals["seed"]), layer=int(vals["layer"]),
                             prefill=str(vals["prefill"]), format_version=int(vals["format_version"]),
                             key_offset=bool(int(vals["key_offset"])), scale_group=int(vals["scale_group"]),
                             runtime=getattr(self, "runtime", None),
                             **getattr(self, "gpu_options", {}))
        if pages is None:
            return
        self._allocate(int(vals["batch"]), int(vals["num_kv_heads"]), int(vals["head_dim"]))
        self.fmkv.load_storage(pages, fk, fv, int(vals["offset"]))
        self.offset = int(vals["offset"])
        if self.key_offset and self.offset > 0:
            if key_mu is None or tuple(key_mu.shape) != (self.batch, self.num_kv_heads, 1, self.head_dim):
                raise FmkvError(f"FmkvKVCache state: a cache with the key offset needs its offset array "
                                f"[{self.batch}, {self.num_kv_heads}, 1, {self.head_dim}], got "
                                f"{None if key_mu is None else tuple(key_mu.shape)}")
            self.key_mu = key_mu

    @property
    def meta_state(self):
        """The scalars of ``state`` as strings (mlx-lm versions that keep them apart from the arrays)."""
        return tuple(str(x) for x in self._scalars())


def _wrap_sdpa(original):
    if getattr(original, "_fmkv_wrapped", False):
        return original

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(keys, _Compressed):
            return keys.cache.attention(queries, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._fmkv_wrapped = True
    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def install(model=None) -> None:
    """Route mlx-lm's attention through fmkv for FmkvKVCache layers (idempotent): wraps
    ``scaled_dot_product_attention`` in mlx_lm.models.base and in every loaded ``mlx_lm.models.*``
    module (and ``model``'s own module) that imported it, and registers FmkvKVCache in
    mlx_lm.models.cache for load_prompt_cache."""
    original = getattr(_base.scaled_dot_product_attention, "__wrapped__", _base.scaled_dot_product_attention)
    wrapped = _wrap_sdpa(_base.scaled_dot_product_attention)
    _base.scaled_dot_product_attention = wrapped
    mods = [m for name, m in list(sys.modules.items()) if name.startswith("mlx_lm.models.") and m is not None]
    if model is not None and type(model).__module__ in sys.modules:
        mods.append(sys.modules[type(model).__module__])
    for m in mods:
        if getattr(m, "scaled_dot_product_attention", None) is original:
            m.scaled_dot_product_attention = wrapped
    _cache.FmkvKVCache = FmkvKVCache


def make_prompt_cache(model, layer_bits=None, **options) -> List[FmkvKVCache]:
    """One FmkvKVCache per layer of an mlx-lm model (options: FmkvKVCache's; ``layer`` is set per
    layer), after :func:`install`. ``layer_bits``: a (k_bits, v_bits) pair per layer (e.g. the ``layer_bits`` of
    an ``fmkv-eval plan`` budget plan) instead of ``k_bits`` / ``v_bits``. Widths per kv head (``head_bits``,
    fmkv.hf's width groups) are not an option here."""
    if "head_bits" in options:
        raise FmkvError("fmkv.mlx.lm.make_prompt_cache: head_bits (widths per kv head) is an fmkv.hf option; "
                        "fmkv.mlx takes one width pair per layer (layer_bits)")
    if layer_bits is not None and ({"k_bits", "v_bits"} & set(options)):
        raise FmkvError("fmkv.mlx.lm.make_prompt_cache: layer_bits and k_bits / v_bits both choose the widths; "
                        "pass one of them")
    if hasattr(model, "make_cache"):  # e.g. llama: KVCache for full attention, RotatingKVCache for sliding layers
        kinds = sorted({type(c).__name__ for c in model.make_cache()} - {"KVCache"})
        if kinds:
            raise FmkvError(f"{type(model).__name__} has {', '.join(kinds)} layers; FmkvKVCache replaces "
                            f"full-attention KVCache layers only")
    layers = getattr(model, "layers", None)
    if layers is None:
        raise FmkvError(f"{type(model).__name__} has no .layers")
    if layer_bits is not None:
        pairs = list(layer_bits)
        if len(pairs) != len(layers):
            raise FmkvError(f"layer_bits has {len(pairs)} entries for a model of {len(layers)} layers")
        pairs = [_args.width_pair(f"layer_bits[{i}]", p) for i, p in enumerate(pairs)]
    install(model)
    options.pop("layer", None)
    if layer_bits is None:
        return [FmkvKVCache(layer=i, **options) for i in range(len(layers))]
    return [FmkvKVCache(layer=i, k_bits=kb, v_bits=vb, **options) for i, (kb, vb) in enumerate(pairs)]

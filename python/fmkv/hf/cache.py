"""FmkvCache: the dynamic compressed cache for eager use (generate(), forward calls, evaluation).

    cache = fmkv.hf.FmkvCache(model.config, k_bits=3, v_bits=3)     # window_tokens=64 by default
    out = model.generate(ids, **fmkv.hf.cache_kwargs(cache), max_new_tokens=32)
    print(cache.resident_bytes, cache.fp16_equivalent_bytes())

* Each full-attention layer stores its K/V compressed in torch tensors on the model's device (the
  device of the first key tensor, or ``device=``): a page pool plus the fp16 sink/window regions,
  written and read by ``torch.ops.fmkv.append`` / ``attention`` (fmkv.torch_ops). CPU models use
  the host backend ('cpu', else 'ref'); CUDA models the 'cuda' backend, on device memory, with no
  host-device copy or synchronisation per step. ``device="cpu"`` with a CUDA model keeps the cache
  in host memory and copies each step's K/V/Q there explicitly.
* Prefill (a chunk with no cached past) attends the chunk at full precision while writing the
  compressed cache; every later step (decode, or a prefill chunk with a cached past) runs the fused
  kernel on the compressed cache (causal for multi-row queries). ``prefill="compressed"`` makes the
  first chunk read the compressed cache too.
* Sliding-window layers (Gemma 3, Mistral with a window, ...) keep transformers' fp16
  ``DynamicSlidingWindowLayer``: their size is bounded by the window.
* Options: asymmetric ``k_bits`` / ``v_bits`` (K may be 16 = fp16), ``window_tokens`` (recent
  tokens kept in fp16, default 64: measured to matter most, see docs/EVAL.md; pass 0 to compress
  every token), ``sink_tokens``, ``boundary_layers`` (first/last N layers at ``boundary_k_bits`` /
  ``boundary_v_bits``) or ``layer_bits`` (a (k_bits, v_bits) pair per layer, e.g. a budget plan of
  ``fmkv-eval plan``) or ``head_bits`` (a pair per kv head of every layer: ``fmkv-eval plan --per-head``;
  a layer with several pairs is one layer per pair over its heads, fmkv.hf.head_groups), ``scale_rule`` ('lsq' default, or 'rms'), rotation ``seed``, ``format_version``
  (0: the library's default; 3: format 3's 3-bit codes), ``scale_group`` (rotated coordinates per fp16 scale:
  0 = the default ``fmkv.format.SCALE_GROUP``, or one of ``fmkv.format.SCALE_GROUPS``; 64 saves 2 bytes per 64
  coordinates of each token and head; every backend has it), ``key_offset`` (keys minus their mean over each
  sequence's first 128 tokens, fixed by the first chunk: softmax ignores it, the codes see centred keys; refused for a
  model that softcaps its attention logits, where it would not cancel;
  fmkv.key_offset), ``backend`` (default: the device's), ``device``.
* The host keeps each layer's length (a Python int: it plans each CUDA call for the actual length),
  so a step is not capturable in a CUDA graph; fmkv.hf.FmkvStaticCache is the graph-capturable form.

Limits: batches must not be padded (the kernel takes no padding mask; FmkvStaticCache takes
left-padded batches), no beam search / cache cropping; page pools are allocated up front for
``max_cache_len`` tokens per sequence.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

import fmkv
from fmkv import format as _format
from fmkv.key_offset import first_tokens_mean

from .attention import use_fmkv_attention
from .compat import (Cache, CacheLayerMixin, DynamicSlidingWindowLayer, FixedLayerOps, layer_types, require_attention,
                     text_config)
from .head_groups import HeadGroups, cache_widths, width_groups

__all__ = ["FmkvCache", "FmkvLayer", "FmkvHeadGroupLayer", "DEFAULT_WINDOW_TOKENS", "layer_seed",
           "pages_per_sequence"]

# Recent tokens kept in fp16 by default. docs/EVAL.md: the error on the last few dozen tokens
# dominates; a 32-token window takes k4v4 from +4.8% to +0.9% perplexity and 64 tokens take k3v3
# (the default bits) from +21.5% to +2.8% (k3v3-w32: +3.5%, misses the +3% target). 64 meets both
# targets (k4v4 with 64 lies between w32 +0.91% and w128 +0.58%) and costs 64 fp16 tokens per
# sequence per layer, amortised to nothing at long context.
DEFAULT_WINDOW_TOKENS = 64


def layer_seed(seed: int, layer: int) -> int:
    """Seed whose layer-0 rotation signs equal those of (seed, layer) (FORMAT.md section 3; the
    library's rule, fmkv.format.layer_seed).

    Each FmkvLayer owns a one-layer fmkv.Cache; this keeps its bytes identical to a
    multi-layer cache with ``seed`` (and to fmkv.torch_quant with (seed, layer))."""
    return _format.layer_seed(seed, layer)


class FmkvLayer(FixedLayerOps, CacheLayerMixin):
    """One decoder layer's compressed K/V in torch tensors on the model's device, one sequence per
    batch row, driven by ``torch.ops.fmkv.append`` / ``attention`` (fmkv.torch_ops).

    Storage, allocated at the first update: page pool uint8 [batch * pages_per_seq, page_bytes]
    (pages for ``max_cache_len`` tokens per sequence), fp16 sink/window regions
    [batch, kv_heads, sink + window, head_dim]. The block table is static (sequence i owns pages
    [i * pages_per_seq, (i + 1) * pages_per_seq)), lengths live on the device ([batch] int64,
    advanced by an in-place add) and the host keeps only ``self.length``: a decode step does no
    host-device copy and no synchronisation.

    Decode steps (a chunk of at most ``fmkv.torch_ops.FUSED_MAX_ROWS`` tokens after the first) are
    one call per layer when ``fused`` (the default): ``update`` keeps the chunk's K/V and the "fmkv"
    attention function runs ``torch.ops.fmkv.append_attention`` (on CUDA one attention launch, no
    separate append); pages and fp16 regions are bit-identical to the two-call path (append in
    ``update``, then ``attention``), which ``fused=False`` selects. K/V kept by an ``update`` whose
    attention never came are appended before anything else touches the layer.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, k_bits: int = 3, v_bits: int = 3, max_cache_len: int = 4096,
                 page_size: int = 64, sink_tokens: int = 0, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                 scale_rule: str = "lsq", seed: int = 0, backend: Optional[str] = None,
                 prefill: str = "full", device=None, fused: bool = True, format_version: int = 0,
                 key_offset: bool = False, scale_group: int = 0):
        super().__init__()
        self.fused = bool(fused)
        self.scale_group = int(scale_group)
        self.key_offset = bool(key_offset)
        self.key_mu: Optional[torch.Tensor] = None  # [batch, kv_heads, 1, head_dim] (key_offset): set by the first chunk
        self.format_version = int(format_version)
        self._pending = None  # (k rows, v rows, n) of a decode chunk update() kept for the fused step
        self.layer_idx = int(layer_idx)
        self.k_bits, self.v_bits = int(k_bits), int(v_bits)
        self.max_cache_len = int(max_cache_len)
        self.page_size = int(page_size)
        self.sink_tokens, self.window_tokens = int(sink_tokens), int(window_tokens)
        self.scale_rule = scale_rule
        self.seed = int(seed)
        self.backend = backend
        self.prefill = prefill
        self.storage_device = None if device is None else torch.device(device)
        self.batch = 0
        self.pages: Optional[torch.Tensor] = None
        self.length = 0
        self.dtype = torch.float32

    def __repr__(self) -> str:
        return (f"FmkvLayer(layer={self.layer_idx}, k{self.k_bits}v{self.v_bits}, len={self.length}, "
                f"sink={self.sink_tokens}, window={self.window_tokens}, device={self.storage_device}"
                + (", key_offset" if self.key_offset else "") + ")")

    @property
    def seqs(self) -> List[int]:
        """Sequence index of each batch row (row i is sequence i)."""
        return list(range(self.batch))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        from .. import torch_ops

        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        dev = self.storage_device if self.storage_device is not None else key_states.device
        self.backend_name = torch_ops.backend_for_device(dev, self.backend, f"FmkvCache layer {self.layer_idx}")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.storage_device = dev
        self.config = fmkv.Config(head_dim=d, num_kv_heads=h, k_bits=self.k_bits, v_bits=self.v_bits,
                                  page_size=self.page_size, sink_tokens=self.sink_tokens,
                                  window_tokens=self.window_tokens, scale_rule=self.scale_rule,
                                  seed=layer_seed(self.seed, self.layer_idx), format_version=self.format_version,
                                  scale_group=self.scale_group)
        require_attention(self.backend_name, self.config, f"FmkvCache layer {self.layer_idx}")
        self._cfg = torch_ops.config_to_list(self.config)
        pps = pages_per_sequence(self.max_cache_len, self.sink_tokens, self.page_size)
        R = self.sink_tokens + self.window_tokens
        self.pages_per_seq = pps
        self.batch = b
        self.pages = torch.zeros(b * pps, self.config.page_bytes, dtype=torch.uint8, device=dev)
        self.fp16_k = torch.zeros(b, h, R, d, dtype=torch.float16, device=dev)
        self.fp16_v = torch.zeros(b, h, R, d, dtype=torch.float16, device=dev)
        self.block_table = torch.arange(b * pps, dtype=torch.int32, device=dev).view(b, pps)
        self.slots = torch.arange(b, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(b, dtype=torch.int64, device=dev)
        self._offsets: Dict[int, torch.Tensor] = {}
        self.length = 0
        self.is_initialized = True

    def _row_offsets(self, n: int) -> torch.Tensor:
        t = self._offsets.get(n)
        if t is None:  # [0, n, 2n, ...]: made on the device, cached per chunk length
            t = torch.arange(self.batch + 1, dtype=torch.int64, device=self.storage_device) * n
            self._offsets[n] = t
        return t

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h, n, d] -> [b * n, h, d] rows on the storage device (a view when b == 1)."""
        x = x.detach()
        if x.device != self.storage_device:  # explicit device= offload (documented), never implicit
            x = x.to(self.storage_device)
        b, h, n, d = x.shape
        x = x.transpose(1, 2)
        return x[0] if b == 1 else x.reshape(b * n, h, d)

    def _append(self, k_rows: torch.Tensor, v_rows: torch.Tensor, n: int) -> None:
        with torch.no_grad():
            torch.ops.fmkv.append(self.pages, self.fp16_k, self.fp16_v, k_rows, v_rows, self.slots, self.lens,
                                  self._row_offsets(n), self.block_table, self._cfg, 0, self.backend_name)
            self.lens.add_(n)

    def flush(self) -> None:
        """Append the K/V a fused decode step kept (update() without its attention call yet)."""
        if self._pending is not None:
            k_rows, v_rows, n = self._pending
            self._pending = None
            try:
                self._append(k_rows, v_rows, n)
            except BaseException:
                self.length -= n  # update() counted the kept chunk; the failed append left the cache as it was
                raise

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush()
        b, _, n, _ = key_states.shape
        if b != self.batch:
            raise fmkv.FmkvError(f"batch size changed from {self.batch} to {b}")
        if self.length + n > self.max_cache_len:
            raise fmkv.FmkvError(f"cache full: {self.length} + {n} tokens > max_cache_len {self.max_cache_len}")
        from .. import torch_ops

        new_mu = None
        keys = key_states
        if self.key_offset:  # the first chunk fixes the offset; it is kept only once that chunk is stored
            if self.key_mu is None:
                new_mu = first_tokens_mean(key_states).to(key_states.dtype)
            keys = key_states - (new_mu if new_mu is not None else self.key_mu.to(key_states.device, key_states.dtype))
        k_rows, v_rows = self._rows(keys), self._rows(value_states)
        if self.fused and self.length > 0 and n <= torch_ops.FUSED_MAX_ROWS:
            self._pending = (k_rows, v_rows, n)  # appended by attention() in the same call (fused step)
        else:
            self._append(k_rows, v_rows, n)
        if new_mu is not None:
            self.key_mu = new_mu
        past = self.length
        self.length += n
        # The chunk's own K/V go to the attention function, tagged with this layer: it attends them
        # directly on prefill and calls the fused kernel on the compressed cache otherwise.
        key_states = key_states.view_as(key_states)
        key_states._fmkv_layer = (self, past)
        return key_states, value_states

    def attention(self, query: torch.Tensor, scaling: Optional[float], softcap: Optional[float]) -> torch.Tensor:
        """Fused attention of query [b, hq, n, d] (the last n appended tokens) -> [b, n, hq, d]. Every
        row of the batch holds self.length tokens (update() counted the n new ones): the call passes it
        as max_seq_len, so CUDA plans the split count for the actual length."""
        b, hq, n, d = query.shape
        scale, cap = 0.0 if scaling is None else float(scaling), float(softcap or 0.0)
        if self._pending is not None and self._pending[2] != n:  # (not a query per kept token)
            self.flush()
        with torch.no_grad():
            if self._pending is not None:  # fused decode step: append the kept K/V and attend, one call
                k_rows, v_rows, _ = self._pending
                self._pending = None
                try:
                    out = torch.ops.fmkv.append_attention(self.pages, self.fp16_k, self.fp16_v, k_rows, v_rows,
                                                          self._rows(query), self.slots, self.lens, self._row_offsets(n),
                                                          self.block_table, self._cfg, 0, scale, cap, self.backend_name,
                                                          self.length)
                except BaseException:
                    self.length -= n  # the fused step appended nothing: back to the length before update()
                    raise
                self.lens.add_(n)
            else:
                out = torch.ops.fmkv.attention(self.pages, self.fp16_k, self.fp16_v, self._rows(query), self.slots,
                                               self.lens, self._row_offsets(n), self.block_table, self._cfg, 0,
                                               scale, cap, self.backend_name, self.length)
        return out.view(b, n, hq, d).to(device=query.device, dtype=query.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    @property
    def resident_bytes(self) -> int:
        """Bytes of storage allocated on the device: page pool + fp16 sink/window regions."""
        if self.pages is None:
            return 0
        return sum(t.untyped_storage().nbytes() for t in (self.pages, self.fp16_k, self.fp16_v))

    @property
    def index_bytes(self) -> int:
        """Bytes of the device-side bookkeeping: block table, lengths, slots, row offsets."""
        if self.pages is None:
            return 0
        return sum(t.untyped_storage().nbytes() for t in (self.block_table, self.slots, self.lens,
                                                           *self._offsets.values(),
                                                           *([] if self.key_mu is None else [self.key_mu])))

    @property
    def used_bytes(self) -> int:
        """Bytes of the pages holding compressed tokens plus the fp16 regions (as fmkv.Cache.used_bytes)."""
        if self.pages is None:
            return 0
        c = self.config
        comp = max(0, self.length - c.sink_tokens - c.window_tokens)
        return self.batch * (math.ceil(comp / c.page_size) * c.page_bytes + c.fp16_slot_bytes)

    def reset(self) -> None:
        self._pending = None
        if self.pages is not None:
            self.lens.zero_()
        self.length = 0
        self.key_mu = None



class FmkvHeadGroupLayer(HeadGroups, FixedLayerOps, CacheLayerMixin):
    """One decoder layer whose kv heads have different widths (``head_bits``): an :class:`FmkvLayer` per distinct
    (k_bits, v_bits) pair over its kv heads (fmkv.hf.head_groups). ``update`` hands each group its heads' K/V;
    the attention runs each group over its query heads and merges the outputs in head order."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    @property
    def prefill(self) -> str:
        return self.parts[0][0].prefill

    @property
    def length(self) -> int:
        return self.parts[0][0].length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self._check_heads(key_states, "K")
        self._check_heads(value_states, "V")
        self._check_values(key_states, "K", True)
        self._check_values(value_states, "V", True)
        past = self.length
        done = []
        try:
            for layer, k, v in zip(self.layers, self._split(key_states), self._split(value_states)):
                layer.update(k, v)
                done.append(layer)
        except BaseException:
            for layer in done:  # groups that took the chunk give it back only if it is still kept for the fused step
                if layer._pending is not None:
                    layer._pending = None
                    layer.length = past
            raise
        self.is_initialized = True
        key_states = key_states.view_as(key_states)
        key_states._fmkv_layer = (self, past)
        return key_states, value_states

    def attention(self, query: torch.Tensor, scaling: Optional[float], softcap: Optional[float]) -> torch.Tensor:
        """Each group's attention over its query heads, merged into [b, n, hq, d]."""
        try:
            self._check_heads(query, "query", self.num_kv_heads * self.q_per_kv)
            self._check_values(query, "query", False)
        except BaseException:  # as a failed fused step of one FmkvLayer: the kept K/V are dropped, lengths restored
            for layer in self.layers:
                if layer._pending is not None:
                    layer.length -= layer._pending[2]
                    layer._pending = None
            raise
        calls = [lambda layer=layer, q=q: layer.attention(q, scaling, softcap)
                 for layer, q in zip(self.layers, self._split(query, True))]
        return self._merge(self._concurrently(self.layers[0].storage_device or query.device, calls))

    def flush(self) -> None:
        for layer in self.layers:
            layer.flush()

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.parts[0][0].max_cache_len



def pages_per_sequence(max_cache_len: int, sink_tokens: int, page_size: int) -> int:
    """Pages each sequence slot of a layer gets for ``max_cache_len`` tokens (at least one)."""
    return max(1, math.ceil(max(0, int(max_cache_len) - int(sink_tokens)) / int(page_size)))


class FmkvCache(Cache):
    """transformers Cache whose full-attention layers hold compressed fmkv storage."""

    def __init__(self, config, k_bits: int = 3, v_bits: int = 3, max_cache_len: int = 4096,
                 page_size: int = 64, sink_tokens: int = 0, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                 boundary_layers: int = 0, boundary_k_bits: int = 16, boundary_v_bits: int = 4,
                 scale_rule: str = "lsq", seed: int = 0, backend: Optional[str] = None,
                 prefill: str = "full", set_attention: bool = True, device=None, fused: bool = True,
                 format_version: int = 0, layer_bits=None, head_bits=None, key_offset: bool = False,
                 scale_group: int = 0):
        if prefill not in ("full", "compressed"):
            raise ValueError("prefill must be 'full' or 'compressed'")
        scale_group = fmkv.Config(scale_group=scale_group).scale_group  # checked now, not at the first update
        text = text_config(config)
        types = layer_types(text)
        n = len(types)
        q_heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
        heads, widths = cache_widths(n, kv_heads, k_bits, v_bits, boundary_layers, boundary_k_bits, boundary_v_bits,
                                     layer_bits, head_bits)
        layers = []
        for i, t in enumerate(types):
            if t == "sliding_attention" and getattr(text, "sliding_window", None):
                layers.append(DynamicSlidingWindowLayer(sliding_window=int(text.sliding_window)))
                continue
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"layer {i}: type {t!r} is not supported by FmkvCache")
            groups = width_groups(heads[i]) if heads is not None else [(widths[i], None)]
            parts = [(FmkvLayer(i, kb, vb, max_cache_len, page_size, sink_tokens, window_tokens, scale_rule, seed,
                                backend, prefill, device, fused, format_version, key_offset, scale_group), h)
                     for (kb, vb), h in groups]
            layers.append(parts[0][0] if len(parts) == 1 else FmkvHeadGroupLayer(i, parts, kv_heads,
                                                                                   q_heads // kv_heads))
        super().__init__(layers=layers)
        self._max_cache_len = int(max_cache_len)
        self.layer_widths = [tuple(w) for w in widths]  # (k_bits, v_bits) of each layer (the widest group's)
        head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // q_heads)
        self.geometry = dict(num_layers=n, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)  # what save records
        self.options = dict(k_bits=k_bits, v_bits=v_bits, page_size=page_size, sink_tokens=sink_tokens,
                            window_tokens=window_tokens, boundary_layers=boundary_layers,
                            scale_rule=scale_rule, seed=seed, prefill=prefill, backend=backend,
                            device=None if device is None else str(device), fused=fused,
                            format_version=format_version, layer_bits=None if layer_bits is None else widths,
                            head_bits=heads, key_offset=bool(key_offset), scale_group=scale_group)
        if set_attention:
            use_fmkv_attention(config)

    def save(self, path: Any) -> None:
        """Write this cache (options, tokens of every fmkv layer) to the directory ``path`` (fmkv.hf.persist):
        snapshot files of docs/FILE-FORMAT.md, one per fmkv layer, and a manifest; replaced whole if it exists."""
        from .persist import save_cache

        save_cache(self, path)

    @classmethod
    def load(cls, path: Any, config: Any, device: Any = None, set_attention: bool = True) -> "FmkvCache":
        """A cache for the model ``config`` holding what :meth:`save` wrote to ``path``, with the saved options
        (``device=`` overrides where the storage goes; default: where it was, CUDA on the current device)."""
        from .persist import load_cache

        return load_cache(cls, path, config, device, set_attention)

    @property
    def max_cache_len(self) -> int:
        """Tokens per sequence the page pools hold (a read-only property of Cache in newer
        transformers, so it is defined here rather than assigned)."""
        return self._max_cache_len

    @property
    def fmkv_layers(self) -> List[FmkvLayer]:
        """Every FmkvLayer, the width groups of FmkvHeadGroupLayers included."""
        out = []
        for layer in self.layers:
            out += layer.layers if isinstance(layer, FmkvHeadGroupLayer) else [layer] if isinstance(layer, FmkvLayer) else []
        return out

    def check(self) -> None:
        """Raise the first error fmkv's CUDA kernels detected on this cache's device(s) since the
        last check (waits for the device); nothing to do for a host cache."""
        from .. import torch_ops

        for layer in self.fmkv_layers:
            layer.flush()
        for dev in sorted({str(layer.storage_device) for layer in self.fmkv_layers
                           if layer.pages is not None and layer.storage_device.type == "cuda"}):
            torch_ops.cuda_check(dev)

    @property
    def device_bytes(self) -> int:
        """resident_bytes plus the device-side bookkeeping (block tables, lengths, slots)."""
        return self.resident_bytes + sum(layer.index_bytes for layer in self.fmkv_layers)

    @property
    def resident_bytes(self) -> int:
        """Allocated bytes: compressed page pools + fp16 regions (tensor storage on the cache's
        device), plus fp16 sliding-window layers."""
        total = sum(layer.resident_bytes for layer in self.fmkv_layers)
        for layer in self.layers:
            if not isinstance(layer, (FmkvLayer, FmkvHeadGroupLayer)) and getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    @property
    def used_bytes(self) -> int:
        """Bytes of pages held by the sequences + fp16 regions (+ sliding layers)."""
        total = sum(layer.used_bytes for layer in self.fmkv_layers)
        for layer in self.layers:
            if not isinstance(layer, (FmkvLayer, FmkvHeadGroupLayer)) and getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    def fp16_equivalent_bytes(self) -> int:
        """Bytes the same tokens would take in an fp16 DynamicCache (K and V, all layers)."""
        total = 0
        for layer in self.fmkv_layers:
            if layer.pages is not None:
                c = layer.config
                total += 2 * 2 * c.num_kv_heads * c.head_dim * layer.length * layer.batch
        for layer in self.layers:
            if not isinstance(layer, (FmkvLayer, FmkvHeadGroupLayer)) and getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * 2 * 2
        return total

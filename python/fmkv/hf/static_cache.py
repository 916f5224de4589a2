"""FmkvStaticCache: a static-shape compressed cache whose decode step is capturable in one CUDA graph.

    cache = fmkv.hf.FmkvStaticCache(model.config, max_cache_len=4096, k_bits=4, v_bits=4)
    out = model.generate(ids, attention_mask=mask, **fmkv.hf.cache_kwargs(cache), max_new_tokens=64,
                         compile_config=transformers.CompileConfig(fullgraph=True))   # CUDA: compiled decode
    # or: step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) after an eager prefill

The layout of transformers' StaticCache with fmkv storage:

* Everything is allocated up front, on the model's device, at the first update (or at construction
  when ``batch_size`` and ``device`` are given): per full-attention layer a page pool with pages for
  ``max_cache_len`` tokens per sequence slot, the fp16 sink/window regions, a static block table
  (slot i owns pages [i * pages_per_seq, (i + 1) * pages_per_seq)), the per-sequence lengths and the
  timeline length (``cumulative_length``, as StaticLayer's) as device tensors, marked as static
  addresses for torch.compile / CUDA graphs.
* A decode step (at most ``fmkv.torch_ops.FUSED_MAX_ROWS`` tokens per sequence after the prompt) is one
  ``torch.ops.fmkv.append_attention`` per layer plus in-place adds of the lengths: no host bookkeeping,
  no host-device copy or synchronisation, every shape and argument fixed (the call's length bound is
  ``max_cache_len``). The step is therefore capturable as a whole: ``torch.compile(mode=
  "reduce-overhead")`` of the model's forward, transformers' compiled decoding in generate() (the
  cache is ``is_compileable``), or a ``torch.cuda.CUDAGraph`` of an eager step.
* Positions come from the model (transformers passes ``position_ids``; the mask's query offset is the
  device timeline length), as for StaticCache.
* Prompts of different lengths: left-padded batches (generate()'s layout). A prompt chunk runs eagerly:
  its real tokens are read from the attention mask (padding is never stored), so each sequence holds
  only its own tokens and the kernel reads its own length. The first chunk is attended at full
  precision while it is written compressed (``prefill="compressed"``: read back from the cache);
  later chunks read the compressed cache. Chunks may synchronise with the host (they read the mask).
* Sliding-window layers keep transformers' fp16 ``StaticSlidingWindowLayer``.
* A sequence longer than ``max_cache_len`` is an error (on CUDA raised by ``check()``). No beam search,
  cropping or batch reordering. ``reset()`` empties the cache for the next batch of the same size
  (keep the object: a compiled or captured step is bound to its tensors).
* ``save(dir)`` / ``FmkvStaticCache.load(dir, model.config)``: the cache written to a directory and read back
  into a new one, allocated at once with the saved batch size, each sequence's tokens and the timeline as they
  were (fmkv.hf.persist; prompt caching across processes).
"""
from __future__ import annotations

import itertools
import math
from typing import List, Optional

import torch

import fmkv
from fmkv.key_offset import first_tokens_mean

from .attention import use_fmkv_attention
from .cache import DEFAULT_WINDOW_TOKENS, layer_seed, pages_per_sequence
from .compat import Cache, CacheLayerMixin, FixedLayerOps, layer_types, require_attention, text_config
from .head_groups import HeadGroups, cache_widths, width_groups

try:
    from transformers.cache_utils import StaticSlidingWindowLayer
except ImportError as e:  # pragma: no cover
    raise ImportError(f"fmkv.hf.FmkvStaticCache needs transformers' StaticSlidingWindowLayer ({e})") from None

__all__ = ["FmkvStaticCache", "FmkvStaticLayer", "FmkvStaticHeadGroupLayer"]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[b, h, n, d] -> [b * n, h, d] (a view for transformers' projections, whose K/Q/V are laid out
    [b, n, h, d] in memory)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, h, d)


class FmkvStaticLayer(FixedLayerOps, CacheLayerMixin):
    """One decoder layer of an :class:`FmkvStaticCache`: compressed K/V of ``batch_size`` sequence slots,
    ``max_cache_len`` tokens each, in tensors allocated once (see the module docstring)."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    _cache_name = "FmkvStaticCache"

    def __init__(self, layer_idx: int, max_cache_len: int, k_bits: int = 3, v_bits: int = 3, page_size: int = 64,
                 sink_tokens: int = 0, window_tokens: int = DEFAULT_WINDOW_TOKENS, scale_rule: str = "lsq",
                 seed: int = 0, backend: Optional[str] = None, prefill: str = "full", format_version: int = 0,
                 key_offset: bool = False, scale_group: int = 0):
        super().__init__()
        self.format_version = int(format_version)
        self.scale_group = int(scale_group)
        self.key_offset = bool(key_offset)
        self.key_mu: Optional[torch.Tensor] = None  # [batch, kv_heads, 1, head_dim] (key_offset), zeros until set
        self._mu_set: List[bool] = []  # host: which sequences' offsets their first chunk has set
        if prefill not in ("full", "compressed"):
            raise ValueError("prefill must be 'full' or 'compressed'")
        self.layer_idx = int(layer_idx)
        self.max_cache_len = int(max_cache_len)
        if self.max_cache_len < 1:
            raise fmkv.FmkvError(f"max_cache_len must be >= 1, got {max_cache_len}")
        self.k_bits, self.v_bits = int(k_bits), int(v_bits)
        self.page_size = int(page_size)
        self.sink_tokens, self.window_tokens = int(sink_tokens), int(window_tokens)
        self.scale_rule = scale_rule
        self.seed = int(seed)
        self.backend = backend
        self.prefill = prefill
        self.pages: Optional[torch.Tensor] = None
        # Tokens of the padded timeline (prompt width + decoded tokens), on the device after allocation:
        # transformers reads it for positions and masks (get_seq_length / get_query_offset).
        self.cumulative_length = torch.zeros((), dtype=torch.int64)
        self.filled = False  # host flag, set once by the first chunk (or write()), cleared by reset()
        self._awaiting = False  # eager update() whose attention has not come yet

    def __repr__(self) -> str:
        return (f"FmkvStaticLayer(layer={self.layer_idx}, k{self.k_bits}v{self.v_bits}, "
                f"max_cache_len={self.max_cache_len}, sink={self.sink_tokens}, window={self.window_tokens}, "
                f"batch={getattr(self, 'batch_size', None)}" + (", key_offset" if self.key_offset else "") + ")")

    def make_config(self, num_kv_heads: int, head_dim: int) -> fmkv.Config:
        return fmkv.Config(head_dim=int(head_dim), num_kv_heads=int(num_kv_heads), k_bits=self.k_bits,
                           v_bits=self.v_bits, page_size=self.page_size, sink_tokens=self.sink_tokens,
                           window_tokens=self.window_tokens, scale_rule=self.scale_rule,
                           seed=layer_seed(self.seed, self.layer_idx), format_version=self.format_version,
                           scale_group=self.scale_group)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate every tensor for key_states' batch, heads, head_dim and device (also the entry point of
        transformers' ``Cache.early_initialization``)."""
        from .. import torch_ops

        b, h, _, d = key_states.shape
        dev = key_states.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.backend_name = torch_ops.backend_for_device(dev, self.backend, f"FmkvStaticCache layer {self.layer_idx}")
        self.config = self.make_config(h, d)
        require_attention(self.backend_name, self.config, f"FmkvStaticCache layer {self.layer_idx}")
        self._cfg = torch_ops.config_to_list(self.config)
        self.device = dev
        self.dtype = key_states.dtype
        self.batch_size, self.num_heads, self.head_dim = int(b), int(h), int(d)
        pps = pages_per_sequence(self.max_cache_len, self.sink_tokens, self.page_size)
        R = self.sink_tokens + self.window_tokens
        self.pages_per_seq = pps
        self.pages = torch.zeros(b * pps, self.config.page_bytes, dtype=torch.uint8, device=dev)
        self.fp16_k = torch.zeros(b, h, R, d, dtype=torch.float16, device=dev)
        self.fp16_v = torch.zeros(b, h, R, d, dtype=torch.float16, device=dev)
        self.block_table = torch.arange(b * pps, dtype=torch.int32, device=dev).view(b, pps)
        self.slots = torch.arange(b, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(b, dtype=torch.int64, device=dev)
        self.cumulative_length = self.cumulative_length.to(dev)
        # row offsets [0, n, 2n, ...] of every step shape (n = 1 .. FUSED_MAX_ROWS rows per sequence)
        self._offsets = [torch.arange(b + 1, dtype=torch.int64, device=dev) * n
                         for n in range(torch_ops.FUSED_MAX_ROWS + 1)]
        if self.key_offset:
            self.key_mu = torch.zeros(b, h, 1, d, dtype=key_states.dtype, device=dev)
            self._mu_set = [False] * b
        if not _compiling():  # fixed data pointers: no recompilation, no cudagraph skip on their in-place updates
            for t in (self.pages, self.fp16_k, self.fp16_v, self.block_table, self.slots, self.lens,
                      self.cumulative_length, *self._offsets, *([self.key_mu] if self.key_offset else [])):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    # ------------------------------------------------------------------ transformers' layer interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Advance the timeline and hand the chunk's K/V to the attention function (tagged with this
        layer): the "fmkv" attention writes them (with the step's attention, in one call when decoding)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not _compiling():
            self._check_chunk(key_states)
            self._awaiting = True
        self.cumulative_length.add_(key_states.shape[-2])
        key_states = key_states.view_as(key_states)
        key_states._fmkv_static = self
        return key_states, value_states

    def _check_chunk(self, key_states: torch.Tensor) -> None:
        b, h, n, d = key_states.shape
        if self._awaiting:
            raise fmkv.FmkvError(
                f"FmkvStaticCache layer {self.layer_idx}: the previous chunk's attention did not run through the "
                f"'fmkv' attention (its K/V were never stored); the model's attention must be 'fmkv' "
                f"(FmkvStaticCache(set_attention=True) sets it)")
        if (b, h, d) != (self.batch_size, self.num_heads, self.head_dim):
            raise fmkv.FmkvError(
                f"FmkvStaticCache layer {self.layer_idx}: K/V of shape [batch {b}, kv heads {h}, head_dim {d}] "
                f"but the cache was allocated for [{self.batch_size}, {self.num_heads}, {self.head_dim}] "
                f"(make a new cache for another batch size)")
        if key_states.device != self.device:
            raise fmkv.FmkvError(f"FmkvStaticCache layer {self.layer_idx}: K/V on '{key_states.device}' but the "
                                 f"cache lives on '{self.device}'")

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  scaling: Optional[float], softcap: Optional[float]) -> Optional[torch.Tensor]:
        """Attention of query [b, hq, n, d] over this layer after storing the chunk's key/value
        [b, h, n, d] -> [b, n, hq, d]; None when the chunk is to be attended at full precision by the
        caller (the first chunk with prefill="full": its compressed copy is already written)."""
        n = query.shape[2]
        eager = not _compiling()
        if eager:
            self._awaiting = False
        from ..torch_ops import FUSED_MAX_ROWS

        # The capturable decode step. Eagerly, a multi-row chunk with a mask takes the chunk path, which
        # checks the mask for padding; a one-token step is a real token of every sequence.
        if self.filled and n <= FUSED_MAX_ROWS and (not eager or n == 1 or attention_mask is None):
            return self._step(query, key, value, scaling, softcap)
        return self._chunk(query, key, value, attention_mask, scaling, softcap)

    def _step(self, query, key, value, scaling, softcap) -> torch.Tensor:
        b, hq, n, d = query.shape
        if self.key_offset:
            key = (key - self.key_mu).to(key.dtype)
        out = torch.ops.fmkv.append_attention(self.pages, self.fp16_k, self.fp16_v, _rows(key), _rows(value),
                                              _rows(query), self.slots, self.lens, self._offsets[n], self.block_table,
                                              self._cfg, 0, 0.0 if scaling is None else float(scaling),
                                              float(softcap or 0.0), self.backend_name, self.max_cache_len)
        self.lens.add_(n)
        return out.view(b, n, hq, d)

    def _real_tokens(self, attention_mask, b: int, n: int) -> Optional[torch.Tensor]:
        """bool [b, n]: which of the chunk's tokens are real (not padding) per sequence, from the mask's
        last query row (the causal row that sees the whole chunk); None when all are."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            raise fmkv.FmkvError(f"FmkvStaticCache layer {self.layer_idx}: expected a 4-D attention mask tensor "
                                 f"(transformers' sdpa mask), got {type(attention_mask).__name__}")
        past = int(self.cumulative_length) - n  # eager chunk: reading the timeline is allowed here
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        cols = allowed[:, :, -1, past:past + n]
        if cols.shape[-1] != n:
            raise fmkv.FmkvError(f"FmkvStaticCache layer {self.layer_idx}: the attention mask covers "
                                 f"{allowed.shape[-1]} positions, the chunk needs {past + n}")
        real = cols.expand(b, -1, -1)[:, 0].to(self.device)
        return None if bool(real.all()) else real

    def _chunk(self, query, key, value, attention_mask, scaling, softcap) -> Optional[torch.Tensor]:
        """A prompt chunk (eager): store its real tokens, attend its queries (None: at full precision by
        the caller), scatter the rows back into the padded [b, n] layout."""
        b, hq, n, d = query.shape
        real = self._real_tokens(attention_mask, b, n)
        if real is None:
            counts = [n] * b
            sel = None
        else:
            counts = real.sum(1).tolist()
            left = torch.arange(n, device=real.device)[None, :] >= (n - real.sum(1, keepdim=True))
            if not torch.equal(real, left):
                raise fmkv.FmkvError(f"FmkvStaticCache layer {self.layer_idx}: padding must be on the left "
                                     f"(generate()'s layout); the mask has padding between tokens")
            if bool(((self.lens > 0) & (real.sum(1) < n)).any()):
                raise fmkv.FmkvError(f"FmkvStaticCache layer {self.layer_idx}: padding after a sequence's first "
                                     f"token (left padding of a later chunk)")
            sel = real.reshape(-1).nonzero().squeeze(1)
        total = sum(counts)
        new_mu = None
        if self.key_offset:  # sequences whose first real tokens are in this chunk fix their offsets with it
            new_mu = self._first_offsets(key, [n - c for c in counts], counts)
            key = key - (self.key_mu if new_mu is None else new_mu)
        take = (lambda x: _rows(x)) if sel is None else (lambda x: _rows(x).index_select(0, sel))
        offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64, device=self.device)
        grown = torch.tensor(counts, dtype=torch.int64, device=self.device)
        full = not self.filled and self.prefill == "full"
        self.filled = True
        from ..torch_ops import FUSED_MAX_ROWS

        scale, cap = 0.0 if scaling is None else float(scaling), float(softcap or 0.0)
        with torch.no_grad():
            if total == 0:  # every sequence is padding here: nothing to store
                if full:
                    return None
                rows_out = query.new_zeros(0, hq, d)
            elif full:
                torch.ops.fmkv.append(self.pages, self.fp16_k, self.fp16_v, take(key), take(value), self.slots,
                                      self.lens, offsets, self.block_table, self._cfg, 0, self.backend_name)
                self.lens.add_(grown)
                self._keep_offsets(new_mu, counts)
                return None
            elif max(counts) <= FUSED_MAX_ROWS:
                rows_out = torch.ops.fmkv.append_attention(
                    self.pages, self.fp16_k, self.fp16_v, take(key), take(value), take(query), self.slots, self.lens,
                    offsets, self.block_table, self._cfg, 0, scale, cap, self.backend_name, self.max_cache_len)
                self.lens.add_(grown)
            else:
                torch.ops.fmkv.append(self.pages, self.fp16_k, self.fp16_v, take(key), take(value), self.slots,
                                      self.lens, offsets, self.block_table, self._cfg, 0, self.backend_name)
                self.lens.add_(grown)
                rows_out = torch.ops.fmkv.attention(self.pages, self.fp16_k, self.fp16_v, take(query), self.slots,
                                                    self.lens, offsets, self.block_table, self._cfg, 0, scale, cap,
                                                    self.backend_name, self.max_cache_len)
            self._keep_offsets(new_mu, counts)
        if sel is None:
            return rows_out.view(b, n, hq, d)
        out = query.new_zeros(b * n, hq, d)
        out.index_copy_(0, sel, rows_out)
        return out.view(b, n, hq, d)

    def _first_offsets(self, keys: torch.Tensor, starts, counts, first_seq: int = 0) -> Optional[torch.Tensor]:
        """key_offset: the offsets of the sequences of ``keys``' rows (first_seq, first_seq + 1, ...), those not set
        yet that have real tokens here (``counts`` of them from ``starts``) taken from this chunk (fmkv.key_offset);
        None when no sequence gets its offset here. _keep_offsets keeps them once the chunk is stored."""
        b = keys.shape[0]
        todo = [j for j in range(b) if not self._mu_set[first_seq + j] and counts[j] > 0]
        if not todo:
            return None
        mu = self.key_mu[first_seq:first_seq + b].clone()
        for j in todo:
            mu[j] = first_tokens_mean(keys[j:j + 1], starts[j], counts[j])[0].to(mu.dtype)
        return mu

    def _keep_offsets(self, mu: Optional[torch.Tensor], counts, first_seq: int = 0) -> None:
        if mu is None:
            return
        self.key_mu[first_seq:first_seq + mu.shape[0]] = mu
        for j in range(mu.shape[0]):
            self._mu_set[first_seq + j] = self._mu_set[first_seq + j] or counts[j] > 0

    def write(self, keys: torch.Tensor, values: torch.Tensor, first_seq: int = 0) -> None:
        """Append K/V [b, h, n, d] to sequences first_seq .. first_seq + b - 1 without running the model (a
        prefill of known K/V: benchmarks, restoring a cache), through the same append op as a prompt chunk.
        Advances their lengths and the timeline (to the longest sequence); later chunks and decode steps
        read them compressed."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        b, h, n, d = keys.shape
        if (h, d) != (self.num_heads, self.head_dim) or not 0 <= first_seq <= self.batch_size - b:
            raise fmkv.FmkvError(
                f"FmkvStaticCache layer {self.layer_idx}: write of [batch {b}, kv heads {h}, head_dim {d}] at "
                f"sequence {first_seq} into a cache of [{self.batch_size}, {self.num_heads}, {self.head_dim}]")
        if keys.device != self.device:
            raise fmkv.FmkvError(f"FmkvStaticCache layer {self.layer_idx}: K/V on '{keys.device}' but the cache "
                                 f"lives on '{self.device}'")
        seqs = slice(first_seq, first_seq + b)
        offsets = torch.arange(b + 1, dtype=torch.int64, device=self.device) * n
        new_mu = None
        if self.key_offset:
            new_mu = self._first_offsets(keys, [0] * b, [n] * b, first_seq)
            keys = keys - (self.key_mu[seqs] if new_mu is None else new_mu)
        with torch.no_grad():
            torch.ops.fmkv.append(self.pages, self.fp16_k, self.fp16_v, _rows(keys), _rows(values), self.slots[seqs],
                                  self.lens[seqs], offsets, self.block_table[seqs], self._cfg, 0, self.backend_name)
            self.lens[seqs].add_(n)
            torch.maximum(self.cumulative_length, self.lens.max(), out=self.cumulative_length)
        if self.key_offset:
            self._keep_offsets(new_mu, [n] * b, first_seq)
        self.filled = True

    def get_mask_sizes(self, query_length: int) -> tuple:
        """(kv_length, kv_offset) of the mask transformers builds: the chunk itself for the first chunk
        (attended at full precision), then the static max_cache_len (fixed shapes; fmkv's kernels read
        the per-sequence lengths, not the mask)."""
        return (self.max_cache_len, 0) if self.filled else (query_length, 0)

    def get_seq_length(self):
        """The timeline length (a device tensor, as StaticLayer's: reading it needs no synchronisation)."""
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def lengths(self) -> List[int]:
        """Tokens held per sequence (reads the device: synchronises)."""
        return [] if self.pages is None else [int(x) for x in self.lens.tolist()]

    @property
    def resident_bytes(self) -> int:
        """Bytes of storage allocated on the device: page pool + fp16 sink/window regions."""
        if self.pages is None:
            return 0
        return sum(t.untyped_storage().nbytes() for t in (self.pages, self.fp16_k, self.fp16_v))

    @property
    def index_bytes(self) -> int:
        """Bytes of the device-side bookkeeping: block table, lengths, slots, timeline, row offsets."""
        if self.pages is None:
            return 0
        return sum(t.untyped_storage().nbytes() for t in (self.block_table, self.slots, self.lens,
                                                           self.cumulative_length, *self._offsets,
                                                           *([self.key_mu] if self.key_offset else [])))

    def reset(self) -> None:
        if self.pages is not None:
            self.lens.zero_()
        self.cumulative_length.zero_()
        self.filled = False
        self._awaiting = False
        if self.key_mu is not None:
            self.key_mu.zero_()
            self._mu_set = [False] * len(self._mu_set)



class FmkvStaticHeadGroupLayer(HeadGroups, FixedLayerOps, CacheLayerMixin):
    """One decoder layer of an :class:`FmkvStaticCache` whose kv heads have different widths (``head_bits``): an
    :class:`FmkvStaticLayer` per distinct (k_bits, v_bits) pair over its kv heads (fmkv.hf.head_groups). The
    step puts the heads in group order with device index tensors made at allocation, so it stays capturable;
    the groups share one timeline tensor."""

    is_compileable = True
    is_sliding = False
    is_croppable = False
    _cache_name = "FmkvStaticCache"

    @property
    def cumulative_length(self) -> torch.Tensor:
        return self.parts[0][0].cumulative_length

    @property
    def max_cache_len(self) -> int:
        return self.parts[0][0].max_cache_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._tables(self.layers[0].device)  # the permutation tables, before any captured step
        for layer in self.layers[1:]:  # the groups share the first group's timeline tensor (advanced once a step)
            layer.cumulative_length = self.layers[0].cumulative_length
        self.device = self.layers[0].device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not _compiling():
            self._check_heads(key_states, "K")
            self._check_heads(value_states, "V")
            self._check_values(key_states, "K", True)
            self._check_values(value_states, "V", True)
            for layer in self.layers:  # batch, head_dim, device, a previous chunk without its attention
                layer._check_chunk(key_states.narrow(1, 0, layer.num_heads))
            for layer in self.layers:
                layer._awaiting = True
        self.cumulative_length.add_(key_states.shape[-2])
        key_states = key_states.view_as(key_states)
        key_states._fmkv_static = self
        return key_states, value_states

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  scaling: Optional[float], softcap: Optional[float]) -> Optional[torch.Tensor]:
        """Each group's FmkvStaticLayer.attention over its heads, merged into [b, n, hq, d] (None: the first
        chunk, attended at full precision by the caller, every group alike)."""
        if not _compiling():
            try:
                self._check_heads(query, "query", self.num_kv_heads * self.q_per_kv)
                self._check_values(query, "query", False)
            except BaseException:  # the chunk's attention ran (and failed), as a failed op of one layer
                for layer in self.layers:
                    layer._awaiting = False
                raise
        calls = [lambda layer=layer, q=q, k=k, v=v: layer.attention(q, k, v, attention_mask, scaling, softcap)
                 for layer, q, k, v in zip(self.layers, self._split(query, True), self._split(key), self._split(value))]
        outs = self._concurrently(query.device, calls)
        if outs[0] is None:
            return None
        return self._merge(outs)

    def write(self, keys: torch.Tensor, values: torch.Tensor, first_seq: int = 0) -> None:
        """FmkvStaticLayer.write of each group's heads."""
        self._check_heads(keys, "K")
        self._check_heads(values, "V")
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._check_values(keys, "K", True)
        self._check_values(values, "V", True)
        for layer, k, v in zip(self.layers, self._split(keys), self._split(values)):
            layer.write(k, v, first_seq)

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.parts[0][0].get_mask_sizes(query_length)

    def get_seq_length(self):
        return self.parts[0][0].get_seq_length()

    def get_max_length(self) -> int:
        return self.max_cache_len

    def lengths(self) -> List[int]:
        return self.parts[0][0].lengths()



class FmkvStaticCache(Cache):
    """transformers Cache of static shape whose full-attention layers hold compressed fmkv storage and
    whose decode step is capturable in one CUDA graph (module docstring). Options as FmkvCache's;
    ``batch_size`` + ``device`` allocate at construction (``dtype``: of transformers' sliding-window
    layers, default the config's; fmkv layers store uint8 pages and fp16 regions). ``scale_group`` as FmkvCache's
    (32 or 64 on every backend)."""

    def __init__(self, config, max_cache_len: int, k_bits: int = 3, v_bits: int = 3, page_size: int = 64,
                 sink_tokens: int = 0, window_tokens: int = DEFAULT_WINDOW_TOKENS, boundary_layers: int = 0,
                 boundary_k_bits: int = 16, boundary_v_bits: int = 4, scale_rule: str = "lsq", seed: int = 0,
                 backend: Optional[str] = None, prefill: str = "full", set_attention: bool = True,
                 batch_size: Optional[int] = None, device=None, dtype: Optional[torch.dtype] = None,
                 format_version: int = 0, layer_bits=None, head_bits=None, key_offset: bool = False,
                 scale_group: int = 0):
        scale_group = fmkv.Config(scale_group=scale_group).scale_group  # checked now, not at the first update
        text = text_config(config)
        types = layer_types(text)
        n = len(types)
        heads, widths = cache_widths(n, _kv_shape(text)[0], k_bits, v_bits, boundary_layers, boundary_k_bits,
                                     boundary_v_bits, layer_bits, head_bits)
        layers = []
        for i, t in enumerate(types):
            if t == "sliding_attention" and getattr(text, "sliding_window", None):
                layers.append(StaticSlidingWindowLayer(max_cache_len=int(max_cache_len),
                                                       sliding_window=int(text.sliding_window)))
                continue
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"layer {i}: type {t!r} is not supported by FmkvStaticCache")
            groups = width_groups(heads[i]) if heads is not None else [(widths[i], None)]
            parts = [(FmkvStaticLayer(i, max_cache_len, kb, vb, page_size, sink_tokens, window_tokens, scale_rule,
                                      seed, backend, prefill, format_version, key_offset, scale_group), h)
                     for (kb, vb), h in groups]
            layers.append(parts[0][0] if len(parts) == 1 else FmkvStaticHeadGroupLayer(
                i, parts, len(heads[i]), int(text.num_attention_heads) // len(heads[i])))
        super().__init__(layers=layers)
        self._max_cache_len = int(max_cache_len)
        self.layer_widths = [tuple(w) for w in widths]  # (k_bits, v_bits) of each layer (the widest group's)
        kv_heads, head_dim = _kv_shape(text)
        self.geometry = dict(num_layers=n, q_heads=int(text.num_attention_heads), kv_heads=kv_heads,
                             head_dim=head_dim)  # what save records
        self.options = dict(k_bits=k_bits, v_bits=v_bits, page_size=page_size, sink_tokens=sink_tokens,
                            window_tokens=window_tokens, boundary_layers=boundary_layers,
                            boundary_k_bits=boundary_k_bits, boundary_v_bits=boundary_v_bits,
                            scale_rule=scale_rule, seed=seed, prefill=prefill, backend=backend,
                            format_version=format_version, layer_bits=None if layer_bits is None else widths,
                            head_bits=heads, key_offset=bool(key_offset), scale_group=scale_group)
        if set_attention:
            use_fmkv_attention(config)
        if batch_size is not None:
            if device is None:
                raise ValueError("FmkvStaticCache: batch_size= allocates at construction and needs device=")
            dtype = dtype or getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or torch.float32
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            self.early_initialization(int(batch_size), kv_heads, head_dim, dtype, torch.device(device))

    def save(self, path) -> None:
        """Write this cache (options, batch size, every sequence's tokens in every layer, the timeline) to the
        directory ``path`` (fmkv.hf.persist): snapshot files of docs/FILE-FORMAT.md, one per fmkv layer, and a
        manifest; replaced whole if it exists."""
        from .persist import save_cache

        save_cache(self, path)

    @classmethod
    def load(cls, path, config, device=None, set_attention: bool = True) -> "FmkvStaticCache":
        """A cache for the model ``config`` holding what :meth:`save` wrote to ``path``: the saved options and
        batch size, allocated at once on ``device`` (default: where it was saved from, CUDA on the current device),
        every sequence's tokens and the timeline restored, so that decoding (eager, compiled or captured) goes on
        from where the saved cache stood."""
        from .persist import load_cache

        return load_cache(cls, path, config, device, set_attention)

    @property
    def max_cache_len(self) -> int:
        """Tokens per sequence the page pools hold."""
        return self._max_cache_len

    @property
    def fmkv_layers(self) -> List[FmkvStaticLayer]:
        """Every FmkvStaticLayer, the width groups of FmkvStaticHeadGroupLayers included."""
        out = []
        for layer in self.layers:
            if isinstance(layer, FmkvStaticHeadGroupLayer):
                out += layer.layers
            elif isinstance(layer, FmkvStaticLayer):
                out.append(layer)
        return out

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, first_seq: int = 0) -> None:
        """Append K/V [b, h, n, d] to layer ``layer_idx`` of sequences first_seq .. first_seq + b - 1 without
        running the model (FmkvStaticLayer.write)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, (FmkvStaticLayer, FmkvStaticHeadGroupLayer)):
            raise fmkv.FmkvError(f"FmkvStaticCache.write: layer {layer_idx} is not an fmkv layer")
        layer.write(keys, values, first_seq)

    def check(self) -> None:
        """Raise the first error fmkv's CUDA kernels detected on this cache's device since the last check
        (waits for the device); nothing to do for a host cache."""
        from .. import torch_ops

        for dev in sorted({str(layer.device) for layer in self.fmkv_layers
                           if layer.pages is not None and layer.device.type == "cuda"}):
            torch_ops.cuda_check(dev)

    def lengths(self) -> List[int]:
        """Tokens held per sequence in the first fmkv layer (synchronises)."""
        layers = self.fmkv_layers
        return layers[0].lengths() if layers else []

    @property
    def resident_bytes(self) -> int:
        """Allocated bytes: compressed page pools + fp16 regions, plus fp16 sliding-window layers."""
        total = sum(layer.resident_bytes for layer in self.fmkv_layers)
        for layer in self.layers:
            if not isinstance(layer, (FmkvStaticLayer, FmkvStaticHeadGroupLayer)) and getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total

    @property
    def device_bytes(self) -> int:
        """resident_bytes plus the device-side bookkeeping (block tables, lengths, slots, offsets)."""
        return self.resident_bytes + sum(layer.index_bytes for layer in self.fmkv_layers)

    @property
    def used_bytes(self) -> int:
        """Bytes of pages holding compressed tokens plus the fp16 regions, over the sequences' own lengths
        (as fmkv.Cache.used_bytes; synchronises)."""
        total = 0
        for layer in self.fmkv_layers:
            c = layer.config if layer.pages is not None else None
            for length in layer.lengths():
                comp = max(0, length - c.sink_tokens - c.window_tokens)
                total += math.ceil(comp / c.page_size) * c.page_bytes + c.fp16_slot_bytes
        return total

    def fp16_equivalent_bytes(self) -> int:
        """Bytes the same tokens (each sequence's own, no padding) would take as fp16 K and V."""
        return sum(2 * 2 * layer.num_heads * layer.head_dim * sum(layer.lengths())
                   for layer in self.fmkv_layers if layer.pages is not None)

    @staticmethod
    def bytes_per_sequence(config, max_cache_len: int, k_bits: int = 3, v_bits: int = 3, page_size: int = 64,
                           sink_tokens: int = 0, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                           boundary_layers: int = 0, boundary_k_bits: int = 16, boundary_v_bits: int = 4,
                           layer_bits=None, head_bits=None, scale_group: int = 0) -> int:
        """Device bytes one sequence slot of an FmkvStaticCache with these options allocates over all
        full-attention layers (page pool + fp16 regions + its block-table row, length and offsets), from
        the format's page and region sizes: what a batch of B slots takes is B times this (plus a few
        bytes per layer). Sliding-window layers are not counted. ``layer_bits``, ``scale_group``: as the constructor's."""
        text = text_config(config)
        kv_heads, head_dim = _kv_shape(text)
        types = layer_types(text)
        n = len(types)
        from ..torch_ops import FUSED_MAX_ROWS

        pps = pages_per_sequence(max_cache_len, sink_tokens, page_size)
        index = pps * 4 + 4 + 8 + 8 * (FUSED_MAX_ROWS + 1)  # block-table row, slot, length, one entry per offsets row
        heads, widths = cache_widths(n, kv_heads, k_bits, v_bits, boundary_layers, boundary_k_bits,
                                     boundary_v_bits, layer_bits, head_bits)
        total = 0
        for i, t in enumerate(types):
            if t == "sliding_attention" and getattr(text, "sliding_window", None):
                continue
            groups = width_groups(heads[i]) if heads is not None else [(widths[i], range(kv_heads))]
            for (kb, vb), h in groups:  # each width group is a layer of its own (pages, regions, index)
                c = fmkv.Config(head_dim=head_dim, num_kv_heads=len(h), k_bits=kb, v_bits=vb, page_size=page_size,
                                sink_tokens=sink_tokens, window_tokens=window_tokens, scale_group=scale_group)
                total += pps * c.page_bytes + c.fp16_slot_bytes + index
        return total


def _kv_shape(text) -> tuple:
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return kv_heads, head_dim

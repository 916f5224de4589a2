"""KV-cache quantizers for the evaluation: fmkv (via fmkv.torch_quant) and baselines.

Every quantizer maps K and V tensors of shape [batch, kv_heads, tokens, head_dim] (the layout of
Hugging Face attention, keys after RoPE) to their dequantized float32 values, and states its
storage cost in bytes per token per kv head (K and V together, scales and zero points included).

Config names (``parse_config``):

=================  =========================================================================
``fp16``           K and V rounded to fp16 (the reference; 4 * head_dim bytes)
``k4v4`` ...       fmkv format v1: Hadamard rotation, groups of 32, fp16 scale, Lloyd-Max codes
                   (``k16vB``: K in fp16). Suffixes: ``-rms`` (RMS scale instead of LSQ),
                   ``-norot`` (no rotation: ablation), ``-s<N>`` (first N tokens fp16),
                   ``-w<N>`` (fp16 window of the N most recent tokens), ``-km`` (subtract the
                   per-channel key mean of the first 128 tokens before quantizing; softmax-invariant;
                   ``-kms<N>``: of tokens N .. N + 127, skipping the first N, e.g. attention sinks)
                   ``-vm`` (same for V, added back to the output: exact since softmax weights sum
                   to 1), ``-b<N>`` (first and last N layers fp16), ``-f<i.j..>`` (those layers
                   fp16), ``-only<i>`` (diagnostic: only layer i quantized), ``-e5m2`` (research,
                   not format v1: levels restricted to a common factor x fp8-e5m2 values,
                   fmkv.eval.e5m2_levels; ``-ve5m2``: on V only, the format-3 candidate's
                   V levels, whose K levels are the int8 grid's, within 0.003% of Lloyd-Max),
                   ``-fmt3`` (format version 3's codebooks: 3-bit K and V on integer levels x an fp16
                   step; 2- and 4-bit codes are format 2's), ``-g64`` (scale group 64: one fp16 scale per
                   64 rotated coordinates, at d = 64 one per vector; the caches' ``scale_group=64``)
``quanto-int4``    per-token asymmetric int4 / int2 with one fp16 scale + fp16 zero per group
``quanto-int2``    of ``-g<G>`` channels (default 64), as optimum-quanto's KV cache does
``kivi-4/kivi-2``  KIVI: K per-channel (groups of 32 tokens), V per-token (groups of 32 channels),
                   asymmetric with fp16 scale + zero, fp16 residual of the ``-r<R>`` (default 128)
                   most recent tokens
``turbo-4/3/2``    TurboQuant-style (MSE variant): same rotation, one fp16 norm per vector, no
                   groups, Lloyd-Max codes of the normalised coordinates; ``-lsq``: the scale refit
                   by least squares over the vector (fmkv's LSQ rule with one scale per vector)
``fp8``            fp8 e4m3 (no scale, values clamped to +-448)
=================  =========================================================================
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from .. import format as fmt
from .. import torch_quant as tq
from ..key_offset import first_tokens_mean
from .e5m2_levels import e5m2_codebook

DEFAULT_CONFIGS = [
    "fp16", "k4v4", "k3v3", "k2v2", "k4v2", "k16v3",
    "k4v4-rms", "k3v3-rms", "k4v4-norot", "k3v3-norot",
    "quanto-int4", "quanto-int2", "kivi-4", "kivi-2", "turbo-4", "turbo-3", "fp8",
]


@dataclass
class KVQuantizer:
    name: str
    kind: str  # fp16, fmkv, quanto, kivi, turbo, fp8
    k_bits: int = 16
    v_bits: int = 16
    scale_rule: str = "lsq"
    rotate: bool = True
    group: int = 32
    residual: int = 0  # fp16 recent tokens (per query)
    sinks: int = 0  # first tokens kept fp16
    key_mean: bool = False
    key_mean_skip: int = 0  # -kms<N>: the key mean over tokens N .. N + 127 (skips the first N, e.g. sinks)
    value_mean: bool = False
    boundary: int = 0  # first and last `boundary` layers kept fp16
    fp16_layers: tuple = ()  # explicit layers kept fp16
    only_layer: int = -1  # diagnostic: quantize this layer only (others fp16)
    e5m2: bool = False  # research: e5m2-restricted levels (fmkv.eval.e5m2_levels), not format v1
    e5m2_k: bool = True  # ... on K too (False: -ve5m2, V only)
    format_version: int = 0  # fmkv format version (0: the library's default); picks the codebooks
    scale_group: int = 0  # fmkv: coordinates per fp16 scale (0: the format's default; -g64: 64)
    layer_bits: tuple = ()  # ((k_bits, v_bits) per layer): per-layer widths (fmkv.eval.plan), 16 = fp16
    head_bits: tuple = ()  # (((k_bits, v_bits) per kv head) per layer): per-head widths (fmkv.eval.plan --per-head)
    num_layers: int = 0  # set by the evaluation (needed for boundary layers and bytes)
    seed: int = 0
    options: Dict[str, object] = field(default_factory=dict)

    # ---------------------------------------------------------------- storage
    def _side_bytes(self, d: int, bits: int, side: str) -> float:
        if self.kind == "fp16" or bits == 16:
            return 2.0 * d
        if self.kind == "fmkv":
            import fmkv  # the format's bytes (include/fmkv/format.h), for any width the layout defines

            return float(fmkv.bytes_per_token_head(d, bits, self.scale_group))
        if self.kind == "quanto":
            return d * bits / 8 + (d / self.group) * 4
        if self.kind == "kivi":
            # K: per-channel fp16 scale + zero shared by a group of 32 tokens -> 4*d/32 per token;
            # V: per-token fp16 scale + zero per group of 32 channels -> 4*d/32 per token.
            return d * bits / 8 + 4.0 * d / 32
        if self.kind == "turbo":
            return d * bits / 8 + 2
        if self.kind == "fp8":
            return 1.0 * d
        raise ValueError(self.kind)

    def layer_is_fp16(self, layer: int) -> bool:
        if self.only_layer >= 0:
            return layer != self.only_layer
        if layer in self.fp16_layers:
            return True
        return self.boundary > 0 and (layer < self.boundary or
                                      (self.num_layers and layer >= self.num_layers - self.boundary))

    def bytes_per_token_per_head(self, d: int, ctx: Optional[int] = None) -> float:
        """K+V bytes per token per kv head, averaged over layers; with ``ctx``, fp16 sink/residual
        tokens amortised over ctx."""
        if self.head_bits:
            pairs = [p for layer in self.head_bits for p in layer]
            q = sum(self._side_bytes(d, kb, "k") + self._side_bytes(d, vb, "v") for kb, vb in pairs) / len(pairs)
        elif self.layer_bits:
            q = sum(self._side_bytes(d, kb, "k") + self._side_bytes(d, vb, "v")
                    for kb, vb in self.layer_bits) / len(self.layer_bits)
        else:
            q = self._side_bytes(d, self.k_bits, "k") + self._side_bytes(d, self.v_bits, "v")
        n16 = self.residual + self.sinks
        if ctx and n16:
            n16 = min(n16, ctx)
            q = (q * (ctx - n16) + 4.0 * d * n16) / ctx
        if self.num_layers and (self.boundary or self.fp16_layers or self.only_layer >= 0):
            n_fp = sum(self.layer_is_fp16(i) for i in range(self.num_layers))
            q = (q * (self.num_layers - n_fp) + 4.0 * d * n_fp) / self.num_layers
        return q

    # ---------------------------------------------------------------- quantizers
    def quant_k(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        if self.head_bits:
            return self._quant_heads(k, layer, 0, "k")
        return self._quant(k, layer, self.layer_bits[layer][0] if self.layer_bits else self.k_bits, "k")

    def quant_v(self, v: torch.Tensor, layer: int) -> torch.Tensor:
        if self.head_bits:
            return self._quant_heads(v, layer, 1, "v")
        return self._quant(v, layer, self.layer_bits[layer][1] if self.layer_bits else self.v_bits, "v")

    def _quant_heads(self, x: torch.Tensor, layer: int, j: int, side: str) -> torch.Tensor:
        """Each kv head (dim 1) at its own width; heads of equal width are quantized together (the rotation and
        the codes depend on the layer and the vector only, so a head's result does not depend on its batch)."""
        widths = [int(p[j]) for p in self.head_bits[layer]]
        if len(widths) != x.shape[1]:
            raise ValueError(f"{self.name}: layer {layer} has widths for {len(widths)} kv heads, the tensor "
                             f"{x.shape[1]}")
        out = torch.empty_like(x)
        for b in sorted(set(widths)):
            idx = [h for h, w in enumerate(widths) if w == b]
            out[:, idx] = self._quant(x[:, idx], layer, b, side)
        return out

    def _offset(self, x: torch.Tensor, side: str) -> Optional[torch.Tensor]:
        """The mean -km (K) / -vm (V) subtracts before quantizing (fmkv.key_offset), or None."""
        if self.kind == "fmkv" and ((side == "k" and self.key_mean) or (side == "v" and self.value_mean)):
            return first_tokens_mean(x, self.key_mean_skip if side == "k" else 0)
        return None

    def fp16_keys(self, k: torch.Tensor) -> torch.Tensor:
        """float32 keys as a cache keeps them in fp16 (window, sinks): rounded to fp16, after the key offset when
        there is one (the caches store fp16(k - offset); softmax ignores the offset added back here)."""
        mu = self._offset(k.float(), "k")
        return k.half().float() if mu is None else (k.float() - mu).half().float() + mu

    def _quant(self, x: torch.Tensor, layer: int, bits: int, side: str) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        mu = self._offset(x, side)
        if self.kind == "fp16" or bits == 16 or self.layer_is_fp16(layer):
            return (x.to(torch.float16).float() if mu is None else (x - mu).to(torch.float16).float() + mu).to(dt)
        if self.kind == "fmkv":
            if mu is not None:
                x = x - mu
            levels = e5m2_codebook(bits) if self.e5m2 and (side == "v" or self.e5m2_k) else None
            out = tq.fake_quantize(x, bits, self.seed, layer, self.scale_rule, self.rotate, levels=levels,
                                   format_version=self.format_version, side=side, scale_group=self.scale_group)
            return (out if mu is None else out + mu).to(dt)
        if self.kind == "quanto":
            return _asym_groups(x, bits, self.group, axis=-1).to(dt)
        if self.kind == "kivi":
            if side == "k":
                return _asym_groups(x, bits, 32, axis=-2).to(dt)
            return _asym_groups(x, bits, 32, axis=-1).to(dt)
        if self.kind == "turbo":
            return _turbo(x, bits, self.seed, layer, self.scale_rule == "lsq").to(dt)
        if self.kind == "fp8":
            return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float().to(dt)
        raise ValueError(self.kind)


def _asym_groups(x: torch.Tensor, bits: int, group: int, axis: int) -> torch.Tensor:
    """Asymmetric uniform quantization with fp16 scale and zero (min) per group along ``axis``."""
    x16 = x.to(torch.float16).float()
    xt = x16.transpose(axis, -1) if axis != -1 else x16
    shape = xt.shape
    n = shape[-1]
    pad = (-n) % group
    if pad:
        xt = torch.cat([xt, xt[..., -1:].expand(*shape[:-1], pad)], dim=-1)
    g = xt.reshape(*shape[:-1], -1, group)
    lo = g.amin(dim=-1, keepdim=True)
    hi = g.amax(dim=-1, keepdim=True)
    qmax = float((1 << bits) - 1)
    scale = ((hi - lo) / qmax).to(torch.float16).float()
    zero = lo.to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((g - zero) / safe), 0, qmax)
    out = (q * scale + zero).reshape(*shape[:-1], -1)[..., :n]
    return out.transpose(axis, -1) if axis != -1 else out


def _turbo(x: torch.Tensor, bits: int, seed: int, layer: int, lsq: bool = False) -> torch.Tensor:
    """Rotation + per-vector fp16 norm + Lloyd-Max codes of sqrt(d) * y / ||y|| (no groups). lsq: the one
    scale refit to the codes by least squares (sum y L / sum L^2, fp16), fmkv's LSQ rule over the whole
    vector instead of per 32 coordinates (a format-3 option, docs/history/format3-prototypes.md)."""
    d = x.shape[-1]
    y = tq.rotate(tq.canonical(x), seed, layer)
    norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True).to(torch.float16).float()
    s = norm / math.sqrt(d)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    u = y / safe
    mags, thr = tq.codebook_tensor(bits, x.device)
    m = (u.abs().unsqueeze(-1) > thr).sum(-1)
    lv = mags[m]
    lv = torch.where(u < 0, -lv, lv)
    if lsq:
        den = (lv * lv).sum(-1, keepdim=True)
        s = torch.where(den > 0, (y * lv).sum(-1, keepdim=True) / torch.where(den > 0, den, torch.ones_like(den)), s)
        s = s.to(torch.float16).float()
    return tq.unrotate(lv * s, seed, layer)


_FMKV_RE = re.compile(r"^k(\d+)v(\d+)$")


def parse_config(name: str, seed: int = 0) -> KVQuantizer:
    """KVQuantizer from a config name (see module docstring)."""
    parts = name.strip().split("-")
    base, mods = parts[0], parts[1:]
    if base == "fp16":
        return KVQuantizer(name, "fp16", 16, 16, options={})
    if base == "fp8":
        return KVQuantizer(name, "fp8", 8, 8, options={"format": "e4m3", "scale": "none"})
    m = _FMKV_RE.match(base)
    if m:
        kb, vb = int(m.group(1)), int(m.group(2))
        if kb not in fmt.CODE_BITS + (fmt.FP16_BITS,) or vb not in fmt.CODE_BITS:
            raise ValueError(f"config {name!r}: k_bits must be {fmt.K_CODE_BITS_TEXT} and v_bits {fmt.CODE_BITS_TEXT}")
        q = KVQuantizer(name, "fmkv", kb, vb, seed=seed)
        for mod in mods:
            if mod == "rms":
                q.scale_rule = "rms"
            elif mod == "lsq":
                q.scale_rule = "lsq"
            elif mod == "norot":
                q.rotate = False
            elif mod == "e5m2":
                q.e5m2 = True
            elif mod == "ve5m2":
                q.e5m2, q.e5m2_k = True, False
            elif mod == "fmt3":
                q.format_version = 3
            elif re.fullmatch(r"g\d+", mod):
                q.scale_group = int(mod[1:])
                if q.scale_group not in fmt.SCALE_GROUPS:
                    raise ValueError(f"config {name!r}: scale group {q.scale_group} is not supported "
                                     f"({' or '.join(map(str, fmt.SCALE_GROUPS))})")
            elif mod == "km":
                q.key_mean = True
            elif re.fullmatch(r"kms\d+", mod):
                q.key_mean, q.key_mean_skip = True, int(mod[3:])
            elif mod == "vm":
                q.value_mean = True
            elif re.fullmatch(r"b\d+", mod):
                q.boundary = int(mod[1:])
            elif re.fullmatch(r"f[\d.]+", mod):
                q.fp16_layers = tuple(int(t) for t in mod[1:].split(".") if t)
            elif re.fullmatch(r"only\d+", mod):
                q.only_layer = int(mod[4:])
            elif re.fullmatch(r"s\d+", mod):
                q.sinks = int(mod[1:])
            elif re.fullmatch(r"w\d+", mod):
                q.residual = int(mod[1:])
            else:
                raise ValueError(f"config {name!r}: unknown modifier {mod!r}")
        q.options = {"scale_rule": q.scale_rule, "rotation": q.rotate, "sink_tokens": q.sinks,
                     "window_tokens": q.residual, "key_mean": q.key_mean, "key_mean_skip": q.key_mean_skip,
                     "value_mean": q.value_mean,
                     "fp16_boundary_layers": q.boundary, "fp16_layers": list(q.fp16_layers),
                     "only_layer": q.only_layer, "group": fmt.GROUP_SIZE,
                     "scale_group": fmt.resolved_scale_group(q.scale_group)}
        if q.format_version:
            q.options["format_version"] = q.format_version
        if q.e5m2 and q.format_version:
            raise ValueError(f"config {name!r}: -e5m2 / -ve5m2 replace the codebooks; they do not combine with -fmt3")
        if q.e5m2:
            q.options["levels"] = ("e5m2-restricted (research, not format v1)" if q.e5m2_k
                                   else "V e5m2-restricted, K Lloyd-Max (research: the format-3 candidate's V levels)")
        return q
    if base == "quanto":
        bits = int(mods[0].replace("int", "")) if mods else 4
        q = KVQuantizer(name, "quanto", bits, bits, group=64)
        for mod in mods[1:]:
            if re.fullmatch(r"g\d+", mod):
                q.group = int(mod[1:])
            else:
                raise ValueError(f"config {name!r}: unknown modifier {mod!r}")
        q.options = {"axis": "per-token", "group": q.group, "asymmetric": True, "scale_zero": "fp16"}
        return q
    if base == "kivi":
        bits = int(mods[0]) if mods else 2
        q = KVQuantizer(name, "kivi", bits, bits, group=32, residual=128)
        for mod in mods[1:]:
            if re.fullmatch(r"r\d+", mod):
                q.residual = int(mod[1:])
            else:
                raise ValueError(f"config {name!r}: unknown modifier {mod!r}")
        q.options = {"k": "per-channel, 32-token groups", "v": "per-token, 32-channel groups",
                     "residual_fp16": q.residual, "scale_zero": "fp16"}
        return q
    if base == "turbo":
        bits = int(mods[0]) if mods else 3
        if bits not in fmt.CODE_BITS or any(m != "lsq" for m in mods[1:]):
            raise ValueError(f"config {name!r}: turbo-<{'|'.join(map(str, fmt.CODE_BITS))}>[-lsq]")
        q = KVQuantizer(name, "turbo", bits, bits, seed=seed)
        q.scale_rule = "lsq" if "lsq" in mods[1:] else "rms"
        q.options = {"rotation": True, "norm": "fp16 per vector", "codebook": "fmkv Lloyd-Max",
                     "scale": "least squares over the vector" if q.scale_rule == "lsq" else "norm / sqrt(d)"}
        return q
    raise ValueError(f"unknown config {name!r}")

"""Vectorised torch implementation of the fmkv quantizer (docs/FORMAT.md sections 3-5: codes and scales).

Quantizes / dequantizes whole ``[..., d]`` tensors (e.g. ``[tokens, heads, d]``) with exactly the
float32 roundings of the reference (``src/format/quantize_group.h``, ``src/format/rotation.h``):

* canonical fp16 input, rotation signs from splitmix64(seed, layer), FWHT stages h = 1, 2, ..., d/2,
  multiplication by the float32 constant nearest 1/sqrt(d);
* per scale group (``scale_group``: 32 coordinates, or 64 = two code groups of 32): RMS through the fixed tree
  sum of each code group (steps 16, 8, 4, 2, 1), the code groups' sums added in order, fp16 with saturation,
  codes from midpoint thresholds of the codebook's levels (sign-magnitude), LSQ rescale over the scale group. The codebook is
  the format version's for the side: format 2's fp16 Lloyd-Max levels, or format 3's 3-bit integer levels x
  an fp16 step, different for K and V (``format_version``, ``side``).

Every step is one correctly rounded float32 torch operation (elementwise add, mul, div; no fused
multiply-add, no reduction whose order torch chooses) or, for the square root, which torch does not
round correctly in float32, a float64 root corrected to the correctly rounded float32 (``_sqrt_rn``),
so codes and scales are bit-identical to :func:`fmkv.quantize_vector` (tests/python/test_torch_quant.py
checks it, on fixed and on fresh random inputs).

The codebooks come from :func:`fmkv.codebook_levels` (the library's generated tables), never from a
hand-typed copy. ``rotate=False`` gives the no-rotation ablation (groups of 32 raw coordinates).

Dequantization (``dequantize``) returns float32 values in the original basis; the inverse rotation
is float32 (the format leaves its precision to the backend). Quantize-then-dequantize followed by
ordinary attention is mathematically the attention that the fused kernels compute on the cache.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import format as _format

__all__ = [
    "QuantizedTensor",
    "sign_vector",
    "rotate",
    "unrotate",
    "quantize",
    "dequantize",
    "fake_quantize",
    "codebook_tensor",
]

_GROUP = _format.GROUP_SIZE


@functools.lru_cache(maxsize=None)
def _sign_array(seed: int, layer: int, d: int):
    return _format.rotation_signs(seed, layer, d)


def sign_vector(seed: int, layer: int, d: int, device=None) -> torch.Tensor:
    """The rotation signs s (float32 +-1, length d) of (seed, layer) per FORMAT.md section 3 (from the library)."""
    return torch.as_tensor(_sign_array(int(seed), int(layer), int(d)), dtype=torch.float32).to(device)


def _norm(d: int) -> torch.Tensor:
    # float32 nearest to 1/sqrt(d), from the library (include/fmkv/format.h).
    return torch.tensor(_format.rotation_norm(d), dtype=torch.float32)


def _fwht(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised Sylvester FWHT over the last dim, stages h = 1, 2, 4, ..., d/2 (float32)."""
    d = v.shape[-1]
    lead = v.shape[:-1]
    h = 1
    while h < d:
        w = v.reshape(*lead, d // (2 * h), 2, h)
        a, b = w[..., 0, :], w[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return v


def rotate(x: torch.Tensor, seed: int = 0, layer: int = 0) -> torch.Tensor:
    """y = H diag(s) x / sqrt(d) in float32 with the format's exact roundings (x float32)."""
    d = x.shape[-1]
    s = sign_vector(seed, layer, d, x.device)
    y = _fwht(x * s)
    return y * _norm(d).to(x.device)


def unrotate(y: torch.Tensor, seed: int = 0, layer: int = 0) -> torch.Tensor:
    """Inverse rotation x = diag(s) H y / sqrt(d) (float32; not part of the format)."""
    d = y.shape[-1]
    s = sign_vector(seed, layer, d, y.device)
    return _fwht(y) * _norm(d).to(y.device) * s


@functools.lru_cache(maxsize=None)
def _codebook_cpu(bits: int, format_version: int = 0, side: str = "k") -> Tuple[torch.Tensor, torch.Tensor]:
    import fmkv  # the library's generated tables (src/format/codebooks.inc), per format version and side

    mags = torch.as_tensor(fmkv.codebook_levels(int(format_version), int(bits), side), dtype=torch.float32).clone()
    thr = (mags[:-1] + mags[1:]) * 0.5  # midpoints, exact in float32 (as the core's table_threshold)
    return mags, thr


def codebook_tensor(bits: int, device=None, levels: Optional[torch.Tensor] = None, format_version: int = 0,
                    side: str = "k") -> Tuple[torch.Tensor, torch.Tensor]:
    """(positive levels, midpoint thresholds) of the b-bit codebook of ``side`` ('k' or 'v') in ``format_version``
    (0: the library's default) as float32 tensors. ``levels`` replaces the format's levels (research only, e.g.
    fmkv.eval.e5m2_levels; the result is then not the format's codes)."""
    if levels is not None:
        mags = levels.to(device=device, dtype=torch.float32)
        if mags.numel() != 1 << (int(bits) - 1):
            raise ValueError(f"{mags.numel()} levels for a {bits}-bit codebook (expected {1 << (int(bits) - 1)})")
        return mags, (mags[:-1] + mags[1:]) * 0.5
    mags, thr = _codebook_cpu(int(bits), int(format_version), side)
    return mags.to(device), thr.to(device)


def _tree_sum32(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (32) in the fixed order: for step 16..1: v[j] += v[j + step]."""
    step = 16
    while step >= 1:
        t = t[..., :step] + t[..., step:2 * step]
        step //= 2
    return t[..., 0]


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root of float32 x >= 0, as the reference's sqrtf.

    torch.sqrt on float32 CPU tensors is not (torch 2.13 on AVX-512: 17% of random inputs one ulp
    off, e.g. sqrt(0x353e3ef8) -> 0x3a5cb000, correctly rounded 0x3a5cafff). The float64 root rounded
    to float32 is then corrected against its neighbours' rounding midpoints, whose squares are exact
    in float64 (25 significant bits square to at most 50); sqrt never lands on a midpoint exactly."""
    xd = x.to(torch.float64)
    r = torch.sqrt(xd).to(torch.float32)
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    dn = torch.nextafter(r, torch.zeros_like(r))
    rd = r.to(torch.float64)
    hi = (rd + up.to(torch.float64)) * 0.5
    lo = (rd + dn.to(torch.float64)) * 0.5
    r = torch.where(xd > hi * hi, up, r)
    return torch.where(xd < lo * lo, dn, r)


def _to_f16_saturating(x: torch.Tensor) -> torch.Tensor:
    """fp16 (RNE) of a float32 tensor; |h| beyond the fp16 range (inf, NaN) becomes +65504."""
    h = x.to(torch.float16)
    bad = ~torch.isfinite(h)
    if bool(bad.any()):
        h = torch.where(bad, torch.full_like(h, torch.finfo(torch.float16).max), h)
    return h


def canonical(x: torch.Tensor) -> torch.Tensor:
    """fp16 rounding of the input, as float32 (FORMAT.md section 2). Raises on non-finite values."""
    h = x.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise ValueError("non-finite value (NaN, Inf or |x| >= 65520) in K/V input")
    return h.to(torch.float32)


@dataclass
class QuantizedTensor:
    """codes uint8 [..., d] (sign-magnitude, rotated order), scales float16 [..., d / scale_group]."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    seed: int = 0
    layer: int = 0
    rotated: bool = True
    levels: Optional[torch.Tensor] = None  # research codebook (codebook_tensor), None: the format's
    format_version: int = 0  # 0: the library's default (fmkv.format_version())
    side: str = "k"  # which codebook ('k' or 'v'): format 3's 3-bit K and V levels differ
    scale_group: int = 0  # coordinates per scale (0: the format's default, fmkv.format.SCALE_GROUP)


def _scale_group(scale_group: int) -> int:
    """The scale group's coordinates (fmkv.format.resolved_scale_group; FmkvError, a ValueError, if unsupported)."""
    return _format.resolved_scale_group(int(scale_group))


def _scale_group_sum(t: torch.Tensor) -> torch.Tensor:
    """[..., Gs, n, 32] -> [..., Gs]: each code group's tree sum, the n sums added in order."""
    c = _tree_sum32(t)
    out = c[..., 0]
    for h in range(1, c.shape[-1]):
        out = out + c[..., h]
    return out


def quantize_rotated(y: torch.Tensor, bits: int, scale_rule: str = "lsq", levels: Optional[torch.Tensor] = None,
                     format_version: int = 0, side: str = "k", scale_group: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize rotated float32 values y [..., d] per scale group. Returns (codes uint8, scales fp16 [..., d / sg])."""
    if not 1 <= bits <= _format.CODEBOOK_MAX_BITS:
        raise ValueError(f"bits {bits} is not supported (1 .. {_format.CODEBOOK_MAX_BITS})")
    if scale_rule not in ("lsq", "rms"):
        raise ValueError(f"scale_rule {scale_rule!r} is not supported (expected 'lsq' or 'rms')")
    sg = _scale_group(scale_group)
    d = y.shape[-1]
    lead = y.shape[:-1]
    g = y.reshape(*lead, d // sg, sg // _GROUP, _GROUP)  # [..., scale group, code group, coordinate]
    mags, thr = codebook_tensor(bits, y.device, levels, format_version, side)
    rms = _sqrt_rn(_scale_group_sum(g * g) / torch.tensor(float(sg)))
    s0 = _to_f16_saturating(rms)
    s0f = s0.to(torch.float32)
    zero = s0f == 0.0
    safe = torch.where(zero, torch.ones_like(s0f), s0f)
    u = g / safe[..., None, None]
    neg = u < 0.0
    a = torch.abs(u)
    m = (a.unsqueeze(-1) > thr).sum(dim=-1)  # number of thresholds strictly below |u|
    codes = (neg.to(torch.int64) << (bits - 1)) | m
    codes = torch.where(zero[..., None, None], torch.zeros_like(codes), codes)
    if scale_rule == "rms":
        scales = s0
    else:
        lv = mags[m]
        lv = torch.where(neg, -lv, lv)
        num = _scale_group_sum(g * lv)
        den = _scale_group_sum(lv * lv)
        scales = _to_f16_saturating(num / den)
    scales = torch.where(zero, torch.zeros_like(scales), scales)
    return codes.to(torch.uint8).reshape(*lead, d), scales


def quantize(x: torch.Tensor, bits: int, seed: int = 0, layer: int = 0, scale_rule: str = "lsq",
             rotate_input: bool = True, levels: Optional[torch.Tensor] = None, format_version: int = 0,
             side: str = "k", scale_group: int = 0) -> QuantizedTensor:
    """Quantize head vectors x [..., d] (any float dtype; rounded to fp16 first) with the codebook of ``side`` in
    ``format_version`` (the codes are the format's; how a version lays them out in pages does not matter here)."""
    d = x.shape[-1]
    if d % _GROUP:
        raise ValueError(f"head_dim {d} is not a multiple of {_GROUP}")
    xf = canonical(x)
    y = rotate(xf, seed, layer) if rotate_input else xf
    codes, scales = quantize_rotated(y, bits, scale_rule, levels, format_version, side, scale_group)
    return QuantizedTensor(codes, scales, bits, seed, layer, rotate_input, levels, format_version, side, scale_group)


def decode_levels(codes: torch.Tensor, bits: int, levels: Optional[torch.Tensor] = None, format_version: int = 0,
                  side: str = "k") -> torch.Tensor:
    mags, _ = codebook_tensor(bits, codes.device, levels, format_version, side)
    c = codes.to(torch.int64)
    lv = mags[c & ((1 << (bits - 1)) - 1)]
    return torch.where(((c >> (bits - 1)) & 1).bool(), -lv, lv)


def dequantize_rotated(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                       levels: Optional[torch.Tensor] = None, format_version: int = 0, side: str = "k",
                       scale_group: int = 0) -> torch.Tensor:
    """Rotated-domain values level x scale (exact in float32), shape [..., d]."""
    sg = _scale_group(scale_group)
    d = codes.shape[-1]
    lead = codes.shape[:-1]
    lv = decode_levels(codes, bits, levels, format_version, side).reshape(*lead, d // sg, sg)
    return (lv * scales.to(torch.float32).unsqueeze(-1)).reshape(*lead, d)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """float32 [..., d] in the original basis."""
    y = dequantize_rotated(q.codes, q.scales, q.bits, q.levels, q.format_version, q.side, q.scale_group)
    return unrotate(y, q.seed, q.layer) if q.rotated else y


def fake_quantize(x: torch.Tensor, bits: int, seed: int = 0, layer: int = 0, scale_rule: str = "lsq",
                  rotate_input: bool = True, chunk: Optional[int] = 65536,
                  levels: Optional[torch.Tensor] = None, format_version: int = 0, side: str = "k",
                  scale_group: int = 0) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype and shape; bits 16 returns the fp16 rounding of x.

    Processes at most ``chunk`` vectors at a time to bound temporary memory.
    """
    if bits == 16:
        return canonical(x).to(x.dtype)
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    outs = []
    n = flat.shape[0]
    step = n if not chunk else chunk
    for i in range(0, n, max(step, 1)):
        outs.append(dequantize(quantize(flat[i:i + step], bits, seed, layer, scale_rule, rotate_input, levels,
                                        format_version, side, scale_group)))
    out = torch.cat(outs, 0) if outs else flat.to(torch.float32)
    return out.reshape(x.shape).to(x.dtype)

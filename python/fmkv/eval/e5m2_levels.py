"""Research codebooks for a possible format v2 (docs/history/cuda-decode-layouts.md): positive levels that
are a common factor times values representable in fp8 e5m2 (1, 1.25, 1.5, 1.75 times a power of two),
i.e. fp16 values whose low byte is zero once the factor is folded into the group scale. With such
levels one byte permute yields a signed fp16 pair on the GPU, which would roughly halve the integer
work of the decode. Not part of format v1: used only by the ``-e5m2`` modifier of the evaluation to
measure what the restricted levels cost a real model.

The levels are searched, not written down: for each common factor c on a fine grid of one octave, each
Lloyd-Max level of the format's codebook (``fmkv.codebook``) divided by c is rounded to its two nearest
e5m2 values and every combination is scored by the exact mean squared error on N(0, 1) (sign-magnitude
levels, midpoint thresholds, closed-form Gaussian integrals); the best (c, levels) is kept.
"""
import functools
import itertools
import math
from typing import Tuple

import torch


def _e5m2_neighbours(x: float) -> Tuple[float, float]:
    """The e5m2-representable values just below and just above x > 0 (x itself twice if exact)."""
    e = math.floor(math.log2(x))
    step = 2.0 ** (e - 2)  # 2 mantissa bits: 4 values per octave
    lo = math.floor(x / step) * step
    hi = lo if lo == x else lo + step
    return lo, hi


def gaussian_mse(levels: torch.Tensor) -> torch.Tensor:
    """Exact E[(x - q(x))^2] for x ~ N(0, 1), q = nearest of +-levels (midpoint thresholds).

    levels: [..., M] positive, ascending (float64). Returns [...]."""
    L = levels
    t = torch.cat([torch.zeros_like(L[..., :1]), (L[..., :-1] + L[..., 1:]) * 0.5,
                   torch.full_like(L[..., :1], math.inf)], dim=-1)
    a, b = t[..., :-1], t[..., 1:]
    Phi = lambda z: torch.special.ndtr(z)  # noqa: E731
    phi = lambda z: torch.where(torch.isinf(z), torch.zeros_like(z), torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi))  # noqa: E731
    bphi = torch.where(torch.isinf(b), torch.zeros_like(b), b * phi(b))
    p0 = Phi(b) - Phi(a)                   # int phi
    p1 = phi(a) - phi(b)                   # int x phi
    p2 = p0 + a * phi(a) - bphi            # int x^2 phi
    return 2.0 * (p2 - 2.0 * L * p1 + L * L * p0).sum(dim=-1)


@functools.lru_cache(maxsize=None)
def _search(bits: int, steps: int = 512) -> Tuple[Tuple[float, ...], float, float, float]:
    import fmkv  # the format's codebook (src/format/codebooks.inc)

    ref = [float(m) for m in fmkv.codebook(int(bits))]
    ref_mse = float(gaussian_mse(torch.tensor([ref], dtype=torch.float64))[0])
    best = (math.inf, None, None)
    for i in range(steps):  # c over one octave: a factor of 2 in c only shifts the exponents
        c = 2.0 ** (i / steps)
        choices = [_e5m2_neighbours(m / c) for m in ref]
        combos = torch.tensor(list(itertools.product(*choices)), dtype=torch.float64) * c
        combos = combos[(combos[:, 1:] > combos[:, :-1]).all(dim=1)]  # strictly ascending
        if combos.numel() == 0:
            continue
        mse = gaussian_mse(combos)
        j = int(torch.argmin(mse))
        if float(mse[j]) < best[0]:
            best = (float(mse[j]), combos[j].tolist(), c)
    mse, levels, c = best
    return tuple(levels), c, mse, ref_mse


def e5m2_codebook(bits: int) -> torch.Tensor:
    """Positive levels (float32, ascending) of the e5m2-restricted b-bit codebook."""
    return torch.tensor(_search(int(bits))[0], dtype=torch.float32)


def e5m2_report(bits: int) -> dict:
    """The searched codebook: levels, common factor, levels / factor (e5m2 values), MSE on N(0, 1) and
    its ratio to the format's Lloyd-Max codebook."""
    levels, c, mse, ref_mse = _search(int(bits))
    return {"bits": int(bits), "levels": [round(x, 6) for x in levels], "factor": round(c, 6),
            "e5m2_values": [round(x / c, 6) for x in levels], "mse": mse, "format_mse": ref_mse,
            "mse_ratio": mse / ref_mse}

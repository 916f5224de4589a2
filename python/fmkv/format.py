"""The format's numbers, from the C library (include/fmkv/format.h through the binding): the Python
layers (fmkv.torch_quant, fmkv.hf, fmkv.reference, fmkv.eval) take every constant and formula of
docs/FORMAT.md from here or from :func:`fmkv.bytes_per_token_head` / :func:`fmkv.codebook`, never
from a copy of their own."""
from __future__ import annotations

import numpy as np

from . import _fmkv

__all__ = ["GROUP_SIZE", "SCALE_GROUP", "SCALE_GROUPS", "resolved_scale_group", "FP16_BITS", "CODE_BITS", "CODE_BITS_TEXT", "K_CODE_BITS_TEXT", "CODEBOOK_MAX_BITS", "rotation_sign_words", "rotation_signs", "layer_seed", "rotation_norm",
           "compressed_end"]

GROUP_SIZE: int = _fmkv.GROUP_SIZE  # rotated coordinates per code group
SCALE_GROUP: int = _fmkv.SCALE_GROUP  # rotated coordinates per fp16 scale of a default cache (scale_group 0)
SCALE_GROUPS: tuple = tuple(_fmkv.SCALE_GROUPS)  # the scale groups a cache can use (Config.scale_group), ascending
resolved_scale_group = _fmkv.resolved_scale_group  # a config's scale_group (0: SCALE_GROUP); ValueError if unsupported
FP16_BITS: int = _fmkv.FP16_BITS    # k_bits value meaning "K kept in fp16, unrotated"
CODE_BITS: tuple = tuple(_fmkv.CODE_BITS)  # code widths of a K or V side, ascending (K may also be FP16_BITS)
CODE_BITS_TEXT: str = _fmkv.CODE_BITS_TEXT  # CODE_BITS as the library's messages list them ("2, 3 or 4")
K_CODE_BITS_TEXT: str = _fmkv.K_CODE_BITS_TEXT  # the same with fp16 K ("2, 3, 4 or 16")
CODEBOOK_MAX_BITS: int = _fmkv.CODEBOOK_MAX_BITS  # fmkv.codebook(bits) exists for bits 1 .. this


def rotation_sign_words(seed: int, layer: int, head_dim: int) -> np.ndarray:
    """uint64 [head_dim // 64]: bit i of word i // 64 set means the rotation sign s_i is -1."""
    return _fmkv.rotation_sign_words(int(seed), int(layer), int(head_dim))


def rotation_signs(seed: int, layer: int, head_dim: int) -> np.ndarray:
    """float32 [head_dim] of +-1: the rotation signs s of (seed, layer)."""
    words = rotation_sign_words(seed, layer, head_dim)
    bits = (words[:, None] >> np.arange(64, dtype=np.uint64)[None, :]) & np.uint64(1)
    return np.where(bits.reshape(-1) != 0, np.float32(-1.0), np.float32(1.0)).astype(np.float32)


def layer_seed(seed: int, layer: int) -> int:
    """The seed whose layer-0 rotation equals that of (seed, layer): a one-layer cache holding layer
    ``layer`` of a model gets the bytes of a multi-layer cache with ``seed``."""
    return int(_fmkv.layer_seed(int(seed), int(layer)))


def rotation_norm(head_dim: int) -> float:
    """The float32 nearest 1/sqrt(head_dim), applied after the unnormalised FWHT."""
    return float(_fmkv.rotation_norm(int(head_dim)))


def compressed_end(sink: int, window: int, length: int) -> int:
    """E = max(sink, length - window): positions [sink, E) of a sequence are compressed."""
    return int(_fmkv.compressed_end(int(sink), int(window), int(length)))

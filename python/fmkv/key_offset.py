"""The key offset: each (sequence, kv head)'s keys minus their mean over its first ``KEY_OFFSET_TOKENS`` tokens.

Softmax ignores a vector subtracted from every key of a (sequence, kv head): q . (k - mu) = q . k - q . mu, the
same for every key, so attention is unchanged while the vectors the format quantizes are centred (RoPE'd keys
carry a large per-channel mean that costs code levels). The offset is estimated once, from the first chunk a cache
stores for the sequence, and fixed from then on (every later key must share it). The caches take it as
``key_offset=True`` (fmkv.hf.FmkvCache / FmkvStaticCache, fmkv.mlx FmkvKVCache); the evaluation's ``-km``
modifier and ``fmkv-eval plan --key-offset`` compute the same mean (docs/EVAL.md section 15).

The mean is taken over the keys rounded to fp16 (what the cache's fp16 regions would hold), in float32.
"""
from __future__ import annotations

KEY_OFFSET_TOKENS = 128  # tokens of each sequence's first chunk that the offset averages


def check_softcap(softcap) -> None:
    """Raise FmkvError for a softcap with the key offset: a softcap (``cap * tanh(score / cap)``) is applied to the
    scores before softmax, so the shift q . mu no longer cancels -- attention over the offset keys would differ
    from the model's. (Models with attention-logit softcapping, e.g. Gemma 2: use ``key_offset=False``.)"""
    if softcap:
        from . import _args

        raise _args.error(f"key_offset=True with softcap={float(softcap)}: softmax ignores the key offset only without "
                          "a softcap (the cap is applied to the shifted scores); use key_offset=False for this model",
                          "UNSUPPORTED")


def first_tokens_mean(keys, start: int = 0, count: int = KEY_OFFSET_TOKENS):
    """[b, h, n, d] keys (a torch tensor or an MLX array) -> [b, h, 1, d] float32 of the same library: the mean of
    tokens start .. start + min(count, KEY_OFFSET_TOKENS) - 1 (fewer when the chunk is shorter) of the keys rounded
    to fp16; zeros when that span is empty."""
    b, h, n, d = (int(x) for x in keys.shape)
    stop = min(n, int(start) + min(int(count), KEY_OFFSET_TOKENS))
    if type(keys).__module__.startswith("mlx"):
        import mlx.core as mx

        if stop <= start:
            return mx.zeros((b, h, 1, d), dtype=mx.float32)
        return mx.mean(keys[:, :, start:stop].astype(mx.float16).astype(mx.float32), axis=2, keepdims=True)
    import torch

    if stop <= start:
        return torch.zeros(b, h, 1, d, dtype=torch.float32, device=keys.device)
    return keys[:, :, start:stop].to(torch.float16).float().mean(dim=2, keepdim=True)

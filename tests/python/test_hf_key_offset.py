"""fmkv.hf caches with the key offset (``key_offset=True``, fmkv.key_offset): each (sequence, kv head)'s keys minus
their mean over the sequence's first 128 tokens, fixed by its first chunk; softmax ignores it.

Checked on the CPU (tiny random-weight Llama, 3 kv heads):
* through the model, every decode output equals fmkv.eval's dequantize-then-attend with ``-km`` (the quantizer
  ``fmkv-eval plan --key-offset`` measured) on the same recorded K/V -- uniform widths, a window with sinks, widths
  per kv head -- and differs from the output without the offset;
* with K in fp16 the offset changes attention only by fp16 rounding (softmax invariance);
* the stored pages are, bit for bit, those of a cache without the offset fed the keys minus the offset; a left-
  padded sequence's offset is the mean of its real tokens only; the 128-token cap;
* FmkvStaticCache == FmkvCache (tokens and bytes); a compiled static decode step == the eager one;
* a refused first chunk (NaN) leaves no offset behind; reset() clears it.
* a model that softcaps its attention logits (tiny Gemma 2) is refused with the offset (it does not cancel).
On CUDA: a captured decode step with the offset replays the eager tokens.
"""
import pytest

from conftest import import_hf  # noqa: E402

torch, transformers, fmkv, fhf = import_hf()

from hf_cases import COMMON, CUDA_HEAD_BITS, HEAD_BITS  # noqa: E402
from hf_cases import decode_runs_agree, storage as _bytes, token_ids as _ids, tiny_model as _model  # noqa: E402
from fmkv.hf.cache import FmkvHeadGroupLayer, FmkvLayer  # noqa: E402
from fmkv.key_offset import KEY_OFFSET_TOKENS, first_tokens_mean  # noqa: E402


def _record(monkeypatch, cache):
    """{layer: {"kv": [(K, V) per update], "qo": [(query, output, scaling, updates so far) per attention call]}} of
    the cache's layers (a prefill attended at full precision makes no attention call)."""
    log, top = {}, {id(layer) for layer in cache.layers}
    for cls in (FmkvLayer, FmkvHeadGroupLayer):
        def update(self, k, v, *a, _orig=cls.update, **kw):
            if id(self) in top:
                log.setdefault(self.layer_idx, {"kv": [], "qo": []})["kv"].append((k.clone(), v.clone()))
            return _orig(self, k, v, *a, **kw)

        def attention(self, q, scaling, softcap, _orig=cls.attention):
            out = _orig(self, q, scaling, softcap)
            if id(self) in top:
                rec = log[self.layer_idx]
                rec["qo"].append((q.clone(), out.clone(), scaling, len(rec["kv"])))
            return out
        monkeypatch.setattr(cls, "update", update)
        monkeypatch.setattr(cls, "attention", attention)
    return log


def _worst_against(log, quantizer):
    """Largest relative difference of the recorded decode outputs from quantized_attention with ``quantizer``."""
    from fmkv.eval import ppl as P

    class _Mod:
        pass

    worst = 0.0
    for layer, rec in log.items():
        mod = _Mod()
        mod.layer_idx = layer
        for q, out, scaling, upto in rec["qo"]:
            if q.shape[2] != 1:
                continue
            k = torch.cat([x[0] for x in rec["kv"][:upto]], dim=2)
            v = torch.cat([x[1] for x in rec["kv"][:upto]], dim=2)
            ref, _ = P.quantized_attention(mod, q, k, v, None, scaling=scaling, quantizer=quantizer)
            worst = max(worst, (out - ref).abs().max().item() / max(1.0, ref.abs().max().item()))
    return worst


@pytest.mark.parametrize("case", ["k3v3", "k4v2-w8-s2", "head_bits"])
def test_decode_outputs_equal_eval_key_mean(case, monkeypatch):
    """Prefill 140 tokens (the offset averages the first 128), then 4 decode steps: each fused output == the
    evaluation's -km quantizer's dequantize-then-attend over the same K/V, and != the one without the offset."""
    from fmkv.eval.plan import planned_quantizer
    from fmkv.eval.quantizers import parse_config

    model = _model()
    if case == "head_bits":
        kw = dict(head_bits=HEAD_BITS, window_tokens=0)
        with_offset = planned_quantizer("h", [], 0, head_bits=HEAD_BITS, key_offset=True)
        without = planned_quantizer("h", [], 0, head_bits=HEAD_BITS)
    else:
        with_offset, without = parse_config(case + "-km"), parse_config(case)
        kw = dict(k_bits=with_offset.k_bits, v_bits=with_offset.v_bits, window_tokens=with_offset.residual,
                  sink_tokens=with_offset.sinks, page_size=16)
    for q in (with_offset, without):
        q.num_layers = COMMON["num_hidden_layers"]
    cache = fhf.FmkvCache(model.config, max_cache_len=160, key_offset=True, **kw)
    log = _record(monkeypatch, cache)
    ids = _ids(1, 144, 5)
    with torch.no_grad():
        pkv = fhf.output_cache(model(ids[:, :140], **fhf.cache_kwargs(cache), use_cache=True))
        for t in range(140, 144):
            pkv = fhf.output_cache(model(ids[:, t:t + 1], **fhf.cache_kwargs(pkv), use_cache=True))
    assert sorted(log) == [0, 1, 2] and all(sum(q.shape[2] == 1 for q, *_ in r["qo"]) == 4 for r in log.values())
    assert _worst_against(log, with_offset) < 2e-5
    assert _worst_against(log, without) > 1e-3  # the offset changes what is quantized


def test_fp16_keys_attention_is_unchanged_by_the_offset():
    """With K in fp16 the offset moves every score of a query by the same q . mu: a layer's outputs with and without
    it agree to fp16 rounding (keys with a large common mean, causal multi-row queries and decode steps)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 40, 64, generator=g) * 0.5 + torch.randn(1, 3, 1, 64, generator=g) * 2
    v, q = torch.randn(2, 3, 40, 64, generator=g), torch.randn(2, 6, 40, 64, generator=g)
    outs, layers = [], []
    for key_offset in (False, True):
        layer = FmkvLayer(0, 16, 4, max_cache_len=64, window_tokens=0, key_offset=key_offset, prefill="compressed")
        layer.update(k[:, :, :36], v[:, :, :36])
        out = [layer.attention(q[:, :, :36], None, None)]
        for t in range(36, 40):
            layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
            out.append(layer.attention(q[:, :, t:t + 1], None, None))
        outs.append(torch.cat(out, 1))
        layers.append(layer)
    assert (outs[0] - outs[1]).abs().max().item() < 2e-3 * outs[0].abs().max().item()
    assert layers[1].key_mu.abs().max().item() > 1.0  # a real offset was subtracted
    assert not torch.equal(layers[0].pages, layers[1].pages)


@pytest.mark.parametrize("static", [False, True])
def test_pages_equal_a_cache_fed_the_offset_keys(static):
    """The cache with the offset stores, bit for bit, what a cache without it stores when fed K - offset: the offset
    is the fp16-rounded mean of the first 128 tokens of the first chunk and stays fixed."""
    g = torch.Generator().manual_seed(11)
    kw = dict(k_bits=3, v_bits=3, window_tokens=8, page_size=16, seed=4)
    if static:
        a, b = fhf.FmkvStaticLayer(2, 200, key_offset=True, **kw), fhf.FmkvStaticLayer(2, 200, **kw)
    else:
        a, b = FmkvLayer(2, max_cache_len=200, key_offset=True, **kw), FmkvLayer(2, max_cache_len=200, **kw)
    k0 = torch.randn(2, 3, 150, 64, generator=g) + torch.randn(1, 3, 1, 64, generator=g) * 3
    v0 = torch.randn(2, 3, 150, 64, generator=g)
    mu = first_tokens_mean(k0)
    assert torch.equal(mu, k0[:, :, :KEY_OFFSET_TOKENS].half().float().mean(2, keepdim=True))
    steps = [(k0, v0)] + [(torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g))
                          for n in (1, 1, 2)]
    for i, (k, v) in enumerate(steps):
        q = torch.randn(2, 6, k.shape[2], 64, generator=g)
        if static:
            if i == 0:
                a.write(k, v)
                b.write(k - mu, v)
                continue
            ka, va = a.update(k, v)
            kb, vb = b.update(k - mu, v)
            oa, ob = a.attention(q, ka, va, None, None, None), b.attention(q, kb, vb, None, None, None)
        else:
            a.update(k, v)
            b.update(k - mu, v)
            oa, ob = a.attention(q, None, None), b.attention(q, None, None)
        assert torch.equal(oa, ob)
    assert torch.equal(a.key_mu, mu)
    for x, y in zip(_bytes(a), _bytes(b)):
        assert torch.equal(x, y)


def test_static_left_padded_sequence_takes_the_mean_of_its_real_tokens():
    layer = fhf.FmkvStaticLayer(0, 64, k_bits=4, v_bits=4, window_tokens=4, page_size=16, key_offset=True)
    g = torch.Generator().manual_seed(12)
    n, pad = 20, 7
    k, v, q = torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 6, n, 64)
    k[1, :, :pad] = 1e3  # padding: must not enter the offset
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, :pad] = False
    mask = (torch.tril(torch.ones(n, n, dtype=torch.bool))[None] & real[:, None, :])[:, None]
    kk, vv = layer.update(k, v)
    assert layer.attention(q, kk, vv, mask, None, None) is None  # first chunk: attended at full precision
    assert layer.lengths() == [n, n - pad]
    assert torch.equal(layer.key_mu[0:1], first_tokens_mean(k[0:1]))
    assert torch.equal(layer.key_mu[1:2], first_tokens_mean(k[1:2, :, pad:]))
    layer.reset()
    assert not layer.key_mu.any() and layer._mu_set == [False, False]


def test_static_generate_equals_dynamic_and_compiled_step_equals_eager():
    model = _model()
    ids = _ids(2, 21, 1)
    kw = dict(window_tokens=8, page_size=16, head_bits=HEAD_BITS, key_offset=True)
    dyn = fhf.FmkvCache(model.config, max_cache_len=64, **kw)
    st = fhf.FmkvStaticCache(model.config, max_cache_len=64, batch_size=2, device="cpu", **kw)
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **fhf.cache_kwargs(dyn))
        b = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **fhf.cache_kwargs(st))
    assert torch.equal(a, b)
    for ld, ls in zip(dyn.fmkv_layers, st.fmkv_layers):
        assert torch.equal(ld.key_mu, ls.key_mu)
        for x, y in zip(_bytes(ld), _bytes(ls)):
            assert torch.equal(x, y)
    assert st.options["key_offset"] is True and dyn.options["key_offset"] is True
    decode_runs_agree(model, lambda: fhf.FmkvStaticCache(model.config, max_cache_len=40, window_tokens=0, k_bits=3,
                                                         v_bits=3, key_offset=True),
                      ids[:, :15], 4, ("eager", "compiled"), lambda layer: [layer.key_mu.clone()])


def test_refused_first_chunk_leaves_no_offset():
    layer = FmkvLayer(0, 4, 4, max_cache_len=64, window_tokens=4, key_offset=True)
    k, v = torch.randn(1, 3, 10, 64), torch.randn(1, 3, 10, 64)
    k[0, 1, 3, 7] = float("nan")
    with pytest.raises(fmkv.FmkvError):
        layer.update(k, v)
    assert layer.key_mu is None and layer.get_seq_length() == 0
    k[0, 1, 3, 7] = 0.5
    layer.update(k, v)
    assert torch.equal(layer.key_mu, first_tokens_mean(k))
    layer.reset()
    assert layer.key_mu is None
    st = fhf.FmkvStaticLayer(0, 64, k_bits=4, v_bits=4, window_tokens=4, key_offset=True)
    k[0, 1, 3, 7] = float("inf")
    with pytest.raises(fmkv.FmkvError):
        st.write(k, v)
    assert st._mu_set == [False] and not st.key_mu.any() and st.lengths() == [0]


CUDA = torch.cuda.is_available() and fmkv.backends()["cuda"]["available"]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and an fmkv build with the 'cuda' backend")
def test_cuda_graph_capture_with_key_offset_replays_eager_tokens():
    """On CUDA: a decode step with the offset captured in one torch.cuda.CUDAGraph (the subtraction is part of the
    graph) replays to the eager steps' tokens and bytes, with and without width groups."""
    model = _model().to("cuda")
    for kw in (dict(k_bits=3, v_bits=3), dict(head_bits=CUDA_HEAD_BITS)):
        decode_runs_agree(model, lambda: fhf.FmkvStaticCache(model.config, max_cache_len=48, window_tokens=0,
                                                             key_offset=True, **kw),
                          _ids(2, 19, 16).to("cuda"), 6, ("eager", "cuda_graph"), lambda layer: [layer.key_mu.clone()])


@pytest.mark.parametrize("static", [False, True])
def test_softcapped_model_refuses_the_offset(static):
    # Gemma 2 caps its attention logits (cap * tanh(s / cap)): the offset's shift q . mu no longer cancels, so a cache
    # with key_offset=True refuses the model's first attention call naming the softcap; without the offset it runs
    cfg = transformers.Gemma2Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_logit_softcapping=50.0,
                                    sliding_window=4096, layer_types=["full_attention"] * 2, query_pre_attn_scalar=64)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = _ids(1, 12, 3)

    def make(key_offset):
        if static:
            return fhf.FmkvStaticCache(model.config, max_cache_len=64, window_tokens=0, key_offset=key_offset)
        return fhf.FmkvCache(model.config, window_tokens=0, key_offset=key_offset)

    # (an explicit mask: token id 0 is Gemma's pad token, which generate() would read as padding)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        with pytest.raises(fmkv.FmkvError, match=r"key_offset=True with softcap=50.0"):
            model.generate(ids, **kw, **fhf.cache_kwargs(make(True)))
        out = model.generate(ids, **kw, **fhf.cache_kwargs(make(False)))
    assert out.shape == (1, 15)

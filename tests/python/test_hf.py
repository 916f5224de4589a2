"""fmkv.hf: FmkvCache + the "fmkv" attention in transformers models (tiny random-weight configs).

Geometries of Llama, Qwen2, Qwen3, Mistral and Gemma 3 (sliding + full layers), head_dim 64,
GQA. Checks: generate() runs through the compressed cache, the cache holds fewer bytes than fp16,
greedy decoding with k4v4 mostly agrees with fp16 (teacher-forced top-1 agreement >= 0.5 on
near-uniform random-weight logits; measured 0.61-1.0 across the five geometries), and the fused-kernel decode path equals the
dequantize-then-attend evaluation path (fmkv.eval) to float32 rounding.
"""
import pytest

from conftest import import_hf  # noqa: E402

torch, transformers, fmkv, fhf = import_hf()

COMMON = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
              initializer_range=0.08)


def _model(arch):
    t = transformers
    if arch == "llama":
        cfg, cls = t.LlamaConfig(**COMMON), t.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = t.Qwen2Config(**COMMON), t.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = t.Qwen3Config(**COMMON), t.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = t.MistralConfig(**COMMON, sliding_window=None), t.MistralForCausalLM
    elif arch == "gemma3":
        cfg = t.Gemma3TextConfig(**COMMON, sliding_window=16, query_pre_attn_scalar=64,
                                 layer_types=["sliding_attention", "full_attention"] * 2)
        cls = t.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    return cls(cfg).eval()


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def _gen(model, ids, n, cache=None):
    kw = {} if cache is None else fhf.cache_kwargs(cache)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, **kw)[0, ids.shape[1]:]


@torch.no_grad()
def _teacher_forced_argmax(model, ids, cache=None):
    """argmax of next-token logits for every position of ids: prompt prefill + one token at a time."""
    n0 = 8
    kw = {} if cache is None else fhf.cache_kwargs(cache)
    out = model(ids[:, :n0], use_cache=True, **kw)
    pkv = fhf.output_cache(out)
    preds = [out.logits[0, -1].argmax().item()]
    for t in range(n0, ids.shape[1]):
        out = model(ids[:, t:t + 1], **fhf.cache_kwargs(pkv), use_cache=True)
        pkv = fhf.output_cache(out)
        preds.append(out.logits[0, -1].argmax().item())
    return preds


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_compressed_cache(arch):
    model = _model(arch)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = _gen(model, ids, 24)
    # window_tokens=0: every token compressed (the default 64-token fp16 window would hold all 47)
    cache = fhf.FmkvCache(model.config, k_bits=4, v_bits=4, max_cache_len=256, window_tokens=0)
    out = _gen(model, ids, 24, cache)
    assert out.shape == ref.shape
    assert isinstance(cache.layers[1], fhf.FmkvLayer)
    n_fmkv = len(cache.fmkv_layers)
    assert n_fmkv == (2 if arch == "gemma3" else 4)
    assert all(layer.get_seq_length() == 24 + 23 for layer in cache.fmkv_layers)
    # Really compressed: pages in use + fp16 regions < what fp16 K/V would take.
    assert 0 < cache.used_bytes < cache.fp16_equivalent_bytes()
    assert cache.resident_bytes > 0
    # Loose agreement bound on random weights (greedy sequences diverge after the first flip, so
    # compare teacher-forced top-1 on the fp16 continuation).
    seq = torch.cat([ids, ref.unsqueeze(0)], 1)
    a = _teacher_forced_argmax(model, seq)
    b = _teacher_forced_argmax(model, seq, fhf.FmkvCache(model.config, k_bits=4, v_bits=4, max_cache_len=256,
                                                         window_tokens=0))
    agree = sum(x == y for x, y in zip(a, b)) / len(a)
    print(f"{arch}: k4v4 teacher-forced top-1 agreement {agree:.3f}")
    assert agree >= 0.5, (arch, agree)


def test_k3v3_bytes_and_options():
    model = _model("llama")
    ids = torch.randint(0, 320, (2, 90), generator=torch.Generator().manual_seed(2))
    cache = fhf.FmkvCache(model.config, k_bits=3, v_bits=2, max_cache_len=128, page_size=16,
                          sink_tokens=2, window_tokens=8, boundary_layers=1)
    out = _gen(model, ids, 6, cache)
    assert out.shape == (6,)
    ks = [(layer.k_bits, layer.v_bits) for layer in cache.fmkv_layers]
    assert ks == [(16, 4), (3, 2), (3, 2), (16, 4)]
    assert cache.used_bytes < cache.fp16_equivalent_bytes()


def test_layer_bits_and_format_version():
    """layer_bits gives each layer its own widths (a budget plan), format_version reaches every layer's config;
    a plan of the wrong length, or combined with boundary_layers, is refused before anything is allocated."""
    model = _model("llama")
    plan = [(4, 4), (3, 3), (3, 2), (16, 4)]
    for cls, kw in ((fhf.FmkvCache, {}), (fhf.FmkvStaticCache, {})):
        cache = cls(model.config, max_cache_len=64, window_tokens=0, layer_bits=plan, format_version=3, **kw)
        ids = torch.randint(0, 320, (1, 20), generator=torch.Generator().manual_seed(6))
        assert _gen(model, ids, 3, cache).shape == (3,)
        assert [(layer.k_bits, layer.v_bits) for layer in cache.fmkv_layers] == plan
        assert all(layer.config.format_version == 3 for layer in cache.fmkv_layers)
        assert cache.options["layer_bits"] == plan
        with pytest.raises(ValueError, match="3 entries for a model of 4 layers"):
            cls(model.config, max_cache_len=64, layer_bits=plan[:3])
        with pytest.raises(ValueError, match="pass one of them"):
            cls(model.config, max_cache_len=64, layer_bits=plan, boundary_layers=1)
        with pytest.raises(ValueError, match=r"layer_bits\[1\]"):
            cls(model.config, max_cache_len=64, layer_bits=[(4, 4), (3,), (3, 3), (3, 3)])


def test_width_without_decode_kernel_fails_when_the_layer_allocates(monkeypatch):
    """A layer whose (head_dim, K, V) has no decode-attention kernel on the cache's backend (a CUDA build compiles a
    grid of pairs: fmkv.check_attention) is refused when it allocates, at the first forward, naming the layer and the
    pair -- not at the first decode step after the prefill. Here the CPU backend is made to refuse k3v2."""
    real = fmkv.check_attention

    def no_k3v2(backend, config):
        real(backend, config)
        if (config.k_bits, config.v_bits) == (3, 2):
            raise fmkv.FmkvError(f"{backend} attention: k3v2 with head_dim {config.head_dim} is not compiled into this build")

    monkeypatch.setattr(fmkv, "check_attention", no_k3v2)
    model = _model("llama")
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(8))
    plan = [(4, 4), (3, 3), (3, 2), (16, 4)]
    for cls in (fhf.FmkvCache, fhf.FmkvStaticCache):
        cache = cls(model.config, max_cache_len=64, layer_bits=plan)
        with pytest.raises(fmkv.FmkvError, match=rf"{cls.__name__} layer 2: cpu attention: k3v2 with head_dim 64"):
            with torch.no_grad():
                model(ids, use_cache=True, **fhf.cache_kwargs(cache))
        layers = cache.fmkv_layers
        assert layers[2].pages is None and layers[3].pages is None  # nothing allocated at or after the refused layer
    monkeypatch.setattr(fmkv, "check_attention", real)
    cache = fhf.FmkvCache(model.config, max_cache_len=64, layer_bits=plan)
    assert _gen(model, ids, 2, cache).shape == (2,)


def test_attn_implementation_fmkv_at_load():
    cfg = transformers.LlamaConfig(**COMMON)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="fmkv").eval()
    assert model.config._attn_implementation == "fmkv"
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(3))
    # Without an FmkvCache the "fmkv" attention falls back to sdpa: identical to a plain model.
    plain = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    plain.load_state_dict(model.state_dict())
    assert torch.equal(_gen(model, ids, 5), _gen(plain, ids, 5))
    cache = fhf.FmkvCache(model.config, k_bits=4, v_bits=4, max_cache_len=64)
    assert _gen(model, ids, 5, cache).shape == (5,)


def record_fused(monkeypatch):
    """Record, per FmkvLayer, every appended K/V chunk and every (query, fused output)."""
    log = {}
    upd, att = fhf.FmkvLayer.update, fhf.FmkvLayer.attention

    def update(self, k, v, *a, **kw):
        log.setdefault(self.layer_idx, {"kv": [], "qo": []})["kv"].append((k.clone(), v.clone()))
        return upd(self, k, v, *a, **kw)

    def attention(self, q, scaling, softcap):
        out = att(self, q, scaling, softcap)
        log[self.layer_idx]["qo"].append((q.clone(), out.clone(), scaling))
        return out

    monkeypatch.setattr(fhf.FmkvLayer, "update", update)
    monkeypatch.setattr(fhf.FmkvLayer, "attention", attention)
    return log


def check_fused_against_dequantized(log, q_cfg, tol=2e-5):
    """Every fused output == dequantize-then-attend over the same recorded K/V (fmkv.eval path)."""
    from fmkv.eval import ppl as P

    class _Mod:
        pass

    worst = 0.0
    for layer, rec in log.items():
        mod = _Mod()
        mod.layer_idx = layer
        for t, (q, out, scaling) in enumerate(rec["qo"]):
            k = torch.cat([kv[0] for kv in rec["kv"][:t + 1]], dim=2)
            v = torch.cat([kv[1] for kv in rec["kv"][:t + 1]], dim=2)
            ref, _ = P.quantized_attention(mod, q, k, v, None, scaling=scaling, quantizer=q_cfg)
            scale = max(1.0, ref.abs().max().item())
            worst = max(worst, (out - ref).abs().max().item() / scale)
    assert worst < tol, worst
    return worst


@pytest.mark.parametrize("name,kw", [
    ("k3v3", dict(k_bits=3, v_bits=3, window_tokens=0)),
    ("k4v2-rms", dict(k_bits=4, v_bits=2, scale_rule="rms", window_tokens=0)),
    ("k3v3-s2-w8", dict(k_bits=3, v_bits=3, sink_tokens=2, window_tokens=8)),
    ("k16v3", dict(k_bits=16, v_bits=3, window_tokens=0)),
    ("k3v3-fmt3", dict(k_bits=3, v_bits=3, window_tokens=0, format_version=3)),
    ("k4v3-fmt3-s2-w8", dict(k_bits=4, v_bits=3, sink_tokens=2, window_tokens=8, format_version=3)),
])
def test_fused_decode_equals_dequantize_then_attend(name, kw, monkeypatch):
    """fmkv.Cache.attention token by token == fmkv.eval's dequantize-then-attend.

    Layer by layer on the model's own tensors: equal to float32 rounding. Through the whole
    model the two paths agree only statistically: a last-bit difference in a hidden state can
    move a value across a code threshold in a later layer, so logits are compared loosely."""
    from fmkv.eval import ppl as P
    from fmkv.eval.quantizers import parse_config

    log = record_fused(monkeypatch)
    model = _model("llama")
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = fhf.FmkvCache(model.config, max_cache_len=64, prefill="compressed", **kw)
    lps = []
    with torch.no_grad():
        pkv = cache
        for t in range(ids.shape[1] - 1):
            out = model(ids[:, t:t + 1], **fhf.cache_kwargs(pkv), use_cache=True)
            pkv = fhf.output_cache(out)
            lps.append(torch.log_softmax(out.logits[0, -1].float(), -1))
    fused = torch.stack(lps)
    q = parse_config(name)
    check_fused_against_dequantized(log, q)
    P.register()
    ev = _model("llama")
    P.set_attn(ev, P.ATTN_NAME)
    ref = P.window_logprobs(ev, ids, q)
    fp = P.window_logprobs(ev, ids, parse_config("fp16"))
    tgt = ids[0, 1:, None]
    nll = lambda lp: -lp.gather(1, tgt).mean().item()  # noqa: E731
    assert abs(nll(fused) - nll(ref)) < 0.01 + 0.25 * abs(nll(ref) - nll(fp))
    assert (fused - ref).abs().max().item() < 0.5 * (fused - fp).abs().max().item()


def test_default_window_and_bytes():
    """The default keeps the 64 most recent tokens in fp16 (docs/EVAL.md: k4v4-w32 +0.91%,
    k3v3-w64 +2.76% perplexity vs +4.8% / +21.5% with every token compressed); the storage is
    torch tensors on the model's device, and its bytes equal an fmkv.Cache of the same shape."""
    import fmkv as F

    assert fhf.DEFAULT_WINDOW_TOKENS == 64
    model = _model("llama")
    cache = fhf.FmkvCache(model.config, k_bits=3, v_bits=3, max_cache_len=200)
    assert cache.options["window_tokens"] == 64
    ids = torch.randint(0, 320, (2, 100), generator=torch.Generator().manual_seed(5))
    _gen(model, ids, 4, cache)
    layer = cache.fmkv_layers[0]
    assert layer.window_tokens == 64 and layer.storage_device.type == "cpu" and layer.pages.device.type == "cpu"
    assert layer.get_seq_length() == 103
    ref = F.Cache(layer.config, 1, 2 * layer.pages_per_seq, 2, backend="ref")
    assert layer.resident_bytes == ref.resident_bytes
    s = [ref.add_sequence() for _ in range(2)]
    k = torch.randn(103, 2, 64)
    for i in s:
        ref.append(0, i, k, k)
    assert layer.used_bytes == ref.used_bytes
    assert cache.resident_bytes == 4 * layer.resident_bytes
    assert cache.device_bytes > cache.resident_bytes
    cache.check()  # host cache: nothing to raise


@pytest.mark.parametrize("kw", [dict(k_bits=3, v_bits=3, window_tokens=0),
                                dict(k_bits=4, v_bits=2, sink_tokens=2, window_tokens=8)])
def test_layer_matches_fmkv_cache(kw):
    """FmkvLayer (torch ops, batched, static block table) == fmkv.Cache (HostCache) bit for bit."""
    import fmkv as F

    layer = fhf.FmkvLayer(3, max_cache_len=96, page_size=16, seed=9, **kw)
    g = torch.Generator().manual_seed(6)
    b, h, hq, d = 2, 2, 4, 64
    chunks = [torch.randn(b, h, n, d, generator=g) for n in (20, 1, 1, 17)]
    for kv in chunks:
        layer.update(kv, -kv)
    q = torch.randn(b, hq, 3, d, generator=g)
    out = layer.attention(q, None, None)
    ref = F.Cache(layer.config, 1, 2 * layer.pages_per_seq, 2)
    for i in range(b):
        s = ref.add_sequence()
        for kv in chunks:
            ref.append(0, s, kv[i].transpose(0, 1), -kv[i].transpose(0, 1))
        want = ref.attention(0, s, q[i].transpose(0, 1))
        assert torch.equal(out[i], torch.from_numpy(want)), i


@pytest.mark.skipif(fmkv.backends()["cuda"]["available"], reason="checks the error of a build without CUDA")
def test_cuda_device_without_cuda_backend_is_an_error():
    model = _model("llama")
    ids = torch.randint(0, 320, (1, 8), generator=torch.Generator().manual_seed(7))
    cache = fhf.FmkvCache(model.config, max_cache_len=64, device="cuda")
    with pytest.raises(fmkv.FmkvError, match=r"FmkvCache layer 0: tensors are on 'cuda' but this fmkv build has no usable 'cuda' backend"):
        _gen(model, ids, 2, cache)


@pytest.mark.parametrize("arch,kw", [("llama", dict(k_bits=3, v_bits=3, window_tokens=0)),
                                     ("gemma3", dict(k_bits=4, v_bits=2, sink_tokens=2, window_tokens=8))])
def test_fused_decode_step_is_bit_identical_to_two_calls(arch, kw, monkeypatch):
    """FmkvCache(fused=True) runs decode chunks (1 and 3 tokens) as one append_attention call per layer;
    logits, pages and fp16 regions equal those of fused=False (append in update, then attention)."""
    model = _model(arch)
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(3))
    appends = []
    plain_append = fhf.FmkvLayer._append
    monkeypatch.setattr(fhf.FmkvLayer, "_append", lambda self, *a: (appends.append(self.fused), plain_append(self, *a)))
    runs = []
    for fused in (True, False):
        cache = fhf.FmkvCache(model.config, max_cache_len=64, page_size=16, fused=fused, **kw)
        logits = []
        with torch.no_grad():
            out = model(ids[:, :20], use_cache=True, **fhf.cache_kwargs(cache))
            pkv = fhf.output_cache(out)
            t = 20
            for n in (1, 1, 3, 1, 16, 1):  # decode steps and speculative chunks (16 = FUSED_MAX_ROWS)
                out = model(ids[:, t:t + n], **fhf.cache_kwargs(pkv), use_cache=True)
                pkv = fhf.output_cache(out)
                logits.append(out.logits)
                t += n
        assert all(layer._pending is None for layer in cache.fmkv_layers)
        runs.append((logits, [(layer.pages.clone(), layer.fp16_k.clone(), layer.fp16_v.clone(), layer.lens.clone())
                              for layer in cache.fmkv_layers]))
    (lf, sf), (lt, st) = runs
    n_layers = len(runs[0][1])
    # separate appends: the prefill only when fused, the prefill and the 6 decode chunks otherwise
    assert appends.count(True) == n_layers and appends.count(False) == 7 * n_layers
    assert all(torch.equal(a, b) for a, b in zip(lf, lt))
    for a, b in zip(sf, st):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fused_update_without_attention_is_appended_first():
    """K/V an update() kept for a fused step are appended before the next update (no attention call in
    between) and by FmkvCache.check(): the layer then equals one that appended every chunk at once."""
    layers = [fhf.FmkvLayer(1, max_cache_len=64, page_size=16, seed=4, fused=f, sink_tokens=1, window_tokens=4)
              for f in (True, False)]
    g = torch.Generator().manual_seed(8)
    chunks = [torch.randn(1, 2, n, 64, generator=g) for n in (9, 1, 2, 1)]
    for layer in layers:
        for kv in chunks:
            layer.update(kv, kv * 0.5)
    assert layers[0]._pending is not None and layers[1]._pending is None
    layers[0].flush()
    assert layers[0]._pending is None
    for a, b in ((layers[0].pages, layers[1].pages), (layers[0].fp16_k, layers[1].fp16_k),
                 (layers[0].fp16_v, layers[1].fp16_v), (layers[0].lens, layers[1].lens)):
        assert torch.equal(a, b)

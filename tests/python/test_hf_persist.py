"""fmkv.hf.FmkvCache / FmkvStaticCache .save / .load (fmkv.hf.persist): a cache written after a prefill and a few
decode steps, loaded in a new cache, continues a greedy decode exactly as the original (tokens, logits and storage
bit for bit, on the CPU), for plain widths, boundary layers, widths per kv head and the key offset; a static cache of
a left-padded batch (each sequence its own length, the timeline, transformers' static sliding-window layers) too,
and its loaded copy compiles; refused loads (another model geometry, a damaged layer file, a missing manifest, the
other class's directory) raise fmkv.FmkvError naming the problem; a failed save leaves the target as it was; a model
with fp16 sliding-window layers (Gemma 3) round-trips too."""
import json
import os

import pytest

from conftest import import_hf  # noqa: E402

torch, transformers, fmkv, fhf = import_hf()

from hf_cases import COMMON, HEAD_BITS, left_pad, storage, tiny_model, token_ids  # noqa: E402

CASES = {
    "k3v3-w16": dict(k_bits=3, v_bits=3, window_tokens=16, sink_tokens=2),
    "boundary": dict(k_bits=4, v_bits=2, boundary_layers=1, boundary_k_bits=16, boundary_v_bits=4, format_version=3),
    "head_bits": dict(head_bits=HEAD_BITS, window_tokens=8),
    "key_offset": dict(k_bits=3, v_bits=3, window_tokens=0, key_offset=True, scale_group=64),
}


def prefill_and_steps(model, cache, ids, steps, mask=None):
    """Prefill ``ids`` (left-padded rows at their own positions with ``mask``), then ``steps`` greedy tokens; returns
    the last token and position."""
    with torch.no_grad():
        positions = None if mask is None else (mask.cumsum(1) - 1).clamp(min=0)
        tok = model(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **fhf.cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        pos = (torch.full((ids.shape[0], 1), ids.shape[1]) if mask is None else mask.sum(1, keepdim=True)).to(ids.device)
        for _ in range(steps):
            tok = model(input_ids=tok, position_ids=pos, use_cache=True, **fhf.cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            pos = pos + 1
    return tok, pos


def continue_decode(model, cache, tok, pos, steps):
    logits = []
    with torch.no_grad():
        for _ in range(steps):
            lg = model(input_ids=tok, position_ids=pos, use_cache=True, **fhf.cache_kwargs(cache)).logits[:, -1:]
            logits.append(lg)
            tok, pos = lg.argmax(-1), pos + 1
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_saved_cache_continues_like_the_original(tmp_path, name):
    model = tiny_model()
    kw = CASES[name]
    cache = fhf.FmkvCache(model.config, max_cache_len=256, **kw)
    ids = token_ids(2, 70, seed=11)
    tok, pos = prefill_and_steps(model, cache, ids, 3)
    path = tmp_path / "saved"
    cache.save(path)
    manifest = json.loads((path / "fmkv_cache.json").read_text())
    assert manifest["kind"] == "fmkv.hf.FmkvCache" and len(manifest["fmkv_layers"]) == len(cache.fmkv_layers)
    loaded = fhf.FmkvCache.load(path, model.config)
    assert loaded.get_seq_length() == cache.get_seq_length() == 73
    for a, b in zip(cache.fmkv_layers, loaded.fmkv_layers):
        assert all(torch.equal(x, y) for x, y in zip(storage(a), storage(b)))
        assert (a.key_mu is None) == (b.key_mu is None) and (a.key_mu is None or torch.equal(a.key_mu, b.key_mu))
    assert loaded.options["key_offset"] == cache.options["key_offset"]
    out_a = continue_decode(model, cache, tok, pos, 4)
    out_b = continue_decode(model, loaded, tok, pos, 4)
    assert torch.equal(out_a, out_b)
    for a, b in zip(cache.fmkv_layers, loaded.fmkv_layers):
        assert all(torch.equal(x, y) for x, y in zip(storage(a), storage(b)))
    # saving again over the directory replaces it; an unused cache saves and loads empty
    loaded.save(path)
    assert fhf.FmkvCache.load(path, model.config).get_seq_length() == 77
    fhf.FmkvCache(model.config, **kw).save(tmp_path / "empty")
    assert fhf.FmkvCache.load(tmp_path / "empty", model.config).get_seq_length() == 0


def test_refused_loads_and_saves(tmp_path):
    model = tiny_model()
    cache = fhf.FmkvCache(model.config, max_cache_len=128, k_bits=3, v_bits=3, window_tokens=8)
    prefill_and_steps(model, cache, token_ids(1, 40, seed=3), 1)
    path = tmp_path / "c"
    cache.save(path)
    other = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 2})
    with pytest.raises(fmkv.FmkvError, match="layers"):
        fhf.FmkvCache.load(path, other, set_attention=False)
    for field, value in (("num_key_value_heads", 1), ("head_dim", 32)):
        with pytest.raises(fmkv.FmkvError, match="kv_heads" if field == "num_key_value_heads" else "head_dim"):
            fhf.FmkvCache.load(path, transformers.LlamaConfig(**{**COMMON, field: value}), set_attention=False)
    f = path / "layer_001.fmkv"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(fmkv.FmkvError, match="checksum"):
        fhf.FmkvCache.load(path, model.config)
    with pytest.raises(fmkv.FmkvError, match="not found"):
        fhf.FmkvCache.load(tmp_path / "nothing", model.config)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "fmkv_cache.json").write_text('{"kind": "something else"}')
    with pytest.raises(fmkv.FmkvError, match="manifest"):
        fhf.FmkvCache.load(tmp_path / "bad", model.config)
    # a target that is not a saved cache is not replaced; a missing parent directory is an error
    (tmp_path / "plain.txt").write_text("keep me")
    with pytest.raises(fmkv.FmkvError, match="not a saved FmkvCache"):
        cache.save(tmp_path / "plain.txt")
    assert (tmp_path / "plain.txt").read_text() == "keep me"
    with pytest.raises(fmkv.FmkvError, match="does not exist"):
        cache.save(tmp_path / "no" / "dir")
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".fmkv_cache")) == []


def test_sliding_window_layers_are_saved_too(tmp_path):
    """Gemma 3 geometry (sliding + full layers): the fp16 sliding-window layers' K/V travel with the fmkv layers, and
    the loaded cache continues the decode bit for bit."""
    cfg = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, sliding_window=16,
                                        query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    cache = fhf.FmkvCache(model.config, max_cache_len=128, window_tokens=8)
    tok, pos = prefill_and_steps(model, cache, token_ids(1, 40, seed=1), 2)
    cache.save(tmp_path / "g")
    loaded = fhf.FmkvCache.load(tmp_path / "g", model.config)
    assert loaded.get_seq_length() == 42
    assert torch.equal(continue_decode(model, cache, tok, pos, 3), continue_decode(model, loaded, tok, pos, 3))


def gemma3(layers=4):
    cfg = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": layers}, sliding_window=16,
                                        query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


STATIC_CASES = {
    "k4v4-w8": dict(k_bits=4, v_bits=4, window_tokens=8, page_size=16),
    "head_bits": dict(head_bits=HEAD_BITS, window_tokens=8, sink_tokens=2, page_size=16, format_version=3),
    "key_offset": dict(k_bits=3, v_bits=3, window_tokens=0, key_offset=True, page_size=16),
    "gemma3": dict(k_bits=3, v_bits=2, window_tokens=8, page_size=16),
}


@pytest.mark.parametrize("name", list(STATIC_CASES))
def test_static_cache_saved_and_loaded(tmp_path, name):
    """FmkvStaticCache of a left-padded batch (prompts of 37 and 9 tokens: each sequence holds its own count, pages of
    16 tokens) saved after 3 decode steps: the loaded cache (allocated at once, batch 2) holds the same bytes, lengths
    and timeline, and continues the greedy decode with the original's logits bit for bit."""
    model = gemma3() if name == "gemma3" else tiny_model()
    kw = STATIC_CASES[name]
    cache = fhf.FmkvStaticCache(model.config, max_cache_len=64, **kw)
    ids, mask = left_pad([token_ids(1, 37, seed=21)[0], token_ids(1, 9, seed=22)[0]])
    tok, pos = prefill_and_steps(model, cache, ids, 3, mask)
    assert cache.lengths() == [40, 12]
    cache.save(tmp_path / "st")
    manifest = json.loads((tmp_path / "st" / "fmkv_cache.json").read_text())
    assert manifest["kind"] == "fmkv.hf.FmkvStaticCache" and manifest["allocation"]["batch"] == 2
    loaded = fhf.FmkvStaticCache.load(tmp_path / "st", model.config)
    assert loaded.lengths() == [40, 12] and int(loaded.get_seq_length()) == int(cache.get_seq_length()) == 40
    assert loaded.layer_widths == cache.layer_widths and len(loaded.fmkv_layers) == len(cache.fmkv_layers)
    for a, b in zip(cache.fmkv_layers, loaded.fmkv_layers):
        assert all(torch.equal(x, y) for x, y in zip(storage(a), storage(b)))
        assert (a.key_mu is None) == (b.key_mu is None) and (a.key_mu is None or torch.equal(a.key_mu, b.key_mu))
        assert a._mu_set == b._mu_set and a.filled and b.filled
    sliding = [(a, b) for a, b in zip(cache.layers, loaded.layers) if type(a).__name__ == "StaticSlidingWindowLayer"]
    assert len(sliding) == (2 if name == "gemma3" else 0)
    for a, b in sliding:
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    out_a = continue_decode(model, cache, tok, pos, 4)
    out_b = continue_decode(model, loaded, tok, pos, 4)
    assert torch.equal(out_a, out_b)
    for a, b in zip(cache.fmkv_layers, loaded.fmkv_layers):
        assert all(torch.equal(x, y) for x, y in zip(storage(a), storage(b)))
    assert loaded.lengths() == [44, 16]


def test_static_cache_loaded_copy_compiles(tmp_path):
    """The loaded static cache's decode step compiles (torch.compile, fullgraph, aot_eager) and gives the eager
    step's tokens on an identical loaded copy; an unused static cache saves and loads unallocated."""
    model = tiny_model()
    kw = dict(k_bits=4, v_bits=4, window_tokens=8, page_size=16)
    cache = fhf.FmkvStaticCache(model.config, max_cache_len=48, **kw)
    ids, mask = left_pad([token_ids(1, 20, seed=31)[0], token_ids(1, 7, seed=32)[0]])
    tok, pos = prefill_and_steps(model, cache, ids, 1, mask)
    cache.save(tmp_path / "st")
    eager = continue_decode(model, fhf.FmkvStaticCache.load(tmp_path / "st", model.config), tok, pos, 3).argmax(-1)
    loaded = fhf.FmkvStaticCache.load(tmp_path / "st", model.config)

    def step(t, p):
        return model(input_ids=t, position_ids=p, use_cache=True, **fhf.cache_kwargs(loaded)).logits[:, -1:].argmax(-1)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    toks = []
    with torch.no_grad():
        for _ in range(3):
            tok = compiled(tok, pos).clone()
            pos = pos + 1
            toks.append(tok)
    assert torch.equal(torch.cat(toks, 1), eager)
    fhf.FmkvStaticCache(model.config, max_cache_len=48, **kw).save(tmp_path / "empty")
    empty = fhf.FmkvStaticCache.load(tmp_path / "empty", model.config)
    assert empty.lengths() == [] and all(layer.pages is None for layer in empty.fmkv_layers)


def test_static_cache_refusals(tmp_path):
    """A directory is loaded by the class that saved it; a manifest whose lengths disagree with the layer's snapshot
    is refused naming the sequence."""
    model = tiny_model()
    st = fhf.FmkvStaticCache(model.config, max_cache_len=48, k_bits=3, v_bits=3, window_tokens=8, page_size=16)
    prefill_and_steps(model, st, token_ids(2, 30, seed=41), 1)
    st.save(tmp_path / "st")
    dyn = fhf.FmkvCache(model.config, max_cache_len=48, k_bits=3, v_bits=3, window_tokens=8)
    prefill_and_steps(model, dyn, token_ids(1, 30, seed=41), 1)
    dyn.save(tmp_path / "dyn")
    with pytest.raises(fmkv.FmkvError, match="holds a saved fmkv.hf.FmkvStaticCache"):
        fhf.FmkvCache.load(tmp_path / "st", model.config)
    with pytest.raises(fmkv.FmkvError, match="holds a saved fmkv.hf.FmkvCache"):
        fhf.FmkvStaticCache.load(tmp_path / "dyn", model.config)
    m = json.loads((tmp_path / "st" / "fmkv_cache.json").read_text())
    m["fmkv_layers"][1]["lengths"] = [31, 40]  # the manifest disagrees with the layer's snapshot
    (tmp_path / "st" / "fmkv_cache.json").write_text(json.dumps(m))
    with pytest.raises(fmkv.FmkvError, match="sequence 1 holds 31 tokens in 2 pages .expected 40"):
        fhf.FmkvStaticCache.load(tmp_path / "st", model.config)


@pytest.mark.skipif(not (torch.cuda.is_available() and fmkv.backends()["cuda"]["available"]),
                    reason="needs a CUDA device and the extension built with the CUDA backend")
def test_cuda_cache_saved_and_loaded(tmp_path):
    """On a GPU: a CUDA cache saved, loaded back onto the GPU and into host memory (device='cpu'); the GPU copy
    continues bit for bit like the original."""
    model = tiny_model().cuda()
    cache = fhf.FmkvCache(model.config, max_cache_len=256, k_bits=3, v_bits=3, window_tokens=16, format_version=3)
    tok, pos = prefill_and_steps(model, cache, token_ids(2, 90, seed=5).cuda(), 2)
    cache.save(tmp_path / "gpu")
    loaded = fhf.FmkvCache.load(tmp_path / "gpu", model.config)
    assert all(l.storage_device.type == "cuda" for l in loaded.fmkv_layers)
    host = fhf.FmkvCache.load(tmp_path / "gpu", model.config, device="cpu")
    for a, b, h in zip(cache.fmkv_layers, loaded.fmkv_layers, host.fmkv_layers):
        assert all(torch.equal(x, y) and torch.equal(x.cpu(), z) for x, y, z in zip(storage(a), storage(b), storage(h)))
    assert torch.equal(continue_decode(model, cache, tok, pos.cuda(), 3), continue_decode(model, loaded, tok, pos.cuda(), 3))
    cache.check()
    loaded.check()


@pytest.mark.skipif(not (torch.cuda.is_available() and fmkv.backends()["cuda"]["available"]),
                    reason="needs a CUDA device and the extension built with the CUDA backend")
def test_cuda_static_cache_saved_and_loaded(tmp_path):
    """On a GPU: an FmkvStaticCache of a left-padded batch saved and loaded back onto the GPU holds the same bytes and
    continues bit for bit like the original, and its step replays in a CUDA graph to the eager tokens."""
    from conftest import cuda_graph_tokens

    model = tiny_model().cuda()
    kw = dict(k_bits=4, v_bits=4, window_tokens=8, page_size=16, format_version=3)
    cache = fhf.FmkvStaticCache(model.config, max_cache_len=64, **kw)
    ids, mask = left_pad([token_ids(1, 37, seed=51)[0], token_ids(1, 12, seed=52)[0]], device="cuda")
    tok, pos = prefill_and_steps(model, cache, ids, 2, mask)
    cache.save(tmp_path / "gpu")
    loaded = fhf.FmkvStaticCache.load(tmp_path / "gpu", model.config)
    assert all(layer.device.type == "cuda" for layer in loaded.fmkv_layers) and loaded.lengths() == [39, 14]
    for a, b in zip(cache.fmkv_layers, loaded.fmkv_layers):
        assert all(torch.equal(x, y) for x, y in zip(storage(a), storage(b)))
    twin = fhf.FmkvStaticCache.load(tmp_path / "gpu", model.config)
    eager = continue_decode(model, cache, tok, pos, 3)
    assert torch.equal(eager, continue_decode(model, loaded, tok, pos, 3))

    def step(t, p):
        return model(input_ids=t, position_ids=p, use_cache=True, **fhf.cache_kwargs(twin)).logits[:, -1:].argmax(-1)
    assert torch.equal(cuda_graph_tokens(step, tok, pos, 3), eager.argmax(-1))
    cache.check()
    loaded.check()
    twin.check()

"""fmkv.hf.FmkvCache.save / load (fmkv.hf.persist): a cache written after a prefill and a few decode steps, loaded
in a new cache, continues a greedy decode exactly as the original (tokens, logits and storage bit for bit, on the
CPU), for plain widths, boundary layers, widths per kv head and the key offset; refused loads (another model
geometry, a damaged layer file, a missing manifest) raise fmkv.FmkvError naming the problem; a failed save leaves
the target as it was; a model with fp16 sliding-window layers (Gemma 3) round-trips too."""
import json
import os

import pytest

from conftest import import_hf  # noqa: E402

torch, transformers, fmkv, fhf = import_hf()

from hf_cases import COMMON, HEAD_BITS, storage, tiny_model, token_ids  # noqa: E402

CASES = {
    "k3v3-w16": dict(k_bits=3, v_bits=3, window_tokens=16, sink_tokens=2),
    "boundary": dict(k_bits=4, v_bits=2, boundary_layers=1, boundary_k_bits=16, boundary_v_bits=4, format_version=3),
    "head_bits": dict(head_bits=HEAD_BITS, window_tokens=8),
    "key_offset": dict(k_bits=3, v_bits=3, window_tokens=0, key_offset=True, scale_group=64),
}


def prefill_and_steps(model, cache, ids, steps):
    """Prefill ``ids``, then ``steps`` greedy tokens; returns the last token and position."""
    with torch.no_grad():
        tok = model(ids, use_cache=True, **fhf.cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        pos = torch.full((ids.shape[0], 1), ids.shape[1], device=ids.device)
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

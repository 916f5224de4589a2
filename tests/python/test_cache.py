"""fmkv.Cache (fmkv::HostCache) against the float64 numpy reference in fmkv.reference."""
import numpy as np
import pytest

import fmkv
from fmkv import reference
from conftest import random_kv

TOL = 1e-5  # relative (||out - ref|| / ||ref||) for float32 outputs


def check_attention(cache, layer, seq, k, v, q, **kw):
    out = cache.attention(layer, seq, q, **kw)
    assert out.dtype == np.float32 and out.shape == q.shape
    ref = reference.attention(cache.config, layer, k, v, q, kw.get("softmax_scale"), kw.get("softcap", 0.0))
    err = reference.rel_error(out, ref)
    assert err < TOL, f"relative error {err:.3g} (backend {cache.backend})"
    return out


CONFIGS = [
    dict(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16),
    dict(head_dim=64, num_kv_heads=1, k_bits=2, v_bits=4, page_size=32, scale_rule="rms"),
    dict(head_dim=256, num_kv_heads=2, k_bits=4, v_bits=2, page_size=16),
    dict(head_dim=64, num_kv_heads=2, k_bits=16, v_bits=3, page_size=16),
    dict(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=2, page_size=16, sink_tokens=4, window_tokens=8),
    dict(head_dim=64, num_kv_heads=4, k_bits=4, v_bits=4, page_size=64, sink_tokens=0, window_tokens=5),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "d{head_dim}h{num_kv_heads}k{k_bits}v{v_bits}p{page_size}".format(**c)
                         + f"s{c.get('sink_tokens', 0)}w{c.get('window_tokens', 0)}{c.get('scale_rule', '')}")
def test_append_attention_gqa_causal(rng, backend, cfg):
    config = fmkv.Config(seed=int(rng.integers(0, 2**63)), **cfg)
    H, d = config.num_kv_heads, config.head_dim
    cache = fmkv.Cache(config, num_layers=3, num_pages=64, max_seqs=2, backend=backend)
    assert cache.backend == backend
    layer = 2
    s = cache.add_sequence()
    T = int(rng.integers(20, 70))
    k = random_kv(rng, T, H, d, outlier_scale=2.0)
    v = random_kv(rng, T, H, d)
    cut = int(rng.integers(1, T))  # two appends: a prefill chunk, then the rest
    cache.append(layer, s, k[:cut], v[:cut])
    cache.append(layer, s, k[cut:], v[cut:])
    assert cache.length(layer, s) == T and cache.length(0, s) == 0
    for rows, group in [(1, 1), (1, 4), (5, 2), (T, 3)]:  # decode, GQA, multi-token causal, full prefill
        q = rng.standard_normal((rows, H * group, d)).astype(np.float32)
        check_attention(cache, layer, s, k, v, q)


def test_decode_loop_with_window(rng, backend):
    # One token at a time: tokens age out of the fp16 window into pages as the sequence grows.
    config = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, sink_tokens=2,
                         window_tokens=6, seed=int(rng.integers(0, 2**63)))
    cache = fmkv.Cache(config, 1, 8, 1, backend=backend)
    s = cache.add_sequence()
    T = 40
    k, v = random_kv(rng, T, 2, 64), random_kv(rng, T, 2, 64)
    for t in range(T):
        cache.append(0, s, k[t:t + 1], v[t:t + 1])
        q = rng.standard_normal((1, 4, 64)).astype(np.float32)
        if t % 3 == 0 or t == T - 1:
            check_attention(cache, 0, s, k[:t + 1], v[:t + 1], q)
    assert cache.length(0, s) == T


def test_sequence_within_sink_and_window(rng, backend):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, sink_tokens=2, window_tokens=6)
    cache = fmkv.Cache(config, 1, 8, 1, backend=backend)
    s = cache.add_sequence()
    k, v = random_kv(rng, 8, 2, 64), random_kv(rng, 8, 2, 64)
    cache.append(0, s, k[:3], v[:3])
    cache.append(0, s, k[3:], v[3:])
    assert cache.length(0, s) == 8 and cache.block_table(s) == []
    check_attention(cache, 0, s, k, v, rng.standard_normal((2, 4, 64)).astype(np.float32))


def test_sequences_are_independent(rng, backend):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, seed=5)
    cache = fmkv.Cache(config, 2, 32, 3, backend=backend)
    seqs = [cache.add_sequence() for _ in range(3)]
    assert sorted(seqs) == [0, 1, 2]
    data = {}
    for s in seqs:
        for layer in range(2):
            T = int(rng.integers(2, 40))
            k, v = random_kv(rng, T, 2, 64), random_kv(rng, T, 2, 64)
            cache.append(layer, s, k, v)
            data[s, layer] = (k, v)
    for (s, layer), (k, v) in data.items():
        assert cache.length(layer, s) == len(k)
        q = rng.standard_normal((1, 2, 64)).astype(np.float32)
        check_attention(cache, layer, s, k, v, q)
    # Removing a sequence frees its pages and slot; the others are untouched.
    free0 = cache.free_pages
    n_pages = len(cache.block_table(seqs[1]))
    cache.remove_sequence(seqs[1])
    assert cache.free_pages == free0 + n_pages
    with pytest.raises(fmkv.FmkvError, match="does not exist"):
        cache.length(0, seqs[1])
    s_new = cache.add_sequence()
    assert s_new == seqs[1] and cache.length(0, s_new) == 0 and cache.length(1, s_new) == 0
    for s in (seqs[0], seqs[2]):
        k, v = data[s, 1]
        check_attention(cache, 1, s, k, v, rng.standard_normal((2, 2, 64)).astype(np.float32))


def test_options(rng, backend):
    config = fmkv.Config(head_dim=128, num_kv_heads=2, page_size=16, seed=int(rng.integers(0, 2**63)))
    cache = fmkv.Cache(config, 1, 8, 1, backend=backend)
    s = cache.add_sequence()
    k, v = random_kv(rng, 33, 2, 128), random_kv(rng, 33, 2, 128)
    cache.append(0, s, k, v)
    q = (3 * rng.standard_normal((3, 4, 128))).astype(np.float32)
    check_attention(cache, 0, s, k, v, q, softmax_scale=0.05)
    check_attention(cache, 0, s, k, v, q, softcap=1.5)
    check_attention(cache, 0, s, k, v, q, softmax_scale=0.2, softcap=3.0)
    ref = reference.attention(config, 0, k, v, q)
    for out_dtype, tol in [("float16", 2e-3), (np.float16, 2e-3), ("bfloat16", 1e-2), (np.float32, TOL)]:
        out = cache.attention(0, s, q, out_dtype=out_dtype)
        assert out.dtype == np.float32
        assert reference.rel_error(out, ref) < tol
    out16 = cache.attention(0, s, q, out_dtype="float16")
    assert np.array_equal(out16, out16.astype(np.float16).astype(np.float32))


def test_input_dtypes_and_layouts(rng, backend):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, seed=int(rng.integers(0, 2**63)))
    cache = fmkv.Cache(config, 1, 16, 4, backend=backend)
    k, v = random_kv(rng, 20, 2, 64), random_kv(rng, 20, 2, 64)
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    s32 = cache.add_sequence()
    cache.append(0, s32, k, v)
    base = cache.attention(0, s32, q)
    # float16 inputs give the same cache bytes as float32 inputs (values are rounded to fp16).
    s16 = cache.add_sequence()
    cache.append(0, s16, k.astype(np.float16), v.astype(np.float16))
    assert np.array_equal(cache.attention(0, s16, q), base)
    # Strided / transposed / Fortran-order views are read correctly.
    sv = cache.add_sequence()
    k_t = np.ascontiguousarray(k.transpose(2, 1, 0)).transpose(2, 1, 0)  # dim stride != 1
    v_f = np.asfortranarray(v)
    cache.append(0, sv, k_t[::-1].copy()[::-1], v_f)  # negative token stride
    q_nc = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)  # row stride < head stride
    assert np.array_equal(cache.attention(0, sv, q_nc), base)
    # Nested lists are accepted as well (as float32).
    sl = cache.add_sequence()
    cache.append(0, sl, k.tolist(), v.tolist())
    assert np.array_equal(cache.attention(0, sl, q.tolist()), base)
    # Read-only arrays too.
    qr = q.copy()
    qr.setflags(write=False)
    assert np.array_equal(cache.attention(0, sl, qr), base)


def test_backends_agree(rng):
    if not fmkv.backends()["cpu"]["available"]:
        pytest.skip("cpu backend not compiled into this build")
    config = fmkv.Config(head_dim=128, num_kv_heads=2, page_size=16, sink_tokens=1, window_tokens=4,
                         seed=int(rng.integers(0, 2**63)))
    k, v = random_kv(rng, 50, 2, 128), random_kv(rng, 50, 2, 128)
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)
    outs = []
    for b in ("ref", "cpu"):
        cache = fmkv.Cache(config, 1, 8, 1, backend=b)
        s = cache.add_sequence()
        cache.append(0, s, k[:17], v[:17])
        cache.append(0, s, k[17:], v[17:])
        outs.append(cache.attention(0, s, q))
    assert reference.rel_error(outs[1], outs[0]) < TOL


def test_memory_accounting(backend):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, sink_tokens=2, window_tokens=4)
    L, P, S = 2, 10, 3
    cache = fmkv.Cache(config, L, P, S, backend=backend)
    assert cache.num_layers == L and cache.free_pages == P
    assert cache.resident_bytes == L * (P * config.page_bytes + S * config.fp16_slot_bytes)
    assert cache.used_bytes == 0
    s = cache.add_sequence()
    assert cache.used_bytes == L * config.fp16_slot_bytes
    z = np.zeros((2 + 4 + 17, 2, 64), np.float32)  # 17 compressed tokens -> 2 pages
    cache.append(1, s, z, z)
    assert len(cache.block_table(s)) == 2 and cache.free_pages == P - 2
    assert cache.used_bytes == L * (2 * config.page_bytes + config.fp16_slot_bytes)
    cache.remove_sequence(s)
    assert cache.used_bytes == 0 and cache.free_pages == P
    assert "fmkv.Cache" in repr(cache)


def test_empty_append_and_default_backend(rng):
    cache = fmkv.Cache(fmkv.Config(head_dim=64, num_kv_heads=1, page_size=16), 1, 4, 1)
    assert cache.backend == fmkv.default_backend()
    s = cache.add_sequence()
    e = np.zeros((0, 1, 64), np.float32)
    cache.append(0, s, e, e)
    assert cache.length(0, s) == 0
    out = cache.attention(0, s, np.zeros((0, 1, 64), np.float32))
    assert out.shape == (0, 1, 64)


def test_threads_share_a_cache(rng, backend):
    # The GIL is released in append / attention; a per-cache mutex keeps HostCache consistent.
    import threading
    config = fmkv.Config(head_dim=128, num_kv_heads=2, page_size=16, seed=int(rng.integers(0, 2**63)))
    cache = fmkv.Cache(config, 1, 64, 4, backend=backend)
    data = {}
    for _ in range(4):
        s = cache.add_sequence()
        data[s] = (random_kv(rng, 40, 2, 128), random_kv(rng, 40, 2, 128),
                   rng.standard_normal((2, 4, 128)).astype(np.float32))
    results, errors = {}, []

    def work(s):
        try:
            k, v, q = data[s]
            for i in range(0, 40, 8):
                cache.append(0, s, k[i:i + 8], v[i:i + 8])
            results[s] = [cache.attention(0, s, q) for _ in range(3)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for s, (k, v, q) in data.items():
        ref = reference.attention(config, 0, k, v, q)
        for out in results[s]:
            assert reference.rel_error(out, ref) < TOL


@pytest.mark.parametrize("cfg", [dict(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16),
                                 dict(head_dim=64, num_kv_heads=2, k_bits=16, v_bits=3, page_size=32, sink_tokens=2,
                                      window_tokens=8),
                                 dict(head_dim=256, num_kv_heads=1, k_bits=4, v_bits=3, page_size=16)],
                         ids=["d128k3v3", "d64k16v3_sink_window", "d256k4v3"])
def test_format_3(rng, backend, cfg):
    """Format 3 (3-bit codes in tile blocks, integer levels) on the host backends (ref and cpu)."""
    config = fmkv.Config(seed=int(rng.integers(0, 2**63)), format_version=3, **cfg)
    H, d = config.num_kv_heads, config.head_dim
    cache = fmkv.Cache(config, num_layers=1, num_pages=32, max_seqs=1, backend=backend)
    s = cache.add_sequence()
    T = int(rng.integers(20, 90))
    k, v = random_kv(rng, T, H, d, outlier_scale=2.0), random_kv(rng, T, H, d)
    q = rng.standard_normal((2, H * 2, d)).astype(np.float32)
    cache.append(0, s, k[:7], v[:7])
    cache.append(0, s, k[7:], v[7:])
    check_attention(cache, 0, s, k, v, q)
    # format 2 stores the same tokens differently: the reference of one is not the other's
    ref2 = reference.attention(fmkv.Config(**{**cfg, "seed": config.seed}), 0, k, v, q)
    assert reference.rel_error(cache.attention(0, s, q), ref2) > 1e-4

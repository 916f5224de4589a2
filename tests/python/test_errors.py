"""Every error surfaces as fmkv.FmkvError (a ValueError) with a message naming the problem, and
a failed call changes nothing."""
import numpy as np
import pytest

import fmkv
from fmkv import reference
from conftest import random_kv

D, H = 64, 2


@pytest.fixture
def cache(backend):
    c = fmkv.Config(head_dim=D, num_kv_heads=H, page_size=16, seed=11)
    return fmkv.Cache(c, num_layers=2, num_pages=4, max_seqs=2, backend=backend)


def kv(rng, tokens=3, heads=H, d=D, dtype=np.float32):
    return random_kv(rng, tokens, heads, d, dtype=dtype), random_kv(rng, tokens, heads, d, dtype=dtype)


def expect(status, match):
    """pytest.raises for FmkvError with the given status name and message pattern."""
    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(fmkv.FmkvError, match=match)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            r = self.ctx.__exit__(*exc)
            e = self.info.value
            assert isinstance(e, ValueError)
            assert e.status == status, f"status {e.status} != {status}: {e}"
            assert isinstance(e.code, int) and e.code > 0
            return r
    return _Ctx()


# ---- config ----------------------------------------------------------------------------------
def test_head_dim_96():
    with expect("INVALID_ARGUMENT", r"head_dim 96 is not supported"):
        fmkv.Config(head_dim=96)
    with expect("INVALID_ARGUMENT", r"head_dim 96"):
        fmkv.bytes_per_token_head(96, 3)
    with expect("INVALID_ARGUMENT", r"length 96 is not a supported head_dim"):
        fmkv.quantize_vector(np.zeros(96, np.float32), 3)


def test_bits_6():
    """A width the format does not have (it has 2-5; fp16 K is 16) is an invalid argument naming it."""
    with expect("INVALID_ARGUMENT", r"k_bits 6 is not supported"):
        fmkv.Config(k_bits=6)
    with expect("INVALID_ARGUMENT", r"v_bits 6 is not supported"):
        fmkv.Config(v_bits=6)
    with expect("INVALID_ARGUMENT", r"v_bits 16 is not supported"):
        fmkv.Config(v_bits=16)
    with expect("INVALID_ARGUMENT", r"bits 6"):
        fmkv.quantize_vector(np.zeros(64, np.float32), 6)
    with expect("INVALID_ARGUMENT", r"bits 6"):
        fmkv.dequantize_vector(np.zeros(64, np.uint8), np.ones(2, np.float16), 6)
    with expect("INVALID_ARGUMENT", r"bits 6"):
        fmkv.codebook(6)
    with expect("INVALID_ARGUMENT", r"bits 6"):
        fmkv.bytes_per_token_head(128, 6)


@pytest.mark.parametrize("kw,match", [
    (dict(page_size=48), r"page_size 48 must be a power of two"),
    (dict(page_size=512), r"page_size 512"),
    (dict(num_kv_heads=0), r"num_kv_heads must be >= 1"),
    (dict(sink_tokens=-1), r"sink_tokens and window_tokens"),
    (dict(scale_rule="mse"), r"scale_rule 'mse' is not supported"),
    (dict(seed=-1), r"seed must be an integer"),
    (dict(head_dim=128.0), r"head_dim must be a 32-bit integer"),
])
def test_bad_config(kw, match):
    with pytest.raises(fmkv.FmkvError, match=match):
        fmkv.Config(**kw)


def test_bad_cache_arguments(backend):
    c = fmkv.Config(head_dim=D, num_kv_heads=H, page_size=16)
    with expect("INVALID_ARGUMENT", r"num_layers must be in \[1"):
        fmkv.Cache(c, 0, 4, 1, backend=backend)
    with expect("INVALID_ARGUMENT", r"max_seqs must be in \[1"):
        fmkv.Cache(c, 1, 4, 0, backend=backend)
    with expect("INVALID_ARGUMENT", r"num_pages >= 0"):
        fmkv.Cache(c, 1, -1, 1, backend=backend)
    with expect("INVALID_ARGUMENT", r"unknown backend 'tpu'"):
        fmkv.Cache(c, 1, 4, 1, backend="tpu")
    with expect("UNSUPPORTED", r"backend 'cuda'"):
        fmkv.Cache(c, 1, 4, 1, backend="cuda")
    if not fmkv.backends()["cpu"]["available"]:
        with expect("UNSUPPORTED", r"backend 'cpu' is not compiled"):
            fmkv.Cache(c, 1, 4, 1, backend="cpu")
    with pytest.raises(fmkv.FmkvError, match="must be an fmkv.Config"):
        fmkv.Cache({"head_dim": 64}, 1, 4, 1)


# ---- tensors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint16, np.bool_, np.complex64])
def test_wrong_dtype(cache, rng, dtype):
    s = cache.add_sequence()
    k, v = kv(rng)
    with expect("INVALID_ARGUMENT", r"k: dtype \w+ is not supported \(expected float32, float16 or bfloat16\)"):
        cache.append(0, s, k.astype(dtype), v)
    with expect("INVALID_ARGUMENT", r"v: dtype \w+ is not supported"):
        cache.append(0, s, k, v.astype(dtype))
    assert cache.length(0, s) == 0
    cache.append(0, s, k, v)
    with expect("INVALID_ARGUMENT", r"q: dtype \w+ is not supported"):
        cache.attention(0, s, np.ones((1, H, D), dtype))
    with expect("INVALID_ARGUMENT", r"x: dtype \w+ is not supported"):
        fmkv.quantize_vector(np.ones(D, dtype), 3)


def test_wrong_shape(cache, rng):
    s = cache.add_sequence()
    k, v = kv(rng)
    with expect("INVALID_ARGUMENT", r"k: expected a 3-D array \[tokens, num_kv_heads, head_dim\], got shape \(3, 128\)"):
        cache.append(0, s, k.reshape(3, H * D), v)
    with expect("INVALID_ARGUMENT", r"v: expected a 3-D array .* got shape \(1, 3, 2, 64\)"):
        cache.append(0, s, k, v[None])
    with expect("INVALID_ARGUMENT", r"k: shape \(3, 1, 64\) does not match \[tokens, num_kv_heads=2, head_dim=64\]"):
        cache.append(0, s, k[:, :1], v)
    with expect("INVALID_ARGUMENT", r"v: shape \(3, 2, 32\) does not match"):
        cache.append(0, s, k, v[:, :, :32])
    with expect("INVALID_ARGUMENT", r"k has 3 tokens but v has 2"):
        cache.append(0, s, k, v[:2])
    assert cache.length(0, s) == 0
    cache.append(0, s, k, v)
    with expect("INVALID_ARGUMENT", r"q: shape \(1, 3, 64\) does not match .* multiple of num_kv_heads=2"):
        cache.attention(0, s, np.ones((1, 3, D), np.float32))
    with expect("INVALID_ARGUMENT", r"q: shape \(1, 2, 128\) does not match"):
        cache.attention(0, s, np.ones((1, H, 128), np.float32))
    with expect("INVALID_ARGUMENT", r"q: expected a 3-D array"):
        cache.attention(0, s, np.ones((H, D), np.float32))
    with expect("INVALID_ARGUMENT", r"4 query rows but only 3 tokens cached"):
        cache.attention(0, s, np.ones((4, H, D), np.float32))
    with expect("INVALID_ARGUMENT", r"x: expected a 1-D array"):
        fmkv.quantize_vector(np.ones((2, D), np.float32), 3)
    with expect("INVALID_ARGUMENT", r"scales: length 3, expected head_dim / scale_group = 2"):
        fmkv.dequantize_vector(np.zeros(D, np.uint8), np.ones(3, np.float16), 3)
    with expect("INVALID_ARGUMENT", r"codes: dtype int64 is not supported \(expected uint8\)"):
        fmkv.dequantize_vector(np.zeros(D, np.int64), np.ones(2, np.float16), 3)
    with expect("INVALID_ARGUMENT", r"code 9 does not fit in 3 bits"):
        fmkv.dequantize_vector(np.full(D, 9, np.uint8), np.ones(2, np.float16), 3)
    with pytest.raises(fmkv.FmkvError, match="cannot convert"):
        cache.append(0, s, [[1, 2], [3]], v)


@pytest.mark.parametrize("bad,what", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf"), (70000.0, "fp16 range")])
def test_non_finite_kv(cache, rng, bad, what):
    s = cache.add_sequence()
    k, v = kv(rng, tokens=20)  # 20 tokens: needs 2 pages
    cache.append(1, s, k[:5], v[:5])
    k2, v2 = k[5:].copy(), v[5:].copy()
    k2[7, 1, 33] = bad
    with expect("NON_FINITE", r"k\[7\]\[1\]\[33\] is NaN, Inf or beyond the fp16 range"):
        cache.append(1, s, k2, v2)
    assert cache.length(1, s) == 5  # a failed append leaves the length unchanged
    v3 = v[5:].copy()
    v3[0, 0, 0] = bad
    with expect("NON_FINITE", r"v\[0\]\[0\]\[0\]"):
        cache.append(1, s, k[5:], v3)
    assert cache.length(1, s) == 5
    # ... and the cache still holds exactly the first 5 tokens.
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    ref = reference.attention(cache.config, 1, k[:5], v[:5], q)
    assert reference.rel_error(cache.attention(1, s, q), ref) < 1e-5
    cache.append(1, s, k[5:], v[5:])
    assert cache.length(1, s) == 20
    ref = reference.attention(cache.config, 1, k, v, q)
    assert reference.rel_error(cache.attention(1, s, q), ref) < 1e-5


def test_non_finite_q_and_vector(cache, rng):
    s = cache.add_sequence()
    k, v = kv(rng)
    cache.append(0, s, k, v)
    q = np.ones((1, H, D), np.float32)
    q[0, 1, 2] = np.nan
    with pytest.raises(fmkv.FmkvError, match=r"q.*NaN") as ei:
        cache.attention(0, s, q)
    assert ei.value.status == "NON_FINITE"
    x = np.ones(D, np.float32)
    x[5] = np.inf
    with expect("NON_FINITE", r"x\[5\] is NaN or Inf"):
        fmkv.quantize_vector(x, 3)


def test_bad_attention_options(cache, rng):
    s = cache.add_sequence()
    k, v = kv(rng)
    cache.append(0, s, k, v)
    q = np.ones((1, H, D), np.float32)
    with expect("INVALID_ARGUMENT", r"softmax_scale must be finite and > 0"):
        cache.attention(0, s, q, softmax_scale=-1.0)
    with expect("INVALID_ARGUMENT", r"softmax_scale"):
        cache.attention(0, s, q, softmax_scale=float("nan"))
    with expect("INVALID_ARGUMENT", r"softcap must be finite and >= 0"):
        cache.attention(0, s, q, softcap=-2.0)
    with pytest.raises(fmkv.FmkvError, match=r"out_dtype 'int8' is not supported"):
        cache.attention(0, s, q, out_dtype="int8")


# ---- sequences and layers --------------------------------------------------------------------
def test_unknown_sequence(cache, rng):
    k, v = kv(rng)
    q = np.ones((1, H, D), np.float32)
    for bad in (0, 1, 7, -1, 2**40):
        with expect("OUT_OF_RANGE", r"sequence -?\d+ does not exist"):
            cache.length(0, bad)
        with expect("OUT_OF_RANGE", r"does not exist"):
            cache.append(0, bad, k, v)
        with expect("OUT_OF_RANGE", r"does not exist"):
            cache.attention(0, bad, q)
        with expect("OUT_OF_RANGE", r"does not exist"):
            cache.remove_sequence(bad)
    s = cache.add_sequence()
    cache.append(0, s, k, v)
    cache.remove_sequence(s)
    with expect("OUT_OF_RANGE", rf"sequence {s} does not exist"):
        cache.append(0, s, k, v)
    with expect("OUT_OF_RANGE", rf"sequence {s} does not exist"):
        cache.remove_sequence(s)


def test_unknown_layer(cache, rng):
    s = cache.add_sequence()
    k, v = kv(rng)
    for bad in (2, -1):
        with expect("OUT_OF_RANGE", r"layer -?\d+ outside \[0, 2\)"):
            cache.length(bad, s)
        with pytest.raises(fmkv.FmkvError, match=r"layer"):
            cache.append(bad, s, k, v)
        with pytest.raises(fmkv.FmkvError, match=r"layer"):
            cache.attention(bad, s, np.ones((1, H, D), np.float32))
    assert cache.length(0, s) == 0 and cache.length(1, s) == 0


def test_out_of_slots_and_pages(cache, rng):
    a, b = cache.add_sequence(), cache.add_sequence()
    with expect("OUT_OF_RANGE", r"all 2 sequence slots are in use"):
        cache.add_sequence()
    k, v = kv(rng, tokens=70)  # 4 pages of 16 hold 64 tokens
    cache.append(0, a, k[:40], v[:40])
    with expect("OUT_OF_RANGE", r"out of pages \(1 free, sequence needs 2 more\)"):
        cache.append(0, a, k[40:], v[40:])
    assert cache.length(0, a) == 40 and cache.free_pages == 1
    with expect("OUT_OF_RANGE", r"out of pages"):
        cache.append(0, b, k[:40], v[:40])
    assert cache.length(0, b) == 0
    cache.remove_sequence(a)
    cache.append(0, b, k[:40], v[:40])
    assert cache.length(0, b) == 40


# ---- argument types, allocation limits, the fp16 range (docs/RELIABILITY.md) -----------------
def test_integers_are_never_converted_from_floats_or_strings(cache, rng):
    s = cache.add_sequence()
    k, v = kv(rng)
    cases = [
        lambda: cache.append(0, 1.5, k, v), lambda: cache.append("0", s, k, v), lambda: cache.append(True, s, k, v),
        lambda: cache.length(0, float(s)), lambda: cache.remove_sequence("0"), lambda: cache.block_table(0.0),
        lambda: cache.attention(0, s, np.ones((1, H, D), np.float32), softmax_scale="0.1"),
        lambda: cache.attention(0, s, np.ones((1, H, D), np.float32), softcap="1"),
        lambda: fmkv.codebook(3.0), lambda: fmkv.bytes_per_token_head("64", 3),
        lambda: fmkv.quantize_vector(np.ones(D, np.float32), 3, seed=1.0),
        lambda: fmkv.quantize_vector(np.ones(D, np.float32), 3, layer="1"),
        lambda: fmkv.Cache(cache.config, "2", 4, 2), lambda: fmkv.Cache(cache.config, 2, 4.0, 2),
        lambda: fmkv.Cache(cache.config, 2, 4, 2, backend=1), lambda: fmkv.synchronize(3),
        lambda: fmkv.Cache({"head_dim": 64}, 1, 4, 1),
    ]
    for f in cases:
        with expect("INVALID_ARGUMENT", r"must be (an integer|a real number|a string|an fmkv.Config), got"):
            f()
        with pytest.raises(fmkv.FmkvTypeError):
            f()
        with pytest.raises(TypeError):  # FmkvTypeError is both an FmkvError and a TypeError
            f()
    assert cache.length(0, s) == 0 and cache.free_pages == 4
    with pytest.raises(fmkv.FmkvTypeError, match="softmax_scale must be a real number or None, got str"):
        cache._impl.attention(0, s, np.ones((1, H, D), np.float32), "0.1", 0.0, "float32")  # the binding's own check
    # numpy integers and other __index__ types are integers
    cache.append(np.int64(0), np.int32(s), k, v)
    assert cache.length(np.uint8(0), s) == 3


def test_integers_beyond_the_binding_types(cache, rng):
    q = np.ones((1, H, D), np.float32)
    with expect("OUT_OF_RANGE", r"sequence 1180591620717411303424 does not exist"):
        cache.attention(0, 2**70, q)
    with expect("OUT_OF_RANGE", r"layer -1180591620717411303424 does not exist"):
        cache.length(-2**70, 0)
    with expect("INVALID_ARGUMENT", r"seed must be in \[0, 18446744073709551615\], got -1"):
        fmkv.quantize_vector(np.ones(D, np.float32), 3, seed=-1)
    with expect("INVALID_ARGUMENT", r"bits 1099511627776 is not supported"):
        fmkv.codebook(2**40)
    with expect("INVALID_ARGUMENT", r"head_dim 1099511627776 is not supported"):
        fmkv.bytes_per_token_head(2**40, 3)
    with expect("INVALID_ARGUMENT", r"bits 4294967298 is not supported"):
        fmkv.quantize_vector(np.ones(D, np.float32), 2**32 + 2)
    with expect("INVALID_ARGUMENT", r"layer 2147483648 is not supported"):
        fmkv.dequantize_vector(np.zeros(D, np.uint8), np.ones(2, np.float16), 3, layer=2**31)
    with expect("INVALID_ARGUMENT", r"max_seqs must be in \[1, 2\^31\), got 4294967296"):
        fmkv.Cache(cache.config, 1, 4, 2**32)


def test_allocation_sized_up_front(backend):
    c = fmkv.Config(head_dim=D, num_kv_heads=H, page_size=16)
    import time
    t0 = time.time()
    with expect("OUT_OF_RANGE", r"1000000000 sequences need \d+ bytes of host memory, more than this host's \d+"):
        fmkv.Cache(c, 1, 1, 10**9, backend=backend)  # ~32 GB of bookkeeping: refused, not attempted
    with expect("OUT_OF_RANGE", r"bytes of host memory"):
        fmkv.Cache(c, 64, 2**31 - 1, 1, backend=backend)
    with expect("OVERFLOW", r"num_pages 2147483648 exceeds what a 32-bit block table can address"):
        fmkv.Cache(c, 1, 2**31, 1, backend=backend)
    assert time.time() - t0 < 5  # nothing was allocated (or touched) on the way


def test_failed_append_returns_its_pages(backend, rng):
    """The issue's case: 900 rows with a NaN in the last row took 57 of 63 pages for good."""
    c = fmkv.Config(head_dim=D, num_kv_heads=1, page_size=16, seed=3)
    cache = fmkv.Cache(c, 1, 63, 2, backend=backend)
    a, b = cache.add_sequence(), cache.add_sequence()
    k, v = random_kv(rng, 900, 1, D), random_kv(rng, 900, 1, D)
    k[899, 0, 5] = np.nan
    with expect("NON_FINITE", r"k\[899\]\[0\]\[5\]"):
        cache.append(0, a, k, v)
    assert cache.free_pages == 63 and cache.block_table(a) == [] and cache.length(0, a) == 0
    full = random_kv(rng, 63 * 16, 1, D)
    cache.append(0, b, full, full)  # the whole pool is still there for another sequence
    assert cache.free_pages == 0 and sorted(cache.block_table(b)) == list(range(63))


def test_quantize_vector_names_values_beyond_fp16():
    x = np.ones(D, np.float32)
    x[7] = 1e6
    with expect("NON_FINITE", r"x\[7\] = 1e\+06 is beyond the fp16 range \(it rounds to infinity"):
        fmkv.quantize_vector(x, 3)
    x[7] = 65519.0  # rounds to 65504: fine
    fmkv.quantize_vector(x, 3)
    x[7] = np.nan
    with expect("NON_FINITE", r"x\[7\] is NaN or Inf"):
        fmkv.quantize_vector(x, 3)


def test_float16_output_overflow_is_refused(backend):
    """V values near the fp16 limit: the decompressed row exceeds 65504, so a float16 output would
    be inf. fmkv.Cache refuses it (float32 and bfloat16 return the finite value)."""
    search = np.random.default_rng(0)  # the format is bit-exact: a fixed search finds the same row
    for _ in range(400):
        x = np.clip(search.standard_normal(D) * 20000, -65504, 65504).astype(np.float32)
        x[search.integers(D)] = 65504.0
        codes, scales = fmkv.quantize_vector(x, 2)
        if np.abs(fmkv.dequantize_vector(codes, scales, 2)).max() > 65520:
            break
    else:
        pytest.fail("no V row found whose 2-bit reconstruction exceeds the fp16 range")
    c = fmkv.Config(head_dim=D, num_kv_heads=1, k_bits=2, v_bits=2, page_size=16)
    cache = fmkv.Cache(c, 1, 2, 1, backend=backend)
    s = cache.add_sequence()
    cache.append(0, s, np.zeros((1, 1, D), np.float32), x[None, None])
    q = np.zeros((1, 1, D), np.float32)
    out = cache.attention(0, s, q)
    assert np.all(np.isfinite(out)) and np.abs(out).max() > 65504
    assert np.all(np.isfinite(cache.attention(0, s, q, out_dtype="bfloat16")))
    with expect("NON_FINITE", r"attention output \[0\]\[0\]\[\d+\] overflows float16 .* use out_dtype='float32'"):
        cache.attention(0, s, q, out_dtype="float16")


def test_eval_cli_rejects_bad_arguments(capsys):
    pytest.importorskip("torch", reason="torch is not installed: fmkv-eval needs it")
    from fmkv.eval import cli
    for argv, msg in [(["ppl", "--configs", "k9v9"], "k_bits must be 2, 3, 4, 5 or 16"),
                      (["ppl", "--configs", ","], "--configs: empty list"),
                      (["ppl", "--configs", "k3v3-zz"], "unknown modifier 'zz'"),
                      (["ppl", "--ctx", "-5"], "--ctx: -5 is out of range"),
                      (["ppl", "--tokens", "x"], "--tokens: 'x' is not an integer"),
                      (["ppl", "--max-minutes", "nan"], "--max-minutes: nan is out of range"),
                      (["needle", "--trials", "0"], "--trials: 0 is out of range")]:
        with pytest.raises(SystemExit) as ei:
            cli.main(argv)
        assert ei.value.code == 2
        assert msg in capsys.readouterr().err

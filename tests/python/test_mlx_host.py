"""fmkv.mlx on MLX's CPU device (the host runtime: fmkv's C host backends on MLX arrays).

Pages and fp16 regions bit-exact against the reference backend for appends in random chunks (storage
poisoned first, every byte compared); attention within 1e-5 relative of the float64 reference
(fmkv.reference) with the output poisoned (NaN) before the library writes it; MLX arrays read and
written in place (no copies of the storage, strided K/V read as views); errors raise FmkvError
before anything is written. Skips naming MLX when it is not installed."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install mlx mlx-cpu)")

import fmkv  # noqa: E402
import fmkv.mlx as fm  # noqa: E402
from fmkv import reference  # noqa: E402

from conftest import host_backends  # noqa: E402
from mlx_cases import CASES, assert_storage_equal, bhld, poison_storage, random_kv, reference_append  # noqa: E402

ATTN_BOUND = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.2e-2}


@pytest.fixture(autouse=True)
def _cpu_device():
    """The host runtime works on MLX's CPU device (on a GPU machine the default is the GPU)."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(prev)


def _to_mx(x: np.ndarray, dtype):
    a = bhld(x)
    return a.astype(mx.bfloat16) if dtype == "bfloat16" else a


def _np_inputs(rng, T, H, d, dtype):
    x = random_kv(rng, T, H, d, np.float32 if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":  # the values the bf16 MLX array holds, as float32 (exact)
        x = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    return x


@pytest.mark.parametrize("backend", host_backends())
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}h{c[1]}q{c[2]}k{c[3]}v{c[4]}P{c[5]}S{c[6]}W{c[7]}{c[8]}-{np.dtype(c[9]).name if c[9] != 'bfloat16' else 'bf16'}")
def test_host_append_bit_exact_and_attention(rng, backend, case):
    d, H, HQ, kb, vb, P, S, W, rule, dtype = case
    cfg = fmkv.Config(head_dim=d, num_kv_heads=H, k_bits=kb, v_bits=vb, page_size=P, sink_tokens=S, window_tokens=W,
                      scale_rule=rule, seed=int(rng.integers(0, 2**63)))
    layer_index = int(rng.integers(0, 40))
    T = int(rng.integers(3 * P, 5 * P))
    layer = fm.MlxLayer(cfg, layer=layer_index, max_tokens=T + 8, runtime="host", backend=backend)
    assert layer.runtime == "host"
    poisoned = poison_storage(layer)
    k, v = _np_inputs(rng, T, H, d, dtype), _np_inputs(rng, T, H, d, dtype)
    cuts = sorted({0, T, *(int(c) for c in rng.integers(1, T, 4))})
    for a, b in zip(cuts, cuts[1:]):  # random chunks, including single tokens around the window
        layer.append(_to_mx(k[a:b], dtype), _to_mx(v[a:b], dtype))
    assert layer.length == T
    assert_storage_equal(layer, reference_append(layer, poisoned, k, v))

    R = int(rng.integers(1, 5))
    q = _np_inputs(rng, R, HQ, d, dtype)
    out = layer.attention(_to_mx(q, dtype))
    assert out.shape == (R, HQ, d) and out.dtype == (mx.bfloat16 if dtype == "bfloat16" else mx.array(q).dtype)
    ref = reference.attention(cfg, layer_index, k, v, q)
    err = reference.rel_error(np.array(out.astype(mx.float32)), ref)
    bound = ATTN_BOUND["bfloat16" if dtype == "bfloat16" else np.dtype(dtype).name]
    assert err <= bound, f"attention rel. error {err:.3g} > {bound}"


def test_host_storage_is_written_in_place_and_inputs_are_views(rng):
    cfg = fmkv.Config(head_dim=128, num_kv_heads=2, k_bits=4, v_bits=4, page_size=16)
    layer = fm.MlxLayer(cfg, max_tokens=64, runtime="host")
    addr = np.asarray(memoryview(layer.pages)).ctypes.data
    before = np.array(layer.pages).copy()
    k = mx.random.normal((1, 2, 40, 128)).astype(mx.float16)
    # a [1, heads, n, d] view whose rows are strided (what an mlx-lm model's values are: a transpose)
    kt = mx.random.normal((1, 40, 2, 128)).astype(mx.float16).transpose(0, 2, 1, 3)
    layer.append(k, kt)
    assert np.asarray(memoryview(layer.pages)).ctypes.data == addr, "the page pool was reallocated"
    assert not np.array_equal(np.array(layer.pages), before), "the append wrote nothing into the MLX array"
    # the strided V was read correctly: its pages equal those of a contiguous copy
    other = fm.MlxLayer(cfg, max_tokens=64, runtime="host")
    other.append(k, mx.contiguous(kt))
    assert np.array_equal(np.array(layer.pages), np.array(other.pages))


def test_host_errors_leave_the_cache_unchanged(rng):
    cfg = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, window_tokens=8)
    layer = fm.MlxLayer(cfg, max_tokens=48, runtime="host")
    k = mx.array(random_kv(rng, 20, 2, 64).transpose(1, 0, 2)[None])
    layer.append(k, k)
    snap = [np.array(a).copy() for a in layer.storage()]
    bad = np.array(k)
    bad[0, 1, 3, 5] = np.nan
    cases = [
        (lambda: layer.append(mx.array(bad), k), "NaN"),
        (lambda: layer.append(k[:, :1], k[:, :1]), "heads"),
        (lambda: layer.append(k.astype(mx.int32), k), "dtype"),
        (lambda: layer.append(k, k[:, :, :3]), "tokens"),
        (lambda: layer.append(mx.concatenate([k, k], axis=2), mx.concatenate([k, k], axis=2)), "cache full"),
        (lambda: layer.attention(mx.zeros((1, 3, 1, 64))), "multiple"),
        (lambda: layer.attention(mx.zeros((1, 4, 21, 64))), "tokens cached"),
        (lambda: layer.attention(mx.zeros((1, 4, 1, 64)), softmax_scale=float("nan")), "finite"),
        (lambda: layer.trim(1), "window"),
    ]
    for call, what in cases:
        with pytest.raises(fmkv.FmkvError, match=what):
            call()
        assert layer.length == 20
        for a, b in zip(layer.storage(), snap):
            assert np.array_equal(np.array(a), b), f"a failed call ({what}) changed the cache"
    with pytest.raises(fmkv.FmkvError, match="runtime"):
        fm.MlxLayer(cfg, runtime="tpu")
    with pytest.raises(fmkv.FmkvError, match="not one of|backends"):
        fm.MlxLayer(cfg, runtime="host", backend="cuda")


def test_host_trim_is_exact_without_window(rng):
    cfg = fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=4, v_bits=4, page_size=16)
    a = fm.MlxLayer(cfg, max_tokens=64, runtime="host")
    b = fm.MlxLayer(cfg, max_tokens=64, runtime="host")
    x = mx.array(random_kv(rng, 40, 1, 64).transpose(1, 0, 2)[None])
    y = mx.array(random_kv(rng, 40, 1, 64).transpose(1, 0, 2)[None])
    a.append(x, x)
    assert a.trim(13) == 13 and a.length == 27
    a.append(y[:, :, :5], y[:, :, :5])
    b.append(x[:, :, :27], x[:, :, :27])
    b.append(y[:, :, :5], y[:, :, :5])
    q = mx.random.normal((1, 1, 1, 64))
    assert np.array_equal(np.array(a.attention(q)), np.array(b.attention(q)))

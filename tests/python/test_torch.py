"""torch tensors through DLPack: float32, float16, bfloat16, strided views, errors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch to run the DLPack tests")

import fmkv  # noqa: E402
from fmkv import reference  # noqa: E402

TOL = 1e-5


@pytest.fixture
def tgen(rng):
    return torch.Generator().manual_seed(int(rng.integers(0, 2**62)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_append_attention(backend, tgen, dtype):
    config = fmkv.Config(head_dim=128, num_kv_heads=2, page_size=16, sink_tokens=1, window_tokens=3,
                         seed=int(torch.randint(0, 2**62, (1,), generator=tgen)))
    cache = fmkv.Cache(config, 2, 16, 1, backend=backend)
    s = cache.add_sequence()
    k = torch.randn(37, 2, 128, generator=tgen).to(dtype)
    v = torch.randn(37, 2, 128, generator=tgen).to(dtype)
    cache.append(1, s, k[:20], v[:20])
    cache.append(1, s, k[20:], v[20:])
    q = torch.randn(4, 8, 128, generator=tgen).to(dtype)
    out = cache.attention(1, s, q)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (4, 8, 128)
    ref = reference.attention(config, 1, k, v, q)
    assert reference.rel_error(out, ref) < TOL
    # torch.from_numpy round trip works without a copy
    t = torch.from_numpy(out)
    assert t.dtype == torch.float32 and t.shape == (4, 8, 128)


def test_bf16_matches_float32_of_same_values(backend, tgen):
    # bf16 arrives with DLPack's bfloat code: it must be read as bf16, not as fp16 or uint16.
    config = fmkv.Config(head_dim=64, num_kv_heads=1, page_size=16, seed=3)
    k = torch.randn(20, 1, 64, generator=tgen).to(torch.bfloat16)
    v = torch.randn(20, 1, 64, generator=tgen).to(torch.bfloat16)
    q = torch.randn(2, 2, 64, generator=tgen).to(torch.bfloat16)
    outs = []
    for kk, vv, qq in [(k, v, q), (k.float().numpy(), v.float().numpy(), q.float().numpy())]:
        cache = fmkv.Cache(config, 1, 4, 1, backend=backend)
        s = cache.add_sequence()
        cache.append(0, s, kk, vv)
        outs.append(cache.attention(0, s, qq))
    assert np.array_equal(outs[0], outs[1])
    # quantize_vector accepts bf16 tensors too (rounded bf16 -> fp16 like the cache)
    a = fmkv.quantize_vector(k[0, 0], 3, seed=3)
    b = fmkv.quantize_vector(k[0, 0].float().numpy(), 3, seed=3)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_torch_strided_views(backend, tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, seed=9)
    k = torch.randn(64, 2, 30, generator=tgen).permute(2, 1, 0)  # [30, 2, 64], dim stride 60
    v = torch.randn(2, 30, 64, generator=tgen).transpose(0, 1)   # [30, 2, 64], unit dim stride
    q = torch.randn(3, 8, 64, generator=tgen)[:, ::2]             # [3, 4, 64], head stride 128
    cache = fmkv.Cache(config, 1, 8, 2, backend=backend)
    s1, s2 = cache.add_sequence(), cache.add_sequence()
    cache.append(0, s1, k, v)
    cache.append(0, s2, k.contiguous(), v.contiguous())
    o1, o2 = cache.attention(0, s1, q), cache.attention(0, s2, q.contiguous())
    assert np.array_equal(o1, o2)
    assert reference.rel_error(o1, reference.attention(config, 0, k, v, q)) < TOL
    o3 = cache.attention(0, s1, q, out_dtype=torch.bfloat16)
    assert reference.rel_error(o3, o1) < 1e-2


def test_torch_errors(backend, tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    cache = fmkv.Cache(config, 1, 8, 1, backend=backend)
    s = cache.add_sequence()
    k = torch.randn(4, 2, 64, generator=tgen)
    with pytest.raises(fmkv.FmkvError, match=r"k: dtype float64 is not supported"):
        cache.append(0, s, k.double(), k)
    with pytest.raises(fmkv.FmkvError, match=r"v: dtype int64 is not supported"):
        cache.append(0, s, k, k.long())
    with pytest.raises(fmkv.FmkvError, match=r"k: shape \(4, 1, 64\) does not match"):
        cache.append(0, s, k[:, :1], k[:, :1])
    bad = k.clone().to(torch.bfloat16)
    bad[2, 1, 7] = float("nan")
    with pytest.raises(fmkv.FmkvError, match=r"k\[2\]\[1\]\[7\] is NaN"):
        cache.append(0, s, bad, k)
    assert cache.length(0, s) == 0
    cache.append(0, s, k, k)
    with pytest.raises(fmkv.FmkvError, match=r"q: expected a 3-D array"):
        cache.attention(0, s, k[0])

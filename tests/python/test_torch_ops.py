"""torch.library custom ops fmkv::append / fmkv::attention: results, opcheck, fake tensors, errors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch to run the torch.library op tests")

import fmkv  # noqa: E402
from fmkv import reference, torch_ops  # noqa: E402

TOL = 1e-5


@pytest.fixture
def tgen(rng):
    return torch.Generator().manual_seed(int(rng.integers(0, 2**62)))


def layer_tensors(config, num_pages, num_slots):
    R = config.sink_tokens + config.window_tokens
    pages = torch.zeros(num_pages, config.page_bytes, dtype=torch.uint8)
    fk = torch.zeros(num_slots, config.num_kv_heads, R, config.head_dim, dtype=torch.float16)
    return pages, fk, fk.clone()


def batch(slots, lens, rows, tables):
    offs = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    return (torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int64), torch.from_numpy(offs),
            torch.tensor(tables, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_cache_matches_reference(backend, tgen, dtype):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, sink_tokens=2, window_tokens=3,
                         seed=2**64 - 1 - int(torch.randint(0, 2**62, (1,), generator=tgen)))
    tc = torch_ops.TorchCache(config, 2, 8, 2, backend=backend)
    s = tc.add_sequence()
    k = torch.randn(30, 2, 64, generator=tgen).to(dtype)
    v = torch.randn(30, 2, 64, generator=tgen).to(dtype)
    tc.append(1, s, k[:1], v[:1])  # first tokens only in the fp16 sink: no pages yet
    tc.append(1, s, k[1:], v[1:])
    assert tc.length(1, s) == 30 and tc.length(0, s) == 0 and len(tc.block_table(s)) == 2
    q = torch.randn(3, 4, 64, generator=tgen).to(dtype)
    out = tc.attention(1, s, q)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference.attention(config, 1, k, v, q)
    tol = TOL if dtype == torch.float32 else (2e-3 if dtype == torch.float16 else 1e-2)
    assert reference.rel_error(out.float().numpy(), ref) < tol
    # Same bytes as fmkv.Cache: identical float32 results.
    cache = fmkv.Cache(config, 2, 8, 2, backend=backend)
    cs = cache.add_sequence()
    cache.append(1, cs, k[:20], v[:20])
    cache.append(1, cs, k[20:], v[20:])
    if dtype == torch.float32:
        assert np.array_equal(cache.attention(1, cs, q), out.numpy())
    # storage bytes: the same count as fmkv.Cache, from the tensors actually allocated
    assert tc.resident_bytes == cache.resident_bytes and tc.used_bytes == cache.used_bytes
    assert tc.device == torch.device("cpu") and tc.index_bytes > 0
    tc.remove_sequence(s)
    assert tc.free_pages == 8


def test_batched_ops(backend, tgen):
    # Two sequences in one call, permuted pages and slots.
    config = fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=4, v_bits=2, page_size=16, seed=77)
    cfg = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 6, 2)
    ks = [torch.randn(n, 1, 64, generator=tgen) for n in (20, 33)]
    vs = [torch.randn(n, 1, 64, generator=tgen) for n in (20, 33)]
    tables = [[5, 1, 0], [3, 2, 4]]
    torch.ops.fmkv.append(pages, fk, fv, torch.cat(ks), torch.cat(vs), *batch([1, 0], [0, 0], [20, 33], tables), cfg, 3)
    q = torch.randn(4, 2, 64, generator=tgen)
    out = torch.ops.fmkv.attention(pages, fk, fv, q, *batch([1, 0], [20, 33], [1, 3], tables), cfg, 3, 0.0, 0.0, backend)
    assert reference.rel_error(out[:1].numpy(), reference.attention(config, 3, ks[0], vs[0], q[:1])) < TOL
    assert reference.rel_error(out[1:].numpy(), reference.attention(config, 3, ks[1], vs[1], q[1:])) < TOL


def opcheck_args(config, tgen, backend):
    cfg = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 4, 1)
    k = torch.randn(20, config.num_kv_heads, config.head_dim, generator=tgen)
    v = torch.randn(20, config.num_kv_heads, config.head_dim, generator=tgen)
    app = (pages, fk, fv, k, v, *batch([0], [0], [20], [[2, 0]]), cfg, 0, backend)
    torch.ops.fmkv.append(*app)
    q = torch.randn(2, 2 * config.num_kv_heads, config.head_dim, generator=tgen)
    att = (pages, fk, fv, q, *batch([0], [20], [2], [[2, 0]]), cfg, 0, 0.0, 0.0, backend)
    return app, att


@pytest.mark.parametrize("window", [0, 4])
def test_opcheck(backend, tgen, window):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, window_tokens=window, seed=1)
    app, att = opcheck_args(config, tgen, backend)
    torch.library.opcheck(torch.ops.fmkv.append.default, app)
    torch.library.opcheck(torch.ops.fmkv.attention.default, att)


def test_fake_tensor_mode(tgen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    app, att = opcheck_args(config, tgen, "ref")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in att]
        fake[3] = torch.empty(5, 4, 64, dtype=torch.bfloat16)
        out = torch.ops.fmkv.attention(*fake)
        assert out.shape == (5, 4, 64) and out.dtype == torch.bfloat16
        fa = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in app]
        assert torch.ops.fmkv.append(*fa) is None
    # meta tensors go through the fake implementation too
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in att]
    out = torch.ops.fmkv.attention(*meta)
    assert out.device.type == "meta" and out.shape == att[3].shape


def test_op_errors(tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    app, att = opcheck_args(config, tgen, "ref")
    bad = list(att)
    bad[3] = att[3].double()
    with pytest.raises(fmkv.FmkvError, match=r"fmkv::attention: q: dtype torch.float64 is not supported"):
        torch.ops.fmkv.attention(*bad)
    bad = list(app)
    bad[3] = app[3].to(torch.int32)
    with pytest.raises(fmkv.FmkvError, match=r"fmkv::append: k: dtype torch.int32 is not supported"):
        torch.ops.fmkv.append(*bad)
    bad = list(app)
    bad[0] = app[0].to(torch.int16)
    with pytest.raises(fmkv.FmkvError, match=r"pages: dtype int16 is not supported \(expected uint8\)"):
        torch.ops.fmkv.append(*bad)
    bad = list(app)
    bad[0] = app[0][:, :100]
    with pytest.raises(fmkv.FmkvError, match=r"pages: must be contiguous"):
        torch.ops.fmkv.append(*bad)
    bad = list(app)
    bad[8] = app[8][:, :1]  # block table too short for 20 tokens
    with pytest.raises(fmkv.FmkvError, match=r"needs 2 pages but block_table_stride is 1"):
        torch.ops.fmkv.append(*bad)
    bad = list(app)
    bad[3] = app[3].clone()
    bad[3][4, 0, 0] = float("inf")
    before = app[0].clone()
    with pytest.raises(fmkv.FmkvError, match=r"k\[4\]\[0\]\[0\] is NaN, Inf"):
        torch.ops.fmkv.append(*bad)
    assert torch.equal(app[0], before)  # nothing written on error
    bad = list(att)
    bad[9] = -1
    with pytest.raises(fmkv.FmkvError, match=r"layer must be"):
        torch.ops.fmkv.attention(*bad)
    bad = list(att)
    bad[8] = [1, 2, 3]
    with pytest.raises(fmkv.FmkvError, match=r"expected the 11 ints"):
        torch.ops.fmkv.attention(*bad)
    bad = list(att)
    bad[12] = "cuda"  # CPU tensors with the cuda backend: never a silent copy
    with pytest.raises(fmkv.FmkvError, match=r"backend 'cuda' works on CUDA tensors, but the tensors are on 'cpu'"):
        torch.ops.fmkv.attention(*bad)
    bad = list(att)
    bad[4] = att[4].to("meta")  # mixed devices in one call
    with pytest.raises(fmkv.FmkvError, match=r"slots is on device 'meta' but pages is on 'cpu'"):
        torch.ops.fmkv.attention(*bad)
    with pytest.raises(fmkv.FmkvError, match=r"backend 'metal' is not available"):
        torch_ops.TorchCache(config, 1, 4, 1, backend="metal")


def test_raw_binding_device_checks(tgen):
    """The binding itself rejects a backend that does not match the tensors' device."""
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    app, att = opcheck_args(config, tgen, "ref")
    raw = config._raw()
    args = list(att[:8])
    out = torch.empty_like(att[3])
    if fmkv.backends()["cuda"]["available"]:
        with pytest.raises(fmkv.FmkvError, match=r"pages: tensor is on device cpu but backend 'cuda' works on CUDA device memory"):
            fmkv._fmkv.attention_raw("cuda", raw, 0, *args, out)
    else:
        with pytest.raises(fmkv.FmkvError, match=r"backend 'cuda' is not compiled into this build"):
            fmkv._fmkv.attention_raw("cuda", raw, 0, *args, out)
    with pytest.raises(fmkv.FmkvError, match=r"backend 'metal' is not supported by the raw ops"):
        fmkv._fmkv.attention_raw("metal", raw, 0, *args, out)
    # the lse tensor (fmkv_attention_lse): float32 [rows, q heads], refused by name before anything is written
    for lse, msg in ((torch.zeros(2, 4, dtype=torch.float64), r"lse: dtype float64 is not supported \(expected float32\)"),
                     (torch.zeros(2, 3), r"lse: shape \(2, 3\) must be \[query_tokens, q_heads\]")):
        out.fill_(7.0)
        with pytest.raises(fmkv.FmkvError, match=msg):
            fmkv._fmkv.attention_raw("ref", raw, 0, *att[:3], *att[4:8], att[3], out, lse=lse)
        assert bool((out == 7.0).all()) and bool((lse == 0).all())
    # host backends need no workspace: 0 bytes
    assert torch_ops.attention_workspace_bytes(config, 4, 2, 1, backend="cpu") == 0
    assert fmkv._fmkv.attention_workspace_bytes("ref", raw, 4, 2, 1, 0) == 0
    fmkv.synchronize("ref")  # host backends: nothing pending, nothing to raise


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to check the device error")
def test_op_rejects_cuda_tensor_with_host_backend(tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    app, att = opcheck_args(config, tgen, "ref")
    bad = list(att)
    bad[3] = att[3].cuda()
    with pytest.raises(fmkv.FmkvError, match=r"q is on device 'cuda:0' but pages is on 'cpu'"):
        torch.ops.fmkv.attention(*bad)
    bad = [a.cuda() if isinstance(a, torch.Tensor) else a for a in att]
    with pytest.raises(fmkv.FmkvError, match=r"backend 'ref' works on CPU tensors, but the tensors are on 'cuda:0'"):
        torch.ops.fmkv.attention(*bad)


def test_backend_follows_device():
    assert torch_ops.backend_for_device("cpu") == fmkv.default_backend()
    assert torch_ops.backend_for_device("cpu", "ref") == "ref"
    with pytest.raises(fmkv.FmkvError, match=r"backend 'cpu' works on CPU tensors, but the tensors are on 'cuda'"):
        torch_ops.backend_for_device("cuda", "cpu")
    with pytest.raises(fmkv.FmkvError, match=r"backend 'cuda' works on CUDA tensors, but the tensors are on 'cpu'"):
        torch_ops.backend_for_device("cpu", "cuda")
    if not fmkv.backends()["cuda"]["available"]:
        # CUDA tensors with an extension built without CUDA (or no device): a clear error
        with pytest.raises(fmkv.FmkvError, match=r"no usable 'cuda' backend.*FMKV_CUDA=ON"):
            torch_ops.backend_for_device("cuda")
        with pytest.raises(fmkv.FmkvError, match=r"no usable 'cuda' backend"):
            torch_ops.TorchCache(fmkv.Config(head_dim=64, num_kv_heads=1), 1, 2, 1, device="cuda")
    else:
        assert torch_ops.backend_for_device("cuda") == "cuda"


@pytest.mark.parametrize("window", [0, 8])
def test_append_attention_equals_append_then_attention(backend, tgen, window):
    # The fused decode step writes the same bytes as append and returns the same attention as
    # attention over the grown cache (two sequences, 1 and 3 new rows; pages shared by position).
    config = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, window_tokens=window, seed=5)
    cfg = torch_ops.config_to_list(config)
    tables = [[5, 1, 0, 6], [3, 2, 4, 7]]
    pages, fk, fv = layer_tensors(config, 8, 2)
    k0 = torch.randn(53, 2, 64, generator=tgen)
    v0 = torch.randn(53, 2, 64, generator=tgen)
    torch.ops.fmkv.append(pages, fk, fv, k0, v0, *batch([1, 0], [0, 0], [20, 33], tables), cfg, 2)
    k1, v1 = torch.randn(4, 2, 64, generator=tgen), torch.randn(4, 2, 64, generator=tgen)
    q = torch.randn(4, 4, 64, generator=tgen)
    p2, fk2, fv2 = pages.clone(), fk.clone(), fv.clone()
    torch.ops.fmkv.append(pages, fk, fv, k1, v1, *batch([1, 0], [20, 33], [1, 3], tables), cfg, 2)
    want = torch.ops.fmkv.attention(pages, fk, fv, q, *batch([1, 0], [21, 36], [1, 3], tables), cfg, 2, 0.0, 0.0, backend)
    got = torch.ops.fmkv.append_attention(p2, fk2, fv2, k1, v1, q, *batch([1, 0], [20, 33], [1, 3], tables), cfg, 2,
                                          0.0, 0.0, backend)
    assert torch.equal(p2, pages) and torch.equal(fk2, fk) and torch.equal(fv2, fv)
    assert reference.rel_error(got.numpy(), want.numpy()) < 1e-6


def test_append_attention_row_limit_and_opcheck(tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=1, page_size=16, window_tokens=4, seed=2)
    cfg = torch_ops.config_to_list(config)
    n = torch_ops.FUSED_MAX_ROWS + 1
    pages, fk, fv = layer_tensors(config, 4, 1)
    k, v, q = (torch.randn(n, h, 64, generator=tgen) for h in (1, 1, 2))
    with pytest.raises(fmkv.FmkvError, match="at most 16"):
        torch.ops.fmkv.append_attention(pages, fk, fv, k, v, q, *batch([0], [0], [n], [[0, 1, 2]]), cfg, 0)
    assert not pages.any(), "nothing may be written on error"
    args = (pages, fk, fv, k[:3], v[:3], q[:3], *batch([0], [0], [3], [[0, 1, 2]]), cfg, 0, 0.0, 0.0, "ref")
    torch.library.opcheck(torch.ops.fmkv.append_attention.default, args)


def test_written_tensors_get_new_versions(backend, tgen):
    # The ops bump the version counters of the tensors they write (pages, fp16 regions), as aten's in-place
    # ops do, so autograd's saved-tensor check sees the change; attention writes nothing and bumps nothing.
    config = fmkv.Config(head_dim=64, num_kv_heads=1, page_size=16, window_tokens=4, seed=3)
    cfg = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 4, 1)
    k, v = torch.randn(6, 1, 64, generator=tgen), torch.randn(6, 1, 64, generator=tgen)
    before = [t._version for t in (pages, fk, fv)]
    torch.ops.fmkv.append(pages, fk, fv, k, v, *batch([0], [0], [6], [[0, 1, 2, 3]]), cfg, 0, backend)
    after = [t._version for t in (pages, fk, fv)]
    assert all(a > b for a, b in zip(after, before))
    q = torch.randn(1, 2, 64, generator=tgen)
    torch.ops.fmkv.attention(pages, fk, fv, q, *batch([0], [6], [1], [[0, 1, 2, 3]]), cfg, 0, 0.0, 0.0, backend)
    assert [t._version for t in (pages, fk, fv)] == after
    with torch.inference_mode():  # tensors made here have no version counter to bump: no error either
        p2, fk2, fv2 = layer_tensors(config, 4, 1)
        torch.ops.fmkv.append_attention(p2, fk2, fv2, k[:1], v[:1], q, *batch([0], [0], [1], [[0, 1, 2, 3]]), cfg, 0,
                                        0.0, 0.0, backend)
    with torch.no_grad():
        torch.ops.fmkv.append_attention(pages, fk, fv, k[:1], v[:1], q, *batch([0], [6], [1], [[0, 1, 2, 3]]), cfg, 0,
                                        0.0, 0.0, backend)
    assert all(a > b for a, b in zip([t._version for t in (pages, fk, fv)], after))


def test_max_seq_len_bound(backend, tgen):
    # max_seq_len: a promise about the call's lengths (the CUDA split plan follows it). The same results
    # as without it when kept (exact or loose), an error naming the sequence when broken, nothing written.
    config = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, window_tokens=4, seed=9)
    app, att = opcheck_args(config, tgen, backend)  # one sequence of 20 tokens, 2 query rows
    free = torch.ops.fmkv.attention(*att)
    for bound in (20, 21, 10_000):
        assert torch.equal(torch.ops.fmkv.attention(*att, bound), free)
        assert torch.equal(torch_ops.attention(*att, max_seq_len=bound), free)
    with pytest.raises(fmkv.FmkvError, match=r"sequence 0: 20 tokens, more than opts.max_seq_len = 19"):
        torch.ops.fmkv.attention(*att, 19)
    with pytest.raises(fmkv.FmkvError, match=r"max_seq_len must be >= 0"):
        torch.ops.fmkv.attention(*att, -1)
    torch.library.opcheck(torch.ops.fmkv.attention.default, (*att, 20))
    # the fused step: the bound covers the lengths after the append (20 + 3 rows)
    pages, fk, fv, k, v = app[0].clone(), app[1].clone(), app[2].clone(), app[3][:3], app[4][:3]
    q = torch.randn(3, 4, 64, generator=tgen)
    step = (k, v, q, *batch([0], [20], [3], [[2, 0]]), app[9], 0, 0.0, 0.0, backend)
    before = pages.clone()
    with pytest.raises(fmkv.FmkvError, match=r"sequence 0: 23 tokens, more than opts.max_seq_len = 22"):
        torch.ops.fmkv.append_attention(pages, fk, fv, *step, 22)
    assert torch.equal(pages, before), "nothing may be written on error"
    out = torch.ops.fmkv.append_attention(pages, fk, fv, *step, 23)
    p2, fk2, fv2 = app[0].clone(), app[1].clone(), app[2].clone()
    assert torch.equal(torch_ops.append_attention(p2, fk2, fv2, *step), out)
    assert torch.equal(p2, pages) and torch.equal(fk2, fk) and torch.equal(fv2, fv)


def test_torch_cache_key_offset(tgen):
    """TorchCache(key_offset=True): each (layer, sequence)'s pages are those of a cache without the offset fed K minus
    the mean of its first append's first 128 fp16-rounded keys; the offset is fixed by that append, per layer and
    sequence, kept only when the append succeeds, and cleared by reset_sequence / remove_sequence."""
    from fmkv.key_offset import first_tokens_mean

    config = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, window_tokens=4)
    a = torch_ops.TorchCache(config, 2, 32, 2, key_offset=True)
    b = torch_ops.TorchCache(config, 2, 32, 2)
    for c in (a, b):
        assert c.add_sequence() == 0 and c.add_sequence() == 1
    g = torch.Generator().manual_seed(4)
    mus = {}
    for layer in (0, 1):
        for s in (0, 1):
            k = torch.randn(150, 2, 64, generator=g) + 3 * torch.randn(1, 2, 64, generator=g)
            v = torch.randn(150, 2, 64, generator=g)
            mu = first_tokens_mean(k.transpose(0, 1).unsqueeze(0))[0, :, 0]
            mus[layer, s] = mu
            a.append(layer, s, k, v)
            b.append(layer, s, k - mu, v)
            k1, v1 = torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
            a.append(layer, s, k1, v1)
            b.append(layer, s, k1 - mu, v1)
            q = torch.randn(3, 8, 64, generator=g)
            assert torch.equal(a.attention(layer, s, q), b.attention(layer, s, q))
            assert torch.equal(a.key_mu(layer, s), mu)
    for layer in (0, 1):
        assert torch.equal(a.pages[layer], b.pages[layer]) and torch.equal(a.fp16_k[layer], b.fp16_k[layer])
    assert not torch.equal(mus[0, 0], mus[0, 1]) and not torch.equal(mus[0, 0], mus[1, 0])
    a.reset_sequence(1)
    assert a.key_mu(0, 1) is None and a.key_mu(1, 1) is None and torch.equal(a.key_mu(0, 0), mus[0, 0])
    bad = torch.randn(5, 2, 64, generator=g)
    bad[2, 1, 3] = float("nan")
    with pytest.raises(fmkv.FmkvError):
        a.append(0, 1, bad, torch.randn(5, 2, 64, generator=g))
    assert a.key_mu(0, 1) is None and a.length(0, 1) == 0  # the refused first append left no offset
    a.remove_sequence(0)
    assert a.key_mu(0, 0) is None and b.key_mu(0, 0) is None


def reference_lse(config, layer, k, v, q, softmax_scale=None, softcap=0.0):
    """float64 log sum exp of the scaled (softcapped) scores over the stored keys, [R, q_heads] (causal)."""
    kf = reference.stored_values(config, layer, k, is_v=False)
    qf = reference.to_float32(q).astype(np.float64)
    T, H, d = kf.shape
    R, HQ, _ = qf.shape
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    out = np.empty((R, HQ))
    for hq in range(HQ):
        s = (qf[:, hq, :] @ kf[:, hq // (HQ // H), :].T) * scale
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        s = np.where(np.arange(T)[None, :] <= (T - R + np.arange(R))[:, None], s, -np.inf)
        m = s.max(axis=1)
        out[:, hq] = m + np.log(np.exp(s - m[:, None]).sum(axis=1))
    return out


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4, 0.0), (3, 30.0)])
def test_attention_lse(backend, tgen, window, softcap):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, sink_tokens=2, window_tokens=window, seed=5)
    tc = torch_ops.TorchCache(config, 1, 8, 1, backend=backend)
    s = tc.add_sequence()
    k, v = torch.randn(70, 2, 64, generator=tgen), torch.randn(70, 2, 64, generator=tgen)
    tc.append(0, s, k, v)
    q = 2 * torch.randn(3, 8, 64, generator=tgen)
    out, lse = tc.attention_lse(0, s, q, softcap=softcap)
    assert torch.equal(out, tc.attention(0, s, q, softcap=softcap))  # fmkv::attention's output, bit for bit
    assert lse.dtype == torch.float32 and lse.shape == (3, 8) and lse.device == q.device
    ref = reference_lse(config, 0, k, v, q, softcap=softcap)
    assert np.all(np.abs(lse.numpy() - ref) <= 2e-5 * (1 + np.abs(ref)))
    # the numpy Cache over the same bytes: the same float32 lse
    cache = fmkv.Cache(config, 1, 8, 1, backend=backend)
    cs = cache.add_sequence()
    cache.append(0, cs, k.numpy(), v.numpy())
    c_out, c_lse = cache.attention_lse(0, cs, q.numpy(), softcap=softcap)
    assert np.array_equal(c_lse, lse.numpy()) and np.array_equal(c_out, out.numpy())
    # the op on its own, opcheck, fake tensors
    app, att = opcheck_args(config, tgen, backend)
    o2, l2 = torch.ops.fmkv.attention_lse(*att)
    assert torch.equal(o2, torch.ops.fmkv.attention(*att)) and l2.shape == att[3].shape[:2]
    torch.library.opcheck(torch.ops.fmkv.attention_lse.default, att)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in att]
        fake[3] = torch.empty(5, 4, 64, dtype=torch.bfloat16)
        fo, fl = torch.ops.fmkv.attention_lse(*fake)
        assert fo.shape == (5, 4, 64) and fo.dtype == torch.bfloat16 and fl.shape == (5, 4) and fl.dtype == torch.float32
    bad = list(att)
    bad[3] = att[3].double()
    with pytest.raises(fmkv.FmkvError, match=r"fmkv::attention_lse: q: dtype torch.float64 is not supported"):
        torch.ops.fmkv.attention_lse(*bad)


def test_attention_lse_with_key_offset(tgen):
    # the pages hold k - mu: the lse adds q . mu x scale back, so it is the keys' own (as appended)
    config = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=4, v_bits=4, page_size=16, seed=9)
    tc = torch_ops.TorchCache(config, 1, 8, 1, backend="ref", key_offset=True)
    s = tc.add_sequence()
    k = torch.randn(50, 2, 64, generator=tgen) + 3 * torch.randn(1, 2, 64, generator=tgen)  # a large mean
    v = torch.randn(50, 2, 64, generator=tgen)
    tc.append(0, s, k, v)
    mu = tc.key_mu(0, s)
    q = torch.randn(1, 6, 64, generator=tgen)
    out, lse = tc.attention_lse(0, s, q, softmax_scale=0.2)
    assert torch.equal(out, tc.attention(0, s, q, softmax_scale=0.2))
    kc = (k - mu.float()).half().float()  # what the append stored before rotating and quantizing
    ref = reference_lse(config, 0, kc, v, q, softmax_scale=0.2)
    qmu = (q.double().reshape(1, 2, 3, 64) * mu.double().reshape(1, 2, 1, 64)).sum(-1).reshape(1, 6).numpy()
    assert np.all(np.abs(lse.numpy() - (ref + 0.2 * qmu)) <= 2e-5 * (1 + np.abs(ref + 0.2 * qmu)))
    for call in (tc.attention, tc.attention_lse):  # the offset does not cancel under a softcap
        with pytest.raises(fmkv.FmkvError, match=r"key_offset=True with softcap=30.0"):
            call(0, s, q, softcap=30.0)

"""fmkv torch ops, TorchCache and fmkv.hf.FmkvCache on CUDA tensors (the 'cuda' backend).

Needs a CUDA device, a CUDA build of torch, and the extension built with the CUDA backend
(``pip install . -C cmake.define.FMKV_CUDA=ON``); otherwise the whole file is skipped with the
reason. Checks, against the CPU backend on the same inputs:
* append writes the same page and fp16-region bytes (the format is bit-exact across backends), for every code
  width, formats 2 and 3 and both scale groups (32, 64);
* attention is within 4e-3 relative (fp16 tensor-core arithmetic on the GPU);
* attention_lse returns attention's output bit for bit and an lse within 2 x 4e-3 x (1 + |lse|) of the CPU's;
* mismatched device / backend combinations are errors naming the tensor and device, never copies;
* device-detected errors (bad block-table entry, NaN input) surface at fmkv.cuda_check(), the op
  itself does not synchronise and leaves the visible cache unchanged (a failed append may have
  written the token slots it was filling, past the sequence's length: FORMAT.md section 2);
* the attention op captured in a torch.cuda.CUDAGraph replays to the eager result;
* FmkvCache generate() on CUDA (tiny random Llama) agrees with the CPU cache, resident bytes.
"""
import contextlib
import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
import fmkv  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("torch.cuda is not available (no CUDA device, or a CPU-only torch build)", allow_module_level=True)
if not fmkv.backends()["cuda"]["available"]:
    pytest.skip("the fmkv extension has no usable 'cuda' backend (built without CUDA: "
                "pip install . -C cmake.define.FMKV_CUDA=ON, or no device visible to it)", allow_module_level=True)

from fmkv import reference, torch_ops  # noqa: E402

TOL = 4e-3  # CUDA attention vs the CPU backend (docs/ARCHITECTURE.md, op x backend matrix)
DEV = torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True)
def no_pending_device_error():
    fmkv.cuda_check()  # a test starts with a clean device error word ...
    yield
    fmkv.cuda_check()  # ... and must not leave an error behind


@pytest.fixture
def tgen(rng):
    return torch.Generator().manual_seed(int(rng.integers(0, 2**62)))


def layer_tensors(config, num_pages, num_slots, device):
    R = config.sink_tokens + config.window_tokens
    pages = torch.zeros(num_pages, config.page_bytes, dtype=torch.uint8, device=device)
    fk = torch.zeros(num_slots, config.num_kv_heads, R, config.head_dim, dtype=torch.float16, device=device)
    return pages, fk, fk.clone()


def batch(slots, lens, rows, tables, device="cpu"):
    offs = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    return tuple(t.to(device) for t in (torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int64),
                                        torch.from_numpy(offs), torch.tensor(tables, dtype=torch.int32)))


def token_slot_mask(config, slots):
    """Bool [page_bytes]: the bytes of token slots `slots` of a page (FORMAT.md section 7: per kv head a
    K then a V section; a quantized section is code words [G * bits][P] (uint32) then scales [G][P]
    (fp16), an fp16 section values [P][d])."""
    d, P, G = config.head_dim, config.page_size, config.head_dim // 32
    sec = {b: (d * 2 * P if b == 16 else G * b * P * 4 + G * P * 2) for b in (config.k_bits, config.v_bits)}
    mask = torch.zeros(config.page_bytes, dtype=torch.bool)
    base = 0
    for _ in range(config.num_kv_heads):
        for b in (config.k_bits, config.v_bits):
            for t in slots:
                if b == 16:
                    mask[base + t * d * 2: base + (t + 1) * d * 2] = True
                    continue
                for word in range(G * b):
                    o = base + 4 * (word * P + t)
                    mask[o: o + 4] = True
                for g in range(G):
                    o = base + G * b * P * 4 + 2 * (g * P + t)
                    mask[o: o + 2] = True
            base += sec[b]
    assert base == config.page_bytes
    return mask


def assert_cuda_matches_cpu(res):
    """res[device] = (pages, fp16_k, fp16_v, out) on the CPU: bytes equal, attention within TOL."""
    fmkv.cuda_check()
    cpu, gpu = res["cpu"], res[str(DEV)]
    assert torch.equal(gpu[0], cpu[0]), "pages differ between the cuda and cpu backends"
    assert torch.equal(gpu[1], cpu[1]) and torch.equal(gpu[2], cpu[2]), "fp16 regions differ"
    assert reference.rel_error(gpu[3].numpy(), cpu[3].numpy()) < TOL


@contextlib.contextmanager
def skip_if_not_compiled():
    """A default CUDA build compiles a grid of (head_dim, K bits, V bits) decode kernels (CMake option
    FMKV_CUDA_FULL_GRID for all): a combination outside it fails with FMKV_ERR_UNSUPPORTED naming it,
    which the test reports as a skip with that message (with the full grid the test runs)."""
    try:
        yield
    except fmkv.FmkvError as e:
        if "is not compiled into this build" in str(e):
            pytest.skip(str(e))
        raise


CONFIGS = [
    dict(head_dim=64, num_kv_heads=2, k_bits=2, v_bits=2, page_size=16),
    dict(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, sink_tokens=2, window_tokens=5),
    dict(head_dim=128, num_kv_heads=1, k_bits=4, v_bits=4, page_size=64, window_tokens=64),
    dict(head_dim=256, num_kv_heads=2, k_bits=4, v_bits=2, page_size=32, scale_rule="rms"),
    dict(head_dim=64, num_kv_heads=4, k_bits=16, v_bits=3, page_size=16, sink_tokens=4),
    dict(head_dim=128, num_kv_heads=2, k_bits=5, v_bits=4, page_size=16, sink_tokens=2, window_tokens=8),
    dict(head_dim=64, num_kv_heads=2, k_bits=5, v_bits=5, page_size=32, scale_rule="rms"),
    dict(head_dim=64, num_kv_heads=2, k_bits=4, v_bits=4, page_size=16, window_tokens=4, scale_group=64),
    dict(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=32, sink_tokens=2, format_version=3,
         scale_group=64),
]
FUSED_CONFIGS = CONFIGS[:3] + CONFIGS[-2:]  # the fused step: 2-, 3- and 4-bit codes, both scale groups and formats


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c['head_dim']}k{c['k_bits']}v{c['v_bits']}"
                         f"s{c.get('sink_tokens', 0)}w{c.get('window_tokens', 0)}{c.get('scale_rule', '')}"
                         f"f{c.get('format_version', 0)}g{c.get('scale_group', 0)}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ops_match_cpu_backend(cfg, dtype, tgen):
    """Two sequences, two append calls each (ring flushes, permuted pages and slots): the CUDA op
    writes the CPU backend's bytes exactly; attention (1 and 3 causal rows) within 4e-3."""
    config = fmkv.Config(**cfg, seed=int(torch.randint(0, 2**62, (1,), generator=tgen)))
    c = torch_ops.config_to_list(config)
    H, d = config.num_kv_heads, config.head_dim
    lens0, lens1 = [37, 90], [12, 1]
    tables = [[6, 1, 0, 9, 11, 5], [3, 2, 4, 8, 10, 7]]  # up to 91 tokens of 16-token pages
    npages = 12
    k0 = torch.randn(sum(lens0), H, d, generator=tgen).to(dtype)
    v0 = torch.randn(sum(lens0), H, d, generator=tgen).to(dtype)
    k1 = torch.randn(sum(lens1), H, d, generator=tgen).to(dtype)
    v1 = torch.randn(sum(lens1), H, d, generator=tgen).to(dtype)
    q = torch.randn(4, 2 * H, d, generator=tgen).to(dtype)
    res = {}
    for dev in ("cpu", DEV):
        pages, fk, fv = layer_tensors(config, npages, 3, dev)
        torch.ops.fmkv.append(pages, fk, fv, k0.to(dev), v0.to(dev), *batch([2, 0], [0, 0], lens0, tables, dev), c, 5)
        torch.ops.fmkv.append(pages, fk, fv, k1.to(dev), v1.to(dev), *batch([2, 0], lens0, lens1, tables, dev), c, 5)
        total = [a + b for a, b in zip(lens0, lens1)]
        # CPU reference in float32 from the same (exactly widened) q: one output rounding, the GPU's
        qd = q.to(dev) if dev != "cpu" else q.float()
        with skip_if_not_compiled():
            out = torch.ops.fmkv.attention(pages, fk, fv, qd, *batch([2, 0], total, [1, 3], tables, dev), c, 5)
        assert out.device == torch.device(dev) and out.dtype == qd.dtype and out.shape == q.shape
        res[str(dev)] = (pages.cpu(), fk.cpu(), fv.cpu(), out.float().cpu())
    assert_cuda_matches_cpu(res)


@pytest.mark.parametrize("cfg", FUSED_CONFIGS, ids=lambda c: f"d{c['head_dim']}k{c['k_bits']}v{c['v_bits']}"
                         f"w{c.get('window_tokens', 0)}f{c.get('format_version', 0)}g{c.get('scale_group', 0)}")
def test_append_attention_matches_cpu_backend(cfg, tgen):
    """The fused decode step on CUDA (one attention launch appends and attends) writes the CPU
    backend's bytes and matches its attention within 4e-3; captured in a CUDA graph it replays."""
    config = fmkv.Config(**cfg, seed=int(torch.randint(0, 2**62, (1,), generator=tgen)))
    c = torch_ops.config_to_list(config)
    H, d = config.num_kv_heads, config.head_dim
    lens0, rows = [37, 90], [1, 3]
    tables = [[6, 1, 0, 9, 11, 5], [3, 2, 4, 8, 10, 7]]
    k0, v0 = (torch.randn(sum(lens0), H, d, generator=tgen) for _ in range(2))
    k1, v1 = (torch.randn(sum(rows), H, d, generator=tgen) for _ in range(2))
    q = torch.randn(sum(rows), 2 * H, d, generator=tgen)
    res = {}
    for dev in ("cpu", DEV):
        pages, fk, fv = layer_tensors(config, 12, 3, dev)
        torch.ops.fmkv.append(pages, fk, fv, k0.to(dev), v0.to(dev), *batch([2, 0], [0, 0], lens0, tables, dev), c, 5)
        out = torch.ops.fmkv.append_attention(pages, fk, fv, k1.to(dev), v1.to(dev), q.to(dev),
                                              *batch([2, 0], lens0, rows, tables, dev), c, 5)
        res[str(dev)] = (pages.cpu(), fk.cpu(), fv.cpu(), out.float().cpu())
    assert_cuda_matches_cpu(res)
    # graph capture: every run starts from the cache as the prefill left it (a step is not idempotent:
    # with a window it compresses the ring rows it then overwrites), so a replay equals the eager step
    pages, fk, fv = layer_tensors(config, 12, 3, DEV)
    torch.ops.fmkv.append(pages, fk, fv, k0.to(DEV), v0.to(DEV), *batch([2, 0], [0, 0], lens0, tables, DEV), c, 5)
    state0 = [t.clone() for t in (pages, fk, fv)]

    def restore():
        for t, t0 in zip((pages, fk, fv), state0):
            t.copy_(t0)

    args = (pages, fk, fv, k1.to(DEV), v1.to(DEV), q.to(DEV), *batch([2, 0], lens0, rows, tables, DEV), c, 5)
    eager = torch.ops.fmkv.append_attention(*args)
    eager_state = [t.clone() for t in (pages, fk, fv)]
    restore()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.fmkv.append_attention(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = torch.ops.fmkv.append_attention(*args)
    restore()
    captured.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    fmkv.cuda_check()
    assert torch.equal(captured, eager)
    for t, want in zip((pages, fk, fv), eager_state):
        assert torch.equal(t, want)


def test_torch_cache_on_cuda(tgen):
    config = fmkv.Config(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, window_tokens=8)
    gc.collect()  # earlier tests' unreachable CUDA tensors, freed now rather than while the cache is made
    before = torch.cuda.memory_allocated(DEV)
    tc = torch_ops.TorchCache(config, 2, 12, 2, device="cuda")
    assert tc.backend == "cuda" and tc.device == DEV and tc.pages[0].device == DEV
    expect = 2 * (12 * config.page_bytes + 2 * config.fp16_slot_bytes)
    assert tc.resident_bytes == expect == fmkv.Cache(config, 2, 12, 2).resident_bytes
    assert torch.cuda.memory_allocated(DEV) - before >= expect  # really allocated on the device
    host = torch_ops.TorchCache(config, 2, 12, 2)
    assert host.device.type == "cpu" and host.backend in ("ref", "cpu")
    seqs = [(tc.add_sequence(), host.add_sequence()) for _ in range(2)]
    ks = [torch.randn(n, 2, 128, generator=tgen) for n in (50, 1, 1, 30)]
    for i, kk in enumerate(ks):
        s, hs = seqs[i % 2]
        for layer in range(2):
            tc.append(layer, s, kk.to(DEV), (-kk).to(DEV))
            host.append(layer, hs, kk, -kk)
    q = torch.randn(2, 4, 128, generator=tgen)
    for layer in range(2):
        for (s, hs) in seqs:
            out = tc.attention(layer, s, q.to(DEV))
            assert out.device == DEV
            assert reference.rel_error(out.cpu().numpy(), host.attention(layer, hs, q).numpy()) < TOL
        assert torch.equal(tc.pages[layer].cpu(), host.pages[layer])
    fmkv.cuda_check()
    assert tc.used_bytes == host.used_bytes and tc.block_table(0) == host.block_table(0)
    tc.remove_sequence(seqs[0][0])
    assert tc.free_pages == 12 - len(tc.block_table(seqs[1][0]))


@pytest.mark.parametrize("kv,window,key_offset", [((3, 3), 0, False), ((4, 4), 16, False), ((3, 3), 0, True)])
def test_attention_lse_on_cuda(kv, window, key_offset, tgen):
    # fmkv_attention_lse on CUDA: the output is fmkv::attention's bit for bit, lse is the CPU backend's within
    # 2 x the attention bound (|lse - cpu| <= 2 TOL (1 + |cpu|)); a long sequence (many splits merged), 5 rows
    config = fmkv.Config(head_dim=128, num_kv_heads=2, k_bits=kv[0], v_bits=kv[1], page_size=64, sink_tokens=4,
                         window_tokens=window)
    tc = torch_ops.TorchCache(config, 1, 80, 1, device="cuda", key_offset=key_offset)
    host = torch_ops.TorchCache(config, 1, 80, 1, key_offset=key_offset)
    s, hs = tc.add_sequence(), host.add_sequence()
    k, v = torch.randn(5000, 2, 128, generator=tgen) + 1.0, torch.randn(5000, 2, 128, generator=tgen)
    tc.append(0, s, k.to(DEV), v.to(DEV))
    host.append(0, hs, k, v)
    q = 2 * torch.randn(5, 8, 128, generator=tgen)
    out, lse = tc.attention_lse(0, s, q.to(DEV))
    assert lse.device == DEV and lse.dtype == torch.float32 and lse.shape == (5, 8)
    assert torch.equal(out, tc.attention(0, s, q.to(DEV)))
    h_out, h_lse = host.attention_lse(0, hs, q)
    assert reference.rel_error(out.cpu().numpy(), h_out.numpy()) < TOL
    err = (lse.cpu() - h_lse).abs() / (1 + h_lse.abs())
    assert float(err.max()) <= 2 * TOL, float(err.max())
    fmkv.cuda_check()


def test_torch_cache_device_error_marks_changed_sequences_failed(tgen):
    """The CUDA contract of TorchCache (docs/RELIABILITY.md): a NaN in K is detected on the device,
    surfaces at tc.check(); every sequence changed since the previous check is then marked failed
    (its calls raise until reset), the others stay valid, and reset_sequence recovers the failed
    one without rebuilding the cache."""
    config = fmkv.Config(head_dim=128, num_kv_heads=2, page_size=16, window_tokens=8)
    tc = torch_ops.TorchCache(config, 1, 16, 3, device="cuda")
    host = torch_ops.TorchCache(config, 1, 16, 3)
    a, b, c = (tc.add_sequence() for _ in range(3))
    ha = host.add_sequence()
    k = torch.randn(40, 2, 128, generator=tgen)
    tc.append(0, a, k.to(DEV), (-k).to(DEV))
    host.append(0, ha, k, -k)
    tc.check()  # a is settled
    bad = k.clone()
    bad[7, 1, 3] = float("nan")
    tc.append(0, b, bad.to(DEV), k.to(DEV))  # no error here: the device sees the NaN
    tc.append(0, c, k[:20].to(DEV), k[:20].to(DEV))  # enqueued after the failing op: skipped on the device
    with pytest.raises(fmkv.FmkvError) as ei:
        tc.check()
    assert ei.value.status == "NON_FINITE"
    assert set(tc.failed_sequences) == {b, c}
    for s in (b, c):
        with pytest.raises(fmkv.FmkvError, match=rf"sequence {s} failed on the device"):
            tc.attention(0, s, torch.randn(1, 4, 128, generator=tgen).to(DEV))
        with pytest.raises(fmkv.FmkvError, match="failed on the device"):
            tc.append(0, s, k[:1].to(DEV), k[:1].to(DEV))
    q = torch.randn(2, 4, 128, generator=tgen)
    assert reference.rel_error(tc.attention(0, a, q.to(DEV)).cpu().numpy(), host.attention(0, ha, q).numpy()) < TOL
    tc.reset_sequence(b)
    tc.remove_sequence(c)
    assert tc.failed_sequences == {} and tc.length(0, b) == 0
    assert tc.free_pages == 16 - len(tc.block_table(a))
    tc.append(0, b, k.to(DEV), (-k).to(DEV))
    tc.check()
    assert reference.rel_error(tc.attention(0, b, q.to(DEV)).cpu().numpy(), host.attention(0, ha, q).numpy()) < TOL


def test_device_backend_mismatch_errors(tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    c = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 4, 1, DEV)
    k = torch.randn(20, 2, 64, generator=tgen)
    b_gpu = batch([0], [0], [20], [[2, 0]], DEV)
    b_cpu = batch([0], [0], [20], [[2, 0]])
    # CUDA tensors with a host backend: an error naming the device, never a copy
    with pytest.raises(fmkv.FmkvError, match=r"backend 'cpu' works on CPU tensors, but the tensors are on 'cuda:\d'"):
        torch.ops.fmkv.append(pages, fk, fv, k.to(DEV), k.to(DEV), *b_gpu, c, 0, "cpu")
    # CPU tensors with the cuda backend
    hp, hk, hv = layer_tensors(config, 4, 1, "cpu")
    with pytest.raises(fmkv.FmkvError, match=r"backend 'cuda' works on CUDA tensors, but the tensors are on 'cpu'"):
        torch.ops.fmkv.append(hp, hk, hv, k, k, *b_cpu, c, 0, "cuda")
    # one CPU tensor among CUDA tensors
    with pytest.raises(fmkv.FmkvError, match=r"fmkv::append: k is on device 'cpu' but pages is on 'cuda:\d'"):
        torch.ops.fmkv.append(pages, fk, fv, k, k.to(DEV), *b_gpu, c, 0)
    with pytest.raises(fmkv.FmkvError, match=r"block_table is on device 'cpu'"):
        torch.ops.fmkv.append(pages, fk, fv, k.to(DEV), k.to(DEV), *b_gpu[:3], b_cpu[3], c, 0)
    # The binding checks the same on its own (DLPack device types), naming the tensor
    raw = config._raw()
    dl = [t.__dlpack__(stream=-1) for t in (pages, fk, fv, *b_gpu, k.to(DEV), k.to(DEV))]
    with pytest.raises(fmkv.FmkvError, match=r"pages: tensor is on device cuda:\d but backend 'cpu' works on host"):
        fmkv._fmkv.append_raw("cpu", raw, 0, *dl)
    with pytest.raises(fmkv.FmkvError, match=r"pages: tensor is on device cpu but backend 'cuda' works on CUDA device memory"):
        fmkv._fmkv.append_raw("cuda", raw, 0, hp, hk, hv, *b_cpu, k, k)
    dl = [t.__dlpack__(stream=-1) for t in (pages, fk, fv, *b_gpu)]
    with pytest.raises(fmkv.FmkvError, match=r"k: tensor is on device cpu but backend 'cuda'"):
        fmkv._fmkv.append_raw("cuda", raw, 0, *dl, k, k.to(DEV).__dlpack__(stream=-1))
    # attention on cuda without a workspace
    q = torch.randn(1, 2, 64, device=DEV)
    out = torch.empty_like(q)
    dl = [t.__dlpack__(stream=-1) for t in (pages, fk, fv, *batch([0], [20], [1], [[2, 0]], DEV), q, out)]
    with pytest.raises(fmkv.FmkvError, match=r"workspace: the cuda backend needs a workspace tensor"):
        fmkv._fmkv.attention_raw("cuda", raw, 0, *dl)
    with pytest.raises(fmkv.FmkvError, match=r"TorchCache: backend 'cpu' works on CPU tensors, but the tensors are on 'cuda"):
        torch_ops.TorchCache(config, 1, 4, 1, backend="cpu", device="cuda")
    with pytest.raises(fmkv.FmkvError, match=r"TorchCache: backend 'cuda' works on CUDA tensors"):
        torch_ops.TorchCache(config, 1, 4, 1, backend="cuda", device="cpu")
    # nothing was written by any of the failed calls
    assert int(pages.count_nonzero()) == 0 and int(hp.count_nonzero()) == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_two_devices():
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    c = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 4, 1, "cuda:0")
    k = torch.randn(20, 2, 64, device="cuda:1")
    with pytest.raises(fmkv.FmkvError, match=r"k is on device 'cuda:1' but pages is on 'cuda:0'"):
        torch.ops.fmkv.append(pages, fk, fv, k, k, *batch([0], [0], [20], [[2, 0]], "cuda:0"), c, 0)


def test_device_detected_errors_surface_at_sync(tgen):
    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    c = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 8, 1, DEV)
    k = torch.randn(40, 2, 64, generator=tgen).to(DEV)
    # append with a block-table entry outside the 8-page pool: the op returns (no sync) ...
    torch.ops.fmkv.append(pages, fk, fv, k, k, *batch([0], [0], [40], [[2, 1000000, 0]], DEV), c, 0)
    # ... the error surfaces at the sync function (found before anything is written)
    with pytest.raises(fmkv.FmkvError, match=r"block_table\[1\] = 1000000 outside \[0, 8\)") as e:
        fmkv.cuda_check()
    assert e.value.status == "OUT_OF_RANGE"
    assert int(pages.count_nonzero()) == 0
    fmkv.cuda_check()  # cleared
    # a good append, then attention with a bad entry
    torch.ops.fmkv.append(pages, fk, fv, k, k, *batch([0], [0], [40], [[2, 1, 0]], DEV), c, 0)
    q = torch.randn(1, 4, 64, generator=tgen).to(DEV)
    torch.ops.fmkv.attention(pages, fk, fv, q, *batch([0], [40], [1], [[2, -3, 0]], DEV), c, 0)
    with pytest.raises(fmkv.FmkvError, match=r"block_table\[1\] = -3 outside \[0, 8\)"):
        torch_ops.cuda_check(DEV)
    # NaN in K is found on the device too; fmkv.synchronize('cuda') is the same check
    bad = k.clone()
    bad[7, 1, 3] = float("nan")
    snapshot = pages.clone()
    torch.ops.fmkv.append(pages, fk, fv, bad, k, *batch([0], [40], [40], [[2, 1, 0, 3, 4]], DEV), c, 0)
    with pytest.raises(fmkv.FmkvError, match=r"k\[7\]\[1\]\[3\] is NaN"):
        fmkv.synchronize("cuda")
    # the 40 cached tokens are untouched: pages 2 and 1, slots 0..7 of page 0 (the append was filling
    # slots 8.. of page 0 and pages 3, 4, which nothing reads until a successful append rewrites them)
    assert torch.equal(pages[[2, 1]], snapshot[[2, 1]])
    visible = token_slot_mask(config, range(8)).to(DEV)
    assert torch.equal(pages[0][visible], snapshot[0][visible])
    # after the check, the cache works again and matches the CPU backend
    out = torch.ops.fmkv.attention(pages, fk, fv, q, *batch([0], [40], [1], [[2, 1, 0]], DEV), c, 0)
    hp, hk, hv = layer_tensors(config, 8, 1, "cpu")
    torch.ops.fmkv.append(hp, hk, hv, k.cpu(), k.cpu(), *batch([0], [0], [40], [[2, 1, 0]]), c, 0)
    ref = torch.ops.fmkv.attention(hp, hk, hv, q.cpu(), *batch([0], [40], [1], [[2, 1, 0]]), c, 0)
    fmkv.cuda_check()
    assert reference.rel_error(out.cpu().numpy(), ref.numpy()) < TOL


def test_attention_in_cuda_graph(tgen):
    """attention (and append) captured in a CUDA graph: no sync, no host allocation; replays
    follow new values written into the static input tensors."""
    config = fmkv.Config(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, window_tokens=4)
    c = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 8, 1, DEV)
    k = torch.randn(100, 2, 128, generator=tgen).to(DEV)
    torch.ops.fmkv.append(pages, fk, fv, k, -k, *batch([0], [0], [100], [[5, 0, 3, 1, 7, 2, 4]], DEV), c, 0)
    q = torch.randn(1, 8, 128, generator=tgen).to(DEV)
    b = batch([0], [100], [1], [[5, 0, 3, 1, 7, 2, 4]], DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch recommends before capture
        for _ in range(2):
            torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0)
    g.replay()
    eager = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q.copy_(torch.randn(1, 8, 128, generator=tgen))  # new inputs in the captured tensor
    g.replay()
    eager = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0)
    fmkv.cuda_check()
    assert torch.equal(out, eager)
    hp, hk, hv = layer_tensors(config, 8, 1, "cpu")
    hb = [t.cpu() for t in b]
    torch.ops.fmkv.append(hp, hk, hv, k.cpu(), -k.cpu(), *batch([0], [0], [100], [[5, 0, 3, 1, 7, 2, 4]]), c, 0)
    ref = torch.ops.fmkv.attention(hp, hk, hv, q.cpu(), *hb, c, 0)
    assert reference.rel_error(out.cpu().numpy(), ref.numpy()) < TOL

    # append captured too: one decode step (append the new token, then attend), replayed
    pages2, fk2, fv2 = layer_tensors(config, 8, 1, DEV)
    torch.ops.fmkv.append(pages2, fk2, fv2, k[:99], -k[:99], *batch([0], [0], [99], [[5, 0, 3, 1, 7, 2, 4]], DEV), c, 0)
    kt = k[99:].clone()
    ba = batch([0], [99], [1], [[5, 0, 3, 1, 7, 2, 4]], DEV)
    g2 = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g2):
        torch.ops.fmkv.append(pages2, fk2, fv2, kt, -kt, *ba, c, 0)
        out2 = torch.ops.fmkv.attention(pages2, fk2, fv2, q, *b, c, 0)
    g2.replay()
    fmkv.cuda_check()
    assert torch.equal(pages2, pages) and torch.equal(fk2, fk) and torch.equal(out2, eager)


def test_max_seq_len_on_cuda(tgen):
    """max_seq_len on CUDA: the split plan follows it (1 kv head: 254 splits without a bound, fewer with
    this one: 5); results match the unbounded call; a broken bound is found on the device (nothing
    written, output not produced) and surfaces at cuda_check; a graph captured with the bound replays."""
    config = fmkv.Config(head_dim=128, num_kv_heads=1, k_bits=3, v_bits=3, page_size=64)
    c = torch_ops.config_to_list(config)
    pages, fk, fv = layer_tensors(config, 8, 1, DEV)
    k = torch.randn(300, 1, 128, generator=tgen).to(DEV)
    b = batch([0], [300], [1], [[3, 1, 4, 0, 5]], DEV)
    torch.ops.fmkv.append(pages, fk, fv, k, -k, *batch([0], [0], [300], [[3, 1, 4, 0, 5]], DEV), c, 0)
    q = torch.randn(1, 4, 128, generator=tgen).to(DEV)
    free = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0)
    exact = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0, 0.0, 0.0, "", 300)
    fmkv.cuda_check()
    # (another split count: the fp16 rounding of P follows each warp's running max)
    assert reference.rel_error(exact.cpu().numpy(), free.cpu().numpy()) < 1e-3
    snapshot = pages.clone()
    torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0, 0.0, 0.0, "", 299)
    with pytest.raises(fmkv.FmkvError, match=r"sequence 0: 300 tokens, more than opts.max_seq_len = 299") as e:
        fmkv.cuda_check()
    assert e.value.status == "INVALID_ARGUMENT"
    kn = torch.randn(1, 1, 128, generator=tgen).to(DEV)
    torch.ops.fmkv.append_attention(pages, fk, fv, kn, kn, q, *batch([0], [300], [1], [[3, 1, 4, 0, 5]], DEV), c, 0,
                                    0.0, 0.0, "", 300)
    with pytest.raises(fmkv.FmkvError, match=r"301 tokens, more than opts.max_seq_len = 300"):
        fmkv.cuda_check()
    assert torch.equal(pages, snapshot), "a failed step wrote the cache"
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0, 0.0, 0.0, "", 512)
    g.replay()
    eager = torch.ops.fmkv.attention(pages, fk, fv, q, *b, c, 0, 0.0, 0.0, "", 512)
    fmkv.cuda_check()
    assert torch.equal(out, eager)


def test_fake_tensors_on_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16)
    c = torch_ops.config_to_list(config)
    with FakeTensorMode():
        pages, fk, fv = layer_tensors(config, 4, 1, DEV)
        q = torch.empty(3, 4, 64, dtype=torch.float16, device=DEV)
        out = torch.ops.fmkv.attention(pages, fk, fv, q, *batch([0], [20], [3], [[2, 0]], DEV), c, 0)
        assert out.shape == (3, 4, 64) and out.dtype == torch.float16 and out.device.type == "cuda"


# ----------------------------------------------------------------------------- transformers
def _llama(device, dtype=torch.float32):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=2048, initializer_range=0.08)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)


@torch.no_grad()
def _teacher_forced_logprobs(model, ids, cache):
    """log-softmax of next-token logits at every position: 40-token prefill, then one token at a time."""
    import fmkv.hf as fhf  # the callers skip without it

    n0 = 40
    out = model(ids[:, :n0], **fhf.cache_kwargs(cache), use_cache=True)
    lps = [torch.log_softmax(out.logits[0, -1].float(), -1)]
    for t in range(n0, ids.shape[1]):
        out = model(ids[:, t:t + 1], **fhf.cache_kwargs(fhf.output_cache(out)), use_cache=True)
        lps.append(torch.log_softmax(out.logits[0, -1].float(), -1))
    return torch.stack(lps).cpu()


def test_fmkvcache_generate_on_cuda():
    fhf = pytest.importorskip("fmkv.hf", reason="fmkv.hf needs transformers >= 4.56")
    gpu, cpu = _llama(DEV), _llama("cpu")
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    kw = dict(k_bits=4, v_bits=4, max_cache_len=128, page_size=16, window_tokens=8)
    cache = fhf.FmkvCache(gpu.config, **kw)
    before = torch.cuda.memory_allocated(DEV)
    with torch.no_grad():
        gen = gpu.generate(ids.to(DEV), max_new_tokens=24, min_new_tokens=24, do_sample=False, **fhf.cache_kwargs(cache))
    cache.check()
    layer = cache.fmkv_layers[0]
    assert layer.pages.device == DEV and layer.lens.device == DEV and layer.backend_name == "cuda"
    assert layer.get_seq_length() == 40 + 23
    # resident bytes: tensor storage on the device, the same as the CPU cache's
    host = fhf.FmkvCache(cpu.config, **kw)
    with torch.no_grad():
        cpu_gen = cpu.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, **fhf.cache_kwargs(host))
    assert cache.resident_bytes == host.resident_bytes > 0
    assert cache.used_bytes == host.used_bytes < cache.fp16_equivalent_bytes()
    assert torch.cuda.memory_allocated(DEV) - before >= cache.resident_bytes
    same = int((gen[0].cpu() == cpu_gen[0]).sum()) - 40
    print(f"greedy tokens equal to the CPU cache's: {same}/24")
    # Teacher-forced on the same token sequence: CUDA vs CPU cache logits differ far less than
    # the compression itself moves them (fp16 DynamicCache vs fmkv on the CPU).
    seq = cpu_gen
    lp_gpu = _teacher_forced_logprobs(gpu, seq.to(DEV), fhf.FmkvCache(gpu.config, **kw))
    lp_cpu = _teacher_forced_logprobs(cpu, seq, fhf.FmkvCache(cpu.config, **kw))
    from transformers import DynamicCache
    lp_fp = _teacher_forced_logprobs(cpu, seq, DynamicCache())
    fmkv.cuda_check()
    d_dev = (lp_gpu - lp_cpu).abs().max().item()
    d_q = (lp_cpu - lp_fp).abs().max().item()
    agree = (lp_gpu.argmax(-1) == lp_cpu.argmax(-1)).float().mean().item()
    print(f"max |logprob cuda - cpu| {d_dev:.2e}, compression effect {d_q:.2e}, top-1 agreement {agree:.3f}")
    assert d_dev < 0.5 * d_q, (d_dev, d_q)
    assert agree >= 0.9


def test_fmkvcache_fp16_model_on_cuda():
    """A float16 model on CUDA: fp16 K/V/Q go to the kernels as they are, the output is fp16."""
    fhf = pytest.importorskip("fmkv.hf", reason="fmkv.hf needs transformers >= 4.56")
    model = _llama(DEV, torch.float16)
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(2)).to(DEV)
    cache = fhf.FmkvCache(model.config, k_bits=3, v_bits=3, max_cache_len=64, page_size=16, window_tokens=4)
    with torch.no_grad():
        out = model(ids, **fhf.cache_kwargs(cache), use_cache=True)
        out = model(ids[:, -1:], **fhf.cache_kwargs(fhf.output_cache(out)), use_cache=True)
    cache.check()
    assert out.logits.dtype == torch.float16 and torch.isfinite(out.logits).all()
    assert cache.fmkv_layers[0].lens.tolist() == [31, 31]


@pytest.mark.parametrize("fv", [2, 3])
def test_snapshot_of_a_cuda_cache(tmp_path, tgen, fv):
    """A CUDA TorchCache saves the bytes a CPU TorchCache saves for the same tokens (bit-exact pages), restores a
    file on the GPU, and the restored sequence attends within the CUDA bound of the CPU's."""
    config = fmkv.Config(head_dim=128, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, sink_tokens=4,
                         window_tokens=16, format_version=fv)
    gpu = torch_ops.TorchCache(config, 2, 40, 2, device="cuda")
    host = torch_ops.TorchCache(config, 2, 40, 2)
    sg, sh = gpu.add_sequence(), host.add_sequence()
    for layer in range(2):
        k = torch.randn(150, 2, 128, generator=tgen) * 2
        v = torch.randn(150, 2, 128, generator=tgen)
        gpu.append(layer, sg, k.to(DEV), v.to(DEV))
        host.append(layer, sh, k, v)
    path = tmp_path / "gpu.fmkv"
    gpu.save(path, sg)
    assert path.read_bytes() == host.save_bytes(sh)
    s2 = gpu.restore(path)
    q = torch.randn(1, 8, 128, generator=tgen)
    for layer in range(2):
        a = gpu.attention(layer, s2, q.to(DEV)).cpu()
        b = host.attention(layer, sh, q)
        assert torch.equal(a, gpu.attention(layer, sg, q.to(DEV)).cpu())
        assert float((a - b).norm() / b.norm()) < TOL
    gpu.check()

"""fmkv.Config.scale_group (rotated coordinates per fp16 scale: 0 = the default 32, or 64) through the Python layers.

* Config / bytes: k2v2 at head_dim 64 takes 36 bytes per token and kv head with scale_group 64 (40 by default),
  pages are smaller; other values are refused naming scale_group; quantize_vector returns head_dim / 64 scales.
* torch ops on the host backends: the pages an append writes are bit-identical between 'cpu' and 'ref' (storage
  poisoned first), hold quantize_vector(..., scale_group=64)'s scales, and attention (output NaN-poisoned before the
  call) is within 1e-5 of the float64 attention over the dequantized K/V (fmkv.reference) and differs from the
  default scale group's.
* CUDA (skipped without a CUDA device and a CUDA build): the CUDA kernels' appends write the reference's bytes,
  attention and the fused step are within the CUDA bound (4e-3) of the float64 attention; a TorchCache on the device
  holds the host cache's bytes.
* fmkv.hf: FmkvCache / FmkvStaticCache(scale_group=64) decode the tiny model of hf_cases, every layer's config
  (width groups included) carries it, every fused output equals the reference attention over the recorded K/V.
* fmkv.mlx: the host runtime stores scale group 64 bit-exactly; the GPU runtimes (Metal / MLX-CUDA kernels, whose kernel
  core quantizes and attends with it) take it: the layer and the mlx-lm cache are made for them and the kernels'
  parameter blocks carry it (runtime forced, no GPU needed; on a GPU the pages equal the reference bit for bit and
  attention is within 1e-5: tests/python/test_mlx_gpu.py); FmkvKVCache keeps it through save / load (older states load
  with 0).
"""
import dataclasses
import struct

import numpy as np
import pytest

import fmkv
from fmkv import _fmkv, reference

from conftest import host_backends

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch to run the torch op tests")
from fmkv import torch_ops  # noqa: E402

TOL = 1e-5
SG = 64


def _cfg(**kw):
    base = dict(head_dim=64, num_kv_heads=2, k_bits=2, v_bits=2, page_size=16, seed=12345)
    base.update(kw)
    return fmkv.Config(**base)


# ----------------------------------------------------------------------------------------------- Config and bytes
def test_config_bytes_and_validation():
    c64, c32, c0 = _cfg(scale_group=SG), _cfg(scale_group=32), _cfg()
    assert fmkv.format.SCALE_GROUP == 32 and fmkv.format.SCALE_GROUPS == (32, 64)
    assert c64.bytes_per_token_per_head == 36 and c0.bytes_per_token_per_head == 40 == c32.bytes_per_token_per_head
    assert c64.k_bytes_per_token_per_head == 18 == fmkv.bytes_per_token_head(64, 2, SG)
    assert fmkv.bytes_per_token_head(64, 2) == 20 == fmkv.bytes_per_token_head(64, 2, 32)
    assert c64.page_bytes < c0.page_bytes == c32.page_bytes
    assert c64.page_bytes == 2 * 36 * 16 and c0.page_bytes == 2 * 40 * 16  # 2 kv heads x 16 tokens
    # head_dim 128, k16v3: fp16 K is unchanged, V's 4 code groups share 2 scales instead of 4
    wide = dict(head_dim=128, k_bits=16, v_bits=3)
    assert _cfg(scale_group=SG, **wide).bytes_per_token_per_head == 308
    assert _cfg(**wide).bytes_per_token_per_head == 312
    assert c64.fp16_slot_bytes == c0.fp16_slot_bytes
    assert c64 != c0 and c64.scale_group == SG and c0.scale_group == 0
    for bad in (16, 128, -1, 48, 1):
        with pytest.raises(fmkv.FmkvError, match=rf"scale_group {bad} is not supported"):
            _cfg(scale_group=bad)
        with pytest.raises(fmkv.FmkvError, match="scale_group"):
            fmkv.bytes_per_token_head(64, 2, bad)
    for bad in (True, 64.0, "64", None):
        with pytest.raises(fmkv.FmkvTypeError, match="scale_group"):
            _cfg(scale_group=bad)
    with pytest.raises(fmkv.FmkvError, match="scale_group"):
        _cfg(scale_group=2**40)


def test_quantize_vector_scale_group(rng):
    x = (rng.standard_normal(128) * (1 + np.abs(rng.standard_normal(128)))).astype(np.float32)
    c64, s64 = fmkv.quantize_vector(x, 3, 7, 2, scale_group=SG, side="v")
    c32, s32 = fmkv.quantize_vector(x, 3, 7, 2, side="v")
    assert s64.shape == (2,) and s64.dtype == np.float16 and s32.shape == (4,)
    y64 = fmkv.dequantize_vector(c64, s64, 3, 7, 2, side="v", scale_group=SG)
    y32 = fmkv.dequantize_vector(c32, s32, 3, 7, 2, side="v")
    assert not np.array_equal(y64, y32)  # other scales: other values
    e = lambda y: np.linalg.norm(y - x.astype(np.float16)) / np.linalg.norm(x)  # noqa: E731
    assert e(y64) < 0.3 and e(y32) < 0.3
    # scales tensors through DLPack take the same path
    assert np.array_equal(fmkv.dequantize_vector(c64, torch.from_numpy(s64.copy()), 3, 7, 2, side="v",
                                                 scale_group=SG), y64)
    with pytest.raises(fmkv.FmkvError, match="head_dim / scale_group"):
        fmkv.dequantize_vector(c64, s32, 3, 7, 2, side="v", scale_group=SG)
    with pytest.raises(fmkv.FmkvError, match="scale_group 16"):
        fmkv.quantize_vector(x, 3, scale_group=16)


# ----------------------------------------------------------------------------------------------- torch ops (host)
def _tensors(config, num_pages, num_slots, seed):
    """Pages and fp16 regions full of random bytes (what an append does not write must stay so)."""
    g = torch.Generator().manual_seed(seed)
    R = config.sink_tokens + config.window_tokens
    pages = torch.randint(0, 256, (num_pages, config.page_bytes), dtype=torch.uint8, generator=g)
    fk = torch.randint(-2000, 2000, (num_slots, config.num_kv_heads, R, config.head_dim), generator=g).to(torch.float16)
    return pages, fk, fk.clone() * 0.5


def _batch(slots, lens, rows, tables):
    offs = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    return (torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int64), torch.from_numpy(offs),
            torch.tensor(tables, dtype=torch.int32))


CASES = [  # k_bits, v_bits, head_dim, sink, window, scale_rule, format_version
    (2, 2, 64, 0, 0, "lsq", 0),
    (3, 4, 128, 2, 5, "rms", 0),
    (16, 3, 64, 0, 3, "lsq", 0),
    (3, 3, 128, 0, 0, "lsq", 3),
]


def run_host_backends(config, layer, k, v, q, table, seed):
    """Every host backend on one sequence (block table ``table`` over a pool of 5 random-byte pages): two appends
    (the page outside the table untouched), attention -- the op, and the raw binding into a NaN-poisoned output,
    equal -- within TOL of fmkv.reference's float64 attention, the fused step giving the same bytes and the last row's
    output; every backend writes the reference's bytes. Returns ({backend: attention output}, the reference's
    (pages, fp16 K, fp16 V))."""
    cfg = torch_ops.config_to_list(config)
    T, NQ = k.shape[0], q.shape[0]
    ref = reference.attention(config, layer, k, v, q)
    stored, outs = {}, {}
    for backend in host_backends():
        pages, fk, fv16 = _tensors(config, 5, 1, seed % 1000)
        untouched = pages[4].clone()  # not in the block table
        torch.ops.fmkv.append(pages, fk, fv16, k[:20], v[:20], *_batch([0], [0], [20], table), cfg, layer, backend)
        torch.ops.fmkv.append(pages, fk, fv16, k[20:], v[20:], *_batch([0], [20], [T - 20], table), cfg, layer, backend)
        assert torch.equal(pages[4], untouched)
        out = torch_ops.attention(pages, fk, fv16, q, *_batch([0], [T], [NQ], table), cfg, layer, 0.0, 0.0, backend)
        poisoned = torch.full_like(q, float("nan"))
        _fmkv.attention_raw(backend, config._raw(), layer, pages, fk, fv16, *_batch([0], [T], [NQ], table), q,
                            poisoned, 0.0, 0.0, max_seq_len=T)
        assert torch.isfinite(poisoned).all() and torch.equal(poisoned, out)
        assert reference.rel_error(out.numpy(), ref) < TOL, backend
        p2, k2, v2 = _tensors(config, 5, 1, seed % 1000)
        torch.ops.fmkv.append(p2, k2, v2, k[:T - 1], v[:T - 1], *_batch([0], [0], [T - 1], table), cfg, layer, backend)
        fused = torch_ops.append_attention(p2, k2, v2, k[T - 1:], v[T - 1:], q[-1:], *_batch([0], [T - 1], [1], table),
                                           cfg, layer, 0.0, 0.0, backend)
        assert reference.rel_error(fused.numpy(), ref[-1:]) < TOL, backend
        assert all(torch.equal(a, b) for a, b in zip((p2, k2, v2), (pages, fk, fv16)))
        stored[backend], outs[backend] = (pages, fk, fv16), out
    for backend, got in stored.items():  # every host backend writes the reference's bytes
        assert all(torch.equal(a, b) for a, b in zip(got, stored["ref"])), backend
    return outs, stored["ref"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}v{c[1]}d{c[2]}S{c[3]}W{c[4]}{c[5]}f{c[6]}")
def test_torch_ops_host_backends(rng, case):
    kb, vb, d, S, W, rule, fv = case
    seed = int(rng.integers(0, 2**63))
    layer = int(rng.integers(0, 30))
    H, HQ, T, NQ = 2, 6, 45, 3
    g = torch.Generator().manual_seed(seed % 2**62)
    k = torch.randn(T, H, d, generator=g) * (1 + torch.rand(d, generator=g) * 3)
    v = torch.randn(T, H, d, generator=g)
    q = torch.randn(NQ, HQ, d, generator=g)
    outs, pages_by = {}, {}
    for sg in (0, SG):
        config = _cfg(head_dim=d, num_kv_heads=H, k_bits=kb, v_bits=vb, sink_tokens=S, window_tokens=W,
                      scale_rule=rule, seed=seed, format_version=fv, scale_group=sg)
        cfg = torch_ops.config_to_list(config)
        assert len(cfg) == torch_ops.CONFIG_INTS == 11 and cfg[-1] == sg
        got, ref_bytes = run_host_backends(config, layer, k, v, q, [[3, 0, 2, 1]], seed)
        outs.update({(sg, b): o for b, o in got.items()})
        pages_by[sg] = ref_bytes[0]
    assert pages_by[SG].shape[1] < pages_by[0].shape[1]  # smaller pages ...
    for backend in host_backends():  # ... and other values: the option is applied
        assert not torch.equal(outs[(SG, backend)], outs[(0, backend)])


def test_pages_hold_the_scales_of_quantize_vector(backend, rng):
    """One kv head, d 64, k2v3, P 16: the K section is codes [2 groups][2 words][16 tokens] uint32 (256 bytes) then
    one fp16 scale per token (scale group 64), the V section codes (384 bytes) then one scale per token -- each
    the scale quantize_vector(..., scale_group=64) returns."""
    config = fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=2, v_bits=3, page_size=16, seed=99, scale_group=SG)
    assert config.page_bytes == 16 * (256 // 16 + 2) + 16 * (384 // 16 + 2)
    cfg = torch_ops.config_to_list(config)
    k = torch.from_numpy(rng.standard_normal((16, 1, 64)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((16, 1, 64)).astype(np.float32))
    pages = torch.zeros(1, config.page_bytes, dtype=torch.uint8)
    empty = torch.zeros(1, 1, 0, 64, dtype=torch.float16)
    torch_ops.append(pages, empty, empty.clone(), k, v, *_batch([0], [0], [16], [[0]]), cfg, 5, backend)
    raw = pages[0].numpy()
    k_scales = raw[256:256 + 32].view(np.float16)
    v_scales = raw[288 + 384:288 + 384 + 32].view(np.float16)
    for t in range(16):
        _, ks = fmkv.quantize_vector(k[t, 0].numpy(), 2, 99, 5, scale_group=SG, side="k")
        _, vs = fmkv.quantize_vector(v[t, 0].numpy(), 3, 99, 5, scale_group=SG, side="v")
        assert ks.shape == (1,) and ks[0] == k_scales[t] and vs[0] == v_scales[t], t


def test_torch_cache_and_errors(backend, rng):
    config = _cfg(k_bits=3, v_bits=3, window_tokens=4, scale_group=SG)
    tc = torch_ops.TorchCache(config, 2, 6, 2, backend=backend)
    dflt = torch_ops.TorchCache(_cfg(k_bits=3, v_bits=3, window_tokens=4), 2, 6, 2, backend=backend)
    assert tc.resident_bytes < dflt.resident_bytes
    s = tc.add_sequence()
    k = torch.from_numpy(rng.standard_normal((40, 2, 64)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((40, 2, 64)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((2, 4, 64)).astype(np.float32))
    tc.append(1, s, k, v)
    out = tc.attention(1, s, q)
    assert reference.rel_error(out.numpy(), reference.attention(config, 1, k, v, q)) < TOL
    cache = fmkv.Cache(config, 2, 6, 2, backend=backend)  # the same bytes through fmkv.Cache (host memory)
    cs = cache.add_sequence()
    cache.append(1, cs, k, v)
    assert np.array_equal(cache.attention(1, cs, q), out.numpy())
    assert tc.resident_bytes == cache.resident_bytes
    # a config list of the old length (no scale group) is refused, as is a bad scale group inside it
    cfg = torch_ops.config_to_list(config)
    pages, fk, fv = _tensors(config, 2, 1, 1)
    with pytest.raises(fmkv.FmkvError, match="expected the 11 ints"):
        torch.ops.fmkv.append(pages, fk, fv, k[:4], v[:4], *_batch([0], [0], [4], [[0, 1]]), cfg[:10], 0, backend)
    before = pages.clone()
    with pytest.raises(fmkv.FmkvError, match="scale_group 16"):
        torch.ops.fmkv.append(pages, fk, fv, k[:4], v[:4], *_batch([0], [0], [4], [[0, 1]]), cfg[:10] + [16], 0,
                              backend)
    assert torch.equal(pages, before)


# ----------------------------------------------------------------------------------------------- CUDA
CUDA_CASES = [  # k_bits, v_bits, head_dim, sink, window, scale_rule, format_version
    (2, 2, 64, 0, 4, "lsq", 0),
    (3, 3, 128, 2, 5, "rms", 3),
    (4, 4, 128, 0, 0, "lsq", 2),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is not available (no CUDA device, or a "
                    "CPU-only torch build): the 'cuda' backend's scale group 64 is not exercised")
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "k{}v{}d{}S{}W{}{}f{}".format(*c))
def test_cuda_scale_group_64(rng, case):
    """The CUDA kernels with scale group 64: two appends (random-byte pool, a page outside the table untouched) write
    the reference's bytes; attention and the fused step are within the CUDA bound (4e-3) of
    the float64 attention over the dequantized K/V; the fused step writes the separate ops' bytes."""
    if not fmkv.backends()["cuda"]["available"]:
        pytest.skip("the fmkv extension has no usable 'cuda' backend (built without CUDA)")
    kb, vb, d, S, W, rule, fv = case
    dev = torch.device("cuda", torch.cuda.current_device())
    seed, layer = int(rng.integers(0, 2**63)), int(rng.integers(0, 30))
    config = _cfg(head_dim=d, num_kv_heads=2, k_bits=kb, v_bits=vb, sink_tokens=S, window_tokens=W, scale_rule=rule,
                  seed=seed, format_version=fv, scale_group=SG)
    fmkv.check_backend("cuda", config)
    cfg = torch_ops.config_to_list(config)
    T, NQ = 45, 3
    g = torch.Generator().manual_seed(seed % 2**62)
    k = torch.randn(T, 2, d, generator=g) * (1 + torch.rand(d, generator=g) * 3)
    v = torch.randn(T, 2, d, generator=g)
    q = torch.randn(NQ, 6, d, generator=g)
    ref = reference.attention(config, layer, k, v, q)
    table = [[3, 0, 2, 1]]
    want = None
    for backend in ("ref", "cuda"):
        on = dev if backend == "cuda" else torch.device("cpu")
        pages, fk, fv16 = (t.to(on) for t in _tensors(config, 5, 1, seed % 1000))
        untouched = pages[4].clone()
        b1 = tuple(t.to(on) for t in _batch([0], [0], [20], table))
        b2 = tuple(t.to(on) for t in _batch([0], [20], [T - 20], table))
        torch.ops.fmkv.append(pages, fk, fv16, k[:20].to(on), v[:20].to(on), *b1, cfg, layer, backend)
        torch.ops.fmkv.append(pages, fk, fv16, k[20:].to(on), v[20:].to(on), *b2, cfg, layer, backend)
        assert torch.equal(pages[4], untouched)
        got = tuple(t.cpu() for t in (pages, fk, fv16))
        if want is None:
            want = got
            continue
        fmkv.cuda_check()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), "cuda pages differ from the reference's"
        bq = tuple(t.to(dev) for t in _batch([0], [T], [NQ], table))
        out = torch_ops.attention(pages, fk, fv16, q.to(dev), *bq, cfg, layer, 0.0, 0.0, "cuda")
        fmkv.cuda_check()
        assert torch.isfinite(out).all() and reference.rel_error(out.cpu().numpy(), ref) < 4e-3
        p2, k2, v2 = (t.to(dev) for t in _tensors(config, 5, 1, seed % 1000))
        bp = tuple(t.to(dev) for t in _batch([0], [0], [T - 1], table))
        torch.ops.fmkv.append(p2, k2, v2, k[:T - 1].to(dev), v[:T - 1].to(dev), *bp, cfg, layer, "cuda")
        bf = tuple(t.to(dev) for t in _batch([0], [T - 1], [1], table))
        fused = torch_ops.append_attention(p2, k2, v2, k[T - 1:].to(dev), v[T - 1:].to(dev), q[-1:].to(dev), *bf, cfg,
                                           layer, 0.0, 0.0, "cuda")
        fmkv.cuda_check()
        assert reference.rel_error(fused.cpu().numpy(), ref[-1:]) < 4e-3
        assert all(torch.equal(a.cpu(), b) for a, b in zip((p2, k2, v2), want)), "the fused step's bytes differ"
    # a TorchCache on the device: smaller than the default scale group's, the same values as the host cache
    tc = torch_ops.TorchCache(config, 1, 8, 1, backend="cuda")
    host = torch_ops.TorchCache(config, 1, 8, 1, backend="cpu")
    default_sg = dataclasses.replace(config, scale_group=0)
    assert tc.resident_bytes < torch_ops.TorchCache(default_sg, 1, 8, 1, backend="cuda").resident_bytes
    s, hs = tc.add_sequence(), host.add_sequence()
    tc.append(0, s, k.to(dev), v.to(dev))
    host.append(0, hs, k, v)
    tc.check()
    assert torch.equal(tc.pages[0].cpu(), host.pages[0])
    assert reference.rel_error(tc.attention(0, s, q.to(dev)).cpu().numpy(), host.attention(0, hs, q).numpy()) < 4e-3


# ----------------------------------------------------------------------------------------------- fmkv.hf
def _hf():
    pytest.importorskip("transformers", reason="transformers is not installed")
    try:
        import fmkv.hf as fhf
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"fmkv.hf unavailable with this transformers: {e}")
    import hf_cases
    return fhf, hf_cases


def _record(monkeypatch, fhf):
    """Per FmkvLayer (by id): every appended K/V chunk and every (query, output, scaling) of its attention."""
    log = {}
    upd, att = fhf.FmkvLayer.update, fhf.FmkvLayer.attention

    def update(self, k, v, *a, **kw):
        log.setdefault(id(self), {"layer": self, "kv": [], "qo": []})["kv"].append((k.clone(), v.clone()))
        return upd(self, k, v, *a, **kw)

    def attention(self, q, scaling, softcap):
        out = att(self, q, scaling, softcap)
        log[id(self)]["qo"].append((q.clone(), out.clone(), scaling))
        return out

    monkeypatch.setattr(fhf.FmkvLayer, "update", update)
    monkeypatch.setattr(fhf.FmkvLayer, "attention", attention)
    return log


def _greedy(model, cache, ids, steps, fhf):
    """Greedy tokens and the logits of every step (prefill's last position, then each decode step)."""
    toks, logits = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True, **fhf.cache_kwargs(cache))
        for _ in range(steps):
            logits.append(out.logits[0, -1].clone())
            tok = out.logits[:, -1:].argmax(-1)
            toks.append(int(tok))
            out = model(tok, use_cache=True, **fhf.cache_kwargs(fhf.output_cache(out)))
    return toks, torch.stack(logits)


def test_hf_fmkv_cache_scale_group_64(monkeypatch):
    fhf, hc = _hf()
    model = hc.tiny_model()
    ids = hc.token_ids(1, 40, seed=11)
    kw = dict(k_bits=2, v_bits=2, window_tokens=0, max_cache_len=64, prefill="compressed")
    log = _record(monkeypatch, fhf)
    cache = fhf.FmkvCache(model.config, scale_group=SG, **kw)
    toks, logits = _greedy(model, cache, ids, 6, fhf)
    assert len(toks) == 6 and torch.isfinite(logits).all()
    layers = cache.fmkv_layers
    assert len(layers) == 3 and all(layer.config.scale_group == SG for layer in layers)
    assert cache.options["scale_group"] == SG
    # every output the layers returned == the float64 attention over the dequantized K/V recorded (scale group 64)
    n = 0
    for rec in log.values():
        layer = rec["layer"]
        assert layer.config.scale_group == SG
        ks = torch.cat([kv[0] for kv in rec["kv"]], 2)[0].transpose(0, 1)  # [T, kv_heads, d]
        vs = torch.cat([kv[1] for kv in rec["kv"]], 2)[0].transpose(0, 1)
        T = 0
        for i, (q, out, scaling) in enumerate(rec["qo"]):
            T += rec["kv"][i][0].shape[2]
            qr = q[0].transpose(0, 1)  # [n, q_heads, d]
            ref = reference.attention(layer.config, 0, ks[:T], vs[:T], qr, softmax_scale=scaling)
            assert reference.rel_error(out[0].numpy(), ref) < TOL, (layer.layer_idx, i)
            n += 1
    assert n == 3 * 7
    # the default scale group: bigger pages, other logits
    monkeypatch.undo()
    dflt = fhf.FmkvCache(model.config, **kw)
    _, logits32 = _greedy(model, dflt, ids, 6, fhf)
    assert cache.resident_bytes < dflt.resident_bytes and cache.used_bytes < dflt.used_bytes
    assert all(a.config.page_bytes < b.config.page_bytes for a, b in zip(cache.fmkv_layers, dflt.fmkv_layers))
    assert not torch.equal(logits, logits32)
    with pytest.raises(fmkv.FmkvError, match="scale_group 16"):
        fhf.FmkvCache(model.config, scale_group=16)


def test_hf_static_and_head_groups_scale_group_64():
    fhf, hc = _hf()
    model = hc.tiny_model()
    ids = hc.token_ids(1, 24, seed=5)
    kw = dict(k_bits=3, v_bits=2, window_tokens=4, sink_tokens=2, max_cache_len=48)
    dyn = fhf.FmkvCache(model.config, scale_group=SG, **kw)
    toks, logits = _greedy(model, dyn, ids, 5, fhf)
    static = fhf.FmkvStaticCache(model.config, scale_group=SG, **kw)
    stoks, slogits = _greedy(model, static, ids, 5, fhf)
    assert stoks == toks and torch.allclose(slogits, logits, rtol=1e-4, atol=1e-4)
    assert all(layer.config.scale_group == SG for layer in static.fmkv_layers) and static.options["scale_group"] == SG
    bkw = {k: v for k, v in kw.items() if k != "max_cache_len"}
    per_seq = fhf.FmkvStaticCache.bytes_per_sequence(model.config, 48, scale_group=SG, **bkw)
    per_seq32 = fhf.FmkvStaticCache.bytes_per_sequence(model.config, 48, **bkw)
    assert per_seq < per_seq32
    from fmkv.torch_ops import FUSED_MAX_ROWS
    n = len(static.fmkv_layers)  # batch 1: the device bytes are one sequence's plus the per-layer timeline / offsets
    assert static.device_bytes == per_seq + n * (8 + 8 * (FUSED_MAX_ROWS + 1))
    with pytest.raises(fmkv.FmkvError, match="scale_group 128"):
        fhf.FmkvStaticCache(model.config, max_cache_len=32, scale_group=128)
    # widths per kv head: each width group is a layer of its own, each with the scale group
    grouped = fhf.FmkvCache(model.config, head_bits=hc.HEAD_BITS, window_tokens=0, max_cache_len=48, scale_group=SG)
    gtoks, _ = _greedy(model, grouped, ids, 3, fhf)
    assert len(gtoks) == 3
    assert len(grouped.fmkv_layers) == 6 and all(layer.config.scale_group == SG for layer in grouped.fmkv_layers)
    sgrouped = fhf.FmkvStaticCache(model.config, head_bits=hc.HEAD_BITS, window_tokens=0, max_cache_len=48,
                                   scale_group=SG)
    assert _greedy(model, sgrouped, ids, 3, fhf)[0] == gtoks
    assert all(layer.config.scale_group == SG for layer in sgrouped.fmkv_layers)


# ----------------------------------------------------------------------------------------------- fmkv.mlx
def _mlx():
    mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install mlx mlx-cpu)")
    import fmkv.mlx as fm
    return mx, fm


@pytest.mark.parametrize("backend", host_backends())
def test_mlx_host_runtime_scale_group_64(rng, backend):
    mx, fm = _mlx()
    from mlx_cases import assert_storage_equal, bhld, poison_storage, random_kv, reference_append

    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        cfg = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=2, page_size=16, window_tokens=4,
                          seed=int(rng.integers(0, 2**63)), scale_group=SG)
        layer = fm.MlxLayer(cfg, layer=3, max_tokens=64, runtime="host", backend=backend)
        assert layer.pages.size == 4 * cfg.page_bytes and cfg.page_bytes < _cfg(k_bits=3, v_bits=2).page_bytes
        poisoned = poison_storage(layer)
        k, v = random_kv(rng, 50, 2, 64), random_kv(rng, 50, 2, 64)
        layer.append(bhld(k[:17]), bhld(v[:17]))
        layer.append(bhld(k[17:]), bhld(v[17:]))
        assert_storage_equal(layer, reference_append(layer, poisoned, k, v))
        q = random_kv(rng, 2, 4, 64)
        out = np.array(layer.attention(bhld(q)))
        assert reference.rel_error(out, reference.attention(cfg, 3, k, v, q)) < TOL
        other = reference.attention(dataclasses.replace(cfg, scale_group=0), 3, k, v, q)
        assert reference.rel_error(out, other) > 10 * TOL  # the scale group is applied
    finally:
        mx.set_default_device(prev)


@pytest.mark.parametrize("runtime", ["metal", "cuda"])
def test_mlx_gpu_runtimes_take_scale_group_64(monkeypatch, runtime):
    """The kernel core of the GPU runtimes stores one scale per 64 coordinates for a scale_group 64 config: the layer is
    made for them (the runtime is forced here, so no GPU is needed: nothing runs before the first append) with the
    scale group's page size, and the parameter blocks the kernels read carry the config's scale group."""
    mx, fm = _mlx()
    from fmkv.mlx import kernels
    from fmkv.mlx import layer as mlx_layer

    monkeypatch.setattr(mlx_layer, "resolve_runtime", lambda runtime_=None, r=runtime: r)
    for sg in (0, 32, SG):
        cfg = _cfg(scale_group=sg, window_tokens=4)
        layer = fm.MlxLayer(cfg, max_tokens=32)
        assert layer.runtime == runtime and layer.cfg_fields["scale_group"] == sg
        assert layer.pages.size == layer.num_pages * cfg.page_bytes
        blocks = {
            "fmkv_metal_append_params": kernels.pack_append_params(
                layer.cfg_fields, cfg.page_bytes, layer.num_pages, layer.num_slots, 0, 1, True, layer.pages_per_seq,
                "float16", "float16", (128, 64), (128, 64), 3),
            "fmkv_metal_attention_params": kernels.pack_attention_params(
                layer.cfg_fields, cfg.page_bytes, layer.num_pages, layer.num_slots, 0, 1, True, layer.pages_per_seq,
                4, "float16", (256, 64), "float16", (256, 64), 1, 32, 0.0, 0.0, 4, 1),
        }
        for name, blob in blocks.items():
            fields = [f for f, _ in kernels.struct_fields(name)]
            vals = dict(zip(fields, struct.unpack(kernels._format(name), blob)))
            assert vals["scale_group"] == sg and vals["page_bytes"] == cfg.page_bytes, name
    assert _cfg(scale_group=SG).page_bytes < _cfg().page_bytes


def test_mlx_lm_cache_scale_group(tmp_path):
    mx, fm = _mlx()
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    from mlx_lm.models import cache as lm_cache
    from mlx_lm.models import llama

    from fmkv.mlx import lm

    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        mx.random.seed(77)
        args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=97,
                               rms_norm_eps=1e-5)
        model = llama.Model(args)
        mx.eval(model.parameters())
        prompt, more = list(range(3, 43)), [5, 9, 11]

        def step(cache, tokens):
            out = model(mx.array(tokens)[None], cache=cache)
            mx.eval(out)
            return np.array(out[0].astype(mx.float32))

        outs = {}
        for sg in (0, SG):
            cache = lm.make_prompt_cache(model, k_bits=2, v_bits=2, window_tokens=0, max_tokens=64, runtime="host",
                                         scale_group=sg)
            outs[sg] = np.concatenate([step(cache, prompt)] + [step(cache, [t]) for t in more[:2]])
            assert cache[0].scale_group == sg and cache[0].fmkv.config.scale_group == sg
            if sg:
                assert "scale_group 64" in repr(cache[0])
                path = str(tmp_path / "sg.safetensors")
                lm_cache.save_prompt_cache(path, cache)
                loaded = lm_cache.load_prompt_cache(path)
                assert loaded[0].scale_group == SG and loaded[0].fmkv.config.scale_group == SG
                assert loaded[0].meta_state == cache[0].meta_state
                assert np.array_equal(step(loaded, [more[2]]), step(cache, [more[2]]))
                sg_bytes = cache[0].nbytes
            else:
                dflt_bytes = cache[0].nbytes
        assert sg_bytes < dflt_bytes and not np.array_equal(outs[0], outs[SG])
        assert np.isfinite(outs[SG]).all()
        # a state saved before the field existed (16 scalars, then the key-offset array) loads with scale group 0
        old = lm.FmkvKVCache(window_tokens=0, runtime="host", scale_group=SG)
        s = old.state
        old.state = (*s[:3], *s[3:-2], s[-1])
        assert old.scale_group == 0
        with pytest.raises(fmkv.FmkvError, match="scale_group 16"):
            lm.FmkvKVCache(scale_group=16)
        # a GPU runtime takes it: the cache is made for 'metal' (no GPU is needed before the first update)
        gpu = lm.FmkvKVCache(scale_group=SG, runtime="metal")
        assert gpu.scale_group == SG and gpu.runtime == "metal"
        assert "scale_group 64" in repr(gpu)
    finally:
        mx.set_default_device(prev)

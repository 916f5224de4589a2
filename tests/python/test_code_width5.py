"""5-bit codes (docs/FORMAT.md section 6: the magnitude in nibble words, a sign plane) through the Python layers.

* Config / bytes: k5 costs 40 code bytes + 4 scale bytes per 64-d vector; fmkv.codebook(5) is the 16 Lloyd-Max levels.
* torch ops on the host backends (test_scale_group.run_host_backends): the pages an append writes are bit-identical
  between 'cpu' and 'ref' (storage random first), attention (output NaN-poisoned before the call) and the fused step
  are within 1e-5 of the float64 attention over the dequantized K/V (fmkv.reference), for K, V or both at 5 bits,
  formats 2 and 3, both scale groups, sinks and windows.
* fmkv.hf: FmkvCache(k_bits=5, ...) decodes the tiny model of hf_cases; every decode output equals the evaluation's
  dequantize-then-attend with the same config name (k5v4-w8-s2), the quantizer whose perplexity docs/EVAL.md reports.
* The CUDA kernels' 5-bit path is checked against the CPU backend in test_torch_cuda.py (and the C++ harness).
* fmkv.mlx: every runtime takes 5-bit sides (the GPU runtimes' kernel core packs and decodes every width of the
  format; tests/metal/run.sh checks its bytes against the reference, tests/python/test_mlx_gpu.py on an MLX GPU); the
  host runtime attends within 1e-5 of the reference here; a width the format lacks (6) is refused when made.
"""
import numpy as np
import pytest

import fmkv
from fmkv import reference

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch to run the torch op tests")
from fmkv import torch_ops  # noqa: E402
from test_scale_group import _batch, run_host_backends  # noqa: E402  (the host-backend checks of both options)

TOL = 1e-5


def test_bytes_and_levels():
    assert fmkv.bytes_per_token_head(64, 5) == 44 and fmkv.bytes_per_token_head(128, 5) == 88
    assert fmkv.bytes_per_token_head(64, 5, 64) == 42
    c = fmkv.Config(head_dim=64, num_kv_heads=1, k_bits=5, v_bits=4)
    assert c.bytes_per_token_per_head == 44 + 36
    lv = fmkv.codebook(5)
    assert lv.shape == (16,) and np.all(np.diff(lv) > 0) and np.array_equal(lv, lv.astype(np.float16).astype(np.float32))
    # the Lloyd-Max optimum for N(0, 1): the quantizer's distortion, integrated here in float64
    x = np.linspace(0.0, 10.0, 2_000_001)
    q = lv[np.searchsorted((lv[:-1] + lv[1:]) / 2, x)]
    dist = 2 * np.trapezoid((x - q) ** 2 * np.exp(-x * x / 2) / np.sqrt(2 * np.pi), x)
    assert abs(dist - 0.0025047) < 2e-6


CASES = [  # k_bits, v_bits, head_dim, sink, window, scale_rule, format_version, scale_group
    (5, 5, 64, 0, 0, "lsq", 0, 0),
    (5, 4, 128, 2, 5, "rms", 3, 0),
    (16, 5, 64, 0, 3, "lsq", 0, 0),
    (3, 5, 128, 0, 0, "lsq", 3, 64),
    (5, 2, 256, 1, 0, "lsq", 2, 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "k{}v{}d{}S{}W{}{}f{}g{}".format(*c))
def test_torch_ops_host_backends(rng, case):
    kb, vb, d, S, W, rule, fv, sg = case
    seed, layer = int(rng.integers(0, 2**63)), int(rng.integers(0, 30))
    H, HQ, T, NQ = 2, 6, 45, 3
    g = torch.Generator().manual_seed(seed % 2**62)
    k = torch.randn(T, H, d, generator=g) * (1 + torch.rand(d, generator=g) * 3)
    v = torch.randn(T, H, d, generator=g)
    q = torch.randn(NQ, HQ, d, generator=g)
    config = fmkv.Config(head_dim=d, num_kv_heads=H, k_bits=kb, v_bits=vb, page_size=16, sink_tokens=S,
                         window_tokens=W, scale_rule=rule, seed=seed, format_version=fv, scale_group=sg)
    run_host_backends(config, layer, k, v, q, [[3, 0, 2, 1]], seed)
    # the 5-bit side is what it says: at 4 bits the output moves
    four = fmkv.Config(head_dim=d, num_kv_heads=H, k_bits=min(kb, 4), v_bits=min(vb, 4), page_size=16, sink_tokens=S,
                       window_tokens=W, scale_rule=rule, seed=seed, format_version=fv, scale_group=sg)
    assert not np.allclose(reference.attention(four, layer, k, v, q), reference.attention(config, layer, k, v, q),
                           rtol=0, atol=1e-6)


def test_hf_decode_equals_the_evaluation_quantizer(monkeypatch):
    """Prefill 60 tokens, 4 decode steps through FmkvCache(k_bits=5, v_bits=4, window 8, 2 sinks): each fused output
    equals fmkv.eval's k5v4-w8-s2 dequantize-then-attend over the same K/V (and not k4v4-w8-s2's)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import fmkv.hf as fhf
    from fmkv.eval.quantizers import parse_config
    from hf_cases import COMMON, token_ids, tiny_model
    from test_hf_key_offset import _record, _worst_against

    model = tiny_model()
    q5, q4 = parse_config("k5v4-w8-s2"), parse_config("k4v4-w8-s2")
    for q in (q5, q4):
        q.num_layers = COMMON["num_hidden_layers"]
    cache = fhf.FmkvCache(model.config, max_cache_len=80, k_bits=5, v_bits=4, window_tokens=8, sink_tokens=2,
                          page_size=16)
    log = _record(monkeypatch, cache)
    ids = token_ids(1, 64, 7)
    with torch.no_grad():
        pkv = fhf.output_cache(model(ids[:, :60], **fhf.cache_kwargs(cache), use_cache=True))
        for t in range(60, 64):
            pkv = fhf.output_cache(model(ids[:, t:t + 1], **fhf.cache_kwargs(pkv), use_cache=True))
    assert all(sum(q.shape[2] == 1 for q, *_ in r["qo"]) == 4 for r in log.values())
    assert _worst_against(log, q5) < 2e-5
    assert _worst_against(log, q4) > 1e-4


def test_mlx_runtimes_take_five_bits(monkeypatch):
    """fmkv.mlx: the host runtime (the C library) takes a 5-bit config and attends within 1e-5 of the reference; the GPU
    runtimes' kernel core packs and decodes every width of the format (with either scale group), so a layer with a
    5-bit side is made for them (the runtime forced: no GPU is needed before the first append) and an mlx-lm cache
    with a 5-bit side is made for them; width 6, which the format lacks, is refused when the cache is made."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    from fmkv.mlx import layer as mlx_layer
    from fmkv.mlx.layer import MlxLayer

    config = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=5, v_bits=4, page_size=16, seed=5)
    for runtime in ("metal", "cuda"):
        monkeypatch.setattr(mlx_layer, "resolve_runtime", lambda r=None, rt=runtime: rt)
        for kb, vb, sg in ((5, 4, 0), (4, 5, 0), (5, 5, 0), (16, 5, 0), (5, 5, 64)):
            gpu = MlxLayer(fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=kb, v_bits=vb, scale_group=sg), max_tokens=32)
            assert gpu.runtime == runtime and gpu.cfg_fields["scale_group"] == sg
    monkeypatch.undo()
    try:
        from fmkv.mlx import lm
    except ImportError:
        lm = None
    if lm is not None:  # mlx-lm installed: the cache is made for a GPU runtime (no GPU is needed), width 6 refused
        cache = lm.FmkvKVCache(k_bits=5, v_bits=5, runtime="metal")
        assert (cache.k_bits, cache.v_bits) == (5, 5)
        for kb, vb in ((6, 4), (4, 6)):
            with pytest.raises(fmkv.FmkvError, match="bits 6 is not supported"):
                lm.FmkvKVCache(k_bits=kb, v_bits=vb, runtime="metal")
    layer = MlxLayer(config, batch=1, max_tokens=64, runtime="host")
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    layer.append(mx.array(k), mx.array(v))
    out = np.array(layer.attention(mx.array(q)))  # [1, 4, 64]
    want = reference.attention(config, 0, torch.from_numpy(k[0].transpose(1, 0, 2).copy()),
                               torch.from_numpy(v[0].transpose(1, 0, 2).copy()),
                               torch.from_numpy(q[0].transpose(1, 0, 2).copy()))
    assert reference.rel_error(out, want) < TOL

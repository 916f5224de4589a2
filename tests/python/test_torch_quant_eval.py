"""fmkv.eval quantizers: byte accounting and basic behaviour of fmkv configs and baselines (no model)."""
import json
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
fmkv = pytest.importorskip("fmkv", reason="the fmkv binding is not installed")
from fmkv.eval.quantizers import parse_config  # noqa: E402


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fmkv_bytes_match_library(d):
    for kb, vb in [(2, 2), (3, 3), (4, 4), (4, 2), (16, 3)]:
        q = parse_config(f"k{kb}v{vb}")
        cfg = fmkv.Config(head_dim=d, num_kv_heads=1, k_bits=kb, v_bits=vb)
        assert q.bytes_per_token_per_head(d) == cfg.bytes_per_token_per_head


def test_baseline_bytes():
    d = 64
    assert parse_config("fp16").bytes_per_token_per_head(d) == 256
    assert parse_config("fp8").bytes_per_token_per_head(d) == 128
    assert parse_config("quanto-int4").bytes_per_token_per_head(d) == 2 * (32 + 4)
    assert parse_config("quanto-int2-g32").bytes_per_token_per_head(d) == 2 * (16 + 8)
    assert parse_config("kivi-2").bytes_per_token_per_head(d) == 2 * (16 + 8)
    assert parse_config("kivi-2").bytes_per_token_per_head(d, ctx=2048) == pytest.approx(61.0)
    assert parse_config("turbo-3").bytes_per_token_per_head(d) == 2 * (24 + 2)
    assert parse_config("k4v4-w32").bytes_per_token_per_head(d, ctx=2048) == pytest.approx(74.875)
    q = parse_config("k4v4-b1")
    q.num_layers = 30
    assert q.bytes_per_token_per_head(d) == pytest.approx((28 * 72 + 2 * 256) / 30)


def test_error_decreases_with_bits_and_rotation_helps_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 256, 64, generator=g)
    x[..., 3] += 20.0  # an outlier channel, as in real keys
    err = {}
    for name in ["k2v2", "k3v3", "k4v4", "k4v4-norot", "quanto-int4", "turbo-4", "kivi-4", "fp8"]:
        q = parse_config(name)
        err[name] = ((q.quant_k(x, 0) - x).norm() / x.norm()).item()
    assert err["k2v2"] > err["k3v3"] > err["k4v4"]
    assert err["k4v4"] < err["k4v4-norot"]
    assert err["fp8"] < 0.05
    for v in err.values():
        assert 0 < v < 0.5


def test_plot_command(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib): the plot is not checked")
    from fmkv.eval.cli import main

    rows = [{"config": c, "bytes_per_token_per_head": b, "ppl": p, "options": {"kind": k}, "model": "m",
             "text": "t", "ctx": 8, "tokens": 7}
            for c, b, p, k in [("fp16", 256, 10.0, "fp16"), ("k4v4", 72, 10.5, "fmkv"), ("k3v3", 56, 11.0, "fmkv"),
                               ("kivi-2", 61, 12.0, "kivi")]]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(src), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_e5m2_research_codebook(bits):
    """The -e5m2 levels are a common factor times e5m2 values (fp16 with a zero low byte), ascending,
    cost little Gaussian MSE over the format's Lloyd-Max levels (whose MSE matches the textbook value),
    and quantizing with them differs from format v1 only through the levels."""
    from fmkv.eval.e5m2_levels import e5m2_report, gaussian_mse
    r = e5m2_report(bits)
    for v in r["e5m2_values"]:
        h = torch.tensor(v, dtype=torch.float16)
        assert float(h) == v and (int(h.view(torch.int16)) & 0xFF) == 0, v
    assert r["levels"] == sorted(r["levels"])
    assert 1.0 <= r["mse_ratio"] < {2: 1.001, 3: 1.02, 4: 1.06}[bits]
    textbook = {2: 0.1175, 3: 0.03454, 4: 0.009497}[bits]  # Lloyd-Max on N(0, 1), fp16-rounded levels
    assert r["format_mse"] == pytest.approx(textbook, rel=2e-3)
    # the closed form against a fine numerical integral of the same quantizer
    lv = torch.tensor(r["levels"], dtype=torch.float64)
    xs = torch.linspace(0.0, 12.0, 1_200_001, dtype=torch.float64)
    q = lv[(xs.unsqueeze(-1) > (lv[:-1] + lv[1:]) / 2).sum(-1)]
    f = (xs - q) ** 2 * torch.exp(-xs * xs / 2) / (2 * torch.pi) ** 0.5
    assert 2 * float(torch.trapezoid(f, xs)) == pytest.approx(float(gaussian_mse(lv[None])[0]), rel=1e-5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 64, generator=g)
    q1, q2 = parse_config(f"k{bits}v{bits}"), parse_config(f"k{bits}v{bits}-e5m2")
    e1 = ((q1.quant_k(x, 0) - x).norm() / x.norm()).item()
    e2 = ((q2.quant_k(x, 0) - x).norm() / x.norm()).item()
    assert e1 != e2 and abs(e2 / e1 - 1) < 0.1
    assert q2.bytes_per_token_per_head(64) == q1.bytes_per_token_per_head(64)


def test_ve5m2_restricts_v_only():
    """-ve5m2 (the format-3 candidate's levels): K exactly as k3v3, V exactly as k3v3-e5m2."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 64, 64, generator=g)
    base, both, vonly = parse_config("k3v3"), parse_config("k3v3-e5m2"), parse_config("k3v3-ve5m2")
    assert torch.equal(vonly.quant_k(x, 0), base.quant_k(x, 0))
    assert torch.equal(vonly.quant_v(x, 0), both.quant_v(x, 0))
    assert not torch.equal(vonly.quant_v(x, 0), base.quant_v(x, 0))
    assert vonly.options["levels"] != both.options["levels"]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turbo_lsq_refits_the_one_scale(bits):
    """turbo-<b>-lsq keeps turbo's codes and refits the vector's one scale by least squares: never a larger
    error than the norm scale (up to the fp16 rounding of the scale), smaller on average; same bytes."""
    torch.manual_seed(bits)
    x = torch.randn(4, 2, 300, 64) * (1 + torch.rand(64) * 3)
    rms, lsq = parse_config(f"turbo-{bits}"), parse_config(f"turbo-{bits}-lsq")
    assert lsq.bytes_per_token_per_head(64) == rms.bytes_per_token_per_head(64)
    assert lsq.options["scale"] != rms.options["scale"]
    er = ((rms.quant_k(x, 0) - x) ** 2).sum(-1)
    el = ((lsq.quant_k(x, 0) - x) ** 2).sum(-1)
    assert (el <= er * (1 + 2e-3) + 1e-6).all()
    assert el.mean() < er.mean() * 0.999
    with pytest.raises(ValueError):
        parse_config("turbo-3-foo")


def test_key_mean_window_and_skip():
    """-km subtracts the fp16 mean of tokens 0..127 before quantizing and adds it back; -kms<N> of tokens
    N..N+127: shifting every key by a constant c shifts the dequantized keys by c (up to fp16 rounding of
    the mean), and the skipped tokens do not enter the mean."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 300, 64, generator=g)
    x[:, :, :4] += 50.0  # sink-like outliers in the first 4 tokens
    km, kms = parse_config("k3v3-km"), parse_config("k3v3-kms4")
    assert km.key_mean and km.key_mean_skip == 0 and kms.key_mean_skip == 4
    assert kms.options["key_mean_skip"] == 4
    base = parse_config("k3v3").quant_k(x, 0)
    # kms4's mean ignores the outliers: adding a constant to tokens 0..3 only changes those tokens' output
    y = x.clone()
    y[:, :, :4] += 7.0
    a, b = kms.quant_k(x, 0), kms.quant_k(y, 0)
    assert torch.equal(a[:, :, 4:], b[:, :, 4:])
    # km's mean includes them: the same change moves later tokens too
    assert not torch.equal(km.quant_k(x, 0)[:, :, 4:], km.quant_k(y, 0)[:, :, 4:])
    # the mean is removed before quantizing: a large common offset costs km nothing, plain k3v3 a lot
    off = x + 30.0
    err_km = (km.quant_k(off, 0) - off).pow(2).mean()
    err_plain = (parse_config("k3v3").quant_k(off, 0) - off).pow(2).mean()
    assert err_km < 0.5 * err_plain
    assert torch.isfinite(base).all()
    with pytest.raises(ValueError):
        parse_config("k3v3-kmsx")


def test_generate_cache_options_from_config_names():
    from fmkv.eval.cli import generate_cache_options

    assert generate_cache_options("k4v4") == dict(k_bits=4, v_bits=4, window_tokens=0, sink_tokens=0,
                                                  scale_rule="lsq", format_version=0, key_offset=False, scale_group=0)
    assert generate_cache_options("k3v3-fmt3-w64-s4-rms") == dict(k_bits=3, v_bits=3, window_tokens=64, sink_tokens=4,
                                                                  scale_rule="rms", format_version=3, key_offset=False,
                                                                  scale_group=0)
    assert generate_cache_options("k2v2-g64")["scale_group"] == 64  # the caches' scale_group=64
    assert generate_cache_options("k16v3-w32")["k_bits"] == 16
    assert generate_cache_options("k3v3-km")["key_offset"] is True  # the caches' key_offset=True
    for bad, word in (("k3v3-kms4", "-kms<N>"), ("k4v4-norot", "-norot"), ("k4v4-b1", "-b<N>"), ("kivi-4", "fmkv caches"),
                      ("k3v3-w", "unknown modifier"), ("k6v3", "k_bits")):
        with pytest.raises(ValueError, match=re.escape(word)):
            generate_cache_options(bad)


def test_generate_refuses_cache_less_configs_before_loading(capsys):
    from fmkv.eval.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--configs", "k4v4,k3v3-vm", "--model", "/nonexistent.gguf"])
    assert e.value.code == 2
    assert "-vm exist only in the evaluation" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["k3v3-s4", "k3v3-km-s4", "k4v2-s2"])
def test_sinks_without_window_equal_a_float64_mixed_attention(config):
    """Sinks without a window take the SDPA path with per-key mixed K/V: the first S keys / values as the caches keep
    them in fp16 (after the key offset with -km), the rest quantized -- equal to a float64 causal attention over
    that mix (prefill rows and a decode row)."""
    from fmkv.eval import ppl as P

    class _Mod:
        layer_idx = 1

    q_cfg = parse_config(config)
    q_cfg.num_layers = 3
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 3, 40, 64, generator=g) + 2.0
    v = torch.randn(1, 3, 40, 64, generator=g)
    s = q_cfg.sinks
    km = q_cfg.quant_k(k, 1).double()
    vm = q_cfg.quant_v(v, 1).double()
    km[:, :, :s] = q_cfg.fp16_keys(k)[:, :, :s].double()
    vm[:, :, :s] = v[:, :, :s].half().double()
    for n in (40, 1):
        q = torch.randn(1, 6, n, 64, generator=g)
        out, _ = P.quantized_attention(_Mod(), q, k, v, None, scaling=0.125, quantizer=q_cfg)
        sc = q.double() @ km.repeat_interleave(2, 1).transpose(-1, -2) * 0.125
        causal = torch.arange(40 - n, 40)[:, None] < torch.arange(40)[None, :]
        ref = torch.softmax(sc.masked_fill(causal, float("-inf")), -1) @ vm.repeat_interleave(2, 1)
        assert (out.transpose(1, 2).double() - ref).abs().max().item() < 1e-5

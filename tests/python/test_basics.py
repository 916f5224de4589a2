"""Module-level API: version, backends, Config arithmetic, codebooks, vector quantization."""
import pathlib
import re

import numpy as np
import pytest

import fmkv

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_import_and_version():
    assert isinstance(fmkv.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", fmkv.__version__)
    header = REPO / "include" / "fmkv" / "fmkv.h"
    if header.exists():  # the tests run from a source checkout: the header is the source of truth
        m = re.search(r'#define\s+FMKV_VERSION\s+"([^"]+)"', header.read_text())
        assert m and m.group(1) == fmkv.__version__
    from importlib.metadata import version
    assert version("fmkv") == fmkv.__version__


def test_format_version():
    assert fmkv.format_version() == 2


def test_backends():
    b = fmkv.backends()
    assert set(b) == {"ref", "cpu", "cuda", "metal"}
    for name, info in b.items():
        assert set(info) == {"available", "device"}
        assert isinstance(info["available"], bool) and isinstance(info["device"], str)
        assert (info["device"] != "") == info["available"] or name == "cpu"
    assert b["ref"]["available"]
    assert fmkv.default_backend() == ("cpu" if b["cpu"]["available"] else "ref")


def test_error_class():
    assert issubclass(fmkv.FmkvError, ValueError)
    assert fmkv.FmkvError.__module__ == "fmkv"


def test_config_defaults_and_frozen():
    c = fmkv.Config()
    assert (c.head_dim, c.num_kv_heads, c.k_bits, c.v_bits, c.page_size) == (128, 8, 3, 3, 64)
    assert (c.sink_tokens, c.window_tokens, c.scale_rule, c.seed) == (0, 0, "lsq", 0)
    with pytest.raises(Exception):
        c.head_dim = 64
    import dataclasses
    c2 = dataclasses.replace(c, head_dim=64)
    assert c2.head_dim == 64 and c == fmkv.Config()


@pytest.mark.parametrize("bits,expected", [(2, 40), (3, 56), (4, 72), (16, 256)])
def test_spec_bytes_d128(bits, expected):
    # FORMAT.md: per 32-coordinate group, `bits` uint32 code words + one fp16 scale.
    assert fmkv.bytes_per_token_head(128, bits) == expected


def test_config_bytes():
    c = fmkv.Config(head_dim=128, num_kv_heads=8, k_bits=3, v_bits=3, page_size=64)
    assert c.k_bytes_per_token_per_head == 56
    assert c.v_bytes_per_token_per_head == 56
    assert c.bytes_per_token_per_head == 112
    assert c.page_bytes == 8 * 112 * 64
    assert c.fp16_slot_bytes == 0
    c = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=16, v_bits=2, page_size=16, sink_tokens=4, window_tokens=8)
    assert c.k_bytes_per_token_per_head == 128 and c.v_bytes_per_token_per_head == 20
    assert c.page_bytes == 2 * (128 + 20) * 16
    assert c.fp16_slot_bytes == 2 * 2 * 2 * 12 * 64  # K and V, fp16, heads, sink + window, d


def test_codebook_values():
    np.testing.assert_allclose(fmkv.codebook(3), [0.2451, 0.7560, 1.344, 2.152], atol=2e-3)
    for bits in (1, 2, 3, 4):
        cb = fmkv.codebook(bits)
        assert cb.dtype == np.float32 and cb.shape == (2 ** (bits - 1),)
        assert np.all(np.diff(cb) > 0) and cb[0] > 0
        assert np.array_equal(cb, cb.astype(np.float16).astype(np.float32))  # fp16 values
    np.testing.assert_allclose(fmkv.codebook(1), [0.7979], atol=2e-3)  # E|x| of N(0,1)
    np.testing.assert_allclose(fmkv.codebook(2), [0.4528, 1.510], atol=2e-3)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rule", ["lsq", "rms"])
def test_quantize_roundtrip(rng, bits, head_dim, rule):
    # The error is pooled over 32 fresh N(0, 1) vectors: one vector's relative error has a long tail
    # (3 bits, head_dim 64: mean 0.175, 0.1% of vectors above 0.27), the pooled one does not (mean
    # 0.175-0.180, sd <= 0.0034 over 300 trials). Bounds: mean + ~8 sd for every (bits, head_dim,
    # rule) -- a wrong level or scale moves the error far more.
    num = den = 0.0
    for _ in range(32):
        x = rng.standard_normal(head_dim).astype(np.float32)
        seed = int(rng.integers(0, 2**63))
        codes, scales = fmkv.quantize_vector(x, bits, seed=seed, layer=3, scale_rule=rule)
        assert codes.dtype == np.uint8 and codes.shape == (head_dim,)
        assert scales.dtype == np.float16 and scales.shape == (head_dim // 32,)
        assert int(codes.max()) < 2**bits
        y = fmkv.dequantize_vector(codes, scales, bits, seed=seed, layer=3)
        assert y.dtype == np.float32 and y.shape == (head_dim,)
        num += float(np.sum((y - x) ** 2))
        den += float(np.sum(x**2))
    assert np.sqrt(num / den) < {2: 0.38, 3: 0.21, 4: 0.11, 5: 0.058}[bits]
    # Deterministic, and the rotation depends on the seed and the layer.
    c2, s2 = fmkv.quantize_vector(x, bits, seed=seed, layer=3, scale_rule=rule)
    assert np.array_equal(codes, c2) and np.array_equal(scales, s2)
    y_wrong = fmkv.dequantize_vector(codes, scales, bits, seed=seed, layer=4)
    assert np.linalg.norm(y_wrong - x) > np.linalg.norm(y - x)
    # uint16 scale bits are accepted as well as float16 values
    assert np.array_equal(fmkv.dequantize_vector(codes, scales.view(np.uint16), bits, seed=seed, layer=3), y)


def test_quantize_input_is_rounded_to_fp16(rng):
    x = rng.standard_normal(128).astype(np.float32)
    a = fmkv.quantize_vector(x, 3, seed=7)
    b = fmkv.quantize_vector(x.astype(np.float16), 3, seed=7)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    c = fmkv.quantize_vector(x[::-1].copy()[::-1], 3, seed=7)  # negative stride view
    assert np.array_equal(a[0], c[0])


def test_main_module(capsys):
    from fmkv.__main__ import main
    assert main([]) == 0
    out = capsys.readouterr().out
    assert fmkv.__version__ in out and "ref" in out


def test_format_version_3_config_and_codebooks():
    assert fmkv.Config(format_version=3).format_version == 3
    assert fmkv.Config().format_version == 0  # the library's default, fmkv.format_version()
    for bad in (1, 4, -1):
        with pytest.raises(fmkv.FmkvError, match=f"format_version {bad} is not supported"):
            fmkv.Config(format_version=bad)
    # format 3's 3-bit codebooks: integer levels (K on the int8 grid, V with 3 significant bits) x an fp16 step
    k, v = fmkv.codebook_levels(3, 3, "k"), fmkv.codebook_levels(3, 3, "v")
    np.testing.assert_array_equal(k / k[0] * 10, [10, 31, 55, 88])
    np.testing.assert_array_equal(v / v[0], [1, 3, 5, 8])
    assert np.float16(k[0] / 10) == k[0] / 10 and np.float16(v[0]) == v[0]  # the step is an fp16 value
    for bits in (2, 3, 4, 5):  # format 2, and format 3's other widths: the Lloyd-Max table
        np.testing.assert_array_equal(fmkv.codebook_levels(2, bits, "v"), fmkv.codebook(bits))
        if bits != 3:
            np.testing.assert_array_equal(fmkv.codebook_levels(3, bits, "k"), fmkv.codebook(bits))
    with pytest.raises(fmkv.FmkvError, match="side"):
        fmkv.codebook_levels(3, 3, "q")


def test_quantize_vector_format_3(rng):
    x = rng.standard_normal(128).astype(np.float32)
    for side, table in (("k", fmkv.codebook_levels(3, 3, "k")), ("v", fmkv.codebook_levels(3, 3, "v"))):
        codes, scales = fmkv.quantize_vector(x, 3, seed=5, layer=1, format_version=3, side=side)
        y = fmkv.dequantize_vector(codes, scales, 3, seed=5, layer=1, format_version=3, side=side)
        assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.25  # ~sqrt(0.0349) for N(0,1) data
        # the same codes read with format 2's table give other values: the tables differ
        y2 = fmkv.dequantize_vector(codes, scales, 3, seed=5, layer=1)
        assert not np.allclose(y, y2)
        assert set(np.unique(codes)) <= set(range(8)) and table.shape == (4,)

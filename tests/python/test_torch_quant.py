"""fmkv.torch_quant (vectorised torch quantizer) is bit-exact with the library's reference."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
fmkv = pytest.importorskip("fmkv", reason="the fmkv binding is not installed")
tq = pytest.importorskip("fmkv.torch_quant")
fmt = pytest.importorskip("fmkv.format")


def _inputs(d, n=96, seed=0):
    rng = np.random.default_rng(seed + d)
    x = rng.standard_normal((n, d)) * rng.uniform(1e-3, 80.0, (n, 1))
    x[0] = 0.0                       # all-zero vector: scale 0, codes 0
    x[1, :32] = 0.0                  # one zero group
    x[2] *= 1e-5                     # fp16 subnormals after rounding
    x[3, 5] = 3000.0                 # a big outlier
    x[4] = rng.standard_normal(d) + 7.0   # a large per-channel mean
    x[5] = np.where(rng.random(d) < 0.5, -0.0, 0.0)  # signed zeros
    x[6, :] = 60000.0                # near the fp16 limit
    return x.astype(np.float32)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", fmt.CODE_BITS)
@pytest.mark.parametrize("rule", ["lsq", "rms"])
def test_codes_and_scales_bit_exact(d, bits, rule):
    x = _inputs(d)
    seed, layer = 0x1234_5678_9ABC_DEF0, 17
    q = tq.quantize(torch.from_numpy(x), bits, seed, layer, rule)
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float16
    for i in range(x.shape[0]):
        codes, scales = fmkv.quantize_vector(x[i], bits, seed=seed, layer=layer, scale_rule=rule)
        np.testing.assert_array_equal(q.codes[i].numpy(), codes, err_msg=f"codes row {i}")
        np.testing.assert_array_equal(q.scales[i].numpy().view(np.uint16), scales.view(np.uint16),
                                      err_msg=f"scales row {i}")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", fmt.CODE_BITS)
def test_dequantize_matches_binding(d, bits):
    x = _inputs(d, n=32, seed=1)
    q = tq.quantize(torch.from_numpy(x), bits, 3, 2)
    out = tq.dequantize(q).numpy()
    for i in range(x.shape[0]):
        ref = fmkv.dequantize_vector(q.codes[i].numpy(), q.scales[i].numpy(), bits, seed=3, layer=2)
        np.testing.assert_allclose(out[i], ref, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


def test_tensor_layout_and_fp16_reference():
    x = torch.randn(5, 3, 64)
    assert tq.fake_quantize(x, 16).equal(x.half().float())
    y = tq.fake_quantize(x, 4)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < 0.15  # 4-bit Lloyd-Max: ~0.1 relative RMS error on Gaussian data


def test_rotation_is_orthonormal_and_uses_codebook():
    x = torch.randn(10, 128)
    y = tq.rotate(x, 5, 1)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(tq.unrotate(y, 5, 1), x, atol=1e-5)
    mags, thr = tq.codebook_tensor(3)
    assert np.array_equal(mags.numpy(), fmkv.codebook(3))
    assert len(thr) == len(mags) - 1


def test_no_rotation_ablation_quantizes_raw_groups():
    x = torch.randn(4, 64)
    q = tq.quantize(x, 3, rotate_input=False)
    codes, scales = tq.quantize_rotated(x.half().float(), 3)
    assert q.codes.equal(codes) and q.scales.equal(scales)


def test_non_finite_input_rejected():
    x = torch.zeros(2, 64)
    x[1, 3] = 70000.0
    with pytest.raises(ValueError):
        tq.quantize(x, 3)


def _random_inputs_bit_exact(d, rng):
    n = 64
    x = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-8, 6, (n, 1)))).astype(np.float32)
    seed, layer = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**31))
    for bits in fmt.CODE_BITS:
        for rule in ("lsq", "rms"):
            q = tq.quantize(torch.from_numpy(x), bits, seed, layer, rule)
            for i in range(n):
                codes, scales = fmkv.quantize_vector(x[i], bits, seed=seed, layer=layer, scale_rule=rule)
                assert np.array_equal(q.codes[i].numpy(), codes), (bits, rule, i)
                assert np.array_equal(q.scales[i].numpy().view(np.uint16), scales.view(np.uint16)), (bits, rule, i)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fresh_random_inputs_bit_exact(d, rng):
    """Fresh random inputs each run (conftest prints FMKV_TEST_SEED to replay)."""
    _random_inputs_bit_exact(d, rng)


def test_replayed_seed_rms_tie():
    """A seed on which torch's float32 sqrt (one ulp off) flipped a scale's fp16 rounding: vector 2,
    group 3, 2-bit RMS, d = 256 (scale 0x12e6 instead of 0x12e5) before _sqrt_rn."""
    _random_inputs_bit_exact(256, np.random.default_rng(8506910537148222519))


def test_sqrt_rn_is_correctly_rounded():
    """_sqrt_rn against numpy's float32 sqrt (IEEE: correctly rounded) over the float32 range."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 0x7F800000, 1 << 20, dtype=np.uint32)  # every finite non-negative float32
    x = np.concatenate([bits.view(np.float32), np.array([0.0, 1.0, 4.0, np.float32(2.0) ** -149], np.float32),
                        np.array([0x353E3EF8], np.uint32).view(np.float32)])
    got = tq._sqrt_rn(torch.from_numpy(x)).numpy()
    assert np.array_equal(got.view(np.uint32), np.sqrt(x).view(np.uint32))


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("bits", fmt.CODE_BITS)
@pytest.mark.parametrize("rule", ["lsq", "rms"])
def test_codes_and_scales_bit_exact_per_format_version(version, side, bits, rule):
    d = 128
    x = np.concatenate([_inputs(d, n=48, seed=version), np.random.default_rng().standard_normal((64, d)).astype(np.float32)])
    seed, layer = 0xFEED_0000_1111_2222, 5
    q = tq.quantize(torch.from_numpy(x), bits, seed, layer, rule, format_version=version, side=side)
    mags, _ = tq.codebook_tensor(bits, format_version=version, side=side)
    assert np.array_equal(mags.numpy(), fmkv.codebook_levels(version, bits, side))
    for i in range(x.shape[0]):
        codes, scales = fmkv.quantize_vector(x[i], bits, seed=seed, layer=layer, scale_rule=rule,
                                             format_version=version, side=side)
        np.testing.assert_array_equal(q.codes[i].numpy(), codes, err_msg=f"codes row {i}")
        np.testing.assert_array_equal(q.scales[i].numpy().view(np.uint16), scales.view(np.uint16),
                                      err_msg=f"scales row {i}")
        ref = fmkv.dequantize_vector(codes, scales, bits, seed=seed, layer=layer, format_version=version, side=side)
        out = tq.dequantize(tq.QuantizedTensor(q.codes[i:i + 1], q.scales[i:i + 1], bits, seed, layer,
                                               format_version=version, side=side)).numpy()[0]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


def test_format3_three_bit_levels_differ_from_format2():
    # the case the version parameter exists for: 3-bit codes of format 3 stand for other values, per side
    k2, _ = tq.codebook_tensor(3, format_version=2, side="k")
    k3, _ = tq.codebook_tensor(3, format_version=3, side="k")
    v3, _ = tq.codebook_tensor(3, format_version=3, side="v")
    assert not torch.equal(k2, k3) and not torch.equal(k3, v3)
    assert torch.equal(tq.codebook_tensor(4, format_version=3, side="v")[0], tq.codebook_tensor(4)[0])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", fmt.CODE_BITS)
@pytest.mark.parametrize("rule", ["lsq", "rms"])
@pytest.mark.parametrize("version", [2, 3])
def test_scale_group_64_bit_exact(d, bits, rule, version):
    """One scale per 64 coordinates (scale_group=64): codes and d / 64 scales equal the library's, fresh inputs
    included; the dequantized vectors too; and the scales are not scale group 32's."""
    x = np.concatenate([_inputs(d, n=48, seed=7), np.random.default_rng().standard_normal((48, d)).astype(np.float32)])
    x[7, : d // 2] *= 50.0  # one half of the vector much larger than the other: the two scale groups differ
    seed, layer = 0x0DDC_0FFE_E0DD_F00D, 3
    q = tq.quantize(torch.from_numpy(x), bits, seed, layer, rule, format_version=version, side="v", scale_group=64)
    assert q.scales.shape == (x.shape[0], d // 64)
    q32 = tq.quantize(torch.from_numpy(x), bits, seed, layer, rule, format_version=version, side="v")
    assert q32.scales.shape == (x.shape[0], d // 32)
    assert not torch.equal(q.codes, q32.codes)
    out = tq.dequantize(q).numpy()
    for i in range(x.shape[0]):
        codes, scales = fmkv.quantize_vector(x[i], bits, seed=seed, layer=layer, scale_rule=rule,
                                             format_version=version, side="v", scale_group=64)
        np.testing.assert_array_equal(q.codes[i].numpy(), codes, err_msg=f"codes row {i}")
        np.testing.assert_array_equal(q.scales[i].numpy().view(np.uint16), scales.view(np.uint16),
                                      err_msg=f"scales row {i}")
        ref = fmkv.dequantize_vector(codes, scales, bits, seed=seed, layer=layer, format_version=version, side="v",
                                     scale_group=64)
        np.testing.assert_allclose(out[i], ref, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


def test_scale_group_rejected():
    x = torch.randn(4, 64)
    for sg in (16, 48, 128):
        with pytest.raises(ValueError, match=f"scale_group {sg} is not supported"):
            tq.quantize(x, 2, scale_group=sg)

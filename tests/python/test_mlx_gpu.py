"""fmkv.mlx on an MLX GPU: the kernel core through mx.fast.cuda_kernel (MLX's CUDA backend) or
mx.fast.metal_kernel (Apple GPUs), the same launch path for both.

Against the reference backend: pages and fp16 regions bit-exact (storage poisoned first, every byte
compared) for appends in random chunks, every code width, both scale rules, sink/window, f32/f16/bf16
inputs, format versions 2 and 3, scale groups 32 and 64; attention within the bounds of docs/METAL.md (1e-5 relative with float32 queries, 2e-3
float16, 1.2e-2 bfloat16) of the float64 reference, GQA and multi-row causal queries, several
plans (splits x SIMD groups); kernel-detected errors reported by MlxLayer.check. Skips naming MLX's
GPU backends when neither is available (run by tests/python/run_device_mlx.sh on the H200)."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed")

import fmkv  # noqa: E402
import fmkv.mlx as fm  # noqa: E402
from fmkv import reference  # noqa: E402
from fmkv.format import CODE_BITS, FP16_BITS  # noqa: E402

from mlx_cases import CASES, assert_storage_equal, bhld, poison_storage, random_kv, reference_append  # noqa: E402


def _gpu_runtime():
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


RUNTIME = _gpu_runtime()
pytestmark = pytest.mark.skipif(RUNTIME is None, reason="no MLX GPU backend (mx.metal / mx.cuda unavailable): "
                                                        "the kernels run through mx.fast.metal_kernel or cuda_kernel")
ATTN_BOUND = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.2e-2}
EXTRA = [  # more formats on the GPU: every (k, v) width pair of the format at d 128, d 64 / 256 corners
    (128, 8, 32, kb, vb, 64, 0, 0, "lsq", np.float16) for kb in CODE_BITS + (FP16_BITS,) for vb in CODE_BITS
] + [(64, 4, 16, 3, 3, 16, 4, 64, "rms", np.float32), (256, 1, 8, 4, 4, 256, 0, 16, "lsq", "bfloat16")]


@pytest.fixture(autouse=True)
def _gpu_device():
    prev = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(prev)


def _inputs(rng, T, H, d, dtype):
    x = random_kv(rng, T, H, d, np.float32 if dtype == "bfloat16" else dtype)
    if dtype == "bfloat16":
        x = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    a = bhld(x)
    return x, (a.astype(mx.bfloat16) if dtype == "bfloat16" else a)


def _name(c):
    return f"d{c[0]}h{c[1]}q{c[2]}k{c[3]}v{c[4]}P{c[5]}S{c[6]}W{c[7]}{c[8]}-{c[9] if isinstance(c[9], str) else np.dtype(c[9]).name}"


FORMAT3 = [  # format version 3: 3-bit sections in tile blocks (FORMAT.md section 6), the other side unchanged
    (64, 2, 8, 3, 3, 16, 0, 0, "lsq", np.float16), (128, 2, 8, 3, 3, 64, 4, 16, "lsq", np.float32),
    (256, 1, 8, 3, 2, 32, 0, 0, "rms", np.float16), (128, 2, 8, 16, 3, 16, 0, 32, "lsq", np.float16),
    (128, 2, 6, 4, 3, 128, 2, 0, "lsq", "bfloat16"),
    # 5-bit sides (magnitude nibble words + sign plane) next to untiled and tiled ones
    (64, 2, 8, 5, 5, 32, 0, 0, "rms", np.float16), (128, 2, 8, 5, 4, 16, 2, 8, "lsq", np.float32),
    (128, 2, 8, 4, 5, 64, 0, 16, "lsq", "bfloat16"), (128, 2, 6, 5, 3, 16, 0, 0, "lsq", np.float16),
    (64, 2, 4, 3, 5, 16, 1, 0, "rms", np.float16), (256, 1, 8, 16, 5, 16, 0, 32, "lsq", np.float32),
]


SCALE_GROUP64 = [  # scale group 64 (one fp16 scale per 64 rotated coordinates: at d 64 one per vector), formats 2 and 3
    ((64, 2, 8, 2, 2, 16, 0, 0, "lsq", np.float16), 2), ((64, 2, 4, 3, 3, 16, 2, 8, "rms", np.float32), 3),
    ((128, 2, 8, 4, 3, 32, 0, 16, "lsq", np.float16), 3), ((128, 2, 8, 5, 4, 64, 1, 0, "rms", "bfloat16"), 2),
    ((256, 1, 8, 16, 3, 16, 0, 32, "lsq", np.float32), 3), ((128, 2, 6, 3, 3, 16, 0, 0, "lsq", np.float16), 2),
]


@pytest.mark.parametrize("case", CASES + EXTRA, ids=_name)
def test_gpu_append_bit_exact_and_attention(rng, case):
    _append_bit_exact_and_attention(rng, case, 0)


@pytest.mark.parametrize("case", FORMAT3, ids=_name)
def test_gpu_format3_append_bit_exact_and_attention(rng, case):
    _append_bit_exact_and_attention(rng, case, 3)


@pytest.mark.parametrize("case", SCALE_GROUP64, ids=lambda c: _name(c[0]) + f"-fmt{c[1]}")
def test_gpu_scale_group64_append_bit_exact_and_attention(rng, case):
    _append_bit_exact_and_attention(rng, case[0], case[1], scale_group=64)


def _append_bit_exact_and_attention(rng, case, format_version, scale_group=0):
    d, H, HQ, kb, vb, P, S, W, rule, dtype = case
    cfg = fmkv.Config(head_dim=d, num_kv_heads=H, k_bits=kb, v_bits=vb, page_size=P, sink_tokens=S, window_tokens=W,
                      scale_rule=rule, seed=int(rng.integers(0, 2**63)), format_version=format_version,
                      scale_group=scale_group)
    layer_index = int(rng.integers(0, 40))
    T = int(rng.integers(3 * P, 5 * P)) + W
    layer = fm.MlxLayer(cfg, layer=layer_index, max_tokens=T + 8)
    assert layer.runtime == RUNTIME
    poisoned = poison_storage(layer)
    k, kx = _inputs(rng, T, H, d, dtype)
    v, vx = _inputs(rng, T, H, d, dtype)
    cuts = sorted({0, T, *(int(c) for c in rng.integers(1, T, 5))})
    for a, b in zip(cuts, cuts[1:]):
        layer.append(kx[:, :, a:b], vx[:, :, a:b])
    assert_storage_equal(layer, reference_append(layer, poisoned, k, v))
    for R in (1, int(rng.integers(2, 17))):
        q, qx = _inputs(rng, R, HQ, d, dtype)
        ref = reference.attention(cfg, layer_index, k, v, q)
        bound = ATTN_BOUND[dtype if isinstance(dtype, str) else np.dtype(dtype).name]
        for splits, sg in ((None, None), (1, 1), (3, 2), (7, 8)):
            out = layer.attention(qx, splits=splits, simdgroups=sg)
            err = reference.rel_error(np.array(out.astype(mx.float32)), ref)
            assert err <= bound, f"R={R} splits={splits} simdgroups={sg}: rel. error {err:.3g} > {bound}"
    layer.check()


def test_gpu_decode_loop_matches_host(rng):
    """A decode loop (append one token, attend) on the GPU produces the host runtime's pages and,
    within the bound, its outputs; the kernels stay lazy until evaluated."""
    cfg = fmkv.Config(head_dim=128, num_kv_heads=2, k_bits=4, v_bits=4, page_size=16, window_tokens=8)
    gpu = fm.MlxLayer(cfg, max_tokens=80)
    with mx.stream(mx.cpu):
        host = fm.MlxLayer(cfg, max_tokens=80, runtime="host")
    x = random_kv(rng, 60, 2, 128, np.float16)
    q = random_kv(rng, 60, 8, 128, np.float32)
    for t in range(60):
        gpu.append(bhld(x[t:t + 1]), bhld(x[t:t + 1]))
        out = gpu.attention(bhld(q[t:t + 1]))
        with mx.stream(mx.cpu):
            host.append(bhld(x[t:t + 1]), bhld(x[t:t + 1]))
            want = host.attention(bhld(q[t:t + 1]))
        err = reference.rel_error(np.array(out), np.array(want))
        assert err <= 1e-5, f"step {t}: {err:.3g}"
    for a, b in zip(gpu.storage(), host.storage()):
        assert np.array_equal(np.array(a), np.array(b))


def test_gpu_errors_are_reported_by_check(rng):
    cfg = fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16)
    layer = fm.MlxLayer(cfg, max_tokens=64)
    x = bhld(random_kv(rng, 20, 2, 64))
    layer.append(x, x)
    layer.check()
    before = [np.array(a).copy() for a in layer.storage()]
    from fmkv.mlx.gpu import int_array

    table = layer.table
    layer.table = int_array([0, 999, 2, 3], np.int32)  # token 16..31 -> page 999: outside the pool
    layer.append(x[:, :, :1], x[:, :, :1])
    with pytest.raises(fmkv.FmkvError, match="block-table entry"):
        layer.check()
    after = [np.array(a) for a in layer.storage()]  # check() cleared the error; nothing was written
    for a, b in zip(after, before):
        assert np.array_equal(a, b)
    layer.table = table
    # a parameter block that disagrees with the compile-time constants: refused, reported
    wrong = fm.MlxLayer(fmkv.Config(head_dim=64, num_kv_heads=2, k_bits=4, v_bits=3, page_size=16), max_tokens=64)
    wrong.cfg_fields = dict(wrong.cfg_fields, k_bits=3)
    wrong.append(x, x)
    with pytest.raises(fmkv.FmkvError, match="compile-time constants"):
        wrong.check()

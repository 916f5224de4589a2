"""bench/proto/scale_rule_ppl.py (docs/EVAL.md section 12): its scale variants keep LSQ's codes and store the
scale each rule names; V keeps LSQ unless the rule names it."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
import fmkv.torch_quant as tq  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_proto():
    spec = importlib.util.spec_from_file_location("scale_rule_ppl", os.path.join(ROOT, "bench/proto/scale_rule_ppl.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def groups(codes, scales, bits, side="k"):
    lv = tq.decode_levels(codes, bits, side=side).reshape(*codes.shape[:-1], -1, 32)
    return lv * scales.float().unsqueeze(-1)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_variants_keep_codes_and_store_their_scale(bits):
    m = load_proto()
    g = torch.Generator().manual_seed(100 + bits)
    y = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g) * 3
    y[0, :32] = 0.0  # a zero group stays zero under every rule
    codes, s_lsq = tq.quantize_rotated(y, bits, "lsq", side="k")
    yg = y.reshape(64, 4, 32)
    for rule in ("normk", "invk", "tempk", "x1.03"):
        c, s = m.quantize_rotated(y, bits, rule, side="k")
        assert torch.equal(c, codes), rule
        assert s[0, 0].item() == 0, rule
        r = groups(c, s, bits)
        if rule == "normk":  # |y_hat| = |y| per group, to fp16 rounding of the scale
            ratio = r.norm(dim=-1)[1:] / yg.norm(dim=-1)[1:]
            assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
        if rule == "invk":  # <y_hat, y> = |y|^2 per group
            ratio = (r * yg).sum(-1)[1:] / (yg * yg).sum(-1)[1:]
            assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
        if rule == "tempk":
            want = s_lsq.float() / (1 - m.LLOYD_MAX_DISTORTION[bits]) ** 0.5
            assert torch.allclose(s.float(), want, rtol=1e-3)
        if rule == "x1.03":
            assert torch.allclose(s.float(), s_lsq.float() * 1.03, rtol=1e-3)
        # LSQ <= norm <= inv per group (Cauchy-Schwarz), the inflation the variants are about
    s_norm = m.quantize_rotated(y, bits, "normk", side="k")[1].float()
    s_inv = m.quantize_rotated(y, bits, "invk", side="k")[1].float()
    assert bool((s_lsq.float() <= s_norm * (1 + 1e-3)).all()) and bool((s_norm <= s_inv * (1 + 1e-3)).all())
    assert bool((s_norm > s_lsq.float()).any())


def test_v_side_keeps_lsq_unless_named():
    m = load_proto()
    y = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    _, s_lsq = tq.quantize_rotated(y, 3, "lsq", side="v")
    for rule in ("normk", "invk", "tempk", "x1.05"):
        assert torch.equal(m.quantize_rotated(y, 3, rule, side="v")[1], s_lsq), rule
    assert not torch.equal(m.quantize_rotated(y, 3, "normkv", side="v")[1], s_lsq)


def test_factor_variant_names():
    m = load_proto()
    assert m._is_factor("x1.02") and not m._is_factor("x") and not m._is_factor("xabc") and not m._is_factor("x-1")

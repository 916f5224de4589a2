"""fmkv.eval.plan: the exact allocation (against brute force), per-layer quantizers, and the plan command end to
end on a tiny random-weight Llama (the SmolLM2 runs are in docs/EVAL.md)."""
import itertools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
fmkv = pytest.importorskip("fmkv", reason="the fmkv binding is not installed")
from fmkv.eval import plan as PL  # noqa: E402
from fmkv.eval.quantizers import parse_config  # noqa: E402


def _brute(sk, sv, km, vm, d, budget, w, ctx):
    best = None
    n = sk.shape[0]
    opts = [(kb, vb) for kb in km for vb in vm]
    for combo in itertools.product(range(len(opts)), repeat=n):
        bits = [opts[c] for c in combo]
        q = sum(PL.side_bytes(d, kb) + PL.side_bytes(d, vb) for kb, vb in bits) / n
        b = (q * (ctx - w) + 4.0 * d * w) / ctx
        if b > budget + 1e-9:
            continue
        val = sum(sk[i, km.index(kb)] + sv[i, vm.index(vb)] for i, (kb, vb) in enumerate(bits))
        if best is None or val < best[0] - 1e-12:
            best = (val, bits, b)
    return best


@pytest.mark.parametrize("trial", range(6))
def test_allocation_is_the_exact_optimum(trial):
    rng = np.random.default_rng()  # fresh inputs every run
    km, vm, n, d, ctx = [2, 3, 4, 16], [2, 3, 4], 4, 64, 2048
    # KLD falls with width; 16 (fp16) costs nothing
    sk = np.sort(rng.uniform(0, 1, (n, 4)), axis=1)[:, ::-1].copy()
    sk[:, 3] = 0.0
    sv = np.sort(rng.uniform(0, 1, (n, 3)), axis=1)[:, ::-1].copy()
    w = int(rng.choice([0, 64]))
    budget = float(rng.uniform(45, 120))
    got = PL.allocate(sk, sv, km, vm, d, budget, w, ctx)
    ref = _brute(sk, sv, km, vm, d, budget, w, ctx)
    if ref is None:
        assert got is None
        return
    bits, pred, nbytes = got
    assert nbytes <= budget + 1e-9
    assert pred == pytest.approx(ref[0], abs=1e-9)
    assert pred == pytest.approx(sum(sk[i, km.index(k)] + sv[i, vm.index(v)] for i, (k, v) in enumerate(bits)))


def test_nothing_fits_and_window_beyond_ctx():
    z = np.zeros((3, 1))
    assert PL.allocate(z, z, [2], [2], 64, 10.0, 0, 2048) is None  # 40 B at least
    assert PL.allocate(z, z, [2], [2], 64, 500.0, 4096, 2048) is None


def test_planned_quantizer_bytes_and_widths():
    bits = [(4, 4), (3, 2), (16, 3)]
    q = PL.planned_quantizer("p", bits, 0)
    q.num_layers = 3
    d = 64
    expect = sum(PL.side_bytes(d, k) + PL.side_bytes(d, v) for k, v in bits) / 3
    assert q.bytes_per_token_per_head(d) == pytest.approx(expect)
    x = torch.randn(1, 2, 40, d)
    # layer 1 of the plan quantizes exactly as uniform k3v2 does at that layer
    u = parse_config("k3v2")
    assert torch.equal(q.quant_k(x, 1), u.quant_k(x, 1)) and torch.equal(q.quant_v(x, 1), u.quant_v(x, 1))
    assert torch.equal(q.quant_k(x, 2), x.half().float())  # K in fp16 at layer 2


def test_plan_command_end_to_end(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from fmkv.eval import cli
    from fmkv.eval import ppl as P

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(P, "load_model", lambda name, device="cpu": (model, None))
    ids = torch.randint(0, 300, (64 * 5,), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    out = tmp_path / "plan.jsonl"
    rc = cli.main(["plan", "--model", "tiny", "--ids", str(tmp_path / "ids.pt"), "--ctx", "64",
                   "--calib-tokens", "128", "--check-tokens", "192", "--budgets", "60,80", "--windows", "0,8",
                   "--out", str(out), "--plot", str(tmp_path / "plan.png"), "--no-progress", "--commit", "test"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    plans = [r for r in rows if r["suite"] == "plan"]
    assert [p["budget"] for p in plans] == [60.0, 80.0]
    for p in plans:
        assert p["bytes_per_token_per_head"] <= p["budget"] + 1e-6
        assert len(p["layer_bits"]) == 3 and p["window_tokens"] in (0, 8)
        assert p["check"]["tokens"] == 3 * 63 and p["calib_windows"] == [0, 2] and p["check_windows"] == [2, 5]
        assert p["check"]["kld"] >= 0 and "best_uniform" in p
    sens = [r for r in rows if r["suite"] == "plan-sensitivity"]
    assert len(sens) == 2 * (3 + 3) and all(len(r["kld_per_layer"]) == 3 for r in sens)
    assert (tmp_path / "plan.png").stat().st_size > 0
    # a larger budget never predicts a worse plan
    assert plans[1]["predicted_kld"] <= plans[0]["predicted_kld"] + 1e-12


def test_plan_rejects_bad_arguments(capsys):
    from fmkv.eval import cli

    for argv, msg in ((["plan", "--budgets", "0"], "positive"), (["plan", "--k-bits", "5"], "k width 5"),
                      (["plan", "--windows", "-3"], "negative"), (["plan", "--budgets", "x"], "not a comma")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert msg in capsys.readouterr().err


def test_load_plans_reads_plan_rows_only(tmp_path):
    from fmkv.eval.plan import load_plans
    bits = [[3, 2], [4, 3], [16, 4]]
    rows = [{"suite": "plan-sensitivity", "config": "k3v3"},
            {"suite": "plan", "config": "plan-56B", "window_tokens": 64, "format_version": 3,
             "layer_bits": json.dumps(bits)},
            {"suite": "plan-check", "config": "fp16"},
            {"suite": "plan", "config": "plan-91B", "window_tokens": 128, "layer_bits": [[4, 4]] * 3}]
    p = tmp_path / "plan.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    qs = load_plans(str(p), num_layers=3)
    assert [q.name for q in qs] == ["plan-56B", "plan-91B"]
    assert qs[0].layer_bits == ((3, 2), (4, 3), (16, 4)) and qs[0].residual == 64 and qs[0].format_version == 3
    assert qs[1].layer_bits == ((4, 4),) * 3 and qs[1].residual == 128
    # the plan's bytes: its widths per layer, the window amortised as for any config
    assert qs[1].bytes_per_token_per_head(64) == parse_config("k4v4").bytes_per_token_per_head(64)
    with pytest.raises(ValueError, match="plan-56B' has 3 layers, the model 30"):
        load_plans(str(p), num_layers=30)
    q = tmp_path / "none.jsonl"
    q.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="no plan rows"):
        load_plans(str(q))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"suite": "plan", "config": "plan-x", "layer_bits": [[4]]}) + "\n")
    with pytest.raises(ValueError, match="no \\(k_bits, v_bits\\) pair per layer"):
        load_plans(str(bad))

"""fmkv.eval.plan: the exact allocation (against brute force), per-layer quantizers, and the plan command end to
end on a tiny random-weight Llama (the SmolLM2 runs are in docs/EVAL.md)."""
import itertools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
fmkv = pytest.importorskip("fmkv", reason="the fmkv binding is not installed")
from fmkv import format as fmt  # noqa: E402
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
    from fmkv.eval import cli

    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    out = tmp_path / "plan.jsonl"
    rc = cli.main(argv + ["--budgets", "60,80", "--windows", "0,8", "--out", str(out), "--plot", str(tmp_path / "plan.png")])
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
    # per window: one row per K code width and per V code width (the default menus: every width of the format)
    assert len(sens) == 2 * 2 * len(fmt.CODE_BITS) and all(len(r["kld_per_layer"]) == 3 for r in sens)
    assert (tmp_path / "plan.png").stat().st_size > 0
    # a larger budget never predicts a worse plan
    assert plans[1]["predicted_kld"] <= plans[0]["predicted_kld"] + 1e-12


def test_plan_rejects_bad_arguments(capsys):
    from fmkv.eval import cli

    for argv, msg in ((["plan", "--budgets", "0"], "positive"), (["plan", "--k-bits", "6"], "k width 6"),
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


def test_budget_from_memory():
    # 30 layers x 3 kv heads, 32k tokens, 2 sequences: 1 GiB is 2^30 / (32768 * 90 * 2) B per token per kv head
    assert PL.budget_from_memory(2 ** 30, 32768, 30, 3, 2) == pytest.approx(2 ** 30 / (32768 * 90 * 2))
    for bad in ((0, 10, 1, 1), (1e9, 0, 1, 1), (1e9, 10, -1, 1), (float("nan"), 10, 1, 1), (1e9, 10, 1, 1, 0)):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            PL.budget_from_memory(*bad)


def test_per_head_quantizer_matches_uniform_per_head():
    d = 64
    heads = [[(4, 4), (3, 2), (16, 3)], [(2, 2), (2, 2), (4, 16)]]
    q = PL.planned_quantizer("ph", [], 0, head_bits=heads)
    q.num_layers = 2
    # the per-layer maxima are what a one-width-per-layer cache would need
    assert q.layer_bits == ((16, 4), (4, 16))
    pairs = [p for layer in heads for p in layer]
    assert q.bytes_per_token_per_head(d) == pytest.approx(
        sum(PL.side_bytes(d, k) + PL.side_bytes(d, v) for k, v in pairs) / len(pairs))
    x = torch.randn(2, 3, 40, d)
    for layer in range(2):
        k, v = q.quant_k(x, layer), q.quant_v(x, layer)
        for h, (kb, vb) in enumerate(heads[layer]):
            uk = x[:, h:h + 1].half().float() if kb == 16 else parse_config(f"k{kb}v2").quant_k(x[:, h:h + 1], layer)
            uv = x[:, h:h + 1].half().float() if vb == 16 else parse_config(f"k2v{vb}").quant_v(x[:, h:h + 1], layer)
            assert torch.equal(k[:, h:h + 1], uk) and torch.equal(v[:, h:h + 1], uv)
    with pytest.raises(ValueError, match="widths for 3 kv heads, the tensor 2"):
        q.quant_k(torch.randn(1, 2, 8, d), 0)


def test_sensitivity_configs_per_head():
    cfg = PL.sensitivity_configs(2, [3, 16], [2], PL.fp16_regions([0, 64]), kv_heads=3)
    assert len(cfg) == 2 * 2 * 2 * 3  # windows x sides (one width < 16 each) x layers x heads
    assert cfg["sens-w64-k3-L1-H2"] == ((64, 0), "k", 1, 2, 3)
    q = PL.sensitivity_quantizer("s", 2, 3, (64, 0), "v", 1, 2, 2)
    assert q.head_bits[1][2] == (16, 2) and all(p == (16, 16) for i, l in enumerate(q.head_bits)
                                                  for h, p in enumerate(l) if (i, h) != (1, 2))
    assert q.residual == 64 and q.sinks == 0
    assert PL.sensitivity_configs(1, [2], [2], [(0, 0)])["sens-w0-k2-L0"] == ((0, 0), "k", 0, -1, 2)
    # sinks: a region per (window, sinks) pair, named by both
    assert PL.fp16_regions([0, 64], [0, 4]) == [(0, 0), (0, 4), (64, 0), (64, 4)]
    cfg = PL.sensitivity_configs(1, [2], [2], PL.fp16_regions([0], [0, 4]))
    assert cfg["sens-w0-s4-v2-L0"] == ((0, 4), "v", 0, -1, 2) and len(cfg) == 4
    q = PL.sensitivity_quantizer("s", 1, 1, (0, 4), "k", 0, -1, 3)
    assert q.sinks == 4 and q.residual == 0 and q.options["sink_tokens"] == 4


def test_allocation_counts_sinks_as_fp16_tokens():
    """Sinks cost 4 d bytes each, amortised over ctx, as the window does: a plan with W window and S sink tokens
    has the bytes of one with a window of W + S."""
    rng = np.random.default_rng(5)
    sk, sv = rng.random((4, 4)), rng.random((4, 3))
    km, vm = [2, 3, 4, 16], [2, 3, 4]
    a = PL.allocate(sk, sv, km, vm, 64, 60.0, 16, 2048, sinks=4)
    b = PL.allocate(sk, sv, km, vm, 64, 60.0, 20, 2048)
    assert a == b and a[2] <= 60.0
    assert PL.allocate(sk, sv, km, vm, 64, 500.0, 2040, 2048, sinks=8) is None  # no compressed token left
    names = dict(PL.uniform_candidates([3], [3], PL.fp16_regions([0, 32], [0, 4]), 64, 60.0, 2048))
    assert set(names) == {"k3v3", "k3v3-s4", "k3v3-w32", "k3v3-w32-s4"}
    assert names["k3v3-s4"] == pytest.approx((56 * 2044 + 256 * 4) / 2048)


def _tiny_plan_setup(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from fmkv.eval import ppl as P

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(P, "load_model", lambda name, device="cpu": (model, None))
    ids = torch.randint(0, 300, (64 * 5,), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    return ["plan", "--model", "tiny", "--ids", str(tmp_path / "ids.pt"), "--ctx", "64", "--calib-tokens", "128",
            "--check-tokens", "192", "--no-progress", "--commit", "test", "--plot", ""]


def test_plan_per_head_and_memory_end_to_end(tmp_path, monkeypatch):
    from fmkv.eval import cli

    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    layer_out = tmp_path / "layer.jsonl"
    assert cli.main(argv + ["--budgets", "70", "--windows", "0", "--out", str(layer_out)]) == 0
    out = tmp_path / "heads.jsonl"
    # 3 layers x 2 kv heads x 1024 tokens x 2 sequences at 70 B per token per kv head
    mem = 3 * 2 * 1024 * 2 * 70
    assert cli.main(argv + ["--per-head", "--memory", f"{mem}B", "--context", "1024", "--batch", "2",
                            "--windows", "0", "--plans", str(layer_out), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    sens = [r for r in rows if r["suite"] == "plan-sensitivity"]
    assert len(sens) == 2 * len(fmt.CODE_BITS) and all(len(r["kld_per_head"]) == 3 and len(r["kld_per_head"][0]) == 2 for r in sens)
    (plan,) = [r for r in rows if r["suite"] == "plan"]
    assert plan["config"] == "plan-70B-per-head" and plan["budget"] == pytest.approx(70.0)
    assert plan["memory_bytes"] == mem and plan["context"] == 1024 and plan["batch"] == 2
    assert len(plan["head_bits"]) == 3 and all(len(layer) == 2 for layer in plan["head_bits"])
    assert plan["bytes_per_token_per_head"] <= 70.0 + 1e-6
    # the per-head allocation is exact over (layer, head) units: its prediction is the sum of its units' entries
    sk = {r["bits"]: r["kld_per_head"] for r in sens if r["side"] == "k"}
    sv = {r["bits"]: r["kld_per_head"] for r in sens if r["side"] == "v"}
    pred = sum((0.0 if kb == 16 else sk[kb][i][h]) + sv[vb][i][h]
               for i, layer in enumerate(plan["head_bits"]) for h, (kb, vb) in enumerate(layer))
    assert plan["predicted_kld"] == pytest.approx(pred, abs=1e-5)
    checked = {r["config"] for r in rows if r["suite"] == "plan-check"}
    assert {"fp16", "plan-70B", "plan-70B-per-head"} <= checked  # the stored per-layer plan checked beside it
    # the plan file's per-head plan loads and evaluates as stored
    (q,) = [q for q in PL.load_plans(str(out), num_layers=3)]
    assert [[list(p) for p in layer] for layer in q.head_bits] == plan["head_bits"]


def test_plan_memory_argument_errors(capsys):
    from fmkv.eval import cli

    for argv, msg in ((["plan", "--memory", "1GiB"], "--memory needs --context"),
                      (["plan", "--memory", "1GiB", "--context", "64", "--budgets", "60"], "pass one of them"),
                      (["plan", "--context", "4096"], "without --memory pass --budgets"),
                      (["plan", "--memory", "2XB", "--context", "64"], "is not a size"),
                      (["plan", "--memory", "0GiB", "--context", "64"], "must be positive"),
                      (["plan", "--memory", "1GiB", "--context", "64", "--windows", "64"], "do not fit --context"),
                      (["plan", "--memory", "1GiB", "--context", "64", "--windows", "60", "--sinks", "0,4"],
                       "--sinks 4 do not fit --context")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert msg in capsys.readouterr().err


def test_load_plans_rejects_ragged_head_bits(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"suite": "plan", "config": "p", "head_bits": [[[4, 4], [3, 3]], [[4, 4]]]}) + "\n")
    with pytest.raises(ValueError, match="pair per kv head"):
        PL.load_plans(str(bad))


@pytest.mark.parametrize("max_groups", [1, 2])
def test_allocation_with_at_most_g_width_groups_per_layer_is_exact(max_groups):
    rng = np.random.default_rng()  # fresh inputs every run
    km, vm, layers, heads, d, ctx = [2, 3, 16], [2, 4], 2, 3, 64, 2048
    n = layers * heads
    sk = np.sort(rng.uniform(0, 1, (n, 3)), axis=1)[:, ::-1].copy()
    sk[:, 2] = 0.0
    sv = np.sort(rng.uniform(0, 1, (n, 2)), axis=1)[:, ::-1].copy()
    budget = float(rng.uniform(50, 130))
    got = PL.allocate(sk, sv, km, vm, d, budget, 0, ctx, heads=heads, max_groups=max_groups)
    opts = [(kb, vb) for kb in km for vb in vm]
    best = None
    for combo in itertools.product(range(len(opts)), repeat=n):
        bits = [opts[c] for c in combo]
        if any(len(set(bits[L * heads:(L + 1) * heads])) > max_groups for L in range(layers)):
            continue
        if sum(PL.side_bytes(d, k) + PL.side_bytes(d, v) for k, v in bits) / n > budget + 1e-9:
            continue
        val = sum(sk[u, km.index(k)] + sv[u, vm.index(v)] for u, (k, v) in enumerate(bits))
        if best is None or val < best - 1e-12:
            best = val
    if best is None:
        assert got is None
        return
    bits, pred, nbytes = got
    assert pred == pytest.approx(best, abs=1e-9) and nbytes <= budget + 1e-9
    assert all(len(set(bits[L * heads:(L + 1) * heads])) <= max_groups for L in range(layers))
    # no limit (max_groups >= heads) is the per-unit optimum, never worse
    free = PL.allocate(sk, sv, km, vm, d, budget, 0, ctx, heads=heads, max_groups=0)
    assert free[1] <= pred + 1e-12


def test_replan_from_stored_sensitivity(tmp_path, monkeypatch):
    from fmkv.eval import cli

    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    first = tmp_path / "first.jsonl"
    assert cli.main(argv + ["--per-head", "--budgets", "70", "--windows", "0,8", "--out", str(first)]) == 0
    again = tmp_path / "again.jsonl"
    assert cli.main(argv + ["--per-head", "--max-groups", "1", "--budgets", "60,70", "--windows", "0,8",
                            "--from-sensitivity", str(first), "--out", str(again)]) == 0
    r1 = [json.loads(line) for line in first.read_text().splitlines()]
    r2 = [json.loads(line) for line in again.read_text().splitlines()]
    s1 = {(r["window_tokens"], r["side"], r["bits"]): r["kld_per_head"] for r in r1 if r["suite"] == "plan-sensitivity"}
    s2 = {(r["window_tokens"], r["side"], r["bits"]): r["kld_per_head"] for r in r2 if r["suite"] == "plan-sensitivity"}
    assert s1 == s2  # read, not measured again
    p1 = next(r for r in r1 if r["suite"] == "plan")
    plans = [r for r in r2 if r["suite"] == "plan"]
    assert [p["config"] for p in plans] == ["plan-60B-per-head-g1", "plan-70B-per-head-g1"]
    assert all(p["groups_per_layer"] == [1, 1, 1] and p["max_groups"] == 1 for p in plans)
    # one width per layer: never better (the stored sensitivities are rounded to 7 decimals)
    assert plans[1]["predicted_kld"] >= p1["predicted_kld"] - 1e-5
    assert plans[1]["check"]["tokens"] == p1["check"]["tokens"]  # the same held-out windows
    # what the stored rows cannot answer is refused, naming it
    for extra, msg in ((["--per-head", "--windows", "0,16"], "no sensitivity of K at 2 bits with window 16"),
                       (["--per-head", "--windows", "0", "--calib-tokens", "64"], "calibrated on"),
                       (["--windows", "0"], "the rows are per kv head; pass --per-head")):
        out = tmp_path / "x.jsonl"
        assert cli.main(argv + ["--budgets", "70", "--from-sensitivity", str(first), "--out", str(out)] + extra) == 2


def test_max_groups_needs_per_head(capsys):
    from fmkv.eval import cli

    with pytest.raises(SystemExit):
        cli.main(["plan", "--max-groups", "2"])
    assert "pass --per-head" in capsys.readouterr().err


def test_model_label_by_key_name_or_content(tmp_path, monkeypatch):
    """Result rows name a known model whether it was loaded by key, by its file, or from a copy under another name
    (by MD5); anything else keeps the name it was given."""
    import hashlib

    from fmkv.eval import ppl as P

    blob = tmp_path / "copy.gguf"
    blob.write_bytes(b"not really a model" * 1000)
    md5 = hashlib.md5(blob.read_bytes()).hexdigest()
    monkeypatch.setitem(P.MODELS, "tiny-model", ("no_package", "tiny.gguf", md5))
    assert P.model_label("tiny-model") == "tiny-model"
    assert P.model_label("/somewhere/tiny.gguf") == "tiny-model"
    assert P.model_label(str(blob)) == "tiny-model"
    other = tmp_path / "other.gguf"
    other.write_bytes(b"something else")
    assert P.model_label(str(other)) == str(other)
    assert P.model_label("/no/such/file.gguf") == "/no/such/file.gguf"


def test_plan_with_key_offset(tmp_path, monkeypatch):
    """--key-offset: the sensitivity is measured with the offset (it changes the rows), the plan and its uniform
    configs carry it, and stored rows are used only with the same setting."""
    from fmkv.eval import cli

    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    plain, ko = tmp_path / "plain.jsonl", tmp_path / "ko.jsonl"
    common = ["--per-head", "--budgets", "60", "--windows", "0", "--uniform-per-budget", "2"]
    assert cli.main(argv + common + ["--out", str(plain), "--plot", ""]) == 0
    assert cli.main(argv + common + ["--key-offset", "--out", str(ko), "--plot", ""]) == 0
    r0 = [json.loads(line) for line in plain.read_text().splitlines()]
    r1 = [json.loads(line) for line in ko.read_text().splitlines()]
    s0 = [r for r in r0 if r["suite"] == "plan-sensitivity"]
    s1 = [r for r in r1 if r["suite"] == "plan-sensitivity"]
    assert all(r.get("key_offset") for r in s1) and not any("key_offset" in r for r in s0)
    assert [r["kld_per_head"] for r in s0] != [r["kld_per_head"] for r in s1]  # measured with the offset
    plan = next(r for r in r1 if r["suite"] == "plan")
    assert plan["config"] == "plan-60B-per-head-ko" and plan["key_offset"] is True
    assert plan["uniform_compared"] and all(u.endswith("-km") for u in plan["uniform_compared"])
    checks = {r["config"]: r for r in r1 if r["suite"] == "plan-check"}
    assert checks[plan["config"]]["options"]["key_offset"] is True
    q = PL.load_plans(str(ko))[0]
    assert q.key_mean and q.options["key_offset"] and q.head_bits
    assert not PL.load_plans(str(plain))[0].key_mean
    # re-planning reads only rows of the same setting
    again = tmp_path / "again.jsonl"
    assert cli.main(argv + common + ["--key-offset", "--from-sensitivity", str(ko), "--out", str(again),
                                     "--plot", ""]) == 0
    r2 = [json.loads(line) for line in again.read_text().splitlines()]
    assert [r["kld_per_head"] for r in r2 if r["suite"] == "plan-sensitivity"] == [r["kld_per_head"] for r in s1]
    cfg = PL.sensitivity_configs(3, [2, 3, 4, 16], [2, 3, 4], [(0, 0)], 2)
    with pytest.raises(ValueError, match="measured without the key offset"):
        PL.load_sensitivity(str(plain), cfg, [2, 3, 4, 16], [2, 3, 4], 6, 126, key_offset=True)
    with pytest.raises(ValueError, match="measured with the key offset"):
        PL.load_sensitivity(str(ko), cfg, [2, 3, 4, 16], [2, 3, 4], 6, 126)


def test_plan_chooses_sinks_from_the_menu(tmp_path, monkeypatch):
    """--sinks 0,4: sensitivities per (window, sinks) region, the plan's sinks in its row and its quantizer, the
    uniform configs of both regions compared; rows without sink_tokens (older files) read as no sinks."""
    from fmkv.eval import cli

    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    out = tmp_path / "sinks.jsonl"
    assert cli.main(argv + ["--budgets", "60", "--windows", "0", "--sinks", "0,4", "--uniform-per-budget", "4",
                            "--key-offset", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    sens = [r for r in rows if r["suite"] == "plan-sensitivity"]
    assert sorted({r["sink_tokens"] for r in sens}) == [0, 4] and len(sens) == 2 * 2 * len(fmt.CODE_BITS)
    assert sens[0]["kld_per_layer"] != next(r for r in sens if r["sink_tokens"] == 4 and r["side"] == sens[0]["side"]
                                            and r["bits"] == sens[0]["bits"])["kld_per_layer"]
    plan = next(r for r in rows if r["suite"] == "plan")
    assert plan["sink_tokens"] in (0, 4) and plan["bytes_per_token_per_head"] <= 60.0
    assert plan["config"] == "plan-60B" + ("-s4" if plan["sink_tokens"] else "") + "-ko"
    assert any(u.endswith("-s4-km") for u in plan["uniform_compared"])
    q = PL.load_plans(str(out))[0]
    assert q.sinks == plan["sink_tokens"] and q.options["sink_tokens"] == plan["sink_tokens"]
    # an older sensitivity file (no sink_tokens) serves a menu without sinks
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "sink_tokens"}) + "\n"
                           for r in rows if r.get("sink_tokens", 0) == 0))
    cfg = PL.sensitivity_configs(3, [2, 3, 4, 16], [2, 3, 4], [(0, 0)])
    got, n = PL.load_sensitivity(str(old), cfg, [2, 3, 4, 16], [2, 3, 4], 3, 126, key_offset=True)
    assert n == 126 and set(got) == {((0, 0), "k"), ((0, 0), "v")}


def test_plan_with_scale_group_64(tmp_path, monkeypatch):
    """--scale-group 64: bytes of one scale per 64 coordinates (36 B for k2v2 at d = 64, a budget scale group 32
    cannot meet), sensitivities measured with it (they change), plans and uniform configs carry it, stored rows are
    used only with the same scale group, and the cache options of a -g64 name pass it on."""
    from fmkv.eval import cli

    assert PL.side_bytes(64, 2, 64) == 18 and PL.side_bytes(64, 2) == 20 and PL.side_bytes(64, 16, 64) == 128
    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    plain, sg = tmp_path / "plain.jsonl", tmp_path / "sg.jsonl"
    common = ["--per-head", "--windows", "0", "--uniform-per-budget", "2", "--k-bits", "2,3", "--v-bits", "2,3"]
    assert cli.main(argv + common + ["--budgets", "44", "--out", str(plain)]) == 0
    assert cli.main(argv + common + ["--budgets", "36,44", "--scale-group", "64", "--out", str(sg)]) == 0
    r0 = [json.loads(line) for line in plain.read_text().splitlines()]
    r1 = [json.loads(line) for line in sg.read_text().splitlines()]
    s0 = [r for r in r0 if r["suite"] == "plan-sensitivity"]
    s1 = [r for r in r1 if r["suite"] == "plan-sensitivity"]
    assert all(r.get("scale_group") == 64 for r in s1) and not any("scale_group" in r for r in s0)
    assert [r["kld_per_head"] for r in s0] != [r["kld_per_head"] for r in s1]
    plans = {r["config"]: r for r in r1 if r["suite"] == "plan"}
    assert set(plans) == {"plan-36B-per-head-sg64", "plan-44B-per-head-sg64"}
    p36 = plans["plan-36B-per-head-sg64"]
    assert p36["scale_group"] == 64 and p36["bytes_per_token_per_head"] == 36.0
    assert all(tuple(p) == (2, 2) for layer in p36["head_bits"] for p in layer)
    assert "k2v2-g64" in p36["uniform_compared"]
    assert not [r for r in r0 if r["suite"] == "plan" and r["budget"] < 40]  # 40 B is k2v2's least with 32
    q = PL.load_plans(str(sg))[0]
    assert q.scale_group == 64 and q.options["scale_group"] == 64
    assert q.bytes_per_token_per_head(64) == 36.0
    cfg = PL.sensitivity_configs(3, [2, 3], [2, 3], [(0, 0)], 2)
    with pytest.raises(ValueError, match="another scale group"):
        PL.load_sensitivity(str(plain), cfg, [2, 3], [2, 3], 6, 126, scale_group=64)
    got, _ = PL.load_sensitivity(str(sg), cfg, [2, 3], [2, 3], 6, 126, scale_group=64)
    assert got
    assert cli.generate_cache_options("k2v2-g64-km")["scale_group"] == 64
    assert parse_config("k3v2-g64").bytes_per_token_per_head(64) == 44.0
    with pytest.raises(ValueError, match="scale group 48 is not supported"):
        parse_config("k3v3-g48")


@pytest.mark.parametrize("trial", range(4))
def test_allocation_within_backend_pairs_is_the_exact_optimum(trial):
    """allocate(pairs=...) is the exact optimum over only those (k_bits, v_bits) pairs (a backend's compiled grid)."""
    rng = np.random.default_rng()
    km, vm, n, d, ctx = [2, 3, 4, 16], [2, 3, 4], 3, 64, 2048
    sk = np.sort(rng.uniform(0, 1, (n, 4)), axis=1)[:, ::-1].copy()
    sk[:, 3] = 0.0
    sv = np.sort(rng.uniform(0, 1, (n, 3)), axis=1)[:, ::-1].copy()
    every = [(kb, vb) for kb in km for vb in vm]
    pairs = [every[i] for i in sorted(rng.choice(len(every), size=5, replace=False))]
    budget = float(rng.uniform(50, 120))
    got = PL.allocate(sk, sv, km, vm, d, budget, 0, ctx, pairs=pairs)
    best = None
    for combo in itertools.product(pairs, repeat=n):
        q = sum(PL.side_bytes(d, kb) + PL.side_bytes(d, vb) for kb, vb in combo) / n
        if q > budget + 1e-9:
            continue
        val = sum(sk[i, km.index(kb)] + sv[i, vm.index(vb)] for i, (kb, vb) in enumerate(combo))
        best = val if best is None else min(best, val)
    if best is None:
        assert got is None
        return
    bits, pred, nbytes = got
    assert set(bits) <= set(pairs) and nbytes <= budget + 1e-9
    assert pred == pytest.approx(best, abs=1e-9)
    assert PL.allocate(sk, sv, km, vm, d, budget, 0, ctx, pairs=[]) is None
    names = {nm for nm, _ in PL.uniform_candidates(km, vm, [(0, 0)], d, 1000.0, ctx, pairs=pairs)}
    assert names == {f"k{kb}v{vb}" for kb, vb in pairs}


def test_attention_pairs_of_the_host_backends():
    """The reference and CPU backends attend every pair of the menus; a backend that cannot run the head_dim at all
    is an error, not an empty menu."""
    km, vm = list(fmt.CODE_BITS) + [16], list(fmt.CODE_BITS)
    for backend in ("ref", "cpu"):
        ok, refused, why = PL.attention_pairs(backend, 64, km, vm)
        assert ok == [(kb, vb) for kb in km for vb in vm] and refused == [] and why == ""
    c = fmkv.Config(head_dim=64, k_bits=5, v_bits=2, format_version=3, scale_group=64)
    assert fmkv.attention_supported("cpu", c) and fmkv.attention_supported("ref", c)
    with pytest.raises(fmkv.FmkvError, match="unknown backend"):
        fmkv.check_attention("tpu", c)
    if not fmkv.backends()["metal"]["available"]:
        with pytest.raises(ValueError, match="backend metal"):
            PL.attention_pairs("metal", 64, km, vm)
        assert not fmkv.attention_supported("metal", c)


def test_plan_keeps_to_the_backend_pairs(tmp_path, monkeypatch, capsys):
    """--backend: the plan and the uniform configs beside it use only the pairs whose attention the backend has (here
    a CPU backend made to refuse every pair but k4v4, k3v3 and k2v2, as a CUDA build's grid refuses pairs); the plan
    row names the backend and the refused pairs; a backend without a device is refused by name."""
    from fmkv.eval import cli

    argv = _tiny_plan_setup(tmp_path, monkeypatch)
    real = fmkv.check_attention
    grid = {(4, 4), (3, 3), (2, 2)}

    def grid_only(backend, config):
        real(backend, config)
        if backend == "cpu" and (config.k_bits, config.v_bits) not in grid:
            raise fmkv.FmkvError(f"cpu attention: k{config.k_bits}v{config.v_bits} is not compiled into this build")

    monkeypatch.setattr(fmkv, "check_attention", grid_only)
    out = tmp_path / "plan.jsonl"
    assert cli.main(argv + ["--budgets", "60,90", "--windows", "0", "--backend", "cpu", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "backend cpu: planning with the 3 pairs" in err and "without k2v3" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    plans = [r for r in rows if r["suite"] == "plan"]
    assert len(plans) == 2
    for p in plans:
        assert p["backend"] == "cpu" and {tuple(b) for b in p["layer_bits"]} <= grid
        assert len(p["pairs_refused"]) == len(fmt.CODE_BITS) * (len(fmt.CODE_BITS) + 1) - 3
        assert all(u.split("-")[0] in {"k4v4", "k3v3", "k2v2"} for u in p["uniform_compared"])
    # the default on a CPU device: the host backend the torch ops use there, which attends every pair
    monkeypatch.setattr(fmkv, "check_attention", real)
    assert cli.main(argv + ["--budgets", "60", "--windows", "0", "--out", str(out)]) == 0
    (p,) = [r for r in map(json.loads, out.read_text().splitlines()) if r["suite"] == "plan"]
    assert p["backend"] == fmkv.default_backend() and "pairs_refused" not in p
    if not fmkv.backends()["metal"]["available"]:
        assert cli.main(argv + ["--budgets", "60", "--backend", "metal", "--out", str(out)]) == 2
        assert "--backend: backend metal" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--backend", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err

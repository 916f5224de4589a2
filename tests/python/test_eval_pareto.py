"""fmkv-eval pareto: the front, the per-budget winner and the CLI's files and errors, on fresh random rows
checked against a brute-force rule, plus hand-made cases whose answer is known."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fmkv.eval import pareto as PA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row(config, nbytes, ratio, kld, kind=None, suite="ppl", tokens=131008, **extra):
    kind = kind or ("fmkv" if re.match(r"k\d+v\d+", config) else config.split("-")[0])
    return {"suite": suite, "model": "m", "text": "t", "ctx": 2048, "tokens": tokens, "config": config,
            "bytes_per_token_per_head": nbytes, "ppl_ratio": ratio, "kld": kld,
            "options": {"kind": kind, **extra}}


HAND = [row("fp16", 256.0, 1.0, 0.0), row("k4v4", 72, 1.048, 0.043), row("k3v3", 56, 1.215, 0.18),
        row("k2v2", 40, 2.6, 0.9), row("k4v4-w128", 83.5, 1.0058, 0.0052), row("kivi-4", 91, 1.0023, 0.0045),
        row("turbo-3", 52, 1.279, 0.23), row("turbo-2", 36, 3.16, 1.09), row("quanto-int4", 72, 1.11, 0.099),
        row("fp8", 128, 1.0098, 0.0091)]


def test_front_hand_case():
    fr = [r["config"] for r in PA.front([r for r in HAND if r["config"] != "fp16"], "ppl_ratio")]
    # quanto-int4 (same bytes as k4v4, worse) and fp8 (more bytes than kivi-4, worse) are dominated
    assert fr == ["turbo-2", "k2v2", "turbo-3", "k3v3", "k4v4", "k4v4-w128", "kivi-4"]


def test_budget_table_hand_case():
    t = {r["budget"]: r for r in PA.budget_table(HAND, [30, 36, 40, 52, 56, 91, 128], "ppl_ratio")}
    assert t[30]["winner"] is None and t[30]["fmkv"] is None and t[30]["other"] is None
    assert t[36]["winner"] == "other" and t[36]["fmkv"] is None and t[36]["other"]["config"] == "turbo-2"
    assert t[40]["winner"] == "fmkv" and t[40]["fmkv"]["config"] == "k2v2"
    assert t[52]["winner"] == "other" and t[52]["other"]["config"] == "turbo-3"
    assert t[56]["winner"] == "fmkv" and t[56]["fmkv"]["config"] == "k3v3"
    assert t[91]["winner"] == "other" and t[91]["other"]["config"] == "kivi-4"
    assert t[91]["fmkv"]["config"] == "k4v4-w128"
    assert all(r["other"] is None or r["other"]["family"] != "fp16" for r in t.values())  # fp16 is the reference


def test_tie_and_equal_bytes():
    rows = [row("k4v4", 64, 1.05, 0.04), row("turbo-4", 64, 1.05, 0.04)]
    assert PA.budget_table(rows, [64], "ppl_ratio")[0]["winner"] == "tie"
    assert {r["config"] for r in PA.front(rows, "ppl_ratio")} == {"k4v4", "turbo-4"}


@pytest.mark.parametrize("metric", PA.METRICS)
def test_front_and_budgets_match_brute_force(rng, metric):
    n = int(rng.integers(5, 40))
    rows = [row(("k%dv4" % i) if rng.random() < 0.5 else ("turbo-%d" % i), float(rng.integers(30, 130)),
                float(1 + rng.random()), float(rng.random())) for i in range(n)]
    fr = {r["config"] for r in PA.front(rows, metric)}
    for r in rows:
        dominated = any(o is not r and o["bytes_per_token_per_head"] <= r["bytes_per_token_per_head"]
                        and o[metric] <= r[metric]
                        and (o["bytes_per_token_per_head"], o[metric]) != (r["bytes_per_token_per_head"], r[metric])
                        for o in rows)
        assert (r["config"] in fr) == (not dominated)
    for b in rng.uniform(25, 135, size=8):
        t = PA.budget_table(rows, [float(b)], metric)[0]
        for side, fams in (("fmkv", {"fmkv"}), ("other", {"turbo"})):
            fit = [r[metric] for r in rows if PA.quantizer_family(r) in fams and r["bytes_per_token_per_head"] <= b]
            assert (t[side] is None) == (not fit)
            if fit:
                assert t[side][metric] == min(fit)


def test_family_without_kind():
    assert PA.quantizer_family({"config": "plan-56B"}) == "fmkv"
    assert PA.quantizer_family({"config": "k3v3-w64-fmt3"}) == "fmkv"
    assert PA.quantizer_family({"config": "kivi-4"}) == "kivi"


def test_sets_are_kept_apart_and_last_row_wins():
    rows = [row("k4v4", 72, 1.2, 0.1), row("k4v4", 72, 1.048, 0.043), row("turbo-4", 68, 1.06, 0.05),
            row("k4v4", 72, 1.0, 0.0001, suite="plan-check", tokens=65504),
            dict(row("turbo-4", 68, 1.001, 0.001), device="cpu")]  # the same windows on another device
    sets = PA.measurement_sets(rows)
    assert len(sets) == 3
    main = [rs for k, rs in sets.items() if k[4] == "ppl" and k[5] is None][0]
    assert sorted(r["config"] for r in main) == ["k4v4", "turbo-4"]
    assert [r["ppl_ratio"] for r in main if r["config"] == "k4v4"] == [1.048]
    rep = PA.report(rows, [72])
    wins = {(r["set_suite"], r["metric"]): r["winner"] for r in rep if r["suite"] == "pareto-budget"}
    wins = {(r["set_suite"], r["metric"]): r["winner"] for r in rep
            if r["suite"] == "pareto-budget" and r["set_device"] is None}
    assert wins[("ppl", "ppl_ratio")] == "fmkv" and wins[("plan-check", "ppl_ratio")] == "fmkv"
    assert wins[("ppl", "kld")] == "fmkv"


def test_parse_budgets():
    assert PA.parse_budgets("36:48:4") == [36, 40, 44, 48]
    assert PA.parse_budgets("91,52, 52") == [52, 91]
    for bad in ("", "0", "-4", "nan", "4:1:1", "1:2", "1:2:0", "1:1e9:1e-3", "x"):
        with pytest.raises(ValueError):
            PA.parse_budgets(bad)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fmkv.eval", "pareto", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_cli_writes_table_jsonl_and_png(tmp_path):
    src = tmp_path / "ppl.jsonl"
    extra = [{"suite": "needle", "x": 1}, row("k3v3-only1", 56, 1.01, 0.01, only_layer=1)]
    src.write_text("".join(json.dumps(r) + "\n" for r in HAND + extra))
    out = tmp_path / "pareto.jsonl"
    r = _cli(str(src), "--budgets", "36,56,91", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "k3v3" in r.stdout and "turbo-2" in r.stdout and "kivi-4" in r.stdout
    rep = [json.loads(line) for line in out.read_text().splitlines()]
    fronts = [x for x in rep if x["suite"] == "pareto-front"]
    assert {x["metric"] for x in fronts} == set(PA.METRICS)
    assert all("k3v3-only1" not in [f["config"] for f in x["front"]] for x in fronts)  # ablation rows skipped
    budgets = [x for x in rep if x["suite"] == "pareto-budget" and x["metric"] == "ppl_ratio"]
    assert [x["winner"] for x in budgets] == ["other", "fmkv", "other"]
    png = tmp_path / "pareto.png"
    assert png.stat().st_size > 10000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(tmp_path):
    r = _cli(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "no such file" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(HAND[1]) + "\n{not json\n")
    r = _cli(str(bad))
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"suite": "needle"}) + "\n")
    r = _cli(str(empty))
    assert r.returncode == 2 and "no configuration rows" in r.stderr
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(HAND[1]) + "\n")
    r = _cli(str(good), "--budgets", "4:1:1")
    assert r.returncode == 2 and "budgets" in r.stderr and "Traceback" not in r.stderr


def test_committed_results_report():
    """The committed H200 rows: the report runs and fp16 never appears as a competitor."""
    paths = [os.path.join(ROOT, "docs", "results", f) for f in ("ppl.jsonl", "ppl.format3.jsonl", "plan.jsonl")]
    paths = [p for p in paths if os.path.exists(p)]
    if not paths:
        pytest.skip("docs/results ppl files not in this checkout")
    rep = PA.report(PA.load_rows(paths), PA.parse_budgets("36:128:4"))
    assert any(r["suite"] == "pareto-front" for r in rep)
    assert all(r["other"] is None or r["other"]["family"] != "fp16" for r in rep if r["suite"] == "pareto-budget")

"""bench/proto/per_layer_window_plan.py (docs/history/per-head-widths.md): a window per layer never predicts more
KLD than the best single window, is exact against brute force on a tiny case, and keeps the budget."""
import importlib.util
import itertools
import json
import os

import numpy as np
import pytest

pytest.importorskip("fmkv", reason="the fmkv binding is not installed")
from fmkv import format as fmt  # noqa: E402
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_proto():
    spec = importlib.util.spec_from_file_location("plw", os.path.join(ROOT, "bench/proto/per_layer_window_plan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sens(rng, layers, windows):
    sens = {}
    for w in windows:
        shrink = 1.0 / (1 + w / 16)  # a window lowers every layer's sensitivity
        for side, bits in (("k", fmt.CODE_BITS), ("v", fmt.CODE_BITS)):  # every width the proto's default menus take
            base = rng.uniform(0.1, 1.0, layers)
            for b in bits:
                sens[(w, side, b)] = base * shrink * 4.0 ** (2 - b) * rng.uniform(0.5, 1.5, layers)
    return sens


@pytest.mark.parametrize("trial", range(3))
def test_window_per_layer_is_exact_and_never_worse(trial):
    m = load_proto()
    rng = np.random.default_rng()  # fresh inputs every run
    layers, windows = 3, [0, 64, 128]
    sens = _sens(rng, layers, windows)
    budget = float(rng.uniform(50, 90))
    km, vm = (2, 4, 16), (2, 3)
    got = m.plan(sens, layers, budget, windows, km, vm)
    best = None
    opts = [(kb, vb, w) for w in windows for kb in km for vb in vm]
    for combo in itertools.product(opts, repeat=layers):
        cost = sum((m.PL.side_bytes(64, kb) + m.PL.side_bytes(64, vb)) * (2048 - w) + 256 * w for kb, vb, w in combo)
        if cost / 2048 / layers > budget + 1e-9:
            continue
        val = sum((0 if kb == 16 else sens[(w, "k", kb)][i]) + sens[(w, "v", vb)][i] for i, (kb, vb, w) in enumerate(combo))
        best = val if best is None or val < best else best
    if best is None:
        assert got is None
        return
    assert got[0] == pytest.approx(best, rel=1e-12) and got[1] <= budget + 1e-9
    for w in windows:  # one window for every layer is one of the options
        one = m.plan(sens, layers, budget, [w], km, vm)
        assert one is None or got[0] <= one[0] + 1e-12


def test_reads_plan_rows_and_prints(tmp_path, capsys):
    m = load_proto()
    rng = np.random.default_rng(1)
    sens = _sens(rng, 4, [0, 64])
    rows = [{"suite": "plan-sensitivity", "window_tokens": w, "side": s, "bits": b, "kld_per_layer": list(v)}
            for (w, s, b), v in sens.items()] + [{"suite": "plan", "config": "plan-60B"}]
    p = tmp_path / "plan.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert m.main([str(p), "--budgets", "60,30"]) == 0
    out = capsys.readouterr().out
    assert "60 B: one window" in out and "a window per layer" in out and "30 B: nothing fits" in out

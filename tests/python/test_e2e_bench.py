"""bench/e2e_decode.py on the CPU with the tiny geometry: every case kind runs, and every line carries the
fields of shared/BENCHMARKS.md "End-to-end decode (e2e_decode)" with consistent values; the plot and
the table are written. (The timings of an eager CPU step mean nothing here; the H200 run is
tests/python/run_device_e2e.sh.)"""
import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (the benchmark draws a PNG)")
fmkv = pytest.importorskip("fmkv", reason="the fmkv binding is not installed")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "e2e_decode.py")
FIELDS = ("suite", "device", "commit", "model", "cache", "case", "batch", "context", "graph", "ms_per_step",
          "tokens_per_s", "cache_bytes", "max_batch", "attention_ms", "weights_ms", "other_ms", "speedup")


def _bench():
    spec = importlib.util.spec_from_file_location("e2e_decode", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_the_fields(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "e2e.jsonl"
    rc = _bench().main(["--device", "cpu", "--tiny", "--caches", "fp16,k3v3-w64", "--fixed", "1:256,2:512",
                        "--prefill-chunks", "256", "--steps", "2", "--profile-steps", "1", "--no-compile",
                        "--max-capacity-batch", "3", "--out", str(out), "--commit", "test"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["case"], r["cache"]) for r in rows] == [
        ("fixed", "fp16"), ("fixed", "k3v3-w64"), ("fixed", "fp16"), ("fixed", "k3v3-w64"),
        ("capacity", "fp16"), ("capacity", "k3v3-w64"), ("prefill", "fp16"), ("prefill", "k3v3-w64")]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert all(f in r for f in FIELDS), [f for f in FIELDS if f not in r]
        assert r["suite"] == "e2e_decode" and r["commit"] == "test" and r["graph"] is False
        assert r["tokens_per_s"] > 0 and r["cache_bytes"] > 0
        if r["cache"] == "fp16":
            assert r["speedup"] == 1.0 and r["k_bits"] == 16
        else:
            assert r["speedup"] > 0 and (r["k_bits"], r["v_bits"], r["window_tokens"]) == (3, 3, 64)
        if r["case"] != "prefill":
            assert r["ms_per_step"] > 0 and r["fill"] == "direct"
            assert min(r[k] for k in ("attention_ms", "weights_ms", "other_ms")) >= 0
            assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["ms_per_step"] / 1e3), rel=1e-3, abs=0.006)
        if r["case"] == "fixed" and r["cache"] != "fp16":  # each sequence: the context + the steps taken
            lo, hi = (int(x) for x in r["lengths_after"].split("-"))
            assert lo == hi > r["context"]
        if r["case"] == "capacity":
            assert 1 <= r["batch"] <= r["max_batch"] <= 3 and r["fit"]["per_seq_cache_bytes"] > 0
        if r["case"] == "prefill":
            assert r["prefill_ms"] > 0 and r["chunk"] == 256 and r["batch"] == 1
    fp16, k3 = (next(r for r in rows if r["case"] == "capacity" and r["cache"] == c) for c in ("fp16", "k3v3-w64"))
    assert k3["fit"]["per_seq_cache_bytes"] * 3 < fp16["fit"]["per_seq_cache_bytes"]  # compressed: > 3x fewer bytes
    assert (tmp_path / "e2e.png").stat().st_size > 0
    assert "capacity 1k" in capsys.readouterr().out


def test_cache_names_with_widths_per_layer_and_per_head(tmp_path, monkeypatch):
    b = _bench()
    assert b.parse_cache("k4v4|k3v3-w64") == (4, 4, 64, ((4, 4),), ((4, 4), (3, 3)), False)
    assert b.parse_cache("k4v4/k3v3") == (4, 4, 0, ((4, 4), (3, 3)), (), False)
    assert b.parse_cache("k3v3-ko") == (3, 3, 0, ((3, 3),), (), True)
    assert b.parse_cache("k4v4|k3v3-w64-ko")[4:] == (((4, 4), (3, 3)), True)
    assert b.head_bits_of(b.parse_cache("k4v4|k3v3|k4v2-w8"), 2, 4) == [[(4, 4), (3, 3), (4, 2), (4, 4)]] * 2
    assert b.head_bits_of(b.parse_cache("k4v4-w8"), 2, 4) is None
    with pytest.raises(ValueError, match="not both"):
        b.parse_cache("k4v4/k3v3|k2v2")
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "e2e.jsonl"
    assert b.main(["--device", "cpu", "--tiny", "--caches", "k3v3-w64,k4v4|k3v3-w64,k3v3-ko", "--only", "fixed",
                   "--fixed", "1:256", "--steps", "2", "--no-profile", "--no-compile", "--out", str(out),
                   "--commit", "test"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["cache"] for r in rows] == ["k3v3-w64", "k4v4|k3v3-w64", "k3v3-ko"]
    assert all("error" not in r for r in rows), rows
    assert rows[2]["key_offset"] is True and "key_offset" not in rows[0] and rows[2]["window_tokens"] == 0
    assert rows[1]["head_bits"] == [[4, 4], [3, 3]] and "per-kv-head" in rows[1]["cache_dtype"]
    assert rows[1]["cache_bytes"] > rows[0]["cache_bytes"]  # one head of each layer at 4 bits

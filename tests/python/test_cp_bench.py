"""bench/cp_decode.py on the CPU (gloo, tiny context): one process and two ranks under torchrun write a line
with the fields of shared/BENCHMARKS.md "Context parallel (cp_decode)", consistent values and a passed float64-
backed check; the plot and table are drawn. (CPU timings mean nothing here; the GPU runs are the device's.)"""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (the benchmark draws a PNG)")
fmkv = pytest.importorskip("fmkv", reason="the fmkv binding is not installed")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cp_decode.py")
ARGS = ["--device", "cpu", "--tokens-per-gpu", "3000", "--layers", "2", "--steps", "3", "--warmup", "1",
        "--chunk", "1024", "--head-dim", "64", "--q-heads", "8", "--kv-heads", "2", "--commit", "test"]


def _run(cmd, out):
    env = dict(os.environ, FMKV_NUM_THREADS="1", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd + ARGS + ["--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_cp_bench_lines_and_plot(tmp_path):
    out = tmp_path / "cp.jsonl"
    _run([sys.executable, BENCH], out)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", BENCH, "--window", "64"], out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["gpus"] for r in rows] == [1, 2]
    for r in rows:
        assert r["suite"] == "cp_decode" and r["process_group"] == "gloo" and r["layers"] == 2
        assert r["context"] == r["gpus"] * 3000 + 1 + 3  # the fill and the warmup + timed steps' tokens
        for f in ("time_us", "comm_us", "single_gpu_time_us", "append_us"):
            assert r[f] > 0, f
        assert r["ratio"] == pytest.approx(r["time_us"] / r["single_gpu_time_us"])
        assert 0 <= r["check_rel_err"] <= r["check_bound"]
    png = tmp_path / "cp.png"
    p = subprocess.run([sys.executable, BENCH, "--plot", str(out), "--png", str(png)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and png.stat().st_size > 1000, p.stderr
    assert len(p.stdout.strip().splitlines()) == 3  # header + two rows


def test_cp_bench_refuses_bad_numbers(tmp_path):
    for bad in (["--tokens-per-gpu", "0"], ["--layers", "-1"], ["--steps", str(1 << 41)], ["--nonsense"]):
        p = subprocess.run([sys.executable, BENCH, "--out", str(tmp_path / "x.jsonl")] + bad, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and ("must be in" in p.stderr or "unrecognized" in p.stderr), (bad, p.stderr)
        assert not (tmp_path / "x.jsonl").exists()

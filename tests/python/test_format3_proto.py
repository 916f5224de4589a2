"""The format-3 prototypes (docs/history/format3-prototypes.md) keep building and checking themselves:
the CPU K-side prototype is compiled and run (one round) where the CPU has AVX-512 VNNI and VBMI, and
exits non-zero when its integer scores leave the float64 scores of the same quantizer; the CUDA
prototypes are compiled (host and device code) where nvcc is found, and the V-side one runs its host check
of the one-permute fp16 decode against its layout model (its GPU timing needs a device). (The real-loop
candidate is format version 3's CUDA kernels now; its layout check against the fragment decode is a ctest.)"""
import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_cpu_prototype_runs_and_checks_itself(tmp_path):
    need = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "f16c", "fma"}
    missing = need - cpu_flags()
    if missing:
        pytest.skip("the CPU lacks " + ", ".join(sorted(missing)) + " (the prototype is AVX-512 VNNI + VBMI code)")
    if not shutil.which("g++"):
        pytest.skip("g++ not found")
    exe = str(tmp_path / "f3")
    subprocess.run(["g++", "-O2", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi",
                    "-mf16c", "-mfma", "-I", os.path.join(ROOT, "src"), "-I", os.path.join(ROOT, "include"), "-I",
                    os.path.join(ROOT, "tools"), os.path.join(ROOT, "bench/proto/format3_cpu_scores.cpp"),
                    os.path.join(ROOT, "tools/lloyd_max.cpp"), "-o", exe], check=True)
    r = subprocess.run([exe, "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert {(x["impl"], x["tokens"]) for x in lines} == {(i, n) for i in ("format2", "format3", "format3-1")
                                                         for n in (4096, 32768, 131072)}
    for x in lines:
        if x["impl"] == "format3":
            assert x["max_abs_err_vs_f64"] <= 1e-4 * x["max_abs_score"]
        if x["impl"] == "format3-1":  # one int8 query part: visibly worse, which is why the design has two
            assert x["max_abs_err_vs_f64"] > 10 * 1e-4 * x["max_abs_score"]


def test_cuda_prototype_compiles(tmp_path):
    if not shutil.which("nvcc"):
        pytest.skip("nvcc not found")
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-I", os.path.join(ROOT, "src"), "-I",
                    os.path.join(ROOT, "include"), "-I", os.path.join(ROOT, "tools"),
                    os.path.join(ROOT, "bench/proto/format3_cuda_scores.cu"), os.path.join(ROOT, "tools/lloyd_max.cpp"),
                    "-o", str(tmp_path / "f3cu")], check=True, timeout=600)
    assert os.path.getsize(tmp_path / "f3cu") > 0


def test_cuda_v_prototype_host_check(tmp_path):
    if not shutil.which("nvcc"):
        pytest.skip("nvcc not found")
    exe = str(tmp_path / "f3pv")
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-I", os.path.join(ROOT, "src"), "-I",
                    os.path.join(ROOT, "include"), os.path.join(ROOT, "bench/proto/format3_cuda_pv.cu"), "-o", exe],
                   check=True, timeout=600)
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    check = json.loads(r.stdout.splitlines()[0])
    assert check["ok"] and check["mismatches"] == 0 and check["pairs"] == 3200000

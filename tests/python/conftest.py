"""Shared fixtures of the fmkv Python tests: fresh random inputs every run (the seed is printed,
and FMKV_TEST_SEED=<int> replays a run), and the host backends to test."""
import os
import secrets

import numpy as np
import pytest

import fmkv


def host_backends():
    """'ref' always; 'cpu' only when the SIMD backend is compiled into this build."""
    names = ["ref"]
    if fmkv.backends()["cpu"]["available"]:
        names.append("cpu")
    return names


@pytest.fixture(params=host_backends())
def backend(request):
    return request.param


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("FMKV_TEST_SEED", secrets.randbits(63)))
    print(f"{request.node.nodeid}: FMKV_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def random_kv(rng, tokens, heads, head_dim, outlier_scale=1.0, dtype=np.float32):
    """Gaussian rows with heavy-tailed per-channel scales, like real keys."""
    chan = 1.0 + outlier_scale * np.abs(rng.standard_normal(head_dim))
    return (rng.standard_normal((tokens, heads, head_dim)) * chan).astype(dtype)


# Lines a test wants in the run's summary (the reliability tests' step and invariant counts).
REPORT = []


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("fmkv reliability counts")
        for line in REPORT:
            terminalreporter.write_line(line)

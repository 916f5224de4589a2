"""Shared fixtures of the fmkv Python tests: fresh random inputs every run (the seed is printed,
and FMKV_TEST_SEED=<int> replays a run), and the host backends to test."""
import os
import secrets

import numpy as np
import pytest

import fmkv


def import_hf():
    """(torch, transformers, fmkv, fmkv.hf) for the fmkv.hf tests, or the calling test module skipped with the reason."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    try:
        import fmkv.hf as fhf
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"fmkv.hf unavailable with this transformers: {e}", allow_module_level=True)
    return torch, transformers, fmkv, fhf


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


def cuda_graph_tokens(step, tok, pos, n):
    """Greedy tokens [b, n] of ``step(tok, pos) -> next tok`` run as one captured torch.cuda.CUDAGraph: two eager
    steps on a side stream first (lazy initialisation, fmkv's device error word), recorded as tokens 0 and 1, then
    the capture of one step (the token and position fed back in place) and n - 2 replays, under
    torch.cuda.set_sync_debug_mode("error") (a replay that synchronises with the host fails)."""
    import torch

    tok_buf, pos_buf = tok.clone(), pos.clone()
    hist = torch.zeros(tok.shape[0], n, dtype=torch.long, device=tok.device)

    def one():
        tok_buf.copy_(step(tok_buf, pos_buf))
        pos_buf.add_(1)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(2):
                one()
                hist[:, i:i + 1].copy_(tok_buf)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            one()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(2, n):
                g.replay()
                hist[:, i:i + 1].copy_(tok_buf)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return hist


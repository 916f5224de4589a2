"""fmkv.distributed on CPU processes (gloo): a sequence sharded over 2 and 4 ranks by token range.

Each rank is a separate process (tests/python/distributed_worker.py; the data: distributed_case.py).
Checked: every rank returns the same bits; they equal merge_partials of the gathered partials in this
process (a single-process merge of the same partials); they match one fmkv.Cache holding the whole
sequence within the CPU backend's attention bound; a rank holding no token yet contributes nothing;
bad calls raise the same error on every rank and leave the cache answering as before."""
import os
import subprocess
import sys

import numpy as np
import pytest

import fmkv
import fmkv.distributed as fd

from distributed_case import CASE, case_data

torch = pytest.importorskip("torch", reason="fmkv.distributed runs over torch.distributed (pip install torch)")
HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(tmp_path, world, backend):
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.npz" for r in range(world)]
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), FMKV_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "distributed_worker.py"), str(r), str(world), str(store),
                               str(outs[r]), backend], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for x in procs:
                x.kill()
            pytest.fail("a rank did not finish in 240 s")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r]}"
    return [dict(np.load(o)) for o in outs]


def one_cache_outputs(backend):
    cfg, k, v, q = case_data()
    c = fmkv.Cache(cfg, CASE["layers"], 64, 1, backend)
    s = c.add_sequence()
    n, out = 0, []
    for chunk in CASE["chunks"]:
        for layer in range(CASE["layers"]):
            c.append(layer, s, k[layer, n:n + chunk], v[layer, n:n + chunk])
        n += chunk
    for step in range(CASE["steps"]):
        for layer in range(CASE["layers"]):
            c.append(layer, s, k[layer, n:n + 1], v[layer, n:n + 1])
            out.append(c.attention(layer, s, q[layer, step:step + 1]))
        n += 1
    return np.stack(out)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_cache(tmp_path, world):
    backend = fmkv.default_backend()
    ranks = run_ranks(tmp_path, world, backend)
    merged = ranks[0]["merged"]
    for r in ranks[1:]:
        assert np.array_equal(r["merged"], merged), "ranks returned different bits"
        assert np.array_equal(r["p_lse"], ranks[0]["p_lse"]) and np.array_equal(r["p_out"], ranks[0]["p_out"])
    # a single-process merge of the same partials: bit for bit
    here = np.stack([fd.merge_partials(list(o), list(l)) for o, l in zip(ranks[0]["p_out"], ranks[0]["p_lse"])])
    assert np.array_equal(here, merged)
    # one cache with the whole sequence: within the attention bound (each partial is fmkv attention over a
    # part of the same stored tokens)
    ref = one_cache_outputs(backend)
    err = np.linalg.norm((merged - ref).reshape(len(ref), -1), axis=1) / np.linalg.norm(ref.reshape(len(ref), -1), axis=1)
    assert err.max() < 1e-5, err
    # the ranks' token ranges tile the sequence; which ranks held tokens shows in the partials
    n = sum(CASE["chunks"]) + CASE["steps"]
    spans = sorted(tuple(r["local"][0]) for r in ranks)
    assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all((r["lengths"] == n).all() for r in ranks)
    first_step_lse = ranks[0]["p_lse"][0]  # [world, 1, q_heads]
    holds = [r["local"][0][1] > r["local"][0][0] for r in ranks]
    assert list(np.isfinite(first_step_lse[:, 0, 0])) == holds
    # bad calls: the same refusal everywhere, and the cache still gives the same answer
    errs = [list(r["errors"]) for r in ranks]
    assert all(e == errs[0] for e in errs)
    assert errs[0] == ["nan: NON_FINITE", "shape: INVALID_ARGUMENT", "capacity: OUT_OF_RANGE",
                       "two rows: INVALID_ARGUMENT", "layer: OUT_OF_RANGE"]
    last_layer0 = merged[(CASE["steps"] - 1) * CASE["layers"]]
    for r in ranks:
        assert np.array_equal(r["after"], last_layer0)


def test_merge_partials_rules():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 3, 8)).astype(np.float32), rng.standard_normal((2, 3, 8)).astype(np.float32)
    la, lb = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    m = fd.merge_partials([a, b], [la, lb])
    wa, wb = np.exp(la.astype(np.float64)), np.exp(lb.astype(np.float64))
    expect = (wa[..., None] * a + wb[..., None] * b) / (wa + wb)[..., None]
    assert np.allclose(m, expect, rtol=1e-6, atol=1e-7)
    empty = np.full((2, 3), -np.inf, np.float32)
    assert np.array_equal(fd.merge_partials([a, np.full_like(b, np.nan)], [la, empty]), a)  # an empty part is ignored
    with pytest.raises(fmkv.FmkvError, match="no visible token"):
        fd.merge_partials([a, b], [empty, empty])
    with pytest.raises(fmkv.FmkvError, match="do not match"):
        fd.merge_partials([a, b[:1]], [la, lb[:1]])
    with pytest.raises(fmkv.FmkvError):
        fd.merge_partials([], [])


def test_needs_an_initialised_process_group():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(fmkv.FmkvError, match="not initialised"):
        fd.ContextParallelCache(fmkv.Config(head_dim=64, num_kv_heads=2), 1, 128)

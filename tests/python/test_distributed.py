"""fmkv.distributed on CPU processes (gloo): a sequence sharded over 2 and 4 ranks by token range, in host
shards (fmkv.Cache, numpy) and in torch shards (fmkv.torch_ops.TorchCache on the CPU device, torch tensors).

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


def run_ranks(tmp_path, world, backend, shards="host", pg="gloo"):
    store = tmp_path / f"store_{shards}_{world}"
    outs = [tmp_path / f"rank{r}_{shards}_{world}.npz" for r in range(world)]
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), FMKV_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "distributed_worker.py"), str(r), str(world), str(store),
                               str(outs[r]), backend, shards, pg], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


@pytest.mark.parametrize("shards", ["host", "cpu"])
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_cache(tmp_path, world, shards):
    backend = fmkv.default_backend()
    ranks = run_ranks(tmp_path, world, backend, shards)
    merged = ranks[0]["merged"]
    for r in ranks[1:]:
        assert np.array_equal(r["merged"], merged), "ranks returned different bits"
        assert np.array_equal(r["p_lse"], ranks[0]["p_lse"]) and np.array_equal(r["p_out"], ranks[0]["p_out"])
    # a single-process merge of the same partials (numpy for host shards, torch for torch shards): bit for bit
    arr = (lambda x: x) if shards == "host" else torch.from_numpy
    here = np.stack([np.asarray(fd.merge_partials([arr(x) for x in o], [arr(x) for x in l]))
                     for o, l in zip(ranks[0]["p_out"], ranks[0]["p_lse"])])
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


def test_torch_shards_match_host_shards(tmp_path):
    """TorchCache shards on the CPU give the host shards' partials bit for bit (the same backend and pages); the
    two merges (numpy, torch) agree to float32 rounding."""
    backend = fmkv.default_backend()
    host, tens = run_ranks(tmp_path, 2, backend, "host"), run_ranks(tmp_path, 2, backend, "cpu")
    assert np.array_equal(host[0]["p_out"], tens[0]["p_out"]) and np.array_equal(host[0]["p_lse"], tens[0]["p_lse"])
    np.testing.assert_allclose(tens[0]["merged"], host[0]["merged"], rtol=1e-6, atol=1e-7)
    assert list(host[0]["errors"]) == list(tens[0]["errors"])


def _cuda_ready():
    return torch.cuda.is_available() and fmkv.backends()["cuda"]["available"]


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device, a CUDA torch and the extension built "
                                "with the CUDA backend (pip install . -C cmake.define.FMKV_CUDA=ON)")
CUDA_TOL = 4e-3  # CUDA attention's bound (docs/ARCHITECTURE.md, op x backend matrix)


@needs_cuda
@pytest.mark.parametrize("world,pg", [(2, "gloo"), (1, "nccl")])
def test_context_parallel_cuda_shards(tmp_path, world, pg):
    """TorchCache shards on this GPU (the 'cuda' backend): 2 gloo ranks sharing it, and one NCCL rank (NCCL
    refuses two ranks on one GPU; the multi-GPU runs are a device benchmark's). Ranks agree bit for bit, a
    single-process merge of the gathered partials on the GPU gives the same bits, and the result is within the
    CUDA attention bound of one host cache."""
    dev = f"cuda:{torch.cuda.current_device()}"
    ranks = run_ranks(tmp_path, world, "cuda", dev, pg)
    merged = ranks[0]["merged"]
    for r in ranks[1:]:
        assert np.array_equal(r["merged"], merged) and np.array_equal(r["p_out"], ranks[0]["p_out"])
    here = np.stack([fd.merge_partials([torch.from_numpy(x).to(dev) for x in o],
                                       [torch.from_numpy(x).to(dev) for x in l]).cpu().numpy()
                     for o, l in zip(ranks[0]["p_out"], ranks[0]["p_lse"])])
    assert np.array_equal(here, merged)
    ref = one_cache_outputs(fmkv.default_backend())
    err = np.linalg.norm((merged - ref).reshape(len(ref), -1), axis=1) / np.linalg.norm(ref.reshape(len(ref), -1), axis=1)
    assert err.max() < CUDA_TOL, err
    assert list(ranks[0]["errors"]) == ["nan: NON_FINITE", "shape: INVALID_ARGUMENT", "capacity: OUT_OF_RANGE",
                                        "two rows: INVALID_ARGUMENT", "layer: OUT_OF_RANGE"]


def test_merge_partials_torch_matches_numpy():
    rng = np.random.default_rng(2)
    outs = [rng.standard_normal((1, 8, 64)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((1, 8)).astype(np.float32) * 4 for _ in range(3)]
    lses[1][0, 3] = -np.inf  # one empty part in one row: its NaN output is ignored
    outs[1][0, 3] = np.nan
    a = fd.merge_partials(outs, lses)
    b = fd.merge_partials([torch.from_numpy(x) for x in outs], [torch.from_numpy(x) for x in lses])
    assert isinstance(b, torch.Tensor) and b.dtype == torch.float32 and np.isfinite(b.numpy()).all()
    np.testing.assert_allclose(b.numpy(), a, rtol=1e-6, atol=1e-7)
    with pytest.raises(fmkv.FmkvError, match="torch tensor"):
        fd.merge_partials([torch.from_numpy(outs[0]), outs[1]], [torch.from_numpy(lses[0]), torch.from_numpy(lses[1])])


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
    for x in ([a, b], [torch.from_numpy(a), torch.from_numpy(b)]):  # check=False: no host-side test, the row is NaN
        lx = [empty, la.copy()] if isinstance(x[0], np.ndarray) else [torch.from_numpy(empty), torch.from_numpy(la.copy())]
        lx[1][1, 2] = -np.inf
        got = np.asarray(fd.merge_partials(x, lx, check=False))
        assert np.isnan(got[1, 2]).all() and np.isfinite(np.delete(got.reshape(6, 8), 5, axis=0)).all()
        assert np.array_equal(np.delete(got.reshape(6, 8), 5, axis=0), np.delete(b.reshape(6, 8), 5, axis=0))
    many = [rng.standard_normal((2, 3, 8)).astype(np.float32) for _ in range(5)]  # five sets, in one call
    lmany = [rng.standard_normal((2, 3)).astype(np.float32) * 3 for _ in range(5)]
    w = [np.exp(x.astype(np.float64)) for x in lmany]
    expect = sum(wi[..., None] * x for wi, x in zip(w, many)) / sum(w)[..., None]
    assert np.allclose(fd.merge_partials(many, lmany), expect, rtol=1e-6, atol=1e-7)
    with pytest.raises(fmkv.FmkvError, match="do not match"):
        fd.merge_partials([a, b[:1]], [la, lb[:1]])
    with pytest.raises(fmkv.FmkvError):
        fd.merge_partials([], [])


def test_needs_an_initialised_process_group():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(fmkv.FmkvError, match="not initialised"):
        fd.ContextParallelCache(fmkv.Config(head_dim=64, num_kv_heads=2), 1, 128)

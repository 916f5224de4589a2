"""Threads and processes: fmkv.Cache and TorchCache under concurrent calls (different sequences near
the end of the page pool; one sequence from several threads), and the CPU backend's thread pool
in children made by multiprocessing with the fork and the spawn start methods."""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import fmkv
from fmkv import reference
from conftest import REPORT, random_kv

D, H, PAGE = 64, 2, 16
TRIALS = 25


def make(kind, config, num_pages, max_seqs):
    if kind == "Cache":
        return fmkv.Cache(config, 1, num_pages, max_seqs, backend=fmkv.default_backend())
    torch_ops = pytest.importorskip("fmkv.torch_ops", reason="torch is not installed: pip install torch")
    return torch_ops.TorchCache(config, 1, num_pages, max_seqs)


def as_input(kind, x):
    if kind == "Cache":
        return x
    import torch
    return torch.from_numpy(x)


def as_numpy(x):
    return x if isinstance(x, np.ndarray) else x.numpy()


def check_pages(cache, seqs, num_pages, config):
    """Every page free or in exactly one table; each table sized for its sequence's length."""
    tables = [cache.block_table(s) for s in seqs]
    used = [p for t in tables for p in t]
    assert len(set(used)) == len(used), "a page is mapped twice"
    assert cache.free_pages + len(used) == num_pages, "a page leaked"
    for s, t in zip(seqs, tables):
        comp = max(0, cache.length(0, s) - config.sink_tokens - config.window_tokens)
        assert len(t) == -(-comp // config.page_size)
    if hasattr(cache, "_lens_dev"):  # TorchCache: the device-side tables equal the host mirrors
        for s, t in zip(seqs, tables):
            assert cache._bt[s, :len(t)].tolist() == t
            assert int(cache._lens_dev[0, s]) == cache.length(0, s)


@pytest.mark.parametrize("kind", ["Cache", "TorchCache"])
def test_threads_on_different_sequences_near_the_end_of_the_pool(kind, rng):
    """4 threads append chunks to their own sequences until the pool runs out: every refusal is
    'out of pages', no page is leaked or shared, and each sequence's attention is bit-identical
    to the same accepted appends replayed by one thread into a fresh cache."""
    config = fmkv.Config(head_dim=D, num_kv_heads=H, page_size=PAGE, window_tokens=4, seed=int(rng.integers(2**63)))
    num_pages, threads, checks = 24, 4, 0
    for trial in range(TRIALS):
        cache = make(kind, config, num_pages, threads)
        seqs = [cache.add_sequence() for _ in range(threads)]
        chunks = {s: [random_kv(rng, int(n), H, D) for n in rng.integers(1, 40, size=12)] for s in seqs}
        vals = {s: [random_kv(rng, c.shape[0], H, D) for c in chunks[s]] for s in seqs}
        accepted = {s: [] for s in seqs}
        errors, barrier = [], threading.Barrier(threads)

        def work(s):
            barrier.wait()
            for k, v in zip(chunks[s], vals[s]):
                try:
                    cache.append(0, s, as_input(kind, k), as_input(kind, v))
                    accepted[s].append((k, v))
                except fmkv.FmkvError as e:
                    if e.status != "OUT_OF_RANGE" or "out of pages" not in str(e):
                        errors.append(e)
                except Exception as e:  # noqa: BLE001 -- anything else is a defect
                    errors.append(e)

        ts = [threading.Thread(target=work, args=(s,)) for s in seqs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        check_pages(cache, seqs, num_pages, config)
        q = rng.standard_normal((1, 2 * H, D)).astype(np.float32)
        for s in seqs:
            if not accepted[s]:
                continue
            assert cache.length(0, s) == sum(k.shape[0] for k, _ in accepted[s])
            solo = make(kind, config, num_pages, 1)
            t = solo.add_sequence()
            for k, v in accepted[s]:
                solo.append(0, t, as_input(kind, k), as_input(kind, v))
            assert np.array_equal(as_numpy(cache.attention(0, s, as_input(kind, q))),
                                  as_numpy(solo.attention(0, t, as_input(kind, q))))
            checks += 1
    assert checks > TRIALS  # most sequences got some tokens in
    REPORT.append(f"{kind} threads on different sequences: {TRIALS} trials x {threads} threads, "
                  f"{checks} sequences bit-identical to a one-thread replay")


@pytest.mark.parametrize("kind", ["Cache", "TorchCache"])
def test_threads_on_one_sequence(kind, rng):
    """Several threads append to ONE sequence. fmkv.Cache serialises them (all accepted);
    TorchCache accepts one call at a time and refuses the others with 'in use by another thread'.
    Either way the length is the accepted rows' count, host and device tables agree, and attention
    equals the float64 model of the accepted rows (order-free: no sink/window, one query row)."""
    config = fmkv.Config(head_dim=D, num_kv_heads=H, page_size=PAGE, seed=int(rng.integers(2**63)))
    refused = accepted_calls = 0
    for trial in range(TRIALS // 5):
        cache = make(kind, config, 64, 1)
        s = cache.add_sequence()
        accepted, errors, lock, refused_here = [], [], threading.Lock(), [0]
        barrier = threading.Barrier(4)

        def work(i):
            local = np.random.default_rng([trial, i])
            barrier.wait()
            for _ in range(8):
                k, v = random_kv(local, 8, H, D), random_kv(local, 8, H, D)
                try:
                    cache.append(0, s, as_input(kind, k), as_input(kind, v))
                    with lock:
                        accepted.append((k, v))
                except fmkv.FmkvError as e:
                    if kind == "Cache" or "in use by another thread" not in str(e):
                        errors.append(e)
                    with lock:
                        refused_here[0] += 1
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        refused += refused_here[0]
        accepted_calls += len(accepted)
        assert cache.length(0, s) == 8 * len(accepted)
        if kind == "Cache":
            assert len(accepted) == 32
        check_pages(cache, [s], 64, config)
        k = np.concatenate([a for a, _ in accepted])
        v = np.concatenate([b for _, b in accepted])
        q = rng.standard_normal((1, H, D)).astype(np.float32)
        out = as_numpy(cache.attention(0, s, as_input(kind, q)))
        assert reference.rel_error(out, reference.attention(config, 0, k, v, q)) < 1e-5
    REPORT.append(f"{kind} threads on one sequence: {accepted_calls} appends accepted, {refused} refused as in use")


FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys, threading, warnings
    import numpy as np
    import fmkv
    warnings.simplefilter("ignore", DeprecationWarning)  # fork of a multi-threaded process: the point here

    cfg = fmkv.Config(head_dim=128, num_kv_heads=2, page_size=16, seed=5)
    rng = np.random.default_rng(7)
    k, v = (rng.standard_normal((600, 2, 128)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)

    def build():
        c = fmkv.Cache(cfg, 1, 64, 1, backend="cpu")
        s = c.add_sequence()
        c.append(0, s, k, v)
        return c, s

    cache, seq = build()
    expected = cache.attention(0, seq, q)  # the parent's thread pool is running now

    def child_same_cache(out):  # fork: the inherited cache, a fresh thread pool
        out.put(cache.attention(0, seq, q).tobytes())

    def child_new_cache(out):  # spawn (and fork): a cache built in the child
        c, s = build()
        out.put(c.attention(0, s, q).tobytes())

    def run(method, target):
        ctx = mp.get_context(method)
        out = ctx.Queue()
        p = ctx.Process(target=target, args=(out,))
        p.start()
        got = out.get(timeout=90)
        p.join(90)
        assert p.exitcode == 0, (method, p.exitcode)
        assert got == expected.tobytes(), method + ": child result differs"

    if __name__ == "__main__":
        busy = threading.Event()
        other, other_seq = build()  # (a cache busy in another thread at fork() is not usable in the child:
                                    # its lock may be held there -- docs/RELIABILITY.md)
        def hammer():  # the parent keeps using the pool from another thread while it forks
            while not busy.is_set():
                other.attention(0, other_seq, q)
        t = threading.Thread(target=hammer)
        t.start()
        try:
            for _ in range(3):
                run("fork", child_same_cache)
                run("fork", child_new_cache)
        finally:
            busy.set()
            t.join()
        run("spawn", child_new_cache)
        print("fork-ok")
""")


def test_thread_pool_in_fork_and_spawn_children(tmp_path):
    if not fmkv.backends()["cpu"]["available"]:
        pytest.skip("the cpu backend (with its thread pool) is not compiled into this build")
    if sys.platform == "win32":
        pytest.skip("fork does not exist on Windows")
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_SCRIPT)
    env = dict(os.environ, FMKV_NUM_THREADS="4")  # workers even on a 1-core machine
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "fork-ok" in r.stdout, r.stdout + r.stderr
    REPORT.append("thread pool: 6 forked children (3 with the parent's pool busy in another thread) and 1 spawned "
                  "child ran attention bit-identical to the parent")


def test_torch_cache_refuses_a_second_call_on_a_busy_sequence(rng, monkeypatch):
    """Deterministic version of the overlap: an append held inside its op (after the pages were
    reserved) makes every other change of that sequence, and an attention on it, an error; other
    sequences proceed; the held append then completes and the bookkeeping is whole."""
    import torch
    config = fmkv.Config(head_dim=D, num_kv_heads=H, page_size=PAGE, seed=int(rng.integers(2**63)))
    tc = make("TorchCache", config, 8, 2)
    s, other = tc.add_sequence(), tc.add_sequence()
    k = torch.from_numpy(random_kv(rng, 40, H, D))
    tc.append(0, s, k[:20], k[:20])
    inside, release = threading.Event(), threading.Event()
    store = tc._store_table

    def held_store(seq, first, new):  # runs inside append, outside the lock, with the pages reserved
        if seq == s and threading.current_thread().name == "holder":
            inside.set()
            release.wait(30)
        store(seq, first, new)

    monkeypatch.setattr(tc, "_store_table", held_store)
    t = threading.Thread(target=tc.append, args=(0, s, k[20:], k[20:]), name="holder")
    t.start()
    assert inside.wait(30)
    q = torch.from_numpy(rng.standard_normal((1, H, D)).astype(np.float32))
    for call in (lambda: tc.append(0, s, k[:1], k[:1]), lambda: tc.reset_sequence(s),
                 lambda: tc.remove_sequence(s), lambda: tc.attention(0, s, q)):
        with pytest.raises(fmkv.FmkvError, match=rf"sequence {s} is in use by another thread"):
            call()
    tc.append(0, other, k, k)  # another sequence is not held up
    tc.attention(0, other, q)
    release.set()
    t.join(30)
    assert not t.is_alive()
    assert tc.length(0, s) == 40 and tc.length(0, other) == 40
    check_pages(tc, [s, other], 8, config)
    # attentions on one sequence may overlap: one held inside its op does not block another
    inside.clear()
    release.clear()
    attention_op = torch.ops.fmkv.attention

    def held_attention(*a):
        if threading.current_thread().name == "reader":
            inside.set()
            release.wait(30)
        return attention_op(*a)

    monkeypatch.setattr(torch.ops.fmkv, "attention", held_attention)
    r = threading.Thread(target=tc.attention, args=(0, s, q), name="reader")
    r.start()
    assert inside.wait(30)
    out = tc.attention(0, s, q)  # a second reader of the same sequence
    with pytest.raises(fmkv.FmkvError, match="in use by another thread"):
        tc.append(0, s, k[:1], k[:1])  # but no writer while it reads
    release.set()
    r.join(30)
    monkeypatch.undo()
    assert torch.equal(out, tc.attention(0, s, q))

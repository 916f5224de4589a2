"""Stateful property test of the caches' bookkeeping (hypothesis): random interleavings of valid and
invalid appends, attentions, sequence additions and removals, and snapshots (a sequence saved and restored as a new
one; restores refused for want of a slot or pages, or of a damaged snapshot) against fmkv.Cache (host 'cpu'
backend, else 'ref') and fmkv.torch_ops.TorchCache (CPU tensors). After every step:

* the bookkeeping invariants hold: every page is either free or in exactly one live sequence's
  block table (none leaked, none shared), each table has exactly the pages its longest layer
  needs, the lengths are those of the accepted appends, used_bytes agrees, and for TorchCache the
  device-side tables (block-table rows, lengths) equal the host mirrors;
* a rejected call raised an FmkvError with the expected status and changed nothing;
* the attention of the sequence just touched equals a float64 model built from the accepted calls
  only (the format primitives quantize each accepted token; rel. error < 1e-5).

Bounded and seeded (FMKV_TEST_SEED overrides the seed); the counts are printed in the summary.
"""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed: pip install hypothesis")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test  # noqa: E402

import fmkv  # noqa: E402
from fmkv import _args, reference  # noqa: E402

import conftest  # noqa: E402

SEED = int(os.environ.get("FMKV_TEST_SEED", 34))
TOL = 1e-5
EXAMPLES, STEPS = 20, 50
APPEND_FAULTS = ["nan_k", "inf_v", "beyond_fp16", "float64", "wrong_heads", "wrong_dim", "rows_mismatch",
                 "bad_layer", "dead_seq", "float_seq", "not_tensor"]
ATTENTION_FAULTS = ["too_many_rows", "nan_q", "wrong_heads", "negative_softcap", "dead_seq", "str_scale",
                    "bad_layer"]


class Counts:
    def __init__(self):
        self.steps = self.invariants = self.attention_checks = self.rejected = self.accepted = 0
        self.restored = self.restores_refused = 0


COUNTS = {"fmkv.Cache": Counts(), "TorchCache": Counts()}


class Model:
    """What the cache must hold: the accepted token rows of every (sequence, layer), each with its
    fp16 value and its quantized-dequantized value (computed once with the format primitives)."""

    def __init__(self, config, num_layers, num_pages, max_seqs):
        self.c, self.L, self.P, self.S = config, num_layers, num_pages, max_seqs
        self.seqs = {}  # seq -> [per layer: list of (k16, kq, v16, vq) rows]

    def length(self, s, layer):
        return len(self.seqs[s][layer])

    def pages_for(self, length):
        comp = max(0, length - self.c.sink_tokens - self.c.window_tokens)
        return -(-comp // self.c.page_size)

    def table_len(self, s):
        return self.pages_for(max(self.length(s, l) for l in range(self.L)))

    def free_pages(self):
        return self.P - sum(self.table_len(s) for s in self.seqs)

    def append_needs(self, s, layer, n):
        return max(0, self.pages_for(self.length(s, layer) + n) - self.table_len(s))

    def accept(self, s, layer, k, v):
        c = self.c
        for t in range(k.shape[0]):
            row = []
            for x, bits in ((k[t], c.k_bits), (v[t], c.v_bits)):
                x16 = x.astype(np.float16)
                if bits == 16:
                    q = x16.astype(np.float64)
                else:
                    q = np.stack([fmkv.dequantize_vector(*fmkv.quantize_vector(x16[h], bits, c.seed, layer, c.scale_rule),
                                                         bits, c.seed, layer) for h in range(x16.shape[0])])
                row += [x16.astype(np.float64), q.astype(np.float64)]
            self.seqs[s][layer].append(tuple(row))

    def attention(self, s, layer, q, softmax_scale=None, softcap=0.0):
        rows, c = self.seqs[s][layer], self.c
        T = len(rows)
        comp_end = max(c.sink_tokens, T - c.window_tokens)
        quantized = [c.sink_tokens <= p < comp_end for p in range(T)]
        kf = np.stack([r[1] if qz else r[0] for r, qz in zip(rows, quantized)])
        vf = np.stack([r[3] if qz else r[2] for r, qz in zip(rows, quantized)])
        qf = q.astype(np.float64)
        R, HQ, d = qf.shape
        group = HQ // c.num_kv_heads
        scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
        out = np.empty((R, HQ, d))
        for hq in range(HQ):
            sc = qf[:, hq] @ kf[:, hq // group].T * scale
            if softcap > 0:
                sc = softcap * np.tanh(sc / softcap)
            sc = np.where(np.arange(T)[None, :] <= (T - R + np.arange(R))[:, None], sc, -np.inf)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            out[:, hq] = (p / p.sum(axis=1, keepdims=True)) @ vf[:, hq // group]
        return out


class HostAdapter:
    name = "fmkv.Cache"

    def __init__(self, config, L, P, S):
        self.c = fmkv.Cache(config, L, P, S, backend=fmkv.default_backend())

    def tensor(self, x):
        return x

    def append(self, layer, s, k, v):
        self.c.append(layer, s, k, v)

    def attention(self, layer, s, q, **kw):
        return self.c.attention(layer, s, q, **kw)

    def free_pages(self):
        return self.c.free_pages

    def table(self, s):
        return self.c.block_table(s)

    def length(self, layer, s):
        return self.c.length(layer, s)

    def extra_invariants(self, model):
        return 0


class TorchAdapter(HostAdapter):
    name = "TorchCache"

    def __init__(self, config, L, P, S):
        from fmkv import torch_ops
        self.torch = torch_ops.torch
        self.c = torch_ops.TorchCache(config, L, P, S)

    def tensor(self, x):
        return self.torch.from_numpy(x) if isinstance(x, np.ndarray) else x

    def attention(self, layer, s, q, **kw):
        out = self.c.attention(layer, s, q, **kw)
        return out.numpy() if hasattr(out, "numpy") else out

    def extra_invariants(self, model):
        # the device-side tables (here: CPU tensors) equal the host mirrors
        c, n = self.c, 0
        for s in model.seqs:
            table = c.block_table(s)
            assert c._bt[s, :len(table)].tolist() == table
            for layer in range(model.L):
                assert int(c._lens_dev[layer, s]) == model.length(s, layer)
            n += 1 + model.L
        assert not (set(c._free) & {p for s in model.seqs for p in c.block_table(s)})
        assert not c._writing and not c._reading and not c._failed
        return n + 2


def expect_error(status, fn, type_error=False):  # status: a name, or names joined by "|"
    with pytest.raises(fmkv.FmkvError) as ei:
        fn()
    assert ei.value.status in status.split("|"), f"{ei.value.status} != {status}: {ei.value}"
    if type_error:
        assert isinstance(ei.value, TypeError)
    return ei.value


class CacheMachine(RuleBasedStateMachine):
    adapter = HostAdapter

    @initialize(head_dim=st.sampled_from([64, 128]), heads=st.sampled_from([1, 2]),
                k_bits=st.sampled_from([2, 3, 4, 16]), v_bits=st.sampled_from([2, 3, 4]),
                sink=st.sampled_from([0, 0, 2]), window=st.sampled_from([0, 0, 3]),
                num_pages=st.integers(3, 12), max_seqs=st.integers(1, 3), cfg_seed=st.integers(0, 2**64 - 1))
    def setup(self, head_dim, heads, k_bits, v_bits, sink, window, num_pages, max_seqs, cfg_seed):
        self.config = fmkv.Config(head_dim=head_dim, num_kv_heads=heads, k_bits=k_bits, v_bits=v_bits, page_size=16,
                                  sink_tokens=sink, window_tokens=window, seed=cfg_seed)
        self.L = 2
        self.cache = self.adapter(self.config, self.L, num_pages, max_seqs)
        self.model = Model(self.config, self.L, num_pages, max_seqs)
        self.rng = np.random.default_rng(cfg_seed)
        self.touched = None
        self.counts = COUNTS[self.adapter.name]

    # ---- helpers -----------------------------------------------------------------------------
    def rows(self, n, heads=None, d=None):
        return conftest.random_kv(self.rng, n, heads or self.config.num_kv_heads, d or self.config.head_dim)

    def dead_id(self):
        return next(s for s in range(-2, self.model.S + 3) if s not in self.model.seqs)

    def reject(self, status, fn, type_error=False):
        expect_error(status, fn, type_error)
        self.counts.rejected += 1

    # ---- steps ----------------------------------------------------------------------------------
    # One rule draws the step from a fixed mix (hypothesis' own rule choice runs whole examples with
    # some rules switched off, which here would mostly mean runs without appends).
    OPS = ["append"] * 5 + ["attention"] * 3 + ["add_sequence", "remove_sequence"] + ["snapshot"] * 2

    @rule(data=st.data())
    def step(self, data):
        ops = [op for op in self.OPS if op not in ("append", "attention", "reset_sequence", "snapshot") or self.model.seqs]
        if not any(self.model.length(s, l) for s in self.model.seqs for l in range(self.L)):
            ops = [op for op in ops if op != "attention"]
        if len(self.model.seqs) == self.model.S:
            ops = [op for op in ops if op != "add_sequence"]
        getattr(self, data.draw(st.sampled_from(ops)))(data)

    def append(self, data):
        n = data.draw(st.integers(0, 24))
        fault = data.draw(st.sampled_from([None] * 16 + APPEND_FAULTS))
        self.counts.steps += 1
        s = data.draw(st.sampled_from(sorted(self.model.seqs)))
        layer = data.draw(st.integers(0, self.L - 1))
        k, v = self.rows(n), self.rows(n)
        T = self.cache.tensor
        if fault is None:
            if self.model.append_needs(s, layer, n) > self.model.free_pages():
                self.reject("OUT_OF_RANGE", lambda: self.cache.append(layer, s, T(k), T(v)))
                return
            self.cache.append(layer, s, T(k), T(v))
            self.model.accept(s, layer, k, v)
            self.touched = (s, layer)
            self.counts.accepted += 1
            return
        n = max(n, 1)
        k, v = self.rows(n), self.rows(n)
        pages_short = self.model.append_needs(s, layer, n) > self.model.free_pages()
        value_fault = fault in ("nan_k", "inf_v", "beyond_fp16")
        if fault == "nan_k":
            k[data.draw(st.integers(0, n - 1)), 0, data.draw(st.integers(0, self.config.head_dim - 1))] = np.nan
        elif fault == "inf_v":
            v[n - 1, -1, 0] = -np.inf
        elif fault == "beyond_fp16":
            k[0, 0, 1] = 7e4
        args = [layer, s, T(k), T(v)]
        status, type_error = ("OUT_OF_RANGE" if pages_short else "NON_FINITE") if value_fault else "INVALID_ARGUMENT", False
        if fault == "float64":
            args[2] = T(k.astype(np.float64))
        elif fault == "wrong_heads":
            args[3] = T(self.rows(n, heads=self.config.num_kv_heads + 1))
        elif fault == "wrong_dim":
            args[2] = T(self.rows(n, d=32))
        elif fault == "rows_mismatch":
            args[3] = T(self.rows(n + 1))
        elif fault == "bad_layer":
            args[0], status = self.L, "OUT_OF_RANGE"
        elif fault == "dead_seq":
            args[1], status = self.dead_id(), "OUT_OF_RANGE"
        elif fault == "float_seq":
            args[1], type_error = float(s), True
        elif fault == "not_tensor":  # a ragged list for fmkv.Cache, a numpy array for TorchCache
            if self.adapter is HostAdapter:
                args[2] = [[1.0, 2.0], [3.0]]
            else:
                args[2], type_error = k, True
        self.reject(status, lambda: self.cache.append(*args), type_error)

    def attention(self, data):
        fault = data.draw(st.sampled_from([None] * 8 + ATTENTION_FAULTS))
        self.counts.steps += 1
        s, layer = data.draw(st.sampled_from([(s, l) for s in sorted(self.model.seqs) for l in range(self.L)
                                              if self.model.length(s, l)]))
        length, H = self.model.length(s, layer), self.config.num_kv_heads
        rows = data.draw(st.integers(1, min(length, 3)))
        q = self.rng.standard_normal((rows, H * data.draw(st.sampled_from([1, 2])), self.config.head_dim)).astype(np.float32)
        T = self.cache.tensor
        if fault is None:
            softcap = data.draw(st.sampled_from([0.0, 0.0, 5.0]))
            out = self.cache.attention(layer, s, T(q), softcap=softcap)
            assert reference.rel_error(out, self.model.attention(s, layer, q, softcap=softcap)) < TOL
            self.counts.accepted += 1
            self.counts.attention_checks += 1
            return
        args, kw, status, type_error = [layer, s, T(q)], {}, "INVALID_ARGUMENT", False
        if fault == "too_many_rows":
            args[2] = T(self.rng.standard_normal((length + 1, H, self.config.head_dim)).astype(np.float32))
        elif fault == "nan_q":
            q[0, 0, 0] = np.nan
            status = "NON_FINITE"
        elif fault == "wrong_heads":
            args[2] = T(self.rng.standard_normal((1, H + 1 if H > 1 else 3, self.config.head_dim)).astype(np.float32))
            if H == 1:  # any head count is a multiple of 1: use a wrong head_dim instead
                args[2] = T(self.rng.standard_normal((1, 1, 32)).astype(np.float32))
        elif fault == "negative_softcap":
            kw["softcap"] = -1.0
        elif fault == "dead_seq":
            args[1], status = self.dead_id(), "OUT_OF_RANGE"
        elif fault == "str_scale":
            kw["softmax_scale"], type_error = "0.1", True
        elif fault == "bad_layer":
            args[0], status = -1, "OUT_OF_RANGE"
        self.reject(status, lambda: self.cache.attention(*args, **kw), type_error)

    def add_sequence(self, data):
        self.counts.steps += 1
        s = self.cache.c.add_sequence()
        assert s not in self.model.seqs and 0 <= s < self.model.S
        self.model.seqs[s] = [[] for _ in range(self.L)]
        self.counts.accepted += 1

    def remove_sequence(self, data):
        how = data.draw(st.sampled_from(["live", "live", "dead", "float", "full"]))
        self.counts.steps += 1
        live = sorted(self.model.seqs)
        if how in ("live", "full") and live and not (how == "full" and len(live) == self.model.S):
            s = data.draw(st.sampled_from(live))
            self.cache.c.remove_sequence(s)
            del self.model.seqs[s]
            self.counts.accepted += 1
        elif how == "full" and len(live) == self.model.S:  # no free slot: add_sequence is refused
            self.reject("OUT_OF_RANGE", self.cache.c.add_sequence)
        elif how == "float":
            self.reject("INVALID_ARGUMENT", lambda: self.cache.c.remove_sequence(0.0), type_error=True)
        else:
            self.reject("OUT_OF_RANGE", lambda: self.cache.c.remove_sequence(self.dead_id()))

    def snapshot(self, data):
        """Save a sequence whose layers hold the same tokens (its whole state) and restore it as a new one: accepted
        when a slot and its pages are free (the model copies its rows), else OUT_OF_RANGE; a snapshot with one bit
        flipped is refused. Refused restores change nothing (the invariants check)."""
        m = self.model
        even = [s for s in sorted(m.seqs) if len({m.length(s, l) for l in range(self.L)}) == 1]
        if not even:
            return
        s = data.draw(st.sampled_from(even))
        how = data.draw(st.sampled_from(["restore", "restore", "restore", "damaged"]))
        self.counts.steps += 1
        b = self.cache.c.save_bytes(s)
        if how == "damaged":
            bad = bytearray(b)
            bad[data.draw(st.integers(0, len(bad) - 1))] ^= 1 << data.draw(st.integers(0, 7))
            # a damaged version field is UNSUPPORTED (checked before the checksums), anything else INVALID_ARGUMENT
            self.reject("INVALID_ARGUMENT|UNSUPPORTED", lambda: self.cache.c.restore(bytes(bad)))
            self.counts.restores_refused += 1
        elif len(m.seqs) == m.S or m.table_len(s) > m.free_pages():
            self.reject("OUT_OF_RANGE", lambda: self.cache.c.restore(b))
            self.counts.restores_refused += 1
        else:
            s2 = self.cache.c.restore(b)
            assert s2 not in m.seqs and 0 <= s2 < m.S
            m.seqs[s2] = [list(rows) for rows in m.seqs[s]]
            self.touched = (s2, 0) if m.length(s2, 0) else None
            self.counts.accepted += 1
            self.counts.restored += 1

    # ---- after every step ----------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "model"):
            return
        m, c, n = self.model, self.cache, 0
        pages = []
        for s in m.seqs:
            t = c.table(s)
            assert len(t) == m.table_len(s), f"sequence {s}: {len(t)} pages, needs {m.table_len(s)}"
            pages += t
            for layer in range(m.L):
                assert c.length(layer, s) == m.length(s, layer)
            n += 1 + m.L
        assert len(set(pages)) == len(pages), "a page is in two block tables (or twice in one)"
        assert all(0 <= p < m.P for p in pages)
        assert c.free_pages() == m.P - len(pages) == m.free_pages(), "pages leaked"
        assert c.c.used_bytes == m.L * (len(pages) * self.config.page_bytes + self.config.fp16_slot_bytes * len(m.seqs))
        n += 4 + c.extra_invariants(m)
        self.counts.invariants += n

    @invariant()
    def attention_of_a_sequence(self):
        """The sequence just appended to, else one of the others in turn, against the model."""
        if not hasattr(self, "model"):
            return
        cands = [(s, l) for s in sorted(self.model.seqs) for l in range(self.L) if self.model.length(s, l)]
        if not cands:
            return
        s, layer = self.touched if self.touched in cands else cands[self.counts.steps % len(cands)]
        self.touched = None
        q = self.rng.standard_normal((1, self.config.num_kv_heads, self.config.head_dim)).astype(np.float32)
        out = self.cache.attention(layer, s, self.cache.tensor(q))
        assert reference.rel_error(out, self.model.attention(s, layer, q)) < TOL
        self.counts.attention_checks += 1
        self.counts.invariants += 1


class TorchCacheMachine(CacheMachine):
    adapter = TorchAdapter
    OPS = CacheMachine.OPS + ["reset_sequence"]

    def reset_sequence(self, data):
        self.counts.steps += 1
        s = data.draw(st.sampled_from(sorted(self.model.seqs)))
        self.cache.c.reset_sequence(s)
        self.model.seqs[s] = [[] for _ in range(self.L)]
        self.counts.accepted += 1


def run_machine(machine):
    hypothesis.seed(SEED)(machine)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None, derandomize=False,
        suppress_health_check=list(HealthCheck), print_blob=True))
    counts = COUNTS[machine.adapter.name]
    conftest.REPORT.append(
        f"{machine.adapter.name} state machine (seed {SEED}): {EXAMPLES} runs, {counts.steps} steps "
        f"({counts.accepted} accepted, {counts.rejected} rejected calls), {counts.invariants} invariant checks, "
        f"{counts.attention_checks} attention comparisons with the model, {counts.restored} snapshot restores "
        f"({counts.restores_refused} refused)")
    assert counts.steps >= EXAMPLES * STEPS // 2 and counts.rejected > 0 and counts.attention_checks > 0
    assert counts.restored > 0 and counts.restores_refused > 0


def test_cache_state_machine():
    run_machine(CacheMachine)


def test_torch_cache_state_machine():
    pytest.importorskip("torch", reason="torch is not installed: pip install torch to test TorchCache")
    run_machine(TorchCacheMachine)


# ---- TorchCache: the cases and the device-error contract (exercised here on the CPU) ----
def torch_cache(config, *args):
    torch_ops = pytest.importorskip("fmkv.torch_ops", reason="torch is not installed: pip install torch")
    return torch_ops.TorchCache(config, *args)


def test_torch_cache_failed_append_returns_its_pages(rng):
    import torch
    c = fmkv.Config(head_dim=64, num_kv_heads=1, page_size=16, seed=9)
    tc = torch_cache(c, 1, 63, 2)
    a, b = tc.add_sequence(), tc.add_sequence()
    k = torch.from_numpy(conftest.random_kv(rng, 900, 1, 64))
    bad = k.clone()
    bad[899, 0, 0] = float("nan")
    for args, status in [((bad, k), "NON_FINITE"), ((k.double(), k), "INVALID_ARGUMENT"),
                         ((k.numpy(), k), "INVALID_ARGUMENT"), ((k[:, None, 0].expand(900, 2, 64), k), "INVALID_ARGUMENT"),
                         ((k, k[:899]), "INVALID_ARGUMENT")]:
        e = expect_error(status, lambda: tc.append(0, a, *args))
        assert tc.free_pages == 63 and tc.block_table(a) == [] and tc.length(0, a) == 0, e
        assert int(tc._lens_dev[0, a]) == 0
    with pytest.raises(fmkv.FmkvTypeError, match="k must be a torch.Tensor, got ndarray"):
        tc.append(0, a, k.numpy(), k.numpy())
    full = torch.from_numpy(conftest.random_kv(rng, 63 * 16, 1, 64))
    tc.append(0, b, full, full)
    assert tc.free_pages == 0 and sorted(tc.block_table(b)) == list(range(63))
    expect_error("OUT_OF_RANGE", lambda: torch_cache(c, 1, 1, 10**9))


def test_torch_cache_device_error_contract(rng, monkeypatch):
    """check() after a device-detected error (simulated: on the CPU the ops raise at once) marks
    the sequences changed since the previous check failed; their calls raise until reset or
    removal; the others, and the rest of the cache, stay usable."""
    import torch
    c = fmkv.Config(head_dim=64, num_kv_heads=2, page_size=16, window_tokens=4, seed=4)
    tc = torch_cache(c, 2, 12, 3)
    a, b, d = (tc.add_sequence() for _ in range(3))
    k = torch.from_numpy(conftest.random_kv(rng, 30, 2, 64))
    q = torch.from_numpy(rng.standard_normal((1, 2, 64)).astype(np.float32))
    tc.append(0, a, k, k)
    tc.check()  # nothing recorded: a is settled
    tc.append(1, b, k, k)
    tc.append(0, d, k[:3], k[:3])
    before = tc.attention(0, a, q)

    def device_error(backend):
        raise _args.error("batch: sequence 0: k[3][0][1] is NaN (simulated device error)", "NON_FINITE")

    monkeypatch.setattr(fmkv._fmkv, "synchronize", device_error)
    with pytest.raises(fmkv.FmkvError, match="simulated") as ei:
        tc.check()
    assert ei.value.status == "NON_FINITE"
    monkeypatch.undo()
    assert set(tc.failed_sequences) == {b, d}
    for s in (b, d):
        expect_error("BACKEND", lambda: tc.attention(0, s, q))
        expect_error("BACKEND", lambda: tc.append(1, s, k[:1], k[:1]))
    assert torch.equal(tc.attention(0, a, q), before)
    tc.append(1, a, k, k)  # the healthy sequence keeps working
    tc.reset_sequence(b)
    assert tc.length(1, b) == 0 and tc.block_table(b) == [] and b not in tc.failed_sequences
    tc.remove_sequence(d)
    assert tc.failed_sequences == {}
    assert tc.free_pages == 12 - len(tc.block_table(a))
    tc.append(1, b, k, k)
    tc.check()
    assert torch.equal(tc.attention(1, b, q), tc.attention(1, a, q))  # same tokens, same layer

"""Snapshots from Python (fmkv.snapshot over include/fmkv/io.h): fmkv.Cache and fmkv.torch_ops.TorchCache save sequences
to files or bytes and restore them; fmkv.Snapshot reads a file's config, sequences and layers.

Checked on fresh random data: a restored sequence attends bit for bit like the original (formats 2 and 3, scale
groups 32 and 64, fp16 sink / window, fp16 K) and keeps appending like it; both caches write the same bytes for
the same tokens and read each other's files; prefixes (the dequantized-window rule); refused inputs (another
config field, layer count, corrupted or truncated files, bad arguments) raise FmkvError naming the problem and
leave the cache as it was."""
import dataclasses
import os

import numpy as np
import pytest

import fmkv

CONFIGS = [
    dict(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=4, page_size=16, sink_tokens=4, window_tokens=16),
    dict(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, format_version=3, seed=7),
    dict(head_dim=128, num_kv_heads=1, k_bits=4, v_bits=2, page_size=32, scale_group=64, window_tokens=8),
    dict(head_dim=64, num_kv_heads=2, k_bits=16, v_bits=3, page_size=16, format_version=3, sink_tokens=2),
]


def rows(rng, n, cfg):
    return (rng.standard_normal((n, cfg.num_kv_heads, cfg.head_dim)) * 2).astype(np.float32)


def filled(cfg, lengths, rng, layers=2, pages=64, seqs=4):
    c = fmkv.Cache(cfg, layers, pages, seqs)
    ids, data = [], []
    for n in lengths:
        s = c.add_sequence()
        kv = [(rows(rng, n, cfg), rows(rng, n, cfg)) for _ in range(layers)]
        for layer, (k, v) in enumerate(kv):
            c.append(layer, s, k, v)
        ids.append(s)
        data.append(kv)
    return c, ids, data


def same_answers(a, sa, b, sb, cfg, rng, layers=2):
    q = rng.standard_normal((2, 2 * cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
    for layer in range(layers):
        assert a.length(layer, sa) == b.length(layer, sb)
        assert np.array_equal(a.attention(layer, sa, q), b.attention(layer, sb, q))


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_cache_round_trip(tmp_path, ci):
    rng = np.random.default_rng(100 + ci)
    cfg = fmkv.Config(**CONFIGS[ci])
    c, ids, data = filled(cfg, [75, 140], rng)
    path = tmp_path / "two.fmkv"
    c.save(path, [ids[1], ids[0]])  # file order is the list's
    snap = fmkv.Snapshot.load(path)
    recorded = dataclasses.replace(cfg, format_version=cfg.format_version or fmkv.format_version())  # 0 resolved
    assert snap.config == recorded and snap.num_layers == 2 and snap.num_seqs == 2 and snap.mapped
    assert [q.num_tokens for q in snap.sequences] == [140, 75] and snap.file_version == fmkv.snapshot.FILE_VERSION
    assert snap.format_version == (cfg.format_version or fmkv.format_version()) and not snap.has_dequantized
    # into another cache (with a sequence already there) from the file, and from bytes
    other, _, _ = filled(cfg, [30], rng, pages=80)
    free = other.free_pages
    s1 = other.restore(path, 1)
    s0 = other.restore(c.save_bytes(ids[1]))
    assert other.free_pages == free - len(c.block_table(ids[0])) - len(c.block_table(ids[1]))
    same_answers(c, ids[0], other, s1, cfg, rng)
    same_answers(c, ids[1], other, s0, cfg, rng)
    # it keeps appending like the original
    k, v = rows(rng, 9, cfg), rows(rng, 9, cfg)
    for layer in range(2):
        c.append(layer, ids[0], k, v)
        other.append(layer, s1, k, v)
    same_answers(c, ids[0], other, s1, cfg, rng)
    # a whole cache from the file; the same bytes saved again
    whole = fmkv.Cache.from_snapshot(path, extra_pages=3, extra_seqs=1)
    assert whole.free_pages == 3 and whole.add_sequence() == 2
    assert whole.save_bytes([0, 1]) == path.read_bytes()


def test_layers_are_read_only_views_that_keep_the_snapshot():
    rng = np.random.default_rng(3)
    cfg = fmkv.Config(**CONFIGS[0])
    c, ids, _ = filled(cfg, [100], rng)
    snap = fmkv.Snapshot.load(c.save_bytes(ids))
    rl, pages, fk, fv = snap.layer(1)
    assert rl == 1 and pages.dtype == np.uint8 and pages.shape == (snap.file_pages, cfg.page_bytes)
    assert fk.dtype == np.float16 and fk.shape == (1, cfg.num_kv_heads, 20, cfg.head_dim) and fv.shape == fk.shape
    with pytest.raises(ValueError):
        pages[0, 0] = 1
    seq = snap.sequence(0)
    del snap
    assert pages[seq.block_table].shape[0] == len(seq.block_table) and np.isfinite(fk.astype(np.float32)).all()
    with pytest.raises(fmkv.FmkvError, match="outside"):
        fmkv.Snapshot.load(c.save_bytes(ids)).layer(2)
    assert fmkv.Snapshot.load(c.save_bytes(ids), mmap=False).sequence(0) == seq
    no_fp16 = filled(fmkv.Config(**CONFIGS[1]), [40], rng)[0]  # a config without sink or window tokens
    assert fmkv.Snapshot.load(no_fp16.save_bytes(0)).layer(0)[2] is None


def test_prefix_and_the_window(tmp_path):
    rng = np.random.default_rng(4)
    cfg = fmkv.Config(**CONFIGS[0])  # 4 sink + 16 window tokens
    c, ids, data = filled(cfg, [120], rng)
    # a prefix whose window tokens were compressed since: refused unless allowed, then flagged
    with pytest.raises(fmkv.FmkvError, match="(?i)dequantized|window"):
        c.save_bytes(ids, num_tokens=60)
    b = c.save_bytes(ids, num_tokens=60, allow_dequantized=True)
    snap = fmkv.Snapshot.load(b)
    assert snap.has_dequantized and snap.sequence(0).num_tokens == 60 and snap.sequence(0).dequantized_tokens > 0
    with pytest.raises(fmkv.FmkvError, match="(?i)dequantized"):
        fmkv.Snapshot.load(b, reject_dequantized=True)
    # the restored prefix attends like a cache that holds only those tokens, within the codes' error
    pre = fmkv.Cache(cfg, 2, 64, 2)
    sp = pre.add_sequence()
    for layer, (k, v) in enumerate(data[0]):
        pre.append(layer, sp, k[:60], v[:60])
    r = fmkv.Cache(cfg, 2, 64, 2)
    sr = r.restore(b)
    q = rng.standard_normal((1, 4, cfg.head_dim)).astype(np.float32)
    a, e = r.attention(0, sr, q), pre.attention(0, sp, q)
    assert np.linalg.norm(a - e) / np.linalg.norm(e) < 0.2
    # a prefix outside the window is exact: the same bytes as saving that many appended tokens
    assert c.save_bytes(ids, num_tokens=cfg.sink_tokens) == pre_bytes(cfg, data[0], cfg.sink_tokens)


def pre_bytes(cfg, kv, n):
    c = fmkv.Cache(cfg, 2, 64, 1)
    s = c.add_sequence()
    for layer, (k, v) in enumerate(kv):
        c.append(layer, s, k[:n], v[:n])
    return c.save_bytes(s)


@pytest.mark.parametrize("field,value", [("seed", 1), ("format_version", 3), ("scale_group", 64), ("k_bits", 4),
                                         ("window_tokens", 8)])
def test_restore_refuses_another_config(field, value):
    rng = np.random.default_rng(5)
    base = dict(head_dim=64, num_kv_heads=2, k_bits=3, v_bits=3, page_size=16, sink_tokens=2, window_tokens=16)
    c, ids, _ = filled(fmkv.Config(**base), [90], rng)
    b = c.save_bytes(ids)
    other, oids, _ = filled(fmkv.Config(**{**base, field: value}), [20], rng)
    free = other.free_pages
    with pytest.raises(fmkv.FmkvError, match=field):
        other.restore(b)
    assert other.free_pages == free and other.add_sequence() == 1  # nothing changed, no slot left behind
    with pytest.raises(fmkv.FmkvError, match="layers"):
        filled(fmkv.Config(**base), [5], rng, layers=3)[0].restore(b)


def test_refused_files_and_arguments(tmp_path):
    rng = np.random.default_rng(6)
    cfg = fmkv.Config(**CONFIGS[0])
    c, ids, _ = filled(cfg, [100], rng)
    b = c.save_bytes(ids)
    target, _, _ = filled(cfg, [10], rng, pages=8)
    free = target.free_pages
    bad = bytearray(b)
    bad[len(bad) // 2] ^= 0x40
    for data, what in ((bytes(bad), "checksum"), (b[:len(b) // 2], "truncated"), (b"", "truncated|header"),
                       (b + b"\0", "trailing")):
        with pytest.raises(fmkv.FmkvError, match=what):
            target.restore(data)
    p = tmp_path / "bad.fmkv"
    p.write_bytes(bytes(bad))
    with pytest.raises(fmkv.FmkvError, match="checksum"):
        target.restore(p)
    with pytest.raises(fmkv.FmkvError):
        target.restore(tmp_path / "missing.fmkv")
    with pytest.raises(fmkv.FmkvError, match="out of pages"):
        fmkv.Cache(cfg, 2, 2, 2).restore(b)
    with pytest.raises(fmkv.FmkvError):
        target.restore(b, file_seq=1)
    with pytest.raises(fmkv.FmkvTypeError):
        target.restore(12)
    assert target.free_pages == free and target.add_sequence() == 1
    for call, what in ((lambda: c.save_bytes([]), "no sequence"), (lambda: c.save_bytes(3), "sequence"),
                       (lambda: c.save_bytes(ids, num_tokens=-2), "num_tokens"),
                       (lambda: c.save_bytes(ids, num_tokens=101), "num_tokens|prefix|length|tokens"),
                       (lambda: c.save(b"x", ids), "path")):
        with pytest.raises(fmkv.FmkvError, match=what):
            call()
    for bad in (True, 1.5, "0", None):
        with pytest.raises(fmkv.FmkvTypeError, match="seqs"):
            c.save_bytes(bad)
    # a failed save leaves no file behind; the directory must exist
    with pytest.raises(fmkv.FmkvError):
        c.save(tmp_path / "no" / "such" / "dir.fmkv", ids)
    assert sorted(os.listdir(tmp_path)) == ["bad.fmkv"]


torch = pytest.importorskip("torch", reason="TorchCache needs torch (pip install torch)")


def test_torch_cache_same_bytes_and_cross_restore(tmp_path):
    from fmkv.torch_cache import TorchCache

    rng = np.random.default_rng(7)
    for ci, kw in enumerate(CONFIGS):
        cfg = fmkv.Config(**kw)
        c, ids, data = filled(cfg, [130], rng)
        t = TorchCache(cfg, 2, 64, 3)
        t.add_sequence()  # a sequence before it: other slots and pages than the host cache's
        ts = t.add_sequence()
        for layer, (k, v) in enumerate(data[0]):
            t.append(layer, ts, torch.from_numpy(k), torch.from_numpy(v))
        assert t.save_bytes(ts) == c.save_bytes(ids), ci
        path = tmp_path / f"t{ci}.fmkv"
        t.save(path, [ts])
        s2 = c.restore(path)
        same_answers(c, ids[0], c, s2, cfg, rng)
        free = t.free_pages
        tr = t.restore(c.save_bytes(ids))
        assert t.free_pages == free - len(c.block_table(ids[0])) and t.length(1, tr) == 130
        q = rng.standard_normal((1, 2 * cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
        for layer in range(2):
            assert np.array_equal(t.attention(layer, tr, torch.from_numpy(q)).numpy(), c.attention(layer, ids[0], q))
        k, v = rows(rng, 5, cfg), rows(rng, 5, cfg)  # appends continue the same way
        for layer in range(2):
            t.append(layer, tr, torch.from_numpy(k), torch.from_numpy(v))
            c.append(layer, ids[0], k, v)
            assert np.array_equal(t.attention(layer, tr, torch.from_numpy(q)).numpy(), c.attention(layer, ids[0], q))


def test_torch_cache_from_snapshot(tmp_path):
    from fmkv.torch_cache import TorchCache

    rng = np.random.default_rng(9)
    cfg = fmkv.Config(**CONFIGS[1])
    c, ids, _ = filled(cfg, [70, 33], rng)
    c.save(tmp_path / "two.fmkv", ids)
    t = TorchCache.from_snapshot(tmp_path / "two.fmkv", extra_pages=2, extra_seqs=1)
    assert t.free_pages == 2 and t.config == fmkv.Snapshot.load(tmp_path / "two.fmkv").config
    assert t.save_bytes([0, 1]) == (tmp_path / "two.fmkv").read_bytes() and t.add_sequence() == 2


def test_torch_cache_refusals_change_nothing():
    from fmkv.torch_cache import TorchCache

    rng = np.random.default_rng(8)
    cfg = fmkv.Config(**CONFIGS[0])
    c, ids, _ = filled(cfg, [100], rng)
    b = c.save_bytes(ids)
    t = TorchCache(cfg, 2, 3, 2)
    s = t.add_sequence()
    with pytest.raises(fmkv.FmkvError, match="out of pages"):
        t.restore(b)
    with pytest.raises(fmkv.FmkvError, match="seed"):
        TorchCache(fmkv.Config(**{**CONFIGS[0], "seed": 9}), 2, 64, 2).restore(b)
    bad = bytearray(b)
    bad[100] ^= 1
    with pytest.raises(fmkv.FmkvError):
        t.restore(bytes(bad))
    assert t.free_pages == 3 and t.add_sequence() == s + 1
    with pytest.raises(fmkv.FmkvError, match="key_offset"):
        TorchCache(cfg, 2, 64, 2, key_offset=True).restore(b)
    ko = TorchCache(cfg, 2, 64, 2, key_offset=True)
    with pytest.raises(fmkv.FmkvError, match="key_offset"):
        ko.save_bytes(ko.add_sequence())
    with pytest.raises(fmkv.FmkvError, match="repeat"):
        t.save_bytes([s, s])

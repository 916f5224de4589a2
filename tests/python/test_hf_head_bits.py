"""fmkv.hf caches with widths per kv head (``head_bits``, fmkv.hf.head_groups; a ``fmkv-eval plan --per-head`` plan).

A layer whose kv heads have different (k_bits, v_bits) pairs is one fmkv layer per distinct pair over its heads.
Checked on the CPU (tiny random-weight Llama, 3 kv heads so that a layer can hold three groups):
* a group layer (dynamic and static) gives, bit for bit, the outputs, pages, fp16 regions and lengths of separate
  one-width layers fed its heads' K/V and its query heads (the gather / scatter adds nothing);
* through the model, every fused output equals fmkv.eval's per-head dequantize-then-attend on the same recorded
  K/V (what `fmkv-eval plan --per-head` evaluated is what the cache computes);
* FmkvStaticCache's greedy tokens and bytes equal FmkvCache's; byte accounting (bytes_per_sequence);
* errors: malformed head_bits, head_bits with layer_bits, a tensor with another head count, NaN in one head
  (refused before any group is touched: the cache is left as it was).
"""
import pytest

from conftest import import_hf  # noqa: E402

torch, transformers, fmkv, fhf = import_hf()

from hf_cases import CUDA_HEAD_BITS, HEAD_BITS  # noqa: E402
from hf_cases import decode_runs_agree, storage as _bytes, token_ids as _ids, tiny_model as _model  # noqa: E402
from fmkv.hf.cache import FmkvHeadGroupLayer  # noqa: E402
from fmkv.hf.static_cache import FmkvStaticHeadGroupLayer  # noqa: E402


def test_cache_structure_and_options():
    model = _model()
    cache = fhf.FmkvCache(model.config, head_bits=HEAD_BITS, max_cache_len=64)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["FmkvHeadGroupLayer", "FmkvLayer", "FmkvHeadGroupLayer"]
    assert [(p.k_bits, p.v_bits, h) for p, h in cache.layers[2].parts] == [(2, 3, [0]), (3, 3, [1]), (16, 4, [2])]
    assert [(p.k_bits, p.v_bits, h) for p, h in cache.layers[0].parts] == [(4, 4, [0, 2]), (3, 2, [1])]
    assert len(cache.fmkv_layers) == 2 + 1 + 3
    assert cache.options["head_bits"] == HEAD_BITS


@pytest.mark.parametrize("kw", [dict(window_tokens=0), dict(sink_tokens=2, window_tokens=8, page_size=16)])
def test_group_layer_equals_separate_layers(kw):
    """FmkvHeadGroupLayer == one FmkvLayer per width over its heads, bit for bit (outputs and bytes)."""
    pairs = [(4, 4), (3, 2), (4, 4)]
    parts = [(fhf.FmkvLayer(5, kb, vb, max_cache_len=96, seed=3, **kw), h)
             for (kb, vb), h in [((4, 4), [0, 2]), ((3, 2), [1])]]
    group = FmkvHeadGroupLayer(5, parts, 3, 2)
    alone = {pair: fhf.FmkvLayer(5, *pair, max_cache_len=96, seed=3, **kw) for pair in set(pairs)}
    heads = {(4, 4): [0, 2], (3, 2): [1]}
    qheads = {p: [h * 2 + j for h in hs for j in range(2)] for p, hs in heads.items()}
    g = torch.Generator().manual_seed(7)
    b, d = 2, 64
    for n in (20, 1, 1, 3, 1):
        k, v, q = (torch.randn(b, 3, n, d, generator=g), torch.randn(b, 3, n, d, generator=g),
                   torch.randn(b, 6, n, d, generator=g))
        group.update(k, v)
        out = group.attention(q, None, None)
        assert out.shape == (b, n, 6, d)
        for p, layer in alone.items():
            layer.update(k[:, heads[p]], v[:, heads[p]])
            ref = layer.attention(q[:, qheads[p]], None, None)
            assert torch.equal(out[:, :, qheads[p]], ref), p
    assert group.get_seq_length() == 26
    for part, _ in group.parts:
        for x, y in zip(_bytes(part), _bytes(alone[(part.k_bits, part.v_bits)])):
            assert torch.equal(x, y)


def test_static_group_layer_equals_separate_layers():
    kw = dict(max_cache_len=64, page_size=16, window_tokens=8, seed=2)
    parts = [(fhf.FmkvStaticLayer(1, k_bits=kb, v_bits=vb, **kw), h) for (kb, vb), h in [((2, 3), [0]),
                                                                                         ((16, 4), [1, 2])]]
    group = FmkvStaticHeadGroupLayer(1, parts, 3, 2)
    alone = [fhf.FmkvStaticLayer(1, k_bits=2, v_bits=3, **kw), fhf.FmkvStaticLayer(1, k_bits=16, v_bits=4, **kw)]
    heads, qheads = [[0], [1, 2]], [[0, 1], [2, 3, 4, 5]]
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(2, 3, 30, 64, generator=g), torch.randn(2, 3, 30, 64, generator=g)
    group.write(k, v)
    for layer, h in zip(alone, heads):
        layer.write(k[:, h], v[:, h])
    assert group.lengths() == [30, 30] and int(group.get_seq_length()) == 30
    for n in (1, 1, 2):
        k, v, q = (torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g),
                   torch.randn(2, 6, n, 64, generator=g))
        kk, vv = group.update(k, v)
        out = group.attention(q, kk, vv, None, None, None)
        for layer, h, qh in zip(alone, heads, qheads):
            ka, va = layer.update(k[:, h], v[:, h])
            assert torch.equal(out[:, :, qh], layer.attention(q[:, qh], ka, va, None, None, None))
    assert int(group.get_seq_length()) == 34  # one timeline, advanced once per step
    assert group.layers[1].cumulative_length is group.layers[0].cumulative_length
    for (part, _), layer in zip(group.parts, alone):
        for x, y in zip(_bytes(part), _bytes(layer)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("kw", [dict(window_tokens=0), dict(sink_tokens=2, window_tokens=8, page_size=16)])
def test_fused_outputs_equal_per_head_dequantize_then_attend(kw, monkeypatch):
    """Through the model, token by token: each group layer's output == fmkv.eval's dequantize-then-attend with
    the per-head widths (planned_quantizer(head_bits=...)) over the same recorded K/V, to float32 rounding."""
    from fmkv.eval import ppl as P
    from fmkv.eval.plan import planned_quantizer

    log = {}
    upd, att = FmkvHeadGroupLayer.update, FmkvHeadGroupLayer.attention

    def update(self, k, v, *a, **k2):
        log.setdefault(self.layer_idx, {"kv": [], "qo": []})["kv"].append((k.clone(), v.clone()))
        return upd(self, k, v, *a, **k2)

    def attention(self, q, scaling, softcap):
        out = att(self, q, scaling, softcap)
        log[self.layer_idx]["qo"].append((q.clone(), out.clone(), scaling))
        return out

    monkeypatch.setattr(FmkvHeadGroupLayer, "update", update)
    monkeypatch.setattr(FmkvHeadGroupLayer, "attention", attention)
    model = _model()
    ids = _ids(1, 30, 4)
    cache = fhf.FmkvCache(model.config, head_bits=HEAD_BITS, max_cache_len=64, prefill="compressed", **kw)
    with torch.no_grad():
        pkv = cache
        for t in range(ids.shape[1]):
            pkv = fhf.output_cache(model(ids[:, t:t + 1], **fhf.cache_kwargs(pkv), use_cache=True))
    assert sorted(log) == [0, 2] and all(len(r["qo"]) == 30 for r in log.values())
    q_cfg = planned_quantizer("heads", [], kw["window_tokens"], head_bits=HEAD_BITS)
    q_cfg.sinks = kw.get("sink_tokens", 0)

    class _Mod:
        pass

    worst = 0.0
    for layer, rec in log.items():
        mod = _Mod()
        mod.layer_idx = layer
        for t, (q, out, scaling) in enumerate(rec["qo"]):
            k = torch.cat([x[0] for x in rec["kv"][:t + 1]], dim=2)
            v = torch.cat([x[1] for x in rec["kv"][:t + 1]], dim=2)
            ref, _ = P.quantized_attention(mod, q, k, v, None, scaling=scaling, quantizer=q_cfg)
            worst = max(worst, (out - ref).abs().max().item() / max(1.0, ref.abs().max().item()))
    assert worst < 2e-5, worst


def test_static_generate_equals_dynamic_and_bytes():
    model = _model()
    ids = _ids(2, 21, 1)
    kw = dict(window_tokens=8, page_size=16)
    dyn = fhf.FmkvCache(model.config, head_bits=HEAD_BITS, max_cache_len=64, **kw)
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **fhf.cache_kwargs(dyn))
    b_, L = 2, 64
    st = fhf.FmkvStaticCache(model.config, max_cache_len=L, head_bits=HEAD_BITS, batch_size=b_, device="cpu", **kw)
    with torch.no_grad():
        b = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **fhf.cache_kwargs(st))
    assert torch.equal(a, b)
    assert st.lengths() == [26, 26]
    for ld, ls in zip(dyn.fmkv_layers, st.fmkv_layers):
        for x, y in zip(_bytes(ld), _bytes(ls)):
            assert torch.equal(x, y)
    # bytes: each width group is a layer of its own (pages, regions, index rows)
    from fmkv.torch_ops import FUSED_MAX_ROWS
    per_seq = fhf.FmkvStaticCache.bytes_per_sequence(model.config, L, head_bits=HEAD_BITS, **kw)
    assert st.device_bytes == b_ * per_seq + len(st.fmkv_layers) * (8 + 8 * (FUSED_MAX_ROWS + 1))
    assert dyn.resident_bytes == st.resident_bytes
    assert dyn.fp16_equivalent_bytes() == 2 * 2 * 3 * 64 * 26 * 2 * 3  # K+V, fp16, 3 kv heads, 2 seqs, 3 layers
    # compressed: the group layers hold less than the widest width everywhere would
    widest = fhf.FmkvStaticCache.bytes_per_sequence(model.config, L, layer_bits=[(4, 4), (3, 3), (16, 4)], **kw)
    assert per_seq < widest


def test_head_bits_errors():
    model = _model()
    cfg = model.config
    for hb, msg in ((HEAD_BITS[:2], "head_bits has 2 entries for a model of 3 layers"),
                    ([HEAD_BITS[0], [(3, 3)] * 2, HEAD_BITS[2]], r"head_bits\[1\] has 2 pairs for 3 kv heads"),
                    ([HEAD_BITS[0], [(3, 3), (3,), (3, 3)], HEAD_BITS[2]], r"head_bits\[1\]\[1\] = \(3,\) is not"),
                    ([HEAD_BITS[0], [(3, 3), (3, 3.0), (3, 3)], HEAD_BITS[2]], r"head_bits\[1\]\[1\]")):
        for cls in (fhf.FmkvCache, fhf.FmkvStaticCache):
            with pytest.raises(ValueError, match=msg):
                cls(cfg, max_cache_len=32, head_bits=hb)
    with pytest.raises(ValueError, match="head_bits and layer_bits both"):
        fhf.FmkvCache(cfg, head_bits=HEAD_BITS, layer_bits=[(4, 4)] * 3)
    with pytest.raises(ValueError, match="head_bits and boundary_layers both"):
        fhf.FmkvStaticCache(cfg, max_cache_len=32, head_bits=HEAD_BITS, boundary_layers=1)
    with pytest.raises(ValueError, match="head_bits and layer_bits both"):
        fhf.FmkvStaticCache.bytes_per_sequence(cfg, 32, head_bits=HEAD_BITS, layer_bits=[(4, 4)] * 3)
    # a width the format does not have: the group's fmkv.Config refuses it at allocation
    cache = fhf.FmkvCache(cfg, head_bits=[[(4, 4), (6, 2), (4, 4)]] + HEAD_BITS[1:], max_cache_len=32)
    with pytest.raises((fmkv.FmkvError, ValueError), match="bits"):
        with torch.no_grad():
            model(_ids(1, 4, 3), use_cache=True, **fhf.cache_kwargs(cache))


def test_nan_in_one_head_leaves_every_group_as_it_was():
    group = FmkvHeadGroupLayer(0, [(fhf.FmkvLayer(0, 4, 4, max_cache_len=64, window_tokens=4), [0, 2]),
                                   (fhf.FmkvLayer(0, 3, 2, max_cache_len=64, window_tokens=4), [1])], 3, 2)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(1, 3, 12, 64, generator=g), torch.randn(1, 3, 12, 64, generator=g)
    group.update(k, v)
    group.attention(torch.randn(1, 6, 12, 64, generator=g), None, None)
    before = [_bytes(p) for p in group.layers]
    for bad_head in (1, 2):  # in the second group, and in the first group's second head
        for what in ("k", "v"):
            k1, v1 = torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
            (k1 if what == "k" else v1)[0, bad_head, 0, 5] = float("nan")
            with pytest.raises(fmkv.FmkvError, match=f"{what.upper()} head {bad_head} holds NaN"):
                group.update(k1, v1)
            assert group.get_seq_length() == 12 and all(p.length == 12 for p in group.layers)
    k1 = torch.randn(1, 3, 1, 64, generator=g)
    k1[0, 0, 0, 0] = 7e4  # beyond fp16
    with pytest.raises(fmkv.FmkvError, match="beyond the fp16 range"):
        group.update(k1, k1)
    # a query with Inf in the second group's heads: refused before the first group's fused step
    group.update(torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g))
    q = torch.randn(1, 6, 1, 64, generator=g)
    q[0, 3, 0, 0] = float("inf")
    with pytest.raises(fmkv.FmkvError, match="query head 3 holds NaN, Inf"):
        group.attention(q, None, None)
    # as one FmkvLayer's failed fused step: the step's K/V dropped, every group back at 12 tokens
    assert group.get_seq_length() == 12 and all(p.length == 12 and p._pending is None for p in group.layers)
    with pytest.raises(ValueError, match="name 3 kv heads"):
        group.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    for p, b in zip(group.layers, before):
        for x, y in zip(_bytes(p), b):
            assert torch.equal(x, y)


def test_compiled_static_decode_step_equals_eager():
    """torch.compile(fullgraph=True) traces the group layers' decode step (gathers with the tables made at
    allocation, one call per group, the merge) and gives the eager step's tokens and bytes."""
    model = _model()
    decode_runs_agree(model, lambda: fhf.FmkvStaticCache(model.config, max_cache_len=40, head_bits=HEAD_BITS,
                                                         window_tokens=8, page_size=16),
                      _ids(2, 15, 6), 5, ("eager", "compiled"))


CUDA = torch.cuda.is_available() and fmkv.backends()["cuda"]["available"]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and an fmkv build with the 'cuda' backend")
def test_cuda_graph_capture_of_group_layers_replays_eager_tokens():
    """On CUDA: an eager decode step through group layers captured in one torch.cuda.CUDAGraph replays to the eager
    steps' tokens and bytes (no host sync: replays under set_sync_debug_mode("error")), with the groups on side
    streams (parallel branches of the graph)."""
    model = _model().to("cuda")
    decode_runs_agree(model, lambda: fhf.FmkvStaticCache(model.config, max_cache_len=48, head_bits=CUDA_HEAD_BITS,
                                                         window_tokens=8),
                      _ids(2, 19, 16).to("cuda"), 6, ("eager", "cuda_graph"))

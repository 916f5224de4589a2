"""The device-side diagnostic scripts under tests/cuda run on ncu / cuobjdump / benchmark output; here they
run on small synthetic inputs (ab.sh on stub benchmark binaries), so a format change breaks a test and not a
device session."""
import argparse
import csv
import importlib.util
import io
import json
import os
import pathlib
import contextlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "cuda" / (name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _source_csv(path, body):
    """An ncu `--page source --csv` file: kernel line, header, one row per SASS instruction."""
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_short_sb",
           "stall_wait (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "attn_kernel"])
        w.writerow(hdr)
        for addr, sass, wait, ssb in body:
            w.writerow(["0x%x" % addr, sass, wait + ssb, wait, ssb, 0])


def test_stall_by_phase_splits_the_tile_loop(tmp_path):
    body = [(0x100, "S2R R0, SR_TID.X", 5, 0)]
    a = 0x200
    loop_start = a
    for _ in range(31):  # loop top
        body.append((a, "IADD3 R1, R1, 0x1, RZ", 1, 0)); a += 16
    for k in range(8):  # K phase: decode + mma
        body.append((a, "PRMT R2, R3, R4, R5", 2, 0)); a += 16
        body.append((a, "HMMA.16816.F32 R4, R8, R12, R4", 0, 3)); a += 16
    body.append((a, "FMNMX R6, R6, R7, !PT", 1, 0)); a += 16
    body.append((a, "VOTE.ANY P0, P0", 1, 0)); a += 16
    for k in range(8):  # V phase
        body.append((a, "LOP3.LUT R2, R3, 0x3, RZ, 0xc0, !PT", 4, 0)); a += 16
        body.append((a, "HMMA.16816.F32 R16, R8, R12, R16", 0, 1)); a += 16
    body.append((a, "@P1 BRA 0x%x" % loop_start, 0, 0)); a += 16
    body.append((a, "EXIT", 9, 0))
    path = tmp_path / "src.csv"
    _source_csv(path, body)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _load("stall_by_phase").main(str(path))
    text = out.getvalue()
    total = sum(w + s for _, _, w, s in body)
    loop = sum(w + s for addr, _, w, s in body if loop_start <= addr < a)
    assert "warp-state samples %d" % total in text
    assert "tile loop: %d instructions, %.1f%% of the samples" % (len(body) - 2, 100 * loop / total) in text
    lines = {ln.split("  ")[0].strip(): ln for ln in text.splitlines()}
    # the loop top holds the instructions more than 30 before the first HMMA (index 32): 2 of the 31 IADD3
    assert "   2 instructions" in lines["loop top (entries, copies, waits)"]
    assert "  45 instructions" in lines["K decode + mma"]  # the other 29 IADD3, 8 PRMT + 8 HMMA
    assert "   2 instructions" in lines["scales + softmax"]
    assert "  17 instructions" in lines["V decode + mma"]
    # before the loop: the S2R (5 samples); after it: the EXIT (9)
    assert "    1 instructions %5.1f%% of samples: wait" % (100 * 5 / total) in lines["prologue"]
    assert "    1 instructions %5.1f%% of samples: wait" % (100 * 9 / total) in lines["after the loop"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _load("stall_by_phase").main(str(path), 1)
    assert "top 1 prologue instructions" in out.getvalue() and "S2R R0, SR_TID.X" in out.getvalue()


def _sass_kernel(name, before, after):
    """A cuobjdump -sass listing of one kernel: `before` filler instructions, a tile loop (6 HMMA and a
    backward branch), `after` filler instructions."""
    ins = ["MOV R1, c[0x0][0x28]"] * before
    top = 16 * len(ins)
    ins += ["PRMT R2, R3, 0x7610, R4", "HMMA.16816.F32 R4, R8, R12, R4"] * 6 + ["@P0 BRA 0x%x" % top]
    ins += ["FADD R5, R5, R6"] * after + ["EXIT"]
    body = "\n".join("        /*%04x*/                   %s ;" % (16 * i, x) for i, x in enumerate(ins))
    return "\n\tcode for sm_90\n\t\tFunction : %s\n\t.headerflags\t@\"EF_CUDA_SM90\"\n%s\n" % (name, body)


def test_tile_loop_check_flags_a_loop_laid_out_late():
    tl = _load("tile_loop_check")
    name = "_ZN4fmkv4cuda11attn_kernelILi128ELi3ELi3ELi64EEEvNS0_10AttnParamsE"
    lines, n, bad = tl.check_sass(_sass_kernel(name, 10, 80))
    assert (n, bad) == (1, 0), lines
    assert "d128 k3v3 page 64" in lines[0] and "13 instructions" in lines[0] and "6 HMMA" in lines[0]
    assert "at 10%" in lines[0] and "<--" not in lines[0]
    lines, n, bad = tl.check_sass(_sass_kernel(name, 80, 10))
    assert (n, bad) == (1, 1), lines
    assert "tile loop laid out after 77% of the kernel's code" in lines[0]
    # a loop that spills is flagged too; a listing without attn_kernel checks nothing
    spill = _sass_kernel(name, 10, 80).replace("PRMT R2, R3, 0x7610, R4", "LDL R2, [R1+0x10]", 1)
    assert tl.check_sass(spill)[1:] == (1, 1)
    assert tl.check_sass(_sass_kernel("_Z5otherv", 10, 80)) == ([], 0, 0)


def test_ab_table_best_of_each_variant(tmp_path):
    rec = lambda v, r: json.dumps({"variant": v, "r": r})
    dec = lambda t: {"kind": "decode", "k_bits": 3, "v_bits": 3, "batch": 1, "context": 4096, "time_us": t}
    step = lambda f, s: {"kind": "step", "k_bits": 4, "v_bits": 4, "batch": 1, "context": 4096, "window": 64,
                         "fused_us": f, "separate_us": s}
    path = tmp_path / "ab.jsonl"
    path.write_text("\n".join([rec("old", dec(16.0)), rec("new", dec(12.5)), rec("old", dec(15.0)),
                               rec("new", step(10.0, 20.0)), rec("old", step(12.0, 18.0)),
                               rec("old", dict(dec(40.0), kv_heads=1)), rec("new", dict(dec(10.0), kv_heads=1)),
                               rec("old", {"kind": "quantize", "k_bits": 3, "v_bits": 3, "tokens": 32768, "head_dim": 128,
                                           "time_us": 120.0}),
                               rec("new", {"kind": "quantize", "k_bits": 3, "v_bits": 3, "tokens": 32768, "head_dim": 128,
                                           "time_us": 100.0}),
                               rec("old", {"kind": "quantize", "k_bits": 3, "v_bits": 3, "tokens": 32768, "head_dim": 128,
                                           "time_us": 190.0, "format_version": 3}),
                               rec("new", {"kind": "quantize", "k_bits": 3, "v_bits": 3, "tokens": 32768, "head_dim": 128,
                                           "time_us": 152.0, "format_version": 3})]) + "\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv, sys.argv = sys.argv, ["ab_table.py", str(path)]
        try:
            _load("ab_table").main()
        finally:
            sys.argv = argv
    key = lambda ln: " ".join(t for t in ln.split() if "." not in t)  # the case's words (times have a ".")
    lines = {key(ln): ln.split() for ln in out.getvalue().splitlines()[1:]}
    assert lines["decode k3v3 f2 1 4096 0"][-3:] == ["15.00", "12.50", "1.200"]  # best of 2 for "old"
    assert lines["step k4v4 f2 1 4096 64 fused"][-3:] == ["12.00", "10.00", "1.200"]
    assert lines["step k4v4 f2 1 4096 64 separate"][-3:] == ["18.00", "20.00", "0.900"]
    assert lines["decode k3v3 f2 1 4096 0 kv1"][-3:] == ["40.00", "10.00", "4.000"]  # other kv head counts apart
    assert lines["quantize k3v3 f2 32768 128"][-3:] == ["120.00", "100.00", "1.200"]  # a prefill chunk's quantize-append
    assert lines["quantize k3v3 f3 32768 128"][-3:] == ["190.00", "152.00", "1.250"]  # format versions kept apart


def test_trace_sm_groups_calls_and_ctas_by_sm(tmp_path):
    """Two traced calls in one file are told apart, and an SM holding 3 split CTAs whose loops take 30 us
    is reported apart from SMs holding 4 (40 us)."""
    mod = _load("trace_sm")

    def row(cta, sm, loop, bits=3, kernel=0, role="split"):
        return json.dumps({"label": "attention", "batch": 1, "context": 4096, "k_bits": bits, "v_bits": bits,
                           "kernel": kernel, "cta": cta, "role": role, "sm": sm, "entry_us": 0.0,
                           "exit_us": loop + 5.0, "phase_us": {"4": 2.0, "6": 2.0 + loop}})

    lines = []
    for bits in (3, 4):  # two calls: CTAs 0..10 each, then a merge CTA
        lines += [row(c, c // 4, 40.0 if c < 8 else 30.0, bits) for c in range(11)]
        lines.append(row(0, 0, 1.0, bits, kernel=1, role="merge"))
    path = tmp_path / "ctas.jsonl"
    path.write_text("\n".join(lines) + "\n")
    calls = mod.calls(str(path))
    assert [k[3] for k, _ in calls] == ["k3v3", "k4v4"] and [len(r) for _, r in calls] == [12, 12]
    out = io.StringIO()
    res = mod.summarize(calls[0][1], out=out)
    text = out.getvalue()
    assert res["ctas"] == 11 and res["sms"] == 3 and res["loop_max"] == 40.0
    assert "SMs holding 3 split CTAs:   1 SMs, loop us median 30.0" in text
    assert "SMs holding 4 split CTAs:   2 SMs, loop us median 40.0" in text
    assert res["within"] == 0.0 and res["across"] > 0.0  # CTAs of one SM alike here: the spread is between SMs
    # a fused-step CTA on SM 2: the 3 split CTAs there are reported apart from the 8 on SMs 0 and 1
    out = io.StringIO()
    mod.summarize(calls[0][1] + [json.loads(row(11, 2, 5.0, role="fused"))], out=out)
    assert "split CTAs sharing an SM with a sink/window or fused CTA: 3," in out.getvalue()
    assert "split CTAs on the other SMs: 8," in out.getvalue()


def test_kv_heads_sweep_records_and_plot(tmp_path):
    """bench/cuda_bench.py --kv-heads-sweep: a binary decode record becomes a cuda_kv_heads line with the
    fields docs/results needs (shape, GB/s, same-run SDPA ratio), and the plot is written."""
    spec = importlib.util.spec_from_file_location("cuda_bench", ROOT / "bench" / "cuda_bench.py")
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    recs = []
    for h in (1, 8):
        for ctx, t in ((4096, 11.0), (131072, 25.0 * h)):
            r = {"kind": "decode", "k_bits": 3, "v_bits": 3, "batch": 1, "context": ctx, "head_dim": 128,
                 "q_heads": 4 * h, "kv_heads": h, "page_size": 64, "time_us": t, "bytes": 1e6, "gbps": 1e6 / t / 1e3,
                 "copy_gbps": 4250.0, "pct_copy_bw": 1.0, "nonfinite_out": 0}
            recs.append(cb.decode_record(r, 2 * t, "fold_flash", "NVIDIA H200", "abc1234", suite="cuda_kv_heads"))
    need = {"suite", "backend", "device", "commit", "op", "batch", "q_len", "context", "head_dim", "q_heads", "kv_heads",
            "layers", "k_bits", "v_bits", "page_size", "time_us", "bytes", "gbps", "copy_gbps", "pct_copy_bw",
            "baseline", "baseline_time_us", "speedup"}
    assert need <= set(recs[0]) and recs[0]["suite"] == "cuda_kv_heads"
    assert recs[-1]["kv_heads"] == 8 and recs[-1]["q_heads"] == 32 and recs[-1]["speedup"] == 2.0
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib): the plot is not checked")
    png = tmp_path / "kv.png"
    cb.plot_kv_heads(recs, str(png))
    assert png.stat().st_size > 10000


def test_shape_sweep_relative_to_headline(tmp_path, monkeypatch):
    """bench/cuda_bench.py --shape-sweep: each (head_dim, GQA group) runs as its own --only process with
    FMKV_BENCH_HEAD_DIM / FMKV_BENCH_Q_PER_KV set; its bandwidth is read against the headline shape's (d = 128,
    group 4) of the same format and context, SDPA is timed at 128k only, groups over 8 also run with FMKV_CUDA_WIDE=0
    (their default rows' vs_wide_off the time ratio), and the plot is written."""
    spec = importlib.util.spec_from_file_location("cuda_bench", ROOT / "bench" / "cuda_bench.py")
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    stub = tmp_path / "fmkv_cuda_bench"  # --only B ctx kb vb: % of copy bw 40 + group + d / 64 - kb (a known pattern)
    stub.write_text("#!/bin/bash\n"  # FMKV_CUDA_WIDE=0: twice the time
                    "g=$FMKV_BENCH_Q_PER_KV; d=$FMKV_BENCH_HEAD_DIM; pct=$((40 + g + d / 64 - $4)); t=100.0\n"
                    "if [ \"$FMKV_CUDA_WIDE\" = 0 ]; then t=200.0; fi\n"
                    "echo '{\"kind\":\"copy\",\"gbps\":2000.0,\"device\":\"stub GPU\",\"l2_bytes\":1}'\n"
                    "echo \"{\\\"kind\\\":\\\"decode\\\",\\\"k_bits\\\":$4,\\\"v_bits\\\":$5,\\\"batch\\\":$2,"
                    "\\\"context\\\":$3,\\\"head_dim\\\":$d,\\\"q_heads\\\":$((8 * g)),\\\"kv_heads\\\":8,"
                    "\\\"page_size\\\":64,\\\"time_us\\\":$t,\\\"bytes\\\":1e6,\\\"gbps\\\":10.0,"
                    "\\\"copy_gbps\\\":2000.0,\\\"pct_copy_bw\\\":$pct,\\\"nonfinite_out\\\":0}\"\n")
    stub.chmod(0o755)
    sdpa_calls = []
    monkeypatch.setattr(cb, "sdpa_time_us", lambda B, ctx, **kw: sdpa_calls.append((ctx, kw["HQ"], kw["d"])) or
                        (200.0, "fold_flash"))
    monkeypatch.setattr(cb, "SHAPE_SWEEP", ((128, 4), (128, 7), (64, 16)))
    cb.shape_sweep(argparse.Namespace(bin=str(stub), out=str(tmp_path), commit="abc1234"))
    recs = [json.loads(l) for l in (tmp_path / "cuda_shapes.jsonl").read_text().splitlines()]
    assert len(recs) == (3 + 1) * 2 * len(cb.SHAPE_CONTEXTS)  # (64, 16) also with FMKV_CUDA_WIDE=0
    off = [r for r in recs if r["cuda_wide"] == "off"]
    assert {(r["head_dim"], r["q_heads"]) for r in off} == {(64, 128)} and all(r["time_us"] == 200.0 for r in off)
    by = {(r["head_dim"], r["q_heads"], r["k_bits"], r["context"]): r for r in recs if r["cuda_wide"] == "default"}
    assert by[(64, 128, 3, 131072)]["vs_wide_off"] == 2.0 and by[(128, 56, 3, 131072)]["vs_wide_off"] is None
    head = by[(128, 32, 3, 131072)]
    assert head["pct_copy_bw"] == 43 and head["vs_headline_bw"] == 1.0
    assert by[(128, 56, 3, 131072)]["vs_headline_bw"] == round(46 / 43, 3)
    assert by[(64, 128, 4, 1048576)]["vs_headline_bw"] == round(53 / 42, 3)
    assert by[(128, 56, 3, 131072)]["speedup"] == 2.0 and by[(128, 56, 3, 1048576)]["speedup"] is None
    assert sorted(sdpa_calls) == [(131072, 32, 128), (131072, 56, 128), (131072, 128, 64)]
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib): the plot is not checked")
    assert (tmp_path / "cuda_shapes.png").stat().st_size > 10000


def test_quantize_only_widths_and_tag(tmp_path):
    """bench/cuda_bench.py --quantize-only: --formats picks the widths the binary runs (--quant-only K V, each with
    the copy bandwidth of its own process), --tag names the file, and a width triple is refused."""
    spec = importlib.util.spec_from_file_location("cuda_bench", ROOT / "bench" / "cuda_bench.py")
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    stub = tmp_path / "fmkv_cuda_bench"
    stub.write_text("#!/bin/bash\n"
                    "echo '{\"kind\":\"copy\",\"gbps\":2000.0,\"device\":\"stub GPU\"}'\n"
                    "echo \"{\\\"kind\\\":\\\"quantize\\\",\\\"k_bits\\\":$2,\\\"v_bits\\\":$3,\\\"tokens\\\":32768,"
                    "\\\"head_dim\\\":128,\\\"kv_heads\\\":8,\\\"page_size\\\":64,\\\"time_us\\\":100.0,"
                    "\\\"bytes\\\":1e8,\\\"gbps\\\":1000.0,\\\"mtok_per_s\\\":300.0}\"\n")
    stub.chmod(0o755)
    a = argparse.Namespace(bin=str(stub), out=str(tmp_path), commit="abc1234", formats="5:4,3:3")
    cb.quantize_only(a, "_t")
    recs = [json.loads(l) for l in (tmp_path / "cuda_quantize_t.jsonl").read_text().splitlines()]
    assert [(r["k_bits"], r["v_bits"]) for r in recs] == [(5, 4), (3, 3)]
    assert recs[0]["pct_copy_bw"] == 50.0 and recs[0]["device"] == "stub GPU" and recs[0]["commit"] == "abc1234"
    a.formats = "4:4:64"
    with pytest.raises(SystemExit, match="without a scale group"):
        cb.quantize_only(a, "_t")


def test_ab_sh_runs_variants_patches_and_forced_settings(tmp_path):
    """tests/cuda/ab.sh with stub benchmark binaries (AB_REUSE): a patch variant gets its own patched source,
    an @NAME:ENV variant runs NAME's binary with ENV, case lines carry their own environment (a forced split
    count tags the variant NAME:sN), and every variant runs every case once per round."""
    stub = ("#!/bin/bash\n"
            "echo '{\"kind\":\"copy\",\"gbps\":1}'\n"
            "echo \"{\\\"kind\\\":\\\"decode\\\",\\\"k_bits\\\":3,\\\"v_bits\\\":3,\\\"batch\\\":$2,\\\"context\\\":$3,"
            "\\\"kv_heads\\\":${FMKV_BENCH_KV_HEADS:-8},\\\"time_us\\\":$(( BASE + ${FMKV_CUDA_SPLITS:-0} )).5}\"\n")
    for name, base in (("tree", 10), ("p", 12)):
        d = tmp_path / ("ab_" + name)
        d.mkdir()
        (d / "fmkv_cuda_bench").write_text(stub.replace("BASE", str(base)))
        (d / "fmkv_cuda_bench").chmod(0o755)
    patch = tmp_path / "new_file.patch"  # adds a file: applies to any tree
    patch.write_text("--- /dev/null\n+++ b/ab_patched.txt\n@@ -0,0 +1 @@\n+patched\n")
    cases = tmp_path / "cases.txt"
    cases.write_text("# three cases\n--only 1 4096 3 3\n\nFMKV_BENCH_KV_HEADS=1 --only 1 131072 3 3\n"
                     "FMKV_CUDA_SPLITS=7 --only 1 4096 3 3\n")
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), AB_DIR=str(tmp_path), AB_REUSE="1")
    res = subprocess.run(["bash", "tests/cuda/ab.sh", "-r", "2", "-c", str(cases), "tree=.",
                          "p=" + str(patch), "s4=@tree:FMKV_CUDA_SPLITS=4"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr + res.stdout
    assert (tmp_path / "ab_src_p" / "ab_patched.txt").read_text() == "patched\n"
    assert (tmp_path / "ab_src_p" / "src" / "cuda" / "decode_attention.cuh").exists()  # the tree, copied
    recs = [json.loads(l) for l in (out / "ab.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * 3 * 3  # rounds x variants x cases
    times = {(r["variant"], r["r"]["context"], r["r"]["kv_heads"]): r["r"]["time_us"] for r in recs}
    assert times[("tree", 4096, 8)] == 10.5 and times[("p", 4096, 8)] == 12.5 and times[("s4", 4096, 8)] == 14.5
    assert times[("tree", 131072, 1)] == 10.5  # the case's own environment
    assert times[("tree:s7", 4096, 8)] == 17.5 and times[("s4:s7", 4096, 8)] == 17.5  # the case's count wins
    table = [l for l in res.stdout.splitlines() if l.startswith("decode")]
    assert len(table) == 2 and "0.840" in table[0] and "0.724" in table[0]
    assert "0.600" in table[1]  # the tree:s7 column of the 4k case
    bad = subprocess.run(["bash", "tests/cuda/ab.sh", "x=@tree"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "not a built variant" in bad.stdout

#!/usr/bin/env python3
"""Static instruction counts of the format-3 CUDA prototypes (bench/proto/format3_cuda_scores.cu: the K side,
format3_cuda_pv.cu: the V side), no GPU needed: compiles them for sm_90 (-cubin), disassembles them and, for each
kernel, finds the tile loop (the
shortest backward-branch loop with >= 4 HMMA / IMMA instructions) and prints one JSON line: SASS
instructions per 16-token tile, of them integer-ALU-pipe instructions (tests/cuda/tile_loop_check.py's
classification), HMMA / IMMA, conversions (I2F / F2F / HADD2.F32), and instructions per cached value
of the lane (a tile is 16 tokens x 128 coordinates over 32 lanes: 64 values per lane).

    python3 bench/proto/format3_sass_count.py --cuobjdump PATH [--nvcc nvcc] [--out FILE]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "cuda"))
from tile_loop_check import alu_count, kernels, loop_span  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuobjdump", default="cuobjdump")
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--out")
    a = ap.parse_args()
    sass = ""
    with tempfile.TemporaryDirectory() as tmp:
        for src in ("format3_cuda_scores.cu", "format3_cuda_pv.cu"):
            cubin = os.path.join(tmp, src + ".cubin")
            subprocess.run([a.nvcc, "-O3", "-std=c++17", "-arch=sm_90", "-cubin", "-I", os.path.join(ROOT, "src"), "-I",
                            os.path.join(ROOT, "include"), "-I", os.path.join(ROOT, "tools"), os.path.join(HERE, src),
                            "-o", cubin], check=True)
            sass += subprocess.run([a.cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = []
    for name, ins in kernels(sass):
        short = re.search(r"(f2_scores|f3_scores|f2_pv|f3_pv)", name)
        if not short:
            continue
        impl = short.group(1)
        if impl in ("f3_scores", "f3_pv") and "ILb1E" in name:
            impl = impl.replace("f3", "f3v")
        seg = loop_span(ins, mma=r"\b[HI]MMA")
        if seg is None:
            print(f"{impl}: no tile loop found", file=sys.stderr)
            return 1
        ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for _, x in seg]
        count = lambda p: sum(bool(re.match(p, o)) for o in ops)  # noqa: E731
        n = len(seg) - 1  # the loop's own branch excluded below by the per-value figure
        side = dict(k_bits=3) if "scores" in impl else dict(v_bits=3)
        lines.append(dict(suite="format3_proto_sass", commit=commit, impl=impl, **side, head_dim=128,
                          sass_per_tile=len(seg), alu_pipe=alu_count(seg), hmma=count(r"HMMA"), imma=count(r"IMMA"),
                          prmt=count(r"PRMT"), lds=count(r"LDS"), conversions=count(r"(I2F|F2F|HADD2\.F32|I2FP)"),
                          ffma=count(r"FFMA"), imad=count(r"IMAD"), movm=count(r"MOVM"), per_value=round(n / 64, 3)))
    for l in lines:
        print(json.dumps(l))
    if a.out:
        with open(a.out, "w") as f:
            for l in lines:
                f.write(json.dumps(l) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

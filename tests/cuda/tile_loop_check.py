#!/usr/bin/env python3
"""Static check of the decode-attention tile loops in compiled CUDA objects (no GPU needed).

For every attn_kernel instantiation in the given objects (cuobjdump -sass), finds the tile loop (the
innermost backward-branch loop that contains mma instructions) and prints its instruction count, how
many of them issue to the integer ALU pipe (logic, shifts, byte permutes, integer adds / compares,
selects, fp32 compare / min / max: the loop's busiest pipe, one warp instruction per 2 cycles on
sm_90; IMAD and fp32 arithmetic go to the FMA pipe; docs/CUDA-NOTES.md "Floors"), its HMMA count and
local-memory operations (LDL/STL: register spills) and where the loop starts in the kernel's code. Exits 1 if any
tile loop touches local memory: every kernel shares its 128-register budget with the cold paths (fp16
part, fused step), and a change there can make ptxas spill inside the hot loop (seen while developing
the fused-step validation: 3-6 spill loads/stores per tile from unrelated code); or if a tile loop
starts after the first half of its kernel's instructions (--max-loop-position): at f04ef89 a one-line
change of the sink/window dispatch made ptxas place the loop after ~11k instructions of cold code, with
the loop's own SASS unchanged, and every decode step measured 7-9% slower (docs/history/cuda-fused-step.md).

    python3 tests/cuda/tile_loop_check.py build/CMakeFiles/fmkv.dir/*/cuda/decode_k*.cu.o
"""
import argparse
import re
import shutil
import subprocess
import sys


def kernels(sass):
    for f in re.split(r"\n\s*Function : ", sass)[1:]:
        name = f.split("\n")[0].strip()
        ins = []
        for line in f.split("\n"):
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        yield name, ins


def loop_span(ins, min_hmma=4, mma=r"HMMA"):
    """The shortest backward-branch loop of ins (entries (address, SASS, ...)) that holds at least
    min_hmma instructions matching mma (HMMA: the decode tile loop). Also used on ncu's source page
    (stall_by_phase) and by bench/proto/format3_sass_count.py (HMMA or IMMA)."""
    at = {x[0]: i for i, x in enumerate(ins)}
    best = None
    for i, x in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", x[1])
        if not m or int(m.group(1), 16) >= x[0] or int(m.group(1), 16) not in at:
            continue
        seg = ins[at[int(m.group(1), 16)]:i + 1]
        if sum(bool(re.search(mma, y[1])) for y in seg) >= min_hmma and (best is None or len(seg) < len(best)):
            best = seg
    return best


def tile_loop(ins):
    """(instructions, HMMA, LDL/STL, ALU-pipe instructions, start position as a fraction of the kernel's
    instructions) of the tile loop, or None."""
    seg = loop_span(ins)
    if seg is None:
        return None
    start = next(i for i, x in enumerate(ins) if x[0] == seg[0][0])
    return (len(seg), sum("HMMA" in x for _, x in seg), sum(bool(re.match(r"(@\S+\s+)?(LDL|STL)", x)) for _, x in seg),
            alu_count(seg), start / len(ins))


ALU_OPS = {"LOP3", "LOP", "SHF", "PRMT", "ISETP", "IADD3", "SEL", "LEA", "IMNMX", "VIMNMX", "PLOP3",
           "FSETP", "FSEL", "FMNMX", "BMSK", "SGXT", "POPC", "FLO", "BREV"}


def alu_count(seg):
    return sum(re.sub(r"^@!?U?P\w+\s+", "", x).split(".")[0].split()[0] in ALU_OPS for _, x in seg)


def short(name):
    m = re.search(r"attn_kernelILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E", name)
    return "d%s k%sv%s page %s" % m.groups() if m else name


def check_sass(sass, max_pos=0.5):
    """Checks every attn_kernel of one cuobjdump -sass listing: (lines to print, loops checked, failures)."""
    out, bad, n = [], 0, 0
    for name, ins in kernels(sass):
        if "attn_kernel" not in name:
            continue
        loop = tile_loop(ins)
        if loop is None:
            out.append("%-28s no tile loop found" % short(name))
            bad += 1
            continue
        n += 1
        size, hmma, local, alu, pos = loop
        flag = "  <-- local memory in the tile loop" if local else ""
        if pos > max_pos:
            flag += "  <-- tile loop laid out after %.0f%% of the kernel's code" % (100 * pos)
        out.append("%-28s tile loop %5d instructions (%3d ALU pipe), %3d HMMA, %d LDL/STL, at %2.0f%%%s" %
                   (short(name), size, alu, hmma, local, 100 * pos, flag))
        bad += local > 0 or pos > max_pos
    return out, n, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("objects", nargs="+")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    ap.add_argument("--max-loop-position", type=float, default=0.5,
                    help="fail when a tile loop starts after this fraction of its kernel's instructions")
    a = ap.parse_args()
    bad = n = 0
    for obj in a.objects:
        sass = subprocess.run([a.cuobjdump, "-sass", obj], capture_output=True, text=True, check=True).stdout
        lines, k, b = check_sass(sass, a.max_loop_position)
        for ln in lines:
            print(ln)
        n += k
        bad += b
    print("%d tile loops checked, %d with local memory, laid out late or not found" % (n, bad))
    return 1 if bad or n == 0 else 0


if __name__ == "__main__":
    sys.exit(main())

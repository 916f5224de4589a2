#!/usr/bin/env python3
"""Static check of the decode-attention tile loops in compiled CUDA objects (no GPU needed).

For every attn_kernel instantiation in the given objects (cuobjdump -sass), finds the tile loop (the
innermost backward-branch loop that contains mma instructions) and prints its instruction count, how
many of them issue to the integer ALU pipe (logic, shifts, byte permutes, integer adds / compares,
selects, fp32 compare / min / max: the loop's busiest pipe, one warp instruction per 2 cycles on
sm_90; IMAD and fp32 arithmetic go to the FMA pipe; docs/CUDA-NOTES.md "Floors"), its HMMA count and
local-memory operations (LDL/STL: register spills). Exits 1 if any tile loop touches local
memory: every kernel shares its 128-register budget with the cold paths (fp16 part, fused step), and a
change there can make ptxas spill inside the hot loop (seen while developing the fused-step
validation: 3-6 spill loads/stores per tile from unrelated code).

    python3 tests/cuda/tile_loop_check.py build/CMakeFiles/fmkv.dir/src/cuda/decode_k*.cu.o
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


def loop_span(ins, min_hmma=4):
    """The shortest backward-branch loop of ins (entries (address, SASS, ...)) that holds at least
    min_hmma HMMA instructions: the decode tile loop. Also used on ncu's source page (stall_by_phase)."""
    at = {x[0]: i for i, x in enumerate(ins)}
    best = None
    for i, x in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", x[1])
        if not m or int(m.group(1), 16) >= x[0] or int(m.group(1), 16) not in at:
            continue
        seg = ins[at[int(m.group(1), 16)]:i + 1]
        if sum("HMMA" in y[1] for y in seg) >= min_hmma and (best is None or len(seg) < len(best)):
            best = seg
    return best


def tile_loop(ins):
    seg = loop_span(ins)
    if seg is None:
        return None
    return (len(seg), sum("HMMA" in x for _, x in seg), sum(bool(re.match(r"(@\S+\s+)?(LDL|STL)", x)) for _, x in seg),
            alu_count(seg))


ALU_OPS = {"LOP3", "LOP", "SHF", "PRMT", "ISETP", "IADD3", "SEL", "LEA", "IMNMX", "VIMNMX", "PLOP3",
           "FSETP", "FSEL", "FMNMX", "BMSK", "SGXT", "POPC", "FLO", "BREV"}


def alu_count(seg):
    return sum(re.sub(r"^@!?U?P\w+\s+", "", x).split(".")[0].split()[0] in ALU_OPS for _, x in seg)


def short(name):
    m = re.search(r"attn_kernelILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E", name)
    return "d%s k%sv%s page %s" % m.groups() if m else name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("objects", nargs="+")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    a = ap.parse_args()
    bad = n = 0
    for obj in a.objects:
        sass = subprocess.run([a.cuobjdump, "-sass", obj], capture_output=True, text=True, check=True).stdout
        for name, ins in kernels(sass):
            if "attn_kernel" not in name:
                continue
            loop = tile_loop(ins)
            if loop is None:
                print("%-28s no tile loop found" % short(name))
                bad += 1
                continue
            n += 1
            size, hmma, local, alu = loop
            flag = "  <-- local memory in the tile loop" if local else ""
            print("%-28s tile loop %5d instructions (%3d ALU pipe), %3d HMMA, %d LDL/STL%s" %
                  (short(name), size, alu, hmma, local, flag))
            bad += local > 0
    print("%d tile loops checked, %d with local memory or not found" % (n, bad))
    return 1 if bad or n == 0 else 0


if __name__ == "__main__":
    sys.exit(main())

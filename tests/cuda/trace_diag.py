#!/usr/bin/env python3
"""Diagnostic variants of the latency-trace build (-DFMKV_CUDA_TRACE=ON) for the fused step's
sink/window CTA. Patches the FMKV_TRACE marks of a COPY of the source tree (never the checkout):

    A  compression detail: 3 = copies issued, 4 = the vector's own loads landed, 5 = compress
       computation done, 6 = validation completed (exit - 6 = ring writes + fp16 part)
    B  fp16-part detail, role fp16_part (an attention call's sink/window CTA, a fused step's second
       one): 5 = q in shared memory, 6 = chunk loop done (exit - 6 = partial writes); the fused CTA
       keeps 3 = compression, 4 = validation completed
    C  cold vs warm: compress_vector and the attention part (fresh_part) each run twice
       (both idempotent): 4 - 3 = first compression, 5 - 4 = second; 6 - 5 = validation + ring + first
       attention part, exit - 6 = second
    D  split-CTA prologue detail (attention, role "split"): 3 = first tiles' page entries read and
       copies issued (the query loads were issued just before), 4 = query values landed, 5 = queries
       checked, rotated and stored, 6 = after the barrier (exit - 6 = first tile + tile loop + combine)

On the device (used from 52ade48 on; results in docs/history/cuda-fused-step.md):
    mkdir /tmp/dA && cp -r CMakeLists.txt cmake include src bench tests python cli tools /tmp/dA/
    python3 tests/cuda/trace_diag.py A /tmp/dA
    cmake -S /tmp/dA -B /tmp/btA -G Ninja -DFMKV_CUDA=ON -DFMKV_CUDA_TRACE=ON -DFMKV_BUILD_TESTS=OFF \
        -DFMKV_BUILD_CLI=OFF && ninja -C /tmp/btA fmkv_cuda_bench
    /tmp/btA/fmkv_cuda_bench --trace 1 4096 3 3 | grep '"role":"fused"'
The patterns are exact source lines; an assertion names the one that no longer matches.
"""
import sys

if len(sys.argv) != 3 or sys.argv[1] not in ('A', 'B', 'C', 'D'):
    sys.exit(__doc__)
v, root = sys.argv[1], sys.argv[2]
fs = root + '/src/cuda/fused_step.cuh'; fp = root + '/src/cuda/fp16_part.cuh'
s = open(fs).read(); t = open(fp).read()
def rep(x, a, b):
    assert a in x, a
    return x.replace(a, b, 1)
if v == 'D':
    fa = root + '/src/cuda/decode_attention.cuh'
    a = open(fa).read()
    a = rep(a, "  FMKV_TRACE(p, 0, 3);\n", "")
    a = rep(a, "    if (k == 0) FMKV_TRACE(p, 0, 5);\n", "")
    a = rep(a, "    FMKV_TRACE(p, 0, 6);\n", "")
    a = rep(a, "      issue(k, k, pg_ahead);\n      pg_ahead = pn;\n    }\n",
            "      issue(k, k, pg_ahead);\n      pg_ahead = pn;\n    }\n    FMKV_TRACE(p, 0, 3);\n"
            "    asm volatile(\"\" ::\"f\"(xq[0][0]), \"f\"(xq[kQVPerWarp - 1][D / 32 - 1]));\n    FMKV_TRACE(p, 0, 4);\n")
    a = rep(a, "    __syncthreads();  // also: sh.tab filled\n    FMKV_TRACE(p, 0, 4);\n",
            "    FMKV_TRACE(p, 0, 5);\n    __syncthreads();  // also: sh.tab filled\n    FMKV_TRACE(p, 0, 6);\n")
    open(fa, 'w').write(a)
elif v == 'A':
    s = rep(s, "    else cp_async_commit();\n  }\n", "    else cp_async_commit();\n  }\n  FMKV_TRACE(p, 0, 3);\n")
    s = rep(s, "      load_f16_bits_n<NR>(src, dt, off, x);\n    } else {",
            "      load_f16_bits_n<NR>(src, dt, off, x);\n      asm volatile(\"\" ::\"h\"(x[0]), \"h\"(x[NR - 1]));\n      if (vj == warp) FMKV_TRACE(p, 0, 4);\n    } else {")
    s = rep(s, "    else compress_vector<D, KB, P>(x, sec, t, p.sw, p.kq, p.rule, lane, dst);\n  }\n  FMKV_TRACE(p, 0, 3);",
            "    else compress_vector<D, KB, P>(x, sec, t, p.sw, p.kq, p.rule, lane, dst);\n    __syncwarp();\n    if (vj == warp) FMKV_TRACE(p, 0, 5);\n  }")
    s = rep(s, "  if (__syncthreads_or(bad)) return;  // also: dk / dv complete\n  FMKV_TRACE(p, 0, 4);",
            "  if (__syncthreads_or(bad)) return;  // also: dk / dv complete\n  FMKV_TRACE(p, 0, 6);")
    s = rep(s, "  FMKV_TRACE(p, 0, 5);\n", "")
    s = rep(s, "  FMKV_TRACE(p, 0, 6);\n}", "}")
elif v == 'C':  # cold vs warm: compress_vector and the attention part each run twice (idempotent)
    s = rep(s, "    else cp_async_commit();\n  }\n", "    else cp_async_commit();\n  }\n  FMKV_TRACE(p, 0, 3);\n")
    s = rep(s, "    else compress_vector<D, KB, P>(x, sec, t, p.sw, p.kq, p.rule, lane, dst);\n  }\n  FMKV_TRACE(p, 0, 3);",
            "    else compress_vector<D, KB, P>(x, sec, t, p.sw, p.kq, p.rule, lane, dst);\n    __syncwarp();\n    if (vj == warp) FMKV_TRACE(p, 0, 4);\n"
            "    if (isv) compress_vector<D, VB, P>(x, sec, t, p.sw, p.vq, p.rule, lane, dst);\n    else compress_vector<D, KB, P>(x, sec, t, p.sw, p.kq, p.rule, lane, dst);\n"
            "    __syncwarp();\n    if (vj == warp) FMKV_TRACE(p, 0, 5);\n  }")
    s = rep(s, "  FMKV_TRACE(p, 0, 4);\n", "")
    s = rep(s, "  FMKV_TRACE(p, 0, 5);\n", "")
    # the second attention part reads q from global memory (the first may have overwritten the staged copy)
    s = rep(s, "                kv_staged ? stage + 16 * chk.first[1] : nullptr);\n  FMKV_TRACE(p, 0, 6);",
            "                kv_staged ? stage + 16 * chk.first[1] : nullptr);\n  FMKV_TRACE(p, 0, 6);\n"
            "  fresh_part<D>(p, h, len0, r0, n, smem, E0, E1, a, b, nullptr, nullptr, nullptr);")
else:
    s = rep(s, "  FMKV_TRACE(p, 0, 5);\n", "")
    s = rep(s, "  FMKV_TRACE(p, 0, 6);\n}", "}")
    lines = t.split('\n')
    # second __syncthreads of the batch loop (q loaded into qs) -> phase 5; before "if (TPH > 1) {" -> phase 6
    idx = [i for i, l in enumerate(lines) if l == '    __syncthreads();'][1]
    lines.insert(idx + 1, '    FMKV_TRACE(p, 0, 5);')
    j = [i for i, l in enumerate(lines) if l == '    if (TPH > 1) {'][0]
    lines.insert(j, '    FMKV_TRACE(p, 0, 6);')
    t = '\n'.join(lines)
open(fs, 'w').write(s); open(fp, 'w').write(t)

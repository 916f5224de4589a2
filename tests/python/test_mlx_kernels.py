"""fmkv.mlx.kernels without MLX: the parameter blocks against the C structs, and the CUDA sources that
mx.fast.cuda_kernel generates compiled with nvcc (skipped without nvcc), including a check that the
quantize-append kernels contain no fused multiply-add (their bytes must not depend on contraction:
MLX compiles with NVRTC's default -fmad=true)."""
import os
import re
import shutil
import subprocess
import struct

import pytest

from fmkv.mlx import kernels

HERE = os.path.dirname(os.path.abspath(__file__))
STRUCTS = ("fmkv_metal_append_params", "fmkv_metal_attention_params")
NVCC = os.environ.get("NVCC") or shutil.which("nvcc")
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _offsets(name):
    fields, off, out = kernels.struct_fields(name), 0, []
    for f, ch in fields:
        out.append((f, off, struct.calcsize("<" + ch)))
        off += struct.calcsize("<" + ch)
    return out, off


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++)")
def test_parameter_blocks_match_the_c_structs(tmp_path):
    """Field order, offsets and sizes read from params_msl.h == the C++ compiler's offsetof/sizeof."""
    src = ['#include "../format/portability.h"', '#include "params_msl.h"', "#include <cstddef>", "#include <cstdio>",
           "int main() {"]
    for s in STRUCTS:
        for f, _, _ in _offsets(s)[0]:
            src.append(f'  std::printf("{s} {f} %zu %zu\\n", offsetof({s}, {f}), sizeof((({s}*)0)->{f}));')
        src.append(f'  std::printf("{s} sizeof %zu 0\\n", sizeof({s}));')
    src.append("}")
    (tmp_path / "layout.cpp").write_text("\n".join(src) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([CXX, "-std=c++17", "-I", kernels.metal_source_dir(), str(tmp_path / "layout.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    got = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        s, f, off, size = line.split()
        got[(s, f)] = (int(off), int(size))
    for s in STRUCTS:
        fields, total = _offsets(s)
        for f, off, size in fields:
            assert got[(s, f)] == (off, size), f"{s}.{f}: Python packs it at {off} ({size} B), C at {got[(s, f)]}"
        assert got[(s, "sizeof")][0] == total, f"{s}: {total} bytes packed, sizeof is {got[(s, 'sizeof')][0]}"
        assert struct.calcsize(kernels._format(s)) == total


def test_packing_checks_fields_and_templates():
    cfg = dict(head_dim=128, num_kv_heads=8, k_bits=4, v_bits=4, page_size=64)
    blob = kernels.pack_attention_params(cfg, 9216, 10, 1, 3, 1, True, 10, 32, "float16", (4096, 128), "float16",
                                         (4096, 128), 1, 4096, 0.0, 0.0, 4, 16)
    plan = kernels.attention_plan_fields(blob)
    assert plan["tiles"] == 1 and plan["num_splits"] == 16 and plan["parts"] == 64
    with pytest.raises(ValueError, match="missing fields"):
        kernels._pack("fmkv_metal_append_params", {"head_dim": 1})
    assert kernels.template_args("attention_merge", 64, 3, 2) == [("FMKV_D", 64)]
    assert kernels.template_args("append_fp16", 64, 3, 2) == []
    for name in kernels.KERNELS:  # the bodies differ only in thread ids
        m, c = kernels.body(name, "metal"), kernels.body(name, "cuda")
        strip = lambda b, d: b.replace(kernels._IDS[d], "IDS").replace(kernels._GID[d], "GID")  # noqa: E731
        assert strip(m, "metal") == strip(c, "cuda")


DTYPES = {"params": "int32", "pages": "uint8", "fp16_k": "uint16", "fp16_v": "uint16", "seq_lens": "int64",
          "row_offsets": "int64", "block_table": "int32", "slots": "int32", "ws": "float32", "status": "uint32",
          "after": "uint32", "done": "uint32"}


def _cuda_source(dtype, formats, header_edit=None, names=None):
    """One translation unit with every kernel (or ``names``) for each format, generated as
    mx.fast.cuda_kernel does; kernels of different formats get distinct names already."""
    t = dict(DTYPES, k=dtype, v=dtype, q=dtype, out=dtype)
    parts = []
    for d, kb, vb in formats:
        for name in names or kernels.KERNELS:
            tmpl = kernels.template_args(name, d, kb, vb)
            if not tmpl and (d, kb, vb) != formats[0]:
                continue  # the fp16 pass has no template: once
            src = kernels.generated_source(name, t, t, "cuda", tmpl)
            if header_edit:
                src = header_edit(src)
            parts.append(src)
    return "\n".join(parts)


def _nvcc(tmp_path, src, stem, ptx=False):
    path = tmp_path / f"{stem}.cu"
    path.write_text(src)
    out = tmp_path / (f"{stem}.ptx" if ptx else f"{stem}.o")
    cmd = [NVCC, "-arch=sm_90", "-std=c++17", "-I", os.path.join(HERE, "mlx_cuda_stub"), "-o", str(out), str(path),
           "-ptx" if ptx else "-c"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"nvcc failed on the generated source:\n{r.stderr[-4000:]}"
    return out


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit): the generated CUDA sources are not compiled")
def test_generated_cuda_sources_compile(tmp_path):
    """All four kernels x K/V/Q dtypes x formats, as MLX's CUDA backend generates them: sm_90 objects
    for float16 (d 128 k4v4, d 64 k3v2), PTX for d 256 k16v3 and the other dtypes (5-bit codes: d 128 k5v5)."""
    _nvcc(tmp_path, _cuda_source("float16", [(128, 4, 4), (64, 3, 2)]), "f16")
    _nvcc(tmp_path, _cuda_source("float16", [(256, 16, 3)]), "f16_d256", ptx=True)
    _nvcc(tmp_path, _cuda_source("float32", [(128, 3, 3)]), "f32", ptx=True)
    _nvcc(tmp_path, _cuda_source("bfloat16", [(64, 4, 2), (128, 5, 5)]), "bf16", ptx=True)


def _fma_count(ptx_text, kernel_prefix):
    """fma.rn.f32 instructions inside the PTX entries whose name contains kernel_prefix."""
    count, inside = 0, False
    for line in ptx_text.splitlines():
        if line.startswith(".visible .entry") or line.startswith(".entry"):
            inside = kernel_prefix in line
        if inside and re.search(r"\bfma\.rn(\.ftz)?\.f32\b", line):
            count += 1
    return count


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit)")
def test_append_kernels_contain_no_fma(tmp_path):
    """The quantize-append kernels of every code width contain no fused multiply-add under nvcc's
    (and NVRTC's, MLX's) default -fmad=true: their bytes cannot depend on contraction. Control: with
    the same flags a plain a*b + c is contracted and counted."""
    formats = [(128, 4, 4), (64, 3, 2), (128, 2, 3), (128, 5, 4)]
    ptx = _nvcc(tmp_path, _cuda_source("float16", formats, names=["append_compress"]), "append", ptx=True).read_text()
    assert sum(1 for l in ptx.splitlines() if ".entry" in l and "append_compress" in l) == len(formats)
    assert _fma_count(ptx, "append_compress") == 0
    control = _nvcc(tmp_path, "__global__ void control_kernel(const float* a, float* o) { o[0] = a[0] * a[1] + a[2]; }\n",
                    "control", ptx=True).read_text()
    assert _fma_count(control, "control_kernel") == 1, "control: a*b + c was not contracted (the check is void)"

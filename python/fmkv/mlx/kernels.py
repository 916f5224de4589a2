"""The kernel sources and parameter blocks of fmkv's MLX GPU path, for both of MLX's kernel dialects.

One kernel core, two dialects. ``mx.fast.metal_kernel`` (Apple GPUs) and ``mx.fast.cuda_kernel``
(MLX's CUDA backend) both take a kernel *body*, a *header* and the names of the inputs and outputs,
and generate the signature themselves. The header is ``src/metal/kernel_core.h`` flattened (its
``#include "..."`` lines resolved, the generated codebook table included, never copied); it compiles
as MSL and as CUDA through ``src/format/portability.h``. The bodies here are one call into the core
each; only the thread ids differ between the dialects (:func:`body`).

:func:`generated_source` rebuilds the exact source each MLX backend compiles (header + generated
signature + body), without importing MLX: ``tests/metal/run.sh`` type-checks the Metal sources
against an MSL shim, ``tests/python/test_mlx_kernels.py`` compiles the CUDA sources with nvcc.

Parameter blocks: the field lists are read from ``src/metal/params_msl.h`` itself (:func:`struct_fields`),
so the ``struct.pack`` formats cannot drift from the C structs; ``run.sh`` compares the packed bytes
with the C++ host's (``src/metal/host_plan.h``) and ``test_mlx_kernels.py`` the offsets with the C
compiler's.

This module imports only the standard library (``run.sh`` loads it without the fmkv extension).
"""
from __future__ import annotations

import math
import os
import re
import struct
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "metal_source_dir", "header", "KERNELS", "DIALECTS", "body", "template_args", "generated_source",
    "kernel_name", "struct_fields", "APPEND_PARAMS_FORMAT", "ATTENTION_PARAMS_FORMAT", "QTILE",
    "pack_append_params", "pack_attention_params", "attention_plan_fields", "DTYPE_CODES", "define",
]

DIALECTS = ("metal", "cuda")
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}  # fmkv_dtype (include/fmkv/params.h)


def metal_source_dir() -> str:
    """Directory holding kernel_core.h: $FMKV_METAL_SRC, the package data ``fmkv/metal_src/src/metal``
    (wheels: the kernel core and the format core in the repository's layout), or the source tree
    (``src/metal`` next to ``python/``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("FMKV_METAL_SRC", ""), os.path.join(here, "..", "metal_src", "src", "metal"),
                  os.path.join(here, "..", "..", "..", "src", "metal")]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "kernel_core.h")):
            return os.path.normpath(c)
    raise FileNotFoundError("fmkv kernel sources (src/metal/kernel_core.h) not found: set FMKV_METAL_SRC to src/metal")


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _flatten(path: str, seen: set) -> str:
    path = os.path.normpath(path)
    if path in seen and not path.endswith(".inc"):  # headers are include-guarded; a table is included
        return ""                                    # once per qualifier (src/format/codebook.h)
    seen.add(path)
    out = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            m = _INCLUDE.match(line)
            if m:
                out.append(_flatten(os.path.join(os.path.dirname(path), m.group(1)), seen))
            else:
                out.append(line)
    return "".join(out)


_HEADER: Dict[str, str] = {}


def header() -> str:
    """The MLX ``header`` of both dialects: src/metal/kernel_core.h with its quoted includes resolved."""
    d = metal_source_dir()
    if d not in _HEADER:
        _HEADER[d] = _flatten(os.path.join(d, "kernel_core.h"), set())
    return _HEADER[d]


# ---------------------------------------------------------------------------------------------
# Parameter blocks, read from src/metal/params_msl.h.

_C_TYPES = {"fmkv_i32": "i", "fmkv_u32": "I", "fmkv_i64": "q", "fmkv_u64": "Q", "float": "f"}
_FIELDS: Dict[str, List[Tuple[str, str]]] = {}


def struct_fields(name: str) -> List[Tuple[str, str]]:
    """[(field, struct format char)] of ``struct <name>`` in src/metal/params_msl.h, in order. The
    header promises natural alignment without implicit padding; a field that breaks it is an error."""
    if name not in _FIELDS:
        with open(os.path.join(metal_source_dir(), "params_msl.h"), encoding="utf-8") as f:
            text = re.sub(r"//[^\n]*", "", f.read())
        m = re.search(r"struct\s+%s\s*\{(.*?)\};" % re.escape(name), text, re.S)
        if not m:
            raise ValueError(f"struct {name} not found in params_msl.h")
        fields: List[Tuple[str, str]] = []
        offset = 0
        for stmt in m.group(1).split(";"):
            stmt = stmt.strip()
            if not stmt:
                continue
            ctype, _, names = stmt.partition(" ")
            if ctype not in _C_TYPES:
                raise ValueError(f"params_msl.h: {name}: field type {ctype!r} has no struct format")
            ch = _C_TYPES[ctype]
            for n in names.split(","):
                size = struct.calcsize("<" + ch)
                if offset % size:
                    raise ValueError(f"params_msl.h: {name}.{n.strip()} at offset {offset} is not {size}-aligned")
                fields.append((n.strip(), ch))
                offset += size
        _FIELDS[name] = fields
    return _FIELDS[name]


def _format(name: str) -> str:
    return "<" + "".join(ch for _, ch in struct_fields(name))


def _pack(name: str, values: Dict[str, object]) -> bytes:
    fields = struct_fields(name)
    missing = [f for f, _ in fields if f not in values]
    extra = sorted(set(values) - {f for f, _ in fields})
    if missing or extra:
        raise ValueError(f"{name}: missing fields {missing}, unknown fields {extra}")
    return struct.pack(_format(name), *(values[f] for f, _ in fields))


_DEFINES: Dict[str, int] = {}


def define(name: str) -> int:
    """An integer #define of src/metal/params_msl.h (FMKV_METAL_QTILE, FMKV_METAL_ERR_*, ...)."""
    if name not in _DEFINES:
        with open(os.path.join(metal_source_dir(), "params_msl.h"), encoding="utf-8") as f:
            m = re.search(r"#define\s+%s\s+(\d+)u?\b" % re.escape(name), f.read())
        if not m:
            raise ValueError(f"{name} not found in params_msl.h")
        _DEFINES[name] = int(m.group(1))
    return _DEFINES[name]


def __getattr__(attr: str):  # read from the header on first use (importing needs no sources)
    if attr == "APPEND_PARAMS_FORMAT":
        return _format("fmkv_metal_append_params")
    if attr == "ATTENTION_PARAMS_FORMAT":
        return _format("fmkv_metal_attention_params")
    if attr == "QTILE":
        return define("FMKV_METAL_QTILE")
    raise AttributeError(attr)


def _config_fields(cfg: dict) -> Dict[str, object]:
    return dict(head_dim=cfg["head_dim"], num_kv_heads=cfg["num_kv_heads"], k_bits=cfg["k_bits"],
                v_bits=cfg["v_bits"], page_size=cfg["page_size"], sink_tokens=cfg.get("sink_tokens", 0),
                window_tokens=cfg.get("window_tokens", 0), scale_rule=cfg.get("scale_rule", 1),
                seed=cfg.get("seed", 0) & (2**64 - 1), format_version=cfg.get("format_version", 0),
                scale_group=cfg.get("scale_group", 0))


def pack_append_params(cfg: dict, page_bytes: int, num_pages: int, num_slots: int, layer: int, num_seqs: int,
                       has_slots: bool, block_table_stride: int, k_dtype: str, v_dtype: str,
                       k_strides: Tuple[int, int], v_strides: Tuple[int, int], total_rows: int) -> bytes:
    """struct fmkv_metal_append_params (as src/metal/host_plan.h append_params fills it). ``cfg``:
    the fmkv_config fields (scale_rule as the C enum value; format_version as given: 0 = the default, 2 or 3;
    scale_group as given: 0 = the default, 32 or 64); ``page_bytes``: fmkv.Config.page_bytes."""
    v = _config_fields(cfg)
    v.update(num_pages=num_pages, num_slots=num_slots, layer=layer, num_seqs=num_seqs, has_slots=int(has_slots),
             block_table_stride=block_table_stride, k_dtype=DTYPE_CODES[k_dtype], v_dtype=DTYPE_CODES[v_dtype],
             k_row_stride=k_strides[0], k_head_stride=k_strides[1], v_row_stride=v_strides[0],
             v_head_stride=v_strides[1], total_rows=total_rows, page_bytes=page_bytes)
    return _pack("fmkv_metal_append_params", v)


def pack_attention_params(cfg: dict, page_bytes: int, num_pages: int, num_slots: int, layer: int, num_seqs: int,
                          has_slots: bool, block_table_stride: int, q_heads: int, q_dtype: str,
                          q_strides: Tuple[int, int], out_dtype: str, out_strides: Tuple[int, int],
                          max_rows: int, max_len: int, softmax_scale: float, softcap: float,
                          simdgroups: int, splits: int) -> bytes:
    """struct fmkv_metal_attention_params (as host_plan.h attention_params fills it for fmkv_attention:
    no lse, has_lse = 0). ``max_len``: an upper bound of the sequence lengths the block serves (key splits
    cover [0, splits * split_len))."""
    group = q_heads // cfg["num_kv_heads"]
    splits = max(1, int(splits))
    v = _config_fields(cfg)
    v.update(num_pages=num_pages, num_slots=num_slots, layer=layer, num_seqs=num_seqs, has_slots=int(has_slots),
             block_table_stride=block_table_stride, q_heads=q_heads, q_dtype=DTYPE_CODES[q_dtype],
             q_row_stride=q_strides[0], q_head_stride=q_strides[1], out_dtype=DTYPE_CODES[out_dtype],
             max_rows=max_rows, out_row_stride=out_strides[0], out_head_stride=out_strides[1],
             softmax_scale=softmax_scale if softmax_scale > 0 else 1.0 / math.sqrt(cfg["head_dim"]),
             softcap=softcap, tiles=max(1, -(-max_rows * group // define("FMKV_METAL_QTILE"))), num_splits=splits,
             split_len=-(-max(1, max_len) // splits), parts=splits * simdgroups, page_bytes=page_bytes,
             has_lse=0, lse_row_stride=0, lse_head_stride=0)  # the MLX merge body passes no lse buffer
    return _pack("fmkv_metal_attention_params", v)


def attention_plan_fields(blob: bytes) -> Dict[str, int]:
    """tiles, num_splits, parts, head_dim, num_kv_heads, num_seqs of a packed attention block."""
    fields = struct_fields("fmkv_metal_attention_params")
    vals = dict(zip((f for f, _ in fields), struct.unpack(_format("fmkv_metal_attention_params"), blob)))
    return {k: vals[k] for k in ("tiles", "num_splits", "parts", "head_dim", "num_kv_heads", "num_seqs", "max_rows")}


# ---------------------------------------------------------------------------------------------
# Kernels: inputs, outputs, compile-time constants and one body per kernel.
#
# Storage arrays (pages, fp16 regions, the status words) are INPUTS written in place: the bodies cast
# away const, as MLX's own in-place cache kernels do. Every kernel also takes ``after``, an output of
# the previous kernel that touched the same storage, so that MLX orders the kernels (and, on Metal,
# puts a barrier between them); it is never read. The status words (uint32[8]) stay set until the
# caller clears them: 0 = fine, FMKV_METAL_ERR_* otherwise.

_IDS = {
    "metal": ("threadgroup_position_in_grid.x, simdgroup_index_in_threadgroup, simdgroups_per_threadgroup, "
              "thread_index_in_simdgroup, threads_per_threadgroup.x"),
    "cuda": "blockIdx.x, threadIdx.x / 32u, blockDim.x / 32u, threadIdx.x % 32u, blockDim.x",
}
_GID = {"metal": "thread_position_in_grid.x", "cuda": "blockIdx.x * blockDim.x + threadIdx.x"}

_D = "FMKV_DEVICE"
# name -> (input names, output names, template constant names, body with {ids} / {gid}).
KERNELS: Dict[str, Tuple[List[str], List[str], List[str], str]] = {
    "append_compress": (
        ["params", "pages", "fp16_k", "fp16_v", "k", "v", "seq_lens", "row_offsets", "block_table", "slots", "status",
         "after"],
        ["done"],
        ["FMKV_D", "FMKV_KB", "FMKV_VB"],
        f"  fmkv_append_compress_spec(*(const {_D} fmkv_metal_append_params*)params,\n"
        f"      const_cast<{_D} fmkv_u8*>((const {_D} fmkv_u8*)pages), (const {_D} fmkv_u16*)fp16_k,\n"
        f"      (const {_D} fmkv_u16*)fp16_v, (const {_D} fmkv_u8*)k, (const {_D} fmkv_u8*)v,\n"
        f"      (const {_D} fmkv_i64*)seq_lens, (const {_D} fmkv_i64*)row_offsets,\n"
        f"      (const {_D} fmkv_i32*)block_table, (const {_D} fmkv_i32*)slots,\n"
        f"      const_cast<{_D} fmkv_u32*>((const {_D} fmkv_u32*)status),\n"
        "      {ids}, FMKV_D, FMKV_KB, FMKV_VB);\n"
        "  (void)after;\n  (void)done;\n"),
    "append_fp16": (
        ["params", "fp16_k", "fp16_v", "k", "v", "seq_lens", "row_offsets", "slots", "after"],
        ["done"],
        [],
        f"  fmkv_append_fp16_impl(*(const {_D} fmkv_metal_append_params*)params,\n"
        f"      const_cast<{_D} fmkv_u16*>((const {_D} fmkv_u16*)fp16_k),\n"
        f"      const_cast<{_D} fmkv_u16*>((const {_D} fmkv_u16*)fp16_v), (const {_D} fmkv_u8*)k,\n"
        f"      (const {_D} fmkv_u8*)v, (const {_D} fmkv_i64*)seq_lens, (const {_D} fmkv_i64*)row_offsets,\n"
        f"      (const {_D} fmkv_i32*)slots, {{gid}});\n"
        "  (void)after;\n  (void)done;\n"),
    "attention_partial": (
        ["params", "pages", "fp16_k", "fp16_v", "q", "seq_lens", "row_offsets", "block_table", "slots", "status",
         "after"],
        ["ws"],
        ["FMKV_D", "FMKV_KB", "FMKV_VB"],
        "  FMKV_THREADGROUP_ARRAY(float, q_rot, FMKV_METAL_QTILE * 256);\n"
        "  FMKV_THREADGROUP_ARRAY(float, q_raw, FMKV_METAL_QTILE * 256);\n"
        f"  fmkv_attention_partial_spec(*(const {_D} fmkv_metal_attention_params*)params,\n"
        f"      (const {_D} fmkv_u8*)pages, (const {_D} fmkv_u16*)fp16_k, (const {_D} fmkv_u16*)fp16_v,\n"
        f"      (const {_D} fmkv_u8*)q, (const {_D} fmkv_i64*)seq_lens, (const {_D} fmkv_i64*)row_offsets,\n"
        f"      (const {_D} fmkv_i32*)block_table, (const {_D} fmkv_i32*)slots, ({_D} float*)ws,\n"
        f"      const_cast<{_D} fmkv_u32*>((const {_D} fmkv_u32*)status), q_rot, q_raw,\n"
        "      {ids}, FMKV_D, FMKV_KB, FMKV_VB);\n"
        "  (void)after;\n"),
    "attention_merge": (
        ["params", "row_offsets", "ws", "status"],
        ["out"],
        ["FMKV_D"],
        f"  fmkv_attention_merge_spec(*(const {_D} fmkv_metal_attention_params*)params,\n"
        f"      (const {_D} fmkv_i64*)row_offsets, (const {_D} float*)ws, ({_D} fmkv_u8*)out, ({_D} float*)0,\n"
        f"      const_cast<{_D} fmkv_u32*>((const {_D} fmkv_u32*)status),\n"
        "      {ids}, FMKV_D);\n"),
}


def body(name: str, dialect: str) -> str:
    """The body of KERNELS[name] in ``dialect`` ('metal' or 'cuda'): only the thread ids differ."""
    if dialect not in DIALECTS:
        raise ValueError(f"dialect {dialect!r} is not one of {DIALECTS}")
    return KERNELS[name][3].replace("{ids}", _IDS[dialect]).replace("{gid}", _GID[dialect])


def template_args(name: str, head_dim: int, k_bits: int, v_bits: int) -> List[Tuple[str, int]]:
    """MLX ``template=`` of KERNELS[name]: the compile-time head_dim and bit widths it uses."""
    values = {"FMKV_D": int(head_dim), "FMKV_KB": int(k_bits), "FMKV_VB": int(v_bits)}
    return [(t, values[t]) for t in KERNELS[name][2]]


# ---------------------------------------------------------------------------------------------
# The sources MLX generates (MLX 0.32: mlx/backend/common/metal_kernel.cpp write_signature,
# mlx/backend/cuda/custom_kernel.cpp build_kernel), without MLX.

# MLX's metal_kernel attribute table (name -> type), scanned in the body like MLX does.
_MLX_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
]
# dtype names -> each dialect's type names (MLX get_type_string / dtype_to_cuda_type).
_TYPE_NAMES = {
    "metal": {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "uint8": "uint8_t",
              "uint16": "uint16_t", "uint32": "uint32_t", "int32": "int32_t", "int64": "int64_t"},
    "cuda": {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "uint8": "uint8_t",
             "uint16": "uint16_t", "uint32": "uint32_t", "int32": "int32_t", "int64": "int64_t"},
}
CUDA_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'


def kernel_name(name: str, dialect: str, template: Sequence[Tuple[str, int]],
                input_dtypes: Sequence[str] = (), output_dtypes: Sequence[str] = ()) -> str:
    """The name MLX gives the generated kernel (Metal's also names the input and output types)."""
    n = "custom_kernel_fmkv_" + name
    if dialect == "cuda":
        return n + "".join("_%d" % v for _, v in template)
    if template:  # MLX's make_template_hash of "<a, b>" is "_a_b", appended after "_"
        n += "__" + "_".join(str(v) for _, v in template)
    n += "".join("_" + _TYPE_NAMES["metal"][t] for t in input_dtypes)
    return n + "".join("_" + _TYPE_NAMES["metal"][t] for t in output_dtypes)


def generated_source(name: str, input_dtypes: Dict[str, str], output_dtypes: Dict[str, str],
                     dialect: str = "metal", template: Optional[Sequence[Tuple[str, int]]] = None) -> str:
    """The kernel source MLX builds for KERNELS[name] in ``dialect``: header + generated signature +
    body. Dtypes by input / output name ('float32', 'uint8', ...); every input is assumed to have at
    least 8 elements (Metal binds smaller ones as ``constant``: the launchers pad them). ``template``
    defaults to d=128, k4v4."""
    inputs, outputs, _, _ = KERNELS[name]
    if template is None:
        template = template_args(name, 128, 4, 4)
    src_body = body(name, dialect)
    kname = kernel_name(name, dialect, template, [input_dtypes[n] for n in inputs], [output_dtypes[n] for n in outputs])
    types = _TYPE_NAMES[dialect]
    if dialect == "cuda":
        src = CUDA_DEFAULT_HEADER + header() + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        src += "__global__ void " + kname + "(\n"
        for n in inputs:
            src += "    const %s* %s,\n" % (types[input_dtypes[n]], n)
        src += ",\n".join("    %s* %s" % (types[output_dtypes[n]], n) for n in outputs) + ") {\n"
        if template:
            src += "".join("  constexpr int %s = %d;\n" % (t, v) for t, v in template) + "\n"
        return src + src_body + "\n}\n\n} // namespace mlx::core::cu\n"
    src = header()
    if template:
        src += "template <" + ", ".join("int " + t for t, _ in template) + ">\n"
    src += "[[kernel]] void " + kname + "(\n"
    index = 0
    for n in inputs:
        src += "  const device %s* %s [[buffer(%d)]],\n" % (types[input_dtypes[n]], n, index)
        index += 1
    attrs = ["  %s %s [[%s]]" % (t, a, a) for a, t in _MLX_ATTRIBUTES if a in src_body]
    for i, n in enumerate(outputs):
        src += "  device %s* %s [[buffer(%d)]]" % (types[output_dtypes[n]], n, index)
        src += ",\n" if (i < len(outputs) - 1 or attrs) else ") {\n"
        index += 1
    for i, a in enumerate(attrs):
        src += a + (",\n" if i < len(attrs) - 1 else ") {\n")
    src += src_body + "\n}\n"
    if template:
        inst = kname + "<" + ", ".join(str(v) for _, v in template) + ">"
        src += '\ntemplate [[host_name("%s")]] [[kernel]] decltype(%s) %s;\n' % (kname, inst, inst)
    return src

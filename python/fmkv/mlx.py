"""fmkv on Apple silicon through MLX: the Metal kernels of ``src/metal/`` run via ``mx.fast.metal_kernel``.

The kernel *bodies* shipped here are one-line calls into the single-source kernel core
(``src/metal/kernel_core.h``); the MLX *header* is that core, flattened (its ``#include "..."``
lines resolved, the generated codebook table included, never copied). So MLX runs exactly the code
that ``tests/metal/run.sh`` type-checks against an MSL shim and runs bit-exactly in the CPU emulator.
The sources MLX generates around each body (header + signature + body, as MLX's
``write_signature`` does) are produced by :func:`generated_source` without importing MLX, and are
type-checked on Linux by ``tests/metal/run.sh``.

Status: written and type-checked without a Mac; nothing here has run on MLX yet (see docs/METAL.md).
``mlx`` is imported lazily, only by the functions that launch kernels, so ``import fmkv.mlx`` works
on any platform.

Caveats (MLX semantics, not fmkv's):
  * MLX arrays are immutable; :func:`append` writes the page pool and fp16 regions *in place*
    (the kernel casts the input buffers to writable), like other in-place MLX cache kernels. Do not
    keep other references to those arrays expecting old contents; evaluate (``mx.eval``) the
    returned status before reading them.
  * Bit-exact quantization needs IEEE float32 without fast math. The header asks for it with
    ``#pragma METAL fp math_mode(safe)`` / ``fp contract(off)`` (MSL >= 3.2, macOS 15); on older
    systems MLX's default compile options apply and bytes may differ from the other backends.
  * Inputs with fewer than 8 elements are bound by MLX in the ``constant`` address space; every
    small array is padded to 8 elements so that all bindings are ``device``, as the bodies expect.
"""
from __future__ import annotations

import math
import os
import re
import struct
from typing import Dict, List, Sequence, Tuple

__all__ = [
    "metal_source_dir",
    "header",
    "KERNELS",
    "generated_source",
    "pack_append_params",
    "pack_attention_params",
    "append",
    "attention",
]

QTILE = 4  # FMKV_METAL_QTILE (src/metal/params_msl.h)
APPEND_PARAMS_FORMAT = "<8iQq2i2iq2i4qqq"  # struct fmkv_metal_append_params: 128 bytes
ATTENTION_PARAMS_FORMAT = "<8iQq2i2iq2i2q2i2q2f2iq2iq"  # struct fmkv_metal_attention_params: 160 bytes
_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


def metal_source_dir() -> str:
    """Directory holding kernel_core.h: $FMKV_METAL_SRC, package data ``fmkv/metal_src``, or the
    source tree (``src/metal`` next to ``python/``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.environ.get("FMKV_METAL_SRC", ""), os.path.join(here, "metal_src"),
                  os.path.join(here, "..", "..", "src", "metal")]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "kernel_core.h")):
            return os.path.normpath(c)
    raise FileNotFoundError("fmkv Metal kernel sources not found (set FMKV_METAL_SRC to src/metal)")


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


def header() -> str:
    """The MLX ``header``: src/metal/kernel_core.h with its quoted includes resolved."""
    return _flatten(os.path.join(metal_source_dir(), "kernel_core.h"), set())


_IDS = ("threadgroup_position_in_grid.x, simdgroup_index_in_threadgroup, simdgroups_per_threadgroup, "
        "thread_index_in_simdgroup, threads_per_threadgroup.x")

# name -> (input names, output names, body). Bodies only cast MLX's typed bindings to the core's
# byte/word pointers and pass the thread ids; the kernels' logic is all in kernel_core.h.
KERNELS: Dict[str, Tuple[List[str], List[str], str]] = {
    "append_compress": (
        ["params", "pages", "fp16_k", "fp16_v", "k", "v", "seq_lens", "row_offsets", "block_table", "slots"],
        ["status"],
        "  fmkv_append_compress_impl(*(const device fmkv_metal_append_params*)params,\n"
        "      const_cast<device fmkv_u8*>((const device fmkv_u8*)pages), (const device fmkv_u16*)fp16_k,\n"
        "      (const device fmkv_u16*)fp16_v, (const device fmkv_u8*)k, (const device fmkv_u8*)v,\n"
        "      (const device fmkv_i64*)seq_lens, (const device fmkv_i64*)row_offsets,\n"
        "      (const device fmkv_i32*)block_table, (const device fmkv_i32*)slots, (device fmkv_u32*)status,\n"
        "      " + _IDS + ");\n"),
    "append_fp16": (
        ["params", "fp16_k", "fp16_v", "k", "v", "seq_lens", "row_offsets", "slots"],
        ["status"],
        "  fmkv_append_fp16_impl(*(const device fmkv_metal_append_params*)params,\n"
        "      const_cast<device fmkv_u16*>((const device fmkv_u16*)fp16_k),\n"
        "      const_cast<device fmkv_u16*>((const device fmkv_u16*)fp16_v), (const device fmkv_u8*)k,\n"
        "      (const device fmkv_u8*)v, (const device fmkv_i64*)seq_lens, (const device fmkv_i64*)row_offsets,\n"
        "      (const device fmkv_i32*)slots, thread_position_in_grid.x);\n"
        "  (void)status;\n"),
    "attention_partial": (
        ["params", "pages", "fp16_k", "fp16_v", "q", "seq_lens", "row_offsets", "block_table", "slots"],
        ["ws", "status"],
        "  FMKV_THREADGROUP_ARRAY(float, q_rot, FMKV_METAL_QTILE * 256);\n"
        "  FMKV_THREADGROUP_ARRAY(float, q_raw, FMKV_METAL_QTILE * 256);\n"
        "  fmkv_attention_partial_impl(*(const device fmkv_metal_attention_params*)params,\n"
        "      (const device fmkv_u8*)pages, (const device fmkv_u16*)fp16_k, (const device fmkv_u16*)fp16_v,\n"
        "      (const device fmkv_u8*)q, (const device fmkv_i64*)seq_lens, (const device fmkv_i64*)row_offsets,\n"
        "      (const device fmkv_i32*)block_table, (const device fmkv_i32*)slots, (device float*)ws,\n"
        "      (device fmkv_u32*)status, q_rot, q_raw,\n"
        "      " + _IDS + ");\n"),
    "attention_merge": (
        ["params", "row_offsets", "ws"],
        ["out", "status"],
        "  fmkv_attention_merge_impl(*(const device fmkv_metal_attention_params*)params,\n"
        "      (const device fmkv_i64*)row_offsets, (const device float*)ws, (device fmkv_u8*)out,\n"
        "      (device fmkv_u32*)status,\n"
        "      " + _IDS + ");\n"),
}

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


def generated_source(name: str, input_types: Dict[str, str], output_types: Dict[str, str]) -> str:
    """The kernel source MLX builds for KERNELS[name] (header + generated signature + body),
    following MLX's ``write_signature`` for inputs of >= 8 elements (``device`` bindings) and no
    template arguments. Types are MSL type names ("float", "half", "uint8_t", "int32_t", ...)."""
    inputs, outputs, body = KERNELS[name]
    src = header()
    src += "[[kernel]] void custom_kernel_fmkv_" + name + "(\n"
    index = 0
    for n in inputs:
        src += "  const device %s* %s [[buffer(%d)]],\n" % (input_types[n], n, index)
        index += 1
    attrs = ["  %s %s [[%s]]" % (t, a, a) for a, t in _MLX_ATTRIBUTES if a in body]
    for i, n in enumerate(outputs):
        src += "  device %s* %s [[buffer(%d)]]" % (output_types[n], n, index)
        src += ",\n" if (i < len(outputs) - 1 or attrs) else ") {\n"
        index += 1
    for i, a in enumerate(attrs):
        src += a + (",\n" if i < len(attrs) - 1 else ") {\n")
    return src + body + "\n}\n"


# ---------------------------------------------------------------------------------------------
# Parameter blocks (byte-identical to src/metal/host_plan.h).

def _page_bytes(d: int, H: int, kb: int, vb: int, P: int) -> int:
    def per_token(bits: int) -> int:
        return 2 * d if bits == 16 else (d // 32) * (4 * bits + 2)
    return H * (per_token(kb) + per_token(vb)) * P


def pack_append_params(cfg: dict, num_pages: int, num_slots: int, layer: int, num_seqs: int,
                       has_slots: bool, block_table_stride: int, k_dtype: str, v_dtype: str,
                       k_strides: Tuple[int, int], v_strides: Tuple[int, int], total_rows: int) -> bytes:
    c = cfg
    return struct.pack(
        APPEND_PARAMS_FORMAT, c["head_dim"], c["num_kv_heads"], c["k_bits"], c["v_bits"], c["page_size"],
        c.get("sink_tokens", 0), c.get("window_tokens", 0), c.get("scale_rule", 1), c.get("seed", 0) & (2**64 - 1),
        num_pages, num_slots, layer, num_seqs, int(has_slots), block_table_stride,
        _DTYPE_CODES[k_dtype], _DTYPE_CODES[v_dtype], k_strides[0], k_strides[1], v_strides[0], v_strides[1],
        total_rows, _page_bytes(c["head_dim"], c["num_kv_heads"], c["k_bits"], c["v_bits"], c["page_size"]))


def pack_attention_params(cfg: dict, num_pages: int, num_slots: int, layer: int, num_seqs: int,
                          has_slots: bool, block_table_stride: int, q_heads: int, q_dtype: str,
                          q_strides: Tuple[int, int], out_dtype: str, out_strides: Tuple[int, int],
                          max_rows: int, max_len: int, softmax_scale: float, softcap: float,
                          simdgroups: int, splits: int) -> bytes:
    c = cfg
    group = q_heads // c["num_kv_heads"]
    tiles = max(1, -(-max_rows * group // QTILE))
    split_len = -(-max(1, max_len) // splits)
    scale = softmax_scale if softmax_scale > 0 else 1.0 / math.sqrt(c["head_dim"])
    return struct.pack(
        ATTENTION_PARAMS_FORMAT, c["head_dim"], c["num_kv_heads"], c["k_bits"], c["v_bits"], c["page_size"],
        c.get("sink_tokens", 0), c.get("window_tokens", 0), c.get("scale_rule", 1), c.get("seed", 0) & (2**64 - 1),
        num_pages, num_slots, layer, num_seqs, int(has_slots), block_table_stride, q_heads, _DTYPE_CODES[q_dtype],
        q_strides[0], q_strides[1], _DTYPE_CODES[out_dtype], max_rows, out_strides[0], out_strides[1], scale,
        softcap, tiles, splits, split_len, splits * simdgroups, 0,
        _page_bytes(c["head_dim"], c["num_kv_heads"], c["k_bits"], c["v_bits"], c["page_size"]))


# ---------------------------------------------------------------------------------------------
# Launchers (need MLX on Apple silicon; untested here).

_kernel_cache: Dict[str, object] = {}


def _mx():
    import mlx.core as mx  # deferred: fmkv.mlx imports on any platform
    return mx


def _kernel(name: str):
    if name not in _kernel_cache:
        mx = _mx()
        inputs, outputs, body = KERNELS[name]
        _kernel_cache[name] = mx.fast.metal_kernel(name="fmkv_" + name, input_names=inputs, output_names=outputs,
                                                   source=body, header=header(), ensure_row_contiguous=True)
    return _kernel_cache[name]


def _params_array(blob: bytes):
    mx = _mx()
    import numpy as np
    return mx.array(np.frombuffer(blob, dtype=np.int32).copy())


def _pad8(a):
    """Arrays of < 8 elements are bound as `constant` by MLX; pad so every binding is `device`."""
    mx = _mx()
    flat = a.reshape(-1)
    if flat.size >= 8:
        return flat
    return mx.concatenate([flat, mx.zeros((8 - flat.size,), dtype=flat.dtype)])


def append(cfg: dict, layer: int, pages, fp16_k, fp16_v, k, v, seq_lens: Sequence[int],
           row_offsets: Sequence[int], block_table, slots=None, threads: int = 128):
    """Quantize-append k, v ([rows][kv_heads][head_dim], float32/float16/bfloat16 MLX arrays) into
    the page pool ``pages`` (uint8) and fp16 regions (uint16), in place. Returns the kernel status
    (uint32[2]; nonzero: block table entry out of range / bad launch). Host-side validation
    (shapes, finiteness) is the caller's: see fmkv.Cache for the checked API."""
    mx = _mx()
    H, d = cfg["num_kv_heads"], cfg["head_dim"]
    rows = int(k.shape[0])
    S, W = cfg.get("sink_tokens", 0), cfg.get("window_tokens", 0)
    num_pages = int(pages.size) // _page_bytes(d, H, cfg["k_bits"], cfg["v_bits"], cfg["page_size"])
    num_seqs = len(seq_lens)
    num_slots = max(1, int(fp16_k.size) // max(1, H * (S + W) * d)) if S + W > 0 else 1
    blob = pack_append_params(cfg, num_pages, num_slots, layer, num_seqs, slots is not None,
                              int(block_table.shape[-1]), str(k.dtype).split(".")[-1], str(v.dtype).split(".")[-1],
                              (H * d, d), (H * d, d), rows)
    params = _params_array(blob)
    lens = _pad8(mx.array(list(seq_lens), dtype=mx.int64))
    offs = _pad8(mx.array(list(row_offsets), dtype=mx.int64))
    table = _pad8(block_table.astype(mx.int32))
    sl = _pad8(slots.astype(mx.int32) if slots is not None else mx.zeros((8,), dtype=mx.int32))
    fk, fv = _pad8(fp16_k), _pad8(fp16_v)
    items = rows * H * 2
    nsg = threads // 32
    groups = -(-items // nsg)
    (status,) = _kernel("append_compress")(
        inputs=[params, pages.reshape(-1), fk, fv, k, v, lens, offs, table, sl],
        output_shapes=[(2,)], output_dtypes=[mx.uint32], grid=(max(1, groups) * threads, 1, 1),
        threadgroup=(threads, 1, 1), init_value=0)
    if S + W > 0:
        mx.eval(status)  # pass 2 overwrites ring slots pass 1 reads
        total = items * d
        _kernel("append_fp16")(
            inputs=[params, fk, fv, k, v, lens, offs, sl], output_shapes=[(2,)], output_dtypes=[mx.uint32],
            grid=(-(-total // 256) * 256, 1, 1), threadgroup=(256, 1, 1), init_value=0)
    return status


def attention(cfg: dict, layer: int, pages, fp16_k, fp16_v, q, seq_lens: Sequence[int],
              row_offsets: Sequence[int], block_table, slots=None, softmax_scale: float = 0.0,
              softcap: float = 0.0, out_dtype: str = "float32", simdgroups: int = 4, splits: int = 1):
    """Decode attention of q ([rows][q_heads][head_dim]) over the compressed cache; returns
    (out [rows][q_heads][head_dim], status)."""
    mx = _mx()
    H, d = cfg["num_kv_heads"], cfg["head_dim"]
    rows, HQ = int(q.shape[0]), int(q.shape[1])
    S, W = cfg.get("sink_tokens", 0), cfg.get("window_tokens", 0)
    num_pages = int(pages.size) // _page_bytes(d, H, cfg["k_bits"], cfg["v_bits"], cfg["page_size"])
    num_seqs = len(seq_lens)
    num_slots = max(1, int(fp16_k.size) // max(1, H * (S + W) * d)) if S + W > 0 else 1
    max_rows = max(row_offsets[i + 1] - row_offsets[i] for i in range(num_seqs))
    blob = pack_attention_params(cfg, num_pages, num_slots, layer, num_seqs, slots is not None,
                                 int(block_table.shape[-1]), HQ, str(q.dtype).split(".")[-1], (HQ * d, d),
                                 out_dtype, (HQ * d, d), max_rows, max(seq_lens), softmax_scale, softcap,
                                 simdgroups, splits)
    fields = struct.unpack(ATTENTION_PARAMS_FORMAT, blob)
    tiles, parts = fields[25], fields[28]
    items = num_seqs * H * tiles * QTILE
    params = _params_array(blob)
    lens = _pad8(mx.array(list(seq_lens), dtype=mx.int64))
    offs = _pad8(mx.array(list(row_offsets), dtype=mx.int64))
    table = _pad8(block_table.astype(mx.int32))
    sl = _pad8(slots.astype(mx.int32) if slots is not None else mx.zeros((8,), dtype=mx.int32))
    ws, status = _kernel("attention_partial")(
        inputs=[params, pages.reshape(-1), _pad8(fp16_k), _pad8(fp16_v), q, lens, offs, table, sl],
        output_shapes=[(items * parts * (2 + d),), (2,)], output_dtypes=[mx.float32, mx.uint32],
        grid=(num_seqs * H * tiles * splits * simdgroups * 32, 1, 1), threadgroup=(simdgroups * 32, 1, 1),
        init_value=0)
    out_t = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[out_dtype]
    merge_sg = 2
    out, status2 = _kernel("attention_merge")(
        inputs=[params, offs, ws], output_shapes=[(rows, HQ, d), (2,)], output_dtypes=[out_t, mx.uint32],
        grid=(-(-items // merge_sg) * merge_sg * 32, 1, 1), threadgroup=(merge_sg * 32, 1, 1), init_value=0)
    return out, status + status2

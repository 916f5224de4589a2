"""fmkv on MLX: a compressed KV cache whose bytes are the format's, on any device MLX runs on.

    import mlx.core as mx, fmkv, fmkv.mlx
    layer = fmkv.mlx.MlxLayer(fmkv.Config(head_dim=128, num_kv_heads=8, k_bits=4, v_bits=4), max_tokens=8192)
    layer.append(k, v)                  # [1, kv_heads, n, 128] MLX arrays
    out = layer.attention(q)            # [1, q_heads, n, 128] -> [n, q_heads, 128]

Runtimes (fmkv.mlx.layer.resolve_runtime; default: MLX's default device):

* Apple GPU: the single-source kernel core (src/metal/kernel_core.h) through ``mx.fast.metal_kernel``;
* MLX's CUDA backend: the same kernel core, bodies and launch path through ``mx.fast.cuda_kernel``
  (fmkv.mlx.gpu; only the kernel dialect differs, fmkv.mlx.kernels);
* MLX's CPU device: fmkv's C host backends on the MLX arrays' memory (fmkv.mlx.host).

``fmkv.mlx.lm`` is an mlx-lm KV cache on top (``FmkvKVCache``, ``make_prompt_cache``), and
``fmkv.mlx.gguf_llama`` builds an mlx-lm llama model from a GGUF file. docs/METAL.md says what has
run on which MLX.

Caveats (MLX semantics): the storage arrays are written in place (the kernels cast their input
buffers to writable, as MLX's own in-place cache kernels do): do not keep other references to them
expecting old contents. On the GPU runtimes kernels are lazy MLX operations ordered among themselves
(each takes the previous one's output as a dependency); errors they detect surface at
``MlxLayer.check()``. Importing this package needs neither MLX nor the kernel sources.
"""
from __future__ import annotations

from .kernels import (KERNELS, generated_source, header, metal_source_dir, pack_append_params,
                      pack_attention_params)
from .layer import RUNTIMES, MlxLayer, resolve_runtime

__all__ = ["MlxLayer", "resolve_runtime", "RUNTIMES", "KERNELS", "generated_source", "header", "metal_source_dir",
           "pack_append_params", "pack_attention_params"]

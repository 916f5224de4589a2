// Stand-in for MLX's JIT header of the same name (compiled into libmlx, not shipped as a file), for
// compiling the sources mx.fast.cuda_kernel generates with nvcc in tests/python/test_mlx_kernels.py.
// The fmkv kernels use nothing from it; it provides what the real one makes available to them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
namespace mlx::core::cu {}

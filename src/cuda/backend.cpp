// The CUDA backend in the backend registry (host C++: the table of entry points of backend.h).
#include "backend.h"

#include "../core/backend.h"
#include "code_widths.cuh"

namespace fmkv {
extern const BackendOps cuda_backend = {
    FMKV_BACKEND_CUDA, /*host_memory=*/false, /*attention_rel_error=*/4e-3,  // fp16 tensor-core operands
    cuda::available, cuda::device_name,
    cuda::append, cuda::decode_attention, cuda::append_attention, cuda::attention_workspace_bytes,
    cuda::alloc, cuda::free, cuda::copy, cuda::synchronize, /*attention_lse=*/true,
    /*max_format_version=*/3, /*max_scale_group=*/64, /*max_code_bits=*/FMKV_CUDA_CODE_BITS_MAX,
    cuda::check_attention};
}  // namespace fmkv

// The reference backend (the oracle) in the backend registry: host memory, float64 attention.
#include "../core/backend.h"
#include "append.h"
#include "decode_attention.h"

namespace fmkv {

extern const BackendOps ref_backend = {
    FMKV_BACKEND_REF, /*host_memory=*/true, /*attention_rel_error=*/1e-6,
    [] { return true; },
    [] { return std::string("host (scalar reference)"); },
    ref::append, ref::decode_attention,
    /*append_attention=*/nullptr, /*attention_workspace_bytes=*/nullptr,
    /*alloc=*/nullptr, /*free=*/nullptr, /*copy=*/nullptr, /*synchronize=*/nullptr, /*attention_lse=*/true,
    /*max_format_version=*/3, /*max_scale_group=*/64, /*max_code_bits=*/FMKV_CODE_BITS_MAX,
    /*check_attention=*/nullptr};

}  // namespace fmkv

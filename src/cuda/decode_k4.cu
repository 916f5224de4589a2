// Instantiations of the decode attention kernel for k_bits = 4 (split by K width for build parallelism).
#include "decode_attention.cuh"

namespace fmkv {
namespace cuda {
FMKV_ATTN_DISPATCH(4)
}  // namespace cuda
}  // namespace fmkv

#pragma once
#include "../core/ops.h"

namespace fmkv::ref {
// Attention of q over the cache in float64: rotated domain for compressed tokens, online softmax,
// output rotated back once. Writes out in its dtype.
void decode_attention(const AttentionArgs& a);
}  // namespace fmkv::ref

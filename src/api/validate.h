// Argument validation shared by every backend. Throws fmkv::Error naming the problem.
#pragma once
#include "../core/config.h"
#include "../core/ops.h"

namespace fmkv {
// Shape/dtype/stride checks that need no access to the tensors' memory.
void validate_append_shapes(const AppendArgs& a);
void validate_attention_shapes(const AttentionArgs& a);
// fmkv_attention_lse's lse tensor: f32, q's rows and heads, last dimension 1.
void validate_attention_lse(const AttentionArgs& a);
// Checks that read batch arrays and tensor contents: host-memory backends only.
void validate_append_host(const AppendArgs& a);
void validate_attention_host(const AttentionArgs& a);

}  // namespace fmkv

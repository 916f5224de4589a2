#pragma once
#include "../core/ops.h"

namespace fmkv::ref {
// Append K/V tokens (sequentially, token by token): sink -> fp16, else through the fp16 window,
// flushing the token that ages out of it into its compressed page.
void append(const AppendArgs& a);
}  // namespace fmkv::ref

// Entry points of the CPU backend (SIMD + threads, host memory): one op per file.
#pragma once
#include <string>

#include "../core/ops.h"

namespace fmkv::cpu {
void append(const AppendArgs& a);            // append.cpp
void decode_attention(const AttentionArgs& a);  // decode_attention.cpp
std::string device_name();                   // backend.cpp: CPU model and the SIMD level selected at run time
}  // namespace fmkv::cpu

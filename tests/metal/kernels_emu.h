// Launchers of the exact MSL kernels (src/metal/*.metal) in the CPU emulator. The kernels are
// compiled in kernels_emu.cpp, a translation unit of their own (host C++ against
// tests/metal/emu/metal_stdlib); this header only needs the plain-host parameter blocks.
#pragma once
#include <cstdint>

#include "emulator.h"
#include "format/portability.h"
#include "metal/params_msl.h"

namespace emu_kernels {

struct AppendBuffers {
  uint8_t* pages;
  uint16_t *fp16_k, *fp16_v;
  const uint8_t *k, *v;
  const int64_t *seq_lens, *row_offsets;
  const int32_t *block_table, *slots;
  uint32_t* status;  // [2]
};
struct AttentionBuffers {
  const uint8_t* pages;
  const uint16_t *fp16_k, *fp16_v;
  const uint8_t* q;
  const int64_t *seq_lens, *row_offsets;
  const int32_t *block_table, *slots;
  float* ws;
  uint8_t* out;
  uint32_t* status;  // [2]
  float* lse;        // fmkv_attention_lse (params.has_lse); nullptr: not requested
};
struct Launch {
  uint32_t groups, threads;
  emu::Order order;
  uint64_t seed;
};

// tests/metal/core_test.metal
struct CoreTestParams {
  int32_t head_dim, bits, scale_rule, layer;
  uint64_t seed;
  int32_t vectors, table;
  int32_t scale_group, reserved;
};
struct CoreTestBuffers {
  const float* x;
  float *sums, *rotated;
  uint32_t* codes;
  uint16_t* scales;
  uint32_t* words;
  float* group_sums;  // gsums of core_test.metal
};
void core_test(const CoreTestParams& p, const CoreTestBuffers& b, const Launch& l);

void append_compress(const fmkv_metal_append_params& p, const AppendBuffers& b, const Launch& l);
// l.groups * l.threads must cover every element thread.
void append_fp16(const fmkv_metal_append_params& p, const AppendBuffers& b, const Launch& l);
void attention_partial(const fmkv_metal_attention_params& p, const AttentionBuffers& b, const Launch& l);
void attention_merge(const fmkv_metal_attention_params& p, const AttentionBuffers& b, const Launch& l);

}  // namespace emu_kernels

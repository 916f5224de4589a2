// The exact text of the MSL kernels, compiled as host C++ for the emulator (FMKV_EMULATOR), and
// their launchers. Nothing here adapts the kernels: they see their [[buffer]] pointers and
// [[thread ids]] as arguments, as on a GPU.
#include "../../src/metal/quantize.metal"
#include "../../src/metal/decode_attention.metal"
#include "core_test.metal"
#include "kernels_emu.h"

namespace emu_kernels {

void append_compress(const fmkv_metal_append_params& p, const AppendBuffers& b, const Launch& l) {
  emu::dispatch(l.groups, l.threads, l.order, l.seed, [&](const emu::ThreadIds& t) {
    fmkv_append_compress(p, b.pages, b.fp16_k, b.fp16_v, b.k, b.v, b.seq_lens, b.row_offsets, b.block_table,
                         b.slots, b.status, t.group, t.simdgroup, t.simdgroups, t.lane, t.threads);
  });
}

void append_fp16(const fmkv_metal_append_params& p, const AppendBuffers& b, const Launch& l) {
  emu::dispatch(l.groups, l.threads, l.order, l.seed, [&](const emu::ThreadIds& t) {
    fmkv_append_fp16(p, b.fp16_k, b.fp16_v, b.k, b.v, b.seq_lens, b.row_offsets, b.slots, t.grid_thread);
  });
}

void attention_partial(const fmkv_metal_attention_params& p, const AttentionBuffers& b, const Launch& l) {
  emu::dispatch(l.groups, l.threads, l.order, l.seed, [&](const emu::ThreadIds& t) {
    fmkv_attention_partial(p, b.pages, b.fp16_k, b.fp16_v, b.q, b.seq_lens, b.row_offsets, b.block_table, b.slots,
                           b.ws, b.status, t.group, t.simdgroup, t.simdgroups, t.lane, t.threads);
  });
}

void attention_merge(const fmkv_metal_attention_params& p, const AttentionBuffers& b, const Launch& l) {
  emu::dispatch(l.groups, l.threads, l.order, l.seed, [&](const emu::ThreadIds& t) {
    fmkv_attention_merge(p, b.row_offsets, b.ws, b.out, b.status, b.lse, t.group, t.simdgroup, t.simdgroups, t.lane,
                         t.threads);
  });
}

void core_test(const CoreTestParams& p, const CoreTestBuffers& b, const Launch& l) {
  static_assert(sizeof(CoreTestParams) == sizeof(fmkv_core_test_params), "core test params");
  fmkv_core_test_params q;
  std::memcpy(&q, &p, sizeof q);
  emu::dispatch(l.groups, l.threads, l.order, l.seed, [&](const emu::ThreadIds& t) {
    fmkv_core_test(q, b.x, b.sums, b.rotated, b.codes, b.scales, b.words, b.group_sums, t.group, t.simdgroup,
                   t.simdgroups, t.lane);
  });
}

}  // namespace emu_kernels

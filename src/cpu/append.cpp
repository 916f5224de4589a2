// CPU append: fp16 sink / window ring / compressed pages, bytes identical to ref::append.
//
// Thread -> data mapping. The sequential token-by-token semantics of the reference are split into
// two phases with no intra-phase dependencies:
//  1. compress: every new position p whose arrival pushes a token q out of the window (q = p - W,
//     or q = p when W == 0) yields one task "quantize token q into compressed slot q - S"; the source
//     is the input row when q was appended in this call, else the old ring slot (read before phase 2
//     overwrites it). Tasks are independent (distinct page words/scales); parallel over blocks of
//     kTokBlock tasks, each task covering all kv heads, K and V. With tile blocks (format 3, 3-bit
//     sections) the 16 token slots of a tile share code words, which each task read-modify-writes: a
//     block then ends only where the tile changes (whole tiles' tasks, up to kTokBlock of them), so no
//     two threads touch one tile block.
//  2. fp16 writes: sink slots, and ring slots whose write is the last one to that slot in this call;
//     parallel over blocks of tokens.
// Every byte is produced by exactly one task, so results do not depend on the thread count.
#include <utility>
#include <vector>

#include "backend.h"
#include "../core/tensor_io.h"
#include "kernels.h"
#include "quantize.h"
#include "thread_pool.h"

namespace fmkv::cpu {
namespace {
constexpr int64_t kTokBlock = 16;

struct Task {
  int32_t seq;
  int64_t q;  // position of the token compressed
};
}  // namespace

void append(const AppendArgs& a) {
  const fmkv_config& c = a.cfg;
  const Kernels& K = kernels();
  const int32_t d = c.head_dim, H = c.num_kv_heads, R = fp16_slots(c), S = c.sink_tokens, W = c.window_tokens,
                P = c.page_size;
  const int64_t pb = page_bytes(c);
  QuantParams qk, qv;
  if (c.k_bits != FMKV_FP16_BITS) make_quant_params(d, c.k_bits, c.scale_rule, c.seed, a.layer.layer, c.format_version, 0, c.scale_group, &qk);
  make_quant_params(d, c.v_bits, c.scale_rule, c.seed, a.layer.layer, c.format_version, 1, c.scale_group, &qv);
  const int32_t version = fmkv_resolved_format_version(c.format_version);
  const bool tiled = fmkv_tiled_codes(version, c.k_bits) || fmkv_tiled_codes(version, c.v_bits);

  std::vector<Task> tasks;
  for (int32_t s = 0; s < a.batch.num_seqs; ++s) {
    const int64_t n = a.batch.row_offsets[s + 1] - a.batch.row_offsets[s], len0 = a.batch.seq_lens[s];
    for (int64_t p = len0 < S ? S : len0; p < len0 + n; ++p) {
      const int64_t ci = p - S;
      if (W == 0) tasks.push_back({s, p});
      else if (ci >= W) tasks.push_back({s, p - W});
    }
  }

  auto source = [&](int32_t s, int64_t q, int is_v, int32_t h, uint16_t* buf) -> const uint16_t* {
    const int64_t row0 = a.batch.row_offsets[s], len0 = a.batch.seq_lens[s];
    if (q < len0) {  // still in the fp16 ring from an earlier call
      const int32_t slot = a.batch.slots ? a.batch.slots[s] : 0;
      const uint16_t* region = is_v ? a.layer.fp16_v : a.layer.fp16_k;
      return region + (((int64_t)slot * H + h) * R + fp16_slot_of(c, q)) * d;
    }
    const fmkv_tensor& t = is_v ? a.v : a.k;
    K.to_f16(tensor_ptr(t, row0 + (q - len0), h), t.dtype, d, buf);
    return buf;
  };

  const int64_t ntask = (int64_t)tasks.size();
  // Block boundaries when tiled: runs of tasks of one tile (a sequence's tasks are consecutive and in
  // order), joined while a block stays within kTokBlock tasks.
  std::vector<int64_t> bounds;
  if (tiled) {
    bounds.push_back(0);
    auto tile = [&](int64_t i) { return std::make_pair(tasks[(size_t)i].seq, (tasks[(size_t)i].q - S) >> 4); };
    for (int64_t i = 0, run = 0; i < ntask; i = run) {
      for (run = i + 1; run < ntask && tile(run) == tile(i);) ++run;
      if (run - bounds.back() > kTokBlock && i > bounds.back()) bounds.push_back(i);
    }
    bounds.push_back(ntask);
  }
  const int64_t nblk = tiled ? (int64_t)bounds.size() - 1 : (ntask + kTokBlock - 1) / kTokBlock;
  ThreadPool::instance().parallel_for(nblk, [&](int64_t blk) {
    alignas(64) uint16_t buf[256];
    const int64_t i0 = tiled ? bounds[(size_t)blk] : blk * kTokBlock;
    const int64_t i1 = tiled ? bounds[(size_t)blk + 1] : (blk + 1) * kTokBlock < ntask ? (blk + 1) * kTokBlock : ntask;
    for (int64_t i = i0; i < i1; ++i) {
      const Task& tk = tasks[(size_t)i];
      const int32_t* bt = a.batch.block_table + (int64_t)tk.seq * a.batch.block_table_stride;
      const int64_t co = tk.q - S;
      const int32_t page = bt[co / P], t = (int32_t)(co % P);
      uint8_t* pg = a.layer.pages + (int64_t)page * pb;
      for (int is_v = 0; is_v < 2; ++is_v) {
        const int32_t bits = is_v ? c.v_bits : c.k_bits;
        for (int32_t h = 0; h < H; ++h) {
          const uint16_t* x = source(tk.seq, tk.q, is_v, h, buf);
          uint8_t* sec = pg + section_offset(c, h, is_v);
          if (bits == FMKV_FP16_BITS) std::memcpy((uint16_t*)sec + (int64_t)t * d, x, (size_t)d * 2);
          else K.quantize(is_v ? qv : qk, x, sec, P, t);
        }
      }
    }
  });

  if (R == 0) return;
  // Phase 2: fp16 sink and ring writes (rows of all sequences, flattened).
  const int64_t rows = a.batch.num_seqs > 0 ? a.batch.row_offsets[a.batch.num_seqs] : 0;
  ThreadPool::instance().parallel_for((rows + kTokBlock - 1) / kTokBlock, [&](int64_t blk) {
    int32_t s = 0;
    for (int64_t row = blk * kTokBlock; row < rows && row < (blk + 1) * kTokBlock; ++row) {
      while (a.batch.row_offsets[s + 1] <= row) ++s;
      const int64_t row0 = a.batch.row_offsets[s], n = a.batch.row_offsets[s + 1] - row0;
      const int64_t p = a.batch.seq_lens[s] + (row - row0);
      const bool sink = p < S, last_ring_write = W > 0 && p >= a.batch.seq_lens[s] + n - W;
      if (!sink && !last_ring_write) continue;
      const int32_t slot = a.batch.slots ? a.batch.slots[s] : 0, fs = fp16_slot_of(c, p);
      for (int is_v = 0; is_v < 2; ++is_v) {
        const fmkv_tensor& src = is_v ? a.v : a.k;
        uint16_t* region = is_v ? a.layer.fp16_v : a.layer.fp16_k;
        for (int32_t h = 0; h < H; ++h)
          K.to_f16(tensor_ptr(src, row, h), src.dtype, d, region + (((int64_t)slot * H + h) * R + fs) * d);
      }
    }
  });
}

}  // namespace fmkv::cpu

#include "append.h"

#include <vector>

#include "../core/tensor_io.h"
#include "../format/codebook.h"
#include "quantize.h"

namespace fmkv::ref {
namespace {

struct SectionRef {
  uint8_t* base;  // start of the K or V section of one head in one page
  int32_t bits, d, P;
  int is_v;
};

SectionRef section(const AppendArgs& a, int32_t page, int32_t h, int is_v) {
  const fmkv_config& c = a.cfg;
  uint8_t* p = a.layer.pages + (int64_t)page * page_bytes(c) +
               section_offset(c, h, is_v);
  return {p, is_v ? c.v_bits : c.k_bits, c.head_dim, c.page_size, is_v};
}

// Write one head vector (fp16 bits) into token slot t of a page section.
void write_compressed(const AppendArgs& a, const SectionRef& s, int32_t t, const uint16_t* x) {
  if (s.bits == FMKV_FP16_BITS) {  // K kept in fp16, unrotated
    uint16_t* dst = (uint16_t*)s.base + (int64_t)t * s.d;
    for (int32_t i = 0; i < s.d; ++i) dst[i] = x[i];
    return;
  }
  std::vector<uint64_t> sw = sign_words(a.cfg.seed, a.layer.layer, s.d);
  std::vector<uint8_t> codes(s.d);
  const int32_t sg = a.cfg.scale_group;
  std::vector<uint16_t> scales(fmkv_scales_per_vector(s.d, sg));
  const int32_t version = fmkv_resolved_format_version(a.cfg.format_version);
  quantize_vector(x, s.d, s.bits, a.cfg.scale_rule, sw.data(), codes.data(), scales.data(),
                  codebook_table(version, s.bits, s.is_v), sg);
  write_token_codes(s.base, version, s.is_v, s.d, s.bits, s.P, t, codes.data(), scales.data(), sg);
}

}  // namespace

void append(const AppendArgs& a) {
  const fmkv_config& c = a.cfg;
  const int32_t d = c.head_dim, H = c.num_kv_heads, R = fp16_slots(c);
  std::vector<uint16_t> x(d);
  for (int32_t s = 0; s < a.batch.num_seqs; ++s) {
    const int64_t row0 = a.batch.row_offsets[s], n = a.batch.row_offsets[s + 1] - row0;
    const int64_t len0 = a.batch.seq_lens[s];
    const int32_t slot = a.batch.slots ? a.batch.slots[s] : 0;
    const int32_t* bt = a.batch.block_table + (int64_t)s * a.batch.block_table_stride;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = len0 + j;
      for (int is_v = 0; is_v < 2; ++is_v) {
        const fmkv_tensor& src = is_v ? a.v : a.k;
        uint16_t* region = is_v ? a.layer.fp16_v : a.layer.fp16_k;
        for (int32_t h = 0; h < H; ++h) {
          for (int32_t i = 0; i < d; ++i) x[i] = load_f16(src, row0 + j, h, i);
          uint16_t* rh = region ? region + ((int64_t)slot * H + h) * R * d : nullptr;
          if (p < c.sink_tokens) {
            for (int32_t i = 0; i < d; ++i) rh[(int64_t)p * d + i] = x[i];
            continue;
          }
          int64_t ci = p - c.sink_tokens;  // compressed index of this token
          if (c.window_tokens > 0) {
            uint16_t* ring = rh + (int64_t)fp16_slot_of(c, p) * d;
            if (ci >= c.window_tokens) {  // token p - W leaves the window: compress it
              int64_t co = ci - c.window_tokens;
              write_compressed(a, section(a, bt[co / c.page_size], h, is_v), (int32_t)(co % c.page_size), ring);
            }
            for (int32_t i = 0; i < d; ++i) ring[i] = x[i];
          } else {
            write_compressed(a, section(a, bt[ci / c.page_size], h, is_v), (int32_t)(ci % c.page_size), x.data());
          }
        }
      }
    }
  }
}

}  // namespace fmkv::ref

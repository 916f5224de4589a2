#include "format1.h"

#include <cstring>

#include "../core/ops.h"
#include "../format/pack.h"

namespace fmkv::io {

bool format1_differs(const fmkv_config& c) { return c.k_bits == 4 || c.v_bits == 4; }

namespace {
// The 32 codes (sign << 3 | magnitude) of one group from its four format-1 words.
void unpack_format1_group(const uint32_t (&w)[4], uint8_t* codes) {
  for (int32_t j = 0; j < 32; ++j) {
    const uint32_t low = (w[fmkv_field_word(j)] >> fmkv_field_shift(j)) & 3u;
    const uint32_t bit2 = (w[2] >> j) & 1u, sign = (w[3] >> j) & 1u;
    codes[j] = (uint8_t)(sign << 3 | bit2 << 2 | low);
  }
}
}  // namespace

void upgrade_format1_pages(const fmkv_config& c, uint8_t* pages, int64_t num_pages) {
  const int32_t d = c.head_dim, P = c.page_size, G = fmkv_groups(d);
  const int64_t pb = page_bytes(c);
  for (int64_t pg = 0; pg < num_pages; ++pg)
    for (int32_t h = 0; h < c.num_kv_heads; ++h)
      for (int isv = 0; isv < 2; ++isv) {
        if ((isv ? c.v_bits : c.k_bits) != 4) continue;
        uint8_t* sec = pages + pg * pb + fmkv_section_offset(d, c.k_bits, c.v_bits, P, h, isv, c.scale_group);
        for (int32_t g = 0; g < G; ++g)
          for (int32_t t = 0; t < P; ++t) {
            uint32_t w[4], nib[4];
            uint8_t codes[32];
            for (int k = 0; k < 4; ++k) std::memcpy(&w[k], sec + 4 * fmkv_code_word_index(4, P, g, k, t), 4);
            unpack_format1_group(w, codes);
            pack_group_words(codes, 4, nib);
            for (int k = 0; k < 4; ++k) std::memcpy(sec + 4 * fmkv_code_word_index(4, P, g, k, t), &nib[k], 4);
          }
      }
}

}  // namespace fmkv::io

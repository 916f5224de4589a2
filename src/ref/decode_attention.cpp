#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "../core/tensor_io.h"
#include "../format/codebook.h"
#include "quantize.h"

namespace fmkv::ref {
namespace {

// Dequantized rotated values (or fp16 unrotated values when bits == 16) of one token of one head.
void load_compressed(const AttentionArgs& a, int32_t page, int32_t t, int32_t h, int is_v,
                     double* out) {
  const fmkv_config& c = a.cfg;
  const int32_t d = c.head_dim, bits = is_v ? c.v_bits : c.k_bits, P = c.page_size;
  const uint8_t* base = a.layer.pages + (int64_t)page * page_bytes(c) +
                        section_offset(c, h, is_v);
  if (bits == FMKV_FP16_BITS) {
    for (int32_t i = 0; i < d; ++i) out[i] = f16_to_f32(((const uint16_t*)base)[(int64_t)t * d + i]);
    return;
  }
  std::vector<uint8_t> codes(d);
  std::vector<uint16_t> scales(fmkv_scales_per_vector(d, c.scale_group));
  const int32_t version = fmkv_resolved_format_version(c.format_version);
  read_token_codes(base, version, is_v, d, bits, P, t, codes.data(), scales.data(), c.scale_group);
  dequantize_vector(codes.data(), scales.data(), d, bits, out, codebook_table(version, bits, is_v), c.scale_group);
}

}  // namespace

void decode_attention(const AttentionArgs& a) {
  const fmkv_config& c = a.cfg;
  const int32_t d = c.head_dim, H = c.num_kv_heads, HQ = a.q.heads, group = HQ / H, R = fp16_slots(c);
  const double scale = a.opts.softmax_scale > 0 ? a.opts.softmax_scale : 1.0 / std::sqrt((double)d);
  const std::vector<uint64_t> sw = sign_words(c.seed, a.layer.layer, d);
  std::vector<double> q(d), qr(d), k(d), v(d), acc_raw(d), acc_rot(d), o(d);
  for (int32_t s = 0; s < a.batch.num_seqs; ++s) {
    const int64_t row0 = a.batch.row_offsets[s], nq = a.batch.row_offsets[s + 1] - row0;
    const int64_t len = a.batch.seq_lens[s], E = compressed_end(c, len);
    const int32_t slot = a.batch.slots ? a.batch.slots[s] : 0;
    const int32_t* bt = a.batch.block_table + (int64_t)s * a.batch.block_table_stride;
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t pos = len - nq + j;  // causal: attend to [0, pos]
      for (int32_t hq = 0; hq < HQ; ++hq) {
        const int32_t h = hq / group;
        for (int32_t i = 0; i < d; ++i) q[i] = load_f32(a.q, row0 + j, hq, i);
        rotate_f64(q.data(), d, sw.data(), qr.data());
        double m = -INFINITY, l = 0;
        std::fill(acc_raw.begin(), acc_raw.end(), 0.0);
        std::fill(acc_rot.begin(), acc_rot.end(), 0.0);
        for (int64_t p = 0; p <= pos; ++p) {
          const bool compressed = p >= c.sink_tokens && p < E;
          const bool k_rot = compressed && c.k_bits != FMKV_FP16_BITS, v_rot = compressed;
          if (compressed) {
            int64_t ci = p - c.sink_tokens;
            int32_t page = bt[ci / c.page_size], t = (int32_t)(ci % c.page_size);
            load_compressed(a, page, t, h, 0, k.data());
            load_compressed(a, page, t, h, 1, v.data());
          } else {
            int64_t off = (((int64_t)slot * H + h) * R + fp16_slot_of(c, p)) * d;
            for (int32_t i = 0; i < d; ++i) {
              k[i] = f16_to_f32(a.layer.fp16_k[off + i]);
              v[i] = f16_to_f32(a.layer.fp16_v[off + i]);
            }
          }
          const double* qq = k_rot ? qr.data() : q.data();
          double sc = 0;
          for (int32_t i = 0; i < d; ++i) sc += qq[i] * k[i];
          sc *= scale;
          if (a.opts.softcap > 0) sc = a.opts.softcap * std::tanh(sc / a.opts.softcap);
          const double mn = std::max(m, sc), corr = std::exp(m - mn), pw = std::exp(sc - mn);
          l = l * corr + pw;
          std::vector<double>& acc = v_rot ? acc_rot : acc_raw;
          for (int32_t i = 0; i < d; ++i) {
            acc_raw[i] *= corr;
            acc_rot[i] *= corr;
            acc[i] += pw * v[i];
          }
          m = mn;
        }
        unrotate_f64(acc_rot.data(), d, sw.data(), o.data());
        for (int32_t i = 0; i < d; ++i) store_f32(a.out, row0 + j, hq, i, (float)((acc_raw[i] + o[i]) / l));
        if (a.lse.data) store_f32(a.lse, row0 + j, hq, 0, (float)(m + std::log(l)));
      }
    }
  }
}

}  // namespace fmkv::ref

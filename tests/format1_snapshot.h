// The caches behind the format-1 snapshot files in tests/golden/format1_*.fmkv. These files were
// written by this same code compiled against the format-1 library (commit 7978fef; command in
// tests/golden/README.md); compiled against this library it builds the same caches in the current
// format, which loading a format-1 file must reproduce byte for byte (test_io.cpp, Format1Files).
// Public C API only, so that both versions of the library compile it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmkv/fmkv.h"
#include "fmkv/io.h"

namespace fmkv_format1 {

struct Case {
  const char* file;  // under tests/golden/
  fmkv_config cfg;
  int32_t layers;
  std::vector<int64_t> lens;  // tokens per sequence
};

// 4-bit K and V (converted on load), 4-bit V beside fp16 K with a sink and a window, 4-bit K beside
// 2-bit V with the RMS rule, and 3-bit codes only (format 1 and 2 bytes identical).
inline std::vector<Case> cases() {
  return {
      {"format1_k4v4.fmkv", {64, 2, 4, 4, 16, 0, 0, FMKV_SCALE_LSQ, 7, 2, 0}, 2, {37, 20}},
      {"format1_k16v4_sink_window.fmkv", {64, 2, 16, 4, 16, 2, 4, FMKV_SCALE_LSQ, 11, 2, 0}, 1, {45, 9}},
      {"format1_k4v2_rms.fmkv", {128, 1, 4, 2, 32, 0, 0, FMKV_SCALE_RMS, 3, 2, 0}, 1, {70}},
      {"format1_k3v3.fmkv", {64, 1, 3, 3, 16, 0, 0, FMKV_SCALE_LSQ, 5, 2, 0}, 1, {33}},
  };
}

// Deterministic inputs (a 64-bit LCG): values in [-2, 2), every 16th channel 8x larger (outliers).
inline float next_value(uint64_t& s, int channel) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  const float u = (float)(s >> 40) / (float)(1u << 24);  // [0, 1)
  return (4.0f * u - 2.0f) * (channel % 16 == 3 ? 8.0f : 1.0f);
}

inline void ok(fmkv_status st) {
  if (st != FMKV_OK) throw std::runtime_error(std::string("fmkv: ") + fmkv_last_error());
}

// The snapshot of case c: every layer and sequence filled by the reference backend's append in two
// chunks per sequence (pages in order, sequence after sequence), then fmkv_save_memory.
inline std::vector<uint8_t> build(const Case& c) {
  const fmkv_config& cfg = c.cfg;
  const int32_t H = cfg.num_kv_heads, d = cfg.head_dim, P = cfg.page_size, nseq = (int32_t)c.lens.size();
  const int64_t pb = fmkv_config_page_bytes(&cfg);
  const size_t slot = (size_t)(fmkv_config_fp16_slot_bytes(&cfg) / 2);
  std::vector<std::vector<int32_t>> table(nseq);
  int64_t pages = 0;
  for (int32_t s = 0; s < nseq; ++s) {
    const int64_t comp = c.lens[s] - cfg.sink_tokens - cfg.window_tokens;
    const int64_t np = comp > 0 ? (comp + P - 1) / P : 0;
    for (int64_t j = 0; j < np; ++j) table[s].push_back((int32_t)pages++);
    if (table[s].empty()) table[s].push_back(0);  // a valid pointer; no entry is read
  }
  std::vector<std::vector<uint8_t>> pool(c.layers, std::vector<uint8_t>((size_t)(std::max<int64_t>(pages, 1) * pb), 0));
  std::vector<std::vector<uint16_t>> fk(c.layers, std::vector<uint16_t>(slot * nseq + 1, 0)), fv = fk;
  std::vector<fmkv_layer_cache> layers;
  uint64_t rng = 0x9e3779b97f4a7c15ull ^ cfg.seed;
  for (int32_t l = 0; l < c.layers; ++l) {
    fmkv_layer_cache lc{pool[l].data(), std::max<int64_t>(pages, 1), slot ? fk[l].data() : nullptr,
                        slot ? fv[l].data() : nullptr, nseq, l};
    for (int32_t s = 0; s < nseq; ++s) {
      const int64_t n = c.lens[s], first = n / 2;
      for (int part = 0; part < 2; ++part) {
        const int64_t before = part ? first : 0, rows = part ? n - first : first;
        if (rows == 0) continue;
        std::vector<float> k((size_t)(rows * H * d)), v(k.size());
        for (size_t i = 0; i < k.size(); ++i) k[i] = next_value(rng, (int)(i % (size_t)d));
        for (size_t i = 0; i < v.size(); ++i) v[i] = next_value(rng, (int)(i % (size_t)d));
        const fmkv_tensor kt{k.data(), FMKV_F32, rows, H, d, (int64_t)H * d, d};
        const fmkv_tensor vt{v.data(), FMKV_F32, rows, H, d, (int64_t)H * d, d};
        const int32_t slots[1] = {s};
        const int64_t lens[1] = {before}, offs[2] = {0, rows};
        const fmkv_batch bt{1, slots, lens, offs, table[s].data(), (int64_t)table[s].size()};
        ok(fmkv_append(FMKV_BACKEND_REF, &cfg, &lc, &bt, &kt, &vt, nullptr));
      }
    }
    layers.push_back(lc);
  }
  std::vector<fmkv_save_sequence> seqs;
  for (int32_t s = 0; s < nseq; ++s)
    seqs.push_back({s, c.lens[s], nullptr, -1, table[s].data(), (int64_t)table[s].size()});
  void* data = nullptr;
  size_t size = 0;
  ok(fmkv_save_memory(&cfg, c.layers, layers.data(), nseq, seqs.data(), 0, &data, &size));
  std::vector<uint8_t> out(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
  fmkv_buffer_free(data);
  return out;
}

}  // namespace fmkv_format1

// Writes small valid snapshots (several geometries, multi-sequence, prefixes, sink/window,
// dequantized window tokens) into a directory: the fuzzer's seed corpus.
// Usage: make_corpus DIR
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fmkv/io.h"

namespace {

uint64_t g_state = 0x1234567;
uint64_t next() {
  uint64_t z = (g_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint16_t rand_f16() {  // |x| < 2, fp16 bits
  uint16_t e = (uint16_t)(10 + next() % 5), m = (uint16_t)(next() & 0x3FF), s = (uint16_t)((next() & 1) << 15);
  return (uint16_t)(s | (e << 10) | m);
}

int make(const std::string& path, int32_t d, int32_t kb, int32_t vb, int32_t heads, int32_t page, int32_t sink,
         int32_t window, int32_t layers, std::vector<int64_t> lens, int64_t prefix, uint32_t flags) {
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = d; c.num_kv_heads = heads; c.k_bits = kb; c.v_bits = vb; c.page_size = page;
  c.sink_tokens = sink; c.window_tokens = window; c.seed = next();
  const int32_t nseq = (int32_t)lens.size();
  int64_t per = 0;
  for (int64_t L : lens) per = std::max<int64_t>(per, (std::max<int64_t>(0, L - sink - window) + page - 1) / page + 1);
  const int64_t pages = per * nseq;
  const int64_t pb = fmkv_config_page_bytes(&c), slot = fmkv_config_fp16_slot_bytes(&c) / 4;
  std::vector<std::vector<uint8_t>> pool(layers, std::vector<uint8_t>((size_t)(pages * pb)));
  std::vector<std::vector<uint16_t>> fk(layers, std::vector<uint16_t>((size_t)(slot * nseq + 1))), fv = fk;
  std::vector<std::vector<int32_t>> table(nseq);
  for (int32_t s = 0; s < nseq; ++s)
    for (int64_t j = 0; j < per; ++j) table[s].push_back((int32_t)(pages - 1 - (s * per + j)));
  std::vector<fmkv_layer_cache> lcs;
  for (int32_t l = 0; l < layers; ++l) {
    fmkv_layer_cache lc{pool[l].data(), pages, fk[l].data(), fv[l].data(), nseq, l};
    lcs.push_back(lc);
    for (int32_t s = 0; s < nseq; ++s) {
      std::vector<uint16_t> k((size_t)(lens[s] * heads * d)), v(k.size());
      for (auto& x : k) x = rand_f16();
      for (auto& x : v) x = rand_f16();
      int64_t len = 0, rows[2] = {0, lens[s]};
      fmkv_batch bt{1, &s, &len, rows, table[s].data(), per};
      fmkv_tensor kt{k.data(), FMKV_F16, lens[s], heads, d, (int64_t)heads * d, d};
      fmkv_tensor vt{v.data(), FMKV_F16, lens[s], heads, d, (int64_t)heads * d, d};
      if (fmkv_append(FMKV_BACKEND_REF, &c, &lc, &bt, &kt, &vt, nullptr) != FMKV_OK) {
        fprintf(stderr, "append: %s\n", fmkv_last_error());
        return 1;
      }
    }
  }
  std::vector<fmkv_save_sequence> ss;
  for (int32_t s = 0; s < nseq; ++s) ss.push_back({s, lens[s], nullptr, s == 0 ? prefix : -1, table[s].data(), per});
  if (fmkv_save(path.c_str(), &c, layers, lcs.data(), nseq, ss.data(), flags | FMKV_SAVE_NO_FSYNC) != FMKV_OK) {
    fprintf(stderr, "save %s: %s\n", path.c_str(), fmkv_last_error());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int rc = 0;
  rc |= make(dir + "/k2v3_two_seqs", 64, 2, 3, 1, 16, 0, 0, 1, {40, 17}, -1, 0);
  rc |= make(dir + "/k3v3_sink_window", 64, 3, 3, 1, 16, 2, 16, 2, {50}, -1, 0);
  rc |= make(dir + "/k3v2_prefix", 64, 3, 2, 2, 16, 0, 0, 2, {70, 5}, 33, 0);
  rc |= make(dir + "/k4v3_dequantized_window", 64, 4, 3, 1, 16, 1, 8, 1, {60}, 30, FMKV_SAVE_ALLOW_DEQUANTIZED);
  rc |= make(dir + "/k16v4_page32", 64, 16, 4, 1, 32, 0, 4, 1, {45}, -1, 0);
  rc |= make(dir + "/d128_k3v3_rms_three_seqs", 128, 3, 3, 1, 16, 0, 0, 1, {20, 1, 0}, -1, 0);
  rc |= make(dir + "/short_in_sink", 64, 2, 2, 1, 16, 8, 8, 1, {3}, -1, 0);
  return rc;
}

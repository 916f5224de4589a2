// libFuzzer target over the snapshot loader (fmkv_load_memory). Each input is loaded twice: as is
// (almost always stopped by a checksum), and with its checksums recomputed so the mutations reach
// the structural checks behind them. Invariants checked on every accepted input:
//   * a failed load returns no snapshot;
//   * everything an accepted snapshot exposes is consistent: attention over every sequence of
//     every layer passes the library's own validation (block tables, slots, lengths);
//   * saving the snapshot again and reloading it works, and is a fixed point.
// Build and run: tests/fuzz/run.sh [seconds].
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fmkv/io.h"
#include "io/layout.h"

namespace {

void die(const char* what) {
  fprintf(stderr, "fuzz_load invariant violated: %s (last error: %s)\n", what, fmkv_last_error());
  abort();
}

std::vector<uint8_t> resave(fmkv_snapshot* s) {
  fmkv_snapshot_info info;
  if (fmkv_snapshot_get_info(s, &info) != FMKV_OK) die("get_info failed");
  std::vector<fmkv_layer_cache> layers(info.num_layers);
  for (int32_t l = 0; l < info.num_layers; ++l)
    if (fmkv_snapshot_layer(s, l, &layers[l]) != FMKV_OK) die("snapshot_layer failed");
  std::vector<fmkv_save_sequence> seqs(info.num_seqs);
  for (int32_t i = 0; i < info.num_seqs; ++i) {
    fmkv_snapshot_sequence q;
    if (fmkv_snapshot_get_sequence(s, i, &q) != FMKV_OK) die("get_sequence failed");
    seqs[i] = fmkv_save_sequence{q.slot, q.num_tokens, nullptr, -1, q.block_table, q.num_pages};
  }
  void* data = nullptr;
  size_t size = 0;
  // Dequantized window tokens are already fp16 in the snapshot: a re-save is exact.
  if (fmkv_save_memory(&info.config, info.num_layers, layers.data(), info.num_seqs, seqs.data(), 0, &data, &size) != FMKV_OK)
    die("re-saving an accepted snapshot failed");
  std::vector<uint8_t> out((uint8_t*)data, (uint8_t*)data + size);
  fmkv_buffer_free(data);
  return out;
}

void exercise(fmkv_snapshot* s) {
  fmkv_snapshot_info info;
  if (fmkv_snapshot_get_info(s, &info) != FMKV_OK) die("get_info failed");
  const fmkv_config& c = info.config;
  const int32_t qh = c.num_kv_heads;
  std::vector<float> q((size_t)qh * c.head_dim, 0.5f), out(q.size());
  for (int32_t l = 0; l < info.num_layers; ++l) {
    fmkv_layer_cache lc;
    if (fmkv_snapshot_layer(s, l, &lc) != FMKV_OK) die("snapshot_layer failed");
    for (int32_t i = 0; i < info.num_seqs; ++i) {
      fmkv_snapshot_sequence sq;
      if (fmkv_snapshot_get_sequence(s, i, &sq) != FMKV_OK) die("get_sequence failed");
      if (sq.num_tokens < 1 || sq.num_tokens > 100000) continue;
      int32_t dummy = 0, slot = sq.slot;
      int64_t len = sq.num_tokens, rows[2] = {0, 1};
      fmkv_batch bt{1, &slot, &len, rows, sq.num_pages ? sq.block_table : &dummy, sq.num_pages ? sq.num_pages : 1};
      fmkv_tensor qt{q.data(), FMKV_F32, 1, qh, c.head_dim, (int64_t)qh * c.head_dim, c.head_dim};
      fmkv_tensor ot{out.data(), FMKV_F32, 1, qh, c.head_dim, (int64_t)qh * c.head_dim, c.head_dim};
      if (fmkv_attention(FMKV_BACKEND_REF, &c, &lc, &bt, &qt, nullptr, &ot, nullptr, 0, nullptr) != FMKV_OK)
        die("attention rejected an accepted snapshot");
    }
  }
}

void run(const uint8_t* data, size_t size, bool deep) {
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  o.extra_pages = (int64_t)(size & 3);
  fmkv_snapshot* s = reinterpret_cast<fmkv_snapshot*>(0x1);
  if (fmkv_load_memory(data, size, &o, &s) != FMKV_OK) {
    if (s != nullptr) die("failed load returned a snapshot");
    return;
  }
  if (!s) die("successful load returned no snapshot");
  exercise(s);
  if (deep) {
    std::vector<uint8_t> a = resave(s);
    fmkv_snapshot* s2 = nullptr;
    if (fmkv_load_memory(a.data(), a.size(), nullptr, &s2) != FMKV_OK) die("re-saved snapshot does not load");
    if (resave(s2) != a) die("save(load(x)) is not a fixed point");
    fmkv_snapshot_free(s2);
  }
  fmkv_snapshot_free(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run(data, size, false);
  std::vector<uint8_t> fixed(data, data + size);
  if (fmkv::io::refresh_checksums(fixed.data(), fixed.size())) run(fixed.data(), fixed.size(), true);
  return 0;
}

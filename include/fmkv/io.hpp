// fmkv snapshots, C++ convenience over include/fmkv/io.h: a RAII Snapshot, and save/restore of
// HostCache sequences (a whole sequence or a prefix of N tokens).
#pragma once
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fmkv/fmkv.hpp"
#include "fmkv/io.h"

namespace fmkv {

class Snapshot {
 public:
  Snapshot() = default;
  explicit Snapshot(fmkv_snapshot* s) : s_(s) {}
  Snapshot(Snapshot&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Snapshot& operator=(Snapshot&& o) noexcept {
    if (this != &o) {
      fmkv_snapshot_free(s_);
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;
  ~Snapshot() { fmkv_snapshot_free(s_); }

  static Snapshot load(const std::string& path, const fmkv_load_options* opts = nullptr) {
    fmkv_snapshot* s = nullptr;
    check(fmkv_load(path.c_str(), opts, &s));
    return Snapshot(s);
  }
  static Snapshot load_memory(const void* data, size_t size, const fmkv_load_options* opts = nullptr) {
    fmkv_snapshot* s = nullptr;
    check(fmkv_load_memory(data, size, opts, &s));
    return Snapshot(s);
  }

  fmkv_snapshot* get() const { return s_; }
  explicit operator bool() const { return s_ != nullptr; }
  fmkv_snapshot_info info() const {
    fmkv_snapshot_info i;
    check(fmkv_snapshot_get_info(s_, &i));
    return i;
  }
  fmkv_layer_cache layer(int32_t i) const {
    fmkv_layer_cache l;
    check(fmkv_snapshot_layer(s_, i, &l));
    return l;
  }
  fmkv_snapshot_sequence sequence(int32_t i) const {
    fmkv_snapshot_sequence q;
    check(fmkv_snapshot_get_sequence(s_, i, &q));
    return q;
  }

 private:
  fmkv_snapshot* s_ = nullptr;
};

namespace detail {
inline std::vector<fmkv_layer_cache> host_layers(HostCache& c) {
  std::vector<fmkv_layer_cache> v;
  for (int32_t l = 0; l < c.num_layers(); ++l) v.push_back(c.layer_view(l));
  return v;
}
inline fmkv_save_sequence host_sequence(const HostCache& c, int32_t s, int64_t num_tokens,
                                        std::vector<int64_t>& lens) {
  lens.clear();
  for (int32_t l = 0; l < c.num_layers(); ++l) lens.push_back(c.length(l, s));
  const std::vector<int32_t>& t = c.block_table(s);
  return fmkv_save_sequence{s, lens.empty() ? 0 : lens[0], lens.data(), num_tokens, t.data(), (int64_t)t.size()};
}

// Give sequence s pages for len tokens and set its length in every layer. Uses
// HostCache::restore_length(s, len) when the class has it; otherwise appends len zero tokens
// through the reference backend (same page allocation; the caller overwrites every byte).
template <typename C>
auto restore_length(C& c, int32_t s, int64_t len, int) -> decltype(c.restore_length(s, len), void()) {
  c.restore_length(s, len);
}
template <typename C>
void restore_length(C& c, int32_t s, int64_t len, long) {
  if (len == 0) return;
  const fmkv_config& cfg = c.config();
  std::vector<uint16_t> zeros((size_t)len * cfg.num_kv_heads * cfg.head_dim, 0);
  fmkv_tensor t = make_tensor(zeros.data(), FMKV_F16, len, cfg.num_kv_heads, cfg.head_dim);
  for (int32_t l = 0; l < c.num_layers(); ++l) c.append(FMKV_BACKEND_REF, l, s, t, t);
}
}  // namespace detail

// Save sequences `seqs` of a HostCache (their first num_tokens tokens, -1 = all cached in every
// layer) to `path`; file sequence i is seqs[i]. flags: FMKV_SAVE_*.
inline void save(const std::string& path, HostCache& cache, const std::vector<int32_t>& seqs,
                 int64_t num_tokens = -1, uint32_t flags = 0) {
  std::vector<fmkv_layer_cache> layers = detail::host_layers(cache);
  std::vector<std::vector<int64_t>> lens(seqs.size());
  std::vector<fmkv_save_sequence> ss;
  for (size_t i = 0; i < seqs.size(); ++i) ss.push_back(detail::host_sequence(cache, seqs[i], num_tokens, lens[i]));
  check(fmkv_save(path.c_str(), &cache.config(), cache.num_layers(), layers.data(), (int32_t)ss.size(), ss.data(), flags));
}
inline void save(const std::string& path, HostCache& cache, int32_t seq, int64_t num_tokens = -1, uint32_t flags = 0) {
  save(path, cache, std::vector<int32_t>{seq}, num_tokens, flags);
}
inline std::vector<uint8_t> save_memory(HostCache& cache, const std::vector<int32_t>& seqs, int64_t num_tokens = -1,
                                        uint32_t flags = 0) {
  std::vector<fmkv_layer_cache> layers = detail::host_layers(cache);
  std::vector<std::vector<int64_t>> lens(seqs.size());
  std::vector<fmkv_save_sequence> ss;
  for (size_t i = 0; i < seqs.size(); ++i) ss.push_back(detail::host_sequence(cache, seqs[i], num_tokens, lens[i]));
  void* data = nullptr;
  size_t size = 0;
  check(fmkv_save_memory(&cache.config(), cache.num_layers(), layers.data(), (int32_t)ss.size(), ss.data(), flags, &data,
                         &size));
  std::vector<uint8_t> out(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
  fmkv_buffer_free(data);
  return out;
}
inline std::vector<uint8_t> save_memory(HostCache& cache, int32_t seq, int64_t num_tokens = -1, uint32_t flags = 0) {
  return save_memory(cache, std::vector<int32_t>{seq}, num_tokens, flags);
}

// Restore sequence `file_seq` of a snapshot as a new sequence of `cache` (same config, seed and
// layer count; the snapshot's layer i must be rotation layer i). Returns the new sequence index.
// Checks everything before touching the cache; copies bytes (the cache owns its memory).
inline int32_t restore(HostCache& cache, const Snapshot& snap, int32_t file_seq = 0) {
  const fmkv_snapshot_info info = snap.info();
  const fmkv_config& c = cache.config();
  if (fmkv_snapshot_check_config(snap.get(), &c) != FMKV_OK)  // every field, as a load's expect_config
    throw Error(FMKV_ERR_INVALID_ARGUMENT, std::string("restore: ") + fmkv_last_error());
  if (info.num_layers != cache.num_layers())
    throw Error(FMKV_ERR_INVALID_ARGUMENT, "restore: the snapshot has " + std::to_string(info.num_layers) +
                                               " layers, the cache " + std::to_string(cache.num_layers()));
  for (int32_t l = 0; l < info.num_layers; ++l)
    if (snap.layer(l).layer != l)
      throw Error(FMKV_ERR_INVALID_ARGUMENT, "restore: snapshot layer " + std::to_string(l) + " was saved as rotation layer " +
                                                 std::to_string(snap.layer(l).layer));
  const fmkv_snapshot_sequence q = snap.sequence(file_seq);
  if (q.num_pages > cache.free_pages())
    throw Error(FMKV_ERR_OUT_OF_RANGE, "restore: out of pages (" + std::to_string(cache.free_pages()) + " free, the sequence needs " +
                                           std::to_string(q.num_pages) + ")");
  const int32_t s = cache.add_sequence();
  try {
    detail::restore_length(cache, s, q.num_tokens, 0);
  } catch (...) {
    cache.remove_sequence(s);
    throw;
  }
  const std::vector<int32_t>& table = cache.block_table(s);
  if ((int64_t)table.size() < q.num_pages) {
    cache.remove_sequence(s);
    throw Error(FMKV_ERR_INTERNAL, "restore: the cache allocated fewer pages than the snapshot holds");
  }
  const int64_t pb = fmkv_config_page_bytes(&c);
  const size_t slot_elems = (size_t)(fmkv_config_fp16_slot_bytes(&c) / 4);
  for (int32_t l = 0; l < info.num_layers; ++l) {
    const fmkv_layer_cache src = snap.layer(l);
    const fmkv_layer_cache dst = cache.layer_view(l);
    for (int64_t j = 0; j < q.num_pages; ++j)
      std::memcpy(dst.pages + (size_t)table[(size_t)j] * (size_t)pb, src.pages + (size_t)q.block_table[j] * (size_t)pb, (size_t)pb);
    if (slot_elems) {
      std::memcpy(dst.fp16_k + (size_t)s * slot_elems, src.fp16_k + (size_t)q.slot * slot_elems, slot_elems * 2);
      std::memcpy(dst.fp16_v + (size_t)s * slot_elems, src.fp16_v + (size_t)q.slot * slot_elems, slot_elems * 2);
    }
  }
  return s;
}
inline int32_t restore(HostCache& cache, const std::string& path, int32_t file_seq = 0) {
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  o.mode = FMKV_LOAD_MMAP;  // zero copy into the mapping, then one copy into the cache
  o.expect_config = &cache.config();
  o.expect_num_layers = cache.num_layers();
  return restore(cache, Snapshot::load(path, &o), file_seq);
}

}  // namespace fmkv

// fmkv C++ API: exceptions over the C API, and HostCache, a paged compressed KV cache that owns
// host memory for all layers (page allocation, block tables, per-layer lengths).
//
// HostCache guarantees (docs/RELIABILITY.md): every mutating call is all-or-nothing -- after an
// exception its pages, lengths, block tables and sequence slots are as before the call; its whole
// allocation is computed up front (overflow-checked) and refused when larger than the host's memory
// (fmkv_host_memory_bytes). It is not synchronised: one thread at a time per HostCache (the Python
// fmkv.Cache wraps it with a mutex).
#pragma once
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmkv/error.hpp"
#include "fmkv/fmkv.h"

namespace fmkv {

inline void check(fmkv_status s) {
  if (s != FMKV_OK) throw Error((int)s, fmkv_last_error());
}

inline fmkv_tensor make_tensor(const void* data, fmkv_dtype dt, int64_t rows, int32_t heads, int32_t dim) {
  return fmkv_tensor{const_cast<void*>(data), (int32_t)dt, rows, heads, dim, (int64_t)heads * dim, dim};
}

class HostCache {
 public:
  HostCache(const fmkv_config& cfg, int32_t num_layers, int64_t num_pages, int32_t max_seqs)
      : cfg_(cfg), num_layers_(num_layers), num_pages_(num_pages), max_seqs_(max_seqs) {
    check(fmkv_config_validate(&cfg));
    if (num_layers < 1 || num_pages < 0 || max_seqs < 1)
      throw Error(FMKV_ERR_INVALID_ARGUMENT, "HostCache: need num_layers >= 1, num_pages >= 0, max_seqs >= 1");
    if (num_pages > std::numeric_limits<int32_t>::max())
      throw Error(FMKV_ERR_OVERFLOW, "HostCache: num_pages " + std::to_string(num_pages) +
                                         " exceeds what a 32-bit block table can address (2^31 - 1)");
    page_bytes_ = fmkv_config_page_bytes(&cfg);
    slot_elems_ = fmkv_config_fp16_slot_bytes(&cfg) / 4;  // fp16 elements of K (or V) per slot
    const int64_t need = host_bytes(cfg, num_layers, num_pages, max_seqs), have = fmkv_host_memory_bytes();
    if (have > 0 && need > have)
      throw Error(FMKV_ERR_OUT_OF_RANGE, "HostCache: " + std::to_string(num_layers) + " layers x " + std::to_string(num_pages) +
                                             " pages, " + std::to_string(max_seqs) + " sequences need " + std::to_string(need) +
                                             " bytes of host memory, more than this host's " + std::to_string(have));
    try {
      pages_.resize(num_layers);
      fp16_k_.resize(num_layers);
      fp16_v_.resize(num_layers);
      for (int32_t l = 0; l < num_layers; ++l) {
        pages_[l].assign((size_t)(num_pages * page_bytes_), 0);
        fp16_k_[l].assign((size_t)(slot_elems_ * max_seqs), 0);
        fp16_v_[l].assign((size_t)(slot_elems_ * max_seqs), 0);
      }
      free_pages_.reserve((size_t)num_pages);
      for (int64_t p = num_pages - 1; p >= 0; --p) free_pages_.push_back((int32_t)p);
      lens_.assign((size_t)num_layers * max_seqs, -1);
      tables_.resize(max_seqs);
    } catch (const std::bad_alloc&) {
      throw Error(FMKV_ERR_OUT_OF_RANGE, "HostCache: out of host memory allocating " + std::to_string(need) + " bytes");
    }
  }

  // Host bytes a HostCache of this geometry allocates (pages, fp16 regions, bookkeeping), checked
  // for overflow (FMKV_ERR_OVERFLOW): what the constructor compares with fmkv_host_memory_bytes().
  static int64_t host_bytes(const fmkv_config& cfg, int64_t num_layers, int64_t num_pages, int64_t max_seqs) {
    check(fmkv_config_validate(&cfg));
    const int64_t pb = fmkv_config_page_bytes(&cfg), slot = fmkv_config_fp16_slot_bytes(&cfg);
    // per layer: pages + fp16 K and V regions + lengths; per cache: free list + block tables
    const int64_t per_layer = add(mul(num_pages, pb), add(mul(max_seqs, slot), mul(max_seqs, (int64_t)sizeof(int64_t))));
    return add(mul(num_layers, per_layer),
               add(mul(num_pages, (int64_t)sizeof(int32_t)), mul(max_seqs, (int64_t)sizeof(std::vector<int32_t>))));
  }

  const fmkv_config& config() const { return cfg_; }
  int32_t num_layers() const { return num_layers_; }
  int64_t free_pages() const { return (int64_t)free_pages_.size(); }

  int32_t add_sequence() {
    for (int32_t s = 0; s < max_seqs_; ++s)
      if (lens_[s] < 0) {
        for (int32_t l = 0; l < num_layers_; ++l) lens_[(size_t)l * max_seqs_ + s] = 0;
        tables_[s].clear();
        return s;
      }
    throw Error(FMKV_ERR_OUT_OF_RANGE, "HostCache: all " + std::to_string(max_seqs_) + " sequence slots are in use");
  }
  void remove_sequence(int32_t s) {
    check_seq(s);
    for (int32_t p : tables_[s]) free_pages_.push_back(p);
    tables_[s].clear();
    for (int32_t l = 0; l < num_layers_; ++l) lens_[(size_t)l * max_seqs_ + s] = -1;
  }
  int64_t length(int32_t layer, int32_t s) const {
    check_seq(s);
    check_layer(layer);
    return lens_[(size_t)layer * max_seqs_ + s];
  }

  // Append rows of k/v ([rows][kv_heads][head_dim]) to sequence s of one layer. On any error the
  // pages it took are returned and the length is unchanged.
  void append(fmkv_backend b, int32_t layer, int32_t s, const fmkv_tensor& k, const fmkv_tensor& v) {
    check_seq(s);
    check_layer(layer);
    int64_t len = lens_[(size_t)layer * max_seqs_ + s];
    if (k.rows < 0 || k.rows > std::numeric_limits<int64_t>::max() - len)
      throw Error(FMKV_ERR_INVALID_ARGUMENT, "HostCache: append of " + std::to_string(k.rows) + " rows to a sequence of " +
                                                 std::to_string(len) + " tokens");
    const size_t had = tables_[s].size();
    reserve(s, len + k.rows);
    int64_t rows[2] = {0, k.rows};
    fmkv_layer_cache lc = layer_view(layer);
    fmkv_batch bt{1, &s, &len, rows, tables_[s].data(), (int64_t)tables_[s].size()};
    const fmkv_status st = fmkv_append(b, &cfg_, &lc, &bt, &k, &v, nullptr);
    if (st != FMKV_OK) {
      release_to(s, had);
      check(st);
    }
    lens_[(size_t)layer * max_seqs_ + s] = len + k.rows;
  }

  // Attention of q rows (the last q.rows tokens of s, already appended) over layer `layer`.
  void attention(fmkv_backend b, int32_t layer, int32_t s, const fmkv_tensor& q, fmkv_tensor& out,
                 fmkv_attention_opts opts = {0.0f, 0.0f, 0}) const {
    attend(b, layer, s, q, out, nullptr, opts);
  }
  // The same, also writing lse[row][qh][0] = log of the softmax denominator (fmkv_attention_lse).
  void attention(fmkv_backend b, int32_t layer, int32_t s, const fmkv_tensor& q, fmkv_tensor& out, fmkv_tensor& lse,
                 fmkv_attention_opts opts = {0.0f, 0.0f, 0}) const {
    attend(b, layer, s, q, out, &lse, opts);
  }

  // Give sequence s pages for len tokens and set its length in every layer (restoring a snapshot).
  void restore_length(int32_t s, int64_t len) {
    check_seq(s);
    reserve(s, len);
    for (int32_t l = 0; l < num_layers_; ++l) lens_[(size_t)l * max_seqs_ + s] = len;
  }

  fmkv_layer_cache layer_view(int32_t layer) {
    check_layer(layer);
    return fmkv_layer_cache{pages_[layer].data(), num_pages_, fp16_k_[layer].data(), fp16_v_[layer].data(),
                            max_seqs_, layer};
  }
  const std::vector<int32_t>& block_table(int32_t s) const { check_seq(s); return tables_[s]; }

  // Bytes actually allocated (pages of all layers + fp16 regions).
  int64_t resident_bytes() const {
    return num_layers_ * (num_pages_ * page_bytes_ + 2 * 2 * slot_elems_ * (int64_t)max_seqs_);
  }
  // Bytes of the pages in use by live sequences plus their fp16 regions.
  int64_t used_bytes() const {
    int64_t pages = 0, seqs = 0;
    for (int32_t s = 0; s < max_seqs_; ++s)
      if (lens_[s] >= 0) { pages += (int64_t)tables_[s].size(); ++seqs; }
    return num_layers_ * (pages * page_bytes_ + 2 * 2 * slot_elems_ * seqs);
  }

 private:
  void attend(fmkv_backend b, int32_t layer, int32_t s, const fmkv_tensor& q, fmkv_tensor& out, fmkv_tensor* lse,
              fmkv_attention_opts opts) const {
    check_seq(s);
    check_layer(layer);
    int64_t len = lens_[(size_t)layer * max_seqs_ + s];
    int64_t rows[2] = {0, q.rows};
    fmkv_layer_cache lc = const_cast<HostCache*>(this)->layer_view(layer);
    const std::vector<int32_t>& t = tables_[s];
    fmkv_batch bt{1, &s, &len, rows, t.data(), (int64_t)t.size()};
    check(lse ? fmkv_attention_lse(b, &cfg_, &lc, &bt, &q, &opts, &out, lse, nullptr, 0, nullptr)
              : fmkv_attention(b, &cfg_, &lc, &bt, &q, &opts, &out, nullptr, 0, nullptr));
  }
  void check_seq(int32_t s) const {
    if (s < 0 || s >= max_seqs_ || lens_[s] < 0)
      throw Error(FMKV_ERR_OUT_OF_RANGE, "HostCache: sequence " + std::to_string(s) + " does not exist");
  }
  void check_layer(int32_t l) const {
    if (l < 0 || l >= num_layers_)
      throw Error(FMKV_ERR_OUT_OF_RANGE, "HostCache: layer " + std::to_string(l) + " outside [0, " + std::to_string(num_layers_) + ")");
  }
  static int64_t mul(int64_t a, int64_t b) {
    if (a < 0 || b < 0 || (a != 0 && b > std::numeric_limits<int64_t>::max() / a))
      throw Error(FMKV_ERR_OVERFLOW, "HostCache: size " + std::to_string(a) + " x " + std::to_string(b) + " overflows 64 bits");
    return a * b;
  }
  static int64_t add(int64_t a, int64_t b) {
    if (b > std::numeric_limits<int64_t>::max() - a)
      throw Error(FMKV_ERR_OVERFLOW, "HostCache: size " + std::to_string(a) + " + " + std::to_string(b) + " overflows 64 bits");
    return a + b;
  }
  // Give back the pages of sequence s past its first `keep` (the undo of a reserve).
  void release_to(int32_t s, size_t keep) {
    while (tables_[s].size() > keep) {
      free_pages_.push_back(tables_[s].back());
      tables_[s].pop_back();
    }
  }
  // Make sure sequence s has pages for `len` tokens (all layers share the block table). Takes
  // nothing when the free pages do not suffice.
  void reserve(int32_t s, int64_t len) {
    int64_t comp = fmkv_compressed_end(cfg_.sink_tokens, cfg_.window_tokens, len) - cfg_.sink_tokens;
    int64_t need = (comp + cfg_.page_size - 1) / cfg_.page_size;
    if (need - (int64_t)tables_[s].size() > (int64_t)free_pages_.size())
      throw Error(FMKV_ERR_OUT_OF_RANGE, "HostCache: out of pages (" + std::to_string(free_pages_.size()) +
                                             " free, sequence needs " + std::to_string(need - (int64_t)tables_[s].size()) + " more)");
    while ((int64_t)tables_[s].size() < need) {
      tables_[s].push_back(free_pages_.back());
      free_pages_.pop_back();
    }
  }

  fmkv_config cfg_;
  int32_t num_layers_;
  int64_t num_pages_;
  int32_t max_seqs_;
  int64_t page_bytes_ = 0, slot_elems_ = 0;
  std::vector<std::vector<uint8_t>> pages_;
  std::vector<std::vector<uint16_t>> fp16_k_, fp16_v_;
  std::vector<int32_t> free_pages_;
  std::vector<int64_t> lens_;  // [layer][seq], -1 = no sequence
  std::vector<std::vector<int32_t>> tables_;
};

}  // namespace fmkv

// Snapshot save/load (include/fmkv/io.h, docs/FILE-FORMAT.md): round trips (bytes and attention
// identical, copy and mmap modes, prefixes, sink/window), and every rejection with a clear message
// and nothing half-loaded.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "fmkv/io.h"
#include "fmkv/io.hpp"
#include "harness.h"
#include "io/crc32c.h"
#include "format1_snapshot.h"
#include "io/layout.h"

namespace fmkv::test {
namespace {

using fmkv::io::rd32;
using fmkv::io::rd64;
using fmkv::io::wr32;
using fmkv::io::wr64;

// One scratch directory per test process, removed with everything in it when the process exits (the
// tests' snapshot files are ~0.5 MB each; a test run leaves nothing behind in /tmp).
struct ScratchDir {
  std::string path;
  ScratchDir() {
    char t[] = "/tmp/fmkv_io_test_XXXXXX";
    const char* p = mkdtemp(t);
    if (p == nullptr) {
      std::perror("fmkv_io_test: mkdtemp");
      std::abort();
    }
    path = p;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

std::string tmpdir() {
  static ScratchDir d;
  return d.path;
}

std::vector<uint8_t> read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
void write_file(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write((const char*)b.data(), (std::streamsize)b.size());
}
bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
std::vector<std::string> dir_entries(const std::string& d) {
  std::vector<std::string> out;
  if (DIR* dp = opendir(d.c_str())) {
    while (dirent* e = readdir(dp))
      if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.push_back(e->d_name);
    closedir(dp);
  }
  return out;
}

// A paged cache driven through the C API directly: every sequence owns a fixed block table (a
// random permutation of pages) and per-layer lengths. Unused pages hold random bytes.
struct RawCache {
  fmkv_config cfg;
  int32_t nl, nseq;
  int64_t pages = 0, pb = 0;
  size_t slot_elems = 0;
  std::vector<std::vector<uint8_t>> pool;
  std::vector<std::vector<uint16_t>> fk, fv;
  std::vector<std::vector<int32_t>> table;  // [seq]
  std::vector<std::vector<int64_t>> len;    // [seq][layer]

  RawCache(const fmkv_config& c, int32_t layers, int32_t seqs, int64_t max_len) : cfg(c), nl(layers), nseq(seqs) {
    const int64_t per = (std::max<int64_t>(0, max_len - c.sink_tokens - c.window_tokens) + c.page_size - 1) / c.page_size + 1;
    pages = per * seqs + 3;
    pb = fmkv_config_page_bytes(&c);
    slot_elems = (size_t)(fmkv_config_fp16_slot_bytes(&c) / 4);
    std::vector<int32_t> perm((size_t)pages);
    for (int64_t i = 0; i < pages; ++i) perm[(size_t)i] = (int32_t)i;
    std::shuffle(perm.begin(), perm.end(), rng());
    for (int32_t s = 0; s < seqs; ++s) table.emplace_back(perm.begin() + s * per, perm.begin() + (s + 1) * per);
    for (int32_t l = 0; l < layers; ++l) {
      pool.push_back(random_bytes((size_t)(pages * pb)));
      for (auto& t : table)
        for (int32_t p : t) std::memset(&pool.back()[(size_t)(p * pb)], 0, (size_t)pb);
      fk.emplace_back(slot_elems * seqs, 0);
      fv.emplace_back(slot_elems * seqs, 0);
    }
    len.assign(seqs, std::vector<int64_t>(layers, 0));
  }
  fmkv_layer_cache layer(int32_t l) {
    return fmkv_layer_cache{pool[l].data(), pages, slot_elems ? fk[l].data() : nullptr, slot_elems ? fv[l].data() : nullptr, nseq, l};
  }
  void append(int32_t l, int32_t s, const uint8_t* k, const uint8_t* v, int64_t rows) {
    fmkv_tensor kt = make_tensor(k, FMKV_F16, rows, cfg.num_kv_heads, cfg.head_dim);
    fmkv_tensor vt = make_tensor(v, FMKV_F16, rows, cfg.num_kv_heads, cfg.head_dim);
    int64_t r[2] = {0, rows};
    fmkv_batch bt{1, &s, &len[s][l], r, table[s].data(), (int64_t)table[s].size()};
    fmkv_layer_cache lc = layer(l);
    check(fmkv_append(FMKV_BACKEND_REF, &cfg, &lc, &bt, &kt, &vt, nullptr));
    len[s][l] += rows;
  }
  fmkv_save_sequence seq(int32_t s, int64_t n) {
    return fmkv_save_sequence{s, len[s][0], len[s].data(), n, table[s].data(), (int64_t)table[s].size()};
  }
};

// Random tokens for `lens.size()` sequences; builds caches from any prefix of them.
struct Model {
  fmkv_config cfg;
  int32_t layers;
  std::vector<std::vector<std::vector<uint8_t>>> k, v;  // [seq][layer] f16 [len][H][d]
  std::vector<int64_t> lens;

  Model(const fmkv_config& c, int32_t nl, std::vector<int64_t> l) : cfg(c), layers(nl), lens(std::move(l)) {
    for (int64_t len : lens) {
      k.emplace_back();
      v.emplace_back();
      for (int32_t i = 0; i < nl; ++i) {
        k.back().push_back(random_tensor(FMKV_F16, len, c.num_kv_heads, c.head_dim, 2.0));
        v.back().push_back(random_tensor(FMKV_F16, len, c.num_kv_heads, c.head_dim));
      }
    }
  }
  size_t row_bytes() const { return (size_t)cfg.num_kv_heads * cfg.head_dim * 2; }
  int64_t chunk(int64_t left) const { return std::min<int64_t>(left, 1 + (int64_t)(rng()() % 40)); }
  // Appends tokens [from, to) of sequence i to sequence s, in random chunks.
  void feed(RawCache& c, int32_t s, size_t i, int64_t from, int64_t to) const {
    for (int32_t l = 0; l < layers; ++l)
      for (int64_t p = from, n; p < to; p += n) {
        n = chunk(to - p);
        c.append(l, s, &k[i][l][(size_t)p * row_bytes()], &v[i][l][(size_t)p * row_bytes()], n);
      }
  }
  void feed(HostCache& c, int32_t s, size_t i, int64_t from, int64_t to) const {
    for (int32_t l = 0; l < layers; ++l)
      for (int64_t p = from, n; p < to; p += n) {
        // HostCache passes a NULL block table while a sequence has no page: first chunk whole.
        n = c.block_table(s).empty() ? to - p : chunk(to - p);
        fmkv_tensor kt = make_tensor(&k[i][l][(size_t)p * row_bytes()], FMKV_F16, n, cfg.num_kv_heads, cfg.head_dim);
        fmkv_tensor vt = make_tensor(&v[i][l][(size_t)p * row_bytes()], FMKV_F16, n, cfg.num_kv_heads, cfg.head_dim);
        c.append(FMKV_BACKEND_REF, l, s, kt, vt);
      }
  }
  // A fresh cache holding the first n[i] tokens of every sequence i.
  std::unique_ptr<RawCache> build(const std::vector<int64_t>& n) const {
    auto c = std::make_unique<RawCache>(cfg, layers, (int32_t)lens.size(), *std::max_element(lens.begin(), lens.end()));
    for (size_t i = 0; i < lens.size(); ++i) feed(*c, (int32_t)i, i, 0, n[i]);
    return c;
  }
  std::unique_ptr<RawCache> build() const { return build(lens); }
};

template <class C>
constexpr auto has_restore_length(int) -> decltype(std::declval<C&>().restore_length(0, 0), true) { return true; }
template <class C>
constexpr bool has_restore_length(long) { return false; }

int32_t q_heads(const fmkv_config& c) { return c.num_kv_heads * 2; }

std::vector<float> make_q(const fmkv_config& c, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q((size_t)q_heads(c) * c.head_dim);
  for (auto& x : q) x = nd(r);
  return q;
}

// Attention of one query row at the last position of a sequence of `len` tokens.
std::vector<float> attend(const fmkv_config& c, const fmkv_layer_cache& lc, int32_t slot, int64_t len,
                          const int32_t* table, int64_t stride, const std::vector<float>& q,
                          fmkv_backend be = FMKV_BACKEND_REF) {
  std::vector<float> out(q.size(), NAN);
  fmkv_tensor qt = make_tensor(q.data(), FMKV_F32, 1, q_heads(c), c.head_dim);
  fmkv_tensor ot = make_tensor(out.data(), FMKV_F32, 1, q_heads(c), c.head_dim);
  int64_t rows[2] = {0, 1};
  std::vector<int32_t> dummy(1, 0);
  fmkv_batch bt{1, &slot, &len, rows, stride > 0 ? table : dummy.data(), std::max<int64_t>(1, stride)};
  fmkv_attention_opts o{0.0f, 0.0f, 0};
  check(fmkv_attention(be, &c, &lc, &bt, &qt, &o, &ot, nullptr, 0, nullptr));
  return out;
}
std::vector<float> attend(RawCache& rc, int32_t l, int32_t s, const std::vector<float>& q) {
  return attend(rc.cfg, rc.layer(l), s, rc.len[s][l], rc.table[s].data(), (int64_t)rc.table[s].size(), q);
}
std::vector<float> attend(HostCache& hc, int32_t l, int32_t s, const std::vector<float>& q) {
  const auto& t = hc.block_table(s);
  return attend(hc.config(), hc.layer_view(l), s, hc.length(l, s), t.data(), (int64_t)t.size(), q);
}
std::vector<float> attend(const Snapshot& snap, int32_t l, int32_t i, const std::vector<float>& q) {
  fmkv_snapshot_sequence sq = snap.sequence(i);
  fmkv_snapshot_info info = snap.info();
  return attend(info.config, snap.layer(l), sq.slot, sq.num_tokens, sq.block_table, sq.num_pages, q);
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

std::vector<uint8_t> save_mem(HostCache& hc, const std::vector<int32_t>& seqs, int64_t n, uint32_t flags = 0,
                              fmkv_status* st = nullptr) {
  std::vector<fmkv_layer_cache> layers;
  for (int32_t l = 0; l < hc.num_layers(); ++l) layers.push_back(hc.layer_view(l));
  std::vector<std::vector<int64_t>> lens(seqs.size());
  std::vector<fmkv_save_sequence> ss;
  for (size_t i = 0; i < seqs.size(); ++i) ss.push_back(detail::host_sequence(hc, seqs[i], n, lens[i]));
  void* data = nullptr;
  size_t size = 0;
  fmkv_status s = fmkv_save_memory(&hc.config(), hc.num_layers(), layers.data(), (int32_t)ss.size(), ss.data(), flags, &data, &size);
  if (st) *st = s;
  else check(s);
  std::vector<uint8_t> out;
  if (data) out.assign((uint8_t*)data, (uint8_t*)data + size);
  fmkv_buffer_free(data);
  return out;
}

std::vector<uint8_t> save_mem(RawCache& rc, const std::vector<int32_t>& seqs, int64_t n, uint32_t flags = 0,
                              fmkv_status* st = nullptr) {
  std::vector<fmkv_layer_cache> layers;
  for (int32_t l = 0; l < rc.nl; ++l) layers.push_back(rc.layer(l));
  std::vector<fmkv_save_sequence> ss;
  for (int32_t s : seqs) ss.push_back(rc.seq(s, n));
  void* data = nullptr;
  size_t size = 0;
  fmkv_status s = fmkv_save_memory(&rc.cfg, rc.nl, layers.data(), (int32_t)ss.size(), ss.data(), flags, &data, &size);
  if (st) *st = s;
  else check(s);
  std::vector<uint8_t> out;
  if (data) out.assign((uint8_t*)data, (uint8_t*)data + size);
  fmkv_buffer_free(data);
  return out;
}
fmkv_status save_file(const std::string& path, RawCache& rc, const std::vector<int32_t>& seqs, int64_t n, uint32_t flags = 0) {
  std::vector<fmkv_layer_cache> layers;
  for (int32_t l = 0; l < rc.nl; ++l) layers.push_back(rc.layer(l));
  std::vector<fmkv_save_sequence> ss;
  for (int32_t s : seqs) ss.push_back(rc.seq(s, n));
  return fmkv_save(path.c_str(), &rc.cfg, rc.nl, layers.data(), (int32_t)ss.size(), ss.data(), flags);
}

// Loads from memory expecting failure; asserts the message contains one of `needles` and that no
// snapshot came back.
void expect_reject(const std::vector<uint8_t>& img, std::initializer_list<const char*> needles,
                   const fmkv_load_options* opts = nullptr, const std::string& what = "") {
  fmkv_snapshot* s = reinterpret_cast<fmkv_snapshot*>(0x1);
  fmkv_status st = fmkv_load_memory(img.data(), img.size(), opts, &s);
  ASSERT_NE(st, FMKV_OK) << what;
  ASSERT_EQ(s, nullptr) << what;
  std::string msg = fmkv_last_error();
  bool hit = false;
  for (const char* n : needles) hit = hit || msg.find(n) != std::string::npos;
  ASSERT_TRUE(hit) << what << ": message was: " << msg;
}

struct Case {
  const char* name;
  int32_t d, kb, vb, heads, page, sink, window, rule, format_version = 0, scale_group = 0;
};
const Case kCases[] = {
    {"d64_k2v3", 64, 2, 3, 2, 16, 0, 0, FMKV_SCALE_LSQ},
    {"d128_k3v3_sink_window_rms", 128, 3, 3, 2, 16, 4, 32, FMKV_SCALE_RMS},
    {"d64_k16v4_page32_window", 64, 16, 4, 1, 32, 0, 24, FMKV_SCALE_LSQ},
    {"d256_k4v2_sink", 256, 4, 2, 1, 16, 5, 0, FMKV_SCALE_LSQ},
    // format 3: 3-bit codes in tile blocks (a prefix's last page cleared code by code)
    {"v3_d128_k3v3_sink_window", 128, 3, 3, 2, 16, 4, 32, FMKV_SCALE_LSQ, 3},
    {"v3_d64_k3v2_page32", 64, 3, 2, 1, 32, 0, 0, FMKV_SCALE_RMS, 3},
    // scale group 64 (one scale per 64 coordinates): the header's scale_group field
    {"sg64_d64_k2v2_window", 64, 2, 2, 2, 16, 0, 24, FMKV_SCALE_LSQ, 0, 64},
    {"v3_sg64_d128_k3v2_sink", 128, 3, 2, 1, 32, 3, 0, FMKV_SCALE_RMS, 3, 64},
};

class IoCase : public ::testing::TestWithParam<Case> {
 protected:
  fmkv_config cfg() const {
    const Case& k = GetParam();
    fmkv_config c = config(k.d, k.kb, k.vb, k.heads, k.page, k.sink, k.window, k.rule);
    c.format_version = k.format_version;
    c.scale_group = k.scale_group;
    return c;
  }
};

// ---------------------------------------------------------------------------------------------

TEST(IoCrc, KnownValueAndHardwareMatchesPortable) {
  EXPECT_EQ(io::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(io::crc32c_portable("123456789", 9), 0xE3069283u);
  auto b = random_bytes(5000);
  for (size_t n : {0, 1, 3, 8, 15, 64, 4097, 4999}) {
    EXPECT_EQ(io::crc32c(b.data() + 1, n), io::crc32c_portable(b.data() + 1, n)) << n;
    uint32_t c = io::crc32c(b.data(), n / 2);
    EXPECT_EQ(io::crc32c(b.data() + n / 2, n - n / 2, c), io::crc32c_portable(b.data(), n)) << n;
  }
}

// The bytes of a loaded snapshot saved again (every layer and sequence, in file order).
std::vector<uint8_t> resave(const Snapshot& snap) {
  const fmkv_snapshot_info info = snap.info();
  std::vector<fmkv_layer_cache> ls;
  for (int32_t l = 0; l < info.num_layers; ++l) ls.push_back(snap.layer(l));
  std::vector<fmkv_save_sequence> ss;
  for (int32_t i = 0; i < info.num_seqs; ++i) {
    const fmkv_snapshot_sequence q = snap.sequence(i);
    ss.push_back({q.slot, q.num_tokens, nullptr, -1, q.block_table, q.num_pages});
  }
  void* data;
  size_t size;
  check(fmkv_save_memory(&info.config, info.num_layers, ls.data(), info.num_seqs, ss.data(), 0, &data, &size));
  std::vector<uint8_t> out(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + size);
  fmkv_buffer_free(data);
  return out;
}

TEST_P(IoCase, RoundTripBytesAndAttention) {
  const fmkv_config c = cfg();
  Model m(c, 3, {150, 37, 1});
  auto src = m.build();
  const std::string path = tmpdir() + "/rt_" + GetParam().name + ".fmkv";
  check(save_file(path, *src, {0, 1, 2}, -1));
  const std::vector<uint8_t> file = read_file(path);
  EXPECT_EQ(file, save_mem(*src, {0, 1, 2}, -1));  // file and memory writers agree
  EXPECT_EQ(rd64(&file[io::kOffFileSize]), (uint64_t)file.size());  // the header records the length
  EXPECT_EQ(rd32(&file[io::kOffScaleGroup]), c.scale_group == 64 ? 64u : 0u);
  for (int mode : {FMKV_LOAD_COPY, FMKV_LOAD_MMAP}) {
    fmkv_load_options o;
    fmkv_load_options_default(&o);
    o.mode = mode;
    o.expect_config = &c;
    o.expect_num_layers = 3;
    Snapshot snap = Snapshot::load(path, &o);
    fmkv_snapshot_info info = snap.info();
    EXPECT_EQ(info.mapped, mode == FMKV_LOAD_MMAP ? 1 : 0);
    EXPECT_EQ(info.num_seqs, 3);
    EXPECT_EQ(info.flags, 0u);
    EXPECT_EQ(fmkv_resolved_scale_group(info.config.scale_group), fmkv_resolved_scale_group(c.scale_group));
    const int64_t pb = fmkv_config_page_bytes(&c);
    const size_t slot_elems = (size_t)(fmkv_config_fp16_slot_bytes(&c) / 4);
    for (int32_t l = 0; l < 3; ++l) {
      fmkv_layer_cache sl = snap.layer(l), hl = src->layer(l);
      EXPECT_EQ(sl.layer, l);
      if (mode == FMKV_LOAD_MMAP) {
        EXPECT_EQ((uintptr_t)sl.pages % 4096, 0u);
      }
      for (int32_t i = 0; i < 3; ++i) {
        fmkv_snapshot_sequence q = snap.sequence(i);
        ASSERT_EQ(q.num_tokens, m.lens[i]);
        ASSERT_EQ(q.dequantized_tokens, 0);
        const auto& t = src->table[i];
        ASSERT_EQ(q.num_pages, (std::max<int64_t>(0, m.lens[i] - c.sink_tokens - c.window_tokens) + c.page_size - 1) / c.page_size);
        for (int64_t j = 0; j < q.num_pages; ++j)
          ASSERT_EQ(0, std::memcmp(sl.pages + q.block_table[j] * pb, hl.pages + t[j] * pb, (size_t)pb)) << "layer " << l << " seq " << i << " page " << j;
        if (slot_elems) {
          ASSERT_EQ(0, std::memcmp(sl.fp16_k + q.slot * slot_elems, hl.fp16_k + i * slot_elems, slot_elems * 2));
          ASSERT_EQ(0, std::memcmp(sl.fp16_v + q.slot * slot_elems, hl.fp16_v + i * slot_elems, slot_elems * 2));
        }
        auto qv = make_q(c, 100 * l + i);
        EXPECT_TRUE(same_bits(attend(snap, l, i, qv), attend(*src, l, i, qv))) << "layer " << l << " seq " << i;
        if (fmkv_backend_available(FMKV_BACKEND_CPU)) {  // the optimized host backend reads the loaded state too
          EXPECT_TRUE(same_bits(attend(c, sl, q.slot, q.num_tokens, q.block_table, q.num_pages, qv, FMKV_BACKEND_CPU),
                                attend(c, hl, i, m.lens[i], src->table[i].data(), (int64_t)src->table[i].size(), qv, FMKV_BACKEND_CPU)))
              << "cpu backend, layer " << l << " seq " << i;
        }
      }
    }
    // Whole-batch attention straight from the snapshot's batch arrays.
    const int64_t* lens;
    const int32_t *slots, *table;
    int64_t stride;
    check(fmkv_snapshot_batch(snap.get(), &lens, &slots, &table, &stride));
    EXPECT_EQ(lens[0], 150);
    EXPECT_EQ(slots[2], 2);
    // Saving the loaded snapshot again gives the same bytes.
    EXPECT_TRUE(resave(snap) == file);
  }
  // From memory too.
  Snapshot ms = Snapshot::load_memory(file.data(), file.size());
  auto qv = make_q(c, 7);
  EXPECT_TRUE(same_bits(attend(ms, 1, 0, qv), attend(*src, 1, 0, qv)));
}

// A prefix of N tokens is written exactly as a cache that only ever saw N tokens would be.
TEST_P(IoCase, ExactPrefixEqualsShorterCache) {
  const fmkv_config c = cfg();
  const int64_t L = 170;
  Model m(c, 2, {L});
  auto src = m.build();
  const int64_t S = c.sink_tokens, W = c.window_tokens, P = c.page_size;
  std::set<int64_t> ns = {L, 0};
  if (W == 0)  // every prefix is exact
    for (int64_t n : {S, S + 1, S + P - 1, S + P, S + P + 1, S + 3 * P, L - 1, L - P}) ns.insert(n);
  else
    for (int64_t n = 0; n <= S; ++n) ns.insert(n);
  for (int64_t n : ns) {
    if (n < 0 || n > L) continue;
    SCOPED_TRACE("N = " + std::to_string(n));
    auto img = save_mem(*src, {0}, n);
    auto shorter = m.build({n});
    EXPECT_EQ(img, save_mem(*shorter, {0}, -1));
    Snapshot snap = Snapshot::load_memory(img.data(), img.size());
    EXPECT_EQ(snap.sequence(0).num_tokens, n);
    if (n > 0) {
      auto qv = make_q(c, (uint64_t)n);
      for (int32_t l = 0; l < 2; ++l) EXPECT_TRUE(same_bits(attend(snap, l, 0, qv), attend(*shorter, l, 0, qv)));
    }
    // Restoring the prefix into a HostCache and appending the rest reproduces the full cache.
    if (n <= c.sink_tokens + c.window_tokens && !has_restore_length<HostCache>(0)) continue;  // needs HostCache::restore_length
    auto dst = std::make_unique<HostCache>(c, 2, 64, 3);
    dst->add_sequence();  // occupy slot 0 and a page so indices differ from the source
    m.feed(*dst, 0, 0, 0, std::min<int64_t>(L, S + W + P));
    int32_t s = restore(*dst, snap, 0);
    EXPECT_EQ(s, 1);
    m.feed(*dst, s, 0, n, L);
    auto qv = make_q(c, 1000 + (uint64_t)n);
    for (int32_t l = 0; l < 2; ++l) EXPECT_TRUE(same_bits(attend(*dst, l, s, qv), attend(*src, l, 0, qv)));
    EXPECT_EQ(save_mem(*dst, {s}, -1), save_mem(*src, {0}, -1));
  }
}

// A prefix whose fp16 window holds tokens the source already compressed: rejected unless
// FMKV_SAVE_ALLOW_DEQUANTIZED, then restored from codes and flagged.
TEST_P(IoCase, PrefixInsideWindow) {
  const fmkv_config c = cfg();
  if (c.window_tokens == 0) GTEST_SKIP() << "no window";
  const int64_t L = 160, S = c.sink_tokens, W = c.window_tokens;
  Model m(c, 2, {L});
  auto src = m.build();
  for (int64_t n : {L - 1, L - W / 2, L - W, S + W + 5, S + 3}) {
    SCOPED_TRACE("N = " + std::to_string(n));
    fmkv_status st;
    auto img = save_mem(*src, {0}, n, 0, &st);
    EXPECT_EQ(st, FMKV_ERR_UNSUPPORTED);
    EXPECT_TRUE(img.empty());
    std::string msg = fmkv_last_error();
    EXPECT_NE(msg.find("FMKV_SAVE_ALLOW_DEQUANTIZED"), std::string::npos) << msg;
    EXPECT_NE(msg.find("already compressed"), std::string::npos) << msg;
    // Nothing written to disk either.
    const std::string path = tmpdir() + "/win.fmkv";
    ::unlink(path.c_str());
    std::vector<int64_t> lens;
    EXPECT_EQ(save_file(path, *src, {0}, n), FMKV_ERR_UNSUPPORTED);
    EXPECT_FALSE(exists(path));

    img = save_mem(*src, {0}, n, FMKV_SAVE_ALLOW_DEQUANTIZED);
    Snapshot snap = Snapshot::load_memory(img.data(), img.size());
    const int64_t e_n = std::max(S, n - W), e_l = std::max(S, L - W);
    EXPECT_EQ(snap.sequence(0).dequantized_tokens, std::min(n, e_l) - e_n);
    EXPECT_EQ(snap.info().flags, 1u);
    auto shorter = m.build({n});
    auto qv = make_q(c, 5);
    for (int32_t l = 0; l < 2; ++l) EXPECT_LT(rel_error(attend(snap, l, 0, qv), attend(*shorter, l, 0, qv)), 1.0);
    // The restored window tokens are the dequantized inputs: within the codes' error (K exact
    // for k16), and the exact fp16 inputs for tokens still in the source window.
    const int32_t H = c.num_kv_heads, d = c.head_dim, R = c.sink_tokens + c.window_tokens;
    for (int32_t l = 0; l < 2; ++l)
      for (int is_v = 0; is_v < 2; ++is_v) {
        const uint16_t* reg = is_v ? snap.layer(l).fp16_v : snap.layer(l).fp16_k;
        const auto& in = is_v ? m.v[0][l] : m.k[0][l];
        double err = 0, norm = 0;
        for (int64_t pos = e_n; pos < n; ++pos) {
          const int32_t r = (int32_t)(S + (pos - S) % W);
          for (int32_t h = 0; h < H; ++h)
            for (int32_t j = 0; j < d; ++j) {
              uint16_t want, got = reg[((size_t)h * R + r) * d + j];
              std::memcpy(&want, &in[(((size_t)pos * H + h) * d + j) * 2], 2);
              const bool exact = pos >= e_l || (!is_v && c.k_bits == 16);
              if (exact) {
                ASSERT_EQ(got, want) << "pos " << pos;
              }
              double e = (double)f16_to_f32(got) - f16_to_f32(want);
              err += e * e;
              norm += (double)f16_to_f32(want) * f16_to_f32(want);
            }
        }
        EXPECT_LT(std::sqrt(err / norm), 0.45) << "layer " << l << (is_v ? " V" : " K");
      }
    // Pages equal the shorter cache's (only the window differs).
    auto a = shorter->layer(0);
    auto b = snap.layer(0);
    const int64_t pb = fmkv_config_page_bytes(&c);
    for (int64_t j = 0; j < snap.sequence(0).num_pages; ++j)
      EXPECT_EQ(0, std::memcmp(a.pages + shorter->table[0][j] * pb, b.pages + snap.sequence(0).block_table[j] * pb, (size_t)pb));
    fmkv_load_options o;
    fmkv_load_options_default(&o);
    o.flags = FMKV_LOAD_REJECT_DEQUANTIZED;
    expect_reject(img, {"dequantized"}, &o);
  }
}

// Zero-copy load with spare pages, then appends into the mapping: same results as the source,
// and the file is untouched (MAP_PRIVATE).
TEST_P(IoCase, MmapAppendDoesNotWriteFile) {
  const fmkv_config c = cfg();
  const int64_t L = 140, n = c.window_tokens ? L - 40 : 77;
  Model m(c, 2, {L});
  auto src = m.build();
  auto pre = m.build({n});
  const std::string path = tmpdir() + "/mm_" + GetParam().name + ".fmkv";
  check(save_file(path, *pre, {0}, -1));
  const auto before = read_file(path);
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  o.mode = FMKV_LOAD_MMAP;
  o.extra_pages = 8;
  Snapshot snap = Snapshot::load(path, &o);
  fmkv_snapshot_info info = snap.info();
  EXPECT_EQ(info.mapped, 1);
  EXPECT_EQ(info.num_pages, info.file_pages + 8);
  fmkv_snapshot_sequence q = snap.sequence(0);
  std::vector<int32_t> table(q.block_table, q.block_table + q.num_pages);
  for (int64_t j = 0; j < 8; ++j) table.push_back((int32_t)(info.file_pages + j));
  for (int32_t l = 0; l < 2; ++l) {
    fmkv_layer_cache lc = snap.layer(l);
    int64_t len = n, rows[2] = {0, L - n};
    int32_t slot = q.slot;
    fmkv_batch bt{1, &slot, &len, rows, table.data(), (int64_t)table.size()};
    fmkv_tensor kt = make_tensor(&m.k[0][l][(size_t)n * m.row_bytes()], FMKV_F16, L - n, c.num_kv_heads, c.head_dim);
    fmkv_tensor vt = make_tensor(&m.v[0][l][(size_t)n * m.row_bytes()], FMKV_F16, L - n, c.num_kv_heads, c.head_dim);
    check(fmkv_append(FMKV_BACKEND_REF, &c, &lc, &bt, &kt, &vt, nullptr));
    auto qv = make_q(c, 9 + l);
    EXPECT_TRUE(same_bits(attend(c, lc, slot, L, table.data(), (int64_t)table.size(), qv), attend(*src, l, 0, qv)));
  }
  EXPECT_EQ(read_file(path), before);
}

// io.hpp on HostCache: save a sequence (whole or a prefix) and restore it into another cache.
TEST_P(IoCase, HostCacheSaveRestore) {
  const fmkv_config c = cfg();
  const int64_t L = 120, S = c.sink_tokens, W = c.window_tokens;
  Model m(c, 2, {L});
  HostCache a(c, 2, 40, 2);
  m.feed(a, a.add_sequence(), 0, 0, L);
  const std::string path = tmpdir() + "/hc_" + GetParam().name + ".fmkv";
  for (int64_t n : {L, W ? std::min(L, S) : L / 2}) {
    if (n <= S + W && !has_restore_length<HostCache>(0)) continue;  // needs HostCache::restore_length
    SCOPED_TRACE("N = " + std::to_string(n));
    save(path, a, 0, n);
    HostCache b(c, 2, 40, 3);
    m.feed(b, b.add_sequence(), 0, 0, L);  // occupy pages and slot 0
    const int64_t free_before = b.free_pages();
    int32_t s = restore(b, path);
    EXPECT_EQ(s, 1);
    EXPECT_EQ(b.length(1, s), n);
    m.feed(b, s, 0, n, L);
    EXPECT_EQ(b.free_pages(), free_before - (int64_t)b.block_table(s).size());
    auto qv = make_q(c, 77);
    for (int32_t l = 0; l < 2; ++l) EXPECT_TRUE(same_bits(attend(b, l, s, qv), attend(a, l, 0, qv)));
    EXPECT_EQ(save_memory(b, s), save_memory(a, 0));
  }
  // Wrong layer count or config: refused, cache untouched.
  HostCache three(c, 3, 40, 2);
  EXPECT_THROW(restore(three, path), Error);
  EXPECT_NE(std::string(fmkv_last_error()).find("expected 3"), std::string::npos) << fmkv_last_error();
  EXPECT_EQ(three.free_pages(), 40);
}

INSTANTIATE_TEST_SUITE_P(Configs, IoCase, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// ---- rejection -------------------------------------------------------------------------------

struct Fixture {
  fmkv_config cfg = config(64, 3, 2, 2, 16, 2, 16);
  Model m{cfg, 2, {90, 20}};
  std::unique_ptr<RawCache> hc = m.build();
  std::vector<uint8_t> img = save_mem(*hc, {0, 1}, -1);
  uint64_t sec_off(size_t i) const { return rd64(&img[io::kHeaderBytes + i * io::kSectionEntryBytes + 8]); }
  uint64_t sec_size(size_t i) const { return rd64(&img[io::kHeaderBytes + i * io::kSectionEntryBytes + 16]); }
  size_t num_sections() const { return rd32(&img[io::kOffNumSections]); }
};

TEST(IoReject, Truncated) {
  Fixture f;
  ASSERT_GT(f.img.size(), 4096u * 3);
  std::vector<size_t> lens;
  for (size_t n = 0; n < 600; ++n) lens.push_back(n);
  for (size_t n = 600; n < f.img.size(); n += 1 + rng()() % 97) lens.push_back(n);
  lens.push_back(f.img.size() - 1);
  for (size_t n : lens) {
    std::vector<uint8_t> t(f.img.begin(), f.img.begin() + (long)n);
    expect_reject(t, {"truncated"}, nullptr, "length " + std::to_string(n));
  }
  // Through a real file as well (copy and mmap).
  const std::string path = tmpdir() + "/trunc.fmkv";
  for (size_t n : {size_t(0), size_t(100), f.img.size() / 2, f.img.size() - 1}) {
    write_file(path, std::vector<uint8_t>(f.img.begin(), f.img.begin() + (long)n));
    for (int mode : {FMKV_LOAD_COPY, FMKV_LOAD_MMAP}) {
      fmkv_load_options o;
      fmkv_load_options_default(&o);
      o.mode = mode;
      fmkv_snapshot* s = nullptr;
      EXPECT_NE(fmkv_load(path.c_str(), &o, &s), FMKV_OK);
      EXPECT_EQ(s, nullptr);
      EXPECT_NE(std::string(fmkv_last_error()).find("truncated"), std::string::npos) << fmkv_last_error();
    }
  }
  // Trailing garbage is rejected too.
  auto longer = f.img;
  longer.push_back(0);
  expect_reject(longer, {"trailing"});
}

TEST(IoReject, EveryHeaderAndTableByteFlipped) {
  Fixture f;
  const size_t meta_end = io::kHeaderBytes + f.num_sections() * io::kSectionEntryBytes;
  for (size_t i = 0; i < meta_end; ++i)
    for (uint8_t bit : {0x01, 0x80}) {
      auto t = f.img;
      t[i] ^= bit;
      if (i < 8) expect_reject(t, {"bad magic"}, nullptr, "byte " + std::to_string(i));
      else if (i < 12) expect_reject(t, {"file version"}, nullptr, "byte " + std::to_string(i));
      else if (i < 16) expect_reject(t, {"header size"}, nullptr, "byte " + std::to_string(i));
      else expect_reject(t, {"checksum mismatch"}, nullptr, "byte " + std::to_string(i));
    }
}

TEST(IoReject, DataBytesFlipped) {
  Fixture f;
  const size_t n = f.num_sections();
  uint64_t prev_end = io::kHeaderBytes + n * io::kSectionEntryBytes;
  for (size_t s = 0; s < n; ++s) {
    const uint64_t off = f.sec_off(s), size = f.sec_size(s);
    if (size == 0) continue;
    std::vector<uint64_t> at = {off, off + size - 1};
    for (int k = 0; k < 40; ++k) at.push_back(off + rng()() % size);
    for (uint64_t a : at) {
      auto t = f.img;
      t[a] ^= (uint8_t)(1u << (rng()() % 8));
      expect_reject(t, {"checksum mismatch"}, nullptr, "section " + std::to_string(s) + " byte " + std::to_string(a));
    }
    if (off > prev_end) {  // padding before the section
      auto t = f.img;
      t[prev_end + rng()() % (off - prev_end)] = 0x5A;
      expect_reject(t, {"padding"}, nullptr, "padding before section " + std::to_string(s));
    }
    prev_end = off + size;
  }
}

TEST(IoReject, WrongMagic) {
  Fixture f;
  auto t = f.img;
  std::memcpy(t.data(), "GGUF\0\0\0\0", 8);
  expect_reject(t, {"not an fmkv snapshot (bad magic)"});
  expect_reject(std::vector<uint8_t>(5000, 0), {"bad magic"});
}

TEST(IoReject, WrongVersions) {
  Fixture f;
  auto t = f.img;
  wr32(&t[io::kOffFileVersion], 2);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"snapshot file version 2 is not supported; this library reads file version 1"});
  t = f.img;
  wr32(&t[io::kOffFormatVersion], FMKV_FORMAT_VERSION_NEWEST + 1);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {("cache data is fmkv format version " + std::to_string(FMKV_FORMAT_VERSION_NEWEST + 1) +
                     "; this library reads format versions 2 to " + std::to_string(FMKV_FORMAT_VERSION_NEWEST) +
                     " (and converts version 1 on load)").c_str()});
  t = f.img;
  wr32(&t[io::kOffFormatVersion], 0);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"cache data is fmkv format version 0"});
}

// Snapshots written by the format-1 library (tests/golden/format1_*.fmkv, made by
// tests/golden/make_format1_snapshots.cpp at 7978fef from the caches of tests/format1_snapshot.h).
// Loaded in every mode and saved again, each gives exactly the current library's snapshot of the same
// cache: 4-bit sections repacked, everything else (3-bit codes, scales, fp16 regions, sequences,
// tables) as stored.

TEST(IoFormat1, LoadedFilesEqualTheCurrentFormat) {
  for (const auto& c : fmkv_format1::cases()) {
    SCOPED_TRACE(c.file);
    const std::string path = std::string(FMKV_SOURCE_DIR) + "/tests/golden/" + c.file;
    const std::vector<uint8_t> v1 = read_file(path), now = fmkv_format1::build(c);
    ASSERT_GT(v1.size(), io::kHeaderBytes) << "missing golden file " << path;
    ASSERT_EQ(rd32(&v1[io::kOffFormatVersion]), 1u);
    ASSERT_EQ(v1.size(), now.size());
    // the files differ in the header (version, checksum) and, with 4-bit codes, in the pages
    size_t differing = 0;
    for (size_t i = io::kHeaderBytes; i < v1.size(); ++i) differing += v1[i] != now[i];
    if (c.cfg.k_bits == 4 || c.cfg.v_bits == 4) EXPECT_GT(differing, 100u);
    else EXPECT_EQ(differing, 0u);
    for (int mode : {FMKV_LOAD_COPY, FMKV_LOAD_MMAP}) {
      fmkv_load_options o;
      fmkv_load_options_default(&o);
      o.mode = mode;
      o.extra_pages = mode == FMKV_LOAD_MMAP ? 0 : 2;  // pools with and without room to append
      Snapshot snap = Snapshot::load(path, &o);
      EXPECT_EQ(snap.info().format_version, FMKV_FORMAT_VERSION);
      EXPECT_EQ(snap.info().mapped, mode == FMKV_LOAD_MMAP ? 1 : 0);
      EXPECT_TRUE(resave(snap) == now) << "mode " << mode;
    }
    EXPECT_TRUE(resave(Snapshot::load_memory(v1.data(), v1.size())) == now);
    EXPECT_EQ(read_file(path), v1) << "loading modified the file";
    // checksums are verified on the stored bytes, before the repacking
    std::vector<uint8_t> bad = v1;
    bad[bad.size() - 7] ^= 0x10;
    expect_reject(bad, {"checksum"});
  }
}

TEST(IoReject, GeometryMismatch) {
  Fixture f;
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  fmkv_config e = f.cfg;
  e.head_dim = 128;
  o.expect_config = &e;
  expect_reject(f.img, {"geometry mismatch: file has head_dim 64 (expected 128)"}, &o);
  e = f.cfg;
  e.seed ^= 1;
  e.window_tokens = 8;
  expect_reject(f.img, {"window_tokens 16 (expected 8), seed"}, &o);
  e = f.cfg;
  e.scale_group = 64;
  expect_reject(f.img, {"scale_group 32 (expected 64)"}, &o);
  e = f.cfg;
  e.scale_group = 32;  // 32 is the default the file's 0 stands for
  EXPECT_TRUE(Snapshot::load_memory(f.img.data(), f.img.size(), &o));
  EXPECT_EQ(rd32(&f.img[io::kOffScaleGroup]), 0u) << "a default cache stores scale_group 0";
  e = f.cfg;
  o.expect_num_layers = 32;
  expect_reject(f.img, {"2 layers (expected 32)"}, &o);
  o.expect_num_layers = 2;
  Snapshot ok = Snapshot::load_memory(f.img.data(), f.img.size(), &o);
  EXPECT_TRUE(ok);
  // Header geometry inconsistent with itself (checksums refreshed so only the check can catch it).
  auto t = f.img;
  wr32(&t[io::kOffHeadDim], 96);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"head_dim 96 is not supported"});
  t = f.img;
  wr32(&t[io::kOffScaleGroup], 48);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"scale_group 48 is not supported"});
  t = f.img;
  wr32(&t[io::kOffScaleGroup], 64);  // a valid scale group the pages were not written with: page_bytes disagrees
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"page_bytes"});
  t = f.img;
  wr64(&t[io::kOffPageBytes], rd64(&t[io::kOffPageBytes]) + 16);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"page_bytes"});
  t = f.img;
  wr32(&t[io::kOffNumLayers], 3);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"sections in header", "file size", "needs more than"});
  t = f.img;
  wr32(&t[io::kOffNumLayers], 0x7fffffff);
  io::refresh_checksums(t.data(), t.size());
  expect_reject(t, {"needs", "more than"});
  // A restore into a HostCache with a different config is refused before touching it.
  fmkv_config other = f.cfg;
  other.seed ^= 2;
  HostCache hc(other, 2, 32, 2);
  Snapshot snap = Snapshot::load_memory(f.img.data(), f.img.size());
  EXPECT_THROW(restore(hc, snap), Error);
  EXPECT_EQ(hc.free_pages(), 32);
  // ... and so is one whose format version or scale group differs (format 2 and 3 pages of k3 can be the same size:
  // their bytes would have been copied as they are).
  EXPECT_EQ(fmkv_snapshot_check_config(snap.get(), &f.cfg), FMKV_OK);
  fmkv_config resolved = f.cfg;  // 0 and the default it stands for are the same config
  resolved.format_version = fmkv_resolved_format_version(f.cfg.format_version);
  resolved.scale_group = fmkv_resolved_scale_group(f.cfg.scale_group);
  EXPECT_EQ(fmkv_snapshot_check_config(snap.get(), &resolved), FMKV_OK);
  for (const char* field : {"format_version", "scale_group"}) {
    fmkv_config o2 = resolved;
    if (std::string(field) == "format_version") o2.format_version = resolved.format_version == 3 ? 2 : 3;
    else o2.scale_group = resolved.scale_group == 64 ? 32 : 64;
    ASSERT_EQ(fmkv_config_validate(&o2), FMKV_OK) << field;
    EXPECT_EQ(fmkv_snapshot_check_config(snap.get(), &o2), FMKV_ERR_INVALID_ARGUMENT) << field;
    EXPECT_NE(std::string(fmkv_last_error()).find(field), std::string::npos) << fmkv_last_error();
    HostCache h2(o2, 2, 32, 2);
    try {
      restore(h2, snap);
      ADD_FAILURE() << "a snapshot restored into a cache of another " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
    EXPECT_EQ(h2.free_pages(), 32);
    EXPECT_EQ(h2.add_sequence(), 0);
  }
  EXPECT_EQ(fmkv_snapshot_check_config(nullptr, &f.cfg), FMKV_ERR_INVALID_ARGUMENT);
  HostCache small(f.cfg, 2, 2, 2);
  EXPECT_THROW(restore(small, snap, 0), Error);  // needs more pages than free
  EXPECT_EQ(small.free_pages(), 2);
  EXPECT_EQ(small.add_sequence(), 0);  // no sequence was left behind
}

TEST(IoReject, BlockTableAndRecords) {
  Fixture f;
  const uint64_t tb = f.sec_off(2);
  const int32_t pages = (int32_t)rd64(&f.img[io::kOffPagesPerLayer]);
  ASSERT_GE(pages, 2);
  auto edit = [&](uint64_t at, uint32_t v) {
    auto t = f.img;
    wr32(&t[at], v);
    io::refresh_checksums(t.data(), t.size());
    return t;
  };
  expect_reject(edit(tb, (uint32_t)pages), {("block table entry 0 = " + std::to_string(pages) + " outside [0, " + std::to_string(pages) + ")").c_str()});
  expect_reject(edit(tb + 4, 0xFFFFFFFFu), {"outside [0,"});
  expect_reject(edit(tb + 4, 0), {"page 0 appears twice"});
  const uint64_t sq = f.sec_off(1);
  expect_reject(edit(sq + 8, 99), {"pages recorded"});                    // page count of sequence 0
  expect_reject(edit(sq, 5000), {"pages recorded"});                      // token count
  expect_reject(edit(sq + 32 + 16, 0), {"first block-table entry"});     // sequence 1's first entry
  expect_reject(edit(sq + 24, 3), {"disagrees", "dequantized"});          // dequantized count without flag
  expect_reject(edit(sq + 28, 1), {"reserved"});
  expect_reject(edit(f.sec_off(0), 0x80000000u), {"negative layer index"});
  // Section table entries that do not match the canonical layout.
  const uint64_t e3 = io::kHeaderBytes + 3 * io::kSectionEntryBytes;
  expect_reject(edit(e3 + 8, (uint32_t)f.sec_off(3) + 4096), {"expected offset", "outside"});
  expect_reject(edit(e3 + 16, 0xFFFFFFFFu), {"outside"});
  expect_reject(edit(e3, 99), {"kind 99"});
  // A permuted (but valid) block table is accepted and followed.
  auto t = f.img;
  uint32_t a = rd32(&t[tb]), b = rd32(&t[tb + 4]);
  wr32(&t[tb], b);
  wr32(&t[tb + 4], a);
  io::refresh_checksums(t.data(), t.size());
  Snapshot s = Snapshot::load_memory(t.data(), t.size());
  EXPECT_EQ(s.sequence(0).block_table[0], (int32_t)b);
}

TEST(IoReject, SaveErrorsLeaveNothingBehind) {
  Fixture f;
  const std::string dir = tmpdir() + "/save_err";
  ::mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/x.fmkv";
  write_file(path, {1, 2, 3});  // an existing file stays as it was when a save fails
  std::vector<fmkv_layer_cache> layers = {f.hc->layer(0), f.hc->layer(1)};
  auto try_save = [&](fmkv_save_sequence ss, const char* needle) {
    EXPECT_NE(fmkv_save(path.c_str(), &f.cfg, 2, layers.data(), 1, &ss, 0), FMKV_OK);
    EXPECT_NE(std::string(fmkv_last_error()).find(needle), std::string::npos) << fmkv_last_error();
    EXPECT_EQ(read_file(path), (std::vector<uint8_t>{1, 2, 3}));
    EXPECT_EQ(dir_entries(dir).size(), 1u);
  };
  fmkv_save_sequence ss = f.hc->seq(0, -1);
  auto bad = ss;
  bad.num_tokens = 91;
  try_save(bad, "exceeds the 90 tokens");
  bad = ss;
  bad.slot = 7;
  try_save(bad, "slot 7 outside");
  std::vector<int32_t> tbl(ss.block_table, ss.block_table + ss.block_table_len);
  tbl[1] = 1000;
  bad = ss;
  bad.block_table = tbl.data();
  try_save(bad, "block_table[1] = 1000 outside");
  bad = ss;
  bad.block_table_len = 1;
  try_save(bad, "block_table_len is 1");
  EXPECT_NE(fmkv_save(path.c_str(), nullptr, 2, layers.data(), 1, &ss, 0), FMKV_OK);
  EXPECT_NE(fmkv_save((dir + "/no/such/dir.fmkv").c_str(), &f.cfg, 2, layers.data(), 1, &ss, 0), FMKV_OK);
  EXPECT_NE(std::string(fmkv_last_error()).find("cannot create"), std::string::npos);
  // A successful save replaces the file atomically and leaves no temporary behind.
  check(fmkv_save(path.c_str(), &f.cfg, 2, layers.data(), 1, &ss, FMKV_SAVE_NO_FSYNC));
  EXPECT_EQ(dir_entries(dir).size(), 1u);
  EXPECT_EQ(read_file(path), save_mem(*f.hc, {0}, -1));
}

TEST(IoReject, LoadArgumentErrors) {
  Fixture f;
  fmkv_snapshot* s = nullptr;
  EXPECT_EQ(fmkv_load((tmpdir() + "/does_not_exist").c_str(), nullptr, &s), FMKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fmkv_last_error()).find("cannot open"), std::string::npos);
  EXPECT_EQ(fmkv_load(tmpdir().c_str(), nullptr, &s), FMKV_ERR_INVALID_ARGUMENT);  // a directory
  EXPECT_EQ(s, nullptr);
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  o.extra_pages = -1;
  expect_reject(f.img, {"negative extra_pages"}, &o);
  Snapshot snap = Snapshot::load_memory(f.img.data(), f.img.size());
  fmkv_layer_cache lc;
  EXPECT_EQ(fmkv_snapshot_layer(snap.get(), 2, &lc), FMKV_ERR_OUT_OF_RANGE);
  fmkv_snapshot_sequence q;
  EXPECT_EQ(fmkv_snapshot_get_sequence(snap.get(), -1, &q), FMKV_ERR_OUT_OF_RANGE);
}

// Values the file stores unsigned are quoted as stored (a corrupted u64 is never shown negative).
TEST(IoReject, UnsignedFieldsQuotedUnsigned) {
  Fixture f;
  auto edit64 = [&](uint64_t at, uint64_t v) {
    auto t = f.img;
    wr64(&t[at], v);
    io::refresh_checksums(t.data(), t.size());
    return t;
  };
  auto message = [](const std::vector<uint8_t>& img) {
    fmkv_snapshot* s = nullptr;
    EXPECT_NE(fmkv_load_memory(img.data(), img.size(), nullptr, &s), FMKV_OK);
    return std::string(fmkv_last_error());
  };
  std::string m = message(edit64(io::kOffPagesPerLayer, ~0ull));
  EXPECT_NE(m.find("pages per layer 18446744073709551615"), std::string::npos) << m;
  m = message(edit64(io::kOffPageBytes, 1ull << 63));
  EXPECT_NE(m.find("page_bytes 9223372036854775808"), std::string::npos) << m;
  m = message(edit64(f.sec_off(1), 1ull << 63));  // sequence 0's token count
  EXPECT_NE(m.find("token count 9223372036854775808"), std::string::npos) << m;
  auto t = f.img;
  ASSERT_GE(t.size(), (size_t)io::kHeaderBytes);
  wr32(t.data() + io::kOffNumLayers, 0xFFFFFFFFu);
  io::refresh_checksums(t.data(), t.size());
  m = message(t);
  EXPECT_NE(m.find("num_layers 4294967295"), std::string::npos) << m;
  const uint64_t e3 = io::kHeaderBytes + 3 * io::kSectionEntryBytes;
  m = message(edit64(e3 + 8, ~0ull - 5));
  EXPECT_NE(m.find("18446744073709551610"), std::string::npos) << m;
}

}  // namespace
}  // namespace fmkv::test

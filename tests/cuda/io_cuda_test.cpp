// Snapshot save/load (include/fmkv/io.h, docs/FILE-FORMAT.md) around a cache that lives in CUDA
// device memory, through the public C API only:
//   1. build a multi-layer, multi-sequence cache on the device (fmkv_device_alloc, fmkv_append with
//      FMKV_BACKEND_CUDA, random chunk sizes); unowned pages hold random bytes;
//   2. download the page pools and fp16 regions, fmkv_save a snapshot (and fmkv_save_memory: same
//      bytes);
//   3. fmkv_load it in COPY and in MMAP mode, upload every layer into fresh device buffers; check
//      that the pages of every sequence and its valid fp16 sink/window entries are byte-identical
//      to the original (after the device round trip), and that CUDA attention over the loaded
//      cache equals CUDA attention over the original bit for bit (same kernel, same bytes), and
//      matches the reference backend over the loaded host snapshot within the stated CUDA bound;
//   4. prefix save: a prefix of every sequence is written exactly as a cache that only ever saw the
//      prefix (built separately on the device): same file bytes, same pages, same attention bits;
//      the loaded prefix (with extra pages) then continues on the device with the remaining tokens
//      and ends up with the full cache's attention, bit for bit.
// Prints one line per case and "N passed, M failed"; exit status 1 on any failure.
// `io_cuda_test ref` runs the same program on the reference backend (host memory), which checks
// the test's own logic on a machine without a GPU. Fresh inputs every run (seed printed;
// FMKV_IO_SEED=<n> repeats a run).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../compare.h"
#include "fmkv/fmkv.h"
#include "fmkv/io.h"

// Portable binaries (tests/cuda/build_gpu1.sh defines FMKV_GLIBC_COMPAT_ARC4RANDOM): the statically
// linked libstdc++ of GCC 12 on glibc 2.36 calls arc4random (GLIBC_2.36) from std::random_device;
// defining it here keeps the binary loadable on glibc 2.35 (the other symbols need <= 2.35).
#ifdef FMKV_GLIBC_COMPAT_ARC4RANDOM
#include <sys/random.h>
extern "C" __uint32_t arc4random(void) __THROW {
  __uint32_t x = 0;
  if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x) x ^= (__uint32_t)(uintptr_t)&x;
  return x;
}
#endif

namespace {

fmkv_backend g_be = FMKV_BACKEND_CUDA;
std::mt19937_64 g_rng;
int g_passed = 0, g_failed = 0;

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void ck(fmkv_status s, const char* what, int line) {
  if (s != FMKV_OK) throw Failure(std::string(what) + " (line " + std::to_string(line) + ") failed: status " +
                                  std::to_string((int)s) + ": " + fmkv_last_error());
}
#define CK(x) ck((x), #x, __LINE__)

void report(bool ok, const std::string& name, const std::string& detail) {
  (ok ? g_passed : g_failed)++;
  printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  fflush(stdout);
}

// ---- fp16 helpers (host) ----
uint16_t f32_to_f16(float f) {  // round to nearest even; inputs here are small normals
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  int e = (int)(ax >> 23) - 127;
  if (e < -14) return (uint16_t)sign;  // flush tiny values (test data only)
  if (e > 15) return (uint16_t)(sign | 0x7bffu);
  uint32_t r = ((uint32_t)(e + 15) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

// ---- device memory through the C API ----
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : n(bytes) {
    p = fmkv_device_alloc(g_be, std::max<size_t>(bytes, 16));
    if (!p) throw Failure("fmkv_device_alloc(" + std::to_string(bytes) + ") failed: " + fmkv_last_error());
  }
  ~DevBuf() {
    if (p) fmkv_device_free(g_be, p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void up(const void* src, size_t bytes) {
    if (bytes > n) throw Failure("upload larger than buffer");
    if (bytes) CK(fmkv_device_copy(g_be, p, src, bytes, 1));
  }
  template <typename T> void up(const std::vector<T>& v) { up(v.data(), v.size() * sizeof(T)); }
  template <typename T> std::vector<T> down(size_t count) const {
    std::vector<T> v(count);
    if (count) CK(fmkv_device_copy(g_be, v.data(), p, count * sizeof(T), 0));
    return v;
  }
};
template <typename T> std::unique_ptr<DevBuf> dev_of(const std::vector<T>& v) {
  auto b = std::make_unique<DevBuf>(v.size() * sizeof(T));
  b->up(v);
  return b;
}

// Token data of every sequence and layer: f16 [len][H][d].
struct Model {
  fmkv_config cfg;
  int32_t layers;
  std::vector<int64_t> lens;
  std::vector<std::vector<std::vector<uint16_t>>> k, v;  // [seq][layer]
  Model(const fmkv_config& c, int32_t nl, std::vector<int64_t> l) : cfg(c), layers(nl), lens(std::move(l)) {
    std::normal_distribution<float> nd;
    const size_t row = (size_t)c.num_kv_heads * c.head_dim;
    for (int64_t len : lens) {
      k.emplace_back();
      v.emplace_back();
      for (int32_t i = 0; i < nl; ++i) {
        std::vector<float> chan(c.head_dim);
        for (auto& x : chan) x = 1.0f + 2.0f * std::fabs(nd(g_rng));  // outlier channels in K
        std::vector<uint16_t> kk((size_t)len * row), vv((size_t)len * row);
        for (size_t e = 0; e < kk.size(); ++e) kk[e] = f32_to_f16(nd(g_rng) * chan[e % c.head_dim]);
        for (auto& x : vv) x = f32_to_f16(nd(g_rng));
        k.back().push_back(std::move(kk));
        v.back().push_back(std::move(vv));
      }
    }
  }
  size_t row() const { return (size_t)cfg.num_kv_heads * cfg.head_dim; }
};

// A cache in device memory: per layer a page pool and fp16 regions; host block table / slots /
// lengths (uploaded per call).
struct DevCache {
  fmkv_config cfg;
  int32_t nl = 0, nseq = 0, layer_base = 0;
  int64_t pages = 0, pb = 0, stride = 0;
  size_t slot_elems = 0;  // uint16 elements of one slot's K (or V) fp16 region
  std::vector<std::unique_ptr<DevBuf>> pool, fk, fv;
  std::vector<int32_t> table, slots;  // table [nseq][stride]
  std::vector<int64_t> len;           // tokens per sequence (all layers)

  fmkv_layer_cache layer(int32_t l) const {
    return fmkv_layer_cache{(uint8_t*)pool[l]->p, pages, (uint16_t*)fk[l]->p, (uint16_t*)fv[l]->p, nseq, layer_base + l};
  }
  // Appends tokens [len[s], to[s]) of every sequence, in random chunks (several sequences per call).
  void feed(const Model& m, const std::vector<int64_t>& to) {
    for (;;) {
      std::vector<int64_t> rows(nseq, 0);
      int64_t total = 0;
      for (int32_t s = 0; s < nseq; ++s) {
        const int64_t left = to[s] - len[s];
        if (left > 0 && g_rng() % 4 != 0) rows[s] = std::min<int64_t>(left, 1 + (int64_t)(g_rng() % 40));
        total += rows[s];
      }
      bool done = true;
      for (int32_t s = 0; s < nseq; ++s) done = done && len[s] == to[s];
      if (done) return;
      if (total == 0) continue;
      std::vector<int64_t> offs(1, 0);
      for (auto r : rows) offs.push_back(offs.back() + r);
      auto dlen = dev_of(len), doff = dev_of(offs);
      auto dtab = dev_of(table), dslot = dev_of(slots);
      for (int32_t l = 0; l < nl; ++l) {
        std::vector<uint16_t> kb((size_t)total * m.row()), vb((size_t)total * m.row());
        for (int32_t s = 0; s < nseq; ++s)
          if (rows[s]) {
            const size_t src = (size_t)len[s] * m.row(), dst = (size_t)offs[s] * m.row(), n = (size_t)rows[s] * m.row();
            std::memcpy(&kb[dst], &m.k[s][l][src], n * 2);
            std::memcpy(&vb[dst], &m.v[s][l][src], n * 2);
          }
        auto dk = dev_of(kb), dv = dev_of(vb);
        fmkv_tensor kt{dk->p, FMKV_F16, total, cfg.num_kv_heads, cfg.head_dim, (int64_t)m.row(), cfg.head_dim};
        fmkv_tensor vt{dv->p, FMKV_F16, total, cfg.num_kv_heads, cfg.head_dim, (int64_t)m.row(), cfg.head_dim};
        fmkv_batch bt{nseq, (int32_t*)dslot->p, (int64_t*)dlen->p, (int64_t*)doff->p, (int32_t*)dtab->p, stride};
        fmkv_layer_cache lc = layer(l);
        CK(fmkv_append(g_be, &cfg, &lc, &bt, &kt, &vt, nullptr));
        CK(fmkv_device_synchronize(g_be));
      }
      for (int32_t s = 0; s < nseq; ++s) len[s] += rows[s];
    }
  }
};

int64_t pages_needed(const fmkv_config& c, int64_t len) {
  const int64_t e = std::max<int64_t>(c.sink_tokens, len - c.window_tokens);
  return (e - c.sink_tokens + c.page_size - 1) / c.page_size;
}

// Fresh device cache for the model's sequences, holding the first n[s] tokens of each.
std::unique_ptr<DevCache> build(const Model& m, const std::vector<int64_t>& n, int32_t layer_base) {
  auto c = std::make_unique<DevCache>();
  c->cfg = m.cfg;
  c->nl = m.layers;
  c->nseq = (int32_t)m.lens.size();
  c->layer_base = layer_base;
  int64_t per = 0;
  for (int64_t L : m.lens) per = std::max(per, pages_needed(m.cfg, L));
  c->stride = per + 1;
  c->pages = c->stride * c->nseq + 3;
  c->pb = fmkv_config_page_bytes(&m.cfg);
  c->slot_elems = (size_t)(fmkv_config_fp16_slot_bytes(&m.cfg) / 4);
  std::vector<int32_t> perm((size_t)c->pages);
  for (int64_t i = 0; i < c->pages; ++i) perm[(size_t)i] = (int32_t)i;
  std::shuffle(perm.begin(), perm.end(), g_rng);
  c->table.assign(perm.begin(), perm.begin() + c->stride * c->nseq);
  for (int32_t s = 0; s < c->nseq; ++s) c->slots.push_back(c->nseq - 1 - s);  // slot != index
  c->len.assign(c->nseq, 0);
  for (int32_t l = 0; l < c->nl; ++l) {
    std::vector<uint8_t> img((size_t)(c->pages * c->pb));
    for (auto& b : img) b = (uint8_t)g_rng();  // unowned pages: garbage
    for (int32_t p : c->table) std::memset(&img[(size_t)(p * c->pb)], 0, (size_t)c->pb);
    c->pool.push_back(dev_of(img));
    std::vector<uint16_t> z(c->slot_elems * c->nseq, 0);
    c->fk.push_back(dev_of(z));
    c->fv.push_back(dev_of(z));
  }
  c->feed(m, n);
  return c;
}

// Host image of a device cache (what fmkv_save reads).
struct HostImage {
  std::vector<std::vector<uint8_t>> pool;
  std::vector<std::vector<uint16_t>> fk, fv;
};
HostImage download(const DevCache& c) {
  HostImage h;
  for (int32_t l = 0; l < c.nl; ++l) {
    h.pool.push_back(c.pool[l]->down<uint8_t>((size_t)(c.pages * c.pb)));
    h.fk.push_back(c.fk[l]->down<uint16_t>(c.slot_elems * c.nseq));
    h.fv.push_back(c.fv[l]->down<uint16_t>(c.slot_elems * c.nseq));
  }
  return h;
}

std::vector<fmkv_layer_cache> host_layers(const DevCache& c, HostImage& h) {
  std::vector<fmkv_layer_cache> v;
  for (int32_t l = 0; l < c.nl; ++l)
    v.push_back(fmkv_layer_cache{h.pool[l].data(), c.pages, c.slot_elems ? h.fk[l].data() : nullptr,
                                 c.slot_elems ? h.fv[l].data() : nullptr, c.nseq, c.layer_base + l});
  return v;
}
std::vector<fmkv_save_sequence> save_seqs(const DevCache& c, const std::vector<int64_t>& n) {
  std::vector<fmkv_save_sequence> v;
  for (int32_t s = 0; s < c.nseq; ++s)
    v.push_back(fmkv_save_sequence{c.slots[s], c.len[s], nullptr, n.empty() ? -1 : n[s], &c.table[(size_t)s * c.stride],
                                   c.stride});
  return v;
}
std::vector<uint8_t> save_memory(const DevCache& c, const std::vector<int64_t>& n) {
  HostImage h = download(c);
  auto layers = host_layers(c, h);
  auto seqs = save_seqs(c, n);
  void* data = nullptr;
  size_t size = 0;
  CK(fmkv_save_memory(&c.cfg, c.nl, layers.data(), c.nseq, seqs.data(), 0, &data, &size));
  std::vector<uint8_t> out((const uint8_t*)data, (const uint8_t*)data + size);
  fmkv_buffer_free(data);
  return out;
}
std::vector<uint8_t> read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A loaded snapshot uploaded into fresh device buffers, as a DevCache (block table = the
// snapshot's, padded rows with -1 replaced by extra pages when asked).
std::unique_ptr<DevCache> upload(fmkv_snapshot* snap) {
  fmkv_snapshot_info info;
  CK(fmkv_snapshot_get_info(snap, &info));
  auto c = std::make_unique<DevCache>();
  c->cfg = info.config;
  c->nl = info.num_layers;
  c->nseq = info.num_seqs;
  c->pages = info.num_pages;
  c->pb = fmkv_config_page_bytes(&info.config);
  c->slot_elems = (size_t)(fmkv_config_fp16_slot_bytes(&info.config) / 4);
  const int64_t *lens = nullptr;
  const int32_t *slots = nullptr, *table = nullptr;
  int64_t stride = 0;
  CK(fmkv_snapshot_batch(snap, &lens, &slots, &table, &stride));
  c->len.assign(lens, lens + c->nseq);
  c->slots.assign(slots, slots + c->nseq);
  c->stride = std::max<int64_t>(1, stride);
  c->table.assign((size_t)(c->stride * c->nseq), -1);
  for (int32_t s = 0; s < c->nseq; ++s)
    for (int64_t j = 0; j < stride; ++j) c->table[(size_t)(s * c->stride + j)] = table[s * stride + j];
  for (int32_t l = 0; l < c->nl; ++l) {
    fmkv_layer_cache lc;
    CK(fmkv_snapshot_layer(snap, l, &lc));
    if (l == 0) c->layer_base = lc.layer;
    if (lc.layer != c->layer_base + l) throw Failure("snapshot layer index not preserved");
    if (lc.num_pages != c->pages || lc.num_slots != c->nseq) throw Failure("snapshot layer geometry");
    c->pool.push_back(std::make_unique<DevBuf>((size_t)(c->pages * c->pb)));
    c->pool.back()->up(lc.pages, (size_t)(c->pages * c->pb));
    const size_t fe = c->slot_elems * c->nseq;
    c->fk.push_back(std::make_unique<DevBuf>(fe * 2));
    c->fv.push_back(std::make_unique<DevBuf>(fe * 2));
    if (fe) {
      c->fk.back()->up(lc.fp16_k, fe * 2);
      c->fv.back()->up(lc.fp16_v, fe * 2);
    }
  }
  return c;
}
// Gives every sequence of a loaded cache room to grow: a wider block table whose new entries
// are the extra pages [first_free, ...).
void extend_table(DevCache& c, int64_t new_stride, int64_t first_free) {
  std::vector<int32_t> t((size_t)(new_stride * c.nseq), -1);
  int64_t next = first_free;
  for (int32_t s = 0; s < c.nseq; ++s)
    for (int64_t j = 0; j < new_stride; ++j) {
      int32_t e = j < c.stride ? c.table[(size_t)(s * c.stride + j)] : -1;
      t[(size_t)(s * new_stride + j)] = e >= 0 ? e : (int32_t)(next++);
    }
  if (next > c.pages) throw Failure("not enough extra pages");
  c.table = t;
  c.stride = new_stride;
}

// One query row per sequence at its last position (plus a few earlier rows for the longest:
// causal multi-row decode). Queries are the same for every cache compared.
struct Queries {
  std::vector<int64_t> rows;
  std::vector<float> q;
  int32_t heads;
};
Queries make_queries(const fmkv_config& c, const std::vector<int64_t>& lens, uint64_t seed) {
  Queries Q;
  Q.heads = c.num_kv_heads * 2;
  std::mt19937_64 r(seed);
  std::normal_distribution<float> nd;
  for (size_t s = 0; s < lens.size(); ++s) Q.rows.push_back(std::min<int64_t>(lens[s], s == 0 ? 3 : 1));
  int64_t total = 0;
  for (auto x : Q.rows) total += x;
  Q.q.resize((size_t)total * Q.heads * c.head_dim);
  for (auto& x : Q.q) x = nd(r);
  return Q;
}
std::vector<float> attend_on(fmkv_backend be, const fmkv_config& cfg, const fmkv_layer_cache& lc,
                             const std::vector<int32_t>& slots, const std::vector<int64_t>& lens,
                             const std::vector<int32_t>& table, int64_t stride, const Queries& Q) {
  const int32_t nseq = (int32_t)lens.size();
  std::vector<int64_t> offs(1, 0);
  for (auto r : Q.rows) offs.push_back(offs.back() + r);
  const int64_t rows = offs.back();
  std::vector<float> out(Q.q.size(), NAN);
  if (be == FMKV_BACKEND_REF) {  // host arrays
    fmkv_tensor qt{(void*)Q.q.data(), FMKV_F32, rows, Q.heads, cfg.head_dim, (int64_t)Q.heads * cfg.head_dim, cfg.head_dim};
    fmkv_tensor ot{out.data(), FMKV_F32, rows, Q.heads, cfg.head_dim, (int64_t)Q.heads * cfg.head_dim, cfg.head_dim};
    fmkv_batch bt{nseq, slots.data(), lens.data(), offs.data(), table.data(), stride};
    fmkv_attention_opts o{0.0f, 0.0f, 0};
    CK(fmkv_attention(FMKV_BACKEND_REF, &cfg, &lc, &bt, &qt, &o, &ot, nullptr, 0, nullptr));
    return out;
  }
  auto dq = dev_of(Q.q), dout = dev_of(out), dlen = dev_of(lens), doff = dev_of(offs), dslot = dev_of(slots),
       dtab = dev_of(table);
  int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const int64_t ws = fmkv_attention_workspace_bytes(g_be, &cfg, Q.heads, rows, nseq, max_len);
  if (ws < 0) throw Failure(std::string("fmkv_attention_workspace_bytes: ") + fmkv_last_error());
  DevBuf work((size_t)ws);
  fmkv_tensor qt{dq->p, FMKV_F32, rows, Q.heads, cfg.head_dim, (int64_t)Q.heads * cfg.head_dim, cfg.head_dim};
  fmkv_tensor ot{dout->p, FMKV_F32, rows, Q.heads, cfg.head_dim, (int64_t)Q.heads * cfg.head_dim, cfg.head_dim};
  fmkv_batch bt{nseq, (int32_t*)dslot->p, (int64_t*)dlen->p, (int64_t*)doff->p, (int32_t*)dtab->p, stride};
  fmkv_attention_opts o{0.0f, 0.0f, 0};
  CK(fmkv_attention(g_be, &cfg, &lc, &bt, &qt, &o, &ot, work.p, (size_t)ws, nullptr));
  CK(fmkv_device_synchronize(g_be));
  return dout->down<float>(out.size());
}
std::vector<float> attend(const DevCache& c, int32_t l, const Queries& Q) {
  return attend_on(g_be, c.cfg, c.layer(l), c.slots, c.len, c.table, c.stride, Q);
}
using fmkv::test::rel_error;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Pages of every sequence (its first pages_needed entries) and its valid fp16 entries, a vs b.
std::string compare_state(const DevCache& a, const DevCache& b) {
  const HostImage ha = download(a), hb = download(b);
  const fmkv_config& c = a.cfg;
  const int64_t S = c.sink_tokens, W = c.window_tokens, H = c.num_kv_heads, d = c.head_dim;
  for (int32_t l = 0; l < a.nl; ++l)
    for (int32_t s = 0; s < a.nseq; ++s) {
      if (a.len[s] != b.len[s]) return "sequence " + std::to_string(s) + " length differs";
      for (int64_t j = 0; j < pages_needed(c, a.len[s]); ++j) {
        const int32_t pa = a.table[(size_t)(s * a.stride + j)], pb = b.table[(size_t)(s * b.stride + j)];
        if (pa < 0 || pb < 0) return "missing block table entry";
        if (std::memcmp(&ha.pool[l][(size_t)(pa * a.pb)], &hb.pool[l][(size_t)(pb * b.pb)], (size_t)a.pb) != 0)
          return "layer " + std::to_string(l) + " sequence " + std::to_string(s) + " page " + std::to_string(j) +
                 " bytes differ";
      }
      const int64_t e = std::max<int64_t>(S, a.len[s] - W);
      for (int64_t p = 0; p < a.len[s]; ++p) {
        if (p >= S && p < e) continue;
        const int64_t ring = p < S ? p : S + (p - S) % W;
        for (int64_t h = 0; h < H; ++h) {
          const size_t oa = (size_t)(((a.slots[s] * H + h) * (S + W) + ring) * d),
                       ob = (size_t)(((b.slots[s] * H + h) * (S + W) + ring) * d);
          if (std::memcmp(&ha.fk[l][oa], &hb.fk[l][ob], (size_t)d * 2) != 0 ||
              std::memcmp(&ha.fv[l][oa], &hb.fv[l][ob], (size_t)d * 2) != 0)
            return "layer " + std::to_string(l) + " sequence " + std::to_string(s) + " fp16 entry of token " +
                   std::to_string(p) + " differs";
        }
      }
    }
  return "";
}

std::string tmpdir() {
  char t[] = "/tmp/fmkv_io_cuda_XXXXXX";
  const char* d = mkdtemp(t);
  if (!d) throw Failure("mkdtemp failed");
  return d;
}

std::string cfg_name(const fmkv_config& c, int32_t nl, const std::vector<int64_t>& lens) {
  char b[200];
  std::string ls;
  for (auto x : lens) ls += (ls.empty() ? "" : ",") + std::to_string(x);
  snprintf(b, sizeof b, "d%d H%d k%dv%d P%d S%d W%d %s, %d layers, lens {%s}", c.head_dim, c.num_kv_heads, c.k_bits,
           c.v_bits, c.page_size, c.sink_tokens, c.window_tokens, c.scale_rule == FMKV_SCALE_RMS ? "rms" : "lsq", nl,
           ls.c_str());
  return b;
}

void run_case(const fmkv_config& cfg, int32_t nl, const std::vector<int64_t>& lens, const std::string& dir, int idx) {
  const std::string name = cfg_name(cfg, nl, lens);
  auto guarded = [&](const std::string& what, const std::function<std::string()>& f) {
    std::string err;
    try {
      err = f();
    } catch (const std::exception& e) {
      err = std::string("exception: ") + e.what();
    }
    report(err.empty() || err.rfind("ok:", 0) == 0, what + " [" + name + "]", err);
  };
  std::unique_ptr<Model> m;
  std::unique_ptr<DevCache> src;
  const std::string path = dir + "/snap" + std::to_string(idx) + ".fmkv";
  guarded("build on device + save", [&]() -> std::string {
    m = std::make_unique<Model>(cfg, nl, lens);
    src = build(*m, lens, (int32_t)(g_rng() % 30));
    HostImage h = download(*src);
    auto layers = host_layers(*src, h);
    auto seqs = save_seqs(*src, {});
    CK(fmkv_save(path.c_str(), &cfg, nl, layers.data(), src->nseq, seqs.data(), FMKV_SAVE_NO_FSYNC));
    const auto file = read_file(path);
    if (file.empty()) return "empty file";
    if (file != save_memory(*src, {})) return "fmkv_save file differs from fmkv_save_memory bytes";
    return "ok: " + std::to_string(file.size()) + " bytes";
  });
  if (!src) return;
  const Queries Q = make_queries(cfg, lens, g_rng());
  std::vector<std::vector<float>> orig(nl);
  for (int32_t l = 0; l < nl; ++l) orig[l] = attend(*src, l, Q);

  for (int mode : {FMKV_LOAD_COPY, FMKV_LOAD_MMAP}) {
    const char* mname = mode == FMKV_LOAD_COPY ? "copy" : "mmap";
    guarded(std::string("load (") + mname + ") + upload: pages/fp16 identical, CUDA attention bitwise equal", [&]() -> std::string {
      fmkv_load_options o;
      fmkv_load_options_default(&o);
      o.mode = mode;
      o.expect_config = &cfg;
      o.expect_num_layers = nl;
      fmkv_snapshot* snap = nullptr;
      CK(fmkv_load(path.c_str(), &o, &snap));
      std::unique_ptr<fmkv_snapshot, void (*)(fmkv_snapshot*)> guard(snap, fmkv_snapshot_free);
      fmkv_snapshot_info info;
      CK(fmkv_snapshot_get_info(snap, &info));
      auto dst = upload(snap);
      if (dst->layer_base != src->layer_base) return "layer index differs";
      std::string e = compare_state(*src, *dst);
      if (!e.empty()) return e;
      double worst_ref = 0;
      for (int32_t l = 0; l < nl; ++l) {
        auto got = attend(*dst, l, Q);
        if (!same_bits(got, orig[l])) return "attention over loaded layer " + std::to_string(l) + " differs (rel " +
                                             std::to_string(rel_error(got, orig[l])) + ")";
        // Reference backend over the loaded host snapshot: within the CUDA bound (f32 out: 4e-3).
        fmkv_layer_cache hl;
        CK(fmkv_snapshot_layer(snap, l, &hl));
        auto ref = attend_on(FMKV_BACKEND_REF, info.config, hl, dst->slots, dst->len, dst->table, dst->stride, Q);
        worst_ref = std::max(worst_ref, rel_error(got, ref));
      }
      const double bound = g_be == FMKV_BACKEND_REF ? 0.0 : 4e-3;
      char b[160];
      snprintf(b, sizeof b, "ok: mapped=%d, file_pages=%lld, rel error vs ref backend %.3g (bound %.0e)", info.mapped,
               (long long)info.file_pages, worst_ref, bound);
      if (worst_ref > bound) return std::string("too far from reference: ") + (b + 4);
      return b;
    });
  }

  guarded("prefix save == cache that only saw the prefix; continue on device == full cache", [&]() -> std::string {
    std::vector<int64_t> n;
    const int64_t S = cfg.sink_tokens, W = cfg.window_tokens;
    for (int64_t L : lens) {
      int64_t x;
      if (W == 0 || L - W <= S) x = 1 + (int64_t)(g_rng() % (uint64_t)L);  // every prefix is exact
      else x = S == 0 || g_rng() % 3 == 0 ? L : 1 + (int64_t)(g_rng() % (uint64_t)S);  // exact: N <= S or N = L
      n.push_back(std::min(x, L));
    }
    const std::string ppath = path + ".prefix";
    {
      HostImage h = download(*src);
      auto layers = host_layers(*src, h);
      auto seqs = save_seqs(*src, n);
      CK(fmkv_save(ppath.c_str(), &cfg, nl, layers.data(), src->nseq, seqs.data(), FMKV_SAVE_NO_FSYNC));
    }
    auto shorter = build(*m, n, src->layer_base);
    if (read_file(ppath) != save_memory(*shorter, {})) return "prefix file differs from the save of a cache built with the prefix only";
    fmkv_load_options o;
    fmkv_load_options_default(&o);
    o.mode = FMKV_LOAD_MMAP;
    int64_t need = 1;
    for (int64_t L : lens) need = std::max(need, pages_needed(cfg, L));
    o.extra_pages = (need + 1) * (int64_t)lens.size();  // enough for extend_table below
    fmkv_snapshot* snap = nullptr;
    CK(fmkv_load(ppath.c_str(), &o, &snap));
    std::unique_ptr<fmkv_snapshot, void (*)(fmkv_snapshot*)> guard(snap, fmkv_snapshot_free);
    fmkv_snapshot_info info;
    CK(fmkv_snapshot_get_info(snap, &info));
    if (info.flags != 0) return "prefix snapshot flagged as dequantized";
    auto dst = upload(snap);
    for (int32_t s = 0; s < dst->nseq; ++s)
      if (dst->len[s] != n[s]) return "loaded prefix length differs";
    std::string e = compare_state(*shorter, *dst);
    if (!e.empty()) return "prefix vs shorter cache: " + e;
    const Queries QP = make_queries(cfg, n, g_rng());
    for (int32_t l = 0; l < nl; ++l)
      if (!same_bits(attend(*dst, l, QP), attend(*shorter, l, QP)))
        return "attention over loaded prefix (layer " + std::to_string(l) + ") differs from the shorter cache";
    // Continue the loaded prefix on the device with the rest of every sequence.
    extend_table(*dst, need + 1, info.file_pages);
    dst->feed(*m, lens);
    e = compare_state(*src, *dst);
    if (!e.empty()) return "continued prefix vs full cache: " + e;
    for (int32_t l = 0; l < nl; ++l)
      if (!same_bits(attend(*dst, l, Q), orig[l]))
        return "attention after continuing the prefix (layer " + std::to_string(l) + ") differs from the full cache";
    std::string ns;
    for (auto x : n) ns += (ns.empty() ? "" : ",") + std::to_string(x);
    return "ok: prefix {" + ns + "}, mapped=" + std::to_string(info.mapped);
  });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "ref") g_be = FMKV_BACKEND_REF;
  const char* seed_env = std::getenv("FMKV_IO_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                                 : (uint64_t)std::chrono::system_clock::now().time_since_epoch().count() % 1000000007ull;
  g_rng.seed(seed);
  printf("snapshot save/load through the %s backend, FMKV_IO_SEED=%llu\n", fmkv_backend_name(g_be),
         (unsigned long long)seed);
  if (!fmkv_backend_available(g_be)) {
    printf("FAIL backend %s not available: %s\n0 passed, 1 failed\n", fmkv_backend_name(g_be), fmkv_last_error());
    return 1;
  }
  printf("device: %s\n", fmkv_backend_device(g_be));
  const std::string dir = tmpdir();
  auto mk = [](int d, int H, int kb, int vb, int P, int S, int W, int rule) {
    fmkv_config c;
    fmkv_config_default(&c);
    c.head_dim = d;
    c.num_kv_heads = H;
    c.k_bits = kb;
    c.v_bits = vb;
    c.page_size = P;
    c.sink_tokens = S;
    c.window_tokens = W;
    c.scale_rule = rule;
    c.seed = g_rng();
    return c;
  };
  int idx = 0;
  run_case(mk(128, 2, 3, 3, 16, 4, 16, FMKV_SCALE_LSQ), 2, {170, 61, 9}, dir, idx++);
  run_case(mk(64, 4, 2, 4, 32, 0, 0, FMKV_SCALE_RMS), 3, {300, 33, 1}, dir, idx++);
  run_case(mk(256, 1, 16, 2, 64, 2, 8, FMKV_SCALE_LSQ), 2, {140, 77}, dir, idx++);
  run_case(mk(128, 8, 4, 3, 64, 0, 32, FMKV_SCALE_LSQ), 2, {1000, 257, 40, 2}, dir, idx++);
  // Clean up the snapshot files.
  for (int i = 0; i < idx; ++i) {
    std::string p = dir + "/snap" + std::to_string(i) + ".fmkv";
    unlink(p.c_str());
    unlink((p + ".prefix").c_str());
  }
  rmdir(dir.c_str());
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

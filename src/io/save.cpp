// Snapshot writer (docs/FILE-FORMAT.md): validates the source cache, then streams the canonical
// layout into a sink (memory buffer or a temporary file renamed into place).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../core/config.h"
#include "../core/ops.h"
#include "../format/codebook.h"
#include "../format/numbers.h"
#include "../format/pack.h"
#include "../format/rotation.h"
#include "crc32c.h"
#include "error.h"
#include "fmkv/io.h"
#include "layout.h"

namespace fmkv::io {
namespace {

std::string S(int64_t v) { return std::to_string(v); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What gets written for one sequence.
struct SeqPlan {
  int32_t slot = 0;
  int64_t n = 0;            // tokens saved
  int64_t comp = 0;         // compressed tokens [S, S + comp)
  int64_t pages = 0;        // ceil(comp / P)
  int64_t first = 0;        // first block-table entry
  int64_t win_begin = 0;    // E_N: window tokens [win_begin, n)
  int32_t dequantized = 0;  // max over layers of window tokens restored from codes
  std::vector<int64_t> layer_len;
  const int32_t* table = nullptr;
};

struct Plan {
  fmkv_config cfg;
  int32_t num_layers = 0;
  const fmkv_layer_cache* layers = nullptr;
  std::vector<SeqPlan> seqs;
  int64_t page_bytes = 0, fp16_seq_bytes = 0, pages_per_layer = 0;
  uint32_t flags = 0;
  Layout layout;
};

Plan make_plan(const fmkv_config* cfg, int32_t num_layers, const fmkv_layer_cache* layers, int32_t num_seqs,
               const fmkv_save_sequence* seqs, uint32_t flags) {
  if (!cfg || !layers || !seqs) fail(kInvalidArgument, "fmkv_save: NULL argument");
  if (flags & ~(FMKV_SAVE_ALLOW_DEQUANTIZED | FMKV_SAVE_NO_FSYNC))
    fail(kInvalidArgument, "fmkv_save: unknown flags " + std::to_string(flags & ~(FMKV_SAVE_ALLOW_DEQUANTIZED | FMKV_SAVE_NO_FSYNC)));
  validate_config(*cfg);
  if (num_layers < 1) fail(kInvalidArgument, "fmkv_save: num_layers is " + S(num_layers) + ", need >= 1");
  if (num_seqs < 1) fail(kInvalidArgument, "fmkv_save: num_seqs is " + S(num_seqs) + ", need >= 1");
  Plan p;
  p.cfg = *cfg;
  p.num_layers = num_layers;
  p.layers = layers;
  const fmkv_config& c = *cfg;
  const int32_t S_ = c.sink_tokens, W = c.window_tokens, P = c.page_size;
  p.page_bytes = page_bytes(c);
  p.fp16_seq_bytes = 2LL * c.num_kv_heads * fp16_slots(c) * c.head_dim;
  for (int32_t l = 0; l < num_layers; ++l) {
    try {
      validate_layer(c, layers[l]);
    } catch (const Error& e) {
      fail(e.code(), "fmkv_save: layer " + S(l) + ": " + e.what());
    }
    if (layers[l].layer < 0) fail(kInvalidArgument, "fmkv_save: layer " + S(l) + " has negative layer index");
  }
  int64_t total = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const fmkv_save_sequence& s = seqs[i];
    const std::string q = "fmkv_save: sequence " + S(i) + ": ";
    SeqPlan sp;
    sp.slot = s.slot;
    sp.table = s.block_table;
    int64_t min_len = INT64_MAX;
    for (int32_t l = 0; l < num_layers; ++l) {
      int64_t len = s.layer_lens ? s.layer_lens[l] : s.seq_len;
      if (len < 0) fail(kInvalidArgument, q + "negative length " + S(len) + " in layer " + S(l));
      sp.layer_len.push_back(len);
      min_len = std::min(min_len, len);
    }
    sp.n = s.num_tokens < 0 ? min_len : s.num_tokens;
    if (sp.n > min_len)
      fail(kOutOfRange, q + "num_tokens " + S(sp.n) + " exceeds the " + S(min_len) + " tokens cached" +
                            (s.layer_lens ? " in its shortest layer" : ""));
    if (fp16_slots(c) > 0)
      for (int32_t l = 0; l < num_layers; ++l)
        if (s.slot < 0 || s.slot >= layers[l].num_slots)
          fail(kOutOfRange, q + "slot " + S(s.slot) + " outside [0, " + S(layers[l].num_slots) + ") of layer " + S(l));
    sp.comp = std::max<int64_t>(0, sp.n - S_ - W);
    sp.pages = ceil_div(sp.comp, P);
    sp.win_begin = compressed_end(c, sp.n);
    // Pages read: the saved compressed tokens, plus the codes of window tokens the source has
    // already compressed (only with FMKV_SAVE_ALLOW_DEQUANTIZED).
    int64_t read_pages = sp.pages;
    for (int32_t l = 0; l < num_layers; ++l) {
      int64_t e_src = compressed_end(c, sp.layer_len[l]);
      int64_t dq = std::max<int64_t>(0, std::min(sp.n, e_src) - sp.win_begin);
      if (dq > 0 && !(flags & FMKV_SAVE_ALLOW_DEQUANTIZED))
        fail(kUnsupported,
             q + "a " + S(sp.n) + "-token prefix keeps tokens [" + S(sp.win_begin) + ", " + S(sp.n) +
                 ") in its fp16 window, but layer " + S(l) + " (" + S(sp.layer_len[l]) + " tokens) has already compressed [" +
                 S(sp.win_begin) + ", " + S(sp.win_begin + dq) + "). Exact prefixes with a " + S(W) +
                 "-token window: num_tokens <= sink_tokens (" + S(S_) + ") or the whole sequence; "
                 "pass FMKV_SAVE_ALLOW_DEQUANTIZED to restore those tokens from their codes");
      sp.dequantized = (int32_t)std::max<int64_t>(sp.dequantized, dq);
      if (dq > 0) read_pages = std::max(read_pages, ceil_div(sp.win_begin + dq - S_, P));
    }
    if (read_pages > 0) {
      if (!s.block_table) fail(kInvalidArgument, q + "block_table is NULL");
      if (s.block_table_len < read_pages)
        fail(kOutOfRange, q + "needs " + S(read_pages) + " pages but block_table_len is " + S(s.block_table_len));
      for (int64_t j = 0; j < read_pages; ++j)
        for (int32_t l = 0; l < num_layers; ++l)
          if (s.block_table[j] < 0 || s.block_table[j] >= layers[l].num_pages)
            fail(kOutOfRange, q + "block_table[" + S(j) + "] = " + S(s.block_table[j]) + " outside [0, " +
                                  S(layers[l].num_pages) + ") of layer " + S(l));
    }
    sp.first = total;
    total += sp.pages;
    if (sp.dequantized > 0) p.flags |= 1u;
    p.seqs.push_back(std::move(sp));
  }
  if (total > INT32_MAX) fail(kOverflow, "fmkv_save: more pages than a 32-bit block table can address");
  p.pages_per_layer = total;
  std::string why;
  if (!canonical_layout(num_layers, num_seqs, total, p.page_bytes, p.fp16_seq_bytes, UINT64_MAX, &p.layout, &why))
    fail(kOverflow, "fmkv_save: " + why);
  return p;
}

// Sequential writer with CRC of the current section.
struct Sink {
  virtual ~Sink() = default;
  virtual void write(const void* d, size_t n) = 0;
  virtual void patch(uint64_t off, const void* d, size_t n) = 0;
  uint64_t pos = 0;
  uint32_t crc = 0;
  void put(const void* d, size_t n) {
    crc = crc32c(d, n, crc);
    write(d, n);
    pos += n;
  }
  void pad_to(uint64_t off) {
    static const uint8_t zeros[4096] = {};
    while (pos < off) {
      size_t n = (size_t)std::min<uint64_t>(off - pos, sizeof zeros);
      write(zeros, n);
      pos += n;
    }
  }
};

struct MemSink : Sink {
  uint8_t* buf;
  explicit MemSink(uint8_t* b) : buf(b) {}
  void write(const void* d, size_t n) override { std::memcpy(buf + pos, d, n); }
  void patch(uint64_t off, const void* d, size_t n) override { std::memcpy(buf + off, d, n); }
};

struct FileSink : Sink {
  int fd;
  std::string path;
  explicit FileSink(int f, std::string p) : fd(f), path(std::move(p)) {}
  void write(const void* d, size_t n) override { pwrite_all(pos, d, n); }
  void patch(uint64_t off, const void* d, size_t n) override { pwrite_all(off, d, n); }
  void pwrite_all(uint64_t off, const void* d, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(d);
    while (n > 0) {
      ssize_t w = ::pwrite(fd, p, n, (off_t)off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail(kInvalidArgument, "fmkv_save: writing " + path + " failed: " + std::strerror(errno));
      p += w;
      n -= (size_t)w;
      off += (uint64_t)w;
    }
  }
};

// Zero token slots [from, P) of every section of a page (the unused tail of a prefix's last page).
void zero_tail(const fmkv_config& c, uint8_t* page, int32_t from) {
  const int32_t P = c.page_size, d = c.head_dim, G = fmkv_groups(d);
  for (int32_t h = 0; h < c.num_kv_heads; ++h)
    for (int is_v = 0; is_v < 2; ++is_v) {
      const int32_t bits = is_v ? c.v_bits : c.k_bits;
      uint8_t* sec = page + section_offset(c, h, is_v);
      if (bits == FMKV_FP16_BITS) {
        std::memset(sec + (size_t)from * d * 2, 0, (size_t)(P - from) * d * 2);
        continue;
      }
      for (int32_t g = 0; g < G; ++g) {
        if (fmkv_tiled_codes(c.format_version, bits)) {  // tile blocks: the slots' codes, bit by bit
          for (int32_t t = from; t < P; ++t)
            for (int32_t j = 0; j < FMKV_GROUP_SIZE; ++j)
              tile_put_code(sec + fmkv_tile_block_offset(d, t), G, is_v, t & 15, g, j, 0);
        } else {
          for (int32_t w = 0; w < bits; ++w)
            std::memset(sec + 4 * fmkv_code_word_index(bits, P, g, w, from), 0, 4 * (size_t)(P - from));
        }
      }
      for (int32_t s = 0; s < fmkv_scales_per_vector(d, c.scale_group); ++s)
        std::memset(sec + fmkv_scales_offset(d, bits, P) + 2 * ((int64_t)s * P + from), 0, 2 * (size_t)(P - from));
    }
}

// fp16 rounding of a compressed token's dequantized (unrotated) head vector.
void dequantize_token(const fmkv_config& c, const uint8_t* page, int32_t h, int is_v, int32_t t,
                      const std::vector<uint64_t>& signs, uint16_t* out) {
  const int32_t P = c.page_size, d = c.head_dim, G = fmkv_groups(d);
  const int32_t bits = is_v ? c.v_bits : c.k_bits;
  const uint8_t* sec = page + section_offset(c, h, is_v);
  if (bits == FMKV_FP16_BITS) {
    std::memcpy(out, sec + (size_t)t * d * 2, (size_t)d * 2);
    return;
  }
  std::vector<double> y(d), x(d);
  const int32_t version = fmkv_resolved_format_version(c.format_version);
  const int table = codebook_table(version, bits, is_v);
  for (int32_t g = 0; g < G; ++g) {
    uint32_t words[FMKV_CODE_BITS_MAX];
    if (!fmkv_tiled_codes(version, bits))
      for (int32_t w = 0; w < bits; ++w) words[w] = rd32(sec + 4 * fmkv_code_word_index(bits, P, g, w, t));
    const int64_t s = g >> fmkv_scale_shift(c.scale_group);  // the code group's scale
    const double scale = (double)f16_to_f32(rd16(sec + fmkv_scales_offset(d, bits, P) + 2 * (s * P + t)));
    for (int32_t j = 0; j < FMKV_GROUP_SIZE; ++j) {
      const uint32_t code = fmkv_tiled_codes(version, bits)
                                ? tile_get_code(sec + fmkv_tile_block_offset(d, t), G, is_v, t & 15, g, j)
                                : unpack_code(words, 1, bits, j);
      y[(size_t)g * FMKV_GROUP_SIZE + j] = (double)decode_level_table(code, bits, table) * scale;
    }
  }
  unrotate_exact(y.data(), d, signs.data(), std::sqrt((double)d), x.data());
  for (int32_t i = 0; i < d; ++i) {
    float f = (float)std::max(-65504.0, std::min(65504.0, x[i]));
    out[i] = f32_to_f16(f);
  }
}

// The fp16 region ([H][S+W][d]) of one saved sequence in one layer, K or V.
void build_fp16(const Plan& p, const SeqPlan& sp, int32_t l, int is_v, std::vector<uint16_t>& out) {
  const fmkv_config& c = p.cfg;
  const int32_t H = c.num_kv_heads, d = c.head_dim, R = fp16_slots(c), S_ = c.sink_tokens;
  const fmkv_layer_cache& lc = p.layers[l];
  const uint16_t* src = is_v ? lc.fp16_v : lc.fp16_k;
  out.assign((size_t)H * R * d, 0);
  auto copy_slot = [&](int32_t r) {
    for (int32_t h = 0; h < H; ++h)
      std::memcpy(&out[((size_t)h * R + r) * d], src + (((size_t)sp.slot * H + h) * R + r) * d, (size_t)d * 2);
  };
  for (int64_t pos = 0; pos < std::min<int64_t>(S_, sp.n); ++pos) copy_slot((int32_t)pos);
  const int64_t e_src = compressed_end(c, sp.layer_len[l]);
  std::vector<uint64_t> signs;
  for (int64_t pos = sp.win_begin; pos < sp.n; ++pos) {
    const int32_t r = fp16_slot_of(c, pos);
    if (pos >= e_src) {
      copy_slot(r);
      continue;
    }
    if (signs.empty()) {
      signs.assign(FMKV_MAX_SIGN_WORDS, 0);
      rotation_sign_words(c.seed, lc.layer, d, signs.data());
    }
    const int64_t ci = pos - S_;
    const uint8_t* page = lc.pages + (size_t)sp.table[ci / c.page_size] * (size_t)p.page_bytes;
    for (int32_t h = 0; h < H; ++h)
      dequantize_token(c, page, h, is_v, (int32_t)(ci % c.page_size), signs, &out[((size_t)h * R + r) * d]);
  }
}

void write_snapshot(const Plan& p, Sink& sink) {
  const fmkv_config& c = p.cfg;
  const int32_t L = p.num_layers;
  std::vector<Section> secs = p.layout.sections;
  const size_t table_bytes = secs.size() * kSectionEntryBytes;
  sink.pad_to(kHeaderBytes + table_bytes);  // header and table are patched in at the end
  std::vector<uint8_t> page_buf((size_t)p.page_bytes);
  std::vector<uint16_t> region;
  for (Section& s : secs) {
    sink.pad_to(s.offset);
    sink.crc = 0;
    const int32_t l = (int32_t)s.layer;
    switch (s.kind) {
      case kSecLayers:
        for (int32_t i = 0; i < L; ++i) {
          uint8_t b[4];
          wr32(b, (uint32_t)p.layers[i].layer);
          sink.put(b, 4);
        }
        break;
      case kSecSequences:
        for (const SeqPlan& sp : p.seqs) {
          uint8_t r[kSequenceRecordBytes] = {};
          wr64(r, (uint64_t)sp.n);
          wr64(r + 8, (uint64_t)sp.pages);
          wr64(r + 16, (uint64_t)sp.first);
          wr32(r + 24, (uint32_t)sp.dequantized);
          sink.put(r, sizeof r);
        }
        break;
      case kSecBlockTable:
        for (int64_t i = 0; i < p.pages_per_layer; ++i) {
          uint8_t b[4];
          wr32(b, (uint32_t)i);
          sink.put(b, 4);
        }
        break;
      case kSecPages:
        for (const SeqPlan& sp : p.seqs)
          for (int64_t j = 0; j < sp.pages; ++j) {
            const uint8_t* src = p.layers[l].pages + (size_t)sp.table[j] * (size_t)p.page_bytes;
            const int64_t used = std::min<int64_t>(c.page_size, sp.comp - j * c.page_size);
            if (used == c.page_size) {
              sink.put(src, (size_t)p.page_bytes);
            } else {
              std::memcpy(page_buf.data(), src, page_buf.size());
              zero_tail(c, page_buf.data(), (int32_t)used);
              sink.put(page_buf.data(), page_buf.size());
            }
          }
        break;
      case kSecFp16K:
      case kSecFp16V:
        for (const SeqPlan& sp : p.seqs) {
          build_fp16(p, sp, l, s.kind == kSecFp16V, region);
          sink.put(region.data(), region.size() * 2);
        }
        break;
    }
    if (sink.pos != s.offset + s.size) fail(kInternal, "fmkv_save: section size mismatch (bug)");
    s.crc = sink.crc;
  }
  // Section table, then the header that covers it.
  std::vector<uint8_t> table(table_bytes, 0);
  for (size_t i = 0; i < secs.size(); ++i) {
    uint8_t* e = &table[i * kSectionEntryBytes];
    wr32(e, secs[i].kind);
    wr32(e + 4, secs[i].layer);
    wr64(e + 8, secs[i].offset);
    wr64(e + 16, secs[i].size);
    wr32(e + 24, secs[i].crc);
  }
  uint8_t h[kHeaderBytes] = {};
  std::memcpy(h, kMagic, 8);
  wr32(h + kOffFileVersion, FMKV_FILE_VERSION);
  wr32(h + kOffHeaderBytes, kHeaderBytes);
  wr32(h + kOffFormatVersion, (uint32_t)fmkv_resolved_format_version(c.format_version));
  wr32(h + kOffFlags, p.flags);
  wr32(h + kOffHeadDim, (uint32_t)c.head_dim);
  wr32(h + kOffKvHeads, (uint32_t)c.num_kv_heads);
  wr32(h + kOffKBits, (uint32_t)c.k_bits);
  wr32(h + kOffVBits, (uint32_t)c.v_bits);
  wr32(h + kOffPageSize, (uint32_t)c.page_size);
  wr32(h + kOffSink, (uint32_t)c.sink_tokens);
  wr32(h + kOffWindow, (uint32_t)c.window_tokens);
  wr32(h + kOffScaleRule, (uint32_t)c.scale_rule);
  const int32_t sg = fmkv_resolved_scale_group(c.scale_group);
  wr32(h + kOffScaleGroup, sg == FMKV_SCALE_GROUP ? 0u : (uint32_t)sg);  // 0: the default (FILE-FORMAT.md)
  wr64(h + kOffSeed, c.seed);
  wr32(h + kOffNumLayers, (uint32_t)L);
  wr32(h + kOffNumSeqs, (uint32_t)p.seqs.size());
  wr64(h + kOffPagesPerLayer, (uint64_t)p.pages_per_layer);
  wr64(h + kOffPageBytes, (uint64_t)p.page_bytes);
  wr64(h + kOffFp16SeqBytes, (uint64_t)p.fp16_seq_bytes);
  wr64(h + kOffFileSize, p.layout.file_size);
  wr32(h + kOffNumSections, (uint32_t)secs.size());
  wr32(h + kOffTableCrc, crc32c(table.data(), table.size()));
  wr32(h + kOffAlignment, (uint32_t)kDataAlign);
  wr32(h + kOffHeaderCrc, crc32c(h, kOffHeaderCrc));
  sink.patch(kHeaderBytes, table.data(), table.size());
  sink.patch(0, h, sizeof h);
}

std::atomic<uint64_t> g_tmp_counter{0};

}  // namespace
}  // namespace fmkv::io

using namespace fmkv::io;

extern "C" {

fmkv_status fmkv_save_memory(const fmkv_config* cfg, int32_t num_layers, const fmkv_layer_cache* layers,
                             int32_t num_seqs, const fmkv_save_sequence* seqs, uint32_t flags, void** data,
                             size_t* size) {
  return guarded_io([&] {
    if (!data || !size) fail(fmkv::kInvalidArgument, "fmkv_save_memory: NULL output pointer");
    *data = nullptr;
    *size = 0;
    Plan p = make_plan(cfg, num_layers, layers, num_seqs, seqs, flags);
    if (p.layout.file_size > (uint64_t)SIZE_MAX) fail(fmkv::kOverflow, "fmkv_save_memory: snapshot exceeds the address space");
    uint8_t* buf = static_cast<uint8_t*>(std::malloc((size_t)p.layout.file_size));
    if (!buf) throw std::bad_alloc();
    try {
      MemSink sink(buf);
      write_snapshot(p, sink);
    } catch (...) {
      std::free(buf);
      throw;
    }
    *data = buf;
    *size = (size_t)p.layout.file_size;
  });
}

void fmkv_buffer_free(void* data) { std::free(data); }

fmkv_status fmkv_save(const char* path, const fmkv_config* cfg, int32_t num_layers, const fmkv_layer_cache* layers,
                      int32_t num_seqs, const fmkv_save_sequence* seqs, uint32_t flags) {
  return guarded_io([&] {
    if (!path || !*path) fail(fmkv::kInvalidArgument, "fmkv_save: empty path");
    Plan p = make_plan(cfg, num_layers, layers, num_seqs, seqs, flags);
    const std::string target = path;
    const std::string tmp = target + ".tmp." + std::to_string((long)getpid()) + "." + std::to_string(g_tmp_counter++);
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) fail(fmkv::kInvalidArgument, "fmkv_save: cannot create " + tmp + ": " + std::strerror(errno));
    try {
      FileSink sink(fd, tmp);
      write_snapshot(p, sink);
      if (!(flags & FMKV_SAVE_NO_FSYNC) && ::fsync(fd) != 0)
        fail(fmkv::kInvalidArgument, "fmkv_save: fsync of " + tmp + " failed: " + std::strerror(errno));
      if (::close(fd) != 0) {
        fd = -1;
        fail(fmkv::kInvalidArgument, "fmkv_save: closing " + tmp + " failed: " + std::strerror(errno));
      }
      fd = -1;
      if (::rename(tmp.c_str(), target.c_str()) != 0)
        fail(fmkv::kInvalidArgument, "fmkv_save: renaming " + tmp + " to " + target + " failed: " + std::strerror(errno));
    } catch (...) {
      if (fd >= 0) ::close(fd);
      ::unlink(tmp.c_str());
      throw;
    }
  });
}

}  // extern "C"

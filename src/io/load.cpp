// Snapshot reader (docs/FILE-FORMAT.md). Everything is validated before a snapshot object exists:
// a failed load frees whatever it had mapped or allocated and returns no object.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/config.h"
#include "../core/ops.h"
#include "crc32c.h"
#include "error.h"
#include "format1.h"
#include "fmkv/io.h"
#include "layout.h"

namespace fmkv::io {
namespace {

std::string S(int64_t v) { return std::to_string(v); }
// Values stored unsigned in the file are shown as the file holds them (a corrupted u64 is never printed negative).
std::string U(uint64_t v) { return std::to_string(v); }
std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

// Owned memory: an mmap region or a 4096-aligned heap block.
struct Region {
  void* p = nullptr;
  size_t n = 0;
  bool mapped = false;
  Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() {
    if (!p) return;
    if (mapped) ::munmap(p, n);
    else std::free(p);
  }
  static std::unique_ptr<Region> heap(size_t n) {
    auto r = std::make_unique<Region>();
    size_t sz = (n + 4095) & ~(size_t)4095;
    r->p = std::aligned_alloc(4096, sz ? sz : 4096);
    if (!r->p) throw std::bad_alloc();
    r->n = sz;
    return r;
  }
};

// Byte source of the file being loaded: a pointer (mapping or caller memory) or a file read.
struct Source {
  const uint8_t* base = nullptr;  // whole file, when addressable
  int fd = -1;
  uint64_t size = 0;
  std::string name;
  void read(uint64_t off, size_t n, void* dst) const {
    if (n == 0) return;
    if (base) {
      std::memcpy(dst, base + off, n);
      return;
    }
    uint8_t* d = static_cast<uint8_t*>(dst);
    while (n > 0) {
      ssize_t r = ::pread(fd, d, n, (off_t)off);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) fail(kInvalidArgument, name + ": read failed at offset " + U(off) + ": " + (r == 0 ? "unexpected end of file" : std::strerror(errno)));
      d += r;
      n -= (size_t)r;
      off += (uint64_t)r;
    }
  }
  // CRC of [off, off + n), through a bounce buffer when the source is not addressable.
  uint32_t crc(uint64_t off, uint64_t n) const {
    if (base) return crc32c(base + off, (size_t)n);
    std::vector<uint8_t> buf((size_t)std::min<uint64_t>(n, 1 << 20));
    uint32_t c = 0;
    while (n > 0) {
      size_t k = (size_t)std::min<uint64_t>(n, buf.size());
      read(off, k, buf.data());
      c = crc32c(buf.data(), k, c);
      off += k;
      n -= k;
    }
    return c;
  }
  bool zero(uint64_t off, uint64_t n) const {
    uint8_t buf[4096];
    while (n > 0) {
      size_t k = (size_t)std::min<uint64_t>(n, sizeof buf);
      read(off, k, buf);
      for (size_t i = 0; i < k; ++i)
        if (buf[i]) return false;
      off += k;
      n -= k;
    }
    return true;
  }
};

struct Header {
  uint32_t file_version, header_bytes, format_version, flags;
  fmkv_config cfg;
  int32_t num_layers, num_seqs;
  int64_t pages_per_layer, page_bytes, fp16_seq_bytes;
  uint64_t file_size;
  uint32_t num_sections, table_crc, alignment;
};

struct SeqRec {
  int64_t n, pages, first;
  int32_t dequantized;
};

std::string cfg_diff(const fmkv_config& f, const fmkv_config& e) {
  std::string d;
  auto one = [&](const char* name, long long a, long long b) {
    if (a == b) return;
    d += (d.empty() ? "" : ", ") + std::string(name) + " " + std::to_string(a) + " (expected " + std::to_string(b) + ")";
  };
  one("head_dim", f.head_dim, e.head_dim);
  one("num_kv_heads", f.num_kv_heads, e.num_kv_heads);
  one("k_bits", f.k_bits, e.k_bits);
  one("v_bits", f.v_bits, e.v_bits);
  one("page_size", f.page_size, e.page_size);
  one("sink_tokens", f.sink_tokens, e.sink_tokens);
  one("window_tokens", f.window_tokens, e.window_tokens);
  one("scale_rule", f.scale_rule, e.scale_rule);
  one("scale_group", fmkv_resolved_scale_group(f.scale_group), fmkv_resolved_scale_group(e.scale_group));
  one("format_version", fmkv_resolved_format_version(f.format_version), fmkv_resolved_format_version(e.format_version));
  if (f.seed != e.seed)
    d += (d.empty() ? "" : ", ") + std::string("seed ") + std::to_string((unsigned long long)f.seed) + " (expected " +
         std::to_string((unsigned long long)e.seed) + ")";
  return d;
}

Header parse_header(const Source& src, const fmkv_load_options& o) {
  const std::string& nm = src.name;
  uint8_t h[kHeaderBytes];
  const size_t have = (size_t)std::min<uint64_t>(src.size, kHeaderBytes);
  src.read(0, have, h);
  if (std::memcmp(h, kMagic, std::min<size_t>(have, 8)) != 0)
    fail(kInvalidArgument, nm + ": not an fmkv snapshot (bad magic)");
  if (have < kHeaderBytes)
    fail(kInvalidArgument, nm + ": truncated: " + U(src.size) + " bytes, shorter than the " + S(kHeaderBytes) + "-byte header");
  Header H;
  H.file_version = rd32(h + kOffFileVersion);
  if (H.file_version != FMKV_FILE_VERSION)
    fail(kUnsupported, nm + ": snapshot file version " + S(H.file_version) + " is not supported; this library reads file version " +
                           S(FMKV_FILE_VERSION));
  H.header_bytes = rd32(h + kOffHeaderBytes);
  if (H.header_bytes != kHeaderBytes)
    fail(kInvalidArgument, nm + ": header size " + S(H.header_bytes) + ", file version 1 has " + S(kHeaderBytes));
  const uint32_t stored = rd32(h + kOffHeaderCrc), computed = crc32c(h, kOffHeaderCrc);
  if (stored != computed)
    fail(kInvalidArgument, nm + ": header checksum mismatch (stored " + hex32(stored) + ", computed " + hex32(computed) +
                               "): the file is corrupted");
  H.format_version = rd32(h + kOffFormatVersion);
  if (!fmkv_format_version_supported((int32_t)H.format_version) && H.format_version != kFormatVersion1)
    fail(kUnsupported, nm + ": cache data is fmkv format version " + S(H.format_version) + "; this library reads format versions 2 to " +
                           S(FMKV_FORMAT_VERSION_NEWEST) + " (and converts version 1 on load)");
  H.flags = rd32(h + kOffFlags);
  if (H.flags & ~kKnownFlags) fail(kUnsupported, nm + ": unknown header flags " + hex32(H.flags));
  if (rd32(h + kOffReserved))
    fail(kInvalidArgument, nm + ": reserved header bytes are not zero");
  fmkv_config& c = H.cfg;
  c.head_dim = (int32_t)rd32(h + kOffHeadDim);
  c.num_kv_heads = (int32_t)rd32(h + kOffKvHeads);
  c.k_bits = (int32_t)rd32(h + kOffKBits);
  c.v_bits = (int32_t)rd32(h + kOffVBits);
  c.page_size = (int32_t)rd32(h + kOffPageSize);
  c.sink_tokens = (int32_t)rd32(h + kOffSink);
  c.window_tokens = (int32_t)rd32(h + kOffWindow);
  c.scale_rule = (int32_t)rd32(h + kOffScaleRule);
  c.scale_group = (int32_t)rd32(h + kOffScaleGroup);  // 0 (files before the field): the default
  c.seed = rd64(h + kOffSeed);
  c.format_version = H.format_version == kFormatVersion1 ? 2 : (int32_t)H.format_version;  // version 1 loads as 2
  try {
    validate_config(c);
  } catch (const Error& e) {
    fail(kInvalidArgument, nm + ": invalid cache config in header: " + e.what());
  }
  if (o.expect_config) {
    std::string d = cfg_diff(c, *o.expect_config);
    if (!d.empty()) fail(kInvalidArgument, nm + ": geometry mismatch: file has " + d);
  }
  H.num_layers = (int32_t)rd32(h + kOffNumLayers);
  H.num_seqs = (int32_t)rd32(h + kOffNumSeqs);
  if (H.num_layers < 1) fail(kInvalidArgument, nm + ": num_layers " + U((uint32_t)H.num_layers) + " in header, need 1 to 2^31 - 1");
  if (o.expect_num_layers > 0 && H.num_layers != o.expect_num_layers)
    fail(kInvalidArgument, nm + ": geometry mismatch: file has " + U((uint32_t)H.num_layers) + " layers (expected " + S(o.expect_num_layers) + ")");
  if (H.num_seqs < 1) fail(kInvalidArgument, nm + ": num_seqs " + U((uint32_t)H.num_seqs) + " in header, need 1 to 2^31 - 1");
  H.pages_per_layer = (int64_t)rd64(h + kOffPagesPerLayer);
  if (H.pages_per_layer < 0 || H.pages_per_layer > INT32_MAX)
    fail(kInvalidArgument, nm + ": pages per layer " + U((uint64_t)H.pages_per_layer) + " outside [0, 2^31)");
  H.page_bytes = (int64_t)rd64(h + kOffPageBytes);
  if (H.page_bytes != page_bytes(c))
    fail(kInvalidArgument, nm + ": page_bytes " + U((uint64_t)H.page_bytes) + " does not match the config's " + S(page_bytes(c)));
  H.fp16_seq_bytes = (int64_t)rd64(h + kOffFp16SeqBytes);
  const int64_t want_fp16 = 2LL * c.num_kv_heads * fp16_slots(c) * c.head_dim;
  if (H.fp16_seq_bytes != want_fp16)
    fail(kInvalidArgument, nm + ": fp16 region bytes " + U((uint64_t)H.fp16_seq_bytes) + " do not match the config's " + S(want_fp16));
  H.file_size = rd64(h + kOffFileSize);
  if (src.size < H.file_size)
    fail(kInvalidArgument, nm + ": truncated: " + U(src.size) + " bytes, the header says " + U(H.file_size));
  if (src.size > H.file_size)
    fail(kInvalidArgument, nm + ": " + U(src.size - H.file_size) + " trailing bytes after the " + U(H.file_size) +
                               " the header declares");
  H.num_sections = rd32(h + kOffNumSections);
  H.table_crc = rd32(h + kOffTableCrc);
  H.alignment = rd32(h + kOffAlignment);
  if (H.alignment != kDataAlign) fail(kInvalidArgument, nm + ": data alignment " + S(H.alignment) + ", file version 1 uses 4096");
  return H;
}

}  // namespace
}  // namespace fmkv::io

using namespace fmkv::io;

struct fmkv_snapshot {
  fmkv_config cfg{};
  int32_t num_layers = 0, num_seqs = 0;
  int64_t file_pages = 0, num_pages = 0;
  bool mapped = false;
  uint32_t flags = 0;
  std::vector<fmkv_layer_cache> layers;
  std::vector<int64_t> lens, npages;
  std::vector<int32_t> slots, dequantized;
  std::vector<int32_t> table;       // [num_seqs][stride], padded with -1
  int64_t stride = 1;
  std::vector<std::unique_ptr<Region>> regions;  // declared last: freed after the views
};

namespace fmkv::io {
namespace {

fmkv_snapshot* load_impl(const Source& src, const fmkv_load_options& o, int fd_for_map,
                         std::unique_ptr<Region> whole_map) {
  const std::string& nm = src.name;
  if (o.mode != FMKV_LOAD_COPY && o.mode != FMKV_LOAD_MMAP) fail(kInvalidArgument, "fmkv_load: unknown mode " + S(o.mode));
  if (o.extra_pages < 0) fail(kInvalidArgument, "fmkv_load: negative extra_pages");
  if (o.flags & ~FMKV_LOAD_REJECT_DEQUANTIZED) fail(kInvalidArgument, "fmkv_load: unknown flags " + hex32(o.flags));
  Header H = parse_header(src, o);
  const fmkv_config& c = H.cfg;
  if ((o.flags & FMKV_LOAD_REJECT_DEQUANTIZED) && (H.flags & 1u))
    fail(kUnsupported, nm + ": the snapshot holds dequantized window tokens (saved with FMKV_SAVE_ALLOW_DEQUANTIZED) "
                            "and FMKV_LOAD_REJECT_DEQUANTIZED is set");
  // Geometry -> canonical layout; the section table must be exactly it.
  Layout lay;
  std::string why;
  if (!canonical_layout(H.num_layers, H.num_seqs, H.pages_per_layer, H.page_bytes, H.fp16_seq_bytes, H.file_size, &lay, &why))
    fail(kInvalidArgument, nm + ": inconsistent header: " + why);
  if (lay.file_size != H.file_size)
    fail(kInvalidArgument, nm + ": file size " + U(H.file_size) + " in header, its geometry gives " + U(lay.file_size));
  if (H.num_sections != lay.sections.size())
    fail(kInvalidArgument, nm + ": " + S(H.num_sections) + " sections in header, its geometry gives " + S((int64_t)lay.sections.size()));
  std::vector<uint8_t> table(lay.sections.size() * kSectionEntryBytes);
  src.read(kHeaderBytes, table.size(), table.data());
  const uint32_t tcrc = crc32c(table.data(), table.size());
  if (tcrc != H.table_crc)
    fail(kInvalidArgument, nm + ": section table checksum mismatch (stored " + hex32(H.table_crc) + ", computed " + hex32(tcrc) +
                               "): the file is corrupted");
  uint64_t prev_end = kHeaderBytes + table.size();
  for (size_t i = 0; i < lay.sections.size(); ++i) {
    const uint8_t* e = &table[i * kSectionEntryBytes];
    Section& want = lay.sections[i];
    const uint32_t kind = rd32(e), layer = rd32(e + 4);
    const uint64_t off = rd64(e + 8), size = rd64(e + 16);
    const std::string sn = "section " + S((int64_t)i) + " (" + section_name(want.kind, want.layer) + ")";
    if (kind != want.kind || layer != want.layer)
      fail(kInvalidArgument, nm + ": " + sn + " has kind " + U(kind) + " layer " + U(layer) + ", expected kind " + S(want.kind));
    if (off > H.file_size || size > H.file_size - off)
      fail(kInvalidArgument, nm + ": " + sn + " [" + U(off) + ", +" + U(size) + ") lies outside the " +
                                 U(H.file_size) + "-byte file");
    if (off != want.offset || size != want.size)
      fail(kInvalidArgument, nm + ": " + sn + " at offset " + U(off) + " size " + U(size) + ", expected offset " +
                                 U(want.offset) + " size " + U(want.size));
    if (rd32(e + 28) != 0) fail(kInvalidArgument, nm + ": " + sn + ": reserved field is not zero");
    want.crc = rd32(e + 24);
    if (!src.zero(prev_end, want.offset - prev_end))
      fail(kInvalidArgument, nm + ": non-zero padding before " + sn + ": the file is corrupted");
    prev_end = want.offset + want.size;
  }
  auto check_crc = [&](const Section& s, uint32_t computed) {
    if (computed != s.crc)
      fail(kInvalidArgument, nm + ": checksum mismatch in " + section_name(s.kind, s.layer) + " (stored " + hex32(s.crc) +
                                 ", computed " + hex32(computed) + "): the file is corrupted");
  };
  auto read_meta = [&](size_t i) {
    const Section& s = lay.sections[i];
    std::vector<uint8_t> b((size_t)s.size);
    src.read(s.offset, b.size(), b.data());
    check_crc(s, crc32c(b.data(), b.size()));
    return b;
  };
  // Metadata: layer indices, sequence records, block table.
  std::vector<uint8_t> lb = read_meta(0), sb = read_meta(1), tb = read_meta(2);
  std::vector<int32_t> layer_ids(H.num_layers);
  for (int32_t l = 0; l < H.num_layers; ++l) {
    layer_ids[l] = (int32_t)rd32(&lb[4 * (size_t)l]);
    if (layer_ids[l] < 0) fail(kInvalidArgument, nm + ": layer " + S(l) + " has negative layer index (stored as " + U((uint32_t)layer_ids[l]) + ", more than 2^31 - 1)");
  }
  std::vector<SeqRec> recs(H.num_seqs);
  int64_t expect_first = 0, max_pages = 0;
  uint32_t dq_flag = 0;
  for (int32_t i = 0; i < H.num_seqs; ++i) {
    const uint8_t* r = &sb[(size_t)i * kSequenceRecordBytes];
    SeqRec& q = recs[i];
    q.n = (int64_t)rd64(r);
    q.pages = (int64_t)rd64(r + 8);
    q.first = (int64_t)rd64(r + 16);
    q.dequantized = (int32_t)rd32(r + 24);
    const std::string sq = nm + ": sequence " + S(i) + ": ";
    if (q.n < 0 || q.n > ((int64_t)1 << 48)) fail(kInvalidArgument, sq + "token count " + U((uint64_t)q.n) + " out of range (at most 2^48)");
    const int64_t comp = std::max<int64_t>(0, q.n - c.sink_tokens - c.window_tokens);
    const int64_t want_pages = (comp + c.page_size - 1) / c.page_size;
    if (q.pages != want_pages)
      fail(kInvalidArgument, sq + U((uint64_t)q.pages) + " pages recorded, " + S(q.n) + " tokens need " + S(want_pages));
    if (q.first != expect_first)
      fail(kInvalidArgument, sq + "first block-table entry " + U((uint64_t)q.first) + ", expected " + S(expect_first));
    const int64_t win = std::max<int64_t>(0, q.n - compressed_end(c, q.n));
    if (q.dequantized < 0 || q.dequantized > win)
      fail(kInvalidArgument, sq + U((uint32_t)q.dequantized) + " dequantized window tokens, its window holds " + S(win));
    if (rd32(r + 28) != 0) fail(kInvalidArgument, sq + "reserved field is not zero");
    if (q.dequantized > 0) dq_flag = 1;
    expect_first += q.pages;
    max_pages = std::max(max_pages, q.pages);
    if (expect_first > H.pages_per_layer)
      fail(kInvalidArgument, sq + "pages beyond the " + S(H.pages_per_layer) + " per layer in the file");
  }
  if (expect_first != H.pages_per_layer)
    fail(kInvalidArgument, nm + ": sequences use " + S(expect_first) + " pages, the header says " + S(H.pages_per_layer));
  if (dq_flag != (H.flags & 1u))
    fail(kInvalidArgument, nm + ": header flag 'dequantized window tokens' disagrees with the sequence records");
  std::vector<int32_t> flat((size_t)H.pages_per_layer);
  {
    std::vector<uint8_t> seen((size_t)H.pages_per_layer, 0);
    for (int64_t j = 0; j < H.pages_per_layer; ++j) {
      int32_t v = (int32_t)rd32(&tb[4 * (size_t)j]);
      if (v < 0 || v >= H.pages_per_layer)
        fail(kOutOfRange, nm + ": block table entry " + S(j) + " = " + U((uint32_t)v) + " outside [0, " + S(H.pages_per_layer) + ")");
      if (seen[(size_t)v]) fail(kInvalidArgument, nm + ": page " + S(v) + " appears twice in the block table");
      seen[(size_t)v] = 1;
      flat[(size_t)j] = v;
    }
  }
  // Data sections: checksum, then expose (zero copy or copy).
  const uint64_t total_pages = (uint64_t)H.pages_per_layer + (uint64_t)o.extra_pages;
  uint64_t pool_bytes;
  if (__builtin_mul_overflow(total_pages, (uint64_t)H.page_bytes, &pool_bytes) || total_pages > (uint64_t)INT32_MAX ||
      pool_bytes > (uint64_t)SIZE_MAX / 2)
    fail(kOverflow, "fmkv_load: extra_pages " + S(o.extra_pages) + " makes the page pool too large");
  auto snap = std::make_unique<fmkv_snapshot>();
  snap->cfg = c;
  snap->num_layers = H.num_layers;
  snap->num_seqs = H.num_seqs;
  snap->file_pages = H.pages_per_layer;
  snap->num_pages = (int64_t)total_pages;
  snap->flags = H.flags;
  const long os_page = ::sysconf(_SC_PAGESIZE);
  const bool can_map = o.mode == FMKV_LOAD_MMAP && whole_map && fd_for_map >= 0 && os_page > 0 && kDataAlign % (uint64_t)os_page == 0;
  snap->mapped = can_map;
  uint8_t* const wbase = whole_map ? static_cast<uint8_t*>(whole_map->p) : nullptr;
  const bool fp16 = fp16_slots(c) > 0;
  size_t si = 3;
  for (int32_t l = 0; l < H.num_layers; ++l) {
    fmkv_layer_cache lc{};
    lc.num_pages = (int64_t)total_pages;
    lc.num_slots = H.num_seqs;
    lc.layer = layer_ids[l];
    const Section& ps = lay.sections[si++];
    if (can_map) {
      check_crc(ps, src.crc(ps.offset, ps.size));
      if (o.extra_pages == 0) {
        lc.pages = wbase + ps.offset;
      } else {
        // Anonymous pool, the file's pages mapped privately over its start.
        auto r = std::make_unique<Region>();
        const size_t osz = (size_t)os_page, total = (size_t)pool_bytes;
        const size_t alen = (total + osz - 1) / osz * osz, flen = ((size_t)ps.size + osz - 1) / osz * osz;
        void* a = ::mmap(nullptr, alen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (a == MAP_FAILED) fail(kInternal, "fmkv_load: mmap of " + S((int64_t)alen) + " bytes failed: " + std::strerror(errno));
        r->p = a;
        r->n = alen;
        r->mapped = true;
        if (flen > 0) {
          void* m = ::mmap(a, flen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd_for_map, (off_t)ps.offset);
          if (m == MAP_FAILED) fail(kInternal, "fmkv_load: mmap of " + section_name(ps.kind, ps.layer) + " failed: " + std::strerror(errno));
          std::memset(static_cast<uint8_t*>(a) + ps.size, 0, flen - (size_t)ps.size);  // file bytes past the section
        }
        lc.pages = static_cast<uint8_t*>(a);
        snap->regions.push_back(std::move(r));
      }
    } else {
      auto r = Region::heap((size_t)pool_bytes);
      src.read(ps.offset, (size_t)ps.size, r->p);
      check_crc(ps, crc32c(r->p, (size_t)ps.size));
      std::memset(static_cast<uint8_t*>(r->p) + ps.size, 0, r->n - (size_t)ps.size);
      lc.pages = static_cast<uint8_t*>(r->p);
      snap->regions.push_back(std::move(r));
    }
    // format 1: repack the file's 4-bit sections (in the owned copy, or in the private mapping,
    // whose touched pages the OS then copies)
    if (H.format_version == kFormatVersion1 && format1_differs(c)) upgrade_format1_pages(c, lc.pages, H.pages_per_layer);
    if (fp16) {
      for (int v = 0; v < 2; ++v) {
        const Section& fs = lay.sections[si++];
        uint16_t* ptr;
        if (can_map) {
          check_crc(fs, src.crc(fs.offset, fs.size));
          ptr = reinterpret_cast<uint16_t*>(wbase + fs.offset);
        } else {
          auto r = Region::heap((size_t)fs.size);
          src.read(fs.offset, (size_t)fs.size, r->p);
          check_crc(fs, crc32c(r->p, (size_t)fs.size));
          ptr = static_cast<uint16_t*>(r->p);
          snap->regions.push_back(std::move(r));
        }
        (v ? lc.fp16_v : lc.fp16_k) = ptr;
      }
    }
    snap->layers.push_back(lc);
  }
  if (can_map) snap->regions.push_back(std::move(whole_map));
  snap->stride = std::max<int64_t>(1, max_pages);
  snap->table.assign((size_t)(snap->stride * H.num_seqs), -1);
  for (int32_t i = 0; i < H.num_seqs; ++i) {
    snap->lens.push_back(recs[i].n);
    snap->npages.push_back(recs[i].pages);
    snap->slots.push_back(i);
    snap->dequantized.push_back(recs[i].dequantized);
    for (int64_t j = 0; j < recs[i].pages; ++j) snap->table[(size_t)(i * snap->stride + j)] = flat[(size_t)(recs[i].first + j)];
  }
  return snap.release();
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace
}  // namespace fmkv::io

extern "C" {

void fmkv_load_options_default(fmkv_load_options* o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
  o->mode = FMKV_LOAD_COPY;
}

fmkv_status fmkv_load_memory(const void* data, size_t size, const fmkv_load_options* opts, fmkv_snapshot** out) {
  return guarded_io([&] {
    if (!out) fail(fmkv::kInvalidArgument, "fmkv_load_memory: out is NULL");
    *out = nullptr;
    if (!data && size) fail(fmkv::kInvalidArgument, "fmkv_load_memory: data is NULL");
    fmkv_load_options o;
    fmkv_load_options_default(&o);
    if (opts) o = *opts;
    o.mode = FMKV_LOAD_COPY;
    Source src;
    src.base = static_cast<const uint8_t*>(data);
    src.size = size;
    src.name = "snapshot in memory";
    *out = load_impl(src, o, -1, nullptr);
  });
}

fmkv_status fmkv_load(const char* path, const fmkv_load_options* opts, fmkv_snapshot** out) {
  return guarded_io([&] {
    if (!out) fail(fmkv::kInvalidArgument, "fmkv_load: out is NULL");
    *out = nullptr;
    if (!path) fail(fmkv::kInvalidArgument, "fmkv_load: path is NULL");
    fmkv_load_options o;
    fmkv_load_options_default(&o);
    if (opts) o = *opts;
    Fd f;
    f.fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) fail(fmkv::kInvalidArgument, std::string("fmkv_load: cannot open ") + path + ": " + std::strerror(errno));
    struct stat st;
    if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
      fail(fmkv::kInvalidArgument, std::string("fmkv_load: ") + path + " is not a regular file");
    Source src;
    src.fd = f.fd;
    src.size = (uint64_t)st.st_size;
    src.name = path;
    std::unique_ptr<Region> whole;
    if (o.mode == FMKV_LOAD_MMAP && st.st_size > 0 && (uint64_t)st.st_size <= (uint64_t)SIZE_MAX) {
      void* m = ::mmap(nullptr, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, f.fd, 0);
      if (m != MAP_FAILED) {
        whole = std::make_unique<Region>();
        whole->p = m;
        whole->n = (size_t)st.st_size;
        whole->mapped = true;
        src.base = static_cast<const uint8_t*>(m);
      }
    }
    *out = load_impl(src, o, f.fd, std::move(whole));
  });
}

void fmkv_snapshot_free(fmkv_snapshot* s) { delete s; }

fmkv_status fmkv_snapshot_check_config(const fmkv_snapshot* s, const fmkv_config* expect) {
  return guarded_io([&] {
    if (!s || !expect) fail(fmkv::kInvalidArgument, "fmkv_snapshot_check_config: NULL argument");
    const std::string d = cfg_diff(s->cfg, *expect);
    if (!d.empty()) fail(fmkv::kInvalidArgument, "snapshot: config mismatch: file has " + d);
  });
}

fmkv_status fmkv_snapshot_get_info(const fmkv_snapshot* s, fmkv_snapshot_info* info) {
  return guarded_io([&] {
    if (!s || !info) fail(fmkv::kInvalidArgument, "fmkv_snapshot_get_info: NULL argument");
    info->config = s->cfg;
    info->num_layers = s->num_layers;
    info->num_seqs = s->num_seqs;
    info->file_pages = s->file_pages;
    info->num_pages = s->num_pages;
    info->mapped = s->mapped ? 1 : 0;
    info->file_version = FMKV_FILE_VERSION;
    info->format_version = s->cfg.format_version;
    info->flags = s->flags;
  });
}

fmkv_status fmkv_snapshot_layer(const fmkv_snapshot* s, int32_t i, fmkv_layer_cache* layer) {
  return guarded_io([&] {
    if (!s || !layer) fail(fmkv::kInvalidArgument, "fmkv_snapshot_layer: NULL argument");
    if (i < 0 || i >= s->num_layers)
      fail(fmkv::kOutOfRange, "fmkv_snapshot_layer: layer " + std::to_string(i) + " outside [0, " + std::to_string(s->num_layers) + ")");
    *layer = s->layers[(size_t)i];
  });
}

fmkv_status fmkv_snapshot_get_sequence(const fmkv_snapshot* s, int32_t i, fmkv_snapshot_sequence* q) {
  return guarded_io([&] {
    if (!s || !q) fail(fmkv::kInvalidArgument, "fmkv_snapshot_get_sequence: NULL argument");
    if (i < 0 || i >= s->num_seqs)
      fail(fmkv::kOutOfRange, "fmkv_snapshot_get_sequence: sequence " + std::to_string(i) + " outside [0, " + std::to_string(s->num_seqs) + ")");
    q->num_tokens = s->lens[(size_t)i];
    q->slot = s->slots[(size_t)i];
    q->dequantized_tokens = s->dequantized[(size_t)i];
    q->num_pages = s->npages[(size_t)i];
    q->block_table = s->table.data() + (size_t)i * (size_t)s->stride;
  });
}

fmkv_status fmkv_snapshot_batch(const fmkv_snapshot* s, const int64_t** seq_lens, const int32_t** slots,
                                const int32_t** block_table, int64_t* stride) {
  return guarded_io([&] {
    if (!s) fail(fmkv::kInvalidArgument, "fmkv_snapshot_batch: snapshot is NULL");
    if (seq_lens) *seq_lens = s->lens.data();
    if (slots) *slots = s->slots.data();
    if (block_table) *block_table = s->table.data();
    if (stride) *stride = s->stride;
  });
}

}  // extern "C"

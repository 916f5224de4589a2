#include "layout.h"

namespace fmkv::io {

std::string section_name(uint32_t kind, uint32_t layer) {
  std::string l = " of layer " + std::to_string(layer);
  switch (kind) {
    case kSecLayers: return "layer table";
    case kSecSequences: return "sequence table";
    case kSecBlockTable: return "block table";
    case kSecPages: return "pages" + l;
    case kSecFp16K: return "fp16 K region" + l;
    case kSecFp16V: return "fp16 V region" + l;
  }
  return "section kind " + std::to_string(kind);
}

namespace {
bool mul(uint64_t a, uint64_t b, uint64_t* r) { return !__builtin_mul_overflow(a, b, r); }
bool add(uint64_t a, uint64_t b, uint64_t* r) { return !__builtin_add_overflow(a, b, r); }
bool align_up(uint64_t v, uint64_t a, uint64_t* r) {
  if (!add(v, a - 1, r)) return false;
  *r &= ~(a - 1);
  return true;
}
}  // namespace

bool canonical_layout(int32_t num_layers, int32_t num_seqs, int64_t pages_per_layer, int64_t page_bytes,
                      int64_t fp16_seq_bytes, uint64_t limit, Layout* out, std::string* why) {
  out->sections.clear();
  if (num_layers < 1 || num_seqs < 1 || pages_per_layer < 0 || page_bytes < 0 || fp16_seq_bytes < 0) {
    *why = "negative or zero count in the header";
    return false;
  }
  uint64_t pages_size = 0, fp16_size = 0, meta = 0;
  bool ok = mul((uint64_t)pages_per_layer, (uint64_t)page_bytes, &pages_size) &&
            mul((uint64_t)num_seqs, (uint64_t)fp16_seq_bytes, &fp16_size);
  const bool fp16 = fp16_seq_bytes > 0;
  uint64_t nsec = 3 + (uint64_t)num_layers * (fp16 ? 3 : 1);
  uint64_t pos = 0;
  ok = ok && mul(nsec, kSectionEntryBytes, &meta) && add(kHeaderBytes, meta, &pos);
  if (ok && pos > limit) {
    *why = "the section table alone needs " + std::to_string(pos) + " bytes, more than the file's " + std::to_string(limit);
    return false;
  }
  auto put = [&](uint32_t kind, uint32_t layer, uint64_t size, uint64_t align) {
    if (!ok) return;
    Section s;
    s.kind = kind;
    s.layer = layer;
    s.size = size;
    ok = align_up(pos, align, &s.offset) && add(s.offset, size, &pos) && pos <= limit;
    out->sections.push_back(s);
  };
  put(kSecLayers, kNoLayer, 4ull * (uint64_t)num_layers, kMetaAlign);
  put(kSecSequences, kNoLayer, (uint64_t)kSequenceRecordBytes * (uint64_t)num_seqs, kMetaAlign);
  uint64_t table_size = 0;
  ok = ok && mul(4, (uint64_t)pages_per_layer, &table_size);
  put(kSecBlockTable, kNoLayer, table_size, kMetaAlign);
  for (int32_t l = 0; l < num_layers && ok; ++l) {
    put(kSecPages, (uint32_t)l, pages_size, kDataAlign);
    if (fp16) {
      put(kSecFp16K, (uint32_t)l, fp16_size, kDataAlign);
      put(kSecFp16V, (uint32_t)l, fp16_size, kDataAlign);
    }
  }
  if (!ok || pos > (uint64_t)INT64_MAX) {
    *why = pos > limit && limit < (uint64_t)INT64_MAX
               ? "the header's geometry needs more than the file's " + std::to_string(limit) + " bytes"
               : "section sizes overflow 64-bit file offsets";
    out->sections.clear();
    return false;
  }
  out->file_size = pos;
  return true;
}

}  // namespace fmkv::io

#include "crc32c.h"

namespace fmkv::io {

bool refresh_checksums(uint8_t* data, size_t size) {
  if (size < kHeaderBytes) return false;
  const uint64_t n = rd32(data + kOffNumSections);
  const uint64_t avail = (size - kHeaderBytes) / kSectionEntryBytes;
  const uint64_t m = n < avail ? n : avail;
  for (uint64_t i = 0; i < m; ++i) {
    uint8_t* e = data + kHeaderBytes + i * kSectionEntryBytes;
    const uint64_t off = rd64(e + 8), sz = rd64(e + 16);
    if (off <= size && sz <= size - off) wr32(e + 24, crc32c(data + off, (size_t)sz));
  }
  if (n <= avail) wr32(data + kOffTableCrc, crc32c(data + kHeaderBytes, (size_t)(n * kSectionEntryBytes)));
  wr32(data + kOffHeaderCrc, crc32c(data, kOffHeaderCrc));
  return true;
}

}  // namespace fmkv::io

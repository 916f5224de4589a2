// fmkv snapshot file (docs/FILE-FORMAT.md): constants, little-endian field access and the
// canonical section layout that both the writer and the reader derive from the header fields.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fmkv/io.h"

namespace fmkv::io {

constexpr uint8_t kMagic[8] = {0x89, 'F', 'M', 'K', 'V', '\r', '\n', 0x1A};
constexpr uint32_t kHeaderBytes = 128;
constexpr uint32_t kSectionEntryBytes = 32;
constexpr uint32_t kSequenceRecordBytes = 32;
constexpr uint64_t kDataAlign = 4096;  // data sections (pages, fp16 regions)
constexpr uint64_t kMetaAlign = 8;     // metadata sections
constexpr uint32_t kNoLayer = 0xFFFFFFFFu;
constexpr uint32_t kKnownFlags = 1u;   // bit 0: dequantized window tokens present

// Header field offsets.
enum HeaderOffset : uint32_t {
  kOffMagic = 0, kOffFileVersion = 8, kOffHeaderBytes = 12, kOffFormatVersion = 16, kOffFlags = 20,
  kOffHeadDim = 24, kOffKvHeads = 28, kOffKBits = 32, kOffVBits = 36, kOffPageSize = 40,
  kOffSink = 44, kOffWindow = 48, kOffScaleRule = 52, kOffSeed = 56, kOffNumLayers = 64,
  kOffNumSeqs = 68, kOffPagesPerLayer = 72, kOffPageBytes = 80, kOffFp16SeqBytes = 88,
  kOffFileSize = 96, kOffNumSections = 104, kOffTableCrc = 108, kOffAlignment = 112,
  kOffScaleGroup = 116, kOffReserved = 120, kOffHeaderCrc = 124
};

enum SectionKind : uint32_t {
  kSecLayers = 1,      // int32 [num_layers]: rotation-sign layer index of each layer
  kSecSequences = 2,   // 32-byte records [num_seqs]
  kSecBlockTable = 3,  // int32 [pages_per_layer]
  kSecPages = 16,      // per layer: pages_per_layer * page_bytes
  kSecFp16K = 17,      // per layer: num_seqs * fp16_seq_bytes (only when sink + window > 0)
  kSecFp16V = 18
};

inline uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
inline uint32_t rd32(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24); }
inline uint64_t rd64(const uint8_t* p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }
inline void wr32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; ++i) p[i] = (uint8_t)(v >> (8 * i)); }
inline void wr64(uint8_t* p, uint64_t v) { for (int i = 0; i < 8; ++i) p[i] = (uint8_t)(v >> (8 * i)); }

struct Section {
  uint32_t kind = 0, layer = kNoLayer;
  uint64_t offset = 0, size = 0;
  uint32_t crc = 0;
};

std::string section_name(uint32_t kind, uint32_t layer);

// Canonical layout for the given geometry. Returns false (with *why) when a size overflows.
struct Layout {
  std::vector<Section> sections;
  uint64_t file_size = 0;
};
// Stops (returning false) as soon as the layout would exceed `limit` bytes, so a hostile header
// cannot make the reader allocate a huge section list.
bool canonical_layout(int32_t num_layers, int32_t num_seqs, int64_t pages_per_layer, int64_t page_bytes,
                      int64_t fp16_seq_bytes, uint64_t limit, Layout* out, std::string* why);

}  // namespace fmkv::io

namespace fmkv::io {
// Recomputes every checksum of a snapshot image in place (section CRCs for entries that lie inside
// the buffer, then the section-table CRC, then the header CRC). For tests and the fuzzer, which
// edit fields and still want to reach the checks behind the checksums. Returns false when the
// buffer is too short to hold a header.
bool refresh_checksums(uint8_t* data, size_t size);
}  // namespace fmkv::io

// Reading snapshots whose cache data is fmkv format version 1 (docs/FILE-FORMAT.md, "Older format
// versions"). Format 1 differs from format 2 only in how 4-bit codes are packed: format 1 stored the
// 32 codes of a group as planes (words 0, 1: the 2-bit field plane of the magnitude bits 0-1, at
// fmkv_field_word / fmkv_field_shift as for 3-bit codes; word 2: magnitude bit 2, bit j = coordinate
// j; word 3: the sign plane), format 2 as nibble words (FORMAT.md section 6). Codes, scales, fp16
// data and every offset are the same.
#pragma once
#include <cstdint>

#include "fmkv/params.h"

namespace fmkv::io {

constexpr uint32_t kFormatVersion1 = 1;

// True when a cache of this config is stored differently by format 1 (a 4-bit K or V side).
bool format1_differs(const fmkv_config& c);

// Repack every 4-bit section of num_pages pages (page_bytes apart) from format 1 to the current
// format, in place.
void upgrade_format1_pages(const fmkv_config& c, uint8_t* pages, int64_t num_pages);

}  // namespace fmkv::io

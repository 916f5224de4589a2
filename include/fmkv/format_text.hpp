// The values the format's predicates (fmkv/format.h) accept, as error messages list them, derived from the
// predicates themselves so that no message restates a rule: "2, 3 or 4" (code widths; with_fp16: "2, 3, 4 or
// 16"), "64, 128 or 256" (head dims), "2 or 3" (format versions a cache can be created in). C++ only; part of
// the format core's public text, used by the library's checks, the CLI and the Python binding alike.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format.h"

namespace fmkv {
namespace format_text_detail {
// "a, b or c" of the values in v (one value: itself).
inline std::string listed(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : i + 1 == v.size() ? " or " : ", ") + std::to_string(v[i]);
  return s;
}
}  // namespace format_text_detail

// The code widths fmkv_code_bits_supported accepts, ascending.
inline std::vector<int32_t> supported_code_bits() {
  std::vector<int32_t> v;
  for (int32_t b = 1; b < FMKV_FP16_BITS; ++b)
    if (fmkv_code_bits_supported(b)) v.push_back(b);
  return v;
}

inline std::string supported_code_bits_text(bool with_fp16) {
  std::vector<int32_t> v = supported_code_bits();
  if (with_fp16) v.push_back(FMKV_FP16_BITS);
  return format_text_detail::listed(v);
}

// The head dims fmkv_head_dim_supported accepts (powers of two up to FMKV_MAX_HEAD_DIM), ascending.
inline std::vector<int32_t> supported_head_dims() {
  std::vector<int32_t> v;
  for (int32_t d = 1; d <= FMKV_MAX_HEAD_DIM; d *= 2)
    if (fmkv_head_dim_supported(d)) v.push_back(d);
  return v;
}

inline std::string supported_head_dims_text() { return format_text_detail::listed(supported_head_dims()); }

inline std::string supported_format_versions_text() {
  std::vector<int32_t> v;
  for (int32_t f = 1; f <= FMKV_FORMAT_VERSION_NEWEST; ++f)
    if (fmkv_format_version_supported(f)) v.push_back(f);
  return format_text_detail::listed(v);
}
}  // namespace fmkv

#include "config.h"

#include <limits>
#include <string>

#include "fmkv/format_text.hpp"

namespace fmkv {
namespace {
std::string S(int64_t v) { return std::to_string(v); }
}  // namespace

void validate_config(const fmkv_config& c) {
  if (!fmkv_head_dim_supported(c.head_dim))
    fail(kInvalidArgument, "head_dim " + S(c.head_dim) + " is not supported (" + supported_head_dims_text() + ")");
  if (c.num_kv_heads < 1) fail(kInvalidArgument, "num_kv_heads must be >= 1, got " + S(c.num_kv_heads));
  if (!fmkv_code_bits_supported(c.k_bits) && c.k_bits != FMKV_FP16_BITS)
    fail(kInvalidArgument, "k_bits " + S(c.k_bits) + " is not supported (" + supported_code_bits_text(true) + ")");
  if (!fmkv_code_bits_supported(c.v_bits))
    fail(kInvalidArgument, "v_bits " + S(c.v_bits) + " is not supported (" + supported_code_bits_text(false) + ")");
  if (!fmkv_page_size_supported(c.page_size))
    fail(kInvalidArgument, "page_size " + S(c.page_size) + " must be a power of two in [" + S(FMKV_MIN_PAGE_SIZE) + ", " +
                               S(FMKV_MAX_PAGE_SIZE) + "]");
  if (c.sink_tokens < 0 || c.window_tokens < 0 || c.sink_tokens > (1 << 20) || c.window_tokens > (1 << 20))
    fail(kInvalidArgument, "sink_tokens and window_tokens must be in [0, 2^20]");
  if (c.format_version != 0 && !fmkv_format_version_supported(c.format_version))
    fail(kInvalidArgument, "format_version " + S(c.format_version) + " is not supported (0 = default, " +
                               supported_format_versions_text() + ")");
  if (!fmkv_scale_group_supported(c.scale_group))
    fail(kInvalidArgument, "scale_group " + S(c.scale_group) + " is not supported (0 = default " + S(FMKV_SCALE_GROUP) +
                               ", 32 or 64 coordinates per scale)");
  if (c.scale_rule != FMKV_SCALE_RMS && c.scale_rule != FMKV_SCALE_LSQ)
    fail(kInvalidArgument, "scale_rule " + S(c.scale_rule) + " is not FMKV_SCALE_RMS (0) or FMKV_SCALE_LSQ (1)");
}

void validate_layer(const fmkv_config& c, const fmkv_layer_cache& l) {
  if (l.num_pages < 0) fail(kInvalidArgument, "layer: negative num_pages");
  if (l.num_pages > 0 && !l.pages) fail(kInvalidArgument, "layer: pages is NULL");
  if (l.num_pages > std::numeric_limits<int32_t>::max())
    fail(kOverflow, "layer: num_pages exceeds what a 32-bit block table can address");
  int64_t pool = 0;
  if (__builtin_mul_overflow(l.num_pages, page_bytes(c), &pool)) fail(kOverflow, "layer: page pool size overflows 64 bits");
  if (fp16_slots(c) > 0) {
    if (!l.fp16_k || !l.fp16_v) fail(kInvalidArgument, "layer: sink/window configured but fp16_k or fp16_v is NULL");
    if (l.num_slots < 1) fail(kInvalidArgument, "layer: sink/window configured but num_slots < 1");
  }
  if (l.layer < 0) fail(kInvalidArgument, "layer: negative layer index");
}

}  // namespace fmkv

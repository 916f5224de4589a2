// Checks of a cache configuration and of one layer's storage against the format's rules
// (include/fmkv/format.h): what every op, the snapshot loader and the snapshot writer accept.
// Throw fmkv::Error naming the problem.
#pragma once
#include "ops.h"

namespace fmkv {

void validate_config(const fmkv_config& c);
void validate_layer(const fmkv_config& c, const fmkv_layer_cache& l);

}  // namespace fmkv

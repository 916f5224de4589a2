// Randomized Hadamard rotation of the format (v1 and v2 alike): sign vector from (seed, layer), normalisation constant.
// FORMAT.md "Rotation" is normative. Host and CUDA device.
#pragma once
#include <stdint.h>
#include "fmkv/format.h"

namespace fmkv {

FMKV_HD uint64_t splitmix64_next(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Sign bits of the rotation for one layer: bit i of word i/64 set means s_i = -1.
// words must hold head_dim / 64 entries.
FMKV_HD void rotation_sign_words(uint64_t seed, int32_t layer, int32_t head_dim, uint64_t* words) {
  uint64_t state = seed ^ ((uint64_t)(uint32_t)layer * 0xD6E8FEB86659FD93ull);
  for (int32_t k = 0; k < head_dim / 64; ++k) words[k] = splitmix64_next(&state);
}

// float32 nearest to 1/sqrt(d): the factor applied after the unnormalised FWHT.
FMKV_HD float rotation_norm(int32_t head_dim) {
  return head_dim == 64 ? 0.125f : head_dim == 128 ? 0.0883883461356163f : 0.0625f;
}

}  // namespace fmkv

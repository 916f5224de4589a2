// Test kernel for the per-SIMD-group primitives of src/metal/kernel_core.h (not shipped): runs in the
// CPU emulator on adversarial inputs (tests/metal/test_metal.cpp "core" cases) and is type-checked
// against the MSL shim like the real kernels. One SIMD group per vector of head_dim floats:
//   sums[(v*G + g)*32 + lane] = group sum of group g in every lane (must equal tree_sum32),
//   gsums[(v*G + g)*32 + lane] = fmkv_simd_scale_group_sum of the scale group whose first code group is g, in
//                               every lane (must equal the code groups' tree_sum32 sums added in coordinate
//                               order; the other code groups' slots untouched),
//   codes / scales / words    = quantization of each scale group (p.scale_group: 1 or 2 code groups) taken
//                               as rotated values y with codebook p.table (must equal
//                               quantize_scale_group_table + pack_group; scales[v*G + g] for the first code
//                               group g of each scale group, the others untouched; words: FMKV_CODE_BITS_MAX
//                               per code group, the first p.bits written),
//   rotated                   = the vector rotated (must equal fmkv::rotate, bitwise).
#include "../../src/format/portability.h"
#include "../../src/metal/params_msl.h"
#include "../../src/metal/kernel_core.h"

struct fmkv_core_test_params {
  fmkv_i32 head_dim, bits, scale_rule, layer;
  fmkv_u64 seed;
  fmkv_i32 vectors, table;  // table: fmkv::codebook_table (0; 1 / 2 = format 3's 3-bit K / V levels)
  fmkv_i32 scale_group, reserved;  // fmkv_config.scale_group (0 / 32, or 64)
};

kernel void fmkv_core_test(device const fmkv_core_test_params& p [[buffer(0)]],
                           device const float* x [[buffer(1)]],
                           device float* sums [[buffer(2)]],
                           device float* rotated [[buffer(3)]],
                           device fmkv_u32* codes [[buffer(4)]],
                           device fmkv_u16* scales [[buffer(5)]],
                           device fmkv_u32* words [[buffer(6)]],
                           device float* gsums [[buffer(7)]],
                           uint tg [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint nsg [[simdgroups_per_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]]) {
  const fmkv_i64 vec = (fmkv_i64)tg * nsg + sg;
  if (vec >= p.vectors) return;
  const int d = p.head_dim, G = d / 32;
  float v[FMKV_METAL_GMAX];
  for (int g = 0; g < G; ++g) v[g] = x[vec * d + g * 32 + lane];
  for (int g = 0; g < G; ++g) sums[(vec * G + g) * 32 + lane] = fmkv_simd_tree_sum(v[g]);
  const int n = 1 << fmkv_scale_shift(p.scale_group);
  for (int g0 = 0; g0 < G; g0 += n) {
    gsums[(vec * G + g0) * 32 + lane] = fmkv_simd_scale_group_sum(v + g0, n);
    fmkv_u32 code[2];
    const fmkv_u16 scale = fmkv_quantize_scale_group_lanes_table(v + g0, n, p.bits, p.table, p.scale_rule, code);
    for (int h = 0; h < n; ++h) {
      const int g = g0 + h;
      codes[vec * d + g * 32 + lane] = code[h];
      fmkv_u32 w[FMKV_CODE_BITS_MAX];
      fmkv_pack_group_lanes(code[h], p.bits, w);
      for (int b = 0; b < p.bits; ++b)
        if ((int)lane == b) words[(vec * G + g) * FMKV_CODE_BITS_MAX + b] = w[b];
    }
    if (lane == 0u) scales[vec * G + g0] = scale;
  }
  fmkv_u64 sw[4];
  fmkv::rotation_sign_words(p.seed, p.layer, d, sw);
  fmkv_rotate_lanes(v, G, sw, fmkv_rotation_norm(d), lane);
  for (int g = 0; g < G; ++g) rotated[vec * d + g * 32 + lane] = v[g];
}

// fmkv Metal backend: single-source kernel logic (MSL, host emulator, CUDA) over src/format/portability.h.
//
// Execution model: a SIMD group of 32 lanes owns one head vector; lane `lane` holds coordinates
// i = g*32 + lane for g < G = d/32 (one code group per register g). So
//   * FWHT stages h = 1..16 are xor-shuffles between lanes, stages h = 32..d/2 are in-register, in
//     the order h = 1, 2, 4, ... of FORMAT.md §3;
//   * a group sum is the xor butterfly 16, 8, 4, 2, 1, which computes exactly tree_sum32 of
//     src/format/quantize_group.h in every lane (same pairwise sums; float addition is commutative);
//   * a scale group (fmkv_config.scale_group sg, FORMAT.md section 4; the parameter blocks carry it) is one
//     register (sg = 32) or the two registers 2s, 2s + 1 (sg = 64): its sums are the registers' butterfly sums
//     added in coordinate order (fmkv_simd_scale_group_sum), as quantize_scale_group_table adds its code
//     groups' tree_sum32 sums; code group g uses scale g >> fmkv_scale_shift(sg), written by lane 0;
//   * 2/3-bit codes: 1-bit planes are one ballot each, the 2-bit field plane is built from two
//     ballots; 4-bit codes: nibble words (format version 2) are built from four ballots; 5-bit codes:
//     the nibble words of the 4-bit magnitude from four ballots, the sign plane from a fifth;
//   * attention decodes the code of coordinate i in lane i mod 32 from broadcast code words.
// Format version 3, 3-bit sections (tile blocks of 16 token slots, FORMAT.md section 6; the parameter
// blocks carry fmkv_config.format_version): the quantizer uses table fmkv::codebook_table(version, 3, is_v)
// (integer levels x fp16 step, K and V differ) with the reference's comparisons (encode_value_table). The
// SIMD group of (token slot t, kv head, K|V) writes no whole word of the tile block: for each group g, lane j
// computes the 3 bit positions of its code (coordinate j of group g) with fmkv_tile_code_bit and replaces
// them with at most one atomic AND and one atomic OR per containing aligned uint32 word of the block
// (fmkv::tile_put_code_atomic; a uint16 Y word is the low or high half of such a word), because the other 15
// slots of the block may be written at the same time by other SIMD groups and threadgroups; lane 0 stores
// the scale group's fp16 scale. Attention: lane j of the SIMD group of a key loads the (one or two) uint32 words
// of the key's tile block that hold coordinate j's code of group g (fmkv::tile_get_code_words) and
// dequantizes it as decode_level_table x scale.
// Every arithmetic step of the quantizer mirrors src/format/quantize_group.h operation by operation
// (float32, no FMA: compile with fast math off / -ffp-contract=off). docs/FORMAT.md is normative;
// tests/metal/ checks bit-exactness against src/ref in the emulator.
#ifndef FMKV_METAL_KERNEL_CORE_H
#define FMKV_METAL_KERNEL_CORE_H

#include "../format/portability.h"
// The format's rules come from the one format core (layout, regions, rotation signs, codebook, code
// packing, number formats, the group quantizer's scale rules); this file adds only the SIMD-group
// forms of the hot steps and the kernel bodies.
#include "../../include/fmkv/format.h"
#include "../format/codebook.h"
#include "../format/numbers.h"
#include "../format/pack.h"
#include "../format/quantize_group.h"
#include "../format/rotation.h"
#include "../format/rows.h"
#include "params_msl.h"

#define FMKV_NEG_BIG (-3.0e38f)  // "minus infinity" of the online softmax (finite: fast-math safe)

// ---- small helpers ------------------------------------------------------------------------------------
FMKV_INLINE fmkv_i64 fmkv_min_i64(fmkv_i64 a, fmkv_i64 b) { return a < b ? a : b; }
FMKV_INLINE float fmkv_max_f32(float a, float b) { return a > b ? a : b; }

// Element idx of a tensor of dtype 0 f32 / 1 f16 / 2 bf16, as canonical fp16 bits (FORMAT.md "Input").
FMKV_INLINE fmkv_u16 fmkv_load_as_f16(FMKV_DEVICE const fmkv_u8* base, fmkv_i32 dtype, fmkv_i64 idx) {
  if (dtype == 1) return ((FMKV_DEVICE const fmkv_u16*)base)[idx];
  float x = dtype == 0 ? ((FMKV_DEVICE const float*)base)[idx]
                       : fmkv::bf16_to_f32(((FMKV_DEVICE const fmkv_u16*)base)[idx]);
  return fmkv::f32_to_f16(x);
}
FMKV_INLINE float fmkv_load_as_f32(FMKV_DEVICE const fmkv_u8* base, fmkv_i32 dtype, fmkv_i64 idx) {
  if (dtype == 0) return ((FMKV_DEVICE const float*)base)[idx];
  fmkv_u16 h = ((FMKV_DEVICE const fmkv_u16*)base)[idx];
  return dtype == 1 ? fmkv::f16_to_f32(h) : fmkv::bf16_to_f32(h);
}
FMKV_INLINE void fmkv_store_f32(FMKV_DEVICE fmkv_u8* base, fmkv_i32 dtype, fmkv_i64 idx, float v) {
  if (dtype == 0) ((FMKV_DEVICE float*)base)[idx] = v;
  else if (dtype == 1) ((FMKV_DEVICE fmkv_u16*)base)[idx] = fmkv::f32_to_f16(v);
  else ((FMKV_DEVICE fmkv_u16*)base)[idx] = fmkv::f32_to_bf16(v);
}

// ---- SIMD-group primitives (all 32 lanes must call them together) ---------------------------------
// xor butterfly 16, 8, 4, 2, 1 == tree_sum32 (src/format/quantize_group.h) in every lane.
FMKV_INLINE float fmkv_simd_tree_sum(float x) {
  x = x + FMKV_SHUFFLE_XOR(x, 16);
  x = x + FMKV_SHUFFLE_XOR(x, 8);
  x = x + FMKV_SHUFFLE_XOR(x, 4);
  x = x + FMKV_SHUFFLE_XOR(x, 2);
  x = x + FMKV_SHUFFLE_XOR(x, 1);
  return x;
}

// Sum over a scale group of n code groups (n = 1 << fmkv_scale_shift(sg): 1 or 2), v[h] = the lane's value of
// code group h: the code groups' butterfly sums (tree_sum32 each) added in coordinate order, h = 0 first, as
// quantize_scale_group_table (src/format/quantize_group.h) forms its sums; the same in every lane.
FMKV_INLINE float fmkv_simd_scale_group_sum(FMKV_THREAD const float* v, int n) {
  float s = fmkv_simd_tree_sum(v[0]);
  for (int h = 1; h < n; ++h) s = s + fmkv_simd_tree_sum(v[h]);
  return s;
}

// Unnormalised FWHT of the d = 32*G values held as v[g] = coordinate g*32 + lane; stage order
// h = 1, 2, ..., d/2, each pair (a at the lower index, b at the higher) -> (a + b, a - b).
FMKV_INLINE void fmkv_fwht_lanes(FMKV_THREAD float* v, int G, fmkv_u32 lane) {
  for (fmkv_u32 h = 1; h < 32u; h <<= 1) {
    for (int g = 0; g < G; ++g) {
      float o = FMKV_SHUFFLE_XOR(v[g], h);
      v[g] = (lane & h) ? o - v[g] : v[g] + o;
    }
  }
  for (int hg = 1; hg < G; hg <<= 1) {
    for (int g = 0; g < G; ++g) {
      if ((g & hg) == 0) {
        float a = v[g], b = v[g + hg];
        v[g] = a + b;
        v[g + hg] = a - b;
      }
    }
  }
}

// y = H diag(s) x / sqrt(d), bit-exact (FORMAT.md §3).
FMKV_INLINE void fmkv_rotate_lanes(FMKV_THREAD float* v, int G, FMKV_THREAD const fmkv_u64* words, float norm,
                                   fmkv_u32 lane) {
  for (int g = 0; g < G; ++g)
    if (fmkv::sign_negative(words, g * 32 + (int)lane)) v[g] = -v[g];
  fmkv_fwht_lanes(v, G, lane);
  for (int g = 0; g < G; ++g) v[g] = v[g] * norm;
}
// x = diag(s) H y / sqrt(d) (inverse rotation; attention output, not part of the format).
FMKV_INLINE void fmkv_unrotate_lanes(FMKV_THREAD float* v, int G, FMKV_THREAD const fmkv_u64* words, float norm,
                                     fmkv_u32 lane) {
  fmkv_fwht_lanes(v, G, lane);
  for (int g = 0; g < G; ++g) {
    v[g] = v[g] * norm;
    if (fmkv::sign_negative(words, g * 32 + (int)lane)) v[g] = -v[g];
  }
}

// quantize_scale_group_table (src/format/quantize_group.h) of one scale group of n code groups (n = 1 <<
// fmkv_scale_shift(sg): 1, or 2 with scale group 64), lane j holding y[h] = coordinate 32 h + j of the scale
// group (the lane's register of code group h), with codebook `table` (fmkv::codebook_table: 0 = the fp16
// Lloyd-Max levels, 1 / 2 = format 3's integer levels of 3-bit K / V): code[h] = the lane's code in code group
// h; returns the fp16 bits of the scale group's stored scale (identical in every lane). The sums of the scale
// rules are fmkv_simd_scale_group_sum's (the reference's order); the products are rounded before the butterfly
// adds them (FMKV_MUL_RN: never an FMA), as in tree_sum32; the code is encode_value_table's (a value equal to a
// threshold takes the smaller magnitude).
FMKV_INLINE fmkv_u16 fmkv_quantize_scale_group_lanes_table(FMKV_THREAD const float* y, int n, int bits, int table,
                                                           int scale_rule, FMKV_THREAD fmkv_u32* code) {
  float sq[2], num[2], den[2];
  for (int h = 0; h < n; ++h) sq[h] = FMKV_MUL_RN(y[h], y[h]);
  const fmkv_u16 s0 = fmkv::rms_scale(fmkv_simd_scale_group_sum(sq, n), 32 * n);
  const float s0f = fmkv::f16_to_f32(s0);
  if (s0f == 0.0f) {  // uniform across the SIMD group
    for (int h = 0; h < n; ++h) code[h] = 0u;
    return 0;
  }
  for (int h = 0; h < n; ++h) code[h] = fmkv::encode_value_table(y[h] / s0f, bits, table);
  if (scale_rule == FMKV_SCALE_RMS) return s0;
  for (int h = 0; h < n; ++h) {
    const float l = fmkv::decode_level_table(code[h], bits, table);
    num[h] = FMKV_MUL_RN(y[h], l);
    den[h] = FMKV_MUL_RN(l, l);
  }
  const float sn = fmkv_simd_scale_group_sum(num, n), sd = fmkv_simd_scale_group_sum(den, n);
  return fmkv::lsq_scale(sn, sd);
}
// One code group with its own scale (quantize_group_table; scale group 32): returns lane j's code of y_j;
// *scale = fp16 bits of the group's stored scale.
FMKV_INLINE fmkv_u32 fmkv_quantize_group_lane_table(float y, int bits, int table, int scale_rule,
                                                    FMKV_THREAD fmkv_u16* scale) {
  fmkv_u32 code;
  *scale = fmkv_quantize_scale_group_lanes_table(&y, 1, bits, table, scale_rule, &code);
  return code;
}
// The same with table 0 (every width of format 2).
FMKV_INLINE fmkv_u32 fmkv_quantize_group_lane(float y, int bits, int scale_rule, FMKV_THREAD fmkv_u16* scale) {
  return fmkv_quantize_group_lane_table(y, bits, 0, scale_rule, scale);
}

// Bits 0..7 of x spread to bits 0, 4, ..., 28 (bit k -> bit 4k): one bit of 8 nibbles.
FMKV_INLINE fmkv_u32 fmkv_spread_nibbles(fmkv_u32 x) {
  x &= 0xffu;
  x = (x | (x << 12)) & 0x000f000fu;
  x = (x | (x << 6)) & 0x03030303u;
  x = (x | (x << 3)) & 0x11111111u;
  return x;
}

// Code words of one group (FORMAT.md §6) from each lane's code; w[0..bits-1] (w holds FMKV_CODE_BITS_MAX
// words), same in every lane. bits 2, 3: magnitude planes / field plane and the sign plane; bits 4: nibble
// words of the whole code; bits 5: nibble words of the 4-bit magnitude (at the positions of a 4-bit code)
// and the sign plane.
FMKV_INLINE void fmkv_pack_group_lanes(fmkv_u32 code, int bits, FMKV_THREAD fmkv_u32* w) {
  if (bits >= 4) {  // uniform: nibble word k = nibbles of coordinates 8k..8k+7, coordinate j at 4*(j & 7)
    const fmkv_u32 nib = code & 15u;  // bits 4: the whole code (sign in bit 3); bits 5: the magnitude
    fmkv_u32 c0 = FMKV_BALLOT((nib & 1u) != 0u);
    fmkv_u32 c1 = FMKV_BALLOT((nib & 2u) != 0u);
    fmkv_u32 c2 = FMKV_BALLOT((nib & 4u) != 0u);
    fmkv_u32 c3 = FMKV_BALLOT((nib & 8u) != 0u);
    for (fmkv_u32 k = 0; k < 4u; ++k) {
      fmkv_u32 s = 8u * k;
      w[k] = fmkv_spread_nibbles(c0 >> s) | (fmkv_spread_nibbles(c1 >> s) << 1) |
             (fmkv_spread_nibbles(c2 >> s) << 2) | (fmkv_spread_nibbles(c3 >> s) << 3);
    }
    if (bits == 5) w[4] = FMKV_BALLOT(((code >> 4) & 1u) != 0u);  // the sign plane is the last word
    return;
  }
  fmkv_u32 m = code & ((1u << (bits - 1)) - 1u);
  fmkv_u32 sign_plane = FMKV_BALLOT(((code >> (bits - 1)) & 1u) != 0u);
  fmkv_u32 b0 = FMKV_BALLOT((m & 1u) != 0u);
  if (bits == 2) {
    w[0] = b0;
    w[1] = sign_plane;
    return;
  }
  fmkv_u32 b1 = FMKV_BALLOT(((m >> 1) & 1u) != 0u);
  fmkv_u32 f0 = 0u, f1 = 0u;
  for (fmkv_u32 j = 0; j < 32u; ++j) {
    fmkv_u32 field = (((b0 >> j) & 1u) | (((b1 >> j) & 1u) << 1)) << fmkv_field_shift((int32_t)j);
    if (fmkv_field_word((int32_t)j) == 0) f0 |= field;
    else f1 |= field;
  }
  w[0] = f0;
  w[1] = f1;
  w[2] = sign_plane;  // bits == 3
}

// Dequantized rotated values (or fp16 values, bits == 16) of token slot t of the K (is_v = 0) or V section
// of a cache in format `version` (resolved: 2 or 3) and scale group `sg` (fmkv_config.scale_group as given),
// lane layout: lane reads coordinate g*32 + lane of every group g, with scale g >> fmkv_scale_shift(sg).
// Code words (format 2, and 2-, 4- and 5-bit codes of format 3): unpack_code from the group's words.
// Tile blocks (3-bit codes of format 3): the lane loads the (at most two) aligned uint32 words of its tile
// block that hold its code's three bits (tile_get_code_words); level = decode_level_table with the
// section's table (signed integer level x fp16 step, exact in float32), times the fp16 scale.
FMKV_INLINE void fmkv_load_section_lanes_fmt(FMKV_DEVICE const fmkv_u8* section, int bits, fmkv_i32 version, int is_v,
                                             fmkv_i32 sg, fmkv_i32 d, fmkv_i32 P, fmkv_i32 t, fmkv_u32 lane,
                                             FMKV_THREAD float* out) {
  int G = d / 32;
  const fmkv_i32 ssh = fmkv_scale_shift(sg);
  if (bits == 16) {
    FMKV_DEVICE const fmkv_u16* vals = (FMKV_DEVICE const fmkv_u16*)section + (fmkv_i64)t * d;
    for (int g = 0; g < G; ++g) out[g] = fmkv::f16_to_f32(vals[g * 32 + (int)lane]);
    return;
  }
  FMKV_DEVICE const fmkv_u16* scales = (FMKV_DEVICE const fmkv_u16*)(section + fmkv_scales_offset(d, bits, P));
  const int table = fmkv::codebook_table(version, bits, is_v);
  if (fmkv_tiled_codes(version, bits)) {  // uniform per kernel
    FMKV_DEVICE const fmkv_u32* block = (FMKV_DEVICE const fmkv_u32*)(section + fmkv_tile_block_offset(d, t));
    for (int g = 0; g < G; ++g) {
      fmkv_u32 code = fmkv::tile_get_code_words(block, G, is_v, t & 15, g, (int32_t)lane);
      out[g] = fmkv::decode_level_table(code, bits, table) * fmkv::f16_to_f32(scales[(fmkv_i64)(g >> ssh) * P + t]);
    }
    return;
  }
  FMKV_DEVICE const fmkv_u32* words = (FMKV_DEVICE const fmkv_u32*)section;
  for (int g = 0; g < G; ++g) {
    fmkv_u32 code = fmkv::unpack_code(words + fmkv_code_word_index(bits, P, g, 0, t), P, bits, (int32_t)lane);
    out[g] = fmkv::decode_level_table(code, bits, table) * fmkv::f16_to_f32(scales[(fmkv_i64)(g >> ssh) * P + t]);
  }
}
// The same for format 2 and the default scale group.
FMKV_INLINE void fmkv_load_section_lanes(FMKV_DEVICE const fmkv_u8* section, int bits, fmkv_i32 d, fmkv_i32 P,
                                         fmkv_i32 t, fmkv_u32 lane, FMKV_THREAD float* out) {
  fmkv_load_section_lanes_fmt(section, bits, 2, 0, 0, d, P, t, lane, out);
}

// Online softmax: fold score sc with value vector v (lane layout) into (m, l, acc).
FMKV_INLINE void fmkv_softmax_update(FMKV_THREAD float* m, FMKV_THREAD float* l, FMKV_THREAD float* acc,
                                     FMKV_THREAD const float* v, int G, float sc) {
  float mn = fmkv_max_f32(*m, sc);
  float corr = FMKV_EXP(*m - mn), pw = FMKV_EXP(sc - mn);
  *l = *l * corr + pw;
  for (int g = 0; g < G; ++g) acc[g] = acc[g] * corr + pw * v[g];
  *m = mn;
}

// ================================================================================================
// Whole-kernel bodies. The .metal kernels (and the MLX bodies in python/fmkv/mlx/kernels.py, and the
// CUDA tests) are thin wrappers: they declare threadgroup arrays and pass thread ids.
// The SIMD-group kernels come in two forms: fmkv_*_spec takes head_dim D and the bit widths KB, VB
// as arguments that the caller may pass as compile-time constants (the MLX bodies pass template
// arguments: loops over groups and queries then unroll and per-lane arrays stay in registers); a
// launch whose constants differ from the parameter block refuses to run (FMKV_METAL_ERR_LAUNCH).
// fmkv_*_impl passes the parameter block's own values.
// ================================================================================================

// quantize-append, pass 1: compress the tokens that enter [S, E) in this call. One SIMD group per
// (packed row r, kv head h, K|V): row r = row0 + j of sequence s compresses position E_old + j
// when that is < E_new; its source is the new row itself (position >= len0) or the fp16 window
// ring slot (position < len0; pass 2 overwrites the ring afterwards). Needs full SIMD groups.
FMKV_INLINE void fmkv_append_compress_spec(
    FMKV_DEVICE const fmkv_metal_append_params& p, FMKV_DEVICE fmkv_u8* pages,
    FMKV_DEVICE const fmkv_u16* fp16_k, FMKV_DEVICE const fmkv_u16* fp16_v, FMKV_DEVICE const fmkv_u8* k,
    FMKV_DEVICE const fmkv_u8* v, FMKV_DEVICE const fmkv_i64* seq_lens, FMKV_DEVICE const fmkv_i64* row_offsets,
    FMKV_DEVICE const fmkv_i32* block_table, FMKV_DEVICE const fmkv_i32* slots, FMKV_DEVICE fmkv_u32* status,
    fmkv_u32 tg, fmkv_u32 sg, fmkv_u32 nsg, fmkv_u32 lane, fmkv_u32 threads, const fmkv_i32 D, const int KB,
    const int VB) {
  if ((threads & 31u) != 0u || D != p.head_dim || KB != p.k_bits || VB != p.v_bits) {
    status[1] = FMKV_METAL_ERR_LAUNCH;
    return;
  }
  const fmkv_i32 H = p.num_kv_heads, d = D, G = d / 32, S = p.sink_tokens, W = p.window_tokens,
                 P = p.page_size;
  const fmkv_i64 item = (fmkv_i64)tg * nsg + sg;
  if (item >= p.total_rows * H * 2) return;
  const int is_v = (int)(item & 1);
  const fmkv_i32 h = (fmkv_i32)((item >> 1) % H);
  const fmkv_i64 r = (item >> 1) / H;
  const fmkv_i32 s = fmkv::seq_of_row(row_offsets, p.num_seqs, r);
  const fmkv_i64 row0 = row_offsets[s], n = row_offsets[s + 1] - row0, len0 = seq_lens[s];
  const fmkv_i64 e_old = fmkv_compressed_end(S, W, len0), e_new = fmkv_compressed_end(S, W, len0 + n);
  const fmkv_i64 q = e_old + (r - row0);
  if (q >= e_new) return;
  const fmkv_i64 ci = q - S;
  const fmkv_i32 page = block_table[(fmkv_i64)s * p.block_table_stride + ci / P];
  if (page < 0 || (fmkv_i64)page >= p.num_pages) {
    status[0] = FMKV_METAL_ERR_BLOCK_TABLE;
    return;
  }
  const fmkv_i32 t = (fmkv_i32)(ci % P);
  const int bits = is_v ? VB : KB;
  fmkv_u16 xh[FMKV_METAL_GMAX];
  if (q >= len0) {
    FMKV_DEVICE const fmkv_u8* src = is_v ? v : k;
    const fmkv_i64 base = (row0 + (q - len0)) * (is_v ? p.v_row_stride : p.k_row_stride) +
                          (fmkv_i64)h * (is_v ? p.v_head_stride : p.k_head_stride);
    for (int g = 0; g < G; ++g) xh[g] = fmkv_load_as_f16(src, is_v ? p.v_dtype : p.k_dtype, base + g * 32 + lane);
  } else {
    FMKV_DEVICE const fmkv_u16* region = is_v ? fp16_v : fp16_k;
    const fmkv_i64 slot = p.has_slots ? slots[s] : 0;
    const fmkv_i64 off = fmkv_fp16_offset(H, S + W, d, slot, h, fmkv_fp16_row(S, W, q));
    for (int g = 0; g < G; ++g) xh[g] = region[off + g * 32 + lane];
  }
  FMKV_DEVICE fmkv_u8* section =
      pages + (fmkv_i64)page * p.page_bytes + fmkv_section_offset(d, KB, VB, P, h, is_v, p.scale_group);
  if (bits == 16) {  // K kept in fp16, unrotated
    FMKV_DEVICE fmkv_u16* dst = (FMKV_DEVICE fmkv_u16*)section + (fmkv_i64)t * d;
    for (int g = 0; g < G; ++g) dst[g * 32 + lane] = xh[g];
    return;
  }
  fmkv_u64 sw[4];
  fmkv::rotation_sign_words(p.seed, p.layer, d, sw);
  float y[FMKV_METAL_GMAX];
  for (int g = 0; g < G; ++g) y[g] = fmkv::f16_to_f32(xh[g]);
  fmkv_rotate_lanes(y, G, sw, fmkv_rotation_norm(d), lane);
  FMKV_DEVICE fmkv_u32* words = (FMKV_DEVICE fmkv_u32*)section;
  FMKV_DEVICE fmkv_u16* scales = (FMKV_DEVICE fmkv_u16*)(section + fmkv_scales_offset(d, bits, P));
  const fmkv_i32 version = fmkv_resolved_format_version(p.format_version);
  const int table = fmkv::codebook_table(version, bits, is_v);
  const fmkv_i32 ssh = fmkv_scale_shift(p.scale_group), ns = 1 << ssh;  // code groups per scale group
  const int tiled = fmkv_tiled_codes(version, bits);                      // uniform per SIMD group
  // Tile blocks: lane j writes its own code (coordinate j of group g) of slot t with atomic AND / OR on the words
  // holding its bits; the block's other 15 tokens may be written concurrently by other SIMD groups (this
  // dispatch) and keep their bits.
  FMKV_DEVICE fmkv_u32* block = (FMKV_DEVICE fmkv_u32*)(section + fmkv_tile_block_offset(d, t));
  for (int g0 = 0; g0 < G; g0 += ns) {  // one scale group: code groups g0 .. g0 + ns - 1
    fmkv_u32 code[2];
    const fmkv_u16 scale = fmkv_quantize_scale_group_lanes_table(y + g0, ns, bits, table, p.scale_rule, code);
    for (int gi = 0; gi < ns; ++gi) {
      const int g = g0 + gi;
      if (tiled) {
        fmkv::tile_put_code_atomic(block, G, is_v, t & 15, g, (int32_t)lane, code[gi]);
        continue;
      }
      fmkv_u32 w[FMKV_CODE_BITS_MAX];
      fmkv_pack_group_lanes(code[gi], bits, w);
      for (int b = 0; b < bits; ++b)
        if ((int)lane == b) words[fmkv_code_word_index(bits, P, g, b, t)] = w[b];
    }
    if (lane == 0u) scales[(fmkv_i64)(g0 >> ssh) * P + t] = scale;
  }
}
FMKV_INLINE void fmkv_append_compress_impl(
    FMKV_DEVICE const fmkv_metal_append_params& p, FMKV_DEVICE fmkv_u8* pages,
    FMKV_DEVICE const fmkv_u16* fp16_k, FMKV_DEVICE const fmkv_u16* fp16_v, FMKV_DEVICE const fmkv_u8* k,
    FMKV_DEVICE const fmkv_u8* v, FMKV_DEVICE const fmkv_i64* seq_lens, FMKV_DEVICE const fmkv_i64* row_offsets,
    FMKV_DEVICE const fmkv_i32* block_table, FMKV_DEVICE const fmkv_i32* slots, FMKV_DEVICE fmkv_u32* status,
    fmkv_u32 tg, fmkv_u32 sg, fmkv_u32 nsg, fmkv_u32 lane, fmkv_u32 threads) {
  fmkv_append_compress_spec(p, pages, fp16_k, fp16_v, k, v, seq_lens, row_offsets, block_table, slots, status, tg,
                            sg, nsg, lane, threads, p.head_dim, p.k_bits, p.v_bits);
}

// quantize-append, pass 2 (after pass 1): write the new tokens' fp16 sink / window-ring entries.
// One thread per element (row, kv head, K|V, i); any threadgroup size, partial SIMD groups fine.
FMKV_INLINE void fmkv_append_fp16_impl(FMKV_DEVICE const fmkv_metal_append_params& p, FMKV_DEVICE fmkv_u16* fp16_k,
                                       FMKV_DEVICE fmkv_u16* fp16_v, FMKV_DEVICE const fmkv_u8* k,
                                       FMKV_DEVICE const fmkv_u8* v, FMKV_DEVICE const fmkv_i64* seq_lens,
                                       FMKV_DEVICE const fmkv_i64* row_offsets, FMKV_DEVICE const fmkv_i32* slots,
                                       fmkv_u32 gid) {
  const fmkv_i32 H = p.num_kv_heads, d = p.head_dim, S = p.sink_tokens, W = p.window_tokens;
  const fmkv_i64 total = p.total_rows * H * 2 * d;
  if ((fmkv_i64)gid >= total) return;
  const fmkv_i64 i = (fmkv_i64)gid % d, rest = (fmkv_i64)gid / d;
  const int is_v = (int)(rest & 1);
  const fmkv_i32 h = (fmkv_i32)((rest >> 1) % H);
  const fmkv_i64 r = (rest >> 1) / H;
  const fmkv_i32 s = fmkv::seq_of_row(row_offsets, p.num_seqs, r);
  const fmkv_i64 row0 = row_offsets[s], n = row_offsets[s + 1] - row0, len0 = seq_lens[s];
  const fmkv_i64 pos = len0 + (r - row0);
  fmkv_i64 rslot;
  if (pos < S) rslot = pos;
  else if (W > 0 && pos >= len0 + n - W) rslot = fmkv_fp16_row(S, W, pos);
  else return;  // compressed (pass 1), or overwritten later in this call
  const fmkv_i64 slot = p.has_slots ? slots[s] : 0;
  FMKV_DEVICE fmkv_u16* region = is_v ? fp16_v : fp16_k;
  const fmkv_i64 src = r * (is_v ? p.v_row_stride : p.k_row_stride) +
                       (fmkv_i64)h * (is_v ? p.v_head_stride : p.k_head_stride) + i;
  region[fmkv_fp16_offset(H, S + W, d, slot, h, rslot) + i] = fmkv_load_as_f16(is_v ? v : k, is_v ? p.v_dtype : p.k_dtype, src);
}

// Workspace of decode attention (floats): [NQI * parts][2] (m, l) then [NQI * parts][d] acc,
// NQI = num_seqs * H * tiles * QTILE query items.
FMKV_INLINE fmkv_i64 fmkv_attention_items(FMKV_DEVICE const fmkv_metal_attention_params& p) {
  return (fmkv_i64)p.num_seqs * p.num_kv_heads * p.tiles * FMKV_METAL_QTILE;
}

// decode attention, pass 1. Threadgroup (sequence s, kv head h, query tile, key split c); its
// SIMD group w takes keys lo + w, lo + w + nsg, ... of the split and writes partial state
// (m, l, acc) number c * nsg + w of each query of the tile. Scores use the rotated query for
// rotated keys and the raw query for fp16 keys; values are accumulated in the rotated domain
// (fp16 window / sink values are rotated on load). q_rot, q_raw: threadgroup [QTILE * 256].
FMKV_INLINE void fmkv_attention_partial_spec(
    FMKV_DEVICE const fmkv_metal_attention_params& p, FMKV_DEVICE const fmkv_u8* pages,
    FMKV_DEVICE const fmkv_u16* fp16_k, FMKV_DEVICE const fmkv_u16* fp16_v, FMKV_DEVICE const fmkv_u8* q,
    FMKV_DEVICE const fmkv_i64* seq_lens, FMKV_DEVICE const fmkv_i64* row_offsets,
    FMKV_DEVICE const fmkv_i32* block_table, FMKV_DEVICE const fmkv_i32* slots, FMKV_DEVICE float* ws,
    FMKV_DEVICE fmkv_u32* status, FMKV_THREADGROUP float* q_rot, FMKV_THREADGROUP float* q_raw, fmkv_u32 tg,
    fmkv_u32 sg, fmkv_u32 nsg, fmkv_u32 lane, fmkv_u32 threads, const fmkv_i32 D, const int KB, const int VB) {
  if ((threads & 31u) != 0u || D != p.head_dim || KB != p.k_bits || VB != p.v_bits) {
    status[1] = FMKV_METAL_ERR_LAUNCH;
    return;
  }
  const fmkv_i32 H = p.num_kv_heads, d = D, G = d / 32, S = p.sink_tokens, W = p.window_tokens,
                 P = p.page_size, group = p.q_heads / p.num_kv_heads;
  fmkv_i64 rest = tg;
  const fmkv_i32 c = (fmkv_i32)(rest % p.num_splits);
  rest /= p.num_splits;
  const fmkv_i32 tile = (fmkv_i32)(rest % p.tiles);
  rest /= p.tiles;
  const fmkv_i32 h = (fmkv_i32)(rest % H);
  const fmkv_i32 s = (fmkv_i32)(rest / H);
  if (s >= p.num_seqs) return;
  const fmkv_i64 row0 = row_offsets[s], n = row_offsets[s + 1] - row0, len = seq_lens[s];
  const fmkv_i64 nquery = n * group, qbase = (fmkv_i64)tile * FMKV_METAL_QTILE;
  if (qbase >= nquery) return;  // whole threadgroup: nothing of this tile exists
  const int nq = (int)fmkv_min_i64(FMKV_METAL_QTILE, nquery - qbase);
  const fmkv_i64 e = fmkv_compressed_end(S, W, len);
  const fmkv_i64 slot = p.has_slots ? slots[s] : 0;
  const fmkv_i32 version = fmkv_resolved_format_version(p.format_version);
  fmkv_u64 sw[4];
  fmkv::rotation_sign_words(p.seed, p.layer, d, sw);
  const float norm = fmkv_rotation_norm(d);

  // Queries of the tile: raw and rotated, into threadgroup memory.
  for (int qt = (int)sg; qt < nq; qt += (int)nsg) {
    const fmkv_i64 qi = qbase + qt, row = row0 + qi / group;
    const fmkv_i32 hq = h * group + (fmkv_i32)(qi % group);
    float x[FMKV_METAL_GMAX];
    for (int g = 0; g < G; ++g) {
      x[g] = fmkv_load_as_f32(q, p.q_dtype, row * p.q_row_stride + (fmkv_i64)hq * p.q_head_stride + g * 32 + lane);
      q_raw[qt * 256 + g * 32 + (int)lane] = x[g];
    }
    fmkv_rotate_lanes(x, G, sw, norm, lane);
    for (int g = 0; g < G; ++g) q_rot[qt * 256 + g * 32 + (int)lane] = x[g];
  }
  FMKV_TG_BARRIER();

  fmkv_i64 qpos[FMKV_METAL_QTILE];
  float m[FMKV_METAL_QTILE], l[FMKV_METAL_QTILE], acc[FMKV_METAL_QTILE][FMKV_METAL_GMAX];
  for (int qt = 0; qt < FMKV_METAL_QTILE; ++qt) {
    qpos[qt] = len - n + (qbase + qt) / group;
    m[qt] = FMKV_NEG_BIG;
    l[qt] = 0.0f;
    for (int g = 0; g < FMKV_METAL_GMAX; ++g) acc[qt][g] = 0.0f;
  }
  const fmkv_i64 lo = (fmkv_i64)c * p.split_len, hi = fmkv_min_i64(lo + p.split_len, len);
  for (fmkv_i64 kp = lo + sg; kp < hi; kp += nsg) {  // uniform per SIMD group
    const bool comp = kp >= S && kp < e;
    float kv[FMKV_METAL_GMAX], vv[FMKV_METAL_GMAX];
    bool k_rot = false;
    FMKV_DEVICE const fmkv_u8* base = pages;
    fmkv_i32 t = 0;
    fmkv_i64 off = 0;
    if (comp) {
      const fmkv_i64 ci = kp - S;
      const fmkv_i32 page = block_table[(fmkv_i64)s * p.block_table_stride + ci / P];
      if (page < 0 || (fmkv_i64)page >= p.num_pages) {
        status[0] = FMKV_METAL_ERR_BLOCK_TABLE;
        continue;
      }
      t = (fmkv_i32)(ci % P);
      base = pages + (fmkv_i64)page * p.page_bytes;
      fmkv_load_section_lanes_fmt(base + fmkv_section_offset(d, KB, VB, P, h, 0, p.scale_group), KB, version, 0,
                                  p.scale_group, d, P, t, lane, kv);
      k_rot = KB != 16;
    } else {
      off = fmkv_fp16_offset(H, S + W, d, slot, h, fmkv_fp16_row(S, W, kp));
      for (int g = 0; g < G; ++g) kv[g] = fmkv::f16_to_f32(fp16_k[off + g * 32 + lane]);
    }
    FMKV_THREADGROUP const float* qq = k_rot ? q_rot : q_raw;
    float sc[FMKV_METAL_QTILE];
    for (int qt = 0; qt < FMKV_METAL_QTILE; ++qt) {  // constant trip count: sc, m, l, acc in registers
      sc[qt] = 0.0f;
      if (qt >= nq) continue;  // uniform per SIMD group
      float part = 0.0f;
      for (int g = 0; g < G; ++g) part = part + qq[qt * 256 + g * 32 + (int)lane] * kv[g];
      float x = fmkv_simd_tree_sum(part) * p.softmax_scale;
      if (p.softcap > 0.0f) x = p.softcap * FMKV_TANH(x / p.softcap);
      sc[qt] = x;
    }
    if (comp) {
      fmkv_load_section_lanes_fmt(base + fmkv_section_offset(d, KB, VB, P, h, 1, p.scale_group), VB, version, 1,
                                  p.scale_group, d, P, t, lane, vv);
    } else {
      for (int g = 0; g < G; ++g) vv[g] = fmkv::f16_to_f32(fp16_v[off + g * 32 + lane]);
      fmkv_rotate_lanes(vv, G, sw, norm, lane);
    }
    for (int qt = 0; qt < FMKV_METAL_QTILE; ++qt)
      if (qt < nq && kp <= qpos[qt]) fmkv_softmax_update(&m[qt], &l[qt], acc[qt], vv, G, sc[qt]);
  }
  const fmkv_i64 nqi = fmkv_attention_items(p);
  const fmkv_i64 item0 = (((fmkv_i64)s * H + h) * p.tiles + tile) * FMKV_METAL_QTILE;
  const fmkv_i32 part = c * (fmkv_i32)nsg + (fmkv_i32)sg;
  for (int qt = 0; qt < FMKV_METAL_QTILE; ++qt) {
    if (qt >= nq) continue;
    const fmkv_i64 idx = (item0 + qt) * p.parts + part;
    if (lane == 0u) {
      ws[idx * 2] = m[qt];
      ws[idx * 2 + 1] = l[qt];
    }
    FMKV_DEVICE float* a = ws + nqi * p.parts * 2 + idx * d;
    for (int g = 0; g < G; ++g) a[g * 32 + lane] = acc[qt][g];
  }
}
FMKV_INLINE void fmkv_attention_partial_impl(
    FMKV_DEVICE const fmkv_metal_attention_params& p, FMKV_DEVICE const fmkv_u8* pages,
    FMKV_DEVICE const fmkv_u16* fp16_k, FMKV_DEVICE const fmkv_u16* fp16_v, FMKV_DEVICE const fmkv_u8* q,
    FMKV_DEVICE const fmkv_i64* seq_lens, FMKV_DEVICE const fmkv_i64* row_offsets,
    FMKV_DEVICE const fmkv_i32* block_table, FMKV_DEVICE const fmkv_i32* slots, FMKV_DEVICE float* ws,
    FMKV_DEVICE fmkv_u32* status, FMKV_THREADGROUP float* q_rot, FMKV_THREADGROUP float* q_raw, fmkv_u32 tg,
    fmkv_u32 sg, fmkv_u32 nsg, fmkv_u32 lane, fmkv_u32 threads) {
  fmkv_attention_partial_spec(p, pages, fp16_k, fp16_v, q, seq_lens, row_offsets, block_table, slots, ws, status,
                              q_rot, q_raw, tg, sg, nsg, lane, threads, p.head_dim, p.k_bits, p.v_bits);
}

// decode attention, pass 2: one SIMD group per query item merges its `parts` partial states,
// normalises, rotates back and stores out[row][hq] in the output dtype. With p.has_lse, lane 0 also
// stores lse[row][hq] = mx + log(lsum), the natural log of the softmax denominator (the partial states'
// m are scaled scores and FMKV_EXP is exp: natural-log units), of exactly the mx and lsum the output
// is divided by (fmkv_attention_lse). Needs full SIMD groups.
FMKV_INLINE void fmkv_attention_merge_spec(FMKV_DEVICE const fmkv_metal_attention_params& p,
                                           FMKV_DEVICE const fmkv_i64* row_offsets, FMKV_DEVICE const float* ws,
                                           FMKV_DEVICE fmkv_u8* out, FMKV_DEVICE float* lse,
                                           FMKV_DEVICE fmkv_u32* status, fmkv_u32 tg, fmkv_u32 sg, fmkv_u32 nsg,
                                           fmkv_u32 lane, fmkv_u32 threads, const fmkv_i32 D) {
  if ((threads & 31u) != 0u || D != p.head_dim) {
    status[1] = FMKV_METAL_ERR_LAUNCH;
    return;
  }
  const fmkv_i32 H = p.num_kv_heads, d = D, G = d / 32, group = p.q_heads / p.num_kv_heads;
  const fmkv_i64 nqi = fmkv_attention_items(p), item = (fmkv_i64)tg * nsg + sg;
  if (item >= nqi) return;
  fmkv_i64 rest = item;
  const fmkv_i32 qt = (fmkv_i32)(rest % FMKV_METAL_QTILE);
  rest /= FMKV_METAL_QTILE;
  const fmkv_i32 tile = (fmkv_i32)(rest % p.tiles);
  rest /= p.tiles;
  const fmkv_i32 h = (fmkv_i32)(rest % H);
  const fmkv_i32 s = (fmkv_i32)(rest / H);
  const fmkv_i64 row0 = row_offsets[s], n = row_offsets[s + 1] - row0;
  const fmkv_i64 qi = (fmkv_i64)tile * FMKV_METAL_QTILE + qt;
  if (qi >= n * group) return;
  float mx = FMKV_NEG_BIG;
  for (fmkv_i32 k = 0; k < p.parts; ++k) mx = fmkv_max_f32(mx, ws[(item * p.parts + k) * 2]);
  float lsum = 0.0f, o[FMKV_METAL_GMAX];
  for (int g = 0; g < G; ++g) o[g] = 0.0f;
  for (fmkv_i32 k = 0; k < p.parts; ++k) {
    const fmkv_i64 idx = item * p.parts + k;
    const float w = FMKV_EXP(ws[idx * 2] - mx);
    lsum = lsum + ws[idx * 2 + 1] * w;
    FMKV_DEVICE const float* a = ws + nqi * p.parts * 2 + idx * d;
    for (int g = 0; g < G; ++g) o[g] = o[g] + a[g * 32 + lane] * w;
  }
  for (int g = 0; g < G; ++g) o[g] = o[g] / lsum;
  const fmkv_i64 row = row0 + qi / group;
  const fmkv_i32 hq = h * group + (fmkv_i32)(qi % group);
  if (p.has_lse != 0 && lane == 0u)
    lse[row * p.lse_row_stride + (fmkv_i64)hq * p.lse_head_stride] = mx + FMKV_LOG(lsum);
  fmkv_u64 sw[4];
  fmkv::rotation_sign_words(p.seed, p.layer, d, sw);
  fmkv_unrotate_lanes(o, G, sw, fmkv_rotation_norm(d), lane);
  for (int g = 0; g < G; ++g)
    fmkv_store_f32(out, p.out_dtype, row * p.out_row_stride + (fmkv_i64)hq * p.out_head_stride + g * 32 + lane, o[g]);
}
FMKV_INLINE void fmkv_attention_merge_impl(FMKV_DEVICE const fmkv_metal_attention_params& p,
                                           FMKV_DEVICE const fmkv_i64* row_offsets, FMKV_DEVICE const float* ws,
                                           FMKV_DEVICE fmkv_u8* out, FMKV_DEVICE float* lse,
                                           FMKV_DEVICE fmkv_u32* status, fmkv_u32 tg, fmkv_u32 sg, fmkv_u32 nsg,
                                           fmkv_u32 lane, fmkv_u32 threads) {
  fmkv_attention_merge_spec(p, row_offsets, ws, out, lse, status, tg, sg, nsg, lane, threads, p.head_dim);
}

#endif  // FMKV_METAL_KERNEL_CORE_H

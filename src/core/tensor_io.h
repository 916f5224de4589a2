// Host-side element access of fmkv_tensor (reference and tests).
#pragma once
#include <cstring>

#include "../format/numbers.h"
#include "ops.h"

namespace fmkv {

inline const void* tensor_ptr(const fmkv_tensor& t, int64_t row, int32_t head) {
  return (const char*)t.data + (row * t.row_stride + head * t.head_stride) * (int64_t)dtype_size(t.dtype);
}
inline float load_f32(const fmkv_tensor& t, int64_t row, int32_t head, int32_t i) {
  const void* p = tensor_ptr(t, row, head);
  switch (t.dtype) {
    case FMKV_F32: return ((const float*)p)[i];
    case FMKV_F16: return f16_to_f32(((const uint16_t*)p)[i]);
    default: return bf16_to_f32(((const uint16_t*)p)[i]);
  }
}
// Canonical fp16 input of the quantizer (FORMAT.md "Input"): the value rounded to fp16.
inline uint16_t load_f16(const fmkv_tensor& t, int64_t row, int32_t head, int32_t i) {
  if (t.dtype == FMKV_F16) return ((const uint16_t*)tensor_ptr(t, row, head))[i];
  return f32_to_f16(load_f32(t, row, head, i));
}
inline void store_f32(const fmkv_tensor& t, int64_t row, int32_t head, int32_t i, float v) {
  void* p = (void*)tensor_ptr(t, row, head);
  switch (t.dtype) {
    case FMKV_F32: ((float*)p)[i] = v; break;
    case FMKV_F16: ((uint16_t*)p)[i] = f32_to_f16(v); break;
    default: ((uint16_t*)p)[i] = f32_to_bf16(v); break;
  }
}

}  // namespace fmkv

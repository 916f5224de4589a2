// Argument conversion: fp16 / bf16 rounding, dtype / shape inspection and the host views of the
// arrays the binding receives (numpy or any DLPack object), names of backends and output dtypes.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace fmkv_py {

// ---- fp16 / bf16 conversions (IEEE round-to-nearest-even, same rounding as the format's) ----
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t b);

// ---- array inspection ----------------------------------------------------------------------
std::string dtype_name(nb::dlpack::dtype dt);
std::string shape_str(const AnyArray& a);
bool is_dtype(nb::dlpack::dtype dt, nb::dlpack::dtype_code code, int bits);
// float32 / float16 / bfloat16 -> fmkv_dtype, or FmkvError naming the argument.
fmkv_dtype float_dtype(const char* name, const AnyArray& a);
void require_host(const char* name, const AnyArray& a);
size_t elem_size(fmkv_dtype dt);

// A [rows][heads][dim] host tensor: a view of the caller's memory when its strides fit
// fmkv_tensor (unit dim stride, non-negative strides), else a packed copy.
struct HostTensor {
  fmkv_tensor t{};
  std::vector<uint8_t> packed;
};
HostTensor host_tensor(const char* name, const AnyArray& a, const char* expect, bool heads_major = false);

// Element i of a 1-D float32/float16/bfloat16 array as fp16 bits (rounded like the format).
std::vector<uint16_t> vector_f16(const char* name, const AnyArray& a);

template <typename T>
std::vector<T> vector_exact(const char* name, const AnyArray& a, nb::dlpack::dtype_code code, const char* what) {
  require_host(name, a);
  if (!is_dtype(a.dtype(), code, 8 * sizeof(T)))
    fail(std::string(name) + ": dtype " + dtype_name(a.dtype()) + " is not supported (expected " + what + ")");
  if (a.ndim() != 1) fail(std::string(name) + ": expected a 1-D array, got shape " + shape_str(a));
  std::vector<T> out(a.shape(0));
  const T* p = (const T*)a.data();
  for (size_t i = 0; i < out.size(); ++i) out[i] = p[(int64_t)i * a.stride(0)];
  return out;
}

// New numpy array owning a heap buffer.
template <typename T>
nb::ndarray<nb::numpy, T> numpy_array(std::vector<T>&& v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete (std::vector<T>*)p; });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

template <typename A>
void require_contiguous(const char* name, const A& a) {
  for (size_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) == 0) return;  // empty: strides are irrelevant
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      fail(std::string(name) + ": must be contiguous (row-major), got shape " + shape_str(AnyArray(a)) + " with strides that are not");
    expect *= (int64_t)a.shape(i);
  }
}

template <typename A>
size_t numel(const A& a) {
  size_t n = 1;
  for (size_t i = 0; i < a.ndim(); ++i) n *= a.shape(i);
  return n;
}

// Device placement is checked by DeviceCheck before; this checks dtype, rank and layout only
// (the pointer is never dereferenced here: it may be device memory).
template <typename T, typename A>
const T* index_array(const char* name, const A& a, size_t ndim, const char* what) {
  if (!is_dtype(a.dtype(), nb::dlpack::dtype_code::Int, 8 * sizeof(T)))
    fail(std::string(name) + ": dtype " + dtype_name(a.dtype()) + " is not supported (expected " + what + ")");
  if (a.ndim() != ndim)
    fail(std::string(name) + ": expected a " + std::to_string(ndim) + "-D array, got shape " + shape_str(AnyArray(a)));
  require_contiguous(name, a);
  return (const T*)a.data();
}

fmkv_backend backend_from_name(const std::string& name);
fmkv_dtype out_dtype_from_name(const std::string& n);
int32_t to_i32(const char* what, int64_t v, int64_t lo);
inline bool fits_i32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }
// v as int32, or FmkvError "<what> <v> is not supported (outside the 32-bit range)".
int32_t narrow_i32(const char* what, int64_t v);

}  // namespace fmkv_py

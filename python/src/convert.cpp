#include "convert.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

namespace fmkv_py {

namespace {
std::string g_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

// The format's conversions, from the C library (one definition: src/format/numbers.h).
uint16_t f32_to_f16(float f) {
  uint16_t h;
  fmkv_f32_to_f16(&f, &h, 1);
  return h;
}
float f16_to_f32(uint16_t h) {
  float f;
  fmkv_f16_to_f32(&h, &f, 1);
  return f;
}
float bf16_to_f32(uint16_t b) {
  float f;
  fmkv_bf16_to_f32(&b, &f, 1);
  return f;
}

std::string dtype_name(nb::dlpack::dtype dt) {
  std::string base;
  switch ((nb::dlpack::dtype_code)dt.code) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: base = "dlpack-code-" + std::to_string((int)dt.code) + "-"; break;
  }
  std::string s = base + std::to_string((int)dt.bits);
  if (dt.lanes != 1) s += "x" + std::to_string((int)dt.lanes);
  return s;
}

std::string shape_str(const AnyArray& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

bool is_dtype(nb::dlpack::dtype dt, nb::dlpack::dtype_code code, int bits) {
  return dt.code == (uint8_t)code && dt.bits == bits && dt.lanes == 1;
}

// float32 / float16 / bfloat16 -> fmkv_dtype, or FmkvError naming the argument.
fmkv_dtype float_dtype(const char* name, const AnyArray& a) {
  nb::dlpack::dtype dt = a.dtype();
  if (is_dtype(dt, nb::dlpack::dtype_code::Float, 32)) return FMKV_F32;
  if (is_dtype(dt, nb::dlpack::dtype_code::Float, 16)) return FMKV_F16;
  if (is_dtype(dt, nb::dlpack::dtype_code::Bfloat, 16)) return FMKV_BF16;
  fail(std::string(name) + ": dtype " + dtype_name(dt) + " is not supported (expected float32, float16 or bfloat16)");
}

void require_host(const char* name, const AnyArray& a) {
  if (a.device_type() != nb::device::cpu::value)
    fail(std::string(name) + ": tensor is on a non-CPU device (DLPack device type " + std::to_string(a.device_type()) +
             "); this fmkv API works on host (CPU) memory, move the tensor to the CPU first",
         FMKV_ERR_UNSUPPORTED);
}

size_t elem_size(fmkv_dtype dt) { return dt == FMKV_F32 ? 4 : 2; }

HostTensor host_tensor(const char* name, const AnyArray& a, const char* expect, bool heads_major) {
  require_host(name, a);
  fmkv_dtype dt = float_dtype(name, a);
  // heads_major: a 4-D [1, heads, tokens, dim] array (the attention layout of mlx-lm and Hugging Face,
  // one sequence) is accepted as the [tokens, heads, dim] view it is (the raw ops; no copy).
  const bool bhld = heads_major && a.ndim() == 4 && a.shape(0) == 1;
  if (a.ndim() != 3 && !bhld)
    fail(std::string(name) + ": expected a 3-D array " + expect + (heads_major ? " (or [1, heads, tokens, head_dim])" : "") +
         ", got shape " + shape_str(a));
  const size_t d_rows = bhld ? 2 : 0, d_heads = 1, d_dim = bhld ? 3 : 2;
  const int64_t rows = (int64_t)a.shape(d_rows);
  if (a.shape(d_heads) > (size_t)std::numeric_limits<int32_t>::max() || a.shape(d_dim) > (size_t)std::numeric_limits<int32_t>::max())
    fail(std::string(name) + ": shape " + shape_str(a) + " is too large", FMKV_ERR_OVERFLOW);
  const int32_t heads = (int32_t)a.shape(d_heads), dim = (int32_t)a.shape(d_dim);
  // Strides of size-1 dimensions are meaningless (frameworks set them freely): normalise to 0.
  int64_t s0 = a.shape(d_rows) > 1 ? a.stride(d_rows) : 0, s1 = a.shape(d_heads) > 1 ? a.stride(d_heads) : 0,
          s2 = a.shape(d_dim) > 1 ? a.stride(d_dim) : 1;
  HostTensor h;
  const size_t es = elem_size(dt);
  if (s2 == 1 && s0 >= 0 && s1 >= 0) {
    h.t = fmkv_tensor{const_cast<void*>(a.data()), (int32_t)dt, rows, heads, dim, s0, s1};
    return h;
  }
  h.packed.resize((size_t)rows * heads * dim * es);
  const uint8_t* src = (const uint8_t*)a.data();
  uint8_t* dst = h.packed.data();
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t hh = 0; hh < heads; ++hh)
      for (int32_t i = 0; i < dim; ++i, dst += es)
        std::memcpy(dst, src + (r * s0 + hh * s1 + i * s2) * (int64_t)es, es);
  h.t = fmkv::make_tensor(h.packed.data(), dt, rows, heads, dim);
  return h;
}

// Element i of a 1-D float32/float16/bfloat16 array as fp16 bits (rounded like the format).
std::vector<uint16_t> vector_f16(const char* name, const AnyArray& a) {
  require_host(name, a);
  fmkv_dtype dt = float_dtype(name, a);
  if (a.ndim() != 1) fail(std::string(name) + ": expected a 1-D array [head_dim], got shape " + shape_str(a));
  std::vector<uint16_t> out(a.shape(0));
  const uint8_t* p = (const uint8_t*)a.data();
  const int64_t st = a.stride(0), es = (int64_t)elem_size(dt);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint8_t* e = p + (int64_t)i * st * es;
    uint16_t u16;
    float f;
    switch (dt) {
      case FMKV_F32: std::memcpy(&f, e, 4); break;
      case FMKV_F16: std::memcpy(&u16, e, 2); out[i] = u16; continue;
      default: std::memcpy(&u16, e, 2); f = bf16_to_f32(u16); break;
    }
    out[i] = f32_to_f16(f);
    // A finite value that rounds to fp16 infinity is named as such (NaN / Inf are the library's).
    if (std::isfinite(f) && (out[i] & 0x7fffu) == 0x7c00u)
      fail(std::string(name) + "[" + std::to_string(i) + "] = " + g_str(f) +
               " is beyond the fp16 range (it rounds to infinity; inputs are rounded to fp16 first)",
           FMKV_ERR_NON_FINITE);
  }
  return out;
}

fmkv_backend backend_from_name(const std::string& name) {
  fmkv_backend b;
  if (fmkv_backend_from_name(name.c_str(), &b)) return b;
  std::string known;
  for (int i = 0; i < FMKV_BACKEND_COUNT; ++i) known += std::string(i ? ", '" : "'") + fmkv_backend_name((fmkv_backend)i) + "'";
  fail("unknown backend '" + name + "' (expected one of " + known + ")");
}

fmkv_dtype out_dtype_from_name(const std::string& n) {
  if (n == "float32") return FMKV_F32;
  if (n == "float16") return FMKV_F16;
  if (n == "bfloat16") return FMKV_BF16;
  fail("out_dtype '" + n + "' is not supported (expected 'float32', 'float16' or 'bfloat16')");
}

int32_t narrow_i32(const char* what, int64_t v) {
  if (!fits_i32(v)) fail(std::string(what) + " " + std::to_string(v) + " is not supported (outside the 32-bit range)");
  return (int32_t)v;
}

int32_t to_i32(const char* what, int64_t v, int64_t lo) {
  if (v < lo || v > std::numeric_limits<int32_t>::max())
    fail(std::string(what) + " must be in [" + std::to_string(lo) + ", 2^31), got " + std::to_string(v));
  return (int32_t)v;
}

}  // namespace fmkv_py

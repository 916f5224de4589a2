// fmkv Python extension (_fmkv): nanobind binding over the public C / C++ API only
// (fmkv/fmkv.h, fmkv/fmkv.hpp). Tensors arrive as numpy arrays or any DLPack-capable object
// (torch tensors included) through nb::ndarray; no framework headers are used.
//
// Errors: every fmkv::Error (from the library, or raised here for shape / dtype / device
// problems) becomes fmkv.FmkvError (a ValueError) carrying the library's message and status code.
//
// Devices: fmkv.Cache and the format primitives work on host memory. The raw ops (append_raw /
// attention_raw, used by fmkv.torch_ops) take the tensors of one layer and one batch on the
// backend's device: host (DLPack kDLCPU) for 'ref' / 'cpu', CUDA device memory (kDLCUDA) for
// 'cuda', where the pointers go to the C API as they are (no copy, no host synchronisation, no
// allocation: the caller passes its stream and, for attention, a workspace tensor). A tensor on
// the wrong kind of device, or on another device than the call's other tensors, is an error;
// nothing is ever copied between devices here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "fmkv/fmkv.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using AnyArray = nb::ndarray<nb::ro>;  // any dtype, any device, any shape: checked by hand below

[[noreturn]] void fail(const std::string& msg, int code = FMKV_ERR_INVALID_ARGUMENT) {
  throw fmkv::Error(code, msg);
}

// ---- fp16 / bf16 conversions (IEEE round-to-nearest-even, same rounding as the format's) ----
uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  int e = (int)(ax >> 23) - 127;
  if (e < -25) return (uint16_t)sign;
  uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  if (e < -14) {
    int sh = -(e + 1);
    uint32_t r = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  if (e > 15) return (uint16_t)(sign | 0x7c00u);
  uint32_t r = ((uint32_t)(e + 15) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}
float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}
float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

// ---- array inspection ----------------------------------------------------------------------
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

// ---- devices of the raw ops --------------------------------------------------------------------
std::string device_str(int32_t type, int32_t id) {
  if (type == nb::device::cpu::value) return "cpu";
  if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
  if (type == nb::device::cuda_host::value) return "cuda_host (pinned host memory, DLPack type 3)";
  if (type == nb::device::cuda_managed::value) return "cuda_managed:" + std::to_string(id);
  return "DLPack device type " + std::to_string(type) + ":" + std::to_string(id);
}

bool is_host_backend(fmkv_backend b) { return b == FMKV_BACKEND_REF || b == FMKV_BACKEND_CPU; }

// Every tensor of one raw call must live on the backend's kind of device (host memory for 'ref' /
// 'cpu', CUDA device memory for 'cuda'), all on the same device. Never a copy.
class DeviceCheck {
 public:
  explicit DeviceCheck(fmkv_backend b) : b_(b) {
    if (!is_host_backend(b) && b != FMKV_BACKEND_CUDA)
      fail(std::string("backend '") + fmkv_backend_name(b) + "' is not supported by the raw ops (use 'ref', 'cpu' or 'cuda')",
           FMKV_ERR_UNSUPPORTED);
    if (!fmkv_backend_available(b))
      fail(std::string("backend '") + fmkv_backend_name(b) + "' is not compiled into this build or has no usable device" +
               (b == FMKV_BACKEND_CUDA ? " (build the extension with CUDA: pip install . -C cmake.define.FMKV_CUDA=ON, see python/README.md)" : ""),
           FMKV_ERR_UNSUPPORTED);
  }
  bool cuda() const { return b_ == FMKV_BACKEND_CUDA; }

  template <typename A>
  void operator()(const char* name, const A& a) {
    const int32_t t = a.device_type(), id = a.device_id();
    const int32_t want = cuda() ? (int32_t)nb::device::cuda::value : (int32_t)nb::device::cpu::value;
    if (t != want)
      fail(std::string(name) + ": tensor is on device " + device_str(t, id) + " but backend '" + fmkv_backend_name(b_) +
               (cuda() ? "' works on CUDA device memory: move the tensor to the GPU, or use backend 'cpu' / 'ref' with CPU tensors"
                       : "' works on host (CPU) memory: use backend 'cuda' for CUDA tensors, or move the tensor to the CPU") +
               " (fmkv never copies between devices)");
    if (!first_) {
      first_ = name;
      id_ = id;
    } else if (cuda() && id != id_) {
      fail(std::string(name) + ": tensor is on device " + device_str(t, id) + " but " + first_ + " is on " +
           device_str(t, id_) + "; all tensors of one call must be on the same device");
    }
  }

 private:
  fmkv_backend b_;
  const char* first_ = nullptr;
  int32_t id_ = 0;
};

// A [rows][heads][dim] tensor in device memory: a view, never a copy (the dim stride must be 1).
fmkv_tensor device_tensor(const char* name, const AnyArray& a, const char* expect) {
  fmkv_dtype dt = float_dtype(name, a);
  if (a.ndim() != 3)
    fail(std::string(name) + ": expected a 3-D tensor " + expect + ", got shape " + shape_str(a));
  if (a.shape(1) > (size_t)std::numeric_limits<int32_t>::max() || a.shape(2) > (size_t)std::numeric_limits<int32_t>::max())
    fail(std::string(name) + ": shape " + shape_str(a) + " is too large", FMKV_ERR_OVERFLOW);
  int64_t s0 = a.shape(0) > 1 ? a.stride(0) : 0, s1 = a.shape(1) > 1 ? a.stride(1) : 0,
          s2 = a.shape(2) > 1 ? a.stride(2) : 1;
  if (s2 != 1 || s0 < 0 || s1 < 0)
    fail(std::string(name) + ": a device tensor needs unit stride in its last dimension and non-negative strides "
                             "(fmkv does not copy device memory); pass a contiguous tensor");
  return fmkv_tensor{const_cast<void*>(a.data()), (int32_t)dt, (int64_t)a.shape(0), (int32_t)a.shape(1),
                     (int32_t)a.shape(2), s0, s1};
}

// A [rows][heads][dim] host tensor: a view of the caller's memory when its strides fit
// fmkv_tensor (unit dim stride, non-negative strides), else a packed copy.
struct HostTensor {
  fmkv_tensor t{};
  std::vector<uint8_t> packed;
};

// heads_major: a 4-D [1, heads, tokens, dim] array (the attention layout of mlx-lm and Hugging Face,
// one sequence) is accepted as the [tokens, heads, dim] view it is (the raw ops; no copy).
HostTensor host_tensor(const char* name, const AnyArray& a, const char* expect, bool heads_major = false) {
  require_host(name, a);
  fmkv_dtype dt = float_dtype(name, a);
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
      case FMKV_F32: std::memcpy(&f, e, 4); out[i] = f32_to_f16(f); break;
      case FMKV_F16: std::memcpy(&u16, e, 2); out[i] = u16; break;
      default: std::memcpy(&u16, e, 2); out[i] = f32_to_f16(bf16_to_f32(u16)); break;
    }
  }
  return out;
}

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

fmkv_backend backend_from_name(const std::string& name) {
  for (int b = FMKV_BACKEND_REF; b <= FMKV_BACKEND_METAL; ++b)
    if (name == fmkv_backend_name((fmkv_backend)b)) return (fmkv_backend)b;
  fail("unknown backend '" + name + "' (expected 'ref', 'cpu', 'cuda' or 'metal')");
}

fmkv_dtype out_dtype_from_name(const std::string& n) {
  if (n == "float32") return FMKV_F32;
  if (n == "float16") return FMKV_F16;
  if (n == "bfloat16") return FMKV_BF16;
  fail("out_dtype '" + n + "' is not supported (expected 'float32', 'float16' or 'bfloat16')");
}

int32_t to_i32(const char* what, int64_t v, int64_t lo) {
  if (v < lo || v > std::numeric_limits<int32_t>::max())
    fail(std::string(what) + " must be in [" + std::to_string(lo) + ", 2^31), got " + std::to_string(v));
  return (int32_t)v;
}

// ---- Cache -----------------------------------------------------------------------------------
class Cache {
 public:
  Cache(const fmkv_config& cfg, int64_t num_layers, int64_t num_pages, int64_t max_seqs, const std::string& backend)
      : backend_(backend_from_name(backend)),
        cache_(checked_config(cfg), to_i32("num_layers", num_layers, 1), num_pages, to_i32("max_seqs", max_seqs, 1)) {
    if (backend_ != FMKV_BACKEND_REF && backend_ != FMKV_BACKEND_CPU)
      fail("backend '" + backend + "' works on device memory; fmkv.Cache holds host memory (use 'ref' or 'cpu')",
           FMKV_ERR_UNSUPPORTED);
    if (!fmkv_backend_available(backend_))
      fail("backend '" + backend + "' is not compiled into this build", FMKV_ERR_UNSUPPORTED);
  }

  std::string backend() const { return fmkv_backend_name(backend_); }
  const fmkv_config& config() const { return cache_.config(); }

  int32_t add_sequence() { std::lock_guard<std::mutex> g(mu_); return cache_.add_sequence(); }
  void remove_sequence(int64_t s) { std::lock_guard<std::mutex> g(mu_); cache_.remove_sequence(seq(s)); }
  int64_t length(int64_t layer, int64_t s) {
    std::lock_guard<std::mutex> g(mu_);
    return cache_.length(check_layer(layer), seq(s));
  }
  std::vector<int32_t> block_table(int64_t s) { std::lock_guard<std::mutex> g(mu_); return cache_.block_table(seq(s)); }
  int64_t free_pages() { std::lock_guard<std::mutex> g(mu_); return cache_.free_pages(); }
  int64_t resident_bytes() { std::lock_guard<std::mutex> g(mu_); return cache_.resident_bytes(); }
  int64_t used_bytes() { std::lock_guard<std::mutex> g(mu_); return cache_.used_bytes(); }
  int32_t num_layers() const { return cache_.num_layers(); }

  void append(int64_t layer, int64_t s, const AnyArray& k, const AnyArray& v) {
    const fmkv_config& c = cache_.config();
    HostTensor kt = host_tensor("k", k, "[tokens, num_kv_heads, head_dim]");
    HostTensor vt = host_tensor("v", v, "[tokens, num_kv_heads, head_dim]");
    // Shape checks up front so a malformed call reserves no pages.
    for (const HostTensor* t : {&kt, &vt}) {
      const char* n = t == &kt ? "k" : "v";
      if (t->t.heads != c.num_kv_heads || t->t.dim != c.head_dim)
        fail(std::string(n) + ": shape " + shape_str(t == &kt ? k : v) + " does not match [tokens, num_kv_heads=" +
             std::to_string(c.num_kv_heads) + ", head_dim=" + std::to_string(c.head_dim) + "]");
    }
    if (kt.t.rows != vt.t.rows)
      fail("k has " + std::to_string(kt.t.rows) + " tokens but v has " + std::to_string(vt.t.rows));
    const int32_t l = check_layer(layer), sq = seq(s);
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(mu_);
    if (kt.t.rows == 0) {  // nothing to append: only check the sequence exists
      cache_.length(check_layer(l), sq);
      return;
    }
    cache_.append(backend_, check_layer(l), sq, kt.t, vt.t);
  }

  nb::ndarray<nb::numpy, float> attention(int64_t layer, int64_t s, const AnyArray& q, nb::object softmax_scale,
                                          double softcap, const std::string& out_dtype) {
    const fmkv_config& c = cache_.config();
    HostTensor qt = host_tensor("q", q, "[query_tokens, q_heads, head_dim]");
    if (qt.t.dim != c.head_dim || qt.t.heads < c.num_kv_heads || qt.t.heads % c.num_kv_heads != 0)
      fail("q: shape " + shape_str(q) + " does not match [query_tokens, q_heads, head_dim=" + std::to_string(c.head_dim) +
           "] with q_heads a multiple of num_kv_heads=" + std::to_string(c.num_kv_heads));
    fmkv_attention_opts opts{0.0f, 0.0f, 0};
    if (!softmax_scale.is_none()) {
      double sc = nb::cast<double>(softmax_scale);
      if (!(sc > 0) || !std::isfinite(sc)) fail("softmax_scale must be finite and > 0 (None means 1/sqrt(head_dim))");
      opts.softmax_scale = (float)sc;
    }
    if (!(softcap >= 0) || !std::isfinite(softcap)) fail("softcap must be finite and >= 0 (0 disables it)");
    opts.softcap = (float)softcap;
    const fmkv_dtype odt = out_dtype_from_name(out_dtype);
    const int32_t l = check_layer(layer), sq = seq(s);
    const size_t n = (size_t)qt.t.rows * qt.t.heads * qt.t.dim;
    std::vector<float> out(n);
    {
      nb::gil_scoped_release nogil;
      std::vector<uint16_t> half(odt == FMKV_F32 ? 0 : n);
      void* buf = odt == FMKV_F32 ? (void*)out.data() : (void*)half.data();
      fmkv_tensor ot = fmkv::make_tensor(buf, odt, qt.t.rows, qt.t.heads, qt.t.dim);
      {
        std::lock_guard<std::mutex> g(mu_);
        if (qt.t.rows == 0) cache_.length(check_layer(l), sq);  // no query rows: only check the sequence
        else cache_.attention(backend_, check_layer(l), sq, qt.t, ot, opts);
      }
      if (odt == FMKV_F16)
        for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(half[i]);
      else if (odt == FMKV_BF16)
        for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(half[i]);
    }
    return numpy_array(std::move(out), {(size_t)qt.t.rows, (size_t)qt.t.heads, (size_t)qt.t.dim});
  }

 private:
  static const fmkv_config& checked_config(const fmkv_config& c) {
    fmkv::check(fmkv_config_validate(&c));
    return c;
  }
  int32_t check_layer(int64_t l) const {
    if (l < 0 || l >= cache_.num_layers())
      fail("layer " + std::to_string(l) + " outside [0, " + std::to_string(cache_.num_layers()) + ")", FMKV_ERR_OUT_OF_RANGE);
    return (int32_t)l;
  }
  static int32_t seq(int64_t s) {
    if (s < 0 || s > std::numeric_limits<int32_t>::max())
      fail("sequence " + std::to_string(s) + " does not exist", FMKV_ERR_OUT_OF_RANGE);
    return (int32_t)s;
  }

  fmkv_backend backend_;
  fmkv::HostCache cache_;
  std::mutex mu_;
};


// ---- raw ops over caller-owned tensors (the torch.library ops in fmkv.torch_ops use these) ------
// One layer's storage lives in the caller's tensors: pages (uint8, num_pages * page_bytes bytes),
// fp16_k / fp16_v (2-byte elements, num_slots * num_kv_heads * (sink + window) * head_dim; may
// be empty when sink + window == 0). The batch: slots int32 [n], seq_lens int64 [n],
// row_offsets int64 [n + 1], block_table int32 [n, stride]. All contiguous, all on the backend's
// device (host memory for 'ref' / 'cpu', one CUDA device for 'cuda'; see DeviceCheck).
// On 'cuda' the ops are stream-ordered on the caller's stream and do not synchronise: errors that
// only the device can see (block-table entries, lengths, slots, NaN/Inf inputs) are recorded in
// the device error word and raised by synchronize('cuda') (fmkv_device_synchronize).
using MutArray = nb::ndarray<>;

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

struct RawLayer {
  fmkv_layer_cache lc{};
};

RawLayer raw_layer(const fmkv_config& c, int64_t layer_index, const MutArray& pages, const MutArray& fk, const MutArray& fv) {
  fmkv::check(fmkv_config_validate(&c));
  RawLayer r;
  if (!is_dtype(pages.dtype(), nb::dlpack::dtype_code::UInt, 8))
    fail("pages: dtype " + dtype_name(pages.dtype()) + " is not supported (expected uint8)");
  require_contiguous("pages", pages);
  const int64_t pb = fmkv_config_page_bytes(&c), nbytes = (int64_t)numel(pages);
  if (nbytes % pb != 0)
    fail("pages: " + std::to_string(nbytes) + " bytes is not a multiple of the page size " + std::to_string(pb) + " bytes");
  r.lc.pages = (uint8_t*)pages.data();
  r.lc.num_pages = nbytes / pb;
  const int64_t slot_elems = fmkv_config_fp16_slot_bytes(&c) / 4;
  for (const MutArray* a : {&fk, &fv}) {
    const char* n = a == &fk ? "fp16_k" : "fp16_v";
    if (a->dtype().bits != 16 || a->dtype().lanes != 1 || a->dtype().code == (uint8_t)nb::dlpack::dtype_code::Bfloat)
      fail(std::string(n) + ": dtype " + dtype_name(a->dtype()) + " is not supported (expected float16, or int16/uint16 bits)");
    require_contiguous(n, *a);
    if (slot_elems > 0 && (numel(*a) == 0 || (int64_t)numel(*a) % slot_elems != 0))
      fail(std::string(n) + ": " + std::to_string(numel(*a)) + " elements is not a positive multiple of one sequence slot (" +
           std::to_string(slot_elems) + " = num_kv_heads * (sink_tokens + window_tokens) * head_dim)");
  }
  if (numel(fk) != numel(fv)) fail("fp16_k and fp16_v differ in size");
  r.lc.fp16_k = slot_elems > 0 ? (uint16_t*)fk.data() : nullptr;
  r.lc.fp16_v = slot_elems > 0 ? (uint16_t*)fv.data() : nullptr;
  if (slot_elems > 0 && (int64_t)numel(fk) / slot_elems > std::numeric_limits<int32_t>::max())
    fail("fp16_k: too many sequence slots", FMKV_ERR_OVERFLOW);
  r.lc.num_slots = slot_elems > 0 ? (int32_t)((int64_t)numel(fk) / slot_elems) : 1;
  r.lc.layer = to_i32("layer", layer_index, 0);
  return r;
}

struct RawBatch {
  fmkv_batch b{};
  int32_t dummy_table = 0;  // a non-NULL host block table when it has no entries
};

void raw_batch(RawBatch& r, bool device, const AnyArray& slots, const AnyArray& seq_lens, const AnyArray& row_offsets,
               const AnyArray& block_table) {
  const int32_t* sl = index_array<int32_t>("slots", slots, 1, "int32");
  const int64_t* ln = index_array<int64_t>("seq_lens", seq_lens, 1, "int64");
  const int64_t* ro = index_array<int64_t>("row_offsets", row_offsets, 1, "int64");
  const int32_t* bt = index_array<int32_t>("block_table", block_table, 2, "int32");
  const size_t n = slots.shape(0);
  if (n > (size_t)std::numeric_limits<int32_t>::max()) fail("slots: too many sequences", FMKV_ERR_OVERFLOW);
  if (seq_lens.shape(0) != n) fail("seq_lens: " + std::to_string(seq_lens.shape(0)) + " entries, expected one per sequence (" + std::to_string(n) + ")");
  if (row_offsets.shape(0) != n + 1) fail("row_offsets: " + std::to_string(row_offsets.shape(0)) + " entries, expected num_seqs + 1 = " + std::to_string(n + 1));
  if (block_table.shape(0) != n) fail("block_table: " + std::to_string(block_table.shape(0)) + " rows, expected one per sequence (" + std::to_string(n) + ")");
  r.b.num_seqs = (int32_t)n;
  r.b.slots = sl;
  r.b.seq_lens = ln;
  r.b.row_offsets = ro;
  if (numel(block_table) > 0) {
    r.b.block_table = bt;
    r.b.block_table_stride = (int64_t)block_table.shape(1);
  } else if (device) {  // no entries: never dereferenced (a sequence that needs a page fails on the device)
    r.b.block_table = nullptr;
    r.b.block_table_stride = 0;
  } else {
    r.b.block_table = &r.dummy_table;
    r.b.block_table_stride = (int64_t)block_table.shape(1);
  }
}

void* stream_ptr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

// One layer's storage and batch arrays must all live where the backend works (DeviceCheck).
void check_layer_devices(DeviceCheck& dev, const MutArray& pages, const MutArray& fk, const MutArray& fv, const AnyArray& slots,
                         const AnyArray& seq_lens, const AnyArray& row_offsets, const AnyArray& block_table) {
  dev("pages", pages);
  dev("fp16_k", fk);
  dev("fp16_v", fv);
  dev("slots", slots);
  dev("seq_lens", seq_lens);
  dev("row_offsets", row_offsets);
  dev("block_table", block_table);
}

void raw_append(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                const AnyArray& row_offsets, const AnyArray& block_table, const AnyArray& k, const AnyArray& v,
                uintptr_t stream) {
  const fmkv_backend b = backend_from_name(backend);
  DeviceCheck dev(b);
  check_layer_devices(dev, pages, fk, fv, slots, seq_lens, row_offsets, block_table);
  dev("k", k);
  dev("v", v);
  RawLayer L = raw_layer(cfg, layer_index, pages, fk, fv);
  RawBatch B;
  raw_batch(B, dev.cuda(), slots, seq_lens, row_offsets, block_table);
  if (dev.cuda()) {
    fmkv_tensor kt = device_tensor("k", k, "[tokens, num_kv_heads, head_dim]");
    fmkv_tensor vt = device_tensor("v", v, "[tokens, num_kv_heads, head_dim]");
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_append(b, &cfg, &L.lc, &B.b, &kt, &vt, stream_ptr(stream)));
    return;
  }
  HostTensor kt = host_tensor("k", k, "[tokens, num_kv_heads, head_dim]", true);
  HostTensor vt = host_tensor("v", v, "[tokens, num_kv_heads, head_dim]", true);
  nb::gil_scoped_release nogil;
  fmkv::check(fmkv_append(b, &cfg, &L.lc, &B.b, &kt.t, &vt.t, nullptr));
}

// The attention-side arguments shared by attention_raw and append_attention_raw: q, out (shape and
// dtype of q), options, the optional workspace; resolved for host or device memory.
struct RawAttention {
  fmkv_tensor q{}, out{};
  fmkv_attention_opts opts{};
  void* ws = nullptr;
  size_t ws_bytes = 0;
  HostTensor q_host;  // keeps a converted host q alive
};

void raw_attention_args(RawAttention& r, bool cuda, int32_t num_seqs, const AnyArray& q, const MutArray& out,
                        double softmax_scale, double softcap, const std::optional<MutArray>& workspace,
                        int64_t max_seq_len) {
  const fmkv_dtype odt = float_dtype("out", AnyArray(out));
  if (!(softmax_scale >= 0) || !std::isfinite(softmax_scale)) fail("softmax_scale must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  if (!(softcap >= 0) || !std::isfinite(softcap)) fail("softcap must be finite and >= 0 (0 disables it)");
  if (max_seq_len < 0) fail("max_seq_len must be >= 0 (0: no bound), got " + std::to_string(max_seq_len));
  r.opts = fmkv_attention_opts{(float)softmax_scale, (float)softcap, max_seq_len};
  if (workspace) {
    if (!is_dtype(workspace->dtype(), nb::dlpack::dtype_code::UInt, 8))
      fail("workspace: dtype " + dtype_name(workspace->dtype()) + " is not supported (expected uint8)");
    require_contiguous("workspace", *workspace);
    r.ws = workspace->data();
    r.ws_bytes = numel(*workspace);
  }
  if (cuda) {
    r.q = device_tensor("q", q, "[query_tokens, q_heads, head_dim]");
  } else {
    r.q_host = host_tensor("q", q, "[query_tokens, q_heads, head_dim]", true);
    r.q = r.q_host.t;
  }
  if (out.ndim() != 3 || (int64_t)out.shape(0) != r.q.rows || (int64_t)out.shape(1) != r.q.heads || (int64_t)out.shape(2) != r.q.dim)
    fail("out: shape " + shape_str(AnyArray(out)) + " must equal q's shape " + shape_str(q));
  require_contiguous("out", out);
  r.out = fmkv::make_tensor(out.data(), odt, r.q.rows, r.q.heads, r.q.dim);
  if (cuda && r.q.rows > 0 && num_seqs > 0 && !r.ws)
    fail("workspace: the cuda backend needs a workspace tensor (uint8, on q's device) of "
         "attention_workspace_bytes('cuda', config, q_heads, rows, num_seqs, max_seq_len) bytes");
}

// attention_raw (kv == nullptr) and append_attention_raw (kv = the rows of k and v to append first,
// fmkv_append_attention; seq_lens are then the lengths before the append).
void attention_call(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                    const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                    const AnyArray& row_offsets, const AnyArray& block_table, const std::pair<AnyArray, AnyArray>* kv,
                    const AnyArray& q, const MutArray& out, double softmax_scale, double softcap,
                    const std::optional<MutArray>& workspace, uintptr_t stream, int64_t max_seq_len) {
  const fmkv_backend b = backend_from_name(backend);
  DeviceCheck dev(b);
  check_layer_devices(dev, pages, fk, fv, slots, seq_lens, row_offsets, block_table);
  if (kv) {
    dev("k", kv->first);
    dev("v", kv->second);
  }
  dev("q", q);
  dev("out", out);
  if (workspace) dev("workspace", *workspace);
  RawLayer L = raw_layer(cfg, layer_index, pages, fk, fv);
  RawBatch B;
  raw_batch(B, dev.cuda(), slots, seq_lens, row_offsets, block_table);
  RawAttention A;
  raw_attention_args(A, dev.cuda(), B.b.num_seqs, q, out, softmax_scale, softcap, workspace, max_seq_len);
  void* st = dev.cuda() ? stream_ptr(stream) : nullptr;
  if (!kv) {
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_attention(b, &cfg, &L.lc, &B.b, &A.q, &A.opts, &A.out, A.ws, A.ws_bytes, st));
    return;
  }
  HostTensor kh, vh;
  fmkv_tensor kt, vt;
  if (dev.cuda()) {
    kt = device_tensor("k", kv->first, "[tokens, num_kv_heads, head_dim]");
    vt = device_tensor("v", kv->second, "[tokens, num_kv_heads, head_dim]");
  } else {
    kh = host_tensor("k", kv->first, "[tokens, num_kv_heads, head_dim]", true);
    vh = host_tensor("v", kv->second, "[tokens, num_kv_heads, head_dim]", true);
    kt = kh.t;
    vt = vh.t;
  }
  nb::gil_scoped_release nogil;
  fmkv::check(fmkv_append_attention(b, &cfg, &L.lc, &B.b, &kt, &vt, &A.q, &A.opts, &A.out, A.ws, A.ws_bytes, st));
}

void raw_attention(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                   const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                   const AnyArray& row_offsets, const AnyArray& block_table, const AnyArray& q, const MutArray& out,
                   double softmax_scale, double softcap, std::optional<MutArray> workspace, uintptr_t stream,
                   int64_t max_seq_len) {
  attention_call(backend, cfg, layer_index, pages, fk, fv, slots, seq_lens, row_offsets, block_table, nullptr, q, out,
                 softmax_scale, softcap, workspace, stream, max_seq_len);
}

void raw_append_attention(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                          const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                          const AnyArray& row_offsets, const AnyArray& block_table, const AnyArray& k, const AnyArray& v,
                          const AnyArray& q, const MutArray& out, double softmax_scale, double softcap,
                          std::optional<MutArray> workspace, uintptr_t stream, int64_t max_seq_len) {
  const std::pair<AnyArray, AnyArray> kv(k, v);
  attention_call(backend, cfg, layer_index, pages, fk, fv, slots, seq_lens, row_offsets, block_table, &kv, q, out,
                 softmax_scale, softcap, workspace, stream, max_seq_len);
}

const char* status_name(int code) {
  switch (code) {
    case FMKV_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case FMKV_ERR_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case FMKV_ERR_NON_FINITE: return "NON_FINITE";
    case FMKV_ERR_OVERFLOW: return "OVERFLOW";
    case FMKV_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case FMKV_ERR_BACKEND: return "BACKEND";
    default: return "INTERNAL";
  }
}

}  // namespace

NB_MODULE(_fmkv, m) {
  m.doc() = "fmkv native extension (use the fmkv package, not this module directly)";

  // fmkv.FmkvError(ValueError): .code (int status) and .status (name) are set on instances.
  // A raw pointer on purpose: a static nb::object would be released after interpreter shutdown.
  static PyObject* error_type = PyErr_NewExceptionWithDoc(
      "fmkv.FmkvError",
      "fmkv error (a ValueError): .code is the fmkv_status value, .status its name "
      "(INVALID_ARGUMENT, OUT_OF_RANGE, NON_FINITE, OVERFLOW, UNSUPPORTED, BACKEND, INTERNAL).",
      PyExc_ValueError, nullptr);
  if (!error_type) throw nb::python_error();
  m.attr("FmkvError") = nb::handle(error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fmkv::Error& e) {
      nb::object exc = nb::handle(error_type)(nb::str(e.what()));
      nb::setattr(exc, "code", nb::int_(e.code()));
      nb::setattr(exc, "status", nb::str(status_name(e.code())));
      PyErr_SetObject(error_type, exc.ptr());
    }
  });

  m.def("version", [] { return std::string(fmkv_version()); });
  m.def("format_version", &fmkv_format_version);
  m.def("backends", [] {
    nb::dict d;
    for (int b = FMKV_BACKEND_REF; b <= FMKV_BACKEND_METAL; ++b) {
      nb::dict e;
      e["available"] = nb::bool_(fmkv_backend_available((fmkv_backend)b) != 0);
      e["device"] = nb::str(fmkv_backend_device((fmkv_backend)b));
      d[fmkv_backend_name((fmkv_backend)b)] = e;
    }
    return d;
  });

  nb::class_<fmkv_config>(m, "RawConfig", "fmkv_config as a plain struct (fmkv.Config wraps it)")
      .def("__init__", [](fmkv_config* c) { new (c) fmkv_config; fmkv_config_default(c); })
      .def_rw("head_dim", &fmkv_config::head_dim)
      .def_rw("num_kv_heads", &fmkv_config::num_kv_heads)
      .def_rw("k_bits", &fmkv_config::k_bits)
      .def_rw("v_bits", &fmkv_config::v_bits)
      .def_rw("page_size", &fmkv_config::page_size)
      .def_rw("sink_tokens", &fmkv_config::sink_tokens)
      .def_rw("window_tokens", &fmkv_config::window_tokens)
      .def_rw("scale_rule", &fmkv_config::scale_rule)
      .def_rw("seed", &fmkv_config::seed);
  m.attr("SCALE_RMS") = (int)FMKV_SCALE_RMS;
  m.attr("SCALE_LSQ") = (int)FMKV_SCALE_LSQ;
  m.attr("GROUP_SIZE") = (int)FMKV_GROUP_SIZE;

  m.def("config_validate", [](const fmkv_config& c) { fmkv::check(fmkv_config_validate(&c)); });
  m.def("config_page_bytes", [](const fmkv_config& c) {
    fmkv::check(fmkv_config_validate(&c));
    return fmkv_config_page_bytes(&c);
  });
  m.def("config_fp16_slot_bytes", [](const fmkv_config& c) {
    fmkv::check(fmkv_config_validate(&c));
    return fmkv_config_fp16_slot_bytes(&c);
  });
  m.def("bytes_per_token_head", [](int32_t d, int32_t bits) {
    if (!fmkv_head_dim_supported(d)) fail("head_dim " + std::to_string(d) + " is not supported (format v2: 64, 128, 256)");
    if (!fmkv_code_bits_supported(bits) && bits != FMKV_FP16_BITS)
      fail("bits " + std::to_string(bits) + " is not supported (2, 3, 4 or 16)");
    return fmkv_bytes_per_token_head(d, bits);
  }, "head_dim"_a, "bits"_a);

  m.def("codebook", [](int32_t bits) {
    if (bits < 1 || bits > 4) fail("bits " + std::to_string(bits) + " is not supported (codebooks exist for 1..4 bits)");
    std::vector<float> mags((size_t)1 << (bits - 1));
    fmkv::check(fmkv_codebook(bits, mags.data()));
    size_t n = mags.size();
    return numpy_array(std::move(mags), {n});
  }, "bits"_a);

  // Returns (codes uint8 [d], scale bits uint16 [d/32]); the Python layer views scales as float16.
  m.def("quantize_vector", [](const AnyArray& x, int32_t bits, uint64_t seed, int32_t layer, int32_t scale_rule) {
    std::vector<uint16_t> xh = vector_f16("x", x);
    const int32_t d = (int32_t)xh.size();
    if (!fmkv_head_dim_supported(d)) fail("x: length " + std::to_string(d) + " is not a supported head_dim (64, 128, 256)");
    std::vector<uint8_t> codes(d);
    std::vector<uint16_t> scales(d / FMKV_GROUP_SIZE);
    fmkv::check(fmkv_quantize_vector(d, bits, scale_rule, seed, layer, xh.data(), codes.data(), scales.data()));
    size_t nc = codes.size(), ns = scales.size();
    return nb::make_tuple(numpy_array(std::move(codes), {nc}), numpy_array(std::move(scales), {ns}));
  }, "x"_a, "bits"_a, "seed"_a = 0, "layer"_a = 0, "scale_rule"_a = (int)FMKV_SCALE_LSQ);

  m.def("dequantize_vector", [](const AnyArray& codes, const AnyArray& scale_bits, int32_t bits, uint64_t seed, int32_t layer) {
    std::vector<uint8_t> c = vector_exact<uint8_t>("codes", codes, nb::dlpack::dtype_code::UInt, "uint8");
    std::vector<uint16_t> s = vector_exact<uint16_t>("scales", scale_bits, nb::dlpack::dtype_code::UInt, "float16 / uint16 bits");
    const int32_t d = (int32_t)c.size();
    if (!fmkv_head_dim_supported(d)) fail("codes: length " + std::to_string(d) + " is not a supported head_dim (64, 128, 256)");
    if ((int32_t)s.size() != d / FMKV_GROUP_SIZE)
      fail("scales: length " + std::to_string(s.size()) + ", expected head_dim / 32 = " + std::to_string(d / FMKV_GROUP_SIZE));
    std::vector<float> out(d);
    fmkv::check(fmkv_dequantize_vector(d, bits, seed, layer, c.data(), s.data(), out.data()));
    return numpy_array(std::move(out), {(size_t)d});
  }, "codes"_a, "scales"_a, "bits"_a, "seed"_a = 0, "layer"_a = 0);

  // stream: a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream), 0 = the legacy
  // default stream; ignored by the host backends.
  m.def("append_raw", &raw_append, "backend"_a, "config"_a, "layer"_a, "pages"_a, "fp16_k"_a, "fp16_v"_a, "slots"_a,
        "seq_lens"_a, "row_offsets"_a, "block_table"_a, "k"_a, "v"_a, "stream"_a = (uintptr_t)0);
  m.def("attention_raw", &raw_attention, "backend"_a, "config"_a, "layer"_a, "pages"_a, "fp16_k"_a, "fp16_v"_a,
        "slots"_a, "seq_lens"_a, "row_offsets"_a, "block_table"_a, "q"_a, "out"_a, "softmax_scale"_a = 0.0,
        "softcap"_a = 0.0, "workspace"_a = nb::none(), "stream"_a = (uintptr_t)0, "max_seq_len"_a = 0);
  m.def("append_attention_raw", &raw_append_attention, "backend"_a, "config"_a, "layer"_a, "pages"_a, "fp16_k"_a,
        "fp16_v"_a, "slots"_a, "seq_lens"_a, "row_offsets"_a, "block_table"_a, "k"_a, "v"_a, "q"_a, "out"_a,
        "softmax_scale"_a = 0.0, "softcap"_a = 0.0, "workspace"_a = nb::none(), "stream"_a = (uintptr_t)0,
        "max_seq_len"_a = 0);
  m.attr("FUSED_MAX_ROWS") = FMKV_FUSED_MAX_ROWS;
  m.def("attention_workspace_bytes", [](const std::string& backend, const fmkv_config& c, int64_t q_heads, int64_t max_rows,
                                         int64_t num_seqs, int64_t max_seq_len) {
    const fmkv_backend b = backend_from_name(backend);
    fmkv::check(fmkv_config_validate(&c));
    return fmkv_attention_workspace_bytes(b, &c, to_i32("q_heads", q_heads, 0), max_rows < 0 ? 0 : max_rows,
                                          to_i32("num_seqs", num_seqs, 0), max_seq_len < 0 ? 0 : max_seq_len);
  }, "backend"_a, "config"_a, "q_heads"_a, "max_rows"_a, "num_seqs"_a, "max_seq_len"_a = 0,
     "Workspace bytes attention_raw needs on a backend (0 for host backends): fmkv_attention_workspace_bytes.");
  m.def("backend_available", [](const std::string& backend) {
    return fmkv_backend_available(backend_from_name(backend)) != 0;
  }, "backend"_a);
  // Waits for the backend's device and raises the first error its kernels recorded since the last
  // call (CUDA: block-table entries, slots, lengths, NaN/Inf inputs; the failed op wrote nothing and
  // later fmkv CUDA ops were skipped). Reads the error word of the calling thread's current device.
  m.def("synchronize", [](const std::string& backend) {
    const fmkv_backend b = backend_from_name(backend);
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_device_synchronize(b));
  }, "backend"_a);

  nb::class_<Cache>(m, "Cache", "fmkv::HostCache: paged compressed KV cache in host memory (fmkv.Cache wraps it)")
      .def(nb::init<const fmkv_config&, int64_t, int64_t, int64_t, const std::string&>(), "config"_a, "num_layers"_a,
           "num_pages"_a, "max_seqs"_a, "backend"_a)
      .def_prop_ro("backend", &Cache::backend)
      .def_prop_ro("raw_config", [](const Cache& c) { return c.config(); })
      .def_prop_ro("num_layers", &Cache::num_layers)
      .def_prop_ro("free_pages", &Cache::free_pages)
      .def_prop_ro("resident_bytes", &Cache::resident_bytes)
      .def_prop_ro("used_bytes", &Cache::used_bytes)
      .def("add_sequence", &Cache::add_sequence)
      .def("remove_sequence", &Cache::remove_sequence, "seq"_a)
      .def("length", &Cache::length, "layer"_a, "seq"_a)
      .def("block_table", &Cache::block_table, "seq"_a)
      .def("append", &Cache::append, "layer"_a, "seq"_a, "k"_a, "v"_a)
      .def("attention", &Cache::attention, "layer"_a, "seq"_a, "q"_a, "softmax_scale"_a = nb::none(),
           "softcap"_a = 0.0, "out_dtype"_a = "float32");
}

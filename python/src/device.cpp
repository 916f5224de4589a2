#include "device.h"

#include <limits>

#include "convert.h"

namespace fmkv_py {

std::string device_str(int32_t type, int32_t id) {
  if (type == nb::device::cpu::value) return "cpu";
  if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
  if (type == nb::device::cuda_host::value) return "cuda_host (pinned host memory, DLPack type 3)";
  if (type == nb::device::cuda_managed::value) return "cuda_managed:" + std::to_string(id);
  return "DLPack device type " + std::to_string(type) + ":" + std::to_string(id);
}

bool is_host_backend(fmkv_backend b) { return b == FMKV_BACKEND_REF || b == FMKV_BACKEND_CPU; }

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

}  // namespace fmkv_py

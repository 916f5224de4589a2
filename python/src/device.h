// Device and placement checks of the raw ops: every tensor of one call lives on the backend's kind
// of device (host memory for 'ref' / 'cpu', CUDA device memory for 'cuda'), all on one device;
// nothing is ever copied between devices.
#pragma once
#include <cstdint>
#include <string>

#include "common.h"

namespace fmkv_py {

std::string device_str(int32_t type, int32_t id);
bool is_host_backend(fmkv_backend b);

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
fmkv_tensor device_tensor(const char* name, const AnyArray& a, const char* expect);

inline void* stream_ptr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

}  // namespace fmkv_py

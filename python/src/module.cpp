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
//
// Files: module.cpp (this: the module and its version / backend queries), errors.cpp (FmkvError),
// convert.{h,cpp} (argument conversion: dtypes, shapes, fp16 rounding, host views), device.{h,cpp}
// (device and placement checks of the raw ops), format.cpp (config sizes, codebooks, quantize_vector),
// raw_ops.cpp (append_raw / attention_raw / append_attention_raw, synchronize), cache.cpp (Cache), snapshot.cpp
// (RawSnapshot: loaded snapshots as numpy views; saving host arrays).
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"

namespace nb = nanobind;

NB_MODULE(_fmkv, m) {
  m.doc() = "fmkv native extension (use the fmkv package, not this module directly)";
  fmkv_py::bind_errors(m);
  m.def("version", [] { return std::string(fmkv_version()); });
  m.def("format_version", &fmkv_format_version);
  m.def("host_memory_bytes", &fmkv_host_memory_bytes,
        "Bytes of memory this process may use on the host (physical memory or a lower cgroup limit; 0: unknown)");
  m.def("backends", [] {
    nb::dict d;
    for (int b = 0; b < FMKV_BACKEND_COUNT; ++b) {
      nb::dict e;
      e["available"] = nb::bool_(fmkv_backend_available((fmkv_backend)b) != 0);
      e["device"] = nb::str(fmkv_backend_device((fmkv_backend)b));
      d[fmkv_backend_name((fmkv_backend)b)] = e;
    }
    return d;
  });

  fmkv_py::bind_format(m);
  fmkv_py::bind_raw_ops(m);
  fmkv_py::bind_cache(m);
  fmkv_py::bind_snapshot(m);
}

// The parts of the _fmkv module (module.cpp calls each once, in this order): the error types, the
// format primitives, the raw ops over caller-owned tensors, the host cache wrapper, snapshots.
#pragma once
#include "common.h"

namespace fmkv_py {

void bind_errors(nb::module_& m);   // errors.cpp: fmkv.FmkvError and the exception translator
void bind_format(nb::module_& m);   // format.cpp: RawConfig, config sizes, codebook, quantize_vector
void bind_raw_ops(nb::module_& m);  // raw_ops.cpp: append_raw / attention_raw / ..., synchronize
void bind_cache(nb::module_& m);    // cache.cpp: Cache (fmkv::HostCache; its snapshots)
void bind_snapshot(nb::module_& m); // snapshot.cpp: RawSnapshot (a loaded snapshot), saving host arrays

}  // namespace fmkv_py

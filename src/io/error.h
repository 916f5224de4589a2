// Error plumbing of the snapshot I/O: fmkv::Error exceptions inside, status + fmkv_last_error() at the
// C boundary (src/core/status.h, shared with the C API).
#pragma once
#include "../core/status.h"

namespace fmkv::io {
using fmkv::fail;
// Run a snapshot C API body: its status, the message in fmkv_last_error().
template <typename F>
fmkv_status guarded_io(F&& f) {
  return guarded(static_cast<F&&>(f));
}
}  // namespace fmkv::io

// Status plumbing inside the library: fmkv::Error (include/fmkv/error.hpp) carries an fmkv_status
// code; `guarded` runs a C API body and turns an exception into its status code, recording the
// message for fmkv_last_error() (thread-local). Used by the C API (src/api) and the snapshot I/O
// (src/io) alike.
#pragma once
#include <string>
#include <utility>

#include "fmkv/error.hpp"
#include "fmkv/fmkv.h"

namespace fmkv {

// Status codes (the values of fmkv_status in fmkv.h).
enum Status : int {
  kOk = FMKV_OK,
  kInvalidArgument = FMKV_ERR_INVALID_ARGUMENT,  // shape, dtype, bits, head_dim, strides, null pointers
  kOutOfRange = FMKV_ERR_OUT_OF_RANGE,           // page table entry, slot or length outside the storage
  kNonFinite = FMKV_ERR_NON_FINITE,              // NaN/Inf (or beyond fp16 range) in K/V/Q input
  kOverflow = FMKV_ERR_OVERFLOW,                 // a size or offset does not fit the index types
  kUnsupported = FMKV_ERR_UNSUPPORTED,           // combination not compiled / backend not available
  kBackendError = FMKV_ERR_BACKEND,              // CUDA/Metal runtime failure
  kInternal = FMKV_ERR_INTERNAL
};

// The message fmkv_last_error() returns on this thread.
const std::string& last_error();
void set_last_error(const std::string& msg);

[[noreturn]] inline void fail(int code, const std::string& msg) { throw Error(code, msg); }
// A check with a fixed message, or with a message built only when the check fails (a callable returning
// std::string: the passing path of a check allocates nothing).
inline void require(bool ok, int code, const char* msg) {
  if (!ok) fail(code, msg);
}
template <typename MakeMessage, typename = decltype(std::string(std::declval<MakeMessage&>()()))>
inline void require(bool ok, int code, MakeMessage&& make_message) {
  if (!ok) fail(code, make_message());
}

// Run f(); FMKV_OK and an empty last error, or the status of what it threw and its message.
template <typename F>
fmkv_status guarded(F&& f) {
  try {
    f();
    set_last_error("");
    return FMKV_OK;
  } catch (const Error& e) {
    set_last_error(e.what());
    return (fmkv_status)e.code();
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return FMKV_ERR_INTERNAL;
  } catch (const std::exception& e) {
    set_last_error(std::string("internal error: ") + e.what());
    return FMKV_ERR_INTERNAL;
  }
}

}  // namespace fmkv

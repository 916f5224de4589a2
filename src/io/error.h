// Error plumbing of the snapshot I/O: fmkv::Error exceptions inside, status + fmkv_last_error()
// at the C boundary.
#pragma once
#include <new>
#include <string>

#include "fmkv/fmkv.hpp"

namespace fmkv {
// Sets the thread-local message returned by fmkv_last_error(). Defined in src/api/c_api.cpp
// (a weak fallback in src/io/save.cpp keeps the library linking without it).
void set_last_error(const std::string& msg);
}  // namespace fmkv

namespace fmkv::io {

[[noreturn]] inline void fail(int code, const std::string& msg) { throw Error(code, msg); }

template <typename F>
fmkv_status guarded_io(F&& f) {
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

}  // namespace fmkv::io

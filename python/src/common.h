// Shared by the files of the _fmkv extension: nanobind, the array types the binding accepts and
// the one way it raises (fmkv::Error, turned into fmkv.FmkvError by errors.cpp; ArgTypeError into
// fmkv.FmkvTypeError).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

#include "fmkv/fmkv.hpp"

namespace fmkv_py {

namespace nb = nanobind;

using AnyArray = nb::ndarray<nb::ro>;  // any dtype, any device, any shape: checked by hand (convert.h)
using MutArray = nb::ndarray<>;        // a tensor an op writes (raw ops: pages, fp16 regions, out)

[[noreturn]] inline void fail(const std::string& msg, int code = FMKV_ERR_INVALID_ARGUMENT) {
  throw fmkv::Error(code, msg);
}

// An argument of the wrong Python type: raised as fmkv.FmkvTypeError (FmkvError and TypeError).
struct ArgTypeError : fmkv::Error {
  explicit ArgTypeError(const std::string& msg) : fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, msg) {}
};
[[noreturn]] inline void fail_type(const std::string& msg) { throw ArgTypeError(msg); }

}  // namespace fmkv_py

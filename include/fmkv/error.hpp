// fmkv's C++ exception: an fmkv_status code (fmkv.h) and a message naming the problem. The C++ API
// (fmkv.hpp) throws it for a failed C call; inside the library, validation and backends throw it and
// the C API turns it into the status code and fmkv_last_error().
#pragma once
#include <stdexcept>
#include <string>

namespace fmkv {

class Error : public std::runtime_error {
 public:
  Error(int code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

}  // namespace fmkv

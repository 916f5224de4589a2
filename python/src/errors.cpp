// fmkv.FmkvError and the translation of fmkv::Error into it.
#include "bindings.h"

namespace fmkv_py {
namespace {

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

void bind_errors(nb::module_& m) {
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
}

}  // namespace fmkv_py

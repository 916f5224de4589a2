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
  // fmkv.FmkvError(ValueError): .code (int status) and .status (name) are set on instances; the
  // class holds INVALID_ARGUMENT as the default for errors raised in Python without a status.
  // A raw pointer on purpose: a static nb::object would be released after interpreter shutdown.
  static PyObject* error_type = PyErr_NewExceptionWithDoc(
      "fmkv.FmkvError",
      "fmkv error (a ValueError): .code is the fmkv_status value, .status its name "
      "(INVALID_ARGUMENT, OUT_OF_RANGE, NON_FINITE, OVERFLOW, UNSUPPORTED, BACKEND, INTERNAL).",
      PyExc_ValueError, nullptr);
  if (!error_type) throw nb::python_error();
  // fmkv.FmkvTypeError(FmkvError, TypeError): an argument of the wrong type (a float or a string
  // where an integer is expected, a numpy array where a torch tensor is); status INVALID_ARGUMENT.
  static PyObject* type_error_type = [] {
    PyObject* bases = PyTuple_Pack(2, error_type, PyExc_TypeError);
    if (!bases) throw nb::python_error();
    PyObject* t = PyErr_NewExceptionWithDoc("fmkv.FmkvTypeError",
                                            "an argument of the wrong type: both an fmkv.FmkvError and a TypeError",
                                            bases, nullptr);
    Py_DECREF(bases);
    if (!t) throw nb::python_error();
    return t;
  }();
  nb::setattr(nb::handle(error_type), "code", nb::int_((int)FMKV_ERR_INVALID_ARGUMENT));
  nb::setattr(nb::handle(error_type), "status", nb::str(status_name(FMKV_ERR_INVALID_ARGUMENT)));
  m.attr("FmkvError") = nb::handle(error_type);
  m.attr("FmkvTypeError") = nb::handle(type_error_type);
  nb::dict codes;
  for (int c = FMKV_ERR_INVALID_ARGUMENT; c <= FMKV_ERR_INTERNAL; ++c) codes[status_name(c)] = c;
  m.attr("STATUS_CODES") = codes;  // {status name: fmkv_status value}, for errors raised in Python
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fmkv::Error& e) {
      PyObject* type = dynamic_cast<const ArgTypeError*>(&e) ? type_error_type : error_type;
      nb::object exc = nb::handle(type)(nb::str(e.what()));
      nb::setattr(exc, "code", nb::int_(e.code()));
      nb::setattr(exc, "status", nb::str(status_name(e.code())));
      PyErr_SetObject(type, exc.ptr());
    }
  });
}

}  // namespace fmkv_py

#include "errors.h"

#include <string>

namespace py = pybind11;

namespace strata_py {

namespace {

PyObject* ExceptionType(const strata::Status& s) {
  using strata::StatusCode;
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return PyExc_ValueError;
    case StatusCode::kNotFound:
      return PyExc_FileNotFoundError;
    case StatusCode::kPermissionDenied:
      return PyExc_PermissionError;
    case StatusCode::kAlreadyExists:
      return PyExc_FileExistsError;
    case StatusCode::kIOError:
    case StatusCode::kDataLoss:
      return PyExc_OSError;
    case StatusCode::kResourceExhausted:
      return s.errno_value() != 0 ? PyExc_OSError : PyExc_RuntimeError;
    case StatusCode::kUnimplemented:
      return PyExc_NotImplementedError;
    default:
      return PyExc_RuntimeError;
  }
}

}  // namespace

void ThrowStatus(const strata::Status& status) {
  PyObject* type = ExceptionType(status);
  py::object exc = py::reinterpret_borrow<py::object>(type)(status.message());
  exc.attr("status_code") = std::string(strata::StatusCodeName(status.code()));
  if (PyObject_IsSubclass(type, PyExc_OSError) == 1 && status.errno_value() != 0) {
    exc.attr("errno") = status.errno_value();
  }
  PyErr_SetObject(type, exc.ptr());
  throw py::error_already_set();
}

void ThrowValueError(const std::string& message) {
  PyErr_SetString(PyExc_ValueError, message.c_str());
  throw py::error_already_set();
}

void BindErrors(py::module_& m) {
  m.def(
      "_raise_status",
      [](const std::string& code, const std::string& message, int errno_value) {
        for (int c = 1; c <= static_cast<int>(strata::StatusCode::kInternal); ++c) {
          auto sc = static_cast<strata::StatusCode>(c);
          if (strata::StatusCodeName(sc) == code) {
            ThrowStatus(strata::Status(sc, message, errno_value));
          }
        }
        ThrowValueError("unknown status code " + code);
      },
      py::arg("code"), py::arg("message"), py::arg("errno") = 0,
      "For tests: raises the exception a Status of this code name becomes.");
}

}  // namespace strata_py

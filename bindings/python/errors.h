// Errors crossing into Python: a non-OK Status becomes a Python exception carrying the
// same message (docs/python.md, "Exceptions"):
//
//   InvalidArgument, OutOfRange                 -> ValueError
//   NotFound                                    -> FileNotFoundError (an OSError)
//   PermissionDenied                            -> PermissionError (an OSError)
//   AlreadyExists                               -> FileExistsError (an OSError)
//   IOError, DataLoss                           -> OSError
//   ResourceExhausted with an errno (ENOSPC...) -> OSError
//   Unimplemented                               -> NotImplementedError (a RuntimeError)
//   everything else                             -> RuntimeError
//
// The exception's str() is the Status message; it also gets `status_code` (the code's
// name, e.g. "DataLoss") and, for OSErrors, `errno` when the Status carries one.
// Must be called with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "strata/core/status.h"

namespace strata_py {

[[noreturn]] void ThrowStatus(const strata::Status& status);

// Raises ValueError(message). Not `throw py::value_error`: on the GPU image (Ubuntu's g++
// 13, torch 2.11's shared pybind11 internals) that came out of a binding as "SystemError:
// returned NULL without setting an exception"; setting the error and throwing
// error_already_set is the path every Status takes.
[[noreturn]] void ThrowValueError(const std::string& message);

inline void Check(const strata::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

template <typename T>
T ValueOrThrow(strata::Result<T> r) {
  if (!r.ok()) ThrowStatus(r.status());
  return std::move(r).value();
}

void BindErrors(pybind11::module_& m);
void BindOptim(pybind11::module_& m);
void BindIo(pybind11::module_& m);
void BindNvmeBench(pybind11::module_& m);
void BindEngine(pybind11::module_& m);

}  // namespace strata_py

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

#include <utility>

#include "strata/core/status.h"

namespace strata_py {

[[noreturn]] void ThrowStatus(const strata::Status& status);

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

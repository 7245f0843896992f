// strata::Error: the exception the LibTorch front end throws (and the autograd functions of
// the layer under both front ends, tensor_engine.h); what() is the Status' message.
#pragma once

#include <stdexcept>
#include <utility>

#include "strata/core/status.h"

namespace strata {

class Error : public std::runtime_error {
 public:
  explicit Error(Status status)
      : std::runtime_error(status.message()), status_(std::move(status)) {}
  const Status& status() const { return status_; }

 private:
  Status status_;
};

}  // namespace strata

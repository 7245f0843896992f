// ParseNvmeBenchJson over arbitrary text: no crash, leak or undefined behaviour; what it
// accepts is two positive finite bandwidths, and what it refuses it names.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/core/planner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::Result<strata::MeasuredBandwidth> m = strata::ParseNvmeBenchJson(text);
  if (m.ok()) {
    if (!(m->read > 0) || !(m->write > 0) || !std::isfinite(m->read) || !std::isfinite(m->write)) {
      __builtin_trap();
    }
  } else if (m.status().message().empty()) {
    __builtin_trap();
  }
  return 0;
}

// The frozen base's fingerprint (checkpoint.h).
#include <algorithm>

#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

uint64_t FrozenFingerprintSum(std::span<float> values, uint64_t first_index,
                              std::optional<DType> round_to) {
  constexpr size_t kBlock = 1024;
  uint16_t rounded[kBlock];
  uint64_t sum = 0;
  for (size_t at = 0; at < values.size(); at += kBlock) {
    const size_t n = std::min(kBlock, values.size() - at);
    float* v = values.data() + at;
    if (round_to && *round_to != DType::kFloat32) {
      ConvertFromFloat(v, n, rounded, *round_to);
      ConvertToFloat(rounded, *round_to, n, v);
    }
    sum += BulkIndexedBitsSum(std::span<const float>(v, n), first_index + at);
  }
  return sum;
}
}  // namespace strata::engine

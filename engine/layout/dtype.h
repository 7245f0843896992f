// Working dtypes of the engine and element conversions over raw bytes.
//
// The working dtype is the type parameters are stored, gathered and communicated in,
// and the type of the gradient buckets: fp32 (no mixed precision), bf16 (`bf16.enabled`)
// or fp16 (`fp16.enabled`). Master parameters, Adam moments and gradient accumulators
// are always fp32.
//
// Conversions round to nearest even (optim/cpu_adam's FloatToBFloat16/FloatToFloat16);
// 16-bit values are raw bit patterns (uint16_t).
//
// Thread-safety: all functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16 };

constexpr size_t DTypeSize(DType t) {
  return t == DType::kFloat32 ? 4 : 2;
}
std::string_view DTypeName(DType t);  // "fp32", "bf16", "fp16"
comm::DType ToCommDType(DType t);
ScalarType ToScalarType(DType t);
// fp16.enabled -> fp16, bf16 -> bf16, else fp32.
DType WorkingDTypeFromConfig(const Config& config);

// dst[i] = float(src[i]) for n elements.
void ConvertToFloat(const void* src, DType src_type, size_t n, float* dst);
// dst[i] = src[i] rounded to dst_type (a copy for fp32).
void ConvertFromFloat(const float* src, size_t n, void* dst, DType dst_type);
// dst = src converted (memcpy when the types are equal).
void Convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);
// dst[i] = dst[i] + src[i], computed in fp32 and rounded to dst_type once.
void AddInto(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace strata::engine

#include "strata/engine/layout/dtype.h"

#include <cstring>
#include <span>

namespace strata::engine {
namespace {

// Element access per type, so the loops below are specialized (no switch per element).
struct F32 {
  static float Load(const void* p, size_t i) { return static_cast<const float*>(p)[i]; }
  static void Store(void* p, size_t i, float v) { static_cast<float*>(p)[i] = v; }
};
struct BF16 {
  static float Load(const void* p, size_t i) {
    return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  static void Store(void* p, size_t i, float v) {
    static_cast<uint16_t*>(p)[i] = FloatToBFloat16(v);
  }
};
struct FP16 {
  static float Load(const void* p, size_t i) {
    return Float16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  static void Store(void* p, size_t i, float v) {
    static_cast<uint16_t*>(p)[i] = FloatToFloat16(v);
  }
};

template <typename F>
void WithType(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      f(F32{});
      return;
    case DType::kBFloat16:
      f(BF16{});
      return;
    case DType::kFloat16:
      f(FP16{});
      return;
  }
}

}  // namespace

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "fp32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
  }
  return "?";
}

comm::DType ToCommDType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return comm::DType::kFloat32;
    case DType::kBFloat16:
      return comm::DType::kBFloat16;
    case DType::kFloat16:
      return comm::DType::kFloat16;
  }
  return comm::DType::kFloat32;
}

ScalarType ToScalarType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return ScalarType::kFloat32;
    case DType::kBFloat16:
      return ScalarType::kBFloat16;
    case DType::kFloat16:
      return ScalarType::kFloat16;
  }
  return ScalarType::kFloat32;
}

DType WorkingDTypeFromConfig(const Config& config) {
  if (config.fp16.enabled) return DType::kFloat16;
  if (config.bf16) return DType::kBFloat16;
  return DType::kFloat32;
}

// The 16-bit <-> fp32 paths run optim/cpu_adam's SIMD bulk converters (bit-identical to
// the element converters); the rest are element loops.
void ConvertToFloat(const void* src, DType src_type, size_t n, float* dst) {
  if (n == 0) return;
  if (src_type == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  BulkToFloat(GradSpan{src, n, ToScalarType(src_type)}, std::span<float>(dst, n));
}

void ConvertFromFloat(const float* src, size_t n, void* dst, DType dst_type) {
  if (n == 0) return;
  if (dst_type == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  BulkToHalf(std::span<const float>(src, n),
             Param16Span{static_cast<uint16_t*>(dst), n, ToScalarType(dst_type)});
}

void Convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (n == 0) return;
  if (src_type == dst_type) {
    std::memcpy(dst, src, n * DTypeSize(src_type));
    return;
  }
  if (dst_type == DType::kFloat32) {
    ConvertToFloat(src, src_type, n, static_cast<float*>(dst));
    return;
  }
  if (src_type == DType::kFloat32) {
    ConvertFromFloat(static_cast<const float*>(src), n, dst, dst_type);
    return;
  }
  WithType(src_type, [&](auto S) {
    WithType(dst_type, [&](auto D) {
      for (size_t i = 0; i < n; ++i)
        decltype(D)::Store(dst, i, decltype(S)::Load(src, i));
    });
  });
}

void AddInto(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (n == 0) return;
  if (dst_type == DType::kFloat32) {  // the gradient accumulators
    BulkAddToFloat(GradSpan{src, n, ToScalarType(src_type)},
                   std::span<float>(static_cast<float*>(dst), n));
    return;
  }
  WithType(src_type, [&](auto S) {
    WithType(dst_type, [&](auto D) {
      using SrcT = decltype(S);
      using DstT = decltype(D);
      for (size_t i = 0; i < n; ++i)
        DstT::Store(dst, i, DstT::Load(dst, i) + SrcT::Load(src, i));
    });
  });
}

}  // namespace strata::engine

#include "strata/engine/dtype.h"

#include <cstring>

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

void ConvertToFloat(const void* src, DType src_type, size_t n, float* dst) {
  if (n == 0) return;
  if (src_type == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  WithType(src_type, [&](auto S) {
    for (size_t i = 0; i < n; ++i)
      dst[i] = decltype(S)::Load(src, i);
  });
}

void ConvertFromFloat(const float* src, size_t n, void* dst, DType dst_type) {
  if (n == 0) return;
  if (dst_type == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  WithType(dst_type, [&](auto D) {
    for (size_t i = 0; i < n; ++i)
      decltype(D)::Store(dst, i, src[i]);
  });
}

void Convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (n == 0) return;
  if (src_type == dst_type) {
    std::memcpy(dst, src, n * DTypeSize(src_type));
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

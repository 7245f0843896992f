// The portable kernels: plain C++ with std::fma and std::sqrt, compiled with the baseline
// flags so they run on every x86-64 CPU. They define the results the vector kernels
// reproduce bit for bit (see kernels.h).
#include "strata/optim/cpu_adam/kernels.h"

namespace strata::cpu_adam_internal {
namespace {

template <ScalarType G, bool kL2, bool kDecoupled>
struct ScalarAdam {
  static void Run(const KernelConsts& c, float* p, float* m, float* v, const void* g, uint16_t* out,
                  ScalarType ot, size_t n) {
    AdamScalarRange<G, kL2, kDecoupled>(c, p, m, v, g, out, ot, 0, n);
  }
};

void Adam(const KernelConsts& c, float* p, float* m, float* v, const void* g, ScalarType gt,
          uint16_t* out, ScalarType ot, size_t n) {
  DispatchAdam<ScalarAdam>(c, p, m, v, g, gt, out, ot, n);
}

void SumSq(const void* g, ScalarType gt, size_t n, double lanes[16]) {
  switch (gt) {
    case ScalarType::kFloat32:
      SumSqScalarRange<ScalarType::kFloat32>(g, 0, n, lanes);
      break;
    case ScalarType::kBFloat16:
      SumSqScalarRange<ScalarType::kBFloat16>(g, 0, n, lanes);
      break;
    case ScalarType::kFloat16:
      SumSqScalarRange<ScalarType::kFloat16>(g, 0, n, lanes);
      break;
  }
}

void ToHalf(const float* src, uint16_t* dst, ScalarType ot, size_t n) {
  for (size_t i = 0; i < n; ++i)
    dst[i] = StoreHalf(src[i], ot);
}

void ToFloat(const void* src, ScalarType st, float* dst, size_t n, bool add) {
  WithScalarType(st, [&]<ScalarType G>() { ToFloatScalarRange<G>(src, dst, 0, n, add); });
}

void AddToZero(const void* src, ScalarType st, float* dst, size_t n) {
  WithScalarType(st, [&]<ScalarType G>() { AddToZeroScalarRange<G>(src, dst, 0, n); });
}

void AddToZeroSumSq(const void* src, ScalarType st, float* dst, size_t n, double lanes[16]) {
  WithScalarType(st, [&]<ScalarType G>() { AddToZeroSumSqScalarRange<G>(src, dst, 0, n, lanes); });
}

void LambMoments(const LambConsts& c, const float* p, float* m, float* v, const void* g,
                 ScalarType gt, size_t n, double w_lanes[16], double u_lanes[16]) {
  WithScalarType(gt, [&]<ScalarType G>() {
    LambMomentsScalarRange<G>(c, p, m, v, g, 0, n, w_lanes, u_lanes);
  });
}

void LambApply(const LambConsts& c, float* p, const float* m, const float* v, uint16_t* out,
               ScalarType ot, size_t n) {
  LambApplyScalarRange(c, p, m, v, out, ot, 0, n);
}

uint64_t IndexedBitsSum(const float* v, uint64_t first, size_t n) {
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i)
    sum += IndexedBitsTerm(first + i, F2U(v[i]));
  return sum;
}

}  // namespace

const KernelTable& ScalarKernels() {
  static const KernelTable table{&Adam,        &SumSq,     &ToHalf,
                                 &ToFloat,     &AddToZero, &AddToZeroSumSq,
                                 &LambMoments, &LambApply, &IndexedBitsSum};
  return table;
}

}  // namespace strata::cpu_adam_internal

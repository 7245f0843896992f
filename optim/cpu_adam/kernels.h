// Internal: the per-ISA kernel tables and the element-wise definition every kernel
// follows. Not installed.
//
// Each ISA's kernels live in their own translation unit compiled with their own -m flags
// (kernels_scalar.cc, kernels_avx2.cc, kernels_avx512.cc); only cpu_adam.cc, compiled
// with the baseline flags, chooses among them after checking cpuid. The helpers below
// are in an unnamed namespace so every TU gets its own copy compiled with its own flags
// (no ODR merging of an AVX-512 body into the scalar TU).
//
// The element-wise step, in float with correctly rounded operations, in this order
// (c = KernelConsts):
//   g  = grad * c.gscale
//   g  = fma(c.wd, p, g)                      (L2 mode only)
//   m  = fma(c.beta1, m, c.omb1 * g)
//   v  = fma(c.beta2, v, (c.omb2 * g) * g)
//   d  = fma(sqrt(v), c.inv_sqrt_bc2, c.eps)
//   p  = p * c.decay                          (decoupled mode only)
//   p  = fma(c.neg_step_size, m / d, p)
//
// LAMB (c = LambConsts) in two passes over a tensor, because the trust ratio needs the
// whole tensor's norms before any parameter changes:
//   pass 1 (moments): g, m and v as Adam's (no decay term), then
//     u  = Update(p, m, v);  w_lanes[i % 16] += double(p)^2;  u_lanes[i % 16] += double(u)^2
//   pass 2 (apply):
//     p  = fma(c.neg_lr_ratio, Update(p, m, v), p)
//   Update(p, m, v):
//     d  = fma(sqrt(v), c.inv_sqrt_bc2, c.eps)   (eps outside the root, the default)
//     d  = sqrt(fma(v, c.inv_bc2, c.eps))        (eps_inside_sqrt)
//     u  = fma(c.wd, p, (m * c.inv_bc1) / d)
// Pass 2 recomputes u from p, m and v (bit-identical to pass 1's) rather than storing it:
// storing costs the same bytes as re-reading m and v.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::cpu_adam_internal {

struct KernelConsts {
  float gscale = 1.0f;
  float beta1 = 0.9f, omb1 = 0.1f;
  float beta2 = 0.999f, omb2 = 0.001f;
  float eps = 1e-8f;
  float inv_sqrt_bc2 = 1.0f;
  float neg_step_size = -1e-3f;
  float wd = 0.0f;     // L2 mode
  float decay = 1.0f;  // decoupled mode
  bool l2 = false;
  bool decoupled = false;
};

// out_type is meaningful only when out != nullptr.
using AdamFn = void (*)(const KernelConsts& c, float* p, float* m, float* v, const void* g,
                        ScalarType grad_type, uint16_t* out, ScalarType out_type, size_t n);
// Adds g[i]^2 (in double) into lanes[i % 16] for i in [0, n), elementwise in index order.
// Returns nothing; the caller reduces the lanes in a fixed order.
using SumSqFn = void (*)(const void* g, ScalarType grad_type, size_t n, double lanes[16]);
using ToHalfFn = void (*)(const float* src, uint16_t* dst, ScalarType out_type, size_t n);
// dst[i] = float(src[i]), or dst[i] += float(src[i]) (one float addition) with `add`.
using ToFloatFn = void (*)(const void* src, ScalarType src_type, float* dst, size_t n, bool add);
// dst[i] = 0.0f + float(src[i]) without reading dst: ToFloatFn's addition where dst holds
// +0.0f (a -0.0 source gives +0.0). The vector kernels write with non-temporal stores and
// end with a store fence.
using AddToZeroFn = void (*)(const void* src, ScalarType src_type, float* dst, size_t n);
// AddToZeroFn, and adds double(dst[i])^2 into lanes[i % 16] in index order (SumSqFn over
// the written dst): the gradient norm's lanes from the values as they are written, without
// reading them back. With a 64-byte aligned dst (AVX-512; 32 for AVX2) every full vector is
// streamed; otherwise the same values are written with ordinary stores.
using AddToZeroSumSqFn = void (*)(const void* src, ScalarType src_type, float* dst, size_t n,
                                  double lanes[16]);

// The sum mod 2^64 of IndexedBitsTerm(first + i, bits of v[i]) for i in [0, n).
using IndexedBitsSumFn = uint64_t (*)(const float* v, uint64_t first, size_t n);

struct LambConsts {
  float gscale = 1.0f;
  float beta1 = 0.9f, omb1 = 0.1f;
  float beta2 = 0.999f, omb2 = 0.001f;
  float eps = 1e-8f;
  float inv_bc1 = 1.0f;       // 1 / (1 - beta1^t)
  float inv_bc2 = 1.0f;       // 1 / (1 - beta2^t)        (eps_inside_sqrt)
  float inv_sqrt_bc2 = 1.0f;  // 1 / sqrt(1 - beta2^t)    (eps outside)
  float wd = 0.0f;
  float neg_lr_ratio = 0.0f;  // -lr * trust ratio (pass 2)
  bool eps_inside_sqrt = false;
};

// Pass 1 over [0, n): updates m and v; adds p^2 and u^2 (in double) into the lanes
// [i % 16] in index order.
using LambMomentsFn = void (*)(const LambConsts& c, const float* p, float* m, float* v,
                               const void* g, ScalarType grad_type, size_t n, double w_lanes[16],
                               double u_lanes[16]);
// Pass 2 over [0, n): updates p and writes the optional 16-bit copy.
using LambApplyFn = void (*)(const LambConsts& c, float* p, const float* m, const float* v,
                             uint16_t* out, ScalarType out_type, size_t n);

struct KernelTable {
  AdamFn adam;
  SumSqFn sumsq;
  ToHalfFn to_half;
  ToFloatFn to_float;
  AddToZeroFn add_to_zero;
  AddToZeroSumSqFn add_to_zero_sumsq;
  LambMomentsFn lamb_moments;
  LambApplyFn lamb_apply;
  IndexedBitsSumFn indexed_bits_sum;
};

const KernelTable& ScalarKernels();
const KernelTable& Avx2Kernels();
const KernelTable& Avx512Kernels();

namespace {

[[maybe_unused]] inline float U2F(uint32_t u) {
  return std::bit_cast<float>(u);
}
[[maybe_unused]] inline uint32_t F2U(float f) {
  return std::bit_cast<uint32_t>(f);
}

[[maybe_unused]] inline float Bf16ToF32(uint16_t h) {
  return U2F(uint32_t{h} << 16);
}

[[maybe_unused]] inline uint16_t F32ToBf16(float f) {
  const uint32_t bits = F2U(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Exact, as F16C's vcvtph2ps (NaN made quiet).
[[maybe_unused]] inline float Fp16ToF32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24, exact
    return U2F(F2U(mag) | sign);
  }
  if (exp == 31) {
    return U2F(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
  }
  return U2F(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even, as F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT (NaN keeps
// the top payload bits and is made quiet). Needs the default MXCSR (no FTZ/DAZ).
[[maybe_unused]] inline uint16_t F32ToFp16(float f) {
  uint32_t x = F2U(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t o;
  if (x >= 0x47800000u) {  // >= 65536: inf, or NaN
    o = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (x < 0x38800000u) {           // below 2^-14: subnormal or zero
    const float magic = U2F(126u << 23);  // 0.5: its ulp is 2^-24, the fp16 subnormal step
    o = F2U(U2F(x) + magic) - F2U(magic);
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += 0xc8000fffu + odd;  // rebias exponent (-112 << 23, mod 2^32) and round
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | sign);
}

template <ScalarType G>
inline float LoadGrad(const void* g, size_t i) {
  if constexpr (G == ScalarType::kFloat32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (G == ScalarType::kBFloat16) {
    return Bf16ToF32(static_cast<const uint16_t*>(g)[i]);
  } else {
    return Fp16ToF32(static_cast<const uint16_t*>(g)[i]);
  }
}

// Software prefetch of the streaming kernels. The hardware prefetchers stop at each 4 KiB
// page and ramp up again on the next one's first misses, so a thread with several
// concurrent streams (Adam: p, m, v and the gradient) or one long dependent chain (the
// norm pass) keeps too few lines in flight. Measured on the 2-core dev VM at 64M
// parameters (docs/PERFORMANCE.md "Peers"): the Adam step went from 0.87-0.90 of the
// memory roofline to the roofline with each stream prefetched 1 KiB ahead (2 and 4 KiB
// were no better), and the norm pass over bf16 gradients from 12-15 GB/s to about
// 30 GB/s with its one stream prefetched 8 KiB ahead. A prefetch never faults, and the
// address is formed as an integer, so reaching past a buffer's end is harmless.
// The helpers are always inlined: GCC 12 at -O2 otherwise judged a not-yet-inlined helper
// side-effect free (a prefetch changes no memory) and deleted its calls from the Adam loops.
inline constexpr size_t kStreamPrefetchBytes = 1024;  // each of several streams
inline constexpr size_t kSinglePrefetchBytes = 8192;  // a pass with one stream

// Prefetches the line `ahead` bytes past element i of an array of T.
template <typename T>
[[gnu::always_inline]] inline void PrefetchAhead(const T* base, size_t i, size_t ahead) {
  __builtin_prefetch(
      reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + i * sizeof(T) + ahead));
}

// The same for a gradient stream of type G (fp32 or 16-bit).
template <ScalarType G>
[[gnu::always_inline]] inline void PrefetchGradAhead(const void* g, size_t i, size_t ahead) {
  if constexpr (G == ScalarType::kFloat32) {
    PrefetchAhead(static_cast<const float*>(g), i, ahead);
  } else {
    PrefetchAhead(static_cast<const uint16_t*>(g), i, ahead);
  }
}

// Adam's (and LAMB's first pass's) four input streams.
template <ScalarType G>
[[gnu::always_inline]] inline void PrefetchAdamStreams(const float* p, const float* m,
                                                       const float* v, const void* g, size_t i) {
  PrefetchAhead(p, i, kStreamPrefetchBytes);
  PrefetchAhead(m, i, kStreamPrefetchBytes);
  PrefetchAhead(v, i, kStreamPrefetchBytes);
  PrefetchGradAhead<G>(g, i, kStreamPrefetchBytes);
}

[[maybe_unused]] inline uint16_t StoreHalf(float x, ScalarType t) {
  return t == ScalarType::kBFloat16 ? F32ToBf16(x) : F32ToFp16(x);
}

template <bool kL2, bool kDecoupled>
inline void AdamElement(const KernelConsts& c, float& p_io, float& m_io, float& v_io, float graw) {
  float g = graw * c.gscale;
  float p = p_io;
  if constexpr (kL2) g = std::fma(c.wd, p, g);
  const float m = std::fma(c.beta1, m_io, c.omb1 * g);
  const float t = c.omb2 * g;
  const float v = std::fma(c.beta2, v_io, t * g);
  const float d = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  if constexpr (kDecoupled) p = p * c.decay;
  p = std::fma(c.neg_step_size, m / d, p);
  p_io = p;
  m_io = m;
  v_io = v;
}

// The scalar loop of [begin, n): the whole scalar kernel, and the vector kernels' tails.
template <ScalarType G, bool kL2, bool kDecoupled>
inline void AdamScalarRange(const KernelConsts& c, float* p, float* m, float* v, const void* g,
                            uint16_t* out, ScalarType out_type, size_t begin, size_t n) {
  for (size_t i = begin; i < n; ++i) {
    AdamElement<kL2, kDecoupled>(c, p[i], m[i], v[i], LoadGrad<G>(g, i));
    if (out != nullptr) out[i] = StoreHalf(p[i], out_type);
  }
}

template <ScalarType G>
inline void SumSqScalarRange(const void* g, size_t begin, size_t n, double lanes[16]) {
  for (size_t i = begin; i < n; ++i) {
    const double x = LoadGrad<G>(g, i);
    lanes[i % 16] += x * x;  // x*x is exact in double, so this equals fma(x, x, lane)
  }
}

template <ScalarType G>
inline void ToFloatScalarRange(const void* src, float* dst, size_t begin, size_t n, bool add) {
  for (size_t i = begin; i < n; ++i)
    dst[i] = add ? dst[i] + LoadGrad<G>(src, i) : LoadGrad<G>(src, i);
}

template <ScalarType G>
inline void AddToZeroScalarRange(const void* src, float* dst, size_t begin, size_t n) {
  for (size_t i = begin; i < n; ++i)
    dst[i] = 0.0f + LoadGrad<G>(src, i);  // not folded: 0.0f + -0.0f is +0.0f
}

template <ScalarType G>
inline void AddToZeroSumSqScalarRange(const void* src, float* dst, size_t begin, size_t n,
                                      double lanes[16]) {
  for (size_t i = begin; i < n; ++i) {
    const float y = 0.0f + LoadGrad<G>(src, i);
    dst[i] = y;
    const double x = y;
    lanes[i % 16] += x * x;  // as SumSqScalarRange
  }
}

[[maybe_unused]] inline float LambUpdate(const LambConsts& c, float p, float m, float v) {
  const float d = c.eps_inside_sqrt ? std::sqrt(std::fma(v, c.inv_bc2, c.eps))
                                    : std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  return std::fma(c.wd, p, (m * c.inv_bc1) / d);
}

// The scalar loops of LAMB's passes over [begin, n): the scalar kernels, and the vector
// kernels' tails.
template <ScalarType G>
inline void LambMomentsScalarRange(const LambConsts& c, const float* p, float* m, float* v,
                                   const void* g, size_t begin, size_t n, double w_lanes[16],
                                   double u_lanes[16]) {
  for (size_t i = begin; i < n; ++i) {
    const float gi = LoadGrad<G>(g, i) * c.gscale;
    const float mi = std::fma(c.beta1, m[i], c.omb1 * gi);
    const float t = c.omb2 * gi;
    const float vi = std::fma(c.beta2, v[i], t * gi);
    m[i] = mi;
    v[i] = vi;
    const double pd = p[i];
    const double ud = LambUpdate(c, p[i], mi, vi);
    w_lanes[i % 16] += pd * pd;  // exact products: equal to the vector kernels' fma
    u_lanes[i % 16] += ud * ud;
  }
}

[[maybe_unused]] inline void LambApplyScalarRange(const LambConsts& c, float* p, const float* m,
                                                  const float* v, uint16_t* out,
                                                  ScalarType out_type, size_t begin, size_t n) {
  for (size_t i = begin; i < n; ++i) {
    p[i] = std::fma(c.neg_lr_ratio, LambUpdate(c, p[i], m[i], v[i]), p[i]);
    if (out != nullptr) out[i] = StoreHalf(p[i], out_type);
  }
}

// Calls `f.template operator()<G>()` with the ScalarType `t` as a template argument.
template <typename F>
inline void WithScalarType(ScalarType t, F&& f) {
  switch (t) {
    case ScalarType::kFloat32:
      f.template operator()<ScalarType::kFloat32>();
      break;
    case ScalarType::kBFloat16:
      f.template operator()<ScalarType::kBFloat16>();
      break;
    case ScalarType::kFloat16:
      f.template operator()<ScalarType::kFloat16>();
      break;
  }
}

// Instantiates `Kernel<G, kL2, kDecoupled>(c, p, m, v, g, out, out_type, n)` for the
// run-time choice.
template <template <ScalarType, bool, bool> class Kernel>
inline void DispatchAdam(const KernelConsts& c, float* p, float* m, float* v, const void* g,
                         ScalarType gt, uint16_t* out, ScalarType ot, size_t n) {
  auto by_mode = [&]<ScalarType G>() {
    if (c.l2) {
      if (c.decoupled) {
        Kernel<G, true, true>::Run(c, p, m, v, g, out, ot, n);
      } else {
        Kernel<G, true, false>::Run(c, p, m, v, g, out, ot, n);
      }
    } else if (c.decoupled) {
      Kernel<G, false, true>::Run(c, p, m, v, g, out, ot, n);
    } else {
      Kernel<G, false, false>::Run(c, p, m, v, g, out, ot, n);
    }
  };
  switch (gt) {
    case ScalarType::kFloat32:
      by_mode.template operator()<ScalarType::kFloat32>();
      break;
    case ScalarType::kBFloat16:
      by_mode.template operator()<ScalarType::kBFloat16>();
      break;
    case ScalarType::kFloat16:
      by_mode.template operator()<ScalarType::kFloat16>();
      break;
  }
}

}  // namespace
}  // namespace strata::cpu_adam_internal

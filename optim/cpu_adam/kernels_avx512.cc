// AVX-512 kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq plus the AVX2 set;
// called only when cpuid reports AVX-512F/BW/VL/DQ). 16 floats per vector, masked tails.
//
// bf16 conversion uses integer round-to-nearest-even rather than AVX512_BF16's
// vcvtneps2bf16: that instruction flushes subnormal inputs and outputs to zero, which
// would break bit-identity with the other kernels, and the pass is memory-bound anyway.
#include <immintrin.h>

#include <algorithm>

#include "strata/optim/cpu_adam/kernels.h"

namespace strata::cpu_adam_internal {
namespace {

template <ScalarType G>
inline __m512 LoadGrad16(const void* g, size_t i, __mmask16 k) {
  if constexpr (G == ScalarType::kFloat32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(g) + i);
    if constexpr (G == ScalarType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

inline __m256i ToBf16x16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline __m256i ToHalf16(__m512 x, ScalarType ot) {
  if (ot == ScalarType::kBFloat16) return ToBf16x16(x);
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The 16-bit copy-out of the lanes in `k`: a non-temporal store when `stream` (a full,
// 32-byte aligned vector of a write-only stream), else a masked one.
inline void StoreHalf16(uint16_t* dst, __mmask16 k, __m512 x, ScalarType ot, bool stream) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), ToHalf16(x, ot));
  } else {
    _mm256_mask_storeu_epi16(dst, k, ToHalf16(x, ot));
  }
}

template <ScalarType G, bool kL2, bool kDecoupled>
struct Avx512Adam {
  static inline void Block(const KernelConsts& c, float* p, float* m, float* v, const void* g,
                           uint16_t* out, ScalarType ot, size_t i, __mmask16 k, bool stream) {
    __m512 gv = _mm512_mul_ps(LoadGrad16<G>(g, i, k), _mm512_set1_ps(c.gscale));
    __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
    if constexpr (kL2) gv = _mm512_fmadd_ps(_mm512_set1_ps(c.wd), pv, gv);
    const __m512 mv = _mm512_fmadd_ps(_mm512_set1_ps(c.beta1), _mm512_maskz_loadu_ps(k, m + i),
                                      _mm512_mul_ps(_mm512_set1_ps(c.omb1), gv));
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(c.omb2), gv);
    const __m512 vv = _mm512_fmadd_ps(_mm512_set1_ps(c.beta2), _mm512_maskz_loadu_ps(k, v + i),
                                      _mm512_mul_ps(t, gv));
    const __m512 d =
        _mm512_fmadd_ps(_mm512_sqrt_ps(vv), _mm512_set1_ps(c.inv_sqrt_bc2), _mm512_set1_ps(c.eps));
    if constexpr (kDecoupled) pv = _mm512_mul_ps(pv, _mm512_set1_ps(c.decay));
    pv = _mm512_fmadd_ps(_mm512_set1_ps(c.neg_step_size), _mm512_div_ps(mv, d), pv);
    _mm512_mask_storeu_ps(p + i, k, pv);
    _mm512_mask_storeu_ps(m + i, k, mv);
    _mm512_mask_storeu_ps(v + i, k, vv);
    if (out != nullptr) StoreHalf16(out + i, k, pv, ot, stream);
  }
  static void Run(const KernelConsts& c, float* p, float* m, float* v, const void* g, uint16_t* out,
                  ScalarType ot, size_t n) {
    // The 16-bit copy is a write-only stream: non-temporal stores skip the read for
    // ownership of its lines when the copy is 32-byte aligned (full vectors only).
    const bool stream = out != nullptr && reinterpret_cast<uintptr_t>(out) % 32 == 0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      PrefetchAdamStreams<G>(p, m, v, g, i);
      Block(c, p, m, v, g, out, ot, i, 0xffff, stream);
    }
    if (stream) _mm_sfence();
    if (i < n) {
      Block(c, p, m, v, g, out, ot, i, static_cast<__mmask16>((1u << (n - i)) - 1), false);
    }
  }
};

void Adam(const KernelConsts& c, float* p, float* m, float* v, const void* g, ScalarType gt,
          uint16_t* out, ScalarType ot, size_t n) {
  DispatchAdam<Avx512Adam>(c, p, m, v, g, gt, out, ot, n);
}

// Adds the squares of a's 16 floats (in double) into acc0 (lanes 0-7) and acc1 (8-15).
inline void AddSquares16(__m512 a, __m512d& acc0, __m512d& acc1) {
  const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
  const __m512d x1 =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  acc0 = _mm512_fmadd_pd(x0, x0, acc0);
  acc1 = _mm512_fmadd_pd(x1, x1, acc1);
}

template <ScalarType G>
void SumSqT(const void* g, size_t n, double lanes[16]) {
  __m512d acc0 = _mm512_loadu_pd(lanes), acc1 = _mm512_loadu_pd(lanes + 8);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    PrefetchGradAhead<G>(g, i, kSinglePrefetchBytes);
    AddSquares16(LoadGrad16<G>(g, i, 0xffff), acc0, acc1);
  }
  _mm512_storeu_pd(lanes, acc0);
  _mm512_storeu_pd(lanes + 8, acc1);
  SumSqScalarRange<G>(g, i, n, lanes);
}

void SumSq(const void* g, ScalarType gt, size_t n, double lanes[16]) {
  switch (gt) {
    case ScalarType::kFloat32:
      SumSqT<ScalarType::kFloat32>(g, n, lanes);
      break;
    case ScalarType::kBFloat16:
      SumSqT<ScalarType::kBFloat16>(g, n, lanes);
      break;
    case ScalarType::kFloat16:
      SumSqT<ScalarType::kFloat16>(g, n, lanes);
      break;
  }
}

void ToHalf(const float* src, uint16_t* dst, ScalarType ot, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        ToHalf16(_mm512_loadu_ps(src + i), ot));
  }
  for (; i < n; ++i)
    dst[i] = StoreHalf(src[i], ot);
}

template <ScalarType G>
void ToFloatT(const void* src, float* dst, size_t n, bool add) {
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 k =
        n - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 x = LoadGrad16<G>(src, i, k);
    if (add) x = _mm512_add_ps(_mm512_maskz_loadu_ps(k, dst + i), x);
    _mm512_mask_storeu_ps(dst + i, k, x);
  }
}

void ToFloat(const void* src, ScalarType st, float* dst, size_t n, bool add) {
  WithScalarType(st, [&]<ScalarType G>() { ToFloatT<G>(src, dst, n, add); });
}

// A masked head up to dst's 64-byte boundary, streamed vectors, a masked tail.
template <ScalarType G>
void AddToZeroT(const void* src, float* dst, size_t n) {
  auto masked = [&](size_t i, size_t count) {
    const __mmask16 k = static_cast<__mmask16>((1u << count) - 1u);
    _mm512_mask_storeu_ps(dst + i, k, _mm512_add_ps(_mm512_setzero_ps(), LoadGrad16<G>(src, i, k)));
  };
  const size_t misaligned = (reinterpret_cast<uintptr_t>(dst) / sizeof(float)) % 16;
  size_t i = std::min(n, misaligned == 0 ? size_t{0} : 16 - misaligned);
  if (i > 0) masked(0, i);
  for (; i + 16 <= n; i += 16) {
    _mm512_stream_ps(dst + i,
                     _mm512_add_ps(_mm512_setzero_ps(), LoadGrad16<G>(src, i, __mmask16{0xffff})));
  }
  if (i < n) masked(i, n - i);
  _mm_sfence();
}

void AddToZero(const void* src, ScalarType st, float* dst, size_t n) {
  WithScalarType(st, [&]<ScalarType G>() { AddToZeroT<G>(src, dst, n); });
}

// Vectors of 16 from the call's start (the lanes' order): streamed when dst is 64-byte
// aligned, else stored; the scalar tail (as SumSqT's, so that masked-off lanes never reach
// the sums).
template <ScalarType G, bool kStream>
void AddToZeroSumSqT(const void* src, float* dst, size_t n, double lanes[16]) {
  __m512d acc0 = _mm512_loadu_pd(lanes), acc1 = _mm512_loadu_pd(lanes + 8);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_add_ps(_mm512_setzero_ps(), LoadGrad16<G>(src, i, __mmask16{0xffff}));
    if constexpr (kStream) {
      _mm512_stream_ps(dst + i, a);
    } else {
      _mm512_storeu_ps(dst + i, a);
    }
    AddSquares16(a, acc0, acc1);
  }
  _mm512_storeu_pd(lanes, acc0);
  _mm512_storeu_pd(lanes + 8, acc1);
  AddToZeroSumSqScalarRange<G>(src, dst, i, n, lanes);
  if constexpr (kStream) _mm_sfence();
}

void AddToZeroSumSq(const void* src, ScalarType st, float* dst, size_t n, double lanes[16]) {
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  WithScalarType(st, [&]<ScalarType G>() {
    if (aligned) {
      AddToZeroSumSqT<G, true>(src, dst, n, lanes);
    } else {
      AddToZeroSumSqT<G, false>(src, dst, n, lanes);
    }
  });
}

// LAMB (kernels.h). The moments pass runs full vectors only and leaves the tail to the
// scalar code, so masked-off lanes never reach the norm sums.
inline __m512 LambUpdate16(const LambConsts& c, __m512 p, __m512 m, __m512 v) {
  const __m512 d =
      c.eps_inside_sqrt
          ? _mm512_sqrt_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(c.inv_bc2), _mm512_set1_ps(c.eps)))
          : _mm512_fmadd_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.inv_sqrt_bc2),
                            _mm512_set1_ps(c.eps));
  return _mm512_fmadd_ps(_mm512_set1_ps(c.wd), p,
                         _mm512_div_ps(_mm512_mul_ps(m, _mm512_set1_ps(c.inv_bc1)), d));
}

inline __m512d LowHalfPd(__m512 x) {
  return _mm512_cvtps_pd(_mm512_castps512_ps256(x));
}
inline __m512d HighHalfPd(__m512 x) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

template <ScalarType G>
void LambMomentsT(const LambConsts& c, const float* p, float* m, float* v, const void* g, size_t n,
                  double w_lanes[16], double u_lanes[16]) {
  __m512d w0 = _mm512_loadu_pd(w_lanes), w1 = _mm512_loadu_pd(w_lanes + 8);
  __m512d u0 = _mm512_loadu_pd(u_lanes), u1 = _mm512_loadu_pd(u_lanes + 8);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    PrefetchAdamStreams<G>(p, m, v, g, i);
    const __m512 gv = _mm512_mul_ps(LoadGrad16<G>(g, i, 0xffff), _mm512_set1_ps(c.gscale));
    const __m512 mv = _mm512_fmadd_ps(_mm512_set1_ps(c.beta1), _mm512_loadu_ps(m + i),
                                      _mm512_mul_ps(_mm512_set1_ps(c.omb1), gv));
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(c.omb2), gv);
    const __m512 vv =
        _mm512_fmadd_ps(_mm512_set1_ps(c.beta2), _mm512_loadu_ps(v + i), _mm512_mul_ps(t, gv));
    _mm512_storeu_ps(m + i, mv);
    _mm512_storeu_ps(v + i, vv);
    const __m512 pv = _mm512_loadu_ps(p + i);
    const __m512 uv = LambUpdate16(c, pv, mv, vv);
    const __m512d pl = LowHalfPd(pv), ph = HighHalfPd(pv);
    const __m512d ul = LowHalfPd(uv), uh = HighHalfPd(uv);
    w0 = _mm512_fmadd_pd(pl, pl, w0);
    w1 = _mm512_fmadd_pd(ph, ph, w1);
    u0 = _mm512_fmadd_pd(ul, ul, u0);
    u1 = _mm512_fmadd_pd(uh, uh, u1);
  }
  _mm512_storeu_pd(w_lanes, w0);
  _mm512_storeu_pd(w_lanes + 8, w1);
  _mm512_storeu_pd(u_lanes, u0);
  _mm512_storeu_pd(u_lanes + 8, u1);
  LambMomentsScalarRange<G>(c, p, m, v, g, i, n, w_lanes, u_lanes);
}

void LambMoments(const LambConsts& c, const float* p, float* m, float* v, const void* g,
                 ScalarType gt, size_t n, double w_lanes[16], double u_lanes[16]) {
  WithScalarType(gt, [&]<ScalarType G>() { LambMomentsT<G>(c, p, m, v, g, n, w_lanes, u_lanes); });
}

void LambApply(const LambConsts& c, float* p, const float* m, const float* v, uint16_t* out,
               ScalarType ot, size_t n) {
  const bool stream = out != nullptr && reinterpret_cast<uintptr_t>(out) % 32 == 0;
  for (size_t i = 0; i < n; i += 16) {
    const bool full = n - i >= 16;
    const __mmask16 k = full ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1u);
    PrefetchAhead(p, i, kStreamPrefetchBytes);
    PrefetchAhead(m, i, kStreamPrefetchBytes);
    PrefetchAhead(v, i, kStreamPrefetchBytes);
    __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
    const __m512 uv =
        LambUpdate16(c, pv, _mm512_maskz_loadu_ps(k, m + i), _mm512_maskz_loadu_ps(k, v + i));
    pv = _mm512_fmadd_ps(_mm512_set1_ps(c.neg_lr_ratio), uv, pv);
    _mm512_mask_storeu_ps(p + i, k, pv);
    if (out != nullptr) StoreHalf16(out + i, k, pv, ot, stream && full);
  }
  if (stream) _mm_sfence();
}

// Eight indices a vector (AVX-512DQ's 64-bit multiply), two vectors an iteration
// (independent chains); the index times the golden ratio advanced by additions.
uint64_t IndexedBitsSum(const float* v, uint64_t first, size_t n) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  const __m512i m1 = _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ull));
  const __m512i m2 = _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBull));
  const __m512i golden = _mm512_set1_epi64(static_cast<long long>(kGolden));
  const __m512i step = _mm512_set1_epi64(static_cast<long long>(16 * kGolden));
  const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  auto lanes = [&](uint64_t at) {
    return _mm512_mullo_epi64(_mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(at)), iota),
                              golden);
  };
  auto term = [&](__m512i idx, const float* at) {
    const __m512i bits =
        _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    __m512i z = _mm512_xor_si512(idx, bits);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), m1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), m2);
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  };
  __m512i idx0 = lanes(first), idx1 = lanes(first + 8);
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm512_add_epi64(acc0, term(idx0, v + i));
    acc1 = _mm512_add_epi64(acc1, term(idx1, v + i + 8));
    idx0 = _mm512_add_epi64(idx0, step);
    idx1 = _mm512_add_epi64(idx1, step);
  }
  // Stored and added (GCC 12's _mm512_reduce_add_epi64 trips -Wuninitialized: bug 105593).
  alignas(64) uint64_t parts[8];
  _mm512_store_si512(parts, _mm512_add_epi64(acc0, acc1));
  uint64_t sum = 0;
  for (const uint64_t p : parts)
    sum += p;
  for (; i < n; ++i)
    sum += IndexedBitsTerm(first + i, F2U(v[i]));
  return sum;
}

}  // namespace

const KernelTable& Avx512Kernels() {
  static const KernelTable table{&Adam,        &SumSq,     &ToHalf,
                                 &ToFloat,     &AddToZero, &AddToZeroSumSq,
                                 &LambMoments, &LambApply, &IndexedBitsSum};
  return table;
}

}  // namespace strata::cpu_adam_internal

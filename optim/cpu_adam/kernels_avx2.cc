// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; called only when cpuid
// reports all three). 8 floats per vector; the tail runs the scalar element code of
// kernels.h, compiled here with the same flags.
#include <immintrin.h>

#include <algorithm>

#include "strata/optim/cpu_adam/kernels.h"

namespace strata::cpu_adam_internal {
namespace {

template <ScalarType G>
inline __m256 LoadGrad8(const void* g, size_t i) {
  if constexpr (G == ScalarType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == ScalarType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even to bf16; NaN -> quiet NaN (payload's top bits kept).
inline __m128i ToBf16x8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

inline __m128i ToHalf8(__m256 x, ScalarType ot) {
  if (ot == ScalarType::kBFloat16) return ToBf16x8(x);
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The 16-bit copy-out of 8 values: a non-temporal store when `stream` (the copy is 16-byte
// aligned: it skips the read for ownership of a write-only stream), else a plain one.
inline void StoreHalf8(uint16_t* dst, __m256 x, ScalarType ot, bool stream) {
  __m128i* d = reinterpret_cast<__m128i*>(dst);
  if (stream) {
    _mm_stream_si128(d, ToHalf8(x, ot));
  } else {
    _mm_storeu_si128(d, ToHalf8(x, ot));
  }
}

template <ScalarType G, bool kL2, bool kDecoupled>
struct Avx2Adam {
  static void Run(const KernelConsts& c, float* p, float* m, float* v, const void* g, uint16_t* out,
                  ScalarType ot, size_t n) {
    const __m256 gscale = _mm256_set1_ps(c.gscale);
    const __m256 beta1 = _mm256_set1_ps(c.beta1), omb1 = _mm256_set1_ps(c.omb1);
    const __m256 beta2 = _mm256_set1_ps(c.beta2), omb2 = _mm256_set1_ps(c.omb2);
    const __m256 eps = _mm256_set1_ps(c.eps), ibc2 = _mm256_set1_ps(c.inv_sqrt_bc2);
    const __m256 nstep = _mm256_set1_ps(c.neg_step_size);
    const __m256 wd = _mm256_set1_ps(c.wd), decay = _mm256_set1_ps(c.decay);
    // The 16-bit copy is a write-only stream: non-temporal stores skip the read for
    // ownership of its lines when the copy is 16-byte aligned.
    const bool stream = out != nullptr && reinterpret_cast<uintptr_t>(out) % 16 == 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      if (i % 16 == 0) {  // one prefetch per 64-byte line of each fp32 stream
        PrefetchAdamStreams<G>(p, m, v, g, i);
      }
      __m256 gv = _mm256_mul_ps(LoadGrad8<G>(g, i), gscale);
      __m256 pv = _mm256_loadu_ps(p + i);
      if constexpr (kL2) gv = _mm256_fmadd_ps(wd, pv, gv);
      const __m256 mv = _mm256_fmadd_ps(beta1, _mm256_loadu_ps(m + i), _mm256_mul_ps(omb1, gv));
      const __m256 t = _mm256_mul_ps(omb2, gv);
      const __m256 vv = _mm256_fmadd_ps(beta2, _mm256_loadu_ps(v + i), _mm256_mul_ps(t, gv));
      const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), ibc2, eps);
      if constexpr (kDecoupled) pv = _mm256_mul_ps(pv, decay);
      pv = _mm256_fmadd_ps(nstep, _mm256_div_ps(mv, d), pv);
      _mm256_storeu_ps(p + i, pv);
      _mm256_storeu_ps(m + i, mv);
      _mm256_storeu_ps(v + i, vv);
      if (out != nullptr) StoreHalf8(out + i, pv, ot, stream);
    }
    if (stream) _mm_sfence();
    AdamScalarRange<G, kL2, kDecoupled>(c, p, m, v, g, out, ot, i, n);
  }
};

void Adam(const KernelConsts& c, float* p, float* m, float* v, const void* g, ScalarType gt,
          uint16_t* out, ScalarType ot, size_t n) {
  DispatchAdam<Avx2Adam>(c, p, m, v, g, gt, out, ot, n);
}

// Adds the squares of x's 8 floats (in double) into acc[0] (lanes 0-3) and acc[1] (4-7).
inline void AddSquares8(__m256 x, __m256d* acc) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
  acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
}

template <ScalarType G>
void SumSqT(const void* g, size_t n, double lanes[16]) {
  __m256d acc[4];
  for (int k = 0; k < 4; ++k)
    acc[k] = _mm256_loadu_pd(lanes + 4 * k);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    PrefetchGradAhead<G>(g, i, kSinglePrefetchBytes);
    AddSquares8(LoadGrad8<G>(g, i), acc);
    AddSquares8(LoadGrad8<G>(g, i + 8), acc + 2);
  }
  for (int k = 0; k < 4; ++k)
    _mm256_storeu_pd(lanes + 4 * k, acc[k]);
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
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), ToHalf8(_mm256_loadu_ps(src + i), ot));
  }
  for (; i < n; ++i)
    dst[i] = StoreHalf(src[i], ot);
}

template <ScalarType G>
void ToFloatT(const void* src, float* dst, size_t n, bool add) {
  size_t i = 0;
  if (add) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), LoadGrad8<G>(src, i)));
  } else {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, LoadGrad8<G>(src, i));
  }
  ToFloatScalarRange<G>(src, dst, i, n, add);
}

void ToFloat(const void* src, ScalarType st, float* dst, size_t n, bool add) {
  WithScalarType(st, [&]<ScalarType G>() { ToFloatT<G>(src, dst, n, add); });
}

// The scalar head up to dst's 32-byte boundary, streamed vectors, the scalar tail.
template <ScalarType G>
void AddToZeroT(const void* src, float* dst, size_t n) {
  const size_t misaligned = (reinterpret_cast<uintptr_t>(dst) / sizeof(float)) % 8;
  size_t i = std::min(n, misaligned == 0 ? size_t{0} : 8 - misaligned);
  AddToZeroScalarRange<G>(src, dst, 0, i);
  for (; i + 8 <= n; i += 8)
    _mm256_stream_ps(dst + i, _mm256_add_ps(_mm256_setzero_ps(), LoadGrad8<G>(src, i)));
  AddToZeroScalarRange<G>(src, dst, i, n);
  _mm_sfence();
}

void AddToZero(const void* src, ScalarType st, float* dst, size_t n) {
  WithScalarType(st, [&]<ScalarType G>() { AddToZeroT<G>(src, dst, n); });
}

// Blocks of 16 from the call's start (the lanes' order): streamed when dst is 32-byte
// aligned, else stored; the scalar tail.
template <ScalarType G, bool kStream>
void AddToZeroSumSqT(const void* src, float* dst, size_t n, double lanes[16]) {
  __m256d acc[4];
  for (int k = 0; k < 4; ++k)
    acc[k] = _mm256_loadu_pd(lanes + 4 * k);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_add_ps(_mm256_setzero_ps(), LoadGrad8<G>(src, i));
    const __m256 b = _mm256_add_ps(_mm256_setzero_ps(), LoadGrad8<G>(src, i + 8));
    if constexpr (kStream) {
      _mm256_stream_ps(dst + i, a);
      _mm256_stream_ps(dst + i + 8, b);
    } else {
      _mm256_storeu_ps(dst + i, a);
      _mm256_storeu_ps(dst + i + 8, b);
    }
    AddSquares8(a, acc);
    AddSquares8(b, acc + 2);
  }
  for (int k = 0; k < 4; ++k)
    _mm256_storeu_pd(lanes + 4 * k, acc[k]);
  AddToZeroSumSqScalarRange<G>(src, dst, i, n, lanes);
  if constexpr (kStream) _mm_sfence();
}

void AddToZeroSumSq(const void* src, ScalarType st, float* dst, size_t n, double lanes[16]) {
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 32 == 0;
  WithScalarType(st, [&]<ScalarType G>() {
    if (aligned) {
      AddToZeroSumSqT<G, true>(src, dst, n, lanes);
    } else {
      AddToZeroSumSqT<G, false>(src, dst, n, lanes);
    }
  });
}

// LAMB (kernels.h): 16 elements per iteration (two vectors), so the four double
// accumulators of each sum hold the lanes i % 16 as the scalar code does.
inline __m256 LambUpdate8(const LambConsts& c, __m256 p, __m256 m, __m256 v) {
  const __m256 d =
      c.eps_inside_sqrt
          ? _mm256_sqrt_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(c.inv_bc2), _mm256_set1_ps(c.eps)))
          : _mm256_fmadd_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c.inv_sqrt_bc2),
                            _mm256_set1_ps(c.eps));
  return _mm256_fmadd_ps(_mm256_set1_ps(c.wd), p,
                         _mm256_div_ps(_mm256_mul_ps(m, _mm256_set1_ps(c.inv_bc1)), d));
}

// Moments of the 8 elements at i; returns p and u.
template <ScalarType G>
inline void LambMoments8(const LambConsts& c, const float* p, float* m, float* v, const void* g,
                         size_t i, __m256& pv, __m256& uv) {
  const __m256 gv = _mm256_mul_ps(LoadGrad8<G>(g, i), _mm256_set1_ps(c.gscale));
  const __m256 mv = _mm256_fmadd_ps(_mm256_set1_ps(c.beta1), _mm256_loadu_ps(m + i),
                                    _mm256_mul_ps(_mm256_set1_ps(c.omb1), gv));
  const __m256 t = _mm256_mul_ps(_mm256_set1_ps(c.omb2), gv);
  const __m256 vv =
      _mm256_fmadd_ps(_mm256_set1_ps(c.beta2), _mm256_loadu_ps(v + i), _mm256_mul_ps(t, gv));
  _mm256_storeu_ps(m + i, mv);
  _mm256_storeu_ps(v + i, vv);
  pv = _mm256_loadu_ps(p + i);
  uv = LambUpdate8(c, pv, mv, vv);
}

template <ScalarType G>
void LambMomentsT(const LambConsts& c, const float* p, float* m, float* v, const void* g, size_t n,
                  double w_lanes[16], double u_lanes[16]) {
  __m256d w[4], u[4];
  for (int k = 0; k < 4; ++k) {
    w[k] = _mm256_loadu_pd(w_lanes + 4 * k);
    u[k] = _mm256_loadu_pd(u_lanes + 4 * k);
  }
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 pa, ua, pb, ub;
    PrefetchAdamStreams<G>(p, m, v, g, i);
    LambMoments8<G>(c, p, m, v, g, i, pa, ua);
    LambMoments8<G>(c, p, m, v, g, i + 8, pb, ub);
    AddSquares8(pa, w);
    AddSquares8(pb, w + 2);
    AddSquares8(ua, u);
    AddSquares8(ub, u + 2);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_pd(w_lanes + 4 * k, w[k]);
    _mm256_storeu_pd(u_lanes + 4 * k, u[k]);
  }
  LambMomentsScalarRange<G>(c, p, m, v, g, i, n, w_lanes, u_lanes);
}

void LambMoments(const LambConsts& c, const float* p, float* m, float* v, const void* g,
                 ScalarType gt, size_t n, double w_lanes[16], double u_lanes[16]) {
  WithScalarType(gt, [&]<ScalarType G>() { LambMomentsT<G>(c, p, m, v, g, n, w_lanes, u_lanes); });
}

void LambApply(const LambConsts& c, float* p, const float* m, const float* v, uint16_t* out,
               ScalarType ot, size_t n) {
  const bool stream = out != nullptr && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) {  // one prefetch per 64-byte line of each stream
      PrefetchAhead(p, i, kStreamPrefetchBytes);
      PrefetchAhead(m, i, kStreamPrefetchBytes);
      PrefetchAhead(v, i, kStreamPrefetchBytes);
    }
    __m256 pv = _mm256_loadu_ps(p + i);
    const __m256 uv = LambUpdate8(c, pv, _mm256_loadu_ps(m + i), _mm256_loadu_ps(v + i));
    pv = _mm256_fmadd_ps(_mm256_set1_ps(c.neg_lr_ratio), uv, pv);
    _mm256_storeu_ps(p + i, pv);
    if (out != nullptr) StoreHalf8(out + i, pv, ot, stream);
  }
  if (stream) _mm_sfence();
  LambApplyScalarRange(c, p, m, v, out, ot, i, n);
}

// a * b mod 2^64 per 64-bit lane (AVX2 has no 64-bit multiply): the low product plus the
// two cross products shifted up; b_hi is b >> 32, given by the caller (b is a constant).
inline __m256i MulLo64(__m256i a, __m256i b, __m256i b_hi) {
  const __m256i lo = _mm256_mul_epu32(a, b);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b), _mm256_mul_epu32(a, b_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

// Four indices a vector, two vectors an iteration (independent chains); the index times the
// golden ratio advanced by additions.
uint64_t IndexedBitsSum(const float* v, uint64_t first, size_t n) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull, kM1 = 0xBF58476D1CE4E5B9ull,
                     kM2 = 0x94D049BB133111EBull;
  const __m256i m1 = _mm256_set1_epi64x(static_cast<long long>(kM1));
  const __m256i m1_hi = _mm256_set1_epi64x(static_cast<long long>(kM1 >> 32));
  const __m256i m2 = _mm256_set1_epi64x(static_cast<long long>(kM2));
  const __m256i m2_hi = _mm256_set1_epi64x(static_cast<long long>(kM2 >> 32));
  const __m256i step = _mm256_set1_epi64x(static_cast<long long>(8 * kGolden));
  auto lanes = [&](uint64_t at) {
    return _mm256_setr_epi64x(
        static_cast<long long>(at * kGolden), static_cast<long long>((at + 1) * kGolden),
        static_cast<long long>((at + 2) * kGolden), static_cast<long long>((at + 3) * kGolden));
  };
  auto term = [&](__m256i idx, const float* at) {
    const __m256i bits =
        _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    __m256i z = _mm256_xor_si256(idx, bits);
    z = MulLo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1, m1_hi);
    z = MulLo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2, m2_hi);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
  };
  __m256i idx0 = lanes(first), idx1 = lanes(first + 4);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_add_epi64(acc0, term(idx0, v + i));
    acc1 = _mm256_add_epi64(acc1, term(idx1, v + i + 4));
    idx0 = _mm256_add_epi64(idx0, step);
    idx1 = _mm256_add_epi64(idx1, step);
  }
  alignas(32) uint64_t parts[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), _mm256_add_epi64(acc0, acc1));
  uint64_t sum = parts[0] + parts[1] + parts[2] + parts[3];
  for (; i < n; ++i)
    sum += IndexedBitsTerm(first + i, F2U(v[i]));
  return sum;
}

}  // namespace

const KernelTable& Avx2Kernels() {
  static const KernelTable table{&Adam,        &SumSq,     &ToHalf,
                                 &ToFloat,     &AddToZero, &AddToZeroSumSq,
                                 &LambMoments, &LambApply, &IndexedBitsSum};
  return table;
}

}  // namespace strata::cpu_adam_internal

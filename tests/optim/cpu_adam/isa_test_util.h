// Shared by the CPU-Adam and LAMB kernel tests: the ISA and gradient-type matrix, the skip
// for an ISA this CPU lacks (with the reason), the kernel driver of an ISA, the state of one
// update on unaligned spans, test names.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::cpu_adam_test {

inline constexpr CpuIsa kAllIsas[] = {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512};
inline constexpr ScalarType kGradTypes[] = {ScalarType::kFloat32, ScalarType::kBFloat16,
                                            ScalarType::kFloat16};

#define SKIP_IF_UNSUPPORTED(isa)                                               \
  if (!CpuSupportsIsa(isa))                                                    \
  GTEST_SKIP() << "this CPU lacks the instructions of the " << CpuIsaName(isa) \
               << " kernel (cpuid); best supported: " << CpuIsaName(BestCpuIsa())

inline std::unique_ptr<CpuAdam> MakeAdam(CpuIsa isa, int threads = 0) {
  CpuAdam::Options o;
  o.isa = isa;
  o.num_threads = threads;
  auto r = CpuAdam::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return std::move(r).value();
}

// Storage with a deliberate one-element offset so spans are not 16/32/64-byte aligned.
struct State {
  State(size_t size, uint32_t seed, ScalarType gt, double gmul = 1.0, float pscale = 1.0f)
      : n(size),
        grad_type(gt),
        p_(size + 1),
        m_(size + 1),
        v_(size + 1),
        g32_(size + 1),
        g16_(size + 1) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> up(-pscale, pscale), uv(0.0f, 1e-4f);
    std::normal_distribution<float> nm(0.0f, 1e-2f);
    for (size_t i = 0; i < n; ++i) {
      p()[i] = up(rng);
      m()[i] = nm(rng);
      v()[i] = uv(rng);
    }
    NewGrad(seed + 1, gmul);
  }
  void NewGrad(uint32_t seed, double gmul) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> ng(0.0f, 3e-2f);
    for (size_t i = 0; i < n; ++i) {
      const float x = static_cast<float>(ng(rng) * gmul);
      if (grad_type == ScalarType::kFloat32) {
        g32()[i] = x;
      } else if (grad_type == ScalarType::kBFloat16) {
        g16()[i] = FloatToBFloat16(x);
      } else {
        g16()[i] = FloatToFloat16(x);
      }
    }
  }
  float* p() { return p_.data() + 1; }
  float* m() { return m_.data() + 1; }
  float* v() { return v_.data() + 1; }
  // p, m and v one after the other: what a step left, to compare runs bit for bit.
  std::vector<float> Snapshot() {
    std::vector<float> out(p(), p() + n);
    out.insert(out.end(), m(), m() + n);
    out.insert(out.end(), v(), v() + n);
    return out;
  }
  float* g32() { return g32_.data() + 1; }
  uint16_t* g16() { return g16_.data() + 1; }
  double GradAt(size_t i) {
    if (grad_type == ScalarType::kFloat32) return g32()[i];
    if (grad_type == ScalarType::kBFloat16) return BFloat16ToFloat(g16()[i]);
    return Float16ToFloat(g16()[i]);
  }
  GradSpan Grad() {
    if (grad_type == ScalarType::kFloat32) return GradSpan::Fp32({g32(), n});
    return {g16(), n, grad_type};
  }
  AdamTensors Tensors(uint16_t* out = nullptr, ScalarType ot = ScalarType::kBFloat16) {
    AdamTensors t{{p(), n}, {m(), n}, {v(), n}, Grad(), {}};
    if (out != nullptr) t.param16 = {out, n, ot};
    return t;
  }
  size_t n;
  ScalarType grad_type;
  std::vector<float> p_, m_, v_, g32_;
  std::vector<uint16_t> g16_;
};

inline std::string KernelTestName(
    const ::testing::TestParamInfo<std::tuple<CpuIsa, ScalarType>>& info) {
  return std::string(CpuIsaName(std::get<0>(info.param))) + "_" +
         std::string(ScalarTypeName(std::get<1>(info.param)));
}

}  // namespace strata::cpu_adam_test

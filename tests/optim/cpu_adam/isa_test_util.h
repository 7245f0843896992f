// Shared by the CPU-Adam and LAMB kernel tests: the ISA and gradient-type matrix, the skip
// for an ISA this CPU lacks (with the reason), the kernel driver of an ISA, test names.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>

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

inline std::string KernelTestName(
    const ::testing::TestParamInfo<std::tuple<CpuIsa, ScalarType>>& info) {
  return std::string(CpuIsaName(std::get<0>(info.param))) + "_" +
         std::string(ScalarTypeName(std::get<1>(info.param)));
}

}  // namespace strata::cpu_adam_test

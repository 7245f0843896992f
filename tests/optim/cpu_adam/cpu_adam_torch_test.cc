// Agreement of Strata's CPU Adam with LibTorch's torch::optim::Adam (L2 weight decay) and
// torch::optim::AdamW (decoupled) on the same data: params, exp_avg and exp_avg_sq within
// 1e-6 relative (max norm-wise) after 1 and after 10 steps, for every ISA this CPU has.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata {
namespace {

double RelErr(const std::vector<float>& x, const torch::Tensor& ref_t) {
  const torch::Tensor ref = ref_t.contiguous();
  const float* r = ref.data_ptr<float>();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num = std::max(num, std::abs(double(x[i]) - double(r[i])));
    den = std::max(den, std::abs(double(r[i])));
  }
  return den == 0 ? num : num / den;
}

struct Case {
  const char* name;
  bool decoupled;
  double lr, wd;
};

class CpuAdamTorchTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(CpuAdamTorchTest, MatchesTorchAdamAndAdamW) {
  const CpuIsa isa = GetParam();
  if (!CpuSupportsIsa(isa)) {
    GTEST_SKIP() << "this CPU lacks the instructions of the " << CpuIsaName(isa)
                 << " kernel (cpuid)";
  }
  CpuAdam::Options o;
  o.isa = isa;
  auto adam = CpuAdam::Create(o);
  ASSERT_TRUE(adam.ok()) << adam.status();
  torch::manual_seed(0);
  const int64_t n = 100003;
  for (const Case& c : {Case{"adam", false, 1e-3, 0.0}, Case{"adam_l2", false, 2e-3, 0.1},
                        Case{"adamw", true, 1e-3, 0.01}}) {
    SCOPED_TRACE(c.name);
    torch::Tensor p = torch::randn({n}).set_requires_grad(true);
    std::vector<float> sp(p.data_ptr<float>(), p.data_ptr<float>() + n);
    std::vector<float> sm(n, 0.0f), sv(n, 0.0f);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (c.decoupled) {
      opt = std::make_unique<torch::optim::AdamW>(
          std::vector<torch::Tensor>{p}, torch::optim::AdamWOptions(c.lr).weight_decay(c.wd));
    } else {
      opt = std::make_unique<torch::optim::Adam>(
          std::vector<torch::Tensor>{p}, torch::optim::AdamOptions(c.lr).weight_decay(c.wd));
    }
    const AdamParams hp =
        c.decoupled ? AdamParams::AdamW(c.lr, c.wd) : AdamParams::Adam(c.lr, c.wd);
    for (int64_t step = 1; step <= 10; ++step) {
      torch::Tensor g = torch::randn({n}) * 0.01;
      p.mutable_grad() = g;
      opt->step();
      ASSERT_TRUE((*adam)
                      ->Step(hp, step, {},
                             {{sp.data(), sp.size()},
                              {sm.data(), sm.size()},
                              {sv.data(), sv.size()},
                              GradSpan::Fp32({g.data_ptr<float>(), static_cast<size_t>(n)}),
                              {}})
                      .ok());
      if (step == 1 || step == 10) {
        SCOPED_TRACE("step " + std::to_string(step));
        void* key = p.unsafeGetTensorImpl();  // torch 2.x keys the state by TensorImpl
        torch::Tensor m_ref, v_ref;
        if (c.decoupled) {
          auto& st = static_cast<torch::optim::AdamWParamState&>(*opt->state().at(key));
          m_ref = st.exp_avg();
          v_ref = st.exp_avg_sq();
        } else {
          auto& st = static_cast<torch::optim::AdamParamState&>(*opt->state().at(key));
          m_ref = st.exp_avg();
          v_ref = st.exp_avg_sq();
        }
        EXPECT_LE(RelErr(sp, p.detach()), 1e-6);
        EXPECT_LE(RelErr(sm, m_ref), 1e-6);
        EXPECT_LE(RelErr(sv, v_ref), 1e-6);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamTorchTest,
                         ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const auto& param_info) {
                           return std::string(CpuIsaName(param_info.param));
                         });

}  // namespace
}  // namespace strata

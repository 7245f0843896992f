// LAMB on the CPU: the kernels of every ISA the CPU supports (the others SKIPPED with the
// reason) against a float64 implementation of the published algorithm (You et al. 2019,
// Algorithm 2) with DeepSpeed's trust-ratio clamp and eps placement; bit-identity across
// thread counts and ISAs; the trust ratio's edge cases; argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "isa_test_util.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata {
namespace {

using namespace cpu_adam_test;  // NOLINT(google-build-using-namespace): test helpers

// The published algorithm in float64, with DeepSpeed's clamp of the ratio and its
// eps_inside_sqrt option: the reference the kernels are held to.
struct Reference {
  explicit Reference(State& t)
      : p(t.p(), t.p() + t.n), m(t.m(), t.m() + t.n), v(t.v(), t.v() + t.n) {}
  // Returns the trust ratio.
  double Step(State& t, const LambParams& hp, int64_t step, const GradScaling& sc) {
    const double b1 = hp.beta1, b2 = hp.beta2;
    const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, double(step)) : 1.0;
    const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, double(step)) : 1.0;
    const double gscale = double(sc.inv_loss_scale) * double(sc.clip_coef);
    std::vector<double> u(p.size());
    double wsq = 0, usq = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = t.GradAt(i) * gscale;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double mh = m[i] / bc1, vh = v[i] / bc2;
      const double d = hp.eps_inside_sqrt ? std::sqrt(vh + hp.eps) : std::sqrt(vh) + hp.eps;
      u[i] = mh / d + hp.weight_decay * p[i];
      wsq += p[i] * p[i];
      usq += u[i] * u[i];
    }
    const double w = std::sqrt(wsq), un = std::sqrt(usq);
    const double ratio = w > 0 && un > 0 ? std::clamp(w / un, hp.min_coeff, hp.max_coeff) : 1.0;
    for (size_t i = 0; i < p.size(); ++i)
      p[i] -= hp.lr * ratio * u[i];
    return ratio;
  }
  std::vector<double> p, m, v;
};

double RelErr(const float* x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::abs(double(x[i]) - ref[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  return den == 0 ? num : num / den;
}

struct Mode {
  const char* name;
  LambParams hp;
};
std::vector<Mode> Modes() {
  LambParams paper;  // the clamp out of reach: the published algorithm
  paper.lr = 1e-2;
  paper.weight_decay = 0.01;
  paper.min_coeff = 0.0;
  paper.max_coeff = 1e30;
  LambParams deepspeed;  // DeepSpeed's defaults, decay on
  deepspeed.weight_decay = 0.01;
  LambParams clamped = paper;  // the upper clamp active
  clamped.max_coeff = 0.5;
  LambParams inside = paper;
  inside.eps_inside_sqrt = true;
  inside.eps = 1e-6;
  LambParams nobc = paper;
  nobc.bias_correction = false;
  nobc.weight_decay = 0.0;
  return {{"paper", paper},
          {"deepspeed_defaults", deepspeed},
          {"clamped", clamped},
          {"eps_inside_sqrt", inside},
          {"no_bias_correction_no_decay", nobc}};
}

class LambKernelTest : public ::testing::TestWithParam<std::tuple<CpuIsa, ScalarType>> {};

TEST_P(LambKernelTest, OneStepOverSeveralTensorsMatchesFloat64Reference) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto k = MakeAdam(isa);
  const GradScaling scaling{0.25f, 0.5f};
  for (const Mode& mode : Modes()) {
    for (int out_kind = 0; out_kind < 3; ++out_kind) {
      SCOPED_TRACE(std::string(mode.name) + " out=" + std::to_string(out_kind));
      std::vector<State> ts;
      uint32_t seed = 5;
      for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{1000}, size_t{200003}})
        ts.emplace_back(n, seed++, gt, 1.0, n == 17 ? 1e-3f : 1.0f);
      std::vector<Reference> refs;
      for (State& t : ts)
        refs.emplace_back(t);
      const ScalarType ot = out_kind == 2 ? ScalarType::kFloat16 : ScalarType::kBFloat16;
      std::vector<std::vector<uint16_t>> outs;
      std::vector<AdamTensors> spans;
      for (State& t : ts) {
        outs.emplace_back(t.n, 0xdead);
        spans.push_back(t.Tensors(out_kind == 0 ? nullptr : outs.back().data(), ot));
      }
      std::vector<double> ratios;
      ASSERT_TRUE(k->LambStep(mode.hp, 4, scaling, spans, &ratios).ok());
      ASSERT_EQ(ratios.size(), ts.size());
      for (size_t i = 0; i < ts.size(); ++i) {
        SCOPED_TRACE("tensor of " + std::to_string(ts[i].n));
        const double want = refs[i].Step(ts[i], mode.hp, 4, scaling);
        EXPECT_NEAR(ratios[i], want, 1e-6 * want);
        EXPECT_LE(RelErr(ts[i].p(), refs[i].p), 1e-6);
        EXPECT_LE(RelErr(ts[i].m(), refs[i].m), 1e-6);
        EXPECT_LE(RelErr(ts[i].v(), refs[i].v), 1e-6);
        if (out_kind != 0) {
          size_t bad = 0;
          for (size_t j = 0; j < ts[i].n; ++j) {
            const float x = ts[i].p()[j];
            bad += outs[i][j] !=
                   (ot == ScalarType::kBFloat16 ? FloatToBFloat16(x) : FloatToFloat16(x));
          }
          EXPECT_EQ(bad, 0u) << "16-bit copy differs from round-to-nearest-even of fp32";
        }
      }
      // The empty tensor has ratio 1. The small-weight tensor's ratio is about 1e-3 and
      // the 1-element one's about 14: the published algorithm leaves them, DeepSpeed's
      // clamp [0.01, 10] catches both, and max_coeff 0.5 caps every large one.
      EXPECT_EQ(ratios[0], 1.0);
      const auto [lo, hi] = std::minmax_element(ratios.begin() + 1, ratios.end());
      const std::string name = mode.name;
      if (name == "paper") {
        EXPECT_LT(*lo, 0.01);
        EXPECT_GT(*hi, 10.0);
      } else if (name == "deepspeed_defaults") {
        EXPECT_EQ(*lo, 0.01);
        EXPECT_EQ(*hi, 10.0);
      } else if (name == "clamped") {
        EXPECT_EQ(*hi, 0.5);
      }
    }
  }
}

TEST_P(LambKernelTest, FiftyStepsMatchFloat64Reference) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto k = MakeAdam(isa);
  for (const Mode& mode : Modes()) {
    SCOPED_TRACE(mode.name);
    State t(4099, 77, gt);
    Reference ref(t);
    std::vector<uint16_t> out(t.n);
    const GradScaling scaling{1.0f / 1024.0f, 0.75f};
    for (int64_t step = 1; step <= 50; ++step) {
      t.NewGrad(static_cast<uint32_t>(1000 + step), 1024.0);
      const AdamTensors one = t.Tensors(out.data());
      ASSERT_TRUE(k->LambStep(mode.hp, step, scaling, {&one, 1}).ok());
      ref.Step(t, mode.hp, step, scaling);
    }
    EXPECT_LE(RelErr(t.p(), ref.p), 1e-5);
    EXPECT_LE(RelErr(t.m(), ref.m), 1e-5);
    EXPECT_LE(RelErr(t.v(), ref.v), 1e-5);
    for (size_t i = 0; i < t.n; ++i)
      ASSERT_EQ(out[i], FloatToBFloat16(t.p()[i])) << i;
  }
}

TEST_P(LambKernelTest, BitIdenticalWhateverTheThreadCount) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const size_t n = 5 * CpuAdam::kTileElems + 123;
  LambParams hp;
  hp.weight_decay = 0.01;
  std::vector<std::vector<float>> states;
  std::vector<std::vector<uint16_t>> outs;
  std::vector<LambNorms> norms;
  for (int threads : {1, 2, 3, 4}) {
    auto k = MakeAdam(isa, threads);
    ASSERT_EQ(k->num_threads(), threads);
    State t(n, 11, gt);
    std::vector<uint16_t> out(n);
    auto sums = k->LambMoments(hp, 2, {0.5f, 1.0f}, t.Tensors());
    ASSERT_TRUE(sums.ok()) << sums.status();
    norms.push_back(*sums);
    ASSERT_TRUE(
        k->LambApply(hp, 2, LambTrustRatio(hp, *sums), t.Tensors(out.data(), ScalarType::kFloat16))
            .ok());
    states.push_back(t.Snapshot());
    outs.push_back(out);
  }
  for (size_t i = 1; i < states.size(); ++i) {
    EXPECT_EQ(std::memcmp(states[0].data(), states[i].data(), states[0].size() * 4), 0) << i;
    EXPECT_EQ(outs[0], outs[i]);
    EXPECT_EQ(std::memcmp(&norms[0], &norms[i], sizeof(LambNorms)), 0) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsasAndGradTypes, LambKernelTest,
                         ::testing::Combine(::testing::ValuesIn(kAllIsas),
                                            ::testing::ValuesIn(kGradTypes)),
                         KernelTestName);

// The vector kernels reproduce the scalar kernel bit for bit: parameters, moments, copy-out
// and the norm sums, in full vectors and tails, for every gradient type and mode.
class LambCrossIsaTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(LambCrossIsaTest, BitIdenticalToScalar) {
  const CpuIsa isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto scalar = MakeAdam(CpuIsa::kScalar);
  auto vec = MakeAdam(isa);
  for (ScalarType gt : kGradTypes) {
    for (const Mode& mode : Modes()) {
      for (ScalarType ot : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
        for (size_t n : {size_t{1}, size_t{7}, size_t{31}, size_t{100003}}) {
          SCOPED_TRACE(std::string(ScalarTypeName(gt)) + " " + mode.name + " out " +
                       std::string(ScalarTypeName(ot)) + " n=" + std::to_string(n));
          State a(n, 21, gt), b(n, 21, gt);
          std::vector<uint16_t> oa(n), ob(n);
          for (int64_t step = 1; step <= 3; ++step) {
            auto na = scalar->LambMoments(mode.hp, step, {0.5f, 0.9f}, a.Tensors());
            auto nb = vec->LambMoments(mode.hp, step, {0.5f, 0.9f}, b.Tensors());
            ASSERT_TRUE(na.ok() && nb.ok());
            EXPECT_EQ(std::memcmp(&*na, &*nb, sizeof(LambNorms)), 0) << "step " << step;
            const double ratio = LambTrustRatio(mode.hp, *na);
            ASSERT_TRUE(scalar->LambApply(mode.hp, step, ratio, a.Tensors(oa.data(), ot)).ok());
            ASSERT_TRUE(vec->LambApply(mode.hp, step, ratio, b.Tensors(ob.data(), ot)).ok());
          }
          EXPECT_EQ(std::memcmp(a.p(), b.p(), n * 4), 0);
          EXPECT_EQ(std::memcmp(a.m(), b.m(), n * 4), 0);
          EXPECT_EQ(std::memcmp(a.v(), b.v(), n * 4), 0);
          EXPECT_EQ(oa, ob);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(VectorIsas, LambCrossIsaTest,
                         ::testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const auto& param_info) {
                           return std::string(CpuIsaName(param_info.param));
                         });

// ---------------------------------------------------------------------------
// The trust ratio and errors

TEST(LambTrustRatioTest, OneWhenANormIsZeroElseClampedQuotient) {
  LambParams hp;  // clamp [0.01, 10]
  EXPECT_EQ(LambTrustRatio(hp, {0.0, 4.0}), 1.0);
  EXPECT_EQ(LambTrustRatio(hp, {4.0, 0.0}), 1.0);
  EXPECT_EQ(LambTrustRatio(hp, {std::numeric_limits<double>::quiet_NaN(), 1.0}), 1.0);
  EXPECT_EQ(LambTrustRatio(hp, {9.0, 4.0}), 1.5);
  EXPECT_EQ(LambTrustRatio(hp, {1e6, 1.0}), 10.0);
  EXPECT_EQ(LambTrustRatio(hp, {1e-8, 1.0}), 0.01);
}

TEST(LambTrustRatioTest, AZeroTensorMovesByTheUpdateItself) {
  // ||x|| = 0 (e.g. a bias initialized to zero): ratio 1, x = -lr * u.
  auto k = MakeAdam(BestCpuIsa());
  State t(100, 3, ScalarType::kFloat32);
  std::fill(t.p(), t.p() + t.n, 0.0f);
  Reference ref(t);
  LambParams hp;
  hp.lr = 0.1;
  std::vector<double> ratios;
  const AdamTensors one = t.Tensors();
  ASSERT_TRUE(k->LambStep(hp, 1, {}, {&one, 1}, &ratios).ok());
  ASSERT_EQ(ratios, std::vector<double>{1.0});
  ref.Step(t, hp, 1, {});
  EXPECT_LE(RelErr(t.p(), ref.p), 1e-6);
}

TEST(LambApiTest, RejectsBadArgumentsBeforeWritingAnything) {
  auto k = MakeAdam(BestCpuIsa());
  State t(10, 1, ScalarType::kFloat32);
  const std::vector<float> p0(t.p(), t.p() + t.n), m0(t.m(), t.m() + t.n);
  LambParams hp;
  AdamTensors bad = t.Tensors();
  bad.exp_avg = bad.exp_avg.first(9);
  EXPECT_EQ(k->LambMoments(hp, 1, {}, bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(k->LambApply(hp, 1, 1.0, bad).code(), StatusCode::kInvalidArgument);
  // A bad second tensor: the first is not touched either.
  const AdamTensors pair[2] = {t.Tensors(), bad};
  EXPECT_EQ(k->LambStep(hp, 1, {}, pair).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(std::memcmp(p0.data(), t.p(), t.n * 4), 0);
  EXPECT_EQ(std::memcmp(m0.data(), t.m(), t.n * 4), 0);
  EXPECT_EQ(k->LambMoments(hp, 0, {}, t.Tensors()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(k->LambApply(hp, 1, std::nan(""), t.Tensors()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(k->LambApply(hp, 1, -1.0, t.Tensors()).code(), StatusCode::kInvalidArgument);
  LambParams coeffs;
  coeffs.min_coeff = 2.0;
  coeffs.max_coeff = 1.0;
  const Status s = ValidateLambParams(coeffs);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("min_coeff"), std::string::npos) << s;
  coeffs = {};
  coeffs.min_coeff = -0.1;
  EXPECT_FALSE(ValidateLambParams(coeffs).ok());
  coeffs = {};
  coeffs.beta2 = 1.0;
  EXPECT_NE(ValidateLambParams(coeffs).message().find("beta2"), std::string::npos);
  EXPECT_EQ(std::memcmp(p0.data(), t.p(), t.n * 4), 0);
}

}  // namespace
}  // namespace strata

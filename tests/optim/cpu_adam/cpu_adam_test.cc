// CPU Adam: kernels against a float64 reference for every ISA the CPU supports (the
// others SKIPPED with the reason), every gradient type and 16-bit copy-out, sizes 0 to
// 1e6+3 on unaligned spans; the norm/overflow pass; bit-identity across thread counts
// and ISAs; conversions; dispatch and argument errors; parameter groups.
#include "strata/optim/cpu_adam/cpu_adam.h"

#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "isa_test_util.h"
#include "strata/core/topology.h"

namespace strata {
namespace {

using namespace cpu_adam_test;  // NOLINT(google-build-using-namespace): test helpers

// The float64 reference of one step over the state's values.
struct Reference {
  explicit Reference(State& s)
      : p(s.p(), s.p() + s.n), m(s.m(), s.m() + s.n), v(s.v(), s.v() + s.n) {}
  void Step(State& s, const AdamParams& hp, int64_t step, const GradScaling& sc) {
    const double b1 = hp.beta1, b2 = hp.beta2, lr = hp.lr, wd = hp.weight_decay;
    const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, double(step)) : 1.0;
    const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, double(step)) : 1.0;
    const double gscale = double(sc.inv_loss_scale) * double(sc.clip_coef);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = s.GradAt(i) * gscale;
      if (hp.weight_decay_mode == WeightDecayMode::kL2) g += wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      if (hp.weight_decay_mode == WeightDecayMode::kDecoupled) p[i] *= 1 - lr * wd;
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + double(hp.eps));
    }
  }
  std::vector<double> p, m, v;
};

// max |x - ref| / max |ref|
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
  AdamParams hp;
};
std::vector<Mode> Modes() {
  AdamParams nobc = AdamParams::AdamW(2e-3, 0.05);
  nobc.bias_correction = false;
  AdamParams plain;
  plain.lr = 1e-3;
  return {{"adam_l2", AdamParams::Adam(1e-3, 0.1)},
          {"adamw", AdamParams::AdamW(1e-3, 0.01)},
          {"adamw_no_bias_correction", nobc},
          {"adam_no_decay", plain}};
}

class CpuAdamKernelTest : public ::testing::TestWithParam<std::tuple<CpuIsa, ScalarType>> {};

TEST_P(CpuAdamKernelTest, OneStepMatchesFloat64Reference) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto adam = MakeAdam(isa);
  const GradScaling scaling{0.25f, 0.5f};
  uint32_t seed = 1;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{31}, size_t{1000003}}) {
    for (const Mode& mode : Modes()) {
      for (int out_kind = 0; out_kind < 3; ++out_kind) {
        if (n == 1000003 && mode.hp.weight_decay == 0.0 && out_kind != 1) continue;  // time
        SCOPED_TRACE(std::string(mode.name) + " n=" + std::to_string(n) +
                     " out=" + std::to_string(out_kind));
        State s(n, seed++, gt, /*gmul=*/4.0);
        Reference ref(s);
        std::vector<uint16_t> out_store(n + 1, 0xdead);
        uint16_t* out = out_kind == 0 ? nullptr : out_store.data() + 1;
        const ScalarType ot = out_kind == 2 ? ScalarType::kFloat16 : ScalarType::kBFloat16;
        const int64_t step = 3;
        ASSERT_TRUE(adam->Step(mode.hp, step, scaling, s.Tensors(out, ot)).ok());
        ref.Step(s, mode.hp, step, scaling);
        EXPECT_LE(RelErr(s.p(), ref.p), 1e-6);
        EXPECT_LE(RelErr(s.m(), ref.m), 1e-6);
        EXPECT_LE(RelErr(s.v(), ref.v), 1e-6);
        if (out != nullptr) {
          size_t bad = 0;
          for (size_t i = 0; i < n; ++i) {
            const uint16_t want =
                ot == ScalarType::kBFloat16 ? FloatToBFloat16(s.p()[i]) : FloatToFloat16(s.p()[i]);
            bad += out[i] != want;
          }
          EXPECT_EQ(bad, 0u) << "16-bit copy differs from round-to-nearest-even of fp32";
          EXPECT_EQ(out_store[0], 0xdead) << "wrote before the span";
        }
      }
    }
  }
}

TEST_P(CpuAdamKernelTest, HundredStepsMatchFloat64Reference) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto adam = MakeAdam(isa);
  for (const Mode& mode : Modes()) {
    SCOPED_TRACE(mode.name);
    State s(4099, 77, gt, 1024.0);  // loss-scaled gradients
    Reference ref(s);
    std::vector<uint16_t> out(s.n);
    const GradScaling scaling{1.0f / 1024.0f, 0.75f};
    for (int64_t step = 1; step <= 100; ++step) {
      s.NewGrad(static_cast<uint32_t>(1000 + step), 1024.0);
      ASSERT_TRUE(adam->Step(mode.hp, step, scaling, s.Tensors(out.data())).ok());
      ref.Step(s, mode.hp, step, scaling);
    }
    EXPECT_LE(RelErr(s.p(), ref.p), 1e-5);
    EXPECT_LE(RelErr(s.m(), ref.m), 1e-5);
    EXPECT_LE(RelErr(s.v(), ref.v), 1e-5);
    for (size_t i = 0; i < s.n; ++i)
      ASSERT_EQ(out[i], FloatToBFloat16(s.p()[i])) << i;
  }
}

// The copy-out at every alignment: the vector kernels use non-temporal stores when it is
// 16-byte (AVX2) or 32-byte (AVX-512) aligned, ordinary stores otherwise.
TEST_P(CpuAdamKernelTest, CopyOutAtEveryAlignment) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto adam = MakeAdam(isa);
  const size_t n = 3 * CpuAdam::kTileElems + 45;
  std::vector<uint16_t> storage(n + 64 + 32);
  uint16_t* base = storage.data();
  while (reinterpret_cast<uintptr_t>(base) % 64 != 0)
    ++base;
  for (size_t offset = 0; offset < 17; ++offset) {
    for (ScalarType ot : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
      SCOPED_TRACE("offset " + std::to_string(offset) + " " + std::string(ScalarTypeName(ot)));
      std::fill(storage.begin(), storage.end(), 0xbeef);
      State s(n, static_cast<uint32_t>(offset), gt);
      uint16_t* out = base + offset;
      ASSERT_TRUE(adam->Step(AdamParams::AdamW(1e-3, 0.01), 2, {}, s.Tensors(out, ot)).ok());
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) {
        bad += out[i] !=
               (ot == ScalarType::kBFloat16 ? FloatToBFloat16(s.p()[i]) : FloatToFloat16(s.p()[i]));
      }
      EXPECT_EQ(bad, 0u);
      for (uint16_t* q = storage.data(); q < out; ++q)
        ASSERT_EQ(*q, 0xbeef);
      for (uint16_t* q = out + n; q < storage.data() + storage.size(); ++q)
        ASSERT_EQ(*q, 0xbeef);
    }
  }
}

TEST_P(CpuAdamKernelTest, NormPassMatchesReferenceAndFindsInfNan) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto adam = MakeAdam(isa);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{31}, size_t{1000003}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    State s(n, 5, gt, 64.0);
    double want = 0;
    for (size_t i = 0; i < n; ++i)
      want += s.GradAt(i) * s.GradAt(i);
    want /= 64.0 * 64.0;
    auto r = adam->GradSquaredNorm(s.Grad(), 1.0f / 64.0f);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->has_inf_nan);
    EXPECT_NEAR(r->sum_sq, want, 1e-12 * want + 1e-300);
    if (n == 0) continue;
    const float specials[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
    for (size_t pos : {size_t{0}, n / 2, n - 1}) {
      for (float bad : specials) {
        State t(n, 6, gt);
        if (gt == ScalarType::kFloat32) {
          t.g32()[pos] = bad;
        } else if (gt == ScalarType::kBFloat16) {
          t.g16()[pos] = FloatToBFloat16(bad);
        } else {
          t.g16()[pos] = FloatToFloat16(bad);
        }
        auto rr = adam->GradSquaredNorm(t.Grad());
        ASSERT_TRUE(rr.ok());
        EXPECT_TRUE(rr->has_inf_nan) << "pos " << pos << " value " << bad;
      }
    }
    if (gt == ScalarType::kFloat16) {  // an fp16 value that is finite but large stays finite
      State t(n, 7, gt);
      t.g16()[n - 1] = 0x7bff;  // 65504
      auto rr = adam->GradSquaredNorm(t.Grad());
      ASSERT_TRUE(rr.ok());
      EXPECT_FALSE(rr->has_inf_nan);
    }
  }
}

TEST_P(CpuAdamKernelTest, TheNormByTilesSummedApartIsTheNormPassBitForBit) {
  // GradSquaredNormTiles over separate tile ranges, in any order and on other threads, and
  // GradNormOfTiles give GradSquaredNorm's result exactly (the early step sums a chunk's
  // tiles as its groups are done).
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  auto adam = MakeAdam(isa, 2);
  const size_t n = 5 * CpuAdam::kTileElems + 123;
  State s(n, 13, gt, 8.0);
  auto whole = adam->GradSquaredNorm(s.Grad(), 0.125f);
  ASSERT_TRUE(whole.ok());
  const size_t tiles = CpuAdam::NumTiles(n);
  ASSERT_EQ(tiles, 6u);
  std::vector<double> sums(tiles, -1.0);
  const size_t elem = gt == ScalarType::kFloat32 ? 4 : 2;
  auto range = [&](size_t first, size_t count) {
    const size_t b = first * CpuAdam::kTileElems;
    const size_t e = std::min(n, (first + count) * CpuAdam::kTileElems);
    GradSpan g = s.Grad();
    g.data = static_cast<const unsigned char*>(g.data) + b * elem;
    g.size = e - b;
    return adam->GradSquaredNormTiles(g, std::span<double>(sums).subspan(first, count));
  };
  ASSERT_TRUE(range(4, 2).ok());  // the last two, the last one partial
  std::thread other([&] { EXPECT_TRUE(range(1, 1).ok()); });
  ASSERT_TRUE(range(0, 1).ok());
  other.join();
  ASSERT_TRUE(range(2, 2).ok());
  const GradNorm parts = CpuAdam::GradNormOfTiles(sums, 0.125f);
  EXPECT_EQ(parts.sum_sq, whole->sum_sq);
  EXPECT_EQ(parts.has_inf_nan, whole->has_inf_nan);
  // A wrong number of tile sums is refused.
  std::vector<double> few(tiles - 1);
  const Status bad = adam->GradSquaredNormTiles(s.Grad(), few);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
}

// AddToZeroedWithNormTiles: the values BulkAddToZeroedFloat writes, and the norm's tiles
// GradSquaredNormTiles sums over them afterwards, bit for bit (the engine sums a tile as
// the reduced gradients are written into it), with a -0.0 and an inf in one tile and a
// NaN in another, at an aligned and a misaligned destination, on 1 and 2 threads.
TEST_P(CpuAdamKernelTest, TheWriteWithItsNormTilesIsTheWriteThenTheNormPassBitForBit) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const size_t n = 3 * CpuAdam::kTileElems + 77;
  const size_t tiles = CpuAdam::NumTiles(n);
  for (const bool special : {false, true}) {
    State s(n, 29, gt, 5.0);
    if (special) {
      auto set = [&](size_t i, float x) {
        if (gt == ScalarType::kFloat32) {
          s.g32()[i] = x;
        } else {
          s.g16()[i] = gt == ScalarType::kBFloat16 ? FloatToBFloat16(x) : FloatToFloat16(x);
        }
      };
      set(5, -0.0f);
      set(6, std::numeric_limits<float>::infinity());
      set(2 * CpuAdam::kTileElems + 3, std::numeric_limits<float>::quiet_NaN());
    }
    for (const int threads : {1, 2}) {
      auto adam = MakeAdam(isa, threads);
      for (const size_t off : {size_t{0}, size_t{3}}) {
        // 64-byte aligned storage with room for a float before it; `off` floats in.
        std::vector<float> want_buf(n + 32, 0.0f), got_buf(n + 32, 7.0f);
        auto aligned = [&](std::vector<float>& b) {
          auto at = reinterpret_cast<uintptr_t>(b.data() + 1);
          return reinterpret_cast<float*>((at + 63) / 64 * 64) + off;
        };
        float* want = aligned(want_buf);
        float* got = aligned(got_buf);
        BulkAddToZeroedFloat(s.Grad(), std::span<float>(want, n), isa);
        std::vector<double> want_sums(tiles), got_sums(tiles, -1.0);
        ASSERT_TRUE(
            adam->GradSquaredNormTiles(GradSpan::Fp32({want, n}), std::span<double>(want_sums))
                .ok());
        ASSERT_TRUE(adam->AddToZeroedWithNormTiles(s.Grad(), std::span<float>(got, n),
                                                   std::span<double>(got_sums))
                        .ok());
        EXPECT_EQ(got[-1], 7.0f) << "written before the span";
        EXPECT_EQ(got[n], 7.0f) << "written past the span";
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(std::memcmp(&got[i], &want[i], sizeof(float)) == 0)
              << "element " << i << ", threads " << threads << ", offset " << off << ": " << got[i]
              << " vs " << want[i];
        }
        for (size_t k = 0; k < tiles; ++k) {
          EXPECT_TRUE(std::memcmp(&got_sums[k], &want_sums[k], sizeof(double)) == 0)
              << "tile " << k << ", threads " << threads << ", offset " << off << ": "
              << got_sums[k] << " vs " << want_sums[k];
        }
        if (special) {
          EXPECT_TRUE(std::isinf(got_sums[0]));
          EXPECT_TRUE(std::isnan(got_sums[2]));
          EXPECT_FALSE(std::signbit(got[5])) << "-0.0 written as 0.0f + -0.0f is +0.0";
        }
      }
    }
  }
  // The sizes are checked.
  auto adam = MakeAdam(isa);
  std::vector<float> dst(10);
  std::vector<double> sums(2);
  State s(10, 3, gt);
  EXPECT_EQ(adam->AddToZeroedWithNormTiles(s.Grad(), dst, sums).code(),
            StatusCode::kInvalidArgument);
  std::vector<double> one(1);
  EXPECT_EQ(adam->AddToZeroedWithNormTiles(s.Grad(), std::span<float>(dst).first(9), one).code(),
            StatusCode::kInvalidArgument);
}

TEST_P(CpuAdamKernelTest, BitIdenticalWhateverTheThreadCount) {
  const auto [isa, gt] = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const size_t n = 5 * CpuAdam::kTileElems + 123;
  const AdamParams hp = AdamParams::AdamW(1e-3, 0.01);
  std::vector<std::vector<float>> ps;
  std::vector<std::vector<uint16_t>> outs;
  std::vector<double> norms;
  for (int threads : {1, 2, 3, 4}) {
    auto adam = MakeAdam(isa, threads);
    ASSERT_EQ(adam->num_threads(), threads);
    State s(n, 11, gt);
    std::vector<uint16_t> out(n);
    auto norm = adam->GradSquaredNorm(s.Grad());
    ASSERT_TRUE(norm.ok());
    norms.push_back(norm->sum_sq);
    ASSERT_TRUE(adam->Step(hp, 1, {}, s.Tensors(out.data(), ScalarType::kFloat16)).ok());
    ps.push_back(s.Snapshot());
    outs.push_back(out);
  }
  for (size_t k = 1; k < ps.size(); ++k) {
    EXPECT_EQ(std::memcmp(ps[0].data(), ps[k].data(), ps[0].size() * 4), 0) << k;
    EXPECT_EQ(outs[0], outs[k]);
    EXPECT_EQ(std::memcmp(&norms[0], &norms[k], sizeof(double)), 0) << k;
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsasAndGradTypes, CpuAdamKernelTest,
                         ::testing::Combine(::testing::ValuesIn(kAllIsas),
                                            ::testing::ValuesIn(kGradTypes)),
                         KernelTestName);

// The vector kernels must reproduce the scalar kernel bit for bit, in full vectors and in
// tails, for every gradient type, mode and copy-out.
class CpuAdamCrossIsaTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(CpuAdamCrossIsaTest, BitIdenticalToScalar) {
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
          State a(n, 21, gt, 8.0), b(n, 21, gt, 8.0);
          std::vector<uint16_t> oa(n), ob(n);
          for (int64_t step = 1; step <= 3; ++step) {
            ASSERT_TRUE(scalar->Step(mode.hp, step, {0.5f, 0.9f}, a.Tensors(oa.data(), ot)).ok());
            ASSERT_TRUE(vec->Step(mode.hp, step, {0.5f, 0.9f}, b.Tensors(ob.data(), ot)).ok());
          }
          EXPECT_EQ(std::memcmp(a.p(), b.p(), n * 4), 0);
          EXPECT_EQ(std::memcmp(a.m(), b.m(), n * 4), 0);
          EXPECT_EQ(std::memcmp(a.v(), b.v(), n * 4), 0);
          EXPECT_EQ(oa, ob);
          auto na = scalar->GradSquaredNorm(a.Grad(), 0.5f);
          auto nb = vec->GradSquaredNorm(b.Grad(), 0.5f);
          ASSERT_TRUE(na.ok() && nb.ok());
          EXPECT_EQ(std::memcmp(&na->sum_sq, &nb->sum_sq, sizeof(double)), 0);
        }
      }
    }
  }
  // Conversion kernel, including specials and subnormals.
  std::vector<float> src = {0.0f,
                            -0.0f,
                            1.0f,
                            65504.0f,
                            65520.0f,
                            1e-8f,
                            -3e-6f,
                            1e-40f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            3.14159f,
                            -2.5e38f};
  std::mt19937 rng(3);
  for (int i = 0; i < 10000; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    src.push_back(f);
  }
  for (ScalarType ot : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
    std::vector<uint16_t> a(src.size()), b(src.size());
    ASSERT_TRUE(scalar->CopyToHalf(src, {a.data(), a.size(), ot}).ok());
    ASSERT_TRUE(vec->CopyToHalf(src, {b.data(), b.size(), ot}).ok());
    EXPECT_EQ(a, b) << ScalarTypeName(ot);
  }
}

INSTANTIATE_TEST_SUITE_P(VectorIsas, CpuAdamCrossIsaTest,
                         ::testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const auto& param_info) {
                           return std::string(CpuIsaName(param_info.param));
                         });

// ---------------------------------------------------------------------------
// Conversions

TEST(CpuAdamConversionTest, BFloat16RoundsToNearestEven) {
  auto f = [](uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  };
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(f(0x3f808000)), 0x3f80);  // tie, even below
  EXPECT_EQ(FloatToBFloat16(f(0x3f818000)), 0x3f82);  // tie, odd below -> up
  EXPECT_EQ(FloatToBFloat16(f(0x3f808001)), 0x3f81);  // above tie
  EXPECT_EQ(FloatToBFloat16(f(0x7f7fffff)), 0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(f(0x00000001)), 0x0000);  // subnormal rounds to zero
  EXPECT_EQ(FloatToBFloat16(f(0x00018000)), 0x0002);  // subnormals kept
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  const uint16_t qnan = FloatToBFloat16(f(0x7fc00000));
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(qnan)));
  const uint16_t snan = FloatToBFloat16(f(0x7f800001));  // payload only in the low bits
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(snan))) << std::hex << snan;
  EXPECT_NE(snan & 0x40, 0) << "NaN made quiet";
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
}

TEST(CpuAdamConversionTest, Float16RoundsToNearestEven) {
  EXPECT_EQ(FloatToFloat16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFloat16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFloat16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFloat16(1e9f), 0x7c00);
  EXPECT_EQ(FloatToFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFloat16(5.9604645e-8f), 0x0001);       // smallest subnormal
  EXPECT_EQ(FloatToFloat16(2.9802322e-8f), 0x0000);       // tie to even (zero)
  EXPECT_EQ(FloatToFloat16(8.940697e-8f), 0x0002);        // 1.5 ulp: tie to even (2)
  EXPECT_EQ(FloatToFloat16(1.0f + 1.0f / 2048), 0x3c00);  // tie, even below
  EXPECT_EQ(FloatToFloat16(1.0f + 3.0f / 2048), 0x3c02);  // tie, odd below -> up
  EXPECT_TRUE(std::isnan(Float16ToFloat(FloatToFloat16(std::nanf("")))));
  for (uint32_t h = 0; h < 0x10000; ++h) {  // round trip of every finite half
    if ((h & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(FloatToFloat16(Float16ToFloat(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

__attribute__((target("f16c"))) uint16_t HardwareToHalf(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, 0));
}
__attribute__((target("f16c"))) float HardwareFromHalf(uint16_t h) {
  return _cvtsh_ss(h);
}

TEST(CpuAdamConversionTest, Float16MatchesF16cHardware) {
  if (!CpuSupportsIsa(CpuIsa::kAvx2)) GTEST_SKIP() << "this CPU has no F16C (cpuid)";
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float a = Float16ToFloat(static_cast<uint16_t>(h));
    const float b = HardwareFromHalf(static_cast<uint16_t>(h));
    if (std::isnan(b)) {
      ASSERT_TRUE(std::isnan(a));
      continue;
    }
    ASSERT_EQ(std::memcmp(&a, &b, 4), 0) << std::hex << h;
  }
  std::mt19937 rng(9);
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    ASSERT_EQ(FloatToFloat16(f), HardwareToHalf(f)) << std::hex << bits;
  }
}

// ---------------------------------------------------------------------------
// Bulk conversions (BulkToFloat, BulkAddToFloat, BulkToHalf): every ISA equals the
// element converters bit for bit, at every 16-bit value, every tail length and offset.

class CpuAdamBulkTest : public ::testing::TestWithParam<CpuIsa> {};

bool SameBits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

TEST_P(CpuAdamBulkTest, EverySixteenBitValueToFloatAndAdded) {
  const CpuIsa isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  std::vector<uint16_t> all(0x10000 + 1);  // one element of offset: unaligned spans
  for (uint32_t h = 0; h < 0x10000; ++h)
    all[h + 1] = static_cast<uint16_t>(h);
  const std::span<const uint16_t> src(all.data() + 1, 0x10000);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (ScalarType t : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
    const GradSpan g = t == ScalarType::kBFloat16 ? GradSpan::Bf16(src) : GradSpan::Fp16(src);
    std::vector<float> out(0x10000 + 1, -1.0f), acc(0x10000 + 1);
    for (float& x : acc)
      x = u(rng);
    const std::vector<float> acc0 = acc;
    BulkToFloat(g, std::span<float>(out.data() + 1, 0x10000), isa);
    BulkAddToFloat(g, std::span<float>(acc.data() + 1, 0x10000), isa);
    EXPECT_EQ(out[0], -1.0f) << "written before the span";
    EXPECT_TRUE(SameBits(acc[0], acc0[0])) << "added before the span";
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const uint16_t v = static_cast<uint16_t>(h);
      const float want = t == ScalarType::kBFloat16 ? BFloat16ToFloat(v) : Float16ToFloat(v);
      const float want_sum = acc0[h + 1] + want;
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[h + 1])) << ScalarTypeName(t) << " " << std::hex << h;
        ASSERT_TRUE(std::isnan(acc[h + 1])) << ScalarTypeName(t) << " " << std::hex << h;
        continue;
      }
      ASSERT_TRUE(SameBits(out[h + 1], want)) << ScalarTypeName(t) << " " << std::hex << h;
      ASSERT_TRUE(SameBits(acc[h + 1], want_sum)) << ScalarTypeName(t) << " " << std::hex << h;
    }
  }
}

TEST_P(CpuAdamBulkTest, TailsOffsetsAndFloat32) {
  const CpuIsa isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 100.0f);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{15}, size_t{16}, size_t{17},
                   size_t{33}, size_t{1000}}) {
    for (size_t off = 0; off < 3; ++off) {
      std::vector<float> f(n + off + 1);
      for (float& x : f)
        x = nd(rng);
      const std::span<const float> src(f.data() + off, n);
      // fp32 -> 16 bits, against the element converters; nothing written past the end.
      for (ScalarType t : {ScalarType::kBFloat16, ScalarType::kFloat16}) {
        std::vector<uint16_t> h(n + off + 1, 0xabcd);
        const std::span<uint16_t> dst(h.data() + off, n);
        BulkToHalf(
            src, t == ScalarType::kBFloat16 ? Param16Span::Bf16(dst) : Param16Span::Fp16(dst), isa);
        for (size_t i = 0; i < n; ++i) {
          const uint16_t want =
              t == ScalarType::kBFloat16 ? FloatToBFloat16(src[i]) : FloatToFloat16(src[i]);
          ASSERT_EQ(dst[i], want) << ScalarTypeName(t) << " n " << n << " i " << i;
        }
        EXPECT_EQ(h[n + off], 0xabcd) << "written past the end, n " << n;
      }
      // fp32 sources: a copy, and an addition.
      std::vector<float> out(n + 1, 7.0f), acc(n + 1, 0.5f);
      BulkToFloat(GradSpan::Fp32(src), std::span<float>(out.data(), n), isa);
      BulkAddToFloat(GradSpan::Fp32(src), std::span<float>(acc.data(), n), isa);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(SameBits(out[i], src[i])) << "n " << n << " i " << i;
        ASSERT_TRUE(SameBits(acc[i], 0.5f + src[i])) << "n " << n << " i " << i;
      }
      EXPECT_EQ(out[n], 7.0f) << "written past the end, n " << n;
      EXPECT_EQ(acc[n], 0.5f) << "added past the end, n " << n;
    }
  }
}

// BulkAddToZeroedFloat: BulkAddToFloat's sums into +0.0 accumulators bit for bit (-0.0
// sources give +0.0; inf and NaN pass), at every alignment of the destination (the vector
// kernels stream from its 32- or 64-byte boundary), every tail, and nothing written
// outside the span.
TEST_P(CpuAdamBulkTest, AddedToZeroedAccumulatorsAtEveryAlignment) {
  const CpuIsa isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  constexpr size_t kMax = 200;
  std::vector<float> f(kMax);
  for (float& x : f)
    x = nd(rng);
  f[3] = -0.0f;
  f[4] = 0.0f;
  f[5] = std::numeric_limits<float>::infinity();
  f[6] = -std::numeric_limits<float>::infinity();
  f[7] = std::numeric_limits<float>::quiet_NaN();
  f[kMax - 1] = -0.0f;
  for (ScalarType t : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    std::vector<uint16_t> h(kMax);
    for (size_t i = 0; i < kMax; ++i)
      h[i] = t == ScalarType::kBFloat16 ? FloatToBFloat16(f[i]) : FloatToFloat16(f[i]);
    for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{15}, size_t{16}, size_t{17},
                     size_t{31}, size_t{64}, size_t{100}, kMax}) {
      for (size_t off = 0; off < 17; ++off) {
        const void* data = t == ScalarType::kFloat32 ? static_cast<const void*>(f.data())
                                                     : static_cast<const void*>(h.data());
        const GradSpan g{data, n, t};
        alignas(64) float got[kMax + 18];
        alignas(64) float want[kMax + 18];
        std::fill(std::begin(got), std::end(got), 9.0f);
        std::fill(std::begin(want), std::end(want), 0.0f);
        BulkAddToFloat(g, std::span<float>(want + off, n), isa);
        std::fill(got + off, got + off + n, 123.0f);  // a kernel that read it would add it
        BulkAddToZeroedFloat(g, std::span<float>(got + off, n), isa);
        for (size_t i = 0; i < off; ++i)
          ASSERT_EQ(got[i], 9.0f) << "written before the span, off " << off;
        for (size_t i = off + n; i < kMax + 18; ++i)
          ASSERT_EQ(got[i], 9.0f) << "written past the end, n " << n << " off " << off;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(SameBits(got[off + i], want[off + i]) ||
                      (std::isnan(want[off + i]) && std::isnan(got[off + i])))
              << ScalarTypeName(t) << " n " << n << " off " << off << " i " << i << ": "
              << got[off + i] << " vs " << want[off + i];
        }
        if (n > 3) {
          EXPECT_FALSE(std::signbit(got[off + 3])) << "-0.0 added to +0.0 is +0.0";
        }
      }
    }
  }
}

// The indexed sum of bits (the checkpoints' frozen-base fingerprint): the sum of the terms,
// written out here, at every tail length, offset and index (across 2^32, which AVX2's
// emulated 64-bit multiply splits at, and wrapping at 2^64), with NaN, infinities and -0.
uint64_t TermWrittenOut(uint64_t index, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  uint64_t z = (index * 0x9E3779B97F4A7C15ull) ^ bits;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

TEST_P(CpuAdamBulkTest, IndexedBitsSumIsTheSumOfItsTerms) {
  const CpuIsa isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.0f, 10.0f);
  std::vector<float> f(4099 + 3);
  for (float& x : f)
    x = nd(rng);
  f[5] = std::numeric_limits<float>::quiet_NaN();
  f[6] = std::numeric_limits<float>::infinity();
  f[7] = -0.0f;
  f[40] = -std::numeric_limits<float>::infinity();
  for (const uint64_t first :
       {uint64_t{0}, uint64_t{12345}, (uint64_t{1} << 32) - 5, ~uint64_t{0} - 9}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{7}, size_t{8}, size_t{15}, size_t{16},
                     size_t{17}, size_t{31}, size_t{32}, size_t{33}, size_t{4099}}) {
      for (size_t off = 0; off < 3; ++off) {
        const std::span<const float> v(f.data() + off, n);
        uint64_t want = 0;
        for (size_t i = 0; i < n; ++i)
          want += TermWrittenOut(first + i, v[i]);
        ASSERT_EQ(BulkIndexedBitsSum(v, first, isa), want)
            << CpuIsaName(isa) << " n=" << n << " off=" << off << " first=" << first;
      }
    }
  }
  // The function is part of the checkpoint format (fingerprints saved by one build are
  // checked by another): a fixed input's sum, computed apart (Python integers).
  std::vector<float> fixed(20);
  for (size_t k = 0; k < fixed.size(); ++k)
    fixed[k] = 0.5f * static_cast<float>(k) - 3.0f;
  EXPECT_EQ(BulkIndexedBitsSum(fixed, 1000, isa), 0x719daec6b9747554ull);
  EXPECT_EQ(IndexedBitsTerm(1003, 0x3FC00000u), TermWrittenOut(1003, 1.5f));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamBulkTest, ::testing::ValuesIn(kAllIsas),
                         [](const auto& param_info) {
                           return std::string(CpuIsaName(param_info.param));
                         });

// ---------------------------------------------------------------------------
// Dispatch

TEST(CpuAdamIsaTest, NamesParseAndBestIsSupported) {
  for (CpuIsa isa : kAllIsas)
    EXPECT_EQ(*ParseCpuIsa(CpuIsaName(isa)), isa);
  EXPECT_EQ(*ParseCpuIsa("AVX2"), CpuIsa::kAvx2);
  EXPECT_EQ(ParseCpuIsa("sse9").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CpuSupportsIsa(CpuIsa::kScalar));
  EXPECT_TRUE(CpuSupportsIsa(BestCpuIsa()));
  std::cout << "best ISA on this CPU: " << CpuIsaName(BestCpuIsa()) << "\n";
}

struct EnvGuard {
  explicit EnvGuard(const char* value) {
    const char* old = std::getenv("STRATA_CPU_ISA");
    if (old != nullptr) saved = old, had = true;
    if (value != nullptr) {
      setenv("STRATA_CPU_ISA", value, 1);
    } else {
      unsetenv("STRATA_CPU_ISA");
    }
  }
  ~EnvGuard() {
    if (had) {
      setenv("STRATA_CPU_ISA", saved.c_str(), 1);
    } else {
      unsetenv("STRATA_CPU_ISA");
    }
  }
  std::string saved;
  bool had = false;
};

TEST(CpuAdamIsaTest, EnvironmentForcesAnIsa) {
  {
    EnvGuard env(nullptr);
    auto a = CpuAdam::Create();
    ASSERT_TRUE(a.ok());
    EXPECT_EQ((*a)->isa(), BestCpuIsa());
  }
  {
    EnvGuard env("scalar");
    auto a = CpuAdam::Create();
    ASSERT_TRUE(a.ok());
    EXPECT_EQ((*a)->isa(), CpuIsa::kScalar);
  }
  {
    EnvGuard env("neon");
    auto a = CpuAdam::Create();
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(a.status().message().find("STRATA_CPU_ISA"), std::string::npos) << a.status();
  }
  {
    EnvGuard env("scalar");  // an explicit option wins over the environment
    CpuAdam::Options o;
    o.isa = BestCpuIsa();
    auto a = CpuAdam::Create(o);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ((*a)->isa(), BestCpuIsa());
  }
}

TEST(CpuAdamIsaTest, RefusesAnIsaTheCpuLacks) {
  CpuIsa missing = CpuIsa::kScalar;
  for (CpuIsa isa : kAllIsas) {
    if (!CpuSupportsIsa(isa)) {
      missing = isa;
      break;
    }
  }
  if (missing == CpuIsa::kScalar) {
    GTEST_SKIP() << "this CPU supports every ISA (best: " << CpuIsaName(BestCpuIsa())
                 << "), so none can be refused";
  }
  EnvGuard env(std::string(CpuIsaName(missing)).c_str());
  auto a = CpuAdam::Create();
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(a.status().message().find("lacks"), std::string::npos) << a.status();
  CpuAdam::Options o;
  o.isa = missing;
  EXPECT_EQ(CpuAdam::Create(o).status().code(), StatusCode::kFailedPrecondition);
}

// ---------------------------------------------------------------------------
// Errors and groups

TEST(CpuAdamApiTest, RejectsBadArguments) {
  auto adam = MakeAdam(BestCpuIsa());
  State s(10, 1, ScalarType::kFloat32);
  const AdamParams hp;
  auto t = s.Tensors();
  t.exp_avg = t.exp_avg.first(9);
  EXPECT_EQ(adam->Step(hp, 1, {}, t).code(), StatusCode::kInvalidArgument);
  t = s.Tensors();
  t.grad.size = 11;
  EXPECT_EQ(adam->Step(hp, 1, {}, t).code(), StatusCode::kInvalidArgument);
  t = s.Tensors();
  t.grad.data = nullptr;
  EXPECT_EQ(adam->Step(hp, 1, {}, t).code(), StatusCode::kInvalidArgument);
  std::vector<uint16_t> out(10);
  t = s.Tensors(out.data());
  t.param16.type = ScalarType::kFloat32;
  EXPECT_EQ(adam->Step(hp, 1, {}, t).code(), StatusCode::kInvalidArgument);
  t = s.Tensors();
  EXPECT_EQ(adam->Step(hp, 0, {}, t).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(adam->Step(hp, 1, {std::nanf(""), 1.0f}, t).code(), StatusCode::kInvalidArgument);
  AdamParams bad;
  bad.beta1 = 1.0;
  EXPECT_EQ(adam->Step(bad, 1, {}, t).code(), StatusCode::kInvalidArgument);
  bad = {};
  bad.lr = -1.0;
  EXPECT_NE(ValidateAdamParams(bad).message().find("lr"), std::string::npos);
  bad = {};
  bad.eps = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(ValidateAdamParams(bad).ok());
  CpuAdam::Options o;
  o.num_threads = -1;
  EXPECT_EQ(CpuAdam::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = {};
  o.numa_node = 4096;
  EXPECT_EQ(CpuAdam::Create(o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(adam->Step(hp, 1, {}, s.Tensors()).ok());
}

TEST(CpuAdamApiTest, ArenaPinnedToANumaNodeGivesTheSameResults) {
  auto topo = Topology::Discover();
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_FALSE(topo->numa_nodes().empty());
  CpuAdam::Options o;
  o.numa_node = topo->numa_nodes().front().os_index;
  auto pinned = CpuAdam::Create(o);
  if (!pinned.ok()) {
    GTEST_SKIP() << "oneTBB cannot pin to NUMA node " << o.numa_node
                 << " here (tbbbind/hwloc missing?): " << pinned.status();
  }
  EXPECT_GE((*pinned)->num_threads(), 1);
  auto plain = MakeAdam((*pinned)->isa(), 1);
  const size_t n = 4 * CpuAdam::kTileElems + 5;
  State a(n, 8, ScalarType::kBFloat16), b(n, 8, ScalarType::kBFloat16);
  ASSERT_TRUE((*pinned)->Step(AdamParams::AdamW(1e-3), 1, {}, a.Tensors()).ok());
  ASSERT_TRUE(plain->Step(AdamParams::AdamW(1e-3), 1, {}, b.Tensors()).ok());
  EXPECT_EQ(std::memcmp(a.p(), b.p(), n * 4), 0);
}

TEST(CpuAdamApiTest, ForEachTileCoversEveryElementOnceAcrossTheThreads) {
  const size_t n = 7 * CpuAdam::kTileElems / 2 + 5;  // the last tile partial
  for (int threads : {1, 3}) {
    auto adam = CpuAdam::Create({.isa = CpuIsa::kScalar, .num_threads = threads});
    ASSERT_TRUE(adam.ok()) << adam.status();
    std::vector<std::atomic<int>> seen(n);
    std::mutex mu;
    std::vector<std::pair<size_t, size_t>> spans;
    std::set<std::thread::id> ids;
    (*adam)->ForEachTile(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i)
        seen[i].fetch_add(1);
      // Long enough that another thread takes a tile meanwhile.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::lock_guard<std::mutex> lock(mu);
      spans.emplace_back(b, e);
      ids.insert(std::this_thread::get_id());
    });
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(seen[i].load(), 1) << "element " << i << " with " << threads << " threads";
    ASSERT_EQ(spans.size(), CpuAdam::NumTiles(n));
    for (const auto& [b, e] : spans) {
      EXPECT_EQ(b % CpuAdam::kTileElems, 0u);
      EXPECT_EQ(e, std::min(n, b + CpuAdam::kTileElems));
    }
    if ((*adam)->num_threads() == 1) {  // a TSan build runs every pass on the caller
      EXPECT_EQ(ids.size(), 1u);
    } else {
      EXPECT_GT(ids.size(), 1u) << "the tiles ran on one thread";
    }
  }
}

// Step's zero_grad: the same p, m, v and 16-bit copy as the step alone, bit for bit, and
// every gradient element 0 after it (each tile zeroed after its update, on any thread);
// refused for another span or a 16-bit gradient, touching nothing.
TEST(CpuAdamApiTest, ZeroGradLeavesTheStepAsItIsAndTheGradientZero) {
  const size_t n = 5 * CpuAdam::kTileElems / 2 + 7;  // the last tile partial
  for (int threads : {1, 3}) {
    auto adam = CpuAdam::Create({.isa = BestCpuIsa(), .num_threads = threads});
    ASSERT_TRUE(adam.ok()) << adam.status();
    State a(n, 21, ScalarType::kFloat32), b(n, 21, ScalarType::kFloat32);
    std::vector<uint16_t> out_a(n), out_b(n);
    const AdamParams hp = AdamParams::AdamW(1e-3, 0.01);
    const GradScaling sc{0.5f, 0.75f};
    ASSERT_TRUE((*adam)->Step(hp, 3, sc, a.Tensors(out_a.data(), ScalarType::kBFloat16)).ok());
    const AdamTensors tb = b.Tensors(out_b.data(), ScalarType::kBFloat16);
    ASSERT_TRUE((*adam)->Step(hp, 3, sc, tb, std::span<float>(b.g32(), n)).ok());
    EXPECT_EQ(a.Snapshot(), b.Snapshot()) << threads << " threads";
    EXPECT_EQ(out_a, out_b);
    size_t nonzero = 0;
    for (size_t i = 0; i < n; ++i)
      nonzero += std::bit_cast<uint32_t>(b.g32()[i]) != 0u ? 1 : 0;
    EXPECT_EQ(nonzero, 0u) << "gradient elements left after zero_grad";
    EXPECT_NE(std::bit_cast<uint32_t>(a.g32()[n - 1]), 0u);  // the plain step leaves it
  }
  auto adam = MakeAdam(BestCpuIsa());
  State s(100, 3, ScalarType::kFloat32);
  const std::vector<float> before = s.Snapshot();
  const float g0 = s.g32()[0];
  std::vector<float> other(100);
  Status st = adam->Step({}, 1, {}, s.Tensors(), std::span<float>(other));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("zero_grad"), std::string::npos) << st;
  EXPECT_EQ(adam->Step({}, 1, {}, s.Tensors(), std::span<float>(s.g32(), 99)).code(),
            StatusCode::kInvalidArgument);
  State h(100, 3, ScalarType::kBFloat16);
  EXPECT_EQ(adam->Step({}, 1, {}, h.Tensors(), std::span<float>(other)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s.Snapshot(), before);
  EXPECT_EQ(s.g32()[0], g0);
}

TEST(CpuAdamApiTest, GroupsKeepTheirOwnStepsAndParams) {
  auto adam = MakeAdam(BestCpuIsa());
  AdamOptimizer opt(adam.get());
  const int g0 = *opt.AddGroup(AdamParams::AdamW(1e-3, 0.01));
  const int g1 = *opt.AddGroup(AdamParams::Adam(5e-3, 0.0));
  EXPECT_EQ(opt.num_groups(), 2);
  AdamParams bad;
  bad.beta2 = -0.5;
  EXPECT_FALSE(opt.AddGroup(bad).ok());
  EXPECT_EQ(opt.StepCount(5).status().code(), StatusCode::kOutOfRange);

  // A group split in two parts equals one update over the whole, with the group's step.
  const size_t n = 1000;
  State whole(n, 3, ScalarType::kBFloat16), split(n, 3, ScalarType::kBFloat16);
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(adam->Step(AdamParams::AdamW(1e-3, 0.01), k + 1, {}, whole.Tensors()).ok());
    AdamTensors all = split.Tensors();
    const AdamTensors parts[2] = {{all.param.first(400),
                                   all.exp_avg.first(400),
                                   all.exp_avg_sq.first(400),
                                   {split.g16(), 400, ScalarType::kBFloat16},
                                   {}},
                                  {all.param.subspan(400),
                                   all.exp_avg.subspan(400),
                                   all.exp_avg_sq.subspan(400),
                                   {split.g16() + 400, 600, ScalarType::kBFloat16},
                                   {}}};
    ASSERT_TRUE(opt.StepGroup(g0, parts).ok());
  }
  EXPECT_EQ(*opt.StepCount(g0), 3);
  EXPECT_EQ(*opt.StepCount(g1), 0);
  EXPECT_EQ(std::memcmp(whole.p(), split.p(), n * 4), 0);
  EXPECT_EQ(std::memcmp(whole.v(), split.v(), n * 4), 0);

  // A bad part is rejected before anything is written or counted.
  AdamTensors bad_part = split.Tensors();
  bad_part.grad.size = 3;
  const std::vector<float> before(split.p(), split.p() + n);
  EXPECT_FALSE(opt.StepGroup(g0, std::span<const AdamTensors>(&bad_part, 1)).ok());
  EXPECT_EQ(*opt.StepCount(g0), 3);
  EXPECT_EQ(std::memcmp(before.data(), split.p(), n * 4), 0);

  ASSERT_TRUE(opt.SetGroupParams(g1, AdamParams::Adam(1e-2)).ok());
  EXPECT_EQ(opt.GroupParams(g1)->lr, 1e-2);
  ASSERT_TRUE(opt.SetStepCount(g1, 41).ok());
  State one(10, 4, ScalarType::kFloat32);
  const AdamTensors part = one.Tensors();
  ASSERT_TRUE(opt.StepGroup(g1, std::span<const AdamTensors>(&part, 1)).ok());
  EXPECT_EQ(*opt.StepCount(g1), 42);
}

// The planner's rate: real timed steps of the asked size, the ISA and copy-out that ran.
TEST(MeasureAdamRateTest, TimesStepsAndSaysWhatRan) {
  CpuAdam::Options options;
  options.num_threads = 1;
  auto adam = CpuAdam::Create(options);
  ASSERT_TRUE(adam.ok()) << adam.status();
  AdamRateOptions ro;
  ro.elements = size_t{1} << 16;
  ro.copy_out = ScalarType::kBFloat16;
  ro.min_seconds = 0.0;
  ro.min_steps = 5;
  Result<AdamRate> rate = MeasureAdamRate(**adam, ro);
  ASSERT_TRUE(rate.ok()) << rate.status();
  EXPECT_EQ(rate->steps, 5);
  EXPECT_GT(rate->median_step_s, 0.0);
  EXPECT_TRUE(std::isfinite(rate->params_per_second));
  EXPECT_NEAR(rate->params_per_second * rate->median_step_s, 65536.0, 1.0);
  EXPECT_EQ(rate->description,
            std::string(CpuIsaName((*adam)->isa())) + ", 1 thread, bf16 copy-out");

  ro.copy_out = ScalarType::kFloat32;
  rate = MeasureAdamRate(**adam, ro);
  ASSERT_TRUE(rate.ok()) << rate.status();
  EXPECT_EQ(rate->description, std::string(CpuIsaName((*adam)->isa())) + ", 1 thread");

  ro.elements = 0;
  EXPECT_EQ(MeasureAdamRate(**adam, ro).status().code(), StatusCode::kInvalidArgument);
  ro.elements = 16;
  ro.min_steps = 0;
  EXPECT_EQ(MeasureAdamRate(**adam, ro).status().code(), StatusCode::kInvalidArgument);
}

TEST(MeasureAdamRateTest, ARankGetsItsShareOfTheCores) {
  // More ranks than cores: each gets one thread.
  Result<AdamRate> rate = MeasureAdamRateOfARank(100000, ScalarType::kFloat16);
  ASSERT_TRUE(rate.ok()) << rate.status();
  EXPECT_NE(rate->description.find(", 1 thread, fp16 copy-out"), std::string::npos)
      << rate->description;
  EXPECT_GE(rate->steps, 3);
  EXPECT_EQ(MeasureAdamRateOfARank(0, ScalarType::kFloat32).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata

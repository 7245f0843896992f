// Model FLOPs, throughput and MFU (core/throughput.h): the formula on numbers worked by
// hand, the preset shapes, the datasheet table.
#include "strata/core/throughput.h"

#include <gtest/gtest.h>

#include "strata/core/model_shapes.h"

namespace strata {
namespace {

TEST(ThroughputTest, FlopsPerTokenIsSixTimesTheParametersPlusAttention) {
  // 1M parameters, 2 layers, 64 tokens of context, width 32: 6e6 + 12 x 2 x 64 x 32.
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(1e6, 2, 64, 32), 6e6 + 49152.0);
  // strata-train's medium preset (1.64M parameters): attention is 12 x 8 x 128 x 128.
  const ModelPreset* medium = FindModelPreset("medium");
  ASSERT_NE(medium, nullptr);
  const GptShape& s = medium->shape;
  EXPECT_DOUBLE_EQ(
      TrainingFlopsPerToken(static_cast<double>(s.TotalParams()), s.n_layers, s.seq_len, s.d_model),
      6.0 * static_cast<double>(s.TotalParams()) + 12.0 * 8 * 128 * 128);
}

TEST(ThroughputTest, TokensTflopsAndMfuOverEveryRank) {
  // 4096 tokens in 0.5 s at 1e9 FLOPs per token on 2 ranks of 4 TFLOP/s each.
  const Throughput t = ComputeThroughput(1e9, 4096, 0.5, 2, 4e12);
  EXPECT_DOUBLE_EQ(t.tokens_per_s, 8192.0);
  EXPECT_DOUBLE_EQ(t.flops_per_s, 8.192e12);
  EXPECT_DOUBLE_EQ(t.tflops, 8.192);
  EXPECT_DOUBLE_EQ(t.mfu, 8.192e12 / 8e12);
  // No peak: no MFU; no time or no tokens: zeros, not infinities.
  EXPECT_EQ(ComputeThroughput(1e9, 4096, 0.5, 2, 0).mfu, 0.0);
  EXPECT_EQ(ComputeThroughput(1e9, 4096, 0.0, 1, 4e12).tflops, 0.0);
  EXPECT_EQ(ComputeThroughput(1e9, 0, 1.0, 1, 4e12).tokens_per_s, 0.0);
}

TEST(ThroughputTest, DatasheetPeaksByTheNameCudaReports) {
  auto h100 = DatasheetPeakFlops("cuda:0 (NVIDIA H100 80GB HBM3)", "bf16");
  ASSERT_TRUE(h100.has_value());
  EXPECT_DOUBLE_EQ(h100->flops_per_s, 989.4e12);
  EXPECT_EQ(h100->source, "H100 SXM datasheet, dense bf16");
  auto pcie = DatasheetPeakFlops("NVIDIA H100 PCIe", "fp16");
  ASSERT_TRUE(pcie.has_value());
  EXPECT_DOUBLE_EQ(pcie->flops_per_s, 756e12);
  auto h200 = DatasheetPeakFlops("NVIDIA H200", "fp32");
  ASSERT_TRUE(h200.has_value());
  EXPECT_DOUBLE_EQ(h200->flops_per_s, 66.9e12);
  EXPECT_FALSE(DatasheetPeakFlops("NVIDIA GeForce RTX 4090", "bf16").has_value());
  EXPECT_FALSE(DatasheetPeakFlops("NVIDIA H100 80GB HBM3", "int8").has_value());
  EXPECT_FALSE(DatasheetPeakFlops("cpu", "fp32").has_value());
}

}  // namespace
}  // namespace strata

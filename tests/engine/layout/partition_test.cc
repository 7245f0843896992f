// Partition layout math and the tiers.
#include "strata/engine/layout/partition.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "strata/engine/device/tier.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine {
namespace {

std::vector<ParamSpec> Specs(std::vector<size_t> numels) {
  std::vector<ParamSpec> v;
  for (size_t i = 0; i < numels.size(); ++i)
    v.push_back({"p" + std::to_string(i), numels[i]});
  return v;
}

TEST(PartitionTest, OffsetsAlignedAndPadded) {
  const auto specs = Specs({25, 5, 1, 17});
  Result<GroupLayout> r = LayoutGroup("g", specs, 3, 16);
  ASSERT_TRUE(r.ok()) << r.status();
  const GroupLayout& g = *r;
  ASSERT_EQ(g.params.size(), 4u);
  EXPECT_EQ(g.params[0].offset, 0u);
  EXPECT_EQ(g.params[1].offset, 32u);
  EXPECT_EQ(g.params[2].offset, 48u);
  EXPECT_EQ(g.params[3].offset, 64u);
  EXPECT_EQ(g.used_numel, 81u);
  EXPECT_EQ(g.numel, 48u);
  // ceil(81 / 3) = 27 -> 32.
  EXPECT_EQ(g.shard_numel, 32u);
  EXPECT_EQ(g.padded_numel, 96u);
}

TEST(PartitionTest, SlicesCoverEveryElementOnce) {
  for (int w = 1; w <= 4; ++w) {
    for (size_t align : {size_t{1}, size_t{16}}) {
      const auto specs = Specs({25, 5, 1, 17, 0, 3});
      Result<GroupLayout> r = LayoutGroup("g", specs, w, align);
      ASSERT_TRUE(r.ok());
      const GroupLayout& g = *r;
      EXPECT_EQ(g.padded_numel % static_cast<size_t>(w), 0u);
      EXPECT_EQ(g.shard_numel % align, 0u);
      EXPECT_GE(g.padded_numel, g.used_numel);
      EXPECT_LT(g.padded_numel - g.used_numel, static_cast<size_t>(w) * align + align);
      for (size_t i = 0; i < g.params.size(); ++i) {
        EXPECT_EQ(g.params[i].offset % align, 0u);
        std::vector<int> seen(g.params[i].numel, 0);
        for (int r2 = 0; r2 < w; ++r2) {
          auto s = g.Slice(i, r2);
          if (!s) continue;
          EXPECT_LE(s->shard_offset + s->count, g.shard_numel);
          // The slice is where the flat buffer says it is.
          EXPECT_EQ(g.shard_begin(r2) + s->shard_offset, g.params[i].offset + s->param_offset);
          for (size_t k = 0; k < s->count; ++k)
            ++seen[s->param_offset + k];
        }
        for (int c : seen)
          EXPECT_EQ(c, 1) << "w=" << w << " param " << i;
      }
    }
  }
}

TEST(PartitionTest, EmptyGroupAndErrors) {
  Result<GroupLayout> r = LayoutGroup("empty", {}, 4);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->shard_numel, 0u);
  EXPECT_EQ(r->padded_numel, 0u);
  EXPECT_EQ(LayoutGroup("g", {}, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(PartitionTest, ModelPartitionOffsetsAndPersistence) {
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> groups = {
      {"root", Specs({1})}, {"a", Specs({25, 5})}, {"b", Specs({100})}, {"c", Specs({3})}};
  PartitionOptions o;
  o.param_persistence_threshold = 3;
  Result<ModelPartition> r = PartitionModel(groups, 2, 1, o);
  ASSERT_TRUE(r.ok()) << r.status();
  const ModelPartition& m = *r;
  EXPECT_EQ(m.persistent, (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ(m.shard_offset[0], 0u);
  EXPECT_EQ(m.shard_offset[1], m.groups[0].shard_numel);
  EXPECT_EQ(m.partition_numel, m.groups[0].shard_numel + m.groups[1].shard_numel +
                                   m.groups[2].shard_numel + m.groups[3].shard_numel);
  EXPECT_EQ(m.persistent_numel(), m.groups[0].padded_numel + m.groups[3].padded_numel);
  EXPECT_EQ(m.LargestTwo(), std::make_pair(m.groups[2].padded_numel, m.groups[1].padded_numel));
  // The model-wide cap keeps only the first small group.
  o.model_persistence_threshold = 32;
  r = PartitionModel(groups, 2, 0, o);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->persistent, (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(PartitionModel(groups, 2, 2, o).status().code(), StatusCode::kInvalidArgument);
}

TEST(DTypeTest, ConversionsMatchTheKernelsRounding) {
  const std::vector<float> x = {0.0f, 1.0f, -2.5f, 1.0f + 1.0f / 512, 3.14159f, 65519.0f, 1e-8f};
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> h(x.size());
    ConvertFromFloat(x.data(), x.size(), h.data(), t);
    std::vector<float> back(x.size());
    ConvertToFloat(h.data(), t, x.size(), back.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t want = t == DType::kBFloat16 ? FloatToBFloat16(x[i]) : FloatToFloat16(x[i]);
      EXPECT_EQ(h[i], want) << DTypeName(t) << " " << x[i];
      EXPECT_EQ(back[i], t == DType::kBFloat16 ? BFloat16ToFloat(want) : Float16ToFloat(want));
    }
    // 16 -> 16 of another type goes through fp32; fp32 -> fp32 is a copy.
    std::vector<float> copy(x.size());
    Convert(x.data(), DType::kFloat32, copy.data(), DType::kFloat32, x.size());
    EXPECT_EQ(copy, x);
  }
  // AddInto rounds once: fp16 1 + 2^-11 is a tie that rounds to even (1.0); twice makes 1 +
  // 2^-10 exactly when added in one go.
  uint16_t one = FloatToFloat16(1.0f);
  const float tiny = 1.0f / 2048;
  AddInto(&tiny, DType::kFloat32, &one, DType::kFloat16, 1);
  EXPECT_EQ(Float16ToFloat(one), 1.0f);
  const float two_tiny = 2.0f / 2048;
  AddInto(&two_tiny, DType::kFloat32, &one, DType::kFloat16, 1);
  EXPECT_EQ(Float16ToFloat(one), 1.0f + 1.0f / 1024);
  EXPECT_EQ(ToCommDType(DType::kBFloat16), comm::DType::kBFloat16);
  EXPECT_EQ(ToScalarType(DType::kFloat16), ScalarType::kFloat16);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  Config c;
  EXPECT_EQ(WorkingDTypeFromConfig(c), DType::kFloat32);
  c.bf16 = true;
  EXPECT_EQ(WorkingDTypeFromConfig(c), DType::kBFloat16);
}

TEST(TierTest, ArenaRefusesPastBudgetAndTracksHighWater) {
  auto arena = std::make_shared<HostArenaAllocator>(1000);
  std::unique_ptr<Tier> tier = MakeDeviceTier(arena);
  EXPECT_EQ(tier->kind(), TierKind::kDevice);
  Result<TierBuffer> a = tier->Allocate(600, "first");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->size(), 600u);
  EXPECT_EQ(tier->usage().bytes_in_use, 640u);  // rounded to 64 bytes
  Result<TierBuffer> b = tier->Allocate(500, "second buffer");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  const std::string msg = b.status().message();
  EXPECT_NE(msg.find("second buffer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("512 bytes requested"), std::string::npos) << msg;
  EXPECT_NE(msg.find("640"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1000"), std::string::npos) << msg;
  a->Reset();
  EXPECT_EQ(tier->usage().bytes_in_use, 0u);
  Result<TierBuffer> c = tier->Allocate(900, "third");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(tier->usage().peak_bytes, 960u);
  EXPECT_LE(tier->usage().peak_bytes, 1000u);
  // Zero-filled.
  for (std::byte x : std::span<std::byte>(c->data(), c->size()))
    ASSERT_EQ(x, std::byte{0});
}

TEST(TierTest, NvmeIsRefusedNamingTheKey) {
  auto arena = std::make_shared<HostArenaAllocator>(0);
  std::unique_ptr<Tier> dev = MakeDeviceTier(arena);
  Result<Tier*> t = SelectOffloadTier(OffloadDevice::kNvme,
                                      "zero_optimization.offload_param.device", dev.get(), nullptr);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(t.status().message().find("zero_optimization.offload_param.device"), std::string::npos);
  EXPECT_NE(t.status().message().find("NVMe tier not implemented yet"), std::string::npos);
  EXPECT_EQ(*SelectOffloadTier(OffloadDevice::kNone, "k", dev.get(), nullptr), dev.get());
}

}  // namespace
}  // namespace strata::engine

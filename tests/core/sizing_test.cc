// core/sizing.h: the keys a document leaves at DeepSpeed's defaults sized from the model;
// a key the document set, or one a program changed, kept.
#include "strata/core/sizing.h"

#include <gtest/gtest.h>

#include "strata/core/check.h"
#include "strata/core/planner.h"

namespace strata {
namespace {

Config Parse(const std::string& json) {
  Result<Config> c = ParseConfig(json);
  STRATA_CHECK_OK(c.status());
  return *std::move(c);
}

constexpr const char* kPlain = R"({"train_batch_size": 8, "zero_optimization": {"stage": 3}})";

TEST(SizingTest, DefaultsAreSizedFromTheModel) {
  Config c = Parse(kPlain);
  EXPECT_FALSE(c.Given("zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(c.Given("zero_optimization.stage"));
  EXPECT_TRUE(c.Given("zero_optimization"));
  // 160M trainable elements, the largest group 4M, 80M of them this rank's.
  const std::vector<SizedKey> sized = SizeFromModel(
      c, {.trainable = 160'000'000, .largest_group = 4'000'000, .partition = 80'000'000});
  ASSERT_EQ(sized.size(), 2u);
  EXPECT_EQ(c.zero.reduce_bucket_size, 10'000'000);  // a sixteenth of the model
  EXPECT_EQ(c.zero.sub_group_size, 5'000'000);       // a sixteenth of the partition
  EXPECT_EQ(sized[0].path, "zero_optimization.reduce_bucket_size");
  EXPECT_EQ(sized[0].from, 500'000'000);
  EXPECT_EQ(sized[0].to, 10'000'000);
  EXPECT_NE(sized[0].ToString().find("zero_optimization.reduce_bucket_size 500000000 -> 10000000"),
            std::string::npos)
      << sized[0].ToString();
  EXPECT_NE(sized[1].why.find("80000000"), std::string::npos) << sized[1].why;
}

TEST(SizingTest, TheLargestGroupAndTheFloorsBound) {
  Config c = Parse(kPlain);
  // A model of one large group: its bucket holds the group; a small partition: 2^20.
  SizeFromModel(c, {.trainable = 32'000'000, .largest_group = 30'000'000, .partition = 1'000});
  EXPECT_EQ(c.zero.reduce_bucket_size, 30'000'000);
  EXPECT_EQ(c.zero.sub_group_size, 1 << 20);
  // Never above the default: a model too large for a sixteenth to be smaller keeps it.
  Config big = Parse(kPlain);
  EXPECT_TRUE(SizeFromModel(big, {.trainable = 100'000'000'000,
                                  .largest_group = 1'000'000'000,
                                  .partition = 100'000'000'000})
                  .empty());
  EXPECT_EQ(big.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(big.zero.sub_group_size, 1'000'000'000);
}

TEST(SizingTest, AKeyTheDocumentSetOrAProgramChangedIsKept) {
  Config given = Parse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "reduce_bucket_size": 500000000, "sub_group_size": 1e9}})");
  EXPECT_TRUE(given.Given("zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(
      SizeFromModel(given,
                    {.trainable = 160'000'000, .largest_group = 4'000'000, .partition = 80'000'000})
          .empty());
  EXPECT_EQ(given.zero.reduce_bucket_size, 500'000'000);
  Config changed = Parse(kPlain);
  changed.zero.reduce_bucket_size = 123;
  const std::vector<SizedKey> sized = SizeFromModel(
      changed, {.trainable = 160'000'000, .largest_group = 4'000'000, .partition = 80'000'000});
  ASSERT_EQ(sized.size(), 1u);
  EXPECT_EQ(sized[0].path, "zero_optimization.sub_group_size");
  EXPECT_EQ(changed.zero.reduce_bucket_size, 123);
}

// NVMe parameters: a group's shard larger than DeepSpeed's buffer_size raises the buffer to
// it when the key is left out; written out, it is kept (the engine then refuses it).
TEST(SizingTest, TheParameterBufferHoldsTheLargestShard) {
  constexpr const char* kNvme = R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})";
  Config c = Parse(kNvme);
  const ModelExtent m{.trainable = 1'000'000'000,
                      .largest_group = 262'000'000,
                      .partition = 1'000'000'000,
                      .largest_shard = 262'000'000};
  SizeFromModel(c, m);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 262'000'000);
  Config given = Parse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_size": 1e8}}})");
  SizeFromModel(given, m);
  EXPECT_EQ(given.zero.offload_param.buffer_size, 100'000'000);
}

// The ZeRO-Infinity section as DeepSpeed's docs give it (no sizing keys) for a 1.24B model on
// one rank with the CPU device, against a 6 GiB room (where the kernel killed it in
// `initialize` with DeepSpeed's defaults): the keys left out are lowered until the plan
// fits, a key written out is kept, and a room nothing fits is left to the check.
constexpr const char* kInfinity = R"({"train_batch_size": 1, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pin_memory": true},
      "offload_param": {"device": "nvme", "nvme_path": "/tmp", "pin_memory": true}}})";

TEST(FitToMemoryTest, TheInfinitySectionIsLoweredToTheRoom) {
  const PlanInput in{.params = 1'235'814'400, .largest_group = 262'668'288, .device_on_host = true};
  const uint64_t room = uint64_t{6} << 30;
  Config c = Parse(kInfinity);
  Result<Plan> before = MakePlan(c, in);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_GT(before->memory_bytes(), room) << before->ToString();
  Result<std::vector<SizedKey>> keys = FitToMemory(c, in, room, "a test's 6 GiB");
  ASSERT_TRUE(keys.ok()) << keys.status();
  Result<Plan> after = MakePlan(c, in);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_LE(after->memory_bytes(), room) << after->ToString();
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 0);  // the cheapest goes first
  ASSERT_FALSE(keys->empty());
  for (const SizedKey& k : *keys) {
    EXPECT_LT(k.to, k.from) << k.ToString();
    EXPECT_NE(k.why.find("a test's 6 GiB"), std::string::npos) << k.ToString();
  }
  // Written out, max_in_cpu is kept; the others still give way.
  Config kept = Parse(R"({"train_batch_size": 1, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
        "offload_param": {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 1e8}}})");
  ASSERT_TRUE(FitToMemory(kept, in, room, "6 GiB").ok());
  EXPECT_EQ(kept.zero.offload_param.max_in_cpu, 100'000'000);
  // A room too small for anything: lowered as far as it goes, and the plan still above it.
  Config tiny = Parse(kInfinity);
  Result<std::vector<SizedKey>> far = FitToMemory(tiny, in, 64 << 20, "64 MiB");
  ASSERT_TRUE(far.ok()) << far.status();
  ASSERT_FALSE(far->empty());
  EXPECT_NE(far->front().why.find("as far as it goes"), std::string::npos) << far->front().why;
  EXPECT_GT(MakePlan(tiny, in)->memory_bytes(), uint64_t{64} << 20);
}

// The CPU device's memory is the host's: the plan counts the gathered groups and buckets in
// the memory the limits see, bounded by stage3_max_live_parameters.
TEST(FitToMemoryTest, TheCpuDevicesMemoryCountsAndFollowsMaxLive) {
  Config c = Parse(kPlain);
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  PlanInput in{.params = 100'000'000, .largest_group = 10'000'000};
  Result<Plan> gpu = MakePlan(c, in);
  in.device_on_host = true;
  Result<Plan> cpu = MakePlan(c, in);
  ASSERT_TRUE(gpu.ok() && cpu.ok());
  EXPECT_EQ(gpu->memory_bytes(), gpu->host_bytes());
  EXPECT_EQ(cpu->memory_bytes(), cpu->host_bytes() + cpu->device_bytes + cpu->device_working_bytes +
                                     cpu->autograd_bytes);
  // max_live 1e9 (the default) bounds nothing here: the whole model may be gathered.
  EXPECT_GE(cpu->device_working_bytes, 4 * in.params);
  c.zero.stage3_max_live_parameters = 20'000'000;  // two groups
  Result<Plan> bounded = MakePlan(c, in);
  ASSERT_TRUE(bounded.ok());
  EXPECT_LT(bounded->device_working_bytes, 4 * in.params);
  EXPECT_GE(bounded->device_working_bytes, 4 * 2 * in.largest_group);
}

// The engine keeps the groups in use gathered (the root and one block at most): the floor
// max_live is lowered to is the two largest groups, not twice the largest (a tied
// embedding in the root is far larger than a block).
TEST(FitToMemoryTest, MaxLiveIsLoweredToTheTwoLargestGroups) {
  const PlanInput twice{
      .params = 1'235'814'400, .largest_group = 262'668'288, .device_on_host = true};
  PlanInput two = twice;
  two.second_group = 60'821'504;  // a decoder layer of the 1.24B Llama
  EXPECT_EQ(GatheredFloor(twice), 2 * twice.largest_group);
  EXPECT_EQ(GatheredFloor(two), two.largest_group + two.second_group);
  Config c = Parse(kInfinity);
  ASSERT_TRUE(FitToMemory(c, two, uint64_t{1} << 30, "1 GiB").ok());  // as far as it goes
  EXPECT_EQ(c.zero.stage3_max_live_parameters,
            static_cast<int64_t>(two.largest_group + two.second_group));
  Result<Plan> low = MakePlan(c, two);
  Config d = Parse(kInfinity);
  ASSERT_TRUE(FitToMemory(d, twice, uint64_t{1} << 30, "1 GiB").ok());
  EXPECT_EQ(d.zero.stage3_max_live_parameters, static_cast<int64_t>(2 * twice.largest_group));
  Result<Plan> high = MakePlan(d, twice);
  ASSERT_TRUE(low.ok() && high.ok());
  EXPECT_EQ(high->device_working_bytes - low->device_working_bytes,
            (twice.largest_group - two.second_group) * 2);  // bf16
}

}  // namespace
}  // namespace strata

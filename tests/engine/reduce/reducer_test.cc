// GradientReducer's park (engine/reduce/reducer.h): the gradients a group gets ahead of the rest
// of it (a root group's final norm before the blocks, its tied embedding after them) wait
// in the park, so the group is reduced once instead of twice, with the sums of its
// gradients given together.
#include "strata/engine/reduce/reducer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "thread_comm.h"

namespace strata::engine {
namespace {

using testing::ThreadCommunicator;
using testing::ThreadGroup;

constexpr int kWorld = 2;
// Group 0 ("root"): a final norm of 32 elements and an embedding of 400; groups 1-3
// ("block k"): a weight of 200 and a bias of 16. Padded for 2 ranks: 448 and 224 each.
const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& Specs() {
  static const auto* specs = new std::vector<std::pair<std::string, std::vector<ParamSpec>>>{
      {"root", {{"ln_f", 32}, {"embedding", 400}}},
      {"block 1", {{"w", 200}, {"b", 16}}},
      {"block 2", {{"w", 200}, {"b", 16}}},
      {"block 3", {{"w", 200}, {"b", 16}}},
  };
  return *specs;
}

struct Arrival {
  int group, param;
};

// A backward of a model whose final norm and embedding are in the root group: the norm's
// gradient first, the blocks' in reverse, a second gradient of the norm (a module run twice),
// the embedding's last; `embedding` false leaves the embedding out (it got no gradient).
std::vector<Arrival> Backward(bool embedding) {
  std::vector<Arrival> a = {{0, 0}, {3, 1}, {3, 0}, {2, 1}, {2, 0}, {1, 1}, {1, 0}};
  if (embedding) {
    a.push_back({0, 0});
    a.push_back({0, 1});
  }
  return a;
}

// One rank's reducer over the fp32 accumulators it adds into.
struct RankReducer {
  std::shared_ptr<std::vector<float>> acc;
  std::unique_ptr<GradientReducer> reducer;
};

Result<RankReducer> MakeReducer(const ModelPartition& partition, comm::Communicator* comm,
                                Device* device, Tier* tier, int64_t park_elems) {
  RankReducer r;
  r.acc = std::make_shared<std::vector<float>>(partition.partition_numel, 0.0f);
  AccumulateFn add = [acc = r.acc](size_t offset, const std::byte* src, DType dtype, size_t n) {
    std::vector<float> v(n);
    ConvertToFloat(src, dtype, n, v.data());
    for (size_t i = 0; i < n; ++i)
      (*acc)[offset + i] += v[i];
    return Status::Ok();
  };
  ReducerOptions o;
  o.bucket_elems = 512;  // the root group and a block do not fit together; two blocks do
  o.num_buckets = 2;
  o.device = device;
  o.park_elems = park_elems;
  STRATA_ASSIGN_OR_RETURN(r.reducer, GradientReducer::Create(&partition, DType::kBFloat16, comm,
                                                             tier, std::move(add), o));
  return r;
}

void RunRank(int rank, std::vector<std::shared_ptr<ThreadGroup>> groups) {
  Result<ModelPartition> partition = PartitionModel(Specs(), kWorld, rank, PartitionOptions{});
  ASSERT_TRUE(partition.ok()) << partition.status();
  Result<std::unique_ptr<Device>> device = MakeCpuDevice(CpuDeviceOptions{});
  ASSERT_TRUE(device.ok()) << device.status();
  std::unique_ptr<Tier> tier = MakeDeviceTier((*device)->allocator());
  ThreadCommunicator parked_comm(groups[0], rank), plain_comm(groups[1], rank),
      together_comm(groups[2], rank);
  // The default park (512 / 16 = 32 elements: the norm fits), and two reducers without one:
  // fed the same arrivals, and fed them with the root group's together at the end.
  Result<RankReducer> parked = MakeReducer(*partition, &parked_comm, device->get(), tier.get(), -1);
  ASSERT_TRUE(parked.ok()) << parked.status();
  Result<RankReducer> plain = MakeReducer(*partition, &plain_comm, device->get(), tier.get(), 0);
  ASSERT_TRUE(plain.ok()) << plain.status();
  Result<RankReducer> together =
      MakeReducer(*partition, &together_comm, device->get(), tier.get(), 0);
  ASSERT_TRUE(together.ok()) << together.status();
  EXPECT_EQ(parked->reducer->stats().park_elems, 32u);
  EXPECT_EQ(plain->reducer->stats().park_elems, 0u);
  EXPECT_EQ(parked->reducer->stats().bucket_bytes,
            plain->reducer->stats().bucket_bytes + 64);  // 32 bf16 elements, rounded to 64
  ReducerOptions sized;
  sized.bucket_elems = 512;
  EXPECT_EQ(GradientReducer::BucketBytes(*partition, DType::kBFloat16, sized),
            parked->reducer->stats().bucket_bytes);

  const size_t elem = sizeof(uint16_t);
  const uint64_t once = (448 + 3 * 224) * elem;  // each group's slot reduced once
  std::mt19937 rng(100 + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int backward = 0; backward < 4; ++backward) {
    SCOPED_TRACE("backward " + std::to_string(backward));
    const bool embedding = backward != 2;
    for (RankReducer* r : {&*parked, &*plain, &*together})
      std::fill(r->acc->begin(), r->acc->end(), 0.0f);
    const uint64_t parked_before = parked->reducer->stats().gradients_parked;
    const uint64_t bytes_before = parked->reducer->stats().reduce_scatter_bytes;
    const uint64_t plain_bytes_before = plain->reducer->stats().reduce_scatter_bytes;
    const std::vector<Arrival> arrivals = Backward(embedding);
    std::vector<std::vector<float>> grads;
    for (const Arrival& a : arrivals) {
      std::vector<float> grad(
          Specs()[static_cast<size_t>(a.group)].second[static_cast<size_t>(a.param)].numel);
      for (float& x : grad)
        x = normal(rng);
      ASSERT_TRUE(
          parked->reducer->AddGradient(a.group, a.param, grad.data(), DType::kFloat32).ok());
      ASSERT_TRUE(plain->reducer->AddGradient(a.group, a.param, grad.data(), DType::kFloat32).ok());
      if (backward > 0 && a.group != 0) {
        // The norm's gradient waits in the park from the second backward on: the root group
        // is pending although no bucket holds a slot of it.
        EXPECT_TRUE(parked->reducer->GroupPending(0));
        EXPECT_TRUE(parked->reducer->pending());
      }
      grads.push_back(std::move(grad));
    }
    std::vector<size_t> order(arrivals.size());
    for (size_t i = 0; i < order.size(); ++i)
      order[i] = i;
    std::stable_partition(order.begin(), order.end(),
                          [&](size_t i) { return arrivals[i].group != 0; });
    for (size_t i : order) {
      ASSERT_TRUE(
          together->reducer
              ->AddGradient(arrivals[i].group, arrivals[i].param, grads[i].data(), DType::kFloat32)
              .ok());
    }
    for (RankReducer* r : {&*parked, &*plain, &*together})
      ASSERT_TRUE(r->reducer->Flush().ok());
    EXPECT_FALSE(parked->reducer->pending());
    EXPECT_FALSE(parked->reducer->GroupPending(0));
    // Bit for bit: the first backward's sums are the plain reducer's (nothing parked); from
    // the second on, those of the root group's gradients given together (the norm's two
    // added in the communication dtype before the reduction, as in one slot).
    const std::vector<float>& acc = *parked->acc;
    const std::vector<float>& want = backward == 0 ? *plain->acc : *together->acc;
    ASSERT_EQ(acc.size(), want.size());
    EXPECT_EQ(std::memcmp(acc.data(), want.data(), acc.size() * sizeof(float)), 0);
    EXPECT_GT(std::count_if(acc.begin(), acc.end(), [](float x) { return x != 0; }), 200);
    const uint64_t bytes = parked->reducer->stats().reduce_scatter_bytes - bytes_before;
    const uint64_t plain_bytes = plain->reducer->stats().reduce_scatter_bytes - plain_bytes_before;
    const uint64_t parked_now = parked->reducer->stats().gradients_parked - parked_before;
    if (backward == 0) {
      // Nothing known yet of the order: the root group is reduced twice, as without a park.
      EXPECT_EQ(parked_now, 0u);
      EXPECT_EQ(bytes, once + 448 * elem);
    } else {
      // Only the norm's first gradient is parked (the blocks' come together), and every
      // group is reduced once; without the embedding the norm's slot opens in Flush.
      EXPECT_EQ(parked_now, 1u);
      EXPECT_EQ(bytes, once);
    }
    EXPECT_EQ(plain_bytes, embedding ? once + 448 * elem : once);
    EXPECT_EQ(plain->reducer->stats().gradients_parked, 0u);
  }
}

TEST(ReducerParkTest, AGroupWithGradientsAtBothEndsIsReducedOnceWithTheSameSums) {
  std::vector<std::shared_ptr<ThreadGroup>> groups;
  for (int i = 0; i < 3; ++i)
    groups.push_back(std::make_shared<ThreadGroup>(kWorld));
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r)
    ranks.emplace_back(RunRank, r, groups);
  for (std::thread& t : ranks)
    t.join();
}

// Gradient accumulation on the device (ReducerOptions::accumulate_on_device): the sums stay
// on the device until the boundary's backward; there a group's fp32 sum, larger than the
// bf16 staging buffer holds, reaches the host in pieces that end on aligned elements, in
// later rounds of the same buffer, with the same sums as adding every backward's shards on
// the host.
TEST(ReducerDeviceAccumulationTest, ASumLargerThanItsStagingGoesInAlignedPieces) {
  const std::vector<std::pair<std::string, std::vector<ParamSpec>>> specs = {
      {"big", {{"w", 1000}}}};
  Result<ModelPartition> partition = PartitionModel(specs, 1, 0, PartitionOptions{});
  ASSERT_TRUE(partition.ok()) << partition.status();
  ASSERT_EQ(partition->partition_numel, 1008u);  // padded to 16
  Result<std::unique_ptr<Device>> device = MakeCpuDevice(CpuDeviceOptions{});
  ASSERT_TRUE(device.ok()) << device.status();
  std::unique_ptr<Tier> tier = MakeDeviceTier((*device)->allocator());
  struct Call {
    size_t offset, n;
    DType dtype;
  };
  struct Side {
    std::vector<float> acc = std::vector<float>(1008, 0.0f);
    std::vector<Call> calls;
    std::unique_ptr<ThreadCommunicator> comm;
    std::unique_ptr<GradientReducer> reducer;
  };
  Side on, off;
  for (Side* side : {&on, &off}) {
    side->comm = std::make_unique<ThreadCommunicator>(std::make_shared<ThreadGroup>(1), 0);
    AccumulateFn add = [side](size_t offset, const std::byte* src, DType dtype, size_t n) {
      side->calls.push_back({offset, n, dtype});
      std::vector<float> v(n);
      ConvertToFloat(src, dtype, n, v.data());
      for (size_t i = 0; i < n; ++i)
        side->acc[offset + i] += v[i];
      return Status::Ok();
    };
    ReducerOptions o;
    o.bucket_elems = 1008;
    o.num_buckets = 2;
    o.device = device->get();
    o.shards_to_host = true;
    Result<StreamId> copy = (*device)->CreateStream("gradient shards");
    ASSERT_TRUE(copy.ok());
    o.copy_stream = *copy;
    o.staging_tier = tier.get();
    o.accumulate_on_device = side == &on;
    o.piece_align_elems = 96;
    Result<std::unique_ptr<GradientReducer>> r = GradientReducer::Create(
        &*partition, DType::kBFloat16, side->comm.get(), tier.get(), std::move(add), o);
    ASSERT_TRUE(r.ok()) << r.status();
    side->reducer = *std::move(r);
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int step = 0; step < 2; ++step) {
    for (int micro = 0; micro < 3; ++micro) {
      const bool boundary = micro == 2;
      std::vector<float> grad(1000);
      for (float& x : grad)
        x = normal(rng);
      on.calls.clear();
      for (Side* side : {&on, &off}) {
        side->reducer->set_boundary(boundary);
        ASSERT_TRUE(side->reducer->AddGradient(0, 0, grad.data(), DType::kFloat32).ok());
        ASSERT_TRUE(side->reducer->Flush().ok());
      }
      if (!boundary) {
        EXPECT_TRUE(on.calls.empty()) << "step " << step << ", micro-step " << micro;
        continue;
      }
      // The staging holds 1008 bf16 elements (2016 bytes), 504 floats: pieces of at most
      // 504 elements, cut at multiples of 96 (480, 960), each round one piece.
      ASSERT_EQ(on.calls.size(), 3u);
      const size_t want[3][2] = {{0, 480}, {480, 480}, {960, 48}};
      for (size_t k = 0; k < 3; ++k) {
        EXPECT_EQ(on.calls[k].offset, want[k][0]);
        EXPECT_EQ(on.calls[k].n, want[k][1]);
        EXPECT_EQ(on.calls[k].dtype, DType::kFloat32);
      }
      EXPECT_EQ(std::memcmp(on.acc.data(), off.acc.data(), on.acc.size() * sizeof(float)), 0)
          << "step " << step;
      std::fill(on.acc.begin(), on.acc.end(), 0.0f);
      std::fill(off.acc.begin(), off.acc.end(), 0.0f);
    }
  }
  const ReducerStats s = on.reducer->stats();
  EXPECT_EQ(s.staging_refills, 4u);  // two a boundary
  EXPECT_EQ(s.shards_added_on_device, 6u);
  EXPECT_EQ(s.accumulated_copies, 2u);
  EXPECT_EQ(s.shard_copies, 2u);
  EXPECT_EQ(s.shard_copy_bytes, 2u * 1008 * sizeof(float));
  EXPECT_EQ(s.device_accumulator_bytes, 1008u * sizeof(float));
  EXPECT_EQ(off.reducer->stats().shard_copies, 6u);
}

}  // namespace
}  // namespace strata::engine

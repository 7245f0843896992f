// The engine's two largest components on their own, with the CPU device and host-resident
// state stores, not through EngineCore: the ParameterCoordinator (engine/gather) gathers
// every rank's working shards into each group's full buffer, prefetches along the trace it
// recorded, and refuses misuse; the OptimizerDriver (engine/step) steps the fp32 master, m
// and v with CPU-Adam as plain Adam does, copies the new parameters into the working
// shards, and gives the same bits when its update is pipelined.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "strata/core/check.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/gather/coordinator.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/runtime/stores.h"
#include "strata/engine/step/loss_scaler.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/offload/cpu/host_state_store.h"
#include "strata/optim/cpu_adam/cpu_adam.h"
#include "thread_comm.h"

namespace strata::engine {
namespace {

using testing::ThreadCommunicator;
using testing::ThreadGroup;

// Three groups of odd sizes (parameters straddle the shards).
const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& Specs() {
  static const auto* specs = new std::vector<std::pair<std::string, std::vector<ParamSpec>>>{
      {"root", {{"scale", 3}}},
      {"block 1", {{"w", 37}, {"b", 5}}},
      {"block 2", {{"w", 64}, {"b", 9}}},
  };
  return *specs;
}

ModelPartition Partition(int world, int rank) {
  PartitionOptions o;
  o.param_persistence_threshold = 0;
  Result<ModelPartition> p = PartitionModel(Specs(), world, rank, o);
  STRATA_CHECK(p.ok());
  return *std::move(p);
}

// A host-resident store over the heap.
std::unique_ptr<offload::StateStore> HeapStore() {
  return offload::MakeHostStateStore(
      [](size_t bytes, std::string_view) -> Result<offload::StateMemory> {
        std::shared_ptr<std::byte[]> heap(new std::byte[bytes]());
        std::byte* data = heap.get();
        return offload::StateMemory{data, bytes, std::move(heap)};
      });
}

// The value of element e of group g's flat buffer (padding included).
float Value(int g, size_t e) {
  return static_cast<float>(g) * 1000.0f + static_cast<float>(e) * 0.5f;
}

// Runs body(rank, comm) on `world` ranks as threads; the first failure of each rank.
template <typename Body>
std::vector<Status> RunRanks(int world, Body body) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<Status> out(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r);
      out[static_cast<size_t>(r)] = body(r, comm);
    });
  }
  for (std::thread& t : threads)
    t.join();
  return out;
}

#define CHECK_OR_RETURN(cond, msg)                                      \
  do {                                                                  \
    if (!(cond)) return InternalError(std::string(#cond ": ") + (msg)); \
  } while (0)

// ---------------------------------------------------------------------------
// ParameterCoordinator

// Every rank's shards (each rank writes its own part of Value) gathered into each group's
// full buffer, forward and backward, two iterations: the second served by prefetches along
// the recorded trace. On the delaying CPU device too, where a missing wait for the staging
// copy or the all-gather gives wrong values.
Status GatherEveryGroup(int world, int rank, comm::Communicator& comm, bool delaying) {
  const ModelPartition partition = Partition(world, rank);
  CpuDeviceOptions dopts;
  dopts.delaying = delaying;
  dopts.seed = 31 + static_cast<uint64_t>(rank);
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Device> device, MakeCpuDevice(dopts));
  // The shards' memory registered with the device, which copies from it (as the engine's).
  std::unique_ptr<offload::StateStore> store =
      offload::MakeHostStateStore(StoreAllocator(nullptr, device));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<WorkingShards> shards,
                          WorkingShards::Create(&partition, DType::kFloat32, store.get()));
  for (int g = 0; g < partition.num_groups(); ++g) {
    const GroupLayout& l = partition.groups[static_cast<size_t>(g)];
    STRATA_ASSIGN_OR_RETURN(offload::StateLease lease, shards->Acquire(g, offload::Access::kWrite));
    std::span<float> v = lease.as<float>();
    for (size_t i = 0; i < l.shard_numel; ++i)
      v[i] = Value(g, l.shard_begin(rank) + i);
    STRATA_RETURN_IF_ERROR(lease.Release());
  }
  std::unique_ptr<Tier> tier = MakeDeviceTier(device->allocator());
  CoordinatorOptions o;
  o.device = device.get();
  o.stage_shards = true;
  STRATA_ASSIGN_OR_RETURN(o.copy_stream, device->CreateStream("staging"));
  ShardSource source;
  source.store = shards.get();
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<ParameterCoordinator> c,
      ParameterCoordinator::Create(&partition, source, DType::kFloat32, &comm, tier.get(), o));
  STRATA_RETURN_IF_ERROR(c->RegatherPersistent());
  auto check = [&](int g) -> Status {
    STRATA_ASSIGN_OR_RETURN(GatheredGroup full, c->FullBuffer(g));
    const GroupLayout& l = partition.groups[static_cast<size_t>(g)];
    for (size_t i = 0; i < l.params.size(); ++i) {
      const auto* p = reinterpret_cast<const float*>(full.param_data(i));
      for (size_t e = 0; e < l.params[i].numel; ++e) {
        const size_t at = l.params[i].offset + e;
        CHECK_OR_RETURN(p[e] == Value(g, at), "group " + std::to_string(g) + " element " +
                                                  std::to_string(at) + " is " +
                                                  std::to_string(p[e]));
      }
    }
    return Status::Ok();
  };
  for (int iteration = 0; iteration < 2; ++iteration) {
    for (int g = 0; g < partition.num_groups(); ++g) {
      STRATA_RETURN_IF_ERROR(c->PreForward(g));
      STRATA_RETURN_IF_ERROR(check(g));
      STRATA_RETURN_IF_ERROR(c->PostForward(g));
    }
    for (int g = partition.num_groups() - 1; g >= 0; --g) {
      STRATA_RETURN_IF_ERROR(c->PreBackward(g));
      STRATA_RETURN_IF_ERROR(check(g));
      STRATA_RETURN_IF_ERROR(c->PostBackward(g));
    }
    STRATA_RETURN_IF_ERROR(c->EndStep());
    STRATA_RETURN_IF_ERROR(c->BeginIteration());
  }
  const CoordinatorStats s = c->stats();
  CHECK_OR_RETURN(s.trace_valid && s.trace_recordings == 1, "the trace was not recorded once");
  CHECK_OR_RETURN(s.fetches_prefetched > 0, "the second iteration prefetched nothing");
  CHECK_OR_RETURN(s.all_gather_calls > 0, "no all-gather");
  // Misuse: a release without its gather, a full buffer of a released group.
  const Status post = c->PostForward(1);
  CHECK_OR_RETURN(post.code() == StatusCode::kFailedPrecondition, post.ToString());
  CHECK_OR_RETURN(!c->FullBuffer(1).ok(), "the full buffer of a released group");
  CHECK_OR_RETURN(c->PreForward(7).code() == StatusCode::kFailedPrecondition, "group 7");
  return Status::Ok();
}

TEST(ParameterCoordinatorTest, GathersEveryRanksShardsAndPrefetchesAlongTheTrace) {
  for (const int world : {1, 2, 3}) {
    for (const bool delaying : {false, true}) {
      SCOPED_TRACE("world " + std::to_string(world) + (delaying ? ", delaying" : ""));
      const std::vector<Status> out = RunRanks(world, [&](int rank, comm::Communicator& comm) {
        return GatherEveryGroup(world, rank, comm, delaying);
      });
      for (const Status& s : out)
        EXPECT_TRUE(s.ok()) << s;
    }
  }
}

// ---------------------------------------------------------------------------
// OptimizerDriver

struct Driver {
  ModelPartition partition;
  std::unique_ptr<offload::StateStore> store, shard_store;
  std::unique_ptr<WorkingShards> shards;
  std::unique_ptr<CpuAdam> adam;
  std::unique_ptr<OptimizerDriver> driver;
};

Result<std::unique_ptr<Driver>> MakeDriver(comm::Communicator& comm) {
  auto d = std::make_unique<Driver>();
  d->partition = Partition(1, 0);
  d->store = HeapStore();
  d->shard_store = HeapStore();
  STRATA_ASSIGN_OR_RETURN(
      d->shards, WorkingShards::Create(&d->partition, DType::kBFloat16, d->shard_store.get()));
  CpuAdam::Options ao;
  ao.num_threads = 1;
  STRATA_ASSIGN_OR_RETURN(d->adam, CpuAdam::Create(ao));
  OptimizerDriverOptions o;
  o.adam.lr = 0.05;
  o.adam.weight_decay = 0.01;
  o.adam.weight_decay_mode = WeightDecayMode::kDecoupled;
  o.sub_group_elems = 40;  // several sub-groups, cut inside groups
  STRATA_ASSIGN_OR_RETURN(
      d->driver, OptimizerDriver::Create(&d->partition, d->store.get(), d->shards.get(), &comm,
                                         d->adam.get(), o));
  std::vector<float> master(d->partition.partition_numel);
  for (size_t i = 0; i < master.size(); ++i)
    master[i] = std::sin(0.1f * static_cast<float>(i));
  STRATA_RETURN_IF_ERROR(d->driver->WriteMaster(0, master));
  STRATA_RETURN_IF_ERROR(d->driver->SyncWorkingFromMaster());
  STRATA_RETURN_IF_ERROR(d->driver->Commit());
  return d;
}

std::vector<float> Gradient(size_t n, int step) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i)
    g[i] = std::cos(0.3f * static_cast<float>(i) + static_cast<float>(step));
  return g;
}

// Three steps of two micro-steps each, the gradients added into the accumulators as the
// reducer adds them: the master, m and v are plain AdamW's (torch's formula, the kernel's
// fp32 operations), the working shards the master rounded to bf16, and a pipelined update
// (StartStep, WaitGroup, FinishUpdate) gives the same bits as Step.
TEST(OptimizerDriverTest, StepsAsAdamWAndThePipelinedUpdateGivesTheSameBits) {
  auto group = std::make_shared<ThreadGroup>(1);
  ThreadCommunicator comm_a(group, 0), comm_b(group, 0);
  Result<std::unique_ptr<Driver>> a = MakeDriver(comm_a), b = MakeDriver(comm_b);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const size_t n = (*a)->partition.partition_numel;
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  ASSERT_TRUE((*a)->driver->ReadMaster(0, p).ok());
  LossScaler scaler_a, scaler_b;
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> sum(n, 0.0f);
    for (int micro = 0; micro < 2; ++micro) {
      const std::vector<float> g = Gradient(n, 2 * step + micro);
      for (size_t i = 0; i < n; ++i)
        sum[i] += g[i];
      for (Driver* d : {a->get(), b->get()}) {
        ASSERT_TRUE(
            d->driver
                ->Accumulate(0, reinterpret_cast<const std::byte*>(g.data()), DType::kFloat32, n)
                .ok());
      }
    }
    Result<StepOutcome> done = (*a)->driver->Step(0.05, scaler_a);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_TRUE(done->applied);
    EXPECT_EQ(done->adam_step, step);
    Result<StepOutcome> started = (*b)->driver->StartStep(0.05, scaler_b, std::nullopt, {2, 1, 0});
    ASSERT_TRUE(started.ok()) << started.status();
    for (int g = 0; g < (*b)->partition.num_groups(); ++g)
      ASSERT_TRUE((*b)->driver->WaitGroup(g).ok());
    ASSERT_TRUE((*b)->driver->FinishUpdate().ok());
    // AdamW, as the kernel computes it.
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    const double bc1 = 1.0 - std::pow(0.9, step), bc2 = 1.0 - std::pow(0.999, step);
    const float neg_step = static_cast<float>(-0.05 / bc1);
    const float decay = static_cast<float>(1.0 - 0.05 * 0.01);
    const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    for (size_t i = 0; i < n; ++i) {
      p[i] *= decay;
      m[i] = std::fma(b1, m[i], (1.0f - b1) * sum[i]);
      v[i] = std::fma(b2, v[i], ((1.0f - b2) * sum[i]) * sum[i]);
      p[i] = std::fma(neg_step, m[i] / std::fma(std::sqrt(v[i]), inv_sqrt_bc2, eps), p[i]);
    }
  }
  Result<std::vector<float>> master = (*a)->driver->CopyState(OptimizerState::kMaster);
  ASSERT_TRUE(master.ok());
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i)
    worst = std::max(worst, std::abs(static_cast<double>((*master)[i]) - p[i]));
  EXPECT_LT(worst, 1e-6) << "the master against plain AdamW";
  for (const OptimizerState s :
       {OptimizerState::kMaster, OptimizerState::kExpAvg, OptimizerState::kExpAvgSq}) {
    Result<std::vector<float>> x = (*a)->driver->CopyState(s);
    Result<std::vector<float>> y = (*b)->driver->CopyState(s);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(0, std::memcmp(x->data(), y->data(), n * sizeof(float)))
        << OptimizerStateName(s) << ": Step and the pipelined update differ";
  }
  // The working shards: the master rounded to bf16.
  for (int g = 0; g < (*a)->partition.num_groups(); ++g) {
    if (!(*a)->shards->has(g)) continue;
    Result<offload::StateLease> l = (*a)->shards->Acquire(g, offload::Access::kRead);
    ASSERT_TRUE(l.ok());
    const GroupLayout& layout = (*a)->partition.groups[static_cast<size_t>(g)];
    std::vector<float> got(layout.shard_numel);
    ConvertToFloat(l->data(), DType::kBFloat16, got.size(), got.data());
    const size_t at = (*a)->partition.shard_offset[static_cast<size_t>(g)];
    for (size_t i = 0; i < got.size(); ++i) {
      uint16_t bits = 0;
      float want = 0.0f;
      ConvertFromFloat(&(*master)[at + i], 1, &bits, DType::kBFloat16);
      ConvertToFloat(&bits, DType::kBFloat16, 1, &want);
      ASSERT_EQ(got[i], want) << "group " << g << " element " << i;
    }
    ASSERT_TRUE(l->Release().ok());
  }
  EXPECT_EQ((*a)->driver->stats().steps_applied, 3u);
  EXPECT_EQ((*b)->driver->stats().steps_pipelined, 3u);
}

}  // namespace
}  // namespace strata::engine

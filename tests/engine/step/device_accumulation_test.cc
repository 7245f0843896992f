// Gradient accumulation on the device (strata.accumulate_on_device, docs/engine/reduce.md
// "Gradient accumulation on the device", docs/engine/step.md "CPU-Adam on the device's sums"):
// the micro-steps' reduced shards summed in device memory and read by CPU-Adam from there, each
// sub-group copied to the host once per optimizer step (or, for the step variants that read
// accumulators during the backward, copied into host accumulators at the boundary), give the
// same bits as summing them on the host, on one and two ranks, with every step variant; the
// copies per optimizer step and the host memory they save; the groups a boundary's backward
// leaves out; the device budget's fallback; and the waits that keep a bucket from being written
// while the device still adds it and the host from reading sums still being copied.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../swap/test_util.h"
#include "strata/engine/runtime/engine_core.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

constexpr int kGas = 3;

struct TrainedRank {
  Params params;
  std::vector<double> losses;
  EngineStats stats;
  // Per micro-step: the reduced shards copied device->host during it (the stats' delta).
  std::vector<uint64_t> copies;
  Status status;
};

// `steps` micro-steps (Step() after each) on rank `rank` of `comm`, the layer sequence of
// micro-step m being seq(m).
TrainedRank TrainRank(const Config& c, std::shared_ptr<comm::Communicator> comm,
                      const EngineOptions& o, int steps,
                      const std::function<std::vector<int>(int)>& seq) {
  TrainedRank r;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, std::move(comm), Groups(InitialParams()), o);
  if (!e.ok()) {
    r.status = e.status();
    return r;
  }
  uint64_t copies = 0;
  for (int m = 0; m < steps; ++m) {
    Result<double> loss = EngineMicroStep(**e, seq(m), MakeBatch(m));
    if (!loss.ok()) {
      r.status = loss.status();
      return r;
    }
    r.losses.push_back(*loss);
    Result<StepOutcome> out = (*e)->Step();
    if (!out.ok()) {
      r.status = out.status();
      return r;
    }
    const uint64_t now = (*e)->stats().reducer.shard_copies;
    r.copies.push_back(now - copies);
    copies = now;
  }
  r.params = EngineParams(**e);
  r.stats = (*e)->stats();
  return r;
}

// Every rank of a `world`-rank job (ranks as threads); rank 0's run first.
std::vector<TrainedRank> Train(const Config& c, int world, const EngineOptions& o, int steps,
                               const std::function<std::vector<int>(int)>& seq = Seq) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<TrainedRank> runs(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      runs[static_cast<size_t>(r)] =
          TrainRank(c, std::make_shared<ThreadCommunicator>(group, r), o, steps, seq);
    });
  }
  for (std::thread& t : threads)
    t.join();
  return runs;
}

bool SameBits(const Params& a, const Params& b) {
  if (a.size() != b.size()) return false;
  for (size_t g = 0; g < a.size(); ++g) {
    if (a[g].size() != b[g].size()) return false;
    for (size_t i = 0; i < a[g].size(); ++i) {
      if (!BitEqual(a[g][i], b[g][i])) return false;
    }
  }
  return true;
}

bool SameBits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

Config Offloaded() {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.gradient_accumulation_steps = kGas;
  return c;
}

struct Variant {
  const char* name;
  int world;
  std::function<void(Config&, EngineOptions&)> set;
};

class DeviceAccumulationTest : public ::testing::TestWithParam<Variant> {};

// The same training with the accumulators on the device and on the host: the same bits,
// and one copy to the host per sub-group (CPU-Adam on the device's sums) or group (host
// accumulators) and optimizer step instead of one per group and micro-step.
TEST_P(DeviceAccumulationTest, BitIdenticalToHostAccumulation) {
  const Variant& v = GetParam();
  swap::testing::ScratchDir dir;
  Config c = Offloaded();
  EngineOptions o = TestOptions();
  v.set(c, o);
  if (c.zero.offload_optimizer.device == OffloadDevice::kNvme) {
    c.zero.offload_optimizer.nvme_path = {dir.path()};
  }
  constexpr int kSteps = 3 * kGas;
  Config on_host = c;
  on_host.strata.accumulate_on_device = false;
  const std::vector<TrainedRank> host = Train(on_host, v.world, o, kSteps);
  const std::vector<TrainedRank> device = Train(c, v.world, o, kSteps);
  for (int r = 0; r < v.world; ++r) {
    const TrainedRank& h = host[static_cast<size_t>(r)];
    const TrainedRank& d = device[static_cast<size_t>(r)];
    ASSERT_TRUE(h.status.ok()) << h.status;
    ASSERT_TRUE(d.status.ok()) << d.status;
    EXPECT_TRUE(SameBits(h.losses, d.losses)) << "rank " << r;
    EXPECT_TRUE(SameBits(h.params, d.params)) << "rank " << r;
    EXPECT_EQ(h.stats.optimizer.steps_applied + h.stats.optimizer.steps_skipped, 3u);
    EXPECT_EQ(d.stats.optimizer.steps_applied, h.stats.optimizer.steps_applied);
    EXPECT_EQ(h.stats.gradient_accumulation, "host (strata.accumulate_on_device false)");
    EXPECT_EQ(d.stats.gradient_accumulation, "device") << d.stats.gradient_accumulation;
    EXPECT_EQ(h.stats.reducer.shards_added_on_device, 0u);
    EXPECT_EQ(h.stats.reducer.device_accumulator_bytes, 0u);
    EXPECT_GT(d.stats.reducer.device_accumulator_bytes, 0u);
    const uint64_t acc_bytes = h.stats.optimizer.master_bytes;  // 4 B per element
    if (d.stats.grad_accumulators.rfind("device", 0) == 0) {
      // CPU-Adam on the device's sums: nothing reaches the host through the reducer; each
      // applied step copies every sub-group once, the norm summed on the device first; the
      // optimizer's store holds no accumulators (4 B per element less), the host only the
      // buffers of the sub-groups leased at once.
      EXPECT_EQ(d.stats.reducer.shard_copies, 0u);
      EXPECT_EQ(d.stats.reducer.accumulated_copies, 0u);
      const uint64_t subs = d.stats.optimizer.sub_groups;
      EXPECT_EQ(d.stats.device_sums.fetches, d.stats.optimizer.steps_applied * subs);
      EXPECT_EQ(d.stats.device_sums.fetch_bytes, d.stats.optimizer.steps_applied * acc_bytes);
      EXPECT_EQ(d.stats.device_sums.norm_passes, 3 * subs);
      EXPECT_EQ(d.stats.device_sums.write_backs, 0u);
      EXPECT_GE(d.stats.device_sums.device_bytes, acc_bytes);
      // (NVMe: the swap files hold no accumulators; the store's buffers stay.)
      EXPECT_EQ(h.stats.store.state_bytes - d.stats.store.state_bytes, acc_bytes);
      if (c.zero.offload_optimizer.device != OffloadDevice::kNvme) {
        EXPECT_EQ(h.stats.store.memory_bytes - d.stats.store.memory_bytes, acc_bytes);
      }
      EXPECT_EQ(d.stats.optimizer.grad_accumulator_bytes, acc_bytes);  // the state, on the device
      EXPECT_LE(d.stats.device_sums.buffers, subs);
      if (subs > 3) {
        // The synchronous step holds one sub-group and reads the next ahead; the pipelined
        // update's worker one, the next, and one a group spans into.
        EXPECT_LE(d.stats.device_sums.buffers, c.strata.pipeline_step ? 3u : 2u);
        EXPECT_LT(d.stats.device_sums.buffer_bytes, acc_bytes);
      }
      // (Counted when the host had to block.)
      EXPECT_LE(d.stats.device_ops.host_waits[static_cast<size_t>(HostWait::kGradientFetch)],
                d.stats.device_sums.fetches + d.stats.device_sums.norm_passes);
      for (int m = 0; m < kSteps; ++m)
        EXPECT_EQ(d.copies[static_cast<size_t>(m)], 0u) << "micro-step " << m;
      const std::string summary = d.stats.ToString();
      EXPECT_NE(summary.find("device gradient sums: "), std::string::npos) << summary;
      continue;
    }
    // Host accumulators (a step variant that reads them during the backward).
    EXPECT_EQ(d.stats.device_sums.fetches, 0u);
    EXPECT_EQ(d.stats.store.memory_bytes, h.stats.store.memory_bytes);
    // Every group gets gradients in every micro-step here (Seq): on the device, the
    // boundary's copies only, each a group's sum (fp32); on the host every micro-step's.
    for (int m = 0; m < kSteps; ++m) {
      const size_t i = static_cast<size_t>(m);
      if ((m + 1) % kGas == 0) {
        EXPECT_EQ(d.copies[i], h.copies[i]) << "boundary micro-step " << m;
      } else {
        EXPECT_EQ(d.copies[i], 0u) << "micro-step " << m;
        EXPECT_GT(h.copies[i], 0u) << "micro-step " << m;
      }
    }
    EXPECT_EQ(d.stats.reducer.accumulated_copies, d.stats.reducer.shard_copies);
    EXPECT_EQ(d.stats.reducer.shard_copies * kGas, h.stats.reducer.shard_copies);
    EXPECT_EQ(d.stats.reducer.shards_added_on_device, h.stats.reducer.shard_copies);
    const std::string summary = d.stats.ToString();
    EXPECT_NE(summary.find("gradient accumulation: device ("), std::string::npos) << summary;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, DeviceAccumulationTest,
    ::testing::Values(Variant{"Plain", 1, [](Config&, EngineOptions&) {}},
                      Variant{"TwoRanks", 2, [](Config&, EngineOptions&) {}},
                      Variant{"TwoRanksClipping", 2,
                              [](Config& c, EngineOptions&) { c.gradient_clipping = 0.05; }},
                      Variant{"Fp16", 2,
                              [](Config& c, EngineOptions&) {
                                c.fp16.enabled = true;
                                c.fp16.initial_scale_power = 8;
                              }},
                      Variant{"Bf16", 1, [](Config& c, EngineOptions&) { c.bf16 = true; }},
                      Variant{"NotPipelined", 1,
                              [](Config& c, EngineOptions&) { c.strata.pipeline_step = false; }},
                      Variant{"NotPipelinedSubGroups", 2,
                              [](Config& c, EngineOptions&) {
                                c.strata.pipeline_step = false;
                                c.zero.sub_group_size = 40;
                              }},
                      Variant{"PipelinedSubGroups", 1,
                              [](Config& c, EngineOptions&) { c.zero.sub_group_size = 40; }},
                      Variant{"Lamb", 1,
                              [](Config& c, EngineOptions&) {
                                c.optimizer.type = OptimizerType::kLamb;
                                c.zero.sub_group_size = 40;
                              }},
                      Variant{"HostAccumulators", 2,
                              [](Config&, EngineOptions& o) { o.test.host_accumulators = true; }},
                      Variant{"EarlyStep", 2,
                              [](Config& c, EngineOptions&) {
                                c.strata.early_step = true;
                                c.strata.skip_inf_nan_steps = false;
                              }},
                      Variant{"NormInBackwardOff", 1,
                              [](Config& c, EngineOptions&) { c.strata.norm_in_backward = false; }},
                      Variant{"OnTheBackwardsThread", 2,
                              [](Config& c, EngineOptions&) {
                                c.strata.accumulate_in_background = false;
                              }},
                      Variant{"OneBucketAllReduce", 2,
                              [](Config& c, EngineOptions&) {
                                c.zero.overlap_comm = false;
                                c.zero.reduce_scatter = false;
                              }},
                      Variant{"ParamsOffloaded", 1,
                              [](Config& c, EngineOptions&) {
                                c.zero.offload_param.device = OffloadDevice::kCpu;
                              }},
                      Variant{"Nvme", 2,
                              [](Config& c, EngineOptions&) {
                                c.zero.offload_optimizer.device = OffloadDevice::kNvme;
                                c.zero.offload_optimizer.buffer_count = 8;
                                c.aio.block_size = 4096;
                              }},
                      Variant{"NvmeNotPipelined", 1,
                              [](Config& c, EngineOptions&) {
                                c.zero.offload_optimizer.device = OffloadDevice::kNvme;
                                c.zero.offload_optimizer.buffer_count = 8;
                                c.aio.block_size = 4096;
                                c.strata.pipeline_step = false;
                                c.zero.sub_group_size = 1024;
                              }},
                      Variant{"DelayingDevice", 2,
                              [](Config&, EngineOptions& o) {
                                o.cpu_device.delaying = true;
                                o.cpu_device.seed = 41;
                              }}),
    [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.name); });

// A boundary's backward that leaves groups out (a layer unused in the last micro-step):
// their sums still reach the host, at the end of that backward, and the step is the same.
TEST(DeviceAccumulationEdgeTest, GroupsTheBoundaryLeavesOutStillReachTheHost) {
  // Micro-steps 0 and 1 use every layer; the boundary (2) only layer 1, and the next step's
  // boundary layers 3 and 1, with layer 3 twice (its group reduced twice in one backward).
  auto seq = [](int m) -> std::vector<int> {
    if (m % kGas != kGas - 1) return {1, 2, 3};
    return m < kGas ? std::vector<int>{1} : std::vector<int>{3, 1, 3};
  };
  Config c = Offloaded();
  c.zero.reduce_bucket_size = 32;  // a group per bucket
  EngineOptions host_acc = TestOptions();
  host_acc.test.host_accumulators = true;  // the boundary's copies (CPU-Adam's sums: none)
  for (const int world : {1, 2}) {
    Config on_host = c;
    on_host.strata.accumulate_on_device = false;
    const std::vector<TrainedRank> host = Train(on_host, world, TestOptions(), 2 * kGas, seq);
    const std::vector<TrainedRank> device = Train(c, world, host_acc, 2 * kGas, seq);
    const std::vector<TrainedRank> sums = Train(c, world, TestOptions(), 2 * kGas, seq);
    for (int r = 0; r < world; ++r) {
      const TrainedRank& h = host[static_cast<size_t>(r)];
      const TrainedRank& d = device[static_cast<size_t>(r)];
      ASSERT_TRUE(h.status.ok()) << h.status;
      ASSERT_TRUE(d.status.ok()) << d.status;
      EXPECT_TRUE(SameBits(h.losses, d.losses)) << "world " << world;
      EXPECT_TRUE(SameBits(h.params, d.params)) << "world " << world;
      // The first boundary: layer 1 and the root reduced; layers 2 and 3 copied at its end.
      // The second: layer 3's second reduction copied as it is (its sum went with the
      // first), layer 2 copied at the end.
      EXPECT_EQ(d.copies[kGas - 1], h.copies[kGas - 1] + 2) << "world " << world;
      EXPECT_EQ(d.copies[2 * kGas - 1], h.copies[2 * kGas - 1] + 1) << "world " << world;
      EXPECT_EQ(d.stats.reducer.shard_copies - d.stats.reducer.accumulated_copies, 1u);
      // CPU-Adam on the device's sums: the same bits, nothing through the reducer.
      const TrainedRank& s = sums[static_cast<size_t>(r)];
      ASSERT_TRUE(s.status.ok()) << s.status;
      EXPECT_TRUE(SameBits(h.params, s.params)) << "world " << world;
      EXPECT_EQ(s.stats.reducer.shard_copies, 0u);
      EXPECT_EQ(s.stats.device_sums.fetches, 2 * s.stats.optimizer.sub_groups);
    }
  }
}

// The device budget decides: room for the accumulators beside the rest, on the device;
// not, on the host (the statistics say why); one micro-step per step, on the host.
TEST(DeviceAccumulationEdgeTest, TheDeviceBudgetDecidesAndTheStatisticsSay) {
  Config c = Offloaded();
  c.strata.device_budget = 1;
  // The model's need without the accumulators, from the refusal's numbers.
  Result<std::unique_ptr<EngineCore>> refused =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(refused.ok());
  const std::string msg = refused.status().message();
  const size_t at = msg.find("is below the ");
  ASSERT_NE(at, std::string::npos) << msg;
  const uint64_t need = std::stoull(msg.substr(at + std::strlen("is below the ")));
  ASSERT_GT(need, 0u);
  auto accumulation = [&](uint64_t budget, int64_t gas) {
    Config b = c;
    b.strata.device_budget = budget;
    b.gradient_accumulation_steps = gas;
    std::unique_ptr<EngineCore> e = MakeEngine(b, SingleRank(), InitialParams());
    EXPECT_NE(e, nullptr);
    if (e == nullptr) return std::string();
    // It trains either way.
    for (int m = 0; m < static_cast<int>(gas); ++m) {
      EXPECT_TRUE(EngineMicroStep(*e, Seq(m), MakeBatch(m)).ok());
      EXPECT_TRUE(e->Step().ok());
    }
    EXPECT_EQ(e->stats().optimizer.steps_applied, 1u);
    return e->stats().gradient_accumulation;
  };
  const std::string tight = accumulation(need, kGas);
  EXPECT_EQ(tight.rfind("host (the device budget of ", 0), 0u) << tight;
  EXPECT_NE(tight.find("device gradient accumulators"), std::string::npos) << tight;
  EXPECT_EQ(accumulation(need + (1u << 20), kGas), "device");
  EXPECT_EQ(accumulation(need + (1u << 20), 1),
            "host (one micro-step per optimizer step: nothing to sum)");
}

// A mutation on the delaying device (seed `seed`): `c` trained as it is gives host
// accumulation's bits, and with `mutate` (a wait left out) it must not; returns the run
// without the mutation.
TrainedRank ExpectTheWaitKeepsTheBits(const Config& c, uint64_t seed,
                                      const std::function<void(EngineOptions&)>& mutate) {
  Config on_host = c;
  on_host.strata.accumulate_on_device = false;
  EngineOptions o = TestOptions();
  o.cpu_device.delaying = true;
  o.cpu_device.seed = seed;
  const std::vector<TrainedRank> host = Train(on_host, 1, o, 2 * kGas);
  const std::vector<TrainedRank> waited = Train(c, 1, o, 2 * kGas);
  mutate(o);
  const std::vector<TrainedRank> unwaited = Train(c, 1, o, 2 * kGas);
  EXPECT_TRUE(host[0].status.ok() && waited[0].status.ok() && unwaited[0].status.ok());
  EXPECT_TRUE(SameBits(host[0].params, waited[0].params));
  EXPECT_FALSE(SameBits(host[0].params, unwaited[0].params))
      << "without the wait the numbers still matched: the delaying device did not expose it";
  return waited[0];
}

// The compute stream waits for a bucket's additions into the device accumulators before the
// bucket is written again; without that wait the delaying device gives wrong numbers.
TEST(DeviceAccumulationEdgeTest, AsyncDeviceWithoutTheAccumulatorWaitGoesWrong) {
  if (RelocatingStoreMode()) {
    GTEST_SKIP() << "a mutation test calibrated on the plain store";
  }
  Config c = Offloaded();
  // One bucket, all-reduced in place: the next group's slot is zeroed by the compute
  // stream right where the device adds the last reduction from.
  c.zero.overlap_comm = false;
  c.zero.reduce_scatter = false;
  ExpectTheWaitKeepsTheBits(c, 5,
                            [](EngineOptions& o) { o.test.reducer.skip_accumulator_wait = true; });
}

// CPU-Adam reads the device's sums only after their copy to the host completed; without that
// wait (the delaying device completes copies late) it reads the buffer's old contents.
TEST(DeviceAccumulationEdgeTest, AsyncDeviceWithoutTheFetchWaitGoesWrong) {
  if (RelocatingStoreMode()) {
    GTEST_SKIP() << "a mutation test calibrated on the plain store";
  }
  Config c = Offloaded();
  c.strata.pipeline_step = false;
  c.zero.sub_group_size = 40;  // several sub-groups: buffers reused within a step
  const TrainedRank waited =
      ExpectTheWaitKeepsTheBits(c, 7, [](EngineOptions& o) { o.test.skip_sums_fetch_wait = true; });
  EXPECT_GT(waited.stats.device_sums.fetches, 0u);
}

}  // namespace
}  // namespace strata::engine

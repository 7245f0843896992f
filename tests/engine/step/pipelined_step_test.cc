// The pipelined CPU step (strata.pipeline_step): Step() returns while the
// optimizer's update runs on, group by group in the order the next forward uses them, and
// the next forward waits only for each group's own update. Checked on order, not on time:
// with the update held on a latch after group G, the next forward gathers G and runs G's
// compute before the latch opens (the control, the step inside Step(), cannot); and
// training is bit-identical with the pipeline on and off, overlap_comm on and off, on 1 and
// 2 ranks, with clipping, gradient accumulation and fp16 loss scaling (an overflow step
// included).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../swap/test_util.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

Result<double> WatchedMicroStep(EngineCore& e, int step,
                                const std::function<void(int, Phase)>& gathered) {
  return EngineMicroStep(e, Seq(step), MakeBatch(step), {}, gathered);
}

// The update of step 1 is held after group kHeld (layer2: the second group the forward
// uses) until the next forward has gathered kHeld and is about to run its compute, or
// until a timeout. Returns whether the latch opened because that happened.
struct LatchRun {
  bool computed_before_open = false;
  bool held = false;
  int opened_by_timeout = 0;
  uint64_t deferred = 0;  // prefetches deferred (the coordinator's count)
};

// `nvme`: the states and working shards on NVMe (the update writes the new parameters into
// staging buffers, handed over to the shards' store as the forward opens each group).
LatchRun RunWithLatch(bool pipeline, std::chrono::seconds timeout, bool nvme = false) {
  constexpr int kHeld = 2;
  Config c = BaseConfig();
  c.strata.pipeline_step = pipeline;
  swap::testing::ScratchDir dir;
  if (nvme) {
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_optimizer.nvme_path = {dir.path()};
    c.zero.offload_optimizer.buffer_count = 8;
    c.aio.block_size = 4096;
    c.zero.offload_param.device = OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = {dir.path()};
    c.zero.offload_param.buffer_count = 3;
    c.zero.offload_param.max_in_cpu = 0;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool computed = false, open = false;
  std::atomic<bool> armed{false};
  LatchRun run;
  EngineOptions o = TestOptions();
  o.test.driver.on_group_updated = [&](int g) {
    if (g != kHeld || !armed.exchange(false)) return;
    std::unique_lock<std::mutex> lock(mu);
    run.held = true;
    cv.wait(lock, [&] { return open; });
  };
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  EXPECT_NE(e, nullptr);
  if (e == nullptr) return run;
  std::thread opener([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return computed; })) ++run.opened_by_timeout;
    run.computed_before_open = computed;
    open = true;
    cv.notify_all();
  });
  for (int step = 0; step < 3; ++step) {
    auto gathered = [&](int g, Phase phase) {
      if (step != 2 || g != kHeld || phase != Phase::kForward) return;
      std::lock_guard<std::mutex> lock(mu);
      computed = true;
      cv.notify_all();
    };
    Result<double> loss = WatchedMicroStep(*e, step, gathered);
    EXPECT_TRUE(loss.ok()) << loss.status();
    if (step == 1) armed = true;  // the update Step() starts now
    Result<StepOutcome> out = e->Step();
    EXPECT_TRUE(out.ok()) << out.status();
    if (!loss.ok() || !out.ok()) break;
  }
  opener.join();
  EXPECT_EQ(e->stats().optimizer.steps_pipelined, pipeline ? 3u : 0u);
  if (nvme && pipeline) {
    EXPECT_GT(e->stats().optimizer.shard_handovers, 0u);
  }
  run.deferred = e->stats().coordinator.prefetches_deferred;
  return run;
}

// The pipelined step's latch run: layer2 gathered and computed while the update was held,
// and layer3's prefetch (issued when layer1 was gathered) deferred behind its update.
void ExpectComputedWhileHeld(const LatchRun& run) {
  EXPECT_TRUE(run.held);
  EXPECT_TRUE(run.computed_before_open)
      << "the forward after a pipelined step did not gather and compute layer2 while the "
         "update of the groups after it was held";
  EXPECT_EQ(run.opened_by_timeout, 0);
  EXPECT_GT(run.deferred, 0u);
}

TEST(PipelinedStepTest, TheNextForwardComputesAGroupWhileTheStepOfTheNextIsHeld) {
  ExpectComputedWhileHeld(RunWithLatch(/*pipeline=*/true, std::chrono::seconds(30)));
}

TEST(PipelinedStepTest, WithNvmeParametersTheNextForwardComputesAGroupWhileTheStepIsHeld) {
  // The parameters on NVMe: the held group's new shard went through a staging buffer into
  // the shards' store before the forward read it back from there.
  ExpectComputedWhileHeld(RunWithLatch(/*pipeline=*/true, std::chrono::seconds(30), /*nvme=*/true));
}

TEST(PipelinedStepTest, ControlTheStepInsideStepHoldsTheWholeForward) {
  // The same latch with the step inside Step(): Step() itself is held, so nothing of the
  // next forward runs before the latch opens (by its timeout): the test above can fail.
  const LatchRun run = RunWithLatch(/*pipeline=*/false, std::chrono::seconds(1));
  EXPECT_TRUE(run.held);
  EXPECT_FALSE(run.computed_before_open);
  EXPECT_EQ(run.opened_by_timeout, 1);
  EXPECT_EQ(run.deferred, 0u);
}

// ---- Bit-identical ---------------------------------------------------------------------

struct Variant {
  const char* name;
  int world;
  bool fp16;
};

struct Trained {
  std::vector<double> losses;
  std::vector<float> params;  // every group's fp32 master, gathered
  std::vector<double> loss_scales;
  uint64_t pipelined = 0;
  uint64_t skipped = 0;
};

// Trains 6 optimizer steps of 2 micro-steps each on `world` thread ranks; with fp16 a
// gradient of step 3 is made inf on rank 0 (the step is skipped on every rank).
std::vector<Trained> Train(const Variant& v, bool pipeline, bool overlap) {
  Config c = BaseConfig();
  c.strata.pipeline_step = pipeline;
  c.zero.overlap_comm = overlap;
  c.zero.reduce_bucket_size = overlap ? kD * kD + kD : 500000000;
  c.zero.stage3_prefetch_bucket_size = kD * kD + kD;  // one layer ahead
  c.gradient_clipping = 0.05;
  c.gradient_accumulation_steps = 2;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  if (v.fp16) {
    c.fp16.enabled = true;
    c.fp16.initial_scale_power = 8;
    c.fp16.hysteresis = 1;
  }
  auto group = std::make_shared<ThreadGroup>(v.world);
  std::vector<Trained> out(static_cast<size_t>(v.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < v.world; ++r) {
    threads.emplace_back([&, r] {
      Trained& t = out[static_cast<size_t>(r)];
      EngineOptions o = TestOptions();
      // A slower update, so the forward catches up with it and its prefetches are
      // deferred (likely, not checked: the latch test above checks the order).
      o.test.driver.on_group_updated = [](int) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      };
      std::unique_ptr<EngineCore> e =
          MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), InitialParams(), o);
      ASSERT_NE(e, nullptr);
      int micro = 0;
      for (int step = 0; step < 6; ++step) {
        for (int m = 0; m < 2; ++m, ++micro) {
          auto tamper = [&](int g, int i, std::vector<float>& grad) {
            if (v.fp16 && step == 3 && m == 1 && r == 0 && g == 2 && i == 0)
              grad[1] = std::numeric_limits<float>::infinity();
          };
          Result<double> loss = EngineMicroStep(*e, Seq(micro), MakeBatch(micro), tamper);
          ASSERT_TRUE(loss.ok()) << loss.status();
          t.losses.push_back(*loss);
          Result<StepOutcome> s = e->Step();
          ASSERT_TRUE(s.ok()) << s.status();
        }
        t.loss_scales.push_back(e->loss_scale());
      }
      for (int g = 0; g < e->num_groups(); ++g) {
        std::vector<float> flat(e->layout(g).numel);
        ASSERT_TRUE(e->GatherMasterParams(g, flat).ok());
        t.params.insert(t.params.end(), flat.begin(), flat.end());
      }
      const EngineStats s = e->stats();
      t.pipelined = s.optimizer.steps_pipelined;
      t.skipped = s.optimizer.steps_skipped;
    });
  }
  for (auto& t : threads)
    t.join();
  return out;
}

class PipelinedBitIdenticalTest : public ::testing::TestWithParam<Variant> {};

TEST_P(PipelinedBitIdenticalTest, WithThePipelineAndOverlapOnAndOff) {
  const Variant& v = GetParam();
  const std::vector<Trained> base = Train(v, /*pipeline=*/false, /*overlap=*/false);
  ASSERT_EQ(base.size(), static_cast<size_t>(v.world));
  ASSERT_EQ(base[0].losses.size(), 12u);
  EXPECT_EQ(base[0].pipelined, 0u);
  if (v.fp16) {
    EXPECT_EQ(base[0].skipped, 1u) << "the inf gradient did not skip a step";
  }
  for (bool pipeline : {false, true}) {
    for (bool overlap : {false, true}) {
      if (!pipeline && !overlap) continue;
      const std::vector<Trained> run = Train(v, pipeline, overlap);
      ASSERT_EQ(run.size(), base.size());
      for (size_t r = 0; r < run.size(); ++r) {
        const std::string what = std::string("pipeline ") + (pipeline ? "on" : "off") +
                                 ", overlap_comm " + (overlap ? "on" : "off") + ", rank " +
                                 std::to_string(r);
        EXPECT_EQ(run[r].losses, base[r].losses) << what;
        EXPECT_EQ(run[r].loss_scales, base[r].loss_scales) << what;
        EXPECT_TRUE(BitEqual(run[r].params, base[r].params)) << what;
        EXPECT_EQ(run[r].skipped, base[r].skipped) << what;
        // Every applied step was pipelined (a skipped one has no update to run).
        EXPECT_EQ(run[r].pipelined, pipeline ? 6u - base[r].skipped : 0u) << what;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, PipelinedBitIdenticalTest,
                         ::testing::Values(Variant{"fp32_1rank", 1, false},
                                           Variant{"fp32_2ranks", 2, false},
                                           Variant{"fp16_1rank", 1, true},
                                           Variant{"fp16_2ranks", 2, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

TEST(PipelinedStepTest, LambStepsInsideStepNvmeStatesAndParametersArePipelined) {
  // LAMB has an all-reduce between its passes: it is not pipelined. Optimizer states on
  // NVMe are (the update streams them on its worker), and so are working shards on NVMe
  // (staged); nvme_offload_test.cc checks their bits and faults.
  swap::testing::ScratchDir dir;
  for (int k = 0; k < 3; ++k) {
    Config c = BaseConfig();
    if (k == 0) {
      c.optimizer.type = OptimizerType::kLamb;
    } else {
      c.zero.offload_optimizer.device = OffloadDevice::kNvme;
      c.zero.offload_optimizer.nvme_path = {dir.path()};
      c.zero.offload_optimizer.buffer_count = 8;
      c.aio.block_size = 4096;
    }
    if (k == 2) {
      c.zero.offload_param.device = OffloadDevice::kNvme;
      c.zero.offload_param.nvme_path = {dir.path()};
      c.zero.offload_param.buffer_count = 3;
      c.zero.offload_param.max_in_cpu = 0;
    }
    const char* what = k == 0 ? "LAMB" : k == 1 ? "NVMe states" : "NVMe parameters";
    const bool pipelined = k != 0;
    std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
    ASSERT_NE(e, nullptr) << what;
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step)).ok()) << what;
      ASSERT_TRUE(e->Step().ok()) << what;
      EXPECT_EQ(e->step_in_flight(), pipelined) << what;
    }
    EXPECT_EQ(e->stats().optimizer.steps_pipelined, pipelined ? 2u : 0u) << what;
    EXPECT_EQ(e->stats().optimizer.steps_applied, 2u) << what;
  }
}

TEST(PipelinedStepTest, CheckpointsAndStateReadsCompleteTheStepFirst) {
  Config c = BaseConfig();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  ASSERT_TRUE(e->Step().ok());
  EXPECT_TRUE(e->step_in_flight());
  // The non-const accessor completes the update: the step count is the step's.
  EXPECT_EQ(e->optimizer().adam_step(), 1);
  EXPECT_FALSE(e->step_in_flight());
  const std::vector<float> master = *e->optimizer().CopyState(OptimizerState::kMaster);
  // The working shards the next forward gathers are the master's (fp32: exact).
  ASSERT_TRUE(EngineMicroStep(*e, Seq(1), MakeBatch(1)).ok());
  ASSERT_TRUE(e->Step().ok());
  EXPECT_TRUE(e->step_in_flight());
  EXPECT_EQ(e->optimizer().adam_step(), 2);
  EXPECT_NE(*e->optimizer().CopyState(OptimizerState::kMaster), master);
}

}  // namespace
}  // namespace strata::engine

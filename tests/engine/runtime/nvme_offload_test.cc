// offload_optimizer.device = nvme and offload_param.device = nvme:
// the optimizer states and the working shards in swap slots behind the state store. The toy model
// of toy_model.h trained with its states on NVMe gives the same bits as with them in host memory
// (fp32, bf16, fp16; one and two ranks); states four times the host budget train within it; every
// injected I/O fault surfaces as an error on every rank and leaves the last good step's state; the
// swap files go with the engine.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../../swap/test_util.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/swap/fault_injection.h"
#include "toy_model.h"
#include "update_fault.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using swap::testing::ListDir;
using swap::testing::ScratchDir;

Config NvmeConfig(const Config& base, const std::string& dir, int buffers, bool pipelined) {
  Config c = base;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {dir};
  c.zero.offload_optimizer.buffer_count = buffers;
  c.zero.offload_optimizer.pipeline_read = pipelined;
  c.zero.offload_optimizer.pipeline_write = pipelined;
  c.aio.block_size = 4096;
  return c;
}

struct TrainRun {
  std::vector<double> losses;
  Params params;
  EngineStats stats;
  Status status;          // the first error
  Status gather_status;   // gathering the parameters after training (params empty if not ok)
  int steps_done = 0;     // steps that returned Ok
  uint64_t injected = 0;  // faults the rank's I/O engine injected
};

// `world` thread ranks train `steps` steps; with `faults`, rank r's swap spaces get
// fault-injecting I/O engines, the first one made ((*faults)[r], valid while the rank's
// engine lives; the working shards' with offload_param = nvme) being the one
// `arm` may give rules to. A failed step ends the rank's loop; the parameters are then
// gathered (every rank fails at the same step, so the collectives still match).
std::vector<TrainRun> Train(const Config& c, int world, int steps,
                            std::vector<swap::FaultInjectingIoEngine*>* faults = nullptr,
                            std::function<void(int rank, swap::FaultInjectingIoEngine&)> arm = {},
                            std::function<void(int rank, swap::IoEngineOptions&)> io_options = {}) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<TrainRun> runs(static_cast<size_t>(world));
  if (faults != nullptr) faults->assign(static_cast<size_t>(world), nullptr);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      TrainRun& run = runs[static_cast<size_t>(r)];
      EngineOptions o = TestOptions();
      if (faults != nullptr) {
        swap::FaultInjectingIoEngine** slot = &(*faults)[static_cast<size_t>(r)];
        o.test.nvme_io_engine_factory =
            [slot, io_options,
             r](const swap::IoEngineOptions& io) -> Result<std::unique_ptr<swap::IoEngine>> {
          swap::IoEngineOptions changed = io;
          if (io_options) io_options(r, changed);
          STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::FaultInjectingIoEngine> e,
                                  swap::FaultInjectingIoEngine::Create(changed, 5));
          if (*slot == nullptr) *slot = e.get();  // the first swap space made
          return std::unique_ptr<swap::IoEngine>(std::move(e));
        };
      }
      const Params init = InitialParams();
      Result<std::unique_ptr<EngineCore>> e =
          EngineCore::Create(c, std::make_shared<ThreadCommunicator>(group, r), Groups(init), o);
      if (!e.ok()) {
        run.status = e.status();
        return;
      }
      if (arm && faults != nullptr) arm(r, *(*faults)[static_cast<size_t>(r)]);
      for (int step = 0; step < steps; ++step) {
        Result<double> loss = EngineMicroStep(**e, Seq(step), MakeBatch(step));
        Result<StepOutcome> out = loss.ok() ? (*e)->Step() : loss.status();
        if (!out.ok()) {
          run.status = out.status();
          break;
        }
        run.losses.push_back(*loss);
        ++run.steps_done;
      }
      if (faults != nullptr) {
        run.injected = (*faults)[static_cast<size_t>(r)]->injected();
        (*faults)[static_cast<size_t>(r)]->ClearRules();
      }
      Result<Params> params = TryEngineParams(**e);
      if (params.ok()) {
        run.params = *std::move(params);
      } else {
        run.gather_status = params.status();  // (a swap engine that refuses all I/O)
      }
      run.stats = (*e)->stats();
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

bool SameBits(const Params& a, const Params& b) {
  if (a.size() != b.size()) return false;
  for (size_t g = 0; g < a.size(); ++g)
    for (size_t i = 0; i < a[g].size(); ++i)
      if (a[g][i].size() != b[g][i].size() ||
          std::memcmp(a[g][i].data(), b[g][i].data(), a[g][i].size() * sizeof(float)) != 0) {
        return false;
      }
  return true;
}

// Both runs ended well with the same losses, parameter bits and applied steps.
::testing::AssertionResult SameTraining(const TrainRun& host, const TrainRun& nvme) {
  if (!host.status.ok()) return ::testing::AssertionFailure() << "reference: " << host.status;
  if (!nvme.status.ok()) return ::testing::AssertionFailure() << nvme.status;
  if (host.losses != nvme.losses) {
    size_t s = 0;
    while (s < host.losses.size() && s < nvme.losses.size() && host.losses[s] == nvme.losses[s])
      ++s;
    return ::testing::AssertionFailure() << "the losses differ from step " << s;
  }
  if (!SameBits(host.params, nvme.params)) {
    return ::testing::AssertionFailure()
           << "the parameters differ: relative difference " << RelDiff(nvme.params, host.params);
  }
  if (host.stats.optimizer.steps_applied != nvme.stats.optimizer.steps_applied) {
    return ::testing::AssertionFailure() << "applied steps " << nvme.stats.optimizer.steps_applied
                                         << ", reference " << host.stats.optimizer.steps_applied;
  }
  return ::testing::AssertionSuccess();
}

enum class Precision { kFp32, kBf16, kFp16 };

// "2RanksBf16": a test name's start from a (ranks, precision, ...) parameter.
template <typename Tuple>
std::string RanksAndPrecision(const Tuple& param) {
  const Precision p = std::get<1>(param);
  return std::to_string(std::get<0>(param)) + "Ranks" +
         (p == Precision::kFp32   ? "Fp32"
          : p == Precision::kBf16 ? "Bf16"
                                  : "Fp16");
}

class NvmeBitIdentityTest : public ::testing::TestWithParam<std::tuple<int, Precision, bool>> {};

TEST_P(NvmeBitIdentityTest, SameLossesAndParametersAsTheHostTier) {
  const auto [world, precision, pipelined] = GetParam();
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config host = BaseConfig();
  host.zero.offload_optimizer.device = OffloadDevice::kCpu;
  host.gradient_clipping = 0.5;
  host.zero.sub_group_size = 16;
  host.bf16 = precision == Precision::kBf16;
  host.fp16.enabled = precision == Precision::kFp16;
  Config nvme = NvmeConfig(host, dir.path(), pipelined ? 12 : 4, pipelined);
  // Pipelined: also the optimizer step's (its update streams the states on a worker);
  // serial: the step inside Step().
  nvme.strata.pipeline_step = pipelined;
  const int steps = 5;
  const std::vector<TrainRun> a = Train(host, world, steps);
  const std::vector<TrainRun> b = Train(nvme, world, steps);
  for (int r = 0; r < world; ++r) {
    const TrainRun& n = b[static_cast<size_t>(r)];
    ASSERT_TRUE(SameTraining(a[static_cast<size_t>(r)], n)) << "rank " << r;
    EXPECT_EQ(n.stats.optimizer_tier, TierKind::kNvme);
    EXPECT_EQ(n.stats.store_name, StoreName("nvme"));
    EXPECT_EQ(n.stats.store.chunks, 4 * n.stats.optimizer.sub_groups);
    EXPECT_GT(n.stats.optimizer.sub_groups, 1u);
    EXPECT_GT(n.stats.store.writes, 0u);
    // Chunks of 64 bytes move as whole 4 KiB blocks: nothing goes through a bounce buffer.
    EXPECT_EQ(n.stats.store.bounced_bytes, 0u);
    EXPECT_EQ(n.stats.optimizer.steps_pipelined, pipelined ? n.stats.optimizer.steps_applied : 0u);
    if (precision != Precision::kFp16) {
      EXPECT_GT(n.stats.optimizer.steps_applied, 0u);
    }
    if (!pipelined) {
      // Four buffers for twelve chunks: chunks were read back, and never prefetched.
      EXPECT_GT(n.stats.store.reads, 0u);
      EXPECT_EQ(n.stats.store.prefetches, 0u);
    }
  }
  // The swap files are gone with the engines: only the (empty) scratch directory is left.
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

INSTANTIATE_TEST_SUITE_P(
    RanksPrecisionsPipelines, NvmeBitIdentityTest,
    ::testing::Combine(::testing::Values(1, 2),
                       ::testing::Values(Precision::kFp32, Precision::kBf16, Precision::kFp16),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<NvmeBitIdentityTest::ParamType>& param_info) {
      return RanksAndPrecision(param_info.param) +
             (std::get<2>(param_info.param) ? "Pipelined" : "Serial");
    });

// Gradient accumulation (accumulator chunks written out and read back between
// micro-steps, their cached norms forgotten when they change) and LAMB (two passes over
// the states per step) on NVMe, reading two sub-groups ahead: the host tier's bits.
TEST(NvmeOffloadTest, GradientAccumulationAndLambMatchTheHostTier) {
  for (const bool lamb : {false, true}) {
    ScratchDir dir;
    ASSERT_TRUE(dir.ok());
    Config host = BaseConfig();
    host.zero.offload_optimizer.device = OffloadDevice::kCpu;
    host.zero.sub_group_size = 16;
    host.gradient_accumulation_steps = 3;
    host.gradient_clipping = 0.3;
    if (lamb) host.optimizer.type = OptimizerType::kLamb;
    Config nvme = NvmeConfig(host, dir.path(), 12, true);
    nvme.strata.swap_pipeline_depth = 3;  // two sub-groups read ahead
    const std::vector<TrainRun> a = Train(host, 2, 9);
    const std::vector<TrainRun> b = Train(nvme, 2, 9);
    for (int r = 0; r < 2; ++r) {
      const TrainRun& n = b[static_cast<size_t>(r)];
      ASSERT_TRUE(SameTraining(a[static_cast<size_t>(r)], n))
          << (lamb ? "LAMB" : "Adam") << " rank " << r;
      EXPECT_EQ(n.stats.optimizer.steps_applied, 3u);
      EXPECT_GT(n.stats.store.reads, 0u);
    }
  }
}

// ZeRO stages 1 and 2 with the optimizer states on NVMe, on 2 ranks with
// accumulation and clipping, stage 1 in bf16 and stage 2 in fp16: the host tier's bits;
// every group stays gathered (no fetch in a pass).
TEST(NvmeOffloadTest, StagesOneAndTwoMatchTheHostTier) {
  for (const int stage : {1, 2}) {
    ScratchDir dir;
    ASSERT_TRUE(dir.ok());
    Config host = BaseConfig();
    host.zero.stage = stage;
    host.zero.offload_optimizer.device = OffloadDevice::kCpu;
    host.zero.sub_group_size = 16;
    host.gradient_accumulation_steps = 2;
    host.gradient_clipping = 0.3;
    host.bf16 = stage == 1;
    host.fp16.enabled = stage == 2;
    const Config nvme = NvmeConfig(host, dir.path(), 12, true);
    const std::vector<TrainRun> a = Train(host, 2, 6);
    const std::vector<TrainRun> b = Train(nvme, 2, 6);
    for (int r = 0; r < 2; ++r) {
      const TrainRun& n = b[static_cast<size_t>(r)];
      ASSERT_TRUE(SameTraining(a[static_cast<size_t>(r)], n)) << "stage " << stage << " rank " << r;
      EXPECT_EQ(n.stats.optimizer_tier, TierKind::kNvme);
      EXPECT_GT(n.stats.store.writes, 0u);
      const CoordinatorStats& cs = n.stats.coordinator;
      EXPECT_EQ(cs.fetches_on_demand + cs.fetches_prefetched + cs.fetches_reused, 0u);
      EXPECT_EQ(n.stats.reducer.all_reduce_calls > 0, stage == 1);
    }
    EXPECT_TRUE(ListDir(dir.path()).empty());
  }
}

// Faults: each injected on rank 1 only; both ranks fail the same step with an error naming
// rank 1, and the parameters are those of the last good step (a host-tier run of as many
// steps). The pipelined step (on by default) streams the states on its worker: a fault in
// its update is agreed on at the next micro-step's backward, which fails on every rank (the
// step had returned Ok), so the last good step is the one before.
struct FaultCase {
  const char* name;
  swap::FaultRule rule;
  StatusCode rank1_code;
  const char* rank1_text;  // in rank 1's message, which every rank's error carries
};

class NvmeFaultTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(NvmeFaultTest, EveryRankFailsTheSameStepAndKeepsTheLastGoodState) {
  const FaultCase& fc = GetParam();
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config host = BaseConfig();
  host.zero.offload_optimizer.device = OffloadDevice::kCpu;
  host.zero.sub_group_size = 16;  // more chunks than buffers: reads and writes every step
  const Config nvme = NvmeConfig(host, dir.path(), 4, false);
  std::vector<swap::FaultInjectingIoEngine*> faults;
  const std::vector<TrainRun> runs = Train(nvme, 2, 6, &faults, [&](int rank, auto& f) {
    if (rank == 1) {
      ASSERT_TRUE(f.AddRule(fc.rule).ok());
    }
  });
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_GT(runs[1].injected, 0u) << "the fault never fired";
  EXPECT_EQ(runs[0].injected, 0u);
  const int done = runs[0].steps_done;
  EXPECT_EQ(runs[1].steps_done, done);
  EXPECT_LT(done, 6);
  // The steps that count: those completed (an update that failed is taken back).
  const int good = static_cast<int>(runs[0].stats.optimizer.steps_applied);
  EXPECT_EQ(runs[1].stats.optimizer.steps_applied, runs[0].stats.optimizer.steps_applied);
  EXPECT_TRUE(good == done || good == done - 1) << good << " steps applied, " << done << " done";
  for (int r = 0; r < 2; ++r) {
    const Status& s = runs[static_cast<size_t>(r)].status;
    ASSERT_FALSE(s.ok()) << "rank " << r << " saw no error";
    EXPECT_NE(s.message().find("on rank 1"), std::string::npos) << s;
    EXPECT_NE(s.message().find(fc.rank1_text), std::string::npos) << s;
    EXPECT_NE(s.message().find("strata-swap-"), std::string::npos) << s;  // the file
    EXPECT_NE(s.message().find("last completed step"), std::string::npos) << s;
    EXPECT_EQ(runs[static_cast<size_t>(r)].stats.optimizer.steps_failed, 1u);
  }
  EXPECT_EQ(runs[1].status.code(), fc.rank1_code) << runs[1].status;
  // The state is the last good step's: a host-tier run of `good` steps.
  const std::vector<TrainRun> ref = Train(host, 2, good);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(SameBits(runs[static_cast<size_t>(r)].params, ref[static_cast<size_t>(r)].params))
        << "rank " << r << " after " << good << " steps: relative difference "
        << RelDiff(runs[static_cast<size_t>(r)].params, ref[static_cast<size_t>(r)].params)
        << "; one step more: "
        << RelDiff(runs[static_cast<size_t>(r)].params, Train(host, 2, good + 1)[0].params);
  }
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

INSTANTIATE_TEST_SUITE_P(
    Faults, NvmeFaultTest,
    ::testing::Values(
        FaultCase{"WriteEio", swap::FaultRule::Error(EIO).OnOp(swap::IoOp::kWrite).Nth(40, 0),
                  StatusCode::kIOError, "writing state"},
        FaultCase{"WriteEnospc", swap::FaultRule::Error(ENOSPC).OnOp(swap::IoOp::kWrite).Nth(25, 0),
                  StatusCode::kResourceExhausted, "writing state"},
        FaultCase{
            "WriteShortWithoutProgress",
            swap::FaultRule::ShortTransfer(0).OnOp(swap::IoOp::kWrite).Nth(40, 0).EveryAttempt(),
            StatusCode::kIOError, "writing state"},
        FaultCase{"ReadShortWithoutProgress",
                  swap::FaultRule::ShortTransfer(0).OnOp(swap::IoOp::kRead).Nth(30).EveryAttempt(),
                  StatusCode::kIOError, "reading state"},
        FaultCase{"ReadEio", swap::FaultRule::Error(EIO).OnOp(swap::IoOp::kRead).Nth(30),
                  StatusCode::kIOError, "reading state"},
        FaultCase{"ReadFlippedBit", swap::FaultRule::CorruptRead(3).OnOp(swap::IoOp::kRead).Nth(30),
                  StatusCode::kDataLoss, "reading state"}),
    [](const ::testing::TestParamInfo<FaultCase>& param_info) {
      return std::string(param_info.param.name);
    });

// The io_uring ring itself fails on rank 1 (its io_uring_enter returns EBADF from the 150th
// call on, or a completion names no request; either must not abort the process): the step
// fails on both ranks with rank 1's error, which names the ring's failure, and nothing aborts.
TEST(NvmeRingFailureTest, AFailedRingFailsTheStepOnEveryRankAndNothingAborts) {
  if (!swap::IoUringAvailable().ok()) GTEST_SKIP() << "io_uring is not available here";
  for (const swap::IoRingCall call : {swap::IoRingCall::kEnter, swap::IoRingCall::kCompletion}) {
    const bool enter = call == swap::IoRingCall::kEnter;
    SCOPED_TRACE(enter ? "io_uring_enter fails" : "a completion for no request");
    ScratchDir dir;
    ASSERT_TRUE(dir.ok());
    Config host = BaseConfig();
    host.zero.offload_optimizer.device = OffloadDevice::kCpu;
    host.zero.sub_group_size = 16;
    const Config nvme = NvmeConfig(host, dir.path(), 4, false);
    auto calls = std::make_shared<std::atomic<int>>(0);
    std::vector<swap::FaultInjectingIoEngine*> faults;  // (no rule: a plain io_uring engine)
    const std::vector<TrainRun> runs =
        Train(nvme, 2, 6, &faults, {}, [&](int rank, swap::IoEngineOptions& io) {
          io.kind = swap::IoEngineKind::kIoUring;
          io.failed_ring_drain = std::chrono::milliseconds(500);
          if (rank != 1) return;
          io.ring_hook = [calls, call](swap::IoRingCall c, int) {
            if (c != call) return 0;
            const int n = ++*calls;
            if (c == swap::IoRingCall::kEnter) return n >= 150 ? -EBADF : 0;
            return n == 150 ? 1 : 0;
          };
        });
    ASSERT_EQ(runs.size(), 2u);
    EXPECT_GE(calls->load(), 150) << "the ring's failure was never injected";
    EXPECT_EQ(runs[0].steps_done, runs[1].steps_done);
    EXPECT_LT(runs[0].steps_done, 6);
    for (int r = 0; r < 2; ++r) {
      const Status& s = runs[static_cast<size_t>(r)].status;
      ASSERT_FALSE(s.ok()) << "rank " << r << " saw no error";
      EXPECT_NE(s.message().find("on rank 1"), std::string::npos) << s;
      EXPECT_NE(s.message().find(enter ? "io_uring_enter" : "a completion for no request"),
                std::string::npos)
          << s;
    }
    // The failed ring refuses all I/O from then on: gathering the master parameters (which
    // reads them from NVMe) fails on rank 1 and, agreed, on rank 0 too; it says why.
    EXPECT_FALSE(runs[1].gather_status.ok());
    EXPECT_FALSE(runs[0].gather_status.ok());
    EXPECT_TRUE(ListDir(dir.path()).empty());
  }
}

// The pipelined step with the states on NVMe (strata.pipeline_step, on by default): a read
// that fails on rank 1 in the middle of step 2's update (on the update's worker) does not
// fail that Step() (it returned with the update in flight) but the next micro-step's
// backward, on both ranks, with rank 1's error; the states are those after step 1 and the
// engine is ready for a forward. Training again from the last completed step (the batches
// from step 2 on) ends with the host tier's bits: nothing was half-applied or lost.
TEST(NvmeOffloadTest, AFailedPipelinedUpdateVoidsTheNextIterationAndTrainingGoesOn) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config host = BaseConfig();
  host.zero.offload_optimizer.device = OffloadDevice::kCpu;
  host.zero.sub_group_size = 16;
  host.bf16 = true;
  const Config nvme = NvmeConfig(host, dir.path(), 12, /*pipelined=*/true);
  ASSERT_TRUE(nvme.strata.pipeline_step);
  constexpr int kSteps = 6;
  constexpr int kFailing = 2;  // the step whose update fails
  auto group = std::make_shared<ThreadGroup>(2);
  std::vector<TrainRun> runs(2);
  std::vector<std::vector<std::string>> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      TrainRun& run = runs[static_cast<size_t>(r)];
      EngineOptions o = TestOptions();
      testing::UpdateReadFault fault;  // rank 1's read fails in step kFailing's update
      fault.Install(o, kFailing, /*fails=*/r == 1, /*seed=*/5);
      Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(
          nvme, std::make_shared<ThreadCommunicator>(group, r), Groups(InitialParams()), o);
      ASSERT_TRUE(e.ok()) << e.status();
      for (int step = 0; step < kSteps;) {
        Result<double> loss = EngineMicroStep(**e, Seq(step), MakeBatch(step));
        if (loss.ok()) fault.updating = step;
        Result<StepOutcome> out = loss.ok() ? (*e)->Step() : loss.status();
        if (!out.ok()) {
          errors[static_cast<size_t>(r)].push_back(out.status().ToString());
          // Again from the last completed step (every rank agreed on it).
          const auto good = static_cast<int>((*e)->stats().optimizer.steps_applied);
          if (good < step - 1 || errors[static_cast<size_t>(r)].size() > 1) break;
          if (run.losses.size() > static_cast<size_t>(good))
            run.losses.resize(static_cast<size_t>(good));
          step = good;
          continue;
        }
        run.losses.push_back(*loss);
        ++step;
      }
      EXPECT_TRUE(fault.armed || r == 0) << "the fault was never armed";
      run.injected = fault.io->injected();
      run.params = EngineParams(**e);
      run.stats = (*e)->stats();
    });
  }
  for (auto& t : threads)
    t.join();
  const std::vector<TrainRun> ref = Train(host, 2, kSteps);
  for (int r = 0; r < 2; ++r) {
    const TrainRun& run = runs[static_cast<size_t>(r)];
    const std::vector<std::string>& errs = errors[static_cast<size_t>(r)];
    ASSERT_EQ(errs.size(), 1u) << "rank " << r;
    // The error of the micro-step after the failing step: rank 1's read, agreed on.
    EXPECT_NE(errs[0].find("on rank 1"), std::string::npos) << errs[0];
    EXPECT_NE(errs[0].find("reading state"), std::string::npos) << errs[0];
    EXPECT_NE(errs[0].find("last completed step"), std::string::npos) << errs[0];
    EXPECT_NE(errs[0].find("iteration are void"), std::string::npos) << errs[0];
    EXPECT_EQ(run.stats.optimizer.steps_failed, 1u);
    EXPECT_EQ(run.stats.optimizer.steps_applied, static_cast<uint64_t>(kSteps));
    EXPECT_EQ(run.stats.optimizer.steps_pipelined, static_cast<uint64_t>(kSteps + 1));
    EXPECT_EQ(run.stats.global_steps, kSteps);
    ASSERT_TRUE(SameTraining(ref[static_cast<size_t>(r)], run)) << "rank " << r;
  }
  EXPECT_EQ(runs[1].injected, 1u);
  EXPECT_EQ(runs[0].injected, 0u);
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

// The step as a pipeline, seen from the store's I/O and the driver's updates: before
// CPU-Adam starts on a sub-group, the read of the next one was submitted, and the write of
// the previous one was submitted and not yet waited for: three sub-groups in flight, 12
// buffers (in the order the update runs them: the pipelined step's, on its worker, is the
// order the next forward needs the groups in). Checked once the pipeline is full, from the
// fourth sub-group on: at the step's
// start the buffers also hold the accumulators the backward left there (modified, so
// evicting them costs a write), and the first prefetches wait for the first writes.
TEST(NvmeOffloadTest, ReadOfTheNextSubGroupAndWriteOfThePreviousOverlapTheUpdate) {
  if (RelocatingStoreMode()) {
    GTEST_SKIP() << "the relocating test mode writes every chunk at its release and reads "
                    "every lease back from disk: no overlap or residency to observe (the "
                    "plain pass checks it)";
  }
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config c = BaseConfig();
  c.zero.sub_group_size = 16;  // 91 elements (more with padding): 6 or more sub-groups
  c = NvmeConfig(c, dir.path(), 12, /*pipelined=*/true);
  struct Event {
    int kind;  // StateEvent::Kind, or -1: update begins
    size_t chunk;
    uint32_t state;
  };
  std::vector<Event> events;
  EngineOptions o = TestOptions();
  o.test.nvme_observer = [&](const offload::StateEvent& e) {
    events.push_back({e.kind, e.range.chunk, e.range.state.value});
  };
  o.test.driver.on_update = [&](size_t i, bool begin) {
    if (begin) events.push_back({-1, i, 0});
  };
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  ASSERT_NE(e, nullptr);
  const uint32_t master = 1;  // the driver registers master, m, v, accumulators in order
  int checked = 0;
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step)).ok());
    events.clear();
    ASSERT_TRUE(e->Step().ok());
    // The pipelined step (on by default) streams the states on its worker: completed here.
    const size_t groups = e->optimizer().num_sub_groups();
    EXPECT_FALSE(e->optimizer().update_in_flight());
    if (step == 0) continue;  // the first step starts from zeros: little to read
    ASSERT_GE(groups, 6u);
    // The sub-groups in the order the update ran them (the pipelined step's: the order the
    // next forward needs the groups in), and where each began.
    std::vector<size_t> ran, begin_at;
    for (size_t k = 0; k < events.size(); ++k) {
      if (events[k].kind != -1) continue;
      ran.push_back(events[k].chunk);
      begin_at.push_back(k);
    }
    ASSERT_EQ(ran.size(), groups);
    for (size_t at = 3; at + 1 < groups; ++at) {
      const size_t i = ran[at], next = ran[at + 1], prev = ran[at - 1];
      bool read_next = false, write_prev = false, write_prev_waited = false;
      for (size_t k = 0; k < begin_at[at]; ++k) {
        const Event& ev = events[k];
        if (ev.state != master) continue;
        read_next |= ev.kind == offload::StateEvent::kReadSubmitted && ev.chunk == next;
        write_prev |= ev.kind == offload::StateEvent::kWriteSubmitted && ev.chunk == prev;
        write_prev_waited |= ev.kind == offload::StateEvent::kWriteDone && ev.chunk == prev;
      }
      EXPECT_TRUE(read_next) << "step " << step << ": master chunk " << next
                             << " was not being read when sub-group " << i << " started";
      EXPECT_TRUE(write_prev) << "step " << step << ": master chunk " << prev
                              << " was not being written when sub-group " << i << " started";
      EXPECT_FALSE(write_prev_waited)
          << "step " << step << ": sub-group " << i << " waited for the write of " << prev;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * static_cast<int>(e->optimizer().num_sub_groups() - 4));
  EXPECT_GT(e->stats().store.prefetch_hits, 0u);
  EXPECT_EQ(e->stats().optimizer.steps_pipelined, 3u);
}

TEST(NvmeOffloadTest, TooFewBuffersAreRefusedWithTheNumberNeeded) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config c = NvmeConfig(BaseConfig(), dir.path(), 4, /*pipelined=*/true);
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("offload_optimizer.buffer_count = 4"), std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find("at least 8"), std::string::npos) << e.status();
  c.zero.offload_optimizer.pipeline_read = false;
  c.zero.offload_optimizer.buffer_count = 3;
  e = EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("at least 4"), std::string::npos) << e.status();
  // strata.swap_pipeline_depth: sub-groups in flight with pipeline_read.
  c.zero.offload_optimizer.pipeline_read = true;
  c.zero.offload_optimizer.buffer_count = 8;
  c.strata.swap_pipeline_depth = 3;
  e = EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("at least 12"), std::string::npos) << e.status();
  EXPECT_NE(e.status().message().find("strata.swap_pipeline_depth = 3"), std::string::npos)
      << e.status();
  c.strata.swap_pipeline_depth = 1;
  e = EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("reads nothing ahead"), std::string::npos) << e.status();
  c.strata.swap_pipeline_depth = 2;
  c.zero.offload_optimizer.pipeline_read = false;
  c.zero.offload_optimizer.buffer_count = 4;
  c.zero.offload_optimizer.nvme_path = {dir.path() + "/missing"};
  e = EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound) << e.status();
  EXPECT_NE(e.status().message().find("nvme_path"), std::string::npos) << e.status();
}

// States and accumulators four times strata.host_budget: training works, the host pool's
// high-water stays within the budget, and the result is the host tier's, bit for bit.
TEST(NvmeOffloadTest, StatesFourTimesTheHostBudgetTrainWithinIt) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  constexpr size_t kNumel = size_t{1} << 21;  // one parameter: 8 MiB per fp32 state
  std::vector<float> init(kNumel);
  for (size_t i = 0; i < kNumel; ++i)
    init[i] = 0.001f * static_cast<float>(static_cast<int>(i % 2001) - 1000);
  constexpr int kGroups = 16;  // modules of 128 Ki elements: small gradient buckets
  constexpr size_t kPer = kNumel / kGroups;
  std::vector<GroupDesc> groups;
  for (int g = 0; g < kGroups; ++g) {
    groups.push_back({"m" + std::to_string(g), {{"w", kPer, init.data() + g * kPer}}});
  }
  Config host;
  host.optimizer.lr = 0.01;
  host.zero.offload_optimizer.device = OffloadDevice::kCpu;
  host.zero.reduce_bucket_size = 1 << 18;
  host.zero.sub_group_size = 1 << 14;  // 64 KiB chunks
  host.bf16 = true;                    // the working shards' pinned host mirror: 4 MiB
  host.zero.stage3_param_persistence_threshold = 0;
  Config nvme = NvmeConfig(host, dir.path(), 12, true);
  nvme.strata.host_budget = 8 << 20;  // the states are 32 MiB
  auto train = [&](const Config& c, Result<EngineStats>* stats) -> std::vector<float> {
    Result<std::unique_ptr<EngineCore>> e =
        EngineCore::Create(c, SingleRank(), groups, TestOptions());
    if (!e.ok()) {
      *stats = e.status();
      return {};
    }
    EngineCore& en = **e;
    std::vector<float> grad(kNumel);
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < kNumel; ++i)
        grad[i] = 0.01f * static_cast<float>(static_cast<int>((i * 7 + step * 13) % 101) - 50);
      Status s;
      for (int g = 0; g < kGroups && s.ok(); ++g) {
        s = en.PreForward(g);
        if (s.ok()) s = en.PostForward(g);
      }
      for (int g = kGroups - 1; g >= 0 && s.ok(); --g) {
        s = en.PreBackward(g);
        if (s.ok()) s = en.AddGradient(g, 0, grad.data() + g * kPer, DType::kFloat32);
        if (s.ok()) s = en.PostBackward(g);
      }
      if (s.ok()) s = en.EndBackward();
      Result<StepOutcome> out = s.ok() ? en.Step() : Result<StepOutcome>(s);
      if (!out.ok()) {
        *stats = out.status();
        return {};
      }
    }
    std::vector<float> w(kNumel);
    Status st;
    for (int g = 0; g < kGroups && st.ok(); ++g) {
      st = en.GatherMasterParams(g, std::span<float>(w).subspan(g * kPer, kPer));
    }
    *stats = st.ok() ? Result<EngineStats>(en.stats()) : Result<EngineStats>(st);
    return w;
  };
  Result<EngineStats> hs = InvalidArgumentError("not run"), ns = InvalidArgumentError("not run");
  const std::vector<float> a = train(host, &hs);
  const std::vector<float> b = train(nvme, &ns);
  ASSERT_TRUE(hs.ok()) << hs.status();
  ASSERT_TRUE(ns.ok()) << ns.status();
  const uint64_t states = ns->optimizer.master_bytes + ns->optimizer.exp_avg_bytes +
                          ns->optimizer.exp_avg_sq_bytes + ns->optimizer.grad_accumulator_bytes;
  EXPECT_GE(states, 4 * nvme.strata.host_budget);
  ASSERT_TRUE(ns->host.has_value());
  EXPECT_LE(ns->host->usage.peak_bytes, nvme.strata.host_budget);
  EXPECT_GT(ns->store.reads, 0u);
  EXPECT_GT(ns->store.prefetch_hits, 0u);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_NE(a[12345], init[12345]);  // it trained
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

// offload_param.device = nvme: the working shards in swap slots too (all of
// them: max_in_cpu 0).
Config NvmeParamConfig(const Config& base, const std::string& dir, int param_buffers) {
  Config c = NvmeConfig(base, dir, 12, /*pipelined=*/true);
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = {dir};
  c.zero.offload_param.buffer_count = param_buffers;
  c.zero.offload_param.max_in_cpu = 0;
  return c;
}

// The reference for the NVMe-parameter tests: the optimizer and the shards in host memory.
Config HostTierConfig() {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  return c;
}

class NvmeParamBitIdentityTest : public ::testing::TestWithParam<std::tuple<int, Precision, bool>> {
};

// Parameters and optimizer states on NVMe give the host tier's losses and parameters, bit for
// bit; three buffers for the four groups' shards, so shards are read back every iteration.
// With the pipelined step and with the step inside Step(): pipelined, the update writes
// each group's new parameters into a staging buffer that the engine's thread copies into
// the shards' store when the forward opens the group.
TEST_P(NvmeParamBitIdentityTest, SameLossesAndParametersAsTheHostTier) {
  const auto [world, precision, pipelined] = GetParam();
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config host = BaseConfig();
  host.zero.offload_optimizer.device = OffloadDevice::kCpu;
  host.zero.offload_param.device = OffloadDevice::kCpu;
  host.gradient_clipping = 0.5;
  host.zero.sub_group_size = 16;
  host.bf16 = precision == Precision::kBf16;
  host.fp16.enabled = precision == Precision::kFp16;
  Config nvme = NvmeParamConfig(host, dir.path(), 3);
  nvme.strata.pipeline_step = pipelined;
  const int steps = 5;
  const std::vector<TrainRun> a = Train(host, world, steps);
  const std::vector<TrainRun> b = Train(nvme, world, steps);
  for (int r = 0; r < world; ++r) {
    const TrainRun& n = b[static_cast<size_t>(r)];
    ASSERT_TRUE(SameTraining(a[static_cast<size_t>(r)], n)) << "rank " << r;
    const OptimizerStats& o = n.stats.optimizer;
    EXPECT_EQ(o.steps_pipelined, pipelined ? o.steps_applied : 0u);
    // Every trainable group's shard staged in every applied step (kLayers + the root).
    EXPECT_EQ(o.shard_handovers, pipelined ? o.steps_applied * (kLayers + 1) : 0u);
    // Each without a copy: the staging buffer exchanged for one of the store's, with its
    // block CRCs computed by the update's worker, so the store's write computed none.
    EXPECT_EQ(o.shard_handovers_exchanged, o.shard_handovers);
    EXPECT_EQ(o.shard_handovers_checksummed, o.shard_handovers);
    EXPECT_EQ(n.stats.param_store.writes_with_given_crcs, o.shard_handovers);
    if (o.shard_handovers > 0) {
      EXPECT_GT(o.shard_checksum_s, 0.0);
      const std::string summary = n.stats.ToString();
      EXPECT_NE(summary.find(std::to_string(o.shard_handovers) +
                             " new shards handed over by the pipelined step"),
                std::string::npos)
          << summary;
    }
    // A sub-group of 16 elements touches two groups at most: within the two buffers.
    EXPECT_LE(o.staging_buffers, pipelined ? 2u : 0u);
    if (pipelined && precision != Precision::kFp16) {
      EXPECT_GT(o.staging_buffers, 0u);
    }
    EXPECT_EQ(n.stats.param_tier, TierKind::kNvme);
    EXPECT_EQ(n.stats.param_store_name, StoreName("nvme"));
    EXPECT_EQ(n.stats.param_store.chunks, static_cast<uint64_t>(kLayers + 1));
    EXPECT_GT(n.stats.param_store.reads, 0u);
    EXPECT_GT(n.stats.param_store.writes, 0u);
    EXPECT_EQ(n.stats.param_store.bounced_bytes, 0u);
    EXPECT_EQ(n.stats.coordinator.shard_read_errors, 0u);
  }
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

INSTANTIATE_TEST_SUITE_P(
    RanksPrecisionsPipelines, NvmeParamBitIdentityTest,
    ::testing::Combine(::testing::Values(1, 2),
                       ::testing::Values(Precision::kFp32, Precision::kBf16, Precision::kFp16),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<NvmeParamBitIdentityTest::ParamType>& param_info) {
      return RanksAndPrecision(param_info.param) +
             (std::get<2>(param_info.param) ? "Pipelined" : "Serial");
    });

// On a stable trace the shards are read ahead of their all-gathers: after the first step
// (recorded on demand) no fetch reads its shard on demand, although every iteration reads
// shards back (two buffers, four shards: one read ahead), on 1 and 2 ranks.
TEST(NvmeOffloadTest, ParameterShardsAreReadAheadAfterTheFirstStep) {
  for (const int world : {1, 2}) {
    ScratchDir dir;
    ASSERT_TRUE(dir.ok());
    Config c = BaseConfig();
    c.bf16 = true;
    c.zero.stage3_prefetch_bucket_size = 40;  // all-gathers one group ahead
    c = NvmeParamConfig(c, dir.path(), 2);
    // The step inside Step() writes every shard behind, so each iteration reads them back
    // along the trace. (After a pipelined step the forward finds each new shard in a store
    // buffer; how many the backward reads back then depends on when the update's groups
    // end, so the counts below would be timing's.)
    c.strata.pipeline_step = false;
    const std::vector<TrainRun> one = Train(c, world, 1);
    const std::vector<TrainRun> six = Train(c, world, 6);
    for (int r = 0; r < world; ++r) {
      const TrainRun& a = one[static_cast<size_t>(r)];
      const TrainRun& b = six[static_cast<size_t>(r)];
      ASSERT_TRUE(a.status.ok()) << a.status;
      ASSERT_TRUE(b.status.ok()) << b.status;
      EXPECT_EQ(b.stats.coordinator.shard_reads_on_demand,
                a.stats.coordinator.shard_reads_on_demand)
          << world << " ranks, rank " << r;
      EXPECT_GT(b.stats.param_store.reads, a.stats.param_store.reads + 5)
          << "the shards were not read back: the test shows nothing";
      // At least one shard per iteration after the first comes from a read ahead.
      EXPECT_GE(b.stats.coordinator.shard_reads_ahead, 5u);
      EXPECT_GE(b.stats.param_store.prefetch_hits, 5u);
    }
  }
}

// After a pipelined step every trainable group's new shard reaches its store by the
// hand-over (a whole-chunk write) when the forward opens the group: reading the shard ahead
// before that would read the old one for nothing, and the hand-over would wait for that
// read. Here the update has ended before each forward begins (the test waits for it), so
// every group's shard is ready to be read ahead: none is, and the forward reads nothing
// from swap (each shard is handed over into a store buffer and read from there).
TEST(NvmeOffloadTest, NoShardIsReadAheadBeforeThePipelinedStepHandsItOver) {
  if (RelocatingStoreMode()) {
    GTEST_SKIP() << "the relocating test mode writes every chunk at its release and reads "
                    "every lease back from disk: no overlap or residency to observe (the "
                    "plain pass checks it)";
  }
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config c = BaseConfig();
  c.bf16 = true;
  c.zero.stage3_prefetch_bucket_size = 40;  // all-gathers one group ahead
  c = NvmeParamConfig(c, dir.path(), 3);    // two shards read ahead
  ASSERT_TRUE(c.strata.pipeline_step);
  std::mutex mu;
  std::condition_variable cv;
  int updated = 0;
  EngineOptions o = TestOptions();
  // A staging buffer per group: the update never waits for a hand-over, so it can end
  // before the forward (with two, it waits for the forward to open the first groups).
  o.test.driver.staged_shard_buffers = kLayers + 1;
  o.test.driver.on_group_updated = [&](int) {
    std::lock_guard<std::mutex> lock(mu);
    ++updated;
    cv.notify_all();
  };
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  ASSERT_NE(e, nullptr);
  const int trainable = kLayers + 1;
  int checked = 0;
  for (int step = 0; step < 5; ++step) {
    // The stores' counters when the last forward group is gathered (the backward's first
    // PreBackward completes the update and may read ahead then).
    uint64_t reads_ahead = 0, reads = 0, overwritten = 0;
    const EngineStats before = e->stats();
    Result<double> loss =
        EngineMicroStep(*e, Seq(step), MakeBatch(step), {}, [&](int, Phase phase) {
          if (phase != Phase::kForward) return;
          const EngineStats now = e->stats();
          reads_ahead = now.coordinator.shard_reads_ahead - before.coordinator.shard_reads_ahead;
          reads = now.param_store.reads - before.param_store.reads;
          overwritten =
              now.param_store.reads_ahead_overwritten - before.param_store.reads_ahead_overwritten;
        });
    ASSERT_TRUE(loss.ok()) << loss.status();
    if (step >= 2) {
      // This forward followed a pipelined step on a recorded trace (step 0 records it).
      EXPECT_EQ(reads_ahead, 0u) << "step " << step << ": shards read ahead of their hand-over";
      EXPECT_EQ(overwritten, 0u) << "step " << step << ": shards read ahead, then overwritten";
      EXPECT_EQ(reads, 0u) << "step " << step;
      ++checked;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      updated = 0;
    }
    ASSERT_TRUE(e->Step().ok());
    ASSERT_TRUE(e->step_in_flight());
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return updated == trainable; }))
        << "the update did not end: " << updated << " of " << trainable << " groups";
  }
  EXPECT_EQ(checked, 3);
  const OptimizerStats& os = e->stats().optimizer;
  // (The last step's update is still in flight: its shards are handed over by the next
  // forward.)
  EXPECT_EQ(os.shard_handovers, (os.steps_applied - 1) * static_cast<uint64_t>(trainable));
  // Without the pipelined step's hand-over the same forward reads its shards ahead (the
  // rule above is not the read-ahead switched off): ParameterShardsAreReadAheadAfterTheFirstStep.
}

// A shard read that fails on rank 1 (an I/O error, a flipped bit) during a forward: every
// rank still issues the same collectives, fails the same step with rank 1's error, and keeps
// the last good step's parameters (the bad shard is rewritten from the committed master).
// With the pipelined step (on by default) the read may come before the step's update is
// committed (the shards it wrote are read back): the store's error then fails that
// commit, at the next backward on every rank, and the update is rolled back with it (the
// iteration is void): the last good step is the last one applied.
TEST(NvmeOffloadTest, AShardReadFailureFailsTheStepOnEveryRank) {
  for (const bool corrupt : {false, true}) {
    ScratchDir dir;
    ASSERT_TRUE(dir.ok());
    const Config host = HostTierConfig();
    Config nvme = NvmeParamConfig(host, dir.path(), 2);
    // Every group gathered again for the backward: after a pipelined step the forward finds
    // each new shard in a store buffer (handed over there), the backward reads shards back.
    nvme.zero.stage3_max_reuse_distance = 0;
    std::vector<swap::FaultInjectingIoEngine*> faults;
    // The parameters' swap space is made first: its I/O engine is the one armed.
    const swap::FaultRule rule = corrupt ? swap::FaultRule::CorruptRead(3).OnOp(swap::IoOp::kRead)
                                         : swap::FaultRule::Error(EIO).OnOp(swap::IoOp::kRead);
    const std::vector<TrainRun> runs = Train(nvme, 2, 6, &faults, [&](int rank, auto& f) {
      if (rank == 1) {
        ASSERT_TRUE(f.AddRule(swap::FaultRule(rule).Nth(8)).ok());
      }
    });
    EXPECT_GT(runs[1].injected, 0u) << "the fault never fired";
    const int done = runs[0].steps_done;
    EXPECT_EQ(runs[1].steps_done, done);
    EXPECT_LT(done, 6);
    for (int r = 0; r < 2; ++r) {
      const Status& s = runs[static_cast<size_t>(r)].status;
      ASSERT_FALSE(s.ok()) << "rank " << r << " saw no error";
      EXPECT_NE(s.message().find("on rank 1"), std::string::npos) << s;
      EXPECT_NE(s.message().find("working shard of group"), std::string::npos) << s;
      EXPECT_NE(s.message().find("last completed step"), std::string::npos) << s;
    }
    EXPECT_EQ(runs[1].status.code(), corrupt ? StatusCode::kDataLoss : StatusCode::kIOError)
        << runs[1].status;
    EXPECT_GT(runs[1].stats.coordinator.shard_read_errors, 0u) << runs[1].status;
    // (The relocating test mode reads every lease from disk: the injected read failure comes
    // in an earlier step, before any pipelined one.)
    if (!RelocatingStoreMode()) {
      EXPECT_GT(runs[0].stats.optimizer.steps_pipelined, 0u);
    }
    const auto applied = static_cast<int>(runs[0].stats.optimizer.steps_applied);
    EXPECT_EQ(runs[1].stats.optimizer.steps_applied, runs[0].stats.optimizer.steps_applied);
    EXPECT_TRUE(applied == done || applied + 1 == done) << applied << " of " << done;
    for (int r = 0; r < 2; ++r) {
      const Status& s = runs[static_cast<size_t>(r)].status;
      // A void iteration says so.
      EXPECT_EQ(s.message().find("void") != std::string::npos, applied < done) << s;
    }
    const std::vector<TrainRun> ref = Train(host, 2, applied);
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(SameBits(runs[static_cast<size_t>(r)].params, ref[static_cast<size_t>(r)].params))
          << "rank " << r << " after " << applied << " steps";
    }
    EXPECT_TRUE(ListDir(dir.path()).empty());
  }
}

// The pipelined step with the parameters on NVMe: a write of a new working shard (the
// engine's thread copies it from the update's staging buffer into the shards' store, which
// writes it behind) fails on rank 1. Every rank fails the same micro-step (the next
// backward, which completes the update), names rank 1, voids the iteration and is back at
// the last completed step: the host tier's parameters after as many steps. Training then
// goes on from there and gives the host tier's bits.
TEST(NvmeOffloadTest, AFailedWriteOfAStagedShardVoidsTheIterationAndTrainingGoesOn) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  const Config host = HostTierConfig();
  const Config nvme = NvmeParamConfig(host, dir.path(), 3);
  constexpr int kSteps = 6;
  auto group = std::make_shared<ThreadGroup>(2);
  std::vector<TrainRun> runs(2);
  std::vector<int> failed_at(2, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      TrainRun& run = runs[static_cast<size_t>(r)];
      EngineOptions o = TestOptions();
      swap::FaultInjectingIoEngine* params_io = nullptr;  // the first swap space made
      o.test.nvme_io_engine_factory =
          [&params_io](const swap::IoEngineOptions& io) -> Result<std::unique_ptr<swap::IoEngine>> {
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::FaultInjectingIoEngine> e,
                                swap::FaultInjectingIoEngine::Create(io, 5));
        if (params_io == nullptr) params_io = e.get();
        return std::unique_ptr<swap::IoEngine>(std::move(e));
      };
      const Params init = InitialParams();
      Result<std::unique_ptr<EngineCore>> e =
          EngineCore::Create(nvme, std::make_shared<ThreadCommunicator>(group, r), Groups(init), o);
      ASSERT_TRUE(e.ok()) << e.status();
      // Each iteration trains the batch of the next step to apply (steps_applied counts a
      // pipelined step from its start, and takes it back when its update fails).
      for (int it = 0; it < 2 * kSteps && (*e)->stats().optimizer.steps_applied < kSteps; ++it) {
        // One write of rank 1's shards fails: the first after step 0's update began (a
        // shard it staged, handed over in iteration 1's forward).
        if (it == 1 && r == 1) {
          ASSERT_TRUE(
              params_io->AddRule(swap::FaultRule::Error(EIO).OnOp(swap::IoOp::kWrite).Nth(1)).ok());
        }
        const auto from = static_cast<int>((*e)->stats().optimizer.steps_applied);
        Result<double> loss = EngineMicroStep(**e, Seq(from), MakeBatch(from));
        Result<StepOutcome> out = loss.ok() ? (*e)->Step() : loss.status();
        if (!out.ok()) {
          EXPECT_EQ(failed_at[static_cast<size_t>(r)], -1) << "a second failure: " << out.status();
          failed_at[static_cast<size_t>(r)] = it;
          run.status = out.status();
          continue;
        }
        run.losses.resize(static_cast<size_t>(from));  // a void iteration's loss goes
        run.losses.push_back(*loss);
      }
      run.injected = params_io->injected();
      run.params = EngineParams(**e);
      run.stats = (*e)->stats();
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_GT(runs[1].injected, 0u) << "the fault never fired";
  EXPECT_EQ(failed_at[0], failed_at[1]);
  EXPECT_GE(failed_at[0], 1);
  for (int r = 0; r < 2; ++r) {
    const Status& s = runs[static_cast<size_t>(r)].status;
    ASSERT_FALSE(s.ok()) << "rank " << r << " saw no error";
    EXPECT_NE(s.message().find("on rank 1"), std::string::npos) << s;
    EXPECT_NE(s.message().find("void"), std::string::npos) << s;
    EXPECT_EQ(runs[static_cast<size_t>(r)].stats.optimizer.steps_failed, 1u);
    EXPECT_EQ(runs[static_cast<size_t>(r)].stats.optimizer.steps_applied,
              static_cast<uint64_t>(kSteps));
  }
  EXPECT_EQ(runs[1].status.code(), StatusCode::kIOError) << runs[1].status;
  // Trained from the last completed step on each time: the host tier's run of kSteps steps.
  const std::vector<TrainRun> ref = Train(host, 2, kSteps);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(SameBits(runs[static_cast<size_t>(r)].params, ref[static_cast<size_t>(r)].params))
        << "rank " << r;
    EXPECT_EQ(runs[static_cast<size_t>(r)].losses, ref[static_cast<size_t>(r)].losses)
        << "rank " << r;
  }
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

// max_in_cpu: the leading groups whose elements fit stay in host memory (root: 16 elements
// on one rank, 32 on two; each layer 48 on one rank, 64 on two), the rest on NVMe; the
// default (1e9) keeps all of this small model in host memory. The host tier's bits each
// time.
TEST(NvmeOffloadTest, MaxInCpuKeepsTheLeadingGroupsShardsInHostMemory) {
  struct Case {
    int world;
    int64_t max_in_cpu;
    uint64_t in_host;  // groups whose shards stay in host memory
  };
  for (const Case& k : {Case{1, 64, 2}, Case{1, 63, 1}, Case{2, 96, 2}, Case{2, 1000000000, 4}}) {
    ScratchDir dir;
    ASSERT_TRUE(dir.ok());
    Config host = BaseConfig();
    host.bf16 = true;
    host.zero.offload_optimizer.device = OffloadDevice::kCpu;
    host.zero.offload_param.device = OffloadDevice::kCpu;
    Config nvme = NvmeParamConfig(host, dir.path(), 2);
    nvme.zero.offload_param.max_in_cpu = k.max_in_cpu;
    const std::vector<TrainRun> a = Train(host, k.world, 4);
    const std::vector<TrainRun> b = Train(nvme, k.world, 4);
    for (int r = 0; r < k.world; ++r) {
      const TrainRun& n = b[static_cast<size_t>(r)];
      ASSERT_TRUE(SameTraining(a[static_cast<size_t>(r)], n)) << "max_in_cpu " << k.max_in_cpu;
      EXPECT_EQ(n.stats.param_store.chunks, kLayers + 1 - k.in_host)
          << "max_in_cpu " << k.max_in_cpu;
      const uint64_t layer_shard = (k.world == 1 ? 48 : 32) * 2, root_shard = 16 * 2;
      EXPECT_EQ(n.stats.working_shard_host_bytes,
                k.in_host == 0 ? 0 : root_shard + (k.in_host - 1) * layer_shard)
          << "max_in_cpu " << k.max_in_cpu;
      // The rest went to NVMe (and only they did).
      EXPECT_EQ(n.stats.param_store.writes > 0, k.in_host <= kLayers);
    }
    EXPECT_TRUE(ListDir(dir.path()).empty());
  }
}

// The planner's check runs at start (the same as `strata-config plan`): a machine without
// the memory or the disk the config needs is refused before anything is allocated, with
// the numbers; every rank of the node counts.
TEST(NvmeOffloadTest, StartUpRefusesWhatTheMachineCannotHold) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  const Config c = NvmeParamConfig(BaseConfig(), dir.path(), 3);
  for (const bool disk : {false, true}) {
    EngineOptions o = TestOptions();
    o.test.machine_facts = [&](const Plan& plan) -> Result<MachineFacts> {
      MachineFacts m;
      m.host_available_bytes = disk ? uint64_t{1} << 40 : 1000;
      for (const auto& [path, bytes] : plan.nvme_bytes)
        m.free_disk[path] = disk ? 4096 : bytes * 8;
      return m;
    };
    Result<std::unique_ptr<EngineCore>> e =
        EngineCore::Create(c, SingleRank(), Groups(InitialParams()), o);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("the plan does not fit this machine"), std::string::npos)
        << e.status();
    EXPECT_NE(e.status().message().find(disk ? "nvme_path " + dir.path() + ": the plan needs"
                                             : "host memory: the plan needs"),
              std::string::npos)
        << e.status();
    EXPECT_NE(e.status().message().find(disk ? "but 4 KiB is free" : "but the machine has 1000 B"),
              std::string::npos)
        << e.status();
    EXPECT_TRUE(ListDir(dir.path()).empty());
  }
  // This machine holds the toy model.
  EXPECT_TRUE(EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions()).ok());
}

// The pipelined step's two staging buffers (working shards on NVMe) are taken from the host
// tier when the engine is made: a budget with room for everything else but them is refused
// there, naming them, the key and the way out (the same budget without the pipelined step
// is fine).
// A host budget that holds the synchronous step's buffers and not the pipelined step's
// staging: the keys left out are lowered at start until the plan, which counts the staging,
// fits (here the gathered bound, the bucket and the optimizer's buffers), and the engine
// starts within the budget with the pipelined step. (Before the plan counted three staging
// buffers it fitted as it was, and the staging's own allocation refused the start.)
TEST(NvmeOffloadTest, AHostBudgetWithoutRoomForTheStagingBuffersIsMadeRoomForAtStart) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  Config c = NvmeParamConfig(BaseConfig(), dir.path(), 3);
  c.strata.pipeline_step = false;
  uint64_t used = 0;
  {
    Result<std::unique_ptr<EngineCore>> e =
        EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE((*e)->stats().host.has_value());
    used = (*e)->stats().host->usage.peak_bytes;
  }
  ASSERT_GT(used, 0u);
  c.strata.host_budget = used;
  c.strata.pipeline_step = true;
  const int buffers = c.zero.offload_optimizer.buffer_count;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE((*e)->config().strata.pipeline_step);
  EXPECT_LT((*e)->config().zero.offload_optimizer.buffer_count, buffers);
  EXPECT_LE((*e)->stats().host->usage.peak_bytes, used);
}

TEST(NvmeOffloadTest, ParameterOffloadSettingsAreCheckedWithTheNumbers) {
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  auto create = [&](const Config& c) {
    return EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  };
  Config c = NvmeParamConfig(BaseConfig(), dir.path(), 3);
  c.zero.offload_param.buffer_size = 20;  // a layer's shard is 48 elements
  Result<std::unique_ptr<EngineCore>> e = create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("offload_param.buffer_size = 20"), std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find("48 elements"), std::string::npos) << e.status();
  c = NvmeParamConfig(BaseConfig(), dir.path(), 1);
  e = create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("offload_param.buffer_count = 1"), std::string::npos)
      << e.status();
  c = NvmeParamConfig(BaseConfig(), dir.path(), 3);
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  e = create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("needs offload_optimizer.device = nvme"), std::string::npos)
      << e.status();
  c = NvmeParamConfig(BaseConfig(), dir.path(), 3);
  c.zero.offload_param.nvme_path = {dir.path() + "/missing"};
  e = create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound) << e.status();
  EXPECT_NE(e.status().message().find("offload_param.nvme_path"), std::string::npos) << e.status();
  EXPECT_TRUE(ListDir(dir.path()).empty());
}

}  // namespace
}  // namespace strata::engine

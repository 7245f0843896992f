// The early step (strata.early_step): with clipping off, no loss scale and
// inf/NaN steps applied (strata.skip_inf_nan_steps false), a group's optimizer update starts
// during the backward, as soon as its gradient is final. Checked on order, not on time: the
// update of layer3 (the first group the backward ends) runs before the backward reaches
// layer1 (the control, the early step off, cannot); training is bit-identical with the early
// step on and off (and with the plain step inside Step()), fp32 and bf16, 1 and 2 ranks,
// with gradient accumulation; a front end that gives a group's gradient after the group's
// backward ended, or sets the learning rate during the backward, is refused; Step() sums
// the norm's tiles left with the worker held, and the groups left then go in the next
// forward's order.
// The norm in the backward (strata.norm_in_backward, on by default): with clipping on,
// layer3's norm tiles are summed before the backward reaches layer1 (the control, off,
// cannot); clipped training is bit-identical with it on and off, with a block run twice in
// a backward too (the sums are dropped); an inf gradient skips the step either way.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

Config EarlyConfig(bool early) {
  Config c = BaseConfig();
  c.strata.early_step = early;
  c.strata.skip_inf_nan_steps = false;
  c.zero.overlap_comm = true;
  c.zero.reduce_bucket_size = kD * kD + kD;  // one layer per bucket
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  return c;
}

// EngineMicroStep's `gathered` for step `step` of a latch test: in step 1's backward it sets
// `armed` when the root is gathered (its backward comes first: the last step's update is
// complete by then) and, when layer1 is, waits up to `timeout` for `ready` (under `mu`, woken
// by `cv`) and tells `came` whether it came.
std::function<void(int, Phase)> AtLayer1OfStep1(int step, std::atomic<bool>& armed, std::mutex& mu,
                                                std::condition_variable& cv,
                                                std::chrono::milliseconds timeout,
                                                std::function<bool()> ready,
                                                std::function<void(bool)> came) {
  return [=, &armed, &mu, &cv](int g, Phase phase) {
    if (step != 1 || phase != Phase::kBackward) return;
    if (g == 0) armed = true;
    if (g != 1) return;
    std::unique_lock<std::mutex> lock(mu);
    const bool ok = cv.wait_for(lock, timeout, ready);
    came(ok);
  };
}

// Step 0 runs plainly; in step 1's backward the test waits, when layer1 (the last group of
// the backward) is gathered, until layer3's update ran or a timeout passed.
// (With `on_norm`, the latch waits for layer3's norm tiles, strata.norm_in_backward.)
struct LatchRun {
  bool updated_before_layer1 = false;
  int timeouts = 0;
  uint64_t early_steps = 0;
  uint64_t released_in_backward = 0;
  uint64_t norms_in_backward = 0;
  uint64_t tiles_in_background = 0;
};

LatchRun RunWithLatch(Config c, std::chrono::milliseconds timeout, bool on_norm = false) {
  constexpr int kFirst = 3;  // the first group whose backward ends
  // The engine's thread hands a final group over in its own calls: with the reduced shards
  // added on the reducer's thread (strata.accumulate_in_background) layer3 becomes final
  // after the engine's last call before the latch, which blocks that thread.
  c.strata.accumulate_in_background = false;
  std::mutex mu;
  std::condition_variable cv;
  bool updated = false;
  std::atomic<bool> armed{false};
  EngineOptions o = TestOptions();
  auto latch = [&](int g) {
    if (g != kFirst || !armed.load()) return;
    std::lock_guard<std::mutex> lock(mu);
    updated = true;
    cv.notify_all();
  };
  (on_norm ? o.test.driver.on_norm_summed : o.test.driver.on_group_updated) = latch;
  LatchRun run;
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  EXPECT_NE(e, nullptr);
  if (e == nullptr) return run;
  for (int step = 0; step < 3; ++step) {
    auto gathered = AtLayer1OfStep1(
        step, armed, mu, cv, timeout, [&] { return updated; },
        [&](bool came) {
          if (!came) ++run.timeouts;
          run.updated_before_layer1 = updated;
        });
    Result<double> loss = EngineMicroStep(*e, Seq(step), MakeBatch(step), {}, gathered);
    EXPECT_TRUE(loss.ok()) << loss.status();
    Result<StepOutcome> out = e->Step();
    EXPECT_TRUE(out.ok()) << out.status();
    if (!loss.ok() || !out.ok()) break;
  }
  const EngineStats s = e->stats();
  run.early_steps = s.optimizer.steps_early;
  run.released_in_backward = s.optimizer.groups_released_in_backward;
  run.norms_in_backward = s.optimizer.norms_in_backward;
  run.tiles_in_background = s.optimizer.norm_tiles_in_background;
  EXPECT_EQ(s.optimizer.steps_applied, 3u);
  return run;
}

TEST(EarlyStepTest, AGroupsUpdateRunsBeforeTheBackwardReachesTheLastGroup) {
  const LatchRun run = RunWithLatch(EarlyConfig(true), std::chrono::seconds(30));
  EXPECT_TRUE(run.updated_before_layer1)
      << "layer3's update did not run while the backward went on to layer1";
  EXPECT_EQ(run.timeouts, 0);
  EXPECT_EQ(run.early_steps, 3u);
  // Per step: root, layer3 and layer2 are final before the backward ends (layer1's last
  // reduction completes at EndBackward's flush).
  EXPECT_GE(run.released_in_backward, 3u * 2);
}

TEST(EarlyStepTest, ControlWithoutTheEarlyStepNoUpdateRunsDuringTheBackward) {
  const LatchRun run = RunWithLatch(EarlyConfig(false), std::chrono::milliseconds(500));
  EXPECT_FALSE(run.updated_before_layer1);
  EXPECT_EQ(run.timeouts, 1);
  EXPECT_EQ(run.early_steps, 0u);
  EXPECT_EQ(run.released_in_backward, 0u);
}

// Step() sums the norm's tiles the worker has not with the worker held: the two would share
// CPU-Adam's threads. In step 1 the worker is stopped (by the test) after its first group,
// so every other group waits for it; when Step() begins summing, the test lets it go and
// waits 300 ms — a free worker updates a toy group in microseconds — for a group to be
// updated: none is until the sums end; they all are after, in the next forward's order.
TEST(EarlyStepTest, TheNormIsSummedWithTheWorkerHeldThenTheGroupsLeftGoInTheForwardsOrder) {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> armed{false};
  bool hold = true;        // the worker waits in its first group's hook of step 1
  int held = 0;            // times it did
  int updated = 0;         // groups updated after it was let go (step 1 and 2)
  int held_at_norm = -1;   // `held` when the sums began
  int during_norm = -1;    // groups updated while they were summed
  std::vector<int> after;  // step 1's other groups, in the order they were updated
  EngineOptions o = TestOptions();
  o.test.driver.on_group_updated = [&](int g) {
    if (!armed.load()) return;
    std::unique_lock<std::mutex> lock(mu);
    if (hold) {
      ++held;
      cv.notify_all();
      EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return !hold; }));
      return;
    }
    ++updated;
    if (after.size() < 3) after.push_back(g);
    cv.notify_all();
  };
  o.test.driver.on_early_norm = [&] {
    std::unique_lock<std::mutex> lock(mu);
    if (!armed.load() || during_norm >= 0) return;
    held_at_norm = held;
    hold = false;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::milliseconds(300), [&] { return updated > 0; });
    during_norm = updated;
  };
  Config c = EarlyConfig(true);
  c.strata.accumulate_in_background = false;  // layer3 final before layer1 (RunWithLatch)
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  ASSERT_NE(e, nullptr);
  for (int step = 0; step < 3; ++step) {
    // The first group updated (the root) is held: the others wait for the worker.
    auto gathered = AtLayer1OfStep1(
        step, armed, mu, cv, std::chrono::seconds(30), [&] { return held == 1; },
        [](bool came) { EXPECT_TRUE(came); });
    Result<double> loss = EngineMicroStep(*e, Seq(step), MakeBatch(step), {}, gathered);
    ASSERT_TRUE(loss.ok()) << loss.status();
    Result<StepOutcome> out = e->Step();
    ASSERT_TRUE(out.ok()) << out.status();
  }
  ASSERT_TRUE(armed.load());
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(held_at_norm, 1) << "the worker was not held after its first group of step 1";
    EXPECT_EQ(during_norm, 0) << "the worker updated a group while Step() summed the norm";
    // Step 1's other groups, after the sums, in the next forward's order although layer3's
    // and layer2's were given during the backward, before layer1's.
    EXPECT_EQ(after, (std::vector<int>{1, 2, 3}));
  }
  const EngineStats s = e->stats();
  EXPECT_EQ(s.optimizer.steps_early, 3u);
  EXPECT_GT(s.optimizer.norm_tiles_in_step, 0u);
  EXPECT_GT(s.optimizer.norm_s, 0.0);
}

// ---- Bit-identical ---------------------------------------------------------------------

struct Variant {
  const char* name;
  int world;
  bool bf16;
};

struct Trained {
  std::vector<double> losses;
  std::vector<float> params;  // every group's fp32 master, gathered
  std::vector<double> norms;
  uint64_t early = 0;
  uint64_t released_in_backward = 0;
  uint64_t tiles_in_background = 0;
  uint64_t tiles_in_step = 0;
  uint64_t tiles_as_written = 0;
  uint64_t norms_in_backward = 0;
  uint64_t norms_dropped = 0;
  uint64_t accumulated_in_background = 0;  // buckets added on the reducer's thread
  uint64_t zeroed_lazily = 0;              // accumulator chunks (lazy zeroing)
  uint64_t stale_zeroed = 0;               // stale elements zeroed before a read
};

// The same losses, norms and parameters, bit for bit.
void ExpectTrainedTheSame(const Trained& a, const Trained& b, const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  EXPECT_EQ(a.norms, b.norms) << what;
  EXPECT_TRUE(BitEqual(a.params, b.params)) << what;
}

enum class Mode { kPlain, kPipelined, kEarly };

// 5 optimizer steps of 2 micro-steps each on `world` thread ranks (10 steps of one with a
// `tweak` setting gradient_accumulation_steps 1); `tweak` changes the configuration, `seq`
// the order the groups run in (default: Seq), `seq_of` per micro-step if given;
// `norm_as_written`: EngineOptions::test_norm_as_written; `lazy_zero`: test_lazy_zero.
std::vector<Trained> Train(const Variant& v, Mode mode,
                           const std::function<void(Config&)>& tweak = {},
                           const std::vector<int>& seq = {}, bool norm_as_written = true,
                           bool lazy_zero = true,
                           const std::function<std::vector<int>(int)>& seq_of = {}) {
  Config c = EarlyConfig(mode == Mode::kEarly);
  c.strata.pipeline_step = mode != Mode::kPlain;
  // The plain step skips inf/NaN steps as by default (there are none here).
  c.strata.skip_inf_nan_steps = mode == Mode::kPlain;
  c.gradient_accumulation_steps = 2;
  c.bf16 = v.bf16;
  if (tweak) tweak(c);
  auto group = std::make_shared<ThreadGroup>(v.world);
  std::vector<Trained> out(static_cast<size_t>(v.world));
  std::vector<std::thread> threads;
  for (int r = 0; r < v.world; ++r) {
    threads.emplace_back([&, r] {
      Trained& t = out[static_cast<size_t>(r)];
      EngineOptions o = TestOptions();
      o.test.driver.norm_as_written = norm_as_written;
      o.test.driver.lazy_zero = lazy_zero;
      // Host accumulators in every mode, so that the plain and pipelined steps' norm in the
      // backward, tiles as written and lazy zeroing run (with the device's sums CPU-Adam
      // reads there, none of them do: device_accumulation_test.cc).
      o.test.host_accumulators = true;
      // A slower update, so the backward and the next forward run beside it.
      o.test.driver.on_group_updated = [](int) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      };
      std::unique_ptr<EngineCore> e =
          MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), InitialParams(), o);
      ASSERT_NE(e, nullptr);
      int micro = 0;
      for (int step = 0; step < 5; ++step) {
        for (int m = 0; m < 2; ++m, ++micro) {
          const std::vector<int> order = seq_of ? seq_of(micro) : seq.empty() ? Seq(micro) : seq;
          Result<double> loss = EngineMicroStep(*e, order, MakeBatch(micro));
          ASSERT_TRUE(loss.ok()) << loss.status();
          t.losses.push_back(*loss);
          Result<StepOutcome> s = e->Step();
          ASSERT_TRUE(s.ok()) << s.status();
          if (s->boundary) t.norms.push_back(s->global_norm);
        }
      }
      for (int g = 0; g < e->num_groups(); ++g) {
        std::vector<float> flat(e->layout(g).numel);
        ASSERT_TRUE(e->GatherMasterParams(g, flat).ok());
        t.params.insert(t.params.end(), flat.begin(), flat.end());
      }
      const EngineStats s = e->stats();
      t.early = s.optimizer.steps_early;
      t.released_in_backward = s.optimizer.groups_released_in_backward;
      t.tiles_in_background = s.optimizer.norm_tiles_in_background;
      t.tiles_in_step = s.optimizer.norm_tiles_in_step;
      t.tiles_as_written = s.optimizer.norm_tiles_as_written;
      t.norms_in_backward = s.optimizer.norms_in_backward;
      t.norms_dropped = s.optimizer.norms_in_backward_dropped;
      t.accumulated_in_background = s.reducer.buckets_accumulated_in_background;
      t.zeroed_lazily = s.optimizer.acc_chunks_zeroed_lazily;
      t.stale_zeroed = s.optimizer.acc_stale_elements_zeroed;
    });
  }
  for (auto& t : threads)
    t.join();
  return out;
}

class EarlyBitIdenticalTest : public ::testing::TestWithParam<Variant> {};

TEST_P(EarlyBitIdenticalTest, WithTheEarlyStepOnAndOff) {
  const Variant& v = GetParam();
  const std::vector<Trained> base = Train(v, Mode::kPlain);
  ASSERT_EQ(base.size(), static_cast<size_t>(v.world));
  ASSERT_EQ(base[0].losses.size(), 10u);
  ASSERT_EQ(base[0].norms.size(), 5u);
  EXPECT_EQ(base[0].early, 0u);
  // Every step's norm is made of the same tiles, whoever sums them (the norm in the
  // backward, on by default, or the early step), each once: those summed in the background
  // (if any: in this toy's tiles, of 40 elements, a group is rarely alone) and the rest.
  EXPECT_GT(base[0].tiles_in_background + base[0].tiles_in_step, 0u);
  EXPECT_EQ(base[0].norms_in_backward, 5u);
  for (Mode mode : {Mode::kPipelined, Mode::kEarly}) {
    const std::vector<Trained> run = Train(v, mode);
    ASSERT_EQ(run.size(), base.size());
    for (size_t r = 0; r < run.size(); ++r) {
      const std::string what = std::string(mode == Mode::kEarly ? "early" : "pipelined") +
                               " step, rank " + std::to_string(r);
      ExpectTrainedTheSame(run[r], base[r], what);
      EXPECT_EQ(run[r].early, mode == Mode::kEarly ? 5u : 0u) << what;
      if (mode == Mode::kEarly) {
        EXPECT_GT(run[r].released_in_backward, 0u) << what;
        EXPECT_EQ(run[r].norms_in_backward, 0u) << what;  // the early step sums it
      } else {
        EXPECT_EQ(run[r].norms_in_backward, 5u) << what;
      }
      EXPECT_EQ(run[r].tiles_in_background + run[r].tiles_in_step,
                base[r].tiles_in_background + base[r].tiles_in_step)
          << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, EarlyBitIdenticalTest,
                         ::testing::Values(Variant{"fp32_1rank", 1, false},
                                           Variant{"fp32_2ranks", 2, false},
                                           Variant{"bf16_1rank", 1, true},
                                           Variant{"bf16_2ranks", 2, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

// ---- Inf/NaN steps applied, refusals ---------------------------------------------------

TEST(EarlyStepTest, AnInfGradientIsAppliedWhenSkippingIsOff) {
  for (bool early : {false, true}) {
    std::unique_ptr<EngineCore> e = MakeEngine(EarlyConfig(early), SingleRank(), InitialParams());
    ASSERT_NE(e, nullptr);
    auto tamper = [](int g, int i, std::vector<float>& grad) {
      if (g == 2 && i == 1) grad[0] = std::numeric_limits<float>::infinity();
    };
    ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0), tamper).ok());
    Result<StepOutcome> out = e->Step();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(out->overflow);
    EXPECT_TRUE(out->applied);
    const EngineStats s = e->stats();
    EXPECT_EQ(s.optimizer.steps_inf_nan_applied, 1u);
    EXPECT_EQ(s.optimizer.steps_skipped, 0u);
    // layer2's bias took the inf: its master is no longer finite.
    std::vector<float> flat(e->layout(2).numel);
    ASSERT_TRUE(e->GatherMasterParams(2, flat).ok());
    EXPECT_FALSE(std::isfinite(flat[kD * kD])) << (early ? "early" : "pipelined");
  }
}

TEST(EarlyStepTest, AGradientAfterItsGroupsBackwardEndedIsRefused) {
  std::unique_ptr<EngineCore> e = MakeEngine(EarlyConfig(true), SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  Status late;
  auto gathered = [&](int g, Phase phase) {
    // When layer1's backward begins, layer3's gradient is final and its update started.
    if (g != 1 || phase != Phase::kBackward) return;
    std::vector<float> grad(kD * kD, 0.0f);
    late = e->AddGradient(3, 0, grad.data(), DType::kFloat32);
  };
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0), {}, gathered).ok());
  EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late;
  EXPECT_NE(late.message().find("layer3"), std::string::npos) << late;
  EXPECT_NE(late.message().find("strata.early_step"), std::string::npos) << late;
}

TEST(EarlyStepTest, AGroupUsedAgainAfterItsBackwardEndedIsRefused) {
  // layer1 runs twice: its first backward ends (and its gradient is taken) before its
  // second begins, which the early step cannot allow.
  std::unique_ptr<EngineCore> e = MakeEngine(EarlyConfig(true), SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  Result<double> loss = EngineMicroStep(*e, {1, 2, 1, 3}, MakeBatch(0));
  ASSERT_FALSE(loss.ok());
  EXPECT_EQ(loss.status().code(), StatusCode::kFailedPrecondition) << loss.status();
  EXPECT_NE(loss.status().message().find("layer1"), std::string::npos) << loss.status();
  // Without the early step the same model trains.
  std::unique_ptr<EngineCore> plain = MakeEngine(EarlyConfig(false), SingleRank(), InitialParams());
  ASSERT_NE(plain, nullptr);
  EXPECT_TRUE(EngineMicroStep(*plain, {1, 2, 1, 3}, MakeBatch(0)).ok());
}

TEST(EarlyStepTest, TheLearningRateAndMasterReadsAreRefusedBetweenTheBackwardAndItsStep) {
  std::unique_ptr<EngineCore> e = MakeEngine(EarlyConfig(true), SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  const Status lr = e->set_lr(0.5);
  EXPECT_EQ(lr.code(), StatusCode::kFailedPrecondition) << lr;
  EXPECT_NE(lr.message().find("before the backward"), std::string::npos) << lr;
  std::vector<float> flat(e->layout(1).numel);
  EXPECT_EQ(e->GatherMasterParams(1, flat).code(), StatusCode::kFailedPrecondition);
  Result<StepOutcome> out = e->Step();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_DOUBLE_EQ(out->lr, BaseConfig().optimizer.lr);
  // After step() both are fine again; the new rate is the next step's.
  EXPECT_TRUE(e->set_lr(0.5).ok());
  EXPECT_TRUE(e->GatherMasterParams(1, flat).ok());
  ASSERT_TRUE(EngineMicroStep(*e, Seq(1), MakeBatch(1)).ok());
  out = e->Step();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_DOUBLE_EQ(out->lr, 0.5);
}

TEST(EarlyStepTest, ACoreConfigThatCannotStepEarlyIsRefusedAtCreate) {
  Config c = EarlyConfig(true);
  c.gradient_clipping = 1.0;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find("strata.early_step"), std::string::npos) << e.status();
}

// ---- The norm in the backward (strata.norm_in_backward) --------------------------------

// Clipping on, inf/NaN steps skipped: not an early step, yet the norm is summed during the
// boundary backward (on by default).
Config NormConfig(bool on) {
  Config c = EarlyConfig(false);
  c.strata.skip_inf_nan_steps = true;
  c.gradient_clipping = 0.05;  // the toy's norms are larger: every step is clipped
  c.strata.norm_in_backward = on;
  // Sub-groups (and so norm tiles) of 10 elements: some lie inside layer3's 30, so its
  // tiles are final as soon as it is.
  c.zero.sub_group_size = 10;
  return c;
}

TEST(NormInBackwardTest, ALayersNormIsSummedBeforeTheBackwardReachesTheLastGroup) {
  const LatchRun run = RunWithLatch(NormConfig(true), std::chrono::seconds(30), /*on_norm=*/true);
  EXPECT_TRUE(run.updated_before_layer1)
      << "layer3's norm tiles were not summed while the backward went on to layer1";
  EXPECT_EQ(run.timeouts, 0);
  EXPECT_EQ(run.norms_in_backward, 3u);
  EXPECT_GT(run.tiles_in_background, 0u);
  EXPECT_EQ(run.early_steps, 0u);
}

TEST(NormInBackwardTest, ControlWithItOffNothingIsSummedDuringTheBackward) {
  const LatchRun run =
      RunWithLatch(NormConfig(false), std::chrono::milliseconds(500), /*on_norm=*/true);
  EXPECT_FALSE(run.updated_before_layer1);
  EXPECT_EQ(run.timeouts, 1);
  EXPECT_EQ(run.norms_in_backward, 0u);
  EXPECT_EQ(run.tiles_in_background, 0u);
}

std::function<void(Config&)> Clipped(bool norm_in_backward) {
  return [norm_in_backward](Config& c) {
    c.gradient_clipping = 0.05;
    c.strata.norm_in_backward = norm_in_backward;
  };
}

class NormInBackwardBitIdenticalTest : public ::testing::TestWithParam<Variant> {};

TEST_P(NormInBackwardBitIdenticalTest, ClippedStepsWithItOnAndOff) {
  const Variant& v = GetParam();
  for (Mode mode : {Mode::kPlain, Mode::kPipelined}) {
    const std::vector<Trained> off = Train(v, mode, Clipped(false));
    const std::vector<Trained> on = Train(v, mode, Clipped(true));
    ASSERT_EQ(off.size(), static_cast<size_t>(v.world));
    ASSERT_EQ(on.size(), off.size());
    for (size_t r = 0; r < on.size(); ++r) {
      const std::string what = std::string(mode == Mode::kPlain ? "plain" : "pipelined") +
                               " step, rank " + std::to_string(r);
      ASSERT_EQ(off[r].norms.size(), 5u) << what;
      EXPECT_GT(off[r].norms[0], 0.05) << what << ": the steps must be clipped";
      ExpectTrainedTheSame(on[r], off[r], what);
      EXPECT_EQ(off[r].norms_in_backward, 0u) << what;
      EXPECT_EQ(off[r].tiles_in_background + off[r].tiles_in_step, 0u) << what;
      EXPECT_EQ(on[r].norms_in_backward, 5u) << what;
      EXPECT_EQ(on[r].norms_dropped, 0u) << what;
      EXPECT_GT(on[r].tiles_in_background + on[r].tiles_in_step, 0u) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, NormInBackwardBitIdenticalTest,
                         ::testing::Values(Variant{"fp32_1rank", 1, false},
                                           Variant{"fp32_2ranks", 2, false},
                                           Variant{"bf16_2ranks", 2, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

TEST(NormInBackwardTest, AGroupRunTwiceInTheBackwardDropsTheSumsAndTrainsTheSame) {
  // layer1 runs twice: its first backward ends (its tiles may be summed) before its second
  // adds more gradient, which makes those sums wrong; Step() then sums every tile itself.
  const Variant v{"fp32_1rank", 1, false};
  const std::vector<int> twice = {1, 2, 1, 3};
  const std::vector<Trained> off = Train(v, Mode::kPipelined, Clipped(false), twice);
  const std::vector<Trained> on = Train(v, Mode::kPipelined, Clipped(true), twice);
  ASSERT_EQ(on.size(), 1u);
  ASSERT_EQ(off.size(), 1u);
  EXPECT_EQ(on[0].losses, off[0].losses);
  EXPECT_EQ(on[0].norms, off[0].norms);
  EXPECT_TRUE(BitEqual(on[0].params, off[0].params));
  EXPECT_EQ(on[0].norms_in_backward, 5u);
  EXPECT_GT(on[0].norms_dropped, 0u);
}

// ---- The norm as written ---------------------------------------------------------------

// The gradient norm's tiles summed as the boundary micro-step's reduced gradients are
// written into zeroed accumulators (OptimizerDriverOptions::norm_as_written): the same
// norms, losses and parameters as reading every tile back, in each step mode (the plain
// and pipelined steps clipped, with the norm in the backward on and off; the early step),
// 1 and 2 ranks, fp32 and bf16. With one micro-step a step, tiles are summed as written
// (none with it off); with two summed on the device (strata.accumulate_on_device), the
// same: the host's accumulators receive the two micro-steps' sum in one write; with two
// summed on the host, none either way (the second micro-step adds into the first's tiles);
// with a layer run twice, the tiles it adds into again are read back (the toy's 4 chunks
// of 40 elements are one tile each; layer3's [112, 160) holds one whole).
struct AsWrittenCase {
  const char* name;
  Mode mode;
  bool norm_in_backward;
  int gas;
  std::vector<int> seq;  // empty: Seq
  bool on_device = true;
};

class NormAsWrittenTest : public ::testing::TestWithParam<Variant> {};

TEST_P(NormAsWrittenTest, TheTilesSummedAsWrittenAreTheTilesReadBack) {
  const Variant& v = GetParam();
  for (const AsWrittenCase& k :
       {AsWrittenCase{"plain", Mode::kPlain, false, 1, {}},
        AsWrittenCase{"plain, norm in backward", Mode::kPlain, true, 1, {}},
        AsWrittenCase{"pipelined", Mode::kPipelined, true, 1, {}},
        AsWrittenCase{"early", Mode::kEarly, false, 1, {}},
        AsWrittenCase{"two micro-steps", Mode::kPipelined, true, 2, {}},
        AsWrittenCase{"two micro-steps summed on the host", Mode::kPipelined, true, 2, {}, false},
        AsWrittenCase{"layer3 twice", Mode::kPipelined, true, 1, {1, 2, 3, 3}}}) {
    SCOPED_TRACE(k.name);
    auto tweak = [&k](Config& c) {
      if (k.mode != Mode::kEarly) c.gradient_clipping = 0.05;  // the norm decides the step
      c.strata.norm_in_backward = k.norm_in_backward;
      c.gradient_accumulation_steps = k.gas;
      c.strata.accumulate_on_device = k.on_device;
    };
    const std::vector<Trained> off = Train(v, k.mode, tweak, k.seq, /*norm_as_written=*/false);
    const std::vector<Trained> on = Train(v, k.mode, tweak, k.seq, /*norm_as_written=*/true);
    ASSERT_EQ(off.size(), static_cast<size_t>(v.world));
    ASSERT_EQ(on.size(), off.size());
    for (size_t r = 0; r < on.size(); ++r) {
      const std::string what = "rank " + std::to_string(r);
      ASSERT_EQ(off[r].norms.size(), k.gas == 1 ? 10u : 5u) << what;
      if (k.mode != Mode::kEarly) {
        EXPECT_GT(off[r].norms[0], 0.05) << what << ": the steps must be clipped";
      }
      ExpectTrainedTheSame(on[r], off[r], what);
      EXPECT_EQ(off[r].tiles_as_written, 0u) << what;
      // (Summed on the device with a 16-bit working dtype, the toy's sums do not fit its
      // tiny staging buffers whole: they go in pieces that cut its tiles, read back then.)
      if ((k.gas == 1 || (k.on_device && !v.bf16)) && k.seq.empty()) {
        EXPECT_GT(on[r].tiles_as_written, 0u) << what;
      } else if (k.gas == 2 && !k.on_device) {
        EXPECT_EQ(on[r].tiles_as_written, 0u) << what;
      }
      // Summed as written, the tiles are not read again (by the background or step()).
      if ((k.mode == Mode::kEarly || k.norm_in_backward) && k.seq.empty()) {
        EXPECT_EQ(on[r].tiles_in_background + on[r].tiles_in_step + on[r].tiles_as_written,
                  off[r].tiles_in_background + off[r].tiles_in_step)
            << what;
      }
    }
    if (!k.seq.empty()) {  // layer3's second gradient went into a tile summed as written
      EXPECT_LT(on[0].tiles_as_written, Train(v, k.mode, tweak, {}, true)[0].tiles_as_written);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, NormAsWrittenTest,
                         ::testing::Values(Variant{"fp32_1rank", 1, false},
                                           Variant{"fp32_2ranks", 2, false},
                                           Variant{"bf16_2ranks", 2, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

TEST(NormInBackwardTest, AnInfGradientSkipsTheStepAsWithoutIt) {
  for (bool on : {false, true}) {
    std::unique_ptr<EngineCore> e = MakeEngine(NormConfig(on), SingleRank(), InitialParams());
    ASSERT_NE(e, nullptr);
    auto tamper = [](int g, int i, std::vector<float>& grad) {
      if (g == 3 && i == 1) grad[0] = std::numeric_limits<float>::infinity();
    };
    ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0), tamper).ok());
    Result<StepOutcome> out = e->Step();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(out->overflow) << on;
    EXPECT_FALSE(out->applied) << on;
    const EngineStats s = e->stats();
    EXPECT_EQ(s.optimizer.steps_skipped, 1u) << on;
    EXPECT_EQ(s.optimizer.norms_in_backward, on ? 1u : 0u);
    // The skipped step's gradients are gone: the next step trains from finite values.
    ASSERT_TRUE(EngineMicroStep(*e, Seq(1), MakeBatch(1)).ok());
    out = e->Step();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(out->applied) << on;
    EXPECT_TRUE(std::isfinite(out->global_norm)) << on;
  }
}

// ---- The reduced shards added on the reducer's thread ----------------------------------
// strata.accumulate_in_background (on by default): the device->host copy of each bucket's
// reduced shards is waited for and the shards added into the accumulators on the reducer's
// thread, while the engine's thread goes on with the backward.

std::function<void(Config&)> Background(bool on, bool clipped = false) {
  return [on, clipped](Config& c) {
    c.strata.accumulate_in_background = on;
    // Every micro-step's shards added on the host (with accumulate_on_device only the
    // boundary's reach it: DeviceAccumulationTest.BitIdenticalToHostAccumulation/
    // OnTheBackwardsThread compares the two there).
    c.strata.accumulate_on_device = false;
    if (clipped) c.gradient_clipping = 0.05;  // the norm in the backward too
  };
}

class AccumulateInBackgroundTest : public ::testing::TestWithParam<Variant> {};

TEST_P(AccumulateInBackgroundTest, BitIdenticalOnAndOffInEveryStepMode) {
  const Variant& v = GetParam();
  struct Case {
    Mode mode;
    bool clipped;
    const char* name;
  };
  for (const Case& k :
       {Case{Mode::kPlain, false, "plain"}, Case{Mode::kPipelined, true, "pipelined, clipped"},
        Case{Mode::kEarly, false, "early"}}) {
    const std::vector<Trained> off = Train(v, k.mode, Background(false, k.clipped));
    const std::vector<Trained> on = Train(v, k.mode, Background(true, k.clipped));
    ASSERT_EQ(off.size(), static_cast<size_t>(v.world));
    ASSERT_EQ(on.size(), off.size());
    for (size_t r = 0; r < on.size(); ++r) {
      const std::string what = std::string(k.name) + " step, rank " + std::to_string(r);
      ASSERT_EQ(off[r].norms.size(), 5u) << what;
      ExpectTrainedTheSame(on[r], off[r], what);
      EXPECT_EQ(off[r].accumulated_in_background, 0u) << what;
      // One layer per bucket: every backward reduces several buckets, all on the thread.
      EXPECT_GE(on[r].accumulated_in_background, 10u * 3) << what;
      if (k.mode == Mode::kEarly) {
        EXPECT_EQ(on[r].early, 5u) << what;
      }
      if (k.clipped) {
        EXPECT_EQ(on[r].norms_in_backward, 5u) << what;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, AccumulateInBackgroundTest,
                         ::testing::Values(Variant{"fp32_1rank", 1, false},
                                           Variant{"bf16_2ranks", 2, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

// With one layer per bucket, layer3's bucket is reduced as soon as its last gradient
// arrived (it is exactly full) and needed again when layer2's is. On the reducer's thread
// its shards are added while the backward goes on: the test holds that addition until the
// backward has gathered layer2, which it reaches without waiting for it (a latch the
// engine's thread cannot pass would hang here). On the engine's own thread (the control)
// the addition runs there, at layer2's last gradient.
struct AddedShards {
  bool on_engine_thread = true;
  int timeouts = 0;
  uint64_t in_background = 0;
};

AddedShards AddLayer3AfterLayer2IsGathered(bool background) {
  Config c = EarlyConfig(false);
  c.strata.accumulate_in_background = background;
  std::mutex mu;
  std::condition_variable cv;
  bool reached_layer2 = false;
  bool held = false;
  AddedShards out;
  const std::thread::id engine_thread = std::this_thread::get_id();
  std::atomic<int> step{0};
  EngineOptions o = TestOptions();
  o.test.reducer.before_adding_shards = [&](int group) {
    if (step.load() != 1 || group != 3) return;
    std::unique_lock<std::mutex> lock(mu);
    if (held) return;
    held = true;
    out.on_engine_thread = std::this_thread::get_id() == engine_thread;
    if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return reached_layer2; })) {
      ++out.timeouts;
    }
  };
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  EXPECT_NE(e, nullptr);
  if (e == nullptr) return out;
  for (int s = 0; s < 3; ++s) {
    step = s;
    auto gathered = [&](int g, Phase phase) {
      if (s != 1 || phase != Phase::kBackward || g != 2) return;
      std::lock_guard<std::mutex> lock(mu);
      reached_layer2 = true;
      cv.notify_all();
    };
    Result<double> loss = EngineMicroStep(*e, Seq(s), MakeBatch(s), {}, gathered);
    EXPECT_TRUE(loss.ok()) << loss.status();
    Result<StepOutcome> res = e->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!loss.ok() || !res.ok()) return out;
  }
  EXPECT_TRUE(held) << "layer3's bucket was never added in step 1";
  out.in_background = e->stats().reducer.buckets_accumulated_in_background;
  return out;
}

TEST(AccumulateInBackgroundTest, TheBackwardGoesOnWhileAShardIsAdded) {
  const AddedShards run = AddLayer3AfterLayer2IsGathered(true);
  EXPECT_FALSE(run.on_engine_thread);
  EXPECT_EQ(run.timeouts, 0);
  EXPECT_GT(run.in_background, 0u);
}

TEST(AccumulateInBackgroundTest, ControlOffTheShardsAreAddedOnTheEnginesThread) {
  const AddedShards run = AddLayer3AfterLayer2IsGathered(false);
  EXPECT_TRUE(run.on_engine_thread);
  EXPECT_EQ(run.timeouts, 0);
  EXPECT_EQ(run.in_background, 0u);
}

// ---- Lazy zeroing ----------------------------------------------------------------------
// With the states in host memory a step leaves its spent gradients in the accumulators and
// the next backward writes over them (OptimizerDriverOptions::lazy_zero). Layer 3 gets no
// gradient in every other step (both micro-steps): there the gradients its accumulators
// kept from the step before must read as zero to every reader — Step()'s norm and update,
// the norm in the backward, an early step's worker — as with zeroing.

std::vector<int> Layer3EveryOtherStep(int micro) {
  return (micro / 2) % 2 == 1 ? std::vector<int>{1, 2} : std::vector<int>{1, 2, 3};
}

class LazyZeroTest : public ::testing::TestWithParam<Variant> {};

TEST_P(LazyZeroTest, BitIdenticalToZeroingWithALayerLeftOutEveryOtherStep) {
  const Variant& v = GetParam();
  struct Case {
    Mode mode;
    bool clipped;
    bool norm_in_backward;
    const char* name;
    bool lamb = false;
  };
  for (const Case& k : {Case{Mode::kPlain, false, false, "plain, the norm in Step()"},
                        Case{Mode::kPlain, true, true, "LAMB, clipped", true},
                        Case{Mode::kPipelined, true, false, "pipelined, clipped in Step()"},
                        Case{Mode::kPipelined, true, true, "pipelined, clipped in the backward"},
                        Case{Mode::kEarly, false, false, "early"}}) {
    const auto tweak = [&k](Config& c) {
      if (k.clipped) c.gradient_clipping = 0.05;
      c.strata.norm_in_backward = k.norm_in_backward;
      if (k.lamb) c.optimizer.type = OptimizerType::kLamb;
    };
    const std::vector<Trained> off =
        Train(v, k.mode, tweak, {}, true, /*lazy_zero=*/false, Layer3EveryOtherStep);
    const std::vector<Trained> on =
        Train(v, k.mode, tweak, {}, true, /*lazy_zero=*/true, Layer3EveryOtherStep);
    ASSERT_EQ(off.size(), static_cast<size_t>(v.world));
    ASSERT_EQ(on.size(), off.size());
    for (size_t r = 0; r < on.size(); ++r) {
      const std::string what = std::string(k.name) + " step, rank " + std::to_string(r);
      ASSERT_EQ(off[r].norms.size(), 5u) << what;
      ExpectTrainedTheSame(on[r], off[r], what);
      EXPECT_EQ(off[r].zeroed_lazily, 0u) << what;
      EXPECT_EQ(off[r].stale_zeroed, 0u) << what;
      // Every step but the first (whose accumulators were never known zero) left its
      // gradients in place; layer 3's were zeroed in steps 1 and 3 (its shard on this rank).
      EXPECT_GT(on[r].zeroed_lazily, 0u) << what;
      EXPECT_GT(on[r].stale_zeroed, 0u) << what;
      if (k.mode == Mode::kEarly) {
        EXPECT_EQ(on[r].early, 5u) << what;
      }
      EXPECT_EQ(on[r].norms_in_backward, k.norm_in_backward ? 5u : 0u) << what;
      EXPECT_EQ(on[r].norms_dropped, 0u) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LazyZeroTest,
                         ::testing::Values(Variant{"fp32_1rank", 1, false},
                                           Variant{"bf16_2ranks", 2, true}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

}  // namespace
}  // namespace strata::engine

// LrSchedule against rates worked out by hand from DeepSpeed's formulas.
#include "strata/engine/step/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace strata::engine {
namespace {

SchedulerConfig Sched(SchedulerType type, double min_lr, double max_lr, int64_t warmup,
                      WarmupType warmup_type, int64_t total = 0) {
  SchedulerConfig s;
  s.type = type;
  s.warmup_min_lr = min_lr;
  s.warmup_max_lr = max_lr;
  s.warmup_num_steps = warmup;
  s.warmup_type = warmup_type;
  s.total_num_steps = total;
  return s;
}

TEST(LrScheduleTest, NoSchedulerIsTheOptimizersRate) {
  OptimizerConfig opt;
  opt.lr = 3e-4;
  auto s = LrSchedule::Create(SchedulerConfig{}, opt);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(0), 3e-4);
  EXPECT_DOUBLE_EQ(s->LrAt(12345), 3e-4);
}

TEST(LrScheduleTest, WarmupLrLogRisesAsLogOfTheStep) {
  auto s = LrSchedule::Create(Sched(SchedulerType::kWarmupLR, 0.0, 1e-3, 1000, WarmupType::kLog),
                              OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(1), 0.0);             // log(1) = 0
  EXPECT_NEAR(s->LrAt(10), 1e-3 / 3.0, 1e-15);   // log(10) / log(1000)
  EXPECT_NEAR(s->LrAt(100), 2e-3 / 3.0, 1e-15);  // log(100) / log(1000)
  EXPECT_NEAR(s->LrAt(1000), 1e-3, 1e-15);
  EXPECT_DOUBLE_EQ(s->LrAt(1001), 1e-3);  // after warm-up: max
  EXPECT_DOUBLE_EQ(s->LrAt(50001), 1e-3);
  EXPECT_DOUBLE_EQ(s->LrAt(-1), 0.0);
}

TEST(LrScheduleTest, WarmupLrLinearFromMinToMax) {
  auto s = LrSchedule::Create(Sched(SchedulerType::kWarmupLR, 0.1, 0.5, 10, WarmupType::kLinear),
                              OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(1), 0.1);
  EXPECT_NEAR(s->LrAt(6), 0.3, 1e-15);
  EXPECT_DOUBLE_EQ(s->LrAt(11), 0.5);
}

TEST(LrScheduleTest, WarmupStepsBelowTwoAreRaisedToTwo) {
  auto s = LrSchedule::Create(Sched(SchedulerType::kWarmupLR, 0.0, 1.0, 1, WarmupType::kLog),
                              OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(1), 0.0);
  EXPECT_DOUBLE_EQ(s->LrAt(2), 1.0);  // log(2) / log(2)
}

TEST(LrScheduleTest, WarmupDecayLrDecaysLinearlyToZero) {
  auto s = LrSchedule::Create(
      Sched(SchedulerType::kWarmupDecayLR, 0.0, 1.0, 10, WarmupType::kLinear, 20),
      OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(s->LrAt(6), 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(s->LrAt(11), 1.0);
  EXPECT_DOUBLE_EQ(s->LrAt(16), 0.5);
  EXPECT_DOUBLE_EQ(s->LrAt(21), 0.0);
  EXPECT_DOUBLE_EQ(s->LrAt(26), 0.0);  // never negative
}

TEST(LrScheduleTest, WarmupCosineScalesTheOptimizersRate) {
  SchedulerConfig c = Sched(SchedulerType::kWarmupCosineLR, 0, 0, 10, WarmupType::kLinear, 20);
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 0.0;
  OptimizerConfig opt;
  opt.lr = 2.0;
  auto s = LrSchedule::Create(c, opt);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(1), 0.2);  // ratio 0.1
  EXPECT_NEAR(s->LrAt(6), 2.0 * (0.1 + 0.5 * 0.9), 1e-15);
  EXPECT_NEAR(s->LrAt(11), 2.0 * (1 + std::cos(std::numbers::pi / 10)) / 2, 1e-15);
  EXPECT_NEAR(s->LrAt(15), 1.0, 1e-15);  // half-way down the cosine
  EXPECT_NEAR(s->LrAt(20), 0.0, 1e-15);  // cos_min_ratio 0
  c.cos_min_ratio = 0.25;
  auto floor = LrSchedule::Create(c, opt);
  ASSERT_TRUE(floor.ok()) << floor.status();
  EXPECT_NEAR(floor->LrAt(20), 2.0 * 0.25, 1e-15);
  EXPECT_NEAR(floor->LrAt(35), 2.0 * 0.25, 1e-15);  // clamped past total_num_steps
}

TEST(LrScheduleTest, DecayWithoutRoomAfterWarmupIsRefused) {
  auto s =
      LrSchedule::Create(Sched(SchedulerType::kWarmupDecayLR, 0.0, 1.0, 10, WarmupType::kLinear, 5),
                         OptimizerConfig{});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("total_num_steps (5)"), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("warmup_num_steps (10)"), std::string::npos) << s.status();
}

TEST(LrScheduleTest, ResumesAfterLastBatchIteration) {
  SchedulerConfig c = Sched(SchedulerType::kWarmupLR, 0.0, 1.0, 10, WarmupType::kLinear);
  c.last_batch_iteration = 4;
  auto s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->first_iteration(), 5);
  // 5 steps were taken; the next one is step 5, at last_batch_iteration 4 (0.4), as in a
  // run that was never interrupted.
  EXPECT_NEAR(s->LrAt(s->first_iteration()), 0.4, 1e-15);
}

// DeepSpeed steps the scheduler after the optimizer (engine.py, _take_model_step), so step
// i uses the formulas at last_batch_iteration = i - 1, and step 0 the rate each schedule's
// constructor sets.
TEST(LrScheduleTest, StepZeroUsesTheConstructorsRateAndStepIThePreviousIteration) {
  auto warm = LrSchedule::Create(
      Sched(SchedulerType::kWarmupLR, 0.25, 1.0, 10, WarmupType::kLinear), OptimizerConfig{});
  ASSERT_TRUE(warm.ok()) << warm.status();
  EXPECT_DOUBLE_EQ(warm->LrAt(0), 0.25);  // the constructor: warmup_min_lr
  EXPECT_DOUBLE_EQ(warm->LrAt(1), 0.25);  // last_batch_iteration 0: gamma 0
  EXPECT_NEAR(warm->LrAt(2), 0.25 + 0.75 * 0.1, 1e-15);
  SchedulerConfig c = Sched(SchedulerType::kWarmupCosineLR, 0, 0, 10, WarmupType::kLinear, 20);
  c.warmup_min_ratio = 0.1;
  OptimizerConfig opt;
  opt.lr = 2.0;
  auto cosine = LrSchedule::Create(c, opt);
  ASSERT_TRUE(cosine.ok()) << cosine.status();
  EXPECT_DOUBLE_EQ(cosine->LrAt(0), 0.0);  // DeepSpeed's WarmupCosineLR starts at 0
  EXPECT_DOUBLE_EQ(cosine->LrAt(1), 0.2);
  SchedulerConfig oc;
  oc.type = SchedulerType::kOneCycle;
  oc.cycle_min_lr = 0.001;
  oc.cycle_max_lr = 0.01;
  oc.cycle_first_step_size = 4;
  auto cycle = LrSchedule::Create(oc, OptimizerConfig{});
  ASSERT_TRUE(cycle.ok()) << cycle.status();
  EXPECT_DOUBLE_EQ(cycle->LrAt(0), 0.001);
  EXPECT_DOUBLE_EQ(cycle->BetasAt(0)->first, 0.8);  // its constructor sets cycle_min_mom
}

// OneCycle: DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py, OneCycle), worked
// out by hand for a cycle of 4 rising + 6 falling steps (ratio 0.4). Step i is the formula
// at DeepSpeed's last_batch_iteration = i - 1, as for the other schedules.
SchedulerConfig Cycle() {
  SchedulerConfig c;
  c.type = SchedulerType::kOneCycle;
  c.cycle_min_lr = 0.001;
  c.cycle_max_lr = 0.01;
  c.cycle_first_step_size = 4;
  c.cycle_second_step_size = 6;
  c.cycle_min_mom = 0.8;
  c.cycle_max_mom = 0.9;
  return c;
}

TEST(LrScheduleTest, OneCycleRisesFallsAndMovesBeta1TheOtherWay) {
  auto s = LrSchedule::Create(Cycle(), OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  struct Want {
    int64_t i;
    double lr, beta1;
  };
  // scale at last_batch_iteration 0: x = 0.1 -> 0.25; 3: x = 0.4 -> 1; 6: x = 0.7 -> 0.5;
  // 9: x = 0 -> 0 (steps 1, 4, 7, 10).
  for (const Want& w : {Want{1, 0.00325, 0.875}, Want{4, 0.01, 0.8}, Want{7, 0.0055, 0.85},
                        Want{10, 0.001, 0.9}, Want{11, 0.001, 0.9}, Want{501, 0.001, 0.9}}) {
    EXPECT_NEAR(s->LrAt(w.i), w.lr, 1e-15) << "i " << w.i;
    const auto b = s->BetasAt(w.i);
    ASSERT_TRUE(b.has_value());
    EXPECT_NEAR(b->first, w.beta1, 1e-15) << "i " << w.i;
    EXPECT_EQ(b->second, 0.99);  // DeepSpeed sets betas = (momentum, 0.99)
  }
  EXPECT_NE(s->ToString().find("OneCycle"), std::string::npos);
}

TEST(LrScheduleTest, OneCycleDecaysAfterTheCycleAndClimbsStairs) {
  SchedulerConfig c = Cycle();
  c.decay_lr_rate = 0.5;
  c.decay_mom_rate = 0.05;
  c.decay_step_size = 2;
  auto s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  // i = 11: 2 steps after the cycle, d = 2 / 2 = 1.
  EXPECT_NEAR(s->LrAt(12), 0.001 / 1.5, 1e-15);
  EXPECT_NEAR(s->BetasAt(12)->first, 0.9 * 1.05, 1e-15);

  c = Cycle();
  c.cycle_first_stair_count = 2;  // the falling half too (-1: the first's)
  s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  // Rising: position = steps x 2 / 4, floored; falling: (10 - steps) x 2 / 6, floored.
  EXPECT_NEAR(s->LrAt(1), 0.001, 1e-15);   // 0.5 -> 0
  EXPECT_NEAR(s->LrAt(2), 0.0055, 1e-15);  // 1 -> 1/2
  EXPECT_NEAR(s->LrAt(4), 0.01, 1e-15);    // 2 -> 1
  EXPECT_NEAR(s->LrAt(5), 0.0055, 1e-15);  // 5/3 -> 1/2
  EXPECT_NEAR(s->LrAt(9), 0.001, 1e-15);   // 1/3 -> 0

  c = Cycle();
  c.cycle_momentum = false;
  s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->BetasAt(4).has_value());
  c.cycle_first_step_size = 0;
  EXPECT_EQ(LrSchedule::Create(c, OptimizerConfig{}).status().code(), StatusCode::kInvalidArgument);
}

TEST(LrScheduleTest, LrRangeTestGrowsLinearlyOrInStairs) {
  SchedulerConfig c;
  c.type = SchedulerType::kLRRangeTest;
  c.lr_range_test_min_lr = 0.001;
  c.lr_range_test_step_size = 4;
  c.lr_range_test_step_rate = 2.0;
  auto s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(s->LrAt(1), 0.001 * (1 + 2.0 * 0.25), 1e-15);  // interval (0 + 1) / 4
  EXPECT_NEAR(s->LrAt(8), 0.001 * (1 + 2.0 * 2.0), 1e-15);   // 8 / 4
  c.lr_range_test_staircase = true;
  s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(s->LrAt(3), 0.001, 1e-15);        // floor(3 / 4) = 0
  EXPECT_NEAR(s->LrAt(6), 0.001 * 3.0, 1e-15);  // floor(6 / 4) = 1
  EXPECT_FALSE(s->BetasAt(6).has_value());
  c.lr_range_test_step_size = 0;
  EXPECT_EQ(LrSchedule::Create(c, OptimizerConfig{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::engine

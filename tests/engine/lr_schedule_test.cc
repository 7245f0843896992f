// LrSchedule against rates worked out by hand from DeepSpeed's formulas.
#include "strata/engine/lr_schedule.h"

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
  EXPECT_DOUBLE_EQ(s->LrAt(0), 0.0);            // log(1) = 0
  EXPECT_NEAR(s->LrAt(9), 1e-3 / 3.0, 1e-15);   // log(10) / log(1000)
  EXPECT_NEAR(s->LrAt(99), 2e-3 / 3.0, 1e-15);  // log(100) / log(1000)
  EXPECT_NEAR(s->LrAt(999), 1e-3, 1e-15);
  EXPECT_DOUBLE_EQ(s->LrAt(1000), 1e-3);  // after warm-up: max
  EXPECT_DOUBLE_EQ(s->LrAt(50000), 1e-3);
  EXPECT_DOUBLE_EQ(s->LrAt(-1), 0.0);
}

TEST(LrScheduleTest, WarmupLrLinearFromMinToMax) {
  auto s = LrSchedule::Create(Sched(SchedulerType::kWarmupLR, 0.1, 0.5, 10, WarmupType::kLinear),
                              OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(0), 0.1);
  EXPECT_NEAR(s->LrAt(5), 0.3, 1e-15);
  EXPECT_DOUBLE_EQ(s->LrAt(10), 0.5);
}

TEST(LrScheduleTest, WarmupStepsBelowTwoAreRaisedToTwo) {
  auto s = LrSchedule::Create(Sched(SchedulerType::kWarmupLR, 0.0, 1.0, 1, WarmupType::kLog),
                              OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(0), 0.0);
  EXPECT_DOUBLE_EQ(s->LrAt(1), 1.0);  // log(2) / log(2)
}

TEST(LrScheduleTest, WarmupDecayLrDecaysLinearlyToZero) {
  auto s = LrSchedule::Create(
      Sched(SchedulerType::kWarmupDecayLR, 0.0, 1.0, 10, WarmupType::kLinear, 20),
      OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(s->LrAt(5), 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(s->LrAt(10), 1.0);
  EXPECT_DOUBLE_EQ(s->LrAt(15), 0.5);
  EXPECT_DOUBLE_EQ(s->LrAt(20), 0.0);
  EXPECT_DOUBLE_EQ(s->LrAt(25), 0.0);  // never negative
}

TEST(LrScheduleTest, WarmupCosineScalesTheOptimizersRate) {
  SchedulerConfig c = Sched(SchedulerType::kWarmupCosineLR, 0, 0, 10, WarmupType::kLinear, 20);
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 0.0;
  OptimizerConfig opt;
  opt.lr = 2.0;
  auto s = LrSchedule::Create(c, opt);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->LrAt(0), 0.2);  // ratio 0.1
  EXPECT_NEAR(s->LrAt(5), 2.0 * (0.1 + 0.5 * 0.9), 1e-15);
  EXPECT_NEAR(s->LrAt(10), 2.0 * (1 + std::cos(std::numbers::pi / 10)) / 2, 1e-15);
  EXPECT_NEAR(s->LrAt(14), 1.0, 1e-15);  // half-way down the cosine
  EXPECT_NEAR(s->LrAt(19), 0.0, 1e-15);  // cos_min_ratio 0
  c.cos_min_ratio = 0.25;
  auto floor = LrSchedule::Create(c, opt);
  ASSERT_TRUE(floor.ok()) << floor.status();
  EXPECT_NEAR(floor->LrAt(19), 2.0 * 0.25, 1e-15);
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
  EXPECT_NEAR(s->LrAt(s->first_iteration()), 0.5, 1e-15);
}

// OneCycle: DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py, OneCycle), worked
// out by hand for a cycle of 4 rising + 6 falling steps (ratio 0.4). Iteration i uses the
// schedule at DeepSpeed's last_batch_iteration = i, as the other schedules here do.
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
  // scale: i=0: x = 0.1 -> 0.25; i=3: x = 0.4 -> 1; i=6: x = 0.7 -> 0.5; i=9: x = 0 -> 0.
  for (const Want& w : {Want{0, 0.00325, 0.875}, Want{3, 0.01, 0.8}, Want{6, 0.0055, 0.85},
                        Want{9, 0.001, 0.9}, Want{10, 0.001, 0.9}, Want{500, 0.001, 0.9}}) {
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
  EXPECT_NEAR(s->LrAt(11), 0.001 / 1.5, 1e-15);
  EXPECT_NEAR(s->BetasAt(11)->first, 0.9 * 1.05, 1e-15);

  c = Cycle();
  c.cycle_first_stair_count = 2;  // the falling half too (-1: the first's)
  s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  // Rising: position = steps x 2 / 4, floored; falling: (10 - steps) x 2 / 6, floored.
  EXPECT_NEAR(s->LrAt(0), 0.001, 1e-15);   // 0.5 -> 0
  EXPECT_NEAR(s->LrAt(1), 0.0055, 1e-15);  // 1 -> 1/2
  EXPECT_NEAR(s->LrAt(3), 0.01, 1e-15);    // 2 -> 1
  EXPECT_NEAR(s->LrAt(4), 0.0055, 1e-15);  // 5/3 -> 1/2
  EXPECT_NEAR(s->LrAt(8), 0.001, 1e-15);   // 1/3 -> 0

  c = Cycle();
  c.cycle_momentum = false;
  s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->BetasAt(3).has_value());
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
  EXPECT_NEAR(s->LrAt(0), 0.001 * (1 + 2.0 * 0.25), 1e-15);  // interval (0 + 1) / 4
  EXPECT_NEAR(s->LrAt(7), 0.001 * (1 + 2.0 * 2.0), 1e-15);   // 8 / 4
  c.lr_range_test_staircase = true;
  s = LrSchedule::Create(c, OptimizerConfig{});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(s->LrAt(2), 0.001, 1e-15);        // floor(3 / 4) = 0
  EXPECT_NEAR(s->LrAt(5), 0.001 * 3.0, 1e-15);  // floor(6 / 4) = 1
  EXPECT_FALSE(s->BetasAt(5).has_value());
  c.lr_range_test_step_size = 0;
  EXPECT_EQ(LrSchedule::Create(c, OptimizerConfig{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::engine

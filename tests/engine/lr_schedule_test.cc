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

}  // namespace
}  // namespace strata::engine

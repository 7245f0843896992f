// LossScaler against DeepSpeed's DynamicLossScaler rules, traced by hand.
#include "strata/engine/step/loss_scaler.h"

#include <gtest/gtest.h>

namespace strata::engine {
namespace {

Fp16Config Dynamic(int power, int64_t window, int hysteresis) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 0.0;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = 1.0;
  return c;
}

TEST(LossScalerTest, DisabledScalesByOneAndNeverSkips) {
  LossScaler s;
  EXPECT_FALSE(s.enabled());
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);
  EXPECT_FALSE(s.Update(true));
  EXPECT_EQ(s.skipped_steps(), 0);
  EXPECT_FALSE(LossScaler::FromConfig(Fp16Config{}).enabled());
}

TEST(LossScalerTest, DynamicGrowsEveryWindowAndUsesHysteresisBeforeHalving) {
  LossScaler s = LossScaler::FromConfig(Dynamic(4, 3, 2));
  EXPECT_TRUE(s.dynamic());
  EXPECT_DOUBLE_EQ(s.scale(), 16.0);
  EXPECT_FALSE(s.Update(false));  // iteration 0
  EXPECT_FALSE(s.Update(false));  // 1
  EXPECT_DOUBLE_EQ(s.scale(), 16.0);
  EXPECT_FALSE(s.Update(false));  // 2: 3 steps since "overflow -1" -> doubles
  EXPECT_DOUBLE_EQ(s.scale(), 32.0);
  EXPECT_TRUE(s.Update(true));  // 3: hysteresis 2 -> 1, scale kept, step skipped
  EXPECT_DOUBLE_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_TRUE(s.Update(true));  // 4: hysteresis used up -> halves
  EXPECT_DOUBLE_EQ(s.scale(), 16.0);
  EXPECT_EQ(s.skipped_steps(), 2);
  EXPECT_FALSE(s.Update(false));  // 5
  EXPECT_FALSE(s.Update(false));  // 6
  EXPECT_DOUBLE_EQ(s.scale(), 16.0);
  EXPECT_FALSE(s.Update(false));  // 7: 3 steps after the overflow at 4 -> doubles, refills
  EXPECT_DOUBLE_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScalerTest, HysteresisOneHalvesOnTheFirstOverflowButNotBelowMin) {
  Fp16Config c = Dynamic(1, 1000, 1);
  c.min_loss_scale = 1.0;
  LossScaler s = LossScaler::FromConfig(c);
  EXPECT_DOUBLE_EQ(s.scale(), 2.0);
  EXPECT_TRUE(s.Update(true));
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);
  EXPECT_TRUE(s.Update(true));
  EXPECT_DOUBLE_EQ(s.scale(), 1.0);  // min_loss_scale
}

TEST(LossScalerTest, ConsecutiveHysteresisRefillsAfterEveryGoodStep) {
  Fp16Config c = Dynamic(8, 1000, 3);
  c.consecutive_hysteresis = true;
  LossScaler s = LossScaler::FromConfig(c);
  s.Update(true);
  s.Update(true);
  EXPECT_EQ(s.hysteresis_left(), 1);
  s.Update(false);
  EXPECT_EQ(s.hysteresis_left(), 3);
  EXPECT_DOUBLE_EQ(s.scale(), 256.0);
}

TEST(LossScalerTest, StaticScaleSkipsOverflowsWithoutChanging) {
  Fp16Config c;
  c.enabled = true;
  c.loss_scale = 128.0;
  LossScaler s = LossScaler::FromConfig(c);
  EXPECT_FALSE(s.dynamic());
  EXPECT_TRUE(s.Update(true));
  for (int i = 0; i < 5000; ++i)
    EXPECT_FALSE(s.Update(false));
  EXPECT_DOUBLE_EQ(s.scale(), 128.0);
  EXPECT_EQ(s.skipped_steps(), 1);
}

TEST(LossScalerTest, StateRoundTrips) {
  LossScaler a = LossScaler::FromConfig(Dynamic(4, 3, 2));
  a.Update(true);
  a.Update(false);
  LossScaler b = LossScaler::FromConfig(Dynamic(4, 3, 2));
  b.set_state(a.state());
  for (bool o : {false, true, true, false, false, false}) {
    EXPECT_EQ(a.Update(o), b.Update(o));
    EXPECT_DOUBLE_EQ(a.scale(), b.scale());
  }
}

}  // namespace
}  // namespace strata::engine

// LossScaler: fp16 loss scaling with DeepSpeed's semantics
// (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler), driven by the config's
// `fp16` section.
//
// Static (fp16.loss_scale > 0): the scale never changes; an overflow still skips the step.
// Dynamic (fp16.loss_scale == 0): starts at 2^initial_scale_power. After each step:
//   - overflow: if the hysteresis is used up (or hysteresis == 1), the scale halves (not
//     below min_loss_scale); else the hysteresis counts down by one. The step is skipped.
//   - no overflow: with consecutive_hysteresis the hysteresis refills; every
//     loss_scale_window steps since the last overflow the scale doubles (and, without
//     consecutive_hysteresis, the hysteresis refills then).
// bf16 and fp32 training use a disabled scaler: scale 1, never skips.
//
// Thread-safety: not synchronized; the engine calls it from its step.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/config.h"

namespace strata::engine {

class LossScaler {
 public:
  // Disabled: scale 1.
  LossScaler() = default;
  static LossScaler FromConfig(const Fp16Config& fp16);

  bool enabled() const { return enabled_; }
  bool dynamic() const { return dynamic_; }
  double scale() const { return scale_; }
  int hysteresis_left() const { return hysteresis_left_; }
  // Steps skipped because of an overflow so far.
  int64_t skipped_steps() const { return skipped_steps_; }
  // Iterations seen (calls of Update).
  int64_t iterations() const { return iteration_; }

  // Records one optimizer step's outcome; returns true when the step must be skipped.
  bool Update(bool overflow);

  // For checkpoints.
  struct State {
    double scale = 1.0;
    int hysteresis_left = 0;
    int64_t iteration = 0;
    int64_t last_overflow_iteration = -1;
    int64_t skipped_steps = 0;
  };
  State state() const;
  void set_state(const State& state);

  std::string ToString() const;

 private:
  bool enabled_ = false;
  bool dynamic_ = false;
  double scale_ = 1.0;
  double min_scale_ = 1.0;
  int64_t window_ = 1000;
  int hysteresis_ = 2;
  int hysteresis_left_ = 2;
  bool consecutive_hysteresis_ = false;
  int64_t iteration_ = 0;
  int64_t last_overflow_iteration_ = -1;
  int64_t skipped_steps_ = 0;
};

}  // namespace strata::engine

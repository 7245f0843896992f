#include "strata/engine/step/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace strata::engine {

LossScaler LossScaler::FromConfig(const Fp16Config& fp16) {
  LossScaler s;
  if (!fp16.enabled) return s;
  s.enabled_ = true;
  s.dynamic_ = fp16.loss_scale == 0.0;
  s.scale_ = s.dynamic_ ? std::ldexp(1.0, fp16.initial_scale_power) : fp16.loss_scale;
  s.min_scale_ = fp16.min_loss_scale;
  s.window_ = std::max<int64_t>(1, fp16.loss_scale_window);
  s.hysteresis_ = std::max(1, fp16.hysteresis);
  s.hysteresis_left_ = s.hysteresis_;
  s.consecutive_hysteresis_ = fp16.consecutive_hysteresis;
  return s;
}

bool LossScaler::Update(bool overflow) {
  if (!enabled_) {
    ++iteration_;
    return false;
  }
  if (overflow) {
    if (dynamic_) {
      if (hysteresis_ == 1 || hysteresis_left_ <= 1) {
        scale_ = std::max(scale_ / 2.0, min_scale_);
      } else {
        --hysteresis_left_;
      }
    }
    last_overflow_iteration_ = iteration_;
    ++skipped_steps_;
  } else if (dynamic_) {
    if (consecutive_hysteresis_) hysteresis_left_ = hysteresis_;
    if ((iteration_ - last_overflow_iteration_) % window_ == 0) {
      if (!consecutive_hysteresis_) hysteresis_left_ = hysteresis_;
      scale_ *= 2.0;
    }
  }
  ++iteration_;
  return overflow;
}

LossScaler::State LossScaler::state() const {
  return {scale_, hysteresis_left_, iteration_, last_overflow_iteration_, skipped_steps_};
}

void LossScaler::set_state(const State& state) {
  scale_ = state.scale;
  hysteresis_left_ = state.hysteresis_left;
  iteration_ = state.iteration;
  last_overflow_iteration_ = state.last_overflow_iteration;
  skipped_steps_ = state.skipped_steps;
}

std::string LossScaler::ToString() const {
  std::ostringstream os;
  if (!enabled_) return "loss scaling off";
  if (!dynamic_) {
    os << "static loss scale " << scale_;
  } else {
    os << "dynamic loss scale " << scale_ << " (window " << window_ << ", hysteresis "
       << hysteresis_left_ << "/" << hysteresis_ << ", min " << min_scale_ << ")";
  }
  os << ", " << skipped_steps_ << " steps skipped";
  return os.str();
}

}  // namespace strata::engine

#include "strata/engine/step/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>

namespace strata::engine {

namespace {

std::string_view TypeName(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone:
      return "none";
    case SchedulerType::kWarmupLR:
      return "WarmupLR";
    case SchedulerType::kWarmupDecayLR:
      return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR:
      return "WarmupCosineLR";
    case SchedulerType::kOneCycle:
      return "OneCycle";
    case SchedulerType::kLRRangeTest:
      return "LRRangeTest";
  }
  return "?";
}

}  // namespace

Result<LrSchedule> LrSchedule::Create(const SchedulerConfig& scheduler,
                                      const OptimizerConfig& optimizer) {
  LrSchedule s;
  s.scheduler_ = scheduler;
  s.base_lr_ = optimizer.lr;
  s.first_iteration_ = std::max<int64_t>(0, scheduler.last_batch_iteration + 1);
  if (scheduler.type == SchedulerType::kNone) return s;
  if (scheduler.type == SchedulerType::kLRRangeTest) {
    if (scheduler.lr_range_test_step_size < 1) {
      return InvalidArgumentError("scheduler.params.lr_range_test_step_size must be >= 1, got " +
                                  std::to_string(scheduler.lr_range_test_step_size));
    }
    return s;
  }
  if (scheduler.type == SchedulerType::kOneCycle) {
    if (scheduler.cycle_first_step_size < 1 || scheduler.cycle_second_step_size < 0) {
      return InvalidArgumentError(
          "scheduler.params.cycle_first_step_size must be >= 1 and cycle_second_step_size >= 0 "
          "(0: the first's), got " +
          std::to_string(scheduler.cycle_first_step_size) + " and " +
          std::to_string(scheduler.cycle_second_step_size));
    }
    if (s.scheduler_.cycle_second_step_size == 0) {
      s.scheduler_.cycle_second_step_size = scheduler.cycle_first_step_size;
    }
    if (s.scheduler_.cycle_second_stair_count < 0) {
      s.scheduler_.cycle_second_stair_count = scheduler.cycle_first_stair_count;
    }
    return s;
  }
  if (scheduler.warmup_num_steps < 0) {
    return InvalidArgumentError("scheduler.params.warmup_num_steps must be >= 0, got " +
                                std::to_string(scheduler.warmup_num_steps));
  }
  // DeepSpeed: warmup_num_steps = max(2, warmup_num_steps) for every schedule.
  s.scheduler_.warmup_num_steps = std::max<int64_t>(2, scheduler.warmup_num_steps);
  if (scheduler.type == SchedulerType::kWarmupDecayLR ||
      scheduler.type == SchedulerType::kWarmupCosineLR) {
    if (scheduler.total_num_steps <= s.scheduler_.warmup_num_steps) {
      return InvalidArgumentError(
          std::string("scheduler.params.total_num_steps (") +
          std::to_string(scheduler.total_num_steps) + ") must be greater than warmup_num_steps (" +
          std::to_string(s.scheduler_.warmup_num_steps) + ") for " +
          std::string(TypeName(scheduler.type)) +
          ": set total_num_steps to the number of optimizer steps of the run");
    }
  }
  return s;
}

double LrSchedule::WarmupGamma(int64_t i) const {
  const int64_t n = scheduler_.warmup_num_steps;
  if (i >= n) return 1.0;
  if (scheduler_.warmup_type == WarmupType::kLog) {
    return std::log(static_cast<double>(i + 1)) / std::log(static_cast<double>(n));
  }
  return static_cast<double>(i) / static_cast<double>(n);
}

// DeepSpeed's engine steps the scheduler after the optimizer, and a schedule started at
// last_batch_iteration = -1 sets its initial rate in its constructor: the optimizer step of
// iteration i uses the formula at last_batch_iteration = i - 1, and iteration 0 the
// constructor's value.
double LrSchedule::LrAt(int64_t i) const {
  if (scheduler_.type == SchedulerType::kNone) return base_lr_;
  if (i < 0) return 0.0;
  if (i > 0) return Formula(i - 1);
  switch (scheduler_.type) {
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      return scheduler_.warmup_min_lr;
    case SchedulerType::kWarmupCosineLR:
      return 0.0;  // DeepSpeed: "before it has started", 0
    case SchedulerType::kOneCycle:
      return scheduler_.cycle_min_lr;
    case SchedulerType::kLRRangeTest:
      return scheduler_.lr_range_test_min_lr;
    case SchedulerType::kNone:
      break;
  }
  return base_lr_;
}

std::optional<std::pair<double, double>> LrSchedule::BetasAt(int64_t i) const {
  if (i > 0) return BetasFormula(i - 1);
  return BetasFormula(-1);  // OneCycle's constructor: (cycle_min_mom, 0.99)
}

double LrSchedule::CycleScale(int64_t i) const {
  const double first = static_cast<double>(scheduler_.cycle_first_step_size);
  const double second = static_cast<double>(scheduler_.cycle_second_step_size);
  const double total = first + second;
  const double ratio = first / total;
  const int64_t b = i + 1;
  const double cycle = std::floor(1.0 + static_cast<double>(b) / total);
  const double x = 1.0 + static_cast<double>(b) / total - cycle;
  double scale;
  int64_t stairs;
  if (x <= ratio) {
    scale = x / ratio;
    stairs = scheduler_.cycle_first_stair_count;
  } else {
    scale = (x - 1.0) / (ratio - 1.0);
    stairs = scheduler_.cycle_second_stair_count;
  }
  if (stairs > 0) {
    // From the integer position in the cycle, as DeepSpeed quantises it.
    const int64_t in_cycle =
        b % (scheduler_.cycle_first_step_size + scheduler_.cycle_second_step_size);
    const double position =
        in_cycle <= scheduler_.cycle_first_step_size
            ? static_cast<double>(in_cycle) * static_cast<double>(stairs) / first
            : (total - static_cast<double>(in_cycle)) * static_cast<double>(stairs) / second;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

std::optional<std::pair<double, double>> LrSchedule::BetasFormula(int64_t i) const {
  if (scheduler_.type != SchedulerType::kOneCycle || !scheduler_.cycle_momentum)
    return std::nullopt;
  constexpr double kBeta2 = 0.99;  // DeepSpeed's OneCycle sets betas = (momentum, 0.99)
  if (i < 0) return std::make_pair(scheduler_.cycle_min_mom, kBeta2);
  const int64_t total = scheduler_.cycle_first_step_size + scheduler_.cycle_second_step_size;
  if (i < total) {
    const double amplitude = scheduler_.cycle_max_mom - scheduler_.cycle_min_mom;
    return std::make_pair(scheduler_.cycle_max_mom - amplitude * CycleScale(i), kBeta2);
  }
  if (scheduler_.decay_step_size == 0 || scheduler_.decay_mom_rate == 0.0) {
    return std::make_pair(scheduler_.cycle_max_mom, kBeta2);
  }
  const double d =
      static_cast<double>(i - total + 1) / static_cast<double>(scheduler_.decay_step_size);
  return std::make_pair(scheduler_.cycle_max_mom * (1.0 + scheduler_.decay_mom_rate * d), kBeta2);
}

double LrSchedule::Formula(int64_t i) const {
  if (scheduler_.type == SchedulerType::kNone) return base_lr_;
  const double min_lr = scheduler_.warmup_min_lr;
  const double max_lr = scheduler_.warmup_max_lr;
  switch (scheduler_.type) {
    case SchedulerType::kNone:
      return base_lr_;
    case SchedulerType::kLRRangeTest: {
      double interval =
          static_cast<double>(i + 1) / static_cast<double>(scheduler_.lr_range_test_step_size);
      if (scheduler_.lr_range_test_staircase) interval = std::floor(interval);
      return scheduler_.lr_range_test_min_lr *
             (1.0 + scheduler_.lr_range_test_step_rate * interval);
    }
    case SchedulerType::kOneCycle: {
      const int64_t total = scheduler_.cycle_first_step_size + scheduler_.cycle_second_step_size;
      if (i < total) {
        return scheduler_.cycle_min_lr +
               (scheduler_.cycle_max_lr - scheduler_.cycle_min_lr) * CycleScale(i);
      }
      if (scheduler_.decay_step_size == 0 || scheduler_.decay_lr_rate == 0.0) {
        return scheduler_.cycle_min_lr;
      }
      const double d =
          static_cast<double>(i - total + 1) / static_cast<double>(scheduler_.decay_step_size);
      return scheduler_.cycle_min_lr / (1.0 + scheduler_.decay_lr_rate * d);
    }
    case SchedulerType::kWarmupLR:
      return min_lr + (max_lr - min_lr) * WarmupGamma(i);
    case SchedulerType::kWarmupDecayLR: {
      double gamma;
      if (i < scheduler_.warmup_num_steps) {
        gamma = WarmupGamma(i);
      } else {
        const double total = static_cast<double>(scheduler_.total_num_steps);
        const double warm = static_cast<double>(scheduler_.warmup_num_steps);
        gamma = std::max(0.0, (total - static_cast<double>(i)) / std::max(1.0, total - warm));
      }
      return min_lr + (max_lr - min_lr) * gamma;
    }
    case SchedulerType::kWarmupCosineLR: {
      double ratio;
      if (i < scheduler_.warmup_num_steps) {
        ratio = scheduler_.warmup_min_ratio + WarmupGamma(i) * (1.0 - scheduler_.warmup_min_ratio);
      } else {
        const double step = static_cast<double>(i - scheduler_.warmup_num_steps + 1);
        const double total =
            static_cast<double>(scheduler_.total_num_steps - scheduler_.warmup_num_steps);
        // Clamped: past total_num_steps the rate stays at cos_min_ratio (DeepSpeed clamps too).
        const double progress = std::min(1.0, step / std::max(1.0, total));
        const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
        ratio = std::max(0.0, scheduler_.cos_min_ratio + (1.0 - scheduler_.cos_min_ratio) * cosine);
      }
      return base_lr_ * ratio;
    }
  }
  return base_lr_;
}

std::string LrSchedule::ToString() const {
  std::ostringstream os;
  os << TypeName(scheduler_.type);
  switch (scheduler_.type) {
    case SchedulerType::kNone:
      os << " (constant lr " << base_lr_ << ")";
      break;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      os << " (" << scheduler_.warmup_min_lr << " -> " << scheduler_.warmup_max_lr << " over "
         << scheduler_.warmup_num_steps << " "
         << (scheduler_.warmup_type == WarmupType::kLog ? "log" : "linear") << " steps";
      if (scheduler_.type == SchedulerType::kWarmupDecayLR) {
        os << ", linear decay to 0 at step " << scheduler_.total_num_steps;
      }
      os << ")";
      break;
    case SchedulerType::kLRRangeTest:
      os << " (from " << scheduler_.lr_range_test_min_lr << ", x(1 + "
         << scheduler_.lr_range_test_step_rate << " per " << scheduler_.lr_range_test_step_size
         << " steps)" << (scheduler_.lr_range_test_staircase ? ", staircase" : "") << ")";
      break;
    case SchedulerType::kOneCycle:
      os << " (" << scheduler_.cycle_min_lr << " -> " << scheduler_.cycle_max_lr << " -> "
         << scheduler_.cycle_min_lr << " over " << scheduler_.cycle_first_step_size << " + "
         << scheduler_.cycle_second_step_size << " steps";
      if (scheduler_.cycle_momentum) {
        os << ", beta1 " << scheduler_.cycle_max_mom << " -> " << scheduler_.cycle_min_mom;
      }
      os << ")";
      break;
    case SchedulerType::kWarmupCosineLR:
      os << " (lr " << base_lr_ << ", warm-up ratio " << scheduler_.warmup_min_ratio
         << " -> 1 over " << scheduler_.warmup_num_steps << " steps, cosine to "
         << scheduler_.cos_min_ratio << " at step " << scheduler_.total_num_steps << ")";
      break;
  }
  return os.str();
}

}  // namespace strata::engine

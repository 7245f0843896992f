// LrSchedule: the learning-rate schedules of the config's `scheduler` section, with
// DeepSpeed's semantics (deepspeed/runtime/lr_schedules.py), so a ds_config.json gives
// the same rates step by step.
//
//   WarmupLR        lr = min + (max - min) * gamma(i)
//   WarmupDecayLR   as WarmupLR during warm-up, then decays linearly to 0 at
//                   total_num_steps
//   WarmupCosineLR  lr = optimizer.lr * ratio(i): warm-up from warmup_min_ratio to 1,
//                   then a cosine from 1 down to cos_min_ratio at total_num_steps
//   LRRangeTest     lr = lr_range_test_min_lr * (1 + step_rate * interval), interval =
//                   (i + 1) / step_size (floored with staircase)
//   OneCycle        one cycle of size F + S (cycle_first/second_step_size): with
//                   b = i + 1 and x = b / (F + S) (within the cycle),
//                   scale = x / r while x <= r = F / (F + S), else (x - 1) / (r - 1);
//                   with a stair count n > 0 for that half the scale is floor(p) / n,
//                   p = n x (steps into the half's side of the cycle) / (its size);
//                   lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale and, with
//                   cycle_momentum, beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom)
//                   * scale and beta2 = 0.99. After the cycle (i >= F + S), with
//                   d = i - (F + S) + 1: lr = cycle_min_lr / (1 + decay_lr_rate * d /
//                   decay_step_size) and beta1 = cycle_max_mom * (1 + decay_mom_rate * d /
//                   decay_step_size) (no decay when the step size or the rate is 0)
// where gamma(i) during warm-up (i < warmup_num_steps) is log(i + 1) / log(warmup_num_steps)
// ("log"; warmup_num_steps is raised to at least 2, as DeepSpeed does) or
// i / warmup_num_steps ("linear"), and 1 after it.
//
// Iterations count optimizer steps from 0: LrAt(i) is the rate of step i, as DeepSpeed's
// engine applies it: it steps the scheduler after each optimizer step, so step i uses the
// formulas below at last_batch_iteration = i - 1 (i - 1 in place of i in them), and step 0
// the rate the schedule's constructor sets (WarmupLR/WarmupDecayLR: warmup_min_lr;
// WarmupCosineLR: 0; OneCycle: cycle_min_lr with beta1 = cycle_min_mom; LRRangeTest:
// lr_range_test_min_lr). The formulas are written for i = last_batch_iteration. The
// schedule is a pure function of the iteration; the engine keeps the iteration (the
// config's last_batch_iteration + 1 at start, for resuming) and may override the rate
// (Engine::set_lr), which then holds until the next schedule step.
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "strata/core/config.h"
#include "strata/core/status.h"

namespace strata::engine {

class LrSchedule {
 public:
  // No scheduler: the optimizer's lr at every step.
  LrSchedule() = default;
  // InvalidArgument for a schedule DeepSpeed would divide by zero on, e.g.
  // WarmupDecayLR/WarmupCosineLR with total_num_steps <= warmup_num_steps.
  static Result<LrSchedule> Create(const SchedulerConfig& scheduler,
                                   const OptimizerConfig& optimizer);

  // The rate for iteration i >= 0 (i < 0: 0, as DeepSpeed).
  double LrAt(int64_t iteration) const;
  // Adam's (beta1, beta2) for iteration i when the schedule sets them (OneCycle with
  // cycle_momentum); nullopt: the optimizer's.
  std::optional<std::pair<double, double>> BetasAt(int64_t iteration) const;
  // The iteration the first step uses: scheduler.last_batch_iteration + 1.
  int64_t first_iteration() const { return first_iteration_; }
  SchedulerType type() const { return scheduler_.type; }
  std::string ToString() const;

 private:
  double Formula(int64_t last_batch_iteration) const;
  std::optional<std::pair<double, double>> BetasFormula(int64_t last_batch_iteration) const;
  double WarmupGamma(int64_t iteration) const;
  double CycleScale(int64_t iteration) const;  // OneCycle, within the cycle

  SchedulerConfig scheduler_;
  double base_lr_ = 1e-3;
  int64_t first_iteration_ = 0;
};

}  // namespace strata::engine

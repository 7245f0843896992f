// The early step: a boundary micro-step's update starts during its backward, a group at a
// time as its gradient is final (optimizer_driver.h, docs/engine.md "The early step").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/step/driver_internal.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/engine/timeline/elapsed.h"
#include "strata/swap/crc32c.h"
namespace strata::engine {

using namespace driver_internal;  // NOLINT(google-build-using-namespace): the driver's own

Status OptimizerDriver::BeginEarlyStep(double lr, std::optional<std::pair<double, double>> betas,
                                       const LossScaler& scaler) {
  if (!CanStepEarly() || scaler.enabled() || options_.gradient_clipping > 0.0) {
    return FailedPreconditionError(
        "the optimizer step cannot start during the backward: it needs Adam, optimizer states "
        "and working shards in memory, no gradient clipping, no fp16 loss scaling and inf/NaN "
        "steps applied (strata.skip_inf_nan_steps false)");
  }
  if (update_ != nullptr || norm_ahead_ != nullptr) {
    return FailedPreconditionError(
        "BeginEarlyStep while a pipelined update or the norm in the backward is in flight");
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<AdamParams> params, AdamParamsAt(lr, betas));
  // What Prepare gives without loss scaling and clipping.
  const GradScaling scaling{static_cast<float>(1.0 / scaler.scale()), 1.0f};
  STRATA_ASSIGN_OR_RETURN(update_, NewUpdate(std::move(params), scaling, /*early=*/true));
  update_->lr = lr;
  early_collecting_ = true;
  return Status::Ok();
}

Status OptimizerDriver::ReleaseGroup(int group) {
  if (update_ == nullptr || !early_collecting_) {
    return FailedPreconditionError("ReleaseGroup outside an early step");
  }
  if (!GroupReleased(group)) ++stats_.groups_released_in_backward;
  return Give(*update_, group);
}

bool OptimizerDriver::GroupReleased(int group) const {
  return update_ != nullptr && group >= 0 && static_cast<size_t>(group) < update_->given.size() &&
         update_->given[static_cast<size_t>(group)] != 0;
}

Status OptimizerDriver::ReleaseRemainingGroups(const std::vector<int>& order) {
  if (update_ == nullptr) return Status::Ok();
  for (int g : order)
    STRATA_RETURN_IF_ERROR(Give(*update_, g));
  for (int g = 0; g < static_cast<int>(partition_->groups.size()); ++g)
    STRATA_RETURN_IF_ERROR(Give(*update_, g));
  {
    // The groups given during the backward and not taken yet came in the backward's order,
    // the reverse of the next forward's: the worker takes every group left in `order`, so
    // the forward's first groups are not updated after those it needs last.
    std::vector<size_t> at(partition_->groups.size(), order.size());
    for (size_t k = order.size(); k-- > 0;) {  // a group listed twice: its first place
      if (order[k] >= 0 && static_cast<size_t>(order[k]) < at.size()) {
        at[static_cast<size_t>(order[k])] = k;
      }
    }
    std::lock_guard<std::mutex> lock(update_->mu);
    std::stable_sort(update_->queue.begin(), update_->queue.end(), [&](int a, int b) {
      return at[static_cast<size_t>(a)] < at[static_cast<size_t>(b)];
    });
  }
  CloseUpdate(*update_);
  return Status::Ok();
}

Result<StepOutcome> OptimizerDriver::StepEarly(double lr, LossScaler& scaler) {
  if (update_ == nullptr || !early_collecting_) {
    return FailedPreconditionError("StepEarly without BeginEarlyStep");
  }
  early_collecting_ = false;
  Update& u = *update_;
  if (lr != u.lr) {
    return FailedPreconditionError("the early step's learning rate changed from " +
                                   std::to_string(u.lr) + " to " + std::to_string(lr) +
                                   " after its update started");
  }
  {
    // From here Prepare sums the tiles the worker has not (the worker sums no more).
    std::lock_guard<std::mutex> lock(u.mu);
    u.tiles.taken = true;
  }
  StepOutcome out;
  GradScaling scaling;
  STRATA_ASSIGN_OR_RETURN(const bool update, TimedPrepare(lr, scaler, out, scaling));
  if (!update || scaling.inv_loss_scale != u.scaling.inv_loss_scale ||
      scaling.clip_coef != u.scaling.clip_coef) {
    return InternalError("an early step was skipped or scaled after its update started");
  }
  out.applied = true;
  out.adam_step = u.next_step;
  u.counted = true;
  ++stats_.steps_applied;
  ++stats_.steps_pipelined;
  ++stats_.steps_early;
  stats_.adam_calls += u.items;
  stats_.elements_updated += partition_->partition_numel;
  stats_.params_updated += real_shard_elems_;
  return out;
}

}  // namespace strata::engine

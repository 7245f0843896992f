// StepControl (step_control.h): the step, its counters and its variants as the engine's calls
// drive them.
#include "strata/engine/runtime/step_control.h"

#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "strata/core/logging.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/update_gate.h"
#include "strata/engine/timeline/timeline.h"

namespace strata::engine {

Result<StepControl::Modes> StepControl::ChooseModes(const Config& config,
                                                    const OptimizerDriver& driver) {
  Modes m;
  m.pipeline_step = config.strata.pipeline_step && driver.CanPipeline();
  m.early_step = config.strata.early_step;
  if (m.early_step && (!m.pipeline_step || !driver.CanStepEarly() || config.fp16.enabled ||
                       config.gradient_clipping > 0.0)) {
    // (The configuration's checks name the key at fault; this is for a Config built in code.)
    return FailedPreconditionError(
        "strata.early_step needs strata.pipeline_step true, gradient_clipping 0, fp16 off, "
        "strata.skip_inf_nan_steps false, Adam or AdamW and no NVMe tier; set early_step false "
        "or change those settings");
  }
  m.delayed_update = config.strata.delayed_update;
  m.delayed_warmup = std::max(0, config.strata.delayed_update_warmup);
  if (m.delayed_update && (!m.pipeline_step || m.early_step || driver.can_fail())) {
    // (The configuration's checks name the key at fault; this is for a Config built in code.)
    return FailedPreconditionError(
        "strata.delayed_update needs strata.pipeline_step true, strata.early_step false, Adam "
        "or AdamW and no NVMe tier; set delayed_update false or change those settings");
  }
  m.norm_in_backward =
      config.strata.norm_in_backward && !m.early_step && driver.CanSumNormInBackward();
  return m;
}

StepControl::StepControl(const Config& config, const ModelPartition& partition,
                         OptimizerDriver& driver, ParameterCoordinator& coordinator,
                         GradientReducer& reducer, Placement& placement, UpdateGate& gate,
                         PhaseClock& clock, const Modes& modes)
    : config_(config),
      partition_(partition),
      driver_(driver),
      coordinator_(coordinator),
      reducer_(reducer),
      placement_(placement),
      gate_(gate),
      clock_(clock),
      modes_(modes),
      scaler_(LossScaler::FromConfig(config.fp16)),
      early_ended_(static_cast<size_t>(partition.num_trainable), 0) {}

Result<std::unique_ptr<StepControl>> StepControl::Create(
    const Config& config, const ModelPartition& partition, OptimizerDriver& driver,
    ParameterCoordinator& coordinator, GradientReducer& reducer, Placement& placement,
    UpdateGate& gate, PhaseClock& clock, const Modes& modes) {
  std::unique_ptr<StepControl> s(new StepControl(config, partition, driver, coordinator, reducer,
                                                 placement, gate, clock, modes));
  STRATA_ASSIGN_OR_RETURN(s->schedule_, LrSchedule::Create(config.scheduler, config.optimizer));
  s->lr_iteration_ = s->schedule_.first_iteration();
  return s;
}

void StepControl::BeginForward() {
  void_backward_ = false;  // a new forward
  // After a backward that did not end (an error), the reducer's thread may still be adding
  // its buckets through the driver: nothing else touches the driver before it is done (its
  // error, if any, is returned again by the next reducer call).
  Status waited = reducer_.WaitAccumulations();
  if (norm_collecting_) {
    // The last backward did not end: its norm's sums are of nothing.
    driver_.DropNormInBackward();
    norm_collecting_ = false;
  }
}

Status StepControl::JoinStep(bool flush, Join join) {
  if (gate_.delayed_in_flight() && join == Join::kBackward && reducer_.accumulates_on_device() &&
      !BackwardIsBoundary()) {
    // A delayed update beside a micro-step whose reductions stay on the device: it runs on.
    return flush ? coordinator_.FlushDeferred() : Status::Ok();
  }
  if (early_ == EarlyPhase::kBackward) {
    // The update takes groups as the backward ends them: nothing to complete yet.
    return flush ? coordinator_.FlushDeferred() : Status::Ok();
  }
  if (early_ == EarlyPhase::kReleased) {
    // Every group is given: wait for them (the step is completed after Step()'s norm).
    STRATA_RETURN_IF_ERROR(gate_.OpenAll());
    return flush ? coordinator_.FlushDeferred() : Status::Ok();
  }
  if (driver_.update_in_flight()) {
    const Status opened = gate_.OpenAll();  // (a delayed update without its copy-out: none)
    std::optional<TimedScope> waited;       // a delayed update's wait (the driver times the rest)
    if (gate_.delayed_in_flight()) {
      waited.emplace(delayed_wait_s_, &clock_.timeline(), "delayed update wait",
                     TimelineLane::kWait);
    }
    // States on NVMe: the update's completion is a collective (every rank's I/O outcome is
    // agreed on), so the deferred all-gathers are issued first (coordinator.h).
    const bool agreed = driver_.can_fail();
    const Status flushed = agreed ? coordinator_.FlushDeferred() : Status::Ok();
    const uint64_t failed_before = driver_.stats().steps_failed;
    const Status finished = driver_.FinishUpdate();
    gate_.EndUpdate();
    if (!finished.ok() && agreed && driver_.stats().steps_failed > failed_before) {
      copy_out_pending_ = false;  // rolled back: the working shards match the master again
      return AfterFailedUpdate(finished);
    }
    STRATA_RETURN_IF_ERROR(opened);
    STRATA_RETURN_IF_ERROR(flushed);
    STRATA_RETURN_IF_ERROR(finished);
  }
  if (join == Join::kDrain && copy_out_pending_) STRATA_RETURN_IF_ERROR(CopyOutDelayed());
  return flush ? coordinator_.FlushDeferred() : Status::Ok();
}

Status StepControl::CopyOutDelayed() {
  // Every rank is here at the same point (the next step, a save, a load): the all-gathers
  // of the persistent groups below match.
  copy_out_pending_ = false;
  {
    TimedScope copied(delayed_copy_out_s_, &clock_.timeline(),
                      "delayed update: master -> working shards", TimelineLane::kOptimizer);
    STRATA_RETURN_IF_ERROR(driver_.SyncWorkingFromMaster().WithContext(
        "copying the delayed update's parameters into the working shards"));
  }
  ++delayed_copy_outs_;
  // Outside Step() (a save, a load: the next iteration began, and prefetched from the old
  // shards) nothing may stay gathered: that pass ends here and begins again after the push.
  const bool between_iterations = !backward_since_step_;
  if (between_iterations) STRATA_RETURN_IF_ERROR(coordinator_.EndForwardOnly());
  STRATA_RETURN_IF_ERROR(placement_.PushWorkingShards(/*frozen_too=*/false));
  STRATA_RETURN_IF_ERROR(coordinator_.RegatherPersistent(/*frozen_too=*/false));
  return between_iterations ? coordinator_.BeginIteration() : Status::Ok();
}

Status StepControl::AfterFailedUpdate(Status failed) {
  // Every rank is here (the failure was agreed on), so the collectives below match. The
  // step that failed is not counted; the next one has its learning rate again.
  if (global_steps_ > 0) --global_steps_;
  if (lr_iteration_ > 0) --lr_iteration_;
  Status restored = placement_.PushWorkingShards();
  // A shard read the void forward failed (NVMe) is no error of the next step: the shards
  // were rewritten from the restored states.
  const Status void_read = coordinator_.TakeShardError();
  // The forward since the step read parameters the failed update partly wrote: that pass
  // ends here, nothing stays gathered (a front end's holds are dropped too), and the
  // persistent groups are gathered again from the restored shards.
  if (restored.ok()) restored = coordinator_.AbandonPass();
  if (restored.ok()) restored = coordinator_.RegatherPersistent();
  if (restored.ok()) restored = coordinator_.BeginIteration();
  clock_.Reset();
  void_backward_ = true;  // until a new forward: the rest of this backward is refused
  std::string msg = failed.message() +
                    "; the forward run since that step used partly updated parameters: its "
                    "loss and this iteration are void (the engine is ready for a new forward)";
  if (!restored.ok()) msg += " (restoring the engine failed too: " + restored.ToString() + ")";
  return Status(failed.code(), msg);
}

void StepControl::KeepShardError() {
  Status error = coordinator_.TakeShardError();
  if (!error.ok()) driver_.KeepIoError(std::move(error));
}

Status StepControl::MaybeBeginEarlyStep() {
  // (Called as every backward call begins.) The reduced gradients of the boundary micro-
  // step are the last before Step(): only then are the norm's tiles summed as written.
  const bool boundary = BackwardIsBoundary();
  driver_.set_boundary_micro_step(boundary);
  reducer_.set_boundary(boundary);
  if (early_ != EarlyPhase::kNone || norm_collecting_ || backward_since_step_ || !boundary) {
    return Status::Ok();
  }
  if (!modes_.early_step && !modes_.norm_in_backward) return Status::Ok();
  // The leases below are the driver's: the reducer's thread must be done with a backward
  // that did not end (it is idle after every EndBackward).
  STRATA_RETURN_IF_ERROR(reducer_.WaitAccumulations());
  if (!modes_.early_step) {
    // The boundary micro-step's backward: the gradient norm is summed as groups become
    // final (strata.norm_in_backward), by a thread of the driver.
    STRATA_RETURN_IF_ERROR(driver_.BeginNormInBackward().WithContext(
        "summing the gradient norm during the backward (strata.norm_in_backward)"));
    norm_collecting_ = true;
    std::fill(early_ended_.begin(), early_ended_.end(), 0);
    return Status::Ok();
  }
  // The boundary micro-step's backward: the step's update starts now, with the learning
  // rate and betas Step() would use.
  STRATA_RETURN_IF_ERROR(
      driver_.BeginEarlyStep(lr(), schedule_.BetasAt(lr_iteration_), scaler_)
          .WithContext("starting the optimizer step during the backward (strata.early_step)"));
  early_ = EarlyPhase::kBackward;
  std::fill(early_ended_.begin(), early_ended_.end(), 0);
  return Status::Ok();
}

Status StepControl::ReleaseFinalGroups() {
  // The reducer's thread may be adding other groups' shards through the driver: it waits
  // while the driver is given groups (strata.accumulate_in_background).
  std::unique_lock<std::mutex> held;
  for (int g = 0; g < partition_.num_trainable; ++g) {
    if (early_ended_[static_cast<size_t>(g)] == 0 || reducer_.GroupPending(g)) continue;
    if (!held.owns_lock()) held = reducer_.HoldAccumulation();
    if (norm_collecting_) {
      driver_.NormGroupFinal(g);  // once; nothing once the sums were dropped
      continue;
    }
    if (driver_.GroupReleased(g)) continue;
    STRATA_RETURN_IF_ERROR(driver_.ReleaseGroup(g));
    gate_.Close(g);  // the next fetch waits for its update
  }
  return Status::Ok();
}

// Refused once an early step took group g: its gradient was final.
Status StepControl::RefuseTaken(int group, const char* what) const {
  if (early_ != EarlyPhase::kBackward || group < 0 || group >= partition_.num_trainable ||
      !driver_.GroupReleased(group)) {
    return Status::Ok();
  }
  return FailedPreconditionError(
      std::string(what) + " for group " + partition_.groups[static_cast<size_t>(group)].name +
      " after its backward ended (its PostBackward left it unused) with strata.early_step: its "
      "update already started with the gradient it had then. A front end must give every "
      "gradient of a group before that PostBackward; set strata.early_step false for this "
      "model");
}

Status StepControl::RefuseVoidBackward(const char* what) const {
  if (!void_backward_) return Status::Ok();
  return FailedPreconditionError(
      std::string(what) +
      " in a backward whose forward ran beside an optimizer step that failed (its error was "
      "returned before): that iteration is void; start it again with a new forward");
}

Status StepControl::PreBackward(int group) {
  STRATA_RETURN_IF_ERROR(JoinStep(/*flush=*/true, Join::kBackward));
  STRATA_RETURN_IF_ERROR(MaybeBeginEarlyStep());
  return RefuseTaken(group, "PreBackward");
}

Status StepControl::PostBackward(int group) {
  if ((early_ == EarlyPhase::kBackward || norm_collecting_) && group >= 0 &&
      group < partition_.num_trainable && !coordinator_.InUse(group)) {
    early_ended_[static_cast<size_t>(group)] = 1;
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
  }
  return Status::Ok();
}

Status StepControl::AddGradient(int group, int param, const void* grad, DType dtype,
                                std::shared_ptr<const void> owner) {
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("AddGradient"));
  if (backward_since_step_) {
    return FailedPreconditionError(
        "AddGradient after EndBackward: call Step() before the next backward");
  }
  STRATA_RETURN_IF_ERROR(JoinStep(/*flush=*/true, Join::kBackward));
  if (group >= 0 && group < partition_.num_groups() && partition_.frozen(group)) {
    return FailedPreconditionError("AddGradient: group " +
                                   partition_.groups[static_cast<size_t>(group)].name +
                                   " is frozen (its parameters take no gradient)");
  }
  STRATA_RETURN_IF_ERROR(MaybeBeginEarlyStep());
  STRATA_RETURN_IF_ERROR(RefuseTaken(group, "a gradient"));
  STRATA_RETURN_IF_ERROR(reducer_.AddGradient(group, param, grad, dtype, std::move(owner)));
  // A reduction completed here may have made an ended group's gradient final.
  return early_ == EarlyPhase::kBackward || norm_collecting_ ? ReleaseFinalGroups() : Status::Ok();
}

Status StepControl::RefuseEndBackward() const {
  if (backward_since_step_) {
    return FailedPreconditionError(
        "EndBackward called twice: call Step() after every backward (it applies the "
        "optimizer at gradient-accumulation boundaries)");
  }
  return RefuseVoidBackward("EndBackward");
}

Status StepControl::EndBackward() {
  STRATA_RETURN_IF_ERROR(JoinStep(/*flush=*/true, Join::kBackward));
  // (A backward without gradients set nothing yet: its Flush copies the device's sums to
  // the host when it is the boundary's.)
  reducer_.set_boundary(BackwardIsBoundary());
  STRATA_RETURN_IF_ERROR(reducer_.Flush());
  // The backward's last kernels may still be queued on the compute stream (work after the
  // last gradient hook): the step's re-gather of the persistent groups must not overwrite
  // buffers they read.
  STRATA_RETURN_IF_ERROR(placement_.WaitForBackward());
  STRATA_RETURN_IF_ERROR(coordinator_.EndStep());
  if (early_ == EarlyPhase::kBackward) {
    // Every gradient is in the accumulators: the groups not given yet go now, in the order
    // the next forward uses them.
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
    STRATA_RETURN_IF_ERROR(driver_.ReleaseRemainingGroups(coordinator_.UseOrder()));
    gate_.CloseAll();
    early_ = EarlyPhase::kReleased;
  }
  if (norm_collecting_) {
    // The rest of the norm: every group is final now (Step() sums what is left).
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
    driver_.NormGroupsFinal(coordinator_.UseOrder());
    norm_collecting_ = false;
  }
  return Status::Ok();
}

int64_t StepControl::CountBackward() {
  ++micro_steps_;
  backward_since_step_ = true;
  return micro_steps_;
}

Status StepControl::EndForwardOnly() {
  if (reducer_.pending() || early_open()) {
    return FailedPreconditionError(
        "EndForwardOnly with gradients pending: end a backward with EndBackward");
  }
  // (A delayed update runs on: an evaluation forward reads the working shards as the
  // training forward would.)
  if (gate_.delayed_in_flight()) {
    STRATA_RETURN_IF_ERROR(coordinator_.FlushDeferred());
  } else {
    STRATA_RETURN_IF_ERROR(JoinStep());
  }
  return coordinator_.EndForwardOnly();
}

bool StepControl::IsGradientAccumulationBoundary() const {
  return backward_since_step_ && micro_steps_ % config_.gradient_accumulation_steps == 0;
}

bool StepControl::BackwardIsBoundary() const {
  return (micro_steps_ + 1) % config_.gradient_accumulation_steps == 0;
}

Status StepControl::set_lr(double lr) {
  if (early_open()) {
    return FailedPreconditionError(
        "set_lr(" + std::to_string(lr) +
        ") between the start of a backward and its step() with "
        "strata.early_step: that step's update already runs with learning rate " +
        std::to_string(this->lr()) +
        "; set the learning rate before the backward (or after "
        "step())");
  }
  lr_override_ = lr;
  return Status::Ok();
}

Status StepControl::set_lr_iteration(int64_t iteration) {
  if (iteration < 0) {
    return InvalidArgumentError("the schedule's iteration must be >= 0, got " +
                                std::to_string(iteration));
  }
  if (backward_since_step_) {
    return FailedPreconditionError(
        "setting the schedule's position between a backward and its step(): set it after "
        "step() (or before the first backward)");
  }
  lr_iteration_ = iteration;
  return Status::Ok();
}

double StepControl::lr() const {
  return lr_override_ ? *lr_override_ : schedule_.LrAt(lr_iteration_);
}

double StepControl::LossMultiplier() const {
  return scaler_.scale() / static_cast<double>(config_.gradient_accumulation_steps);
}

void StepControl::Restore(int64_t global_steps, int64_t micro_steps,
                          std::optional<int64_t> lr_iteration,
                          const std::optional<LossScaler::State>& scaler) {
  global_steps_ = global_steps;
  micro_steps_ = micro_steps;
  if (lr_iteration) {
    lr_iteration_ = *lr_iteration;
    lr_override_.reset();
  }
  if (scaler) scaler_.set_state(*scaler);
}

void StepControl::AddStats(EngineStats& s) const {
  s.delayed_update_steps = delayed_steps_;
  s.delayed_copy_outs = delayed_copy_outs_ + s.optimizer.delayed_copy_outs;
  s.delayed_copy_out_s = delayed_copy_out_s_ + s.optimizer.delayed_copy_out_s;
  s.delayed_update_wait_s = delayed_wait_s_;
  s.micro_steps = micro_steps_;
  s.global_steps = global_steps_;
  s.loss_scale = scaler_.scale();
}

Result<StepOutcome> StepControl::Step() {
  if (!backward_since_step_) {
    return FailedPreconditionError(micro_steps_ == 0
                                       ? "Step() before any backward: run a forward and a backward "
                                         "(ending with EndBackward) first"
                                       : "Step() called twice without a backward in between");
  }
  StepOutcome out;
  if (IsGradientAccumulationBoundary()) {
    // Delayed (strata.delayed_update, after its exact warm-up steps): the update writes no
    // working shard and runs on beside the next micro-steps; the last delayed update's
    // parameters are copied into the working shards by this one's worker first, group by
    // group (the next forward waits for each group's copy, as for a pipelined step).
    const bool delayed = modes_.delayed_update && global_steps_ >= modes_.delayed_warmup;
    // (A backward always completed the last step; an early step's update must run on.)
    if (early_ != EarlyPhase::kReleased) {
      STRATA_RETURN_IF_ERROR(JoinStep(true, delayed ? Join::kFinish : Join::kDrain));
    }
    KeepShardError();
    const uint64_t failed_before = driver_.stats().steps_failed;
    const std::optional<std::pair<double, double>> betas = schedule_.BetasAt(lr_iteration_);
    // Pipelined: the update runs on in the background, group by group in the order the
    // next iteration uses the groups (strata.pipeline_step); an early step's began during
    // the backward (strata.early_step): only the norm is left.
    const bool early = early_ == EarlyPhase::kReleased;
    early_ = EarlyPhase::kNone;
    Result<StepOutcome> stepped =
        early                  ? driver_.StepEarly(lr(), scaler_)
        : delayed              ? driver_.StartStep(lr(), scaler_, betas, coordinator_.UseOrder(),
                                                   /*keep_shards=*/true, /*copy_out_first=*/copy_out_pending_)
        : modes_.pipeline_step ? driver_.StartStep(lr(), scaler_, betas, coordinator_.UseOrder())
                               : driver_.Step(lr(), scaler_, betas);
    if (!stepped.ok()) {
      // A failure every rank agreed on (the driver's Step rolled back and rewrote the
      // working shards from the committed master): every rank pushes them to the device and
      // gathers the persistent groups again, so training can go on from the last step.
      if (driver_.stats().steps_failed > failed_before) {
        backward_since_step_ = false;
        Status restored = placement_.PushWorkingShards();
        if (restored.ok()) restored = coordinator_.RegatherPersistent();
        if (!restored.ok()) STRATA_LOG(kWarn) << "after a failed step: " << restored;
      }
      return stepped.status();
    }
    out = *stepped;
    ++global_steps_;
    // A skipped step started no update to copy the last delayed one out: done here.
    if (copy_out_pending_ && !driver_.update_in_flight()) STRATA_RETURN_IF_ERROR(CopyOutDelayed());
    if (out.applied) {
      ++lr_iteration_;
      lr_override_.reset();
      if (delayed && driver_.update_in_flight()) {
        // The working shards stay as they are until the next Step() (or, when this update
        // copies the last one out first, until each group's copy is done).
        gate_.StartDelayed(/*copy_out=*/copy_out_pending_);
        copy_out_pending_ = true;
        ++delayed_steps_;
        if (gate_.copy_out_in_flight()) {
          gate_.CloseAll();
          placement_.CountGroupwisePush();
        }
      } else if (driver_.update_in_flight()) {
        // Each group's shard goes to the device as the forward opens it (UpdateGate::Open;
        // an early step's groups were closed when given, and some may be open again).
        if (!early) gate_.CloseAll();
        placement_.CountGroupwisePush();
      } else {
        STRATA_RETURN_IF_ERROR(placement_.PushWorkingShards(/*frozen_too=*/false));
      }
      // (Pipelined: waits for the persistent groups' updates, which come first. Delayed:
      // the working shards did not change.)
      if (!gate_.delayed_in_flight() || gate_.copy_out_in_flight())
        STRATA_RETURN_IF_ERROR(coordinator_.RegatherPersistent(/*frozen_too=*/false));
    }
  }
  backward_since_step_ = false;
  // Pipelined, nothing is prefetched here: the forward's calls fetch each group once its
  // update is done, and prefetch the next ones as theirs end (the same on every rank: the
  // update is in flight on every rank or on none).
  STRATA_RETURN_IF_ERROR(coordinator_.BeginIteration(!gate_.ForwardWaits()));
  return out;
}

}  // namespace strata::engine

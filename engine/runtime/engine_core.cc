#include "strata/engine/runtime/engine_core.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/placement.h"

namespace strata::engine {

EngineCore::~EngineCore() {
  if (placement_ == nullptr || !placement_->has_copy_stream()) return;
  // No copy may still read the working shards' store when it goes (only a test skips the
  // wait): the coordinator's leases go first, then the copies end.
  coordinator_.reset();
  const Status s = placement_->WaitForCopies();
  if (!s.ok()) STRATA_LOG(kWarn) << "engine: waiting for the shard copies: " << s;
}

std::string EngineCore::device_name() const {
  return placement_->device().name();
}

Status EngineCore::UseComputeStream(void* native) {
  return placement_->device().SetComputeStream(native);
}

Tier* EngineCore::device_tier() const {
  return placement_->device_tier();
}

Tier* EngineCore::host_tier() const {
  return placement_->host_tier();
}

OptimizerDriver& EngineCore::optimizer() {
  const Status joined = JoinStep(/*flush=*/false);
  if (!joined.ok()) STRATA_LOG(kWarn) << "completing the pipelined optimizer step: " << joined;
  return *driver_;
}

bool EngineCore::ShardReady(int group) const {
  // (A delayed update writes no working shard: the forward reads the last step's.)
  return !ForwardWaitsForUpdate() || group < 0 || group >= partition_.num_trainable ||
         step_open_[static_cast<size_t>(group)] != 0 || driver_->GroupUpdated(group);
}

bool EngineCore::ShardStored(int group) const {
  return group < 0 || group >= partition_.num_trainable || driver_->ShardInStore(group);
}

Status EngineCore::OpenShard(int group) {
  if (!ForwardWaitsForUpdate() || group < 0 || group >= partition_.num_trainable ||
      step_open_[static_cast<size_t>(group)] != 0) {
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(driver_->WaitGroup(group));
  step_open_[static_cast<size_t>(group)] = 1;
  return placement_->PushShard(group);
}

Status EngineCore::JoinStep(bool flush, Join join) {
  if (delayed_in_flight_ && join == Join::kBackward && reducer_->accumulates_on_device() &&
      !BackwardIsBoundary()) {
    // A delayed update beside a micro-step whose reductions stay on the device: it runs on.
    return flush ? coordinator_->FlushDeferred() : Status::Ok();
  }
  if (early_ == EarlyPhase::kBackward) {
    // The update takes groups as the backward ends them: nothing to complete yet.
    return flush ? coordinator_->FlushDeferred() : Status::Ok();
  }
  if (early_ == EarlyPhase::kReleased) {
    // Every group is given: wait for them (the step is completed after Step()'s norm).
    for (int g = 0; g < partition_.num_trainable; ++g)
      STRATA_RETURN_IF_ERROR(OpenShard(g));
    return flush ? coordinator_->FlushDeferred() : Status::Ok();
  }
  if (driver_->update_in_flight()) {
    Status opened;
    for (int g = 0; g < partition_.num_trainable && opened.ok(); ++g)
      opened = OpenShard(g);           // (a delayed update without its copy-out: none)
    std::optional<TimedScope> waited;  // a delayed update's wait (the driver times the rest)
    if (delayed_in_flight_)
      waited.emplace(delayed_wait_s_, &clock_->timeline(), "delayed update wait",
                     TimelineLane::kWait);
    // States on NVMe: the update's completion is a collective (every rank's I/O outcome is
    // agreed on), so the deferred all-gathers are issued first (coordinator.h).
    const bool agreed = driver_->can_fail();
    const Status flushed = agreed ? coordinator_->FlushDeferred() : Status::Ok();
    const uint64_t failed_before = driver_->stats().steps_failed;
    const Status finished = driver_->FinishUpdate();
    delayed_in_flight_ = false;
    copy_out_in_flight_ = false;
    if (!finished.ok() && agreed && driver_->stats().steps_failed > failed_before) {
      copy_out_pending_ = false;  // rolled back: the working shards match the master again
      return AfterFailedUpdate(finished);
    }
    STRATA_RETURN_IF_ERROR(opened);
    STRATA_RETURN_IF_ERROR(flushed);
    STRATA_RETURN_IF_ERROR(finished);
  }
  if (join == Join::kDrain && copy_out_pending_) STRATA_RETURN_IF_ERROR(CopyOutDelayed());
  return flush ? coordinator_->FlushDeferred() : Status::Ok();
}

Status EngineCore::CopyOutDelayed() {
  // Every rank is here at the same point (the next step, a save, a load): the all-gathers
  // of the persistent groups below match.
  copy_out_pending_ = false;
  {
    TimedScope copied(delayed_copy_out_s_, &clock_->timeline(),
                      "delayed update: master -> working shards", TimelineLane::kOptimizer);
    STRATA_RETURN_IF_ERROR(driver_->SyncWorkingFromMaster().WithContext(
        "copying the delayed update's parameters into the working shards"));
  }
  ++delayed_copy_outs_;
  // Outside Step() (a save, a load: the next iteration began, and prefetched from the old
  // shards) nothing may stay gathered: that pass ends here and begins again after the push.
  const bool between_iterations = !backward_since_step_;
  if (between_iterations) STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  STRATA_RETURN_IF_ERROR(placement_->PushWorkingShards(/*frozen_too=*/false));
  STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent(/*frozen_too=*/false));
  return between_iterations ? coordinator_->BeginIteration() : Status::Ok();
}

Status EngineCore::AfterFailedUpdate(Status failed) {
  // Every rank is here (the failure was agreed on), so the collectives below match. The
  // step that failed is not counted; the next one has its learning rate again.
  if (global_steps_ > 0) --global_steps_;
  if (lr_iteration_ > 0) --lr_iteration_;
  Status restored = placement_->PushWorkingShards();
  // A shard read the void forward failed (NVMe) is no error of the next step: the shards
  // were rewritten from the restored states.
  const Status void_read = coordinator_->TakeShardError();
  // The forward since the step read parameters the failed update partly wrote: that pass
  // ends here, nothing stays gathered (a front end's holds are dropped too), and the
  // persistent groups are gathered again from the restored shards.
  if (restored.ok()) restored = coordinator_->AbandonPass();
  if (restored.ok()) restored = coordinator_->RegatherPersistent();
  if (restored.ok()) restored = coordinator_->BeginIteration();
  clock_->Reset();
  void_backward_ = true;  // until a new forward: the rest of this backward is refused
  std::string msg = failed.message() +
                    "; the forward run since that step used partly updated parameters: its "
                    "loss and this iteration are void (the engine is ready for a new forward)";
  if (!restored.ok()) msg += " (restoring the engine failed too: " + restored.ToString() + ")";
  return Status(failed.code(), msg);
}

void EngineCore::KeepShardError() {
  if (coordinator_ == nullptr) return;
  Status error = coordinator_->TakeShardError();
  if (!error.ok()) driver_->KeepIoError(std::move(error));
}

Status EngineCore::PreForward(int group, bool begins_phase) {
  if (begins_phase && clock_->phase() != PhaseClock::Phase::kBackward) {
    void_backward_ = false;  // a new forward
    // After a backward that did not end (an error), the reducer's thread may still be
    // adding its buckets through the driver: nothing else touches the driver before it is
    // done (its error, if any, is returned again by the next reducer call).
    Status waited = reducer_->WaitAccumulations();
    if (norm_collecting_) {
      // The last backward did not end: its norm's sums are of nothing.
      driver_->DropNormInBackward();
      norm_collecting_ = false;
    }
  }
  if (begins_phase) clock_->Enter(PhaseClock::Phase::kForward);
  // A front end's hold right after a pipelined Step() prefetches nothing: a prefetch
  // deferred there would be issued after Step() returned, where the caller may run its own
  // collectives (the same on every rank: the update runs on every rank or on none).
  // (A delayed update defers nothing: the forward does not wait for it.)
  const bool hold_beside_update = !begins_phase && ForwardWaitsForUpdate();
  STRATA_RETURN_IF_ERROR(coordinator_->PreForward(group, /*prefetch=*/!hold_beside_update));
  clock_->OpenSpan(group, 0);
  return Status::Ok();
}
Status EngineCore::PostForward(int group) {
  clock_->CloseSpan(group, 0);
  return coordinator_->PostForward(group);
}
Status EngineCore::MaybeBeginEarlyStep() {
  // (Called as every backward call begins.) The reduced gradients of the boundary micro-
  // step are the last before Step(): only then are the norm's tiles summed as written.
  const bool boundary = BackwardIsBoundary();
  driver_->set_boundary_micro_step(boundary);
  reducer_->set_boundary(boundary);
  if (early_ != EarlyPhase::kNone || norm_collecting_ || backward_since_step_ || !boundary) {
    return Status::Ok();
  }
  if (!early_step_ && !norm_in_backward_) return Status::Ok();
  // The leases below are the driver's: the reducer's thread must be done with a backward
  // that did not end (it is idle after every EndBackward).
  STRATA_RETURN_IF_ERROR(reducer_->WaitAccumulations());
  if (!early_step_) {
    // The boundary micro-step's backward: the gradient norm is summed as groups become
    // final (strata.norm_in_backward), by a thread of the driver.
    STRATA_RETURN_IF_ERROR(driver_->BeginNormInBackward().WithContext(
        "summing the gradient norm during the backward (strata.norm_in_backward)"));
    norm_collecting_ = true;
    std::fill(early_ended_.begin(), early_ended_.end(), 0);
    return Status::Ok();
  }
  // The boundary micro-step's backward: the step's update starts now, with the learning
  // rate and betas Step() would use.
  STRATA_RETURN_IF_ERROR(
      driver_->BeginEarlyStep(lr(), schedule_.BetasAt(lr_iteration_), scaler_)
          .WithContext("starting the optimizer step during the backward (strata.early_step)"));
  early_ = EarlyPhase::kBackward;
  std::fill(early_ended_.begin(), early_ended_.end(), 0);
  return Status::Ok();
}

Status EngineCore::ReleaseFinalGroups() {
  // The reducer's thread may be adding other groups' shards through the driver: it waits
  // while the driver is given groups (strata.accumulate_in_background).
  std::unique_lock<std::mutex> held;
  for (int g = 0; g < partition_.num_trainable; ++g) {
    if (early_ended_[static_cast<size_t>(g)] == 0 || reducer_->GroupPending(g)) continue;
    if (!held.owns_lock()) held = reducer_->HoldAccumulation();
    if (norm_collecting_) {
      driver_->NormGroupFinal(g);  // once; nothing once the sums were dropped
      continue;
    }
    if (driver_->GroupReleased(g)) continue;
    STRATA_RETURN_IF_ERROR(driver_->ReleaseGroup(g));
    step_open_[static_cast<size_t>(g)] = 0;  // the next fetch waits for its update
  }
  return Status::Ok();
}

// Refused once an early step took group g: its gradient was final.
static Status EarlyTaken(const std::string& name, const char* what) {
  return FailedPreconditionError(
      std::string(what) + " for group " + name +
      " after its backward ended (its PostBackward left it unused) with strata.early_step: its "
      "update already started with the gradient it had then. A front end must give every "
      "gradient of a group before that PostBackward; set strata.early_step false for this "
      "model");
}

Status EngineCore::RefuseVoidBackward(const char* what) const {
  if (!void_backward_) return Status::Ok();
  return FailedPreconditionError(
      std::string(what) +
      " in a backward whose forward ran beside an optimizer step that failed (its error was "
      "returned before): that iteration is void; start it again with a new forward");
}

Status EngineCore::PreBackward(int group) {
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("PreBackward"));
  clock_->Enter(PhaseClock::Phase::kBackward);
  STRATA_RETURN_IF_ERROR(JoinStep(/*flush=*/true, Join::kBackward));
  STRATA_RETURN_IF_ERROR(MaybeBeginEarlyStep());
  if (early_ == EarlyPhase::kBackward && group >= 0 && group < partition_.num_trainable &&
      driver_->GroupReleased(group)) {
    return EarlyTaken(layout(group).name, "PreBackward");
  }
  STRATA_RETURN_IF_ERROR(coordinator_->PreBackward(group));
  clock_->OpenSpan(group, 1);
  return Status::Ok();
}
Status EngineCore::PostBackward(int group) {
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("PostBackward"));
  clock_->CloseSpan(group, 1);
  STRATA_RETURN_IF_ERROR(coordinator_->PostBackward(group));
  if ((early_ == EarlyPhase::kBackward || norm_collecting_) && group >= 0 &&
      group < partition_.num_trainable && !coordinator_->InUse(group)) {
    early_ended_[static_cast<size_t>(group)] = 1;
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
  }
  return Status::Ok();
}

Status EngineCore::AddGradient(int group, int param, const void* grad, DType dtype,
                               std::shared_ptr<const void> owner) {
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("AddGradient"));
  if (backward_since_step_) {
    return FailedPreconditionError(
        "AddGradient after EndBackward: call Step() before the next backward");
  }
  STRATA_RETURN_IF_ERROR(JoinStep(/*flush=*/true, Join::kBackward));
  if (group >= 0 && group < num_groups() && frozen(group)) {
    return FailedPreconditionError("AddGradient: group " + layout(group).name +
                                   " is frozen (its parameters take no gradient)");
  }
  STRATA_RETURN_IF_ERROR(MaybeBeginEarlyStep());
  if (early_ == EarlyPhase::kBackward && group >= 0 && group < partition_.num_trainable &&
      driver_->GroupReleased(group)) {
    return EarlyTaken(layout(group).name, "a gradient");
  }
  STRATA_RETURN_IF_ERROR(reducer_->AddGradient(group, param, grad, dtype, std::move(owner)));
  // A reduction completed here may have made an ended group's gradient final.
  return early_ == EarlyPhase::kBackward || norm_collecting_ ? ReleaseFinalGroups() : Status::Ok();
}

Status EngineCore::EndBackward() {
  if (backward_since_step_) {
    return FailedPreconditionError(
        "EndBackward called twice: call Step() after every backward (it applies the "
        "optimizer at gradient-accumulation boundaries)");
  }
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("EndBackward"));
  // A backward whose groups were all left out still ends here.
  clock_->Enter(PhaseClock::Phase::kBackward);
  STRATA_RETURN_IF_ERROR(JoinStep(/*flush=*/true, Join::kBackward));
  // (A backward without gradients set nothing yet: its Flush copies the device's sums to
  // the host when it is the boundary's.)
  reducer_->set_boundary(BackwardIsBoundary());
  STRATA_RETURN_IF_ERROR(reducer_->Flush());
  // The backward's last kernels may still be queued on the compute stream (work after the
  // last gradient hook): the step's re-gather of the persistent groups must not overwrite
  // buffers they read.
  STRATA_RETURN_IF_ERROR(placement_->WaitForBackward());
  STRATA_RETURN_IF_ERROR(coordinator_->EndStep());
  if (early_ == EarlyPhase::kBackward) {
    // Every gradient is in the accumulators: the groups not given yet go now, in the order
    // the next forward uses them.
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
    STRATA_RETURN_IF_ERROR(driver_->ReleaseRemainingGroups(coordinator_->UseOrder()));
    std::fill(step_open_.begin(), step_open_.end(), 0);
    early_ = EarlyPhase::kReleased;
  }
  if (norm_collecting_) {
    // The rest of the norm: every group is final now (Step() sums what is left).
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
    driver_->NormGroupsFinal(coordinator_->UseOrder());
    norm_collecting_ = false;
  }
  clock_->End("backward");
  ++micro_steps_;
  clock_->timeline().set_micro_step(micro_steps_);
  backward_since_step_ = true;
  return Status::Ok();
}

Status EngineCore::EndForwardOnly() {
  if (reducer_->pending() || early_open()) {
    return FailedPreconditionError(
        "EndForwardOnly with gradients pending: end a backward with EndBackward");
  }
  // (A delayed update runs on: an evaluation forward reads the working shards as the
  // training forward would.)
  if (delayed_in_flight_) {
    STRATA_RETURN_IF_ERROR(coordinator_->FlushDeferred());
  } else {
    STRATA_RETURN_IF_ERROR(JoinStep());
  }
  STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  if (clock_->phase() == PhaseClock::Phase::kForward) clock_->End("forward (no backward)");
  return coordinator_->BeginIteration();
}

bool EngineCore::IsGradientAccumulationBoundary() const {
  return backward_since_step_ && micro_steps_ % config_.gradient_accumulation_steps == 0;
}

Status EngineCore::set_lr(double lr) {
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

Status EngineCore::set_lr_iteration(int64_t iteration) {
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

double EngineCore::lr() const {
  return lr_override_ ? *lr_override_ : schedule_.LrAt(lr_iteration_);
}

double EngineCore::LossMultiplier() const {
  return scaler_.scale() / static_cast<double>(config_.gradient_accumulation_steps);
}

Result<StepOutcome> EngineCore::Step() {
  const Timeline::Clock::time_point began = Timeline::Clock::now();
  Result<StepOutcome> out = StepImpl();
  clock_->EndStep(began, out.ok() && out->applied, placement_->device().stats().host_waits);
  return out;
}

Result<StepOutcome> EngineCore::StepImpl() {
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
    const bool delayed = delayed_update_ && global_steps_ >= delayed_warmup_;
    // (A backward always completed the last step; an early step's update must run on.)
    if (early_ != EarlyPhase::kReleased) {
      STRATA_RETURN_IF_ERROR(JoinStep(true, delayed ? Join::kFinish : Join::kDrain));
    }
    KeepShardError();
    const uint64_t failed_before = driver_->stats().steps_failed;
    const std::optional<std::pair<double, double>> betas = schedule_.BetasAt(lr_iteration_);
    // Pipelined: the update runs on in the background, group by group in the order the
    // next iteration uses the groups (strata.pipeline_step); an early step's began during
    // the backward (strata.early_step): only the norm is left.
    const bool early = early_ == EarlyPhase::kReleased;
    early_ = EarlyPhase::kNone;
    Result<StepOutcome> stepped =
        early            ? driver_->StepEarly(lr(), scaler_)
        : delayed        ? driver_->StartStep(lr(), scaler_, betas, coordinator_->UseOrder(),
                                              /*keep_shards=*/true, /*copy_out_first=*/copy_out_pending_)
        : pipeline_step_ ? driver_->StartStep(lr(), scaler_, betas, coordinator_->UseOrder())
                         : driver_->Step(lr(), scaler_, betas);
    if (!stepped.ok()) {
      // A failure every rank agreed on (driver_->Step rolled back and rewrote the working
      // shards from the committed master): every rank pushes them to the device and
      // gathers the persistent groups again, so training can go on from the last step.
      if (driver_->stats().steps_failed > failed_before) {
        backward_since_step_ = false;
        Status restored = placement_->PushWorkingShards();
        if (restored.ok()) restored = coordinator_->RegatherPersistent();
        if (!restored.ok()) STRATA_LOG(kWarn) << "after a failed step: " << restored;
      }
      return stepped.status();
    }
    out = *stepped;
    ++global_steps_;
    // A skipped step started no update to copy the last delayed one out: done here.
    if (copy_out_pending_ && !driver_->update_in_flight()) STRATA_RETURN_IF_ERROR(CopyOutDelayed());
    if (out.applied) {
      ++lr_iteration_;
      lr_override_.reset();
      if (delayed && driver_->update_in_flight()) {
        // The working shards stay as they are until the next Step() (or, when this update
        // copies the last one out first, until each group's copy is done).
        delayed_in_flight_ = true;
        copy_out_in_flight_ = copy_out_pending_;
        copy_out_pending_ = true;
        ++delayed_steps_;
        if (copy_out_in_flight_) {
          step_open_.assign(static_cast<size_t>(partition_.num_trainable), 0);
          placement_->CountGroupwisePush();
        }
      } else if (driver_->update_in_flight()) {
        // Each group's shard goes to the device as the forward opens it (OpenShard; an
        // early step's groups were closed when given, and some may be open again).
        if (!early) step_open_.assign(static_cast<size_t>(partition_.num_trainable), 0);
        placement_->CountGroupwisePush();
      } else {
        STRATA_RETURN_IF_ERROR(placement_->PushWorkingShards(/*frozen_too=*/false));
      }
      // (Pipelined: waits for the persistent groups' updates, which come first. Delayed:
      // the working shards did not change.)
      if (!delayed_in_flight_ || copy_out_in_flight_)
        STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent(/*frozen_too=*/false));
    }
  }
  backward_since_step_ = false;
  // Pipelined, nothing is prefetched here: the forward's calls fetch each group once its
  // update is done, and prefetch the next ones as theirs end (the same on every rank: the
  // update is in flight on every rank or on none).
  STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration(!ForwardWaitsForUpdate()));
  return out;
}

Status EngineCore::AgreeOnLoadCheck(const Status& local_check, const std::string& what) {
  // 16 KiB per rank: a check lists names (up to 20 of each kind).
  STRATA_ASSIGN_OR_RETURN(Outcomes checked,
                          AgreeOnOutcomes(*host_comm_, local_check, {}, size_t{16} << 10));
  // Nothing stays gathered (prefetches in flight are waited for): the groups gathered
  // after the load see the new values. This ends the pass the front end's calls began, on
  // the failed path too, so the next iteration starts the same way on every rank.
  STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  if (checked.any_failed) {
    STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
    return Status(checked.code, OutcomeStatus(checked, what).message() + "; nothing was changed");
  }
  return Status::Ok();
}

namespace {
// "loading" -> "load": WriteParameters' messages.
std::string Infinitive(const std::string& verb) {
  if (verb == "setting") return "set";
  if (verb == "assembling") return "assemble";
  return "load";
}
}  // namespace

Status EngineCore::LoadParameters(const Status& local_check, const ParamReader& read,
                                  const std::function<bool(int group, size_t param)>& only) {
  return WriteParameters("loading", local_check, nullptr, read, only);
}

Status EngineCore::WriteParameters(const std::string& verb, const Status& local_check,
                                   const std::function<Status(Status& local)>& prepare,
                                   const ParamReader& read,
                                   const std::function<bool(int group, size_t param)>& only) {
  if (backward_since_step_ || early_open() || reducer_->pending() ||
      micro_steps_ % config_.gradient_accumulation_steps != 0) {
    return FailedPreconditionError(
        verb + " parameters between a backward and its step: " + Infinitive(verb) +
        " them before training or right after step()");
  }
  STRATA_RETURN_IF_ERROR(JoinStep(true, Join::kDrain));
  STRATA_RETURN_IF_ERROR(
      AgreeOnLoadCheck(local_check, "checking the parameters to " + Infinitive(verb)));
  Status local;
  if (prepare) STRATA_RETURN_IF_ERROR(prepare(local));
  std::vector<float> buffer;
  constexpr size_t kPiece = size_t{1} << 20;
  for (int g = 0; g < num_groups() && local.ok(); ++g) {
    const GroupLayout& l = layout(g);
    const size_t shard = partition_.shard_offset[static_cast<size_t>(g)];
    for (size_t i = 0; i < l.params.size() && local.ok(); ++i) {
      if (only && !only(g, i)) continue;
      const std::optional<ShardSlice> s = l.Slice(i, partition_.rank);
      if (!s) continue;
      for (size_t done = 0; done < s->count && local.ok();) {
        const size_t count = std::min(kPiece, s->count - done);
        buffer.resize(count);
        local = read(g, i, s->param_offset + done, buffer);
        if (local.ok()) {
          // A frozen group's values go straight to its working shard.
          local = frozen(g) ? placement_->WriteFrozen(g, s->shard_offset + done, buffer)
                            : driver_->WriteMaster(shard + s->shard_offset + done, buffer);
        }
        done += count;
      }
    }
  }
  // Agreed on every rank, so every rank goes on into the collectives below either way: the
  // groups gathered again hold what the master holds now.
  const Status committed = driver_->CommitMasterAgreed(local, verb + " parameters");
  STRATA_RETURN_IF_ERROR(placement_->PushWorkingShards());
  STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent());
  STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
  return committed;
}

Status EngineCore::SetParameters(const Status& local_check, int source,
                                 const std::vector<std::pair<int, size_t>>& which,
                                 const std::vector<std::span<float>>& values) {
  Status check = local_check;
  if (check.ok() && (source < 0 || source >= world_size())) {
    check = InvalidArgumentError("SetParameters: source rank " + std::to_string(source) + " of " +
                                 std::to_string(world_size()));
  }
  if (check.ok() && which.size() != values.size()) {
    check = InvalidArgumentError("SetParameters: " + std::to_string(which.size()) +
                                 " parameters, " + std::to_string(values.size()) + " values");
  }
  std::map<std::pair<int, size_t>, size_t> index;
  for (size_t k = 0; k < which.size() && check.ok(); ++k) {
    const auto [g, i] = which[k];
    if (g < 0 || g >= num_groups() || i >= layout(g).params.size()) {
      check = InvalidArgumentError("SetParameters: no parameter " + std::to_string(i) +
                                   " in group " + std::to_string(g));
    } else if (values[k].size() != layout(g).params[i].numel) {
      check = InvalidArgumentError("SetParameters: parameter " + layout(g).params[i].name +
                                   " has " + std::to_string(layout(g).params[i].numel) +
                                   " elements, " + std::to_string(values[k].size()) + " given");
    } else if (!index.emplace(which[k], k).second) {
      check = InvalidArgumentError("SetParameters: parameter " + layout(g).params[i].name +
                                   " given twice");
    }
  }
  // Checked and agreed on before the broadcasts (WriteParameters), which are collective.
  return WriteParameters(
      "setting", check,
      [&](Status&) -> Status {
        for (size_t k = 0; k < which.size(); ++k) {
          if (values[k].empty()) continue;
          STRATA_RETURN_IF_ERROR_CTX(
              host_comm_->Broadcast(values[k].data(), values[k].size(), comm::DType::kFloat32,
                                    source),
              "broadcasting parameter " + layout(which[k].first).params[which[k].second].name);
        }
        return Status::Ok();
      },
      [&](int g, size_t i, uint64_t first, std::span<float> out) -> Status {
        const std::span<float> v = values[index.at({g, i})];
        std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(first), out.size(), out.begin());
        return Status::Ok();
      },
      [&](int g, size_t i) {
        return index.count({g, i}) != 0;
      });
}

Status EngineCore::AssembleParameters(const Status& local_check,
                                      const std::vector<std::pair<int, size_t>>& which,
                                      const std::vector<std::span<const float>>& parts) {
  Status check = local_check;
  if (check.ok() && which.size() != parts.size()) {
    check = InvalidArgumentError("AssembleParameters: " + std::to_string(which.size()) +
                                 " parameters, " + std::to_string(parts.size()) + " parts");
  }
  for (size_t k = 0; k < which.size() && check.ok(); ++k) {
    const auto [g, i] = which[k];
    if (g < 0 || g >= num_groups() || i >= layout(g).params.size()) {
      check = InvalidArgumentError("AssembleParameters: no parameter " + std::to_string(i) +
                                   " in group " + std::to_string(g));
      break;
    }
    const comm::Shard part = comm::Partition(layout(g).params[i].numel, world_size(), rank());
    if (parts[k].size() != part.count) {
      check = InvalidArgumentError(
          "parameter " + layout(g).params[i].name + ": this rank's part holds " +
          std::to_string(parts[k].size()) + " elements, its share of " +
          std::to_string(layout(g).params[i].numel) + " over " + std::to_string(world_size()) +
          " ranks is " + std::to_string(part.count) +
          " (built under strata.zero.Init with another world size?)");
    }
  }
  // The same gate as a load: at a step boundary, the check agreed on (nothing changed when
  // it fails), nothing gathered while the master changes.
  return WriteParameters(
      "assembling", check,
      [&](Status& local) -> Status {
        // Every rank takes part in every gather, whatever its writes do (a failure is kept
        // in `local` and agreed on by CommitMasterAgreed).
        std::vector<float> full;
        for (size_t k = 0; k < which.size(); ++k) {
          const auto [g, i] = which[k];
          const GroupLayout& l = layout(g);
          full.resize(l.params[i].numel);
          if (full.empty()) continue;
          // An empty part (fewer elements than ranks) may have no storage: a valid address
          // all the same.
          const float none = 0.0f;
          const float* part = parts[k].empty() ? &none : parts[k].data();
          STRATA_RETURN_IF_ERROR_CTX(
              host_comm_->AllGatherAsync(part, full.data(), full.size(), comm::DType::kFloat32)
                  ->Wait(),
              "gathering parameter " + l.params[i].name);
          const std::optional<ShardSlice> sl = l.Slice(i, partition_.rank);
          if (!sl || !local.ok()) continue;
          const std::span<const float> mine(full.data() + sl->param_offset, sl->count);
          local =
              frozen(g)
                  ? placement_->WriteFrozen(g, sl->shard_offset, mine)
                  : driver_->WriteMaster(
                        partition_.shard_offset[static_cast<size_t>(g)] + sl->shard_offset, mine);
        }
        return Status::Ok();
      },
      [](int, size_t, uint64_t, std::span<float>) { return Status::Ok(); },
      [](int, size_t) { return false; });  // written above
}

Status EngineCore::GatherMasterParams(int group, std::span<float> out) {
  if (group < 0 || group >= num_groups()) {
    return FailedPreconditionError("GatherMasterParams: unknown group " + std::to_string(group));
  }
  if (early_open()) {
    return FailedPreconditionError(
        "GatherMasterParams between a backward and its step() with strata.early_step (the "
        "master parameters are being updated): call it before the backward or after step()");
  }
  // The reducer's thread may be adding gradients through the driver (in a backward not
  // ended yet).
  STRATA_RETURN_IF_ERROR(reducer_->WaitAccumulations());
  STRATA_RETURN_IF_ERROR(JoinStep());
  const GroupLayout& l = layout(group);
  if (out.size() != l.numel) {
    return InvalidArgumentError("GatherMasterParams: output holds " + std::to_string(out.size()) +
                                " floats, group " + l.name + " has " + std::to_string(l.numel));
  }
  if (l.padded_numel == 0) return Status::Ok();
  std::vector<float> full(l.padded_numel);
  std::vector<float> shard(l.shard_numel);
  // A read error must not leave the other ranks in the all-gather: every rank sends its
  // shard (zeros after a failure) and the ranks agree on the outcome first.
  Status read;
  if (!frozen(group)) {
    read = driver_->ReadMaster(partition_.shard_offset[static_cast<size_t>(group)], shard);
  } else if (placement_->shards().has(group)) {
    // A frozen group's values are its working shard's.
    Result<offload::StateLease> lease = placement_->shards().Acquire(group, offload::Access::kRead);
    read = lease.status();
    if (lease.ok()) {
      ConvertToFloat(lease->data(), dtype_, shard.size(), shard.data());
      read = lease->Release();
    }
    if (!read.ok()) std::fill(shard.begin(), shard.end(), 0.0f);
  }
  if (driver_->store()->can_fail() || placement_->shards().can_fail()) {
    float failed = read.ok() ? 0.0f : 1.0f;
    STRATA_RETURN_IF_ERROR(
        host_comm_->AllReduce(&failed, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
    if (!read.ok()) return read;
    if (failed > 0.0f) {
      return IOError("GatherMasterParams: reading the master parameters failed on " +
                     std::to_string(static_cast<int>(failed)) + " other rank(s)");
    }
  }
  STRATA_RETURN_IF_ERROR(read);
  STRATA_RETURN_IF_ERROR(
      host_comm_->AllGather(shard.data(), full.data(), l.padded_numel, comm::DType::kFloat32));
  size_t pos = 0;
  for (const ParamSlot& p : l.params) {
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(p.offset), p.numel,
                out.begin() + static_cast<std::ptrdiff_t>(pos));
    pos += p.numel;
  }
  return Status::Ok();
}

EngineStats EngineCore::stats() const {
  EngineStats s;
  placement_->AddStats(s);
  s.phases = clock_->phases();
  s.coordinator = coordinator_->stats();
  s.reducer = reducer_->stats();
  {
    // The reducer's thread may be in the driver's Accumulate (its counters).
    std::unique_lock<std::mutex> held = reducer_->HoldAccumulation();
    s.optimizer = driver_->stats();
    s.store_name = placement_->store().name();
    s.store = driver_->store_stats();
  }
  s.all_gather = {s.coordinator.all_gather_calls, s.coordinator.all_gather_bytes};
  s.reduce_scatter = {s.reducer.reduce_scatter_calls, s.reducer.reduce_scatter_bytes};
  s.all_reduce = {s.reducer.all_reduce_calls + s.optimizer.norm_all_reduce_calls +
                      s.optimizer.lamb_norms_all_reduce_calls,
                  s.reducer.all_reduce_bytes + s.optimizer.norm_all_reduce_calls * 8 +
                      s.optimizer.lamb_norms_all_reduce_bytes};
  s.comm = comm_->stats();
  s.reduce_lane = reduce_comm_ != nullptr;
  if (reduce_comm_ != nullptr) s.reduce_lane_comm = reduce_comm_->stats();
  s.gather_lane = gather_comm_ != nullptr;
  if (gather_comm_ != nullptr) s.gather_lane_comm = gather_comm_->stats();
  s.reduce_order = std::string(LaneOrderName(reducer_->lane_order()));
  placement_->AddAccumulationStats(s);
  s.delayed_update_steps = delayed_steps_;
  s.delayed_copy_outs = delayed_copy_outs_ + s.optimizer.delayed_copy_outs;
  s.delayed_copy_out_s = delayed_copy_out_s_ + s.optimizer.delayed_copy_out_s;
  s.delayed_update_wait_s = delayed_wait_s_;
  s.gather_order = std::string(LaneOrderName(coordinator_->lane_order()));
  s.device_ops = placement_->device().stats();
  s.host_waits_last_step = clock_->host_waits_last_step();
  s.micro_steps = micro_steps_;
  s.global_steps = global_steps_;
  s.loss_scale = scaler_.scale();
  return s;
}

void EngineCore::EnableTimeline(bool on) {
  clock_->timeline().Enable(on);
}

bool EngineCore::timeline_enabled() const {
  return clock_->timeline().enabled();
}

std::vector<TimelineEvent> EngineCore::TakeTimeline() {
  return clock_->timeline().Take();
}

uint64_t EngineCore::timeline_dropped() const {
  return clock_->timeline().dropped();
}

uint64_t EngineStats::HostWaitsLastStep() const {
  uint64_t n = 0;
  for (uint64_t w : host_waits_last_step)
    n += w;
  return n;
}

std::string EngineStats::ToString() const {
  std::ostringstream os;
  os << "device tier " << device.name << ": " << FormatBytes(device.usage.bytes_in_use) << " now, "
     << FormatBytes(device.usage.peak_bytes) << " peak";
  if (device.usage.budget_bytes > 0) os << " of " << FormatBytes(device.usage.budget_bytes);
  os << "\n";
  if (host) {
    os << "host tier " << host->name << ": " << FormatBytes(host->usage.bytes_in_use) << " now, "
       << FormatBytes(host->usage.peak_bytes) << " peak\n";
  }
  os << "CPU-Adam: " << cpu_adam_threads << " threads"
     << (numa_node >= 0 ? " on NUMA node " + std::to_string(numa_node)
                        : std::string(", not bound to a NUMA node"))
     << " (" << cpu_adam_cores << " cores this rank may use, shared by " << cpu_adam_ranks_sharing
     << (cpu_adam_ranks_sharing == 1 ? " rank" : " ranks") << " of this machine)\n";
  os << "per rank: working shards " << FormatBytes(working_shard_bytes) << " ("
     << TierKindName(param_tier) << "), master " << FormatBytes(optimizer.master_bytes) << ", m "
     << FormatBytes(optimizer.exp_avg_bytes) << ", v " << FormatBytes(optimizer.exp_avg_sq_bytes)
     << ", grad accumulators " << FormatBytes(optimizer.grad_accumulator_bytes) << " ("
     << grad_accumulators << ")\n";
  if (device_sums.device_bytes > 0) {
    os << "device gradient sums: " << FormatBytes(device_sums.device_bytes) << " on the device, "
       << device_sums.buffers << " host buffers of " << FormatBytes(device_sums.buffer_bytes)
       << "; " << device_sums.fetches << " sub-group copies to the host ("
       << FormatBytes(device_sums.fetch_bytes) << ", " << device_sums.fetches_ahead
       << " read ahead), " << device_sums.norm_passes << " norm passes on the device, waited "
       << device_sums.fetch_wait_s << " s\n";
  }
  if (optimizer_tier == TierKind::kNvme) {
    os << "nvme states: " << store.chunks << " chunks, buffers " << FormatBytes(store.memory_bytes)
       << "; read " << FormatBytes(store.read_bytes) << " (" << store.reads << " chunks, "
       << store.prefetch_hits << " prefetched, waited " << store.read_wait_s << " s), written "
       << FormatBytes(store.write_bytes) << " (" << store.writes << " chunks, waited "
       << store.write_wait_s << " s), " << store.zero_fills << " zero-filled\n";
  }
  if (param_tier == TierKind::kNvme) {
    os << "nvme working shards: " << param_store.chunks << " shards ("
       << FormatBytes(working_shard_host_bytes) << " more in host memory, max_in_cpu), buffers "
       << FormatBytes(param_store.memory_bytes) << "; read " << FormatBytes(param_store.read_bytes)
       << " (" << param_store.reads << " shards, " << coordinator.shard_reads_ahead
       << " read ahead, " << coordinator.shard_reads_on_demand << " on demand, waited "
       << coordinator.shard_read_wait_s << " s), written " << FormatBytes(param_store.write_bytes)
       << " (" << param_store.writes << " shards)";
    if (optimizer.shard_handovers > 0) {
      os << "; " << optimizer.shard_handovers << " new shards handed over by the pipelined step ("
         << optimizer.shard_handovers_exchanged << " without a copy, "
         << optimizer.shard_handovers_checksummed << " with their CRCs from CPU-Adam's threads, "
         << optimizer.shard_checksum_s << " s there; " << optimizer.shard_handover_s
         << " s on the engine's thread)";
    }
    os << "\n";
  }
  os << "fetches: " << coordinator.fetches_on_demand << " on demand, "
     << coordinator.fetches_prefetched << " prefetched, " << coordinator.fetches_reused
     << " reused; live " << coordinator.live_elements << " elements (peak "
     << coordinator.live_elements_peak << "); shards staged host->device "
     << coordinator.shards_staged << ", reduced shards copied device->host " << reducer.shard_copies
     << " (" << FormatBytes(reducer.shard_copy_bytes) << ")"
     << ", working shards copied host->device " << working_shard_pushes << "\n";
  os << "gradient accumulation: " << gradient_accumulation;
  if (reducer.device_accumulator_bytes > 0) {
    os << " (" << FormatBytes(reducer.device_accumulator_bytes) << " of accumulators; "
       << reducer.shards_added_on_device << " reduced shards added there, "
       << reducer.accumulated_copies << " sums copied to the host)";
  }
  os << "\n";
  if (delayed_update_steps > 0) {
    os << "delayed update: " << delayed_update_steps << " steps beside the next micro-steps, "
       << delayed_copy_outs << " copies into the working shards (" << delayed_copy_out_s << " s), "
       << delayed_update_wait_s << " s waited for the update\n";
  }
  os << "collectives: all-gather " << all_gather.calls << " (" << FormatBytes(all_gather.bytes)
     << "), reduce-scatter " << reduce_scatter.calls << " (" << FormatBytes(reduce_scatter.bytes)
     << "), all-reduce " << all_reduce.calls << " (" << FormatBytes(all_reduce.bytes) << "); "
     << (reduce_lane || gather_lane
             ? "all-gathers and gradient reductions on separate communicators"
             : "all-gathers and gradient reductions on one communicator")
     << (!gather_lane  ? ""
         : reduce_lane ? " (neither the engine's)"
                       : " (the reductions on the engine's)")
     << "; ordered with the device's work: reductions " << reduce_order << ", all-gathers "
     << gather_order << "\n";
  os << "phases (s): forward " << phases.forward_s << " (" << phases.forwards << "), backward "
     << phases.backward_s << " (" << phases.backwards << "), step " << phases.step_s << " ("
     << phases.steps << ")\n";
  os << "gradient buckets: " << reducer.buckets_reduced << " reduced, "
     << reducer.buckets_launched_in_backward << " launched during the backward, "
     << reducer.buckets_overlapping_backward << " of them in flight beside it, "
     << reducer.buckets_accumulated_in_background << " added on the reducer's thread ("
     << reducer.background_accumulate_s << " s), " << reducer.gradients_parked
     << " gradients parked until their group's slot opened\n";
  os << "waited (s): all-gathers " << coordinator.all_gather_wait_s << ", shard staging "
     << coordinator.staging_wait_s << ", compute before reductions " << reducer.compute_wait_s
     << ", reductions " << reducer.reduce_wait_s << ", reduced-shard copies "
     << reducer.shard_copy_wait_s << ", the reducer's thread " << reducer.accumulate_wait_s
     << ", working-shard copies " << working_push_wait_s << "; optimizer steps " << optimizer.step_s
     << "\n";
  os << "host waits on the device: " << device_ops.host_synchronizes << " (last step "
     << HostWaitsLastStep();
  for (size_t i = 0; i < host_waits_last_step.size(); ++i) {
    if (host_waits_last_step[i] > 0) {
      os << ", " << HostWaitName(static_cast<HostWait>(i)) << " " << host_waits_last_step[i];
    }
  }
  os << "); stream waits " << device_ops.stream_waits << ", events " << device_ops.events_recorded
     << ", kept alive " << device_ops.keep_alives << "\n";
  os << "optimizer: " << optimizer.steps_applied << " steps, " << optimizer.steps_skipped
     << " skipped, " << optimizer.adam_calls << " CPU optimizer passes, "
     << optimizer.params_updated << " parameter elements updated; loss scale " << loss_scale;
  if (optimizer.lamb_norms_all_reduce_calls > 0) {
    os << "\nLAMB: trust ratios of the last step in [" << optimizer.lamb_trust_ratio_min << ", "
       << optimizer.lamb_trust_ratio_max << "], " << optimizer.lamb_norms_all_reduce_calls
       << " norm all-reduces (" << FormatBytes(optimizer.lamb_norms_all_reduce_bytes) << ")";
  }
  if (optimizer.group_elements.size() > 1) {
    os << "\nparameter groups:";
    for (size_t k = 0; k < optimizer.group_elements.size(); ++k) {
      os << (k == 0 ? " " : ", ") << k << ": " << optimizer.group_elements[k] << " elements, lr "
         << optimizer.group_lr[k];
    }
  }
  return os.str();
}

}  // namespace strata::engine

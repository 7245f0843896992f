// EngineCore (engine_core.h): the calls a front end makes, each run by the components that own
// its parts (the private section of engine_core.h lists them). Create is in engine_create.cc,
// stats() in stats.cc.
#include "strata/engine/runtime/engine_core.h"

#include <utility>

#include "strata/core/logging.h"
#include "strata/engine/runtime/checkpoint_io.h"
#include "strata/engine/runtime/model_io.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"
#include "strata/engine/runtime/update_gate.h"

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

Status EngineCore::PreForward(int group, bool begins_phase) {
  if (begins_phase && clock_->phase() != PhaseClock::Phase::kBackward) step_->BeginForward();
  if (begins_phase) clock_->Enter(PhaseClock::Phase::kForward);
  // A front end's hold right after a pipelined Step() prefetches nothing: a prefetch
  // deferred there would be issued after Step() returned, where the caller may run its own
  // collectives (the same on every rank: the update runs on every rank or on none).
  // (A delayed update defers nothing: the forward does not wait for it.)
  const bool hold_beside_update = !begins_phase && gate_->ForwardWaits();
  STRATA_RETURN_IF_ERROR(coordinator_->PreForward(group, /*prefetch=*/!hold_beside_update));
  clock_->OpenSpan(group, 0);
  return Status::Ok();
}

Status EngineCore::PostForward(int group) {
  clock_->CloseSpan(group, 0);
  return coordinator_->PostForward(group);
}

Status EngineCore::PreBackward(int group) {
  STRATA_RETURN_IF_ERROR(step_->RefuseVoidBackward("PreBackward"));
  clock_->Enter(PhaseClock::Phase::kBackward);
  STRATA_RETURN_IF_ERROR(step_->PreBackward(group));
  STRATA_RETURN_IF_ERROR(coordinator_->PreBackward(group));
  clock_->OpenSpan(group, 1);
  return Status::Ok();
}

Status EngineCore::PostBackward(int group) {
  STRATA_RETURN_IF_ERROR(step_->RefuseVoidBackward("PostBackward"));
  clock_->CloseSpan(group, 1);
  STRATA_RETURN_IF_ERROR(coordinator_->PostBackward(group));
  return step_->PostBackward(group);
}

Status EngineCore::AddGradient(int group, int param, const void* grad, DType dtype,
                               std::shared_ptr<const void> owner) {
  return step_->AddGradient(group, param, grad, dtype, std::move(owner));
}

Status EngineCore::EndBackward() {
  STRATA_RETURN_IF_ERROR(step_->RefuseEndBackward());
  // A backward whose groups were all left out still ends here.
  clock_->Enter(PhaseClock::Phase::kBackward);
  STRATA_RETURN_IF_ERROR(step_->EndBackward());
  clock_->End("backward");
  clock_->timeline().set_micro_step(step_->CountBackward());
  return Status::Ok();
}

Status EngineCore::EndForwardOnly() {
  STRATA_RETURN_IF_ERROR(step_->EndForwardOnly());
  if (clock_->phase() == PhaseClock::Phase::kForward) clock_->End("forward (no backward)");
  return coordinator_->BeginIteration();
}

bool EngineCore::IsGradientAccumulationBoundary() const {
  return step_->IsGradientAccumulationBoundary();
}

bool EngineCore::BackwardIsBoundary() const {
  return step_->BackwardIsBoundary();
}

Result<StepOutcome> EngineCore::Step() {
  const Timeline::Clock::time_point began = Timeline::Clock::now();
  Result<StepOutcome> out = step_->Step();
  clock_->EndStep(began, out.ok() && out->applied, placement_->device().stats().host_waits);
  return out;
}

bool EngineCore::iteration_void() const {
  return step_->iteration_void();
}

double EngineCore::LossMultiplier() const {
  return step_->LossMultiplier();
}

double EngineCore::loss_scale() const {
  return step_->loss_scaler().scale();
}

const LossScaler& EngineCore::loss_scaler() const {
  return step_->loss_scaler();
}

double EngineCore::lr() const {
  return step_->lr();
}

Status EngineCore::set_lr(double lr) {
  return step_->set_lr(lr);
}

int64_t EngineCore::lr_iteration() const {
  return step_->lr_iteration();
}

Status EngineCore::set_lr_iteration(int64_t iteration) {
  return step_->set_lr_iteration(iteration);
}

Tier* EngineCore::device_tier() const {
  return placement_->device_tier();
}

Tier* EngineCore::host_tier() const {
  return placement_->host_tier();
}

OptimizerDriver& EngineCore::optimizer() {
  const Status joined = step_->JoinStep(/*flush=*/false);
  if (!joined.ok()) STRATA_LOG(kWarn) << "completing the pipelined optimizer step: " << joined;
  return *driver_;
}

bool EngineCore::delayed_copy_out_pending() const {
  return step_->delayed_copy_out_pending();
}

Status EngineCore::GatherMasterParams(int group, std::span<float> out) {
  return model_io_->GatherMasterParams(group, out);
}

Status EngineCore::AssembleParameters(const Status& local_check,
                                      const std::vector<std::pair<int, size_t>>& which,
                                      const AssembleParts& parts) {
  return model_io_->AssembleParameters(local_check, which, parts);
}

Status EngineCore::AssembleParameters(const Status& local_check,
                                      const std::vector<std::pair<int, size_t>>& which,
                                      const std::vector<std::span<const float>>& parts) {
  AssembleParts in_memory;
  for (const std::span<const float>& p : parts)
    in_memory.sizes.push_back(p.size());
  in_memory.read = [&](size_t k, size_t first, std::span<float> out) {
    std::copy_n(parts[k].begin() + static_cast<std::ptrdiff_t>(first), out.size(), out.begin());
    return Status::Ok();
  };
  return model_io_->AssembleParameters(local_check, which, in_memory);
}

Status EngineCore::LoadParameters(const Status& local_check, const ParamReader& read,
                                  const std::function<bool(int group, size_t param)>& only) {
  return model_io_->LoadParameters(local_check, read, only);
}

Status EngineCore::SetParameters(const Status& local_check, int source,
                                 const std::vector<std::pair<int, size_t>>& which,
                                 const std::vector<std::span<float>>& values) {
  return model_io_->SetParameters(local_check, source, which, values);
}

Result<std::string> EngineCore::SaveCheckpoint(const CheckpointSaveRequest& options) {
  return checkpoints_->Save(options);
}

Result<CheckpointLoadResult> EngineCore::LoadCheckpoint(const CheckpointLoadRequest& options) {
  return checkpoints_->Load(options);
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

}  // namespace strata::engine

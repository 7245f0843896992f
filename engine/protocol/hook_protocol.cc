#include "strata/engine/protocol/hook_protocol.h"

#include <algorithm>
#include <utility>

namespace strata::engine {

HookProtocol::HookProtocol(EngineCore& core, std::vector<ProtocolGroup> groups,
                           ParameterTensors& tensors, FrontEndNames names)
    : core_(core), tensors_(tensors), names_(std::move(names)) {
  groups_.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    groups_[g].def = groups[g];
    groups_[g].has_arrived.assign(groups[g].params, 0);
  }
}

Status HookProtocol::CheckGroup(int group) const {
  if (group >= 0 && static_cast<size_t>(group) < groups_.size()) return Status::Ok();
  return OutOfRangeError("group " + std::to_string(group) + " of " +
                         std::to_string(groups_.size()));
}

// ---------------------------------------------------------------------------
// Holds

Status HookProtocol::Point(int group) {
  STRATA_ASSIGN_OR_RETURN(GatheredGroup full, core_.FullBuffer(group));
  std::vector<std::byte*> data(groups_[static_cast<size_t>(group)].def.params);
  for (size_t i = 0; i < data.size(); ++i)
    data[i] = full.param_data(i);
  return tensors_.Point(group, data);
}

Status HookProtocol::Acquire(int group, Phase phase, bool begins_phase) {
  GroupState& g = groups_[static_cast<size_t>(group)];
  auto pre = [&](int x) {
    return phase == Phase::kForward ? core_.PreForward(x, begins_phase) : core_.PreBackward(x);
  };
  STRATA_RETURN_IF_ERROR(pre(group));
  if (g.def.companion >= 0) STRATA_RETURN_IF_ERROR(pre(g.def.companion));
  if (++g.open == 1) {
    STRATA_RETURN_IF_ERROR(Point(group));
    if (g.def.companion >= 0) STRATA_RETURN_IF_ERROR(Point(g.def.companion));
  }
  if (phase == Phase::kBackward) ++g.open_backward;
  return Status::Ok();
}

Status HookProtocol::Release(int group, Phase phase) {
  GroupState& g = groups_[static_cast<size_t>(group)];
  if (phase == Phase::kBackward) --g.open_backward;
  Status first;
  if (--g.open == 0) {
    first = tensors_.Empty(group);
    if (g.def.companion >= 0) {
      Status s = tensors_.Empty(g.def.companion);
      if (first.ok()) first = std::move(s);
    }
  }
  auto post = [&](int x) {
    return phase == Phase::kForward ? core_.PostForward(x) : core_.PostBackward(x);
  };
  if (g.def.companion >= 0) {
    Status s = post(g.def.companion);
    if (first.ok()) first = std::move(s);
  }
  Status own = post(group);
  return first.ok() ? own : first;
}

Status HookProtocol::CloseBackward(int group) {
  Status first;
  while (groups_[static_cast<size_t>(group)].open_backward > 0) {
    Status s = Release(group, Phase::kBackward);
    if (first.ok()) first = std::move(s);
  }
  return first;
}

bool HookProtocol::BackwardOver(const GroupState& g) const {
  const size_t trainable = g.def.frozen ? 0 : g.def.params;
  return g.arrived == trainable && g.inputs_pending == 0;
}

void HookProtocol::ResetArrivals() {
  for (GroupState& g : groups_) {
    g.arrived = 0;
    g.inputs_pending = 0;
    std::fill(g.has_arrived.begin(), g.has_arrived.end(), 0);
  }
}

Status HookProtocol::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  return Acquire(0, Phase::kForward, /*begins_phase=*/false);
}

// ---------------------------------------------------------------------------
// Errors and the voided iteration

void HookProtocol::KeepLocked(const Status& error) {
  if (kept_.ok() && !error.ok()) kept_ = error;
}

void HookProtocol::Keep(const Status& error) {
  std::lock_guard<std::mutex> lock(mu_);
  KeepLocked(error);
}

bool HookProtocol::RecoverVoidIteration() {
  if (!core_.iteration_void()) return false;
  ResetArrivals();
  Status dropped = tensors_.DropGradients();
  backward_pending_ = false;
  eval_ = false;
  if (void_recovered_) {
    // A call after the recovery (the voided loss's backward again): the core refused it
    // before anything was taken, and the root is held since the recovery.
    kept_ = dropped;
    return true;
  }
  void_recovered_ = true;
  Status first = dropped;
  for (size_t g = 0; g < groups_.size(); ++g) {
    Status s = tensors_.Empty(static_cast<int>(g));
    if (first.ok()) first = std::move(s);
    groups_[g].open = 0;
    groups_[g].open_backward = 0;
  }
  // Not the start of a forward: the core keeps refusing the voided backward until then.
  Status root = Acquire(0, Phase::kForward, /*begins_phase=*/false);
  kept_ = first.ok() ? root : first;
  return true;
}

Status HookProtocol::UsableLocked() {
  if (kept_.ok()) return Status::Ok();
  if (core_.iteration_void()) {
    Status kept = kept_;
    RecoverVoidIteration();
    return kept;
  }
  return kept_.WithContext(names_.prefix + "an earlier error left the engine unusable");
}

Status HookProtocol::CheckUsable() {
  std::lock_guard<std::mutex> lock(mu_);
  return UsableLocked();
}

Status HookProtocol::Recovering(Status s) {
  if (!s.ok()) RecoverVoidIteration();
  return s;
}

// ---------------------------------------------------------------------------
// Forward

Status HookProtocol::CheckForward() {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  if (backward_pending_) {
    return FailedPreconditionError(names_.prefix +
                                   "forward after backward() without step(): call engine.step() "
                                   "after every engine.backward()");
  }
  return Status::Ok();
}

Status HookProtocol::BeginForward(int group, bool recompute) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  if (recompute) {
    // Activation checkpointing's recompute: the block is gathered as for its backward,
    // which follows at once; its release is the backward's (all its gradients arrived, or
    // the backward ends).
    STRATA_RETURN_IF_ERROR(CheckUsable());
    return PreBackward(group);
  }
  STRATA_RETURN_IF_ERROR(CheckForward());
  std::lock_guard<std::mutex> lock(mu_);
  void_recovered_ = false;  // a new forward: the core's iteration_void() ends here too
  return Acquire(group, Phase::kForward);
}

Status HookProtocol::EndForward(int group, bool recompute, bool unwinding) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  if (recompute) return Status::Ok();  // released with the backward (BeginForward)
  std::lock_guard<std::mutex> lock(mu_);
  Status s = Release(group, Phase::kForward);
  if (unwinding) KeepLocked(s);
  return s;
}

Status HookProtocol::AbortForward() {
  std::lock_guard<std::mutex> lock(mu_);
  Status first;
  for (size_t g = 1; g < groups_.size(); ++g) {
    while (groups_[g].open - groups_[g].open_backward > 0) {
      Status s = Release(static_cast<int>(g), Phase::kForward);
      if (first.ok()) first = std::move(s);
    }
  }
  KeepLocked(first);
  return first;
}

// ---------------------------------------------------------------------------
// Backward

Status HookProtocol::PreBackward(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  std::lock_guard<std::mutex> lock(mu_);
  Status s = Acquire(group, Phase::kBackward);
  KeepLocked(s);
  return s;
}

bool HookProtocol::ExpectInputs(int group, bool recompute) {
  if (!CheckGroup(group).ok() || group == 0) return false;  // the root: held to the end
  std::lock_guard<std::mutex> lock(mu_);
  GroupState& g = groups_[static_cast<size_t>(group)];
  if (!g.def.frozen && g.def.companion < 0) return false;
  if (recompute && g.inputs_pending > 0) return false;
  ++g.inputs_pending;
  return true;
}

Status HookProtocol::PostBackward(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  std::lock_guard<std::mutex> lock(mu_);
  GroupState& g = groups_[static_cast<size_t>(group)];
  if (g.inputs_pending > 0) --g.inputs_pending;
  if (g.open_backward == 0 || !BackwardOver(g)) return Status::Ok();
  Status s = CloseBackward(group);
  KeepLocked(s);
  return s;
}

Status HookProtocol::Gradient(int group, int param, const void* grad, DType dtype,
                              std::shared_ptr<const void> owner) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  std::lock_guard<std::mutex> lock(mu_);
  Status s = core_.AddGradient(group, param, grad, dtype, std::move(owner));
  if (!s.ok()) {
    KeepLocked(s);
    return s;
  }
  GroupState& g = groups_[static_cast<size_t>(group)];
  uint8_t& arrived = g.has_arrived[static_cast<size_t>(param)];
  if (arrived == 0) {
    arrived = 1;
    ++g.arrived;
  }
  // Every gradient of the group arrived (and its inputs' PostBackward ran): its backward is
  // over (post-backward).
  if (group != 0 && g.open_backward > 0 && BackwardOver(g)) {
    s = CloseBackward(group);
    KeepLocked(s);
  }
  return s;
}

Status HookProtocol::BeginBackward() {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  if (backward_pending_) {
    return FailedPreconditionError(names_.api +
                                   "backward called twice without step(): call engine.step() "
                                   "after every engine.backward()");
  }
  if (eval_) {
    return FailedPreconditionError(names_.api + "backward between begin_eval() and end_eval()");
  }
  return Status::Ok();
}

Status HookProtocol::AutogradFailed(const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!kept_.ok()) {
    // A voided iteration (a pipelined optimizer step failed, and the forward since read
    // partly updated parameters): the engine refused everything and stays usable.
    Status first = kept_;
    RecoverVoidIteration();
    return first;
  }
  // Autograd's own error in a voided iteration (the voided loss's graph, partly freed by the
  // backward that failed): the engine refused everything and stays usable.
  if (RecoverVoidIteration()) return Status::Ok();
  KeepLocked(InternalError(names_.prefix + "autograd failed: " + what));
  return Status::Ok();
}

Status HookProtocol::FinishBackward() {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  Status first;
  for (size_t g = 1; g < groups_.size(); ++g) {
    Status s = CloseBackward(static_cast<int>(g));
    if (first.ok()) first = std::move(s);
  }
  ResetArrivals();
  STRATA_RETURN_IF_ERROR(first);
  // The root group stays gathered from step() to the end of the backward.
  STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  Status ended = core_.EndBackward();
  if (!ended.ok()) {
    RecoverVoidIteration();
    return ended;
  }
  backward_pending_ = true;
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Step, evaluation, loads

Result<StepOutcome> HookProtocol::Step() {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  if (eval_) {
    return FailedPreconditionError(names_.api + "step between begin_eval() and end_eval()");
  }
  if (!backward_pending_) {
    Result<StepOutcome> r = core_.Step();  // the core's message for the misuse
    if (!r.ok()) return r.status().WithContext(names_.api + "step");
    return InternalError(names_.api + "step: the core stepped without a backward");
  }
  Result<StepOutcome> r = core_.Step();
  if (!r.ok()) return r.status();
  backward_pending_ = false;
  void_recovered_ = false;  // a new iteration
  STRATA_RETURN_IF_ERROR(Acquire(0, Phase::kForward, /*begins_phase=*/false));
  return r;
}

Status HookProtocol::BeginEval() {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  if (backward_pending_) {
    return FailedPreconditionError(names_.api + "begin_eval between backward() and step()");
  }
  if (eval_) return FailedPreconditionError(names_.api + "begin_eval called twice");
  core_.BeginForwardOnly();
  eval_ = true;
  return Status::Ok();
}

Status HookProtocol::EndEval() {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  if (!eval_) return FailedPreconditionError(names_.api + "end_eval without begin_eval");
  eval_ = false;
  STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  Status ended = core_.EndForwardOnly();
  if (!ended.ok()) {
    RecoverVoidIteration();
    return ended;
  }
  return Acquire(0, Phase::kForward, /*begins_phase=*/false);
}

Status HookProtocol::AtStepBoundary(const std::string& what) {
  STRATA_RETURN_IF_ERROR(UsableLocked());
  if (eval_) return FailedPreconditionError(what + " between begin_eval() and end_eval()");
  if (backward_pending_) {
    return FailedPreconditionError(what + " between backward() and step()");
  }
  return Status::Ok();
}

Result<std::string> HookProtocol::SaveCheckpoint(const CheckpointSaveRequest& options) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = names_.api + "save_checkpoint";
  STRATA_RETURN_IF_ERROR(AtStepBoundary(what));
  // A delayed update's parameters are copied into the working shards by the save (the
  // same on every rank): the root is taken again after, from the new shards.
  const bool copies_out = core_.delayed_copy_out_pending();
  if (copies_out) STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  Result<std::string> saved = core_.SaveCheckpoint(options);
  if (copies_out) STRATA_RETURN_IF_ERROR(Acquire(0, Phase::kForward, /*begins_phase=*/false));
  if (!saved.ok()) return Recovering(saved.status()).WithContext(what + "(" + options.dir + ")");
  return saved;
}

Result<CheckpointLoadResult> HookProtocol::LoadCheckpoint(const CheckpointLoadRequest& options) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = names_.api + "load_checkpoint";
  STRATA_RETURN_IF_ERROR(AtStepBoundary(what));
  STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  Result<CheckpointLoadResult> loaded = core_.LoadCheckpoint(options);
  STRATA_RETURN_IF_ERROR(Acquire(0, Phase::kForward, /*begins_phase=*/false));
  if (!loaded.ok()) return loaded.status().WithContext(what + "(" + options.dir + ")");
  return loaded;
}

Status HookProtocol::LoadSafetensors(
    const std::string& path, const std::vector<std::vector<ExpectedTensor>>& params,
    const std::vector<ExpectedTensor>& others,
    const std::function<Status(size_t other, std::span<const float>)>& fill) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = names_.api + "load_safetensors";
  STRATA_RETURN_IF_ERROR(AtStepBoundary(what));
  STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  const Status loaded = engine::LoadSafetensors(core_, path, params, others, fill);
  STRATA_RETURN_IF_ERROR(Acquire(0, Phase::kForward, /*begins_phase=*/false));
  return loaded.WithContext(what + "(" + path + ")");
}

Status HookProtocol::SetParameters(const Status& local_check, int source,
                                   const std::vector<std::pair<int, size_t>>& which,
                                   const std::vector<std::span<float>>& values) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = names_.api + "GatheredParameters (writing back rank " +
                           std::to_string(source) + "'s changes)";
  STRATA_RETURN_IF_ERROR(AtStepBoundary(what));
  STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  const Status set = core_.SetParameters(local_check, source, which, values);
  STRATA_RETURN_IF_ERROR(Acquire(0, Phase::kForward, /*begins_phase=*/false));
  return Recovering(set).WithContext(what);
}

Status HookProtocol::AssembleParameters(const Status& local_check,
                                        const std::vector<std::pair<int, size_t>>& which,
                                        const EngineCore::AssembleParts& parts) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = names_.api + "initialize (the values strata.zero.Init kept)";
  STRATA_RETURN_IF_ERROR(AtStepBoundary(what));
  STRATA_RETURN_IF_ERROR(Release(0, Phase::kForward));
  const Status made = core_.AssembleParameters(local_check, which, parts);
  STRATA_RETURN_IF_ERROR(Acquire(0, Phase::kForward, /*begins_phase=*/false));
  return Recovering(made).WithContext(what);
}

Result<SaveModelResult> HookProtocol::SaveModel(const SaveModelRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = names_.api + "save_16bit_model";
  STRATA_RETURN_IF_ERROR(AtStepBoundary(what));
  Result<SaveModelResult> saved = engine::SaveModel(core_, request);
  if (!saved.ok()) return Recovering(saved.status()).WithContext(what + "(" + request.dir + ")");
  return saved;
}

Status HookProtocol::GatherMasterParams(int group, std::span<float> out) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(UsableLocked());
  return Recovering(core_.GatherMasterParams(group, out));
}

}  // namespace strata::engine

// The hook protocol: the state machine a front end runs around a model's forward and
// backward, torch-free and in one place, driven by both front ends (the LibTorch one,
// engine/libtorch/, and the Python one, bindings/python/strata/engine.py through
// _strata). A front end keeps what is its own — the tensors, the hooks and autograd
// functions that call the protocol, running autograd — and the protocol tells it, through
// its ParameterTensors, when to point a group's parameter tensors at the gathered buffer
// and when to empty them.
//
// What a front end calls, per micro-step:
//
//   a block's forward        BeginForward(g, recompute) before it, EndForward(g, ...)
//                            after it (a model forward that raised: AbortForward())
//   a block's backward       PreBackward(g), from an autograd function around g's outputs,
//                            before g's gradient functions run
//   a parameter's gradient   Gradient(g, i, grad, dtype, owner) from its gradient hook (the
//                            front end frees the gradient after: `owner`, which keeps it
//                            alive, is held until the compute stream read it; a CUDA
//                            gradient of LibTorch's allocator needs none)
//   a block's inputs         when ExpectInputs(g, recompute) says so, an autograd function
//                            around g's inputs that require grad calls PostBackward(g) once
//                            their gradients are computed (a block with frozen parameters:
//                            no parameter gradient says when their last use is over)
//   engine.backward(loss)    BeginBackward(); autograd on loss * core.LossMultiplier();
//                            FinishBackward(), or AutogradFailed(what) if autograd threw
//   engine.step()            Step()
//   evaluation               BeginEval() before a forward without autograd, EndEval() after
//   checkpoints, weights     SaveCheckpoint, LoadCheckpoint, LoadSafetensors,
//                            GatherMasterParams: the core's calls, at a step boundary
//
// `recompute`: the forward runs inside a backward (activation checkpointing's recompute):
// the group is taken as for its backward, which follows at once, and released with it.
//
// Holds. The root group (0) is held from Start() and from every Step() to the end of the
// next backward: the parameters outside blocks are there through every forward and
// backward. A group is pointed while some forward or backward holds it, with its frozen
// companion. A backward's hold on group g ends when its backward is over — every gradient
// of g's trainable parameters arrived and every PostBackward(g) its wrapped inputs expect
// ran (for a group of trainable parameters only, the gradients alone: autograd computes a
// parameter's gradient in the node that uses it) — or at FinishBackward. A block with
// frozen parameters needs its inputs' PostBackward: its trainable gradients (a LoRA
// adapter's) may all arrive before autograd has used a frozen weight for the input's
// gradient. Its recompute (activation checkpointing) wraps the inputs only when its forward
// did not: the reentrant checkpoint runs the forward under no_grad and back-propagates
// through the recompute; the non-reentrant one's recompute graph is never back-propagated.
// A wrapped input whose gradient autograd never computes (the block's outputs do not depend
// on it) keeps the group until FinishBackward.
//
// Errors. Every call returns a Status. An error of a call made from autograd (the hooks:
// PreBackward, PostBackward, Gradient, and EndForward while unwinding) is also kept: every
// later call but the hooks returns "an earlier error left the engine unusable: ..." — unless
// the core voided the iteration (EngineCore::iteration_void(): a pipelined optimizer step
// failed, and the forward since read partly updated parameters). Then the protocol recovers
// (RecoverVoidIteration): it forgets its holds and the arrived gradients, has the front end
// empty every group and drop its gradients, takes the root group again and clears the kept
// error, so that the caller can start the iteration over with a new forward.
//
// Thread-safety: the calls may come from several autograd threads; a mutex serializes them
// (the ParameterTensors callbacks run under it, so they may not call the protocol).
// Lifetime: the core and the tensors must outlive the protocol.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/runtime/load_safetensors.h"
#include "strata/engine/runtime/save_model.h"

namespace strata::engine {

// What the front end does to its parameter tensors when the protocol says so.
class ParameterTensors {
 public:
  virtual ~ParameterTensors() = default;
  // Points group g's parameter tensors at the gathered buffer: `data[i]` is parameter i's
  // first element (in the engine's working dtype), null for a group of no elements. Valid
  // until Empty(g).
  virtual Status Point(int group, std::span<std::byte* const> data) = 0;
  // Leaves group g's parameter tensors without memory (numel 0).
  virtual Status Empty(int group) = 0;
  // Drops every gradient the front end's tensors hold (a voided iteration's).
  virtual Status DropGradients() = 0;
};

// A group as the protocol needs it (groups.h's PlannedGroup gives these).
struct ProtocolGroup {
  size_t params = 0;  // its parameters (trainable ones; a frozen group's frozen ones)
  bool frozen = false;
  int companion = -1;  // the frozen group gathered with it
};

// How the front end's calls are named in its messages: the C++ front end's
// {"", "Engine::"}; Python's {"strata: ", "strata: engine."}.
struct FrontEndNames {
  std::string prefix;  // before a message about the model's forward
  std::string api;     // before a method's name: api + "backward"
};

class HookProtocol {
 public:
  HookProtocol(EngineCore& core, std::vector<ProtocolGroup> groups, ParameterTensors& tensors,
               FrontEndNames names);
  HookProtocol(const HookProtocol&) = delete;
  HookProtocol& operator=(const HookProtocol&) = delete;

  // Takes the root group (after the front end's tensors are bound).
  Status Start();

  Status BeginForward(int group, bool recompute);
  // `unwinding`: the block's forward raised (the error is then kept, not thrown over it).
  Status EndForward(int group, bool recompute, bool unwinding = false);
  // A model's forward raised where no EndForward ran: releases what the forward held.
  Status AbortForward();
  // Usable, and no backward pending: a model forward may begin.
  Status CheckForward();

  Status PreBackward(int group);
  // Whether the front end wraps group g's inputs that require grad (it calls this only when
  // some do, in grad mode) in the function that calls PostBackward(g): for a block with
  // frozen parameters, in a forward, and in a recompute whose forward wrapped none. Counts
  // the PostBackward(g) expected when true.
  bool ExpectInputs(int group, bool recompute);
  Status PostBackward(int group);
  Status Gradient(int group, int param, const void* grad, DType dtype,
                  std::shared_ptr<const void> owner = nullptr);
  // Keeps `error` (the front end's own, from a hook: a sparse gradient, say) as the hooks'.
  void Keep(const Status& error);

  Status BeginBackward();
  Status FinishBackward();
  // Autograd threw `what`. A hook's error kept in this backward is the first error: it is
  // returned (after recovering a voided iteration), and the front end throws it. Otherwise
  // Ok, with "autograd failed" kept: the front end rethrows autograd's own error.
  Status AutogradFailed(const std::string& what);

  Result<StepOutcome> Step();
  Status BeginEval();
  Status EndEval();

  // The calls between steps (collective; every rank makes them): at a step boundary, not in
  // evaluation (FailedPrecondition naming the call otherwise). A load releases the root group
  // for the core's call (nothing gathered while the master changes) and takes it again
  // after. Errors carry the call's name and its directory or file.
  Result<std::string> SaveCheckpoint(const CheckpointSaveRequest& options);
  Result<CheckpointLoadResult> LoadCheckpoint(const CheckpointLoadRequest& options);
  Status LoadSafetensors(const std::string& path,
                         const std::vector<std::vector<ExpectedTensor>>& params,
                         const std::vector<ExpectedTensor>& others,
                         const std::function<Status(size_t other, std::span<const float>)>& fill);
  // EngineCore::SetParameters (GatheredParameters' write-back): released and taken again
  // as a load.
  Status SetParameters(const Status& local_check, int source,
                       const std::vector<std::pair<int, size_t>>& which,
                       const std::vector<std::span<float>>& values);
  // EngineCore::AssembleParameters (a model partitioned as it was built): as a load.
  Status AssembleParameters(const Status& local_check,
                            const std::vector<std::pair<int, size_t>>& which,
                            const EngineCore::AssembleParts& parts);
  // engine::SaveModel (the model in Hugging Face's layout; the root group stays held).
  Result<SaveModelResult> SaveModel(const SaveModelRequest& request);
  // EngineCore::GatherMasterParams (collective), when the engine is usable.
  Status GatherMasterParams(int group, std::span<float> out);
  // The kept error, as every call but the hooks returns it.
  Status CheckUsable();

  bool backward_pending() const { return backward_pending_; }
  bool in_eval() const { return eval_; }
  int num_groups() const { return static_cast<int>(groups_.size()); }

 private:
  struct GroupState {
    ProtocolGroup def;
    int open = 0;            // holds (forward and backward)
    int open_backward = 0;   // backward holds
    size_t arrived = 0;      // parameters whose gradient arrived in this backward
    int inputs_pending = 0;  // wrapped inputs whose PostBackward has not run yet
    std::vector<uint8_t> has_arrived;
  };
  Status Point(int group);
  Status Acquire(int group, Phase phase, bool begins_phase = true);
  Status Release(int group, Phase phase);
  Status CloseBackward(int group);
  // Group g's backward is over: its trainable gradients arrived, its wrapped inputs' too.
  bool BackwardOver(const GroupState& g) const;
  void ResetArrivals();
  bool RecoverVoidIteration();
  Status CheckGroup(int group) const;  // OutOfRange for an unknown group
  Status UsableLocked();
  void KeepLocked(const Status& error);
  Status AtStepBoundary(const std::string& what);
  // Returns `s`, after recovering the iteration when `s` failed and the core voided it
  // (around a core call that may complete a failed pipelined update).
  Status Recovering(Status s);

  EngineCore& core_;
  ParameterTensors& tensors_;
  const FrontEndNames names_;
  std::mutex mu_;
  std::vector<GroupState> groups_;
  Status kept_;
  bool backward_pending_ = false;
  bool eval_ = false;
  bool void_recovered_ = false;  // RecoverVoidIteration ran since the last forward began
};

}  // namespace strata::engine

// StepControl: the step as the engine's calls drive it. It counts the micro-steps (backwards
// ended) and the global steps (accumulation boundaries reached), owns the loss scaler, the
// learning-rate schedule, its position and a set_lr override, and keeps the bookkeeping of
// the step's variants:
//
// - pipelined (strata.pipeline_step): Step() returns with the update running on the
//   optimizer's worker, group by group in the order the next forward uses them; the forward
//   waits for each group's update (UpdateGate), and the next call that needs the states
//   completes it (Join);
// - early (strata.early_step): the boundary micro-step's update starts during its backward,
//   a group handed to the worker once its gradient is final; the norm summed as groups
//   become final during the backward (strata.norm_in_backward) likewise;
// - delayed (strata.delayed_update): the update runs beside the next micro-steps and writes
//   no working shard; the next step's update (or a save, a load, a skipped step) copies its
//   parameters out;
// - a pipelined update that failed on some rank: the iteration since is void (its forward
//   read partly updated parameters), the engine is restored and the counters set back.
//
// engine_core.h says what a front end sees of all this; docs/engine/step.md describes the
// variants.
// Ownership and lifetime: owns the counters, the scaler, the schedule and the variants'
// state; borrows the config, the partition, the optimizer's driver, the coordinator, the
// reducer, the placement, the update gate and the clock, which must outlive it (EngineCore
// declares it after them).
// Thread-safety: the engine's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/gather/coordinator.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/reduce/reducer.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/step/loss_scaler.h"
#include "strata/engine/step/lr_schedule.h"
#include "strata/engine/step/optimizer_driver.h"

namespace strata::engine {

class Placement;
class PhaseClock;
class UpdateGate;

class StepControl {
 public:
  // The step's variants the config asks for and the driver can run.
  struct Modes {
    bool pipeline_step = false;     // strata.pipeline_step and the driver can pipeline
    bool early_step = false;        // strata.early_step
    bool delayed_update = false;    // strata.delayed_update
    int64_t delayed_warmup = 0;     // strata.delayed_update_warmup: exact steps first
    bool norm_in_backward = false;  // strata.norm_in_backward, not with the early step
  };
  // FailedPrecondition when the config asks for a variant the others or the driver rule out
  // (the configuration's checks name the key at fault; this is for a Config built in code).
  static Result<Modes> ChooseModes(const Config& config, const OptimizerDriver& driver);

  // The loss scaler from the config's fp16 section, the schedule at its first iteration.
  static Result<std::unique_ptr<StepControl>> Create(
      const Config& config, const ModelPartition& partition, OptimizerDriver& driver,
      ParameterCoordinator& coordinator, GradientReducer& reducer, Placement& placement,
      UpdateGate& gate, PhaseClock& clock, const Modes& modes);
  StepControl(const StepControl&) = delete;
  StepControl& operator=(const StepControl&) = delete;

  // --- The engine's calls (EngineCore's of the same names run these parts) ---

  // A forward begins (not during a backward): the iteration is no longer void, and what a
  // backward that did not end left is cleared (the reducer's thread, the norm's sums).
  void BeginForward();
  // FailedPrecondition for a backward call (`what`) after an update that failed voided the
  // iteration, until the next forward begins.
  Status RefuseVoidBackward(const char* what) const;
  // Before the coordinator's PreBackward: an update in flight completed as far as this
  // backward needs it, the boundary's early step or norm begun; a group an early step took
  // is refused.
  Status PreBackward(int group);
  // After the coordinator's PostBackward: a group whose backward ended is handed to the
  // early step's update (or the norm's thread) once its gradient is final.
  Status PostBackward(int group);
  Status AddGradient(int group, int param, const void* grad, DType dtype,
                     std::shared_ptr<const void> owner);
  // EndBackward: refused twice or in a void iteration; then the reducer flushed, the device
  // waited for, the coordinator's pass ended and the early step's or norm's groups handed
  // over; CountBackward counts the backward (the micro-step's number).
  Status RefuseEndBackward() const;
  Status EndBackward();
  int64_t CountBackward();
  // EndForwardOnly's part before the pass ends: refused with gradients pending; an update
  // in flight completed (a delayed one runs on) and the deferred all-gathers issued.
  Status EndForwardOnly();
  // Step(): at a boundary, the optimizer's step (or its start, pipelined or delayed, or the
  // norm of an early one) and the counters; then the next iteration begun.
  Result<StepOutcome> Step();

  // Completes a pipelined step still in flight (every group opened, the update committed);
  // with `flush`, then issues the all-gathers the coordinator deferred, before a call that
  // runs other collectives (the backward's, the host's).
  //
  // A delayed update in flight writes no working shard: `join` says how far to complete
  // it. kBackward (a backward's call): only when this micro-step's reductions write the host
  // accumulators the update reads (the boundary micro-step, or accumulation on the host);
  // kFinish: the update completed (the master, m and v are the step's), the working shards
  // left one step behind; kDrain: completed and its parameters copied into the working
  // shards. Without a delayed update the three are the same.
  enum class Join : uint8_t { kBackward, kFinish, kDrain };
  Status JoinStep(bool flush = true, Join join = Join::kFinish);

  // --- The counters, the learning rate and the loss scale ---

  int64_t micro_steps() const { return micro_steps_; }
  int64_t global_steps() const { return global_steps_; }
  // Between a backward and its Step(), or an early step's backward begun (its update runs).
  bool between_backward_and_step() const { return backward_since_step_ || early_open(); }
  // Whether a gradient-accumulation boundary's backward (or its step) is between its first
  // call and Step() with its update already started.
  bool early_open() const { return early_ != EarlyPhase::kNone; }
  bool IsGradientAccumulationBoundary() const;
  bool BackwardIsBoundary() const;
  bool iteration_void() const { return void_backward_; }
  bool delayed_copy_out_pending() const { return copy_out_pending_; }
  double LossMultiplier() const;
  const LossScaler& loss_scaler() const { return scaler_; }
  double lr() const;
  Status set_lr(double lr);
  int64_t lr_iteration() const { return lr_iteration_; }
  Status set_lr_iteration(int64_t iteration);
  // A checkpoint's position taken (LoadCheckpoint): the counters, and when given the
  // schedule's position (the override dropped) and the loss scaler's state.
  void Restore(int64_t global_steps, int64_t micro_steps, std::optional<int64_t> lr_iteration,
               const std::optional<LossScaler::State>& scaler);

  // EngineStats: the counters, the loss scale, the delayed update's (after s.optimizer).
  void AddStats(EngineStats& s) const;

 private:
  StepControl(const Config& config, const ModelPartition& partition, OptimizerDriver& driver,
              ParameterCoordinator& coordinator, GradientReducer& reducer, Placement& placement,
              UpdateGate& gate, PhaseClock& clock, const Modes& modes);
  // The delayed update's parameters into the working shards: master -> working shards (the
  // step's rounding), pushed to the device's mirror, the persistent groups gathered again.
  // Collective (the all-gathers): every rank calls it at the same point. Between iterations
  // (a save or a load after Step()) the pass the last Step() began is ended first (its
  // prefetches read the old shards) and begun again after.
  Status CopyOutDelayed();
  // After a pipelined update failed on some rank (every rank agreed: the states are back at
  // the last completed step): the working shards to the device, the iteration in progress
  // ended (its forward ran with partly updated parameters), the persistent groups gathered
  // again, and the step counters back. Returns `failed`, with what could not be restored.
  Status AfterFailedUpdate(Status failed);
  // Moves a working shard read error the coordinator kept to the driver (agreed on at the
  // next step).
  void KeepShardError();
  // The early step: begun by the boundary micro-step's first backward call; groups handed to
  // the optimizer's worker as their gradients are final.
  Status MaybeBeginEarlyStep();
  Status ReleaseFinalGroups();
  // FailedPrecondition for `what` on a group an early step's update already took.
  Status RefuseTaken(int group, const char* what) const;

  const Config& config_;
  const ModelPartition& partition_;
  OptimizerDriver& driver_;
  ParameterCoordinator& coordinator_;
  GradientReducer& reducer_;
  Placement& placement_;
  UpdateGate& gate_;
  PhaseClock& clock_;
  const Modes modes_;
  LossScaler scaler_;
  LrSchedule schedule_;
  int64_t lr_iteration_ = 0;
  std::optional<double> lr_override_;
  int64_t micro_steps_ = 0;
  int64_t global_steps_ = 0;
  bool backward_since_step_ = false;
  // A void iteration (AfterFailedUpdate) until the next forward: its backward is refused.
  bool void_backward_ = false;
  // The working shards are one step behind the master until CopyOutDelayed.
  bool copy_out_pending_ = false;
  uint64_t delayed_steps_ = 0;      // EngineStats::delayed_update_steps
  uint64_t delayed_copy_outs_ = 0;  // of EngineStats::delayed_copy_outs: on this thread
  double delayed_copy_out_s_ = 0;   // of EngineStats::delayed_copy_out_s: on this thread
  double delayed_wait_s_ = 0;       // EngineStats::delayed_update_wait_s
  // kBackward: an early step's update runs and takes groups; kReleased: after its backward,
  // every group given, until Step().
  enum class EarlyPhase : uint8_t { kNone, kBackward, kReleased };
  EarlyPhase early_ = EarlyPhase::kNone;
  // norm_collecting_: this boundary backward hands final groups to the norm's thread (from
  // its first backward call to EndBackward).
  bool norm_collecting_ = false;
  // Per trainable group: its backward ended (kBackward or norm_collecting_).
  std::vector<uint8_t> early_ended_;
};

}  // namespace strata::engine

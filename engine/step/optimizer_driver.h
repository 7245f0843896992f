// OptimizerDriver: the optimizer step over the rank's partition, and the fp32 state it
// keeps in a state store (offload/cpu/state_store.h): master parameters, Adam m and v, and
// the gradient accumulators, each a state of partition_numel floats in chunks of
// sub_group_size elements (sub-group i is chunk i of each). Nothing holds a pointer to them
// past a lease: the same code runs with states resident in host memory and on NVMe.
//
// Step(lr, scaler), at a gradient-accumulation boundary: the local norm and inf/NaN flag,
// ONE all-reduce of [norm², overflow], the skip or the clip coefficient, then one fused
// CPU-Adam (or LAMB: two passes and an all-reduce) pass per sub-group and parameter-group
// run, the new parameters copied into the working shards, the accumulators zeroed and the
// store committed. StartStep runs the update on a worker thread instead (the pipelined
// step); BeginEarlyStep starts it during the backward (the early step); BeginNormInBackward
// sums the norm during the backward. Every variant is bit-identical to Step. I/O errors of a
// store that can fail (NVMe) are agreed on by every rank before anything is committed: no
// step is half-applied and no rank is left waiting in a collective. docs/engine.md,
// "OptimizerDriver", describes each in detail (the order of the passes, the faults, the
// pipelined and early steps, the norm in the backward, the norm as written, lazy zeroing).
//
// Files (engine/step/): optimizer_driver.cc (creation, states, agreement), accumulators.cc,
// sync_step.cc, update.cc, early_step.cc, norm_in_backward.cc; driver_internal.h.
// Ownership and lifetime: borrows the partition, the state store, the working shards,
// the communicator and the CpuAdam; all must outlive it.
// Thread-safety: not thread-safe; call from the engine's thread (the pipelined update's
// worker and the norm's thread are internal).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/status.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/step/device_sums.h"
#include "strata/engine/step/loss_scaler.h"
#include "strata/engine/timeline/timeline.h"
#include "strata/offload/cpu/state_store.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

// LAMB's own settings (DeepSpeed FusedLamb's): the trust ratio's clamp and where eps goes.
struct LambOptions {
  double max_coeff = 10.0;
  double min_coeff = 0.01;
  bool eps_inside_sqrt = false;
};

// What tests (and benchmarks) set in the driver; the defaults are production's.
struct DriverTestHooks {
  // Called right before (true) and after (false) the kernels of sub-group i run.
  // (Pipelined: on the update's worker thread, before the first and after the last run of
  // sub-group i in the update's order.)
  std::function<void(size_t sub_group, bool begin)> on_update;
  // Called on the pipelined update's worker thread right after group g's new
  // parameters are in its working shard (WaitGroup(g) then returns); by Step (Adam), for
  // every group after the whole update.
  std::function<void(int group)> on_group_updated;
  // Called on the norm's thread (strata.norm_in_backward) after it summed (and kept)
  // the tiles group g was the last to make final.
  std::function<void(int group)> on_norm_summed;
  // Sum the gradient norm's tiles as the reduced gradients are written into zeroed
  // accumulators on the boundary micro-step (docs/engine.md, "The norm as
  // written"). Bit-identical either way; false: tests comparing the two.
  bool norm_as_written = true;
  // Zero spent accumulators lazily (host-memory stores; docs/engine.md, "Lazy
  // zeroing"): the update leaves its gradients in place and the next backward's first
  // addition writes over them. Bit-identical either way; false: tests and benchmarks
  // comparing the two.
  bool lazy_zero = true;
  // Called on the engine's thread when an early step's Step() begins summing the
  // norm's tiles its worker has not, the worker held (it takes no group until the sums end).
  std::function<void()> on_early_norm;
  // The pipelined step's staging buffers (OptimizerDriverOptions::staged_shard_buffers);
  // 0: the option's.
  size_t staged_shard_buffers = 0;
};

struct OptimizerDriverOptions {
  AdamParams adam;                        // lr is replaced by Step's
  uint64_t sub_group_elems = 1000000000;  // sub_group_size
  double gradient_clipping = 0.0;         // 0 = off
  // Parameter groups (torch.optim's): each group's hyper-parameters; empty: one group,
  // `adam`. A group's learning rate is scaled with the schedule: at a step with learning
  // rate lr, group k uses lr * groups[k].lr / adam.lr (adam.lr = 0: lr).
  std::vector<AdamParams> groups;
  // [engine group][parameter] -> index into `groups` (empty: every parameter in group 0).
  // The padding after a parameter goes with it (its gradient is zero: it stays zero).
  std::vector<std::vector<int>> param_group;
  // LAMB instead of Adam: each group's lr, betas, eps, weight_decay and bias_correction with
  // these (weight_decay_mode is not used: LAMB's decay is part of its update).
  std::optional<LambOptions> lamb;
  // Skip a step whose gradients hold inf/NaN on any rank (strata.skip_inf_nan_steps);
  // false: apply it (warned and counted). With fp16 loss scaling the scaler decides.
  bool skip_inf_nan = true;
  // Sub-groups read ahead of the one being updated (pipeline_read: strata.swap_pipeline_depth
  // - 1; 0: none). The accumulator chunks of the norm pass are read as far ahead.
  size_t prefetch_ahead = 0;
  // Tests' and benchmarks' knobs (DriverTestHooks), passed whole.
  DriverTestHooks test;
  // Where each sub-group's CPU optimizer pass is recorded (engine/timeline/timeline.h); null:
  // nowhere.
  Timeline* timeline = nullptr;
  // The pipelined step with working shards in a store that can fail (NVMe): the staging
  // buffers the update writes new parameters into (see the header comment), each the size
  // of the largest such shard. How many the worker keeps while some group waits to be
  // handed over (at least 1; two let it update one group while the last one waits), and
  // where they come from (null: the heap; called on the update's worker: thread-safe).
  size_t staged_shard_buffers = 2;
  offload::StateAllocator staging_allocator;
  // Called first on each thread the driver starts (the update worker, the norm thread):
  // Device::BindThread, so that device calls there (registering a staging buffer) go to
  // this rank's device. Null: nothing.
  std::function<Status()> bind_thread;
  // The gradient accumulators in device memory, where the reducer sums the micro-steps
  // (docs/engine.md, "CPU-Adam on the device's sums"): the accumulator state is registered
  // there instead of in the state store, each chunk is read to the host by its lease once
  // per step, the norm is summed on the device (DeviceSumsStore::NormTiles) and spent sums
  // are zeroed there. Accumulate is then refused (the reducer adds on the device), and so
  // are the early step and the norm in the backward. Null: the accumulators are the
  // store's. Must outlive the driver.
  DeviceSumsStore* device_sums = nullptr;
};

// The driver's states.
enum class OptimizerState : uint8_t { kMaster, kExpAvg, kExpAvgSq, kGradAccumulator };
std::string_view OptimizerStateName(OptimizerState s);  // "fp32 master parameters", ...

struct StepOutcome {
  bool boundary = false;     // a gradient-accumulation boundary (false: nothing was done)
  bool applied = false;      // the parameters were updated
  bool overflow = false;     // some gradient was inf/NaN: the step was skipped
  double global_norm = 0.0;  // unscaled, over all ranks (before clipping)
  double clip_coef = 1.0;
  double lr = 0.0;
  double loss_scale = 1.0;  // the scale the gradients carried
  int64_t adam_step = 0;    // the optimizer's step count after this step
};

struct OptimizerStats {
  uint64_t steps_applied = 0;
  uint64_t steps_skipped = 0;
  // Fused optimizer passes: Adam one per sub-group and step; LAMB two per piece and step.
  uint64_t adam_calls = 0;
  uint64_t elements_updated = 0;  // elements passed to CPU-Adam, padding included
  uint64_t params_updated = 0;    // real parameter elements of the rank's shards, summed
  uint64_t norm_all_reduce_calls = 0;
  // LAMB: the all-reduces of the per-parameter norm sums (one per applied step), their
  // bytes, and the smallest and largest trust ratio of the last applied step (over every
  // parameter of the model; the same on every rank).
  uint64_t lamb_norms_all_reduce_calls = 0;
  uint64_t lamb_norms_all_reduce_bytes = 0;
  double lamb_trust_ratio_min = 0.0;
  double lamb_trust_ratio_max = 0.0;
  uint64_t master_bytes = 0;  // per rank
  uint64_t exp_avg_bytes = 0;
  uint64_t exp_avg_sq_bytes = 0;
  uint64_t grad_accumulator_bytes = 0;
  // Reduced gradient elements added into accumulators known to hold +0.0 (the first
  // gradient after a step): written without reading the accumulator.
  uint64_t acc_elements_added_to_zero = 0;
  // Lazy zeroing (OptimizerDriverOptions::lazy_zero): accumulator chunks whose spent
  // gradients were left in place instead of zeroed (each counted at each step), and the
  // elements among them zeroed later anyway because no gradient wrote over them before they
  // were read (a parameter without a gradient in the next step).
  uint64_t acc_chunks_zeroed_lazily = 0;
  uint64_t acc_stale_elements_zeroed = 0;
  uint64_t sub_groups = 0;  // chunks of each state
  double last_global_norm = 0.0;
  double step_s = 0;  // seconds in Step (norm all-reduce, CPU-Adam, copy-out, commit)
  double adam_s = 0;  // of which in the CPU-Adam / LAMB kernels
  // Of step_s, the seconds reading and summing this rank's gradient norm before its
  // all-reduce (the tiles the backward did not sum; NVMe states: the chunks not noted as
  // they were written out): the "gradient norm" span of the timeline.
  double norm_s = 0;
  // Pipelined steps (StartStep with an update; counted when started, like steps_applied),
  // the wall time from each completed update's start to its worker's end (in the
  // background, not in step_s), and the seconds the engine's thread waited for their groups
  // (WaitGroup, FinishUpdate).
  uint64_t steps_pipelined = 0;
  // Of those, early steps (strata.early_step), and the groups whose update was handed to
  // the worker during a backward (the rest after it).
  uint64_t steps_early = 0;
  uint64_t groups_released_in_backward = 0;
  // The gradient norm summed during the backward, by tile (CpuAdam::kTileElems elements):
  // the tiles an early step's worker or the norm's thread (strata.norm_in_backward) summed
  // as their groups became final (an early step's counted when its update completes), and
  // those Step() summed itself. Steps whose norm was begun during the backward, and of
  // those, the ones whose sums were dropped (a gradient added into a group already summed,
  // or another use of the accumulators before Step).
  uint64_t norm_tiles_in_background = 0;
  uint64_t norm_tiles_in_step = 0;
  // Tiles of the norm whose sums came from the write of the reduced gradient into zeroed
  // accumulators (CpuAdam::AddToZeroedWithNormTiles; OptimizerDriverOptions::
  // norm_as_written): not read again at all. With the two above, every tile of a step's
  // norm when it was begun during the backward.
  uint64_t norm_tiles_as_written = 0;
  uint64_t norms_in_backward = 0;
  uint64_t norms_in_backward_dropped = 0;
  // Steps applied although some gradient was inf/NaN (skip_inf_nan false).
  uint64_t steps_inf_nan_applied = 0;
  double pipelined_update_s = 0;
  double pipelined_wait_s = 0;
  // The delayed update (StartStep's copy_out_first): the updates whose worker copies the
  // last delayed update's parameters into the working shards first (counted when started),
  // and the worker's seconds doing so (completed updates).
  uint64_t delayed_copy_outs = 0;
  double delayed_copy_out_s = 0;
  // Of the optimizer store's read and write waits (StateStoreStats::read_wait_s,
  // write_wait_s), the seconds the pipelined update's worker waited while it streamed the
  // states (NVMe): waits beside the forward, not the engine's thread's.
  double pipelined_store_wait_s = 0;
  // Working shards on NVMe, pipelined: the groups' new parameters copied from a staging
  // buffer into the store by the engine's thread, the seconds that took, and the most
  // staging buffers an update held.
  uint64_t shard_handovers = 0;
  double shard_handover_s = 0;
  // Of shard_handovers, those that gave the store the staging buffer itself (no copy:
  // StateStore::Exchange); the rest were copied.
  uint64_t shard_handovers_exchanged = 0;
  // Of those, the ones that carried their block CRC32Cs, computed by the update's worker
  // on CPU-Adam's threads once the group was done (the store's write then computes none,
  // so the engine's thread does not), and the worker's seconds computing them (completed
  // updates, like adam_s).
  uint64_t shard_handovers_checksummed = 0;
  double shard_checksum_s = 0;
  uint64_t staging_buffers = 0;
  // Steps that failed on an I/O error (on any rank) and were rolled back.
  uint64_t steps_failed = 0;
  // Per parameter group: the learning rate of the last applied step and the rank's
  // elements (padding included) in the group.
  std::vector<double> group_lr;
  std::vector<uint64_t> group_elements;
};

class OptimizerDriver {
 public:
  static Result<std::unique_ptr<OptimizerDriver>> Create(
      const ModelPartition* partition, offload::StateStore* store, WorkingShards* working_shards,
      comm::Communicator* comm, const CpuAdam* adam, const OptimizerDriverOptions& options);
  // Waits for a pipelined update still in flight (its leases go back to the stores).
  ~OptimizerDriver();
  OptimizerDriver(const OptimizerDriver&) = delete;
  OptimizerDriver& operator=(const OptimizerDriver&) = delete;

  // Writes `values` into the fp32 master parameters at partition element `offset` (to
  // initialize them). Then call SyncWorkingFromMaster and Commit.
  Status WriteMaster(size_t offset, std::span<const float> values);
  // Reads the master parameters at `offset` into `out`.
  Status ReadMaster(size_t offset, std::span<float> out);
  // A copy of a whole state (partition_numel floats), for tests and tools.
  Result<std::vector<float>> CopyState(OptimizerState state);
  // Reads / writes elements [offset, offset + n) of the master, m or v (checkpoints). A
  // write that covers a whole chunk does not read it first. Written values belong to the
  // store's epoch: commit them as CommitMasterAgreed does.
  Status ReadState(OptimizerState s, size_t offset, std::span<float> out);
  // Calls fn(offset, values) on every chunk of state s in order, each held for reading
  // while fn runs (no copy; a store that swaps reads it in).
  Status VisitState(OptimizerState s,
                    const std::function<Status(size_t offset, std::span<const float>)>& fn);
  Status WriteState(OptimizerState s, size_t offset, std::span<const float> values);
  // working = master rounded to the working dtype.
  Status SyncWorkingFromMaster();
  // Commits what was written since the last step (after initialization); a store that can
  // fail agrees on the outcome with the other ranks (a collective: every rank calls it).
  Status Commit();
  // Commits master values written since the last commit (WriteMaster: loaded parameters)
  // once every rank agrees that its `local` outcome, the working shards' sync from the
  // master and (a store that can fail) its writes succeeded. Collective. On a failure on
  // any rank every rank returns `when` failed, naming the ranks and their messages, and
  // rolls back: a store that can fail returns to its committed contents, the host store
  // keeps what was written (the message says which).
  Status CommitMasterAgreed(Status local, std::string_view when);

  // Keeps an I/O error seen outside the driver (a working shard that could not be read for
  // an all-gather) to be agreed on at the next Step like an accumulation error: every rank
  // then fails that step and rolls back. The first error is kept.
  void KeepIoError(Status error) {
    if (acc_error_.ok()) acc_error_ = std::move(error);
  }

  // Adds `n` reduced gradient elements of `dtype` into the accumulators at `offset` (the
  // reducer's AccumulateFn). An I/O error is kept and reported at the next Step, by every
  // rank (Ok is returned, so no rank leaves the backward's collectives early).
  Status Accumulate(size_t offset, const std::byte* src, DType dtype, size_t n);

  // See the header comment. `scaler` is updated (fp16) or left alone (disabled).
  // `betas`: Adam's (beta1, beta2) for this step when the schedule sets them (OneCycle), for
  // every group; nullopt: each group's own.
  Result<StepOutcome> Step(double lr, LossScaler& scaler,
                           std::optional<std::pair<double, double>> betas = std::nullopt);
  Status ZeroGradAccumulators();

  // The pipelined step (see the header comment). Whether this driver can pipeline its step
  // (Adam; the states and working shards in memory or on NVMe).
  bool CanPipeline() const { return !options_.lamb; }
  // With working shards in a store that can fail (NVMe): allocates the pipelined step's
  // staged_shard_buffers staging buffers now (kept for every update); Ok at once otherwise.
  // An allocation failure names the buffers and their size.
  Status ReserveStaging();
  // Whether either store (optimizer states, working shards) can fail (NVMe): Commit,
  // FinishUpdate and a failed step then agree with the other ranks (collectives).
  bool can_fail() const;
  // The optimizer store's counters; while a pipelined update streams the states through a
  // store that can fail, those of the update's start (the worker owns the store then).
  offload::StateStoreStats store_stats() const;
  // Steps 1-4 as Step (a skipped step is finished here, and so is a step with nothing to
  // update); then starts step 5 on a worker and returns with it in flight (update_in_flight):
  // the outcome says applied, the step counters are those of the step. `group_order`: the
  // trainable groups (working-shard indices) in the order the next forward needs them;
  // groups it leaves out come after, in index order. FailedPrecondition unless CanPipeline.
  // `keep_shards` (the delayed update, strata.delayed_update): the update writes the master,
  // m and v only and leaves the working shards as they are, unleased (WaitGroup returns at
  // once); SyncWorkingFromMaster after FinishUpdate copies the master out.
  // `copy_out_first` (with keep_shards): the worker first copies each group's master, as the
  // last delayed update left it, into its working shard (the group is then done: WaitGroup
  // and GroupUpdated as for a pipelined step), then runs its Adam pass.
  Result<StepOutcome> StartStep(double lr, LossScaler& scaler,
                                std::optional<std::pair<double, double>> betas,
                                const std::vector<int>& group_order, bool keep_shards = false,
                                bool copy_out_first = false);
  bool update_in_flight() const { return update_ != nullptr; }
  // Whether group g's new parameters are in its working shard (true when no update is in
  // flight, or g has no optimizer state); does not block.
  bool GroupUpdated(int group) const;
  // Whether group g's working shard in its store is its current one: no update in flight,
  // or its new shard was written there (a staged shard handed over, or a leased one handed
  // back by WaitGroup). False while the update will still write it; the engine's thread.
  bool ShardInStore(int group) const;
  // Blocks until group g's new parameters are in its working shard and gives the shard
  // back to its store (the coordinator may then read it); a staged shard (working shards
  // on NVMe) is copied into its store then, after those done before it. An error of the
  // update is returned by every later call until FinishUpdate; with states on NVMe
  // (can_fail) it is kept for FinishUpdate instead, and the shard handed back as the update
  // left it (a staged shard: as it was before the step).
  Status WaitGroup(int group);
  // Waits for the whole update, hands back every lease, commits the step and counts it
  // (Step's step 6); Ok at once when none is in flight. The update's spans go to the
  // timeline here. An error of the update (a kernel's: host stores cannot fail) is
  // returned, the states then partly updated as a failing Step leaves them. With a store
  // that can fail a collective: every rank's outcome is agreed on first, and on a failure
  // anywhere every rank returns the error and is back at the last completed step
  // (stats().steps_failed counts it).
  Status FinishUpdate();

  // The early step (see the header comment). Whether this driver can start its update during
  // the backward (CanPipeline, Adam, inf/NaN steps applied).
  // (The states stay in memory: Accumulate adds through the update's leases.)
  bool CanStepEarly() const {
    return CanPipeline() && !options_.skip_inf_nan && !can_fail() && sums_ == nullptr;
  }
  // At the boundary micro-step's first backward call: the step's learning rate and betas
  // (as Step takes them) and the scaler (disabled: its scale is 1). FailedPrecondition while
  // an update is in flight or when the scaler is enabled, unless CanStepEarly.
  Status BeginEarlyStep(double lr, std::optional<std::pair<double, double>> betas,
                        const LossScaler& scaler);
  // Whether an early step was begun and StepEarly not yet called.
  bool early_collecting() const { return early_collecting_; }
  // Hands group g (a working-shard group whose gradient in the accumulators is final) to
  // the update's worker; its working shard is leased here. A group given twice is ignored.
  Status ReleaseGroup(int group);
  // After the backward: every group not given yet, in `order` then index order, and every
  // group given and not taken put in `order`; the worker ends once they are done.
  Status ReleaseRemainingGroups(const std::vector<int>& order);
  // Whether group g was given to the worker.
  bool GroupReleased(int group) const;

  // The norm in the backward (see the header comment). Whether this driver can sum it then
  // (optimizer states in a store that cannot fail: host memory; accumulators on the host).
  bool CanSumNormInBackward() const { return !store_->can_fail() && sums_ == nullptr; }
  // Whether the accumulators are the device's (OptimizerDriverOptions::device_sums).
  bool sums_on_device() const { return sums_ != nullptr; }
  // At the boundary micro-step's first backward call (no update in flight, no early step).
  Status BeginNormInBackward();
  // Hands group g, whose gradient in the accumulators is final, to the norm's thread; no-op
  // without a norm in the backward (none begun, or dropped) or when g was given already.
  void NormGroupFinal(int group);
  // After the backward: every group not given yet, in `order` then index order.
  void NormGroupsFinal(const std::vector<int>& order);
  // Whether group g was handed to the norm's thread (false without a norm in the backward).
  bool NormGroupGiven(int group) const;
  // Stops the norm's thread and forgets its sums (Step sums every tile).
  void DropNormInBackward();
  // Whether the gradients added from now on are the boundary micro-step's (the last before
  // Step): only then are the norm's tiles summed as they are written (an earlier micro-
  // step's tiles are added into again). The engine calls it as each micro-step's backward
  // begins; the reducer's thread reads it. Default true.
  void set_boundary_micro_step(bool boundary) {
    boundary_micro_step_.store(boundary, std::memory_order_relaxed);
  }
  // Steps 1-4 of an early step (the norm and overflow, from the leased accumulators, one
  // all-reduce; nothing is skipped or clipped); the update goes on as a pipelined one.
  Result<StepOutcome> StepEarly(double lr, LossScaler& scaler);

  // The order in which the step visits the sub-groups (a permutation of 0..sub_groups-1).
  Status set_sub_group_order(std::vector<size_t> order);
  const std::vector<size_t>& sub_group_order() const { return order_; }
  size_t num_sub_groups() const { return num_chunks_; }

  int64_t adam_step() const;
  Status set_adam_step(int64_t step);
  OptimizerStats stats() const { return stats_; }
  offload::StateStore* store() const { return store_; }

 private:
  OptimizerDriver(const ModelPartition* partition, offload::StateStore* store,
                  WorkingShards* working, comm::Communicator* comm, const CpuAdam* adam,
                  const OptimizerDriverOptions& options);

  // A run of the rank's partition [offset, offset + count) in one parameter group.
  struct Run {
    size_t offset;
    size_t count;
    int group;
  };
  Status BuildRuns();
  // LAMB: a parameter's elements on this rank (its padding included) within one sub-group
  // window; `param` counts the model's parameters over all engine groups.
  struct Piece {
    size_t offset;
    size_t count;
    int param;
    int group;
  };
  void BuildPieces();
  // Group k's hyper-parameters at a step with learning rate `lr`.
  AdamParams GroupParamsAt(size_t k, double lr,
                           std::optional<std::pair<double, double>> betas) const;
  // Every parameter group's hyper-parameters at a step with learning rate `lr`, set in
  // the optimizer (and noted in the statistics).
  Result<std::vector<AdamParams>> AdamParamsAt(double lr,
                                               std::optional<std::pair<double, double>> betas);
  // Step 5 with Adam; returns the fused passes run.
  Result<size_t> StepAdam(double lr, std::optional<std::pair<double, double>> betas,
                          const GradScaling& scaling, int64_t step);
  // Step 5 with LAMB. A local I/O error goes to `io_error` (the all-reduce still runs).
  Status StepLamb(double lr, std::optional<std::pair<double, double>> betas,
                  const GradScaling& scaling, int64_t step, Status& io_error);
  // Sub-group i's range of the partition.
  size_t chunk_begin(size_t i) const { return i * chunk_elems_; }
  size_t chunk_end(size_t i) const;
  // The end of the group's shard that holds partition element `offset`.
  size_t group_end(size_t offset) const;
  // Whether the shard of the group holding `offset` lies inside sub-group i's window (its
  // copy-out then writes the whole shard while holding it).
  bool group_inside(size_t offset, size_t i) const;
  offload::StateId id(OptimizerState s) const { return ids_[static_cast<size_t>(s)]; }
  // Leases on sub-group i's chunks of the states in `which` (others stay invalid).
  struct Leases {
    offload::StateLease l[4];
    std::span<float> span(OptimizerState s) { return l[static_cast<size_t>(s)].as<float>(); }
  };
  // One fused CPU-Adam pass over run `r` of sub-group i (its chunks held in `l`), with the
  // new parameters copied out to `to` (the run's place in its working shard). `zero_grad`:
  // the run's accumulators are zeroed tile by tile as the kernel leaves them (their lease
  // must be writable).
  Status AdamRun(Leases& l, size_t i, const Run& r, std::byte* to, const AdamParams& params,
                 int64_t step, const GradScaling& scaling, bool zero_grad = false) const;
  // Master values rounded into working-shard memory at `to` in the working dtype (the
  // step's rounding); CopyOutRun: run r's, from sub-group i's leases.
  Status RoundInto(std::span<const float> master, std::byte* to) const;
  Status CopyOutRun(Leases& l, size_t i, const Run& r, std::byte* to) const;
  Result<Leases> AcquireSubGroup(size_t i, const offload::Access (&access)[4]);
  void PrefetchSubGroup(size_t i, const offload::Access (&access)[4]);
  // Applies `fn(leases, begin, end)` to the chunks covering [offset, offset + n).
  template <typename Fn>
  Status ForRange(OptimizerState s, size_t offset, size_t n, offload::Access access, Fn fn);
  // Commits the store's epoch; a store that can fail first writes it, and every rank agrees
  // on `local` and its own write outcome (Agree) before any commits.
  Status CommitAgreed(Status local, std::string_view when);
  // Every rank: whether any rank's `local` failed (`flags`: the ranks' flags, already
  // all-reduced; empty: all-reduced here). On a failure every rank gets an error naming the
  // failing ranks and their messages, the store rolls back, and the working shards are
  // rewritten from the committed master.
  Status Agree(const Status& local, std::vector<float> flags, std::string_view when);
  // The store and the working shards back to the committed contents, the working shards
  // rewritten from the committed master.
  Status RollbackEpoch();

  const ModelPartition* partition_;
  std::vector<Run> runs_;      // in offset order, covering the partition
  std::vector<Piece> pieces_;  // LAMB only, in offset order
  size_t num_params_ = 0;      // of the whole model
  WorkingShards* working_;
  DType dtype_;
  comm::Communicator* comm_;
  const CpuAdam* cpu_adam_;
  AdamOptimizer optimizer_;
  OptimizerDriverOptions options_;
  offload::StateStore* store_;
  DeviceSumsStore* sums_ = nullptr;  // options_.device_sums
  // The store of state s: the accumulators' may be the device's sums, the rest store_.
  offload::StateStore* StoreFor(OptimizerState s) const {
    return s == OptimizerState::kGradAccumulator && sums_ != nullptr ? sums_ : store_;
  }
  offload::StateStore* StoreAt(size_t k) const {
    return k == static_cast<size_t>(OptimizerState::kGradAccumulator) && sums_ != nullptr ? sums_
                                                                                          : store_;
  }
  // The device's sums: chunk i's norm summed there (its tiles copied back).
  Status NoteDeviceNorm(size_t chunk);
  offload::StateId ids_[4];
  size_t chunk_elems_ = 0;
  size_t num_chunks_ = 0;
  std::vector<size_t> order_;                 // the step's sub-group order
  std::vector<std::vector<Run>> chunk_runs_;  // Adam: the runs of each sub-group
  Status acc_error_;                          // kept from Accumulate until the next Step
  // Each accumulator chunk's local sum of squares (unscaled) and inf/NaN flag, noted when a
  // store writes the chunk out (its write hook) or when the norm pass reads it, and
  // forgotten when the chunk changes: the norm pass reads only chunks it has no sum for.
  struct ChunkNorm {
    bool valid = false;
    double sum_sq = 0.0;
    bool inf_nan = false;
    uint32_t tiles_as_written = 0;  // of its tiles, the sums kept from the write (counted)
  };
  std::vector<ChunkNorm> acc_norm_;
  Status NoteAccNorm(size_t chunk, std::span<const float> values);
  // Notes chunk i's norm from its tiles summed as written when every tile was (nothing is
  // read); false otherwise.
  bool NoteAccNormAsWritten(size_t chunk);
  // Which accumulator elements are known to hold +0.0: per chunk, whether it was zeroed
  // (by the engine's thread, or by an update it completed) since its contents were last
  // unknown (WriteState, rollbacks), and the ranges added into since. Accumulate writes
  // the rest without reading it (BulkAddToZeroedFloat: the same sums, less memory
  // traffic); ZeroGradAccumulators skips chunks still wholly zero.
  // Also the norm's tiles summed as they were written (AddToZeroedWithNormTiles: a tile
  // written whole by one addition into zeroed accumulators on the boundary micro-step),
  // until anything else touches the tile: read by the norm's summers instead of the tile.
  // Sized once (the norm's threads read them while the engine's thread writes other tiles).
  // With lazy zeroing, `stale`: ranges that may still hold a spent step's gradients where
  // nothing was added since (`added` overrides it), read as +0.0 all the same: Accumulate
  // writes over them, any other reader zeroes them first (MaterializeZeros). Empty unless
  // `zeroed`.
  struct AccZeros {
    bool zeroed = false;
    std::vector<std::pair<size_t, size_t>> added;  // [begin, end) in the chunk, sorted, disjoint
    std::vector<std::pair<size_t, size_t>> stale;  // the same
    std::vector<double> tile_sum;                  // per tile
    std::vector<uint8_t> tile_summed;              // per tile: tile_sum holds its sum
    bool all_zero() const { return zeroed && added.empty(); }
    void Set(bool z) {
      zeroed = z;
      added.clear();
      stale.clear();
      std::fill(tile_summed.begin(), tile_summed.end(), uint8_t{0});
    }
  };
  std::vector<AccZeros> acc_zeros_;
  void ForgetTilesAsWritten() {
    for (AccZeros& z : acc_zeros_)
      std::fill(z.tile_summed.begin(), z.tile_summed.end(), uint8_t{0});
  }
  void SetAccZeros(bool zeroed) {
    for (AccZeros& z : acc_zeros_)
      z.Set(zeroed);
  }
  // Adds src (n elements of dtype) into chunk i's elements [pos, pos + n) of the partition,
  // at `dst` (the chunk's element pos): the elements known zero without reading them (the
  // whole tiles among them with their norm's sums, on the boundary micro-step).
  void AddIntoChunk(size_t i, size_t pos, const std::byte* src, DType dtype, float* dst, size_t n);
  std::atomic<bool> boundary_micro_step_{true};
  // Chunk i's tile sums kept from the write: copies them into `sums` (per tile of the
  // chunk), marks them in `have`, returns how many.
  size_t TilesAsWritten(size_t i, std::span<double> sums, std::vector<uint8_t>& have) const;
  // Sums the tiles of `acc` (a chunk's accumulators) whose `done` is 0 into `sums` (per
  // tile), each run of them in one pass; returns how many.
  Result<size_t> SumTilesLeft(std::span<const float> acc, std::span<double> sums,
                              const std::vector<uint8_t>& done) const;
  // Zeroes accumulator chunk i: in host memory through a lease on CPU-Adam's threads (the
  // store's own ZeroChunk is one memset on this thread), else the store's ZeroChunk (NVMe:
  // no write, rolled back with the step).
  Status ZeroAccumulatorChunk(size_t i);
  // Lazy zeroing (host-memory stores, OptimizerDriverOptions::lazy_zero).
  bool LazyZero() const;
  // Chunk i's spent gradients are left where they are, known as zero from now on: its
  // added ranges become stale. Only for a chunk `zeroed` (else its contents are unknown and
  // are zeroed for real).
  void ZeroLazily(size_t i);
  // Zeroes the stale elements of chunk i's [b, e) (chunk-relative; `acc` is the chunk)
  // that no gradient was written over: the range then reads as it holds.
  void MaterializeZeros(size_t i, size_t b, size_t e, float* acc);
  // The same for group g's shard, `acc_of` giving each chunk's accumulators.
  void MaterializeGroupZeros(int g, const std::function<std::span<float>(size_t)>& acc_of);
  // The same for whole chunks [first, end), through the leases held (the norm in the
  // backward's, an update's) or new ones: before any read of the accumulators.
  Status MaterializeChunkZeros(size_t first, size_t end);
  uint64_t real_shard_elems_ = 0;
  OptimizerStats stats_;

  // Steps 1-4 of Step: the norm, the agreement on I/O errors, overflow and clipping.
  // Returns whether the update (step 5) runs; a skipped step is zeroed and committed here.
  Result<bool> Prepare(double lr, LossScaler& scaler, StepOutcome& out, GradScaling& scaling);
  // Prepare, its time counted in step_s (the pipelined and early steps, which return with
  // the update in flight).
  Result<bool> TimedPrepare(double lr, LossScaler& scaler, StepOutcome& out, GradScaling& scaling);
  // Step 6 after the update: zero the accumulators, commit (agreed on `io`) and count.
  Result<StepOutcome> Finish(StepOutcome out, Status io, size_t calls, int64_t next_step);
  // A pipelined update in flight (StartStep or BeginEarlyStep .. FinishUpdate).
  struct Update;
  // The update of a step with hyper-parameters `params` and gradient scaling `scaling`:
  // every run by group, every chunk leased; the worker is started (waiting for groups).
  Result<std::unique_ptr<Update>> NewUpdate(std::vector<AdamParams> params, GradScaling scaling,
                                            bool early, bool keep_shards = false,
                                            bool copy_out_first = false);
  void RunUpdate(Update& u);  // the worker's body
  // The worker, with the device's sums: sub-group i's leased (copied to the host, the next
  // one's copy queued), and after its last run given back and zeroed on the device.
  Status LeaseSums(Update& u, size_t i);
  Status SpendSums(Update& u, size_t i);
  // The worker's body with states on NVMe: the sub-groups streamed through the store.
  Status RunStreamedUpdate(Update& u);
  // A group's update is done (the worker): noted and announced (on_group_updated); a
  // staged group's block CRCs computed first (ShardChecksums).
  void GroupDone(Update& u, int group);
  // The worker: the block CRCs of staged group g's write from its staging buffer, computed
  // on CPU-Adam's threads, for its hand-over (StateStore::Exchange's block_crcs); empty
  // when its store keeps none, its buffer was never written, or the hand-over copies.
  std::vector<uint32_t> ShardChecksums(Update& u, int group);
  Status Give(Update& u, int group);  // hands group g to the worker (engine thread)
  void CloseUpdate(Update& u);        // no more groups: the worker ends after the given ones
  // The accumulator span of chunk i: from the update's lease while one is in flight, else
  // from the norm in the backward's.
  std::span<float> LeasedAccumulator(size_t i);
  // Where the worker writes group g's new parameters: its leased shard, or (staged) a
  // staging buffer, taken or allocated when the group's first run comes; null when the
  // update is aborted meanwhile.
  Result<std::byte*> ShardOut(Update& u, int group);
  // The engine's thread: copies staged group g into its store and gives the buffer back
  // (an error is kept in the update); HandOverReady does so for every group done so far
  // (FinishUpdate).
  void HandOver(Update& u, int group);
  void HandOverReady(Update& u);
  // Staging buffers, kept from one update to the next.
  std::vector<offload::StateMemory> staging_pool_;
  // Whether group g's shard goes through a staging buffer (it lives in a store that can
  // fail), and the largest such shard's bytes (0: none).
  bool ShardStaged(int group) const {
    return working_->has(group) && working_->store_of(group)->can_fail();
  }
  size_t StagingBytes() const;
  // OptimizerDriverOptions::staged_shard_buffers, or the test hook's.
  size_t StagedShardBuffers() const;
  // Whether group g's hand-over from staging buffer `buffer` gives the store that buffer
  // (Exchange: at least the store's buffer size, 4096-byte aligned) rather than copying.
  bool ExchangesInto(int group, const offload::StateMemory& buffer) const;
  std::unique_ptr<Update> update_;
  bool early_collecting_ = false;
  // The norm in the backward, while begun and not yet summed up or dropped.
  struct NormAhead;
  std::unique_ptr<NormAhead> norm_ahead_;
  void RunNormAhead(NormAhead& n);  // its thread's body
  // Prepare: stops the thread, notes every chunk's norm from its tiles and the tiles left,
  // and gives the leases back.
  Status SumNormInBackward();
  // Whether elements [offset, offset + n) hold some group handed to the norm's thread.
  bool NormGivenIn(size_t offset, size_t n) const;
  // The gradient norm's tiles (an early step's and the norm in the backward's).
  struct TileNorms;
  TileNorms NewTileNorms() const;
  // Sums the tiles group g was the last to make final (`acc`: chunk i's accumulators,
  // held; `mu` guards `t.tile_done`).
  Status SumFinalTiles(TileNorms& t, std::mutex& mu,
                       const std::function<std::span<float>(size_t)>& acc, int group) const;
  // Chunk i's norm from the tiles summed and the rest summed here (bit-identical to
  // NoteAccNorm).
  Status NoteTiledAccNorm(TileNorms& t, std::mutex& mu, std::span<float> acc, size_t chunk);
  // An early step's chunks, from its update's tiles and the rest summed here while its
  // worker takes no group (the two would share CPU-Adam's threads and memory bandwidth).
  Status NoteEarlyAccNorms(const std::vector<size_t>& chunks);
};

}  // namespace strata::engine

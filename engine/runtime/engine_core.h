// EngineCore: the front-end-agnostic ZeRO-3 engine (docs/architecture.md), torch-free.
//
// Built from a Config, a Communicator and a description of the parameter groups (one
// group per wrapped module plus a root group; per parameter its name, numel and initial
// values). It partitions the groups (partition.h), places the working shards on the
// parameter tier and the fp32 master / m / v / gradient accumulators on the optimizer tier
// (tier.h: device, or host with offload_*.device = cpu, or swap slots on NVMe behind a
// state store with offload_*.device = nvme; working_shards.h), and drives the
// ParameterCoordinator, the GradientReducer and the OptimizerDriver. A front end (the
// LibTorch module holder, the Python hooks) calls, per micro-step:
//
//   forward:   PreForward(g); FullBuffer(g) -> point g's parameter tensors at the views;
//              run the module; PostForward(g)
//   loss:      multiply by LossMultiplier() (loss scale / gradient_accumulation_steps)
//   backward:  PreBackward(g) before module g's gradient functions run;
//              AddGradient(g, i, grad, dtype) from each parameter's gradient hook (the
//              gradient may be freed right after); PostBackward(g) after them;
//              EndBackward() when the autograd backward returns
//   step:      Step() after every backward; it applies the optimizer at a gradient-
//              accumulation boundary (every gradient_accumulation_steps-th call) and
//              otherwise only starts the next iteration's prefetch.
//
// All ranks must make the same calls in the same order with the same sizes (the
// collectives are issued in call order). Initial values are rank 0's (broadcast), unless
// EngineOptions::broadcast_initial_values is off.
//
// Errors: Status/Result everywhere; misuse (Step before a backward, an unknown group, a
// Post without its Pre, EndBackward while a group is in use) is FailedPrecondition.
// Ownership and lifetime: owns its tiers, buffers and components; shares the
// communicator. Buffers returned by FullBuffer stay valid until the group's Post* call.
// Pipelined step (strata.pipeline_step): Step() may return with the CPU
// optimizer's update still running on a worker thread, group by group in the order the next
// forward uses them; a fetch of a group waits only for that group's update. The update is
// completed by the next call that needs it (PreBackward, AddGradient, EndBackward,
// EndForwardOnly, LoadParameters, the checkpoints, GatherMasterParams, optimizer()). While
// it runs, the forward's prefetch all-gathers may be issued late (coordinator.h): run no
// collective of your own on the engine's communicator between the first PreForward after a
// Step() and the next backward (between Step() and that forward is fine).
// With the optimizer states on NVMe the update streams them through the swap files, and its
// completion is a collective (every rank's I/O outcome is agreed on before anything is
// committed): the call that completes it must be made on every rank. When any rank's update
// failed, that call returns the error on every rank; the states are back at the last
// completed step, and the forward that ran meanwhile (with partly updated parameters) is
// void: the engine ends that iteration itself, ready for a new forward, and the step
// counters (global_steps, the schedule's iteration) are those of the last completed step.
// Early step (strata.early_step): the update of the step at a gradient-
// accumulation boundary starts during its backward: a group is handed to the optimizer's
// worker once its gradient is final, i.e. its backward ended (PostBackward left it in use by
// nothing) and its reductions were added into the accumulators; the groups left (the root,
// groups some of whose parameters got no gradient) go at EndBackward. A front end must then
// give every gradient of a group before the PostBackward that ends the group's use: a
// gradient or a PreBackward for a group already handed over is refused (FailedPrecondition).
// The step's learning rate is fixed when its backward begins: set_lr from then until Step()
// is refused, and so are GatherMasterParams, LoadParameters and the checkpoints (they are
// refused between a backward and its step anyway).
// Thread-safety: not thread-safe; one thread drives an engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/planner.h"
#include "strata/core/status.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/gather/coordinator.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/reduce/reducer.h"
#include "strata/engine/step/loss_scaler.h"
#include "strata/engine/step/lr_schedule.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/engine/timeline/timeline.h"
#include "strata/offload/cpu/state_store.h"
#include "strata/optim/cpu_adam/cpu_adam.h"
#include "strata/swap/io_engine.h"

namespace strata::engine {

struct ParamDesc {
  std::string name;
  size_t numel = 0;
  // Initial values: numel elements of init_dtype, read during Create only; nullptr = zeros.
  // Rank 0's are broadcast (EngineOptions::broadcast_initial_values); each rank copies its
  // shard into its fp32 master.
  const void* init = nullptr;
  DType init_dtype = DType::kFloat32;
  // Index into EngineOptions::param_groups (0 when there are none).
  int param_group = 0;
};

// A parameter group's hyper-parameters (torch.optim's param_groups): each one set replaces
// the config's optimizer value for the group's parameters. The group's learning rate
// follows the schedule in proportion: lr_group(t) = lr(t) * lr / optimizer.params.lr.
struct ParamGroupOptions {
  std::optional<double> lr;
  std::optional<double> weight_decay;
  std::optional<double> beta1;
  std::optional<double> beta2;
  std::optional<double> eps;
};

struct GroupDesc {
  std::string name;
  std::vector<ParamDesc> params;
  // Partitioned construction (zero3.h's ZeroInit): the group's initial values are already
  // this rank's shard, `shard_numel` floats of the padded flat group (LayoutGroup with the
  // engine's world size and align_elems; rank 0's values when they were broadcast), read
  // during Create only. The parameters' `init` must then be null. Every rank gives the
  // same groups this way.
  bool init_is_shard = false;
  std::span<const float> init_shard = {};
  // Initial values read when Create needs them: for parameter i whose `init` is null, the
  // function gives its values (numel elements of its init_dtype), alive while the pointer it
  // returns is held (null: zeros). Called one parameter at a time, on Create's thread: a
  // device tensor's values copied to the host per parameter, so no rank holds a host copy of
  // the whole model. Its error fails Create on every rank.
  std::function<Result<std::shared_ptr<const void>>(size_t param)> fetch_init = nullptr;
  // Parameters that do not train (requires_grad false: a LoRA model's base): partitioned,
  // gathered and offloaded like the others, with no fp32 master, no Adam m and v, no
  // gradient accumulator and no gradient bucket (the working shards hold their values, in
  // the working dtype). Frozen groups come after every trainable group; a front end gives
  // a module's frozen parameters their own group and gathers it with the module's.
  bool frozen = false;
};

// What tests (and benchmarks) set in the engine; the defaults are production's. Each
// component's part is passed to it whole.
struct EngineTestHooks {
  DriverTestHooks driver;            // the optimizer driver's (step/optimizer_driver.h)
  CoordinatorTestHooks coordinator;  // the coordinator's: skip the shard staging wait
  ReducerTestHooks reducer;          // the reducer's: skip the shard copy's wait, a callback
  // Leave out the wait for the host->device copy of the updated working shards (from their
  // pinned host mirror, offload_param = none) after a step; on the delaying CPU device the
  // results must then go wrong.
  bool skip_working_copy_wait = false;
  // Leave out the host's wait for the compute stream at the end of a backward (before the
  // step re-gathers the persistent groups into the buffers its last kernels read).
  bool skip_end_of_backward_wait = false;
  // Order the lanes' collectives by the host even on lanes of their own (LaneOrder::kHost):
  // for tests that count when a collective reaches its communicator against the engine's
  // issue order (a queued lane reaches it later, from the lane's stream).
  bool host_ordered_lanes = false;
  // Keep host accumulators (the boundary copies the device's sums into them) even where
  // CPU-Adam could read the sums on the device: tests of that path and comparisons.
  bool host_accumulators = false;
  // Leave out the host's wait for a copy of the device's sums (DeviceSumsOptions::
  // skip_fetch_wait): on the delaying CPU device the results must then go wrong.
  bool skip_sums_fetch_wait = false;
  // Makes the I/O engine of the NVMe state store's swap space (a FaultInjectingIoEngine to
  // inject faults); empty: the configured engine.
  std::function<Result<std::unique_ptr<swap::IoEngine>>(const swap::IoEngineOptions&)>
      nvme_io_engine_factory;
  // The NVMe state store's reads and writes as they are submitted and waited for.
  offload::StateObserver nvme_observer;
  // The machine the start-up check (core/planner.h) sees; empty: this one.
  std::function<Result<MachineFacts>(const Plan&)> machine_facts;
};

struct EngineOptions {
  // The device tier's memory; null = the device's arena (below).
  std::shared_ptr<DeviceAllocator> device_allocator;
  // The compute device; null = a CPU device (engine/device/device.h) with an arena of
  // strata.device_budget reserved at Create, made from `cpu_device` (its budget_bytes is
  // taken from the config).
  std::shared_ptr<Device> device;
  CpuDeviceOptions cpu_device;
  // The communicator of the host-side collectives (gradient norm and overflow, the initial
  // broadcast, GatherMasterParams): gloo. Null: the engine's communicator, which must then
  // be gloo too (an NCCL communicator carries device buffers only).
  std::shared_ptr<comm::Communicator> host_comm;
  // The gradient reductions' lane: a second communicator over the same ranks
  // and backend as the engine's, which then carries only the parameter all-gathers (none
  // either with gather_comm, below), so a prefetch never queues behind a reduce-scatter
  // still in flight. Each communicator runs
  // its collectives in issue order, and the engine issues the same sequence on each on
  // every rank. Null: the engine's communicator carries both (one lane). A lane carries the
  // engine's collectives only (issue none of yours on it): a gloo lane's run queued on a
  // device stream of their own, ordered with the device's work like NCCL's (docs/engine.md,
  // "Lanes"), while on the engine's communicator the host orders them.
  std::shared_ptr<comm::Communicator> reduce_comm;
  // The parameter all-gathers' own communicator (same ranks and backend as the engine's;
  // neither it nor reduce_comm). The pipelined step defers all-gathers and issues them at
  // points that differ between ranks (docs/engine.md, "The pipelined step"); on the engine's
  // communicator the caller may then run no collective between the first PreForward after
  // Step() and the backward. With this lane (and reduce_comm) the engine's communicator
  // carries only collectives the engine issues inside its calls, at the same point on every
  // rank: the caller may use it between any two calls. strata::initialize makes both lanes
  // (Communicator::Duplicate) on several gloo ranks. Null: the engine's communicator.
  std::shared_ptr<comm::Communicator> gather_comm;
  CpuAdam::Options cpu_adam;
  // Parameter groups; empty: one group with the config's optimizer values. ParamDesc::
  // param_group indexes it.
  std::vector<ParamGroupOptions> param_groups;
  // For the LibTorch front end (strata::initialize): a parameter's group from its name as
  // in model->named_parameters() (null: group 0). The core itself reads ParamDesc.
  std::function<int(const std::string& name)> param_group_of;
  size_t align_elems = kDefaultAlignElems;
  bool prefetch = true;  // false: every fetch on demand
  // Broadcast rank 0's initial values to every rank at Create (as DeepSpeed does), so
  // ranks whose models were initialized differently still start from one model. Costs
  // one fp32 broadcast per group; false: each rank copies its shard from its own values.
  bool broadcast_initial_values = true;
  // Tests' and benchmarks' knobs, passed whole to the components they belong to.
  EngineTestHooks test;
};

struct TierStats {
  std::string name;
  TierKind kind = TierKind::kDevice;
  TierUsage usage;
};

// Wall time of the engine's phases as its calls delimit them (always measured): forward from
// a micro-step's first PreForward to its first PreBackward (or EndForwardOnly), backward
// from there to the end of EndBackward (the last reductions included), step = Step().
struct PhaseStats {
  double forward_s = 0;
  double backward_s = 0;
  double step_s = 0;
  int64_t forwards = 0;
  int64_t backwards = 0;
  int64_t steps = 0;  // Step() calls
};

struct CollectiveCounts {
  uint64_t calls = 0;
  uint64_t bytes = 0;  // full-buffer bytes (all-gather, reduce-scatter) or reduced bytes
};

struct EngineStats {
  TierStats device;
  std::optional<TierStats> host;  // when some offload device is cpu
  TierKind param_tier = TierKind::kDevice;
  TierKind optimizer_tier = TierKind::kDevice;
  uint64_t working_shard_bytes = 0;  // per rank, on the parameter tier
  // The working shards' state store (host, or nvme with offload_param = nvme); for
  // offload_param = none on a device it is their pinned host mirror.
  std::string param_store_name;
  offload::StateStoreStats param_store;
  // offload_param = nvme: the shards kept in host memory by max_in_cpu (per rank).
  uint64_t working_shard_host_bytes = 0;
  // Host->device copies of the working shards from their host mirror (offload_param =
  // none: once at creation and after every applied step).
  uint64_t working_shard_pushes = 0;
  double working_push_wait_s = 0;  // seconds waited for those copies
  CoordinatorStats coordinator;
  ReducerStats reducer;
  OptimizerStats optimizer;
  // The optimizer's state store (host, or nvme: reads, writes, buffers).
  std::string store_name;
  offload::StateStoreStats store;
  CollectiveCounts all_gather, reduce_scatter, all_reduce;
  comm::CommStats comm;
  // Whether the reductions have their own communicator (EngineOptions::reduce_comm), and
  // its counters (they are not in `comm` then).
  bool reduce_lane = false;
  comm::CommStats reduce_lane_comm;
  // The same for the all-gathers (EngineOptions::gather_comm).
  bool gather_lane = false;
  comm::CommStats gather_lane_comm;
  // How each lane's collectives are ordered with the device's work: "stream" (NCCL's
  // stream waits), "queued" (a gloo lane queued on a device stream) or "host" (lane.h).
  std::string reduce_order, gather_order;
  // Where the micro-steps' gradients are summed (strata.accumulate_on_device): "device", or
  // "host" with the reason in parentheses when the device could not or was not to.
  std::string gradient_accumulation;
  // Where the fp32 accumulators CPU-Adam reads live: "device (...)" when it reads the
  // device's sums (docs/engine.md, "CPU-Adam on the device's sums": no host accumulators,
  // device_sums.buffer_bytes counts the host buffers of the sub-groups leased at once),
  // else "host (why)"; and those sums' counters.
  std::string grad_accumulators;
  DeviceSumsStats device_sums;
  // The delayed update (strata.delayed_update): the steps whose update ran beside the next
  // micro-steps, the copies of its parameters into the working shards and their seconds (at
  // the next step by that step's update worker, group by group; at a checkpoint's save or
  // load, or a skipped step, on the engine's thread), and the seconds the engine's thread
  // waited for a delayed update to end (a backward that writes the host accumulators, a
  // step, a save).
  uint64_t delayed_update_steps = 0;
  uint64_t delayed_copy_outs = 0;
  double delayed_copy_out_s = 0;
  double delayed_update_wait_s = 0;
  // The NUMA node of the host tier's pages and CPU-Adam's threads (strata.numa_node, or
  // with -1 the node the GPU hangs off on a machine of several nodes), or -1: none; and
  // CPU-Adam's threads.
  int numa_node = -1;
  int cpu_adam_threads = 0;
  // The cores this rank may use (its affinity mask, within numa_node's), and the ranks of
  // the job sharing them (the same machine, mask and node, this one included): with
  // strata.cpu_adam_threads 0, CPU-Adam's threads are cores / ranks (at least 1).
  int cpu_adam_cores = 0;
  int cpu_adam_ranks_sharing = 1;
  // The device's counters (copies, kernels, stream waits, host waits by HostWait) since
  // creation, and the host waits of the last Step() cycle (from the return of the Step()
  // before it, or of Create, to its own return: one micro-step's forward, backward and
  // Step), by HostWait.
  DeviceStats device_ops;
  std::array<uint64_t, kHostWaitKinds> host_waits_last_step{};
  uint64_t HostWaitsLastStep() const;  // their sum
  int64_t micro_steps = 0;             // backwards completed
  int64_t global_steps = 0;            // boundaries reached (applied or skipped)
  PhaseStats phases;
  double loss_scale = 1.0;
  std::string ToString() const;  // one line per area, for logs and strata-train
};

// The parts EngineCore is made of, each owning its own state (engine/runtime/: engine_builder.h,
// phase_clock.h, placement.h, update_gate.h, step_control.h, model_io.h, checkpoint_io.h).
class EngineBuilder;
class PhaseClock;
class Placement;
class UpdateGate;
class StepControl;
class ModelIo;
class CheckpointIo;

class EngineCore {
 public:
  static Result<std::unique_ptr<EngineCore>> Create(const Config& config,
                                                    std::shared_ptr<comm::Communicator> comm,
                                                    const std::vector<GroupDesc>& groups,
                                                    const EngineOptions& options = {});
  ~EngineCore();
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  int rank() const { return partition_.rank; }
  // The compute device as its seam names it ("cpu ...", "cuda:0 (NVIDIA H100 80GB HBM3)").
  std::string device_name() const;
  // The compute stream from now on: LibTorch's current stream at this forward, backward or
  // hook (Device::SetComputeStream; a front end calls it at each, so a forward under a
  // user's stream has the engine's events recorded on that stream). Null: the device's
  // stream of creation.
  Status UseComputeStream(void* native);
  int world_size() const { return partition_.world_size; }
  // The validated configuration the engine runs.
  const Config& config() const { return config_; }
  int num_groups() const { return partition_.num_groups(); }
  DType dtype() const { return dtype_; }
  const ModelPartition& partition() const { return partition_; }
  const GroupLayout& layout(int group) const {
    return partition_.groups[static_cast<size_t>(group)];
  }

  // `begins_phase` false: a front end taking a group for the iterations to come (the C++
  // front end holds its root group from one step to the next), not the start of a forward:
  // the forward phase (PhaseStats) starts at the next PreForward instead. While a pipelined
  // step's update runs, such a call prefetches nothing (the forward's calls do).
  Status PreForward(int group, bool begins_phase = true);
  Status PostForward(int group);
  Status PreBackward(int group);
  Status PostBackward(int group);
  Result<GatheredGroup> FullBuffer(int group) { return coordinator_->FullBuffer(group); }

  // `grad`: the parameter's full gradient, numel elements of `dtype` (any of the three;
  // converted to the working dtype for communication), read by work queued on the compute
  // stream: `owner` keeps it valid until that work ran (GradientReducer::AddGradient says
  // what happens without one). FailedPrecondition for a frozen group.
  Status AddGradient(int group, int param, const void* grad, DType dtype,
                     std::shared_ptr<const void> owner = nullptr);
  Status EndBackward();
  // After a forward without backward (evaluation under no_grad): releases the gathered
  // groups and prefetches the next iteration's first groups; the trace of training
  // iterations is left as it is. FailedPrecondition while a group is in use or gradients
  // are pending.
  Status EndForwardOnly();
  // Optional hint before such a forward (the front end knows: grad mode off): prefetch
  // only what the forward will use.
  void BeginForwardOnly() { coordinator_->BeginForwardOnly(); }
  // Whether the next Step() applies the optimizer.
  bool IsGradientAccumulationBoundary() const;
  // Whether the backward under way (or the next one) is a gradient-accumulation boundary's:
  // the last micro-step before an optimizer step.
  bool BackwardIsBoundary() const;
  Result<StepOutcome> Step();
  // True from a call whose error said "this iteration are void" (a pipelined optimizer
  // step with the states on NVMe failed on some rank, and the forward since had read
  // partly updated parameters) until the next forward begins. The engine then holds no
  // group: a front end drops its views of the full buffers and its own holds (its Post*
  // calls are not made), takes its root group again and starts the iteration over with
  // a new forward; the states are those of the last completed step (stats().optimizer.
  // steps_applied).
  bool iteration_void() const;

  // The factor the front end multiplies the loss by before backward: the loss scale
  // (fp16) divided by gradient_accumulation_steps.
  double LossMultiplier() const;
  double loss_scale() const;
  const LossScaler& loss_scaler() const;
  // The learning rate the next applied step uses; set_lr holds until that step.
  double lr() const;
  // FailedPrecondition during an early step's backward (strata.early_step), whose update
  // already runs with lr().
  Status set_lr(double lr);
  // The schedule's position: the iteration the next applied step's rate comes from
  // (DeepSpeed's scheduler last_batch_iteration + 1). Set (a scheduler's load_state_dict)
  // between steps, not after a backward before its step; >= 0. A set_lr override is kept.
  int64_t lr_iteration() const;
  Status set_lr_iteration(int64_t iteration);

  // The tiers, e.g. for a front end's scratch buffers that must count against the device
  // budget.
  // host_tier() is null when nothing is offloaded to cpu.
  Tier* device_tier() const;
  Tier* host_tier() const;
  // This rank's optimizer state (master, m, v, step count), e.g. for checkpoints. The
  // non-const accessor first completes a pipelined step still in flight (strata.
  // pipeline_step); the const one does not (its states may be changing then). Between an
  // early step's first backward call and Step() (strata.early_step) neither can complete
  // it: the states are being updated, and reading them fails ("chunk already held").
  const OptimizerDriver& optimizer() const { return *driver_; }
  OptimizerDriver& optimizer();
  // Whether the last Step()'s update still runs in the background (strata.pipeline_step).
  bool step_in_flight() const { return driver_->update_in_flight(); }
  // Whether a delayed update's parameters are still to be copied into the working shards
  // (strata.delayed_update): the next Step(), a checkpoint's save or load copies them out.
  bool delayed_copy_out_pending() const;

  // Collective: the group's fp32 master parameters gathered from every rank, the
  // parameters concatenated without gaps (layout(group).numel floats). A frozen group's
  // values are its working shards' (exact in fp32).
  Status GatherMasterParams(int group, std::span<float> out);
  bool frozen(int group) const { return partition_.frozen(group); }

  // Elements [first, first + out.size()) of parameter `param` of group `group`, as floats.
  using ParamReader =
      std::function<Status(int group, size_t param, uint64_t first, std::span<float> out)>;
  // Collective: replaces the fp32 master parameters (and the working shards) with values
  // from `read`, which each rank calls only for the slices its shards hold. Call it at a
  // step boundary (no backward pending, no accumulated micro-steps) with nothing gathered
  // by the front end: FailedPrecondition otherwise. `local_check` is this rank's verdict on
  // the source (names, shapes): the ranks agree on it first, and any rank's failure fails
  // the load on every rank with nothing changed. A read failure after that is agreed on
  // too (OptimizerDriver::CommitMasterAgreed). The optimizer's m and v, step counts and the
  // loss scale are not touched. The persistent groups are gathered again and the next
  // iteration's prefetches issued.
  // This rank's part of each parameter to assemble: part k holds `sizes[k]` elements
  // (comm::Partition(numel, W, rank) of parameter k, what a partitioned construction kept:
  // strata.zero.Init), and `read(k, first, out)` gives elements [first, first + out.size())
  // of it as floats (converted from the part's own dtype by the caller, a piece at a time).
  // `chunk_elems`: the most elements of one rank's part gathered at once (0: the default,
  // model_io.cc's kAssembleChunkBytes over the W + 1 buffers of a gather, over one on a
  // single rank, which reads its part without a gather); tests make it small.
  struct AssembleParts {
    std::vector<size_t> sizes;
    std::function<Status(size_t k, size_t first, std::span<float> out)> read;
    size_t chunk_elems = 0;
  };
  // Collective: the parameters `which` ((group, param), the same list on every rank) made
  // from every rank's part of them. One parameter at a time, one bounded chunk of every
  // rank's part at a time, is gathered over the host communicator and the elements of this
  // rank's shard written as LoadParameters writes (so no rank holds a parameter whole in
  // fp32); the rest as LoadParameters. A part of the wrong size on any rank fails the call
  // on every rank with nothing changed. `local_check`: this rank's verdict on its parts
  // (agreed on first, as a load's).
  Status AssembleParameters(const Status& local_check,
                            const std::vector<std::pair<int, size_t>>& which,
                            const AssembleParts& parts);
  // The same with every part in memory as floats.
  Status AssembleParameters(const Status& local_check,
                            const std::vector<std::pair<int, size_t>>& which,
                            const std::vector<std::span<const float>>& parts);
  // `only`: when given, the parameters it returns true for are loaded and the others kept
  // (read is called for those only).
  Status LoadParameters(const Status& local_check, const ParamReader& read,
                        const std::function<bool(int group, size_t param)>& only = nullptr);
  // Collective: the parameters `which` ((group, param) pairs, the same on every rank) set to
  // rank `source`'s `values` (each the parameter's numel floats; on the other ranks they
  // receive them), broadcast over the host communicator, then loaded as LoadParameters
  // does (master, working shards, regathered). `local_check` is agreed on first: any rank's
  // failure fails the call on every rank with nothing changed. What
  // strata.zero.GatheredParameters(modifier_rank=...) writes back on exit.
  Status SetParameters(const Status& local_check, int source,
                       const std::vector<std::pair<int, size_t>>& which,
                       const std::vector<std::span<float>>& values);
  // Checkpoints (engine/checkpoint/checkpoint.h, which describes the files and the protocol).
  // Collective, at a step boundary (FailedPrecondition otherwise, on every rank alike).
  // SaveCheckpoint returns the tag's directory; every rank returns the same outcome, and a
  // failed save leaves the previous checkpoints and `latest` unchanged.
  Result<std::string> SaveCheckpoint(const CheckpointSaveRequest& options);
  // Replaces the states with the checkpoint's after every rank has checked it (model
  // match, every CRC it reads): a check failing on any rank fails the load on every rank
  // with nothing changed. The persistent groups are gathered again.
  Result<CheckpointLoadResult> LoadCheckpoint(const CheckpointLoadRequest& options);
  // The communicator of the host-side collectives (EngineOptions::host_comm), e.g. for a
  // front end's own agreement on local outcomes (engine/agreement/agreement.h).
  comm::Communicator& host_comm() const { return *host_comm_; }

  EngineStats stats() const;

  // The timeline (engine/timeline/timeline.h): the engine's phases, each group's forward and
  // backward, its waits, its collectives in flight and the CPU optimizer's passes as timed
  // spans, for a Chrome/Perfetto trace (WriteChromeTrace). Off until enabled.
  void EnableTimeline(bool on);
  bool timeline_enabled() const;
  // The spans recorded since the last call (and forgets them); dropped: those beyond
  // Timeline::kMaxEvents, counted.
  std::vector<TimelineEvent> TakeTimeline();
  uint64_t timeline_dropped() const;

 private:
  // Construction (engine_builder.h): EngineBuilder runs Create's phases, each making the parts
  // below it decides; no other code sets them. Each component's header says what it owns,
  // its lifetime and its thread-safety; a component holds references to the parts it uses
  // (they outlive it: declared before it).
  friend class EngineBuilder;
  EngineCore() = default;

  // Declaration order = reverse destruction order: the components go before the placement
  // whose tiers own their memory (a component goes before the parts it refers to); the
  // timeline outlives everything that records into it; the communicators go last.
  std::shared_ptr<comm::Communicator> comm_;
  std::shared_ptr<comm::Communicator> host_comm_;
  std::shared_ptr<comm::Communicator> reduce_comm_;  // the reductions' lane (null: comm_)
  std::shared_ptr<comm::Communicator> gather_comm_;  // the all-gathers' lane (null: comm_)
  Config config_;
  DType dtype_ = DType::kFloat32;
  ModelPartition partition_;
  ModelPartition trainable_;  // partition_.Trainable(): the optimizer's and the reducer's
  // The timeline, PhaseStats and the host waits per Step() (phase_clock.h).
  std::unique_ptr<PhaseClock> clock_;
  // The device, the tiers, CPU-Adam, the state stores and the working shards, and the copies
  // of the working shards to the device (placement.h).
  std::unique_ptr<Placement> placement_;
  std::unique_ptr<OptimizerDriver> driver_;
  // Which groups' updated working shards the forward may read while a step's update runs
  // (update_gate.h); the coordinator asks it (before the coordinator: it outlives it).
  std::unique_ptr<UpdateGate> gate_;
  std::unique_ptr<ParameterCoordinator> coordinator_;
  std::unique_ptr<GradientReducer> reducer_;
  // The step: the micro-step and step counters, the loss scaler, the learning rate and its
  // schedule, the pipelined, early and delayed updates (step_control.h).
  std::unique_ptr<StepControl> step_;
  // LoadParameters, SetParameters, AssembleParameters, GatherMasterParams (model_io.h).
  std::unique_ptr<ModelIo> model_io_;
  // SaveCheckpoint and LoadCheckpoint (checkpoint_io.h).
  std::unique_ptr<CheckpointIo> checkpoints_;
};

// The AdamParams of the config's optimizer section (Adam with adam_w_mode -> decoupled).
AdamParams AdamParamsFromConfig(const OptimizerConfig& optimizer);

}  // namespace strata::engine

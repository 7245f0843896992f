// EngineCore::Create and EngineBuilder's phases (engine_builder.h), in the order Create runs
// them; the placement's phases are in placement.cc.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/core/sizing.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/runtime/checkpoint_io.h"
#include "strata/engine/runtime/engine_builder.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/runtime/lanes.h"
#include "strata/engine/runtime/model_io.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"
#include "strata/engine/runtime/stores.h"
#include "strata/engine/runtime/update_gate.h"

namespace strata::engine {

namespace {

uint64_t Round64(uint64_t n) {
  return (n + 63) / 64 * 64;
}

Status CheckSupported(const Config& config) {
  if (config.zero.stage < 1 || config.zero.stage > 3) {
    return InvalidArgumentError("zero_optimization.stage = " + std::to_string(config.zero.stage) +
                                ": the Strata engine runs stages 1, 2 and 3");
  }
  if (config.zero.stage < 3 && config.zero.offload_param.device != OffloadDevice::kNone) {
    return InvalidArgumentError(
        "zero_optimization.offload_param with stage " + std::to_string(config.zero.stage) +
        ": stages 1 and 2 keep every parameter on each rank's device; use stage 3 to offload "
        "parameters");
  }
  if (config.fp16.enabled && config.bf16) {
    return InvalidArgumentError("fp16.enabled and bf16.enabled are both true; choose one");
  }
  if (config.gradient_accumulation_steps < 1) {
    return InvalidArgumentError(
        "gradient_accumulation_steps = " + std::to_string(config.gradient_accumulation_steps) +
        " must be at least 1");
  }
  return Status::Ok();
}

// Create's local outcome agreed on (engine/agreement/agreement.h) before its next collective, or
// before it returns: Ok only when it is Ok on every rank; else every rank returns the failing
// ranks' errors. One rank: its own status as it is.
Status AgreeOnCreate(comm::Communicator& comm, const Status& local) {
  if (comm.world_size() == 1) return local;
  STRATA_ASSIGN_OR_RETURN(Outcomes agreed, AgreeOnOutcomes(comm, local, {}, 4096));
  return OutcomeStatus(agreed, "creating the engine");
}

// A parameter's initial values as Create reads them: its `init`, or what its group's
// `fetch_init` gives (held while `keep` lives); null data: zeros.
struct InitValues {
  const void* data = nullptr;
  std::shared_ptr<const void> keep;
};

Result<InitValues> ReadInit(const GroupDesc& g, size_t i) {
  const ParamDesc& p = g.params[i];
  InitValues v{p.init, nullptr};
  if (v.data != nullptr || !g.fetch_init) return v;
  Result<std::shared_ptr<const void>> fetched = g.fetch_init(i);
  if (!fetched.ok()) {
    return fetched.status().WithContext("reading the initial values of parameter " + p.name);
  }
  v.keep = std::move(*fetched);
  v.data = v.keep.get();
  return v;
}

}  // namespace

AdamParams AdamParamsFromConfig(const OptimizerConfig& o) {
  AdamParams p;
  p.lr = o.lr;
  p.beta1 = o.beta1;
  p.beta2 = o.beta2;
  p.eps = o.eps;
  p.weight_decay = o.weight_decay;
  p.bias_correction = o.bias_correction;
  const bool decoupled = o.type == OptimizerType::kAdamW || o.adam_w_mode;
  p.weight_decay_mode = decoupled ? WeightDecayMode::kDecoupled : WeightDecayMode::kL2;
  return p;
}

Result<std::unique_ptr<EngineCore>> EngineCore::Create(const Config& config,
                                                       std::shared_ptr<comm::Communicator> comm,
                                                       const std::vector<GroupDesc>& groups,
                                                       const EngineOptions& options) {
  STRATA_RETURN_IF_ERROR(EngineBuilder::CheckArguments(config, comm.get(), options));
  std::unique_ptr<EngineCore> e(new EngineCore());
  STRATA_RETURN_IF_ERROR(EngineBuilder(*e, groups, options).Build(config, std::move(comm)));
  return e;
}

Status EngineBuilder::Build(const Config& config, std::shared_ptr<comm::Communicator> comm) {
  EngineCore& e = e_;
  e.reduce_comm_ = options_.reduce_comm;
  e.gather_comm_ = options_.gather_comm;
  e.host_comm_ = options_.host_comm ? options_.host_comm : comm;
  e.comm_ = std::move(comm);
  e.config_ = config;
  e.dtype_ = WorkingDTypeFromConfig(config);
  comm::Communicator& host = *e.host_comm_;
  // 1. This rank's partition, limits, device and tiers.
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(host, Prepare()));
  STRATA_RETURN_IF_ERROR(e.placement_->ShareCores(config, options_, host));
  // 2. CPU-Adam, the stores, the working shards and the optimizer's driver.
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(host, MakeStoresAndDriver()));
  // 3. The initial values (broadcasts: a rank's failure to write them is kept until every
  //    broadcast was issued, then agreed on).
  Status written;
  STRATA_RETURN_IF_ERROR(WriteInitialValues(written));
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(host, written));
  // 4. The initial states committed (an NVMe store's outcome is agreed on there), the working
  //    shards pushed, the coordinator, the reducer, the schedule and the update's staging.
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(host, MakeComponents()));
  // 5. The persistent groups gathered.
  STRATA_RETURN_IF_ERROR(e.coordinator_->RegatherPersistent());
  const Placement& p = *e.placement_;
  STRATA_LOG(kDebug) << "engine: " << e.partition_.num_groups() << " groups, "
                     << e.partition_.partition_numel << " elements per rank, working dtype "
                     << DTypeName(e.dtype_) << ", parameters on " << p.param_tier()->name()
                     << ", optimizer on " << p.optimizer_tier()->name();
  // The first step's host waits count from here (not creation's).
  e.clock_->StartCycle(p.device().stats().host_waits);
  return Status::Ok();
}

// The configuration the engine runs and the communicators it was given.
Status EngineBuilder::CheckArguments(const Config& config, const comm::Communicator* comm,
                                     const EngineOptions& options) {
  if (comm == nullptr) return InvalidArgumentError("EngineCore: null communicator");
  STRATA_RETURN_IF_ERROR(CheckSupported(config));
  if (config.train_batch_size > 0 && config.world_size != comm->world_size()) {
    return InvalidArgumentError("the config's batch sizes were checked for world size " +
                                std::to_string(config.world_size) + " but the communicator has " +
                                std::to_string(comm->world_size()) +
                                " ranks (parse the config with ValidateOptions{.world_size = " +
                                std::to_string(comm->world_size()) + "})");
  }
  const comm::Communicator* host_comm = options.host_comm ? options.host_comm.get() : comm;
  if (host_comm->backend() != comm::Backend::kGloo) {
    return InvalidArgumentError(
        "the engine's host-side collectives (gradient norm, initial broadcast, gathering "
        "master parameters) need a gloo communicator: with an NCCL communicator for the "
        "device buffers, pass a gloo one as EngineOptions::host_comm");
  }
  if (host_comm->world_size() != comm->world_size() || host_comm->rank() != comm->rank()) {
    return InvalidArgumentError(
        "EngineOptions::host_comm is rank " + std::to_string(host_comm->rank()) + " of " +
        std::to_string(host_comm->world_size()) + " but the communicator is rank " +
        std::to_string(comm->rank()) + " of " + std::to_string(comm->world_size()));
  }
  // A lane: a second communicator over the same ranks and backend (not the engine's own,
  // nor the other lane).
  auto check_lane = [&](const std::shared_ptr<comm::Communicator>& lane, const char* name,
                        const std::shared_ptr<comm::Communicator>& other) -> Status {
    if (lane == nullptr) return Status::Ok();
    const comm::Communicator& r = *lane;
    if (r.world_size() != comm->world_size() || r.rank() != comm->rank() ||
        r.backend() != comm->backend()) {
      return InvalidArgumentError(
          std::string("EngineOptions::") + name + " is " +
          std::string(comm::BackendName(r.backend())) + " rank " + std::to_string(r.rank()) +
          " of " + std::to_string(r.world_size()) + " but the communicator is " +
          std::string(comm::BackendName(comm->backend())) + " rank " +
          std::to_string(comm->rank()) + " of " + std::to_string(comm->world_size()) +
          ": a lane must be another communicator over the same ranks and backend "
          "(Communicator::Duplicate makes one)");
    }
    if (lane.get() == comm) {
      return InvalidArgumentError(std::string("EngineOptions::") + name +
                                  " is the engine's communicator itself: leave it null for "
                                  "no lane of its own, or give a second communicator");
    }
    if (lane == other) {
      return InvalidArgumentError(
          "EngineOptions::reduce_comm and gather_comm are one communicator: each lane needs "
          "its own (or leave one null)");
    }
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(check_lane(options.reduce_comm, "reduce_comm", nullptr));
  STRATA_RETURN_IF_ERROR(check_lane(options.gather_comm, "gather_comm", options.reduce_comm));
  return Status::Ok();
}

Status EngineBuilder::Prepare() {
  STRATA_RETURN_IF_ERROR(PartitionGroups());
  SizeFromTheModel();
  STRATA_RETURN_IF_ERROR(CheckMachine());
  e_.placement_ = std::make_unique<Placement>(e_.partition_, e_.trainable_, e_.dtype_, *e_.clock_);
  STRATA_RETURN_IF_ERROR(e_.placement_->MakeTiers(e_.config_, options_));
  STRATA_RETURN_IF_ERROR(CheckDeviceBudget());
  const Config& config = e_.config_;
  const EngineOptions& options = options_;
  if (options.cpu_adam.num_threads > 0 && config.strata.cpu_adam_threads > 0 &&
      options.cpu_adam.num_threads != config.strata.cpu_adam_threads) {
    return InvalidArgumentError(
        "strata.cpu_adam_threads = " + std::to_string(config.strata.cpu_adam_threads) +
        " but EngineOptions::cpu_adam.num_threads = " +
        std::to_string(options.cpu_adam.num_threads) +
        ": set one of them (0: this rank's share of the cores)");
  }
  return Status::Ok();
}

// The keys the config left at DeepSpeed's defaults sized from the model (core/sizing.h),
// the same on every rank (the model's sizes only); rank 0 says what it chose, once.
void EngineBuilder::SizeFromTheModel() {
  // The trainable groups, as the reducer's buckets hold them (GradientReducer::BucketBytes).
  const ModelPartition& trainable = e_.trainable_;
  ModelExtent extent{.partition = trainable.partition_numel};
  for (const GroupLayout& g : trainable.groups) {
    extent.trainable += g.numel;
    extent.largest_group = std::max<uint64_t>(extent.largest_group, g.padded_numel);
  }
  for (const GroupLayout& g : e_.partition_.groups)
    extent.largest_shard = std::max<uint64_t>(extent.largest_shard, g.shard_numel);
  for (const SizedKey& k : SizeFromModel(e_.config_, extent)) {
    if (trainable.rank == 0) STRATA_LOG(kInfo) << "engine: sized from the model: " << k.ToString();
  }
}

// Partitioning: the groups laid out and sharded (layout/partition.h).
Status EngineBuilder::PartitionGroups() {
  const Config& config = e_.config_;
  const EngineOptions& options = options_;
  // Partitioning.
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> specs;
  size_t frozen_groups = 0;
  for (const GroupDesc& g : groups_) {
    if (g.frozen) {
      ++frozen_groups;
    } else if (frozen_groups > 0) {
      return InvalidArgumentError("group " + g.name +
                                  " is trainable but comes after a frozen group: give the "
                                  "frozen groups last (GroupDesc::frozen)");
    }
    std::vector<ParamSpec> ps;
    for (const ParamDesc& p : g.params)
      ps.push_back({p.name, p.numel});
    specs.emplace_back(g.name, std::move(ps));
  }
  PartitionOptions popts;
  popts.align_elems = options.align_elems;
  popts.frozen_groups = frozen_groups;
  popts.param_persistence_threshold =
      static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_param_persistence_threshold));
  popts.model_persistence_threshold =
      static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_model_persistence_threshold));
  if (config.zero.stage < 3) {
    // Stages 1 and 2: the parameters are replicated, i.e. every group is persistent: gathered
    // at Create and again after each step (the updated shards), never in a forward or
    // backward pass. What stays partitioned is the same as in stage 3: the optimizer
    // states, the fp32 gradient accumulators and the working shards the step writes.
    popts.param_persistence_threshold = UINT64_MAX;
    popts.model_persistence_threshold = UINT64_MAX;
  }
  STRATA_ASSIGN_OR_RETURN(e_.partition_,
                          PartitionModel(specs, e_.comm_->world_size(), e_.comm_->rank(), popts));
  // The optimizer's partition: the trainable groups' shards (a prefix of the rank's).
  e_.trainable_ = e_.partition_.Trainable();
  e_.clock_ = std::make_unique<PhaseClock>(e_.partition_);
  return Status::Ok();
}

// The planner's check (core/planner.h, the same as `strata-config plan`): host memory,
// RLIMIT_MEMLOCK and the free disk at each nvme_path for what this config puts there, before
// anything is allocated. Keys the config left at their defaults are first lowered until the
// plan fits the memory every rank may use (FitToMemory, with the least of the ranks' room:
// every rank sizes alike). The budgets are checked exactly below and as allocated.
Status EngineBuilder::CheckMachine() {
  Config& config = e_.config_;
  const ModelPartition& partition = e_.partition_;
  PlanInput pin;
  for (int g = 0; g < partition.num_groups(); ++g) {
    const GroupLayout& l = partition.groups[static_cast<size_t>(g)];
    pin.params += l.padded_numel;
    if (partition.frozen(g)) pin.frozen_params += l.padded_numel;
    if (l.padded_numel > pin.largest_group) {
      pin.second_group = pin.largest_group;
      pin.largest_group = l.padded_numel;
    } else {
      pin.second_group = std::max<uint64_t>(pin.second_group, l.padded_numel);
    }
  }
  pin.world_size = e_.comm_->world_size();
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local != nullptr) {
    pin.ranks_per_node = std::atoi(local);  // torchrun's; 0 (unparsable): every rank
  }
  // The engine's own CPU device (or a given one named "cpu"): device memory is host memory.
  pin.device_on_host = options_.device == nullptr || options_.device->name().rfind("cpu", 0) == 0;
  if (pin.params == 0) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(Plan plan, MakePlan(config, pin));
  Result<MachineFacts> machine =
      options_.test.machine_facts ? options_.test.machine_facts(plan) : ReadMachineFacts(plan);
  // Every rank's room, -1 where the limits could not be read: gathered on every rank
  // whatever its own outcome (Create agrees on the outcomes afterwards).
  std::string limit;
  int64_t room = machine.ok() ? static_cast<int64_t>(std::min<uint64_t>(
                                    PlanRoom(plan, config, *machine, limit), INT64_MAX))
                              : -1;
  if (pin.world_size > 1) {
    std::vector<int64_t> rooms(static_cast<size_t>(pin.world_size));
    STRATA_RETURN_IF_ERROR(
        e_.comm_->AllGatherAsync(&room, rooms.data(), rooms.size(), comm::DType::kInt64)
            ->Wait()
            .WithContext("agreeing on the ranks' memory"));
    const auto least = std::min_element(rooms.begin(), rooms.end());
    if (*least < room) limit = "the limit of rank " + std::to_string(least - rooms.begin());
    room = *least;
  }
  STRATA_RETURN_IF_ERROR(machine.status().WithContext("reading the machine's limits"));
  if (room < 0) return Status::Ok();  // another rank's limits are unreadable: it fails Create
  if (plan.memory_bytes() > static_cast<uint64_t>(room)) {
    // The keys left at their defaults lowered to fit: the same on every rank.
    STRATA_ASSIGN_OR_RETURN(std::vector<SizedKey> keys,
                            FitToMemory(config, pin, static_cast<uint64_t>(room), limit));
    for (const SizedKey& k : keys) {
      if (partition.rank == 0) STRATA_LOG(kInfo) << "engine: sized to the memory: " << k.ToString();
    }
    if (!keys.empty()) {
      STRATA_ASSIGN_OR_RETURN(plan, MakePlan(config, pin));
    }
  }
  return CheckPlan(plan, config, *machine,
                   {.device_budget = false, .host_budget = false, .unusable_paths = false});
}

// The device budget must hold two of the largest groups gathered, the persistent groups, the
// gradient buckets and whatever shards live on the device tier.
Status EngineBuilder::CheckDeviceBudget() {
  const Config& config = e_.config_;
  const ModelPartition& partition = e_.partition_;
  const Placement& placement = *e_.placement_;
  const size_t elem = DTypeSize(e_.dtype_);
  const size_t n = partition.partition_numel, nt = e_.trainable_.partition_numel;
  ReducerOptions& ropts = reducer_;
  ropts.bucket_elems = static_cast<uint64_t>(std::max<int64_t>(1, config.zero.reduce_bucket_size));
  ropts.num_buckets = config.zero.overlap_comm ? 2 : 1;
  // Stage 1 all-reduces the gradients (each rank receives every reduced bucket whole and
  // keeps its slice), stage 2 and 3 reduce-scatter them (unless reduce_scatter = false).
  ropts.reduce_scatter = config.zero.reduce_scatter && config.zero.stage != 1;
  // The config's budget, or the one the device chose when it names none (the CUDA device
  // reserves half the free memory; the CPU device has none: unbounded).
  const uint64_t budget = config.strata.device_budget > 0
                              ? config.strata.device_budget
                              : placement.device_allocator().usage().budget_bytes;
  if (budget > 0) {
    // (Not a structured binding: clang 14 cannot capture one in the lambda below.)
    const std::pair<size_t, size_t> largest = partition.LargestTwo();
    const size_t a = largest.first, b = largest.second;
    // Bytes of the groups gathered at once, at `bytes_per_elem`: the two largest, and
    // the persistent ones.
    auto two_largest = [&](uint64_t bytes_per_elem) {
      return Round64(a * bytes_per_elem) + Round64(b * bytes_per_elem);
    };
    auto persistent_groups = [&](uint64_t bytes_per_elem) {
      uint64_t sum = 0;
      for (size_t g = 0; g < partition.groups.size(); ++g) {
        if (partition.persistent[g]) {
          sum += Round64(partition.groups[g].padded_numel * bytes_per_elem);
        }
      }
      return sum;
    };
    const uint64_t two = two_largest(elem);
    const uint64_t persistent = persistent_groups(elem);
    const uint64_t buckets = GradientReducer::BucketBytes(e_.trainable_, e_.dtype_, ropts);
    uint64_t resident = 0;
    if (placement.param_tier() == placement.device_tier()) resident += Round64(n * elem);
    if (placement.optimizer_tier() == placement.device_tier())
      resident += 4 * Round64(nt * sizeof(float));
    const uint64_t need = two + persistent + buckets + resident;
    device_budget_ = budget;
    device_need_ = need;
    if (budget < need) {
      const std::string whose = config.strata.device_budget > 0
                                    ? "strata.device_budget = "
                                    : "strata.device_budget is 0; the budget of the " +
                                          placement.device_allocator().name() +
                                          " (on a GPU, half its free memory) = ";
      return InvalidArgumentError(
          whose + std::to_string(budget) + " bytes (" + FormatBytes(budget) + ") is below the " +
          std::to_string(need) + " bytes (" + FormatBytes(need) +
          ") this model needs on the device tier: two largest groups gathered " +
          std::to_string(two) + " bytes, persistent groups " + std::to_string(persistent) +
          " bytes, gradient buckets " + std::to_string(buckets) + " bytes, shards and states " +
          "resident on the device " + std::to_string(resident) + " bytes" +
          " (lower reduce_bucket_size, wrap smaller modules, or offload to cpu" +
          (config.strata.device_budget > 0 ? std::string(")")
                                           : std::string("; or set strata.device_budget)")));
    }
  }

  return Status::Ok();
}

Status EngineBuilder::MakeStoresAndDriver() {
  Placement& placement = *e_.placement_;
  STRATA_RETURN_IF_ERROR(placement.MakeCpuAdam(options_));
  STRATA_RETURN_IF_ERROR(placement.MakeShardStores(e_.config_, options_));
  return MakeDriver();
}

// The optimizer's state store and its driver (step/optimizer_driver.h).
Status EngineBuilder::MakeDriver() {
  const Config& config = e_.config_;
  const EngineOptions& options = options_;
  Placement& placement = *e_.placement_;
  const OffloadConfig& opt_off = config.zero.offload_optimizer;
  OptimizerDriverOptions dopts;
  dopts.adam = AdamParamsFromConfig(config.optimizer);
  dopts.sub_group_elems = static_cast<uint64_t>(std::max<int64_t>(1, config.zero.sub_group_size));
  dopts.gradient_clipping = config.gradient_clipping;
  if (config.optimizer.type == OptimizerType::kLamb) {
    dopts.lamb = LambOptions{.max_coeff = config.optimizer.max_coeff,
                             .min_coeff = config.optimizer.min_coeff,
                             .eps_inside_sqrt = config.optimizer.eps_inside_sqrt};
  }
  // Parameter groups (none: the driver's one group of the config's values); the driver
  // checks every ParamDesc::param_group against them.
  for (const ParamGroupOptions& pg : options.param_groups) {
    AdamParams a = dopts.adam;
    if (pg.lr) a.lr = *pg.lr;
    if (pg.weight_decay) a.weight_decay = *pg.weight_decay;
    if (pg.beta1) a.beta1 = *pg.beta1;
    if (pg.beta2) a.beta2 = *pg.beta2;
    if (pg.eps) a.eps = *pg.eps;
    dopts.groups.push_back(a);
  }
  for (const GroupDesc& g : groups_) {
    if (g.frozen) break;  // no optimizer state (the frozen groups come last)
    std::vector<int> of;
    for (const ParamDesc& p : g.params)
      of.push_back(p.param_group);
    dopts.param_group.push_back(std::move(of));
  }
  dopts.prefetch_ahead =
      placement.opt_nvme() && opt_off.pipeline_read
          ? static_cast<size_t>(std::max(1, config.strata.swap_pipeline_depth) - 1)
          : 0;
  dopts.skip_inf_nan = config.strata.skip_inf_nan_steps;
  if (placement.par_nvme()) {
    // The pipelined step writes new parameters into staging buffers on the host tier (its
    // budget counts them; two, the option's default), from the shards' store's allocator
    // (registered with the device alike), so that a staging buffer and a store buffer can
    // be exchanged instead of copied.
    dopts.staging_allocator = StoreAllocator(
        placement.param_tier(), placement.copies() ? placement.shared_device() : nullptr);
  }
  dopts.test = options.test.driver;
  dopts.timeline = &e_.clock_->timeline();
  dopts.bind_thread = [device = &placement.device()] { return device->BindThread(); };
  STRATA_RETURN_IF_ERROR(
      placement.MakeDeviceSums(config, options, device_budget_, device_need_, reducer_));
  dopts.device_sums = placement.sums();
  STRATA_RETURN_IF_ERROR(placement.MakeStateStore(config, options));
  STRATA_ASSIGN_OR_RETURN(
      e_.driver_, OptimizerDriver::Create(&e_.trainable_, &placement.store(), &placement.shards(),
                                          e_.host_comm_.get(), &placement.cpu_adam(), dopts));
  return Status::Ok();
}

// The initial values: a trainable group's into its fp32 master (the working shards follow
// it), a frozen group's into its working shard; rank 0's broadcast unless the options say
// otherwise. The Status returned is a collective's (every rank returns it at once); `init`
// this rank's outcome, for the ranks to agree on.
Status EngineBuilder::WriteInitialValues(Status& init) {
  const std::vector<GroupDesc>& groups = groups_;
  const ModelPartition& partition = e_.partition_;
  OptimizerDriver& driver = *e_.driver_;
  Placement& placement = *e_.placement_;
  const bool broadcast = options_.broadcast_initial_values && partition.world_size > 1;
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupLayout& layout = partition.groups[g];
    const size_t shard = partition.shard_offset[g];
    // A trainable group's values go to its fp32 master (the working shards follow it); a
    // frozen group's straight to its working shard.
    const bool frozen = groups[g].frozen;
    auto put = [&](size_t within, std::span<const float> values) -> Status {
      if (!frozen) return driver.WriteMaster(shard + within, values);
      return placement.WriteFrozen(static_cast<int>(g), within, values);
    };
    if (broadcast && !groups[g].init_is_shard) {
      // Rank 0's values, flattened as the group buffer, to every rank.
      if (layout.padded_numel == 0) continue;
      std::vector<float> full(layout.padded_numel, 0.0f);
      if (partition.rank == 0) {
        for (size_t i = 0; i < layout.params.size() && init.ok(); ++i) {
          const ParamDesc& p = groups[g].params[i];
          Result<InitValues> values = ReadInit(groups[g], i);
          if (!values.ok()) {
            init = values.status();  // zeros go out; the ranks agree on the failure after
            break;
          }
          if (values->data == nullptr) continue;
          ConvertToFloat(values->data, p.init_dtype, p.numel,
                         full.data() + layout.params[i].offset);
        }
      }
      STRATA_RETURN_IF_ERROR_CTX(
          e_.host_comm_->Broadcast(full.data(), full.size(), comm::DType::kFloat32, 0),
          "broadcasting the initial values of group " + layout.name);
      if (init.ok()) {
        init = put(0, std::span<const float>(full).subspan(layout.shard_begin(partition.rank),
                                                           layout.shard_numel));
      }
      continue;
    }
    if (!init.ok()) continue;
    init = [&]() -> Status {
      if (groups[g].init_is_shard) {
        if (groups[g].init_shard.size() != layout.shard_numel) {
          return InvalidArgumentError(
              "group " + layout.name + ": its partitioned initial values hold " +
              std::to_string(groups[g].init_shard.size()) + " elements, the engine's shard of it " +
              std::to_string(layout.shard_numel) +
              " (partitioned for another world size or alignment?)");
        }
        for (const ParamDesc& p : groups[g].params) {
          if (p.init != nullptr) {
            return InvalidArgumentError("group " + layout.name + ": parameter " + p.name +
                                        " has initial values although the group's are a shard");
          }
        }
        return put(0, groups[g].init_shard);
      }
      for (size_t i = 0; i < layout.params.size(); ++i) {
        const ParamDesc& p = groups[g].params[i];
        if (p.init == nullptr && !groups[g].fetch_init) continue;
        const std::optional<ShardSlice> sl = layout.Slice(i, partition.rank);
        if (!sl) continue;
        STRATA_ASSIGN_OR_RETURN(const InitValues source, ReadInit(groups[g], i));
        if (source.data == nullptr) continue;
        // In pieces of at most 1 Mi elements: the temporary stays small whatever the
        // parameter (the values are read from the front end's own tensor).
        constexpr size_t kPiece = size_t{1} << 20;
        std::vector<float> values;
        for (size_t done = 0; done < sl->count; done += kPiece) {
          const size_t count = std::min(kPiece, sl->count - done);
          values.resize(count);
          ConvertToFloat(static_cast<const std::byte*>(source.data) +
                             (sl->param_offset + done) * DTypeSize(p.init_dtype),
                         p.init_dtype, count, values.data());
          STRATA_RETURN_IF_ERROR(put(sl->shard_offset + done, values));
        }
      }
      return Status::Ok();
    }();
  }
  if (init.ok()) init = driver.SyncWorkingFromMaster();
  return Status::Ok();
}

// The initial states committed, the working shards pushed, the update gate, the coordinator,
// the reducer, the step (the loss scaler, the schedule), the pipelined update's staging, and
// the model's and the checkpoints' I/O.
Status EngineBuilder::MakeComponents() {
  EngineCore& e = e_;
  const Config& config = e.config_;
  const EngineOptions& options = options_;
  const OffloadConfig& par_off = config.zero.offload_param;
  Placement& placement = *e.placement_;
  OptimizerDriver& driver = *e.driver_;
  CoordinatorOptions copts;
  ShardSource source;
  ReducerOptions& ropts = reducer_;
  STRATA_RETURN_IF_ERROR(driver.Commit().WithContext("initializing the optimizer states"));
  STRATA_RETURN_IF_ERROR(placement.PushWorkingShards());
  copts.prefetch_bucket_elems =
      static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_prefetch_bucket_size));
  copts.max_live_elems =
      static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_max_live_parameters));
  copts.max_reuse_distance =
      static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_max_reuse_distance));
  copts.prefetch = options.prefetch;
  copts.timeline = &e.clock_->timeline();
  STRATA_ASSIGN_OR_RETURN(const StepControl::Modes modes, StepControl::ChooseModes(config, driver));
  e.gate_ = std::make_unique<UpdateGate>(e.partition_, driver, placement);
  if (modes.pipeline_step) {
    UpdateGate* gate = e.gate_.get();
    copts.shard_ready = [gate](int g) { return gate->Ready(g); };
    copts.open_shard = [gate](int g) { return gate->Open(g); };
    copts.shard_stored = [gate](int g) { return gate->Stored(g); };
  }
  copts.device = &placement.device();
  copts.exclusive_comm = e.gather_comm_ != nullptr && !options.test.host_ordered_lanes;
  copts.test = options.test.coordinator;
  if (placement.staging() && e.partition_.partition_numel > 0) {
    // Working shards in (pinned) host memory or NVMe: staged into the device on a copy
    // stream.
    copts.stage_shards = true;
    copts.copy_stream = placement.copy_stream();
  }
  if (placement.par_nvme()) {
    // One buffer holds the shard being staged; the others read the next ones ahead.
    copts.shard_read_ahead = static_cast<size_t>(par_off.buffer_count - 1);
    copts.shard_read_bandwidth = config.strata.nvme_read_bandwidth;
  }
  if (placement.mirror()) {
    source.device = placement.device_working();
  } else {
    source.store = &placement.shards();
  }
  ropts.device = &placement.device();
  ropts.exclusive_comm = e.reduce_comm_ != nullptr && !options.test.host_ordered_lanes;
  ropts.timeline = &e.clock_->timeline();
  ropts.test = options.test.reducer;
  if (placement.shards_to_host()) {
    // Accumulators in host memory: reduced shards go device->host on their own stream (the
    // device sums' stream when the optimizer reads them there).
    STRATA_ASSIGN_OR_RETURN(ropts.copy_stream, placement.GradientStream());
    ropts.shards_to_host = true;
    ropts.staging_tier = placement.optimizer_tier();
    // Reduced shards added on the reducer's thread: the driver's Accumulate then runs there
    // (host states only: the NVMe store's leases are the engine thread's). With the
    // device's sums the thread adds nothing on the host, but still waits for the
    // reductions and queues their additions beside the backward.
    ropts.accumulate_in_background =
        config.strata.accumulate_in_background &&
        (driver.CanSumNormInBackward() ||
         (placement.sums() != nullptr && !placement.store().can_fail()));
    if (placement.sums() != nullptr) ropts.device_sums = placement.sums()->device_sums();
  }
  // The coordinator allocates the persistent groups' buffers here; it gathers them below.
  STRATA_ASSIGN_OR_RETURN(
      e.coordinator_,
      ParameterCoordinator::Create(&e.partition_, source, e.dtype_,
                                   e.gather_comm_ != nullptr ? e.gather_comm_.get() : e.comm_.get(),
                                   placement.device_tier(), copts));
  STRATA_ASSIGN_OR_RETURN(
      e.reducer_,
      GradientReducer::Create(
          &e.trainable_, e.dtype_, e.reduce_comm_ != nullptr ? e.reduce_comm_.get() : e.comm_.get(),
          placement.device_tier(),
          [driver = &driver](size_t offset, const std::byte* src, DType dtype, size_t count) {
            return driver->Accumulate(offset, src, dtype, count);
          },
          ropts));
  STRATA_ASSIGN_OR_RETURN(
      e.step_, StepControl::Create(config, e.partition_, driver, *e.coordinator_, *e.reducer_,
                                   placement, *e.gate_, *e.clock_, modes));
  if (modes.pipeline_step) {
    // With the working shards on NVMe: the update's staging buffers, taken now (after the
    // rest), so that a host budget without room for them fails here, naming them, rather
    // than at the first step.
    STRATA_RETURN_IF_ERROR(driver.ReserveStaging().WithContext(
        "strata.pipeline_step with offload_param.device nvme (set strata.pipeline_step false, "
        "or raise strata.host_budget)"));
  }
  const IoParts io{.config = config,
                   .partition = e.partition_,
                   .host = *e.host_comm_,
                   .driver = driver,
                   .coordinator = *e.coordinator_,
                   .reducer = *e.reducer_,
                   .placement = placement,
                   .step = *e.step_};
  e.model_io_ = std::make_unique<ModelIo>(io);
  e.checkpoints_ = std::make_unique<CheckpointIo>(io, e.trainable_, e.dtype_);
  return Status::Ok();
}

Status CheckNcclLanes() {
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (connections != nullptr && std::string(connections) == "1") {
    return FailedPreconditionError(
        "strata.nccl_lanes with CUDA_DEVICE_MAX_CONNECTIONS=1: the reductions' and the "
        "all-gathers' NCCL communicators need their kernels able to run at once, which one "
        "connection forbids (the ranks could hang); unset CUDA_DEVICE_MAX_CONNECTIONS, or "
        "set strata.nccl_lanes to false (one communicator carries both)");
  }
  return Status::Ok();
}

}  // namespace strata::engine

#include "strata/engine/runtime/engine_core.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/core/topology.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/offload/cpu/host_state_store.h"
#include "strata/offload/nvme/nvme_state_store.h"
#include "strata/swap/crc32c.h"
#include "strata/swap/swap_space.h"

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

// Memory for a state store from `tier`. With `device`, every block is registered with it
// (the device copies from and to it: staged working shards, their host mirror) and
// unregistered when freed; `tier` null: the heap (a relocating store's moved chunks).
offload::StateAllocator StoreAllocator(Tier* tier, std::shared_ptr<Device> device) {
  return [tier, device](size_t bytes, std::string_view purpose) -> Result<offload::StateMemory> {
    std::unique_ptr<TierBuffer> b;
    std::shared_ptr<std::byte[]> heap;
    std::byte* data = nullptr;
    if (tier != nullptr) {
      STRATA_ASSIGN_OR_RETURN(TierBuffer t, tier->Allocate(bytes, purpose));
      b = std::make_unique<TierBuffer>(std::move(t));
      data = b->data();
    } else {
      heap.reset(new std::byte[bytes]());
      data = heap.get();
    }
    const bool registered = device != nullptr && bytes > 0;
    if (registered) {
      STRATA_RETURN_IF_ERROR(
          device->RegisterHost(data, bytes)
              .WithContext("registering " + std::string(purpose) + " with the device"));
    }
    std::shared_ptr<void> owner(data, [b = std::shared_ptr<TierBuffer>(std::move(b)), heap,
                                       device = registered ? device : nullptr](void* p) {
      if (device == nullptr) return;
      Status st = device->UnregisterHost(p);
      if (!st.ok()) STRATA_LOG(kWarn) << "engine: unregistering a state store block: " << st;
    });
    return offload::StateMemory{data, bytes, std::move(owner)};
  };
}

// STRATA_TEST_RELOCATING_STORE=1: resident stores in their relocating test mode.
Result<bool> RelocatingFromEnv() {
  const char* v = std::getenv("STRATA_TEST_RELOCATING_STORE");
  if (v == nullptr || *v == '\0') return false;
  if (std::string_view(v) != "0" && std::string_view(v) != "1") {
    return InvalidArgumentError("STRATA_TEST_RELOCATING_STORE='" + std::string(v) +
                                "' must be 0 or 1");
  }
  return std::string_view(v) == "1";
}

// A store over swap slots in `o.nvme_path` (`key`: its config section, for errors).
Result<std::unique_ptr<offload::StateStore>> MakeNvmeStore(
    const Config& config, const OffloadConfig& o, std::string_view key, int buffer_count,
    size_t max_chunk_bytes, offload::StateAllocator alloc, bool write_behind,
    const EngineOptions& options) {
  swap::SwapSpaceOptions sopts = swap::SwapSpaceOptions::FromConfig(config.aio, config.strata, o);
  sopts.engine_factory = options.nvme_io_engine_factory;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::SwapSpace> space,
                          swap::SwapSpace::Create(std::move(sopts))
                              .WithContext("the swap space of " + std::string(key) + ".nvme_path"));
  offload::NvmeStateStoreOptions nopts;
  nopts.swap = std::move(space);
  nopts.buffer_count = buffer_count;
  nopts.max_chunk_bytes = max_chunk_bytes;
  nopts.allocator = std::move(alloc);
  nopts.write_behind = write_behind;
  nopts.observer = options.test_nvme_observer;
  return offload::MakeNvmeStateStore(std::move(nopts));
}

// The optimizer's state store: resident on the optimizer tier, or on NVMe (offload_optimizer
// = nvme) with its buffers on the optimizer tier (the host tier). STRATA_TEST_RELOCATING_STORE=1
// puts a resident store in its relocating test mode (docs/engine.md).
Result<std::unique_ptr<offload::StateStore>> MakeStateStore(const Config& config, Tier* tier,
                                                            size_t partition_numel,
                                                            const EngineOptions& options) {
  offload::StateAllocator alloc = StoreAllocator(tier, nullptr);
  const OffloadConfig& o = config.zero.offload_optimizer;
  if (o.device != OffloadDevice::kNvme) {
    offload::HostStateStoreOptions hopts;
    STRATA_ASSIGN_OR_RETURN(hopts.relocate, RelocatingFromEnv());
    return offload::MakeHostStateStore(std::move(alloc), hopts);
  }
  const int depth = config.strata.swap_pipeline_depth;
  if (o.pipeline_read && depth < 2) {
    return InvalidArgumentError(
        "strata.swap_pipeline_depth = " + std::to_string(depth) +
        " with zero_optimization.offload_optimizer.pipeline_read: a depth of 1 (the sub-group "
        "being updated) reads nothing ahead; set it to 2 or more, or pipeline_read to false");
  }
  const int need = o.pipeline_read ? 4 * depth : 4;
  if (o.buffer_count < need) {
    return InvalidArgumentError(
        "zero_optimization.offload_optimizer.buffer_count = " + std::to_string(o.buffer_count) +
        " is too small: the step holds a sub-group's fp32 master, m, v and gradient "
        "accumulator (4 buffers)" +
        (o.pipeline_read
             ? " while pipeline_read brings in the next " + std::to_string(depth - 1) +
                   " sub-group(s) (strata.swap_pipeline_depth = " + std::to_string(depth) + ")"
             : std::string()) +
        "; set buffer_count to at least " + std::to_string(need) +
        (o.pipeline_write ? " (" + std::to_string(need + 4) +
                                " keeps the previous sub-group's writes in flight too)"
                          : std::string()));
  }
  const uint64_t sub = static_cast<uint64_t>(std::max<int64_t>(1, config.zero.sub_group_size));
  const size_t max_chunk =
      static_cast<size_t>(std::min<uint64_t>(sub, std::max<size_t>(1, partition_numel))) *
      sizeof(float);
  return MakeNvmeStore(config, o, "zero_optimization.offload_optimizer", o.buffer_count, max_chunk,
                       std::move(alloc), o.pipeline_write, options);
}

// A resident store for working shards in `tier`'s memory; `device`: the device that copies
// from it (its blocks are registered, moved ones too in the relocating test mode), or null.
Result<std::unique_ptr<offload::StateStore>> MakeHostShardStore(Tier* tier,
                                                                std::shared_ptr<Device> device) {
  offload::HostStateStoreOptions hopts;
  STRATA_ASSIGN_OR_RETURN(hopts.relocate, RelocatingFromEnv());
  if (device != nullptr) hopts.relocate_allocator = StoreAllocator(nullptr, device);
  return offload::MakeHostStateStore(StoreAllocator(tier, std::move(device)), hopts);
}

// The working shards' store (working_shards.h): on NVMe with offload_param = nvme (buffers
// on the host tier), else resident in `tier`'s memory. `device` as above.
Result<std::unique_ptr<offload::StateStore>> MakeParamStore(const Config& config, Tier* tier,
                                                            std::shared_ptr<Device> device,
                                                            const ModelPartition& partition,
                                                            DType dtype,
                                                            const EngineOptions& options) {
  const OffloadConfig& o = config.zero.offload_param;
  if (o.device != OffloadDevice::kNvme) return MakeHostShardStore(tier, std::move(device));
  offload::StateAllocator alloc = StoreAllocator(tier, device);
  // Each buffer holds one group's shard; the largest decides their size.
  size_t largest = 0;
  int largest_group = 0;
  for (int g = 0; g < partition.num_groups(); ++g) {
    if (partition.groups[static_cast<size_t>(g)].shard_numel > largest) {
      largest = partition.groups[static_cast<size_t>(g)].shard_numel;
      largest_group = g;
    }
  }
  if (static_cast<uint64_t>(o.buffer_size) < largest) {
    return InvalidArgumentError(
        "zero_optimization.offload_param.buffer_size = " + std::to_string(o.buffer_size) +
        " elements is below the largest working shard, group " + std::to_string(largest_group) +
        " (" + partition.groups[static_cast<size_t>(largest_group)].name + ") with " +
        std::to_string(largest) +
        " elements on each rank; raise buffer_size or wrap smaller "
        "modules");
  }
  if (o.buffer_count < 2) {
    return InvalidArgumentError(
        "zero_optimization.offload_param.buffer_count = " + std::to_string(o.buffer_count) +
        " is too small: one buffer holds the shard being gathered and the others read the "
        "next ones ahead; set it to at least 2 (DeepSpeed's default is 5)");
  }
  return MakeNvmeStore(config, o, "zero_optimization.offload_param", o.buffer_count,
                       std::max<size_t>(1, largest * DTypeSize(dtype)), std::move(alloc),
                       /*write_behind=*/true, options);
}

// The NUMA node of the host tier's pages and CPU-Adam's threads: strata.numa_node
// (`config_node`) or the caller's CpuAdam option (`adam_node`; the two disagreeing is
// refused), else, on a machine of several nodes, the node `device` hangs off (its PCI bus: a
// GPU); else -1, none (the OS places pages where first touched). `numa_key` names the
// setting that chose the node, for later errors.
Result<int> ResolveNumaNode(int config_node, int adam_node, const Device& device,
                            std::string& numa_key) {
  int numa_node = config_node;
  numa_key = "strata.numa_node";
  if (adam_node >= 0) {
    if (numa_node >= 0 && numa_node != adam_node) {
      return InvalidArgumentError(
          "strata.numa_node = " + std::to_string(numa_node) +
          " but EngineOptions::cpu_adam.numa_node = " + std::to_string(adam_node) +
          ": the host tier and CPU-Adam's threads share one node; set one of them");
    }
    numa_node = adam_node;
    numa_key = "EngineOptions::cpu_adam.numa_node";
  }
  if (numa_node >= 0) {
    STRATA_ASSIGN_OR_RETURN(Topology topo, Topology::Discover());
    if (!topo.HasNumaNode(numa_node)) {
      std::string nodes;
      for (const NumaNode& node : topo.numa_nodes())
        nodes += (nodes.empty() ? "" : ", ") + std::to_string(node.os_index);
      return InvalidArgumentError(numa_key + " = " + std::to_string(numa_node) +
                                  ": this process may use NUMA node(s) " + nodes +
                                  " only; set one of them, or -1 (the GPU's node, or no binding)");
    }
  } else if (const std::string bus = device.pci_bus_id(); !bus.empty()) {
    Result<Topology> topo = Topology::Discover();
    if (!topo.ok()) {
      STRATA_LOG(kWarn) << "strata.numa_node = -1: the NUMA node of " << device.name()
                        << " is unknown (" << topo.status().message()
                        << "); the host tier and CPU-Adam's threads are not bound to a node "
                           "(set strata.numa_node to bind them)";
    } else if (topo->numa_nodes().size() > 1) {
      numa_node = topo->NumaNodeOfPci(bus);
      if (numa_node >= 0) {
        STRATA_LOG(kInfo) << "the host tier and CPU-Adam's threads on NUMA node " << numa_node
                          << ", the node of " << device.name() << " (" << bus
                          << "; strata.numa_node = -1)";
      } else {
        STRATA_LOG(kWarn) << "strata.numa_node = -1: " << device.name() << " (" << bus
                          << ") hangs off no single NUMA node of this machine's "
                          << topo->numa_nodes().size()
                          << "; the host tier and CPU-Adam's threads are not bound to one";
      }
    }
  }
  return numa_node;
}

// What decides which cores CPU-Adam's threads of this rank may use: the machine (host name
// and boot id), this thread's affinity mask and the NUMA node they are bound to (-1: none).
// Ranks with the same key compete for the same cores.
int64_t CoresKey(int numa_node) {
  uint32_t h = 0;
  auto mix = [&h](const void* data, size_t n) {
    h = swap::Crc32cExtend(h, {static_cast<const std::byte*>(data), n});
  };
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) == 0) mix(host, std::strlen(host));
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) mix(boot_id.data(), boot_id.size());
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) mix(&mask, sizeof(mask));
  mix(&numa_node, sizeof(numa_node));
  return static_cast<int64_t>(h);
}

// CPU-Adam's threads: the caller's EngineOptions::cpu_adam.num_threads or
// strata.cpu_adam_threads (Create refuses the two disagreeing first), else the cores this
// rank may use divided among the ranks of `comm` with the same CoresKey (at least 1). Every
// rank takes part in the all-gather of the keys, whatever its own settings.
struct CpuThreads {
  int threads = 0;
  int ranks_sharing = 1;  // ranks of this job with the same cores, this one included
  int cores = 0;          // the cores this rank may use (CpuAdam::AvailableThreads)
};
Result<CpuThreads> ResolveCpuAdamThreads(int config_threads, int adam_threads, int numa_node,
                                         comm::Communicator& comm) {
  CpuThreads t;
  t.cores = CpuAdam::AvailableThreads(numa_node);
  const int64_t key = CoresKey(numa_node);
  if (comm.world_size() > 1) {
    std::vector<int64_t> keys(static_cast<size_t>(comm.world_size()));
    STRATA_RETURN_IF_ERROR_CTX(comm.AllGather(&key, keys.data(), keys.size(), comm::DType::kInt64),
                               "gathering the ranks' cores (for CPU-Adam's threads)");
    t.ranks_sharing = static_cast<int>(std::count(keys.begin(), keys.end(), key));
  }
  t.threads = adam_threads > 0     ? adam_threads
              : config_threads > 0 ? config_threads
                                   : std::max(1, t.cores / std::max(1, t.ranks_sharing));
  return t;
}

// Create's local outcome agreed on (engine/agreement.h) before its next collective, or before
// it returns: Ok only when it is Ok on every rank; else every rank returns the failing ranks'
// errors. One rank: its own status as it is.
Status AgreeOnCreate(comm::Communicator& comm, const Status& local) {
  if (comm.world_size() == 1) return local;
  STRATA_ASSIGN_OR_RETURN(Outcomes agreed, AgreeOnOutcomes(comm, local, {}, 4096));
  return OutcomeStatus(agreed, "creating the engine");
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
  if (comm == nullptr) return InvalidArgumentError("EngineCore: null communicator");
  STRATA_RETURN_IF_ERROR(CheckSupported(config));
  if (config.train_batch_size > 0 && config.world_size != comm->world_size()) {
    return InvalidArgumentError("the config's batch sizes were checked for world size " +
                                std::to_string(config.world_size) + " but the communicator has " +
                                std::to_string(comm->world_size()) +
                                " ranks (parse the config with ValidateOptions{.world_size = " +
                                std::to_string(comm->world_size()) + "})");
  }
  std::shared_ptr<comm::Communicator> host_comm = options.host_comm ? options.host_comm : comm;
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
    if (lane == comm) {
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
  std::unique_ptr<EngineCore> e(new EngineCore());
  e->reduce_comm_ = options.reduce_comm;
  e->gather_comm_ = options.gather_comm;
  e->comm_ = std::move(comm);
  e->host_comm_ = std::move(host_comm);
  e->config_ = config;
  e->dtype_ = WorkingDTypeFromConfig(config);
  const size_t elem = DTypeSize(e->dtype_);
  // Every rank agrees on Create's local outcomes before each of its collectives (the
  // all-gather of the ranks' cores, the broadcasts of the initial values, committing the
  // initial states, and last gathering the persistent groups): a rank that fails alone (a
  // device budget or an allocation, its machine's limits, a path) fails Create on every
  // rank, each naming it, instead of leaving the others in a collective (docs/engine.md,
  // "The start-up check").
  const OffloadConfig& opt_off = config.zero.offload_optimizer;
  const OffloadConfig& par_off = config.zero.offload_param;
  const bool opt_nvme = opt_off.device == OffloadDevice::kNvme;
  const bool par_nvme = par_off.device == OffloadDevice::kNvme;
  size_t n = 0;   // the rank's partition
  size_t nt = 0;  // the optimizer's partition: the trainable groups' shards (a prefix of it)
  int numa_node = -1;
  std::string numa_key;
  bool mirror = false, staging = false, copies = false;
  ReducerOptions ropts;
  EngineCore* raw = e.get();

  // 1. This rank's partition, limits, device and tiers.
  const Status prepared = [&]() -> Status {
    // Partitioning.
    std::vector<std::pair<std::string, std::vector<ParamSpec>>> specs;
    size_t frozen_groups = 0;
    for (const GroupDesc& g : groups) {
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
    STRATA_ASSIGN_OR_RETURN(e->partition_,
                            PartitionModel(specs, e->comm_->world_size(), e->comm_->rank(), popts));
    e->trainable_ = e->partition_.Trainable();
    for (auto& begins : e->span_begin_)
      begins.resize(static_cast<size_t>(e->partition_.num_groups()));
    n = e->partition_.partition_numel;
    // The optimizer's partition: the trainable groups' shards (a prefix of the rank's).
    nt = e->trainable_.partition_numel;

    // The planner's check (core/planner.h, the same as `strata-config plan`): host memory,
    // RLIMIT_MEMLOCK and the free disk at each nvme_path for what this config puts there,
    // before anything is allocated. The budgets are checked exactly below and as allocated.
    {
      PlanInput pin;
      for (int g = 0; g < e->partition_.num_groups(); ++g) {
        const GroupLayout& l = e->partition_.groups[static_cast<size_t>(g)];
        pin.params += l.padded_numel;
        if (e->partition_.frozen(g)) pin.frozen_params += l.padded_numel;
        pin.largest_group = std::max<uint64_t>(pin.largest_group, l.padded_numel);
      }
      pin.world_size = e->comm_->world_size();
      if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local != nullptr) {
        pin.ranks_per_node = std::atoi(local);  // torchrun's; 0 (unparsable): every rank
      }
      if (pin.params > 0) {
        STRATA_ASSIGN_OR_RETURN(Plan plan, MakePlan(config, pin));
        Result<MachineFacts> machine =
            options.test_machine_facts ? options.test_machine_facts(plan) : ReadMachineFacts(plan);
        STRATA_RETURN_IF_ERROR(machine.status().WithContext("reading the machine's limits"));
        STRATA_RETURN_IF_ERROR(
            CheckPlan(plan, config, *machine,
                      {.device_budget = false, .host_budget = false, .unusable_paths = false}));
      }
    }

    // Tiers. nvme is refused before anything is allocated.
    e->device_ = options.device;
    if (e->device_ == nullptr) {
      CpuDeviceOptions dopts = options.cpu_device;
      dopts.budget_bytes = config.strata.device_budget;
      // Testing knob: the delaying CPU device under any front end (the test suites run the
      // front ends' tests a second time with it; docs/engine.md, "The device seam").
      if (const char* seed = std::getenv("STRATA_CPU_DEVICE_DELAY_SEED");
          seed != nullptr && *seed != '\0') {
        char* end = nullptr;
        const unsigned long long v = std::strtoull(seed, &end, 10);
        if (end == seed || *end != '\0') {
          return InvalidArgumentError("STRATA_CPU_DEVICE_DELAY_SEED='" + std::string(seed) +
                                      "' is not a non-negative integer");
        }
        dopts.delaying = true;
        dopts.seed = v;
      }
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, MakeCpuDevice(dopts));
      e->device_ = std::move(dev);
    }
    STRATA_ASSIGN_OR_RETURN(
        numa_node, ResolveNumaNode(config.strata.numa_node, options.cpu_adam.numa_node, *e->device_,
                                   numa_key));
    e->device_allocator_ = options.device_allocator;
    if (e->device_allocator_ == nullptr) e->device_allocator_ = e->device_->allocator();
    e->device_tier_ = MakeDeviceTier(e->device_allocator_);
    if (opt_off.device == OffloadDevice::kNone && !e->device_tier_->host_addressable()) {
      return InvalidArgumentError(
          "zero_optimization.offload_optimizer.device = none on " + e->device_->name() +
          ": Strata's optimizer is CPU-Adam, which updates optimizer states in host memory; set "
          "offload_optimizer.device to cpu");
    }
    // The working shards on the device are written by copies from a pinned host mirror
    // (the optimizer writes the mirror), unless a test's allocator stands in for the device.
    mirror = par_off.device == OffloadDevice::kNone && options.device_allocator == nullptr;
    if (opt_off.device == OffloadDevice::kCpu || par_off.device == OffloadDevice::kCpu || mirror ||
        opt_nvme || par_nvme) {
      // NVMe states stage through the host tier's buffers, page-locked with pin_memory.
      const bool pin = mirror || (opt_off.device != OffloadDevice::kNone && opt_off.pin_memory) ||
                       (par_off.device != OffloadDevice::kNone && par_off.pin_memory);
      HostPoolOptions hopts = HostPoolOptions::FromConfig(config.strata, pin);
      hopts.numa_node = numa_node;
      hopts.name = "host tier";
      STRATA_ASSIGN_OR_RETURN(HostPool pool, HostPool::Create(hopts));
      e->host_pool_ = std::make_shared<HostPool>(std::move(pool));
      e->host_tier_ = MakeHostTier(e->host_pool_);
    }
    // offload_optimizer = nvme: the states live in swap slots, staged through buffers on
    // the host tier.
    STRATA_ASSIGN_OR_RETURN(e->optimizer_tier_,
                            SelectOffloadTier(opt_nvme ? OffloadDevice::kCpu : opt_off.device,
                                              "zero_optimization.offload_optimizer.device",
                                              e->device_tier_.get(), e->host_tier_.get()));
    STRATA_ASSIGN_OR_RETURN(e->param_tier_,
                            SelectOffloadTier(par_nvme ? OffloadDevice::kCpu : par_off.device,
                                              "zero_optimization.offload_param.device",
                                              e->device_tier_.get(), e->host_tier_.get()));
    if (par_nvme && !opt_nvme) {
      return InvalidArgumentError(
          "zero_optimization.offload_param.device = nvme needs offload_optimizer.device = nvme: "
          "the step's new working shards are committed together with the optimizer states, and "
          "only states on NVMe can be rolled back when a write fails on some rank");
    }

    // The device budget must hold two of the largest groups gathered, the persistent groups,
    // the gradient buckets and whatever shards live on the device tier.
    ropts.bucket_elems =
        static_cast<uint64_t>(std::max<int64_t>(1, config.zero.reduce_bucket_size));
    ropts.num_buckets = config.zero.overlap_comm ? 2 : 1;
    // Stage 1 all-reduces the gradients (each rank receives every reduced bucket whole and
    // keeps its slice), stage 2 and 3 reduce-scatter them (unless reduce_scatter = false).
    ropts.reduce_scatter = config.zero.reduce_scatter && config.zero.stage != 1;
    // The config's budget, or the one the device chose when it names none (the CUDA device
    // reserves half the free memory; the CPU device has none: unbounded).
    const uint64_t budget = config.strata.device_budget > 0
                                ? config.strata.device_budget
                                : e->device_allocator_->usage().budget_bytes;
    if (budget > 0) {
      // (Not a structured binding: clang 14 cannot capture one in the lambda below.)
      const std::pair<size_t, size_t> largest = e->partition_.LargestTwo();
      const size_t a = largest.first, b = largest.second;
      // Bytes of the groups gathered at once, at `bytes_per_elem`: the two largest, and
      // the persistent ones.
      auto two_largest = [&](uint64_t bytes_per_elem) {
        return Round64(a * bytes_per_elem) + Round64(b * bytes_per_elem);
      };
      auto persistent_groups = [&](uint64_t bytes_per_elem) {
        uint64_t sum = 0;
        for (size_t g = 0; g < e->partition_.groups.size(); ++g) {
          if (e->partition_.persistent[g]) {
            sum += Round64(e->partition_.groups[g].padded_numel * bytes_per_elem);
          }
        }
        return sum;
      };
      const uint64_t two = two_largest(elem);
      const uint64_t persistent = persistent_groups(elem);
      const uint64_t buckets = GradientReducer::BucketBytes(e->trainable_, e->dtype_, ropts);
      uint64_t resident = 0;
      if (e->param_tier_ == e->device_tier_.get()) resident += Round64(n * elem);
      if (e->optimizer_tier_ == e->device_tier_.get()) resident += 4 * Round64(nt * sizeof(float));
      const uint64_t need = two + persistent + buckets + resident;
      if (budget < need) {
        const std::string whose = config.strata.device_budget > 0
                                      ? "strata.device_budget = "
                                      : "strata.device_budget is 0; the budget of the " +
                                            e->device_allocator_->name() +
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

    if (options.cpu_adam.num_threads > 0 && config.strata.cpu_adam_threads > 0 &&
        options.cpu_adam.num_threads != config.strata.cpu_adam_threads) {
      return InvalidArgumentError(
          "strata.cpu_adam_threads = " + std::to_string(config.strata.cpu_adam_threads) +
          " but EngineOptions::cpu_adam.num_threads = " +
          std::to_string(options.cpu_adam.num_threads) +
          ": set one of them (0: this rank's share of the cores)");
    }
    return Status::Ok();
  }();
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(*e->host_comm_, prepared));
  STRATA_ASSIGN_OR_RETURN(
      const CpuThreads adam_threads,
      ResolveCpuAdamThreads(config.strata.cpu_adam_threads, options.cpu_adam.num_threads, numa_node,
                            *e->host_comm_));

  // 2. CPU-Adam, the stores, the working shards and the optimizer's driver.
  const Status built = [&]() -> Status {
    // Working shards and optimizer state, initialized from the descriptions.
    CpuAdam::Options adam_options = options.cpu_adam;
    adam_options.numa_node = numa_node;
    adam_options.num_threads = adam_threads.threads;
    e->cpu_adam_ranks_sharing_ = adam_threads.ranks_sharing;
    e->cpu_adam_cores_ = adam_threads.cores;
    {
      Result<std::unique_ptr<CpuAdam>> adam = CpuAdam::Create(adam_options);
      if (!adam.ok()) {
        return adam.status().WithContext(
            numa_node >= 0 ? "CPU-Adam's threads on NUMA node " + std::to_string(numa_node) + " (" +
                                 numa_key + "; -1: the GPU's node, or none)"
                           : std::string("CPU-Adam"));
      }
      e->cpu_adam_ = *std::move(adam);
    }
    // The working shards: in their store (the parameter tier's memory, NVMe, or the device's
    // pinned host mirror), and with offload_param = none on a device also in device memory.
    // The device copies from the store when it stages shards or pushes the mirror.
    staging = par_off.device != OffloadDevice::kNone && options.device_allocator == nullptr;
    copies = (mirror || staging) && n > 0;
    // NVMe stores report each read and write to the timeline (its nvme lane), besides a
    // test's observer.
    auto observed = [&](bool params) {
      EngineOptions o = options;
      o.test_nvme_observer = [raw, params,
                              test = options.test_nvme_observer](const offload::StateEvent& ev) {
        if (test) test(ev);
        raw->NoteNvmeEvent(params, ev);
      };
      return o;
    };
    STRATA_ASSIGN_OR_RETURN(e->param_store_,
                            MakeParamStore(config, mirror ? e->host_tier_.get() : e->param_tier_,
                                           copies ? e->device_ : nullptr, e->partition_, e->dtype_,
                                           observed(/*params=*/true)));
    // offload_param = nvme: the leading groups' shards within max_in_cpu stay in host memory.
    const uint64_t max_in_cpu =
        par_nvme ? static_cast<uint64_t>(std::max<int64_t>(0, par_off.max_in_cpu)) : 0;
    if (max_in_cpu > 0) {
      STRATA_ASSIGN_OR_RETURN(
          e->param_host_store_,
          MakeHostShardStore(e->host_tier_.get(), copies ? e->device_ : nullptr));
    }
    STRATA_ASSIGN_OR_RETURN(e->shards_,
                            WorkingShards::Create(&e->partition_, e->dtype_, e->param_store_.get(),
                                                  e->param_host_store_.get(), max_in_cpu));
    if (max_in_cpu > 0) {
      STRATA_LOG(kInfo) << "engine: offload_param.max_in_cpu = " << max_in_cpu << " keeps "
                        << FormatBytes(e->shards_->host_bytes()) << " of the rank's "
                        << FormatBytes(n * elem) << " of working shards in host memory"
                        << (e->shards_->host_bytes() == n * elem ? " (none on NVMe)" : "");
    }
    if (mirror && n > 0) {
      STRATA_ASSIGN_OR_RETURN(e->device_working_,
                              e->device_tier_->Allocate(n * elem, "working shards"));
    }
    if (copies) {
      STRATA_ASSIGN_OR_RETURN(e->copy_stream_, e->device_->CreateStream("shard copies"));
      e->copies_ = true;
    }
    e->test_skip_working_copy_wait_ = options.test_skip_working_copy_wait;
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
    for (const GroupDesc& g : groups) {
      if (g.frozen) break;  // no optimizer state (the frozen groups come last)
      std::vector<int> of;
      for (const ParamDesc& p : g.params)
        of.push_back(p.param_group);
      dopts.param_group.push_back(std::move(of));
    }
    dopts.prefetch_ahead =
        opt_nvme && opt_off.pipeline_read
            ? static_cast<size_t>(std::max(1, config.strata.swap_pipeline_depth) - 1)
            : 0;
    dopts.skip_inf_nan = config.strata.skip_inf_nan_steps;
    if (par_nvme) {
      // The pipelined step writes new parameters into staging buffers on the host tier (its
      // budget counts them; two, the option's default), from the shards' store's allocator
      // (registered with the device alike), so that a staging buffer and a store buffer can
      // be exchanged instead of copied.
      dopts.staging_allocator = StoreAllocator(e->param_tier_, copies ? e->device_ : nullptr);
      if (options.test_staged_shard_buffers > 0) {
        dopts.staged_shard_buffers = options.test_staged_shard_buffers;
      }
    }
    dopts.on_update = options.test_on_update;
    dopts.on_group_updated = options.test_on_group_updated;
    dopts.on_norm_summed = options.test_on_norm_summed;
    dopts.on_early_norm = options.test_on_early_norm;
    dopts.norm_as_written = options.test_norm_as_written;
    dopts.lazy_zero = options.test_lazy_zero;
    dopts.timeline = &e->timeline_;
    STRATA_ASSIGN_OR_RETURN(
        e->store_, MakeStateStore(config, e->optimizer_tier_, nt, observed(/*params=*/false)));
    STRATA_ASSIGN_OR_RETURN(
        e->driver_, OptimizerDriver::Create(&e->trainable_, e->store_.get(), e->shards_.get(),
                                            e->host_comm_.get(), e->cpu_adam_.get(), dopts));
    return Status::Ok();
  }();
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(*e->host_comm_, built));

  // 3. The initial values: a rank's failure to write them is kept until every broadcast
  //    was issued, then agreed on.
  const bool broadcast = options.broadcast_initial_values && e->partition_.world_size > 1;
  Status init;
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupLayout& layout = e->partition_.groups[g];
    const size_t shard = e->partition_.shard_offset[g];
    // A trainable group's values go to its fp32 master (the working shards follow it); a
    // frozen group's straight to its working shard.
    const bool frozen = groups[g].frozen;
    auto put = [&](size_t within, std::span<const float> values) -> Status {
      if (!frozen) return e->driver_->WriteMaster(shard + within, values);
      return e->WriteFrozen(static_cast<int>(g), within, values);
    };
    if (broadcast && !groups[g].init_is_shard) {
      // Rank 0's values, flattened as the group buffer, to every rank.
      if (layout.padded_numel == 0) continue;
      std::vector<float> full(layout.padded_numel, 0.0f);
      if (e->partition_.rank == 0) {
        for (size_t i = 0; i < layout.params.size(); ++i) {
          const ParamDesc& p = groups[g].params[i];
          if (p.init == nullptr) continue;
          ConvertToFloat(p.init, p.init_dtype, p.numel, full.data() + layout.params[i].offset);
        }
      }
      STRATA_RETURN_IF_ERROR_CTX(
          e->host_comm_->Broadcast(full.data(), full.size(), comm::DType::kFloat32, 0),
          "broadcasting the initial values of group " + layout.name);
      if (init.ok()) {
        init = put(0, std::span<const float>(full).subspan(layout.shard_begin(e->partition_.rank),
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
        if (p.init == nullptr) continue;
        const std::optional<ShardSlice> sl = layout.Slice(i, e->partition_.rank);
        if (!sl) continue;
        // In pieces of at most 1 Mi elements: the temporary stays small whatever the
        // parameter (the values are read from the front end's own tensor).
        constexpr size_t kPiece = size_t{1} << 20;
        std::vector<float> values;
        for (size_t done = 0; done < sl->count; done += kPiece) {
          const size_t count = std::min(kPiece, sl->count - done);
          values.resize(count);
          ConvertToFloat(static_cast<const std::byte*>(p.init) +
                             (sl->param_offset + done) * DTypeSize(p.init_dtype),
                         p.init_dtype, count, values.data());
          STRATA_RETURN_IF_ERROR(put(sl->shard_offset + done, values));
        }
      }
      return Status::Ok();
    }();
  }
  if (init.ok()) init = e->driver_->SyncWorkingFromMaster();
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(*e->host_comm_, init));

  // 4. The initial states committed (an NVMe store's outcome is agreed on there), the
  //    working shards pushed, the coordinator, the reducer, the schedule and the update's
  //    staging.
  CoordinatorOptions copts;
  ShardSource source;
  const Status finished = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(e->driver_->Commit().WithContext("initializing the optimizer states"));
    STRATA_RETURN_IF_ERROR(e->PushWorkingShards());
    copts.prefetch_bucket_elems =
        static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_prefetch_bucket_size));
    copts.max_live_elems =
        static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_max_live_parameters));
    copts.max_reuse_distance =
        static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_max_reuse_distance));
    copts.prefetch = options.prefetch;
    copts.timeline = &e->timeline_;
    e->pipeline_step_ = config.strata.pipeline_step && e->driver_->CanPipeline();
    e->early_step_ = config.strata.early_step;
    if (e->early_step_ && (!e->pipeline_step_ || !e->driver_->CanStepEarly() ||
                           config.fp16.enabled || config.gradient_clipping > 0.0)) {
      // (The configuration's checks name the key at fault; this is for a Config built in code.)
      return FailedPreconditionError(
          "strata.early_step needs strata.pipeline_step true, gradient_clipping 0, fp16 off, "
          "strata.skip_inf_nan_steps false, Adam or AdamW and no NVMe tier; set early_step false "
          "or change those settings");
    }
    e->norm_in_backward_ =
        config.strata.norm_in_backward && !e->early_step_ && e->driver_->CanSumNormInBackward();
    if (e->pipeline_step_) {
      copts.shard_ready = [raw](int g) { return raw->ShardReady(g); };
      copts.open_shard = [raw](int g) { return raw->OpenShard(g); };
      copts.shard_stored = [raw](int g) { return raw->ShardStored(g); };
    }
    copts.device = e->device_.get();
    if (staging && n > 0) {
      // Working shards in (pinned) host memory or NVMe: staged into the device on a copy
      // stream.
      copts.stage_shards = true;
      copts.copy_stream = e->copy_stream_;
      copts.test_skip_staging_wait = options.test_skip_staging_wait;
    }
    if (par_nvme) {
      // One buffer holds the shard being staged; the others read the next ones ahead.
      copts.shard_read_ahead = static_cast<size_t>(par_off.buffer_count - 1);
      copts.shard_read_bandwidth = config.strata.nvme_read_bandwidth;
    }
    if (mirror) {
      source.device = e->device_working_.data();
    } else {
      source.store = e->shards_.get();
    }
    ropts.device = e->device_.get();
    ropts.timeline = &e->timeline_;
    if (e->optimizer_tier_ != e->device_tier_.get() && options.device_allocator == nullptr) {
      // Accumulators in host memory: reduced shards go device->host on their own stream.
      STRATA_ASSIGN_OR_RETURN(ropts.copy_stream, e->device_->CreateStream("gradient shards"));
      ropts.shards_to_host = true;
      ropts.staging_tier = e->optimizer_tier_;
      ropts.test_skip_shard_wait = options.test_skip_shard_wait;
      ropts.test_before_adding_shards = options.test_before_adding_shards;
      // Reduced shards added on the reducer's thread: the driver's Accumulate then runs there
      // (host states only: the NVMe store's leases are the engine thread's).
      ropts.accumulate_in_background =
          config.strata.accumulate_in_background && e->driver_->CanSumNormInBackward();
    }
    // The coordinator allocates the persistent groups' buffers here; it gathers them below.
    STRATA_ASSIGN_OR_RETURN(e->coordinator_,
                            ParameterCoordinator::Create(
                                &e->partition_, source, e->dtype_,
                                e->gather_comm_ != nullptr ? e->gather_comm_.get() : e->comm_.get(),
                                e->device_tier_.get(), copts));
    STRATA_ASSIGN_OR_RETURN(e->reducer_,
                            GradientReducer::Create(
                                &e->trainable_, e->dtype_,
                                e->reduce_comm_ != nullptr ? e->reduce_comm_.get() : e->comm_.get(),
                                e->device_tier_.get(),
                                [driver = e->driver_.get()](size_t offset, const std::byte* src,
                                                            DType dtype, size_t count) {
                                  return driver->Accumulate(offset, src, dtype, count);
                                },
                                ropts));
    e->scaler_ = LossScaler::FromConfig(config.fp16);
    e->step_open_.assign(static_cast<size_t>(e->partition_.num_trainable), 1);
    e->early_ended_.assign(static_cast<size_t>(e->partition_.num_trainable), 0);
    STRATA_ASSIGN_OR_RETURN(e->schedule_, LrSchedule::Create(config.scheduler, config.optimizer));
    e->lr_iteration_ = e->schedule_.first_iteration();
    if (e->pipeline_step_) {
      // With the working shards on NVMe: the update's staging buffers, taken now (after the
      // rest), so that a host budget without room for them fails here, naming them, rather
      // than at the first step.
      STRATA_RETURN_IF_ERROR(e->driver_->ReserveStaging().WithContext(
          "strata.pipeline_step with offload_param.device nvme (set strata.pipeline_step false, "
          "or raise strata.host_budget)"));
    }
    return Status::Ok();
  }();
  STRATA_RETURN_IF_ERROR(AgreeOnCreate(*e->host_comm_, finished));

  // 5. The persistent groups gathered.
  STRATA_RETURN_IF_ERROR(e->coordinator_->RegatherPersistent());
  STRATA_LOG(kDebug) << "engine: " << e->partition_.num_groups() << " groups, " << n
                     << " elements per rank, working dtype " << DTypeName(e->dtype_)
                     << ", parameters on " << e->param_tier_->name() << ", optimizer on "
                     << e->optimizer_tier_->name();
  return e;
}

EngineCore::~EngineCore() {
  if (!copies_) return;
  // No copy may still read the working shards' store when it goes (only a test skips the
  // wait): the coordinator's leases go first, then the copies end.
  coordinator_.reset();
  Result<EventId> done = device_->Record(copy_stream_);
  Status s = done.ok() ? device_->Synchronize(*done) : done.status();
  if (!s.ok()) STRATA_LOG(kWarn) << "engine: waiting for the shard copies: " << s;
}

Status EngineCore::PushWorkingShards(bool frozen_too) {
  if (device_working_.empty()) return Status::Ok();
  // Every group's shard from the mirror, held until the copies are done.
  std::vector<offload::StateLease> held;
  const int groups = frozen_too ? partition_.num_groups() : partition_.num_trainable;
  for (int g = 0; g < groups; ++g) {
    if (!shards_->has(g)) continue;
    STRATA_ASSIGN_OR_RETURN(offload::StateLease l, StartShardPush(g));
    held.push_back(std::move(l));
  }
  STRATA_ASSIGN_OR_RETURN(EventId copied, device_->Record(copy_stream_));
  ++working_pushes_;
  if (test_skip_working_copy_wait_) return Status::Ok();
  // The next all-gather reads the working shards: the host waits for the copy first.
  TimedScope waited(working_push_wait_s_, &timeline_, "working-shard push wait",
                    TimelineLane::kWait);
  STRATA_RETURN_IF_ERROR(
      device_->Synchronize(copied).WithContext("copying the updated working shards"));
  for (offload::StateLease& l : held)
    STRATA_RETURN_IF_ERROR(l.Release());
  return Status::Ok();
}

Result<offload::StateLease> EngineCore::StartShardPush(int group) {
  STRATA_ASSIGN_OR_RETURN(offload::StateLease l, shards_->Acquire(group, offload::Access::kRead));
  STRATA_RETURN_IF_ERROR(
      device_->CopyAsync(device_working_.data() + shards_->offset(group) * DTypeSize(dtype_),
                         l.data(), l.size(), CopyKind::kHostToDevice, copy_stream_));
  return l;
}

Status EngineCore::WriteFrozen(int group, size_t within, std::span<const float> values) {
  if (values.empty()) return Status::Ok();
  const size_t elem = DTypeSize(dtype_);
  const bool whole = within == 0 && values.size() == layout(group).shard_numel;
  STRATA_ASSIGN_OR_RETURN(
      offload::StateLease l,
      shards_->Acquire(group, whole ? offload::Access::kWrite : offload::Access::kReadWrite));
  if ((within + values.size()) * elem > l.size()) {
    return InternalError("frozen group " + layout(group).name + ": elements [" +
                         std::to_string(within) + ", " + std::to_string(within + values.size()) +
                         ") outside its working shard of " + std::to_string(l.size()) + " bytes");
  }
  ConvertFromFloat(values.data(), values.size(), l.data() + within * elem, dtype_);
  return l.Release();
}

OptimizerDriver& EngineCore::optimizer() {
  const Status joined = JoinStep(/*flush=*/false);
  if (!joined.ok()) STRATA_LOG(kWarn) << "completing the pipelined optimizer step: " << joined;
  return *driver_;
}

bool EngineCore::ShardReady(int group) const {
  return !driver_->update_in_flight() || group < 0 || group >= partition_.num_trainable ||
         step_open_[static_cast<size_t>(group)] != 0 || driver_->GroupUpdated(group);
}

bool EngineCore::ShardStored(int group) const {
  return group < 0 || group >= partition_.num_trainable || driver_->ShardInStore(group);
}

Status EngineCore::OpenShard(int group) {
  if (!driver_->update_in_flight() || group < 0 || group >= partition_.num_trainable ||
      step_open_[static_cast<size_t>(group)] != 0) {
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(driver_->WaitGroup(group));
  step_open_[static_cast<size_t>(group)] = 1;
  if (device_working_.empty() || !shards_->has(group)) return Status::Ok();
  // The device's working shards (offload_param = none): this group's, from the mirror.
  STRATA_ASSIGN_OR_RETURN(offload::StateLease l, StartShardPush(group));
  STRATA_ASSIGN_OR_RETURN(EventId copied, device_->Record(copy_stream_));
  if (test_skip_working_copy_wait_) return Status::Ok();
  TimedScope waited(working_push_wait_s_, &timeline_, "working-shard push wait",
                    TimelineLane::kWait, group);
  STRATA_RETURN_IF_ERROR(device_->Synchronize(copied).WithContext(
      "copying the updated working shard of " + layout(group).name));
  return l.Release();
}

Status EngineCore::JoinStep(bool flush) {
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
      opened = OpenShard(g);
    // States on NVMe: the update's completion is a collective (every rank's I/O outcome is
    // agreed on), so the deferred all-gathers are issued first (coordinator.h).
    const bool agreed = driver_->can_fail();
    const Status flushed = agreed ? coordinator_->FlushDeferred() : Status::Ok();
    const uint64_t failed_before = driver_->stats().steps_failed;
    const Status finished = driver_->FinishUpdate();
    if (!finished.ok() && agreed && driver_->stats().steps_failed > failed_before) {
      return AfterFailedUpdate(finished);
    }
    STRATA_RETURN_IF_ERROR(opened);
    STRATA_RETURN_IF_ERROR(flushed);
    STRATA_RETURN_IF_ERROR(finished);
  }
  return flush ? coordinator_->FlushDeferred() : Status::Ok();
}

Status EngineCore::AfterFailedUpdate(Status failed) {
  // Every rank is here (the failure was agreed on), so the collectives below match. The
  // step that failed is not counted; the next one has its learning rate again.
  if (global_steps_ > 0) --global_steps_;
  if (lr_iteration_ > 0) --lr_iteration_;
  Status restored = PushWorkingShards();
  // A shard read the void forward failed (NVMe) is no error of the next step: the shards
  // were rewritten from the restored states.
  const Status void_read = coordinator_->TakeShardError();
  // The forward since the step read parameters the failed update partly wrote: that pass
  // ends here, nothing stays gathered (a front end's holds are dropped too), and the
  // persistent groups are gathered again from the restored shards.
  if (restored.ok()) restored = coordinator_->AbandonPass();
  if (restored.ok()) restored = coordinator_->RegatherPersistent();
  if (restored.ok()) restored = coordinator_->BeginIteration();
  phase_ = RunPhase::kIdle;
  void_backward_ = true;  // until a new forward: the rest of this backward is refused
  std::string msg = failed.message() +
                    "; the forward run since that step used partly updated parameters: its "
                    "loss and this iteration are void (the engine is ready for a new forward)";
  if (!restored.ok()) msg += " (restoring the engine failed too: " + restored.ToString() + ")";
  return Status(failed.code(), msg);
}

void EngineCore::NoteNvmeEvent(bool params, const offload::StateEvent& ev) {
  std::lock_guard<std::mutex> lock(nvme_mu_);
  const bool read =
      ev.kind == offload::StateEvent::kReadSubmitted || ev.kind == offload::StateEvent::kReadDone;
  const bool submitted = ev.kind == offload::StateEvent::kReadSubmitted ||
                         ev.kind == offload::StateEvent::kWriteSubmitted;
  const NvmeKey key{params, read, ev.range.state.value, ev.range.chunk};
  if (submitted) {
    if (timeline_.enabled()) nvme_in_flight_[key] = Timeline::Clock::now();
    return;
  }
  auto it = nvme_in_flight_.find(key);
  if (it == nvme_in_flight_.end()) return;  // submitted while the timeline was off
  const offload::StateStore* store = params ? param_store_.get() : store_.get();
  timeline_.Add(std::string(read ? "NVMe read: " : "NVMe write: ") +
                    (store != nullptr ? store->state_name(ev.range.state) : std::string("?")),
                TimelineLane::kNvme, it->second, Timeline::Clock::now(),
                static_cast<int>(ev.range.chunk));
  nvme_in_flight_.erase(it);
}

void EngineCore::KeepShardError() {
  if (coordinator_ == nullptr) return;
  Status error = coordinator_->TakeShardError();
  if (!error.ok()) driver_->KeepIoError(std::move(error));
}

void EngineCore::EnterPhase(RunPhase phase) {
  if (phase_ == phase) return;
  if (phase == RunPhase::kForward && phase_ == RunPhase::kBackward) return;  // a recompute
  if (phase_ == RunPhase::kForward) EndPhase("forward");
  phase_ = phase;
  phase_begin_ = Timeline::Clock::now();
}

void EngineCore::EndPhase(const char* name) {
  if (phase_ == RunPhase::kIdle) return;
  const Timeline::Clock::time_point now = Timeline::Clock::now();
  const double secs = std::chrono::duration<double>(now - phase_begin_).count();
  if (phase_ == RunPhase::kForward) {
    phases_.forward_s += secs;
    ++phases_.forwards;
  } else {
    phases_.backward_s += secs;
    ++phases_.backwards;
  }
  timeline_.Add(name, TimelineLane::kPhase, phase_begin_, now);
  phase_ = RunPhase::kIdle;
}

void EngineCore::OpenSpan(int group, int backward) {
  if (!timeline_.enabled() || group < 0 || group >= num_groups()) return;
  span_begin_[backward][static_cast<size_t>(group)] = Timeline::Clock::now();
}

void EngineCore::CloseSpan(int group, int backward) {
  if (!timeline_.enabled() || group < 0 || group >= num_groups()) return;
  timeline_.Add((backward != 0 ? "backward " : "forward ") + layout(group).name,
                TimelineLane::kCompute, span_begin_[backward][static_cast<size_t>(group)],
                Timeline::Clock::now(), group);
}

Status EngineCore::PreForward(int group, bool begins_phase) {
  if (begins_phase && phase_ != RunPhase::kBackward) {
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
  if (begins_phase) EnterPhase(RunPhase::kForward);
  // A front end's hold right after a pipelined Step() prefetches nothing: a prefetch
  // deferred there would be issued after Step() returned, where the caller may run its own
  // collectives (the same on every rank: the update runs on every rank or on none).
  const bool hold_beside_update = !begins_phase && driver_->update_in_flight();
  STRATA_RETURN_IF_ERROR(coordinator_->PreForward(group, /*prefetch=*/!hold_beside_update));
  OpenSpan(group, 0);
  return Status::Ok();
}
Status EngineCore::PostForward(int group) {
  CloseSpan(group, 0);
  return coordinator_->PostForward(group);
}
Status EngineCore::MaybeBeginEarlyStep() {
  // (Called as every backward call begins.) The reduced gradients of the boundary micro-
  // step are the last before Step(): only then are the norm's tiles summed as written.
  driver_->set_boundary_micro_step((micro_steps_ + 1) % config_.gradient_accumulation_steps == 0);
  if (early_ != EarlyPhase::kNone || norm_collecting_ || backward_since_step_ ||
      (micro_steps_ + 1) % config_.gradient_accumulation_steps != 0) {
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
  EnterPhase(RunPhase::kBackward);
  STRATA_RETURN_IF_ERROR(JoinStep());
  STRATA_RETURN_IF_ERROR(MaybeBeginEarlyStep());
  if (early_ == EarlyPhase::kBackward && group >= 0 && group < partition_.num_trainable &&
      driver_->GroupReleased(group)) {
    return EarlyTaken(layout(group).name, "PreBackward");
  }
  STRATA_RETURN_IF_ERROR(coordinator_->PreBackward(group));
  OpenSpan(group, 1);
  return Status::Ok();
}
Status EngineCore::PostBackward(int group) {
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("PostBackward"));
  CloseSpan(group, 1);
  STRATA_RETURN_IF_ERROR(coordinator_->PostBackward(group));
  if ((early_ == EarlyPhase::kBackward || norm_collecting_) && group >= 0 &&
      group < partition_.num_trainable && !coordinator_->InUse(group)) {
    early_ended_[static_cast<size_t>(group)] = 1;
    STRATA_RETURN_IF_ERROR(ReleaseFinalGroups());
  }
  return Status::Ok();
}

Status EngineCore::AddGradient(int group, int param, const void* grad, DType dtype) {
  STRATA_RETURN_IF_ERROR(RefuseVoidBackward("AddGradient"));
  if (backward_since_step_) {
    return FailedPreconditionError(
        "AddGradient after EndBackward: call Step() before the next backward");
  }
  STRATA_RETURN_IF_ERROR(JoinStep());
  if (group >= 0 && group < num_groups() && frozen(group)) {
    return FailedPreconditionError("AddGradient: group " + layout(group).name +
                                   " is frozen (its parameters take no gradient)");
  }
  STRATA_RETURN_IF_ERROR(MaybeBeginEarlyStep());
  if (early_ == EarlyPhase::kBackward && group >= 0 && group < partition_.num_trainable &&
      driver_->GroupReleased(group)) {
    return EarlyTaken(layout(group).name, "a gradient");
  }
  STRATA_RETURN_IF_ERROR(reducer_->AddGradient(group, param, grad, dtype));
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
  EnterPhase(RunPhase::kBackward);  // a backward whose groups were all left out still ends here
  STRATA_RETURN_IF_ERROR(JoinStep());
  STRATA_RETURN_IF_ERROR(reducer_->Flush());
  // The backward's last kernels may still be queued on the compute stream (work after the
  // last gradient hook): the step's re-gather of the persistent groups must not overwrite
  // buffers they read. One host wait per backward, on an event (no device-wide sync).
  STRATA_ASSIGN_OR_RETURN(EventId backward_done, device_->Record(kComputeStream));
  STRATA_RETURN_IF_ERROR(device_->Synchronize(backward_done));
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
  EndPhase("backward");
  ++micro_steps_;
  timeline_.set_micro_step(micro_steps_);
  backward_since_step_ = true;
  return Status::Ok();
}

Status EngineCore::EndForwardOnly() {
  if (reducer_->pending() || early_open()) {
    return FailedPreconditionError(
        "EndForwardOnly with gradients pending: end a backward with EndBackward");
  }
  STRATA_RETURN_IF_ERROR(JoinStep());
  STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  if (phase_ == RunPhase::kForward) EndPhase("forward (no backward)");
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

double EngineCore::lr() const {
  return lr_override_ ? *lr_override_ : schedule_.LrAt(lr_iteration_);
}

double EngineCore::LossMultiplier() const {
  return scaler_.scale() / static_cast<double>(config_.gradient_accumulation_steps);
}

Result<StepOutcome> EngineCore::Step() {
  const Timeline::Clock::time_point began = Timeline::Clock::now();
  Result<StepOutcome> out = StepImpl();
  const Timeline::Clock::time_point ended = Timeline::Clock::now();
  phases_.step_s += std::chrono::duration<double>(ended - began).count();
  ++phases_.steps;
  timeline_.Add(out.ok() && out->applied ? "step" : "step (no update)", TimelineLane::kPhase, began,
                ended);
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
    // (A backward always completed the last step; an early step's update must run on.)
    if (early_ != EarlyPhase::kReleased) STRATA_RETURN_IF_ERROR(JoinStep());
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
        : pipeline_step_ ? driver_->StartStep(lr(), scaler_, betas, coordinator_->UseOrder())
                         : driver_->Step(lr(), scaler_, betas);
    if (!stepped.ok()) {
      // A failure every rank agreed on (driver_->Step rolled back and rewrote the working
      // shards from the committed master): every rank pushes them to the device and
      // gathers the persistent groups again, so training can go on from the last step.
      if (driver_->stats().steps_failed > failed_before) {
        backward_since_step_ = false;
        Status restored = PushWorkingShards();
        if (restored.ok()) restored = coordinator_->RegatherPersistent();
        if (!restored.ok()) STRATA_LOG(kWarn) << "after a failed step: " << restored;
      }
      return stepped.status();
    }
    out = *stepped;
    ++global_steps_;
    if (out.applied) {
      ++lr_iteration_;
      lr_override_.reset();
      if (driver_->update_in_flight()) {
        // Each group's shard goes to the device as the forward opens it (OpenShard; an
        // early step's groups were closed when given, and some may be open again).
        if (!early) step_open_.assign(static_cast<size_t>(partition_.num_trainable), 0);
        if (!device_working_.empty()) ++working_pushes_;
      } else {
        STRATA_RETURN_IF_ERROR(PushWorkingShards(/*frozen_too=*/false));
      }
      // (Pipelined: waits for the persistent groups' updates, which come first.)
      STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent(/*frozen_too=*/false));
    }
  }
  backward_since_step_ = false;
  // Pipelined, nothing is prefetched here: the forward's calls fetch each group once its
  // update is done, and prefetch the next ones as theirs end (the same on every rank: the
  // update is in flight on every rank or on none).
  STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration(!driver_->update_in_flight()));
  return out;
}

Status EngineCore::LoadParameters(const Status& local_check, const ParamReader& read) {
  if (backward_since_step_ || early_open() || reducer_->pending() ||
      micro_steps_ % config_.gradient_accumulation_steps != 0) {
    return FailedPreconditionError(
        "loading parameters between a backward and its step: load them before training or "
        "right after step()");
  }
  STRATA_RETURN_IF_ERROR(JoinStep());
  // 16 KiB per rank: a check lists names (up to 20 of each kind).
  STRATA_ASSIGN_OR_RETURN(Outcomes checked,
                          AgreeOnOutcomes(*host_comm_, local_check, {}, size_t{16} << 10));
  // Nothing stays gathered (prefetches in flight are waited for): the groups gathered
  // after the load see the new values. This ends the pass the front end's calls began, on
  // the failed path too, so the next iteration starts the same way on every rank.
  STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  if (checked.any_failed) {
    STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
    return Status(checked.code,
                  OutcomeStatus(checked, "checking the parameters to load").message() +
                      "; nothing was changed");
  }
  Status local;
  std::vector<float> buffer;
  constexpr size_t kPiece = size_t{1} << 20;
  for (int g = 0; g < num_groups() && local.ok(); ++g) {
    const GroupLayout& l = layout(g);
    const size_t shard = partition_.shard_offset[static_cast<size_t>(g)];
    for (size_t i = 0; i < l.params.size() && local.ok(); ++i) {
      const std::optional<ShardSlice> s = l.Slice(i, partition_.rank);
      if (!s) continue;
      for (size_t done = 0; done < s->count && local.ok();) {
        const size_t count = std::min(kPiece, s->count - done);
        buffer.resize(count);
        local = read(g, i, s->param_offset + done, buffer);
        if (local.ok()) {
          // A frozen group's values go straight to its working shard.
          local = frozen(g) ? WriteFrozen(g, s->shard_offset + done, buffer)
                            : driver_->WriteMaster(shard + s->shard_offset + done, buffer);
        }
        done += count;
      }
    }
  }
  // Agreed on every rank, so every rank goes on into the collectives below either way: the
  // groups gathered again hold what the master holds now.
  const Status committed = driver_->CommitMasterAgreed(local, "loading parameters");
  STRATA_RETURN_IF_ERROR(PushWorkingShards());
  STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent());
  STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
  return committed;
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
  } else if (shards_->has(group)) {
    // A frozen group's values are its working shard's.
    Result<offload::StateLease> lease = shards_->Acquire(group, offload::Access::kRead);
    read = lease.status();
    if (lease.ok()) {
      ConvertToFloat(lease->data(), dtype_, shard.size(), shard.data());
      read = lease->Release();
    }
    if (!read.ok()) std::fill(shard.begin(), shard.end(), 0.0f);
  }
  if (driver_->store()->can_fail() || shards_->can_fail()) {
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
  s.device = {device_tier_->name(), TierKind::kDevice, device_tier_->usage()};
  if (host_tier_) s.host = TierStats{host_tier_->name(), TierKind::kHost, host_tier_->usage()};
  s.param_tier = param_store_->can_fail() ? TierKind::kNvme : param_tier_->kind();
  s.optimizer_tier = store_->can_fail() ? TierKind::kNvme : optimizer_tier_->kind();
  s.working_shard_bytes = partition_.partition_numel * DTypeSize(dtype_);
  s.numa_node = cpu_adam_->numa_node();
  s.cpu_adam_threads = cpu_adam_->num_threads();
  s.cpu_adam_ranks_sharing = cpu_adam_ranks_sharing_;
  s.cpu_adam_cores = cpu_adam_cores_;
  s.working_shard_host_bytes = shards_->host_bytes();
  s.param_store_name = param_store_->name();
  s.param_store = param_store_->stats();
  s.working_shard_pushes = working_pushes_;
  s.working_push_wait_s = working_push_wait_s_;
  s.phases = phases_;
  s.coordinator = coordinator_->stats();
  s.reducer = reducer_->stats();
  {
    // The reducer's thread may be in the driver's Accumulate (its counters).
    std::unique_lock<std::mutex> held = reducer_->HoldAccumulation();
    s.optimizer = driver_->stats();
    s.store_name = store_->name();
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
  s.micro_steps = micro_steps_;
  s.global_steps = global_steps_;
  s.loss_scale = scaler_.scale();
  return s;
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
     << TierKindName(optimizer_tier) << ")\n";
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
     << ", working shards copied host->device " << working_shard_pushes << "\n";
  os << "collectives: all-gather " << all_gather.calls << " (" << FormatBytes(all_gather.bytes)
     << "), reduce-scatter " << reduce_scatter.calls << " (" << FormatBytes(reduce_scatter.bytes)
     << "), all-reduce " << all_reduce.calls << " (" << FormatBytes(all_reduce.bytes) << "); "
     << (reduce_lane || gather_lane
             ? "all-gathers and gradient reductions on separate communicators"
             : "all-gathers and gradient reductions on one communicator")
     << (!gather_lane  ? ""
         : reduce_lane ? " (neither the engine's)"
                       : " (the reductions on the engine's)")
     << "\n";
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

// Placement (placement.h): the device, the tiers, CPU-Adam, the state stores, the working
// shards and their copies to the device, in the order EngineBuilder makes them.
#include "strata/engine/runtime/placement.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/core/topology.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/stores.h"
#include "strata/swap/crc32c.h"

namespace strata::engine {

namespace {

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

}  // namespace

Placement::Placement(const ModelPartition& partition, const ModelPartition& trainable, DType dtype,
                     PhaseClock& clock)
    : partition_(partition), trainable_(trainable), dtype_(dtype), clock_(clock) {}

// The device, the NUMA node, the device tier, the host tier (the host pool) and which of them
// holds the working shards and the optimizer's states. nvme is refused before anything is
// allocated.
Status Placement::MakeTiers(const Config& config, const EngineOptions& options) {
  const OffloadConfig& opt_off = config.zero.offload_optimizer;
  const OffloadConfig& par_off = config.zero.offload_param;
  opt_nvme_ = opt_off.device == OffloadDevice::kNvme;
  par_nvme_ = par_off.device == OffloadDevice::kNvme;
  const bool opt_nvme = opt_nvme_, par_nvme = par_nvme_;
  device_ = options.device;
  if (device_ == nullptr) {
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
    device_ = std::move(dev);
  }
  STRATA_ASSIGN_OR_RETURN(
      numa_node_,
      ResolveNumaNode(config.strata.numa_node, options.cpu_adam.numa_node, *device_, numa_key_));
  device_allocator_ = options.device_allocator;
  if (device_allocator_ == nullptr) device_allocator_ = device_->allocator();
  device_tier_ = MakeDeviceTier(device_allocator_);
  if (opt_off.device == OffloadDevice::kNone && !device_tier_->host_addressable()) {
    return InvalidArgumentError(
        "zero_optimization.offload_optimizer.device = none on " + device_->name() +
        ": Strata's optimizer is CPU-Adam, which updates optimizer states in host memory; set "
        "offload_optimizer.device to cpu");
  }
  // The working shards on the device are written by copies from a pinned host mirror
  // (the optimizer writes the mirror), unless a test's allocator stands in for the device.
  mirror_ = par_off.device == OffloadDevice::kNone && options.device_allocator == nullptr;
  const bool mirror = mirror_;
  if (opt_off.device == OffloadDevice::kCpu || par_off.device == OffloadDevice::kCpu || mirror ||
      opt_nvme || par_nvme) {
    // NVMe states stage through the host tier's buffers, page-locked with pin_memory.
    const bool pin = mirror || (opt_off.device != OffloadDevice::kNone && opt_off.pin_memory) ||
                     (par_off.device != OffloadDevice::kNone && par_off.pin_memory);
    HostPoolOptions hopts = HostPoolOptions::FromConfig(config.strata, pin);
    hopts.numa_node = numa_node_;
    hopts.name = "host tier";
    STRATA_ASSIGN_OR_RETURN(HostPool pool, HostPool::Create(hopts));
    host_pool_ = std::make_shared<HostPool>(std::move(pool));
    host_tier_ = MakeHostTier(host_pool_);
  }
  // offload_optimizer = nvme: the states live in swap slots, staged through buffers on
  // the host tier.
  STRATA_ASSIGN_OR_RETURN(optimizer_tier_,
                          SelectOffloadTier(opt_nvme ? OffloadDevice::kCpu : opt_off.device,
                                            "zero_optimization.offload_optimizer.device",
                                            device_tier_.get(), host_tier_.get()));
  STRATA_ASSIGN_OR_RETURN(
      param_tier_, SelectOffloadTier(par_nvme ? OffloadDevice::kCpu : par_off.device,
                                     "zero_optimization.offload_param.device", device_tier_.get(),
                                     host_tier_.get()));
  shards_to_host_ = optimizer_tier_ != device_tier_.get() && options.device_allocator == nullptr;
  if (par_nvme && !opt_nvme) {
    return InvalidArgumentError(
        "zero_optimization.offload_param.device = nvme needs offload_optimizer.device = nvme: "
        "the step's new working shards are committed together with the optimizer states, and "
        "only states on NVMe can be rolled back when a write fails on some rank");
  }

  return Status::Ok();
}

Status Placement::ShareCores(const Config& config, const EngineOptions& options,
                             comm::Communicator& host) {
  STRATA_ASSIGN_OR_RETURN(const CpuThreads threads,
                          ResolveCpuAdamThreads(config.strata.cpu_adam_threads,
                                                options.cpu_adam.num_threads, numa_node_, host));
  adam_threads_ = threads.threads;
  ranks_sharing_ = threads.ranks_sharing;
  cores_ = threads.cores;
  return Status::Ok();
}

// CPU-Adam on the rank's share of the cores, on the NUMA node.
Status Placement::MakeCpuAdam(const EngineOptions& options) {
  CpuAdam::Options adam_options = options.cpu_adam;
  adam_options.numa_node = numa_node_;
  adam_options.num_threads = adam_threads_;
  Result<std::unique_ptr<CpuAdam>> adam = CpuAdam::Create(adam_options);
  if (!adam.ok()) {
    return adam.status().WithContext(
        numa_node_ >= 0 ? "CPU-Adam's threads on NUMA node " + std::to_string(numa_node_) + " (" +
                              numa_key_ + "; -1: the GPU's node, or none)"
                        : std::string("CPU-Adam"));
  }
  cpu_adam_ = *std::move(adam);
  return Status::Ok();
}

// The working shards: in their store (the parameter tier's memory, NVMe, or the device's
// pinned host mirror), and with offload_param = none on a device also in device memory. The
// device copies from the store when it stages shards or pushes the mirror.
Status Placement::MakeShardStores(const Config& config, const EngineOptions& options) {
  const OffloadConfig& par_off = config.zero.offload_param;
  const size_t elem = DTypeSize(dtype_);
  const size_t n = partition_.partition_numel;
  staging_ = par_off.device != OffloadDevice::kNone && options.device_allocator == nullptr;
  copies_ = (mirror_ || staging_) && n > 0;
  const bool mirror = mirror_, copies = copies_;
  STRATA_ASSIGN_OR_RETURN(
      param_store_,
      MakeParamStore(config, mirror ? host_tier_.get() : param_tier_, copies ? device_ : nullptr,
                     partition_, dtype_, Observed(options, /*params=*/true)));
  // offload_param = nvme: the leading groups' shards within max_in_cpu stay in host memory.
  const uint64_t max_in_cpu =
      par_nvme_ ? static_cast<uint64_t>(std::max<int64_t>(0, par_off.max_in_cpu)) : 0;
  if (max_in_cpu > 0) {
    STRATA_ASSIGN_OR_RETURN(param_host_store_,
                            MakeHostShardStore(host_tier_.get(), copies ? device_ : nullptr));
  }
  STRATA_ASSIGN_OR_RETURN(shards_, WorkingShards::Create(&partition_, dtype_, param_store_.get(),
                                                         param_host_store_.get(), max_in_cpu));
  if (max_in_cpu > 0) {
    STRATA_LOG(kInfo) << "engine: offload_param.max_in_cpu = " << max_in_cpu << " keeps "
                      << FormatBytes(shards_->host_bytes()) << " of the rank's "
                      << FormatBytes(n * elem) << " of working shards in host memory"
                      << (shards_->host_bytes() == n * elem ? " (none on NVMe)" : "");
  }
  if (mirror && n > 0) {
    STRATA_ASSIGN_OR_RETURN(device_working_, device_tier_->Allocate(n * elem, "working shards"));
  }
  if (copies) {
    STRATA_ASSIGN_OR_RETURN(copy_stream_, device_->CreateStream("shard copies"));
    has_copy_stream_ = true;
  }
  test_skip_working_copy_wait_ = options.test.skip_working_copy_wait;
  test_skip_end_of_backward_wait_ = options.test.skip_end_of_backward_wait;
  return Status::Ok();
}

EngineOptions Placement::Observed(const EngineOptions& options, bool params) {
  EngineOptions o = options;
  o.test.nvme_observer = [this, params,
                          test = options.test.nvme_observer](const offload::StateEvent& ev) {
    if (test) test(ev);
    clock_.NoteNvmeEvent(params, params ? param_store_.get() : store_.get(), ev);
  };
  return o;
}

// Where the micro-steps' gradients are summed and where CPU-Adam reads them (docs/engine.md,
// "Gradient accumulation on the device" and "CPU-Adam on the device's sums"): the sums in
// device memory, read by the optimizer from there (no host accumulators), unless the step's
// variant reads accumulators during the backward; then copied to host accumulators at the
// boundary.
Status Placement::MakeDeviceSums(const Config& config, const EngineOptions& options,
                                 uint64_t device_budget, uint64_t device_need,
                                 ReducerOptions& reducer) {
  if (!shards_to_host_) {
    accumulation_ = optimizer_tier_ == device_tier_.get()
                        ? "device (the optimizer's own accumulators, on the device tier)"
                        : "host (the reduced shards added where the reduction left them)";
    grad_accumulators_ = optimizer_tier_ == device_tier_.get() ? "device (the optimizer's tier)"
                                                               : "host (the optimizer's tier)";
    return Status::Ok();
  }
  ChooseAccumulation(config, device_budget, device_need, reducer);
  if (!reducer.accumulate_on_device) {
    grad_accumulators_ = "host (the gradients are summed on the host)";
    return Status::Ok();
  }
  if (config.strata.early_step) {
    grad_accumulators_ =
        "host (strata.early_step: its update reads the accumulators during the backward)";
    return Status::Ok();
  }
  if (config.strata.delayed_update) {
    grad_accumulators_ =
        "host (strata.delayed_update: its update reads them while the next micro-steps add)";
    return Status::Ok();
  }
  if (trainable_.partition_numel == 0) {
    grad_accumulators_ = "none (nothing trainable on this rank)";
    return Status::Ok();
  }
  if (options.test.host_accumulators) {
    grad_accumulators_ = "host (EngineTestHooks::host_accumulators)";
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(grad_stream_, device_->CreateStream("gradient shards"));
  DeviceSumsOptions so;
  so.device = device_.get();
  so.stream = grad_stream_;
  so.device_tier = device_tier_.get();
  so.host_buffers = StoreAllocator(optimizer_tier_, device_);
  so.tile_elems = CpuAdam::kTileElems;
  so.skip_fetch_wait = options.test.skip_sums_fetch_wait;
  STRATA_ASSIGN_OR_RETURN(sums_store_, DeviceSumsStore::Create(trainable_.partition_numel, so));
  grad_accumulators_ = "device (CPU-Adam copies each sub-group's sums to the host at the step)";
  return Status::Ok();
}

// Where the micro-steps' gradients are summed (strata.accumulate_on_device, docs/engine.md
// "Gradient accumulation on the device"): in device memory when there are micro-steps to
// sum and the device budget holds the accumulators beside the rest, else on the host. A
// local choice (the budget of a GPU is half its free memory): no collective depends on it,
// and the results are the same bits either way.
void Placement::ChooseAccumulation(const Config& config, uint64_t device_budget,
                                   uint64_t device_need, ReducerOptions& reducer) {
  accumulation_ = "host";
  if (config.gradient_accumulation_steps <= 1) {
    accumulation_ = "host (one micro-step per optimizer step: nothing to sum)";
    return;
  }
  if (!config.strata.accumulate_on_device) {
    accumulation_ = "host (strata.accumulate_on_device false)";
    return;
  }
  if (trainable_.partition_numel == 0) return;
  const uint64_t acc = GradientReducer::DeviceAccumulatorBytes(trainable_);
  if (device_budget > 0 && device_need + acc > device_budget) {
    accumulation_ = "host (the device budget of " + FormatBytes(device_budget) + " holds the " +
                    FormatBytes(device_need) + " the model needs there but not the " +
                    FormatBytes(acc) + " of device gradient accumulators beside them)";
    STRATA_LOG(kInfo) << "gradient accumulation: on the " << accumulation_
                      << "; raise strata.device_budget to accumulate on the device";
    return;
  }
  reducer.accumulate_on_device = true;
  reducer.piece_align_elems = CpuAdam::kTileElems;
  accumulation_ = "device";
}

Status Placement::MakeStateStore(const Config& config, const EngineOptions& options) {
  STRATA_ASSIGN_OR_RETURN(
      store_, engine::MakeStateStore(config, optimizer_tier_, trainable_.partition_numel,
                                     Observed(options, /*params=*/false)));
  return Status::Ok();
}

Result<StreamId> Placement::GradientStream() {
  if (sums_store_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(grad_stream_, device_->CreateStream("gradient shards"));
  }
  return grad_stream_;
}

Status Placement::PushWorkingShards(bool frozen_too) {
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
  TimedScope waited(working_push_wait_s_, &clock_.timeline(), "working-shard push wait",
                    TimelineLane::kWait);
  STRATA_RETURN_IF_ERROR(device_->Synchronize(copied, HostWait::kWorkingShardPush)
                             .WithContext("copying the updated working shards"));
  for (offload::StateLease& l : held)
    STRATA_RETURN_IF_ERROR(l.Release());
  return Status::Ok();
}

Status Placement::PushShard(int group) {
  if (device_working_.empty() || !shards_->has(group)) return Status::Ok();
  // The device's working shards (offload_param = none): this group's, from the mirror.
  STRATA_ASSIGN_OR_RETURN(offload::StateLease l, StartShardPush(group));
  STRATA_ASSIGN_OR_RETURN(EventId copied, device_->Record(copy_stream_));
  if (test_skip_working_copy_wait_) return Status::Ok();
  TimedScope waited(working_push_wait_s_, &clock_.timeline(), "working-shard push wait",
                    TimelineLane::kWait, group);
  STRATA_RETURN_IF_ERROR(device_->Synchronize(copied, HostWait::kWorkingShardPush)
                             .WithContext("copying the updated working shard of " +
                                          partition_.groups[static_cast<size_t>(group)].name));
  return l.Release();
}

void Placement::CountGroupwisePush() {
  if (!device_working_.empty()) ++working_pushes_;
}

Result<offload::StateLease> Placement::StartShardPush(int group) {
  STRATA_ASSIGN_OR_RETURN(offload::StateLease l, shards_->Acquire(group, offload::Access::kRead));
  STRATA_RETURN_IF_ERROR(
      device_->CopyAsync(device_working_.data() + shards_->offset(group) * DTypeSize(dtype_),
                         l.data(), l.size(), CopyKind::kHostToDevice, copy_stream_));
  return l;
}

Status Placement::WriteFrozen(int group, size_t within, std::span<const float> values) {
  if (values.empty()) return Status::Ok();
  const GroupLayout& layout = partition_.groups[static_cast<size_t>(group)];
  const size_t elem = DTypeSize(dtype_);
  const bool whole = within == 0 && values.size() == layout.shard_numel;
  STRATA_ASSIGN_OR_RETURN(
      offload::StateLease l,
      shards_->Acquire(group, whole ? offload::Access::kWrite : offload::Access::kReadWrite));
  if ((within + values.size()) * elem > l.size()) {
    return InternalError("frozen group " + layout.name + ": elements [" + std::to_string(within) +
                         ", " + std::to_string(within + values.size()) +
                         ") outside its working shard of " + std::to_string(l.size()) + " bytes");
  }
  ConvertFromFloat(values.data(), values.size(), l.data() + within * elem, dtype_);
  return l.Release();
}

Status Placement::WaitForBackward() {
  STRATA_ASSIGN_OR_RETURN(EventId backward_done, device_->Record(kComputeStream));
  if (!test_skip_end_of_backward_wait_) {
    double waited_s = 0;
    TimedScope waited(waited_s, &clock_.timeline(), "end-of-backward wait", TimelineLane::kWait);
    STRATA_RETURN_IF_ERROR(device_->Synchronize(backward_done, HostWait::kEndOfBackward));
  }
  return Status::Ok();
}

Status Placement::WaitForCopies() {
  if (!has_copy_stream_) return Status::Ok();
  Result<EventId> done = device_->Record(copy_stream_);
  return done.ok() ? device_->Synchronize(*done, HostWait::kShutdown) : done.status();
}

void Placement::AddStats(EngineStats& s) const {
  s.device = {device_tier_->name(), TierKind::kDevice, device_tier_->usage()};
  if (host_tier_) s.host = TierStats{host_tier_->name(), TierKind::kHost, host_tier_->usage()};
  s.param_tier = param_store_->can_fail() ? TierKind::kNvme : param_tier_->kind();
  s.optimizer_tier = store_->can_fail() ? TierKind::kNvme : optimizer_tier_->kind();
  s.working_shard_bytes = partition_.partition_numel * DTypeSize(dtype_);
  s.numa_node = cpu_adam_->numa_node();
  s.cpu_adam_threads = cpu_adam_->num_threads();
  s.cpu_adam_ranks_sharing = ranks_sharing_;
  s.cpu_adam_cores = cores_;
  s.working_shard_host_bytes = shards_->host_bytes();
  s.param_store_name = param_store_->name();
  s.param_store = param_store_->stats();
  s.working_shard_pushes = working_pushes_;
  s.working_push_wait_s = working_push_wait_s_;
}

void Placement::AddAccumulationStats(EngineStats& s) const {
  s.gradient_accumulation = accumulation_;
  s.grad_accumulators = grad_accumulators_;
  if (sums_store_ != nullptr) s.device_sums = sums_store_->sums_stats();
}

}  // namespace strata::engine

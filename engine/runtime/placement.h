// Placement: where the engine's shards and states live, and the copies between them. It owns
// the compute device, the device tier and the host tier (with its pinned pool), CPU-Adam
// (its threads on the rank's share of the cores, on the NUMA node), the optimizer's state
// store, the device's gradient sums, the working shards (their store, host or NVMe, and a
// host store for offload_param.max_in_cpu), the device's copy of the working shards
// (offload_param = none on a device: copied there from a pinned host mirror the optimizer
// writes) and the copy stream between them; and it decides where the micro-steps' gradients
// are summed (docs/engine.md, "Gradient accumulation on the device").
//
// Construction: EngineBuilder (engine_builder.h) calls the Make* phases below in the order
// they are declared, with collectives and agreements between them; each allocates what it
// makes on the tiers made before it (the order of allocations is the device budget's).
// Ownership and lifetime: owns everything above. Reads the partitions and records into the
// clock's timeline, which must outlive it; declared in EngineCore before every component
// that holds its shards, stores or tiers (they go first). A TierBuffer made from its tiers
// must not outlive it.
// Thread-safety: the engine's thread; the NVMe stores report their I/O to the clock from
// theirs (PhaseClock::NoteNvmeEvent).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/reduce/reducer.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/step/device_sums.h"
#include "strata/offload/cpu/state_store.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

class PhaseClock;

class Placement {
 public:
  Placement(const ModelPartition& partition, const ModelPartition& trainable, DType dtype,
            PhaseClock& clock);
  Placement(const Placement&) = delete;
  Placement& operator=(const Placement&) = delete;

  // --- Construction, in this order ---

  // The device (options.device, else a CPU device with the config's budget), the NUMA node,
  // the device tier, the host tier when anything lives in host memory, and which tiers hold
  // the working shards and the optimizer's states. Refuses nvme combinations and an
  // optimizer on a device the host cannot address before anything is allocated.
  Status MakeTiers(const Config& config, const EngineOptions& options);
  // CPU-Adam's threads: the caller's EngineOptions::cpu_adam.num_threads or
  // strata.cpu_adam_threads, else the cores this rank may use divided among the ranks of
  // `host` with the same cores (at least 1). Collective: every rank takes part in the
  // all-gather of the cores, whatever its own settings.
  Status ShareCores(const Config& config, const EngineOptions& options, comm::Communicator& host);
  // CPU-Adam on those threads, on the NUMA node.
  Status MakeCpuAdam(const EngineOptions& options);
  // The working shards: their store (the parameter tier's memory, NVMe, or the device's
  // pinned host mirror), and with offload_param = none on a device also in device memory;
  // the copy stream when the device copies from the store (staging or pushes).
  Status MakeShardStores(const Config& config, const EngineOptions& options);
  // Where the micro-steps' gradients are summed (into `reducer`: accumulate_on_device) and
  // where CPU-Adam reads them: the device's sums when it can (made here, with their
  // stream), else host accumulators. `device_budget` and `device_need`: the budget (0:
  // unbounded) and what the model needs of it without device accumulators.
  Status MakeDeviceSums(const Config& config, const EngineOptions& options, uint64_t device_budget,
                        uint64_t device_need, ReducerOptions& reducer);
  // The optimizer's state store: resident on the optimizer tier, or on NVMe.
  Status MakeStateStore(const Config& config, const EngineOptions& options);
  // The stream the reduced gradient shards go to the host on (made now unless the device's
  // sums made it).
  Result<StreamId> GradientStream();

  // --- What construction decided ---

  bool opt_nvme() const { return opt_nvme_; }  // offload_optimizer.device = nvme
  bool par_nvme() const { return par_nvme_; }  // offload_param.device = nvme
  // The working shards on the device are copies of a pinned host mirror the optimizer
  // writes (offload_param = none on a real device).
  bool mirror() const { return mirror_; }
  // The working shards live in host memory or on NVMe and are staged into the device.
  bool staging() const { return staging_; }
  // The device copies from the shards' store (a mirror or staging, with elements to copy):
  // the copy stream exists.
  bool copies() const { return copies_; }
  bool has_copy_stream() const { return has_copy_stream_; }  // made (WaitForCopies waits)
  // Whether the reduced gradients go to the host (the optimizer's tier is not the device's).
  bool shards_to_host() const { return shards_to_host_; }
  int numa_node() const { return numa_node_; }

  // --- The parts ---

  Device& device() const { return *device_; }
  const std::shared_ptr<Device>& shared_device() const { return device_; }
  DeviceAllocator& device_allocator() const { return *device_allocator_; }
  Tier* device_tier() const { return device_tier_.get(); }
  Tier* host_tier() const { return host_tier_.get(); }  // null: nothing in host memory
  Tier* param_tier() const { return param_tier_; }
  Tier* optimizer_tier() const { return optimizer_tier_; }
  CpuAdam& cpu_adam() const { return *cpu_adam_; }
  offload::StateStore& store() const { return *store_; }       // the optimizer's states
  DeviceSumsStore* sums() const { return sums_store_.get(); }  // null: host accumulators
  offload::StateStore& param_store() const { return *param_store_; }
  WorkingShards& shards() const { return *shards_; }
  StreamId copy_stream() const { return copy_stream_; }
  // The device's copy of the working shards (mirror(): the coordinator reads it there).
  const std::byte* device_working() const { return device_working_.data(); }

  // --- The working shards' copies to the device ---

  // Copies the working shards' host mirror to the device and waits (no mirror: nothing);
  // `frozen_too` false: the trainable groups' only (after a step, which leaves the frozen
  // ones as they are).
  Status PushWorkingShards(bool frozen_too = true);
  // Group g's shard copied from the mirror to the device, waited for (no mirror, or no
  // shard of g on this rank: nothing): a pipelined step's group as the forward opens it.
  Status PushShard(int group);
  // A step's update that pushes each group as the forward opens it (PushShard): counted
  // once, as PushWorkingShards counts itself (EngineStats::working_shard_pushes).
  void CountGroupwisePush();
  // Writes `values` (rounded to the working dtype) into frozen group g's working shard at
  // element `within` of the shard; the rest of the shard is kept.
  Status WriteFrozen(int group, size_t within, std::span<const float> values);
  // The host's wait for the compute stream at the end of a backward (its last kernels may
  // still be queued after the last gradient hook): one event, no device-wide sync.
  Status WaitForBackward();
  // Waits for the copies still in flight on the copy stream, if it was made (the engine's
  // destruction: nothing may read the working shards' store when it goes).
  Status WaitForCopies();

  // EngineStats: the tiers, the working shards and their store, CPU-Adam, the pushes; and
  // AddAccumulationStats: where the gradients are summed, and the device's sums.
  void AddStats(EngineStats& s) const;
  void AddAccumulationStats(EngineStats& s) const;

 private:
  // Issues the copy of group g's shard from the host mirror to the device's working shards
  // on the copy stream; the returned lease holds the source until the copy is waited for.
  Result<offload::StateLease> StartShardPush(int group);
  // The options for an NVMe store (`params`: the working shards', else the optimizer's):
  // each read and write reported to the clock's timeline, besides a test's observer.
  EngineOptions Observed(const EngineOptions& options, bool params);
  // strata.accumulate_on_device: in device memory when there are micro-steps to sum and the
  // device budget holds the accumulators beside the rest, else on the host.
  void ChooseAccumulation(const Config& config, uint64_t device_budget, uint64_t device_need,
                          ReducerOptions& reducer);

  const ModelPartition& partition_;
  const ModelPartition& trainable_;
  const DType dtype_;
  PhaseClock& clock_;
  bool opt_nvme_ = false;
  bool par_nvme_ = false;
  bool mirror_ = false;
  bool staging_ = false;
  bool copies_ = false;
  bool has_copy_stream_ = false;
  bool shards_to_host_ = false;
  int numa_node_ = -1;
  std::string numa_key_;  // the setting that chose numa_node_, for later errors
  int adam_threads_ = 0;
  int ranks_sharing_ = 1;  // EngineStats::cpu_adam_ranks_sharing
  int cores_ = 0;          // EngineStats::cpu_adam_cores
  bool test_skip_working_copy_wait_ = false;
  bool test_skip_end_of_backward_wait_ = false;
  uint64_t working_pushes_ = 0;
  double working_push_wait_s_ = 0;
  std::string accumulation_ = "host";  // EngineStats::gradient_accumulation
  std::string grad_accumulators_;      // EngineStats::grad_accumulators

  // Declaration order = reverse destruction order: the buffers and stores go before the
  // tiers that own their memory, the device last.
  std::shared_ptr<Device> device_;
  StreamId copy_stream_;  // shard staging and pushes to the device's working shards
  std::shared_ptr<DeviceAllocator> device_allocator_;
  std::unique_ptr<Tier> device_tier_;
  std::shared_ptr<HostPool> host_pool_;
  std::unique_ptr<Tier> host_tier_;
  Tier* param_tier_ = nullptr;
  Tier* optimizer_tier_ = nullptr;
  std::unique_ptr<CpuAdam> cpu_adam_;
  // The optimizer's states (its memory is on optimizer_tier_, or its buffers with NVMe).
  std::unique_ptr<offload::StateStore> store_;
  // The gradient accumulators in device memory, when CPU-Adam reads them there.
  std::unique_ptr<DeviceSumsStore> sums_store_;
  StreamId grad_stream_;  // the reduced gradients' copies (and the device sums')
  // The working shards as the optimizer writes them and the coordinator reads them: on the
  // parameter tier (host), or on NVMe; with offload_param = none on a device, a pinned host
  // mirror of device_working_, copied there after each step (PushWorkingShards).
  std::unique_ptr<offload::StateStore> param_store_;
  // offload_param = nvme with max_in_cpu: the leading groups' shards, in host memory.
  std::unique_ptr<offload::StateStore> param_host_store_;
  std::unique_ptr<WorkingShards> shards_;
  TierBuffer device_working_;
};

}  // namespace strata::engine

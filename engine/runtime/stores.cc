// The state stores the engine makes (stores.h).
#include "strata/engine/runtime/stores.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "strata/core/logging.h"
#include "strata/offload/cpu/host_state_store.h"
#include "strata/offload/nvme/nvme_state_store.h"
#include "strata/swap/swap_space.h"

namespace strata::engine {
namespace {

// STRATA_TEST_RELOCATING_STORE=1: every store in its relocating test mode (host and NVMe).
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
  sopts.engine_factory = options.test.nvme_io_engine_factory;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::SwapSpace> space,
                          swap::SwapSpace::Create(std::move(sopts))
                              .WithContext("the swap space of " + std::string(key) + ".nvme_path"));
  offload::NvmeStateStoreOptions nopts;
  nopts.swap = std::move(space);
  nopts.buffer_count = buffer_count;
  nopts.max_chunk_bytes = max_chunk_bytes;
  nopts.allocator = std::move(alloc);
  nopts.write_behind = write_behind;
  nopts.observer = options.test.nvme_observer;
  STRATA_ASSIGN_OR_RETURN(nopts.relocate, RelocatingFromEnv());
  return offload::MakeNvmeStateStore(std::move(nopts));
}

}  // namespace

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

Result<std::unique_ptr<offload::StateStore>> MakeHostShardStore(Tier* tier,
                                                                std::shared_ptr<Device> device) {
  offload::HostStateStoreOptions hopts;
  STRATA_ASSIGN_OR_RETURN(hopts.relocate, RelocatingFromEnv());
  if (device != nullptr) hopts.relocate_allocator = StoreAllocator(nullptr, device);
  return offload::MakeHostStateStore(StoreAllocator(tier, std::move(device)), hopts);
}

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

}  // namespace strata::engine

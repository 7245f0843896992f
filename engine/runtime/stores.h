// The state stores the engine makes (offload/cpu/state_store.h): their memory from a tier,
// registered with the device where it copies from them; the optimizer's states resident on
// their tier or on NVMe; the working shards' store. STRATA_TEST_RELOCATING_STORE=1 puts the
// stores, resident and NVMe, in their relocating test modes (docs/engine.md, "The state store").
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/offload/cpu/state_store.h"

namespace strata::engine {

// Memory for a state store from `tier`. With `device`, every block is registered with it
// (the device copies from and to it: staged working shards, their host mirror) and
// unregistered when freed; `tier` null: the heap (a relocating store's moved chunks).
offload::StateAllocator StoreAllocator(Tier* tier, std::shared_ptr<Device> device);

// The optimizer's state store: resident on the optimizer tier, or on NVMe (offload_optimizer
// = nvme) with its buffers on the optimizer tier (the host tier).
Result<std::unique_ptr<offload::StateStore>> MakeStateStore(const Config& config, Tier* tier,
                                                            size_t partition_numel,
                                                            const EngineOptions& options);

// A resident store for working shards in `tier`'s memory; `device`: the device that copies
// from it (its blocks are registered, moved ones too in the relocating test mode), or null.
Result<std::unique_ptr<offload::StateStore>> MakeHostShardStore(Tier* tier,
                                                                std::shared_ptr<Device> device);

// The working shards' store (gather/working_shards.h): on NVMe with offload_param = nvme
// (buffers on the host tier), else resident in `tier`'s memory. `device` as above.
Result<std::unique_ptr<offload::StateStore>> MakeParamStore(const Config& config, Tier* tier,
                                                            std::shared_ptr<Device> device,
                                                            const ModelPartition& partition,
                                                            DType dtype,
                                                            const EngineOptions& options);

}  // namespace strata::engine

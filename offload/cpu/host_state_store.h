// The host-resident state store: every state in memory from one allocator (the host pool for
// offload_optimizer.device = cpu, the device arena for none on the CPU device), with a
// relocating test mode (state_store.h describes the interface and the mode).
//
// Thread-safety: as every StateStore (one thread).
#pragma once

#include <memory>

#include "strata/offload/cpu/state_store.h"

namespace strata::offload {

struct HostStateStoreOptions {
  // Test mode: every release moves the chunk to a new heap address and fills the old bytes
  // with NaN (float32 quiet NaN in every 4 bytes). Moved chunks live in the heap, outside
  // the allocator's accounting.
  bool relocate = false;
  // Where moved chunks live instead (e.g. heap memory the device can copy from); empty:
  // the heap.
  StateAllocator relocate_allocator;
};

// Every state resident in one allocation from `allocator`.
std::unique_ptr<StateStore> MakeHostStateStore(StateAllocator allocator,
                                               HostStateStoreOptions options = {});

}  // namespace strata::offload

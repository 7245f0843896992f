// The device arena (device.h): the budget reserved once, allocations carved out of it.
// Shared by every Device implementation; what differs between devices (how memory is
// reserved, released and zeroed, and where collectives see it) is an ArenaBackend.
//
// Best fit over a map of free blocks, 64-byte alignment (as the device-budget check at
// EngineCore::Create counts), neighbours coalesced on free. Placement depends only on
// the sequence of Allocate/Free calls: a block given to FreeAfter(block, event) is free
// for placement at once, never "when the event happens to be done", so every rank lays out
// its arena identically; an allocation that reuses some of its bytes waits for the event
// first — the host, through the device's Synchronize (HostWait::kArenaReuse), or, for a
// block whose first user is work on a stream (AllocateOn), that stream on the device
// (Device::Wait: the stream order of PyTorch's caching allocator, without its per-stream
// pools) — and one that does not waits for nothing. Fits() counts bytes, the same on every rank.
// Without an arena (budget 0) a block given to FreeAfter goes back to the backend at the next
// allocation, after its event.
//
// Without a budget (0) and with a backend that allows it, there is no arena: each
// allocation is its own block from the backend, unbounded.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "strata/core/status.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"

namespace strata::engine {

class ArenaBackend {
 public:
  virtual ~ArenaBackend() = default;
  // The whole arena (with a budget) or one block (without). ResourceExhausted when the
  // memory is not there.
  virtual Result<void*> Reserve(size_t bytes) = 0;
  virtual void Release(void* ptr, size_t bytes) = 0;
  virtual Status Zero(void* ptr, size_t bytes) = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0"
  virtual bool host_addressable() const = 0;
  virtual comm::Device comm_device() const = 0;
};

class Arena final : public DeviceAllocator {
 public:
  using SyncFn = std::function<Status(EventId)>;
  using StreamWaitFn = std::function<Status(StreamId, EventId)>;
  static constexpr size_t kAlign = 64;

  // Reserves `budget` bytes (0: no arena; allocations go to the backend one by one).
  static Result<std::shared_ptr<Arena>> Create(uint64_t budget,
                                               std::unique_ptr<ArenaBackend> backend);
  ~Arena() override;

  // How FreeAfter waits for an event (the owning device's Synchronize); null: not at all.
  void SetSync(SyncFn sync);
  // How AllocateOn makes a stream wait for an event (the owning device's Wait); null: the
  // host waits (SetSync's) instead.
  void SetStreamWait(StreamWaitFn wait);
  // Tests: hand a block given to FreeAfter out again without waiting for its event (the
  // delaying CPU device must then give wrong numbers).
  void SetSkipReuseWaitForTest(bool skip);

  std::string name() const override;
  Result<void*> Allocate(size_t bytes) override;
  Result<void*> AllocateOn(size_t bytes, StreamId stream) override;
  void Free(void* ptr, size_t bytes) override;
  void FreeAfter(void* ptr, size_t bytes, EventId after) override;
  Status Zero(void* ptr, size_t bytes) override { return backend_->Zero(ptr, bytes); }
  TierUsage usage() const override;
  bool Fits(size_t bytes) const override;
  bool host_addressable() const override { return backend_->host_addressable(); }
  comm::Device comm_device() const override { return backend_->comm_device(); }

  uint64_t reserved() const { return reserved_; }
  uint64_t LargestFree() const;
  // Returns every block given to FreeAfter, waiting for their events.
  Status Drain();

 private:
  Result<void*> AllocateImpl(size_t bytes, std::optional<StreamId> stream);
  struct Pending {
    void* ptr;
    size_t bytes;
    EventId after;
  };

  Arena(uint64_t budget, std::unique_ptr<ArenaBackend> backend)
      : budget_(budget), backend_(std::move(backend)) {}
  void Count(size_t n);
  uint64_t LargestFreeLocked() const;
  Status DrainLocked(std::unique_lock<std::mutex>& lock);
  void FreeLocked(void* ptr, size_t bytes);

  const uint64_t budget_;
  std::unique_ptr<ArenaBackend> backend_;
  std::byte* base_ = nullptr;
  size_t reserved_ = 0;
  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> size, guarded by mu_
  std::map<size_t, size_t> used_;  // guarded by mu_
  std::deque<Pending> pending_;    // guarded by mu_
  uint64_t in_use_ = 0;            // guarded by mu_
  uint64_t peak_ = 0;              // guarded by mu_
  uint64_t live_ = 0;              // guarded by mu_
  SyncFn sync_;                    // guarded by mu_
  StreamWaitFn stream_wait_;       // guarded by mu_
  bool skip_wait_ = false;         // guarded by mu_
};

}  // namespace strata::engine

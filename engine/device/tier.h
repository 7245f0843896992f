// Memory tiers of the engine: where shards, gathered parameters and optimizer states live.
//
//   device  the compute device's memory. An allocator interface with a byte budget
//           (strata.device_budget, 0 = unlimited): the device's arena (device.h,
//           arena.h; on a machine without a GPU, the CPU device's arena in host memory),
//           which refuses an allocation past the budget and tracks its own high-water
//           mark, so tests can assert what was resident "on device". HostArenaAllocator
//           below only counts bytes (no arena); tests inject it.
//   host    page-locked NUMA-local host memory from a HostPool (offload_*.device = cpu).
//   nvme    not a Tier: states on NVMe live in swap slots behind a state store
//           (offload/nvme/), whose buffers come from the host tier. SelectOffloadTier
//           refuses it; the engine asks for the host tier for those buffers instead.
//
// Every allocation is a TierBuffer: an owning, move-only handle that knows its tier and
// returns its bytes to the tier when destroyed.
//
// Ownership and lifetime: a TierBuffer must not outlive the Tier it came from. Tiers are
// owned by the engine and destroyed after every buffer.
// Thread-safety: Tier::Allocate, usage() and buffer destruction are thread-safe (the
// accounting is atomic / the host pool is thread-safe); a TierBuffer object is a value.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "strata/comm/communicator.h"
#include "strata/core/budget.h"
#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/offload/cpu/host_pool.h"

namespace strata::engine {

// An event of the device seam (device.h): a small copyable handle (0 = none). Events are
// never reused. Here because device memory is freed after one (TierBuffer::ResetAfter).
struct EventId {
  uint64_t value = 0;
  bool valid() const { return value != 0; }
};

// A stream of the device (device.h): a small copyable handle. 0 is the compute stream.
struct StreamId {
  int value = 0;
  friend bool operator==(StreamId a, StreamId b) { return a.value == b.value; }
};
inline constexpr StreamId kComputeStream{0};

// Who first uses a device allocation, and how (Tier::AllocateFor).
struct FirstUse {
  // Work queued on this stream, not the host: a block freed after earlier work (FreeAfter)
  // is then handed out after a device-side wait of this stream for that work, not after a
  // host wait (the arena's stream order). None: the host may touch it at once.
  std::optional<StreamId> stream;
  // Zero-filled first; false where the first user writes every byte (an all-gather).
  bool zero = true;
};

enum class TierKind : uint8_t { kDevice, kHost, kNvme };
std::string_view TierKindName(TierKind kind);  // "device", "host", "nvme"

// Byte counters of a tier (what its budget counts).
struct TierUsage {
  uint64_t bytes_in_use = 0;
  uint64_t peak_bytes = 0;    // high-water mark since creation
  uint64_t budget_bytes = 0;  // 0 = unlimited
  uint64_t allocations = 0;   // live allocations
};

// An owning handle on bytes of one tier. Empty when default-constructed or moved from.
class TierBuffer {
 public:
  // What frees the bytes; implemented by each tier.
  class Releaser {
   public:
    virtual ~Releaser() = default;
    // The bytes go back only once `after` completed (device memory that work queued on a
    // stream may still read); a tier whose memory no stream reads ignores it.
    virtual void SetReleaseAfter(EventId /*after*/) {}
  };

  TierBuffer() = default;
  TierBuffer(std::byte* data, size_t size, TierKind kind, std::unique_ptr<Releaser> releaser)
      : data_(data), size_(size), kind_(kind), releaser_(std::move(releaser)) {}
  TierBuffer(TierBuffer&& other) noexcept;
  TierBuffer& operator=(TierBuffer&& other) noexcept;
  TierBuffer(const TierBuffer&) = delete;
  TierBuffer& operator=(const TierBuffer&) = delete;
  ~TierBuffer() = default;  // the releaser frees the bytes

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return releaser_ == nullptr; }
  TierKind kind() const { return kind_; }
  void Reset();  // frees now
  // Gives the bytes up now; the tier reuses them once `after` completed (the device
  // tier: Arena::FreeAfter). For a buffer that work on a stream may still read.
  void ResetAfter(EventId after);
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(data_), size_ / sizeof(T)};
  }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  TierKind kind_ = TierKind::kDevice;
  std::unique_ptr<Releaser> releaser_;
};

class Tier {
 public:
  virtual ~Tier() = default;
  virtual TierKind kind() const = 0;
  // "device (host arena)", "host (pinned pool)", ...
  virtual std::string name() const = 0;
  // Zero-filled bytes (size 0: an empty buffer with no memory). ResourceExhausted past the
  // tier's budget, naming the request, the bytes in use and the budget. `purpose` names the
  // allocation in errors ("gathered group 3").
  virtual Result<TierBuffer> Allocate(size_t bytes, std::string_view purpose) = 0;
  // The same for a first user that is work on a stream, or that writes every byte
  // (FirstUse); a tier no stream reads ignores `use` (zero-fills all the same).
  virtual Result<TierBuffer> AllocateFor(size_t bytes, std::string_view purpose,
                                         const FirstUse& use) {
    (void)use;
    return Allocate(bytes, purpose);
  }
  virtual TierUsage usage() const = 0;
  // Whether an allocation of `bytes` fits the budget now (as the tier counts it, e.g.
  // rounded up). Decisions made from it are the same on every rank, unlike a failed
  // allocation, which may also mean the machine ran out of memory.
  virtual bool Fits(size_t bytes) const = 0;
  // Whether the CPU may read and write the tier's memory directly (host arena: yes; CUDA
  // device memory: no, copies go through the copy stream).
  virtual bool host_addressable() const = 0;
  // Where collectives see this tier's buffers.
  virtual comm::Device comm_device() const = 0;
};

// ---------------------------------------------------------------------------
// The device tier.

// Device memory: one implementation per kind of device. Allocations are 64-byte aligned.
// Thread-safety: implementations must be thread-safe.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual std::string name() const = 0;
  // ResourceExhausted past the budget (requested, in use and budget in the message).
  virtual Result<void*> Allocate(size_t bytes) = 0;
  // The same for a block whose first user is work queued on `stream`: a reused block's
  // earlier readers are waited for by that stream on the device (the device arena), not
  // by the host. Default: Allocate.
  virtual Result<void*> AllocateOn(size_t bytes, StreamId stream) {
    (void)stream;
    return Allocate(bytes);
  }
  // REQUIRES: `ptr` came from Allocate(bytes) or AllocateOn of this allocator.
  virtual void Free(void* ptr, size_t bytes) = 0;
  // Frees once `after` completed. An allocator of no device (HostArenaAllocator, host
  // memory that only the CPU device's compute stream, the calling thread, uses) frees at
  // once; the device arena waits for the event before reusing the block.
  virtual void FreeAfter(void* ptr, size_t bytes, EventId /*after*/) { Free(ptr, bytes); }
  // Fills with zeros (cudaMemset for CUDA).
  virtual Status Zero(void* ptr, size_t bytes) = 0;
  virtual TierUsage usage() const = 0;
  // Whether Allocate(bytes) fits the budget now.
  virtual bool Fits(size_t bytes) const = 0;
  virtual bool host_addressable() const = 0;
  virtual comm::Device comm_device() const = 0;
};

// A count-only device allocator for tests (EngineOptions::device_allocator): each
// allocation is its own aligned block, rounded up to 64 bytes and counted; the budget
// refuses what does not fit; peak_bytes is the high-water mark.
class HostArenaAllocator final : public DeviceAllocator {
 public:
  // budget_bytes 0 = unlimited.
  explicit HostArenaAllocator(uint64_t budget_bytes);
  ~HostArenaAllocator() override;
  std::string name() const override { return "host arena"; }
  Result<void*> Allocate(size_t bytes) override;
  void Free(void* ptr, size_t bytes) override;
  Status Zero(void* ptr, size_t bytes) override;
  TierUsage usage() const override;
  bool Fits(size_t bytes) const override;
  bool host_addressable() const override { return true; }
  comm::Device comm_device() const override { return comm::Device::Cpu(); }

 private:
  uint64_t budget_bytes_;
  ByteBudget budget_;
  std::atomic<uint64_t> live_{0};
};

// A Tier over a DeviceAllocator. REQUIRES: the allocator outlives the tier's buffers.
std::unique_ptr<Tier> MakeDeviceTier(std::shared_ptr<DeviceAllocator> allocator);

// A Tier over a HostPool (shared with its buffers).
std::unique_ptr<Tier> MakeHostTier(std::shared_ptr<HostPool> pool);

// The tier an offload section asks for: none -> `device`, cpu -> `host`, nvme ->
// Unimplemented "<key> = nvme: NVMe tier not implemented yet" (nvme is a state store over
// the host tier, not a tier: the engine never asks). `key` is the config path
// ("zero_optimization.offload_optimizer.device").
Result<Tier*> SelectOffloadTier(OffloadDevice device, std::string_view key, Tier* device_tier,
                                Tier* host_tier);

}  // namespace strata::engine

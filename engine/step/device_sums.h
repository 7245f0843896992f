// DeviceSumsStore: the gradient accumulator state kept in device memory, where the
// gradient reducer sums the micro-steps' reduced shards (strata.accumulate_on_device), and
// read by CPU-Adam from there (docs/engine.md, "CPU-Adam on the device's sums").
//
// One state (the optimizer driver's "fp32 gradient accumulators"): partition_numel floats
// of device memory, cut into the driver's sub-groups. A lease brings its chunk to the host:
//
//   Acquire(i, kRead)  copies chunk i device->host on the store's stream (the reducer's copy
//                      stream, so after every addition queued there) into a pinned host
//                      buffer and waits for that copy (HostWait::kGradientFetch); Prefetch(i)
//                      queues the copy ahead, so the Acquire only waits. Releasing a read
//                      lease gives the buffer back. A lease that may write copies the chunk
//                      back host->device at its release (tests, WriteState).
//   ZeroChunk(i)       zeroes the chunk in device memory (ZeroAsync on the stream): the
//                      step's spent sums, before the next micro-step adds into them. A
//                      chunk leased for reading may be zeroed: its lease keeps the copy.
//   NormTiles(i, sums) CPU-Adam's gradient-norm tiles of chunk i summed on the device
//                      (Device::SquaredNormTilesAsync, bit-identical to the host's sums)
//                      and copied back: the norm reads no chunk to the host.
//
// So the host holds no accumulators: only the buffers of the chunks leased or read ahead at
// once (the synchronous step: one sub-group and the next; the pipelined step's update
// leases every sub-group for its duration). Each chunk crosses to the host once per
// optimizer step. The pinned buffers are made as needed and kept (memory_bytes counts them).
//
// Epochs: nothing is written to swap, so Flush and Commit do nothing but forget chunks read
// ahead and not leased (their copies would be stale at the next step); Rollback zeroes every
// sum (the committed contents: a step commits after zeroing the sums it spent). can_fail()
// is false: device errors are returned, not kept for an agreement.
//
// Ownership and lifetime: borrows the device; owns the device sums and the host buffers.
// The reducer that adds into device_sums() must be gone (or idle) before the store is.
// Thread-safety: every call takes the store's lock, so the pipelined update's worker may
// lease sub-groups while the engine's thread reads the statistics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/offload/cpu/state_store.h"

namespace strata::engine {

struct DeviceSumsOptions {
  Device* device = nullptr;
  // The stream the reducer adds on (its copy stream): fetches and zeroing are queued
  // behind its additions.
  StreamId stream;
  Tier* device_tier = nullptr;           // the sums and the norm's tile sums
  offload::StateAllocator host_buffers;  // pinned host buffers, registered with the device
  // CPU-Adam's norm tile (CpuAdam::kTileElems).
  size_t tile_elems = 0;
  // Tests: leave out the host's wait for a fetch (the delaying CPU device must then give
  // wrong numbers).
  bool skip_fetch_wait = false;
};

struct DeviceSumsStats {
  uint64_t device_bytes = 0;  // the sums (and the norm's tile sums) in device memory
  uint64_t buffers = 0;       // pinned host buffers made (each a chunk's size)
  uint64_t buffer_bytes = 0;
  uint64_t fetches = 0;  // chunks copied device->host (one per lease that reads)
  uint64_t fetch_bytes = 0;
  uint64_t fetches_ahead = 0;  // of those, queued by Prefetch before their Acquire
  uint64_t write_backs = 0;    // leases that may write, copied back host->device
  uint64_t zeroed_chunks = 0;  // ZeroChunk on the device
  uint64_t norm_passes = 0;    // NormTiles calls (chunks summed on the device)
  double fetch_wait_s = 0;     // the host's waits for fetches and tile sums
};

class DeviceSumsStore final : public offload::StateStore {
 public:
  // `numel` floats of sums, zeroed on the stream.
  static Result<std::unique_ptr<DeviceSumsStore>> Create(size_t numel,
                                                         const DeviceSumsOptions& options);
  // Waits for the stream's copies in flight before the buffers and the sums go.
  ~DeviceSumsStore() override;

  // The sums in device memory (the reducer's accumulators); null when numel is 0.
  std::byte* device_sums() const { return sums_.data(); }
  // tile_sums[k] = chunk `range`'s tile k's squared norm (CpuAdam::GradSquaredNormTiles's
  // bits); tile_sums has ceil(chunk elements / tile_elems) entries. The chunk must not be
  // leased for writing.
  Status NormTiles(offload::StateRange range, std::span<double> tile_sums);
  DeviceSumsStats sums_stats() const;

  std::string name() const override { return "device gradient sums"; }
  // One state only, of numel * 4 bytes.
  Result<offload::StateId> Register(std::string name, size_t bytes, size_t chunk_bytes) override;
  Result<offload::StateLease> Acquire(offload::StateRange range, offload::Access access) override;
  Status Prefetch(offload::StateRange range) override;
  Status ZeroChunk(offload::StateRange range) override;
  Status Flush() override;
  Status Commit() override;
  Status Rollback() override;
  Status SetWriteHook(offload::StateId state, WriteHook hook) override;
  bool can_fail() const override { return false; }
  Status first_error() const override { return Status::Ok(); }
  offload::StateStoreStats stats() const override;

 protected:
  Status Release(offload::StateRange range, offload::Access access) override;

 private:
  explicit DeviceSumsStore(const DeviceSumsOptions& options) : options_(options) {}
  struct Buffer {
    offload::StateMemory mem;
    long chunk = -1;    // the chunk it holds or is fetching (-1: free)
    bool held = false;  // leased
    offload::Access access = offload::Access::kRead;  // the lease's
    EventId copied;  // the fetch's completion (valid while not waited for)
  };
  std::byte* device_chunk(size_t chunk) const;
  // A free buffer (made if none is).
  Result<Buffer*> FreeBuffer();
  // The buffer holding or fetching `chunk`, or null.
  Buffer* BufferOf(size_t chunk);
  Status Fetch(Buffer& b, offload::StateRange range);
  Status WaitFetch(Buffer& b);
  void ForgetReadAhead();

  mutable std::mutex mu_;  // every public call and Release
  DeviceSumsOptions options_;
  size_t numel_ = 0;
  TierBuffer sums_;
  TierBuffer tile_sums_;                          // device: the largest chunk's tiles
  offload::StateMemory host_tile_sums_;           // pinned: their copy
  std::vector<std::unique_ptr<Buffer>> buffers_;  // (stable addresses)
  offload::StateStoreStats base_;                 // the StateStore counters
  DeviceSumsStats stats_;
};

}  // namespace strata::engine

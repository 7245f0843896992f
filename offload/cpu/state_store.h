// The state store: where the engine's fp32 optimizer state lives (master parameters, Adam m
// and v, gradient accumulators), and the only way to reach it (docs/engine.md, "The state store").
//
// A component registers a state (a byte array cut into chunks), and then holds a chunk only
// while it uses it:
//
//   STRATA_ASSIGN_OR_RETURN(StateId m, store.Register("exp_avg", bytes, chunk_bytes));
//   STRATA_RETURN_IF_ERROR(store.Prefetch({m, i + 1}));      // a hint: start reading
//   {
//     STRATA_ASSIGN_OR_RETURN(StateLease l, store.Acquire({m, i}, Access::kReadWrite));
//     Update(l.as<float>());
//     STRATA_RETURN_IF_ERROR(l.Release());                   // or the destructor
//   }
//   STRATA_RETURN_IF_ERROR(store.Commit());                  // the step's end
//
// A lease's bytes are valid only until it is released: a store may move a chunk to another
// address (or another tier) between two leases. Nobody keeps a raw pointer to state.
//
// Implementations:
//   - HostStateStore (host_state_store.h): every state resident in memory from an allocator
//     (the host pool for offload_optimizer.device = cpu, the device arena for none on the
//     CPU device). Its test mode (relocate) moves each chunk to a new heap address at every
//     release and fills the old bytes with NaN, so a component that kept a pointer past its
//     lease reads NaN.
//   - NvmeStateStore (offload/nvme/nvme_state_store.h): chunks in swap slots (swap/SwapSpace,
//     CRC32C per block), brought into a fixed set of host buffers on demand.
//
// Epochs. Changes made since the last Commit() are the epoch's. Flush() writes them (NVMe:
// waits for every write); Commit() makes them the committed contents; Rollback() returns
// every chunk changed in the epoch to its committed contents (after a failed step on any
// rank: nothing is half-applied).
//
// Errors. A failed read or write is returned by the call that sees it and also kept: every
// later call returns it until Rollback(), so a caller that must keep going (into a collective)
// can ask first_error() at the next agreement point.
//
// Thread-safety: not thread-safe; one thread (the engine's) calls a store and its leases.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::offload {

// A registered state. 0 is never valid.
struct StateId {
  uint32_t value = 0;
  bool valid() const { return value != 0; }
};

// One chunk of a state.
struct StateRange {
  StateId state;
  size_t chunk = 0;
};

enum class Access : uint8_t {
  kRead,       // read only: the release leaves the chunk unchanged
  kReadWrite,  // read and modified
  kWrite,      // every byte is overwritten: the old contents are not read (nor zeroed)
};

class StateStore;

// A chunk held by its user. Move-only; destroying it releases it (an error is kept by the
// store, see above). Must not outlive the store.
class StateLease {
 public:
  StateLease() = default;
  StateLease(StateLease&& other) noexcept;
  StateLease& operator=(StateLease&& other) noexcept;
  StateLease(const StateLease&) = delete;
  StateLease& operator=(const StateLease&) = delete;
  ~StateLease();

  bool valid() const { return store_ != nullptr; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(data_), size_ / sizeof(T)};
  }
  StateRange range() const { return range_; }
  // Gives the chunk back; the pointer is invalid afterwards. A store may start writing it.
  Status Release();

 private:
  friend class StateStore;
  StateStore* store_ = nullptr;
  StateRange range_;
  Access access_ = Access::kRead;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Memory a store keeps states in: bytes and what frees them (shared_ptr's deleter).
struct StateMemory {
  std::byte* data = nullptr;
  size_t size = 0;
  std::shared_ptr<void> owner;
};
// Allocates zero-filled memory for states or buffers; `purpose` names it in errors.
using StateAllocator = std::function<Result<StateMemory>(size_t bytes, std::string_view purpose)>;

struct StateStoreStats {
  uint64_t states = 0;
  uint64_t chunks = 0;
  uint64_t state_bytes = 0;   // registered bytes, all states
  uint64_t memory_bytes = 0;  // bytes the store holds from its allocator (states or buffers)
  uint64_t acquires = 0;
  uint64_t relocations = 0;  // HostStateStore in relocate mode
  uint64_t reads = 0;        // chunks read from swap
  uint64_t read_bytes = 0;
  uint64_t writes = 0;  // chunks written to swap
  uint64_t write_bytes = 0;
  uint64_t zero_fills = 0;     // chunks brought in as zeros without a read
  uint64_t prefetches = 0;     // reads started by Prefetch
  uint64_t prefetch_hits = 0;  // acquires whose chunk a Prefetch had started reading
  // Whole-chunk writes (Access::kWrite) of a chunk a Prefetch read and nobody used: reads
  // for nothing (the write also waited for them).
  uint64_t reads_ahead_overwritten = 0;
  uint64_t exchanges = 0;  // NVMe: whole-chunk writes that took the caller's buffer (Exchange)
  // NVMe: writes whose block CRCs the caller computed (Exchange's block_crcs), not the write
  uint64_t writes_with_given_crcs = 0;
  uint64_t evictions = 0;  // buffers taken from a resident chunk
  // NVMe: reads ahead whose buffer an Acquire took when every other one was held (the
  // chunk is read again when wanted; more than a few: raise buffer_count)
  uint64_t reads_ahead_given_up = 0;
  // NVMe: read-only acquires of a chunk whose write was still in flight (not waited for)
  uint64_t reads_beside_write = 0;
  uint64_t commits = 0;
  uint64_t rollbacks = 0;
  uint64_t bounced_bytes = 0;  // NVMe: bytes the swap space copied through bounce buffers
  // NVMe: bytes the swap files hold on disk (preallocated, all directories). The files are
  // unlinked while open: df counts them, du does not.
  uint64_t swap_bytes = 0;
  // NVMe: buffers registered with the I/O engine (its own and exchanged ones), and the
  // transfers that used a registered buffer (the engine's fixed_buffer_ops)
  uint64_t registered_buffers = 0;
  uint64_t fixed_buffer_ios = 0;
  double read_wait_s = 0;   // time Acquire waited for reads
  double write_wait_s = 0;  // time spent waiting for writes (buffers, Commit)
};

// What a store did, in order, for tests that check the pipeline (NvmeStateStore only).
struct StateEvent {
  enum Kind : uint8_t { kReadSubmitted, kReadDone, kWriteSubmitted, kWriteDone };
  Kind kind;
  StateRange range;
};
using StateObserver = std::function<void(const StateEvent&)>;

class StateStore {
 public:
  virtual ~StateStore() = default;
  virtual std::string name() const = 0;

  // A state of `bytes` bytes, zero-filled, in chunks of `chunk_bytes` (the last may be
  // shorter). `name` names it in errors ("fp32 master parameters").
  virtual Result<StateId> Register(std::string name, size_t bytes, size_t chunk_bytes) = 0;
  // Holds a chunk (waits for its read; to modify it, for its write too). A chunk is held by
  // one lease at a time.
  virtual Result<StateLease> Acquire(StateRange range, Access access) = 0;
  // A whole-chunk write without a copy: `buffer` (the caller's memory, at least
  // buffer_bytes() bytes, 4096-byte aligned) holds the chunk's new contents in its first
  // chunk_bytes(range) bytes. The store takes that memory as the chunk's buffer (and treats
  // the chunk as a released Access::kWrite lease: written behind, or when evicted) and
  // gives back in `buffer` one of its own it no longer needs (buffer_bytes() bytes,
  // contents undefined). On an error `buffer` is left as it was. Each block is freed by its
  // owner (StateMemory::owner) wherever it is then, so both allocators must outlive the
  // store and the caller. Unimplemented for a store without buffers (the caller copies
  // through a lease).
  // `block_crcs`: empty, or the write's block checksums computed by the caller (as
  // write_checksums(range) says; e.g. on other threads while the bytes were in cache), so
  // the write computes none: kept with the chunk until its write is submitted, and checked
  // by every read like the store's own (a wrong one is that read's DataLoss). Any later
  // lease that may modify the chunk drops them. InvalidArgument when the store keeps no
  // checksums or the count is not write_checksums(range).blocks().
  virtual Status Exchange(StateRange range, StateMemory& buffer,
                          std::span<const uint32_t> block_crcs);
  Status Exchange(StateRange range, StateMemory& buffer) { return Exchange(range, buffer, {}); }
  // What a chunk's write checksums: `io_bytes` bytes from the buffer's start (the chunk's
  // bytes and the buffer's own past them, up to the write's size), a CRC32C per block of
  // `block_bytes` bytes (the last what is left). block_bytes 0: the store keeps no
  // checksums (Exchange takes none).
  struct WriteChecksums {
    size_t block_bytes = 0;
    size_t io_bytes = 0;
    size_t blocks() const {
      return block_bytes == 0 ? 0 : (io_bytes + block_bytes - 1) / block_bytes;
    }
  };
  virtual WriteChecksums write_checksums(StateRange /*range*/) const { return {}; }
  // The size of each of the store's buffers; 0: it has none (Exchange is unimplemented).
  virtual size_t buffer_bytes() const { return 0; }
  // Starts bringing a chunk in so a later Acquire need not wait. A hint: Ok when there is
  // no buffer free for it.
  virtual Status Prefetch(StateRange range) = 0;
  // Sets every chunk of a state (or one chunk) to zeros, without reading or writing it; an
  // NVMe store frees the chunk's buffer. No such chunk may be held.
  Status Zero(StateId state);  // ZeroChunk on every chunk
  virtual Status ZeroChunk(StateRange range) = 0;
  // See "Epochs" above. Flush() writes what the epoch changed and waits, without making it
  // the committed contents; Commit() flushes and then switches. Callers that must agree with
  // other ranks first Flush, agree, then Commit or Rollback.
  virtual Status Flush() = 0;
  virtual Status Commit() = 0;
  virtual Status Rollback() = 0;
  // Whether releasing a modified chunk submits its write at once (a store configured to
  // write behind, during a step that visits each chunk once) or leaves it in its buffer
  // until the buffer is needed (while gradients accumulate, a chunk is modified many
  // times). On by default; a store that never writes ignores it.
  virtual void SetWriteBehind(bool /*on*/) {}
  // Called with a chunk's contents just before they are written to swap (a store that
  // never writes never calls it), e.g. to keep a statistic of what leaves memory.
  using WriteHook = std::function<void(size_t chunk, std::span<const std::byte> contents)>;
  virtual Status SetWriteHook(StateId state, WriteHook hook) = 0;
  // Whether an operation can fail with an I/O error (callers then agree on outcomes).
  virtual bool can_fail() const = 0;
  // The first error since the last Rollback (Ok when none).
  virtual Status first_error() const = 0;
  virtual StateStoreStats stats() const = 0;

  size_t num_chunks(StateId state) const;
  size_t chunk_bytes(StateRange range) const;  // this chunk's size
  const std::string& state_name(StateId state) const;

 protected:
  friend class StateLease;
  struct StateInfo {
    std::string name;
    size_t bytes = 0;
    size_t chunk_bytes = 0;
    size_t chunks = 0;
  };
  // Checks and records a new state; returns its index + 1 as id.
  Result<StateId> AddState(std::string name, size_t bytes, size_t chunk_bytes);
  const StateInfo& info(StateId state) const { return states_[state.value - 1]; }
  Status CheckState(StateId state) const;  // InvalidArgument for an unknown id
  Status CheckRange(StateRange range) const;
  static StateLease MakeLease(StateStore* store, StateRange range, Access access, std::byte* data,
                              size_t size);
  // Called by StateLease::Release.
  virtual Status Release(StateRange range, Access access) = 0;

  std::vector<StateInfo> states_;
};

// The relocating test modes' poison: quiet NaN floats (0xff for a tail of under 4 bytes).
void FillNaN(std::span<std::byte> bytes);

}  // namespace strata::offload

// Internal to strata_swap (not installed): the parts the io_uring and sync engines share.
//
// EngineBase implements the bookkeeping of the IoEngine interface — the file table, the
// registered-buffer table, up-front validation of a batch, the completion queue that
// waiters take from, the counters — and leaves moving bytes to its subclasses:
//
//   Submit() validates the batch, resolves every request (file descriptor, O_DIRECT,
//   registered buffer) into a QueuedRequest and hands them to Enqueue(). An engine thread
//   later calls Deliver() with finished completions (in batches, one lock per batch).
//
// Thread-safety: every public method may be called from any thread at once; the hooks
// (Enqueue, OnFile*, OnBuffer*) are called without EngineBase's locks held unless noted.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/swap/io_engine.h"

namespace strata::swap::internal {

// A FIFO over a growable circular buffer: no allocation once it has grown to its
// working size (std::deque allocates a block every few elements).
template <typename T>
class RingQueue {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return buf_[head_]; }
  void push_back(T value) {
    if (size_ == buf_.size()) Grow();
    buf_[(head_ + size_) & (buf_.size() - 1)] = std::move(value);
    ++size_;
  }
  T pop_front() {
    T value = std::move(buf_[head_]);
    head_ = (head_ + 1) & (buf_.size() - 1);
    --size_;
    return value;
  }
  // Removes the elements for which pred(element) is true, in order, passing each to
  // removed(T&&). Keeps the order of the others.
  template <typename Pred, typename Removed>
  size_t RemoveIf(Pred pred, Removed removed) {
    size_t kept = 0;
    size_t n = size_;
    for (size_t i = 0; i < n; ++i) {
      T& e = buf_[(head_ + i) & (buf_.size() - 1)];
      if (pred(e)) {
        removed(std::move(e));
      } else {
        if (kept != i) buf_[(head_ + kept) & (buf_.size() - 1)] = std::move(e);
        ++kept;
      }
    }
    size_ = kept;
    return n - kept;
  }

 private:
  void Grow() {
    std::vector<T> next(buf_.empty() ? 64 : buf_.size() * 2);
    for (size_t i = 0; i < size_; ++i)
      next[i] = std::move(buf_[(head_ + i) & (buf_.size() - 1)]);
    buf_ = std::move(next);
    head_ = 0;
  }
  std::vector<T> buf_;  // size is 0 or a power of two
  size_t head_ = 0;
  size_t size_ = 0;
};

struct FileEntry {
  int fd = -1;
  std::string path;
  bool direct = false;  // opened with O_DIRECT
  bool in_use = false;
  std::atomic<uint64_t> in_flight{0};  // requests submitted and not yet delivered
};

// A request as queued inside an engine, resolved at Submit.
struct QueuedRequest {
  IoRequest req;
  FileEntry* file = nullptr;  // stable for the engine's life
  int fd = -1;
  int32_t fixed_buffer = -1;  // registered buffer index, -1 = none
  bool direct = false;
  std::chrono::steady_clock::time_point submitted;
};

// "read of /nvme0/swap at offset 4096, length 8192 (tag 7)"
std::string DescribeRequest(const IoRequest& req, const std::string& path);

// Largest single transfer handed to the kernel (Linux moves at most ~2 GiB per call).
inline constexpr size_t kMaxTransfer = size_t{1} << 30;
// Registered buffers are at most 1 GiB each (a kernel limit): a larger region is
// registered as several consecutive 1 GiB chunks.
inline constexpr size_t kFixedChunk = size_t{1} << 30;
inline constexpr int kMaxFixedBuffers = 1024;
inline constexpr int kMaxFixedFiles = 1024;
// -EAGAIN/-EINTR resubmissions of one request before it fails with Unavailable.
inline constexpr uint32_t kMaxRequeues = 1000;

// What to do with one raw transfer result (bytes, or -errno), shared by both engines
// so the rules are the same: requeue, resubmit the remainder, or complete.
struct TransferState {
  size_t done = 0;        // bytes of the request moved so far
  uint32_t attempts = 0;  // transfers issued so far (IoResultEvent::attempt of the next)
  uint32_t requeues = 0;
};
enum class TransferAction { kComplete, kRequeue, kContinue };
// Applies `result` of a transfer of `piece_length` bytes to `state`. On kComplete,
// *status holds the request's final status (ok when all bytes moved). Counts requeues
// and short-transfer resubmissions into the given counters.
TransferAction ApplyTransferResult(const QueuedRequest& q, size_t piece_length, int64_t result,
                                   bool cancel_requested, TransferState* state, Status* status,
                                   std::atomic<uint64_t>* requeued,
                                   std::atomic<uint64_t>* short_resubmits);

class EngineBase : public IoEngine {
 public:
  explicit EngineBase(IoEngineOptions options);
  ~EngineBase() override;

  std::string fallback() const override;
  void set_fallback(std::string why);
  const IoEngineOptions& options() const override { return options_; }

  Result<FileId> RegisterFile(int fd, std::string path) override;
  Status UnregisterFile(FileId file) override;
  Result<int> RegisterBuffer(std::span<std::byte> memory) override;
  Status UnregisterBuffer(int buffer_id) override;

  Status Submit(std::span<const IoRequest> batch) override;
  Result<IoCompletion> WaitOne(std::optional<std::chrono::milliseconds> timeout) override;
  size_t Poll(std::vector<IoCompletion>* out) override;
  Status WaitAll(std::vector<IoCompletion>* out,
                 std::optional<std::chrono::milliseconds> timeout) override;
  size_t in_flight() const override { return in_flight_.load(std::memory_order_acquire); }
  IoEngineStats stats() const override;

 protected:
  // Takes ownership of accepted requests (already counted as in flight).
  virtual void Enqueue(std::span<QueuedRequest> requests) = 0;
  // Registered-file and -buffer hooks for io_uring; the sync engine ignores them.
  virtual void OnFileRegistered(FileId /*id*/, int /*fd*/) {}
  virtual void OnFileUnregistered(FileId /*id*/) {}
  // Registers [first_index, first_index + chunks.size()) for fixed-buffer I/O; false
  // when the kernel refused (the buffer is then used without registration).
  virtual bool OnBufferRegistered(int /*first_index*/, std::span<const std::pair<void*, size_t>>) {
    return false;
  }
  virtual void OnBufferUnregistered(int /*first_index*/, int /*count*/) {}

  // Hands finished completions to waiters (one lock for the batch); clears `batch`.
  void Deliver(std::vector<IoCompletion>* batch);
  // The completion of `q` with `status` after `done` bytes; updates the counters.
  IoCompletion MakeCompletion(const QueuedRequest& q, size_t done, Status status,
                              std::chrono::steady_clock::time_point now);
  // Refuses new Submits (FailedPrecondition). Subclass destructors call it first.
  void StopAccepting() { stopped_.store(true, std::memory_order_release); }
  int64_t CallResultHook(const QueuedRequest& q, uint64_t offset, size_t length, void* buffer,
                         uint32_t attempt, int64_t result) const;

  IoEngineOptions options_;
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> requeued_{0};
  std::atomic<uint64_t> short_resubmits_{0};
  std::atomic<uint64_t> fixed_buffer_ops_{0};

 private:
  struct BufferRegion {
    uintptr_t base = 0;
    size_t length = 0;
    int id = 0;
    int first_index = -1;  // -1: not registered with the kernel
    int chunks = 0;
  };
  int32_t FindFixedBuffer(const void* buffer, size_t length) const;  // REQUIRES buffers_mu_

  std::atomic<bool> stopped_{false};
  mutable std::mutex fallback_mu_;
  std::string fallback_;

  // Serializes RegisterFile/UnregisterFile with their hooks, so a reused FileId's
  // registered-file slot is never cleared after it was set for the new file.
  std::mutex registration_mu_;
  mutable std::shared_mutex files_mu_;
  std::vector<std::unique_ptr<FileEntry>> files_;  // index = FileId

  mutable std::shared_mutex buffers_mu_;
  std::vector<BufferRegion> buffers_;  // sorted by base
  std::vector<bool> fixed_used_;       // kMaxFixedBuffers slots
  int next_buffer_id_ = 1;

  std::mutex done_mu_;
  std::condition_variable done_cv_;
  RingQueue<IoCompletion> done_;
  std::atomic<size_t> in_flight_{0};  // submitted, not yet taken by a waiter
};

}  // namespace strata::swap::internal

namespace strata::swap::internal {

// The engines behind CreateIoEngine. Options are already validated.
Result<std::unique_ptr<IoEngine>> CreateIoUringEngine(const IoEngineOptions& options);
std::unique_ptr<IoEngine> CreateSyncEngine(const IoEngineOptions& options);
Status ValidateIoEngineOptions(const IoEngineOptions& options);

}  // namespace strata::swap::internal

// Internal helpers shared by comm's backends (gloo in gloo_communicator.cc, NCCL in
// nccl_communicator.cc). Not installed; not part of the public API.
//
// - CompletionWork: a Work completed once from any thread (Complete), waited on from any.
// - OpQueue: one worker thread per communicator that runs operations in issue order and
//   turns the first error into a broken state (later operations: FailedPrecondition).
// - Host-side dtype kernels: 16-bit <-> fp32 conversion (round to nearest even) and the
//   element-wise reductions the gloo backend's rings use (16-bit types reduced in fp32).
// - Error formatting: "<backend> rank R of W: <op>: <what>" so every message names this
//   rank and the operation (and the peer where the caller knows it).
// - Argument checks shared by both backends.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/comm/store.h"
#include "strata/core/status.h"

namespace strata::comm::internal {

using Millis = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Work

// A Work that some thread completes exactly once. Wait(nullopt) blocks until completion:
// the operation itself is bounded (every backend fails it with DeadlineExceeded at the
// latest CommOptions::timeout after it starts running), so this never hangs. Wait(t)
// returns DeadlineExceeded naming `description` when t expires first; the operation then
// keeps running and its buffers must stay valid until IsCompleted().
//
// Thread-safety: all methods may be called from any thread.
class CompletionWork final : public Work {
 public:
  explicit CompletionWork(std::string description);
  ~CompletionWork() override;

  Status Wait(std::optional<Millis> timeout = std::nullopt) override;
  bool IsCompleted() const override;

  // REQUIRES: called once.
  void Complete(Status status);
  const std::string& description() const { return description_; }

 private:
  const std::string description_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // guarded by mu_
  Status status_;      // guarded by mu_; valid once done_
  std::atomic<bool> done_flag_{false};
};

// A Work that is already complete (argument errors, broken communicator, no-ops).
WorkPtr CompletedWork(Status status);

// ---------------------------------------------------------------------------
// SIGPIPE

// Blocks SIGPIPE in the calling thread while alive: a library that writes to a socket
// without MSG_NOSIGNAL (the gloo backend's own transport uses it) would otherwise raise
// SIGPIPE on a write to a peer that died, whose default action kills the process (Python
// ignores it, C++ programs usually do not). Threads created meanwhile inherit the mask. A SIGPIPE
// raised in this thread while blocked is discarded (unless one was pending before), then the mask
// is restored. The process-wide disposition is never changed.
class ScopedBlockSigpipe {
 public:
  ScopedBlockSigpipe();
  ~ScopedBlockSigpipe();
  ScopedBlockSigpipe(const ScopedBlockSigpipe&) = delete;
  ScopedBlockSigpipe& operator=(const ScopedBlockSigpipe&) = delete;

 private:
  unsigned char old_mask_[128];  // a sigset_t (kept opaque: no <signal.h> here)
  bool was_pending_ = false;
};

// ---------------------------------------------------------------------------
// Operation queue

// One worker thread that runs submitted operations one at a time, in submission order.
// The first operation that fails breaks the queue: every later one (queued or submitted
// afterwards) completes at once with FailedPrecondition carrying the first error, and
// `on_error` (if set) runs once on the worker thread right after the failure (backends
// close their connections there so that peers waiting on this rank fail fast too).
//
// The destructor runs what is still queued (every operation is bounded by its timeout),
// then joins the thread. The worker thread blocks SIGPIPE (see ScopedBlockSigpipe).
//
// Thread-safety: Submit may be called from any thread; the submission order is the order
// the calls take the internal lock.
class OpQueue {
 public:
  using Fn = std::function<Status()>;
  // thread_name: at most 15 characters (pthread limit), e.g. "strata-gloo".
  OpQueue(std::string thread_name, std::function<void(const Status&)> on_error);
  ~OpQueue();
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // `description` names the operation in errors ("gloo rank 1 of 2: all_gather #3 ...").
  WorkPtr Submit(std::string description, Fn fn);

  // OK while healthy; the first error otherwise.
  Status first_error() const;
  // A FailedPrecondition carrying the first error, for operations refused after it.
  Status BrokenError(std::string_view description) const;

 private:
  struct Item {
    std::shared_ptr<CompletionWork> work;
    Fn fn;
  };
  void Run();

  std::function<void(const Status&)> on_error_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;  // guarded by mu_
  bool stop_ = false;       // guarded by mu_
  Status first_error_;      // guarded by mu_
  std::string thread_name_;
  std::thread thread_;
};

// ---------------------------------------------------------------------------
// dtype kernels (host memory)

float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);  // round to nearest even; NaN stays NaN
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow to inf; NaN stays NaN

// dst[i] = float(src[i]) for src of `dtype` (fp32, bf16, fp16; int64 is converted too).
void ConvertToFloat(DType dtype, const void* src, float* dst, size_t n);
// dst[i] = dtype(src[i]), rounding to nearest even for 16-bit types.
void ConvertFromFloat(DType dtype, const float* src, void* dst, size_t n);

// dst = a + b, element-wise, n elements of `dtype`. dst may alias a or b. 16-bit types are
// added in fp32 and rounded back (round to nearest even).
void ReduceSum(DType dtype, const void* a, const void* b, void* dst, size_t n);
// dst = (a + b) / divisor: fp32 division for the float types (16-bit: in fp32, then
// rounded once), integer division toward zero for int64. divisor >= 1.
void ReduceSumDivide(DType dtype, const void* a, const void* b, void* dst, size_t n, int divisor);
// In place: data /= divisor, same rules as ReduceSumDivide.
void DivideInPlace(DType dtype, void* data, size_t n, int divisor);

// ---------------------------------------------------------------------------
// Errors and descriptions

// "gloo rank 1 of 4"
std::string RankLabel(Backend backend, int rank, int world_size);
// "all_gather #12 (1000 x fp32)" / "reduce_scatter #3 (8 x bf16, avg)" / "barrier #4".
std::string OpLabel(std::string_view op, uint64_t seq, size_t count, DType dtype,
                    std::optional<ReduceOp> reduce = std::nullopt);

// ---------------------------------------------------------------------------
// Arguments and options

// InvalidArgument unless timeout >= 1 ms.
Status ValidateOptions(const CommOptions& options);
// InvalidArgument when count > 0 and ptr is null ("<what> is null with <count> elements").
Status CheckBuffer(const void* ptr, size_t count, std::string_view what);
Status CheckRoot(int root, int world_size);

// Sizes of the rank-major packing used by the coalesced calls: rank r's part of item i is
// Partition(items[i].total, W, r); counts[r] = sum over items of that part.
std::vector<size_t> CoalescedCounts(std::span<const size_t> totals, int world_size);

// The store a new communicator of `backend` meets through: the rendezvous store under
// "strata/<backend>/<n>", n counting the communicators of that backend this rank has
// created on that store (every rank creates its communicators in the same order, as in
// c10d). The count lives in the store itself (key "strata/<backend>/created/<rank>"), so
// ranks that are threads of one process, or several stores in one process, count apart.
Result<std::shared_ptr<Store>> CommunicatorStore(const Rendezvous& rendezvous, Backend backend);

}  // namespace strata::comm::internal

// IoEngine: asynchronous block I/O over raw bytes and offsets (no tensors).
//
// An engine reads and writes (file, offset, length, buffer) requests. Every request ends
// in exactly one IoCompletion carrying a Status: ok only when all `length` bytes moved.
// Nothing is silent: a failed, short or cancelled transfer is a completion with an
// error, never a dropped request.
//
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> io, CreateIoEngine(options));
//   STRATA_ASSIGN_OR_RETURN(FileId f, io->RegisterFile(fd, "/nvme0/strata-swap/0"));
//   IoRequest req{IoOp::kWrite, f, /*offset=*/0, buf.size(), buf.data(), /*tag=*/1};
//   STRATA_RETURN_IF_ERROR(io->Submit({&req, 1}));
//   STRATA_ASSIGN_OR_RETURN(IoCompletion done, io->WaitOne());
//   STRATA_RETURN_IF_ERROR(done.status);
//
// Engines:
//   - io_uring (liburing): one or more rings, each driven by its own thread, at most
//     queue_depth requests in flight per ring; fixed (registered) buffers for memory
//     passed to RegisterBuffer, registered files; -EAGAIN/-EINTR completions requeued;
//     short transfers completed by resubmitting the remainder; optional SQPOLL.
//   - sync: pread/pwrite on worker threads. Chosen only when asked for, or by kAuto when
//     io_uring is unavailable (the kernel or seccomp refuses io_uring_setup) — then with
//     a logged warning and IoEngine::fallback() saying why.
//   - the fault-injecting wrapper (fault_injection.h) wraps either, for tests.
//
// Alignment: a file opened with O_DIRECT (as the engine sees from fcntl(F_GETFL)) needs
// buffer address, offset and length aligned to IoEngine::kDirectAlignment (4 KiB).
// Submit checks this up front, for every request of the batch, and rejects the whole
// batch with InvalidArgument naming the misaligned address/offset/length before queuing
// any of it.
//
// Thread-safety: all methods may be called from any thread at once. A completion is
// handed to exactly one waiter. Buffers must stay valid and untouched until their
// request's completion has been taken (by WaitOne/WaitAll/Poll).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata {
struct AioConfig;  // strata/core/config.h
}

namespace strata::swap {

enum class IoOp : uint8_t { kRead, kWrite };
std::string_view IoOpName(IoOp op);  // "read", "write"

// A file registered with an engine (RegisterFile). Dense small integers from 0.
using FileId = int32_t;

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file = -1;
  uint64_t offset = 0;
  size_t length = 0;
  void* buffer = nullptr;
  uint64_t tag = 0;  // the caller's; returned in the completion
};

struct IoCompletion {
  uint64_t tag = 0;
  IoOp op = IoOp::kRead;
  FileId file = -1;
  uint64_t offset = 0;
  size_t length = 0;
  size_t bytes_done = 0;  // == length when status is ok
  // ok, or: IOError (EIO, a transfer that cannot finish: EOF inside the range),
  // ResourceExhausted (ENOSPC), Cancelled (Cancel/CancelAll), ... The message names the
  // operation, the file (its path), offset and length, and the errno.
  Status status;
  // Submit to completion, measured by the engine (steady clock).
  std::chrono::nanoseconds latency{0};
};

// One raw transfer result, as seen by IoEngineOptions::result_hook.
struct IoResultEvent {
  const IoRequest& request;  // the request as submitted
  uint64_t offset = 0;       // this transfer: the request's remainder, or a piece of it
  size_t length = 0;
  void* buffer = nullptr;
  // 0 for the first transfer of the request; each requeue (-EAGAIN/-EINTR) or
  // resubmitted remainder adds one.
  uint32_t attempt = 0;
  int64_t result = 0;  // bytes moved, or -errno
};
using IoResultHook = std::function<int64_t(const IoResultEvent& event)>;

// The io_uring calls a test can make fail (IoEngineOptions::ring_hook).
enum class IoRingCall {
  kEnter,       // io_uring_enter (submit, or submit and wait): -errno is its result
  kCompletion,  // a completion reaped: nonzero makes it one for no request of the ring
};
using IoRingHook = std::function<int(IoRingCall call, int ring)>;

enum class IoEngineKind {
  kAuto,     // io_uring when available, else sync with a logged warning
  kIoUring,  // io_uring or an error
  kSync,     // pread/pwrite worker threads
};
std::string_view IoEngineKindName(IoEngineKind kind);  // "auto", "io_uring", "sync"
Result<IoEngineKind> ParseIoEngineKind(std::string_view name);

struct IoEngineOptions {
  IoEngineKind kind = IoEngineKind::kAuto;
  // Requests in flight per ring (io_uring) or per worker thread's batch (sync). >= 1.
  int queue_depth = 16;
  // io_uring rings, each with its own submitting/reaping thread; sync: worker threads.
  // >= 1. Requests are spread over rings round-robin per Submit batch element.
  int threads = 1;
  // io_uring only: a kernel thread polls the submission queue (IORING_SETUP_SQPOLL).
  // When the kernel refuses it (e.g. without privileges on old kernels), Create fails.
  bool sqpoll = false;
  // io_uring only: use IORING_OP_READ_FIXED/WRITE_FIXED for requests whose buffer lies
  // inside memory passed to RegisterBuffer, and registered file descriptors.
  bool fixed_buffers = true;
  bool fixed_files = true;
  // io_uring only, DeepSpeed's aio knobs: single_submit hands each request to the kernel
  // with its own system call instead of one per batch; overlap_events = false submits
  // new requests only once everything in flight on the ring has completed.
  bool single_submit = false;
  bool overlap_events = true;
  // For tests (fault_injection.h builds on it); leave empty otherwise. Called on an
  // engine thread with the raw result of every transfer (bytes moved, or -errno) before
  // the engine acts on it; what it returns is what the engine then sees. Lets a test
  // turn a real result into -EIO, -EAGAIN, a short count, ... so the engine's own
  // handling of each is exercised. Must be thread-safe.
  IoResultHook result_hook;
  // For tests, io_uring only: called on a ring's thread before each io_uring_enter and for
  // each completion reaped; a nonzero return fails that call (see IoRingCall), exercising
  // the failed-ring path below. Must be thread-safe.
  IoRingHook ring_hook;
  // io_uring: when a ring fails (io_uring_enter fails with an error other than a retryable
  // one, or a completion names no request of the ring), the ring stops: requests not yet in
  // the kernel complete at once with the failure, those in the kernel as their completions
  // come, at most this long (then with a message saying they may still be in the kernel);
  // every later Submit is refused with FailedPrecondition naming the failure. Nothing aborts.
  std::chrono::milliseconds failed_ring_drain{10000};

  // aio.queue_depth -> queue_depth, aio.intra_op_parallelism -> threads,
  // aio.single_submit and aio.overlap_events -> the fields of the same name.
  static IoEngineOptions FromConfig(const AioConfig& aio);
  std::string ToString() const;
};

// Counters since creation.
struct IoEngineStats {
  uint64_t submitted = 0;   // requests accepted by Submit
  uint64_t completed = 0;   // completions produced (ok or not)
  uint64_t failed = 0;      // completions with a non-ok status
  uint64_t bytes_read = 0;  // bytes moved by ok reads
  uint64_t bytes_written = 0;
  uint64_t requeued = 0;          // -EAGAIN/-EINTR resubmissions
  uint64_t short_resubmits = 0;   // remainders resubmitted after a short transfer
  uint64_t fixed_buffer_ops = 0;  // requests that used a registered buffer
};

class IoEngine {
 public:
  static constexpr size_t kDirectAlignment = 4096;

  virtual ~IoEngine() = default;

  // "io_uring", "sync", "faulty(io_uring)"
  virtual std::string name() const = 0;
  // Why kAuto did not give io_uring; empty otherwise.
  virtual std::string fallback() const = 0;
  virtual const IoEngineOptions& options() const = 0;

  // Makes an open file descriptor known to the engine. The engine does not own fd: the
  // caller closes it after UnregisterFile. `path` names the file in errors.
  virtual Result<FileId> RegisterFile(int fd, std::string path) = 0;
  // REQUIRES: no request on the file is in flight (FailedPrecondition otherwise).
  virtual Status UnregisterFile(FileId file) = 0;

  // Registers memory (typically a HostBuffer) for fixed-buffer I/O. Optional: requests
  // on unregistered memory work too. Returns an id for UnregisterBuffer.
  virtual Result<int> RegisterBuffer(std::span<std::byte> memory) = 0;
  virtual Status UnregisterBuffer(int buffer_id) = 0;

  // Queues a batch. All-or-nothing: a bad request (unknown file, null buffer, zero
  // length, misaligned O_DIRECT) rejects the whole batch with InvalidArgument; nothing
  // of it is queued. After the engine is shut down: FailedPrecondition.
  virtual Status Submit(std::span<const IoRequest> batch) = 0;

  // Waits for one completion. DeadlineExceeded when none arrives within timeout;
  // FailedPrecondition when nothing is in flight and no completion is waiting.
  virtual Result<IoCompletion> WaitOne(
      std::optional<std::chrono::milliseconds> timeout = std::nullopt) = 0;
  // Takes completions already available without blocking; returns how many it appended.
  virtual size_t Poll(std::vector<IoCompletion>* out) = 0;
  // Waits until nothing is in flight; appends every completion to `out` (if not null).
  // Returns the first non-ok completion's status (all of them are in `out`), or
  // DeadlineExceeded when the timeout passed with requests still in flight (its message
  // then names the first failed completion, if any; what completed is in `out`).
  virtual Status WaitAll(std::vector<IoCompletion>* out,
                         std::optional<std::chrono::milliseconds> timeout = std::nullopt) = 0;

  // Cancels queued or in-flight requests with this tag (best effort for requests the
  // device is already executing: those complete normally). A cancelled request still
  // produces its completion, with status Cancelled. Returns how many were cancelled.
  virtual size_t Cancel(uint64_t tag) = 0;
  virtual size_t CancelAll() = 0;

  // Requests submitted and not yet taken by a waiter.
  virtual size_t in_flight() const = 0;
  virtual IoEngineStats stats() const = 0;
};

// Creates an engine. kAuto: io_uring if a ring can be set up, else the sync engine with a
// warning logged (and fallback() set). InvalidArgument for bad options.
Result<std::unique_ptr<IoEngine>> CreateIoEngine(const IoEngineOptions& options);

// Whether this kernel/process can use io_uring; when not, why (e.g. "io_uring_setup:
// Operation not permitted (seccomp, or kernel.io_uring_disabled=2)").
Status IoUringAvailable();

// Submits `batch`, waits for all of it and returns the first error (every request ends
// before this returns, also on error).
Status SubmitAndWait(IoEngine& engine, std::span<const IoRequest> batch,
                     std::optional<std::chrono::milliseconds> timeout = std::nullopt);

}  // namespace strata::swap

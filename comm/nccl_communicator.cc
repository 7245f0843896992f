// The NCCL backend: collectives over CUDA device buffers (built whenever CUDA is found).
//
// One NCCL communicator per Communicator, created non-blocking (ncclConfig_t::blocking = 0)
// so that initialization and every enqueue can be polled with ncclCommGetAsyncError and
// bounded by CommOptions::timeout; on a timeout or an asynchronous NCCL error the NCCL
// communicator is aborted (ncclCommAbort) and this Communicator is broken (later calls fail
// at once with FailedPrecondition carrying the first error).
//
// Unique id: rank 0 calls ncclGetUniqueId and publishes the 128 bytes in the rendezvous
// store under "strata/nccl/<n>/uid" (CommunicatorStore: n counts the NCCL communicators
// this rank created on that store, so ranks that create them in the same order meet on the same
// key); the others Get it with the timeout.
//
// Streams and completion: every operation is enqueued, in issue order, on one dedicated
// non-blocking CUDA stream of this communicator; a CUDA event is recorded after it, and
// Work::Wait polls that event (cudaEventQuery) together with ncclCommGetAsyncError. An
// operation still running CommOptions::timeout after it was issued is a DeadlineExceeded
// naming this rank and the operation, and the NCCL communicator is aborted; a shorter
// timeout passed to Wait only ends that wait. The communicator's stream does not wait for other
// streams by itself: REQUIRES the caller to have finished writing the input buffers before
// issuing — synchronized the streams that produced them, or made this communicator's stream
// (native_stream()) wait for them on the device — and not to touch the buffers until the
// operation is done (Wait returned, or work queued on another stream after a device-side
// wait for an event recorded on native_stream() after the issue).
//
// Uneven partitions (total % W != 0; Partition() gives the first total % W ranks one
// element more). ncclAllGather and ncclReduceScatter need equal counts per rank, so:
//   - total % W == 0: ncclAllGather / ncclReduceScatter run directly on the caller's
//     buffers, no copy.
//   - otherwise every rank's slice is padded to chunk = ceil(total / W) elements in a
//     staging device buffer of W * chunk elements: all_gather copies the shard into its
//     slot, runs ncclAllGather in place, and compacts the W slots into `full` (one copy for
//     the first total % W ranks, whose offsets already match, and one strided 2-D copy for
//     the rest); reduce_scatter expands `full` into the slots the same way, runs
//     ncclReduceScatter in place and copies this rank's slice out. The extra traffic is
//     device-to-device copies at HBM speed (about the buffer size, ~1 ms per 2 GB on an
//     H100) against one collective that keeps NCCL's full bandwidth; padding elements are
//     never copied out. (The alternative, W grouped ncclBroadcasts, needs no staging but
//     loses the ring/tree all-gather algorithms.)
// Coalesced variants pack every item into one staging buffer (per rank slot: the items'
// padded slices one after another) and issue exactly ONE collective per call — one
// ncclAllGather, ncclReduceScatter or ncclAllReduce over the packed buffer — then unpack
// with one or two (strided) device copies per item. all_reduce over items that already lie
// back to back in memory skips the packing.
// The staging buffer is owned by the communicator, allocated stream-ordered
// (cudaMallocAsync) and grown when a larger operation needs it; it is kept until the
// communicator is destroyed, so its size is the largest uneven/coalesced operation issued.
//
// Reductions: fp32, bf16, fp16 and int64 are reduced natively by NCCL; kAvg is ncclAvg
// (floating types: each input is pre-multiplied by 1/W; int64: the sum divided by W,
// truncated toward zero).
//
// CommStats: NCCL does not report its transport's byte counts, so the NCCL backend counts
// the bytes a ring algorithm moves per rank: all_gather and reduce_scatter (W-1) * chunk
// elements sent and received, all_reduce 2 (W-1)/W of the buffer, broadcast the buffer
// (the root sends it, the others receive it), barrier a 4-byte all_reduce.
#include <cuda_runtime_api.h>
#include <nccl.h>

// ncclConfig_t (non-blocking communicators), ncclCommFinalize and ncclGetLastError.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "the NCCL backend needs NCCL 2.14 or newer"
#endif

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/communicator.h"
#include "strata/comm/nccl_backend.h"
#include "strata/comm/nccl_layout.h"
#include "strata/comm/rendezvous.h"
#include "strata/comm/store.h"
#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/core/status.h"

namespace strata::comm::internal {
namespace {

using std::chrono::milliseconds;

std::string CudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

Status CudaStatus(cudaError_t e, std::string_view what) {
  const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                          : e == cudaErrorInvalidValue   ? StatusCode::kInvalidArgument
                                                         : StatusCode::kInternal;
  return Status(code, std::string(what) + ": " + CudaText(e));
}

#define STRATA_NCCL_CUDA_RETURN(expr, what)        \
  do {                                             \
    const cudaError_t strata_cuda_err_ = (expr);   \
    if (strata_cuda_err_ != cudaSuccess) {         \
      return CudaStatus(strata_cuda_err_, (what)); \
    }                                              \
  } while (0)

StatusCode NcclCode(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    case ncclSystemError:
    case ncclRemoteError:
      return StatusCode::kUnavailable;  // a peer or the network went away
    default:
      return StatusCode::kInternal;
  }
}

// "<what>: <NCCL error string> (<NCCL's last error message>)".
Status NcclStatus(ncclResult_t r, ncclComm_t comm, std::string_view what) {
  std::string msg(what);
  msg += ": ";
  msg += ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') {
    msg += " (";
    msg += last;
    msg += ")";
  }
  return Status(NcclCode(r), std::move(msg));
}

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kInt64:
      return ncclInt64;
  }
  return ncclFloat32;
}

// One rank: the average is the sum (x / 1 == x exactly), and NCCL's one-rank ncclAvg is
// wrong before 2.29.7: its oneRankReduce kernel leaves the last count % blocks elements
// unwritten (NVIDIA/nccl issue 1950; torch 2.11's wheel carries NCCL 2.28.9). Seen here
// on an H200: a reduce-scatter of 2^20 + 3 elements with kAvg (tests/comm/nccl_test.cc).
ncclRedOp_t NcclOp(ReduceOp op, int world) {
  return op == ReduceOp::kAvg && world > 1 ? ncclAvg : ncclSum;
}

bool ValidDType(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16 ||
         d == DType::kInt64;
}
bool ValidOp(ReduceOp op) {
  return op == ReduceOp::kSum || op == ReduceOp::kAvg;
}

// Polling: yield for the first ~1000 rounds (collectives of small buffers finish within
// tens of microseconds), then sleep 50 us between polls.
class Backoff {
 public:
  void Pause() {
    if (rounds_++ < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  int rounds_ = 0;
};

std::string FormatMs(milliseconds t) {
  return std::to_string(t.count()) + " ms";
}

// Owned CUDA stream and event. (The CUDA runtime directly rather than core/cuda's
// Stream/Event: strata_comm links CUDA::cudart and NCCL, not strata_cuda.)
struct StreamDeleter {
  void operator()(cudaStream_t s) const { (void)cudaStreamDestroy(s); }
};
using StreamPtr = std::unique_ptr<CUstream_st, StreamDeleter>;
struct EventDeleter {
  void operator()(cudaEvent_t e) const { (void)cudaEventDestroy(e); }
};
using EventPtr = std::unique_ptr<CUevent_st, EventDeleter>;

Status SetDevice(int device) {
  STRATA_NCCL_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  return Status::Ok();
}

// An event recorded on `stream` now.
Result<EventPtr> RecordEvent(cudaStream_t stream) {
  cudaEvent_t raw = nullptr;
  STRATA_NCCL_CUDA_RETURN(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming),
                          "cudaEventCreate");
  EventPtr ev(raw);
  STRATA_NCCL_CUDA_RETURN(cudaEventRecord(raw, stream), "cudaEventRecord");
  return ev;
}

// True when the work before the event is done.
Result<bool> EventDone(cudaEvent_t ev) {
  const cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  return CudaStatus(e, "cudaEventQuery");
}

// One issued operation.
struct OpState {
  std::string name;  // "all_gather #12"
  EventPtr event;    // recorded after the operation; null for an operation with no work
  Clock::time_point issued = Clock::now();
  bool done = false;
  Status status;
};

// State shared by the Communicator and its Work handles (a Work may outlive the
// Communicator; the NCCL communicator is finalized when the last of them goes).
// Thread-safety: every member is guarded by `mu`.
class Core {
 public:
  Core(int rank, int world, int device, CommOptions options)
      : rank_(rank), world_(world), device_(device), options_(std::move(options)) {}
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;
  ~Core();

  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  const CommOptions& options() const { return options_; }

  // Creation: joins the NCCL clique (bounded by the timeout) and makes the stream.
  Status Init(const ncclUniqueId& id);

  std::mutex& mu() { return mu_; }

  // REQUIRES: mu held, for all of the following.
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_.get(); }
  bool broken() const { return !broken_.ok(); }
  Status BrokenError(std::string_view op) const {
    return FailedPreconditionError(
        Prefix(op) + ": the communicator is broken by an earlier error: " + broken_.ToString());
  }
  // "nccl rank 1 of 4: <op>"
  std::string Prefix(std::string_view op) const {
    return RankLabel(Backend::kNccl, rank_, world_) + ": " + std::string(op);
  }
  // Breaks the communicator with `why` (kept if it is the first error): every in-flight
  // operation that has not completed fails with `why`, then the NCCL communicator is
  // aborted.
  void Fail(const Status& why);
  // After an NCCL call on a non-blocking communicator: polls until the enqueue finished
  // (not ncclInProgress) or the deadline passes.
  Status AwaitEnqueue(std::string_view op, Clock::time_point deadline);
  // True when `op` is finished (successfully or not); may break the communicator on an
  // asynchronous NCCL or CUDA error.
  bool Poll(OpState& op);
  // A device buffer of at least `bytes` for staging (stream-ordered: safe to reuse by the
  // next operation on the stream).
  Result<char*> Staging(size_t bytes);
  void* barrier_buffer() const { return barrier_buf_; }
  void Track(const std::shared_ptr<OpState>& op);
  CommStats& stats() { return stats_; }
  uint64_t NextSeq() { return ++seq_; }
  size_t max_pitch() const { return max_pitch_; }

 private:
  const int rank_;
  const int world_;
  const int device_;
  const CommOptions options_;

  std::mutex mu_;
  ncclComm_t comm_ = nullptr;  // null after an abort
  StreamPtr stream_;
  char* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  void* barrier_buf_ = nullptr;
  size_t max_pitch_ = 0;
  Status broken_;
  CommStats stats_;
  uint64_t seq_ = 0;
  std::vector<std::weak_ptr<OpState>> in_flight_;
};

Status Core::Init(const ncclUniqueId& id) {
  STRATA_RETURN_IF_ERROR(SetDevice(device_));
  int pools = 0;
  STRATA_NCCL_CUDA_RETURN(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_),
                          "cudaDeviceGetAttribute(MemoryPoolsSupported)");
  if (!pools) {
    return FailedPreconditionError("CUDA device " + std::to_string(device_) +
                                   " does not support stream-ordered allocation "
                                   "(cudaMallocAsync), which the NCCL backend needs");
  }
  int pitch = 0;
  STRATA_NCCL_CUDA_RETURN(cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device_),
                          "cudaDeviceGetAttribute(MaxPitch)");
  max_pitch_ = static_cast<size_t>(std::max(pitch, 0));
  cudaStream_t raw_stream = nullptr;
  STRATA_NCCL_CUDA_RETURN(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking),
                          "cudaStreamCreate");
  stream_.reset(raw_stream);
  STRATA_NCCL_CUDA_RETURN(cudaMalloc(&barrier_buf_, 256), "cudaMalloc(barrier buffer)");
  // Zero: the barrier's all-reduce keeps summing zeros.
  STRATA_NCCL_CUDA_RETURN(cudaMemset(barrier_buf_, 0, 256), "cudaMemset(barrier buffer)");

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; progress is polled with a timeout
  const auto deadline = Clock::now() + options_.timeout;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world_, id, rank_, &config);
  const std::string what = Prefix("ncclCommInitRank (CUDA device " + std::to_string(device_) + ")");
  if (r != ncclSuccess && r != ncclInProgress) {
    Status s = NcclStatus(r, comm, what);
    if (comm != nullptr) ncclCommAbort(comm);
    return s;
  }
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      Status s = NcclStatus(state, comm, what);
      ncclCommAbort(comm);
      return s;
    }
    if (Clock::now() >= deadline) {
      ncclCommAbort(comm);
      return DeadlineExceededError(what + " did not complete within " + FormatMs(options_.timeout) +
                                   " (has every rank created its NCCL communicator?)");
    }
    backoff.Pause();
  }
  comm_ = comm;
  return Status::Ok();
}

Core::~Core() {
  std::lock_guard<std::mutex> lock(mu_);
  (void)cudaSetDevice(device_);
  if (comm_ != nullptr) {
    // Drain the stream, then finalize (flushes NCCL's outstanding work) and destroy; if
    // any of it does not finish within the timeout (a dead peer), abort instead.
    bool clean = false;
    const auto deadline = Clock::now() + options_.timeout;
    auto ev = RecordEvent(stream_.get());
    if (ev.ok()) {
      Backoff backoff;
      bool drained = false;
      for (;;) {
        auto q = EventDone(ev->get());
        if (!q.ok()) break;
        if (*q) {
          drained = true;
          break;
        }
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess ||
            (state != ncclSuccess && state != ncclInProgress) || Clock::now() >= deadline)
          break;
        backoff.Pause();
      }
      if (drained) {
        ncclResult_t r = ncclCommFinalize(comm_);
        while (r == ncclInProgress && Clock::now() < deadline) {
          backoff.Pause();
          ncclResult_t state = ncclSuccess;
          r = ncclCommGetAsyncError(comm_, &state);
          if (r == ncclSuccess) r = state;
        }
        if (r == ncclSuccess) {
          clean = ncclCommDestroy(comm_) == ncclSuccess;
        }
      }
    }
    if (!clean) {
      STRATA_LOG(kWarn) << Prefix("destroy")
                        << ": the NCCL communicator did not finish cleanly within "
                        << FormatMs(options_.timeout) << "; aborting it";
      ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }
  if (stream_.get() != nullptr && staging_ != nullptr) {
    (void)cudaFreeAsync(staging_, stream_.get());
  }
  if (barrier_buf_ != nullptr) (void)cudaFree(barrier_buf_);
}

void Core::Fail(const Status& why) {
  if (broken_.ok()) broken_ = why;
  STRATA_LOG(kWarn) << why.ToString() << "; aborting the NCCL communicator";
  for (const std::weak_ptr<OpState>& w : in_flight_) {
    std::shared_ptr<OpState> op = w.lock();
    if (!op || op->done) continue;
    auto q = op->event ? EventDone(op->event.get()) : Result<bool>(true);
    op->done = true;
    op->status = (q.ok() && *q) ? Status::Ok() : why;
  }
  in_flight_.clear();
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

Status Core::AwaitEnqueue(std::string_view op, Clock::time_point deadline) {
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess) return Status::Ok();
    if (state != ncclInProgress) return NcclStatus(state, comm_, Prefix(op));
    if (Clock::now() >= deadline) {
      return DeadlineExceededError(Prefix(op) + ": enqueueing did not finish within " +
                                   FormatMs(options_.timeout));
    }
    backoff.Pause();
  }
}

bool Core::Poll(OpState& op) {
  if (op.done) return true;
  if (op.event.get() == nullptr) {
    op.done = true;
    return true;
  }
  auto q = EventDone(op.event.get());
  if (!q.ok()) {
    Fail(q.status().WithContext(Prefix(op.name)));
    return true;
  }
  if (*q) {
    op.done = true;
    op.status = Status::Ok();
    return true;
  }
  if (!broken_.ok() || comm_ == nullptr) {  // Fail() marks every in-flight op; belt and braces
    op.done = true;
    op.status = BrokenError(op.name);
    return true;
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) state = r;
  if (state != ncclSuccess && state != ncclInProgress) {
    Fail(NcclStatus(state, comm_, Prefix(op.name) + " failed"));
    return true;
  }
  return false;
}

Result<char*> Core::Staging(size_t bytes) {
  if (bytes <= staging_bytes_) return staging_;
  const size_t want =
      AlignUp(std::max<size_t>(bytes, staging_bytes_ + staging_bytes_ / 2), 2 * kMiB);
  if (staging_ != nullptr) {
    STRATA_NCCL_CUDA_RETURN(cudaFreeAsync(staging_, stream_.get()), "cudaFreeAsync(staging)");
    staging_ = nullptr;
    staging_bytes_ = 0;
  }
  void* p = nullptr;
  STRATA_NCCL_CUDA_RETURN(cudaMallocAsync(&p, want, stream_.get()),
                          "cudaMallocAsync(" + FormatBytes(want) + " staging)");
  // Padding elements are reduced but never copied out; zeroing keeps them defined.
  STRATA_NCCL_CUDA_RETURN(cudaMemsetAsync(p, 0, want, stream_.get()), "cudaMemsetAsync(staging)");
  staging_ = static_cast<char*>(p);
  staging_bytes_ = want;
  return staging_;
}

void Core::Track(const std::shared_ptr<OpState>& op) {
  std::erase_if(in_flight_, [](const std::weak_ptr<OpState>& w) {
    std::shared_ptr<OpState> o = w.lock();
    return !o || o->done;
  });
  in_flight_.push_back(op);
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Core> core, std::shared_ptr<OpState> op)
      : core_(std::move(core)), op_(std::move(op)) {}

  // An operation is bounded by CommOptions::timeout from its issue: a Wait that finds it
  // still running after that long aborts the communicator (DeadlineExceeded). A timeout
  // given to Wait that expires first only ends this wait (DeadlineExceeded, the operation
  // goes on).
  Status Wait(std::optional<milliseconds> timeout) override {
    const milliseconds bound = core_->options().timeout;
    const milliseconds limit = timeout.value_or(bound);
    const auto deadline = Clock::now() + limit;
    Backoff backoff;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(core_->mu());
        if (core_->Poll(*op_)) return op_->status;
        const auto now = Clock::now();
        if (now - op_->issued >= bound) {
          core_->Fail(DeadlineExceededError(
              core_->Prefix(op_->name) + " did not complete within " + FormatMs(bound) +
              " (a peer may have died or stopped issuing collectives); the NCCL communicator "
              "was aborted"));
          return op_->status;
        }
        if (now >= deadline) {
          return DeadlineExceededError(core_->Prefix(op_->name) + " still running after " +
                                       FormatMs(limit) +
                                       " (Wait's timeout; the operation goes on and its "
                                       "buffers must stay valid until it completes)");
        }
      }
      backoff.Pause();
    }
  }

  // Also enforces the operation's bound (there is no watchdog thread: the bound is applied
  // by whoever polls).
  bool IsCompleted() const override {
    std::lock_guard<std::mutex> lock(core_->mu());
    if (core_->Poll(*op_)) return true;
    if (Clock::now() - op_->issued >= core_->options().timeout) {
      core_->Fail(DeadlineExceededError(core_->Prefix(op_->name) + " did not complete within " +
                                        FormatMs(core_->options().timeout) +
                                        " (a peer may have died or stopped issuing collectives); "
                                        "the NCCL communicator was aborted"));
      return true;
    }
    return false;
  }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<OpState> op_;
};

// What an operation is, for its label in errors: "all_gather #12 (1000 x fp32)".
struct OpDesc {
  std::string_view op;
  size_t count = 0;  // elements of the full buffer; 0: no count in the label (barrier)
  DType dtype = DType::kFloat32;
  std::optional<ReduceOp> reduce;
};

class NcclCommunicator final : public Communicator {
 public:
  // `origin`: the rendezvous with this communicator's own store namespace, which Duplicate
  // meets the other ranks' duplicates in.
  NcclCommunicator(std::shared_ptr<Core> core, Rendezvous origin)
      : core_(std::move(core)), origin_(std::move(origin)) {}

  int rank() const override { return core_->rank(); }
  int world_size() const override { return core_->world(); }
  Backend backend() const override { return Backend::kNccl; }
  const CommOptions& options() const override { return core_->options(); }
  CommStats stats() const override {
    std::lock_guard<std::mutex> lock(core_->mu());
    return core_->stats();
  }
  void* native_stream() const override { return core_->stream(); }

  WorkPtr AllGatherAsync(const void* shard, void* full, size_t total, DType dtype) override;
  WorkPtr ReduceScatterAsync(const void* full, void* shard, size_t total, DType dtype,
                             ReduceOp op) override;
  WorkPtr AllReduceAsync(void* data, size_t count, DType dtype, ReduceOp op) override;
  WorkPtr BroadcastAsync(void* data, size_t count, DType dtype, int root) override;
  WorkPtr BarrierAsync() override;
  WorkPtr AllGatherCoalescedAsync(std::span<const GatherItem> items, DType dtype) override;
  WorkPtr ReduceScatterCoalescedAsync(std::span<const ScatterItem> items, DType dtype,
                                      ReduceOp op) override;
  WorkPtr AllReduceCoalescedAsync(std::span<const ReduceItem> items, DType dtype,
                                  ReduceOp op) override;

 private:
  Result<std::unique_ptr<Communicator>> DuplicateImpl() const override {
    CommOptions o = core_->options();
    o.device = Device::Cuda(core_->device());
    return CreateNcclCommunicator(origin_, o);
  }

  // A Work that is already finished with `status`.
  WorkPtr Done(std::string_view op, Status status) const {
    auto state = std::make_shared<OpState>();
    state->name = std::string(op);
    state->done = true;
    state->status = std::move(status);
    return std::make_shared<NcclWork>(core_, std::move(state));
  }

  // Buffers must be CUDA device (or managed) memory of this communicator's device.
  Status CheckDevice(const void* p, size_t bytes, std::string_view name, std::string_view op) const;

  // Issues one operation: under the lock, unless broken, runs `enqueue` (CUDA copies and
  // NCCL calls on the stream), waits for NCCL's enqueue, records the completion event.
  // A failure of the enqueue breaks the communicator (the peers may already wait in the
  // collective). `sent`/`received`: this rank's bytes for CommStats.
  template <typename Enqueue>
  WorkPtr Issue(const OpDesc& desc, uint64_t sent, uint64_t received, Enqueue&& enqueue);

  // dst[i * dpitch .. + width) = src[i * spitch .. + width) for i < height, on the stream.
  Status CopyRows(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width,
                  size_t height) const;
  Status Copy(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0 || dst == src) return Status::Ok();
    STRATA_NCCL_CUDA_RETURN(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, core_->stream()),
        "cudaMemcpyAsync device to device");
    return Status::Ok();
  }
  // Padded slots <-> a flat buffer split by `split`: slot q starts at q * slot_pitch bytes
  // of `slots`, rank q's elements at its Partition() offset of `flat`.
  Status SlotsToFlat(char* flat, const char* slots, size_t slot_pitch, const Split& split,
                     size_t es) const;
  Status FlatToSlots(char* slots, size_t slot_pitch, const char* flat, const Split& split,
                     size_t es) const;

  Status Nccl(ncclResult_t r, std::string_view op) const {
    if (r == ncclSuccess || r == ncclInProgress) return Status::Ok();
    return NcclStatus(r, core_->comm(), core_->Prefix(op));
  }

  std::shared_ptr<Core> core_;
  const Rendezvous origin_;
};

Status NcclCommunicator::CheckDevice(const void* p, size_t bytes, std::string_view name,
                                     std::string_view op) const {
  if (bytes == 0) return Status::Ok();
  const std::string prefix = core_->Prefix(op) + ": " + std::string(name);
  if (p == nullptr) return InvalidArgumentError(prefix + " is null");
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return InvalidArgumentError(prefix + " is not a CUDA pointer: " + CudaText(e));
  }
  const std::string want = "; the NCCL backend takes CUDA device memory (device " +
                           std::to_string(core_->device()) + ")";
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != core_->device()) {
        return InvalidArgumentError(prefix + " is memory of CUDA device " +
                                    std::to_string(attr.device) + want);
      }
      return Status::Ok();
    case cudaMemoryTypeManaged:
      return Status::Ok();
    case cudaMemoryTypeHost:
      return InvalidArgumentError(prefix + " is page-locked host memory" + want);
    case cudaMemoryTypeUnregistered:
    default:
      return InvalidArgumentError(prefix + " is host (CPU) memory" + want);
  }
}

template <typename Enqueue>
WorkPtr NcclCommunicator::Issue(const OpDesc& desc, uint64_t sent, uint64_t received,
                                Enqueue&& enqueue) {
  std::lock_guard<std::mutex> lock(core_->mu());
  if (core_->broken()) return Done(desc.op, core_->BrokenError(desc.op));
  auto state = std::make_shared<OpState>();
  const uint64_t seq = core_->NextSeq();
  state->name = desc.count == 0 ? std::string(desc.op) + " #" + std::to_string(seq)
                                : OpLabel(desc.op, seq, desc.count, desc.dtype, desc.reduce);
  const auto deadline = Clock::now() + core_->options().timeout;
  Status s = SetDevice(core_->device());
  if (s.ok()) s = enqueue();
  if (s.ok()) s = core_->AwaitEnqueue(state->name, deadline);
  if (s.ok()) {
    auto ev = RecordEvent(core_->stream());
    if (ev.ok()) {
      state->event = std::move(*ev);
    } else {
      s = ev.status();
    }
  }
  if (!s.ok()) {
    // The peers may already wait inside the collective: this communicator cannot go on.
    Status err = s.WithContext(core_->Prefix(state->name));
    core_->Fail(err);
    return Done(state->name, std::move(err));
  }
  CommStats& st = core_->stats();
  st.bytes_sent += sent;
  st.bytes_received += received;
  st.operations += 1;
  core_->Track(state);
  return std::make_shared<NcclWork>(core_, std::move(state));
}

Status NcclCommunicator::CopyRows(char* dst, size_t dpitch, const char* src, size_t spitch,
                                  size_t width, size_t height) const {
  if (width == 0 || height == 0) return Status::Ok();
  if (height == 1 || (dpitch == width && spitch == width)) {
    return Copy(dst, src, width * height);
  }
  const size_t max_pitch = core_->max_pitch();
  if (max_pitch == 0 || dpitch > max_pitch || spitch > max_pitch) {
    for (size_t i = 0; i < height; ++i)
      STRATA_RETURN_IF_ERROR(Copy(dst + i * dpitch, src + i * spitch, width));
    return Status::Ok();
  }
  STRATA_NCCL_CUDA_RETURN(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                            cudaMemcpyDeviceToDevice, core_->stream()),
                          "cudaMemcpy2DAsync device to device");
  return Status::Ok();
}

Status NcclCommunicator::SlotsToFlat(char* flat, const char* slots, size_t slot_pitch,
                                     const Split& split, size_t es) const {
  for (const StridedCopy& c : SlotsToFlatCopies(split, slot_pitch, es)) {
    STRATA_RETURN_IF_ERROR(CopyRows(flat + c.dst_offset, c.dst_pitch, slots + c.src_offset,
                                    c.src_pitch, c.width, c.rows));
  }
  return Status::Ok();
}

Status NcclCommunicator::FlatToSlots(char* slots, size_t slot_pitch, const char* flat,
                                     const Split& split, size_t es) const {
  for (const StridedCopy& c : FlatToSlotsCopies(split, slot_pitch, es)) {
    STRATA_RETURN_IF_ERROR(CopyRows(slots + c.dst_offset, c.dst_pitch, flat + c.src_offset,
                                    c.src_pitch, c.width, c.rows));
  }
  return Status::Ok();
}

WorkPtr NcclCommunicator::AllGatherAsync(const void* shard, void* full, size_t total, DType dtype) {
  constexpr std::string_view kOp = "all_gather";
  if (!ValidDType(dtype))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype"));
  const int w = core_->world(), r = core_->rank();
  const size_t es = DTypeSize(dtype);
  const Split split(total, w);
  const size_t mine = split.count(r);
  if (Status s = CheckDevice(shard, mine * es, "shard", kOp); !s.ok()) return Done(kOp, s);
  if (Status s = CheckDevice(full, total * es, "full", kOp); !s.ok()) return Done(kOp, s);
  if (total == 0) return Done(kOp, Status::Ok());
  const uint64_t moved = static_cast<uint64_t>(w - 1) * split.chunk * es;
  return Issue({kOp, total, dtype, {}}, moved, moved, [&]() -> Status {
    const ncclDataType_t t = NcclType(dtype);
    if (split.even()) {
      return Nccl(ncclAllGather(shard, full, split.base, t, core_->comm(), core_->stream()), kOp);
    }
    const size_t slot = split.chunk * es;
    STRATA_ASSIGN_OR_RETURN(char* staging, core_->Staging(slot * static_cast<size_t>(w)));
    char* my_slot = staging + static_cast<size_t>(r) * slot;
    STRATA_RETURN_IF_ERROR(Copy(my_slot, shard, mine * es));
    STRATA_RETURN_IF_ERROR(
        Nccl(ncclAllGather(my_slot, staging, split.chunk, t, core_->comm(), core_->stream()), kOp));
    return SlotsToFlat(static_cast<char*>(full), staging, slot, split, es);
  });
}

WorkPtr NcclCommunicator::ReduceScatterAsync(const void* full, void* shard, size_t total,
                                             DType dtype, ReduceOp op) {
  constexpr std::string_view kOp = "reduce_scatter";
  if (!ValidDType(dtype) || !ValidOp(op))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype or reduce op"));
  const int w = core_->world(), r = core_->rank();
  const size_t es = DTypeSize(dtype);
  const Split split(total, w);
  const size_t mine = split.count(r);
  if (Status s = CheckDevice(full, total * es, "full", kOp); !s.ok()) return Done(kOp, s);
  if (Status s = CheckDevice(shard, mine * es, "shard", kOp); !s.ok()) return Done(kOp, s);
  if (total == 0) return Done(kOp, Status::Ok());
  const uint64_t moved = static_cast<uint64_t>(w - 1) * split.chunk * es;
  return Issue({kOp, total, dtype, op}, moved, moved, [&]() -> Status {
    const ncclDataType_t t = NcclType(dtype);
    const ncclRedOp_t o = NcclOp(op, core_->world());
    if (split.even()) {
      return Nccl(ncclReduceScatter(full, shard, split.base, t, o, core_->comm(), core_->stream()),
                  kOp);
    }
    const size_t slot = split.chunk * es;
    STRATA_ASSIGN_OR_RETURN(char* staging, core_->Staging(slot * static_cast<size_t>(w)));
    STRATA_RETURN_IF_ERROR(FlatToSlots(staging, slot, static_cast<const char*>(full), split, es));
    char* my_slot = staging + static_cast<size_t>(r) * slot;
    // A rank with a full slot receives straight into its shard; the others in place.
    void* recv = mine == split.chunk ? shard : static_cast<void*>(my_slot);
    STRATA_RETURN_IF_ERROR(Nccl(
        ncclReduceScatter(staging, recv, split.chunk, t, o, core_->comm(), core_->stream()), kOp));
    if (recv != shard) return Copy(shard, my_slot, mine * es);
    return Status::Ok();
  });
}

WorkPtr NcclCommunicator::AllReduceAsync(void* data, size_t count, DType dtype, ReduceOp op) {
  constexpr std::string_view kOp = "all_reduce";
  if (!ValidDType(dtype) || !ValidOp(op))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype or reduce op"));
  const int w = core_->world();
  const size_t es = DTypeSize(dtype);
  if (Status s = CheckDevice(data, count * es, "data", kOp); !s.ok()) return Done(kOp, s);
  if (count == 0) return Done(kOp, Status::Ok());
  const uint64_t moved = 2 * static_cast<uint64_t>(w - 1) * count * es / static_cast<uint64_t>(w);
  return Issue({kOp, count, dtype, op}, moved, moved, [&]() -> Status {
    return Nccl(ncclAllReduce(data, data, count, NcclType(dtype), NcclOp(op, core_->world()),
                              core_->comm(), core_->stream()),
                kOp);
  });
}

WorkPtr NcclCommunicator::BroadcastAsync(void* data, size_t count, DType dtype, int root) {
  constexpr std::string_view kOp = "broadcast";
  if (!ValidDType(dtype))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype"));
  const int w = core_->world(), r = core_->rank();
  if (root < 0 || root >= w) {
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": root " + std::to_string(root) +
                                          " is not a rank of " + std::to_string(w)));
  }
  const size_t es = DTypeSize(dtype);
  if (Status s = CheckDevice(data, count * es, "data", kOp); !s.ok()) return Done(kOp, s);
  if (count == 0) return Done(kOp, Status::Ok());
  const uint64_t bytes = w > 1 ? count * es : 0;
  return Issue(
      {kOp, count, dtype, {}}, r == root ? bytes : 0, r == root ? 0 : bytes, [&]() -> Status {
        return Nccl(
            ncclBroadcast(data, data, count, NcclType(dtype), root, core_->comm(), core_->stream()),
            kOp);
      });
}

WorkPtr NcclCommunicator::BarrierAsync() {
  constexpr std::string_view kOp = "barrier";
  const uint64_t moved = core_->world() > 1 ? 4 : 0;
  return Issue({kOp, 0, DType::kFloat32, {}}, moved, moved, [&]() -> Status {
    return Nccl(ncclAllReduce(core_->barrier_buffer(), core_->barrier_buffer(), 1, ncclFloat32,
                              ncclSum, core_->comm(), core_->stream()),
                kOp);
  });
}

WorkPtr NcclCommunicator::AllGatherCoalescedAsync(std::span<const GatherItem> items, DType dtype) {
  constexpr std::string_view kOp = "all_gather_coalesced";
  if (!ValidDType(dtype))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype"));
  if (items.size() == 1)
    return AllGatherAsync(items[0].shard, items[0].full, items[0].total, dtype);
  const int w = core_->world(), r = core_->rank();
  const size_t es = DTypeSize(dtype);
  std::vector<size_t> totals;
  totals.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Split split(items[i].total, w);
    const std::string at = "item " + std::to_string(i);
    if (Status s = CheckDevice(items[i].shard, split.count(r) * es, at + " shard", kOp); !s.ok())
      return Done(kOp, s);
    if (Status s = CheckDevice(items[i].full, items[i].total * es, at + " full", kOp); !s.ok())
      return Done(kOp, s);
    totals.push_back(items[i].total);
  }
  const PackedLayout layout = PackItems(totals, w);
  if (layout.slot == 0) return Done(kOp, Status::Ok());
  const uint64_t moved = static_cast<uint64_t>(w - 1) * layout.slot * es;
  const size_t all = layout.slot * static_cast<size_t>(w);
  return Issue({kOp, all, dtype, {}}, moved, moved, [&]() -> Status {
    const size_t slot = layout.slot * es;
    STRATA_ASSIGN_OR_RETURN(char* staging, core_->Staging(slot * static_cast<size_t>(w)));
    char* my_slot = staging + static_cast<size_t>(r) * slot;
    for (size_t i = 0; i < items.size(); ++i) {
      STRATA_RETURN_IF_ERROR(Copy(my_slot + layout.offsets[i] * es, items[i].shard,
                                  Split(items[i].total, w).count(r) * es));
    }
    STRATA_RETURN_IF_ERROR(Nccl(ncclAllGather(my_slot, staging, layout.slot, NcclType(dtype),
                                              core_->comm(), core_->stream()),
                                kOp));
    for (size_t i = 0; i < items.size(); ++i) {
      STRATA_RETURN_IF_ERROR(SlotsToFlat(static_cast<char*>(items[i].full),
                                         staging + layout.offsets[i] * es, slot,
                                         Split(items[i].total, w), es));
    }
    return Status::Ok();
  });
}

WorkPtr NcclCommunicator::ReduceScatterCoalescedAsync(std::span<const ScatterItem> items,
                                                      DType dtype, ReduceOp op) {
  constexpr std::string_view kOp = "reduce_scatter_coalesced";
  if (!ValidDType(dtype) || !ValidOp(op))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype or reduce op"));
  if (items.size() == 1)
    return ReduceScatterAsync(items[0].full, items[0].shard, items[0].total, dtype, op);
  const int w = core_->world(), r = core_->rank();
  const size_t es = DTypeSize(dtype);
  std::vector<size_t> totals;
  totals.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Split split(items[i].total, w);
    const std::string at = "item " + std::to_string(i);
    if (Status s = CheckDevice(items[i].full, items[i].total * es, at + " full", kOp); !s.ok())
      return Done(kOp, s);
    if (Status s = CheckDevice(items[i].shard, split.count(r) * es, at + " shard", kOp); !s.ok())
      return Done(kOp, s);
    totals.push_back(items[i].total);
  }
  const PackedLayout layout = PackItems(totals, w);
  if (layout.slot == 0) return Done(kOp, Status::Ok());
  const uint64_t moved = static_cast<uint64_t>(w - 1) * layout.slot * es;
  const size_t all = layout.slot * static_cast<size_t>(w);
  return Issue({kOp, all, dtype, op}, moved, moved, [&]() -> Status {
    const size_t slot = layout.slot * es;
    STRATA_ASSIGN_OR_RETURN(char* staging, core_->Staging(slot * static_cast<size_t>(w)));
    for (size_t i = 0; i < items.size(); ++i) {
      STRATA_RETURN_IF_ERROR(FlatToSlots(staging + layout.offsets[i] * es, slot,
                                         static_cast<const char*>(items[i].full),
                                         Split(items[i].total, w), es));
    }
    char* my_slot = staging + static_cast<size_t>(r) * slot;
    STRATA_RETURN_IF_ERROR(
        Nccl(ncclReduceScatter(staging, my_slot, layout.slot, NcclType(dtype),
                               NcclOp(op, core_->world()), core_->comm(), core_->stream()),
             kOp));
    for (size_t i = 0; i < items.size(); ++i) {
      STRATA_RETURN_IF_ERROR(Copy(items[i].shard, my_slot + layout.offsets[i] * es,
                                  Split(items[i].total, w).count(r) * es));
    }
    return Status::Ok();
  });
}

WorkPtr NcclCommunicator::AllReduceCoalescedAsync(std::span<const ReduceItem> items, DType dtype,
                                                  ReduceOp op) {
  constexpr std::string_view kOp = "all_reduce_coalesced";
  if (!ValidDType(dtype) || !ValidOp(op))
    return Done(kOp, InvalidArgumentError(core_->Prefix(kOp) + ": bad dtype or reduce op"));
  if (items.size() == 1) return AllReduceAsync(items[0].data, items[0].count, dtype, op);
  const int w = core_->world();
  const size_t es = DTypeSize(dtype);
  size_t total = 0;
  bool contiguous = true;  // the items lie back to back in memory, in order
  const char* expect = nullptr;
  for (size_t i = 0; i < items.size(); ++i) {
    if (Status s = CheckDevice(items[i].data, items[i].count * es,
                               "item " + std::to_string(i) + " data", kOp);
        !s.ok())
      return Done(kOp, s);
    if (items[i].count == 0) continue;
    const char* p = static_cast<const char*>(items[i].data);
    if (expect != nullptr && p != expect) contiguous = false;
    expect = p + items[i].count * es;
    total += items[i].count;
  }
  if (total == 0) return Done(kOp, Status::Ok());
  const uint64_t moved = 2 * static_cast<uint64_t>(w - 1) * total * es / static_cast<uint64_t>(w);
  return Issue({kOp, total, dtype, op}, moved, moved, [&]() -> Status {
    const ncclDataType_t t = NcclType(dtype);
    const ncclRedOp_t o = NcclOp(op, core_->world());
    if (contiguous) {
      void* first = nullptr;
      for (const ReduceItem& item : items) {
        if (item.count > 0) {
          first = item.data;
          break;
        }
      }
      return Nccl(ncclAllReduce(first, first, total, t, o, core_->comm(), core_->stream()), kOp);
    }
    STRATA_ASSIGN_OR_RETURN(char* staging, core_->Staging(total * es));
    size_t at = 0;
    for (const ReduceItem& item : items) {
      STRATA_RETURN_IF_ERROR(Copy(staging + at, item.data, item.count * es));
      at += item.count * es;
    }
    STRATA_RETURN_IF_ERROR(
        Nccl(ncclAllReduce(staging, staging, total, t, o, core_->comm(), core_->stream()), kOp));
    at = 0;
    for (const ReduceItem& item : items) {
      STRATA_RETURN_IF_ERROR(Copy(item.data, staging + at, item.count * es));
      at += item.count * es;
    }
    return Status::Ok();
  });
}

}  // namespace

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const Rendezvous& rendezvous,
                                                             const CommOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));
  const int rank = rendezvous.rank, world = rendezvous.world_size;
  if (world < 1 || rank < 0 || rank >= world) {
    return InvalidArgumentError("NCCL communicator: bad rendezvous: rank " + std::to_string(rank) +
                                " of world size " + std::to_string(world));
  }
  const std::string label = RankLabel(Backend::kNccl, rank, world);
  int devices = 0;
  std::string reason = "no CUDA-capable device";
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    reason = CudaText(e);
    (void)cudaGetLastError();
    devices = 0;
  }
  if (devices == 0) {
    return FailedPreconditionError("no CUDA device: " + reason + " (" + label +
                                   ": the NCCL backend needs a GPU per rank)");
  }
  int device = rendezvous.local_rank;
  if (options.device.kind == Device::Kind::kCuda && options.device.index >= 0) {
    device = options.device.index;  // else (CPU, the default, or no ordinal): LOCAL_RANK
  }
  if (device < 0 || device >= devices) {
    return FailedPreconditionError(label + ": CUDA device " + std::to_string(device) +
                                   " does not exist (" + std::to_string(devices) +
                                   " visible, LOCAL_RANK " + std::to_string(rendezvous.local_rank) +
                                   ")");
  }
  STRATA_RETURN_IF_ERROR(SetDevice(device));

  // The unique id: rank 0 makes it, the store carries it (under "strata/nccl/<n>/uid", n
  // counting this process's NCCL communicators, the same on every rank).
  ncclUniqueId id{};
  Rendezvous origin = rendezvous;
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclStatus(r, nullptr, label + ": ncclGetUniqueId");
  }
  if (world > 1) {
    if (!rendezvous.store) {
      return InvalidArgumentError(label +
                                  ": the rendezvous has no store to carry NCCL's unique id");
    }
    Result<std::shared_ptr<Store>> counted = CommunicatorStore(rendezvous, Backend::kNccl);
    if (!counted.ok()) return counted.status().WithContext(label);
    std::shared_ptr<Store> store = *std::move(counted);
    const std::string key = "uid";
    if (rank == 0) {
      std::vector<uint8_t> bytes(sizeof id.internal);
      std::memcpy(bytes.data(), id.internal, bytes.size());
      STRATA_RETURN_IF_ERROR_CTX(store->Set(key, bytes), label + ": publishing NCCL's unique id");
    } else {
      auto got = store->Get(key, options.timeout);
      if (!got.ok()) {
        return got.status().WithContext(label + ": waiting for NCCL's unique id from rank 0");
      }
      if (got->size() != sizeof id.internal) {
        return InternalError(label + ": NCCL's unique id has " + std::to_string(got->size()) +
                             " bytes, expected " + std::to_string(sizeof id.internal));
      }
      std::memcpy(id.internal, got->data(), got->size());
    }
    origin.store = std::move(store);
  }

  auto core = std::make_shared<Core>(rank, world, device, options);
  STRATA_RETURN_IF_ERROR(core->Init(id));
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(std::move(core), std::move(origin)));
}

}  // namespace strata::comm::internal

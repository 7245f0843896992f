// The NCCL backend's Core and Work (nccl_core.h): the NCCL communicator's creation,
// destruction and failure, the polling of its enqueues and operations against
// CommOptions::timeout, and its staging buffer.
#include "strata/comm/nccl_core.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"

namespace strata::comm::internal {
namespace {

using std::chrono::milliseconds;

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

// True when the work before the event is done.
Result<bool> EventDone(cudaEvent_t ev) {
  const cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  return CudaStatus(e, "cudaEventQuery");
}

}  // namespace

std::string CudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

Status CudaStatus(cudaError_t e, std::string_view what) {
  const StatusCode code = e == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted
                          : e == cudaErrorInvalidValue   ? StatusCode::kInvalidArgument
                                                         : StatusCode::kInternal;
  return Status(code, std::string(what) + ": " + CudaText(e));
}

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

Status SetDevice(int device) {
  STRATA_NCCL_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  return Status::Ok();
}

Result<EventPtr> RecordEvent(cudaStream_t stream) {
  cudaEvent_t raw = nullptr;
  STRATA_NCCL_CUDA_RETURN(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming),
                          "cudaEventCreate");
  EventPtr ev(raw);
  STRATA_NCCL_CUDA_RETURN(cudaEventRecord(raw, stream), "cudaEventRecord");
  return ev;
}

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

Status NcclWork::Wait(std::optional<milliseconds> timeout) {
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

bool NcclWork::IsCompleted() const {
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

}  // namespace strata::comm::internal

// Internal to strata_comm (not installed; built only when CUDA is found): the NCCL
// backend's state shared by a communicator and its Work handles, and the CUDA and NCCL
// plumbing its collectives (nccl_communicator.cc, which describes the backend as a whole)
// are made of: CUDA and NCCL results as a Status, the dtype and reduction mapping, the Core
// (the NCCL communicator created non-blocking and polled against CommOptions::timeout, its
// stream, its staging buffer, the operations in flight) and the Work that waits for one
// operation (nccl_core.cc).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

// ncclConfig_t (non-blocking communicators), ncclCommFinalize and ncclGetLastError.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "the NCCL backend needs NCCL 2.14 or newer"
#endif

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/communicator.h"
#include "strata/core/status.h"

namespace strata::comm::internal {

// "cudaErrorX (its description)", and the Status of a failed CUDA call `what`.
std::string CudaText(cudaError_t e);
Status CudaStatus(cudaError_t e, std::string_view what);

#define STRATA_NCCL_CUDA_RETURN(expr, what)        \
  do {                                             \
    const cudaError_t strata_cuda_err_ = (expr);   \
    if (strata_cuda_err_ != cudaSuccess) {         \
      return CudaStatus(strata_cuda_err_, (what)); \
    }                                              \
  } while (0)

// "<what>: <NCCL error string> (<NCCL's last error message>)".
Status NcclStatus(ncclResult_t r, ncclComm_t comm, std::string_view what);

ncclDataType_t NcclType(DType dtype);

// One rank: the average is the sum (x / 1 == x exactly), and NCCL's one-rank ncclAvg is
// wrong before 2.29.7: its oneRankReduce kernel leaves the last count % blocks elements
// unwritten (NVIDIA/nccl issue 1950; torch 2.11's wheel carries NCCL 2.28.9). Seen here
// on an H200: a reduce-scatter of 2^20 + 3 elements with kAvg (tests/comm/nccl_test.cc).
ncclRedOp_t NcclOp(ReduceOp op, int world);

// The dtypes and reductions the backend takes.
bool ValidDType(DType d);
bool ValidOp(ReduceOp op);

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

Status SetDevice(int device);

// An event recorded on `stream` now.
Result<EventPtr> RecordEvent(cudaStream_t stream);

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

// The Work of one operation.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Core> core, std::shared_ptr<OpState> op)
      : core_(std::move(core)), op_(std::move(op)) {}

  // An operation is bounded by CommOptions::timeout from its issue: a Wait that finds it
  // still running after that long aborts the communicator (DeadlineExceeded). A timeout
  // given to Wait that expires first only ends this wait (DeadlineExceeded, the operation
  // goes on).
  Status Wait(std::optional<std::chrono::milliseconds> timeout) override;
  // Also enforces the operation's bound (there is no watchdog thread: the bound is applied
  // by whoever polls).
  bool IsCompleted() const override;

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<OpState> op_;
};

}  // namespace strata::comm::internal

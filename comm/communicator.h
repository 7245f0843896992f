// Communicator: collectives over raw buffers (pointer, element count, dtype, device).
//
// ZeRO-3 moves every parameter through an all-gather and every gradient through a
// reduce-scatter; both are defined here on a flat buffer of `total` elements that is
// partitioned over the ranks by Partition() (balanced: the first total % W ranks hold one
// element more), so totals need not be divisible by the world size.
//
//   STRATA_ASSIGN_OR_RETURN(Rendezvous rv, RendezvousFromEnvironment({}));
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
//                           CreateCommunicator(Backend::kGloo, rv, {}));
//   Shard s = Partition(n, comm->world_size(), comm->rank());
//   STRATA_RETURN_IF_ERROR(comm->AllGather(shard.data(), full.data(), n, DType::kFloat32));
//
// Ordering: operations run in the order they were issued on a communicator (every rank
// must issue the same sequence), whether issued sync or async. An async call returns at
// once with a Work handle; its buffers must stay valid and untouched until Wait returns.
//
// Failure: every blocking wait is bounded by CommOptions::timeout (or Wait's own). A peer
// that dies or stops answering turns into an error on every surviving rank — Unavailable
// (connection closed/reset) or DeadlineExceeded — whose message names this rank, the
// operation and, where known, the peer rank. After an error the communicator is broken:
// later operations fail at once with FailedPrecondition carrying the first error.
//
// Reduction types: fp32, bf16, fp16 and int64. A backend that cannot reduce a type
// natively (Gloo has no bf16) reduces it in fp32 and rounds back (round to nearest even);
// kAvg divides in fp32 (int64: integer division toward zero).
//
// Thread-safety: a Communicator may be used from several threads, but the issue order
// is the order the calls take an internal lock; to keep ranks in step, issue from one
// thread (as the engine does).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata::comm {

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16, kInt64 };
size_t DTypeSize(DType dtype);
std::string_view DTypeName(DType dtype);  // "fp32", "bf16", "fp16", "int64"
Result<DType> ParseDType(std::string_view name);

enum class ReduceOp : uint8_t { kSum, kAvg };
std::string_view ReduceOpName(ReduceOp op);  // "sum", "avg"

enum class Backend : uint8_t { kGloo, kNccl };
std::string_view BackendName(Backend backend);  // "gloo", "nccl"
Result<Backend> ParseBackend(std::string_view name);

// Where a buffer lives. Gloo takes host memory only, NCCL device memory only; the wrong
// kind is InvalidArgument.
struct Device {
  enum class Kind : uint8_t { kCpu, kCuda } kind = Kind::kCpu;
  int index = -1;  // CUDA device ordinal
  static Device Cpu() { return {}; }
  static Device Cuda(int index) { return {Kind::kCuda, index}; }
};

// The slice of a flat buffer of `total` elements that a rank owns.
struct Shard {
  size_t offset = 0;
  size_t count = 0;
};
// Balanced: base = total / W, the first total % W ranks get base + 1.
Shard Partition(size_t total, int world_size, int rank);

// One buffer of a coalesced call.
struct GatherItem {   // AllGatherCoalesced
  const void* shard;  // Partition(total, W, rank).count elements
  void* full;         // total elements
  size_t total;
};
struct ScatterItem {  // ReduceScatterCoalesced
  const void* full;   // total elements
  void* shard;        // Partition(total, W, rank).count elements
  size_t total;
};
struct ReduceItem {  // AllReduceCoalesced (in place)
  void* data;
  size_t count;
};

struct CommOptions {
  // Bound on every blocking wait (connect, collective, barrier). >= 1 ms.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Gloo: network interface or hostname to bind ("" = the host's name resolves it, as
  // in c10d: GLOO_SOCKET_IFNAME is honoured when set).
  std::string interface;
  // Device of this rank's buffers (NCCL: the CUDA ordinal, default LOCAL_RANK).
  Device device = Device::Cpu();
};

// Byte counters of the calling rank, for tests and benchmarks: what this rank's
// transport sent and received for collectives since creation (payload bytes).
struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t operations = 0;
};

// An asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done or until the timeout (default: the communicator's). Returns the
  // operation's status; may be called more than once (same result). Every backend bounds
  // an operation itself by CommOptions::timeout (a DeadlineExceeded that breaks the
  // communicator), so a Wait without a timeout never hangs. When only Wait's own timeout
  // expires it returns DeadlineExceeded and the operation goes on: its buffers must stay
  // valid until IsCompleted().
  virtual Status Wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) = 0;
  virtual bool IsCompleted() const = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Backend backend() const = 0;
  virtual const CommOptions& options() const = 0;
  virtual CommStats stats() const = 0;
  // The device stream this communicator issues its operations on, in issue order (NCCL: its
  // cudaStream_t), or null when it runs them on the host (gloo). Where not null, a caller
  // may order its operations on the device instead of on the host: make this stream wait
  // for the events its inputs are ready at before issuing, and make the streams that read
  // the results wait for an event recorded on it after the issue. The stream belongs to the
  // communicator and lives as long as it does.
  virtual void* native_stream() const { return nullptr; }

  // A second communicator over the same ranks, backend and options, with connections and
  // an issue order of its own: collectives on the two neither wait for each other nor need
  // a common order. Every rank must call it, and in the same order as its other Duplicate
  // calls on this communicator; the ranks meet through the rendezvous' store, not through
  // this communicator's queue, so collectives may be in flight meanwhile. Bounded by
  // CommOptions::timeout (a rank that never duplicates leaves the others DeadlineExceeded).
  // Unimplemented for a communicator that cannot (DuplicateImpl's default).
  Result<std::unique_ptr<Communicator>> Duplicate() const;

  // shard: Partition(total, W, rank).count elements; full: total elements. Every rank's
  // shard lands at its partition's offset in `full` on every rank.
  virtual WorkPtr AllGatherAsync(const void* shard, void* full, size_t total, DType dtype) = 0;
  // full: total elements (this rank's contribution); shard: Partition(total, W,
  // rank).count elements, the reduction of every rank's slice. A real reduce-scatter:
  // each rank sends and receives about (W-1)/W of the buffer.
  virtual WorkPtr ReduceScatterAsync(const void* full, void* shard, size_t total, DType dtype,
                                     ReduceOp op) = 0;
  virtual WorkPtr AllReduceAsync(void* data, size_t count, DType dtype, ReduceOp op) = 0;
  virtual WorkPtr BroadcastAsync(void* data, size_t count, DType dtype, int root) = 0;
  virtual WorkPtr BarrierAsync() = 0;

  // One collective per call over all the items (flattened), not one per item.
  virtual WorkPtr AllGatherCoalescedAsync(std::span<const GatherItem> items, DType dtype) = 0;
  virtual WorkPtr ReduceScatterCoalescedAsync(std::span<const ScatterItem> items, DType dtype,
                                              ReduceOp op) = 0;
  virtual WorkPtr AllReduceCoalescedAsync(std::span<const ReduceItem> items, DType dtype,
                                          ReduceOp op) = 0;

  // Synchronous forms: issue and wait.
  Status AllGather(const void* shard, void* full, size_t total, DType dtype) {
    return AllGatherAsync(shard, full, total, dtype)->Wait();
  }
  Status ReduceScatter(const void* full, void* shard, size_t total, DType dtype, ReduceOp op) {
    return ReduceScatterAsync(full, shard, total, dtype, op)->Wait();
  }
  Status AllReduce(void* data, size_t count, DType dtype, ReduceOp op) {
    return AllReduceAsync(data, count, dtype, op)->Wait();
  }
  Status Broadcast(void* data, size_t count, DType dtype, int root) {
    return BroadcastAsync(data, count, dtype, root)->Wait();
  }
  Status Barrier() { return BarrierAsync()->Wait(); }

 protected:
  // A backend's Duplicate (Duplicate adds what every backend's errors need to say).
  virtual Result<std::unique_ptr<Communicator>> DuplicateImpl() const;
};

class Store;        // strata/comm/store.h
struct Rendezvous;  // strata/comm/rendezvous.h

// Builds a communicator over the rendezvous' store (which also carries NCCL's unique
// id). Unimplemented for kNccl when this build has no CUDA; FailedPrecondition when it
// has but no device is present.
Result<std::unique_ptr<Communicator>> CreateCommunicator(Backend backend,
                                                         const Rendezvous& rendezvous,
                                                         const CommOptions& options);

}  // namespace strata::comm

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
// The communicator's shared state (the NCCL communicator, its stream, the staging buffer,
// the operations in flight) and the Work handles are in nccl_core.h; this file has the
// collectives.
//
// CommStats: NCCL does not report its transport's byte counts, so the NCCL backend counts
// the bytes a ring algorithm moves per rank: all_gather and reduce_scatter (W-1) * chunk
// elements sent and received, all_reduce 2 (W-1)/W of the buffer, broadcast the buffer
// (the root sends it, the others receive it), barrier a 4-byte all_reduce.#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/communicator.h"
#include "strata/comm/nccl_backend.h"
#include "strata/comm/nccl_core.h"
#include "strata/comm/nccl_layout.h"
#include "strata/comm/rendezvous.h"
#include "strata/comm/store.h"
#include "strata/core/bytes.h"
#include "strata/core/status.h"

namespace strata::comm::internal {
namespace {

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

// GradientReducer: turns the full gradients of one backward into each rank's gradient
// shards, added into the fp32 gradient accumulators.
//
// Fed per tensor as gradient hooks fire: AddGradient(group, param, data, dtype) copies
// (converting to the communication dtype, the working dtype, with the device's kernels on
// its compute stream: `data` is device memory) into a bucket laid out as
// the flat group gradient: a group gets a slot of padded_numel elements, zero-filled, in
// which each parameter's gradient lands at its offset (a second gradient of the same
// parameter in the same slot is added). A bucket holds reduce_bucket_size elements (or
// one group, if a group is larger). When the next group does not fit (or the bucket is
// exactly full of groups whose every gradient arrived), the bucket is reduce-scattered
// asynchronously with one collective for all its groups
// (ReduceScatterCoalescedAsync, ReduceOp::kAvg: gradients are averaged over the
// data-parallel ranks, as DeepSpeed does) and the other bucket takes the next groups
// (two buckets with overlap_comm, one without). When a reduction completes, each group's
// shard of it is added into the accumulator (fp32, through AccumulateFn: the accumulators
// live in the optimizer's state store), so gradients accumulate over
// micro-steps; the loss is scaled by 1/gradient_accumulation_steps by the caller
// (DeepSpeed's convention), not here. Parameters that got no gradient contribute zeros;
// a group whose gradients arrive in two buckets is simply reduced twice (the reduction is
// linear), but for the gradients a park keeps back (below). Flush() at the end of backward
// reduces what is left and waits for everything.
//
// The park: a group whose gradients came interleaved with other groups' in an earlier
// backward (a root group holding a tied embedding gets its final norm's gradients first and
// the embedding's last) would be reduced twice, its whole slot each time. Its gradients
// that arrive while it has no slot go to the park instead (a device buffer of park_elems
// elements, allocated with the buckets) while they fit, until the group's slot opens: at
// a gradient too large for the park, at the one that completes the group, or in Flush;
// their values are then copied into the slot. The group is reduced once; its sums are bit
// for bit those of its gradients given together (a gradient is converted into the park
// exactly as into a slot, and a second one of the same parameter added there), i.e. for a
// parameter with one gradient a backward the same as without the park. The decisions
// depend only on the sequence of calls (this backward's and the earlier ones'), so all
// ranks make the same.
//
// With zero_optimization.reduce_scatter = false the bucket is all-reduced instead and
// each rank keeps its slice (same result, more traffic). On one rank a reduce-scatter is
// issued in place (the output is the bucket itself: no reduce-scatter output beside it).
//
// Gradients are read by work queued on the compute stream during AddGradient: the caller
// may free them right after when it passes their owner (kept until that work ran) or when
// the memory is stream-ordered with the compute stream (LibTorch's CUDA allocator).
//
// Ownership and lifetime: borrows the partition, the communicator, the device tier (the
// buckets live there) and whatever the AccumulateFn reaches; all must outlive the
// reducer. The destructor waits for reductions in flight.
// Thread-safety: not thread-safe (but for the reducer's own thread, see
// accumulate_in_background); call from one thread (the autograd hooks of LibTorch's
// CPU backward run on the calling thread; a front end with several autograd threads must
// serialize its calls).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/status.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/lane.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/timeline/timeline.h"

namespace strata::engine {

// What tests set in the reducer; the defaults are production's.
struct ReducerTestHooks {
  // Leave out the wait for the device->host copy of the reduced shards (the delaying CPU
  // device must then give wrong numbers).
  bool skip_shard_wait = false;
  // Leave out the wait for the compute stream's writes of a bucket before its collective.
  bool skip_compute_wait = false;
  // Leave out the copy stream's device-side wait for a reduction before the reduced shards
  // are copied to the host (a lane ordered on the device).
  bool skip_reduction_wait = false;
  // Drop a gradient's owner at once instead of keeping it until the compute stream read it.
  bool skip_keep_alive = false;
  // Leave out the compute stream's wait for a bucket's additions into the device
  // accumulators (accumulate_on_device) before the bucket is written again.
  bool skip_accumulator_wait = false;
  // Called before a bucket's shards are added, on the thread that adds them, with the
  // bucket's first group.
  std::function<void(int group)> before_adding_shards;
};

struct ReducerOptions {
  uint64_t bucket_elems = 500000000;  // reduce_bucket_size
  int num_buckets = 2;                // 2 with overlap_comm, else 1
  bool reduce_scatter = true;         // zero_optimization.reduce_scatter
  // The device seam (device.h), required: the buckets live in its memory, so they are
  // zeroed and the gradients converted or accumulated into them by its kernels on the
  // compute stream (where the gradients were computed); a bucket's collective is issued on
  // a lane (lane.h) after the compute stream's event recorded after those kernels: on the
  // device (an NCCL communicator's stream, or a queued lane), else by the host.
  Device* device = nullptr;
  // The communicator carries this reducer's collectives only (EngineOptions::reduce_comm):
  // a host one (gloo) then runs them queued on a device stream of their own, ordered on
  // the device like NCCL's (LaneOrder::kQueued).
  bool exclusive_comm = false;
  // With `shards_to_host` (the accumulators live in host memory: offload_optimizer =
  // cpu), each bucket's reduced shards are copied device->host on `copy_stream` into a
  // pinned staging buffer from `staging_tier` (registered with the device) and added into
  // the accumulators once the copy's event completed. Without, the accumulators are on
  // the device tier and must be host-addressable (the CPU device): the reduced shards are
  // added where they are.
  bool shards_to_host = false;
  StreamId copy_stream;
  Tier* staging_tier = nullptr;
  // With `shards_to_host`: a bucket's copy is waited for and its shards added into the
  // accumulators on the reducer's own thread (strata.accumulate_in_background), so the
  // backward's next gradients are computed meanwhile; the calling thread waits only when
  // it needs that bucket again (or at Flush). The AccumulateFn is then called on that
  // thread, one call at a time, in the same order as without (bit-identical), and under
  // the lock HoldAccumulation() takes: whatever the AccumulateFn reaches must be touched
  // by the caller only under that lock until Flush returns.
  bool accumulate_in_background = false;
  // With `shards_to_host`: the gradients are accumulated in device memory (docs/engine.md,
  // "Gradient accumulation on the device"). Create allocates fp32 accumulators for the
  // whole partition on the device tier (DeviceAccumulatorBytes); on a micro-step that is not
  // a boundary (set_boundary) each reduced shard is added into them by the device's kernel
  // on `copy_stream` and nothing goes to the host. On the boundary micro-step a group's
  // first reduced shard is added there too, and the group's sum is copied to the host once
  // (fp32) and given to the AccumulateFn (into zeroed accumulators: the same fp32 sums, in
  // the same order, as adding every micro-step's shard on the host); the device's copy is
  // zeroed behind it. A second reduction of a group in that backward goes as without (its
  // shard copied and added on the host), and Flush copies the sums of groups that got no
  // gradient in it. The staging buffers keep their size: a sum that does not fit beside
  // the rest of its bucket goes in a later round (ReducerStats::staging_refills).
  bool accumulate_on_device = false;
  // With accumulate_on_device: the device accumulators are this memory (partition_numel
  // floats, zeroed: the optimizer's DeviceSumsStore, docs/engine.md "CPU-Adam on the
  // device's sums") and every micro-step's sums stay there, the boundary's too: nothing is
  // copied to the host and the AccumulateFn is never called; the boundary's Flush checks the
  // collectives and leaves the additions queued on `copy_stream`, where the optimizer's
  // copies follow them. Null: Create allocates them and a boundary copies them as above.
  std::byte* device_sums = nullptr;
  // Where a piece of such a round may end (a multiple of this many elements of the
  // partition, when a piece holds at least that many): the optimizer's norm tiles
  // (CpuAdam::kTileElems) are then written whole and summed as written. 0: anywhere.
  size_t piece_align_elems = 0;
  ReducerTestHooks test;
  // Where the waits and the reductions in flight are recorded (engine/timeline/timeline.h); null:
  // nowhere.
  Timeline* timeline = nullptr;
  // The park's size in elements (see the top of this file): -1, the bucket capacity / 16
  // (rounded down to 16 elements); 0, no park.
  int64_t park_elems = -1;
};

struct ReducerStats {
  uint64_t gradients_received = 0;
  uint64_t buckets_reduced = 0;
  uint64_t reduce_scatter_calls = 0;
  uint64_t reduce_scatter_bytes = 0;  // full-bucket bytes of those calls
  uint64_t all_reduce_calls = 0;      // reduce_scatter = false only
  uint64_t all_reduce_bytes = 0;
  uint64_t bucket_bytes = 0;  // device bytes held by the buckets (and the park)
  // Gradients kept in the park until their group's slot opened (each parameter's first in
  // a backward), and the park's size in elements.
  uint64_t gradients_parked = 0;
  uint64_t park_elems = 0;
  // Of buckets_reduced: those launched by AddGradient, i.e. during the backward (the rest
  // by Flush at its end), and of those the ones left in flight while the backward went on
  // (with one bucket each launch is waited for at once: the next gradients need it).
  uint64_t buckets_launched_in_backward = 0;
  uint64_t buckets_overlapping_backward = 0;
  uint64_t shard_copies = 0;      // device->host copies of reduced shards (the device seam)
  uint64_t shard_copy_bytes = 0;  // their bytes
  // accumulate_on_device: the device accumulators' bytes, the reduced shards added into them
  // on the device (one per slot), and of shard_copies those that carried a group's sum
  // (fp32, on a boundary micro-step).
  uint64_t device_accumulator_bytes = 0;
  uint64_t shards_added_on_device = 0;
  uint64_t accumulated_copies = 0;
  // Times a bucket's staging buffer was filled again before the bucket was done: fp32 sums
  // take twice a 16-bit shard's bytes, so with a 16-bit working dtype a boundary's bucket
  // may need more than one round of copies and additions.
  uint64_t staging_refills = 0;
  // Exposed time: seconds the engine's thread waited for the compute stream before a
  // bucket's collective, for reductions to finish, and for the reduced shards' copies.
  double compute_wait_s = 0;
  double reduce_wait_s = 0;
  double shard_copy_wait_s = 0;
  // accumulate_in_background: buckets whose shards were added on the reducer's thread, the
  // seconds that took there (beside the backward), and the seconds the engine's thread
  // waited for it (a bucket needed again, or Flush).
  uint64_t buckets_accumulated_in_background = 0;
  double background_accumulate_s = 0;
  double accumulate_wait_s = 0;
};

// Where the reduced gradient shards go: adds `n` elements of `dtype` at `src` into the fp32
// accumulators at element `offset` of the rank's partition (the optimizer's state store,
// OptimizerDriver::Accumulate).
using AccumulateFn =
    std::function<Status(size_t offset, const std::byte* src, DType dtype, size_t n)>;

class GradientReducer {
 public:
  // The bucket capacity is max(bucket_elems, the largest group's padded_numel), capped at
  // the sum of all groups' padded_numel; buckets are allocated here, on the device tier.
  static Result<std::unique_ptr<GradientReducer>> Create(const ModelPartition* partition,
                                                         DType comm_dtype, comm::Communicator* comm,
                                                         Tier* device_tier, AccumulateFn accumulate,
                                                         const ReducerOptions& options);
  // The bytes Create will allocate on the device tier for these options (each allocation
  // rounded up to 64 bytes, as the host arena counts it).
  static uint64_t BucketBytes(const ModelPartition& partition, DType comm_dtype,
                              const ReducerOptions& options);
  // The bytes of the device accumulators (accumulate_on_device): the partition in fp32,
  // rounded up to 64 bytes.
  static uint64_t DeviceAccumulatorBytes(const ModelPartition& partition);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // `grad`: the parameter's numel elements of `dtype`, read by kernels queued on the
  // compute stream. `owner` keeps it valid: it is held until they ran (Device::KeepAlive).
  // Without an owner the memory must stay valid for the compute stream's work by itself
  // (LibTorch's stream-ordered CUDA allocator on the compute stream); on a device whose
  // compute stream is not LibTorch's (the CPU device) the host then waits for the read
  // before returning (HostWait::kGradientRead). FailedPrecondition for an unknown group or
  // parameter.
  Status AddGradient(int group, int param, const void* grad, DType dtype,
                     std::shared_ptr<const void> owner = nullptr);
  // Reduces what is pending and waits; the accumulators then hold this backward's sum.
  // With accumulate_on_device: the host's accumulators only after a boundary's backward
  // (the others' sums stay in the device's; their collectives' status is checked at the
  // boundary's Flush, when the host first reads what they wrote).
  Status Flush();
  // Whether the next backward is a gradient-accumulation boundary's (the last micro-step
  // before an optimizer step): with accumulate_on_device its sums go to the host. Set
  // before the backward's first AddGradient; true by default.
  void set_boundary(bool boundary) { boundary_.store(boundary, std::memory_order_relaxed); }
  // Whether the micro-steps' sums are kept on the device (ReducerOptions::accumulate_on_device):
  // only a boundary's backward then writes the host's accumulators.
  bool accumulates_on_device() const { return options_.accumulate_on_device; }
  // Whether gradients were added since the last Flush.
  bool pending() const;
  // Whether some gradient of `group` added since the last Flush is not yet in the
  // accumulators (in the park, in the current bucket, in a reduction not completed, or not
  // yet added on the reducer's thread).
  bool GroupPending(int group) const;
  // Waits until the reducer's thread has added every bucket handed to it (nothing to wait
  // for without accumulate_in_background); returns the first error it met.
  Status WaitAccumulations();
  // Holds the reducer's thread between two AccumulateFn calls for as long as the lock is
  // held (with accumulate_in_background; an empty lock without).
  std::unique_lock<std::mutex> HoldAccumulation();

  ReducerStats stats() const;
  LaneOrder lane_order() const { return lane_->order(); }

 private:
  struct Slot {
    int group;
    size_t offset;  // elements into the bucket
  };
  struct Bucket {
    TierBuffer data;    // capacity elements
    TierBuffer shards;  // the reduce-scatter output: capacity / W elements (+ alignment)
    size_t used = 0;
    std::vector<Slot> slots;
    TierBuffer staging;                  // pinned host copy of the reduced shards (with a device)
    comm::WorkPtr work;                  // reduction in flight
    EventId done;                        // its completion on the device (lane ordered)
    bool failed = false;                 // `work` failed and the error was returned to a caller
    Timeline::Clock::time_point issued;  // when `work` was issued (the timeline's comm lane)
    bool queued = false;  // handed to the reducer's thread (under mu_); slots kept till back
    // accumulate_on_device: recorded on the copy stream after the bucket's additions into
    // the device accumulators (the compute stream waits for it before writing the bucket).
    EventId added;
  };

  GradientReducer(const ModelPartition* partition, DType comm_dtype, AccumulateFn accumulate,
                  const ReducerOptions& options);
  // Gives group g a slot in the current bucket (launching it first if g does not fit) and
  // moves g's parked gradients into it.
  Status OpenSlot(size_t g, bool in_backward);
  Status QueueGradient(int group, int param, const void* grad, DType dtype);
  Status Launch(Bucket& b);
  Status LaunchInBackward(Bucket& b);  // Launch from AddGradient, counted
  Status Complete(Bucket& b);          // waits and accumulates (on the reducer's thread, if any)
  // Complete's phases, in order (reducer.cc), over one call's state.
  struct Completion;
  Status OrderAfterReduction(Completion& c);
  void ChooseWays(Completion& c);
  Status PlanPieces(Completion& c);
  Result<size_t> StagePieces(Completion& c, size_t first);
  Status CheckReduction(Completion& c);
  void EndReduction(Completion& c);
  Status AddPieces(Completion& c);
  Status AddInPlace(const Bucket& b);
  Status FinishCompletion(Completion& c, const Status& added);
  Status WaitReduction(Completion& c);
  const std::byte* ReducedShard(const Bucket& b, const Slot& s, size_t out) const;
  Status Failed(Bucket& b, const Status& st);  // marks b failed, returns st with context
  Status Reclaim(Bucket& b);                   // waits until the reducer's thread is done with b
  // Makes bucket b writable again: Complete or Reclaim, then (accumulate_on_device) the
  // compute stream waits on the device for b's additions into the device accumulators.
  Status Reuse(Bucket& b);
  // accumulate_on_device, a boundary's Flush: the sums of the groups that got no gradient
  // in its backward, copied to the host and given to the AccumulateFn; then the status of
  // every collective whose shards went into the device accumulators unchecked.
  Status DrainUntouched();
  Status CheckDeferred();
  void RunAccumulations();  // the reducer's thread

  const ModelPartition* partition_;
  DType dtype_;
  std::unique_ptr<CollectiveLane> lane_;  // the communicator's collectives, device-ordered
  AccumulateFn accumulate_;
  ReducerOptions options_;
  size_t capacity_ = 0;
  std::vector<Bucket> buckets_;
  size_t current_ = 0;
  // Per group: its slot in the current bucket (-1: none) and which parameters arrived.
  std::vector<long> slot_offset_;
  std::vector<std::vector<bool>> received_;
  std::vector<size_t> received_count_;
  // The park: its buffer, the entries in it in arrival order (its space is reused once it
  // is empty), per group the entry of each parameter (-1: none) and how many it has.
  struct Parked {
    int group;
    int param;
    size_t offset;  // elements into the park
  };
  TierBuffer park_;
  size_t park_capacity_ = 0;
  size_t park_used_ = 0;
  std::vector<Parked> parked_;
  std::vector<std::vector<long>> park_index_;
  std::vector<size_t> parked_count_;
  // Which groups' gradients came interleaved with other groups' (in this backward, and in
  // an earlier one: the groups that may park now), from each group's last arrival (1 + the
  // index of its last gradient in this backward; 0: none yet).
  uint64_t arrivals_ = 0;
  std::vector<uint64_t> last_arrival_;
  std::vector<char> interleaved_;
  std::vector<char> may_park_;
  ReducerStats stats_;  // the reducer's thread's fields under mu_
  // accumulate_in_background: the buckets handed to the thread, in order; per group, how
  // many of them hold a slot of it; the first error the thread met.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Bucket*> queue_;
  std::vector<int> queued_slots_;
  Status background_error_;
  bool stop_ = false;
  std::mutex accumulate_mu_;  // held by the thread around each AccumulateFn call
  std::thread thread_;
  // accumulate_on_device: the accumulators (fp32, the partition), whether the next backward
  // is a boundary's, per group whether its accumulators may hold a sum not yet copied to
  // the host (`dirty`) and whether they were copied in this boundary's backward (`drained`),
  // and the collectives whose status is checked at the boundary (guarded by mu_; the
  // reducer's thread adds to them).
  TierBuffer device_acc_;
  std::byte* acc_ = nullptr;  // the accumulators: device_acc_, or ReducerOptions::device_sums
  std::atomic<bool> boundary_{true};
  std::vector<uint8_t> dirty_;
  std::vector<uint8_t> drained_;
  std::vector<comm::WorkPtr> deferred_;
};

}  // namespace strata::engine

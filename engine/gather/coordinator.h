// ParameterCoordinator: gathers each group's full parameters before its module runs and
// releases them after, prefetching ahead along the recorded order of groups.
//
//   PreForward(g)  / PreBackward(g)   make group g's full flat buffer present on the
//                                     device tier (all-gather of the shards, or wait for
//                                     a prefetch already in flight), then prefetch ahead;
//   FullBuffer(g)                     the gathered bytes and the per-parameter views, valid
//                                     until the matching Post call;
//   PostForward(g) / PostBackward(g)  release the gathered buffer unless the group is
//                                     persistent, still in use, or needed again within
//                                     stage3_max_reuse_distance elements of the trace;
//   EndStep()                         end of one forward+backward: releases everything
//                                     not persistent and finalizes the trace;
//   EndForwardOnly()                  the same after a forward without backward (eval),
//                                     leaving the trace alone;
//   BeginIteration()                  prefetch the first groups of the next iteration
//                                     (after the optimizer step, or at once when none);
//   RegatherPersistent()              after the optimizer step changed the shards (NVMe
//                                     shards: read shard_read_ahead groups ahead).
//
// Trace: the sequence of Pre* calls (group, phase) of one iteration is recorded in the
// first iteration. While later iterations follow it, every Pre* call prefetches the
// groups that come next: those within stage3_prefetch_bucket_size elements of the trace
// ahead of the cursor, as far as the same bound on elements prefetched and not yet used
// and stage3_max_live_parameters (elements gathered at once, persistent groups excluded)
// allow, in trace order, stopping at the first that does not fit (or that the device
// budget's count, Tier::Fits, has no room for). A call that deviates from the trace invalidates it:
// the rest of the iteration fetches on demand and the iteration is recorded as the new trace.
//
// Determinism across ranks: every decision (fetch, prefetch, evict, release) depends only
// on the call sequence and the sizes (the device budget's count included, through
// Tier::Fits), never on whether an asynchronous operation has finished or whether an
// allocation failed, so every rank issues the same collectives in the same order: room
// for an on-demand fetch is made by evicting until the budget's count fits, and a
// prefetch stops where it does not. A failed allocation is an error of the call, never
// a skipped prefetch or an extra eviction.
//
// Working shards (ShardSource): in device memory (offload_param = none), the all-gather
// reads them in place; in a store (working_shards.h: host memory or NVMe), a fetch holds the
// group's shard while it is staged into the gathered buffer (or, with a host-addressable
// test device, gathered from in place). A shard that cannot be read (NVMe: an I/O error or
// a bad checksum) does not change the collectives: its place is filled with zeros, the
// all-gather runs as on every other rank, and the error is kept (TakeShardError) for the
// engine to agree on at the next step, which then fails on every rank.
// NVMe read-ahead: while the trace is followed, the shards of the next groups not gathered
// yet are read ahead (WorkingShards::Prefetch), at most CoordinatorOptions::
// shard_read_ahead groups; with a known read bandwidth only those whose read would not be
// done in time otherwise: a shard is read at the last Pre call that leaves at least twice
// its read time (bytes / shard_read_bandwidth), by the times recorded for the trace,
// before the call that acquires it. docs/engine.md explains the rule.
// Pipelined optimizer step: while the step's update still writes some groups'
// working shards, CoordinatorOptions::shard_ready says which may be read, and open_shard
// waits for one. A fetch waits for its group's shard, except a prefetch (issued by a Pre
// call along the trace), which is deferred instead: its buffer is taken now (the same
// decisions as always), its all-gather issued later, once the shard is ready, by a later
// Pre or Post call (without waiting) or by whatever needs it or anything after it (waiting:
// WaitFetch, any call other than Pre and Post, FlushDeferred). Deferred all-gathers are
// issued in the order they were asked for, and any other fetch first issues them all, so
// every rank issues the same collectives in the same order; only when differs. While some
// are deferred (from a Pre call until FlushDeferred) the engine's communicator must carry
// no other collective: the engine flushes before its next collective. shard_stored says
// which groups' stores hold their new shard already: the NVMe read-ahead reads no other.
// Ownership and lifetime: borrows the partition, the working shards, the communicator and
// the device tier; all must outlive the coordinator. The destructor waits for every
// all-gather in flight.
// Thread-safety: not thread-safe; call from the one thread that drives the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/status.h"
#include "strata/engine/device/device.h"
#include "strata/engine/device/lane.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/timeline/timeline.h"

namespace strata::engine {

enum class Phase : uint8_t { kForward, kBackward };

// What tests set in the coordinator; the defaults are production's.
struct CoordinatorTestHooks {
  // Leave out the wait for the staging copy. On the delaying CPU device the all-gather then
  // reads stale shards, so the tests' numbers go wrong (they must).
  bool skip_staging_wait = false;
  // Leave out the compute stream's device-side wait for an all-gather (a lane ordered on
  // the device) before the module reads the gathered parameters.
  bool skip_gather_wait = false;
};

struct CoordinatorOptions {
  uint64_t prefetch_bucket_elems = 50000000;  // stage3_prefetch_bucket_size
  uint64_t max_live_elems = 1000000000;       // stage3_max_live_parameters
  uint64_t max_reuse_distance = 1000000000;   // stage3_max_reuse_distance
  bool prefetch = true;                       // false: always on demand
  // The device seam (device.h), required. A released gathered buffer goes back to the
  // device tier only after the compute stream's work recorded at the release (the module
  // that read it) completed. With `stage_shards` (the working shards live in pinned host
  // memory: offload_param = cpu), a fetch copies this rank's shard host->device on
  // `copy_stream` into its place in the gathered buffer and all-gathers in place once the
  // copy is done (the host waits for the copy's event before issuing the collective).
  // Without, the all-gather reads the shard where it is (device memory).
  Device* device = nullptr;
  // The communicator carries the all-gathers only (EngineOptions::gather_comm): a host one
  // (gloo) then runs them queued on a device stream of their own (lane.h, kQueued). On a
  // device-ordered lane (that, or NCCL's stream) the compute stream waits for an all-gather
  // on the device, and its status is checked at the end of the pass (EndStep,
  // EndForwardOnly) at the latest.
  bool exclusive_comm = false;
  bool stage_shards = false;
  StreamId copy_stream;
  // NVMe working shards: at most this many groups' shards read ahead (0: none; the engine
  // sets offload_param.buffer_count - 1) and the swap tier's read bandwidth in bytes/s
  // (strata.nvme_read_bandwidth; 0 = unknown: read as far ahead as the count allows).
  size_t shard_read_ahead = 0;
  double shard_read_bandwidth = 0.0;
  CoordinatorTestHooks test;
  // Where the waits and the all-gathers in flight are recorded (engine/timeline/timeline.h); null:
  // nowhere.
  Timeline* timeline = nullptr;
  // The pipelined step (see the header comment): whether group g's working shard may be
  // read now (must not block), and the wait until it may. Null: always.
  std::function<bool(int group)> shard_ready;
  std::function<Status(int group)> open_shard;
  // Whether group g's shard in its store is its current one (must not block): false while
  // the pipelined step will still hand the group's new shard over to the store at
  // open_shard (a whole-chunk write, no read), so reading it ahead would read the old one
  // for nothing and make the hand-over wait for that read. Null: always.
  std::function<bool(int group)> shard_stored;
};

// Where the rank's working shards are read from: exactly one of the two.
struct ShardSource {
  // In device memory (offload_param = none): group g's shard at shard_offset[g] elements.
  const std::byte* device = nullptr;
  // In a state store (offload_param = cpu or nvme).
  WorkingShards* store = nullptr;
};

// A gathered group: the flat buffer of padded_numel elements of `dtype`.
struct GatheredGroup {
  std::byte* data = nullptr;  // null for a group of no elements
  size_t bytes = 0;
  DType dtype = DType::kFloat32;
  const GroupLayout* layout = nullptr;

  // Parameter i's contiguous elements (layout->params[i].numel of them).
  std::byte* param_data(size_t i) const {
    return data == nullptr ? nullptr : data + layout->params[i].offset * DTypeSize(dtype);
  }
};

struct CoordinatorStats {
  uint64_t fetches_on_demand = 0;   // Pre* calls that had to all-gather and wait
  uint64_t fetches_prefetched = 0;  // Pre* calls served by a prefetch
  uint64_t fetches_reused = 0;      // Pre* calls finding the group still gathered (reuse)
  uint64_t persistent_hits = 0;     // Pre* calls of persistent groups
  uint64_t prefetches_issued = 0;
  uint64_t prefetches_wasted = 0;  // prefetched, then released before use
  uint64_t evictions = 0;          // released early to make room
  uint64_t all_gather_calls = 0;
  uint64_t all_gather_bytes = 0;  // full-buffer bytes of those calls
  uint64_t shards_staged = 0;     // host->device shard copies through the device seam
  // Working shards in a store that reads (NVMe): reads started ahead along the trace, and
  // fetches whose shard had to be read on demand (neither resident nor read ahead).
  uint64_t shard_reads_ahead = 0;
  uint64_t shard_reads_on_demand = 0;
  uint64_t shard_read_errors = 0;  // shards zero-filled because they could not be read
  // Prefetches whose all-gather was deferred until the pipelined step had written their
  // group's shard (see the header comment).
  uint64_t prefetches_deferred = 0;
  double shard_read_wait_s = 0;  // seconds a fetch waited for its shard to be read
  // Exposed time: seconds the engine's thread waited for all-gathers to finish and for
  // shard staging copies (time the host could not spend issuing compute).
  double all_gather_wait_s = 0;
  double staging_wait_s = 0;
  uint64_t live_elements = 0;  // gathered (or in flight) now, persistent excluded
  uint64_t live_elements_peak = 0;
  uint64_t persistent_elements = 0;
  uint64_t trace_recordings = 0;
  uint64_t trace_invalidations = 0;
  bool trace_valid = false;
  size_t trace_length = 0;
};

class ParameterCoordinator {
 public:
  // `shards`: the rank's working shards (elements of `dtype`). Allocates the persistent
  // groups' buffers (a local outcome the ranks can agree on before any collective) but
  // gathers nothing: call RegatherPersistent() before the first use.
  static Result<std::unique_ptr<ParameterCoordinator>> Create(const ModelPartition* partition,
                                                              ShardSource shards, DType dtype,
                                                              comm::Communicator* comm,
                                                              Tier* device_tier,
                                                              const CoordinatorOptions& options);
  ~ParameterCoordinator();
  ParameterCoordinator(const ParameterCoordinator&) = delete;
  ParameterCoordinator& operator=(const ParameterCoordinator&) = delete;

  // FailedPrecondition for an unknown group, a Post without its Pre, EndStep while a group
  // is in use; comm and allocation errors pass through.
  // `prefetch` false: no prefetch along the trace from this call (the fetch itself as
  // always).
  Status PreForward(int group, bool prefetch = true) {
    return Pre(group, Phase::kForward, prefetch);
  }
  Status PostForward(int group) { return Post(group, Phase::kForward); }
  Status PreBackward(int group) { return Pre(group, Phase::kBackward); }
  Status PostBackward(int group) { return Post(group, Phase::kBackward); }
  Status EndStep() { return EndPass(/*record=*/true); }
  // End of a forward-only pass (evaluation, no backward): releases everything not
  // persistent like EndStep, but neither records nor invalidates the trace, so training
  // iterations keep their prefetching (the pass itself prefetched while it followed the
  // trace's forward part).
  Status EndForwardOnly() { return EndPass(/*record=*/false); }
  // The pass in progress is void (a pipelined optimizer step that failed wrote some of the
  // parameters it read): every Pre* call without its Post* is forgotten, the front end's
  // holds included, and the pass ends as EndForwardOnly does. The front end drops its views
  // of every group's full buffer first.
  Status AbandonPass();
  // Optional, before a forward-only pass: its prefetching stops at the trace's first
  // backward call instead of gathering groups that only the backward would use.
  void BeginForwardOnly() { forward_only_ = true; }
  // `prefetch` false: nothing is prefetched (after a pipelined step the first forward's
  // calls fetch and prefetch as its groups' updates end).
  Status BeginIteration(bool prefetch = true);
  // Issues every deferred all-gather, waiting for their shards (see the header comment).
  Status FlushDeferred() { return Flush(/*block=*/true, -1); }
  // The groups in the order the next iteration uses them: the persistent ones (gathered
  // again after a step), then the trace's groups by first use, then the others.
  std::vector<int> UseOrder() const;
  // `frozen_too` false: the frozen groups (ModelPartition::frozen) stay as gathered (a step
  // leaves their shards unchanged).
  Status RegatherPersistent(bool frozen_too = true);

  // REQUIRES: between Pre* and Post* of the group, or a persistent group.
  Result<GatheredGroup> FullBuffer(int group);
  // Whether the group is between a Pre* and its Post* call.
  bool InUse(int group) const;

  CoordinatorStats stats() const;
  LaneOrder lane_order() const { return lane_->order(); }
  // The first working shard read error since the last call (Ok when none), see above.
  Status TakeShardError() { return std::exchange(shard_error_, Status::Ok()); }

 private:
  struct Event {
    int group;
    Phase phase;
    bool operator==(const Event&) const = default;
  };
  struct GroupState {
    enum class State : uint8_t { kReleased, kFetching, kAvailable };
    State state = State::kReleased;
    TierBuffer full;
    comm::WorkPtr work;
    EventId done;          // the all-gather's completion on the device (lane ordered)
    int open[2] = {0, 0};  // Pre without Post, per phase
    bool prefetched_unused = false;
    bool failed = false;        // `work` failed and the error was returned to a caller
    bool deferred = false;      // kFetching with its all-gather not issued yet
    offload::StateLease shard;  // the shard the all-gather reads in place, until it is done
    Timeline::Clock::time_point issued;  // when `work` was issued (the timeline's comm lane)
  };

  ParameterCoordinator(const ModelPartition* partition, ShardSource shards, DType dtype,
                       comm::Communicator* comm, Tier* device_tier,
                       const CoordinatorOptions& options);
  Status CheckGroup(int group, const char* call) const;
  Status EndPass(bool record);
  Status Pre(int group, Phase phase, bool prefetch = true);
  Status Post(int group, Phase phase);
  size_t Bytes(int group) const;
  int InUseCount(int group) const;
  // Allocates the full buffer and issues the all-gather. With `may_evict`, unused gathered
  // groups are evicted first while the buffer does not fit the device budget.
  // `may_defer`: a prefetch, deferred while its shard is not ready or others are deferred.
  Status Fetch(int group, bool may_evict, bool may_defer = false);
  // The shard read and the all-gather of a fetch.
  Status Issue(int group);
  // Issues deferred all-gathers in order: with `block`, every one (up to and including
  // `until` when it is >= 0), waiting for their shards; else those whose shards are ready,
  // stopping at the first that is not.
  Status Flush(bool block, int until);
  Status WaitFetch(int group);
  // Waits for the all-gathers the compute stream was ordered after on the device whose
  // status is not known yet, and returns the first error (done by then at the end of a
  // backward: the host waited for the compute stream).
  Status CheckGathers();
  Status Release(int group);
  Status MakeRoom(uint64_t elems, int keep);
  Status EvictOne(int keep, bool* evicted);
  // Elements of the trace between the cursor and the next use of `group`; UINT64_MAX
  // when it is not used again (or there is no valid trace).
  uint64_t NextUseDistance(int group) const;
  Status IssuePrefetches();
  // Starts reading the next groups' working shards ahead (NVMe), see the header comment.
  void IssueShardReads();
  // Starts reading one group's shard (a hint), counting the reads it starts.
  void ReadAhead(int group);
  // Group g's working shard from the store, counting on-demand reads and their wait.
  Result<offload::StateLease> AcquireShard(int group);
  bool Following() const { return trace_valid_ && !diverged_; }

  const ModelPartition* partition_;
  ShardSource shards_;
  DType dtype_;
  comm::Communicator* comm_;
  std::unique_ptr<CollectiveLane> lane_;
  // All-gathers ordered before the compute stream on the device, not checked yet (group).
  std::vector<std::pair<int, comm::WorkPtr>> unchecked_;
  Tier* device_;
  CoordinatorOptions options_;
  std::vector<GroupState> groups_;
  std::deque<int> deferred_;  // groups whose all-gathers are deferred, in fetch order
  bool in_pre_ = false;       // inside Pre: prefetches may be deferred

  std::vector<Event> trace_;
  std::vector<uint64_t> trace_prefix_;  // elements before trace_[i]
  // Seconds from the iteration's start to each Pre call of the trace (the last iteration
  // that followed it), and per position the position whose Pre call acquires its shard
  // (for its prefetched all-gather, or on demand; -1: BeginIteration).
  std::vector<double> trace_time_;
  std::vector<int64_t> trace_acquire_at_;
  std::vector<double> current_time_;
  double iteration_start_ = -1.0;
  Status shard_error_;
  bool trace_valid_ = false;
  bool diverged_ = false;
  bool forward_only_ = false;
  size_t cursor_ = 0;
  std::vector<Event> current_;
  uint64_t prefetched_elems_ = 0;  // prefetched and not yet used
  CoordinatorStats stats_;
};

}  // namespace strata::engine

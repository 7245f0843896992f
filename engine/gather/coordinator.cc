#include "strata/engine/gather/coordinator.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "strata/core/logging.h"

namespace strata::engine {

namespace {
std::string GroupName(const ModelPartition& p, int g) {
  return "group " + std::to_string(g) + " (" + p.groups[static_cast<size_t>(g)].name + ")";
}
const char* PhaseName(Phase phase) {
  return phase == Phase::kForward ? "Forward" : "Backward";
}
double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

ParameterCoordinator::ParameterCoordinator(const ModelPartition* partition, ShardSource shards,
                                           DType dtype, comm::Communicator* comm, Tier* device_tier,
                                           const CoordinatorOptions& options)
    : partition_(partition),
      shards_(shards),
      dtype_(dtype),
      comm_(comm),
      device_(device_tier),
      options_(options),
      groups_(static_cast<size_t>(partition->num_groups())) {}

Result<std::unique_ptr<ParameterCoordinator>> ParameterCoordinator::Create(
    const ModelPartition* partition, ShardSource shards, DType dtype, comm::Communicator* comm,
    Tier* device_tier, const CoordinatorOptions& options) {
  if (partition == nullptr || comm == nullptr || device_tier == nullptr) {
    return InvalidArgumentError("ParameterCoordinator: null partition, communicator or tier");
  }
  if (options.device == nullptr) return InvalidArgumentError("ParameterCoordinator: null device");
  if ((shards.device == nullptr) == (shards.store == nullptr) && partition->partition_numel > 0) {
    return InvalidArgumentError(
        "ParameterCoordinator: the working shards must be in device memory or in a store");
  }
  if (options.stage_shards && shards.store == nullptr) {
    return InvalidArgumentError("ParameterCoordinator: staging needs the shards in a store");
  }
  std::unique_ptr<ParameterCoordinator> c(
      new ParameterCoordinator(partition, shards, dtype, comm, device_tier, options));
  STRATA_ASSIGN_OR_RETURN(c->lane_, CollectiveLane::Create(options.device, comm,
                                                           options.exclusive_comm, "all-gathers"));
  for (int g = 0; g < partition->num_groups(); ++g) {
    if (!partition->persistent[static_cast<size_t>(g)]) continue;
    c->stats_.persistent_elements += partition->groups[static_cast<size_t>(g)].padded_numel;
    // Fetch finds the buffer allocated and gathers into it.
    const size_t bytes = c->Bytes(g);
    if (bytes == 0) continue;
    STRATA_ASSIGN_OR_RETURN(c->groups_[static_cast<size_t>(g)].full,
                            device_tier->Allocate(bytes, "gathered " + GroupName(*partition, g)));
  }
  return c;
}

ParameterCoordinator::~ParameterCoordinator() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (groups_[g].work) {
      Status s = groups_[g].work->Wait();
      if (!s.ok() && !groups_[g].failed) {
        STRATA_LOG(kWarn) << "all-gather of group " << g << " at shutdown: " << s;
      }
    }
  }
  for (auto& [g, work] : unchecked_) {
    Status s = work->Wait();
    if (!s.ok()) STRATA_LOG(kWarn) << "all-gather of group " << g << " at shutdown: " << s;
  }
}

Status ParameterCoordinator::CheckGroup(int group, const char* call) const {
  if (group < 0 || group >= partition_->num_groups()) {
    return FailedPreconditionError(std::string(call) + "(" + std::to_string(group) +
                                   "): unknown group (the engine has " +
                                   std::to_string(partition_->num_groups()) + " groups)");
  }
  return Status::Ok();
}

size_t ParameterCoordinator::Bytes(int group) const {
  return partition_->groups[static_cast<size_t>(group)].padded_numel * DTypeSize(dtype_);
}

int ParameterCoordinator::InUseCount(int group) const {
  const GroupState& s = groups_[static_cast<size_t>(group)];
  return s.open[0] + s.open[1];
}

bool ParameterCoordinator::InUse(int group) const {
  if (group < 0 || group >= partition_->num_groups()) return false;
  return InUseCount(group) > 0;
}

Status ParameterCoordinator::Fetch(int group, bool may_evict, bool may_defer) {
  GroupState& s = groups_[static_cast<size_t>(group)];
  const GroupLayout& layout = partition_->groups[static_cast<size_t>(group)];
  const size_t bytes = Bytes(group);
  if (s.full.empty() && bytes > 0) {
    const std::string purpose = "gathered " + GroupName(*partition_, group);
    // Room is made from the budget's count (the same on every rank), never from an
    // allocation's outcome: an eviction changes which all-gathers come later.
    if (may_evict) {
      bool evicted = true;
      while (!device_->Fits(bytes) && evicted)
        STRATA_RETURN_IF_ERROR(EvictOne(group, &evicted));
    }
    // Its first user: the staging copy (or a failed read's zeros) on the copy stream, else
    // the all-gather — on a device-ordered lane the arena makes that stream wait on the
    // device for the block's earlier readers, not the host. The all-gather writes every
    // byte: no zero fill.
    FirstUse use;
    use.stream =
        options_.stage_shards ? std::optional<StreamId>(options_.copy_stream) : lane_->stream();
    use.zero = false;
    Result<TierBuffer> buf = device_->AllocateFor(bytes, purpose, use);
    // A failure here (the budget is full after evicting all it could, or the machine is
    // out of memory) is an error on this rank, not a different sequence of collectives.
    if (!buf.ok()) return buf.status();
    s.full = *std::move(buf);
  }
  if (!partition_->persistent[static_cast<size_t>(group)] &&
      s.state == GroupState::State::kReleased) {
    stats_.live_elements += layout.padded_numel;
    stats_.live_elements_peak = std::max(stats_.live_elements_peak, stats_.live_elements);
  }
  if (bytes == 0) {
    s.state = GroupState::State::kAvailable;
    return Status::Ok();
  }
  // A prefetch waits for no shard of the pipelined step: it is deferred, and so is every
  // prefetch after it until they are issued (the order of the all-gathers never changes).
  if (may_defer && in_pre_ &&
      (!deferred_.empty() || (options_.shard_ready && !options_.shard_ready(group)))) {
    s.deferred = true;
    s.state = GroupState::State::kFetching;
    deferred_.push_back(group);
    ++stats_.prefetches_deferred;
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(Flush(/*block=*/true, -1));
  return Issue(group);
}

Status ParameterCoordinator::Issue(int group) {
  GroupState& s = groups_[static_cast<size_t>(group)];
  const GroupLayout& layout = partition_->groups[static_cast<size_t>(group)];
  const size_t bytes = Bytes(group);
  if (options_.open_shard) STRATA_RETURN_IF_ERROR(options_.open_shard(group));
  const size_t es = DTypeSize(dtype_);
  std::byte* mine = s.full.data() + layout.shard_begin(comm_->rank()) * es;
  const size_t shard_bytes = layout.shard_numel * es;
  const std::byte* shard = nullptr;
  if (shards_.device != nullptr) {
    shard = shards_.device + partition_->shard_offset[static_cast<size_t>(group)] * es;
  } else {
    Result<offload::StateLease> held = AcquireShard(group);
    if (!held.ok()) {
      if (!shards_.store->store_of(group)->can_fail()) return held.status();
      // Every rank still all-gathers (zeros in this rank's place); the step fails on
      // every rank once the error is agreed on.
      if (shard_error_.ok()) {
        shard_error_ = held.status().WithContext("reading the working shard of " +
                                                 GroupName(*partition_, group));
      }
      ++stats_.shard_read_errors;
      STRATA_RETURN_IF_ERROR(options_.device->ZeroAsync(mine, shard_bytes, options_.copy_stream));
      STRATA_ASSIGN_OR_RETURN(EventId zeroed, options_.device->Record(options_.copy_stream));
      STRATA_RETURN_IF_ERROR(options_.device->Synchronize(zeroed, HostWait::kShardZeroFill));
      shard = mine;
    } else if (options_.stage_shards) {
      // Stage the shard into its place in the gathered buffer, then gather in place.
      STRATA_RETURN_IF_ERROR(options_.device->CopyAsync(
          mine, held->data(), shard_bytes, CopyKind::kHostToDevice, options_.copy_stream));
      STRATA_ASSIGN_OR_RETURN(EventId copied, options_.device->Record(options_.copy_stream));
      if (!options_.test.skip_staging_wait) {
        TimedScope waited(stats_.staging_wait_s, options_.timeline, "shard staging wait",
                          TimelineLane::kWait, group);
        STRATA_RETURN_IF_ERROR(options_.device->Synchronize(copied, HostWait::kShardStaging));
        STRATA_RETURN_IF_ERROR(held->Release());
      } else {
        s.shard = std::move(*held);
      }
      ++stats_.shards_staged;
      shard = mine;
    } else {
      // Host-addressable device memory (a test's allocator): gathered from in place,
      // held until the all-gather is done.
      s.shard = std::move(*held);
      shard = s.shard.data();
    }
  }
  // Its inputs are ready on the host's side already (a staged or zero-filled shard was
  // waited for; the working shards' pushes were); the gathered buffer's earlier readers are
  // the arena's to wait for.
  STRATA_ASSIGN_OR_RETURN(LaneCollective issued,
                          lane_->Issue(EventId{}, HostWait::kOther,
                                       [shard, full = s.full.data(), n = layout.padded_numel,
                                        type = ToCommDType(dtype_)](comm::Communicator& c) {
                                         return c.AllGatherAsync(shard, full, n, type);
                                       }));
  s.work = std::move(issued.work);
  s.done = issued.done;
  s.issued = Timeline::Clock::now();
  ++stats_.all_gather_calls;
  stats_.all_gather_bytes += bytes;
  s.state = GroupState::State::kFetching;
  return Status::Ok();
}

Status ParameterCoordinator::Flush(bool block, int until) {
  while (!deferred_.empty()) {
    const int g = deferred_.front();
    if (!block && options_.shard_ready && !options_.shard_ready(g)) break;
    deferred_.pop_front();
    groups_[static_cast<size_t>(g)].deferred = false;
    STRATA_RETURN_IF_ERROR(Issue(g));
    if (g == until) break;
  }
  return Status::Ok();
}

Status ParameterCoordinator::WaitFetch(int group) {
  GroupState& s = groups_[static_cast<size_t>(group)];
  if (s.state != GroupState::State::kFetching) return Status::Ok();
  if (s.deferred) STRATA_RETURN_IF_ERROR(Flush(/*block=*/true, group));
  // On error the Work stays: waiting again returns the same error.
  Status st;
  // A shard the all-gather reads in place (host-addressable) goes back once it is done: the
  // host waits. Otherwise, on a device-ordered lane, the compute stream waits on the device.
  const bool host_waits = !s.done.valid() || s.shard.valid();
  {
    TimedScope waited(stats_.all_gather_wait_s, options_.timeline, "all-gather wait",
                      TimelineLane::kWait, group);
    if (host_waits || !options_.test.skip_gather_wait) {
      st = lane_->OrderBefore(LaneCollective{s.work, s.done}, kComputeStream,
                              /*host_reads=*/s.shard.valid());
    }
  }
  // On a device-ordered lane the status is known where the all-gather is done already (the
  // CPU device's compute stream waits with the calling thread); else the end of the pass
  // checks it.
  const bool done = host_waits || s.work->IsCompleted();
  if (st.ok() && done && !host_waits) st = s.work->Wait();
  if (options_.timeline != nullptr && options_.timeline->enabled() && done) {
    options_.timeline->Add("all-gather " + partition_->groups[static_cast<size_t>(group)].name,
                           TimelineLane::kComm, s.issued, Timeline::Clock::now(), group);
  }
  if (!st.ok()) {
    s.failed = true;
    return st.WithContext("all-gather of " + GroupName(*partition_, group));
  }
  if (!done) unchecked_.emplace_back(group, s.work);
  s.work.reset();
  s.done = EventId{};
  s.state = GroupState::State::kAvailable;
  return s.shard.Release();
}

Status ParameterCoordinator::CheckGathers() {
  Status first;
  for (auto& [g, work] : unchecked_) {
    Status st = work->Wait();
    if (!st.ok() && first.ok())
      first = st.WithContext("all-gather of " + GroupName(*partition_, g));
  }
  unchecked_.clear();
  return first;
}

Result<offload::StateLease> ParameterCoordinator::AcquireShard(int group) {
  offload::StateStore* store = shards_.store->store_of(group);
  const offload::StateStoreStats before = store->stats();
  const double t0 = Now();
  Result<offload::StateLease> held = shards_.store->Acquire(group, offload::Access::kRead);
  const offload::StateStoreStats after = store->stats();
  if (after.reads > before.reads || after.prefetch_hits > before.prefetch_hits) {
    stats_.shard_read_wait_s += Now() - t0;
  }
  if (after.reads > before.reads && after.prefetch_hits == before.prefetch_hits) {
    ++stats_.shard_reads_on_demand;
  }
  return held;
}

void ParameterCoordinator::IssueShardReads() {
  if (shards_.store == nullptr || options_.shard_read_ahead == 0 || !options_.prefetch ||
      !Following() || trace_time_.size() != trace_.size()) {
    return;
  }
  std::vector<bool> seen(groups_.size(), false);
  size_t started = 0;
  for (size_t j = cursor_; j < trace_.size() && started < options_.shard_read_ahead; ++j) {
    if (forward_only_ && trace_[j].phase == Phase::kBackward) break;
    const int g = trace_[j].group;
    if (seen[static_cast<size_t>(g)]) continue;
    seen[static_cast<size_t>(g)] = true;
    // (A shard the pipelined step still updates, or has updated and not handed over yet,
    // is written into the store by the hand-over, not read.)
    if (partition_->persistent[static_cast<size_t>(g)] || !shards_.store->has(g) ||
        groups_[static_cast<size_t>(g)].state != GroupState::State::kReleased ||
        (options_.shard_ready && !options_.shard_ready(g)) ||
        (options_.shard_stored && !options_.shard_stored(g))) {
      continue;
    }
    if (options_.shard_read_bandwidth > 0) {
      // Read now unless the next Pre call (trace position cursor_) still leaves twice the
      // read's time before the call that acquires the shard.
      const double read_s =
          static_cast<double>(shards_.store->bytes(g)) / options_.shard_read_bandwidth;
      const int64_t at = trace_acquire_at_[j];
      if (at > static_cast<int64_t>(cursor_) &&
          trace_time_[static_cast<size_t>(at)] - trace_time_[cursor_] >= 2.0 * read_s) {
        continue;
      }
    }
    ReadAhead(g);
    ++started;
  }
}

void ParameterCoordinator::ReadAhead(int group) {
  // A hint: an error is kept by the store and met by the fetch. A shard still resident is
  // kept there (the store evicts it last).
  offload::StateStore* store = shards_.store->store_of(group);
  const uint64_t before = store->stats().prefetches;
  Status hint = shards_.store->Prefetch(group);
  stats_.shard_reads_ahead += store->stats().prefetches - before;
}

Status ParameterCoordinator::Release(int group) {
  GroupState& s = groups_[static_cast<size_t>(group)];
  if (s.state == GroupState::State::kReleased) return Status::Ok();
  STRATA_RETURN_IF_ERROR(WaitFetch(group));
  const uint64_t n = partition_->groups[static_cast<size_t>(group)].padded_numel;
  if (s.prefetched_unused) {
    s.prefetched_unused = false;
    prefetched_elems_ -= n;
    ++stats_.prefetches_wasted;
  }
  // Modules that read the buffer were queued on the compute stream: the arena reuses it
  // only after they ran.
  STRATA_ASSIGN_OR_RETURN(EventId read, options_.device->Record(kComputeStream));
  s.full.ResetAfter(read);
  s.state = GroupState::State::kReleased;
  stats_.live_elements -= n;
  return Status::Ok();
}

uint64_t ParameterCoordinator::NextUseDistance(int group) const {
  if (!Following()) return UINT64_MAX;
  for (size_t j = cursor_; j < trace_.size(); ++j) {
    if (trace_[j].group == group) return trace_prefix_[j] - trace_prefix_[cursor_];
  }
  return UINT64_MAX;
}

Status ParameterCoordinator::EvictOne(int keep, bool* evicted) {
  *evicted = false;
  int victim = -1;
  uint64_t victim_distance = 0;
  for (int g = 0; g < partition_->num_groups(); ++g) {
    const GroupState& s = groups_[static_cast<size_t>(g)];
    if (g == keep || partition_->persistent[static_cast<size_t>(g)] ||
        s.state == GroupState::State::kReleased || InUseCount(g) > 0) {
      continue;
    }
    const uint64_t d = NextUseDistance(g);
    if (victim < 0 || d > victim_distance) {
      victim = g;
      victim_distance = d;
    }
  }
  if (victim < 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(Release(victim));
  ++stats_.evictions;
  *evicted = true;
  return Status::Ok();
}

Status ParameterCoordinator::MakeRoom(uint64_t elems, int keep) {
  bool evicted = true;
  while (evicted && stats_.live_elements + elems > options_.max_live_elems) {
    STRATA_RETURN_IF_ERROR(EvictOne(keep, &evicted));
  }
  return Status::Ok();
}

Status ParameterCoordinator::Pre(int group, Phase phase, bool prefetch) {
  STRATA_RETURN_IF_ERROR(
      CheckGroup(group, phase == Phase::kForward ? "PreForward" : "PreBackward"));
  const Event ev{group, phase};
  const double now = Now();
  if (current_.empty()) iteration_start_ = now;
  current_.push_back(ev);
  current_time_.push_back(now - iteration_start_);
  if (Following()) {
    if (cursor_ < trace_.size() && trace_[cursor_] == ev) {
      ++cursor_;
    } else {
      diverged_ = true;
      ++stats_.trace_invalidations;
      STRATA_LOG(kDebug) << "Pre" << PhaseName(phase) << "(" << group
                         << ") deviates from the recorded trace at position " << cursor_
                         << "; fetching on demand and recording again";
    }
  }
  // Deferred all-gathers whose shards the pipelined step has written since.
  STRATA_RETURN_IF_ERROR(Flush(/*block=*/false, -1));
  GroupState& s = groups_[static_cast<size_t>(group)];
  const uint64_t n = partition_->groups[static_cast<size_t>(group)].padded_numel;
  if (partition_->persistent[static_cast<size_t>(group)]) {
    ++stats_.persistent_hits;
    STRATA_RETURN_IF_ERROR(WaitFetch(group));
  } else if (s.state == GroupState::State::kReleased) {
    STRATA_RETURN_IF_ERROR(MakeRoom(n, group));
    STRATA_RETURN_IF_ERROR(Fetch(group, /*may_evict=*/true));
    STRATA_RETURN_IF_ERROR(WaitFetch(group));
    ++stats_.fetches_on_demand;
  } else if (s.prefetched_unused) {
    STRATA_RETURN_IF_ERROR(WaitFetch(group));
    s.prefetched_unused = false;
    prefetched_elems_ -= n;
    ++stats_.fetches_prefetched;
  } else {
    STRATA_RETURN_IF_ERROR(WaitFetch(group));
    ++stats_.fetches_reused;
  }
  ++s.open[static_cast<int>(phase)];
  if (Following() && prefetch) {
    in_pre_ = true;
    const Status issued = IssuePrefetches();
    in_pre_ = false;
    STRATA_RETURN_IF_ERROR(issued);
  }
  return Flush(/*block=*/false, -1);
}

Status ParameterCoordinator::Post(int group, Phase phase) {
  STRATA_RETURN_IF_ERROR(
      CheckGroup(group, phase == Phase::kForward ? "PostForward" : "PostBackward"));
  GroupState& s = groups_[static_cast<size_t>(group)];
  int& open = s.open[static_cast<int>(phase)];
  if (open == 0) {
    return FailedPreconditionError("Post" + std::string(PhaseName(phase)) + "(" +
                                   std::to_string(group) + ") without Pre" + PhaseName(phase) +
                                   "(" + std::to_string(group) + ")");
  }
  --open;
  STRATA_RETURN_IF_ERROR(Flush(/*block=*/false, -1));
  if (partition_->persistent[static_cast<size_t>(group)] || InUseCount(group) > 0) {
    return Status::Ok();
  }
  if (NextUseDistance(group) <= options_.max_reuse_distance) return Status::Ok();
  return Release(group);
}

Status ParameterCoordinator::IssuePrefetches() {
  if (!options_.prefetch || !Following()) return Status::Ok();
  // Reads first: the all-gathers below then find their shards read or being read.
  IssueShardReads();
  for (size_t j = cursor_; j < trace_.size(); ++j) {
    // Look ahead at most stage3_prefetch_bucket_size elements of the trace.
    if (trace_prefix_[j + 1] - trace_prefix_[cursor_] > options_.prefetch_bucket_elems) break;
    if (forward_only_ && trace_[j].phase == Phase::kBackward) break;
    const int g = trace_[j].group;
    GroupState& s = groups_[static_cast<size_t>(g)];
    if (partition_->persistent[static_cast<size_t>(g)] || s.state != GroupState::State::kReleased) {
      continue;
    }
    const uint64_t n = partition_->groups[static_cast<size_t>(g)].padded_numel;
    if (n == 0) continue;
    if (prefetched_elems_ + n > options_.prefetch_bucket_elems ||
        stats_.live_elements + n > options_.max_live_elems) {
      break;
    }
    // Stop where the device budget's count is full (identical on every rank); an
    // allocation that fails although it fits is an error, not a skipped prefetch.
    if (!device_->Fits(Bytes(g))) break;
    STRATA_RETURN_IF_ERROR(Fetch(g, /*may_evict=*/false, /*may_defer=*/true));
    s.prefetched_unused = true;
    prefetched_elems_ += n;
    ++stats_.prefetches_issued;
  }
  return Status::Ok();
}

Status ParameterCoordinator::AbandonPass() {
  for (GroupState& s : groups_) {
    s.open[0] = 0;
    s.open[1] = 0;
  }
  return EndPass(/*record=*/false);
}

Status ParameterCoordinator::EndPass(bool record) {
  STRATA_RETURN_IF_ERROR(Flush(/*block=*/true, -1));
  for (int g = 0; g < partition_->num_groups(); ++g) {
    const GroupState& s = groups_[static_cast<size_t>(g)];
    if (s.open[0] > 0 || s.open[1] > 0) {
      return FailedPreconditionError(
          "end of step while " + GroupName(*partition_, g) + " is still in use (" +
          (s.open[0] > 0 ? "PostForward" : "PostBackward") + " missing)");
    }
  }
  for (int g = 0; g < partition_->num_groups(); ++g) {
    if (!partition_->persistent[static_cast<size_t>(g)]) STRATA_RETURN_IF_ERROR(Release(g));
  }
  STRATA_RETURN_IF_ERROR(CheckGathers());
  const bool followed = Following() && cursor_ == trace_.size();
  if (record && !followed) {
    if (Following()) ++stats_.trace_invalidations;  // a shorter iteration
    trace_ = current_;
    trace_prefix_.assign(trace_.size() + 1, 0);
    for (size_t j = 0; j < trace_.size(); ++j) {
      trace_prefix_[j + 1] =
          trace_prefix_[j] + partition_->groups[static_cast<size_t>(trace_[j].group)].padded_numel;
    }
    // The Pre call that acquires position j's shard: the one after which the cursor c
    // first has j within its prefetch window (prefetch_bucket_elems of the trace from c),
    // i.e. the call of position c - 1 (-1: BeginIteration); a group larger than the window
    // is fetched on demand by its own call.
    trace_acquire_at_.assign(trace_.size(), 0);
    for (size_t j = 0, c = 0; j < trace_.size(); ++j) {
      while (c < j && trace_prefix_[j + 1] - trace_prefix_[c] > options_.prefetch_bucket_elems)
        ++c;
      const bool fits = trace_prefix_[j + 1] - trace_prefix_[c] <= options_.prefetch_bucket_elems;
      trace_acquire_at_[j] = fits ? static_cast<int64_t>(c) - 1 : static_cast<int64_t>(j);
    }
    trace_valid_ = !trace_.empty();
    if (trace_valid_) ++stats_.trace_recordings;
  }
  // The times of the last training iteration that followed (or recorded) the trace: later
  // iterations read ahead, so their times are the ones read-ahead runs against.
  if (record && trace_valid_ && current_.size() == trace_.size()) trace_time_ = current_time_;
  current_.clear();
  current_time_.clear();
  cursor_ = 0;
  diverged_ = false;
  forward_only_ = false;
  return Status::Ok();
}

Status ParameterCoordinator::BeginIteration(bool prefetch) {
  if (!current_.empty()) {
    return FailedPreconditionError("BeginIteration in the middle of an iteration");
  }
  STRATA_RETURN_IF_ERROR(Flush(/*block=*/true, -1));
  return prefetch ? IssuePrefetches() : Status::Ok();
}

std::vector<int> ParameterCoordinator::UseOrder() const {
  std::vector<int> order;
  std::vector<bool> seen(groups_.size(), false);
  auto add = [&](int g) {
    if (seen[static_cast<size_t>(g)]) return;
    seen[static_cast<size_t>(g)] = true;
    order.push_back(g);
  };
  for (int g = 0; g < partition_->num_groups(); ++g) {
    if (partition_->persistent[static_cast<size_t>(g)]) add(g);
  }
  if (trace_valid_) {
    for (const Event& ev : trace_)
      add(ev.group);
  }
  for (int g = 0; g < partition_->num_groups(); ++g)
    add(g);
  return order;
}

Status ParameterCoordinator::RegatherPersistent(bool frozen_too) {
  STRATA_RETURN_IF_ERROR(Flush(/*block=*/true, -1));
  std::vector<int> persistent;
  const int groups = frozen_too ? partition_->num_groups() : partition_->num_trainable;
  for (int g = 0; g < groups; ++g) {
    if (!partition_->persistent[static_cast<size_t>(g)]) continue;
    if (InUseCount(g) > 0) {
      return FailedPreconditionError("re-gathering " + GroupName(*partition_, g) +
                                     " while it is in use");
    }
    persistent.push_back(g);
  }
  // NVMe shards: the next groups' shards are read while this one is staged and gathered.
  const size_t ahead = shards_.store != nullptr ? options_.shard_read_ahead : 0;
  for (size_t k = 0; k < persistent.size(); ++k) {
    // At the first group the first `ahead` shards, then the one entering the window.
    for (size_t q = k == 0 ? 0 : k + ahead - 1;
         ahead > 0 && q < std::min(persistent.size(), k + ahead); ++q) {
      if (shards_.store->has(persistent[q])) ReadAhead(persistent[q]);
    }
    const int g = persistent[k];
    STRATA_RETURN_IF_ERROR(WaitFetch(g));
    STRATA_RETURN_IF_ERROR(Fetch(g, /*may_evict=*/false));
  }
  return Status::Ok();
}

Result<GatheredGroup> ParameterCoordinator::FullBuffer(int group) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "FullBuffer"));
  const bool persistent = partition_->persistent[static_cast<size_t>(group)];
  if (!persistent && InUseCount(group) == 0) {
    return FailedPreconditionError("FullBuffer(" + std::to_string(group) +
                                   "): " + GroupName(*partition_, group) +
                                   " is not gathered; call PreForward or PreBackward first");
  }
  STRATA_RETURN_IF_ERROR(WaitFetch(group));
  GroupState& s = groups_[static_cast<size_t>(group)];
  return GatheredGroup{s.full.data(), Bytes(group), dtype_,
                       &partition_->groups[static_cast<size_t>(group)]};
}

CoordinatorStats ParameterCoordinator::stats() const {
  CoordinatorStats s = stats_;
  s.trace_valid = trace_valid_;
  s.trace_length = trace_.size();
  return s;
}

}  // namespace strata::engine

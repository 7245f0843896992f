#include "strata/engine/reduce/reducer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "strata/core/logging.h"

namespace strata::engine {

namespace {
size_t Capacity(const ModelPartition& partition, const ReducerOptions& options) {
  size_t largest = 0, total = 0;
  for (const GroupLayout& g : partition.groups) {
    largest = std::max(largest, g.padded_numel);
    total += g.padded_numel;
  }
  return std::min<size_t>(std::max<size_t>(options.bucket_elems, largest), total);
}

// The park's elements: a sixteenth of the bucket by default, none for a single group (its
// gradients cannot come interleaved with another's).
size_t ParkCapacity(const ModelPartition& partition, const ReducerOptions& options,
                    size_t capacity) {
  if (partition.num_groups() < 2 || options.park_elems == 0) return 0;
  if (options.park_elems > 0) return static_cast<size_t>(options.park_elems);
  return capacity / 16 / kDefaultAlignElems * kDefaultAlignElems;
}

// The elements of the next piece of a sum or shard at partition element `begin` with `left`
// elements to go, at most `most` a piece: a piece cut short ends on a multiple of `align`
// (0: anywhere) where it can.
size_t PieceElems(size_t begin, size_t left, size_t most, size_t align) {
  const size_t count = std::min(most, left);
  const size_t end = begin + count;
  if (count < left && align > 0 && end % align != 0 && end / align * align > begin) {
    return end / align * align - begin;
  }
  return count;
}

// Whether each bucket has a reduce-scatter output beside it: on several ranks; one rank's
// bucket is its own shard, reduced in place.
bool ShardOutputs(const ModelPartition& partition, const ReducerOptions& options) {
  return options.reduce_scatter && partition.world_size > 1;
}

// Park entries start at multiples of 16 elements, as parameters do in a slot.
size_t ParkSpan(size_t numel) {
  return (numel + kDefaultAlignElems - 1) / kDefaultAlignElems * kDefaultAlignElems;
}
}  // namespace

uint64_t GradientReducer::BucketBytes(const ModelPartition& partition, DType comm_dtype,
                                      const ReducerOptions& options) {
  // Each allocation as the host arena counts it (rounded up to 64 bytes).
  auto round64 = [](uint64_t n) { return (n + 63) / 64 * 64; };
  const size_t cap = Capacity(partition, options);
  const size_t elem = DTypeSize(comm_dtype);
  uint64_t per_bucket = round64(cap * elem);
  if (ShardOutputs(partition, options)) {
    per_bucket += round64(cap / static_cast<size_t>(partition.world_size) * elem);
  }
  const size_t park = ParkCapacity(partition, options, cap);
  return static_cast<uint64_t>(std::max(1, options.num_buckets)) * per_bucket +
         (park > 0 ? round64(park * elem) : 0);
}

uint64_t GradientReducer::DeviceAccumulatorBytes(const ModelPartition& partition) {
  return (static_cast<uint64_t>(partition.partition_numel) * sizeof(float) + 63) / 64 * 64;
}

GradientReducer::GradientReducer(const ModelPartition* partition, DType comm_dtype,
                                 AccumulateFn accumulate, const ReducerOptions& options)
    : partition_(partition),
      dtype_(comm_dtype),
      accumulate_(std::move(accumulate)),
      options_(options),
      slot_offset_(static_cast<size_t>(partition->num_groups()), -1),
      received_(static_cast<size_t>(partition->num_groups())),
      received_count_(static_cast<size_t>(partition->num_groups()), 0),
      park_index_(static_cast<size_t>(partition->num_groups())),
      parked_count_(static_cast<size_t>(partition->num_groups()), 0),
      last_arrival_(static_cast<size_t>(partition->num_groups()), 0),
      interleaved_(static_cast<size_t>(partition->num_groups()), 0),
      may_park_(static_cast<size_t>(partition->num_groups()), 0) {
  for (size_t g = 0; g < received_.size(); ++g) {
    received_[g].assign(partition->groups[g].params.size(), false);
    park_index_[g].assign(partition->groups[g].params.size(), -1);
  }
}

Result<std::unique_ptr<GradientReducer>> GradientReducer::Create(
    const ModelPartition* partition, DType comm_dtype, comm::Communicator* comm, Tier* device_tier,
    AccumulateFn accumulate, const ReducerOptions& options) {
  if (partition == nullptr || comm == nullptr || device_tier == nullptr) {
    return InvalidArgumentError("GradientReducer: null partition, communicator or tier");
  }
  if (!accumulate && partition->partition_numel > 0) {
    return InvalidArgumentError("GradientReducer: no accumulator function");
  }
  if (options.device == nullptr) return InvalidArgumentError("GradientReducer: null device");
  std::unique_ptr<GradientReducer> r(
      new GradientReducer(partition, comm_dtype, std::move(accumulate), options));
  STRATA_ASSIGN_OR_RETURN(
      r->lane_, CollectiveLane::Create(options.device, comm, options.exclusive_comm, "reductions"));
  r->capacity_ = Capacity(*partition, options);
  const size_t elem = DTypeSize(comm_dtype);
  if (options.device_sums != nullptr && !options.accumulate_on_device) {
    return InvalidArgumentError("GradientReducer: device_sums needs accumulate_on_device");
  }
  if (options.accumulate_on_device && !options.shards_to_host) {
    return InvalidArgumentError(
        "GradientReducer: accumulate_on_device needs shards_to_host (accumulators on the host)");
  }
  const int n = std::max(1, options.num_buckets);
  r->buckets_.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Bucket& b = r->buckets_[static_cast<size_t>(i)];
    STRATA_ASSIGN_OR_RETURN(
        b.data, device_tier->Allocate(r->capacity_ * elem, "gradient bucket " + std::to_string(i) +
                                                               " (" + std::to_string(r->capacity_) +
                                                               " elements)"));
    if (ShardOutputs(*partition, options)) {
      const size_t shard_cap = r->capacity_ / static_cast<size_t>(partition->world_size);
      STRATA_ASSIGN_OR_RETURN(
          b.shards,
          device_tier->Allocate(shard_cap * elem, "reduce-scatter output " + std::to_string(i)));
    }
    r->stats_.bucket_bytes += b.data.size() + b.shards.size();
    if (options.shards_to_host) {
      if (options.staging_tier == nullptr) {
        return InvalidArgumentError("GradientReducer: a device without a staging tier");
      }
      const size_t shard_cap = r->capacity_ / static_cast<size_t>(partition->world_size);
      STRATA_ASSIGN_OR_RETURN(
          b.staging, options.staging_tier->Allocate(std::max(shard_cap * elem, sizeof(float)),
                                                    "reduced-shard staging " + std::to_string(i)));
      if (!b.staging.empty()) {
        STRATA_RETURN_IF_ERROR(options.device->RegisterHost(b.staging.data(), b.staging.size()));
      }
    }
  }
  r->park_capacity_ = ParkCapacity(*partition, options, r->capacity_);
  if (r->park_capacity_ > 0) {
    STRATA_ASSIGN_OR_RETURN(
        r->park_, device_tier->Allocate(
                      r->park_capacity_ * elem,
                      "gradient park (" + std::to_string(r->park_capacity_) + " elements)"));
    r->stats_.bucket_bytes += r->park_.size();
  }
  r->stats_.park_elems = r->park_capacity_;
  if (options.accumulate_on_device) {
    const size_t groups = static_cast<size_t>(partition->num_groups());
    r->dirty_.assign(groups, 0);
    r->drained_.assign(groups, 0);
    if (options.device_sums != nullptr) {
      // The optimizer's (zeroed by their owner); they stay on the device.
      r->acc_ = options.device_sums;
      r->stats_.device_accumulator_bytes = partition->partition_numel * sizeof(float);
    } else if (partition->partition_numel > 0) {
      STRATA_ASSIGN_OR_RETURN(
          r->device_acc_,
          device_tier->Allocate(partition->partition_numel * sizeof(float),
                                "device gradient accumulators (" +
                                    std::to_string(partition->partition_numel) + " elements)"));
      STRATA_RETURN_IF_ERROR(options.device->ZeroAsync(r->device_acc_.data(), r->device_acc_.size(),
                                                       options.copy_stream));
      r->stats_.device_accumulator_bytes = r->device_acc_.size();
      r->acc_ = r->device_acc_.data();
    }
  }
  if (options.accumulate_in_background && options.shards_to_host) {
    r->queued_slots_.assign(static_cast<size_t>(partition->num_groups()), 0);
    GradientReducer* raw = r.get();
    r->thread_ = std::thread([raw] { raw->RunAccumulations(); });
  }
  return r;
}

GradientReducer::~GradientReducer() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  for (Bucket& b : buckets_) {
    if (b.work) {
      Status s = b.work->Wait();
      if (!s.ok() && !b.failed) STRATA_LOG(kWarn) << "gradient reduction at shutdown: " << s;
    }
  }
  // Reductions into the device accumulators whose status no boundary checked: their sums
  // are dropped with the accumulators (an error, if any, was never anyone's to see).
  for (const comm::WorkPtr& w : deferred_) {
    Status s = w->Wait();
    if (!s.ok()) STRATA_LOG(kWarn) << "gradient reduction (device accumulators) at shutdown: " << s;
  }
  {
    // Kernels queued on the compute stream may still write the buckets and the park (a
    // backward that failed half-way): they run before the memory goes.
    Result<EventId> queued = options_.device->Record(kComputeStream);
    Status s =
        queued.ok() ? options_.device->Synchronize(*queued, HostWait::kShutdown) : queued.status();
    if (!s.ok()) STRATA_LOG(kWarn) << "gradient reducer: waiting for the compute stream: " << s;
  }
  if (!options_.shards_to_host) return;
  // No copy may still write a staging buffer when it goes (only a test skips the wait).
  Result<EventId> done = options_.device->Record(options_.copy_stream);
  Status s = done.ok() ? options_.device->Synchronize(*done, HostWait::kShutdown) : done.status();
  for (Bucket& b : buckets_) {
    if (s.ok() && !b.staging.empty()) s = options_.device->UnregisterHost(b.staging.data());
  }
  if (!s.ok()) STRATA_LOG(kWarn) << "gradient reducer: releasing the shard staging: " << s;
}

bool GradientReducer::pending() const {
  if (!parked_.empty()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  for (const Bucket& b : buckets_) {
    if (b.queued || b.used > 0 || b.work) return true;
  }
  return false;
}

bool GradientReducer::GroupPending(int group) const {
  if (group < 0 || group >= partition_->num_groups()) return false;
  if (slot_offset_[static_cast<size_t>(group)] >= 0) return true;
  if (parked_count_[static_cast<size_t>(group)] > 0) return true;
  std::lock_guard<std::mutex> lock(mu_);
  if (!queued_slots_.empty() && queued_slots_[static_cast<size_t>(group)] > 0) return true;
  // A boundary's backward: a sum in the device accumulators not yet on the host.
  if (!dirty_.empty() && boundary_.load(std::memory_order_relaxed) &&
      dirty_[static_cast<size_t>(group)] != 0 && drained_[static_cast<size_t>(group)] == 0) {
    return true;
  }
  for (const Bucket& b : buckets_) {
    if (b.queued) continue;  // its slots are counted in queued_slots_
    for (const Slot& s : b.slots) {
      if (s.group == group) return true;
    }
  }
  return false;
}

ReducerStats GradientReducer::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::unique_lock<std::mutex> GradientReducer::HoldAccumulation() {
  if (!thread_.joinable()) return {};
  return std::unique_lock<std::mutex>(accumulate_mu_);
}

Status GradientReducer::Reclaim(Bucket& b) {
  std::unique_lock<std::mutex> lock(mu_);
  if (b.queued) {
    // Counted when the scope ends, with mu_ held again.
    TimedScope waited(stats_.accumulate_wait_s, options_.timeline, "accumulation wait",
                      TimelineLane::kWait);
    cv_.wait(lock, [&] { return !b.queued; });
  }
  return background_error_;
}

Status GradientReducer::Reuse(Bucket& b) {
  STRATA_RETURN_IF_ERROR(thread_.joinable() ? Reclaim(b) : Complete(b));
  if (!b.added.valid()) return Status::Ok();
  const EventId added = b.added;
  b.added = EventId{};
  if (options_.test.skip_accumulator_wait) return Status::Ok();
  return options_.device->Wait(kComputeStream, added);
}

Status GradientReducer::WaitAccumulations() {
  if (!thread_.joinable()) return Status::Ok();
  for (size_t i = 1; i <= buckets_.size(); ++i) {
    // Reclaim's error is the thread's first, the same for every bucket.
    Status st = Reclaim(buckets_[(current_ + i) % buckets_.size()]);
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

void GradientReducer::RunAccumulations() {
  // The thread's device calls (waiting for the shard copies) go to this rank's device.
  const Status bound = options_.device->BindThread().WithContext("the reducer's thread");
  for (;;) {
    Bucket* b = nullptr;
    Status st = bound;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      b = queue_.front();
      if (!background_error_.ok()) st = background_error_;
    }
    // After an error nothing more is added (every later call returns that error).
    if (st.ok()) st = Complete(*b);
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok() && background_error_.ok()) background_error_ = st;
    for (const Slot& sl : b->slots)
      --queued_slots_[static_cast<size_t>(sl.group)];
    b->slots.clear();
    b->used = 0;
    b->queued = false;
    queue_.pop_front();
    cv_.notify_all();
  }
}

Status GradientReducer::AddGradient(int group, int param, const void* grad, DType dtype,
                                    std::shared_ptr<const void> owner) {
  STRATA_RETURN_IF_ERROR(QueueGradient(group, param, grad, dtype));
  // The kernels queued above read `grad` on the compute stream.
  if (owner != nullptr) {
    if (options_.test.skip_keep_alive) return Status::Ok();
    return options_.device->KeepAlive(kComputeStream, std::move(owner));
  }
  if (options_.device->torch_on_compute_stream()) return Status::Ok();
  // No owner, and the caller may free the gradient once this returns: read it first.
  STRATA_ASSIGN_OR_RETURN(EventId read, options_.device->Record(kComputeStream));
  return options_.device->Synchronize(read, HostWait::kGradientRead);
}

Status GradientReducer::QueueGradient(int group, int param, const void* grad, DType dtype) {
  if (group < 0 || group >= partition_->num_groups()) {
    return FailedPreconditionError("AddGradient: unknown group " + std::to_string(group) +
                                   " (the engine has " + std::to_string(partition_->num_groups()) +
                                   " groups)");
  }
  const GroupLayout& layout = partition_->groups[static_cast<size_t>(group)];
  if (param < 0 || static_cast<size_t>(param) >= layout.params.size()) {
    return FailedPreconditionError("AddGradient: group " + std::to_string(group) + " (" +
                                   layout.name + ") has no parameter " + std::to_string(param) +
                                   " (it has " + std::to_string(layout.params.size()) + ")");
  }
  const ParamSlot& p = layout.params[static_cast<size_t>(param)];
  if (p.numel > 0 && grad == nullptr) {
    return InvalidArgumentError("AddGradient: null gradient for " + p.name);
  }
  ++stats_.gradients_received;
  if (layout.padded_numel == 0) return Status::Ok();
  const size_t g = static_cast<size_t>(group);
  const size_t pi = static_cast<size_t>(param);
  const size_t elem = DTypeSize(dtype_);
  // Another group's gradient since this group's last one: interleaved.
  ++arrivals_;
  if (last_arrival_[g] != 0 && last_arrival_[g] + 1 != arrivals_) interleaved_[g] = 1;
  last_arrival_[g] = arrivals_;
  if (slot_offset_[g] < 0) {
    if (park_index_[g][pi] >= 0) {
      // A second gradient of a parked parameter: added there, as in a slot.
      return options_.device->ConvertAsync(
          park_.data() + static_cast<size_t>(park_index_[g][pi]) * elem, dtype_, grad, dtype,
          p.numel, /*accumulate=*/true, kComputeStream);
    }
    const bool completes = received_count_[g] + 1 == received_[g].size();
    if (may_park_[g] != 0 && !completes && park_used_ + ParkSpan(p.numel) <= park_capacity_) {
      STRATA_RETURN_IF_ERROR(options_.device->ConvertAsync(park_.data() + park_used_ * elem, dtype_,
                                                           grad, dtype, p.numel,
                                                           /*accumulate=*/false, kComputeStream));
      parked_.push_back({group, param, park_used_});
      park_index_[g][pi] = static_cast<long>(park_used_);
      park_used_ += ParkSpan(p.numel);
      ++parked_count_[g];
      received_[g][pi] = true;
      ++received_count_[g];
      ++stats_.gradients_parked;
      return Status::Ok();
    }
    STRATA_RETURN_IF_ERROR(OpenSlot(g, /*in_backward=*/true));
  }
  std::byte* dst =
      buckets_[current_].data.data() + (static_cast<size_t>(slot_offset_[g]) + p.offset) * elem;
  const bool again = received_[g][pi];
  STRATA_RETURN_IF_ERROR(
      options_.device->ConvertAsync(dst, dtype_, grad, dtype, p.numel, again, kComputeStream));
  if (!again) {
    received_[g][pi] = true;
    ++received_count_[g];
  }
  // A bucket that is exactly full of complete groups goes at once rather than when the
  // next group's first gradient arrives.
  Bucket& cur = buckets_[current_];
  if (cur.used == capacity_) {
    bool complete = true;
    for (const Slot& sl : cur.slots) {
      const size_t sg = static_cast<size_t>(sl.group);
      complete = complete && received_count_[sg] == received_[sg].size();
    }
    if (complete) {
      STRATA_RETURN_IF_ERROR(LaunchInBackward(cur));
      current_ = (current_ + 1) % buckets_.size();
      Bucket& next = buckets_[current_];
      STRATA_RETURN_IF_ERROR(Reuse(next));
    }
  }
  return Status::Ok();
}

Status GradientReducer::OpenSlot(size_t g, bool in_backward) {
  const GroupLayout& layout = partition_->groups[g];
  const size_t elem = DTypeSize(dtype_);
  Bucket* b = &buckets_[current_];
  if (b->used + layout.padded_numel > capacity_) {
    STRATA_RETURN_IF_ERROR(in_backward ? LaunchInBackward(*b) : Launch(*b));
    current_ = (current_ + 1) % buckets_.size();
    b = &buckets_[current_];
    STRATA_RETURN_IF_ERROR(Reuse(*b));
  }
  slot_offset_[g] = static_cast<long>(b->used);
  b->slots.push_back({static_cast<int>(g), b->used});
  std::byte* slot = b->data.data() + b->used * elem;
  STRATA_RETURN_IF_ERROR(
      options_.device->ZeroAsync(slot, layout.padded_numel * elem, kComputeStream));
  b->used += layout.padded_numel;
  if (parked_count_[g] == 0) return Status::Ok();
  // The group's parked gradients, copied into their places in the slot (a conversion to
  // the same dtype: the values unchanged) on the compute stream, behind their writes.
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (static_cast<size_t>(it->group) != g) {
      ++it;
      continue;
    }
    const ParamSlot& p = layout.params[static_cast<size_t>(it->param)];
    STRATA_RETURN_IF_ERROR(options_.device->ConvertAsync(
        slot + p.offset * elem, dtype_, park_.data() + it->offset * elem, dtype_, p.numel,
        /*accumulate=*/false, kComputeStream));
    park_index_[g][static_cast<size_t>(it->param)] = -1;
    it = parked_.erase(it);
  }
  parked_count_[g] = 0;
  if (parked_.empty()) park_used_ = 0;  // the next writes are queued behind these reads
  return Status::Ok();
}

Status GradientReducer::LaunchInBackward(Bucket& b) {
  const uint64_t before = stats_.buckets_reduced;
  STRATA_RETURN_IF_ERROR(Launch(b));
  if (stats_.buckets_reduced > before) {
    ++stats_.buckets_launched_in_backward;
    // The caller next waits for the other bucket's reduction; with one bucket that is this
    // one.
    if (buckets_.size() > 1) ++stats_.buckets_overlapping_backward;
  }
  return Status::Ok();
}

Status GradientReducer::Launch(Bucket& b) {
  if (b.used == 0) return Status::Ok();
  const size_t elem = DTypeSize(dtype_);
  // The bucket was written by kernels on the compute stream: the collective reads it only
  // after they ran (a stream wait on a device-ordered lane, else a host wait).
  STRATA_ASSIGN_OR_RETURN(EventId written, options_.device->Record(kComputeStream));
  const comm::DType type = ToCommDType(dtype_);
  CollectiveLane::IssueFn issue;
  if (options_.reduce_scatter) {
    std::vector<comm::ScatterItem> items;
    size_t out = 0;
    for (const Slot& s : b.slots) {
      const GroupLayout& layout = partition_->groups[static_cast<size_t>(s.group)];
      std::byte* in = b.data.data() + s.offset * elem;
      // Without outputs (one rank): in place, the communicators allow the output to alias
      // its block.
      items.push_back({in, ShardOutputs(*partition_, options_) ? b.shards.data() + out * elem : in,
                       layout.padded_numel});
      out += layout.shard_numel;
    }
    issue = [items = std::move(items), type](comm::Communicator& c) {
      return c.ReduceScatterCoalescedAsync(items, type, comm::ReduceOp::kAvg);
    };
    ++stats_.reduce_scatter_calls;
    stats_.reduce_scatter_bytes += b.used * elem;
  } else {
    issue = [data = b.data.data(), n = b.used, type](comm::Communicator& c) {
      return c.AllReduceAsync(data, n, type, comm::ReduceOp::kAvg);
    };
    ++stats_.all_reduce_calls;
    stats_.all_reduce_bytes += b.used * elem;
  }
  LaneCollective issued;
  {
    TimedScope waited(stats_.compute_wait_s, options_.timeline, "compute before reduction wait",
                      TimelineLane::kWait);
    STRATA_ASSIGN_OR_RETURN(issued, lane_->Issue(written, HostWait::kBucketInputs, std::move(issue),
                                                 options_.test.skip_compute_wait));
  }
  b.work = std::move(issued.work);
  b.done = issued.done;
  ++stats_.buckets_reduced;
  b.issued = Timeline::Clock::now();
  // The groups of this bucket start afresh: their next gradients open a new slot.
  for (const Slot& s : b.slots) {
    slot_offset_[static_cast<size_t>(s.group)] = -1;
    std::fill(received_[static_cast<size_t>(s.group)].begin(),
              received_[static_cast<size_t>(s.group)].end(), false);
    received_count_[static_cast<size_t>(s.group)] = 0;
  }
  if (thread_.joinable()) {
    // The reducer's thread waits for the reduction, copies the shards to the host and
    // adds them, while this thread goes on with the backward.
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Slot& s : b.slots)
        ++queued_slots_[static_cast<size_t>(s.group)];
      b.queued = true;
      queue_.push_back(&b);
    }
    cv_.notify_all();
  }
  return Status::Ok();
}

// One Complete call's state, handed from phase to phase.
struct GradientReducer::Completion {
  // What becomes of a slot's reduced shard (accumulate_on_device: docs/engine.md,
  // "Gradient accumulation on the device").
  enum class Way : uint8_t {
    kHost,    // copied to the host as it is and added there
    kDevice,  // added into the device accumulators; nothing goes to the host
    kDrain,   // added there, and the group's sum copied to the host (fp32)
  };
  // A part of the host's share that fits the staging buffer.
  struct Piece {
    size_t slot, out, begin, n;  // elements [begin, begin + n) of slot `slot`'s shard
    bool sum;                    // the group's fp32 sum (else the reduced shard as it is)
    size_t staged = 0;           // its bytes' place in the staging buffer
    EventId copied;
  };

  Bucket& b;
  // On the reducer's thread (accumulate_in_background) the waits are beside the backward:
  // they are counted apart from the engine's thread's.
  bool background;
  // On a device-ordered lane the copies to the host wait for the reduction on the device
  // and the host waits for the copies only; the reduction's status is checked before any
  // shard is added. Otherwise (a host lane, or shards added where they are) the host waits
  // for the reduction first.
  bool on_device;
  double reduce_wait_s = 0, copy_wait_s = 0, accumulate_s = 0;
  std::vector<Way> ways{};              // per slot
  std::vector<Piece> pieces{};          // the host's share, in slot order
  bool to_host = false;                 // some piece goes to the host
  size_t staged_end = 0;                // the first piece not in the staging buffer
  uint64_t refills = 0;                 // rounds of copies after the first
  Timeline::Clock::time_point began{};  // when the host's additions began
};

// Waits for a bucket's reduction and accumulates its reduced shards, in phases: the
// reduction ordered before the copies (or waited for), each slot's way chosen, the
// device's additions queued and the host's share cut into pieces, the first round of
// pieces copied, the reduction's status checked, the pieces added on the host round by
// round (or the shards added where they are), then the counters. On error the Work stays:
// waiting again returns the same error.
Status GradientReducer::Complete(Bucket& b) {
  if (!b.work) return Status::Ok();
  Completion c{.b = b,
               .background = thread_.joinable(),
               .on_device = options_.shards_to_host && b.done.valid()};
  STRATA_RETURN_IF_ERROR(OrderAfterReduction(c));
  ChooseWays(c);
  STRATA_RETURN_IF_ERROR(PlanPieces(c));
  STRATA_ASSIGN_OR_RETURN(c.staged_end, StagePieces(c, 0));
  STRATA_RETURN_IF_ERROR(CheckReduction(c));
  EndReduction(c);
  if (options_.test.before_adding_shards && !b.slots.empty()) {
    options_.test.before_adding_shards(b.slots.front().group);
  }
  Status added = AddPieces(c);
  if (added.ok() && !options_.shards_to_host) added = AddInPlace(b);
  return FinishCompletion(c, added);
}

// Where slot `s`'s reduced shard is (`out`: the shard's elements into the bucket's
// reduce-scatter output, the slots before it).
const std::byte* GradientReducer::ReducedShard(const Bucket& b, const Slot& s, size_t out) const {
  const size_t elem = DTypeSize(dtype_);
  const GroupLayout& layout = partition_->groups[static_cast<size_t>(s.group)];
  return ShardOutputs(*partition_, options_)
             ? b.shards.data() + out * elem
             : b.data.data() + (s.offset + layout.shard_begin(partition_->rank)) * elem;
}

// The host waits for the bucket's reduction (timed) and returns its status.
Status GradientReducer::WaitReduction(Completion& c) {
  TimedScope waited(c.reduce_wait_s, c.background ? nullptr : options_.timeline, "reduction wait",
                    TimelineLane::kWait);
  Status st = c.b.work->Wait();
  return st.ok() ? st : Failed(c.b, st);
}

// Complete's first phase: the copy stream ordered after the reduction on the device, or
// (not device-ordered) the host waits for it.
Status GradientReducer::OrderAfterReduction(Completion& c) {
  if (!c.on_device) return WaitReduction(c);
  if (options_.test.skip_reduction_wait) return Status::Ok();
  return lane_->OrderBefore(LaneCollective{c.b.work, c.b.done}, options_.copy_stream,
                            /*host_reads=*/false);
}

// Each slot's way: all to the host, but with accumulate_on_device, where off a boundary
// (or with the optimizer's device sums) the shard stays in the device accumulators, and on
// a boundary a group's first shard is added there and its sum drained to the host.
void GradientReducer::ChooseWays(Completion& c) {
  using Way = Completion::Way;
  const Bucket& b = c.b;
  const bool boundary = boundary_.load(std::memory_order_relaxed);
  c.ways.assign(b.slots.size(), Way::kHost);
  if (!options_.accumulate_on_device) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < b.slots.size(); ++i) {
    const size_t g = static_cast<size_t>(b.slots[i].group);
    if (options_.device_sums != nullptr) {
      c.ways[i] = Way::kDevice;  // the optimizer reads the sums on the device
    } else if (!boundary) {
      c.ways[i] = Way::kDevice;
      dirty_[g] = 1;
    } else if (drained_[g] == 0) {
      c.ways[i] = Way::kDrain;
      drained_[g] = 1;
      dirty_[g] = 0;
    }
  }
}

// With shards_to_host: the device's additions queued on the copy stream, then the host's
// share cut into pieces that fit the staging buffer, in slot order: each piece is copied
// device -> pinned host with an event after it and added once its own copy is done, while
// the next ones are still copying. A group's fp32 sum takes twice a 16-bit shard's bytes:
// what does not fit goes in a later round, once the host has added what the buffer held.
Status GradientReducer::PlanPieces(Completion& c) {
  if (!options_.shards_to_host) return Status::Ok();
  using Way = Completion::Way;
  Bucket& b = c.b;
  const size_t elem = DTypeSize(dtype_);
  size_t out = 0;
  uint64_t copies = 0, bytes = 0, added = 0, drains = 0;
  for (size_t i = 0; i < b.slots.size(); ++i) {
    const size_t g = static_cast<size_t>(b.slots[i].group);
    const size_t n = partition_->groups[g].shard_numel;
    if (c.ways[i] != Way::kHost) {
      // fp32 += the shard: the host's addition, on the device (one rounding, no contraction).
      STRATA_RETURN_IF_ERROR(options_.device->ConvertAsync(
          acc_ + partition_->shard_offset[g] * sizeof(float), DType::kFloat32,
          ReducedShard(b, b.slots[i], out), dtype_, n, /*accumulate=*/true, options_.copy_stream));
      ++added;
    }
    if (c.ways[i] != Way::kDevice) {
      const bool sum = c.ways[i] == Way::kDrain;
      const size_t per = sum ? sizeof(float) : elem;
      const size_t most = std::max<size_t>(1, b.staging.size() / per);
      const size_t base = partition_->shard_offset[g];
      const size_t align = options_.piece_align_elems;
      for (size_t at = 0, count = 0; at < n; at += count) {
        count = PieceElems(base + at, n - at, most, align);
        c.pieces.push_back({i, out, at, count, sum, 0, EventId{}});
      }
      ++copies;
      bytes += n * per;
      drains += sum ? 1 : 0;
      c.to_host = true;
    }
    out += n;
  }
  if (added > 0) {
    // The bucket is written again only after the additions read it.
    STRATA_ASSIGN_OR_RETURN(b.added, options_.device->Record(options_.copy_stream));
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.shard_copies += copies;
  stats_.shard_copy_bytes += bytes;
  stats_.shards_added_on_device += added;
  stats_.accumulated_copies += drains;
  return Status::Ok();
}

// Copies pieces [first, ...) to the staging buffer while they fit (a drained group's
// accumulators zeroed behind its sum's last copy); returns the first piece left.
Result<size_t> GradientReducer::StagePieces(Completion& c, size_t first) {
  Bucket& b = c.b;
  const size_t elem = DTypeSize(dtype_);
  size_t used = 0, k = first;
  for (; k < c.pieces.size(); ++k) {
    Completion::Piece& p = c.pieces[k];
    const size_t g = static_cast<size_t>(b.slots[p.slot].group);
    const size_t per = p.sum ? sizeof(float) : elem;
    const size_t at = p.sum ? (used + sizeof(float) - 1) / sizeof(float) * sizeof(float) : used;
    if (k > first && at + p.n * per > b.staging.size()) break;
    std::byte* acc = acc_ + partition_->shard_offset[g] * sizeof(float);
    const std::byte* src = p.sum ? acc + p.begin * sizeof(float)
                                 : ReducedShard(b, b.slots[p.slot], p.out) + p.begin * elem;
    STRATA_RETURN_IF_ERROR(options_.device->CopyAsync(
        b.staging.data() + at, src, p.n * per, CopyKind::kDeviceToHost, options_.copy_stream));
    STRATA_ASSIGN_OR_RETURN(p.copied, options_.device->Record(options_.copy_stream));
    if (p.sum && p.begin + p.n == partition_->groups[g].shard_numel) {
      // The group's next step starts from zero; queued behind its sum's last copy.
      STRATA_RETURN_IF_ERROR(options_.device->ZeroAsync(
          acc, partition_->groups[g].shard_numel * sizeof(float), options_.copy_stream));
    }
    p.staged = at;
    used = at + p.n * per;
  }
  return k;
}

// Device-ordered: the reduction is done on the device by now or soon (the copies wait for
// it). When the host reads what it wrote, its status is checked here, with that of the
// earlier micro-steps' reductions whose sums the host now reads; when nothing reaches the
// host, at the boundary.
Status GradientReducer::CheckReduction(Completion& c) {
  if (!c.on_device) return Status::Ok();
  if (c.to_host || !options_.accumulate_on_device) {
    STRATA_RETURN_IF_ERROR(WaitReduction(c));
    return CheckDeferred();
  }
  std::lock_guard<std::mutex> lock(mu_);
  deferred_.push_back(c.b.work);
  return Status::Ok();
}

// The reduction is over: its span on the timeline's comm lane (from its issue), its wait
// counted (on the engine's thread), and the bucket lets go of it.
void GradientReducer::EndReduction(Completion& c) {
  Bucket& b = c.b;
  if (options_.timeline != nullptr && options_.timeline->enabled()) {
    std::string name = options_.reduce_scatter ? "reduce-scatter" : "all-reduce";
    for (const Slot& s : b.slots)
      name += " " + partition_->groups[static_cast<size_t>(s.group)].name;
    options_.timeline->Add(std::move(name), TimelineLane::kComm, b.issued, Timeline::Clock::now(),
                           b.slots.size() == 1 ? b.slots[0].group : -1);
  }
  if (!c.background) stats_.reduce_wait_s += c.reduce_wait_s;
  b.work.reset();
  b.done = EventId{};
}

// The host's additions: each piece, once its copy is done, given to the AccumulateFn; when
// every piece the staging buffer held is added, the next round is copied.
Status GradientReducer::AddPieces(Completion& c) {
  Bucket& b = c.b;
  Status added;
  c.began = Timeline::Clock::now();
  for (size_t k = 0; k < c.pieces.size() && added.ok(); ++k) {
    const Completion::Piece& p = c.pieces[k];
    if (k == c.staged_end) {
      // Every piece the buffer held is added: the next round.
      Result<size_t> end = StagePieces(c, k);
      if (!end.ok()) {
        added = end.status();
        break;
      }
      c.staged_end = *end;
      ++c.refills;
    }
    if (!options_.test.skip_shard_wait) {
      TimedScope waited(c.copy_wait_s, c.background ? nullptr : options_.timeline,
                        "reduced-shard copy wait", TimelineLane::kWait);
      added = options_.device->Synchronize(p.copied, HostWait::kGradientShards);
      if (!added.ok()) break;
    }
    const size_t g = static_cast<size_t>(b.slots[p.slot].group);
    const Timeline::Clock::time_point add_began = Timeline::Clock::now();
    {
      // The engine's thread may use what the AccumulateFn reaches between two pieces.
      std::unique_lock<std::mutex> held;
      if (c.background) held = std::unique_lock<std::mutex>(accumulate_mu_);
      added = accumulate_(partition_->shard_offset[g] + p.begin, b.staging.data() + p.staged,
                          p.sum ? DType::kFloat32 : dtype_, p.n);
    }
    c.accumulate_s += std::chrono::duration<double>(Timeline::Clock::now() - add_began).count();
  }
  return added;
}

// Without shards_to_host: the accumulators are on the device tier, host-addressable, and
// each slot's reduced shard is added where it is.
Status GradientReducer::AddInPlace(const Bucket& b) {
  Status added;
  size_t out = 0;
  for (size_t i = 0; i < b.slots.size() && added.ok(); ++i) {
    const Slot& s = b.slots[i];
    const GroupLayout& layout = partition_->groups[static_cast<size_t>(s.group)];
    added = accumulate_(partition_->shard_offset[static_cast<size_t>(s.group)],
                        ReducedShard(b, s, out), dtype_, layout.shard_numel);
    out += layout.shard_numel;
  }
  return added;
}

// Complete's last phase: the counters and the additions' span (on the reducer's thread),
// then the bucket emptied, or (on the reducer's thread) left for RunAccumulations to give
// back to the engine's thread.
Status GradientReducer::FinishCompletion(Completion& c, const Status& added) {
  Bucket& b = c.b;
  if (c.refills > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.staging_refills += c.refills;
  }
  if (!c.background) stats_.shard_copy_wait_s += c.copy_wait_s;
  if (c.background && c.to_host && options_.timeline != nullptr && options_.timeline->enabled()) {
    // From the first slot's addition to the last's, the waits for later slots' copies in it.
    std::string name = "add reduced shards";
    for (const Slot& s : b.slots)
      name += " " + partition_->groups[static_cast<size_t>(s.group)].name;
    options_.timeline->Add(std::move(name), TimelineLane::kOptimizer, c.began,
                           Timeline::Clock::now(), b.slots.size() == 1 ? b.slots[0].group : -1);
  }
  STRATA_RETURN_IF_ERROR(added);
  if (c.background) {
    // The bucket goes back to the engine's thread in RunAccumulations.
    std::lock_guard<std::mutex> lock(mu_);
    if (c.to_host) ++stats_.buckets_accumulated_in_background;
    stats_.background_accumulate_s += c.accumulate_s;
    return Status::Ok();
  }
  b.slots.clear();
  b.used = 0;
  return Status::Ok();
}

Status GradientReducer::CheckDeferred() {
  std::vector<comm::WorkPtr> works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    works = deferred_;
  }
  if (works.empty()) return Status::Ok();
  for (const comm::WorkPtr& w : works) {
    Status st = w->Wait();
    // Kept: the next check returns the same error.
    if (!st.ok()) return st.WithContext("gradient reduction (an earlier micro-step's)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  deferred_.erase(deferred_.begin(), deferred_.begin() + static_cast<long>(works.size()));
  return Status::Ok();
}

Status GradientReducer::DrainUntouched() {
  // The groups whose sums are still on the device (no gradient in this backward), in
  // partition order, through the first bucket's staging buffer, as many elements at a time
  // as it holds.
  Bucket& b = buckets_.front();
  const size_t most = std::max<size_t>(1, b.staging.size() / sizeof(float));
  const size_t align = options_.piece_align_elems;
  for (size_t g = 0; g < dirty_.size(); ++g) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (dirty_[g] == 0 || drained_[g] != 0) continue;
    }
    const size_t n = partition_->groups[g].shard_numel;
    std::byte* acc = acc_ + partition_->shard_offset[g] * sizeof(float);
    const size_t base = partition_->shard_offset[g];
    for (size_t at = 0, count = 0; at < n; at += count) {
      count = PieceElems(base + at, n - at, most, align);
      STRATA_RETURN_IF_ERROR(options_.device->CopyAsync(
          b.staging.data(), acc + at * sizeof(float), count * sizeof(float),
          CopyKind::kDeviceToHost, options_.copy_stream));
      STRATA_ASSIGN_OR_RETURN(EventId copied, options_.device->Record(options_.copy_stream));
      if (at + count == n) {
        STRATA_RETURN_IF_ERROR(
            options_.device->ZeroAsync(acc, n * sizeof(float), options_.copy_stream));
      }
      {
        double waited_s = 0;
        TimedScope waited(waited_s, options_.timeline, "reduced-shard copy wait",
                          TimelineLane::kWait);
        STRATA_RETURN_IF_ERROR(options_.device->Synchronize(copied, HostWait::kGradientShards));
        stats_.shard_copy_wait_s += waited_s;
      }
      STRATA_RETURN_IF_ERROR(
          accumulate_(partition_->shard_offset[g] + at, b.staging.data(), DType::kFloat32, count));
      if (at > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        ++stats_.staging_refills;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    dirty_[g] = 0;
    drained_[g] = 1;
    ++stats_.shard_copies;
    stats_.shard_copy_bytes += n * sizeof(float);
    ++stats_.accumulated_copies;
  }
  return Status::Ok();
}

Status GradientReducer::Failed(Bucket& b, const Status& st) {
  // On error the Work stays: waiting again returns the same error.
  b.failed = true;
  return st.WithContext("gradient reduction");
}

Status GradientReducer::Flush() {
  // The parked gradients' groups get their slots, in the order they were first parked.
  while (!parked_.empty()) {
    STRATA_RETURN_IF_ERROR(OpenSlot(static_cast<size_t>(parked_.front().group), false));
  }
  // The groups that came interleaved in this backward park from the next one on.
  for (size_t g = 0; g < may_park_.size(); ++g)
    may_park_[g] = static_cast<char>(may_park_[g] | interleaved_[g]);
  std::fill(interleaved_.begin(), interleaved_.end(), 0);
  std::fill(last_arrival_.begin(), last_arrival_.end(), 0);
  arrivals_ = 0;
  STRATA_RETURN_IF_ERROR(Launch(buckets_[current_]));
  if (thread_.joinable()) {
    STRATA_RETURN_IF_ERROR(WaitAccumulations());
  } else {
    // Complete in issue order: the other bucket's reduction was issued first.
    for (size_t i = 1; i <= buckets_.size(); ++i) {
      STRATA_RETURN_IF_ERROR(Complete(buckets_[(current_ + i) % buckets_.size()]));
    }
  }
  current_ = 0;
  if (!options_.accumulate_on_device) return Status::Ok();
  // The next backward writes the buckets after their additions into the device
  // accumulators read them.
  for (Bucket& b : buckets_) {
    if (!b.added.valid()) continue;
    const EventId added = b.added;
    b.added = EventId{};
    if (!options_.test.skip_accumulator_wait) {
      STRATA_RETURN_IF_ERROR(options_.device->Wait(kComputeStream, added));
    }
  }
  if (!boundary_.load(std::memory_order_relaxed)) return Status::Ok();
  if (options_.device_sums == nullptr) STRATA_RETURN_IF_ERROR(DrainUntouched());
  STRATA_RETURN_IF_ERROR(CheckDeferred());
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(drained_.begin(), drained_.end(), uint8_t{0});
  return Status::Ok();
}

}  // namespace strata::engine

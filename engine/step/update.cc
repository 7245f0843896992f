// The pipelined update: Step() returns with CPU-Adam running group by group on a worker
// thread, in the order the next forward needs them (optimizer_driver.h, docs/engine.md "The
// pipelined step").
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/step/driver_internal.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/engine/timeline/elapsed.h"
#include "strata/swap/crc32c.h"
namespace strata::engine {

using namespace driver_internal;  // NOLINT(google-build-using-namespace): the driver's own

Result<std::unique_ptr<OptimizerDriver::Update>> OptimizerDriver::NewUpdate(
    std::vector<AdamParams> params, GradScaling scaling, bool early, bool keep_shards,
    bool copy_out_first) {
  auto u = std::make_unique<Update>();
  u->keep_shards = keep_shards;
  u->copy_out_first = keep_shards && copy_out_first;
  u->began = Timeline::Clock::now();
  u->params = std::move(params);
  u->scaling = scaling;
  u->early = early;
  u->streamed = store_->can_fail();
  u->next_step = adam_step() + 1;
  const auto groups = static_cast<size_t>(partition_->groups.size());
  u->by_group.resize(groups);
  u->sub_items.assign(num_chunks_, 0);
  for (size_t i = 0; i < num_chunks_; ++i) {
    for (const Run& r : chunk_runs_[i]) {
      u->by_group[static_cast<size_t>(working_->GroupAt(r.offset))].push_back({i, r});
      ++u->sub_items[i];
      ++u->items;
    }
  }
  if (early) u->tiles = NewTileNorms();
  u->lazy.assign(num_chunks_, 0);
  for (size_t i = 0; i < num_chunks_; ++i)
    u->lazy[i] = LazyZero() && acc_zeros_[i].zeroed ? 1 : 0;
  // Every chunk leased now, on this thread (a store is not thread-safe): the worker then
  // touches memory only. Host stores: a lease is a pointer. Streamed (NVMe): the worker
  // takes the store over instead, writing released chunks behind as Step does.
  // The device's sums are not leased here: the worker copies each sub-group's to the host
  // when it first needs it and gives it back (zeroing the sums on the device) after its
  // last run, so the host holds the sums of a sub-group or two, not all of them.
  const Access kAccess[4] = {Access::kReadWrite, Access::kReadWrite, Access::kReadWrite,
                             sums_ != nullptr ? kSkip : Access::kReadWrite};
  u->sub.reserve(num_chunks_);
  u->shards.resize(groups);
  if (u->streamed) {
    u->store_stats = store_->stats();
    store_->SetWriteBehind(true);
  }
  for (size_t i = 0; i < num_chunks_ && !u->streamed; ++i) {
    Result<Leases> l = AcquireSubGroup(i, kAccess);
    if (!l.ok()) {
      Status s = ReleaseAll(u->sub, u->shards);
      return l.status().WithContext("starting the pipelined optimizer step");
    }
    u->sub.push_back(std::move(*l));
  }
  u->sums_zeroed.assign(num_chunks_, 0);
  u->given.assign(groups, 0);
  u->done.assign(groups, 0);
  u->staged.resize(groups);
  u->handed.assign(groups, 0);
  u->stage_buf.assign(groups, -1);
  u->crc_layout.resize(groups);
  u->crcs.resize(groups);
  u->stage_bytes = keep_shards ? 0 : StagingBytes();
  for (size_t g = 0; g < groups; ++g) {
    u->staged[g] = !keep_shards && ShardStaged(static_cast<int>(g)) ? 1 : 0;
    // (Asked here: a store is the engine's thread's.)
    if (u->staged[g] != 0) u->crc_layout[g] = working_->write_checksums(static_cast<int>(g));
  }
  if (u->stage_bytes > 0) {
    u->stage_cap = std::max<size_t>(1, StagedShardBuffers());
    // The buffers of the last update, if they are the size this one needs.
    for (offload::StateMemory& m : staging_pool_) {
      if (m.size != u->stage_bytes) continue;
      u->free_bufs.push_back(static_cast<int>(u->pool.size()));
      u->pool.push_back(std::move(m));
    }
  }
  staging_pool_.clear();
  Update* raw = u.get();
  u->worker = std::thread([this, raw] { RunUpdate(*raw); });
  return u;
}

Status OptimizerDriver::Give(Update& u, int group) {
  const auto g = static_cast<size_t>(group);
  if (group < 0 || g >= u.given.size() || u.given[g] != 0) return Status::Ok();
  if ((!u.keep_shards || u.copy_out_first) && working_->has(group) && u.staged[g] == 0) {
    STRATA_ASSIGN_OR_RETURN(u.shards[g], working_->Acquire(group, Access::kReadWrite));
  }
  // The worker reads the group's gradients from now on.
  if (!u.streamed) {
    MaterializeGroupZeros(
        group, [&u](size_t i) { return u.sub[i].span(OptimizerState::kGradAccumulator); });
  }
  u.given[g] = 1;
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.queue.push_back(group);
  }
  u.cv.notify_all();
  return Status::Ok();
}

void OptimizerDriver::CloseUpdate(Update& u) {
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.closed = true;
  }
  u.cv.notify_all();
}

std::span<float> OptimizerDriver::LeasedAccumulator(size_t i) {
  if (update_ == nullptr) return norm_ahead_->acc[i].as<float>();
  return update_->sub[i].span(OptimizerState::kGradAccumulator);
}

Result<std::byte*> OptimizerDriver::ShardOut(Update& u, int group) {
  const auto g = static_cast<size_t>(group);
  if (u.staged[g] == 0) return u.shards[g].data();
  std::unique_lock<std::mutex> lock(u.mu);
  for (int& b = u.stage_buf[g]; b < 0;) {
    if (u.abort) return static_cast<std::byte*>(nullptr);
    if (!u.free_bufs.empty()) {
      b = u.free_bufs.back();
      u.free_bufs.pop_back();
      break;
    }
    if (u.pool.size() < u.stage_cap || u.ready.empty()) {
      // Below the count, or every buffer is a group's still being updated: one more (no
      // hand-over could free one).
      lock.unlock();
      Result<offload::StateMemory> m = NewStagingBuffer(options_.staging_allocator, u.stage_bytes);
      lock.lock();
      if (!m.ok()) return m.status().WithContext("a staging buffer for the new parameters");
      b = static_cast<int>(u.pool.size());
      u.pool.push_back(*std::move(m));
      break;
    }
    u.starved = true;  // the engine's thread hands a group over (or the update is aborted)
    u.cv.notify_all();
    u.cv.wait(lock);
    u.starved = false;
  }
  return u.pool[static_cast<size_t>(u.stage_buf[g])].data;
}

void OptimizerDriver::HandOver(Update& u, int group) {
  const auto g = static_cast<size_t>(group);
  if (u.staged[g] == 0 || u.handed[g] != 0) return;
  u.handed[g] = 1;
  int b = -1;
  offload::StateMemory mem;
  std::vector<uint32_t> crcs;  // empty: the store computes them
  {
    // (The buffer is this group's, done by the worker; the pool may grow meanwhile.)
    std::lock_guard<std::mutex> lock(u.mu);
    b = u.stage_buf[g];
    if (b >= 0) mem = std::move(u.pool[static_cast<size_t>(b)]);
    crcs = std::move(u.crcs[g]);
  }
  if (b < 0) return;  // not written (the update failed before it)
  {
    TimedScope copied(stats_.shard_handover_s, options_.timeline, "updated shard to its store",
                      TimelineLane::kWait, group);
    // The whole shard is written: the store reads nothing, and writes it behind. A store
    // with buffers takes the staging buffer itself and gives one of its own back (sized
    // alike: StagingBytes); else a copy.
    Status st;
    if (ExchangesInto(group, mem)) {
      st = working_->Exchange(group, mem, crcs);
      if (st.ok()) ++stats_.shard_handovers_exchanged;
      if (st.ok() && !crcs.empty()) ++stats_.shard_handovers_checksummed;
    } else {
      Result<offload::StateLease> l = working_->Acquire(group, Access::kWrite);
      st = l.status();
      if (l.ok()) {
        std::memcpy(l->data(), mem.data, working_->bytes(group));
        st = l->Release();
      }
    }
    if (!st.ok() && u.handover_error.ok()) {
      u.handover_error = st.WithContext("writing the new working shard of " +
                                        partition_->groups[g].name + " to its store");
    }
  }
  ++stats_.shard_handovers;
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.pool[static_cast<size_t>(b)] = std::move(mem);
    u.stage_buf[g] = -1;
    u.free_bufs.push_back(b);
  }
  u.cv.notify_all();
}

void OptimizerDriver::HandOverReady(Update& u) {
  for (;;) {
    int g = -1;
    {
      std::lock_guard<std::mutex> lock(u.mu);
      if (u.ready.empty()) return;
      g = u.ready.front();
      u.ready.pop_front();
    }
    HandOver(u, g);
  }
}

bool OptimizerDriver::ExchangesInto(int group, const offload::StateMemory& buffer) const {
  const size_t store_buffer = working_->store_of(group)->buffer_bytes();
  return store_buffer > 0 && buffer.size >= store_buffer &&
         IsAligned(reinterpret_cast<uintptr_t>(buffer.data), 4096);
}

size_t OptimizerDriver::StagingBytes() const {
  size_t bytes = 0;
  for (int g = 0; g < static_cast<int>(partition_->groups.size()); ++g) {
    if (ShardStaged(g)) {
      // As large as the store's buffers, so that one can be exchanged for the other.
      bytes = std::max({bytes, working_->bytes(g), working_->store_of(g)->buffer_bytes()});
    }
  }
  return bytes;
}

Status OptimizerDriver::ReserveStaging() {
  const size_t bytes = StagingBytes();
  if (bytes == 0) return Status::Ok();
  const size_t count = std::max<size_t>(1, StagedShardBuffers());
  while (staging_pool_.size() < count) {
    Result<offload::StateMemory> m = NewStagingBuffer(options_.staging_allocator, bytes);
    if (!m.ok()) {
      return m.status().WithContext("the pipelined step's " + std::to_string(count) +
                                    " staging buffers for new working shards (" +
                                    FormatBytes(bytes) + " each, the largest shard on NVMe)");
    }
    staging_pool_.push_back(*std::move(m));
  }
  return Status::Ok();
}

Result<StepOutcome> OptimizerDriver::StartStep(double lr, LossScaler& scaler,
                                               std::optional<std::pair<double, double>> betas,
                                               const std::vector<int>& group_order,
                                               bool keep_shards, bool copy_out_first) {
  if (!CanPipeline()) {
    return FailedPreconditionError(
        "the optimizer step cannot be pipelined (LAMB, or working shards on NVMe)");
  }
  if (update_ != nullptr) {
    return FailedPreconditionError("StartStep while a pipelined update is in flight");
  }
  if (keep_shards && can_fail()) {
    return FailedPreconditionError(
        "a delayed update (keep_shards) with a store that can fail (NVMe) is not supported");
  }
  const Timeline::Clock::time_point t0 = Timeline::Clock::now();
  StepOutcome out;
  GradScaling scaling;
  STRATA_ASSIGN_OR_RETURN(const bool update, TimedPrepare(lr, scaler, out, scaling));
  if (!update || partition_->partition_numel == 0) {
    if (!update) return out;  // skipped and committed
    return Finish(out, Status::Ok(), 0, adam_step() + 1);
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<AdamParams> params, AdamParamsAt(lr, betas));
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<Update> u,
      NewUpdate(std::move(params), scaling, /*early=*/false, keep_shards, copy_out_first));
  u->began = t0;
  u->lr = lr;
  // The order: the groups as asked, then the rest (each group's runs in partition order).
  const int groups = static_cast<int>(partition_->groups.size());
  Status given;
  for (int g : group_order) {
    if (given.ok()) given = Give(*u, g);
  }
  for (int g = 0; g < groups && given.ok(); ++g)
    given = Give(*u, g);
  if (!given.ok()) {
    AbortUpdate(*u);
    if (u->streamed) store_->SetWriteBehind(false);
    return given.WithContext("starting the pipelined optimizer step");
  }
  CloseUpdate(*u);
  out.applied = true;
  out.adam_step = u->next_step;
  // Counted now (FinishUpdate takes the count back if the update fails): statistics read
  // while the update runs already include the step.
  u->counted = true;
  ++stats_.steps_applied;
  ++stats_.steps_pipelined;
  if (u->copy_out_first) ++stats_.delayed_copy_outs;
  stats_.adam_calls += u->items;
  stats_.elements_updated += partition_->partition_numel;
  stats_.params_updated += real_shard_elems_;
  update_ = std::move(u);
  return out;
}

void OptimizerDriver::GroupDone(Update& u, int group) {
  const auto g = static_cast<size_t>(group);
  std::vector<uint32_t> crcs = ShardChecksums(u, group);
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.done[g] = 1;
    if (u.staged[g] != 0) {
      u.crcs[g] = std::move(crcs);
      u.ready.push_back(group);
    }
  }
  u.cv.notify_all();
  if (options_.test.on_group_updated) options_.test.on_group_updated(group);
}

std::vector<uint32_t> OptimizerDriver::ShardChecksums(Update& u, int group) {
  const auto g = static_cast<size_t>(group);
  const offload::StateStore::WriteChecksums& w = u.crc_layout[g];
  if (u.staged[g] == 0 || w.block_bytes == 0) return {};
  const std::byte* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(u.mu);
    const int b = u.stage_buf[g];
    if (b < 0) return {};  // nothing was written (the group had nothing to update)
    const offload::StateMemory& mem = u.pool[static_cast<size_t>(b)];
    // A copied hand-over writes through a lease: the store computes the CRCs.
    if (!ExchangesInto(group, mem)) return {};
    data = mem.data;
  }
  // The group's whole write (its shard and the buffer's bytes past it, which nobody writes
  // until the store's write ended), one block per tile of CPU-Adam's threads, while the
  // shard's last lines are still in cache.
  const Timeline::Clock::time_point began = Timeline::Clock::now();
  std::vector<uint32_t> crcs(w.blocks());
  {
    AddElapsed timed(u.checksum_s);
    cpu_adam_->ForEachTile(crcs.size() * CpuAdam::kTileElems, [&](size_t b, size_t e) {
      for (size_t k = b / CpuAdam::kTileElems;
           k < (e + CpuAdam::kTileElems - 1) / CpuAdam::kTileElems; ++k) {
        const size_t at = k * w.block_bytes;
        crcs[k] = swap::Crc32c({data + at, std::min(w.block_bytes, w.io_bytes - at)});
      }
    });
  }
  u.spans.push_back({group, began, Timeline::Clock::now(), 0, /*checksums=*/true});
  return crcs;
}

Status OptimizerDriver::RunStreamedUpdate(Update& u) {
  // The groups, every one given before the worker starts on them (StartStep closes at once).
  std::vector<int> groups;
  {
    std::unique_lock<std::mutex> lock(u.mu);
    u.cv.wait(lock, [&] { return u.closed || u.abort; });
    if (u.abort) return Status::Ok();
    groups.assign(u.queue.begin(), u.queue.end());
    u.queue.clear();
  }
  // The sub-groups in the order the groups need them (each group's when its turn comes),
  // and per group the sub-groups it waits for (its items are in partition order).
  std::vector<size_t> order;
  std::vector<uint8_t> seen(num_chunks_, 0);
  std::vector<size_t> left(u.by_group.size(), 0);
  for (int g : groups) {
    size_t last = num_chunks_;
    for (const Update::Item& it : u.by_group[static_cast<size_t>(g)]) {
      if (it.sub_group == last) continue;
      last = it.sub_group;
      ++left[static_cast<size_t>(g)];
      if (seen[it.sub_group] != 0) continue;
      seen[it.sub_group] = 1;
      order.push_back(it.sub_group);
    }
  }
  for (int g : groups) {
    if (left[static_cast<size_t>(g)] == 0) GroupDone(u, g);  // nothing to update
  }
  // As Step's: read `ahead` sub-groups ahead, the accumulators read only (zeroed after).
  constexpr Access kAccess[4] = {Access::kReadWrite, Access::kReadWrite, Access::kReadWrite,
                                 Access::kRead};
  const size_t elem = DTypeSize(dtype_);
  const size_t ahead = options_.prefetch_ahead;
  for (size_t k = 0; k < std::min(ahead, order.size()); ++k)
    PrefetchSubGroup(order[k], kAccess);
  for (size_t at = 0; at < order.size(); ++at) {
    {
      std::lock_guard<std::mutex> lock(u.mu);
      if (u.abort) return Status::Ok();
    }
    const size_t i = order[at];
    const Timeline::Clock::time_point began = Timeline::Clock::now();
    STRATA_ASSIGN_OR_RETURN(Leases l, AcquireSubGroup(i, kAccess));
    if (ahead > 0 && at + ahead < order.size()) PrefetchSubGroup(order[at + ahead], kAccess);
    if (options_.test.on_update) options_.test.on_update(i, true);
    std::vector<int> touched;  // the groups of the sub-group's runs, each once (contiguous)
    for (const Run& r : chunk_runs_[i]) {
      const int g = working_->GroupAt(r.offset);
      std::byte* to = nullptr;  // a delayed update writes no working shard
      if (!u.keep_shards) {
        STRATA_ASSIGN_OR_RETURN(std::byte * out, ShardOut(u, g));
        if (out == nullptr) return Status::Ok();  // aborted
        to = out + (r.offset - working_->offset(g)) * elem;
      }
      {
        AddElapsed timed(u.adam_s);
        STRATA_RETURN_IF_ERROR(
            AdamRun(l, i, r, to, u.params[static_cast<size_t>(r.group)], u.next_step, u.scaling));
      }
      if (touched.empty() || touched.back() != g) touched.push_back(g);
    }
    if (options_.test.on_update) options_.test.on_update(i, false);
    for (offload::StateLease& lease : l.l)
      STRATA_RETURN_IF_ERROR(lease.Release());
    // The gradients are spent: zeroed without a write (a failed step rolls them back).
    STRATA_RETURN_IF_ERROR(StoreFor(OptimizerState::kGradAccumulator)
                               ->ZeroChunk(StateRange{id(OptimizerState::kGradAccumulator), i}));
    acc_norm_[i] = ChunkNorm{true, 0.0, false};
    u.spans.push_back({-1, began, Timeline::Clock::now(), i});
    for (int g : touched) {
      if (--left[static_cast<size_t>(g)] == 0) GroupDone(u, g);
    }
  }
  return Status::Ok();
}

Status OptimizerDriver::LeaseSums(Update& u, size_t i) {
  offload::StateLease& lease = u.sub[i].l[static_cast<size_t>(OptimizerState::kGradAccumulator)];
  if (lease.valid()) return Status::Ok();
  const offload::StateId acc = id(OptimizerState::kGradAccumulator);
  STRATA_ASSIGN_OR_RETURN(lease, sums_->Acquire(StateRange{acc, i}, Access::kRead));
  // The next sub-group's copy runs beside this one's passes (a guess at the order: the
  // groups come as the next forward needs them, mostly ascending).
  if (i + 1 < num_chunks_ && u.sums_zeroed[i + 1] == 0) {
    STRATA_RETURN_IF_ERROR(sums_->Prefetch(StateRange{acc, i + 1}));
  }
  return Status::Ok();
}

Status OptimizerDriver::SpendSums(Update& u, size_t i) {
  STRATA_RETURN_IF_ERROR(
      u.sub[i].l[static_cast<size_t>(OptimizerState::kGradAccumulator)].Release());
  // Zeroed on the device behind the copy: the next micro-step's additions (queued after
  // FinishUpdate joined this worker) start from zero.
  STRATA_RETURN_IF_ERROR(sums_->ZeroChunk(StateRange{id(OptimizerState::kGradAccumulator), i}));
  u.sums_zeroed[i] = 1;
  return Status::Ok();
}

void OptimizerDriver::RunUpdate(Update& u) {
  const size_t elem = DTypeSize(dtype_);
  // Each sub-group's items still to run, for on_update's begin and end.
  std::vector<size_t> left = u.sub_items;
  std::vector<uint8_t> started(num_chunks_, 0);
  Status st;
  if (options_.bind_thread) st = options_.bind_thread().WithContext("the update worker");
  if (u.streamed && st.ok()) {
    st = RunStreamedUpdate(u);
    const offload::StateStoreStats now = store_->stats();  // the worker still owns the store
    u.store_wait_s = (now.read_wait_s + now.write_wait_s) -
                     (u.store_stats.read_wait_s + u.store_stats.write_wait_s);
  }
  while (st.ok() && !u.streamed) {
    int g = -1;
    {
      std::unique_lock<std::mutex> lock(u.mu);
      u.cv.wait(lock, [&] { return u.abort || (!u.paused && (!u.queue.empty() || u.closed)); });
      if (u.abort || u.queue.empty()) break;
      g = u.queue.front();
      u.queue.pop_front();
    }
    const Timeline::Clock::time_point began = Timeline::Clock::now();
    std::byte* out = nullptr;
    if ((!u.keep_shards || u.copy_out_first) && !u.by_group[static_cast<size_t>(g)].empty()) {
      Result<std::byte*> o = ShardOut(u, g);
      if (!o.ok()) st = o.status();
      if (!o.ok() || *o == nullptr) break;  // failed, or aborted
      out = *o;
    }
    if (u.copy_out_first) {
      // The last delayed update's parameters into the shard, before this update changes
      // the master; the group is then done (the forward may read it) and Adam writes no shard.
      for (const Update::Item& it : u.by_group[static_cast<size_t>(g)]) {
        AddElapsed timed(u.copy_out_s);
        st = CopyOutRun(u.sub[it.sub_group], it.sub_group, it.run,
                        out + (it.run.offset - working_->offset(g)) * elem);
        if (!st.ok()) break;
      }
      if (!st.ok()) break;
      GroupDone(u, g);
      out = nullptr;
    }
    for (const Update::Item& it : u.by_group[static_cast<size_t>(g)]) {
      const size_t i = it.sub_group;
      if (options_.test.on_update && started[i] == 0) options_.test.on_update(i, true);
      started[i] = 1;
      Leases& l = u.sub[i];
      if (sums_ != nullptr) {
        st = LeaseSums(u, i);
        if (!st.ok()) break;
      }
      std::byte* to = out != nullptr ? out + (it.run.offset - working_->offset(g)) * elem : nullptr;
      {
        AddElapsed timed(u.adam_s);
        // The gradients are spent: each tile is zeroed as the kernel leaves it, so the next
        // backward accumulates from zero, unless they are left in place (lazy zeroing).
        // (An early step's norm is computed after its updates began: FinishUpdate zeroes.)
        st = AdamRun(l, i, it.run, to, u.params[static_cast<size_t>(it.run.group)], u.next_step,
                     u.scaling, /*zero_grad=*/!u.early && u.lazy[i] == 0 && sums_ == nullptr);
      }
      if (!st.ok()) break;
      if (--left[i] == 0 && options_.test.on_update) options_.test.on_update(i, false);
      if (left[i] == 0 && sums_ != nullptr) {
        st = SpendSums(u, i);
        if (!st.ok()) break;
      }
    }
    if (!st.ok()) break;
    u.spans.push_back({g, began, Timeline::Clock::now()});
    if (!u.copy_out_first) GroupDone(u, g);
    if (u.early) {
      st = SumFinalTiles(
          u.tiles, u.mu, [&](size_t i) { return u.sub[i].span(OptimizerState::kGradAccumulator); },
          g);
    }
  }
  u.ended = Timeline::Clock::now();
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.error = st.WithContext("the pipelined optimizer step");
    u.finished = true;
  }
  u.cv.notify_all();
}

offload::StateStoreStats OptimizerDriver::store_stats() const {
  if (update_ != nullptr && update_->streamed) return update_->store_stats;
  return store_->stats();
}

bool OptimizerDriver::GroupUpdated(int group) const {
  if (update_ == nullptr || group < 0 || static_cast<size_t>(group) >= update_->done.size()) {
    return true;
  }
  std::lock_guard<std::mutex> lock(update_->mu);
  return update_->done[static_cast<size_t>(group)] != 0;
}

bool OptimizerDriver::ShardInStore(int group) const {
  if (update_ == nullptr || group < 0 || static_cast<size_t>(group) >= update_->done.size()) {
    return true;
  }
  const auto g = static_cast<size_t>(group);
  // (staged and handed are the engine's thread's; a leased shard goes back at WaitGroup.)
  return update_->staged[g] != 0 ? update_->handed[g] != 0 : !update_->shards[g].valid();
}

Status OptimizerDriver::WaitGroup(int group) {
  if (update_ == nullptr || group < 0 || static_cast<size_t>(group) >= update_->done.size()) {
    return Status::Ok();
  }
  Update& u = *update_;
  const auto g = static_cast<size_t>(group);
  const bool staged = u.staged[g] != 0;
  offload::StateLease& shard = u.shards[g];
  // Handed back already (or no shard).
  if (staged ? u.handed[g] != 0 : !shard.valid()) return Status::Ok();
  // Until the group is done (or the update ended without it), handing over the staged
  // groups the worker needs the buffers of; a staged group goes to its store after those
  // done before it (in the order done). No more: with few store buffers, a shard handed
  // over early would push out the one the coordinator reads next.
  for (;;) {
    int next = -1;
    {
      std::unique_lock<std::mutex> lock(u.mu);
      auto wake = [&] { return u.done[g] != 0 || u.finished || (u.starved && !u.ready.empty()); };
      if (!wake()) {
        // The forward waits for the step: exposed time (the "step wait" of the timeline).
        TimedScope waited(stats_.pipelined_wait_s, options_.timeline, "step wait",
                          TimelineLane::kWait, group);
        u.cv.wait(lock, wake);
      }
      if (!u.ready.empty() && (staged || u.done[g] == 0)) {
        next = u.ready.front();
        u.ready.pop_front();
      } else if (u.done[g] == 0 && !u.finished) {
        continue;  // (woken for a hand-over another call made meanwhile)
      }
    }
    if (next < 0) break;
    HandOver(u, next);
    if (staged && u.handed[g] != 0) return Status::Ok();
  }
  if (staged) {
    // The update failed before this group (NVMe: the error waits for FinishUpdate's
    // agreement): its shard stays as it was, read by the forward like every other rank's.
    return Status::Ok();
  }
  {
    std::lock_guard<std::mutex> lock(u.mu);
    // The update failed before this group. Streamed (NVMe), the error waits for
    // FinishUpdate's agreement, and the shard goes to the forward as it is, so that this
    // rank issues the same collectives as every other.
    if (u.done[g] == 0 && !u.streamed) return u.error;
  }
  return shard.Release();
}

Status OptimizerDriver::FinishUpdate() {
  if (update_ == nullptr) return Status::Ok();
  if (early_collecting_) {
    return FailedPreconditionError("FinishUpdate during an early step's backward: StepEarly first");
  }
  // (The engine gave every group after the backward; a group left out still runs.)
  STRATA_RETURN_IF_ERROR(ReleaseRemainingGroups({}));
  {
    std::optional<TimedScope> waited;  // only a real wait is a span
    {
      std::lock_guard<std::mutex> lock(update_->mu);
      if (!update_->finished) {
        waited.emplace(stats_.pipelined_wait_s, options_.timeline, "step wait (the rest)",
                       TimelineLane::kWait);
      }
    }
    // Staged shards go to their store as they are done (the worker may wait for buffers).
    for (Update& u = *update_;;) {
      HandOverReady(u);
      std::unique_lock<std::mutex> lock(u.mu);
      if (u.finished) break;
      u.cv.wait(lock, [&] { return !u.ready.empty() || u.finished; });
    }
    update_->worker.join();
    HandOverReady(*update_);
  }
  std::unique_ptr<Update> u = std::move(update_);
  ForgetTilesAsWritten();  // the update zeroed the accumulators (or failed doing so)
  stats_.staging_buffers = std::max<uint64_t>(stats_.staging_buffers, u->pool.size());
  staging_pool_ = std::move(u->pool);
  if (u->streamed) store_->SetWriteBehind(false);
  if (u->early && sums_ == nullptr) {
    // The gradients are spent (the norm was computed from them at StepEarly): zeroed, or
    // left in place (lazy zeroing).
    for (size_t i = 0; i < u->sub.size(); ++i) {
      if (u->lazy[i] == 0)
        ZeroAccumulators(*cpu_adam_, u->sub[i].span(OptimizerState::kGradAccumulator));
    }
  }
  Status released = ReleaseAll(u->sub, u->shards);
  for (size_t i = 0; i < u->sums_zeroed.size() && sums_ != nullptr && !u->streamed; ++i) {
    // A sub-group the worker did not finish (an error): its sums are spent all the same.
    if (u->sums_zeroed[i] != 0) continue;
    Status z = sums_->ZeroChunk(StateRange{id(OptimizerState::kGradAccumulator), i});
    if (released.ok()) released = z;
  }
  stats_.adam_s += u->adam_s;
  stats_.shard_checksum_s += u->checksum_s;
  stats_.delayed_copy_out_s += u->copy_out_s;
  stats_.pipelined_store_wait_s += u->store_wait_s;
  stats_.norm_tiles_in_background += u->tiles.tiles_summed;
  stats_.pipelined_update_s += std::chrono::duration<double>(u->ended - u->began).count();
  if (options_.timeline != nullptr && options_.timeline->enabled()) {
    for (const Update::Span& sp : u->spans) {
      if (sp.group < 0) {
        options_.timeline->Add("CPU optimizer pass", TimelineLane::kOptimizer, sp.begin, sp.end,
                               static_cast<int>(sp.sub_group));
        continue;
      }
      if (sp.checksums) {
        options_.timeline->Add(
            "block checksums of " + partition_->groups[static_cast<size_t>(sp.group)].name,
            TimelineLane::kOptimizer, sp.begin, sp.end);
        continue;
      }
      options_.timeline->Add(
          "CPU optimizer step of " + partition_->groups[static_cast<size_t>(sp.group)].name,
          TimelineLane::kOptimizer, sp.begin, sp.end);
    }
  }
  Status st = u->error.ok() ? released : u->error;
  if (st.ok()) st = u->handover_error;
  if (st.ok() && !u->counted) {
    st = InternalError(
        "an early step's updates ran, but the step itself (StepEarly) failed: the states hold "
        "them without a step count");
  }
  // Step 6, counted at StartStep / StepEarly. Host stores: nothing to agree on. Streamed:
  // every rank's outcome is agreed on, failed or not (a collective; on a failure anywhere
  // Agree rolls back and counts the failed step).
  const uint64_t failed_before = stats_.steps_failed;
  // Lazy zeroing: the gradients are spent whether the update ended well or not.
  for (size_t i = 0; i < num_chunks_; ++i) {
    if (u->lazy[i] != 0) {
      ZeroLazily(i);
      acc_norm_[i] = ChunkNorm{true, 0.0, false};
    }
  }
  if (st.ok()) {
    // Every other chunk was zeroed (by the update's tiles, its ZeroChunk or the early
    // step's pass).
    acc_norm_.assign(num_chunks_, ChunkNorm{true, 0.0, false});
    for (size_t i = 0; i < num_chunks_; ++i) {
      if (u->lazy[i] == 0) acc_zeros_[i].Set(sums_ == nullptr);  // the device's: unseen
    }
  }
  if (st.ok() || can_fail()) st = CommitAgreed(std::move(st), "the optimizer step");
  if (!st.ok()) {
    if (u->counted) --stats_.steps_applied;
    if (stats_.steps_failed == failed_before) ++stats_.steps_failed;
    return st;
  }
  for (int k = 0; k < optimizer_.num_groups(); ++k)
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, u->next_step));
  return Status::Ok();
}

size_t OptimizerDriver::StagedShardBuffers() const {
  return options_.test.staged_shard_buffers > 0 ? options_.test.staged_shard_buffers
                                                : options_.staged_shard_buffers;
}

}  // namespace strata::engine

// The optimizer driver: its creation, the state it keeps (access, commit and rollback, the
// agreement on outcomes), the runs of its sub-groups (optimizer_driver.h).
#include "strata/engine/step/optimizer_driver.h"

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
#include "strata/engine/timeline/elapsed.h"
#include "strata/swap/crc32c.h"
namespace strata::engine {

using namespace driver_internal;  // NOLINT(google-build-using-namespace): the driver's own

std::string_view OptimizerStateName(OptimizerState s) {
  switch (s) {
    case OptimizerState::kMaster:
      return "fp32 master parameters";
    case OptimizerState::kExpAvg:
      return "Adam exp_avg (m)";
    case OptimizerState::kExpAvgSq:
      return "Adam exp_avg_sq (v)";
    case OptimizerState::kGradAccumulator:
      return "fp32 gradient accumulators";
  }
  return "?";
}

OptimizerDriver::OptimizerDriver(const ModelPartition* partition, offload::StateStore* store,
                                 WorkingShards* working, comm::Communicator* comm,
                                 const CpuAdam* adam, const OptimizerDriverOptions& options)
    : partition_(partition),
      working_(working),
      dtype_(working->dtype()),
      comm_(comm),
      cpu_adam_(adam),
      optimizer_(adam),
      options_(options),
      store_(store),
      sums_(options.device_sums) {}

Result<std::unique_ptr<OptimizerDriver>> OptimizerDriver::Create(
    const ModelPartition* partition, offload::StateStore* store, WorkingShards* working_shards,
    comm::Communicator* comm, const CpuAdam* adam, const OptimizerDriverOptions& options) {
  if (partition == nullptr || store == nullptr || comm == nullptr || adam == nullptr) {
    return InvalidArgumentError(
        "OptimizerDriver: null partition, state store, communicator or CpuAdam");
  }
  if (working_shards == nullptr)
    return InvalidArgumentError("OptimizerDriver: null working shards");
  if (options.sub_group_elems == 0) {
    return InvalidArgumentError("zero_optimization.sub_group_size must be at least 1");
  }
  STRATA_RETURN_IF_ERROR(ValidateAdamParams(options.adam));
  OptimizerDriverOptions o = options;
  if (o.groups.empty()) o.groups.push_back(o.adam);
  for (size_t k = 0; k < o.groups.size(); ++k) {
    STRATA_RETURN_IF_ERROR(
        ValidateAdamParams(o.groups[k]).WithContext("parameter group " + std::to_string(k)));
  }
  if (o.lamb) {
    LambParams check;
    check.max_coeff = o.lamb->max_coeff;
    check.min_coeff = o.lamb->min_coeff;
    STRATA_RETURN_IF_ERROR(ValidateLambParams(check));
  }
  std::unique_ptr<OptimizerDriver> d(
      new OptimizerDriver(partition, store, working_shards, comm, adam, o));
  for (const AdamParams& g : o.groups)
    STRATA_RETURN_IF_ERROR(d->optimizer_.AddGroup(g).status());
  const size_t n = partition->partition_numel;
  d->chunk_elems_ = n == 0 ? 1 : static_cast<size_t>(std::min<uint64_t>(o.sub_group_elems, n));
  d->num_chunks_ = (n + d->chunk_elems_ - 1) / d->chunk_elems_;
  STRATA_RETURN_IF_ERROR(d->BuildRuns());
  if (o.lamb) d->BuildPieces();
  for (OptimizerState s : kStates) {
    STRATA_ASSIGN_OR_RETURN(
        d->ids_[static_cast<size_t>(s)],
        d->StoreFor(s)->Register(std::string(OptimizerStateName(s)), n * sizeof(float),
                                 d->chunk_elems_ * sizeof(float)));
  }
  d->acc_norm_.assign(d->num_chunks_, ChunkNorm{true, 0.0, false});  // zeros
  d->acc_zeros_.assign(d->num_chunks_, AccZeros{});
  for (size_t i = 0; i < d->num_chunks_; ++i) {
    const size_t tiles = CpuAdam::NumTiles(d->chunk_end(i) - d->chunk_begin(i));
    d->acc_zeros_[i].tile_sum.assign(tiles, 0.0);
    d->acc_zeros_[i].tile_summed.assign(tiles, 0);
  }
  OptimizerDriver* raw = d.get();
  STRATA_RETURN_IF_ERROR(
      d->StoreFor(OptimizerState::kGradAccumulator)
          ->SetWriteHook(d->id(OptimizerState::kGradAccumulator),
                         [raw](size_t chunk, std::span<const std::byte> contents) {
                           Status st = raw->NoteAccNorm(
                               chunk, {reinterpret_cast<const float*>(contents.data()),
                                       contents.size() / 4});
                         }));
  // Written behind only during the step's update (while gradients accumulate, a chunk
  // changes many times and stays in its buffer until the buffer is needed).
  store->SetWriteBehind(false);
  d->order_.resize(d->num_chunks_);
  std::iota(d->order_.begin(), d->order_.end(), size_t{0});
  const size_t bytes = n * sizeof(float);
  d->stats_.master_bytes = d->stats_.exp_avg_bytes = d->stats_.exp_avg_sq_bytes =
      d->stats_.grad_accumulator_bytes = bytes;
  d->stats_.sub_groups = d->num_chunks_;
  for (const GroupLayout& g : partition->groups) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (auto s = g.Slice(i, partition->rank)) d->real_shard_elems_ += s->count;
    }
  }
  return d;
}

size_t OptimizerDriver::chunk_end(size_t i) const {
  return std::min(partition_->partition_numel, (i + 1) * chunk_elems_);
}

size_t OptimizerDriver::group_end(size_t offset) const {
  // Groups' shards are contiguous: the next start after `offset` ends its group.
  const std::vector<size_t>& starts = partition_->shard_offset;
  auto it = std::upper_bound(starts.begin(), starts.end(), offset);
  return it == starts.end() ? partition_->partition_numel : *it;
}

bool OptimizerDriver::group_inside(size_t offset, size_t i) const {
  const int g = working_->GroupAt(offset);
  return working_->offset(g) >= chunk_begin(i) && group_end(offset) <= chunk_end(i);
}

bool OptimizerDriver::can_fail() const {
  return store_->can_fail() || working_->can_fail();
}

Status OptimizerDriver::set_sub_group_order(std::vector<size_t> order) {
  std::vector<bool> seen(num_chunks_, false);
  if (order.size() != num_chunks_) {
    return InvalidArgumentError("sub-group order names " + std::to_string(order.size()) +
                                " sub-groups, the partition has " + std::to_string(num_chunks_));
  }
  for (size_t i : order) {
    if (i >= num_chunks_ || seen[i]) {
      return InvalidArgumentError("sub-group order: " + std::to_string(i) +
                                  " is out of range or repeated");
    }
    seen[i] = true;
  }
  order_ = std::move(order);
  return Status::Ok();
}

Result<OptimizerDriver::Leases> OptimizerDriver::AcquireSubGroup(size_t i,
                                                                 const Access (&access)[4]) {
  if (access[static_cast<size_t>(OptimizerState::kGradAccumulator)] != kSkip) DropNormInBackward();
  Leases out;
  for (size_t k = 0; k < 4; ++k) {
    if (access[k] == kSkip) continue;
    STRATA_ASSIGN_OR_RETURN(out.l[k], StoreAt(k)->Acquire(StateRange{ids_[k], i}, access[k]));
  }
  return out;
}

void OptimizerDriver::PrefetchSubGroup(size_t i, const Access (&access)[4]) {
  for (size_t k = 0; k < 4; ++k) {
    if (access[k] == kSkip || access[k] == Access::kWrite) continue;
    // A hint: an error is kept by the store and seen by the next Acquire.
    Status s = StoreAt(k)->Prefetch(StateRange{ids_[k], i});
  }
}

Status OptimizerDriver::WriteMaster(size_t offset, std::span<const float> values) {
  return ForRange(OptimizerState::kMaster, offset, values.size(), Access::kReadWrite,
                  [&](std::span<float> chunk, size_t at) {
                    std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(at), chunk.size(),
                                chunk.begin());
                  });
}

Status OptimizerDriver::WriteState(OptimizerState s, size_t offset, std::span<const float> values) {
  const size_t end = offset + values.size();
  if (end > partition_->partition_numel) {
    return OutOfRangeError(std::string(OptimizerStateName(s)) + ": elements [" +
                           std::to_string(offset) + ", " + std::to_string(end) +
                           ") outside the partition of " +
                           std::to_string(partition_->partition_numel));
  }
  if (s == OptimizerState::kGradAccumulator) {
    // The chunks' other elements keep what they hold, and are then no longer known zero.
    STRATA_RETURN_IF_ERROR(MaterializeChunkZeros(0, num_chunks_));
    DropNormInBackward();
  }
  for (size_t pos = offset; pos < end;) {
    const size_t i = pos / chunk_elems_;
    const size_t stop = std::min(end, chunk_end(i));
    const bool whole = pos == chunk_begin(i) && stop == chunk_end(i);
    if (s == OptimizerState::kGradAccumulator) {
      acc_norm_[i].valid = false;
      acc_zeros_[i].Set(false);
    }
    STRATA_ASSIGN_OR_RETURN(
        StateLease l,
        StoreFor(s)->Acquire(StateRange{id(s), i}, whole ? Access::kWrite : Access::kReadWrite));
    std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(pos - offset), stop - pos,
                l.as<float>().begin() + static_cast<std::ptrdiff_t>(pos - chunk_begin(i)));
    STRATA_RETURN_IF_ERROR(l.Release());
    pos = stop;
  }
  return Status::Ok();
}

Status OptimizerDriver::VisitState(
    OptimizerState s, const std::function<Status(size_t, std::span<const float>)>& fn) {
  if (s == OptimizerState::kGradAccumulator) {
    STRATA_RETURN_IF_ERROR(MaterializeChunkZeros(0, num_chunks_));
    DropNormInBackward();
  }
  for (size_t i = 0; i < num_chunks_; ++i) {
    if (i + 1 < num_chunks_) {
      // A hint: an error is kept by the store and seen by the next Acquire.
      (void)StoreFor(s)->Prefetch(StateRange{id(s), i + 1});
    }
    STRATA_ASSIGN_OR_RETURN(StateLease l,
                            StoreFor(s)->Acquire(StateRange{id(s), i}, Access::kRead));
    const std::span<float> chunk = l.as<float>();
    STRATA_RETURN_IF_ERROR(fn(chunk_begin(i), std::span<const float>(chunk.data(), chunk.size())));
    STRATA_RETURN_IF_ERROR(l.Release());
  }
  return Status::Ok();
}

Status OptimizerDriver::ReadState(OptimizerState s, size_t offset, std::span<float> out) {
  if (s == OptimizerState::kGradAccumulator) {
    STRATA_RETURN_IF_ERROR(MaterializeChunkZeros(0, num_chunks_));
  }
  return ForRange(s, offset, out.size(), Access::kRead, [&](std::span<float> chunk, size_t at) {
    std::copy(chunk.begin(), chunk.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
  });
}

Status OptimizerDriver::ReadMaster(size_t offset, std::span<float> out) {
  return ReadState(OptimizerState::kMaster, offset, out);
}

Result<std::vector<float>> OptimizerDriver::CopyState(OptimizerState s) {
  std::vector<float> out(partition_->partition_numel);
  STRATA_RETURN_IF_ERROR(ReadState(s, 0, out));
  return out;
}

Status OptimizerDriver::Commit() {
  return CommitAgreed(Status::Ok(), "writing the optimizer states");
}

Status OptimizerDriver::CommitAgreed(Status local, std::string_view when) {
  if (sums_ != nullptr) STRATA_RETURN_IF_ERROR(sums_->Commit());  // forgets reads ahead
  if (!can_fail()) {
    STRATA_RETURN_IF_ERROR(local);
    STRATA_RETURN_IF_ERROR(store_->Commit());
    return working_->Commit();
  }
  // Written everywhere before anything is switched: a rank never commits a step another
  // rank rolls back.
  if (local.ok()) local = store_->Flush();
  if (local.ok()) local = working_->Flush();
  STRATA_RETURN_IF_ERROR(Agree(local, {}, when));
  STRATA_RETURN_IF_ERROR(store_->Commit());
  return working_->Commit();
}

Status OptimizerDriver::RollbackEpoch() {
  DropNormInBackward();
  // The stale gradients (lazy zeroing, host stores) would become contents below.
  Status rolled = MaterializeChunkZeros(0, num_chunks_);
  if (rolled.ok()) rolled = store_->Rollback();
  if (rolled.ok() && sums_ != nullptr) rolled = sums_->Rollback();  // zeroes the sums
  if (rolled.ok()) rolled = working_->Rollback();
  acc_norm_.assign(num_chunks_, ChunkNorm{});  // back to contents not summed here
  SetAccZeros(false);
  Status synced = rolled.ok() ? SyncWorkingFromMaster() : rolled;
  if (synced.ok()) synced = working_->Commit();
  return synced;
}

Status OptimizerDriver::CommitMasterAgreed(Status local, std::string_view when) {
  if (local.ok()) local = SyncWorkingFromMaster();
  if (local.ok() && can_fail()) local = store_->Flush();
  if (local.ok() && can_fail()) local = working_->Flush();
  STRATA_ASSIGN_OR_RETURN(Outcomes o, AgreeOnOutcomes(*comm_, local));
  if (!o.any_failed) {
    STRATA_RETURN_IF_ERROR(store_->Commit());
    return working_->Commit();
  }
  const Status rolled = RollbackEpoch();
  std::string msg =
      OutcomeStatus(o, std::string(when)).message() +
      (store_->can_fail() ? "; the parameters are those before the load"
                          : "; the parameters are partly replaced (the host tier keeps no "
                            "copy of the previous ones): load them again");
  if (!rolled.ok()) msg += " (rolling back failed too: " + rolled.ToString() + ")";
  return Status(o.code, msg);
}

Status OptimizerDriver::Agree(const Status& local, std::vector<float> flags,
                              std::string_view when) {
  STRATA_ASSIGN_OR_RETURN(Outcomes o, AgreeOnOutcomes(*comm_, local, std::move(flags)));
  if (!o.any_failed) return Status::Ok();
  // Back to the last committed step, and working shards that match it.
  const Status synced = RollbackEpoch();
  ++stats_.steps_failed;
  std::string msg = OutcomeStatus(o, std::string(when)).message() +
                    "; the optimizer states are those of the last completed step";
  if (!synced.ok())
    msg += " (restoring the working shards from them failed too: " + synced.ToString() + ")";
  return Status(o.code, msg);
}

Status OptimizerDriver::BuildRuns() {
  const size_t n = partition_->partition_numel;
  const int num_groups = static_cast<int>(options_.groups.size());
  if (!options_.param_group.empty() && options_.param_group.size() != partition_->groups.size()) {
    return InvalidArgumentError("parameter groups: " + std::to_string(options_.param_group.size()) +
                                " engine groups named, the model has " +
                                std::to_string(partition_->groups.size()));
  }
  // Each parameter's slice on this rank starts a run of its group (padding follows it).
  std::vector<Run> starts;
  for (size_t g = 0; g < partition_->groups.size(); ++g) {
    const GroupLayout& layout = partition_->groups[g];
    if (!options_.param_group.empty() && options_.param_group[g].size() != layout.params.size()) {
      return InvalidArgumentError("parameter groups: engine group " + layout.name + " has " +
                                  std::to_string(layout.params.size()) + " parameters, " +
                                  std::to_string(options_.param_group[g].size()) + " named");
    }
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const int k = options_.param_group.empty() ? 0 : options_.param_group[g][i];
      if (k < 0 || k >= num_groups) {
        return InvalidArgumentError("parameter " + layout.params[i].name + ": parameter group " +
                                    std::to_string(k) + " of " + std::to_string(num_groups));
      }
      if (auto sl = layout.Slice(i, partition_->rank)) {
        starts.push_back({partition_->shard_offset[g] + sl->shard_offset, 0, k});
      }
    }
  }
  std::sort(starts.begin(), starts.end(),
            [](const Run& a, const Run& b) { return a.offset < b.offset; });
  runs_.clear();
  int group = starts.empty() ? 0 : starts.front().group;
  size_t from = 0;
  for (const Run& r : starts) {
    if (r.group == group) continue;
    if (r.offset > from) runs_.push_back({from, r.offset - from, group});
    from = r.offset;
    group = r.group;
  }
  if (n > from) runs_.push_back({from, n - from, group});
  // Each sub-group's runs: the runs cut at sub-group windows and at the groups' shard ends
  // (the copy-out writes one group's working shard at a time).
  chunk_runs_.assign(num_chunks_, {});
  for (const Run& r : runs_) {
    for (size_t off = r.offset; off < r.offset + r.count;) {
      const size_t i = off / chunk_elems_;
      const size_t len = std::min({r.offset + r.count, chunk_end(i), group_end(off)}) - off;
      chunk_runs_[i].push_back({off, len, r.group});
      off += len;
    }
  }
  stats_.group_elements.assign(static_cast<size_t>(num_groups), 0);
  stats_.group_lr.assign(static_cast<size_t>(num_groups), 0.0);
  for (const Run& r : runs_)
    stats_.group_elements[static_cast<size_t>(r.group)] += r.count;
  return Status::Ok();
}

void OptimizerDriver::BuildPieces() {
  const size_t n = partition_->partition_numel;
  std::vector<Piece> starts;
  int param = 0;
  for (size_t g = 0; g < partition_->groups.size(); ++g) {
    const GroupLayout& layout = partition_->groups[g];
    for (size_t i = 0; i < layout.params.size(); ++i, ++param) {
      const int k = options_.param_group.empty() ? 0 : options_.param_group[g][i];
      if (auto sl = layout.Slice(i, partition_->rank)) {
        starts.push_back({partition_->shard_offset[g] + sl->shard_offset, 0, param, k});
      }
    }
  }
  num_params_ = static_cast<size_t>(param);
  std::sort(starts.begin(), starts.end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  // Elements before the first slice are padding: zero, and they stay zero (their sums add
  // zeros to the first parameter's); a piece of their own, so the pieces cover the
  // partition and the copy-out writes every working shard whole.
  if (!starts.empty() && starts.front().offset > 0) {
    starts.insert(starts.begin(), Piece{0, 0, starts.front().param, starts.front().group});
  }
  pieces_.clear();
  for (size_t j = 0; j < starts.size(); ++j) {
    const size_t end = j + 1 < starts.size() ? starts[j + 1].offset : n;
    for (size_t off = starts[j].offset; off < end;) {
      const size_t len = std::min({end, chunk_end(off / chunk_elems_), group_end(off)}) - off;
      pieces_.push_back({off, len, starts[j].param, starts[j].group});
      off += len;
    }
  }
}

Status OptimizerDriver::SyncWorkingFromMaster() {
  ShardWriter out(working_);
  for (size_t i = 0; i < num_chunks_; ++i) {
    const size_t b = chunk_begin(i), e = chunk_end(i);
    STRATA_ASSIGN_OR_RETURN(
        StateLease l, store_->Acquire(StateRange{id(OptimizerState::kMaster), i}, Access::kRead));
    std::span<const float> master = l.as<const float>();
    for (size_t pos = b; pos < e;) {
      const size_t end = std::min(e, group_end(pos));
      std::span<const float> from = master.subspan(pos - b, end - pos);
      // Ascending over the whole partition: every shard is written whole while held.
      STRATA_ASSIGN_OR_RETURN(std::byte * to, out.At(pos, from.size(), /*whole=*/true));
      STRATA_RETURN_IF_ERROR(RoundInto(from, to));
      pos = end;
    }
    STRATA_RETURN_IF_ERROR(l.Release());
  }
  return out.Release();
}

int64_t OptimizerDriver::adam_step() const {
  return optimizer_.StepCount(0).value_or(0);
}

Status OptimizerDriver::set_adam_step(int64_t step) {
  for (int k = 0; k < optimizer_.num_groups(); ++k)
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, step));
  return Status::Ok();
}

OptimizerDriver::~OptimizerDriver() {
  DropNormInBackward();  // its thread ends
  // An engine going away mid-update (an error unwound it): the worker ends, the leases go
  // back; nothing is committed.
  if (update_ != nullptr) {
    AbortUpdate(*update_);
    if (update_->streamed) store_->SetWriteBehind(false);
  }
}

}  // namespace strata::engine

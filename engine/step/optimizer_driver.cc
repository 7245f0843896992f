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
#include "strata/engine/timeline/elapsed.h"
#include "strata/swap/crc32c.h"

namespace strata::engine {

namespace {

using offload::Access;
using offload::StateLease;
using offload::StateRange;

// In an access list: this state is not acquired.
constexpr auto kSkip = static_cast<Access>(0xff);

constexpr OptimizerState kStates[4] = {OptimizerState::kMaster, OptimizerState::kExpAvg,
                                       OptimizerState::kExpAvgSq, OptimizerState::kGradAccumulator};

// acc[0, n) += src[0, n) (fp32 accumulators), on the optimizer's threads: one thread did
// 1.3B elements a step in about 0.8 s, longer than an H200's backward (PERFORMANCE.md).
// Elementwise: the same sums whatever the split. `zeroed`: acc holds +0.0, written
// without being read (the same sums).
void AddIntoAccumulators(const CpuAdam& adam, const std::byte* src, DType dtype, float* acc,
                         size_t n, bool zeroed) {
  const size_t elem = DTypeSize(dtype);
  adam.ForEachTile(n, [&](size_t b, size_t e) {
    if (zeroed) {
      BulkAddToZeroedFloat(GradSpan{src + b * elem, e - b, ToScalarType(dtype)},
                           std::span<float>(acc + b, e - b));
    } else {
      AddInto(src + b * elem, dtype, acc + b, DType::kFloat32, e - b);
    }
  });
}

// Zeroes spent accumulators on the optimizer's threads.
void ZeroAccumulators(const CpuAdam& adam, std::span<float> acc) {
  adam.ForEachTile(acc.size(), [&](size_t b, size_t e) {
    std::memset(acc.data() + b, 0, (e - b) * sizeof(float));
  });
}

using Ranges = std::vector<std::pair<size_t, size_t>>;

// a and b (each sorted and disjoint) united: sorted, disjoint, touching ranges merged.
Ranges UniteRanges(const Ranges& a, const Ranges& b) {
  Ranges all;
  all.reserve(a.size() + b.size());
  std::merge(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(all));
  Ranges out;
  for (const std::pair<size_t, size_t>& r : all) {
    if (!out.empty() && r.first <= out.back().second) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// Takes [b, e) out of `ranges` (sorted, disjoint).
void SubtractRange(Ranges& ranges, size_t b, size_t e) {
  Ranges out;
  for (const auto& [rb, re] : ranges) {
    if (re <= b || rb >= e) {
      out.emplace_back(rb, re);
      continue;
    }
    if (rb < b) out.emplace_back(rb, b);
    if (re > e) out.emplace_back(e, re);
  }
  ranges = std::move(out);
}

}  // namespace

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
      store_(store) {}

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
    STRATA_ASSIGN_OR_RETURN(d->ids_[static_cast<size_t>(s)],
                            store->Register(std::string(OptimizerStateName(s)), n * sizeof(float),
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
  STRATA_RETURN_IF_ERROR(store->SetWriteHook(
      d->id(OptimizerState::kGradAccumulator),
      [raw](size_t chunk, std::span<const std::byte> contents) {
        Status st = raw->NoteAccNorm(
            chunk, {reinterpret_cast<const float*>(contents.data()), contents.size() / 4});
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
    STRATA_ASSIGN_OR_RETURN(out.l[k], store_->Acquire(StateRange{ids_[k], i}, access[k]));
  }
  return out;
}

void OptimizerDriver::PrefetchSubGroup(size_t i, const Access (&access)[4]) {
  for (size_t k = 0; k < 4; ++k) {
    if (access[k] == kSkip || access[k] == Access::kWrite) continue;
    // A hint: an error is kept by the store and seen by the next Acquire.
    Status s = store_->Prefetch(StateRange{ids_[k], i});
  }
}

template <typename Fn>
Status OptimizerDriver::ForRange(OptimizerState s, size_t offset, size_t n, Access access, Fn fn) {
  if (offset + n > partition_->partition_numel) {
    return OutOfRangeError(std::string(OptimizerStateName(s)) + ": elements [" +
                           std::to_string(offset) + ", " + std::to_string(offset + n) +
                           ") outside the partition of " +
                           std::to_string(partition_->partition_numel));
  }
  if (s == OptimizerState::kGradAccumulator) DropNormInBackward();  // its leases are held
  for (size_t pos = offset; pos < offset + n;) {
    const size_t i = pos / chunk_elems_;
    const size_t end = std::min(offset + n, chunk_end(i));
    STRATA_ASSIGN_OR_RETURN(StateLease l, store_->Acquire(StateRange{id(s), i}, access));
    fn(l.as<float>().subspan(pos - chunk_begin(i), end - pos), pos - offset);
    STRATA_RETURN_IF_ERROR(l.Release());
    pos = end;
  }
  return Status::Ok();
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
        store_->Acquire(StateRange{id(s), i}, whole ? Access::kWrite : Access::kReadWrite));
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
      (void)store_->Prefetch(StateRange{id(s), i + 1});
    }
    STRATA_ASSIGN_OR_RETURN(StateLease l, store_->Acquire(StateRange{id(s), i}, Access::kRead));
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

Status OptimizerDriver::NoteAccNorm(size_t chunk, std::span<const float> values) {
  ChunkNorm& c = acc_norm_[chunk];
  c.valid = false;
  // The tiles summed as they were written, and the rest read here: GradSquaredNorm's sum
  // (made of the same tile sums, added in the same order).
  std::vector<double> sums(CpuAdam::NumTiles(values.size()), 0.0);
  std::vector<uint8_t> have;
  const size_t as_written = TilesAsWritten(chunk, sums, have);
  STRATA_RETURN_IF_ERROR(SumTilesLeft(values, sums, have).status());
  const GradNorm local = CpuAdam::GradNormOfTiles(sums);
  c = ChunkNorm{true, local.sum_sq, local.has_inf_nan, static_cast<uint32_t>(as_written)};
  return Status::Ok();
}

Result<size_t> OptimizerDriver::SumTilesLeft(std::span<const float> acc, std::span<double> sums,
                                             const std::vector<uint8_t>& done) const {
  size_t summed = 0;
  for (size_t k = 0; k < sums.size();) {
    if (done[k] != 0) {
      ++k;
      continue;
    }
    size_t end = k;
    while (end < sums.size() && done[end] == 0)
      ++end;
    const size_t b = k * CpuAdam::kTileElems;
    const size_t n = std::min(end * CpuAdam::kTileElems, acc.size()) - b;
    STRATA_RETURN_IF_ERROR(cpu_adam_->GradSquaredNormTiles(GradSpan::Fp32(acc.subspan(b, n)),
                                                           sums.subspan(k, end - k)));
    summed += end - k;
    k = end;
  }
  return summed;
}

bool OptimizerDriver::NoteAccNormAsWritten(size_t chunk) {
  const AccZeros& z = acc_zeros_[chunk];
  if (z.tile_summed.empty() ||
      std::find(z.tile_summed.begin(), z.tile_summed.end(), uint8_t{0}) != z.tile_summed.end()) {
    return false;
  }
  const GradNorm local = CpuAdam::GradNormOfTiles(z.tile_sum);
  acc_norm_[chunk] =
      ChunkNorm{true, local.sum_sq, local.has_inf_nan, static_cast<uint32_t>(z.tile_sum.size())};
  return true;
}

size_t OptimizerDriver::TilesAsWritten(size_t i, std::span<double> sums,
                                       std::vector<uint8_t>& have) const {
  const AccZeros& z = acc_zeros_[i];
  have.assign(sums.size(), 0);
  size_t count = 0;
  for (size_t k = 0; k < sums.size() && k < z.tile_summed.size(); ++k) {
    if (z.tile_summed[k] == 0) continue;
    sums[k] = z.tile_sum[k];
    have[k] = 1;
    ++count;
  }
  return count;
}

void OptimizerDriver::AddIntoChunk(size_t i, size_t pos, const std::byte* src, DType dtype,
                                   float* dst, size_t n) {
  AccZeros& z = acc_zeros_[i];
  const size_t b = pos - chunk_begin(i), e = b + n;
  // The pieces of [b, e) in order: {begin, end, known zero}.
  std::vector<std::tuple<size_t, size_t, bool>> pieces;
  if (!z.zeroed) {
    pieces.emplace_back(b, e, false);
  } else {
    size_t at = b;
    for (const auto& [ab, ae] : z.added) {
      if (ae <= at) continue;
      if (ab >= e) break;
      if (ab > at) pieces.emplace_back(at, ab, true);
      const size_t stop = std::min(ae, e);
      pieces.emplace_back(at > ab ? at : ab, stop, false);
      at = stop;
    }
    if (at < e) pieces.emplace_back(at, e, true);
    // Noted before anything is written: a failed write leaves it counted as added into.
    const std::pair<size_t, size_t> range{b, e};
    z.added.insert(std::upper_bound(z.added.begin(), z.added.end(), range), range);
    size_t kept = 0;  // merged in place: the ranges stay sorted and disjoint
    for (const std::pair<size_t, size_t>& r : z.added) {
      if (kept > 0 && r.first <= z.added[kept - 1].second) {
        z.added[kept - 1].second = std::max(z.added[kept - 1].second, r.second);
      } else {
        z.added[kept++] = r;
      }
    }
    z.added.resize(kept);
  }
  // The norm's tiles this addition touches are summed anew: as written below, or later.
  constexpr size_t T = CpuAdam::kTileElems;
  for (size_t k = b / T; k < z.tile_summed.size() && k * T < e; ++k)
    z.tile_summed[k] = 0;
  const size_t len = chunk_end(i) - chunk_begin(i);
  const bool as_written =
      options_.norm_as_written && boundary_micro_step_.load(std::memory_order_relaxed);
  const size_t elem = DTypeSize(dtype);
  for (const auto& [pb, pe, zero] : pieces) {
    if (zero) stats_.acc_elements_added_to_zero += pe - pb;
    // The whole tiles of a zeroed piece: written with their norm's sums (the last tile of
    // the chunk may be short).
    const size_t t0 = (pb + T - 1) / T * T;
    const size_t t1 = pe == len ? pe : pe / T * T;
    if (!zero || !as_written || t0 >= t1) {
      AddIntoAccumulators(*cpu_adam_, src + (pb - b) * elem, dtype, dst + (pb - b), pe - pb, zero);
      continue;
    }
    if (t0 > pb) {
      AddIntoAccumulators(*cpu_adam_, src + (pb - b) * elem, dtype, dst + (pb - b), t0 - pb, true);
    }
    const std::span<double> sums =
        std::span<double>(z.tile_sum).subspan(t0 / T, (t1 - t0 + T - 1) / T);
    const Status st = cpu_adam_->AddToZeroedWithNormTiles(
        GradSpan{src + (t0 - b) * elem, t1 - t0, ToScalarType(dtype)},
        std::span<float>(dst + (t0 - b), t1 - t0), sums);
    STRATA_CHECK(st.ok()) << st;  // the sizes are this function's
    for (size_t k = t0 / T; k < t0 / T + sums.size(); ++k)
      z.tile_summed[k] = 1;
    if (pe > t1) {
      AddIntoAccumulators(*cpu_adam_, src + (t1 - b) * elem, dtype, dst + (t1 - b), pe - t1, true);
    }
  }
}

Status OptimizerDriver::Accumulate(size_t offset, const std::byte* src, DType dtype, size_t n) {
  if (!acc_error_.ok()) return Status::Ok();  // reported at the next Step
  if (n > 0 && offset + n <= partition_->partition_numel) {
    for (size_t i = offset / chunk_elems_; i <= (offset + n - 1) / chunk_elems_; ++i)
      acc_norm_[i].valid = false;
  }
  const size_t elem = DTypeSize(dtype);
  // The norm in the backward summed groups already final: a gradient for one of them (a
  // block run twice in this backward) makes those sums wrong.
  if (norm_ahead_ != nullptr && NormGivenIn(offset, n)) DropNormInBackward();
  if (update_ != nullptr || norm_ahead_ != nullptr) {
    // An early step's backward: the update holds every chunk (its worker reads the groups
    // given to it; these elements belong to a group not given yet). The norm in the
    // backward: the same with its thread.
    if (offset + n > partition_->partition_numel) {
      return OutOfRangeError("gradient accumulators: elements [" + std::to_string(offset) + ", " +
                             std::to_string(offset + n) + ") outside the partition of " +
                             std::to_string(partition_->partition_numel));
    }
    for (size_t pos = offset; pos < offset + n;) {
      const size_t i = pos / chunk_elems_;
      const size_t end = std::min(offset + n, chunk_end(i));
      AddIntoChunk(i, pos, src + (pos - offset) * elem, dtype,
                   LeasedAccumulator(i).data() + (pos - chunk_begin(i)), end - pos);
      pos = end;
    }
    return Status::Ok();
  }
  Status st = ForRange(OptimizerState::kGradAccumulator, offset, n, Access::kReadWrite,
                       [&](std::span<float> chunk, size_t at) {
                         AddIntoChunk((offset + at) / chunk_elems_, offset + at, src + at * elem,
                                      dtype, chunk.data(), chunk.size());
                       });
  if (!st.ok()) {
    if (!store_->can_fail()) return st;
    acc_error_ = st.WithContext("adding reduced gradients into the accumulators");
  }
  return Status::Ok();
}

Status OptimizerDriver::Commit() {
  return CommitAgreed(Status::Ok(), "writing the optimizer states");
}

Status OptimizerDriver::CommitAgreed(Status local, std::string_view when) {
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
      if (dtype_ == DType::kFloat32) {
        ConvertFromFloat(from.data(), from.size(), to, dtype_);
      } else {
        // The kernel's threaded SIMD copy-out (the same rounding as the step's).
        STRATA_RETURN_IF_ERROR(cpu_adam_->CopyToHalf(
            from, Param16Span{reinterpret_cast<uint16_t*>(to), from.size(), ToScalarType(dtype_)}));
      }
      pos = end;
    }
    STRATA_RETURN_IF_ERROR(l.Release());
  }
  return out.Release();
}

Status OptimizerDriver::ZeroAccumulatorChunk(size_t i) {
  DropNormInBackward();
  if (LazyZero() && acc_zeros_[i].zeroed) {
    ZeroLazily(i);
    acc_norm_[i] = ChunkNorm{true, 0.0, false};
    return Status::Ok();
  }
  const StateRange range{id(OptimizerState::kGradAccumulator), i};
  if (store_->can_fail()) {
    STRATA_RETURN_IF_ERROR(store_->ZeroChunk(range));
  } else {
    STRATA_ASSIGN_OR_RETURN(StateLease l, store_->Acquire(range, Access::kWrite));
    ZeroAccumulators(*cpu_adam_, l.as<float>());
    STRATA_RETURN_IF_ERROR(l.Release());
  }
  acc_zeros_[i].Set(true);
  acc_norm_[i] = ChunkNorm{true, 0.0, false};
  return Status::Ok();
}

bool OptimizerDriver::LazyZero() const {
  return options_.lazy_zero && !store_->can_fail();
}

void OptimizerDriver::ZeroLazily(size_t i) {
  AccZeros& z = acc_zeros_[i];
  z.stale = UniteRanges(z.stale, z.added);
  z.added.clear();
  std::fill(z.tile_summed.begin(), z.tile_summed.end(), uint8_t{0});
  ++stats_.acc_chunks_zeroed_lazily;
}

void OptimizerDriver::MaterializeZeros(size_t i, size_t b, size_t e, float* acc) {
  AccZeros& z = acc_zeros_[i];
  if (z.stale.empty() || b >= e) return;
  const auto zero = [&](size_t pb, size_t pe) {
    ZeroAccumulators(*cpu_adam_, std::span<float>(acc + pb, pe - pb));
    stats_.acc_stale_elements_zeroed += pe - pb;
  };
  for (const auto& [sb, se] : z.stale) {
    size_t at = std::max(sb, b);
    const size_t stop = std::min(se, e);
    // The pieces of [at, stop) no gradient was written over.
    for (const auto& [ab, ae] : z.added) {
      if (at >= stop) break;
      if (ae <= at) continue;
      if (ab >= stop) break;
      if (ab > at) zero(at, ab);
      at = std::max(at, ae);
    }
    if (at < stop) zero(at, stop);
  }
  SubtractRange(z.stale, b, e);
}

void OptimizerDriver::MaterializeGroupZeros(int g,
                                            const std::function<std::span<float>(size_t)>& acc_of) {
  const size_t begin = partition_->shard_offset[static_cast<size_t>(g)];
  const size_t end = group_end(begin);
  for (size_t pos = begin; pos < end;) {
    const size_t i = pos / chunk_elems_;
    const size_t stop = std::min(end, chunk_end(i));
    if (!acc_zeros_[i].stale.empty()) {
      MaterializeZeros(i, pos - chunk_begin(i), stop - chunk_begin(i), acc_of(i).data());
    }
    pos = stop;
  }
}

Status OptimizerDriver::MaterializeChunkZeros(size_t first, size_t end) {
  // (An update streaming its states, NVMe, holds no leases; nothing is stale there.)
  const bool leased = norm_ahead_ != nullptr || (update_ != nullptr && !store_->can_fail());
  for (size_t i = first; i < end && i < num_chunks_; ++i) {
    if (acc_zeros_[i].stale.empty()) continue;
    const size_t len = chunk_end(i) - chunk_begin(i);
    if (leased) {
      MaterializeZeros(i, 0, len, LeasedAccumulator(i).data());
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(
        StateLease l,
        store_->Acquire(StateRange{id(OptimizerState::kGradAccumulator), i}, Access::kReadWrite));
    MaterializeZeros(i, 0, len, l.as<float>().data());
    STRATA_RETURN_IF_ERROR(l.Release());
  }
  return Status::Ok();
}

Status OptimizerDriver::ZeroGradAccumulators() {
  for (size_t i = 0; i < num_chunks_; ++i) {
    if (!acc_zeros_[i].all_zero()) STRATA_RETURN_IF_ERROR(ZeroAccumulatorChunk(i));
  }
  return Status::Ok();
}

int64_t OptimizerDriver::adam_step() const {
  return optimizer_.StepCount(0).value_or(0);
}

Status OptimizerDriver::set_adam_step(int64_t step) {
  for (int k = 0; k < optimizer_.num_groups(); ++k)
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, step));
  return Status::Ok();
}

Result<bool> OptimizerDriver::Prepare(double lr, LossScaler& scaler, StepOutcome& out,
                                      GradScaling& scaling) {
  out.boundary = true;
  out.lr = lr;
  out.loss_scale = scaler.scale();
  const float inv_scale = static_cast<float>(1.0 / scaler.scale());
  const bool can_fail = this->can_fail();
  const auto world = static_cast<size_t>(partition_->world_size);

  // Lazy zeroing: the stale gradients no addition wrote over are zeroed before the norm and
  // the update read them (none when every parameter got a gradient). An early step's
  // groups were, each as it was given to the worker (all of them by now).
  if (update_ == nullptr) STRATA_RETURN_IF_ERROR(MaterializeChunkZeros(0, num_chunks_));
  // 1-2: local norm² and overflow (and, with a store that can fail, each rank's I/O
  // outcome of the backward and of reading the accumulators), one all-reduce.
  Status io = std::exchange(acc_error_, Status::Ok());
  std::optional<TimedScope> summing;  // until the all-reduce
  summing.emplace(stats_.norm_s, options_.timeline, "gradient norm", TimelineLane::kOptimizer);
  // The norm summed during the backward (host memory): the tiles left are summed now.
  if (norm_ahead_ != nullptr) STRATA_RETURN_IF_ERROR(SumNormInBackward());
  // Each chunk's sum as noted when it was written out, else read now — in the reverse of
  // the update's order, so the chunks read last are the first the update needs and an NVMe
  // store still holds them. The sums are added in one fixed order either way.
  const offload::StateId acc_id = id(OptimizerState::kGradAccumulator);
  std::vector<size_t> unread;
  for (size_t at = order_.size(); at-- > 0;) {
    const size_t i = order_[at];
    if (!acc_norm_[i].valid && !NoteAccNormAsWritten(i)) unread.push_back(i);
  }
  const size_t ahead = update_ != nullptr ? 0 : options_.prefetch_ahead;
  for (size_t k = 0; k < std::min(ahead, unread.size()); ++k) {
    Status hint = store_->Prefetch(StateRange{acc_id, unread[k]});  // errors: kept
  }
  if (update_ != nullptr) {
    // An early step: its update holds the chunks (and only reads the accumulators); its
    // worker summed the tiles of the groups it finished.
    STRATA_RETURN_IF_ERROR(NoteEarlyAccNorms(unread));
    unread.clear();
  }
  for (size_t k = 0; k < unread.size() && io.ok(); ++k) {
    Result<StateLease> l = store_->Acquire(StateRange{acc_id, unread[k]}, Access::kRead);
    if (ahead > 0 && k + ahead < unread.size()) {
      Status hint = store_->Prefetch(StateRange{acc_id, unread[k + ahead]});
    }
    if (!l.ok()) {
      if (!can_fail) return l.status();
      io = l.status().WithContext("reading the gradient accumulators for the norm");
      break;
    }
    STRATA_RETURN_IF_ERROR(NoteAccNorm(unread[k], l->as<const float>()));
    STRATA_RETURN_IF_ERROR(l->Release());
  }
  double sum_sq = 0.0;
  bool inf_nan = false;
  for (size_t at = order_.size(); at-- > 0 && io.ok();) {
    const ChunkNorm& c = acc_norm_[order_[at]];
    sum_sq += c.sum_sq;
    inf_nan = inf_nan || c.inf_nan;
    stats_.norm_tiles_as_written += c.tiles_as_written;
  }
  // The update zeroes the accumulators next (with the step, or at its end): the tile sums
  // are spent. (An early step's worker may still read them: its update's end forgets them.)
  if (update_ == nullptr) ForgetTilesAsWritten();
  // Unscaled by the loss scale here, in double (the chunks' sums are of the scaled values).
  sum_sq *= static_cast<double>(inv_scale) * static_cast<double>(inv_scale);
  summing.reset();
  std::vector<float> reduced(2 + (can_fail ? world : 0), 0.0f);
  reduced[0] = static_cast<float>(sum_sq);
  reduced[1] = inf_nan ? 1.0f : 0.0f;
  if (can_fail && !io.ok()) reduced[2 + static_cast<size_t>(partition_->rank)] = 1.0f;
  STRATA_RETURN_IF_ERROR_CTX(
      comm_->AllReduce(reduced.data(), reduced.size(), comm::DType::kFloat32, comm::ReduceOp::kSum),
      "all-reduce of the gradient norm and overflow flag");
  ++stats_.norm_all_reduce_calls;
  if (can_fail) {
    Status agreed = Agree(io, std::vector<float>(reduced.begin() + 2, reduced.end()),
                          "accumulating the gradients of this step");
    if (!agreed.ok()) return agreed;  // rolled back: the accumulators are zero again
  }
  out.overflow = reduced[1] > 0.0f || !std::isfinite(reduced[0]);
  out.global_norm = std::sqrt(static_cast<double>(reduced[0]));
  stats_.last_global_norm = out.global_norm;

  // 3: overflow.
  const bool skip =
      scaler.enabled() ? scaler.Update(out.overflow) : out.overflow && options_.skip_inf_nan;
  if (out.overflow && !skip && !scaler.enabled()) {
    STRATA_LOG(kWarn) << "inf/NaN gradients applied (strata.skip_inf_nan_steps false): the "
                         "parameters now hold inf/NaN";
    ++stats_.steps_inf_nan_applied;
  }
  if (skip) {
    if (!scaler.enabled()) {
      STRATA_LOG(kWarn) << "inf/NaN gradients without fp16 loss scaling: step skipped";
    }
    ++stats_.steps_skipped;
    out.adam_step = adam_step();
    STRATA_RETURN_IF_ERROR(ZeroGradAccumulators());
    STRATA_RETURN_IF_ERROR(Commit());  // every rank skips: the same collectives
    return false;
  }

  // 4: clipping.
  if (options_.gradient_clipping > 0.0) {
    out.clip_coef = std::min(1.0, options_.gradient_clipping / (out.global_norm + 1e-6));
  }
  scaling = GradScaling{inv_scale, static_cast<float>(out.clip_coef)};
  return true;
}

Result<bool> OptimizerDriver::TimedPrepare(double lr, LossScaler& scaler, StepOutcome& out,
                                           GradScaling& scaling) {
  AddElapsed timed(stats_.step_s);
  return Prepare(lr, scaler, out, scaling);
}

Result<StepOutcome> OptimizerDriver::Finish(StepOutcome out, Status io, size_t calls,
                                            int64_t next_step) {
  // 6: with a store that can fail, everything is written and every rank's outcome agreed
  // on before the step is committed anywhere.
  if (io.ok()) io = ZeroGradAccumulators();
  STRATA_RETURN_IF_ERROR(CommitAgreed(std::move(io), "the optimizer step"));
  for (int k = 0; k < optimizer_.num_groups(); ++k)
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, next_step));
  out.applied = true;
  out.adam_step = adam_step();
  ++stats_.steps_applied;
  stats_.adam_calls += calls;
  stats_.elements_updated += partition_->partition_numel;
  stats_.params_updated += real_shard_elems_;
  return out;
}

Result<StepOutcome> OptimizerDriver::Step(double lr, LossScaler& scaler,
                                          std::optional<std::pair<double, double>> betas) {
  if (update_ != nullptr) {
    return FailedPreconditionError(
        "Step while a pipelined update is in flight: FinishUpdate first");
  }
  AddElapsed timed(stats_.step_s);
  StepOutcome out;
  GradScaling scaling;
  STRATA_ASSIGN_OR_RETURN(const bool update, Prepare(lr, scaler, out, scaling));
  if (!update) return out;
  const bool can_fail = this->can_fail();
  // 5: the update (Adam: StepAdam; LAMB: StepLamb); every group's step counter advances
  // together, once the step is committed on every rank. Released chunks are written
  // behind only here, where each is visited once.
  const int64_t next_step = adam_step() + 1;
  size_t calls = 0;
  Status io;
  {
    store_->SetWriteBehind(true);
    struct Off {
      offload::StateStore* s;
      ~Off() { s->SetWriteBehind(false); }
    } off{store_};
    if (options_.lamb) {
      STRATA_RETURN_IF_ERROR(StepLamb(lr, betas, scaling, next_step, io));
      calls = 2 * pieces_.size();
    } else {
      Result<size_t> c = StepAdam(lr, betas, scaling, next_step);
      if (!c.ok()) {
        if (!can_fail) return c.status();
        io = c.status();
      } else {
        calls = *c;
      }
    }
  }
  return Finish(out, std::move(io), calls, next_step);
}

AdamParams OptimizerDriver::GroupParamsAt(size_t k, double lr,
                                          std::optional<std::pair<double, double>> betas) const {
  AdamParams params = options_.groups[k];
  params.lr = options_.adam.lr > 0 ? lr * options_.groups[k].lr / options_.adam.lr : lr;
  if (betas) {
    params.beta1 = betas->first;
    params.beta2 = betas->second;
  }
  return params;
}

Result<std::vector<AdamParams>> OptimizerDriver::AdamParamsAt(
    double lr, std::optional<std::pair<double, double>> betas) {
  std::vector<AdamParams> params(options_.groups.size());
  for (size_t k = 0; k < params.size(); ++k) {
    params[k] = GroupParamsAt(k, lr, betas);
    stats_.group_lr[k] = params[k].lr;
    STRATA_RETURN_IF_ERROR(optimizer_.SetGroupParams(static_cast<int>(k), params[k]));
  }
  return params;
}

Status OptimizerDriver::AdamRun(Leases& l, size_t i, const Run& r, std::byte* to,
                                const AdamParams& params, int64_t step, const GradScaling& scaling,
                                bool zero_grad) const {
  const size_t o = r.offset - chunk_begin(i);
  AdamTensors t{l.span(OptimizerState::kMaster).subspan(o, r.count),
                l.span(OptimizerState::kExpAvg).subspan(o, r.count),
                l.span(OptimizerState::kExpAvgSq).subspan(o, r.count),
                GradSpan::Fp32(l.span(OptimizerState::kGradAccumulator).subspan(o, r.count)),
                Param16Span{}};
  const bool half = dtype_ != DType::kFloat32;
  if (half) t.param16 = Param16Span{reinterpret_cast<uint16_t*>(to), r.count, ToScalarType(dtype_)};
  const std::span<float> zero =
      zero_grad ? l.span(OptimizerState::kGradAccumulator).subspan(o, r.count) : std::span<float>{};
  STRATA_RETURN_IF_ERROR(cpu_adam_->Step(params, step, scaling, t, zero));
  if (!half) std::memcpy(to, t.param.data(), t.param.size_bytes());
  return Status::Ok();
}

Result<size_t> OptimizerDriver::StepAdam(double lr, std::optional<std::pair<double, double>> betas,
                                         const GradScaling& scaling, int64_t step) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<AdamParams> params, AdamParamsAt(lr, betas));
  constexpr Access kAccess[4] = {Access::kReadWrite, Access::kReadWrite, Access::kReadWrite,
                                 Access::kRead};
  size_t calls = 0;
  ShardWriter out(working_);
  const bool ascending = std::is_sorted(order_.begin(), order_.end());
  const size_t ahead = options_.prefetch_ahead;
  for (size_t k = 0; k < std::min(ahead, order_.size()); ++k)
    PrefetchSubGroup(order_[k], kAccess);
  for (size_t at = 0; at < order_.size(); ++at) {
    const size_t i = order_[at];
    STRATA_ASSIGN_OR_RETURN(Leases l, AcquireSubGroup(i, kAccess));
    // Keep `ahead` sub-groups coming: the chunks before are already being read.
    if (ahead > 0 && at + ahead < order_.size()) PrefetchSubGroup(order_[at + ahead], kAccess);
    if (options_.on_update) options_.on_update(i, true);
    {
      TimedScope adam(stats_.adam_s, options_.timeline, "CPU optimizer pass",
                      TimelineLane::kOptimizer, static_cast<int>(i));
      // One fused pass per parameter-group run of the sub-group.
      for (const Run& r : chunk_runs_[i]) {
        // The runs cover the sub-group, and in ascending order the partition: a group's
        // shard is then written whole while held (no read of its old contents).
        STRATA_ASSIGN_OR_RETURN(std::byte * to,
                                out.At(r.offset, r.count, ascending || group_inside(r.offset, i)));
        STRATA_RETURN_IF_ERROR(
            AdamRun(l, i, r, to, params[static_cast<size_t>(r.group)], step, scaling));
        ++calls;
      }
    }
    if (options_.on_update) options_.on_update(i, false);
    for (offload::StateLease& lease : l.l)
      STRATA_RETURN_IF_ERROR(lease.Release());
    // The sub-group's gradients are spent: zero now frees an NVMe buffer without a write
    // (a failed step rolls them back with the rest).
    STRATA_RETURN_IF_ERROR(ZeroAccumulatorChunk(i));
  }
  STRATA_RETURN_IF_ERROR(out.Release());
  if (options_.on_group_updated) {
    for (int g = 0; g < static_cast<int>(partition_->groups.size()); ++g)
      options_.on_group_updated(g);
  }
  return calls;
}

Status OptimizerDriver::StepLamb(double lr, std::optional<std::pair<double, double>> betas,
                                 const GradScaling& scaling, int64_t step, Status& io_error) {
  std::vector<LambParams> params;
  for (size_t k = 0; k < options_.groups.size(); ++k) {
    const AdamParams a = GroupParamsAt(k, lr, betas);
    LambParams p;
    p.lr = a.lr;
    p.beta1 = a.beta1;
    p.beta2 = a.beta2;
    p.eps = a.eps;
    p.weight_decay = a.weight_decay;
    p.bias_correction = a.bias_correction;
    p.eps_inside_sqrt = options_.lamb->eps_inside_sqrt;
    p.max_coeff = options_.lamb->max_coeff;
    p.min_coeff = options_.lamb->min_coeff;
    params.push_back(p);
    stats_.group_lr[k] = p.lr;
  }
  const bool can_fail = this->can_fail();
  // Pieces never cross a sub-group: each pass visits the sub-groups in order and runs the
  // pieces of each while its chunks are held.
  auto pass = [&](const Access(&access)[4], auto&& fn) -> Status {
    size_t next = 0;
    // The apply pass (no accumulator) writes the working shards: the pieces cover the
    // partition in ascending order, so each shard is written whole while held.
    const bool copy_out = access[3] == kSkip;
    ShardWriter out(working_);
    const size_t ahead = options_.prefetch_ahead;
    for (size_t k = 0; k < std::min(ahead, num_chunks_); ++k)
      PrefetchSubGroup(k, access);
    for (size_t i = 0; i < num_chunks_; ++i) {
      STRATA_ASSIGN_OR_RETURN(Leases l, AcquireSubGroup(i, access));
      if (ahead > 0 && i + ahead < num_chunks_) PrefetchSubGroup(i + ahead, access);
      const size_t b = chunk_begin(i), e = chunk_end(i);
      for (; next < pieces_.size() && pieces_[next].offset < e; ++next) {
        const Piece& pc = pieces_[next];
        const size_t o = pc.offset - b;
        AdamTensors t{l.span(OptimizerState::kMaster).subspan(o, pc.count),
                      l.span(OptimizerState::kExpAvg).subspan(o, pc.count),
                      l.span(OptimizerState::kExpAvgSq).subspan(o, pc.count), GradSpan{},
                      Param16Span{}};
        if (l.l[3].valid()) {
          t.grad = GradSpan::Fp32(l.span(OptimizerState::kGradAccumulator).subspan(o, pc.count));
        }
        std::byte* to = nullptr;
        if (copy_out) {
          STRATA_ASSIGN_OR_RETURN(to, out.At(pc.offset, pc.count, /*whole=*/true));
          if (dtype_ != DType::kFloat32) {
            t.param16 =
                Param16Span{reinterpret_cast<uint16_t*>(to), pc.count, ToScalarType(dtype_)};
          }
        }
        {
          TimedScope adam(stats_.adam_s, options_.timeline, "CPU optimizer pass",
                          TimelineLane::kOptimizer, static_cast<int>(i));
          STRATA_RETURN_IF_ERROR(fn(pc, t));
        }
        if (copy_out && dtype_ == DType::kFloat32) {
          std::memcpy(to, t.param.data(), t.param.size_bytes());
        }
      }
      for (offload::StateLease& lease : l.l)
        STRATA_RETURN_IF_ERROR(lease.Release());
    }
    return out.Release();
  };
  // 5a: moments, and each parameter's local sums.
  std::vector<double> local(2 * num_params_, 0.0);
  constexpr Access kMoments[4] = {Access::kRead, Access::kReadWrite, Access::kReadWrite,
                                  Access::kRead};
  Status st = pass(kMoments, [&](const Piece& pc, const AdamTensors& t) -> Status {
    AdamTensors moments = t;
    moments.param16 = Param16Span{};
    STRATA_ASSIGN_OR_RETURN(
        LambNorms sums,
        cpu_adam_->LambMoments(params[static_cast<size_t>(pc.group)], step, scaling, moments));
    local[2 * static_cast<size_t>(pc.param)] += sums.param_sq;
    local[2 * static_cast<size_t>(pc.param) + 1] += sums.update_sq;
    return Status::Ok();
  });
  if (!st.ok()) {
    if (!can_fail) return st;
    io_error = st;
  }
  // 5b: every rank, every step, the same all-reduce (a rank without pieces, or whose
  // states failed to load, sends zeros).
  std::vector<float> reduced(local.begin(), local.end());
  if (!reduced.empty()) {
    STRATA_RETURN_IF_ERROR_CTX(comm_->AllReduce(reduced.data(), reduced.size(),
                                                comm::DType::kFloat32, comm::ReduceOp::kSum),
                               "all-reduce of LAMB's per-parameter norms");
    ++stats_.lamb_norms_all_reduce_calls;
    stats_.lamb_norms_all_reduce_bytes += reduced.size() * sizeof(float);
  }
  if (!io_error.ok()) return Status::Ok();
  // 5c: the ratios (the clamp is the same in every group) and the update.
  std::vector<double> ratio(num_params_, 1.0);
  for (size_t q = 0; q < num_params_; ++q) {
    ratio[q] = LambTrustRatio(params.front(), {reduced[2 * q], reduced[2 * q + 1]});
  }
  if (!ratio.empty()) {
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    stats_.lamb_trust_ratio_min = *lo;
    stats_.lamb_trust_ratio_max = *hi;
  }
  constexpr Access kApply[4] = {Access::kReadWrite, Access::kRead, Access::kRead, kSkip};
  st = pass(kApply, [&](const Piece& pc, const AdamTensors& t) -> Status {
    return cpu_adam_->LambApply(params[static_cast<size_t>(pc.group)], step,
                                ratio[static_cast<size_t>(pc.param)], t);
  });
  if (!st.ok()) {
    if (!can_fail) return st;
    io_error = st;
  }
  return Status::Ok();
}

}  // namespace strata::engine

// ---------------------------------------------------------------------------
// The pipelined step

namespace strata::engine {

struct OptimizerDriver::TileNorms {
  // The gradient norm per tile (CpuAdam::kTileElems elements of a chunk, the norm pass's
  // unit): a tile is summed once every group overlapping it is final, so that Step() sums
  // only the tiles left.
  struct TileRef {
    size_t chunk, tile;
  };
  std::vector<std::vector<TileRef>> group_tiles;  // per group: the tiles it overlaps, once
  std::vector<std::vector<uint32_t>> tile_left;   // per chunk, tile: groups not final (summer)
  std::vector<std::vector<double>> tile_sum;      // written by the summer before tile_done
  std::vector<std::vector<uint8_t>> tile_done;    // (guarded by the owner's mutex)
  uint64_t tiles_summed = 0;                      // by the summer (read after it ended)
  // Step() is adding the sums up (guarded by the owner's mutex): the summer keeps no more.
  bool taken = false;
};

struct OptimizerDriver::Update {
  // One kernel call: a run of sub-group `sub_group`.
  struct Item {
    size_t sub_group;
    Run run;
  };
  std::vector<std::vector<Item>> by_group;  // per working-shard group, in partition order
  std::vector<size_t> sub_items;            // per sub-group: its items
  size_t items = 0;
  std::vector<Leases> sub;  // per sub-group: master, m, v and accumulator, all held
  // Per working-shard group: its shard, held for writing from when the group is given to
  // the worker until it is waited for.
  std::vector<offload::StateLease> shards;
  std::vector<AdamParams> params;
  GradScaling scaling;
  double lr = 0.0;
  int64_t next_step = 0;
  bool early = false;  // an early step: the accumulators are zeroed at FinishUpdate
  // Per chunk: its spent gradients are left in place (lazy zeroing), not zeroed by the
  // update's kernel or at FinishUpdate.
  std::vector<uint8_t> lazy;
  // States in a store that can fail (NVMe): not leased up front; the worker streams the
  // sub-groups through the store (RunStreamedUpdate), which only it uses until it ends.
  bool streamed = false;
  offload::StateStoreStats store_stats;  // the store's counters at the start (streamed)
  double store_wait_s = 0;               // the store's waits while the worker streamed
  bool counted = false;                  // the step is in the statistics (StartStep, StepEarly)
  std::vector<uint8_t> given;  // per group: handed to the worker (the engine's thread only)
  // Working shards on NVMe (see the header): per group, whether its shard is staged, and
  // (the engine's thread) whether it was copied into its store; the hand-over's first error.
  std::vector<uint8_t> staged;
  std::vector<uint8_t> handed;
  Status handover_error;
  // Per staged group: what its store's write checksums (block_bytes 0: none), and the
  // block CRCs the worker computed once the group was done (guarded by mu; only for a
  // hand-over that gives the store its buffer), passed with it so the engine's thread
  // computes none.
  std::vector<offload::StateStore::WriteChecksums> crc_layout;
  std::vector<std::vector<uint32_t>> crcs;
  size_t stage_bytes = 0;  // each staging buffer's size
  size_t stage_cap = 0;    // buffers kept while a group waits to be handed over
  // An early step's gradient norm: the worker sums a tile once every group overlapping it
  // is done (its gradient is final then). tile_done is guarded by mu.
  TileNorms tiles;
  Timeline::Clock::time_point began;
  std::thread worker;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<int> queue;  // groups given and not yet taken (guarded by mu)
  bool closed = false;    // no more groups will come (guarded by mu)
  bool abort = false;     // the worker stops at once (guarded by mu)
  // The worker takes no group while set (guarded by mu): an early step's Step() sums the
  // gradient norm's tiles left on CPU-Adam's threads alone (NoteEarlyAccNorms).
  bool paused = false;
  std::vector<uint8_t> done;  // per group: its runs ran (guarded by mu)
  // Staging (guarded by mu): the buffers, the free ones, per group the one it writes (-1:
  // none) and the staged groups done and not handed over yet, in the order they were done.
  std::vector<offload::StateMemory> pool;
  std::vector<int> free_bufs;
  std::vector<int> stage_buf;
  std::deque<int> ready;
  bool starved = false;   // the worker waits for a staging buffer
  bool finished = false;  // the worker ended (guarded by mu)
  Status error;           // the worker's first error (guarded by mu)
  // The worker's own time and spans, read after it ended.
  double adam_s = 0;
  double checksum_s = 0;  // computing staged shards' block CRCs
  Timeline::Clock::time_point ended;
  struct Span {
    int group;  // -1: a streamed sub-group's pass
    Timeline::Clock::time_point begin, end;
    size_t sub_group = 0;
    bool checksums = false;  // group's block CRCs
  };
  std::vector<Span> spans;
};

struct OptimizerDriver::NormAhead {
  TileNorms tiles;                       // tile_done guarded by mu
  std::vector<offload::StateLease> acc;  // every accumulator chunk, held
  std::vector<uint8_t> given;            // per group: handed to the thread (engine's thread)
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int> queue;  // groups given and not yet summed (guarded by mu)
  bool abort = false;     // the thread stops after the group in progress (guarded by mu)
  Status error;           // the thread's first error (guarded by mu)
};

namespace {

// Gives every lease of an update back (the first error returned).
template <typename LeasesT>
Status ReleaseAll(std::vector<LeasesT>& sub, std::vector<offload::StateLease>& shards) {
  Status first;
  auto release = [&](offload::StateLease& lease) {
    Status s = lease.Release();
    if (first.ok()) first = s;
  };
  for (LeasesT& l : sub) {
    for (offload::StateLease& lease : l.l)
      release(lease);
  }
  for (offload::StateLease& lease : shards)
    release(lease);
  return first;
}

// Sets `abort` (guarded by `mu`), wakes the thread waiting on `cv` and joins it: an update's
// worker or the norm's thread stops after the run or group in progress.
void StopThread(std::mutex& mu, std::condition_variable& cv, bool& abort, std::thread& thread) {
  {
    std::lock_guard<std::mutex> lock(mu);
    abort = true;
  }
  cv.notify_all();
  if (thread.joinable()) thread.join();
}

// Stops an update's worker at once (after the run in progress), joins it and gives every
// lease back; nothing is committed.
template <typename UpdateT>
void AbortUpdate(UpdateT& u) {
  StopThread(u.mu, u.cv, u.abort, u.worker);
  Status s = ReleaseAll(u.sub, u.shards);
}

// A staging buffer of `bytes` from `alloc` (null: the heap).
Result<offload::StateMemory> NewStagingBuffer(const offload::StateAllocator& alloc, size_t bytes) {
  if (alloc) return alloc(bytes, "staged working shards");
  std::shared_ptr<std::byte[]> heap(new std::byte[bytes]);
  std::byte* data = heap.get();
  return offload::StateMemory{data, bytes, std::move(heap)};
}

}  // namespace

OptimizerDriver::~OptimizerDriver() {
  DropNormInBackward();  // its thread ends
  // An engine going away mid-update (an error unwound it): the worker ends, the leases go
  // back; nothing is committed.
  if (update_ != nullptr) {
    AbortUpdate(*update_);
    if (update_->streamed) store_->SetWriteBehind(false);
  }
}

Result<std::unique_ptr<OptimizerDriver::Update>> OptimizerDriver::NewUpdate(
    std::vector<AdamParams> params, GradScaling scaling, bool early) {
  auto u = std::make_unique<Update>();
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
  constexpr Access kAccess[4] = {Access::kReadWrite, Access::kReadWrite, Access::kReadWrite,
                                 Access::kReadWrite};
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
  u->given.assign(groups, 0);
  u->done.assign(groups, 0);
  u->staged.resize(groups);
  u->handed.assign(groups, 0);
  u->stage_buf.assign(groups, -1);
  u->crc_layout.resize(groups);
  u->crcs.resize(groups);
  u->stage_bytes = StagingBytes();
  for (size_t g = 0; g < groups; ++g) {
    u->staged[g] = ShardStaged(static_cast<int>(g)) ? 1 : 0;
    // (Asked here: a store is the engine's thread's.)
    if (u->staged[g] != 0) u->crc_layout[g] = working_->write_checksums(static_cast<int>(g));
  }
  if (u->stage_bytes > 0) {
    u->stage_cap = std::max<size_t>(1, options_.staged_shard_buffers);
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
  if (working_->has(group) && u.staged[g] == 0) {
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
  const size_t count = std::max<size_t>(1, options_.staged_shard_buffers);
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
                                               const std::vector<int>& group_order) {
  if (!CanPipeline()) {
    return FailedPreconditionError(
        "the optimizer step cannot be pipelined (LAMB, or working shards on NVMe)");
  }
  if (update_ != nullptr) {
    return FailedPreconditionError("StartStep while a pipelined update is in flight");
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
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Update> u,
                          NewUpdate(std::move(params), scaling, /*early=*/false));
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
  stats_.adam_calls += u->items;
  stats_.elements_updated += partition_->partition_numel;
  stats_.params_updated += real_shard_elems_;
  update_ = std::move(u);
  return out;
}

Status OptimizerDriver::BeginEarlyStep(double lr, std::optional<std::pair<double, double>> betas,
                                       const LossScaler& scaler) {
  if (!CanStepEarly() || scaler.enabled() || options_.gradient_clipping > 0.0) {
    return FailedPreconditionError(
        "the optimizer step cannot start during the backward: it needs Adam, optimizer states "
        "and working shards in memory, no gradient clipping, no fp16 loss scaling and inf/NaN "
        "steps applied (strata.skip_inf_nan_steps false)");
  }
  if (update_ != nullptr || norm_ahead_ != nullptr) {
    return FailedPreconditionError(
        "BeginEarlyStep while a pipelined update or the norm in the backward is in flight");
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<AdamParams> params, AdamParamsAt(lr, betas));
  // What Prepare gives without loss scaling and clipping.
  const GradScaling scaling{static_cast<float>(1.0 / scaler.scale()), 1.0f};
  STRATA_ASSIGN_OR_RETURN(update_, NewUpdate(std::move(params), scaling, /*early=*/true));
  update_->lr = lr;
  early_collecting_ = true;
  return Status::Ok();
}

Status OptimizerDriver::ReleaseGroup(int group) {
  if (update_ == nullptr || !early_collecting_) {
    return FailedPreconditionError("ReleaseGroup outside an early step");
  }
  if (!GroupReleased(group)) ++stats_.groups_released_in_backward;
  return Give(*update_, group);
}

bool OptimizerDriver::GroupReleased(int group) const {
  return update_ != nullptr && group >= 0 && static_cast<size_t>(group) < update_->given.size() &&
         update_->given[static_cast<size_t>(group)] != 0;
}

Status OptimizerDriver::ReleaseRemainingGroups(const std::vector<int>& order) {
  if (update_ == nullptr) return Status::Ok();
  for (int g : order)
    STRATA_RETURN_IF_ERROR(Give(*update_, g));
  for (int g = 0; g < static_cast<int>(partition_->groups.size()); ++g)
    STRATA_RETURN_IF_ERROR(Give(*update_, g));
  {
    // The groups given during the backward and not taken yet came in the backward's order,
    // the reverse of the next forward's: the worker takes every group left in `order`, so
    // the forward's first groups are not updated after those it needs last.
    std::vector<size_t> at(partition_->groups.size(), order.size());
    for (size_t k = order.size(); k-- > 0;) {  // a group listed twice: its first place
      if (order[k] >= 0 && static_cast<size_t>(order[k]) < at.size()) {
        at[static_cast<size_t>(order[k])] = k;
      }
    }
    std::lock_guard<std::mutex> lock(update_->mu);
    std::stable_sort(update_->queue.begin(), update_->queue.end(), [&](int a, int b) {
      return at[static_cast<size_t>(a)] < at[static_cast<size_t>(b)];
    });
  }
  CloseUpdate(*update_);
  return Status::Ok();
}

Result<StepOutcome> OptimizerDriver::StepEarly(double lr, LossScaler& scaler) {
  if (update_ == nullptr || !early_collecting_) {
    return FailedPreconditionError("StepEarly without BeginEarlyStep");
  }
  early_collecting_ = false;
  Update& u = *update_;
  if (lr != u.lr) {
    return FailedPreconditionError("the early step's learning rate changed from " +
                                   std::to_string(u.lr) + " to " + std::to_string(lr) +
                                   " after its update started");
  }
  {
    // From here Prepare sums the tiles the worker has not (the worker sums no more).
    std::lock_guard<std::mutex> lock(u.mu);
    u.tiles.taken = true;
  }
  StepOutcome out;
  GradScaling scaling;
  STRATA_ASSIGN_OR_RETURN(const bool update, TimedPrepare(lr, scaler, out, scaling));
  if (!update || scaling.inv_loss_scale != u.scaling.inv_loss_scale ||
      scaling.clip_coef != u.scaling.clip_coef) {
    return InternalError("an early step was skipped or scaled after its update started");
  }
  out.applied = true;
  out.adam_step = u.next_step;
  u.counted = true;
  ++stats_.steps_applied;
  ++stats_.steps_pipelined;
  ++stats_.steps_early;
  stats_.adam_calls += u.items;
  stats_.elements_updated += partition_->partition_numel;
  stats_.params_updated += real_shard_elems_;
  return out;
}

Status OptimizerDriver::BeginNormInBackward() {
  if (!CanSumNormInBackward() || update_ != nullptr || norm_ahead_ != nullptr) {
    return FailedPreconditionError(
        "the gradient norm cannot be summed during this backward: it needs the optimizer "
        "states in host memory and no optimizer update or norm in flight");
  }
  auto n = std::make_unique<NormAhead>();
  n->tiles = NewTileNorms();
  n->given.assign(partition_->groups.size(), 0);
  n->acc.reserve(num_chunks_);
  for (size_t i = 0; i < num_chunks_; ++i) {
    Result<StateLease> l =
        store_->Acquire(StateRange{id(OptimizerState::kGradAccumulator), i}, Access::kReadWrite);
    if (!l.ok()) {
      for (StateLease& held : n->acc)
        Status s = held.Release();
      return l.status().WithContext("summing the gradient norm during the backward");
    }
    n->acc.push_back(std::move(*l));
  }
  NormAhead* raw = n.get();
  n->thread = std::thread([this, raw] { RunNormAhead(*raw); });
  norm_ahead_ = std::move(n);
  ++stats_.norms_in_backward;
  return Status::Ok();
}

void OptimizerDriver::RunNormAhead(NormAhead& n) {
  const auto acc_of = [&n](size_t i) { return n.acc[i].as<float>(); };
  for (;;) {
    int g = -1;
    {
      std::unique_lock<std::mutex> lock(n.mu);
      n.cv.wait(lock, [&] { return !n.queue.empty() || n.abort; });
      if (n.abort) return;
      g = n.queue.front();
      n.queue.pop_front();
    }
    Status st = SumFinalTiles(n.tiles, n.mu, acc_of, g);
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(n.mu);
      n.error = st.WithContext("summing the gradient norm during the backward");
      return;
    }
    if (options_.on_norm_summed) options_.on_norm_summed(g);
  }
}

void OptimizerDriver::NormGroupFinal(int group) {
  if (norm_ahead_ == nullptr || group < 0 ||
      static_cast<size_t>(group) >= norm_ahead_->given.size() ||
      norm_ahead_->given[static_cast<size_t>(group)] != 0) {
    return;
  }
  norm_ahead_->given[static_cast<size_t>(group)] = 1;
  // The norm's thread reads the group's gradients from now on.
  MaterializeGroupZeros(group, [this](size_t i) { return norm_ahead_->acc[i].as<float>(); });
  {
    std::lock_guard<std::mutex> lock(norm_ahead_->mu);
    norm_ahead_->queue.push_back(group);
  }
  norm_ahead_->cv.notify_all();
}

void OptimizerDriver::NormGroupsFinal(const std::vector<int>& order) {
  for (int g : order)
    NormGroupFinal(g);
  for (int g = 0; g < static_cast<int>(partition_->groups.size()); ++g)
    NormGroupFinal(g);
}

bool OptimizerDriver::NormGivenIn(size_t offset, size_t n) const {
  for (size_t pos = offset; pos < offset + n && pos < partition_->partition_numel;) {
    if (NormGroupGiven(working_->GroupAt(pos))) return true;
    pos = std::max(pos + 1, group_end(pos));
  }
  return false;
}

bool OptimizerDriver::NormGroupGiven(int group) const {
  return norm_ahead_ != nullptr && group >= 0 &&
         static_cast<size_t>(group) < norm_ahead_->given.size() &&
         norm_ahead_->given[static_cast<size_t>(group)] != 0;
}

void OptimizerDriver::DropNormInBackward() {
  if (norm_ahead_ == nullptr) return;
  std::unique_ptr<NormAhead> n = std::move(norm_ahead_);
  StopThread(n->mu, n->cv, n->abort, n->thread);
  for (StateLease& l : n->acc) {
    Status s = l.Release();  // host memory: a lease is a pointer
  }
  ++stats_.norms_in_backward_dropped;
}

Status OptimizerDriver::SumNormInBackward() {
  std::unique_ptr<NormAhead> n = std::move(norm_ahead_);
  StopThread(n->mu, n->cv, n->abort, n->thread);
  Status st = n->error;
  for (size_t i = 0; i < num_chunks_ && st.ok(); ++i) {
    if (!acc_norm_[i].valid) st = NoteTiledAccNorm(n->tiles, n->mu, n->acc[i].as<float>(), i);
  }
  stats_.norm_tiles_in_background += n->tiles.tiles_summed;
  for (StateLease& l : n->acc) {
    Status released = l.Release();
    if (st.ok()) st = released;
  }
  return st;
}

OptimizerDriver::TileNorms OptimizerDriver::NewTileNorms() const {
  TileNorms t;
  t.tile_left.resize(num_chunks_);
  t.tile_sum.resize(num_chunks_);
  t.tile_done.resize(num_chunks_);
  for (size_t i = 0; i < num_chunks_; ++i) {
    const size_t tiles = CpuAdam::NumTiles(chunk_end(i) - chunk_begin(i));
    t.tile_left[i].assign(tiles, 0);
    t.tile_sum[i].assign(tiles, 0.0);
    t.tile_done[i].assign(tiles, 0);
  }
  t.group_tiles.resize(partition_->groups.size());
  // The runs in partition order (chunk by chunk): each group's come in that order too, so a
  // tile it already counts is its last.
  for (size_t i = 0; i < num_chunks_; ++i) {
    for (const Run& r : chunk_runs_[i]) {
      if (r.count == 0) continue;
      std::vector<TileNorms::TileRef>& mine =
          t.group_tiles[static_cast<size_t>(working_->GroupAt(r.offset))];
      const size_t first = (r.offset - chunk_begin(i)) / CpuAdam::kTileElems;
      const size_t last = (r.offset + r.count - 1 - chunk_begin(i)) / CpuAdam::kTileElems;
      for (size_t k = first; k <= last; ++k) {
        if (!mine.empty() && mine.back().chunk == i && mine.back().tile == k) continue;
        mine.push_back({i, k});
        ++t.tile_left[i][k];
      }
    }
  }
  return t;
}

Status OptimizerDriver::SumFinalTiles(TileNorms& t, std::mutex& mu,
                                      const std::function<std::span<float>(size_t)>& acc_of,
                                      int group) const {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (t.taken) return Status::Ok();
  }
  std::vector<TileNorms::TileRef> ready;
  for (const TileNorms::TileRef& r : t.group_tiles[static_cast<size_t>(group)]) {
    if (--t.tile_left[r.chunk][r.tile] == 0) ready.push_back(r);
  }
  for (const TileNorms::TileRef& r : ready) {
    const AccZeros& z = acc_zeros_[r.chunk];
    if (z.tile_summed[r.tile] != 0) {  // summed as it was written
      t.tile_sum[r.chunk][r.tile] = z.tile_sum[r.tile];
      continue;
    }
    const std::span<float> acc = acc_of(r.chunk);
    const size_t b = r.tile * CpuAdam::kTileElems;
    const size_t n = std::min(CpuAdam::kTileElems, acc.size() - b);
    STRATA_RETURN_IF_ERROR(cpu_adam_->GradSquaredNormTiles(
        GradSpan::Fp32(acc.subspan(b, n)), std::span<double>(&t.tile_sum[r.chunk][r.tile], 1)));
  }
  std::lock_guard<std::mutex> lock(mu);
  if (t.taken) return Status::Ok();  // Step() summed these itself
  for (const TileNorms::TileRef& r : ready) {
    t.tile_done[r.chunk][r.tile] = 1;
    if (acc_zeros_[r.chunk].tile_summed[r.tile] == 0) ++t.tiles_summed;
  }
  return Status::Ok();
}

Status OptimizerDriver::NoteEarlyAccNorms(const std::vector<size_t>& chunks) {
  Update& u = *update_;
  // The worker finishes the group in progress and takes no other until the sums are done:
  // the two would share CPU-Adam's threads and the memory bandwidth, and the next forward
  // cannot start before Step() returns anyway.
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.paused = true;
  }
  if (options_.on_early_norm) options_.on_early_norm();
  Status st;
  for (size_t at = 0; at < chunks.size() && st.ok(); ++at)
    st = NoteTiledAccNorm(u.tiles, u.mu, LeasedAccumulator(chunks[at]), chunks[at]);
  {
    std::lock_guard<std::mutex> lock(u.mu);
    u.paused = false;
  }
  u.cv.notify_all();
  return st;
}

Status OptimizerDriver::NoteTiledAccNorm(TileNorms& t, std::mutex& mu, std::span<float> acc,
                                         size_t chunk) {
  std::vector<double> sums(t.tile_sum[chunk].size(), 0.0);
  std::vector<uint8_t> done;
  {
    std::lock_guard<std::mutex> lock(mu);
    done = t.tile_done[chunk];
    for (size_t k = 0; k < sums.size(); ++k) {
      if (done[k] != 0) sums[k] = t.tile_sum[chunk][k];
    }
  }
  // The tiles summed as they were written (not counted as the summer's), then those not
  // summed yet, here: each run of them in one pass.
  std::vector<uint8_t> have;
  const size_t as_written = TilesAsWritten(chunk, sums, have);
  for (size_t k = 0; k < sums.size(); ++k)
    done[k] = static_cast<uint8_t>(done[k] | have[k]);
  STRATA_ASSIGN_OR_RETURN(const size_t summed, SumTilesLeft(acc, sums, done));
  stats_.norm_tiles_in_step += summed;
  const GradNorm local = CpuAdam::GradNormOfTiles(sums);
  acc_norm_[chunk] =
      ChunkNorm{true, local.sum_sq, local.has_inf_nan, static_cast<uint32_t>(as_written)};
  return Status::Ok();
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
  if (options_.on_group_updated) options_.on_group_updated(group);
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
    if (options_.on_update) options_.on_update(i, true);
    std::vector<int> touched;  // the groups of the sub-group's runs, each once (contiguous)
    for (const Run& r : chunk_runs_[i]) {
      const int g = working_->GroupAt(r.offset);
      STRATA_ASSIGN_OR_RETURN(std::byte * out, ShardOut(u, g));
      if (out == nullptr) return Status::Ok();  // aborted
      std::byte* to = out + (r.offset - working_->offset(g)) * elem;
      {
        AddElapsed timed(u.adam_s);
        STRATA_RETURN_IF_ERROR(
            AdamRun(l, i, r, to, u.params[static_cast<size_t>(r.group)], u.next_step, u.scaling));
      }
      if (touched.empty() || touched.back() != g) touched.push_back(g);
    }
    if (options_.on_update) options_.on_update(i, false);
    for (offload::StateLease& lease : l.l)
      STRATA_RETURN_IF_ERROR(lease.Release());
    // The gradients are spent: zeroed without a write (a failed step rolls them back).
    STRATA_RETURN_IF_ERROR(store_->ZeroChunk(StateRange{id(OptimizerState::kGradAccumulator), i}));
    acc_norm_[i] = ChunkNorm{true, 0.0, false};
    u.spans.push_back({-1, began, Timeline::Clock::now(), i});
    for (int g : touched) {
      if (--left[static_cast<size_t>(g)] == 0) GroupDone(u, g);
    }
  }
  return Status::Ok();
}

void OptimizerDriver::RunUpdate(Update& u) {
  const size_t elem = DTypeSize(dtype_);
  // Each sub-group's items still to run, for on_update's begin and end.
  std::vector<size_t> left = u.sub_items;
  std::vector<uint8_t> started(num_chunks_, 0);
  Status st;
  if (u.streamed) {
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
    if (!u.by_group[static_cast<size_t>(g)].empty()) {
      Result<std::byte*> o = ShardOut(u, g);
      if (!o.ok()) st = o.status();
      if (!o.ok() || *o == nullptr) break;  // failed, or aborted
      out = *o;
    }
    for (const Update::Item& it : u.by_group[static_cast<size_t>(g)]) {
      const size_t i = it.sub_group;
      if (options_.on_update && started[i] == 0) options_.on_update(i, true);
      started[i] = 1;
      Leases& l = u.sub[i];
      std::byte* to = out + (it.run.offset - working_->offset(g)) * elem;
      {
        AddElapsed timed(u.adam_s);
        // The gradients are spent: each tile is zeroed as the kernel leaves it, so the next
        // backward accumulates from zero, unless they are left in place (lazy zeroing).
        // (An early step's norm is computed after its updates began: FinishUpdate zeroes.)
        st = AdamRun(l, i, it.run, to, u.params[static_cast<size_t>(it.run.group)], u.next_step,
                     u.scaling, /*zero_grad=*/!u.early && u.lazy[i] == 0);
      }
      if (!st.ok()) break;
      if (--left[i] == 0 && options_.on_update) options_.on_update(i, false);
    }
    if (!st.ok()) break;
    u.spans.push_back({g, began, Timeline::Clock::now()});
    GroupDone(u, g);
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
  if (u->early) {
    // The gradients are spent (the norm was computed from them at StepEarly): zeroed, or
    // left in place (lazy zeroing).
    for (size_t i = 0; i < u->sub.size(); ++i) {
      if (u->lazy[i] == 0)
        ZeroAccumulators(*cpu_adam_, u->sub[i].span(OptimizerState::kGradAccumulator));
    }
  }
  const Status released = ReleaseAll(u->sub, u->shards);
  stats_.adam_s += u->adam_s;
  stats_.shard_checksum_s += u->checksum_s;
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
      if (u->lazy[i] == 0) acc_zeros_[i].Set(true);
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

}  // namespace strata::engine

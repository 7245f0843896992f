// The gradient accumulators: reduced shards added in, the norm's tiles noted as written,
// and spent gradients zeroed lazily (optimizer_driver.h).
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

Status OptimizerDriver::NoteDeviceNorm(size_t chunk) {
  ChunkNorm& c = acc_norm_[chunk];
  c.valid = false;
  // The same tiles the host would sum, summed where the sums are, added up here in the same
  // order (GradNormOfTiles): the same bits as NoteAccNorm over a host copy.
  std::vector<double> sums(CpuAdam::NumTiles(chunk_end(chunk) - chunk_begin(chunk)), 0.0);
  STRATA_RETURN_IF_ERROR(
      sums_->NormTiles(StateRange{id(OptimizerState::kGradAccumulator), chunk}, sums));
  const GradNorm local = CpuAdam::GradNormOfTiles(sums);
  c = ChunkNorm{true, local.sum_sq, local.has_inf_nan, 0};
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
      options_.test.norm_as_written && boundary_micro_step_.load(std::memory_order_relaxed);
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
  if (sums_ != nullptr) {
    return FailedPreconditionError(
        "gradients added into host accumulators while the optimizer reads the device's sums "
        "(OptimizerDriverOptions::device_sums): the reducer must keep them on the device");
  }
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

Status OptimizerDriver::ZeroAccumulatorChunk(size_t i) {
  DropNormInBackward();
  if (LazyZero() && acc_zeros_[i].zeroed) {
    ZeroLazily(i);
    acc_norm_[i] = ChunkNorm{true, 0.0, false};
    return Status::Ok();
  }
  const StateRange range{id(OptimizerState::kGradAccumulator), i};
  if (sums_ != nullptr) {
    // On the device, behind the additions and the fetches queued there. The micro-steps
    // add into them unseen by the driver: never known zero, their norm summed anew.
    STRATA_RETURN_IF_ERROR(sums_->ZeroChunk(range));
    acc_zeros_[i].Set(false);
    acc_norm_[i] = ChunkNorm{};
    return Status::Ok();
  }
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
  return options_.test.lazy_zero && !store_->can_fail() && sums_ == nullptr;
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
        StoreFor(OptimizerState::kGradAccumulator)
            ->Acquire(StateRange{id(OptimizerState::kGradAccumulator), i}, Access::kReadWrite));
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

}  // namespace strata::engine

// The gradient norm summed during the backward, tile by tile as groups become final
// (optimizer_driver.h, docs/engine.md "The norm in the backward").
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
        StoreFor(OptimizerState::kGradAccumulator)
            ->Acquire(StateRange{id(OptimizerState::kGradAccumulator), i}, Access::kReadWrite);
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
  if (options_.bind_thread) {
    if (Status bound = options_.bind_thread(); !bound.ok()) {
      std::lock_guard<std::mutex> lock(n.mu);
      n.error = bound.WithContext("the norm thread");
      return;
    }
  }
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
    if (options_.test.on_norm_summed) options_.test.on_norm_summed(g);
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
  if (options_.test.on_early_norm) options_.test.on_early_norm();
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

}  // namespace strata::engine

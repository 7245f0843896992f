// The optimizer driver's own pieces, shared by its files (internal to engine/step/): the
// helpers of accumulation, the pipelined update's and the norm's state, and the threads'
// stopping. optimizer_driver.h is the driver's interface; docs/engine.md ("OptimizerDriver")
// its design.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "strata/engine/step/optimizer_driver.h"

namespace strata::engine {

namespace driver_internal {

using offload::Access;
using offload::StateLease;
using offload::StateRange;

// In an access list: this state is not acquired.
inline constexpr auto kSkip = static_cast<Access>(0xff);

inline constexpr OptimizerState kStates[4] = {OptimizerState::kMaster, OptimizerState::kExpAvg,
                                              OptimizerState::kExpAvgSq,
                                              OptimizerState::kGradAccumulator};

// acc[0, n) += src[0, n) (fp32 accumulators), on the optimizer's threads: one thread did
// 1.3B elements a step in about 0.8 s, longer than an H200's backward (PERFORMANCE.md).
// Elementwise: the same sums whatever the split. `zeroed`: acc holds +0.0, written
// without being read (the same sums).
inline void AddIntoAccumulators(const CpuAdam& adam, const std::byte* src, DType dtype, float* acc,
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
inline void ZeroAccumulators(const CpuAdam& adam, std::span<float> acc) {
  adam.ForEachTile(acc.size(), [&](size_t b, size_t e) {
    std::memset(acc.data() + b, 0, (e - b) * sizeof(float));
  });
}

using Ranges = std::vector<std::pair<size_t, size_t>>;

// a and b (each sorted and disjoint) united: sorted, disjoint, touching ranges merged.
inline Ranges UniteRanges(const Ranges& a, const Ranges& b) {
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
inline void SubtractRange(Ranges& ranges, size_t b, size_t e) {
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
inline void StopThread(std::mutex& mu, std::condition_variable& cv, bool& abort,
                       std::thread& thread) {
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
inline Result<offload::StateMemory> NewStagingBuffer(const offload::StateAllocator& alloc,
                                                     size_t bytes) {
  if (alloc) return alloc(bytes, "staged working shards");
  std::shared_ptr<std::byte[]> heap(new std::byte[bytes]);
  std::byte* data = heap.get();
  return offload::StateMemory{data, bytes, std::move(heap)};
}

}  // namespace driver_internal

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
  // A delayed update (strata.delayed_update): master, m and v only; the working shards are
  // neither leased nor written (the engine copies the master out at the next step).
  bool keep_shards = false;
  // With keep_shards: each group's working shard first gets the master as it is before this
  // update (the last delayed update's parameters), then the group is done (WaitGroup returns)
  // and its Adam pass runs without writing the shard.
  bool copy_out_first = false;
  // Per chunk: its spent gradients are left in place (lazy zeroing), not zeroed by the
  // update's kernel or at FinishUpdate.
  std::vector<uint8_t> lazy;
  // The device's sums (OptimizerDriverOptions::device_sums), not streamed: per chunk,
  // whether the worker leased, released and zeroed them (it leases each when its first run
  // comes; read by the engine's thread after the worker ended).
  std::vector<uint8_t> sums_zeroed;
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
  double copy_out_s = 0;  // copy_out_first: the copies into the working shards
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

template <typename Fn>
Status OptimizerDriver::ForRange(OptimizerState s, size_t offset, size_t n, offload::Access access,
                                 Fn fn) {
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
    STRATA_ASSIGN_OR_RETURN(offload::StateLease l,
                            StoreFor(s)->Acquire(offload::StateRange{id(s), i}, access));
    fn(l.as<float>().subspan(pos - chunk_begin(i), end - pos), pos - offset);
    STRATA_RETURN_IF_ERROR(l.Release());
    pos = end;
  }
  return Status::Ok();
}

}  // namespace strata::engine

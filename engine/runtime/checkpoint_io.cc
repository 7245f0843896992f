// What a checkpoint's save and load share (checkpoint_io.h).
#include "strata/engine/runtime/checkpoint_io.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <utility>

#include "strata/engine/checkpoint/checkpoint.h"

namespace strata::engine {

Status AtStepBoundary(bool backward_since_step, bool reducer_pending, int64_t micro_steps,
                      int64_t accumulation, const char* what) {
  if (backward_since_step || reducer_pending) {
    return FailedPreconditionError(std::string(what) +
                                   " between a backward and its step: call it before "
                                   "training or right after step()");
  }
  if (micro_steps % accumulation != 0) {
    // DeepSpeed saves here and drops the micro-steps accumulated so far; Strata keeps nothing
    // back silently.
    return FailedPreconditionError(
        std::string(what) + " in the middle of a gradient accumulation (micro-step " +
        std::to_string(micro_steps % accumulation) + " of " + std::to_string(accumulation) +
        " done): a checkpoint holds no accumulated gradients, so these would be lost; call "
        "it after the step() that ends the accumulation (one in every " +
        std::to_string(accumulation) + " step() calls) or before training");
  }
  return Status::Ok();
}

void MaybeCrash(const std::string& crash_at, const char* point) {
  if (crash_at == point) ::_exit(9);
}

Result<std::vector<uint64_t>> FrozenFingerprintPartials(const ModelPartition& partition,
                                                        WorkingShards& shards, DType as,
                                                        const CpuAdam& adam) {
  const int first = partition.num_trainable;
  const DType dtype = shards.dtype();
  const size_t elem = DTypeSize(dtype);
  // Working values are exact in their own dtype and in fp32.
  const std::optional<DType> round_to =
      as != DType::kFloat32 && as != dtype ? std::optional<DType>(as) : std::nullopt;
  std::vector<uint64_t> out(partition.groups.size() - static_cast<size_t>(first), 0);
  for (int g = first; g < static_cast<int>(partition.groups.size()); ++g) {
    if (!shards.has(g)) continue;
    const GroupLayout& l = partition.groups[static_cast<size_t>(g)];
    const uint64_t s0 = l.shard_begin(partition.rank);
    // The parameters' elements in the shard, as ranges of the shard (padding left out).
    std::vector<std::pair<uint64_t, uint64_t>> runs;
    for (const ParamSlot& p : l.params) {
      const uint64_t b = std::max<uint64_t>(p.offset, s0);
      const uint64_t e = std::min<uint64_t>(p.offset + p.numel, s0 + l.shard_numel);
      if (b < e) runs.emplace_back(b - s0, e - s0);
    }
    if (runs.empty()) continue;
    STRATA_ASSIGN_OR_RETURN(offload::StateLease lease, shards.Acquire(g, offload::Access::kRead));
    const std::byte* data = lease.data();
    std::atomic<uint64_t> sum{0};
    adam.ForEachTile(l.shard_numel, [&](size_t tb, size_t te) {
      constexpr size_t kBlock = 1024;
      float values[kBlock];
      uint64_t local = 0;  // mod 2^64, as the sum of the ranks' partials
      for (const auto& [rb, re] : runs) {
        const uint64_t end = std::min<uint64_t>(re, te);
        for (uint64_t at = std::max<uint64_t>(rb, tb); at < end; at += kBlock) {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(kBlock, end - at));
          ConvertToFloat(data + at * elem, dtype, n, values);
          local += FrozenFingerprintSum(std::span<float>(values, n), s0 + at, round_to);
        }
      }
      sum.fetch_add(local, std::memory_order_relaxed);
    });
    out[static_cast<size_t>(g - first)] = sum.load();
    STRATA_RETURN_IF_ERROR(lease.Release());
  }
  return out;
}

}  // namespace strata::engine

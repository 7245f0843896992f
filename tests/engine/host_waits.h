// The design's bound on the host's waits on the device in one Step() cycle
// (docs/engine/device.md, "Every wait of a step"): each named wait at most once per operation of
// the step that needs it, and none of the kinds a step should never have. Shared by the CPU
// test (EngineCoreTest.HostWaitsPerStepAreNamedAndWithinTheDesign) and the GPU one
// (Zero3CudaTest).
#pragma once

#include <string>

#include "strata/core/status.h"
#include "strata/engine/runtime/engine_core.h"

namespace strata::engine::testing {

// `before`: the statistics at the previous Step()'s return; `after`: at this one's;
// `groups`: the engine's number of groups.
inline Status CheckHostWaitsOfAStep(const EngineStats& before, const EngineStats& after,
                                    int groups) {
  const auto waits = [&](HostWait w) { return after.host_waits_last_step[static_cast<size_t>(w)]; };
  std::string wrong;
  const auto within = [&](HostWait w, uint64_t bound) {
    if (waits(w) > bound) {
      wrong += std::string(wrong.empty() ? "" : "; ") + std::string(HostWaitName(w)) + " " +
               std::to_string(waits(w)) + " > " + std::to_string(bound);
    }
  };
  within(HostWait::kOther, 0);
  within(HostWait::kShutdown, 0);
  within(HostWait::kShardZeroFill, 0);
  within(HostWait::kGradientRead, 0);  // the front ends pass owners, or need none (CUDA)
  within(HostWait::kEndOfBackward, 1);
  within(HostWait::kBucketInputs, after.reducer.buckets_reduced - before.reducer.buckets_reduced);
  within(HostWait::kGradientShards, after.reducer.shard_copies - before.reducer.shard_copies);
  // The device's sums (CPU-Adam on them): one per sub-group copied, per norm pass and per
  // write-back.
  within(HostWait::kGradientFetch, after.device_sums.fetches + after.device_sums.norm_passes +
                                       after.device_sums.write_backs - before.device_sums.fetches -
                                       before.device_sums.norm_passes -
                                       before.device_sums.write_backs);
  within(HostWait::kShardStaging,
         after.coordinator.shards_staged - before.coordinator.shards_staged);
  // A push waits once for all its copies, or (pipelined) once per group it opens.
  within(HostWait::kWorkingShardPush,
         (after.working_shard_pushes - before.working_shard_pushes) *
             (after.coordinator.fetches_on_demand + after.coordinator.fetches_prefetched +
              after.coordinator.fetches_reused - before.coordinator.fetches_on_demand -
              before.coordinator.fetches_prefetched - before.coordinator.fetches_reused + 1));
  // At most one per block waiting to be reused: those released during the step (one per
  // fetch that gathered) and those pending at its start (at most one per group).
  within(HostWait::kArenaReuse,
         after.coordinator.fetches_on_demand + after.coordinator.fetches_prefetched -
             before.coordinator.fetches_on_demand - before.coordinator.fetches_prefetched +
             static_cast<uint64_t>(groups));
  if (wrong.empty()) return Status::Ok();
  return InternalError("host waits of a step beyond the design: " + wrong + "\n" +
                       after.ToString());
}

}  // namespace strata::engine::testing

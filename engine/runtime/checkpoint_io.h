// What a checkpoint's save and load share inside the engine (runtime/checkpoint_save.cc,
// runtime/checkpoint_load.cc): the optimizer's states in file order, the step-boundary check,
// a test save's crash points, and this rank's partial fingerprints of the frozen groups.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

inline constexpr OptimizerState kStates[3] = {OptimizerState::kMaster, OptimizerState::kExpAvg,
                                              OptimizerState::kExpAvgSq};

// Why a checkpoint cannot be taken or loaded now (every rank sees the same).
Status AtStepBoundary(bool backward_since_step, bool reducer_pending, int64_t micro_steps,
                      int64_t accumulation, const char* what);
// The crash points of a test save.
void MaybeCrash(const std::string& crash_at, const char* point);
// This rank's partial fingerprints of the frozen groups (FrozenFingerprintTerm; index
// g - num_trainable, 0 where it holds none of the group's parameters), the values rounded to
// `as` (the checkpoint's dtype) first. One read of the frozen shards, on CPU-Adam's threads.
Result<std::vector<uint64_t>> FrozenFingerprintPartials(const ModelPartition& partition,
                                                        WorkingShards& shards, DType as,
                                                        const CpuAdam& adam);

}  // namespace strata::engine

// CheckpointIo: the engine's collective checkpoint protocol, EngineCore::SaveCheckpoint and
// LoadCheckpoint (engine/checkpoint/checkpoint.h describes the files and the protocol), and
// what its save (checkpoint_save.cc) and load (checkpoint_load.cc) share: the optimizer's
// states in file order, the step-boundary check, a test save's crash points, and this
// rank's partial fingerprints of the frozen groups.
//
// A save runs in phases, each agreed on by every rank before the next: rank 0 makes the
// directory, every rank writes its file and its part of the manifest, rank 0 collects the
// parts, writes the manifest and publishes the tag. A load: the tag agreed on, every rank
// checks what it will read (the model against the manifest, every CRC it reads, the frozen
// base's fingerprint), the ranks agree, then every rank reads its shards' states from the
// saving ranks' files and the reads are committed together.
//
// Ownership and lifetime: owns nothing between calls (a call's plan lives for the call);
// borrows EngineCore's parts (model_io.h's IoParts) and its trainable partition, which must
// outlive it (EngineCore declares it after them).
// Thread-safety: the engine's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/format.h"
#include "strata/engine/gather/coordinator.h"
#include "strata/engine/gather/working_shards.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/reduce/reducer.h"
#include "strata/engine/runtime/model_io.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

class RankFileWriter;  // checkpoint/files.h

class CheckpointIo {
 public:
  CheckpointIo(const IoParts& io, const ModelPartition& trainable, DType dtype)
      : io_(io), trainable_(trainable), dtype_(dtype) {}
  CheckpointIo(const CheckpointIo&) = delete;
  CheckpointIo& operator=(const CheckpointIo&) = delete;

  // EngineCore::SaveCheckpoint and LoadCheckpoint (engine_core.h says what they do).
  Result<std::string> Save(const CheckpointSaveRequest& options);
  Result<CheckpointLoadResult> Load(const CheckpointLoadRequest& options);

 private:
  // The save's phases (checkpoint_save.cc), in order.
  struct SavePlan;
  Status CheckSaveOptions(const CheckpointSaveRequest& o) const;
  Status MakeSaveDirectory(const SavePlan& s);
  Status WriteRankPart(const SavePlan& s);
  Status WriteStateTensors(const SavePlan& s, RankFileWriter& w, CheckpointRankPart& part);
  Status WriteFrozenTensor(RankFileWriter& w, CheckpointRankPart& part);
  Status AgreeOnRankParts(const SavePlan& s, const Status& written);
  Status PublishCheckpoint(const SavePlan& s);
  Result<Json> CollectRankParts(const SavePlan& s, std::vector<uint64_t>& fingerprint_sums);
  // The load's phases (checkpoint_load.cc), in order.
  struct LoadPlan;
  Result<std::string> AgreeOnCheckpointTag(const std::string& dir, const std::string& wanted);
  Status CheckCheckpoint(LoadPlan& l);
  Result<bool> CheckFrozenBase(const LoadPlan& l);
  Status ReadCheckpointStates(const LoadPlan& l, CheckpointLoadResult& out);
  Result<CheckpointLoadResult> CommitLoad(const LoadPlan& l, const Status& local,
                                          CheckpointLoadResult out);
  int num_groups() const { return io_.partition.num_groups(); }
  const GroupLayout& layout(int group) const {
    return io_.partition.groups[static_cast<size_t>(group)];
  }

  const IoParts io_;
  const ModelPartition& trainable_;  // the optimizer's partition (m and v cover it)
  const DType dtype_;                // the working dtype
};

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

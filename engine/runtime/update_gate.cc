// UpdateGate (update_gate.h): the trainable groups the forward may read during an update.
#include "strata/engine/runtime/update_gate.h"

#include <algorithm>

#include "strata/engine/runtime/placement.h"

namespace strata::engine {

UpdateGate::UpdateGate(const ModelPartition& partition, OptimizerDriver& driver,
                       Placement& placement)
    : partition_(partition),
      driver_(driver),
      placement_(placement),
      open_(static_cast<size_t>(partition.num_trainable), 1) {}

bool UpdateGate::Ready(int group) const {
  // (A delayed update writes no working shard: the forward reads the last step's.)
  return !ForwardWaits() || group < 0 || group >= partition_.num_trainable ||
         open_[static_cast<size_t>(group)] != 0 || driver_.GroupUpdated(group);
}

bool UpdateGate::Stored(int group) const {
  return group < 0 || group >= partition_.num_trainable || driver_.ShardInStore(group);
}

Status UpdateGate::Open(int group) {
  if (!ForwardWaits() || group < 0 || group >= partition_.num_trainable ||
      open_[static_cast<size_t>(group)] != 0) {
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(driver_.WaitGroup(group));
  open_[static_cast<size_t>(group)] = 1;
  return placement_.PushShard(group);
}

Status UpdateGate::OpenAll() {
  for (int g = 0; g < partition_.num_trainable; ++g)
    STRATA_RETURN_IF_ERROR(Open(g));
  return Status::Ok();
}

void UpdateGate::CloseAll() {
  std::fill(open_.begin(), open_.end(), 0);
}

}  // namespace strata::engine

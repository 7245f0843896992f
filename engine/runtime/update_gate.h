// UpdateGate: while a step's update runs on the optimizer's worker (strata.pipeline_step,
// strata.early_step, strata.delayed_update), which trainable groups' working shards the
// forward may read. The coordinator asks it before a fetch (CoordinatorOptions::shard_ready,
// open_shard, shard_stored); the step (StepControl) opens every group before it completes an
// update, closes the groups an update takes, and says what the update in flight writes.
//
// A group is open once the forward waited for its update since the update started (and, with
// the device's copy of the working shards, copied its new shard there): its shard then holds
// the update's values and is read as it is. A delayed update in flight writes no working
// shard: the forward reads the last step's, unless the update copies the delayed one before
// it out first (the forward then waits for each group's copy, as for a pipelined step).
//
// Ownership and lifetime: owns the groups' open flags and what the update in flight writes;
// borrows the partition, the optimizer's driver and the placement, which must outlive it.
// Declared in EngineCore before the coordinator, whose callbacks call it.
// Thread-safety: the engine's thread.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/step/optimizer_driver.h"

namespace strata::engine {

class Placement;

class UpdateGate {
 public:
  // Every group starts open (no update in flight).
  UpdateGate(const ModelPartition& partition, OptimizerDriver& driver, Placement& placement);
  UpdateGate(const UpdateGate&) = delete;
  UpdateGate& operator=(const UpdateGate&) = delete;

  // Whether the forward waits for a group's update in flight (a pipelined step's, or a
  // delayed one's copy-out), or reads the working shards as they are (none in flight, or a
  // delayed update without a copy-out).
  bool ForwardWaits() const {
    return driver_.update_in_flight() && (!delayed_in_flight_ || copy_out_in_flight_);
  }
  // CoordinatorOptions::shard_ready: whether group g's working shard has its new values.
  bool Ready(int group) const;
  // CoordinatorOptions::open_shard: waits for group g's update, which hands the shard back to
  // its store and, with the device's copy of the working shards, copies it there.
  Status Open(int group);
  // CoordinatorOptions::shard_stored: whether the store holds group g's current shard (not
  // while the update will still hand a new one over).
  bool Stored(int group) const;
  // Opens every trainable group in order; stops at the first error and returns it.
  Status OpenAll();
  // The update just started takes every group (each is opened again by the forward), or
  // group g only (an early step's release).
  void CloseAll();
  void Close(int group) { open_[static_cast<size_t>(group)] = 0; }

  // A delayed update started (strata.delayed_update): it writes no working shard; with
  // `copy_out`, it first copies the last delayed update's parameters into them, group by
  // group (the forward waits for each). EndUpdate: the update in flight was completed.
  void StartDelayed(bool copy_out) {
    delayed_in_flight_ = true;
    copy_out_in_flight_ = copy_out;
  }
  void EndUpdate() {
    delayed_in_flight_ = false;
    copy_out_in_flight_ = false;
  }
  bool delayed_in_flight() const { return delayed_in_flight_; }
  bool copy_out_in_flight() const { return copy_out_in_flight_; }

 private:
  const ModelPartition& partition_;
  OptimizerDriver& driver_;
  Placement& placement_;
  std::vector<uint8_t> open_;  // per trainable group: opened since the update started
  bool delayed_in_flight_ = false;
  bool copy_out_in_flight_ = false;
};

}  // namespace strata::engine

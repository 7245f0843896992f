// The sizes a configuration leaves at DeepSpeed's defaults, chosen from the model instead.
// DeepSpeed's defaults assume a large machine: a gradient bucket of 5e8 elements (2 GB in
// fp32, each of the two overlap_comm keeps, and a reduce-scatter buffer beside each) and
// optimizer sub-groups of 1e9 elements (with the states on NVMe, host buffers of 4 GB each).
// A key the document set, or one a program changed from the default, is kept as it is:
// only a key that is both absent from the document (Config::given) and at its default is
// sized. The engine (EngineBuilder) and the planner (strata-config plan) call the same
// function with the same model, so the plan is the engine's arithmetic; every rank of an
// engine gets the same sizes (the model's, nothing local). docs/tuning.md has the rules.
//
// Thread-safety: a plain function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/config.h"

namespace strata {

// The model as the engine lays it out, in elements.
struct ModelExtent {
  uint64_t trainable = 0;      // the trainable parameters, all ranks
  uint64_t largest_group = 0;  // the largest trainable group (a block, or the root)
  uint64_t partition = 0;      // this rank's share of the trainable parameters
  uint64_t largest_shard = 0;  // the largest group's shard on a rank (any group, frozen too)
};

// One key sized: its path, the default it had, the size chosen and why.
struct SizedKey {
  std::string path;
  int64_t from = 0;
  int64_t to = 0;
  std::string why;
  std::string ToString() const;  // "zero_optimization.reduce_bucket_size 500000000 -> ..."
};

// Sets the keys `config` leaves at their defaults to sizes from `model`:
// - zero_optimization.reduce_bucket_size: a sixteenth of the trainable elements, at least
//   the largest group (a group's gradients go into one bucket);
// - zero_optimization.sub_group_size: a sixteenth of this rank's partition, at least 2^20
//   elements;
// - zero_optimization.offload_param.buffer_size: raised to the largest shard (the engine's
//   NVMe buffers hold one group's shard each, so a smaller size could only be refused).
// The first two are never raised above their defaults. Returns the keys it changed.
std::vector<SizedKey> SizeFromModel(Config& config, const ModelExtent& model);

}  // namespace strata

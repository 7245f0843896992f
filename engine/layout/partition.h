// Partitioning of parameter groups over the ranks (ZeRO-3).
//
// A group is the parameters of one wrapped module (plus one root group for the parameters
// outside wrapped modules). Its parameters are flattened and concatenated into one flat
// group buffer, each parameter starting at an offset aligned to `align_elems` elements
// (16: 64 bytes of fp32). The buffer is padded to W * S elements, where the shard size S
// is ceil(used / W) rounded up to `align_elems`, and split into W equal shards: rank r
// owns [r*S, (r+1)*S). One all-gather of the shards rebuilds the whole flat buffer, in
// which every parameter is the contiguous view (offset, numel); one reduce-scatter of the
// flat gradient gives each rank the gradient of its shard. A parameter may straddle
// shards; the optimizer works element-wise on flat shards, so that does not matter.
// Because W*S is a multiple of W, comm::Partition(W*S, W, r) is exactly [r*S, S).
//
// The rank's partition is the concatenation of its shards of every group, in group order:
// group g's shard starts at partition offset shard_offset[g]. The flat working shards and
// the fp32 master / m / v / gradient accumulators are laid out this way, so an optimizer
// sub-group is one contiguous range of the partition.
//
// Frozen groups (parameters that do not train: requires_grad false) are partitioned and
// gathered like the others but have no optimizer state, no gradient and no accumulator.
// They come after every trainable group, so the optimizer's partition is the prefix
// [0, trainable_numel) of the rank's partition and its offsets are the same.
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::engine {

inline constexpr size_t kDefaultAlignElems = 16;

struct ParamSlot {
  std::string name;
  size_t numel = 0;
  size_t offset = 0;  // elements from the start of the flat group buffer
};

// The overlap of one parameter with one rank's shard.
struct ShardSlice {
  size_t param_offset = 0;  // first element, counted within the parameter
  size_t shard_offset = 0;  // where it lands, counted within the shard
  size_t count = 0;
};

struct GroupLayout {
  std::string name;
  std::vector<ParamSlot> params;
  size_t numel = 0;         // sum of the parameters' numel (no alignment gaps, no padding)
  size_t used_numel = 0;    // end of the last parameter in the flat buffer
  size_t padded_numel = 0;  // W * shard_numel
  size_t shard_numel = 0;   // S
  int world_size = 1;

  size_t shard_begin(int rank) const { return static_cast<size_t>(rank) * shard_numel; }
  // The part of parameter `param` inside rank `rank`'s shard; nullopt when none.
  std::optional<ShardSlice> Slice(size_t param, int rank) const;
};

struct ParamSpec {
  std::string name;
  size_t numel = 0;
};

// InvalidArgument for world_size < 1 or align_elems < 1. A group may be empty or hold
// parameters of numel 0; a group of no elements has S = 0 and needs no collectives.
Result<GroupLayout> LayoutGroup(std::string name, std::span<const ParamSpec> params, int world_size,
                                size_t align_elems = kDefaultAlignElems);

// Every group of a model on one rank.
struct ModelPartition {
  std::vector<GroupLayout> groups;
  std::vector<size_t> shard_offset;  // per group: start of its shard in the rank's partition
  std::vector<bool> persistent;      // per group: stays gathered
  size_t partition_numel = 0;        // sum of the groups' S
  int world_size = 1;
  int rank = 0;
  // Groups [num_trainable, num_groups()) are frozen; trainable_numel = the trainable
  // groups' S summed (the start of the first frozen group's shard).
  int num_trainable = 0;
  size_t trainable_numel = 0;

  int num_groups() const { return static_cast<int>(groups.size()); }
  bool frozen(int group) const { return group >= num_trainable; }
  // The partition of the trainable groups alone (the optimizer's and the reducer's).
  ModelPartition Trainable() const;
  size_t persistent_numel() const;  // padded numel of the persistent groups
  // The largest two non-persistent groups' padded numel (0 where there are fewer).
  std::pair<size_t, size_t> LargestTwo() const;
};

struct PartitionOptions {
  size_t align_elems = kDefaultAlignElems;
  // Groups of at most this many elements stay gathered (stage3_param_persistence_threshold),
  // as long as the persistent groups' total stays within model_persistence_threshold
  // (stage3_model_persistence_threshold); groups are considered in order.
  uint64_t param_persistence_threshold = 0;
  uint64_t model_persistence_threshold = UINT64_MAX;
  // The last `frozen_groups` groups are frozen (see above).
  size_t frozen_groups = 0;
};

Result<ModelPartition> PartitionModel(
    const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& groups, int world_size,
    int rank, const PartitionOptions& options);

}  // namespace strata::engine

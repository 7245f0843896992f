#include "strata/engine/layout/partition.h"

#include <algorithm>

namespace strata::engine {
namespace {
size_t RoundUp(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}
}  // namespace

std::optional<ShardSlice> GroupLayout::Slice(size_t param, int rank) const {
  if (param >= params.size() || shard_numel == 0) return std::nullopt;
  const ParamSlot& p = params[param];
  const size_t lo = std::max(p.offset, shard_begin(rank));
  const size_t hi = std::min(p.offset + p.numel, shard_begin(rank) + shard_numel);
  if (lo >= hi) return std::nullopt;
  return ShardSlice{lo - p.offset, lo - shard_begin(rank), hi - lo};
}

Result<GroupLayout> LayoutGroup(std::string name, std::span<const ParamSpec> params, int world_size,
                                size_t align_elems) {
  if (world_size < 1) {
    return InvalidArgumentError("partitioning: world size " + std::to_string(world_size) +
                                " must be at least 1");
  }
  if (align_elems < 1) return InvalidArgumentError("partitioning: alignment must be >= 1");
  GroupLayout g;
  g.name = std::move(name);
  g.world_size = world_size;
  size_t end = 0;
  for (const ParamSpec& p : params) {
    const size_t offset = RoundUp(end, align_elems);
    g.params.push_back({p.name, p.numel, offset});
    end = offset + p.numel;
    g.numel += p.numel;
  }
  g.used_numel = end;
  const size_t w = static_cast<size_t>(world_size);
  g.shard_numel = end == 0 ? 0 : RoundUp((end + w - 1) / w, align_elems);
  g.padded_numel = g.shard_numel * w;
  return g;
}

size_t ModelPartition::persistent_numel() const {
  size_t n = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (persistent[g]) n += groups[g].padded_numel;
  }
  return n;
}

std::pair<size_t, size_t> ModelPartition::LargestTwo() const {
  size_t a = 0, b = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (persistent[g]) continue;
    const size_t n = groups[g].padded_numel;
    if (n > a) {
      b = a;
      a = n;
    } else if (n > b) {
      b = n;
    }
  }
  return {a, b};
}

Result<ModelPartition> PartitionModel(
    const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& groups, int world_size,
    int rank, const PartitionOptions& options) {
  if (rank < 0 || rank >= world_size) {
    return InvalidArgumentError("partitioning: rank " + std::to_string(rank) +
                                " outside world size " + std::to_string(world_size));
  }
  ModelPartition m;
  m.world_size = world_size;
  m.rank = rank;
  uint64_t persistent_total = 0;
  for (const auto& [name, params] : groups) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout,
                            LayoutGroup(name, params, world_size, options.align_elems));
    bool persistent = false;
    if (layout.numel <= options.param_persistence_threshold &&
        persistent_total + layout.padded_numel <= options.model_persistence_threshold) {
      persistent = true;
      persistent_total += layout.padded_numel;
    }
    m.shard_offset.push_back(m.partition_numel);
    m.partition_numel += layout.shard_numel;
    m.persistent.push_back(persistent);
    m.groups.push_back(std::move(layout));
  }
  if (options.frozen_groups > groups.size()) {
    return InvalidArgumentError("partitioning: " + std::to_string(options.frozen_groups) +
                                " frozen groups of " + std::to_string(groups.size()));
  }
  m.num_trainable = static_cast<int>(groups.size() - options.frozen_groups);
  m.trainable_numel = m.num_trainable < m.num_groups()
                          ? m.shard_offset[static_cast<size_t>(m.num_trainable)]
                          : m.partition_numel;
  return m;
}

ModelPartition ModelPartition::Trainable() const {
  ModelPartition t;
  const auto n = static_cast<size_t>(num_trainable);
  t.groups.assign(groups.begin(), groups.begin() + static_cast<std::ptrdiff_t>(n));
  t.shard_offset.assign(shard_offset.begin(),
                        shard_offset.begin() + static_cast<std::ptrdiff_t>(n));
  t.persistent.assign(persistent.begin(), persistent.begin() + static_cast<std::ptrdiff_t>(n));
  t.partition_numel = trainable_numel;
  t.world_size = world_size;
  t.rank = rank;
  t.num_trainable = num_trainable;
  t.trainable_numel = trainable_numel;
  return t;
}

}  // namespace strata::engine

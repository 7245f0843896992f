// WorkingShards: the rank's working parameter shards (16-bit, or fp32 in fp32 mode) in a
// state store (offload/cpu/state_store.h), one state per group: group g's shard, the
// partition elements [shard_offset[g], shard_offset[g] + shard_numel), is state
// "working shard of group <name>", one chunk. Its users hold a group's shard only while
// they use it:
//   - the ParameterCoordinator reads it as the all-gather's source (staged into the
//     device, or gathered from in place) and prefetches it ahead along the trace;
//   - the OptimizerDriver writes the new parameters into it (ShardWriter below);
//   - with offload_param = none the engine copies it into the device's working shards
//     after every step (the store is then the shards' pinned host mirror).
// Where the shards live is the store's business: host memory (offload_param = cpu, or the
// mirror) or swap slots on NVMe (offload_param = nvme), so no caller changes with the tier.
// With offload_param = nvme and max_in_cpu, the first groups (in group order, while their
// elements add up to at most max_in_cpu) keep their shards in a second, host store: the
// groups a forward needs first after a step, before any compute hides a read.
//
// Ownership and lifetime: borrows the partition and the stores (all must outlive it).
// Thread-safety: not thread-safe; the engine's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/layout/partition.h"
#include "strata/offload/cpu/state_store.h"

namespace strata::engine {

class WorkingShards {
 public:
  // Registers one state per group of at least one element (zero-filled) in `store`, or in
  // `host` for the first groups whose elements (padded_numel, all ranks) add up to at most
  // `host_elems` (`host` null: none).
  static Result<std::unique_ptr<WorkingShards>> Create(const ModelPartition* partition, DType dtype,
                                                       offload::StateStore* store,
                                                       offload::StateStore* host = nullptr,
                                                       uint64_t host_elems = 0);

  // The store that holds group g's shard.
  offload::StateStore* store_of(int group) const { return stores_[static_cast<size_t>(group)]; }
  // The stores: `store`, and `host` when some shard is there.
  const std::vector<offload::StateStore*>& stores() const { return distinct_; }
  bool can_fail() const;
  // Each store's epoch (state_store.h); every store is visited, the first error returned.
  Status Flush();
  Status Commit();
  Status Rollback();
  // Bytes of the shards in the host store (0 without one).
  uint64_t host_bytes() const { return host_bytes_; }
  DType dtype() const { return dtype_; }
  // Whether group g has a shard (groups of no elements have none).
  bool has(int group) const { return states_[static_cast<size_t>(group)].valid(); }
  size_t bytes(int group) const {
    return partition_->groups[static_cast<size_t>(group)].shard_numel * DTypeSize(dtype_);
  }
  // REQUIRES: has(group).
  Result<offload::StateLease> Acquire(int group, offload::Access access) {
    return store_of(group)->Acquire(range(group), access);
  }
  // Group g's new shard from `buffer` without a copy (StateStore::Exchange: `buffer` gets
  // one of the store's in return; `block_crcs` empty or its write's, as write_checksums
  // says). REQUIRES: has(group).
  Status Exchange(int group, offload::StateMemory& buffer,
                  std::span<const uint32_t> block_crcs = {}) {
    return store_of(group)->Exchange(range(group), buffer, block_crcs);
  }
  offload::StateStore::WriteChecksums write_checksums(int group) const {
    return store_of(group)->write_checksums(range(group));
  }
  // A hint (the store may be out of free buffers); an error is kept by the store.
  Status Prefetch(int group) { return store_of(group)->Prefetch(range(group)); }
  // The partition offset of group g's shard.
  size_t offset(int group) const { return partition_->shard_offset[static_cast<size_t>(group)]; }
  // The group whose shard holds partition element `offset` (< partition_numel).
  int GroupAt(size_t offset) const;

 private:
  WorkingShards(const ModelPartition* partition, DType dtype)
      : partition_(partition), dtype_(dtype) {}
  offload::StateRange range(int group) const {
    return offload::StateRange{states_[static_cast<size_t>(group)], 0};
  }

  const ModelPartition* partition_;
  DType dtype_;
  std::vector<offload::StateStore*> stores_;  // per group
  std::vector<offload::StateStore*> distinct_;
  std::vector<offload::StateId> states_;  // per group; invalid for an empty group
  uint64_t host_bytes_ = 0;
};

// Writes into the working shards at partition offsets, holding one group's shard at a time:
// At() returns the bytes of [offset, offset + count) (inside one group's shard), acquiring
// that group's shard first and releasing the one held before. Release() (or the destructor)
// gives the last one back.
class ShardWriter {
 public:
  explicit ShardWriter(WorkingShards* shards) : shards_(shards) {}
  ~ShardWriter() { Status s = Release(); }
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // `whole`: the caller writes every byte of the group's shard before it moves to another
  // group or releases (an NVMe store then need not read the old contents). InvalidArgument
  // for a range that crosses a group's shard.
  Result<std::byte*> At(size_t offset, size_t count, bool whole);
  Status Release();

 private:
  WorkingShards* shards_;
  int group_ = -1;
  offload::StateLease lease_;
};

}  // namespace strata::engine

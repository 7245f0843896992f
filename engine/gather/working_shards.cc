#include "strata/engine/gather/working_shards.h"

#include <algorithm>
#include <string>
#include <utility>

namespace strata::engine {

Result<std::unique_ptr<WorkingShards>> WorkingShards::Create(const ModelPartition* partition,
                                                             DType dtype,
                                                             offload::StateStore* store,
                                                             offload::StateStore* host,
                                                             uint64_t host_elems) {
  if (partition == nullptr || store == nullptr) {
    return InvalidArgumentError("WorkingShards: null partition or state store");
  }
  std::unique_ptr<WorkingShards> w(new WorkingShards(partition, dtype));
  w->states_.resize(partition->groups.size());
  w->stores_.assign(partition->groups.size(), store);
  w->distinct_.push_back(store);
  uint64_t in_host = 0;
  bool hot = host != nullptr;  // the leading groups, while they fit
  for (int g = 0; g < partition->num_groups(); ++g) {
    const GroupLayout& layout = partition->groups[static_cast<size_t>(g)];
    const size_t bytes = w->bytes(g);
    if (bytes == 0) continue;
    hot = hot && in_host + layout.padded_numel <= host_elems;
    offload::StateStore* s = store;
    if (hot) {
      in_host += layout.padded_numel;
      w->host_bytes_ += bytes;
      s = host;
      if (w->distinct_.size() == 1) w->distinct_.push_back(host);
    }
    w->stores_[static_cast<size_t>(g)] = s;
    STRATA_ASSIGN_OR_RETURN(w->states_[static_cast<size_t>(g)],
                            s->Register("working shard of group " + layout.name, bytes, bytes));
  }
  return w;
}

bool WorkingShards::can_fail() const {
  for (const offload::StateStore* s : distinct_)
    if (s->can_fail()) return true;
  return false;
}

namespace {
template <typename Fn>
Status ForEachStore(const std::vector<offload::StateStore*>& stores, Fn fn) {
  Status first;
  for (offload::StateStore* s : stores) {
    Status st = fn(*s);
    if (first.ok()) first = std::move(st);
  }
  return first;
}
}  // namespace

Status WorkingShards::Flush() {
  return ForEachStore(distinct_, [](offload::StateStore& s) { return s.Flush(); });
}
Status WorkingShards::Commit() {
  return ForEachStore(distinct_, [](offload::StateStore& s) { return s.Commit(); });
}
Status WorkingShards::Rollback() {
  return ForEachStore(distinct_, [](offload::StateStore& s) { return s.Rollback(); });
}

int WorkingShards::GroupAt(size_t offset) const {
  // The last group starting at or before `offset` that has elements (empty groups share
  // their offset with the next group).
  const std::vector<size_t>& starts = partition_->shard_offset;
  auto it = std::upper_bound(starts.begin(), starts.end(), offset);
  int g = static_cast<int>(it - starts.begin()) - 1;
  while (g > 0 && !has(g))
    --g;
  return g;
}

Result<std::byte*> ShardWriter::At(size_t offset, size_t count, bool whole) {
  const int g = shards_->GroupAt(offset);
  const size_t elem = DTypeSize(shards_->dtype());
  if (g < 0 || !shards_->has(g) || offset + count > shards_->offset(g) + shards_->bytes(g) / elem) {
    return InvalidArgumentError("working shards: elements [" + std::to_string(offset) + ", " +
                                std::to_string(offset + count) +
                                ") are not inside one group's shard");
  }
  if (g != group_) {
    STRATA_RETURN_IF_ERROR(Release());
    STRATA_ASSIGN_OR_RETURN(
        lease_, shards_->Acquire(g, whole ? offload::Access::kWrite : offload::Access::kReadWrite));
    group_ = g;
  }
  return lease_.data() + (offset - shards_->offset(g)) * elem;
}

Status ShardWriter::Release() {
  group_ = -1;
  if (!lease_.valid()) return Status::Ok();
  return lease_.Release();
}

}  // namespace strata::engine

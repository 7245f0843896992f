#include "strata/swap/slot_allocator.h"

#include <string>

#include "strata/core/check.h"

namespace strata::swap {

SlotAllocator::SlotAllocator(uint64_t alignment) : alignment_(alignment) {
  STRATA_CHECK(alignment > 0) << "SlotAllocator alignment 0";
}

uint64_t SlotAllocator::Round(uint64_t bytes) const {
  return bytes == 0 ? alignment_ : (bytes + alignment_ - 1) / alignment_ * alignment_;
}

void SlotAllocator::Grow(uint64_t new_capacity) {
  STRATA_CHECK(new_capacity >= capacity_ && new_capacity % alignment_ == 0)
      << "Grow(" << new_capacity << ") from " << capacity_;
  if (new_capacity == capacity_) return;
  const uint64_t old = capacity_;
  capacity_ = new_capacity;
  AddFree(old, new_capacity - old);
}

void SlotAllocator::RemoveFree(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_offset_.erase(it);
}

void SlotAllocator::AddFree(uint64_t offset, uint64_t length) {
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.end() && next->first == offset + length) {
    length += next->second;
    RemoveFree(next);
  }
  auto it = by_offset_.lower_bound(offset);
  if (it != by_offset_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      RemoveFree(prev);
    }
  }
  by_offset_.emplace(offset, length);
  by_size_.emplace(length, offset);
}

std::optional<uint64_t> SlotAllocator::Reserve(uint64_t bytes) {
  const uint64_t n = Round(bytes);
  auto best = by_size_.lower_bound({n, 0});
  if (best == by_size_.end()) return std::nullopt;
  const uint64_t offset = best->second;
  const uint64_t length = best->first;
  RemoveFree(by_offset_.find(offset));
  if (length > n) AddFree(offset + n, length - n);
  reserved_.emplace(offset, n);
  used_ += n;
  return offset;
}

Status SlotAllocator::Free(uint64_t offset, uint64_t bytes) {
  const uint64_t n = Round(bytes);
  auto it = reserved_.find(offset);
  if (it == reserved_.end())
    return InvalidArgumentError("SlotAllocator::Free: no range is reserved at offset " +
                                std::to_string(offset) + " (double free?)");
  if (it->second != n)
    return InvalidArgumentError("SlotAllocator::Free: the range at offset " +
                                std::to_string(offset) + " holds " + std::to_string(it->second) +
                                " bytes, not " + std::to_string(n));
  reserved_.erase(it);
  used_ -= n;
  AddFree(offset, n);
  return Status::Ok();
}

uint64_t SlotAllocator::tail_free() const {
  if (by_offset_.empty()) return 0;
  auto last = std::prev(by_offset_.end());
  return last->first + last->second == capacity_ ? last->second : 0;
}

uint64_t SlotAllocator::largest_free() const {
  return by_size_.empty() ? 0 : std::prev(by_size_.end())->first;
}

}  // namespace strata::swap

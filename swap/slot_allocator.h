// SlotAllocator: reserves and frees byte ranges of one swap file.
//
// Ranges are multiples of `alignment` (the swap block size) at offsets that are too.
// Best fit: a reservation takes the smallest free range that holds it (lowest offset
// among equals), so large free ranges stay whole; freed ranges coalesce with free
// neighbours. The managed size grows with Grow() (the caller preallocates the file
// first). O(log n) per operation in the number of free ranges.
//
// Thread-safety: none; the owner (SwapSpace) serializes calls.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "strata/core/status.h"

namespace strata::swap {

class SlotAllocator {
 public:
  // REQUIRES: alignment > 0 (any value; swap spaces use the block size).
  explicit SlotAllocator(uint64_t alignment);

  // Adds [capacity(), new_capacity) as free space. REQUIRES: new_capacity >= capacity()
  // and aligned.
  void Grow(uint64_t new_capacity);

  // Reserves `bytes` rounded up to the alignment; nullopt when no free range holds them.
  // A zero size reserves one unit.
  std::optional<uint64_t> Reserve(uint64_t bytes);

  // Frees a range returned by Reserve (same offset, same size as asked). InvalidArgument
  // when it is not a reserved range (double free, wrong size).
  Status Free(uint64_t offset, uint64_t bytes);

  uint64_t alignment() const { return alignment_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  // Free bytes at the end of the managed range (what a Grow extends).
  uint64_t tail_free() const;
  uint64_t largest_free() const;
  size_t free_ranges() const { return by_offset_.size(); }
  size_t reserved_ranges() const { return reserved_.size(); }

 private:
  uint64_t Round(uint64_t bytes) const;
  void AddFree(uint64_t offset, uint64_t length);  // coalesces
  void RemoveFree(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t alignment_;
  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> by_offset_;           // free: offset -> length
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // free: (length, offset)
  std::map<uint64_t, uint64_t> reserved_;            // offset -> length
};

}  // namespace strata::swap

// Internal: the staging layouts of the NCCL backend (nccl_communicator.cc), kept apart from
// the CUDA code so that tests can check them on the host (tests/comm/nccl_test.cc).
// Header-only, torch- and CUDA-free. Not installed; not part of the public API.
//
// ncclAllGather and ncclReduceScatter move the same number of elements per rank, while
// Partition() gives the first total % W ranks one element more. The backend therefore pads
// every rank's slice to chunk = ceil(total / W) elements: "slots" are W such padded slices
// (slot q at q * slot_pitch bytes), "flat" is the caller's buffer (rank q's elements at
// Partition(total, W, q).offset). The coalesced calls put several items in one slot, one
// padded slice after another (PackedLayout).
#pragma once

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

namespace strata::comm::internal {

// How a flat buffer of `total` elements splits over W ranks (as Partition()).
struct Split {
  size_t base = 0;   // elements of each of the last W - rem ranks
  size_t rem = 0;    // the first rem ranks hold base + 1
  size_t chunk = 0;  // padded slice: ceil(total / W)
  size_t world = 1;
  Split(size_t total, int world_size) : world(static_cast<size_t>(world_size)) {
    base = total / world;
    rem = total % world;
    chunk = base + (rem ? 1 : 0);
  }
  bool even() const { return rem == 0; }
  size_t count(int rank) const { return base + (static_cast<size_t>(rank) < rem ? 1 : 0); }
};

// dst[dst_offset + i * dst_pitch, + width) = src[src_offset + i * src_pitch, + width) for
// i < rows; offsets, pitches and width in bytes.
struct StridedCopy {
  size_t dst_offset = 0;
  size_t dst_pitch = 0;
  size_t src_offset = 0;
  size_t src_pitch = 0;
  size_t width = 0;
  size_t rows = 0;
};

// Slots -> flat (after the all-gather): the first rem ranks' slices are whole slots and
// lie back to back in `flat`; the last W - rem lose their padding element. At most two
// copies; none of zero size.
inline std::vector<StridedCopy> SlotsToFlatCopies(const Split& split, size_t slot_pitch,
                                                  size_t es) {
  std::vector<StridedCopy> copies;
  const size_t wide = split.chunk * es, narrow = split.base * es;
  if (split.rem > 0 && wide > 0) copies.push_back({0, wide, 0, slot_pitch, wide, split.rem});
  if (split.world > split.rem && narrow > 0) {
    copies.push_back({split.rem * wide, narrow, split.rem * slot_pitch, slot_pitch, narrow,
                      split.world - split.rem});
  }
  return copies;
}

// Flat -> slots (before the reduce-scatter): the inverse of SlotsToFlatCopies. Padding
// elements are left as they are.
inline std::vector<StridedCopy> FlatToSlotsCopies(const Split& split, size_t slot_pitch,
                                                  size_t es) {
  std::vector<StridedCopy> copies = SlotsToFlatCopies(split, slot_pitch, es);
  for (StridedCopy& c : copies) {
    std::swap(c.dst_offset, c.src_offset);
    std::swap(c.dst_pitch, c.src_pitch);
  }
  return copies;
}

// Several items in one slot: item i's padded slice starts at offsets[i] elements of every
// slot, which holds `slot` elements.
struct PackedLayout {
  std::vector<size_t> offsets;
  size_t slot = 0;
};
inline PackedLayout PackItems(std::span<const size_t> totals, int world_size) {
  PackedLayout layout;
  layout.offsets.reserve(totals.size());
  for (size_t total : totals) {
    layout.offsets.push_back(layout.slot);
    layout.slot += Split(total, world_size).chunk;
  }
  return layout;
}

}  // namespace strata::comm::internal

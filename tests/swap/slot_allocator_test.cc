// SlotAllocator: best fit, coalescing, growth, misuse.
#include "strata/swap/slot_allocator.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace strata::swap {
namespace {

constexpr uint64_t B = 4096;

TEST(SlotAllocatorTest, ReservesAlignedRangesAndGrows) {
  SlotAllocator a(B);
  EXPECT_EQ(a.Reserve(1), std::nullopt);  // nothing managed yet
  a.Grow(10 * B);
  EXPECT_EQ(a.capacity(), 10 * B);
  EXPECT_EQ(a.tail_free(), 10 * B);
  EXPECT_EQ(a.Reserve(1), 0u);  // rounded up to one unit
  EXPECT_EQ(a.Reserve(B + 1), B);
  EXPECT_EQ(a.used_bytes(), 3 * B);
  EXPECT_EQ(a.tail_free(), 7 * B);
  EXPECT_EQ(a.Reserve(8 * B), std::nullopt);
  a.Grow(12 * B);
  EXPECT_EQ(a.Reserve(8 * B), 3 * B);  // the grown tail merged with the old free range
  EXPECT_EQ(a.free_bytes(), B);
}

TEST(SlotAllocatorTest, BestFitAndCoalescing) {
  SlotAllocator a(B);
  a.Grow(100 * B);
  std::vector<uint64_t> off;
  for (int i = 0; i < 10; ++i)
    off.push_back(*a.Reserve(10 * B));
  EXPECT_EQ(a.Reserve(B), std::nullopt);
  // Free holes of 10, 20 (two neighbours) and 10 units.
  ASSERT_TRUE(a.Free(off[1], 10 * B).ok());
  ASSERT_TRUE(a.Free(off[4], 10 * B).ok());
  ASSERT_TRUE(a.Free(off[5], 10 * B).ok());
  ASSERT_TRUE(a.Free(off[8], 10 * B).ok());
  EXPECT_EQ(a.free_ranges(), 3u);  // 4 and 5 coalesced
  EXPECT_EQ(a.largest_free(), 20 * B);
  // 15 units fit only the 20-unit hole; 10 units take the lowest exact hole.
  EXPECT_EQ(a.Reserve(15 * B), off[4]);
  EXPECT_EQ(a.Reserve(10 * B), off[1]);
  EXPECT_EQ(a.Reserve(5 * B), off[4] + 15 * B);  // the 5-unit rest beats the 10-unit hole
  EXPECT_EQ(a.Reserve(10 * B), off[8]);
  EXPECT_EQ(a.free_bytes(), 0u);
  // Free everything: one range again.
  ASSERT_TRUE(a.Free(off[4], 15 * B).ok());
  ASSERT_TRUE(a.Free(off[4] + 15 * B, 5 * B).ok());
  for (int i : {0, 1, 2, 3, 5, 6, 7, 8, 9}) {
    if (i == 5) continue;  // part of the 15+5 above
    ASSERT_TRUE(a.Free(off[i], 10 * B).ok()) << i;
  }
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.largest_free(), 100 * B);
  EXPECT_EQ(a.reserved_ranges(), 0u);
}

TEST(SlotAllocatorTest, MisuseIsAnError) {
  SlotAllocator a(B);
  a.Grow(4 * B);
  uint64_t o = *a.Reserve(2 * B);
  EXPECT_EQ(a.Free(o, B).code(), StatusCode::kInvalidArgument);  // wrong size
  EXPECT_EQ(a.Free(o + B, B).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Free(o, 2 * B).ok());
  Status s = a.Free(o, 2 * B);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("double free"), std::string::npos) << s;
}

TEST(SlotAllocatorTest, RandomReserveFreeKeepsTheBooks) {
  SlotAllocator a(B);
  a.Grow(1000 * B);
  std::mt19937 rng(1);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  for (int step = 0; step < 5000; ++step) {
    if (!live.empty() && rng() % 2) {
      const size_t k = rng() % live.size();
      ASSERT_TRUE(a.Free(live[k].first, live[k].second).ok());
      live.erase(live.begin() + static_cast<long>(k));
    } else {
      const uint64_t n = (1 + rng() % 20) * B;
      std::optional<uint64_t> o = a.Reserve(n);
      if (!o) continue;
      for (const auto& [lo, len] : live)
        ASSERT_TRUE(*o + n <= lo || lo + len <= *o) << "overlap";
      ASSERT_LE(*o + n, a.capacity());
      live.emplace_back(*o, n);
    }
    uint64_t used = 0;
    for (const auto& [lo, len] : live)
      used += len;
    ASSERT_EQ(a.used_bytes(), used);
  }
}

}  // namespace
}  // namespace strata::swap

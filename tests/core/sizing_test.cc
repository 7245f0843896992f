// core/sizing.h: the keys a document leaves at DeepSpeed's defaults sized from the model;
// a key the document set, or one a program changed, kept.
#include "strata/core/sizing.h"

#include <gtest/gtest.h>

#include "strata/core/check.h"

namespace strata {
namespace {

Config Parse(const std::string& json) {
  Result<Config> c = ParseConfig(json);
  STRATA_CHECK_OK(c.status());
  return *std::move(c);
}

constexpr const char* kPlain = R"({"train_batch_size": 8, "zero_optimization": {"stage": 3}})";

TEST(SizingTest, DefaultsAreSizedFromTheModel) {
  Config c = Parse(kPlain);
  EXPECT_FALSE(c.Given("zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(c.Given("zero_optimization.stage"));
  EXPECT_TRUE(c.Given("zero_optimization"));
  // 160M trainable elements, the largest group 4M, 80M of them this rank's.
  const std::vector<SizedKey> sized = SizeFromModel(
      c, {.trainable = 160'000'000, .largest_group = 4'000'000, .partition = 80'000'000});
  ASSERT_EQ(sized.size(), 2u);
  EXPECT_EQ(c.zero.reduce_bucket_size, 10'000'000);  // a sixteenth of the model
  EXPECT_EQ(c.zero.sub_group_size, 5'000'000);       // a sixteenth of the partition
  EXPECT_EQ(sized[0].path, "zero_optimization.reduce_bucket_size");
  EXPECT_EQ(sized[0].from, 500'000'000);
  EXPECT_EQ(sized[0].to, 10'000'000);
  EXPECT_NE(sized[0].ToString().find("zero_optimization.reduce_bucket_size 500000000 -> 10000000"),
            std::string::npos)
      << sized[0].ToString();
  EXPECT_NE(sized[1].why.find("80000000"), std::string::npos) << sized[1].why;
}

TEST(SizingTest, TheLargestGroupAndTheFloorsBound) {
  Config c = Parse(kPlain);
  // A model of one large group: its bucket holds the group; a small partition: 2^20.
  SizeFromModel(c, {.trainable = 32'000'000, .largest_group = 30'000'000, .partition = 1'000});
  EXPECT_EQ(c.zero.reduce_bucket_size, 30'000'000);
  EXPECT_EQ(c.zero.sub_group_size, 1 << 20);
  // Never above the default: a model too large for a sixteenth to be smaller keeps it.
  Config big = Parse(kPlain);
  EXPECT_TRUE(SizeFromModel(big, {.trainable = 100'000'000'000,
                                  .largest_group = 1'000'000'000,
                                  .partition = 100'000'000'000})
                  .empty());
  EXPECT_EQ(big.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(big.zero.sub_group_size, 1'000'000'000);
}

TEST(SizingTest, AKeyTheDocumentSetOrAProgramChangedIsKept) {
  Config given = Parse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "reduce_bucket_size": 500000000, "sub_group_size": 1e9}})");
  EXPECT_TRUE(given.Given("zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(
      SizeFromModel(given,
                    {.trainable = 160'000'000, .largest_group = 4'000'000, .partition = 80'000'000})
          .empty());
  EXPECT_EQ(given.zero.reduce_bucket_size, 500'000'000);
  Config changed = Parse(kPlain);
  changed.zero.reduce_bucket_size = 123;
  const std::vector<SizedKey> sized = SizeFromModel(
      changed, {.trainable = 160'000'000, .largest_group = 4'000'000, .partition = 80'000'000});
  ASSERT_EQ(sized.size(), 1u);
  EXPECT_EQ(sized[0].path, "zero_optimization.sub_group_size");
  EXPECT_EQ(changed.zero.reduce_bucket_size, 123);
}

}  // namespace
}  // namespace strata

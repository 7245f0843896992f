// CRC32C: known values and chaining.
#include "strata/swap/crc32c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace strata::swap {
namespace {

std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c(Bytes("123456789")), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(Crc32c({}), 0u);
  std::vector<std::byte> zeros(32, std::byte{0});
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  std::vector<std::byte> ones(32, std::byte{0xff});
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);  // RFC 3720 B.4: 32 bytes of 0xff
}

TEST(Crc32cTest, ExtendEqualsOnePass) {
  std::vector<std::byte> data(1 << 20);
  testing::FillRandom(data, 3);
  const uint32_t whole = Crc32c(data);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{4095}, size_t{65536}, data.size()}) {
    std::span<const std::byte> all(data);
    EXPECT_EQ(Crc32cExtend(Crc32c(all.first(cut)), all.subspan(cut)), whole) << cut;
  }
  data[12345] ^= std::byte{1};
  EXPECT_NE(Crc32c(data), whole);
}

}  // namespace
}  // namespace strata::swap

#include "strata/swap/crc32c.h"

#include <isa-l.h>

#include <algorithm>

namespace strata::swap {

uint32_t Crc32cExtend(uint32_t crc, std::span<const std::byte> data) {
  // ISA-L works on the un-inverted register and takes an int length.
  uint32_t reg = ~crc;
  constexpr size_t kChunk = size_t{1} << 30;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t left = data.size();
  while (left > 0) {
    const size_t n = std::min(left, kChunk);
    reg = crc32_iscsi(const_cast<unsigned char*>(p), static_cast<int>(n), reg);
    p += n;
    left -= n;
  }
  return ~reg;
}

uint32_t Crc32c(std::span<const std::byte> data) {
  return Crc32cExtend(0, data);
}

}  // namespace strata::swap

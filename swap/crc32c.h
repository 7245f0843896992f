// CRC32C (Castagnoli polynomial, as iSCSI, ext4 and Btrfs use it), computed with ISA-L's
// SIMD crc32_iscsi. Standard conventions: initial value ~0 and a final inversion, so
// Crc32c("123456789") == 0xE3069283.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace strata::swap {

uint32_t Crc32c(std::span<const std::byte> data);
// Continues a CRC: Crc32cExtend(Crc32c(a), b) == Crc32c(a followed by b).
uint32_t Crc32cExtend(uint32_t crc, std::span<const std::byte> data);

}  // namespace strata::swap

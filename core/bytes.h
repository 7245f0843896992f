// Byte sizes: parsing "512MiB", "1.5G", "1e9", "4096" and printing "1.5 GiB".
//
// Units (case-insensitive): none or B = bytes; KiB MiB GiB TiB PiB EiB = powers of 1024;
// KB MB GB TB PB EB = powers of 1000; the single letters K M G T P E = powers of 1024, as
// dd, fio and numfmt --from=iec read them. The number may have a fraction or an
// exponent; the result must be a whole number of bytes that fits in 64 bits. Whole
// numbers are read exactly ("18446744073709551615"); a decimal fraction that misses a
// whole number only by binary rounding ("4.1MB") is taken as that whole number.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kTiB = 1024 * kGiB;

Result<uint64_t> ParseBytes(std::string_view text);

// Bytes per second: a number, or a size with an optional "/s": "6.5GB/s", "800 MiB/s";
// need not be whole ("0.5").
Result<double> ParseByteRate(std::string_view text);

// Whole-number byte counts from a JSON-ish double (1e9 -> 1000000000); rejects
// negatives, fractions, NaN and values beyond 2^64-1, naming the value.
Result<uint64_t> BytesFromDouble(double value);

// "0 B", "512 B", "4 KiB", "1.5 GiB", "1.33 TiB": binary units, at most two decimals.
std::string FormatBytes(uint64_t bytes);

// Bandwidth: bytes per second as "12.3 GB/s" (decimal, as drive vendors quote it).
std::string FormatBandwidth(double bytes_per_second);

// Rounds up to a multiple of `alignment` (a power of two).
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}
constexpr bool IsAligned(uint64_t value, uint64_t alignment) {
  return (value & (alignment - 1)) == 0;
}

}  // namespace strata

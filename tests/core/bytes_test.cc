// Byte sizes (ParseBytes, ParseByteRate, FormatBytes, alignment) and ByteBudget.
#include "strata/core/bytes.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/budget.h"

namespace strata {
namespace {

testing::AssertionResult Contains(const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << "\"" << haystack << "\" does not contain \"" << needle << "\"";
}

uint64_t Bytes(std::string_view text) {
  Result<uint64_t> r = ParseBytes(text);
  EXPECT_TRUE(r.ok()) << "\"" << text << "\": " << r.status();
  return r.value_or(~uint64_t{0});
}

// ---------------------------------------------------------------------------
// ParseBytes

TEST(ParseBytesTest, PlainNumbers) {
  EXPECT_EQ(Bytes("4096"), 4096u);
  EXPECT_EQ(Bytes("0"), 0u);
  EXPECT_EQ(Bytes("1e9"), 1000000000u);
  EXPECT_EQ(Bytes("1E9"), 1000000000u);
  EXPECT_EQ(Bytes("5e8"), 500000000u);
  EXPECT_EQ(Bytes("+12"), 12u);
  // Whole numbers are exact, beyond the 53 bits of a double too.
  EXPECT_EQ(Bytes("18446744073709551615"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(Bytes("9007199254740993"), 9007199254740993u);
  EXPECT_EQ(Bytes("15EiB"), 15 * 1024 * 1024 * kTiB);
}

TEST(ParseBytesTest, BinaryUnits) {
  EXPECT_EQ(Bytes("512MiB"), 512 * kMiB);
  EXPECT_EQ(Bytes("4k"), 4 * kKiB);
  EXPECT_EQ(Bytes("4K"), 4 * kKiB);
  EXPECT_EQ(Bytes("4KiB"), 4 * kKiB);
  EXPECT_EQ(Bytes("4kib"), 4 * kKiB);
  EXPECT_EQ(Bytes("1.5G"), 3 * kGiB / 2);
  EXPECT_EQ(Bytes("1 GiB"), kGiB);
  EXPECT_EQ(Bytes(" 2M "), 2 * kMiB);
  EXPECT_EQ(Bytes("2T"), 2 * kTiB);
  EXPECT_EQ(Bytes("1PiB"), 1024 * kTiB);
  EXPECT_EQ(Bytes("1EiB"), 1024 * 1024 * kTiB);
  EXPECT_EQ(Bytes("0.5KiB"), 512u);
  EXPECT_EQ(Bytes("100B"), 100u);
  EXPECT_EQ(Bytes("100 b"), 100u);
}

TEST(ParseBytesTest, DecimalUnits) {
  EXPECT_EQ(Bytes("1GB"), 1000000000u);
  EXPECT_EQ(Bytes("1gb"), 1000000000u);
  EXPECT_EQ(Bytes("2KB"), 2000u);
  EXPECT_EQ(Bytes("3MB"), 3000000u);
  EXPECT_EQ(Bytes("1.5TB"), 1500000000000u);
  EXPECT_EQ(Bytes("2PB"), 2000000000000000u);
}

TEST(ParseBytesTest, DecimalFractionsThatAreWholeBytes) {
  // 4.1 and 2.01 are not exact in binary; 4.1 * 1e6 is 4099999.9999999995 in doubles.
  EXPECT_EQ(Bytes("4.1MB"), 4100000u);
  EXPECT_EQ(Bytes("2.01KB"), 2010u);
  EXPECT_EQ(Bytes("4.03KB"), 4030u);
  EXPECT_EQ(Bytes("6.4GB"), 6400000000u);
  EXPECT_EQ(Bytes("0.3MB"), 300000u);
}

void ExpectBytesError(std::string_view text, const std::string& fragment) {
  Result<uint64_t> r = ParseBytes(text);
  ASSERT_FALSE(r.ok()) << "\"" << text << "\" parsed as " << *r;
  EXPECT_TRUE(Contains(r.status().message(), fragment)) << "for \"" << text << "\"";
}

TEST(ParseBytesTest, Errors) {
  ExpectBytesError("", "empty byte size");
  ExpectBytesError("   ", "empty byte size");
  ExpectBytesError("-1", "\"-1\": cannot be negative");
  ExpectBytesError("-1K", "cannot be negative");
  ExpectBytesError("1.3K", "\"1.3K\": 1331.2 is not a whole number of bytes");
  ExpectBytesError("1.3K", "\"1.3K\"");
  ExpectBytesError("0.5", "not a whole number");
  ExpectBytesError("12XB", "unknown unit \"xb\"");
  ExpectBytesError("12XB", "KiB");
  ExpectBytesError("abc", "\"abc\": not a byte size");
  ExpectBytesError("MiB", "not a byte size");
  ExpectBytesError("1 G iB", "unknown unit");
  ExpectBytesError("20EiB", "beyond 2^64-1");
  ExpectBytesError("1e30", "beyond 2^64-1");
  ExpectBytesError("16EiB", "beyond 2^64-1");
  ExpectBytesError("inf", "not a byte size");
  ExpectBytesError("nan", "not a byte size");
  ExpectBytesError("18446744073709551616", "beyond 2^64-1");
  ExpectBytesError("1e400", "out of range");
  ExpectBytesError("+-5", "not a byte size");
  ExpectBytesError("0x10", "unknown unit \"x10\"");
}

TEST(ParseBytesTest, ErrorCodes) {
  EXPECT_EQ(ParseBytes("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("1.3K").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("1e30").status().code(), StatusCode::kOutOfRange);
}

TEST(BytesFromDoubleTest, WholeNonNegativeFinite) {
  EXPECT_EQ(*BytesFromDouble(1e9), 1000000000u);
  EXPECT_EQ(*BytesFromDouble(0), 0u);
  EXPECT_EQ(*BytesFromDouble(9007199254740992.0), 9007199254740992u);
  EXPECT_FALSE(BytesFromDouble(-1).ok());
  EXPECT_FALSE(BytesFromDouble(0.5).ok());
  EXPECT_TRUE(Contains(BytesFromDouble(0.5).status().message(), "0.5 is not a whole number"));
  EXPECT_TRUE(
      Contains(BytesFromDouble(-3).status().message(), "-3: a byte size cannot be negative"));
  EXPECT_TRUE(Contains(BytesFromDouble(1e30).status().message(), "1e+30 is beyond 2^64-1"));
  EXPECT_FALSE(BytesFromDouble(std::numeric_limits<double>::quiet_NaN()).ok());
  EXPECT_FALSE(BytesFromDouble(std::numeric_limits<double>::infinity()).ok());
  EXPECT_FALSE(BytesFromDouble(18446744073709551616.0).ok());
}

// ---------------------------------------------------------------------------
// ParseByteRate

double Rate(std::string_view text) {
  Result<double> r = ParseByteRate(text);
  EXPECT_TRUE(r.ok()) << "\"" << text << "\": " << r.status();
  return r.value_or(-1);
}

TEST(ParseByteRateTest, Forms) {
  EXPECT_DOUBLE_EQ(Rate("6.5GB/s"), 6.5e9);
  EXPECT_DOUBLE_EQ(Rate("6.5 GB/s"), 6.5e9);
  EXPECT_DOUBLE_EQ(Rate("800 MiB/s"), 800.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(Rate("800MiB/S"), 800.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(Rate("1e9"), 1e9);
  EXPECT_DOUBLE_EQ(Rate("1e9/s"), 1e9);
  EXPECT_DOUBLE_EQ(Rate("3.2GB"), 3.2e9);
  EXPECT_DOUBLE_EQ(Rate(" 12 GB/s "), 12e9);
  EXPECT_DOUBLE_EQ(Rate("0.5"), 0.5);  // a rate need not be whole
}

TEST(ParseByteRateTest, Errors) {
  EXPECT_FALSE(ParseByteRate("").ok());
  EXPECT_FALSE(ParseByteRate("/s").ok());
  EXPECT_FALSE(ParseByteRate("fast").ok());
  EXPECT_FALSE(ParseByteRate("-1GB/s").ok());
  EXPECT_TRUE(Contains(ParseByteRate("-1GB/s").status().message(), "negative"));
  Result<double> unit = ParseByteRate("6.5 GX/s");
  ASSERT_FALSE(unit.ok());
  EXPECT_TRUE(Contains(unit.status().message(), "\"6.5 GX/s\""));
  EXPECT_TRUE(Contains(unit.status().message(), "unknown unit"));
}

// ---------------------------------------------------------------------------
// FormatBytes / FormatBandwidth

TEST(FormatBytesTest, Values) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1 KiB");
  EXPECT_EQ(FormatBytes(4096), "4 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(3 * kGiB / 2), "1.5 GiB");
  EXPECT_EQ(FormatBytes(512 * kMiB), "512 MiB");
  EXPECT_EQ(FormatBytes(kTiB + kTiB / 3), "1.33 TiB");
  EXPECT_EQ(FormatBytes(std::numeric_limits<uint64_t>::max()), "16 EiB");
}

TEST(FormatBytesTest, RoundingCarriesIntoTheNextUnit) {
  // 1048575 B is 1023.999 KiB: printed with two decimals that is 1024.00 KiB = 1 MiB.
  EXPECT_EQ(FormatBytes(kMiB - 1), "1 MiB");
  EXPECT_EQ(FormatBytes(kGiB - 1), "1 GiB");
}

TEST(FormatBytesTest, RoundTripsThroughParseBytes) {
  for (uint64_t v : {uint64_t{0}, uint64_t{512}, 4 * kKiB, 3 * kGiB / 2, 512 * kMiB, 7 * kTiB}) {
    EXPECT_EQ(Bytes(FormatBytes(v)), v) << FormatBytes(v);
  }
}

TEST(FormatBandwidthTest, Values) {
  EXPECT_EQ(FormatBandwidth(6.5e9), "6.50 GB/s");
  EXPECT_EQ(FormatBandwidth(800e6), "800.0 MB/s");
  EXPECT_EQ(FormatBandwidth(1500), "1.5 kB/s");
}

// ---------------------------------------------------------------------------
// Alignment

TEST(AlignTest, AlignUpAndIsAligned) {
  static_assert(AlignUp(0, 4096) == 0);
  static_assert(AlignUp(1, 4096) == 4096);
  static_assert(AlignUp(4096, 4096) == 4096);
  static_assert(AlignUp(4097, 4096) == 8192);
  static_assert(IsAligned(8192, 4096));
  EXPECT_EQ(AlignUp(5, 1), 5u);
  EXPECT_EQ(AlignUp(5, 8), 8u);
  EXPECT_EQ(AlignUp(kGiB + 1, kMiB), kGiB + kMiB);
  EXPECT_TRUE(IsAligned(0, 64));
  EXPECT_TRUE(IsAligned(128, 64));
  EXPECT_FALSE(IsAligned(4100, 4096));
  EXPECT_FALSE(IsAligned(1, 2));
  EXPECT_TRUE(IsAligned(7, 1));
}

// ---------------------------------------------------------------------------
// ByteBudget

TEST(ByteBudgetTest, ReserveReleasePeakAvailable) {
  ByteBudget b("host tier budget", 10 * kMiB);
  EXPECT_EQ(b.name(), "host tier budget");
  EXPECT_EQ(b.limit(), 10 * kMiB);
  EXPECT_EQ(b.in_use(), 0u);
  EXPECT_EQ(b.available(), 10 * kMiB);

  ASSERT_TRUE(b.Reserve(4 * kMiB).ok());
  ASSERT_TRUE(b.Reserve(6 * kMiB).ok());  // exactly to the limit
  EXPECT_EQ(b.in_use(), 10 * kMiB);
  EXPECT_EQ(b.available(), 0u);
  EXPECT_EQ(b.peak(), 10 * kMiB);

  b.Release(6 * kMiB);
  EXPECT_EQ(b.in_use(), 4 * kMiB);
  EXPECT_EQ(b.available(), 6 * kMiB);
  EXPECT_EQ(b.peak(), 10 * kMiB);  // peak remembers the high-water mark
  b.ResetPeak();
  EXPECT_EQ(b.peak(), 4 * kMiB);

  EXPECT_TRUE(b.Reserve(0).ok());
  EXPECT_EQ(b.in_use(), 4 * kMiB);
  b.Release(4 * kMiB);
  EXPECT_EQ(b.in_use(), 0u);
}

TEST(ByteBudgetTest, ExhaustionNamesBudgetRequestInUseAndLimit) {
  ByteBudget b("device budget", 8 * kMiB);
  ASSERT_TRUE(b.Reserve(6 * kMiB).ok());
  Status s = b.Reserve(4 * kMiB);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(s.message(), "device budget"));
  EXPECT_TRUE(Contains(s.message(), "4 MiB"));  // request
  EXPECT_TRUE(Contains(s.message(), "6 MiB"));  // in use
  EXPECT_TRUE(Contains(s.message(), "8 MiB"));  // limit
  EXPECT_TRUE(Contains(s.message(), "4194304 bytes"));
  // A failed reservation takes nothing.
  EXPECT_EQ(b.in_use(), 6 * kMiB);
  EXPECT_EQ(b.peak(), 6 * kMiB);
  // A request larger than the whole limit fails too, without overflow.
  EXPECT_FALSE(b.Reserve(std::numeric_limits<uint64_t>::max()).ok());
  EXPECT_EQ(b.in_use(), 6 * kMiB);
}

TEST(ByteBudgetTest, UnlimitedNeverFails) {
  ByteBudget b("scratch");
  EXPECT_EQ(b.limit(), ByteBudget::kUnlimited);
  ASSERT_TRUE(b.Reserve(std::numeric_limits<uint64_t>::max() / 2).ok());
  ASSERT_TRUE(b.Reserve(std::numeric_limits<uint64_t>::max() / 2).ok());
  EXPECT_FALSE(b.Reserve(2).ok());  // would wrap past 2^64-1
  b.Release(std::numeric_limits<uint64_t>::max() / 2 * 2);
  EXPECT_EQ(b.in_use(), 0u);
}

TEST(ByteBudgetTest, ConcurrentReserveReleaseKeepsCountsExact) {
  constexpr int kThreads = 4;
  constexpr int kIters = 20000;
  constexpr uint64_t kChunk = 4096;
  // Room for 3 of the 4 threads' chunks at once: some reservations fail, none over-commit.
  ByteBudget b("concurrent budget", 3 * kChunk);
  std::atomic<uint64_t> ok{0}, failed{0};
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kIters; ++i) {
        if (b.Reserve(kChunk).ok()) {
          ++ok;
          if (b.in_use() > b.limit()) over = true;
          b.Release(kChunk);
        } else {
          ++failed;
        }
      }
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(ok + failed, uint64_t{kThreads} * kIters);
  EXPECT_GT(ok.load(), 0u);
  EXPECT_FALSE(over.load());
  EXPECT_EQ(b.in_use(), 0u);
  EXPECT_LE(b.peak(), 3 * kChunk);
  EXPECT_GE(b.peak(), kChunk);
}

TEST(ByteBudgetTest, ConcurrentReservationsSumExactly) {
  constexpr int kThreads = 4;
  constexpr int kIters = 10000;
  ByteBudget b("sum budget");
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i)
        ASSERT_TRUE(b.Reserve(static_cast<uint64_t>(t + 1)).ok());
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(b.in_use(), uint64_t{kIters} * (1 + 2 + 3 + 4));
  EXPECT_EQ(b.peak(), b.in_use());
}

TEST(ByteBudgetDeathTest, ReleasingMoreThanReservedIsABug) {
  ByteBudget b("pinned budget", kMiB);
  ASSERT_TRUE(b.Reserve(100).ok());
  EXPECT_DEATH(b.Release(200), "pinned budget: released 200 bytes with only 100 reserved");
}

}  // namespace
}  // namespace strata

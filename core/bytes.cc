#include "strata/core/bytes.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace strata {
namespace {

struct Unit {
  std::string_view name;
  uint64_t factor;
};

constexpr uint64_t kKilo = 1000;
constexpr Unit kUnits[] = {
    {"", 1},
    {"b", 1},
    {"k", kKiB},
    {"kib", kKiB},
    {"kb", kKilo},
    {"m", kMiB},
    {"mib", kMiB},
    {"mb", kKilo* kKilo},
    {"g", kGiB},
    {"gib", kGiB},
    {"gb", kKilo* kKilo* kKilo},
    {"t", kTiB},
    {"tib", kTiB},
    {"tb", kKilo* kKilo* kKilo* kKilo},
    {"p", kTiB* kKiB},
    {"pib", kTiB* kKiB},
    {"pb", kKilo* kKilo* kKilo* kKilo* kKilo},
    {"e", kTiB* kMiB},
    {"eib", kTiB* kMiB},
    {"eb", kKilo* kKilo* kKilo* kKilo* kKilo* kKilo},
};
constexpr std::string_view kUnitList =
    "B, K/KiB, KB, M/MiB, MB, G/GiB, GB, T/TiB, TB, P/PiB, PB, E/EiB, EB";

std::string Quote(std::string_view s) {
  return "\"" + std::string(s) + "\"";
}

// The shortest text that reads back as `v` ("1e+30", "4099999.9999999995").
std::string ShortestDouble(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  if (ec != std::errc()) return "?";
  return std::string(buf, end);
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return s;
}

// "<number>[ ]<unit>", split and read but not yet multiplied out.
struct Scaled {
  std::string_view digits;  // the number as written, without a leading '+'
  double number = 0;
  uint64_t factor = 1;
};

// Parses `s` (trimmed); `shown` is the caller's text, quoted in errors.
Result<Scaled> ParseScaled(std::string_view s, std::string_view shown) {
  if (s.empty()) {
    return InvalidArgumentError("empty byte size; expected e.g. 512MiB, 1.5G, 1e9");
  }
  if (s.front() == '-') {
    return InvalidArgumentError(Quote(shown) + ": cannot be negative");
  }
  if (s.front() == '+') s.remove_prefix(1);
  const auto not_a_size = [&] {
    return InvalidArgumentError(Quote(shown) +
                                ": not a byte size; expected a number with an optional unit (" +
                                std::string(kUnitList) + "), e.g. 512MiB");
  };
  // from_chars would also take a sign, "inf" and "nan": a size starts with a digit or '.'.
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s.front())) || s.front() == '.')) {
    return not_a_size();
  }
  Scaled out;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out.number);
  if (ec == std::errc::result_out_of_range) {
    return OutOfRangeError(Quote(shown) + ": the number is out of range");
  }
  if (ec != std::errc() || end == s.data()) return not_a_size();
  out.digits = s.substr(0, static_cast<size_t>(end - s.data()));
  std::string unit;
  for (const char* p = end; p != s.data() + s.size(); ++p) {
    if (std::isspace(static_cast<unsigned char>(*p)) && unit.empty()) continue;
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(*p))));
  }
  for (const Unit& u : kUnits) {
    if (unit == u.name) {
      out.factor = u.factor;
      return out;
    }
  }
  return InvalidArgumentError(Quote(shown) + ": unknown unit \"" + unit + "\"; expected " +
                              std::string(kUnitList));
}

}  // namespace

Result<uint64_t> BytesFromDouble(double value) {
  if (std::isnan(value) || std::isinf(value)) {
    return InvalidArgumentError(ShortestDouble(value) + " is not a finite number of bytes");
  }
  if (value < 0) {
    return InvalidArgumentError(ShortestDouble(value) + ": a byte size cannot be negative");
  }
  if (value >= 18446744073709551616.0) {
    return OutOfRangeError(ShortestDouble(value) + " is beyond 2^64-1 bytes");
  }
  if (value != std::floor(value)) {
    return InvalidArgumentError(ShortestDouble(value) + " is not a whole number of bytes");
  }
  return static_cast<uint64_t>(value);
}

Result<uint64_t> ParseBytes(std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(const Scaled s, ParseScaled(Trim(text), text));
  // Whole numbers are read exactly, not through a double (which holds 53 bits).
  if (std::all_of(s.digits.begin(), s.digits.end(),
                  [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    uint64_t n = 0;
    uint64_t bytes = 0;
    auto [end, ec] = std::from_chars(s.digits.data(), s.digits.data() + s.digits.size(), n);
    if (ec != std::errc() || end != s.digits.data() + s.digits.size() ||
        __builtin_mul_overflow(n, s.factor, &bytes)) {
      return OutOfRangeError(Quote(text) + ": beyond 2^64-1 bytes");
    }
    return bytes;
  }
  double v = s.number * static_cast<double>(s.factor);
  // A decimal fraction times a unit can miss a whole number by a rounding error of the
  // binary representation (4.1 x 1e6 = 4099999.9999999995): within a few ulps of a whole
  // number, take the whole number.
  if (const double r = std::nearbyint(v);
      std::fabs(v - r) <= 4 * std::numeric_limits<double>::epsilon() * std::fabs(v)) {
    v = r;
  }
  auto bytes = BytesFromDouble(v);
  if (!bytes.ok()) return bytes.status().WithContext(Quote(text));
  return bytes;
}

Result<double> ParseByteRate(std::string_view text) {
  std::string_view s = Trim(text);
  if (s.size() >= 2 && (s.substr(s.size() - 2) == "/s" || s.substr(s.size() - 2) == "/S")) {
    s = Trim(s.substr(0, s.size() - 2));
  }
  if (s.empty()) {
    return InvalidArgumentError(Quote(text) + ": not a bandwidth; expected e.g. 6.5GB/s, 1e9");
  }
  STRATA_ASSIGN_OR_RETURN(const Scaled scaled, ParseScaled(s, text));
  const double v = scaled.number * static_cast<double>(scaled.factor);
  if (std::isnan(v) || std::isinf(v)) {
    return InvalidArgumentError(Quote(text) + ": not a finite number");
  }
  return v;
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  int unit = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024.0 && unit < 6) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  // 1023.999 KiB prints as "1024.00": that is 1 MiB.
  if (std::strtod(buf, nullptr) >= 1024.0 && unit < 6) {
    v /= 1024.0;
    ++unit;
    std::snprintf(buf, sizeof buf, "%.2f", v);
  }
  std::string s = buf;
  // Trim trailing zeros of the fraction: "4.00" -> "4", "1.50" -> "1.5".
  while (s.back() == '0')
    s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s + " " + kNames[unit];
}

std::string FormatBandwidth(double bytes_per_second) {
  char buf[48];
  if (bytes_per_second >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB/s", bytes_per_second / 1e9);
  } else if (bytes_per_second >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f MB/s", bytes_per_second / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f kB/s", bytes_per_second / 1e3);
  }
  return buf;
}

}  // namespace strata

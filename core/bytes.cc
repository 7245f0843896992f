#include "strata/core/bytes.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace strata {
namespace {

struct Unit {
  std::string_view name;
  double factor;
};

constexpr Unit kUnits[] = {
    {"", 1.0},
    {"b", 1.0},
    {"k", 1024.0},
    {"kib", 1024.0},
    {"kb", 1e3},
    {"m", 1024.0 * 1024},
    {"mib", 1024.0 * 1024},
    {"mb", 1e6},
    {"g", 1024.0 * 1024 * 1024},
    {"gib", 1024.0 * 1024 * 1024},
    {"gb", 1e9},
    {"t", 1024.0 * 1024 * 1024 * 1024},
    {"tib", 1024.0 * 1024 * 1024 * 1024},
    {"tb", 1e12},
    {"p", 1024.0 * 1024 * 1024 * 1024 * 1024},
    {"pib", 1024.0 * 1024 * 1024 * 1024 * 1024},
    {"pb", 1e15},
};

std::string Quote(std::string_view s) { return "\"" + std::string(s) + "\""; }

}  // namespace

Result<uint64_t> BytesFromDouble(double value) {
  if (std::isnan(value) || std::isinf(value)) {
    return InvalidArgumentError("a byte size must be a finite number");
  }
  if (value < 0) return InvalidArgumentError("a byte size cannot be negative");
  if (value >= 18446744073709551616.0) {
    return OutOfRangeError("byte size beyond 2^64-1");
  }
  if (value != std::floor(value)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", value);
    return InvalidArgumentError(std::string(buf) + " is not a whole number of bytes");
  }
  return static_cast<uint64_t>(value);
}

// Parses "<number>[ ]<unit>" into number x unit factor (not yet checked for wholeness).
static Result<double> ParseScaled(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) return InvalidArgumentError("empty byte size; expected e.g. 512MiB, 1.5G, 1e9");
  if (s.front() == '-') return InvalidArgumentError(Quote(text) + ": a byte size cannot be negative");
  if (s.front() == '+') s.remove_prefix(1);

  double number = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), number);
  if (ec != std::errc() || end == s.data()) {
    return InvalidArgumentError(Quote(text) +
                                ": not a byte size; expected a number with an optional unit "
                                "(B, K/KiB, KB, M/MiB, MB, G/GiB, GB, T/TiB, TB), e.g. 512MiB");
  }
  std::string unit;
  for (const char* p = end; p != s.data() + s.size(); ++p) {
    if (std::isspace(static_cast<unsigned char>(*p)) && unit.empty()) continue;
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(*p))));
  }
  for (const Unit& u : kUnits) {
    if (unit == u.name) {
      const double v = number * u.factor;
      if (std::isnan(v) || std::isinf(v)) {
        return InvalidArgumentError(Quote(text) + ": not a finite number");
      }
      return v;
    }
  }
  return InvalidArgumentError(Quote(text) + ": unknown unit \"" + unit +
                              "\"; expected B, K/KiB, KB, M/MiB, MB, G/GiB, GB, T/TiB, TB, P/PiB, PB");
}

Result<uint64_t> ParseBytes(std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(const double v, ParseScaled(text));
  auto bytes = BytesFromDouble(v);
  if (!bytes.ok()) return bytes.status().WithContext(Quote(text));
  return bytes;
}

Result<double> ParseByteRate(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.size() >= 2 && (s.substr(s.size() - 2) == "/s" || s.substr(s.size() - 2) == "/S")) {
    s.remove_suffix(2);
  }
  auto v = ParseScaled(s);
  if (!v.ok()) return v.status();
  if (*v < 0) return InvalidArgumentError(Quote(text) + ": a bandwidth cannot be negative");
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
  std::string s = buf;
  // Trim trailing zeros of the fraction: "4.00" -> "4", "1.50" -> "1.5".
  while (s.back() == '0') s.pop_back();
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

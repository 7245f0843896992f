// Helpers the C++ benchmarks share: the clock, the seconds between two of its points, and
// the median of a sample.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace strata::bench {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The middle value (of an even count, the higher of the two middle ones); 0 for none.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace strata::bench

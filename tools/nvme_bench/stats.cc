#include "strata/tools/nvme_bench/stats.h"

#include <algorithm>
#include <cmath>

namespace strata::nvme_bench {
namespace {

template <typename T>
T NearestRank(std::span<T> values, double p) {
  if (values.empty()) return T{};
  const size_t n = values.size();
  size_t rank = 1;  // 1-based
  if (p >= 100) {
    rank = n;
  } else if (p > 0) {
    rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(n)));
    rank = std::clamp<size_t>(rank, 1, n);
  }
  auto nth = values.begin() + static_cast<std::ptrdiff_t>(rank - 1);
  std::nth_element(values.begin(), nth, values.end());
  return *nth;
}

}  // namespace

double Percentile(std::span<double> values, double p) {
  return NearestRank(values, p);
}

int64_t Percentile(std::span<int64_t> values, double p) {
  return NearestRank(values, p);
}

double Median(std::span<double> values) {
  if (values.empty()) return 0;
  const size_t n = values.size();
  auto mid = values.begin() + static_cast<std::ptrdiff_t>(n / 2);
  std::nth_element(values.begin(), mid, values.end());
  if (n % 2 == 1) return *mid;
  const double upper = *mid;
  const double lower = *std::max_element(values.begin(), mid);
  return (lower + upper) / 2;
}

LatencySummary SummarizeLatencies(std::span<int64_t> latencies_ns) {
  LatencySummary s;
  s.count = latencies_ns.size();
  if (latencies_ns.empty()) return s;
  double sum = 0;
  int64_t max = latencies_ns[0];
  for (int64_t v : latencies_ns) {
    sum += static_cast<double>(v);
    max = std::max(max, v);
  }
  s.mean_us = sum / static_cast<double>(s.count) / 1e3;
  s.max_us = static_cast<double>(max) / 1e3;
  s.p50_us = static_cast<double>(Percentile(latencies_ns, 50)) / 1e3;
  s.p99_us = static_cast<double>(Percentile(latencies_ns, 99)) / 1e3;
  return s;
}

}  // namespace strata::nvme_bench

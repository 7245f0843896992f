// Statistics for nvme_bench: percentiles of request latencies and medians of rounds.
//
// Percentiles use the nearest-rank definition: the p-th percentile of n values is the
// smallest value v such that at least p% of the values are <= v, i.e. the value at rank
// ceil(p/100 * n) (1-based) of the sorted values. It is always a value that was observed.
// Medians average the two middle values of an even count.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace strata::nvme_bench {

// The p-th percentile (0 < p <= 100; p <= 0 gives the minimum) by nearest rank.
// Reorders `values` (partial sort). Returns 0 for no values.
double Percentile(std::span<double> values, double p);
int64_t Percentile(std::span<int64_t> values, double p);

// The median; reorders `values`. Returns 0 for no values.
double Median(std::span<double> values);

// Latencies of one sweep point, in microseconds.
struct LatencySummary {
  uint64_t count = 0;
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
  double max_us = 0;
};
// From nanosecond latencies; reorders `latencies_ns`.
LatencySummary SummarizeLatencies(std::span<int64_t> latencies_ns);

}  // namespace strata::nvme_bench

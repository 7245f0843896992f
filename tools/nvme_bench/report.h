// nvme_bench's reports of a sweep: the text table, the best settings and the config
// snippet, the JSON document and the SVG plot.
//
// Units everywhere: GB/s = 10^9 bytes per second, GiB/s = 2^30 bytes per second; the
// JSON's "gbps" is GB/s. Latencies in microseconds.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "strata/tools/nvme_bench/sweep.h"

namespace strata::nvme_bench {

struct BestSettings {
  // The fastest point of each mode (nullopt when the mode was not measured).
  std::optional<PointResult> read;
  std::optional<PointResult> write;
  // The one setting for the config's `aio` section (block size, queue depth, threads):
  // with both modes measured, the setting that moves the same bytes in and out in the
  // least time (smallest 1/read + 1/write, the swap tier's pattern); with one mode, its
  // fastest point. Its bandwidths at that setting (0 for a mode not measured).
  std::optional<SweepPoint> chosen;
  double chosen_read_bytes_per_second = 0;
  double chosen_write_bytes_per_second = 0;
};
BestSettings ChooseBest(const std::vector<PointResult>& points);

// A bandwidth as the config reads it (ParseByteRate): "5.21GB/s", "812MB/s" — three
// significant digits, rounded down so the config never claims more than was measured.
std::string ConfigBandwidth(double bytes_per_second);

// {"aio": {"block_size": N, "queue_depth": N, "intra_op_parallelism": N},
//  "strata": {"nvme_read_bandwidth": "..GB/s", "nvme_write_bandwidth": "..GB/s"}}
// with the keys of the modes measured; an empty object when nothing was chosen. The keys
// and value formats are those core/config_keys.cc defines, so a config with this merged
// in validates (`strata-config validate`).
nlohmann::json ConfigSnippet(const BestSettings& best);

// The report printed by the tool: settings, machine, memory and engine obtained, notes,
// the table of points, the best settings and the snippet (the snippet's JSON begins on
// the line after "config snippet" and ends with the first line that is "}").
std::string FormatHeader(const SweepResult& result);
std::string FormatTable(const std::vector<PointResult>& points);
std::string FormatBest(const BestSettings& best);
std::string FormatSnippet(const SweepResult& result, const BestSettings& best);
std::string FormatReport(const SweepResult& result);

// Everything as JSON: "tool", "version", "units", "machine", "settings" (the options,
// filesystems, memory and engine obtained), "notes", "points" (each with mode,
// block_size, queue_depth, threads, memory, gbps, iops, p50_us, p99_us, and more),
// "best" and "config_snippet".
nlohmann::json ToJson(const SweepResult& result);

// Bandwidth (GB/s) against queue depth (log scale), one series per block size (and
// thread count, when several were swept), one panel per mode: a standalone SVG document.
std::string RenderSvg(const SweepResult& result);

// Escapes &, <, >, " and ' for XML text and attributes.
std::string XmlEscape(std::string_view text);

}  // namespace strata::nvme_bench

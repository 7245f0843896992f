#include "strata/tools/nvme_bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "strata/core/bytes.h"
#include "strata_generated/version.h"

namespace strata::nvme_bench {

using swap::IoOp;

namespace {

std::string Fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// Rounds to `decimals` for JSON (keeps the files short and diffable).
double Round(double v, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(v * scale) / scale;
}

std::string ThreadsText(int threads) {
  return std::to_string(threads) + (threads == 1 ? " thread" : " threads");
}

std::string PointText(const SweepPoint& p) {
  return "block " + FormatBytes(p.block_size) + ", queue depth " + std::to_string(p.queue_depth) +
         ", " + ThreadsText(p.threads);
}

std::string BandwidthText(double bps) {
  return Fixed(bps / 1e9, 2) + " GB/s (" + Fixed(bps / static_cast<double>(kGiB), 2) + " GiB/s)";
}

nlohmann::json PointJson(const SweepPoint& p) {
  return {{"mode", swap::IoOpName(p.mode)},
          {"block_size", p.block_size},
          {"queue_depth", p.queue_depth},
          {"threads", p.threads}};
}

// A "nice" upper bound for an axis: 1, 2, 2.5 or 5 times a power of ten, >= v.
double NiceCeil(double v) {
  if (!(v > 0)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(v)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * p >= v * (1 - 1e-12)) return m * p;
  }
  return 10 * p;
}

std::string Num(double v) {
  // Coordinates with one decimal, without trailing zeros.
  std::string s = Fixed(v, 1);
  if (s.size() > 2 && s.substr(s.size() - 2) == ".0") s.resize(s.size() - 2);
  return s;
}

std::string AxisLabel(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", Round(v, 3));
  return buf;
}

}  // namespace

std::string XmlEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters other than tab/newline are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Best settings and the snippet.

BestSettings ChooseBest(const std::vector<PointResult>& points) {
  BestSettings best;
  for (const PointResult& p : points) {
    std::optional<PointResult>& slot = p.point.mode == IoOp::kRead ? best.read : best.write;
    if (!slot || p.bytes_per_second > slot->bytes_per_second) slot = p;
  }
  if (best.read && best.write) {
    // The settings measured in both modes; minimize the time to read and write a byte.
    double best_cost = 0;
    for (const PointResult& r : points) {
      if (r.point.mode != IoOp::kRead || !(r.bytes_per_second > 0)) continue;
      for (const PointResult& w : points) {
        if (w.point.mode != IoOp::kWrite || !(w.bytes_per_second > 0)) continue;
        if (w.point.block_size != r.point.block_size ||
            w.point.queue_depth != r.point.queue_depth || w.point.threads != r.point.threads) {
          continue;
        }
        const double cost = 1 / r.bytes_per_second + 1 / w.bytes_per_second;
        if (!best.chosen || cost < best_cost) {
          best_cost = cost;
          best.chosen = r.point;
          best.chosen->mode = IoOp::kRead;
          best.chosen_read_bytes_per_second = r.bytes_per_second;
          best.chosen_write_bytes_per_second = w.bytes_per_second;
        }
      }
    }
  }
  if (!best.chosen) {
    if (best.read) {
      best.chosen = best.read->point;
      best.chosen_read_bytes_per_second = best.read->bytes_per_second;
    } else if (best.write) {
      best.chosen = best.write->point;
      best.chosen_write_bytes_per_second = best.write->bytes_per_second;
    }
  }
  return best;
}

std::string ConfigBandwidth(double bytes_per_second) {
  if (!(bytes_per_second > 0)) return "0";
  static constexpr std::pair<const char*, double> kUnits[] = {
      {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}};
  for (const auto& [unit, scale] : kUnits) {
    const double v = bytes_per_second / scale;
    if (v < 1) continue;
    const int digits = static_cast<int>(std::floor(std::log10(v))) + 1;  // before the point
    const int decimals = std::max(0, 3 - digits);
    const double factor = std::pow(10.0, decimals);
    const double down = std::floor(v * factor * (1 + 1e-12)) / factor;
    return Fixed(down, decimals) + unit + "/s";
  }
  return Fixed(std::floor(bytes_per_second), 0);
}

nlohmann::json ConfigSnippet(const BestSettings& best) {
  nlohmann::json j = nlohmann::json::object();
  if (!best.chosen) return j;
  j["aio"] = {{"block_size", best.chosen->block_size},
              {"queue_depth", best.chosen->queue_depth},
              {"intra_op_parallelism", best.chosen->threads}};
  nlohmann::json strata = nlohmann::json::object();
  if (best.read) strata["nvme_read_bandwidth"] = ConfigBandwidth(best.chosen_read_bytes_per_second);
  if (best.write) {
    strata["nvme_write_bandwidth"] = ConfigBandwidth(best.chosen_write_bytes_per_second);
  }
  j["strata"] = strata;
  return j;
}

// ---------------------------------------------------------------------------
// Text.

std::string FormatHeader(const SweepResult& r) {
  const SweepOptions& o = r.options;
  std::ostringstream os;
  os << "nvme_bench " << STRATA_VERSION_STRING
     << ": swap-tier bandwidth (GB/s = 10^9 bytes/s, GiB/s = 2^30 bytes/s)\n";
  for (size_t i = 0; i < o.paths.size(); ++i) {
    os << (i == 0 ? "directories: " : "             ") << o.paths[i];
    if (i < r.filesystems.size()) os << " (" << r.filesystems[i] << ")";
    os << "\n";
  }
  os << "data set:    " << FormatBytes(r.bytes_per_file * o.paths.size());
  if (o.paths.size() > 1) {
    os << " (" << o.paths.size() << " files of " << FormatBytes(r.bytes_per_file)
       << ", requests striped across them)";
  }
  os << ", " << (o.direct ? "O_DIRECT" : "buffered (page cache)") << "\n";
  os << "memory:      " << MemoryKindName(o.memory) << " asked; got " << r.memory_obtained << "\n";
  os << "engine:      " << r.engine;
  if (r.fixed_buffers) {
    os << ", fixed (registered) buffers";
  } else if (r.engine.find("io_uring") != std::string::npos) {
    os << ", not every point used fixed buffers (see the notes)";
  }
  os << "\n";
  os << "each point:  ";
  if (o.seconds > 0) {
    os << "whole passes over the data set for at least " << o.seconds << " s";
  } else {
    os << "one pass over the data set";
  }
  os << ", " << o.rounds << (o.rounds == 1 ? " round" : " rounds (median shown)") << "; ";
  if (o.backlog == 0) {
    os << "exactly the queue depth submitted per thread\n";
  } else {
    os << "queue depth + "
       << (o.backlog < 0 ? std::string("max(1, QD/8)") : std::to_string(o.backlog))
       << " submitted per thread (the engine keeps QD at the device; latency includes "
          "the wait in its queue)\n";
  }
  const MachineInfo& m = r.machine;
  os << "machine:     " << m.hostname << ", Linux " << m.kernel << ", " << m.cpus << " CPUs"
     << (m.cpu_model.empty() ? "" : " (" + m.cpu_model + ")") << ", " << FormatBytes(m.memory_bytes)
     << " RAM\n";
  for (const std::string& n : r.notes)
    os << "note: " << n << "\n";
  return os.str();
}

std::string FormatTable(const std::vector<PointResult>& points) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%-6s %10s %5s %7s %9s %9s %10s %10s %10s\n", "mode", "block",
                "QD", "threads", "GB/s", "GiB/s", "IOPS", "p50 us", "p99 us");
  os << line;
  for (const PointResult& p : points) {
    std::snprintf(line, sizeof line, "%-6s %10s %5d %7d %9.3f %9.3f %10.0f %10.1f %10.1f\n",
                  std::string(swap::IoOpName(p.point.mode)).c_str(),
                  FormatBytes(p.point.block_size).c_str(), p.point.queue_depth, p.point.threads,
                  p.gbps(), p.gibps(), p.iops, p.p50_us, p.p99_us);
    os << line;
  }
  return os.str();
}

std::string FormatBest(const BestSettings& best) {
  std::ostringstream os;
  if (best.read) {
    os << "best read:   " << BandwidthText(best.read->bytes_per_second) << " at "
       << PointText(best.read->point) << "\n";
  }
  if (best.write) {
    os << "best write:  " << BandwidthText(best.write->bytes_per_second) << " at "
       << PointText(best.write->point) << "\n";
  }
  if (best.chosen && best.read && best.write) {
    os << "for the config: " << PointText(*best.chosen) << ", the fastest to read and write "
       << "the same bytes: read " << Fixed(best.chosen_read_bytes_per_second / 1e9, 2)
       << " GB/s, write " << Fixed(best.chosen_write_bytes_per_second / 1e9, 2) << " GB/s\n";
  }
  return os.str();
}

std::string FormatSnippet(const SweepResult& result, const BestSettings& best) {
  if (!best.chosen) return "";
  std::ostringstream os;
  os << "config snippet (merge the aio and strata keys into your config";
  if (!result.options.direct) os << "; measured through the page cache, not the drive's speed";
  os << "):\n" << ConfigSnippet(best).dump(2) << "\n";
  return os.str();
}

std::string FormatReport(const SweepResult& result) {
  const BestSettings best = ChooseBest(result.points);
  return FormatHeader(result) + "\n" + FormatTable(result.points) + "\n" + FormatBest(best) + "\n" +
         FormatSnippet(result, best);
}

// ---------------------------------------------------------------------------
// JSON.

nlohmann::json ToJson(const SweepResult& r) {
  const SweepOptions& o = r.options;
  nlohmann::json j;
  j["tool"] = "nvme_bench";
  j["version"] = STRATA_VERSION_STRING;
  j["units"] = {{"gbps", "GB/s = 1e9 bytes per second"},
                {"gibps", "GiB/s = 2^30 bytes per second"},
                {"iops", "requests per second"},
                {"latency",
                 "microseconds, each request from its submission to the engine to its "
                 "completion (includes the wait behind the backlog in the engine's queue)"},
                {"block_size", "bytes"}};
  j["machine"] = {{"hostname", r.machine.hostname},
                  {"kernel", r.machine.kernel},
                  {"cpu_model", r.machine.cpu_model},
                  {"cpus", r.machine.cpus},
                  {"memory_bytes", r.machine.memory_bytes}};
  nlohmann::json modes = nlohmann::json::array();
  for (IoOp m : o.modes)
    modes.push_back(swap::IoOpName(m));
  j["settings"] = {{"paths", o.paths},
                   {"filesystems", r.filesystems},
                   {"size", r.bytes_per_file * o.paths.size()},
                   {"bytes_per_file", r.bytes_per_file},
                   {"block_sizes", o.block_sizes},
                   {"queue_depths", o.queue_depths},
                   {"threads", o.threads},
                   {"modes", modes},
                   {"direct", o.direct},
                   {"memory", MemoryKindName(o.memory)},
                   {"memory_obtained", r.memory_obtained},
                   {"memory_fallback", r.memory_fallback},
                   {"memory_pinned", r.memory_pinned},
                   {"memory_huge_pages", r.memory_huge_pages},
                   {"engine_requested", swap::IoEngineKindName(o.engine)},
                   {"engine", r.engine},
                   {"engine_fallback", r.engine_fallback},
                   {"fixed_buffers", r.fixed_buffers},
                   {"backlog", o.backlog < 0 ? nlohmann::json("auto") : nlohmann::json(o.backlog)},
                   {"rounds", o.rounds},
                   {"seconds", o.seconds}};
  j["notes"] = r.notes;
  nlohmann::json points = nlohmann::json::array();
  for (const PointResult& p : r.points) {
    nlohmann::json pj = PointJson(p.point);
    pj["memory"] = MemoryKindName(o.memory);
    pj["gbps"] = Round(p.gbps(), 4);
    pj["gibps"] = Round(p.gibps(), 4);
    pj["iops"] = Round(p.iops, 1);
    pj["p50_us"] = Round(p.p50_us, 1);
    pj["p99_us"] = Round(p.p99_us, 1);
    pj["mean_us"] = Round(p.mean_us, 1);
    pj["max_us"] = Round(p.max_us, 1);
    pj["requests"] = p.requests;
    pj["bytes"] = p.bytes;
    pj["seconds"] = Round(p.seconds, 4);
    nlohmann::json rounds = nlohmann::json::array();
    for (double b : p.round_bytes_per_second)
      rounds.push_back(Round(b / 1e9, 4));
    pj["rounds_gbps"] = rounds;
    pj["fixed_buffers"] = p.fixed_buffers;
    pj["requests_per_thread"] = o.RequestsPerThread(p.point.queue_depth);
    points.push_back(pj);
  }
  j["points"] = points;
  const BestSettings best = ChooseBest(r.points);
  nlohmann::json bj = nlohmann::json::object();
  if (best.read) {
    bj["read"] = PointJson(best.read->point);
    bj["read"]["gbps"] = Round(best.read->gbps(), 4);
  }
  if (best.write) {
    bj["write"] = PointJson(best.write->point);
    bj["write"]["gbps"] = Round(best.write->gbps(), 4);
  }
  if (best.chosen) {
    bj["chosen"] = {{"block_size", best.chosen->block_size},
                    {"queue_depth", best.chosen->queue_depth},
                    {"threads", best.chosen->threads},
                    {"read_gbps", Round(best.chosen_read_bytes_per_second / 1e9, 4)},
                    {"write_gbps", Round(best.chosen_write_bytes_per_second / 1e9, 4)}};
  }
  j["best"] = bj;
  j["config_snippet"] = ConfigSnippet(best);
  return j;
}

// ---------------------------------------------------------------------------
// SVG.

namespace {

// The chart's layout: the series in the data (a panel per mode, a colour per block size, a
// dash pattern per thread count, queue depths along x on a log scale), the y scale and the
// sizes.
struct Chart {
  static constexpr const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                            "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  static constexpr const char* kDashes[] = {"", "7,4", "2,3", "9,3,2,3"};
  static constexpr double plot_w = 400, plot_h = 280;
  static constexpr double left = 80, top = 84, gap = 90, legend_w = 190;

  std::vector<IoOp> modes;
  std::vector<uint64_t> block_sizes;  // sorted
  std::vector<int> thread_counts;     // sorted
  std::vector<int> qds;               // sorted
  double ymax = 1;
  size_t panels = 1;
  double width = 0, height = 0;

  static Chart Of(const SweepResult& r) {
    Chart c;
    for (const PointResult& p : r.points) {
      if (std::find(c.modes.begin(), c.modes.end(), p.point.mode) == c.modes.end()) {
        c.modes.push_back(p.point.mode);
      }
    }
    std::set<int> qd_set;
    double ymax_data = 0;
    for (const PointResult& p : r.points) {
      qd_set.insert(p.point.queue_depth);
      if (std::find(c.block_sizes.begin(), c.block_sizes.end(), p.point.block_size) ==
          c.block_sizes.end()) {
        c.block_sizes.push_back(p.point.block_size);
      }
      if (std::find(c.thread_counts.begin(), c.thread_counts.end(), p.point.threads) ==
          c.thread_counts.end()) {
        c.thread_counts.push_back(p.point.threads);
      }
      ymax_data = std::max(ymax_data, p.gbps());
    }
    std::sort(c.block_sizes.begin(), c.block_sizes.end());
    std::sort(c.thread_counts.begin(), c.thread_counts.end());
    c.qds.assign(qd_set.begin(), qd_set.end());
    c.ymax = NiceCeil(ymax_data > 0 ? ymax_data * 1.05 : 1);
    c.panels = std::max<size_t>(c.modes.size(), 1);
    c.width = left + static_cast<double>(c.panels) * plot_w +
              static_cast<double>(c.panels - 1) * gap + 30 + legend_w;
    c.height = top + plot_h + 80;
    return c;
  }

  // The x of queue depth `qd` in the panel at `x0`, and the y of a bandwidth.
  double X(int qd, double x0) const {
    if (qds.size() <= 1) return x0 + plot_w / 2;
    const double lo = std::log2(static_cast<double>(qds.front()));
    const double hi = std::log2(static_cast<double>(qds.back()));
    const double t = (std::log2(static_cast<double>(qd)) - lo) / (hi - lo);
    return x0 + plot_w * (0.06 + 0.88 * t);
  }
  double Y(double gbps) const { return top + plot_h * (1 - gbps / ymax); }
  const char* Color(uint64_t bs) const {
    const size_t i = static_cast<size_t>(std::find(block_sizes.begin(), block_sizes.end(), bs) -
                                         block_sizes.begin());
    return kColors[i % std::size(kColors)];
  }
  const char* Dash(int threads) const {
    const size_t i = static_cast<size_t>(
        std::find(thread_counts.begin(), thread_counts.end(), threads) - thread_counts.begin());
    return kDashes[i % std::size(kDashes)];
  }
};

// The document's start, the background, the title and the subtitle (I/O kind, memory,
// engine, file system).
void WriteSvgTitle(std::ostream& os, const Chart& c, const SweepResult& r) {
  const SweepOptions& o = r.options;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << Num(c.width) << "\" height=\""
     << Num(c.height) << "\" viewBox=\"0 0 " << Num(c.width) << " " << Num(c.height)
     << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::string subtitle = std::string(o.direct ? "O_DIRECT" : "buffered (page cache)") + ", " +
                         std::string(MemoryKindName(o.memory)) + " buffers, " + r.engine;
  if (!r.filesystems.empty()) subtitle += ", " + r.filesystems.front();
  if (o.paths.size() > 1) subtitle += " (+" + std::to_string(o.paths.size() - 1) + " more)";
  os << "<text x=\"" << Num(Chart::left) << "\" y=\"28\" font-size=\"17\" font-weight=\"bold\">"
     << "nvme_bench: bandwidth against queue depth</text>\n";
  os << "<text x=\"" << Num(Chart::left) << "\" y=\"48\" fill=\"#444\">" << XmlEscape(subtitle)
     << "</text>\n";
}

// A panel's frame at `x0`: its title, the grid with the y ticks, the x ticks, the axes and
// their labels.
void WritePanelFrame(std::ostream& os, const Chart& c, double x0, const std::string& mode) {
  const double plot_w = Chart::plot_w, plot_h = Chart::plot_h, top = Chart::top;
  os << "<text x=\"" << Num(x0 + plot_w / 2) << "\" y=\"" << Num(top - 8)
     << "\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">" << XmlEscape(mode)
     << "</text>\n";
  // Grid and y ticks.
  for (int k = 0; k <= 5; ++k) {
    const double v = c.ymax * k / 5;
    const double y = c.Y(v);
    os << "<line x1=\"" << Num(x0) << "\" y1=\"" << Num(y) << "\" x2=\"" << Num(x0 + plot_w)
       << "\" y2=\"" << Num(y) << "\" stroke=\"#ddd\"/>\n";
    os << "<text x=\"" << Num(x0 - 6) << "\" y=\"" << Num(y + 4) << "\" text-anchor=\"end\">"
       << AxisLabel(v) << "</text>\n";
  }
  // x ticks.
  for (int qd : c.qds) {
    const double x = c.X(qd, x0);
    os << "<line x1=\"" << Num(x) << "\" y1=\"" << Num(top) << "\" x2=\"" << Num(x) << "\" y2=\""
       << Num(top + plot_h) << "\" stroke=\"#eee\"/>\n";
    os << "<text x=\"" << Num(x) << "\" y=\"" << Num(top + plot_h + 18)
       << "\" text-anchor=\"middle\">" << qd << "</text>\n";
  }
  // Axes.
  os << "<rect x=\"" << Num(x0) << "\" y=\"" << Num(top) << "\" width=\"" << Num(plot_w)
     << "\" height=\"" << Num(plot_h) << "\" fill=\"none\" stroke=\"#333\"/>\n";
  os << "<text x=\"" << Num(x0 + plot_w / 2) << "\" y=\"" << Num(top + plot_h + 40)
     << "\" text-anchor=\"middle\">queue depth (requests in flight per thread)</text>\n";
  const double ly = top + plot_h / 2;
  os << "<text x=\"" << Num(x0 - 50) << "\" y=\"" << Num(ly) << "\" text-anchor=\"middle\" "
     << "transform=\"rotate(-90 " << Num(x0 - 50) << " " << Num(ly) << ")\">"
     << "bandwidth, GB/s (10^9 bytes/s)</text>\n";
}

// A panel's series: per block size and thread count, a line over the queue depths with a
// dot (and its numbers as a tooltip) at each point.
void WritePanelSeries(std::ostream& os, const Chart& c, const SweepResult& r, IoOp mode,
                      double x0) {
  for (uint64_t bs : c.block_sizes) {
    for (int t : c.thread_counts) {
      std::vector<const PointResult*> pts;
      for (const PointResult& p : r.points) {
        if (p.point.mode == mode && p.point.block_size == bs && p.point.threads == t) {
          pts.push_back(&p);
        }
      }
      if (pts.empty()) continue;
      std::sort(pts.begin(), pts.end(), [](const PointResult* a, const PointResult* b) {
        return a->point.queue_depth < b->point.queue_depth;
      });
      const char* color = c.Color(bs);
      const char* dash = c.Dash(t);
      os << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\"";
      if (*dash) os << " stroke-dasharray=\"" << dash << "\"";
      os << " points=\"";
      for (size_t k = 0; k < pts.size(); ++k) {
        os << (k ? " " : "") << Num(c.X(pts[k]->point.queue_depth, x0)) << ","
           << Num(c.Y(pts[k]->gbps()));
      }
      os << "\"/>\n";
      for (const PointResult* p : pts) {
        os << "<circle cx=\"" << Num(c.X(p->point.queue_depth, x0)) << "\" cy=\""
           << Num(c.Y(p->gbps())) << "\" r=\"3.5\" fill=\"" << color << "\"><title>"
           << XmlEscape(p->point.ToString() + ": " + Fixed(p->gbps(), 3) + " GB/s, p99 " +
                        Fixed(p->p99_us, 0) + " us")
           << "</title></circle>\n";
      }
    }
  }
}

// The legend right of the panels: the block sizes' colours, and the thread counts' dash
// patterns when there are several.
void WriteLegend(std::ostream& os, const Chart& c) {
  const double lx = Chart::left + static_cast<double>(c.panels) * Chart::plot_w +
                    static_cast<double>(c.panels - 1) * Chart::gap + 30;
  double ly = Chart::top + 10;
  os << "<text x=\"" << Num(lx) << "\" y=\"" << Num(ly) << "\" font-weight=\"bold\">"
     << "block size</text>\n";
  for (uint64_t bs : c.block_sizes) {
    ly += 20;
    os << "<line x1=\"" << Num(lx) << "\" y1=\"" << Num(ly - 4) << "\" x2=\"" << Num(lx + 28)
       << "\" y2=\"" << Num(ly - 4) << "\" stroke=\"" << c.Color(bs) << "\" stroke-width=\"3\"/>\n";
    os << "<text x=\"" << Num(lx + 36) << "\" y=\"" << Num(ly) << "\">"
       << XmlEscape(FormatBytes(bs)) << "</text>\n";
  }
  if (c.thread_counts.size() <= 1) return;
  ly += 30;
  os << "<text x=\"" << Num(lx) << "\" y=\"" << Num(ly) << "\" font-weight=\"bold\">"
     << "threads</text>\n";
  for (int t : c.thread_counts) {
    ly += 20;
    const char* dash = c.Dash(t);
    os << "<line x1=\"" << Num(lx) << "\" y1=\"" << Num(ly - 4) << "\" x2=\"" << Num(lx + 28)
       << "\" y2=\"" << Num(ly - 4) << "\" stroke=\"#333\" stroke-width=\"2\"";
    if (*dash) os << " stroke-dasharray=\"" << dash << "\"";
    os << "/>\n";
    os << "<text x=\"" << Num(lx + 36) << "\" y=\"" << Num(ly) << "\">" << XmlEscape(ThreadsText(t))
       << "</text>\n";
  }
}

}  // namespace

// The title, a panel per mode (its frame, then its series), the legend.
std::string RenderSvg(const SweepResult& r) {
  const Chart c = Chart::Of(r);
  std::ostringstream os;
  WriteSvgTitle(os, c, r);
  for (size_t pi = 0; pi < c.panels; ++pi) {
    const double x0 = Chart::left + static_cast<double>(pi) * (Chart::plot_w + Chart::gap);
    const std::string mode =
        c.modes.empty() ? std::string("no data") : std::string(swap::IoOpName(c.modes[pi]));
    os << "<g>\n";
    WritePanelFrame(os, c, x0, mode);
    if (!c.modes.empty()) WritePanelSeries(os, c, r, c.modes[pi], x0);
    os << "</g>\n";
  }
  WriteLegend(os, c);
  os << "</svg>\n";
  return os.str();
}

}  // namespace strata::nvme_bench

// strata.nvme_bench's native part: runs tools/nvme_bench's sweep (strata_nvme_bench) and
// returns the measurements as Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "errors.h"
#include "strata/tools/nvme_bench/report.h"
#include "strata/tools/nvme_bench/sweep.h"

namespace py = pybind11;
namespace nb = strata::nvme_bench;

namespace strata_py {

namespace {

py::dict PointDict(const nb::PointResult& r, const std::string& memory) {
  py::dict d;
  d["mode"] = std::string(strata::swap::IoOpName(r.point.mode));
  d["block_size"] = r.point.block_size;
  d["queue_depth"] = r.point.queue_depth;
  d["threads"] = r.point.threads;
  d["memory"] = memory;
  d["gbps"] = r.gbps();
  d["gibps"] = r.gibps();
  d["bytes_per_second"] = r.bytes_per_second;
  d["iops"] = r.iops;
  d["p50_us"] = r.p50_us;
  d["p99_us"] = r.p99_us;
  d["mean_us"] = r.mean_us;
  d["max_us"] = r.max_us;
  d["requests"] = r.requests;
  d["bytes"] = r.bytes;
  d["seconds"] = r.seconds;
  d["fixed_buffers"] = r.fixed_buffers;
  return d;
}

py::dict RunBench(const std::vector<std::string>& paths, std::optional<uint64_t> size,
                  std::optional<std::vector<uint64_t>> block_sizes,
                  std::optional<std::vector<int>> queue_depths,
                  std::optional<std::vector<int>> threads,
                  std::optional<std::vector<std::string>> modes, bool direct,
                  const std::string& memory, const std::string& engine,
                  std::optional<double> seconds, std::optional<int> rounds, bool quick) {
  nb::SweepOptions o = quick ? nb::SweepOptions::Quick() : nb::SweepOptions();
  o.paths = paths;
  if (size) o.size = *size;
  if (block_sizes) o.block_sizes = *block_sizes;
  if (queue_depths) o.queue_depths = *queue_depths;
  if (threads) o.threads = *threads;
  if (modes) {
    o.modes.clear();
    for (const std::string& mode : *modes) {
      for (strata::swap::IoOp op :
           ValueOrThrow(nb::ParseModeList(mode, "strata.nvme_bench: modes")))
        o.modes.push_back(op);
    }
  }
  o.direct = direct;
  o.memory = ValueOrThrow(nb::ParseMemoryKind(memory));
  o.engine = ValueOrThrow(strata::swap::ParseIoEngineKind(engine));
  if (seconds) o.seconds = *seconds;
  if (rounds) o.rounds = *rounds;
  Check(o.Validate());

  nb::SweepResult result;
  strata::Status status;
  {
    py::gil_scoped_release release;
    strata::Result<nb::SweepResult> r = nb::RunSweep(o);
    if (r.ok()) {
      result = std::move(r).value();
    } else {
      status = r.status();
    }
  }
  Check(status);
  const std::string mem(nb::MemoryKindName(result.options.memory));
  nb::BestSettings best = nb::ChooseBest(result.points);

  py::dict out;
  py::list points;
  for (const nb::PointResult& p : result.points)
    points.append(PointDict(p, mem));
  out["points"] = points;
  out["best_read"] = best.read ? py::object(PointDict(*best.read, mem)) : py::object(py::none());
  out["best_write"] = best.write ? py::object(PointDict(*best.write, mem)) : py::object(py::none());
  if (best.chosen) {
    py::dict c;
    c["block_size"] = best.chosen->block_size;
    c["queue_depth"] = best.chosen->queue_depth;
    c["threads"] = best.chosen->threads;
    c["read_gbps"] = best.chosen_read_bytes_per_second / 1e9;
    c["write_gbps"] = best.chosen_write_bytes_per_second / 1e9;
    out["chosen"] = c;
  } else {
    out["chosen"] = py::none();
  }
  out["config_json"] = nb::ConfigSnippet(best).dump();
  out["report_json"] = nb::ToJson(result).dump();
  out["report"] = nb::FormatReport(result);
  out["paths"] = result.options.paths;
  out["filesystems"] = result.filesystems;
  out["bytes_per_file"] = result.bytes_per_file;
  out["direct"] = result.options.direct;
  out["memory"] = mem;
  out["memory_obtained"] = result.memory_obtained;
  out["memory_fallback"] = result.memory_fallback;
  out["memory_pinned"] = result.memory_pinned;
  out["engine"] = result.engine;
  out["engine_fallback"] = result.engine_fallback;
  out["notes"] = result.notes;
  return out;
}

}  // namespace

void BindNvmeBench(py::module_& m) {
  m.def("nvme_bench", &RunBench, py::arg("paths"), py::arg("size"), py::arg("block_sizes"),
        py::arg("queue_depths"), py::arg("threads"), py::arg("modes"), py::arg("direct"),
        py::arg("memory"), py::arg("engine"), py::arg("seconds"), py::arg("rounds"),
        py::arg("quick"), "Runs nvme_bench's sweep; see strata.nvme_bench.");
}

}  // namespace strata_py

// _strata: the compiled part of the `strata` Python package (docs/python.md): the
// configuration model, byte sizes and the topology here; the error mapping (errors.cc),
// CPU-Adam (optim.cc), the aio handle and aligned buffers (io.cc), nvme_bench (bench.cc)
// and EngineCore (engine.cc) in their files.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "errors.h"
#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/memory_limit.h"
#include "strata/core/throughput.h"
#include "strata/core/topology.h"
#include "strata_generated/version.h"

namespace py = pybind11;

using strata_py::ValueOrThrow;

PYBIND11_MODULE(_strata, m) {
  m.doc() = "Strata native module";
  m.attr("__version__") = STRATA_VERSION_STRING;
  strata_py::BindErrors(m);
  strata_py::BindOptim(m);
  strata_py::BindIo(m);
  strata_py::BindNvmeBench(m);
  strata_py::BindEngine(m);

  m.def(
      "validate_config",
      [](const std::string& text, int world_size) {
        strata::ValidationResult r = strata::ValidateConfigJson(text, {.world_size = world_size});
        py::list errors;
        for (const strata::ConfigError& e : r.errors)
          errors.append(e.ToString());
        return py::make_tuple(r.ok() ? py::str(r.normalized.dump()) : py::str(""), errors);
      },
      py::arg("text"), py::arg("world_size") = 1,
      "Validates a JSON config; returns (normalized JSON text, list of error strings).");
  m.def(
      "config_reference_markdown", [] { return strata::ConfigReferenceMarkdown(); },
      "The text of docs/config.md.");
  m.def(
      "parse_bytes", [](const std::string& s) { return ValueOrThrow(strata::ParseBytes(s)); },
      py::arg("text"), "Parses a byte size such as '512MiB', '1.5G' or '1e9'.");
  m.def("format_bytes", &strata::FormatBytes, py::arg("bytes"),
        "Formats a byte count as '1.5 GiB'.");
  m.def("trim_heap", &strata::TrimHeap,
        "Hands the malloc heap's free memory back to the system (glibc's malloc_trim); "
        "whether any was given back.");
  m.def(
      "topology", [] { return ValueOrThrow(strata::Topology::Discover()).ToString(); },
      "NUMA nodes, cores, memory and PCI devices, as `strata-config topology` prints them.");
  // Model FLOPs and throughput (core/throughput.h): the definition strata-train uses.
  m.def("training_flops_per_token", &strata::TrainingFlopsPerToken, py::arg("params"),
        py::arg("n_layers"), py::arg("seq_len"), py::arg("d_model"),
        "FLOPs to train on one token of a GPT-style decoder: 6 x params + 12 x n_layers x "
        "seq_len x d_model.");
  m.def(
      "throughput",
      [](double flops_per_token, double tokens, double seconds, int ranks, double peak) {
        const strata::Throughput t =
            strata::ComputeThroughput(flops_per_token, tokens, seconds, ranks, peak);
        py::dict d;
        d["tokens_per_s"] = t.tokens_per_s;
        d["flops_per_s"] = t.flops_per_s;
        d["tflops"] = t.tflops;
        d["mfu"] = t.mfu;
        return d;
      },
      py::arg("flops_per_token"), py::arg("tokens"), py::arg("seconds"), py::arg("ranks") = 1,
      py::arg("peak_flops_per_rank") = 0.0,
      "Tokens/s, model FLOP/s, TFLOPS and MFU (0 without a peak) of `tokens` trained in "
      "`seconds` by `ranks` ranks.");
  m.def(
      "datasheet_peak_flops",
      [](const std::string& device_name, const std::string& dtype) -> py::object {
        const std::optional<strata::DatasheetPeak> p =
            strata::DatasheetPeakFlops(device_name, dtype);
        if (!p) return py::none();
        return py::make_tuple(p->flops_per_s, p->source);
      },
      py::arg("device_name"), py::arg("dtype"),
      "A GPU's dense peak FLOP/s from its datasheet and the source, by the name CUDA reports "
      "and the dtype ('bf16', 'fp16', 'fp32'); None when unknown.");
}

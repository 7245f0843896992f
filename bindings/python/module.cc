// _strata: the compiled part of the `strata` Python package. The engine, CPU-Adam and
// swap I/O bindings come with their issues; this module exposes the configuration
// model, byte sizes and the topology.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/topology.h"
#include "strata_generated/version.h"

namespace py = pybind11;

namespace {

// Errors cross into Python as exceptions carrying the same message.
template <typename T>
T ValueOrThrow(strata::Result<T> r) {
  if (r.ok()) return std::move(r).value();
  if (r.status().code() == strata::StatusCode::kInvalidArgument ||
      r.status().code() == strata::StatusCode::kOutOfRange) {
    throw py::value_error(r.status().message());
  }
  throw std::runtime_error(r.status().ToString());
}

}  // namespace

PYBIND11_MODULE(_strata, m) {
  m.doc() = "Strata native module";
  m.attr("__version__") = STRATA_VERSION_STRING;

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
  m.def(
      "topology", [] { return ValueOrThrow(strata::Topology::Discover()).ToString(); },
      "NUMA nodes, cores, memory and PCI devices, as `strata-config topology` prints them.");
}

// strata-config: validate configuration files, print the key table and the topology.
//
//   strata-config validate FILE [--world-size N]   normalized config, or every error
//   strata-config defaults [--markdown]            the key table (docs/config.md with --markdown)
//   strata-config topology                         NUMA nodes, cores, GPUs and NVMe (hwloc)
//
// Exit codes: 0 success, 2 invalid configuration or usage, 1 anything else.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/topology.h"
#include "strata_generated/version.h"

namespace po = boost::program_options;

namespace {

constexpr int kOk = 0;
constexpr int kFailure = 1;
constexpr int kInvalid = 2;

const char* kUsage =
    "usage: strata-config <command> [options]\n"
    "\n"
    "commands:\n"
    "  validate FILE [--world-size N]  check a DeepSpeed-style JSON config; print it with every\n"
    "                                  default filled in, or every error (exit 2)\n"
    "  defaults [--markdown]           print every key with its type, default and range\n"
    "                                  (--markdown: the text of docs/config.md)\n"
    "  topology                        print NUMA nodes, cores, memory, GPUs and NVMe drives\n"
    "  --version                       print the version\n";

int UsageError(const std::string& message) {
  std::cerr << "strata-config: " << message << "\n\n" << kUsage;
  return kInvalid;
}

// Parses the options of one command; returns false (after printing) on a usage error.
bool ParseCommand(const std::vector<std::string>& args, po::options_description& desc,
                  po::positional_options_description& pos, po::variables_map& vm, int& rc) {
  try {
    po::store(po::command_line_parser(args).options(desc).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    rc = UsageError(e.what());
    return false;
  }
  if (vm.count("help")) {
    std::cout << kUsage << "\n" << desc;
    rc = kOk;
    return false;
  }
  return true;
}

int Validate(const std::vector<std::string>& args) {
  po::options_description desc("validate options");
  int world_size = 1;
  desc.add_options()("help,h", "show help")(
      "world-size", po::value<int>(&world_size)->default_value(1),
      "number of ranks, for train_batch_size = micro batch x accumulation x world size")(
      "file", po::value<std::string>(), "the JSON config");
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  int rc = kOk;
  if (!ParseCommand(args, desc, pos, vm, rc)) return rc;
  if (!vm.count("file")) return UsageError("validate: give the config FILE to check");
  if (world_size < 1) return UsageError("--world-size must be at least 1");
  const std::string file = vm["file"].as<std::string>();
  strata::ValidationResult r = strata::ValidateConfigFile(file, {.world_size = world_size});
  if (!r.ok()) {
    std::cerr << file << ": " << r.errors.size() << " error" << (r.errors.size() == 1 ? "" : "s")
              << ":\n";
    for (const strata::ConfigError& e : r.errors)
      std::cerr << "  " << e.ToString() << "\n";
    return kInvalid;
  }
  std::cout << r.normalized.dump(2) << "\n";
  return kOk;
}

int Defaults(const std::vector<std::string>& args) {
  po::options_description desc("defaults options");
  desc.add_options()("help,h", "show help")("markdown", "print docs/config.md");
  po::positional_options_description pos;
  po::variables_map vm;
  int rc = kOk;
  if (!ParseCommand(args, desc, pos, vm, rc)) return rc;
  if (vm.count("markdown")) {
    std::cout << strata::ConfigReferenceMarkdown();
  } else {
    std::cout << strata::ConfigKeysText();
  }
  return kOk;
}

int Topology(const std::vector<std::string>& args) {
  po::options_description desc("topology options");
  desc.add_options()("help,h", "show help");
  po::positional_options_description pos;
  po::variables_map vm;
  int rc = kOk;
  if (!ParseCommand(args, desc, pos, vm, rc)) return rc;
  auto topo = strata::Topology::Discover();
  if (!topo.ok()) {
    std::cerr << "strata-config: " << topo.status() << "\n";
    return kFailure;
  }
  std::cout << topo->ToString();
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return UsageError("no command given");
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "validate") return Validate(args);
  if (command == "defaults") return Defaults(args);
  if (command == "topology") return Topology(args);
  if (command == "--version" || command == "version") {
    std::cout << "strata-config " << STRATA_VERSION_STRING << "\n";
    return kOk;
  }
  if (command == "-h" || command == "--help" || command == "help") {
    std::cout << kUsage;
    return kOk;
  }
  return UsageError("unknown command \"" + command + "\"");
}

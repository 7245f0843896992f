// strata-config: validate configuration files, print the key table and the topology.
//
//   strata-config validate FILE [--world-size N]   normalized config, or every error
//   strata-config defaults [--markdown]            the key table (docs/config.md with --markdown)
//   strata-config topology                         NUMA nodes, cores, GPUs and NVMe (hwloc)
//   strata-config plan FILE --params N [...]       where each state lives, what it costs,
//                                                  and whether this machine holds it
//
// Exit codes: 0 success, 2 invalid configuration or usage, 1 anything else.
#include <boost/program_options.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/model_shapes.h"
#include "strata/core/planner.h"
#include "strata/core/topology.h"
#include "strata/optim/cpu_adam/cpu_adam.h"
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
    "  plan FILE (--params N [--largest-group N] [--frozen-params N] | --model NAME)\n"
    "       [--world-size W]\n"
    "       [--ranks-per-node R] [--nvme-bench FILE.json] [--adam-rate R]\n"
    "       [--no-check | --suggest]\n"
    "                                  per rank: where each state lives, host bytes (pinned\n"
    "                                  and not), swap bytes per nvme_path, buffers, a step-time\n"
    "                                  bound; then checks the host memory this process may use\n"
    "                                  (MemAvailable, its cgroup's limit, RLIMIT_AS/DATA,\n"
    "                                  strata.host_budget; less strata.memory_reserve), after\n"
    "                                  lowering the keys left out as the engine does at start,\n"
    "                                  RLIMIT_MEMLOCK, free disk and the device budget (exit 2\n"
    "                                  when it does not fit)\n"
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

// Parses a command whose one positional argument is the config FILE; false (after printing)
// on a usage error or a missing FILE (`missing`: the message then).
bool ParseFileCommand(const std::vector<std::string>& args, po::options_description& desc,
                      const char* missing, std::string& file, po::variables_map& vm, int& rc) {
  desc.add_options()("file", po::value<std::string>(), "the JSON config");
  po::positional_options_description pos;
  pos.add("file", 1);
  if (!ParseCommand(args, desc, pos, vm, rc)) return false;
  if (!vm.count("file")) {
    rc = UsageError(missing);
    return false;
  }
  file = vm["file"].as<std::string>();
  return true;
}

int Validate(const std::vector<std::string>& args) {
  po::options_description desc("validate options");
  int world_size = 1;
  desc.add_options()("help,h", "show help")(
      "world-size", po::value<int>(&world_size)->default_value(1),
      "number of ranks, for train_batch_size = micro batch x accumulation x world size");
  po::variables_map vm;
  std::string file;
  int rc = kOk;
  if (!ParseFileCommand(args, desc, "validate: give the config FILE to check", file, vm, rc)) {
    return rc;
  }
  if (world_size < 1) return UsageError("--world-size must be at least 1");
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

// A count such as 7e9, 7000000000 or "7G" is not a byte size: numbers, with an optional
// exponent (JSON-style), are what --params and --largest-group take.
bool ParseCount(const std::string& text, uint64_t* out) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used != text.size() || !(v >= 1) || v > 1e18) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// The engine's start against this process: the keys the file leaves out lowered to the room
// as the engine lowers them (FitToMemory: printed, with the plan they give), then the check.
int CheckAsTheEngine(strata::Config& config, strata::PlanInput in, strata::Plan& plan) {
  strata::Result<strata::MachineFacts> machine = strata::ReadMachineFacts(plan);
  if (!machine.ok()) {
    std::cerr << "strata-config: " << machine.status() << "\n";
    return kFailure;
  }
  // strata.device cpu: the device's memory is the host's (auto: a GPU is assumed).
  in.device_on_host = config.strata.device == strata::ComputeDevice::kCpu;
  strata::Result<strata::Plan> fitted = strata::MakePlan(config, in);
  std::string limit;
  const uint64_t room = fitted.ok() ? strata::PlanRoom(*fitted, config, *machine, limit) : 0;
  if (fitted.ok() && fitted->memory_bytes() > room) {
    strata::Result<std::vector<strata::SizedKey>> keys =
        strata::FitToMemory(config, in, room, limit);
    if (!keys.ok()) {
      std::cerr << "strata-config: sizing to the memory: " << keys.status() << "\n";
      return kInvalid;
    }
    if (!keys->empty()) {
      std::cout << "\nas the engine sizes it to this process's memory at start:\n";
      for (const strata::SizedKey& k : *keys)
        std::cout << "sized to the memory: " << k.ToString() << "\n";
      fitted = strata::MakePlan(config, in);
      if (fitted.ok()) std::cout << fitted->ToString();
    }
  }
  if (!fitted.ok()) {
    std::cerr << "strata-config: " << fitted.status() << "\n";
    return kInvalid;
  }
  plan = *fitted;
  strata::Status fits = strata::CheckPlan(plan, config, *machine);
  if (!fits.ok()) {
    std::cerr << fits.message() << "\n";
    return kInvalid;
  }
  std::cout << "fits this process: " << strata::DescribeHostRoom(plan, config, *machine) << "\n";
  return kOk;
}

int Plan(const std::vector<std::string>& args) {
  po::options_description desc("plan options");
  int world_size = 1;
  int ranks_per_node = 0;
  std::string params_text, largest_text, frozen_text, bench_file, model;
  double adam_rate = 0.0;
  desc.add_options()("help,h", "show help")("params", po::value<std::string>(&params_text),
                                            "model parameters, e.g. 7e9 (this or --model)")(
      "model", po::value<std::string>(&model),
      ("a strata-train preset (" + strata::ModelPresetNames() +
       "): its parameter count and largest group")
          .c_str())("world-size", po::value<int>(&world_size)->default_value(1), "number of ranks")(
      "ranks-per-node", po::value<int>(&ranks_per_node)->default_value(0),
      "ranks sharing this machine's memory and drives (default: all of them)")(
      "largest-group", po::value<std::string>(&largest_text),
      "elements of the largest wrapped module (default: the whole model, an upper bound)")(
      "frozen-params", po::value<std::string>(&frozen_text),
      "of the parameters, those frozen (requires_grad false, e.g. a LoRA model's base): no "
      "optimizer state")("nvme-bench", po::value<std::string>(&bench_file),
                         "nvme_bench --json output: its chosen read and write bandwidth")(
      "adam-rate", po::value<double>(&adam_rate),
      "CPU-Adam parameters per second on one rank, for the step bound (default: measured "
      "here, a fraction of a second, with the cores shared among the node's ranks)")(
      "no-check", "print the plan without checking this machine")(
      "suggest",
      "print the cheapest placement that fits this process (host first, then NVMe for the "
      "optimizer, then the parameters; in each, sub_group_size, reduce_bucket_size and then "
      "the NVMe buffer counts lowered first until the host memory holds it) and the config "
      "snippet that sets it");
  po::variables_map vm;
  std::string file;
  int rc = kOk;
  if (!ParseFileCommand(args, desc, "plan: give the config FILE", file, vm, rc)) return rc;
  if (world_size < 1) return UsageError("--world-size must be at least 1");
  strata::PlanInput in;
  in.world_size = world_size;
  if (ranks_per_node < 0) return UsageError("--ranks-per-node must not be negative");
  in.ranks_per_node = ranks_per_node;
  if (!model.empty()) {
    const strata::ModelPreset* preset = strata::FindModelPreset(model);
    if (preset == nullptr) {
      return UsageError("--model " + model + ": unknown preset (one of " +
                        strata::ModelPresetNames() + ")");
    }
    if (!params_text.empty() || !largest_text.empty()) {
      return UsageError("--model " + model +
                        " sets the parameter count and largest group: drop --params and "
                        "--largest-group");
    }
    in.params = static_cast<uint64_t>(preset->shape.TotalParams());
    in.largest_group = static_cast<uint64_t>(preset->shape.LargestGroupParams());
    std::cout << "model " << preset->name << ": " << preset->shape.ToString() << "\n";
  } else if (params_text.empty()) {
    return UsageError("plan: --params N or --model NAME is required (e.g. --params 7e9)");
  } else if (!ParseCount(params_text, &in.params)) {
    return UsageError("--params '" + params_text + "' is not a positive count (e.g. 7e9)");
  }
  if (!largest_text.empty() && !ParseCount(largest_text, &in.largest_group)) {
    return UsageError("--largest-group '" + largest_text + "' is not a positive count");
  }
  if (!frozen_text.empty() &&
      (!ParseCount(frozen_text, &in.frozen_params) || in.frozen_params >= in.params)) {
    return UsageError("--frozen-params '" + frozen_text +
                      "' is not a positive count below the parameter count");
  }
  if (vm.count("adam-rate")) {
    if (!(adam_rate > 0)) return UsageError("--adam-rate must be positive");
    in.adam_rate = adam_rate;
    in.adam_rate_source = "given";
  }
  if (!bench_file.empty()) {
    std::ifstream f(bench_file);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    strata::Result<strata::MeasuredBandwidth> bw =
        f ? strata::ParseNvmeBenchJson(text) : strata::NotFoundError("cannot be read");
    if (!bw.ok()) {
      std::cerr << "strata-config: " << bench_file << ": not nvme_bench --json output with "
                << "best.chosen.read_gbps and write_gbps (" << bw.status().message() << ")\n";
      return kInvalid;
    }
    in.nvme_read_bandwidth = bw->read;
    in.nvme_write_bandwidth = bw->write;
  }
  strata::Result<strata::Config> config = strata::LoadConfigFile(file, {.world_size = world_size});
  if (!config.ok()) {
    std::cerr << file << ": " << config.status() << "\n";
    return kInvalid;
  }
  if (in.adam_rate == 0) {
    strata::Status measured = strata::MeasureAdamRateForPlan(*config, in);
    if (!measured.ok()) {
      std::cerr << "strata-config: measuring CPU-Adam: " << measured << "\n";
      return kFailure;
    }
  }
  strata::Result<strata::Plan> plan = strata::MakePlan(*config, in);
  if (!plan.ok()) {
    std::cerr << "strata-config: " << plan.status() << "\n";
    return kInvalid;
  }
  std::cout << plan->ToString();
  if (vm.count("suggest")) {
    std::vector<std::string> paths = config->zero.offload_optimizer.nvme_path;
    for (const std::string& p : config->zero.offload_param.nvme_path)
      paths.push_back(p);
    strata::Result<strata::MachineFacts> machine = strata::ReadMachineFacts(paths);
    if (!machine.ok()) {
      std::cerr << "strata-config: " << machine.status() << "\n";
      return kFailure;
    }
    strata::Result<strata::Suggestion> s = strata::SuggestPlan(*config, in, *machine);
    if (!s.ok()) {
      std::cerr << s.status().message() << "\n";
      return kInvalid;
    }
    std::cout << "\nsuggested placement (the cheapest that fits this process):\n"
              << s->plan.ToString() << s->lowered << s->snippet << "\n"
              << "fits this process: " << strata::DescribeHostRoom(s->plan, s->config, *machine)
              << "\n";
    return kOk;
  }
  if (vm.count("no-check")) return kOk;
  return CheckAsTheEngine(*config, in, *plan);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return UsageError("no command given");
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "validate") return Validate(args);
  if (command == "defaults") return Defaults(args);
  if (command == "topology") return Topology(args);
  if (command == "plan") return Plan(args);
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

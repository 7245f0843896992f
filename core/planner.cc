#include "strata/core/planner.h"

#include <sys/resource.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "strata/core/bytes.h"

namespace strata {

namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}
// Swap slots are whole 4 KiB blocks (O_DIRECT).
uint64_t Blocks(uint64_t bytes) {
  return AlignUp(bytes, 4096);
}

// Adds `bytes` spread evenly over `paths` (SwapSpace stripes blocks across them).
void AddSwap(Plan& plan, const std::vector<std::string>& paths, uint64_t bytes) {
  if (paths.empty() || bytes == 0) return;
  const uint64_t each = CeilDiv(bytes, paths.size());
  for (const std::string& p : paths) {
    auto it = std::find_if(plan.nvme_bytes.begin(), plan.nvme_bytes.end(),
                           [&](const auto& e) { return e.first == p; });
    if (it == plan.nvme_bytes.end()) {
      plan.nvme_bytes.emplace_back(p, each);
    } else {
      it->second += each;
    }
  }
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f s", s);
  return buf;
}

}  // namespace

const char* PlanTierName(PlanTier t) {
  switch (t) {
    case PlanTier::kDevice:
      return "device";
    case PlanTier::kHost:
      return "host";
    case PlanTier::kNvme:
      return "nvme";
  }
  return "?";
}

int RanksPerNode(const PlanInput& in) {
  return in.ranks_per_node > 0 ? std::min(in.ranks_per_node, in.world_size) : in.world_size;
}

Result<Plan> MakePlan(const Config& config, const PlanInput& in) {
  if (in.params == 0) return InvalidArgumentError("plan: the parameter count must be at least 1");
  if (in.world_size < 1) return InvalidArgumentError("plan: the world size must be at least 1");
  if (in.frozen_params > in.params) {
    return InvalidArgumentError("plan: " + std::to_string(in.frozen_params) +
                                " frozen parameters of " + std::to_string(in.params));
  }
  if (config.zero.stage < 1 || config.zero.stage > 3) {
    return InvalidArgumentError(
        "plan: zero_optimization.stage = " + std::to_string(config.zero.stage) +
        ": Strata plans stages 1, 2 and 3 (the ones it runs)");
  }
  Plan p;
  p.stage = config.zero.stage;
  p.params = in.params;
  p.world_size = in.world_size;
  p.ranks_per_node = RanksPerNode(in);
  const uint64_t w = static_cast<uint64_t>(in.world_size);
  const uint64_t n = CeilDiv(in.params, w);
  p.rank_elems = n;
  // The optimizer's states cover the trainable parameters only.
  const uint64_t nt = CeilDiv(in.params - in.frozen_params, w);
  p.frozen_params = in.frozen_params;
  p.trainable_rank_elems = nt;
  p.largest_group_known = in.largest_group > 0;
  const uint64_t wbytes = (config.bf16 || config.fp16.enabled) ? 2 : 4;
  p.dtype = config.bf16 ? "bf16" : config.fp16.enabled ? "fp16" : "fp32";
  const uint64_t largest = std::min(in.params, in.largest_group > 0 ? in.largest_group : in.params);
  const uint64_t largest_shard = CeilDiv(largest, w);
  // One host pool holds everything on the host tier: page-locked when some section that
  // uses it asks (pin_memory) or when the device's working shards need a pinned mirror.
  const OffloadConfig& opt = config.zero.offload_optimizer;
  const OffloadConfig& par = config.zero.offload_param;
  const bool pinned = par.device == OffloadDevice::kNone ||
                      (opt.device != OffloadDevice::kNone && opt.pin_memory) ||
                      (par.device != OffloadDevice::kNone && par.pin_memory);
  uint64_t host_bytes = 0;
  auto host = [&](uint64_t bytes) { host_bytes += bytes; };

  // The fp32 optimizer states and the gradient accumulators go together, but for the
  // accumulators CPU-Adam reads from the device's sums (EngineCore::MakeDeviceSums: the
  // micro-steps summed on the device and no step variant reading them during a backward;
  // if the device budget then cannot hold the sums, they are added back below).
  const PlanTier opt_tier = opt.device == OffloadDevice::kNvme  ? PlanTier::kNvme
                            : opt.device == OffloadDevice::kCpu ? PlanTier::kHost
                                                                : PlanTier::kDevice;
  const bool sums_planned = opt_tier != PlanTier::kDevice &&
                            config.gradient_accumulation_steps > 1 &&
                            config.strata.accumulate_on_device && !config.strata.early_step &&
                            !config.strata.delayed_update && nt > 0;
  const uint64_t sub =
      std::min<uint64_t>(std::max<uint64_t>(1, nt),
                         static_cast<uint64_t>(std::max<int64_t>(1, config.zero.sub_group_size)));
  // The accumulators on the optimizer's tier (`nstates` 1) or the other states (3).
  auto add_states = [&](uint64_t nstates) {
    const uint64_t bytes = 4 * nstates * nt;
    if (opt_tier == PlanTier::kDevice) p.device_bytes += bytes;
    if (opt_tier == PlanTier::kHost) host(bytes);
    if (opt_tier == PlanTier::kNvme) {
      AddSwap(p, opt.nvme_path, 2 * nstates * CeilDiv(nt, sub) * Blocks(4 * sub));
      p.nvme_read_bytes += bytes;  // the step reads each once
    }
  };
  for (const char* s : {"fp32 master", "Adam m", "Adam v"})
    p.rows.push_back({s, opt_tier, 4 * nt});
  if (!sums_planned) p.rows.push_back({"gradient accumulators", opt_tier, 4 * nt});
  add_states(sums_planned ? 3 : 4);
  if (opt_tier == PlanTier::kNvme) {
    p.optimizer_buffers = opt.buffer_count;
    p.optimizer_buffer_bytes = Blocks(4 * sub);
    host(static_cast<uint64_t>(opt.buffer_count) * p.optimizer_buffer_bytes);
    // A step writes master, m and v (the accumulators below).
    p.nvme_write_bytes += 12 * nt;
  }

  // The working shards.
  const PlanTier par_tier = par.device == OffloadDevice::kNvme  ? PlanTier::kNvme
                            : par.device == OffloadDevice::kCpu ? PlanTier::kHost
                                                                : PlanTier::kDevice;
  const uint64_t shards = wbytes * n;
  const std::string shard_row = "working shards (" + p.dtype + ")";
  if (par_tier != PlanTier::kNvme) p.rows.push_back({shard_row, par_tier, shards});
  if (par_tier == PlanTier::kDevice) {
    p.device_bytes += shards;
    host(shards);  // the pinned host mirror the optimizer writes
  }
  if (par_tier == PlanTier::kHost) host(shards);
  if (par_tier == PlanTier::kNvme) {
    // max_in_cpu: the leading groups' shards stay in host memory.
    const uint64_t in_cpu =
        std::min<uint64_t>(in.params, static_cast<uint64_t>(std::max<int64_t>(0, par.max_in_cpu)));
    const uint64_t host_shards = std::min(shards, wbytes * CeilDiv(in_cpu, w));
    host(host_shards);
    p.param_buffers = par.buffer_count;
    p.param_buffer_bytes = Blocks(wbytes * largest_shard);
    host(static_cast<uint64_t>(par.buffer_count) * p.param_buffer_bytes);
    if (config.strata.pipeline_step && config.optimizer.type != OptimizerType::kLamb) {
      // The pipelined step stages new shards in two host buffers (more only while a
      // sub-group spans more groups than that), each the size of the store's buffers (one
      // is exchanged for the other at the hand-over).
      p.param_staging_buffers = 2;
      p.param_staging_bytes = p.param_buffer_bytes;
      host(2 * p.param_staging_bytes);
    }
    const uint64_t on_nvme = shards - host_shards;
    p.rows.push_back({shard_row, PlanTier::kNvme, on_nvme});
    if (host_shards > 0)
      p.rows.push_back({shard_row + ", max_in_cpu", PlanTier::kHost, host_shards});
    AddSwap(p, par.nvme_path, 2 * on_nvme);
    // Read in the forward and again in the backward (at most), written after the step.
    p.nvme_read_bytes += 2 * on_nvme;
    p.nvme_write_bytes += on_nvme;
  }

  // The device: two of the largest groups gathered (stages 1 and 2: every parameter, kept
  // gathered), and the gradient buckets as the engine sizes them (engine/reduce/reducer.h):
  // reduce_bucket_size elements, at least the largest group, at most the trainable
  // parameters; and their park, a sixteenth of a bucket (none for a model of one group).
  const uint64_t bucket = std::min<uint64_t>(
      std::max<uint64_t>(
          static_cast<uint64_t>(std::max<int64_t>(1, config.zero.reduce_bucket_size)), largest),
      in.params - in.frozen_params);
  const uint64_t park = largest < in.params ? bucket / 16 / 16 * 16 : 0;
  const uint64_t buckets = config.zero.overlap_comm ? 2 : 1;
  const uint64_t gathered = config.zero.stage < 3 ? in.params : 2 * largest;
  p.device_working_bytes = gathered * wbytes + (buckets * bucket + park) * wbytes;
  // The micro-steps' gradients summed in device memory (the engine's choice,
  // EngineCore::ChooseAccumulation): fp32 for the optimizer's partition, while the device
  // budget holds them beside the rest (the staging of reduced shards keeps its size: a sum
  // that does not fit goes in a later round).
  const bool offloaded = opt_tier != PlanTier::kDevice;
  bool sums_on_device = false;  // CPU-Adam reads the device's sums (sums_planned, and room)
  if (!offloaded) {
    p.gradient_accumulation = "device (the optimizer's own accumulators)";
  } else if (config.gradient_accumulation_steps <= 1) {
    p.gradient_accumulation = "host (one micro-step per optimizer step: nothing to sum)";
  } else if (!config.strata.accumulate_on_device) {
    p.gradient_accumulation = "host (strata.accumulate_on_device false)";
  } else {
    const uint64_t acc = (4 * nt + 63) / 64 * 64;
    const uint64_t budget = config.strata.device_budget;
    const uint64_t rest = p.device_bytes + p.device_working_bytes;
    if (budget > 0 && rest + acc > budget) {
      p.gradient_accumulation = "host (strata.device_budget " + FormatBytes(budget) +
                                " holds the " + FormatBytes(rest) +
                                " the model needs there but not " + FormatBytes(acc) +
                                " of gradient accumulators beside them)";
    } else {
      p.gradient_accumulation =
          budget > 0 ? "device"
                     : "device (if the device's own budget holds them: on a GPU half its free "
                       "memory, checked at start)";
      p.device_accumulator_bytes = acc;
      p.device_bytes += acc;
      p.rows.push_back({"device gradient accumulators", PlanTier::kDevice, acc});
      if (sums_planned) {
        // CPU-Adam reads them there: pinned buffers of the sub-groups leased at once (the
        // synchronous step one and the next; the pipelined update's worker one, the next
        // and one a group spans into).
        const uint64_t chunks = CeilDiv(nt, sub);
        const bool pipelined =
            config.strata.pipeline_step && config.optimizer.type != OptimizerType::kLamb;
        const uint64_t held = std::min<uint64_t>(chunks, pipelined ? 3 : 2);
        p.grad_sums_buffer_bytes = held * 4 * sub;
        sums_on_device = true;
        p.grad_accumulators = "device (CPU-Adam copies each sub-group's sums to the host)";
        p.rows.push_back(
            {"gradient sums' host buffers", PlanTier::kHost, p.grad_sums_buffer_bytes});
        host(p.grad_sums_buffer_bytes);
      }
    }
  }
  if (sums_planned && !sums_on_device) {
    // The device cannot hold the sums: host accumulators after all.
    p.rows.push_back({"gradient accumulators", opt_tier, 4 * nt});
    add_states(1);
  }
  // Accumulators on NVMe: when the states do not fit the buffers, the backward also writes
  // them out.
  if (!sums_on_device && opt_tier == PlanTier::kNvme &&
      16 * nt > static_cast<uint64_t>(opt.buffer_count) * 4 * sub) {
    p.nvme_write_bytes += 4 * nt;
  }
  if (!offloaded) {
    p.grad_accumulators = "device (the optimizer's tier)";
  } else if (!sums_planned && config.gradient_accumulation_steps > 1 &&
             config.strata.accumulate_on_device &&
             (config.strata.early_step || config.strata.delayed_update)) {
    p.grad_accumulators =
        std::string("host (") +
        (config.strata.early_step ? "strata.early_step" : "strata.delayed_update") +
        " reads them while gradients are added)";
  }
  if (offloaded) host(buckets * CeilDiv(bucket, w) * wbytes);
  (pinned ? p.host_pinned_bytes : p.host_unpinned_bytes) = host_bytes;

  p.read_bandwidth =
      in.nvme_read_bandwidth > 0 ? in.nvme_read_bandwidth : config.strata.nvme_read_bandwidth;
  p.write_bandwidth =
      in.nvme_write_bandwidth > 0 ? in.nvme_write_bandwidth : config.strata.nvme_write_bandwidth;
  if (p.nvme_read_bytes + p.nvme_write_bytes == 0) {
    p.io_s = 0.0;
  } else if (p.read_bandwidth > 0 && p.write_bandwidth > 0) {
    p.io_s = static_cast<double>(p.nvme_read_bytes) / p.read_bandwidth +
             static_cast<double>(p.nvme_write_bytes) / p.write_bandwidth;
  }
  if (in.adam_rate > 0) {
    p.adam_s = static_cast<double>(nt) / in.adam_rate;
    p.adam_rate = in.adam_rate;
    p.adam_rate_source = in.adam_rate_source;
  }
  const bool io_known = p.nvme_read_bytes + p.nvme_write_bytes == 0 || p.io_s > 0;
  if (io_known && p.adam_s > 0) p.step_bound_s = std::max(p.io_s, p.adam_s);
  return p;
}

Result<MeasuredBandwidth> ParseNvmeBenchJson(std::string_view text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("not JSON");
  const nlohmann::json* chosen = nullptr;
  if (j.is_object() && j.contains("best") && j["best"].is_object() &&
      j["best"].contains("chosen") && j["best"]["chosen"].is_object()) {
    chosen = &j["best"]["chosen"];
  }
  if (chosen == nullptr) return InvalidArgumentError("no best.chosen object");
  MeasuredBandwidth m;
  for (const auto& [key, out] :
       {std::pair<const char*, double*>{"read_gbps", &m.read}, {"write_gbps", &m.write}}) {
    if (!chosen->contains(key) || !(*chosen)[key].is_number()) {
      return InvalidArgumentError(std::string("no number best.chosen.") + key);
    }
    const double gbps = (*chosen)[key].get<double>();
    // In bytes/s too: 1e304 GB/s is finite, its bytes/s are not (found by fuzz_nvme_bench_json).
    if (!(gbps > 0) || !std::isfinite(gbps * 1e9)) {
      return InvalidArgumentError(std::string("best.chosen.") + key + " = " +
                                  (*chosen)[key].dump() + " is not a positive bandwidth");
    }
    *out = gbps * 1e9;
  }
  return m;
}

std::string Plan::ToString() const {
  std::ostringstream os;
  os << "plan: " << params << " parameters on " << world_size << " rank(s): " << rank_elems
     << " elements per rank, working dtype " << dtype;
  if (stage != 3) os << ", stage " << stage << " (every parameter kept gathered on the device)";
  if (frozen_params > 0) {
    os << "; " << frozen_params << " frozen (no optimizer state: " << trainable_rank_elems
       << " trainable elements per rank)";
  }
  os << "\n";
  os << "per rank:\n";
  for (const PlanRow& r : rows) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-34s %-7s %s%s\n", r.state.c_str(), PlanTierName(r.tier),
                  FormatBytes(r.bytes).c_str(), r.tier == PlanTier::kNvme ? " (x2 slots)" : "");
    os << line;
  }
  os << "device: " << FormatBytes(device_bytes) << " resident + "
     << FormatBytes(device_working_bytes) << " gathered groups and gradient buckets\n";
  os << "gradient accumulation: " << gradient_accumulation << "\n";
  os << "gradient accumulators CPU-Adam reads: " << grad_accumulators << "\n";
  os << "host: " << FormatBytes(host_bytes()) << " (" << FormatBytes(host_pinned_bytes)
     << " pinned, " << FormatBytes(host_unpinned_bytes) << " not)";
  if (optimizer_buffers > 0) {
    os << "; optimizer NVMe buffers " << optimizer_buffers << " x "
       << FormatBytes(optimizer_buffer_bytes);
  }
  if (param_buffers > 0) {
    os << "; parameter NVMe buffers " << param_buffers << " x " << FormatBytes(param_buffer_bytes);
  }
  if (param_staging_buffers > 0) {
    os << "; staged new parameters " << param_staging_buffers << " x "
       << FormatBytes(param_staging_bytes);
  }
  os << "\n";
  for (const auto& [path, bytes] : nvme_bytes)
    os << "nvme " << path << ": " << FormatBytes(bytes) << "\n";
  if (nvme_read_bytes + nvme_write_bytes > 0) {
    os << "per step: read " << FormatBytes(nvme_read_bytes) << ", write "
       << FormatBytes(nvme_write_bytes) << " on NVMe";
    if (io_s > 0) {
      os << " = " << Seconds(io_s) << " at " << FormatBandwidth(read_bandwidth) << " read, "
         << FormatBandwidth(write_bandwidth) << " write";
    } else {
      os << " (bandwidth unknown: give --nvme-bench or strata.nvme_*_bandwidth)";
    }
    os << "\n";
  }
  if (adam_s > 0) {
    char rate[32];
    std::snprintf(rate, sizeof rate, "%.3g", adam_rate);
    os << "CPU-Adam: " << Seconds(adam_s) << " per step at " << rate << " parameters/s";
    if (!adam_rate_source.empty()) os << " (" << adam_rate_source << ")";
    os << "\n";
  }
  if (!largest_group_known) {
    os << "(largest group unknown: the parameter buffers and gathered groups are sized for "
          "the whole model; give --largest-group)\n";
  }
  if (step_bound_s > 0) {
    os << "step bound: " << Seconds(step_bound_s)
       << " (the larger of NVMe I/O and CPU-Adam; compute not counted)\n";
  }
  return os.str();
}

Result<MachineFacts> ReadMachineFacts(const Plan& plan) {
  std::vector<std::string> paths;
  for (const auto& [path, bytes] : plan.nvme_bytes)
    paths.push_back(path);
  return ReadMachineFacts(paths);
}

Result<MachineFacts> ReadMachineFacts(const std::vector<std::string>& paths) {
  MachineFacts m;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  bool found = false;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") {
      m.host_available_bytes = kib * 1024;
      found = true;
      break;
    }
  }
  if (!found) return UnavailableError("plan: /proc/meminfo has no MemAvailable line");
  struct rlimit rl {};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return ErrnoError(errno, "getrlimit(RLIMIT_MEMLOCK)");
  m.memlock_limit = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(rl.rlim_cur);
  // CAP_IPC_LOCK (bit 14 of the effective set) lifts the limit.
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    if (caps & (uint64_t{1} << 14)) m.memlock_limit = UINT64_MAX;
    break;
  }
  for (const std::string& path : paths) {
    struct statvfs fs {};
    if (statvfs(path.c_str(), &fs) != 0) {
      m.disk_errors[path] = std::strerror(errno);
      continue;
    }
    m.free_disk[path] = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  }
  return m;
}

Status CheckPlan(const Plan& plan, const Config& config, const MachineFacts& machine,
                 const CheckOptions& options) {
  std::vector<std::string> problems;
  const uint64_t host = plan.host_bytes();
  const uint64_t ranks = static_cast<uint64_t>(plan.ranks_per_node);
  if (host * ranks > machine.host_available_bytes) {
    problems.push_back("host memory: the plan needs " + FormatBytes(host * ranks) + " (" +
                       FormatBytes(host) + " per rank x " + std::to_string(ranks) +
                       " ranks on this machine, " + FormatBytes(plan.host_pinned_bytes) +
                       " of each pinned) but the machine has " +
                       FormatBytes(machine.host_available_bytes) +
                       " available (MemAvailable); offload to nvme, or lower buffer_count");
  }
  if (options.host_budget && config.strata.host_budget > 0 && host > config.strata.host_budget) {
    problems.push_back("strata.host_budget = " + FormatBytes(config.strata.host_budget) +
                       " is below the plan's " + FormatBytes(host) +
                       " of host memory per rank; raise it, or offload more to nvme");
  }
  if (plan.host_pinned_bytes > machine.memlock_limit && !config.strata.allow_unpinned) {
    problems.push_back("RLIMIT_MEMLOCK: the plan pins " + FormatBytes(plan.host_pinned_bytes) +
                       " per rank but the limit is " + FormatBytes(machine.memlock_limit) +
                       "; raise the limit (ulimit -l, limits.conf), set pin_memory false, or "
                       "strata.allow_unpinned");
  }
  for (const auto& [path, bytes] : plan.nvme_bytes) {
    if (auto e = machine.disk_errors.find(path); e != machine.disk_errors.end()) {
      if (!options.unusable_paths) continue;
      problems.push_back("nvme_path " + path + ": " + e->second + " (the plan puts " +
                         FormatBytes(bytes) + " of swap there per rank)");
      continue;
    }
    auto f = machine.free_disk.find(path);
    if (f == machine.free_disk.end()) {
      problems.push_back("nvme_path " + path + ": its free space is unknown");
      continue;
    }
    const uint64_t need = bytes * ranks;
    if (need > f->second) {
      problems.push_back("nvme_path " + path + ": the plan needs " + FormatBytes(need) + " (" +
                         FormatBytes(bytes) + " per rank x " + std::to_string(ranks) +
                         " ranks on this machine) but " + FormatBytes(f->second) +
                         " is free; free space, or add nvme_path directories on other drives");
    }
  }
  const uint64_t device = plan.device_bytes + plan.device_working_bytes;
  if (options.device_budget && config.strata.device_budget > 0 &&
      device > config.strata.device_budget) {
    problems.push_back("strata.device_budget = " + FormatBytes(config.strata.device_budget) +
                       " is below the plan's " + FormatBytes(device) + " on the device (" +
                       FormatBytes(plan.device_bytes) + " resident states, " +
                       FormatBytes(plan.device_working_bytes) +
                       " gathered groups and buckets); offload to cpu or nvme");
  }
  if (problems.empty()) return Status::Ok();
  std::string msg = "the plan does not fit this machine:";
  for (const std::string& p : problems)
    msg += "\n  - " + p;
  return InvalidArgumentError(msg);
}

Result<Suggestion> SuggestPlan(const Config& config, const PlanInput& input,
                               const MachineFacts& machine) {
  std::vector<std::string> paths = config.zero.offload_optimizer.nvme_path;
  if (paths.empty()) paths = config.zero.offload_param.nvme_path;
  struct Placement {
    OffloadDevice optimizer, param;
    const char* name;
  };
  const Placement placements[] = {
      {OffloadDevice::kCpu, OffloadDevice::kNone,
       "optimizer in host memory, parameters on the device"},
      {OffloadDevice::kCpu, OffloadDevice::kCpu, "optimizer and parameters in host memory"},
      {OffloadDevice::kNvme, OffloadDevice::kCpu, "optimizer on NVMe, parameters in host memory"},
      {OffloadDevice::kNvme, OffloadDevice::kNvme, "optimizer and parameters on NVMe"},
  };
  std::string tried;
  for (const Placement& pl : placements) {
    const bool nvme = pl.optimizer == OffloadDevice::kNvme || pl.param == OffloadDevice::kNvme;
    if (nvme && paths.empty()) {
      return FailedPreconditionError(
          "plan --suggest: nothing fits without NVMe, and the config names no nvme_path; set "
          "zero_optimization.offload_optimizer.nvme_path to a directory on an NVMe drive:\n" +
          tried);
    }
    Config c = config;
    c.zero.offload_optimizer.device = pl.optimizer;
    c.zero.offload_param.device = pl.param;
    if (pl.optimizer == OffloadDevice::kNvme) {
      c.zero.offload_optimizer.nvme_path = paths;
      // A pipelined step: a read and the previous writes in flight (docs/engine.md).
      c.zero.offload_optimizer.pipeline_read = c.zero.offload_optimizer.pipeline_write = true;
      c.zero.offload_optimizer.buffer_count =
          std::max(c.zero.offload_optimizer.buffer_count, 4 * c.strata.swap_pipeline_depth + 4);
    }
    if (pl.param == OffloadDevice::kNvme) {
      c.zero.offload_param.nvme_path = paths;
      c.zero.offload_param.max_in_cpu = 0;
    }
    STRATA_ASSIGN_OR_RETURN(Plan plan, MakePlan(c, input));
    Status fits = CheckPlan(plan, c, machine);
    if (!fits.ok()) {
      tried += std::string(pl.name) + ": " + fits.message() + "\n";
      continue;
    }
    auto section = [](const OffloadConfig& o, bool optimizer) {
      nlohmann::json j = {{"device", o.device == OffloadDevice::kNvme  ? "nvme"
                                     : o.device == OffloadDevice::kCpu ? "cpu"
                                                                       : "none"}};
      if (o.device == OffloadDevice::kNone) return j;
      j["pin_memory"] = o.pin_memory;
      if (o.device != OffloadDevice::kNvme) return j;
      j["nvme_path"] = o.nvme_path;
      j["buffer_count"] = o.buffer_count;
      if (optimizer) {
        j["pipeline_read"] = o.pipeline_read;
        j["pipeline_write"] = o.pipeline_write;
      } else {
        j["max_in_cpu"] = o.max_in_cpu;
      }
      return j;
    };
    nlohmann::json snippet = {{"zero_optimization",
                               {{"offload_optimizer", section(c.zero.offload_optimizer, true)},
                                {"offload_param", section(c.zero.offload_param, false)}}}};
    return Suggestion{c, std::move(plan), snippet.dump(2), tried};
  }
  return NotFoundError("plan --suggest: no placement fits this machine:\n" + tried);
}

}  // namespace strata

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
#include "strata/core/planner_internal.h"

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

namespace {

// The plan's arithmetic as it goes through MakePlan's phases: what it works from, derived
// once from the config and the input, and the host bytes counted so far (one host pool
// holds everything on the host tier).
struct Planning {
  const Config& config;
  const PlanInput& in;
  const OffloadConfig& opt;  // offload_optimizer
  const OffloadConfig& par;  // offload_param
  uint64_t w = 0;            // the world size
  uint64_t n = 0;            // the rank's elements (of all parameters)
  uint64_t nt = 0;           // of the trainable ones: the optimizer's states cover those only
  uint64_t wbytes = 0;       // bytes of an element of the working dtype
  uint64_t largest = 0;      // elements of the largest group (the whole model if unknown)
  PlanTier opt_tier = PlanTier::kDevice;
  // CPU-Adam reads the accumulators from the device's sums (EngineCore::MakeDeviceSums: the
  // micro-steps summed on the device and no step variant reading them during a backward;
  // if the device budget then cannot hold the sums, they are added back).
  bool sums_planned = false;
  uint64_t sub = 0;  // elements of an optimizer sub-group
  // The gradient buckets: elements of one, and how many.
  uint64_t bucket = 0;
  uint64_t buckets = 0;
  uint64_t host_bytes = 0;

  void Host(uint64_t bytes) { host_bytes += bytes; }
};

PlanTier TierOf(OffloadDevice d) {
  return d == OffloadDevice::kNvme  ? PlanTier::kNvme
         : d == OffloadDevice::kCpu ? PlanTier::kHost
                                    : PlanTier::kDevice;
}

// What MakePlan refuses to plan.
Status CheckPlanInput(const Config& config, const PlanInput& in) {
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
  return Status::Ok();
}

// The plan's header (stage, sizes per rank, dtype) and the quantities the phases share.
Planning StartPlan(const Config& config, const PlanInput& in, Plan& p) {
  Planning s{.config = config,
             .in = in,
             .opt = config.zero.offload_optimizer,
             .par = config.zero.offload_param};
  p.stage = config.zero.stage;
  p.params = in.params;
  p.world_size = in.world_size;
  p.ranks_per_node = RanksPerNode(in);
  s.w = static_cast<uint64_t>(in.world_size);
  s.n = CeilDiv(in.params, s.w);
  p.rank_elems = s.n;
  s.nt = CeilDiv(in.params - in.frozen_params, s.w);
  p.frozen_params = in.frozen_params;
  p.trainable_rank_elems = s.nt;
  p.largest_group_known = in.largest_group > 0;
  s.wbytes = (config.bf16 || config.fp16.enabled) ? 2 : 4;
  p.dtype = config.bf16 ? "bf16" : config.fp16.enabled ? "fp16" : "fp32";
  s.largest = std::min(in.params, in.largest_group > 0 ? in.largest_group : in.params);
  s.opt_tier = TierOf(s.opt.device);
  s.sums_planned = s.opt_tier != PlanTier::kDevice && config.gradient_accumulation_steps > 1 &&
                   config.strata.accumulate_on_device && !config.strata.early_step &&
                   !config.strata.delayed_update && s.nt > 0;
  s.sub =
      std::min<uint64_t>(std::max<uint64_t>(1, s.nt),
                         static_cast<uint64_t>(std::max<int64_t>(1, config.zero.sub_group_size)));
  return s;
}

// `nstates` fp32 states of the trainable shard on the optimizer's tier: the accumulators
// (1) or the other states (3), or all four.
void AddStates(Planning& s, Plan& p, uint64_t nstates) {
  const uint64_t bytes = 4 * nstates * s.nt;
  if (s.opt_tier == PlanTier::kDevice) p.device_bytes += bytes;
  if (s.opt_tier == PlanTier::kHost) s.Host(bytes);
  if (s.opt_tier == PlanTier::kNvme) {
    AddSwap(p, s.opt.nvme_path, 2 * nstates * CeilDiv(s.nt, s.sub) * Blocks(4 * s.sub));
    p.nvme_read_bytes += bytes;  // the step reads each once
  }
}

// The fp32 optimizer states and the gradient accumulators (but for the accumulators CPU-Adam
// reads from the device's sums), on the optimizer's tier, with its NVMe buffers.
void PlanOptimizerStates(Planning& s, Plan& p) {
  for (const char* state : {"fp32 master", "Adam m", "Adam v"})
    p.rows.push_back({state, s.opt_tier, 4 * s.nt});
  if (!s.sums_planned) p.rows.push_back({"gradient accumulators", s.opt_tier, 4 * s.nt});
  AddStates(s, p, s.sums_planned ? 3 : 4);
  if (s.opt_tier == PlanTier::kNvme) {
    p.optimizer_buffers = s.opt.buffer_count;
    p.optimizer_buffer_bytes = Blocks(4 * s.sub);
    s.Host(static_cast<uint64_t>(s.opt.buffer_count) * p.optimizer_buffer_bytes);
    // A step writes master, m and v (the accumulators below).
    p.nvme_write_bytes += 12 * s.nt;
  }
}

// The working shards on the parameters' tier: on the device with a pinned host mirror, on
// the host, or on NVMe (the leading groups' in host memory up to max_in_cpu) with the
// store's buffers and the pipelined step's staging.
void PlanWorkingShards(Planning& s, Plan& p) {
  const Config& config = s.config;
  const PlanTier par_tier = TierOf(s.par.device);
  const uint64_t shards = s.wbytes * s.n;
  const std::string shard_row = "working shards (" + p.dtype + ")";
  if (par_tier != PlanTier::kNvme) p.rows.push_back({shard_row, par_tier, shards});
  if (par_tier == PlanTier::kDevice) {
    p.device_bytes += shards;
    s.Host(shards);  // the pinned host mirror the optimizer writes
  }
  if (par_tier == PlanTier::kHost) s.Host(shards);
  if (par_tier != PlanTier::kNvme) return;
  // max_in_cpu: the leading groups' shards stay in host memory.
  const uint64_t in_cpu = std::min<uint64_t>(
      s.in.params, static_cast<uint64_t>(std::max<int64_t>(0, s.par.max_in_cpu)));
  const uint64_t host_shards = std::min(shards, s.wbytes * CeilDiv(in_cpu, s.w));
  s.Host(host_shards);
  p.param_buffers = s.par.buffer_count;
  p.param_buffer_bytes = Blocks(s.wbytes * CeilDiv(s.largest, s.w));
  s.Host(static_cast<uint64_t>(s.par.buffer_count) * p.param_buffer_bytes);
  if (config.strata.pipeline_step && config.optimizer.type != OptimizerType::kLamb) {
    // The pipelined step stages new shards in two host buffers (more only while a
    // sub-group spans more groups than that), each the size of the store's buffers (one
    // is exchanged for the other at the hand-over). Counted as three: measured, the 1.24B
    // Llama's first pipelined step (parameters on NVMe, the CPU device) kept 1495 MiB more
    // than the synchronous one, three of its 501 MiB largest shard, and the plan with two
    // had its second step killed at a 6 GiB limit.
    p.param_staging_buffers = 3;
    p.param_staging_bytes = p.param_buffer_bytes;
    s.Host(3 * p.param_staging_bytes);
  }
  const uint64_t on_nvme = shards - host_shards;
  p.rows.push_back({shard_row, PlanTier::kNvme, on_nvme});
  if (host_shards > 0) p.rows.push_back({shard_row + ", max_in_cpu", PlanTier::kHost, host_shards});
  AddSwap(p, s.par.nvme_path, 2 * on_nvme);
  // Read in the forward and again in the backward (at most), written after the step.
  p.nvme_read_bytes += 2 * on_nvme;
  p.nvme_write_bytes += on_nvme;
}

// The device's working set: the two largest groups gathered (stages 1 and 2: every
// parameter, kept gathered), and the gradient buckets as the engine sizes them
// (engine/reduce/reducer.h): reduce_bucket_size elements, at least the largest group, at
// most the trainable parameters; and their park, a sixteenth of a bucket (none for a model
// of one group).
void PlanDeviceWorkingSet(Planning& s, Plan& p) {
  const Config& config = s.config;
  s.bucket = std::min<uint64_t>(
      std::max<uint64_t>(
          static_cast<uint64_t>(std::max<int64_t>(1, config.zero.reduce_bucket_size)), s.largest),
      s.in.params - s.in.frozen_params);
  const uint64_t park = s.largest < s.in.params ? s.bucket / 16 / 16 * 16 : 0;
  s.buckets = config.zero.overlap_comm ? 2 : 1;
  // Stage 3: the coordinator evicts down to stage3_max_live_parameters, but never the two
  // groups in use.
  const uint64_t max_live =
      static_cast<uint64_t>(std::max<int64_t>(0, config.zero.stage3_max_live_parameters));
  const uint64_t gathered = config.zero.stage < 3
                                ? s.in.params
                                : std::min(s.in.params, std::max(GatheredFloor(s.in), max_live));
  // Reduce-scattered (stages 2 and 3 on several ranks): each bucket's output shard beside it.
  const uint64_t outputs = config.zero.reduce_scatter && config.zero.stage != 1 && s.w > 1
                               ? s.buckets * (s.bucket / s.w)
                               : 0;
  p.device_working_bytes = gathered * s.wbytes + (s.buckets * s.bucket + park + outputs) * s.wbytes;
  // Unknown without the largest group (strata-config plan's --largest-group): not counted.
  p.autograd_bytes = s.in.largest_group > 0
                         ? 3 * std::min(s.largest, s.in.params - s.in.frozen_params) * s.wbytes
                         : 0;
}

// Where the micro-steps' gradients are summed (the engine's choice,
// EngineCore::ChooseAccumulation): in device memory, fp32 for the optimizer's partition,
// while the device budget holds them beside the rest (the staging of reduced shards keeps
// its size: a sum that does not fit goes in a later round). Returns whether CPU-Adam reads
// the device's sums (sums_planned, and room).
bool PlanGradientAccumulation(Planning& s, Plan& p) {
  const Config& config = s.config;
  if (s.opt_tier == PlanTier::kDevice) {
    p.gradient_accumulation = "device (the optimizer's own accumulators)";
    return false;
  }
  if (config.gradient_accumulation_steps <= 1) {
    p.gradient_accumulation = "host (one micro-step per optimizer step: nothing to sum)";
    return false;
  }
  if (!config.strata.accumulate_on_device) {
    p.gradient_accumulation = "host (strata.accumulate_on_device false)";
    return false;
  }
  const uint64_t acc = (4 * s.nt + 63) / 64 * 64;
  const uint64_t budget = config.strata.device_budget;
  const uint64_t rest = p.device_bytes + p.device_working_bytes;
  if (budget > 0 && rest + acc > budget) {
    p.gradient_accumulation = "host (strata.device_budget " + FormatBytes(budget) + " holds the " +
                              FormatBytes(rest) + " the model needs there but not " +
                              FormatBytes(acc) + " of gradient accumulators beside them)";
    return false;
  }
  p.gradient_accumulation =
      budget > 0 ? "device"
                 : "device (if the device's own budget holds them: on a GPU half its free "
                   "memory, checked at start)";
  p.device_accumulator_bytes = acc;
  p.device_bytes += acc;
  p.rows.push_back({"device gradient accumulators", PlanTier::kDevice, acc});
  if (!s.sums_planned) return false;
  // CPU-Adam reads them there: pinned buffers of the sub-groups leased at once (the
  // synchronous step one and the next; the pipelined update's worker one, the next and one
  // a group spans into).
  const uint64_t chunks = CeilDiv(s.nt, s.sub);
  const bool pipelined =
      config.strata.pipeline_step && config.optimizer.type != OptimizerType::kLamb;
  const uint64_t held = std::min<uint64_t>(chunks, pipelined ? 3 : 2);
  p.grad_sums_buffer_bytes = held * 4 * s.sub;
  p.grad_accumulators = "device (CPU-Adam copies each sub-group's sums to the host)";
  p.rows.push_back({"gradient sums' host buffers", PlanTier::kHost, p.grad_sums_buffer_bytes});
  s.Host(p.grad_sums_buffer_bytes);
  return true;
}

// The gradient accumulators when CPU-Adam does not read the device's sums: added back on
// the optimizer's tier if they were left out, written out by the backward on NVMe when the
// states do not fit the buffers, and why they stay on the host.
void PlanAccumulators(Planning& s, Plan& p, bool sums_on_device) {
  const Config& config = s.config;
  if (s.sums_planned && !sums_on_device) {
    // The device cannot hold the sums: host accumulators after all.
    p.rows.push_back({"gradient accumulators", s.opt_tier, 4 * s.nt});
    AddStates(s, p, 1);
  }
  if (!sums_on_device && s.opt_tier == PlanTier::kNvme &&
      16 * s.nt > static_cast<uint64_t>(s.opt.buffer_count) * 4 * s.sub) {
    p.nvme_write_bytes += 4 * s.nt;
  }
  if (s.opt_tier == PlanTier::kDevice) {
    p.grad_accumulators = "device (the optimizer's tier)";
  } else if (!s.sums_planned && config.gradient_accumulation_steps > 1 &&
             config.strata.accumulate_on_device &&
             (config.strata.early_step || config.strata.delayed_update)) {
    p.grad_accumulators =
        std::string("host (") +
        (config.strata.early_step ? "strata.early_step" : "strata.delayed_update") +
        " reads them while gradients are added)";
  }
}

// The step's time bound: the NVMe traffic at the measured (or configured) bandwidths, and
// CPU-Adam over the trainable shard at its measured rate.
void PlanStepTime(const Planning& s, Plan& p) {
  const Config& config = s.config;
  const PlanInput& in = s.in;
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
    p.adam_s = static_cast<double>(s.nt) / in.adam_rate;
    p.adam_rate = in.adam_rate;
    p.adam_rate_source = in.adam_rate_source;
  }
  const bool io_known = p.nvme_read_bytes + p.nvme_write_bytes == 0 || p.io_s > 0;
  if (io_known && p.adam_s > 0) p.step_bound_s = std::max(p.io_s, p.adam_s);
}

}  // namespace

uint64_t GatheredFloor(const PlanInput& in) {
  const uint64_t largest = in.largest_group > 0 ? std::min(in.largest_group, in.params) : in.params;
  const uint64_t second = in.second_group > 0 ? std::min(in.second_group, largest) : largest;
  return std::min(in.params, largest + second);
}

ModelExtent PlanExtent(const PlanInput& in) {
  const uint64_t trainable = in.params - std::min(in.frozen_params, in.params);
  const uint64_t w = static_cast<uint64_t>(std::max(1, in.world_size));
  const uint64_t largest = in.largest_group > 0 ? std::min(in.largest_group, in.params) : in.params;
  return {.trainable = trainable,
          .largest_group = largest,
          .partition = CeilDiv(trainable, w),
          .largest_shard = CeilDiv(largest, w)};
}

// In phases: the optimizer's states, the working shards, the device's working set, where
// the gradients are summed and accumulated, the host pool's bytes (page-locked when some
// section that uses it asks, pin_memory, or when the device's working shards need a pinned
// mirror), then the step's time bound.
Result<Plan> MakePlan(const Config& given, const PlanInput& in) {
  STRATA_RETURN_IF_ERROR(CheckPlanInput(given, in));
  Plan p;
  // The sizes the engine chooses for the keys left at their defaults (core/sizing.h).
  Config config = given;
  p.sized = SizeFromModel(config, PlanExtent(in));
  p.device_on_host = in.device_on_host;
  Planning s = StartPlan(config, in, p);
  PlanOptimizerStates(s, p);
  PlanWorkingShards(s, p);
  PlanDeviceWorkingSet(s, p);
  const bool sums_on_device = PlanGradientAccumulation(s, p);
  PlanAccumulators(s, p, sums_on_device);
  if (s.opt_tier != PlanTier::kDevice) s.Host(s.buckets * CeilDiv(s.bucket, s.w) * s.wbytes);
  const bool pinned = s.par.device == OffloadDevice::kNone ||
                      (s.opt.device != OffloadDevice::kNone && s.opt.pin_memory) ||
                      (s.par.device != OffloadDevice::kNone && s.par.pin_memory);
  (pinned ? p.host_pinned_bytes : p.host_unpinned_bytes) = s.host_bytes;
  PlanStepTime(s, p);
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
  for (const SizedKey& k : sized)
    os << "sized from the model: " << k.ToString() << "\n";
  os << "per rank:\n";
  for (const PlanRow& r : rows) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-34s %-7s %s%s\n", r.state.c_str(), PlanTierName(r.tier),
                  FormatBytes(r.bytes).c_str(), r.tier == PlanTier::kNvme ? " (x2 slots)" : "");
    os << line;
  }
  os << "device: " << FormatBytes(device_bytes) << " resident + "
     << FormatBytes(device_working_bytes) << " gathered groups and gradient buckets\n";
  os << "torch's gradients in a backward: " << FormatBytes(autograd_bytes)
     << (autograd_bytes > 0 ? " (three of the largest group's, outside the device budget)\n"
                            : " (not counted: the largest group is unknown)\n");
  os << "gradient accumulation: " << gradient_accumulation << "\n";
  os << "gradient accumulators CPU-Adam reads: " << grad_accumulators << "\n";
  os << "host: " << FormatBytes(host_bytes()) << " (" << FormatBytes(host_pinned_bytes)
     << " pinned, " << FormatBytes(host_unpinned_bytes) << " not";
  if (device_on_host) os << "; " << FormatBytes(memory_bytes()) << " with the CPU device's";
  os << ")";
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
  return ReadMachineFacts(paths, MemoryLimitOptions{});
}

Result<MachineFacts> ReadMachineFacts(const std::vector<std::string>& paths,
                                      const MemoryLimitOptions& memory) {
  MachineFacts m;
  MemoryLimitOptions limits_options = memory;
  limits_options.host_budget = 0;  // the config's, CheckPlan's
  Result<std::vector<MemoryLimit>> limits = ReadMemoryLimits(limits_options);
  if (!limits.ok()) return limits.status().WithContext("plan");
  // MemAvailable first, then the others.
  m.host_available_bytes = limits->front().available();
  m.host_limits.assign(limits->begin() + 1, limits->end());
  struct rlimit rl {};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return ErrnoError(errno, "getrlimit(RLIMIT_MEMLOCK)");
  m.memlock_limit = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(rl.rlim_cur);
  // CAP_IPC_LOCK (bit 14 of the effective set) lifts the limit.
  std::ifstream status(memory.proc_root + "/self/status");
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

std::vector<MemoryLimit> HostLimits(const Config& config, const MachineFacts& machine,
                                    const CheckOptions& options) {
  std::vector<MemoryLimit> limits = {MemAvailableLimit(machine.host_available_bytes)};
  limits.insert(limits.end(), machine.host_limits.begin(), machine.host_limits.end());
  if (options.host_budget && config.strata.host_budget > 0) {
    limits.push_back(HostBudgetLimit(config.strata.host_budget));
  }
  return limits;
}

MemoryLimit BindingHostLimit(const Plan& plan, const Config& config, const MachineFacts& machine,
                             const CheckOptions& options) {
  const std::vector<MemoryLimit> limits = HostLimits(config, machine, options);
  return *BindingLimit(limits, static_cast<uint64_t>(plan.ranks_per_node));
}

uint64_t PlanRoom(const Plan& plan, const Config& config, const MachineFacts& machine,
                  std::string& limit) {
  const MemoryLimit bind = BindingHostLimit(plan, config, machine, {.host_budget = false});
  const uint64_t share = bind.PerRank(static_cast<uint64_t>(plan.ranks_per_node));
  const uint64_t reserve = config.strata.memory_reserve;
  uint64_t room = share > reserve ? share - reserve : 0;
  limit = bind.ToString();
  if (reserve > 0) limit += ", less strata.memory_reserve's " + FormatBytes(reserve);
  if (config.strata.host_budget > 0 && config.strata.host_budget < room) {
    room = config.strata.host_budget;
    limit = "strata.host_budget";
  }
  return room;
}

std::string DescribeHostRoom(const Plan& plan, const Config& config, const MachineFacts& machine) {
  const MemoryLimit bind = BindingHostLimit(plan, config, machine);
  const uint64_t ranks = static_cast<uint64_t>(plan.ranks_per_node);
  std::string s = FormatBytes(bind.PerRank(ranks)) + " of host memory available";
  if (ranks > 1 && bind.scope != MemoryScope::kProcess) {
    s += " to each of the " + std::to_string(ranks) + " ranks on this machine";
  }
  s += " (" + bind.ToString() + "), the plan needs " + FormatBytes(plan.memory_bytes()) +
       " per rank";
  if (config.strata.memory_reserve > 0) {
    s += " and strata.memory_reserve " + FormatBytes(config.strata.memory_reserve) + " beside it";
  }
  return s;
}

namespace {

// The host memory of the node's ranks against the limit that binds it (strata.host_budget
// has its own line), naming the others it exceeds too.
void CheckHostMemory(const Plan& plan, const Config& config, const MachineFacts& machine,
                     std::vector<std::string>& problems) {
  const std::vector<MemoryLimit> limits = HostLimits(config, machine, {.host_budget = false});
  // What the buffers do not hold is left out of the room (strata.memory_reserve).
  const uint64_t reserve = config.strata.memory_reserve;
  const uint64_t host = plan.memory_bytes() + reserve;
  const uint64_t ranks = static_cast<uint64_t>(plan.ranks_per_node);
  const MemoryLimit& bind = *BindingLimit(limits, ranks);
  if (host <= bind.PerRank(ranks)) return;
  std::string msg = "host memory: the plan needs ";
  const std::string reserved =
      reserve == 0 ? "" : ", with strata.memory_reserve's " + FormatBytes(reserve);
  if (bind.scope == MemoryScope::kProcess) {
    msg += FormatBytes(host) + " per rank (" + FormatBytes(plan.host_pinned_bytes) + " pinned" +
           reserved + ")";
  } else {
    msg += FormatBytes(host * ranks) + " (" + FormatBytes(host) + " per rank x " +
           std::to_string(ranks) + " ranks on this machine, " +
           (bind.scope == MemoryScope::kCgroup ? "in one cgroup, " : "") +
           FormatBytes(plan.host_pinned_bytes) + " of each pinned" + reserved + ")";
  }
  msg += " but ";
  if (bind.scope == MemoryScope::kMachine) {
    msg += "the machine has " + FormatBytes(bind.available()) + " available (MemAvailable)";
  } else if (bind.scope == MemoryScope::kCgroup) {
    msg += "its cgroup leaves " + FormatBytes(bind.available()) + " (" + bind.ToString() + ")";
  } else {
    msg +=
        "this process may use " + FormatBytes(bind.available()) + " more (" + bind.ToString() + ")";
  }
  std::string also;
  for (const MemoryLimit& other : limits) {
    if (&other == &bind || host <= other.PerRank(ranks)) continue;
    also += (also.empty() ? "" : ", ") + other.source + " (" + FormatBytes(other.available()) +
            " left)";
  }
  if (!also.empty()) msg += ", and " + also + " is exceeded too";
  msg +=
      "; lower zero_optimization.sub_group_size, reduce_bucket_size or the NVMe buffer_count "
      "(strata-config plan --suggest finds values that fit), offload to nvme, or " +
      bind.raise_by;
  problems.push_back(msg);
}

// The free space at each nvme_path for the node's swap.
void CheckDisks(const Plan& plan, const MachineFacts& machine, const CheckOptions& options,
                std::vector<std::string>& problems) {
  const uint64_t ranks = static_cast<uint64_t>(plan.ranks_per_node);
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
}

}  // namespace

std::vector<std::string> HostProblems(const Plan& plan, const Config& config,
                                      const MachineFacts& machine, const CheckOptions& options) {
  std::vector<std::string> problems;
  CheckHostMemory(plan, config, machine, problems);
  const uint64_t host = plan.host_bytes();
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
  return problems;
}

Status CheckPlan(const Plan& plan, const Config& config, const MachineFacts& machine,
                 const CheckOptions& options) {
  std::vector<std::string> problems = HostProblems(plan, config, machine, options);
  CheckDisks(plan, machine, options, problems);
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

}  // namespace strata

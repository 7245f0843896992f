// SuggestPlan (core/planner.h): the cheapest placement that fits, each placement first with
// its sizes and buffer counts lowered until the host holds it.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/planner.h"
#include "strata/core/planner_internal.h"

namespace strata {

namespace {

// Sub-groups of at least this many elements: 4 MB transfers of an fp32 state, which a
// drive still moves near its bandwidth.
constexpr int64_t kMinSubGroup = 1000000;

// The largest of 1, 2 and 5 x 10^k below `v` (0 for v <= 1).
int64_t NextLower(int64_t v) {
  const uint64_t u = static_cast<uint64_t>(std::max<int64_t>(0, v));
  uint64_t best = 0;
  for (uint64_t p = 1;; p *= 10) {
    for (const uint64_t m : {1, 2, 5}) {
      if (m * p < u) best = m * p;
    }
    if (p > u / 10) break;
  }
  return static_cast<int64_t>(best);
}

// A key the suggestion may lower within a placement, a notch at a time.
struct Knob {
  const char* key;
  const char* why;  // how it enters the plan's host memory
  int64_t (*get)(const Config&);
  void (*set)(Config&, int64_t);
  // The next value to try, below the one in effect; 0: none (at its floor, or not used).
  int64_t (*next)(const Config&, const Plan&, const PlanInput&);
};

// The sizes first (a smaller unit of transfer), then the buffer counts (less read-ahead).
const Knob kSizes[] = {
    {"zero_optimization.sub_group_size",
     "the optimizer's NVMe buffers and the gradient sums' host buffers are one sub-group each",
     [](const Config& c) { return c.zero.sub_group_size; },
     [](Config& c, int64_t v) { c.zero.sub_group_size = v; },
     [](const Config& c, const Plan& p, const PlanInput&) -> int64_t {
       const int64_t in_effect =
           std::min<int64_t>(c.zero.sub_group_size,
                             static_cast<int64_t>(std::max<uint64_t>(1, p.trainable_rank_elems)));
       if (in_effect <= kMinSubGroup) return 0;
       return std::max(NextLower(in_effect), kMinSubGroup);
     }},
    {"zero_optimization.reduce_bucket_size",
     "the reduced gradients are staged in host memory a bucket's shard per bucket",
     [](const Config& c) { return c.zero.reduce_bucket_size; },
     [](Config& c, int64_t v) { c.zero.reduce_bucket_size = v; },
     [](const Config& c, const Plan&, const PlanInput& in) -> int64_t {
       // The engine's bucket: at least the largest group, at most the trainable parameters.
       const uint64_t largest =
           std::min(in.params, in.largest_group > 0 ? in.largest_group : in.params);
       const uint64_t in_effect = std::min<uint64_t>(
           std::max<uint64_t>(static_cast<uint64_t>(c.zero.reduce_bucket_size), largest),
           in.params - in.frozen_params);
       if (in_effect <= largest) return 0;
       return std::max(NextLower(static_cast<int64_t>(in_effect)), static_cast<int64_t>(largest));
     }},
};
const Knob kCounts[] = {
    {"zero_optimization.offload_optimizer.buffer_count",
     "each is one sub-group's fp32 state in host memory",
     [](const Config& c) -> int64_t { return c.zero.offload_optimizer.buffer_count; },
     [](Config& c, int64_t v) { c.zero.offload_optimizer.buffer_count = static_cast<int>(v); },
     [](const Config& c, const Plan&, const PlanInput&) -> int64_t {
       const OffloadConfig& o = c.zero.offload_optimizer;
       // The engine's least: 4 (a sub-group's four states), 4 x depth with pipeline_read.
       const int floor = o.pipeline_read ? 4 * c.strata.swap_pipeline_depth : 4;
       return o.device == OffloadDevice::kNvme && o.buffer_count > floor ? o.buffer_count - 1 : 0;
     }},
    {"zero_optimization.offload_param.buffer_count",
     "each is the largest group's working shard in host memory",
     [](const Config& c) -> int64_t { return c.zero.offload_param.buffer_count; },
     [](Config& c, int64_t v) { c.zero.offload_param.buffer_count = static_cast<int>(v); },
     [](const Config& c, const Plan&, const PlanInput&) -> int64_t {
       const OffloadConfig& o = c.zero.offload_param;  // the engine's least: 2
       return o.device == OffloadDevice::kNvme && o.buffer_count > 2 ? o.buffer_count - 1 : 0;
     }},
};

// The cheapest first: the working shards max_in_cpu keeps in host memory (the forward then
// reads them from NVMe too), and the gathered groups' bound (fewer groups kept ahead).
const Knob kKeep[] = {
    {"zero_optimization.offload_param.max_in_cpu",
     "the leading groups' working shards it keeps in host memory",
     [](const Config& c) -> int64_t { return c.zero.offload_param.max_in_cpu; },
     [](Config& c, int64_t v) { c.zero.offload_param.max_in_cpu = v; },
     [](const Config& c, const Plan&, const PlanInput&) -> int64_t {
       // 0 is "none", a value like the others here: -1 says "lower to 0".
       const OffloadConfig& o = c.zero.offload_param;
       return o.device == OffloadDevice::kNvme && o.max_in_cpu > 0 ? -1 : 0;
     }},
    {"zero_optimization.stage3_max_live_parameters",
     "the groups gathered at once are in the CPU device's memory, the host's",
     [](const Config& c) { return c.zero.stage3_max_live_parameters; },
     [](Config& c, int64_t v) { c.zero.stage3_max_live_parameters = v; },
     [](const Config& c, const Plan& p, const PlanInput& in) -> int64_t {
       if (!p.device_on_host || c.zero.stage < 3) return 0;
       // The engine keeps the groups in use whatever the bound: the two largest at most.
       const int64_t floor = static_cast<int64_t>(GatheredFloor(in));
       const int64_t in_effect =
           std::min<int64_t>(c.zero.stage3_max_live_parameters, static_cast<int64_t>(in.params));
       if (in_effect <= floor) return 0;
       return std::max(NextLower(in_effect), floor);
     }},
};

// Last, what costs overlap: one gradient bucket instead of two (and its staging), and the
// synchronous step instead of the pipelined one (no staging of new parameters).
const Knob kModes[] = {
    {"zero_optimization.overlap_comm",
     "a second gradient bucket, and its staging in host memory, lets the reduction overlap "
     "the backward",
     [](const Config& c) -> int64_t { return c.zero.overlap_comm ? 1 : 0; },
     [](Config& c, int64_t v) { c.zero.overlap_comm = v != 0; },
     [](const Config& c, const Plan&, const PlanInput&) -> int64_t {
       return c.zero.overlap_comm ? -1 : 0;
     }},
    {"strata.pipeline_step",
     "the pipelined step stages new working shards in host buffers of the largest shard (three "
     "counted)",
     [](const Config& c) -> int64_t { return c.strata.pipeline_step ? 1 : 0; },
     [](Config& c, int64_t v) { c.strata.pipeline_step = v != 0; },
     [](const Config& c, const Plan& p, const PlanInput&) -> int64_t {
       return c.strata.pipeline_step && p.param_staging_buffers > 0 ? -1 : 0;
     }},
};

// What the engine lowers at start (FitToMemory), and what --suggest lowers (its snippet
// writes out the sizes and the counts).
const std::span<const Knob> kStartGroups[] = {kKeep, kSizes, kCounts, kModes};
const std::span<const Knob> kSuggestGroups[] = {kSizes, kCounts};

// A placement's config and plan after Lower, with what it lowered.
struct Fitted {
  Config config;
  Plan plan;
  uint64_t host_before = 0;  // the plan's memory per rank before (Plan::memory_bytes)
  std::vector<std::string> lowered;
  std::vector<std::string> why;
  std::vector<SizedKey> keys;
};

// Lowers the keys `may` allows of `c`, the first group's before the next, a notch at a time
// (each time the key whose notch saves the most memory), while `fits` says no and a notch
// saves anything. Never raises a key.
template <typename Fits, typename May>
Result<Fitted> Lower(const Config& c, const PlanInput& in,
                     std::span<const std::span<const Knob>> groups, Fits fits, May may) {
  STRATA_ASSIGN_OR_RETURN(Plan plan, MakePlan(c, in));
  Fitted f{.config = c,
           .plan = plan,
           .host_before = plan.memory_bytes(),
           .lowered = {},
           .why = {},
           .keys = {}};
  while (!fits(f.plan, f.config)) {
    bool lowered = false;
    for (const std::span<const Knob> group : groups) {
      std::optional<std::pair<Config, Plan>> best;
      for (const Knob& k : group) {
        if (!may(f.config, k.key)) continue;
        int64_t next = k.next(f.config, f.plan, in);
        if (next == -1)
          next = 0;  // kKeep's "lower to 0"
        else if (next <= 0)
          continue;
        if (next >= k.get(f.config)) continue;
        Config t = f.config;
        k.set(t, next);
        STRATA_ASSIGN_OR_RETURN(Plan tp, MakePlan(t, in));
        const uint64_t bar = best ? best->second.memory_bytes() : f.plan.memory_bytes();
        if (tp.memory_bytes() < bar) best.emplace(std::move(t), std::move(tp));
      }
      if (!best) continue;
      f.config = std::move(best->first);
      f.plan = std::move(best->second);
      lowered = true;
      break;
    }
    if (!lowered) break;
  }
  for (const std::span<const Knob> group : groups) {
    for (const Knob& k : group) {
      if (k.get(f.config) == k.get(c)) continue;
      f.lowered.push_back(std::string(k.key) + " " + std::to_string(k.get(c)) + " -> " +
                          std::to_string(k.get(f.config)));
      f.why.push_back(std::string(k.key) + ": " + k.why);
      f.keys.push_back({k.key, k.get(c), k.get(f.config), k.why});
    }
  }
  return f;
}

// Lowers the sizes, then the buffer counts, of `c` while the host cannot hold the plan (the
// limit that binds it, strata.host_budget, RLIMIT_MEMLOCK).
Result<Fitted> FitHost(const Config& c, const PlanInput& in, const MachineFacts& machine) {
  return Lower(
      c, in, kSuggestGroups,
      [&](const Plan& p, const Config& t) { return HostProblems(p, t, machine, {}).empty(); },
      [](const Config&, const char*) { return true; });
}

std::string Join(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (const std::string& p : parts)
    out += (out.empty() ? "" : sep) + p;
  return out;
}

struct Placement {
  OffloadDevice optimizer, param;
  const char* name;
};
constexpr Placement kPlacements[] = {
    {OffloadDevice::kCpu, OffloadDevice::kNone,
     "optimizer in host memory, parameters on the device"},
    {OffloadDevice::kCpu, OffloadDevice::kCpu, "optimizer and parameters in host memory"},
    {OffloadDevice::kNvme, OffloadDevice::kCpu, "optimizer on NVMe, parameters in host memory"},
    {OffloadDevice::kNvme, OffloadDevice::kNvme, "optimizer and parameters on NVMe"},
};

// The config with the placement. A section moved to NVMe keeps its buffer count (at least
// the engine's least) and pipelines the optimizer's reads and writes when that count holds
// the pipeline (docs/engine.md): a buffer count is never raised to fit.
Config Place(const Config& config, const Placement& pl, const std::vector<std::string>& paths) {
  Config c = config;
  OffloadConfig& opt = c.zero.offload_optimizer;
  OffloadConfig& par = c.zero.offload_param;
  opt.device = pl.optimizer;
  par.device = pl.param;
  if (pl.optimizer == OffloadDevice::kNvme) {
    opt.nvme_path = paths;
    opt.buffer_count = std::max(opt.buffer_count, 4);
    if (config.zero.offload_optimizer.device != OffloadDevice::kNvme) {
      const int depth = c.strata.swap_pipeline_depth;
      opt.pipeline_read = opt.pipeline_write = depth >= 2 && opt.buffer_count >= 4 * depth;
    }
  }
  if (pl.param == OffloadDevice::kNvme) {
    par.nvme_path = paths;
    par.max_in_cpu = 0;
    par.buffer_count = std::max(par.buffer_count, 2);
  }
  return c;
}

// The JSON that sets the placement, and the sizes lowered from `original`'s.
std::string Snippet(const Config& c, const Config& original) {
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
  nlohmann::json zero = {{"offload_optimizer", section(c.zero.offload_optimizer, true)},
                         {"offload_param", section(c.zero.offload_param, false)}};
  if (c.zero.sub_group_size != original.zero.sub_group_size) {
    zero["sub_group_size"] = c.zero.sub_group_size;
  }
  if (c.zero.reduce_bucket_size != original.zero.reduce_bucket_size) {
    zero["reduce_bucket_size"] = c.zero.reduce_bucket_size;
  }
  return nlohmann::json{{"zero_optimization", zero}}.dump(2);
}

}  // namespace

Result<Suggestion> SuggestPlan(const Config& given, const PlanInput& input,
                               const MachineFacts& machine) {
  // From the sizes the engine would choose for the keys left at their defaults (what
  // MakePlan plans with): what --suggest lowers, it lowers from those.
  Config config = given;
  SizeFromModel(config, PlanExtent(input));
  std::vector<std::string> paths = config.zero.offload_optimizer.nvme_path;
  if (paths.empty()) paths = config.zero.offload_param.nvme_path;
  std::string tried;
  for (const Placement& pl : kPlacements) {
    const bool nvme = pl.optimizer == OffloadDevice::kNvme || pl.param == OffloadDevice::kNvme;
    if (nvme && paths.empty()) {
      return FailedPreconditionError(
          "plan --suggest: nothing fits without NVMe, and the config names no nvme_path; set "
          "zero_optimization.offload_optimizer.nvme_path to a directory on an NVMe drive:\n" +
          tried);
    }
    const Config placed = Place(config, pl, paths);
    STRATA_ASSIGN_OR_RETURN(Fitted f, FitHost(placed, input, machine));
    Status fits = CheckPlan(f.plan, f.config, machine);
    if (!fits.ok()) {
      tried += std::string(pl.name) + ": " + fits.message() + "\n";
      if (!f.lowered.empty()) {
        tried += "  (with " + Join(f.lowered, ", ") + " lowered for the host memory)\n";
      }
      continue;
    }
    std::string lowered;
    if (!f.lowered.empty()) {
      const MemoryLimit bind = BindingHostLimit(f.plan, f.config, machine);
      lowered = "lowered " + Join(f.lowered, ", ") + ": the placement needed " +
                FormatBytes(f.host_before) + " of host memory per rank with the config's, " +
                FormatBytes(f.plan.memory_bytes()) + " with these, and " +
                FormatBytes(bind.PerRank(static_cast<uint64_t>(f.plan.ranks_per_node))) +
                " is available per rank (" + bind.ToString() + ")\n  " + Join(f.why, "\n  ") + "\n";
    }
    return Suggestion{.config = f.config,
                      .plan = f.plan,
                      .snippet = Snippet(f.config, config),
                      .tried = tried,
                      .lowered = lowered};
  }
  return NotFoundError("plan --suggest: no placement fits this machine:\n" + tried);
}

Result<std::vector<SizedKey>> FitToMemory(Config& config, const PlanInput& input, uint64_t budget,
                                          const std::string& limit) {
  // From the sizes the model gives the keys left out (the engine's already are).
  SizeFromModel(config, PlanExtent(input));
  STRATA_ASSIGN_OR_RETURN(
      Fitted f, Lower(
                    config, input, kStartGroups,
                    [&](const Plan& p, const Config&) { return p.memory_bytes() <= budget; },
                    [](const Config& c, const char* key) { return !c.Given(key); }));
  const bool fits = f.plan.memory_bytes() <= budget;
  for (SizedKey& k : f.keys) {
    k.why = std::string("not set, lowered") + (fits ? "" : " as far as it goes") +
            ": the plan needs " + FormatBytes(f.plan.memory_bytes()) + " of memory per rank (" +
            FormatBytes(f.host_before) + " before), " + FormatBytes(budget) + " left under " +
            limit + "; " + k.why;
  }
  config = std::move(f.config);
  return f.keys;
}

}  // namespace strata

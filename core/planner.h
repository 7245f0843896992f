// The tier planner: from a config and a parameter count, where each
// state of a rank lives (device, host, NVMe), what it costs there (host bytes pinned and
// not, swap bytes per nvme_path, buffers) and a bound on the step's time from measured
// bandwidths; and the check that refuses a plan the machine cannot hold (the host memory
// the process may use: MemAvailable, its cgroup's limit, RLIMIT_AS and RLIMIT_DATA; free
// disk at each nvme_path, RLIMIT_MEMLOCK, the budgets), with the numbers.
//
// The arithmetic follows the engine (docs/engine.md) per rank of W, with n = ceil(params /
// W) elements: working shards n x 2 bytes (bf16, fp16) or 4 (fp32); fp32 master, Adam m
// and v and the gradient accumulators 4 x 4n bytes, all with the optimizer; swap slots
// twice a state's bytes (write-then-switch); NVMe buffers buffer_count x one sub-group (the
// optimizer's) or x the largest group's shard (the parameters'); offload_param = none keeps
// a pinned host mirror of the shards; the reduced-gradient staging is one bucket's shard per
// bucket. It does not see the groups' alignment padding (at most 16 elements per parameter
// and rank) nor allocator rounding: a plan is an estimate, not the engine's accounting.
//
// Thread-safety: plain functions and values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/memory_limit.h"
#include "strata/core/sizing.h"
#include "strata/core/status.h"

namespace strata {

struct PlanInput {
  uint64_t params = 0;  // model parameters (elements), > 0
  // Of which frozen (requires_grad false: no optimizer state, no gradient accumulator).
  uint64_t frozen_params = 0;
  int world_size = 1;
  // Ranks sharing one machine's memory and drives (0: world_size, one machine).
  int ranks_per_node = 0;
  // Elements of the largest wrapped module (its full, gathered size); 0: unknown (taken as
  // the whole model: buffers and device checks are then upper bounds).
  uint64_t largest_group = 0;
  // Elements of the next largest group (0: unknown, taken as the largest). The engine keeps
  // the groups in use gathered whatever stage3_max_live_parameters says: at most the root
  // and one block at once, so the gathered floor is the two largest groups' sum.
  uint64_t second_group = 0;
  // Bytes/s; 0: the config's strata.nvme_read_bandwidth / nvme_write_bandwidth.
  double nvme_read_bandwidth = 0.0;
  double nvme_write_bandwidth = 0.0;
  // CPU-Adam parameters per second on one rank (given, or measured with
  // MeasureAdamRate of optim/cpu_adam); 0: unknown.
  double adam_rate = 0.0;
  std::string adam_rate_source = "";  // how it was found, printed with it: "given", ...
  // The device's memory is the host's (the engine's CPU device: no accelerator): its
  // resident states, gathered groups and buckets count against the host's limits too.
  bool device_on_host = false;
};

enum class PlanTier : uint8_t { kDevice, kHost, kNvme };
const char* PlanTierName(PlanTier t);  // "device", "host", "nvme"

struct PlanRow {
  std::string state;  // "working shards (bf16)", "fp32 master", ...
  PlanTier tier = PlanTier::kHost;
  uint64_t bytes = 0;  // the state's bytes on the rank (on NVMe: one slot)
};

struct Plan {
  // The keys the config left at their defaults that the plan (as the engine) sized from the
  // model (core/sizing.h); the rows below use those sizes.
  std::vector<SizedKey> sized;
  uint64_t params = 0;
  int stage = 3;  // zero_optimization.stage
  int world_size = 1;
  int ranks_per_node = 1;
  uint64_t rank_elems = 0;            // n
  uint64_t frozen_params = 0;         // PlanInput::frozen_params
  uint64_t trainable_rank_elems = 0;  // the optimizer's elements per rank
  bool largest_group_known = false;   // PlanInput::largest_group given
  std::string dtype;                  // working dtype
  std::vector<PlanRow> rows;
  uint64_t device_bytes = 0;  // states resident on the device
  // Gathered groups at once (the two largest; stages 1 and 2: all of them, replicated)
  // and the gradient buckets, on the device.
  uint64_t device_working_bytes = 0;
  // LibTorch's own in a backward, outside the device budget: autograd's gradients of the
  // largest group before the reducer takes them, three of them (a tied parameter's two and
  // their sum; measured: a 1.24B Llama's step on the CPU device held 3.3 of its tied
  // embedding's gradient beyond the buffers).
  uint64_t autograd_bytes = 0;
  uint64_t host_pinned_bytes = 0;
  uint64_t host_unpinned_bytes = 0;
  // Where the micro-steps' gradients are summed (strata.accumulate_on_device): "device"
  // (their fp32 accumulators are in device_bytes and a row) or "host" with the reason.
  std::string gradient_accumulation = "host";
  uint64_t device_accumulator_bytes = 0;
  // Where CPU-Adam reads the accumulators: "device (...)" when it reads the device's sums
  // (no host accumulators: a row of the pinned buffers of the sub-groups leased at once,
  // grad_sums_buffer_bytes), else "host" (with the reason when the step variant decides).
  std::string grad_accumulators = "host";
  uint64_t grad_sums_buffer_bytes = 0;
  int optimizer_buffers = 0;  // NVMe buffers (0: no NVMe tier)
  uint64_t optimizer_buffer_bytes = 0;
  int param_buffers = 0;
  uint64_t param_buffer_bytes = 0;
  // The pipelined step with parameters on NVMe: host buffers its update writes new
  // working shards into (strata.pipeline_step, Adam; 0: none).
  int param_staging_buffers = 0;
  uint64_t param_staging_bytes = 0;
  // Swap bytes per nvme_path (both slots), in path order; a path named by both sections
  // appears once with both.
  std::vector<std::pair<std::string, uint64_t>> nvme_bytes;
  // Per training step (one optimizer step, one forward and backward).
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  double read_bandwidth = 0.0;  // bytes/s used (0: unknown)
  double write_bandwidth = 0.0;
  double io_s = 0.0;    // 0 when a bandwidth is unknown
  double adam_s = 0.0;  // 0 when the rate is unknown
  double adam_rate = 0.0;
  std::string adam_rate_source;
  // max(io, adam): the optimizer's NVMe pipeline overlaps them at best (0: unknown).
  double step_bound_s = 0.0;

  bool device_on_host = false;  // PlanInput::device_on_host

  // The host tier's bytes (what strata.host_budget bounds).
  uint64_t host_bytes() const { return host_pinned_bytes + host_unpinned_bytes; }
  // The process's host memory as its limits see it: the host tier, and the device's bytes
  // when the device's memory is the host's.
  uint64_t memory_bytes() const {
    return host_bytes() +
           (device_on_host ? device_bytes + device_working_bytes + autograd_bytes : 0);
  }
  std::string ToString() const;  // the table strata-config plan prints
};

// The ranks that share one machine: ranks_per_node, at most world_size (0: world_size).
int RanksPerNode(const PlanInput& input);

// The model as core/sizing.h sees it: the trainable parameters, the largest group (the
// whole model when unknown), a rank's share.
ModelExtent PlanExtent(const PlanInput& in);
// The elements the engine keeps gathered however low stage3_max_live_parameters is: the two
// largest groups (PlanInput::second_group), at most the model.
uint64_t GatheredFloor(const PlanInput& in);

// InvalidArgument for params 0, world_size < 1, or a stage other than 3.
Result<Plan> MakePlan(const Config& config, const PlanInput& input);

// Lowers the keys `config` leaves at their defaults (not in the document: Config::given)
// until the plan's memory per rank (Plan::memory_bytes) is at most `budget` (`limit` names
// it in the reasons), a group at a time and in a group the key whose notch saves the most:
// offload_param.max_in_cpu to 0 and stage3_max_live_parameters down to two of the largest
// group (with the CPU device); sub_group_size down to 1e6 and reduce_bucket_size down to the
// largest group; the NVMe buffer counts down to the engine's least; overlap_comm and
// strata.pipeline_step off. A key written out is kept. The keys are first sized from the
// model (SizeFromModel). Returns the keys changed, each with the reason; the plan may still
// not fit (CheckPlan then refuses it with the numbers). The engine calls it at start with
// the least room of its ranks, so that every rank sizes alike.
Result<std::vector<SizedKey>> FitToMemory(Config& config, const PlanInput& input, uint64_t budget,
                                          const std::string& limit);

// The bandwidths nvme_bench chose (its --json output: best.chosen.read_gbps and
// write_gbps, decimal GB/s), in bytes/s. InvalidArgument naming what is missing or wrong
// (not JSON, no best.chosen, a value that is not a positive finite number).
struct MeasuredBandwidth {
  double read = 0.0;
  double write = 0.0;
};
Result<MeasuredBandwidth> ParseNvmeBenchJson(std::string_view text);

// What the machine has, as the check sees it.
struct MachineFacts {
  uint64_t host_available_bytes = 0;  // MemAvailable (the machine's: its ranks share it)
  // The other limits on the host memory this process may use (core/memory_limit.h): its
  // cgroup's (shared by the node's ranks in it), RLIMIT_AS and RLIMIT_DATA (each rank's).
  // Empty: MemAvailable alone.
  std::vector<MemoryLimit> host_limits = {};
  // RLIMIT_MEMLOCK's soft limit; UINT64_MAX: unlimited, or the process may lock any amount
  // (CAP_IPC_LOCK, as root has).
  uint64_t memlock_limit = UINT64_MAX;
  // Free bytes for an unprivileged writer at each nvme_path (a path missing here: it does
  // not exist or cannot be read; its error is in `disk_errors`).
  std::map<std::string, uint64_t> free_disk;
  std::map<std::string, std::string> disk_errors;
};

// Reads the memory limits (ReadMemoryLimits: /proc/meminfo, the process's cgroup, RLIMIT_AS
// and RLIMIT_DATA), getrlimit(RLIMIT_MEMLOCK) and statvfs of every path the plan uses (or of
// `paths`); `memory` gives the roots of /proc and /sys/fs/cgroup and the rlimit getter
// (tests), its host_budget is not read (CheckPlan takes strata.host_budget from the config).
Result<MachineFacts> ReadMachineFacts(const Plan& plan);
Result<MachineFacts> ReadMachineFacts(const std::vector<std::string>& paths);
Result<MachineFacts> ReadMachineFacts(const std::vector<std::string>& paths,
                                      const MemoryLimitOptions& memory);

struct CheckOptions {
  // The budgets in the config (the engine enforces both exactly as it allocates, and
  // checks the device budget against the real groups at start: it leaves them out here).
  bool device_budget = true;
  bool host_budget = true;
  // A path that does not exist or cannot be read (the engine leaves those to the swap
  // space, whose error names the config key).
  bool unusable_paths = true;
};

// The limits on the plan's host memory: MemAvailable, machine.host_limits and, with
// options.host_budget, strata.host_budget when set (a rank's).
std::vector<MemoryLimit> HostLimits(const Config& config, const MachineFacts& machine,
                                    const CheckOptions& options = {});
// Of those, the one that binds the plan: the least left to each of its node's ranks.
MemoryLimit BindingHostLimit(const Plan& plan, const Config& config, const MachineFacts& machine,
                             const CheckOptions& options = {});

// The memory a rank's plan may use: the binding limit's share per rank less
// strata.memory_reserve, or strata.host_budget when lower; `limit` says which (for
// FitToMemory's reasons). The engine gathers every rank's and fits to the least.
uint64_t PlanRoom(const Plan& plan, const Config& config, const MachineFacts& machine,
                  std::string& limit);

// "18.3 GiB of host memory available (MemAvailable), the plan needs 2.1 GiB per rank": the
// binding limit's room per rank ("to each of the 4 ranks on this machine" when they share
// it), its source and numbers; what `strata-config plan` prints when the plan fits.
std::string DescribeHostRoom(const Plan& plan, const Config& config, const MachineFacts& machine);

// Ok, or InvalidArgument naming every limit the plan exceeds, with the numbers and what to
// change: the host memory of the node's ranks above the limit that binds it (MemAvailable
// and a cgroup's limit are shared by the node's ranks, RLIMIT_AS and RLIMIT_DATA are each
// rank's: the message names the limit, its source and its numbers), a rank's pinned bytes
// above RLIMIT_MEMLOCK (unless strata.allow_unpinned), the node's swap bytes above the
// free space of a path (or a path that cannot be used), and (CheckOptions) device bytes
// above strata.device_budget, host bytes above strata.host_budget.
Status CheckPlan(const Plan& plan, const Config& config, const MachineFacts& machine,
                 const CheckOptions& options = {});

// --suggest: the cheapest placement that fits `machine`, trying in order the optimizer
// states in host memory with the working shards on the device, then the shards in host
// memory too, then the optimizer states on NVMe, then the shards on NVMe as well (their
// nvme_path: the config's, either section's). Within each placement, while the host cannot
// hold the plan (the limit that binds it, strata.host_budget, RLIMIT_MEMLOCK), it first
// lowers the keys that size host buffers, a notch at a time, the one that saves the most:
// zero_optimization.sub_group_size (down to 1e6 elements) and reduce_bucket_size (down to
// the largest group), then the NVMe buffer counts (down to the engine's least: 4, 4 x
// strata.swap_pipeline_depth with pipeline_read; 2 for the parameters). It never raises a
// buffer count: a section moved to NVMe keeps the config's (at least the engine's least)
// and pipelines the optimizer's reads and writes only when that count allows it. The
// config's other settings are kept.
struct Suggestion {
  Config config;        // the config with the placement
  Plan plan;            // its plan
  std::string snippet;  // the JSON (zero_optimization.offload_*, the sizes lowered) that sets it
  std::string tried;    // one line per placement that did not fit, with why
  // The keys lowered within the placement, from what to what, and why ("" when none).
  std::string lowered = "";
};
// NotFound (with every placement's reasons) when none fits; FailedPrecondition when NVMe
// is needed and the config names no nvme_path.
Result<Suggestion> SuggestPlan(const Config& config, const PlanInput& input,
                               const MachineFacts& machine);

}  // namespace strata

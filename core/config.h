// The configuration model: one JSON document in DeepSpeed's schema (so existing
// ds_config.json files work unchanged) plus Strata's own keys under "strata".
//
// Every key Strata knows is one row of a table (ConfigKeys()) with its type, default,
// range and meaning; validation, default filling and docs/config.md all come from that
// table. Validation is strict and collects every error at once:
//   - unknown key: its JSON path and the closest known key ("did you mean pin_memory?");
//   - wrong type, enum value or range: path, value and what was expected;
//   - a DeepSpeed key that Strata does not implement: "not supported by Strata";
//   - JSON syntax errors: line and column; duplicate keys: their path;
//   - derived values: train_batch_size = micro batch x accumulation x world size.
// Validation checks the document, not the machine: whether an nvme_path exists or a
// NUMA node is there is checked when the engine starts.
//
// Thread-safety: all functions are pure; the key table is immutable.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/logging.h"
#include "strata/core/status.h"

namespace strata {

// ---------------------------------------------------------------------------
// The key table.

enum class KeyType {
  kObject,     // a JSON object holding more keys
  kBool,       // true / false
  kInt,        // an integer (a JSON number with no fraction)
  kCount,      // a non-negative element count; 5e8 is accepted (DeepSpeed writes these so)
  kFloat,      // any number
  kBytes,      // bytes: a number or a string with a unit, "512MiB", "1.5G"
  kBandwidth,  // bytes per second: a number or "6.5GB/s"
  kString,     // free text
  kEnum,       // one of a fixed set of strings
  kPaths,      // one path or a list of paths; normalized to a list
  kFloatPair,  // [a, b]
};

std::string_view KeyTypeName(KeyType type);

struct KeySpec {
  std::string_view path;  // dotted JSON path, e.g. "zero_optimization.offload_optimizer.device"
  KeyType type = KeyType::kObject;
  // JSON text of the default; empty when the key has none (it stays absent unless given).
  std::string_view default_json = {};
  std::string_view meaning = {};
  double min = -std::numeric_limits<double>::infinity();  // inclusive bounds for numbers
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  std::string_view choices = {};  // kEnum: "none|cpu|nvme"
  std::string_view alias = {};    // another accepted spelling of the last path component
  // Only meaningful when the key `when_key` has one of the values `when_values` ("a|b").
  std::string_view when_key = {};
  std::string_view when_values = {};
  bool required = false;  // must be present whenever its parent object is (and `when` holds)
  // A DeepSpeed key Strata does not implement: refused with `not_supported`'s reason,
  // except when its value is `inert_json` (a value that asks for nothing, like false).
  std::string_view not_supported = {};
  std::string_view inert_json = {};
};

// The table, parents before children, in documentation order.
std::span<const KeySpec> ConfigKeys();
// The row for a dotted path (aliases resolved), or nullptr.
const KeySpec* FindConfigKey(std::string_view path);

// docs/config.md, generated from the table (a test checks the file matches).
std::string ConfigReferenceMarkdown();
// A plain-text table for `strata-config defaults`.
std::string ConfigKeysText();

// ---------------------------------------------------------------------------
// Validation.

struct ConfigError {
  std::string path;  // dotted JSON path ("" for the document, or a syntax error)
  std::string message;
  int line = 0;  // for syntax errors: 1-based line and column
  int column = 0;
  std::string ToString() const;  // "path: message" or "line L, column C: message"
};

struct ValidateOptions {
  int world_size = 1;  // for train_batch_size = micro x accumulation x world size
};

struct ValidationResult {
  std::vector<ConfigError> errors;
  // The document with every default filled, aliases resolved, sizes in bytes,
  // nvme_path as a list and the derived batch sizes; null when there are errors.
  nlohmann::ordered_json normalized;
  // The paths the document itself set (aliases as the keys they name): the rest took
  // their defaults.
  std::set<std::string> given;
  bool ok() const { return errors.empty(); }
  // One error per line; ready to print.
  std::string ErrorsToString() const;
};

ValidationResult ValidateConfigJson(std::string_view json_text,
                                    const ValidateOptions& options = {});
// Reads the file; an unreadable file is one error naming the path.
ValidationResult ValidateConfigFile(const std::string& path, const ValidateOptions& options = {});

// ---------------------------------------------------------------------------
// The typed view of a valid configuration, built from the normalized document.

enum class OffloadDevice { kNone, kCpu, kNvme };
enum class OptimizerType { kAdam, kAdamW, kLamb };
enum class SchedulerType {
  kNone,
  kWarmupLR,
  kWarmupDecayLR,
  kWarmupCosineLR,
  kOneCycle,
  kLRRangeTest
};
enum class WarmupType { kLog, kLinear };

std::string_view OffloadDeviceName(OffloadDevice d);

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdam;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  // Decoupled weight decay (AdamW). DeepSpeed's "Adam" defaults to true as well.
  bool adam_w_mode = true;
  // Lamb: the trust ratio's clamp and where eps goes (DeepSpeed FusedLamb's).
  double max_coeff = 10.0;
  double min_coeff = 0.01;
  bool eps_inside_sqrt = false;
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  int64_t total_num_steps = 0;    // WarmupDecayLR, WarmupCosineLR
  double warmup_min_ratio = 0.0;  // WarmupCosineLR
  double cos_min_ratio = 1e-4;    // WarmupCosineLR
  // OneCycle (DeepSpeed's): a cycle up from cycle_min_lr to cycle_max_lr and back, the
  // momentum (Adam's beta1) the other way, then an optional decay.
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  int64_t cycle_second_step_size = 0;     // 0: cycle_first_step_size
  int64_t cycle_first_stair_count = 0;    // 0: no staircase
  int64_t cycle_second_stair_count = -1;  // -1: cycle_first_stair_count
  int64_t decay_step_size = 0;            // 0: no decay after the cycle
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // LRRangeTest (DeepSpeed's): lr = min_lr * (1 + step_rate * interval), interval =
  // (i + 1) / step_size, floored with staircase.
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
  int64_t last_batch_iteration = -1;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0 = dynamic
  int initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
};

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;
  bool pin_memory = false;
  int buffer_count = 4;
  int64_t buffer_size = 100000000;  // offload_param only (elements)
  int64_t max_in_cpu = 1000000000;  // offload_param only (elements)
  bool pipeline_read = false;       // offload_optimizer only
  bool pipeline_write = false;      // offload_optimizer only
  bool fast_init = false;           // offload_optimizer only
};

struct ZeroConfig {
  int stage = 3;
  bool contiguous_gradients = true;
  bool overlap_comm = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;
  int64_t sub_group_size = 1000000000;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_param_persistence_threshold = 100000;
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;
};

struct AioConfig {
  uint64_t block_size = 1048576;
  int queue_depth = 8;
  int intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
};

enum class ComputeDevice : uint8_t { kAuto, kCpu, kCuda };  // strata.device

struct StrataConfig {
  ComputeDevice device = ComputeDevice::kAuto;
  uint64_t device_budget = 0;  // 0 = CUDA: half the free HBM; CPU device: no arena
  uint64_t host_budget = 0;    // 0 = no limit beyond the process's (core/memory_limit.h)
  // Per rank, left out of the room the plan must fit: what the engine's buffers do not hold
  // (a load's chunk, torch's first step, activations).
  uint64_t memory_reserve = uint64_t{256} << 20;
  bool allow_unpinned = false;
  int numa_node = -1;        // -1 = the node of the GPU (or the local node)
  int cpu_adam_threads = 0;  // 0 = this rank's share of the cores it may use
  bool swap_checksums = true;
  bool pipeline_step = true;             // the CPU step overlaps the next forward
  bool early_step = false;               // a group's update starts during the backward
  bool norm_in_backward = true;          // the gradient norm is summed during the backward (#20)
  bool accumulate_in_background = true;  // reduced shards added off the backward's thread
  bool accumulate_on_device = true;      // micro-steps' gradients summed in device memory
  bool delayed_update = false;           // step i's update beside step i+1's forward/backward
  int delayed_update_warmup = 40;        // exact steps before the delayed update begins
  bool nccl_lanes = true;                // CUDA: reductions and all-gathers on NCCL lanes
  bool skip_inf_nan_steps = true;
  int swap_pipeline_depth = 2;
  double nvme_read_bandwidth = 0;  // bytes/s as measured by nvme_bench; 0 = unknown
  double nvme_write_bandwidth = 0;
  LogLevel log_level = LogLevel::kInfo;
};

struct ActivationCheckpointingConfig {
  bool cpu_checkpointing = false;  // saved inputs in (pinned) host memory
};

struct Config {
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;  // 0 = off
  int64_t steps_per_print = 10;
  int64_t seed = 42;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  bool bf16 = false;
  ZeroConfig zero;
  AioConfig aio;
  StrataConfig strata;
  ActivationCheckpointingConfig activation_checkpointing;
  int world_size = 1;                 // what the batch sizes were checked against
  nlohmann::ordered_json normalized;  // the document this was built from
  // The dotted paths the document set (ValidationResult::given); a key not among them holds
  // its default, which the engine may size from the model (docs/tuning.md).
  std::set<std::string> given;
  bool Given(std::string_view path) const { return given.count(std::string(path)) != 0; }
};

// Validates and builds the typed view. On failure the Status (InvalidArgument) lists
// every error, one per line.
Result<Config> ParseConfig(std::string_view json_text, const ValidateOptions& options = {});
Result<Config> LoadConfigFile(const std::string& path, const ValidateOptions& options = {});

}  // namespace strata

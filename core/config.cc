// The configuration: the key table's index and the helpers on key paths, the JSON text
// parsed with positions and duplicate keys, the typed view of a normalized document, and the
// entry points (validate, parse, load). The keys themselves are in config_keys.cc; the
// validation of one document in config_validate.cc.
#include "strata/core/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/config_internal.h"

namespace strata {

// NOLINTNEXTLINE(google-build-using-namespace): config_internal.h is this file's own.
using namespace config_internal;

std::string_view KeyTypeName(KeyType type) {
  switch (type) {
    case KeyType::kObject:
      return "object";
    case KeyType::kBool:
      return "boolean";
    case KeyType::kInt:
      return "integer";
    case KeyType::kCount:
      return "count";
    case KeyType::kFloat:
      return "number";
    case KeyType::kBytes:
      return "bytes";
    case KeyType::kBandwidth:
      return "bytes/s";
    case KeyType::kString:
      return "string";
    case KeyType::kEnum:
      return "enum";
    case KeyType::kPaths:
      return "path or [paths]";
    case KeyType::kFloatPair:
      return "[number, number]";
  }
  return "?";
}

std::string_view OffloadDeviceName(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

std::string ConfigError::ToString() const {
  if (line > 0) {
    return "line " + std::to_string(line) + ", column " + std::to_string(column) + ": " + message;
  }
  if (path.empty()) return message;
  return path + ": " + message;
}

std::string ValidationResult::ErrorsToString() const {
  std::string out;
  for (const ConfigError& e : errors)
    out += e.ToString() + "\n";
  return out;
}

namespace config_internal {

// ---------------------------------------------------------------------------
// Small helpers.

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string_view::npos ? s.npos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return out;
}

std::string Join(const std::vector<std::string_view>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

std::string_view Parent(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

std::string_view LastComponent(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

std::string JoinPath(std::string_view prefix, std::string_view key) {
  if (prefix.empty()) return std::string(key);
  return std::string(prefix) + "." + std::string(key);
}

// "/a/b/c" for "a.b.c".
ojson::json_pointer Pointer(std::string_view path) {
  std::string p;
  for (std::string_view part : Split(path, '.')) {
    p += "/";
    p += part;
  }
  return ojson::json_pointer(p);
}

// Edit distance on keys with case, '_' and '-' ignored, so "pinmemory" ~ "pin_memory".
std::string Squash(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '_' || c == '-') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string DescribeValue(const json& v) {
  std::string dump = v.dump();
  if (dump.size() > 60) dump = dump.substr(0, 57) + "...";
  const char* kind = v.is_string()    ? "string "
                     : v.is_boolean() ? "boolean "
                     : v.is_number()  ? "number "
                     : v.is_array()   ? "array "
                     : v.is_object()  ? "object "
                                      : "";
  return std::string(kind) + dump;
}

std::string FormatNumber(double v) {
  std::ostringstream os;
  os.precision(15);
  os << v;
  return os.str();
}

// ---------------------------------------------------------------------------
// The table, indexed.

Index::Index() {
  for (const KeySpec& k : ConfigKeys()) {
    STRATA_CHECK(by_path.emplace(std::string(k.path), &k).second) << "duplicate key " << k.path;
    const std::string_view parent = Parent(k.path);
    STRATA_CHECK(parent.empty() || by_path.count(parent)) << k.path << " before its parent";
    children[std::string(parent)].push_back(&k);
    if (!k.alias.empty()) by_alias_path.emplace(JoinPath(parent, k.alias), &k);
  }
}

const Index& GetIndex() {
  static const Index* index = new Index();
  return *index;
}

// Canonical spelling of an enum value (case-insensitive match), or empty.
std::string_view MatchChoice(const KeySpec& spec, std::string_view value) {
  const std::string lower = Lower(value);
  for (std::string_view c : Split(spec.choices, '|')) {
    if (Lower(c) == lower) return c;
  }
  return {};
}

}  // namespace config_internal

namespace {

// ---------------------------------------------------------------------------
// Parsing with line/column and duplicate-key detection.

struct Frame {
  std::string path;
  std::set<std::string> keys;
  std::string current;
  bool is_array = false;
};

std::pair<int, int> LineColumn(std::string_view text, size_t byte) {
  // nlohmann reports the 1-based position of the last character read.
  size_t end = std::min(byte == 0 ? 0 : byte - 1, text.size());
  int line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < end; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, static_cast<int>(end - line_start + 1)};
}

std::optional<json> ParseJson(std::string_view text, std::vector<ConfigError>& errors) {
  std::vector<Frame> stack;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start: {
        Frame f;
        if (!stack.empty()) {
          const Frame& parent = stack.back();
          f.path = parent.is_array ? parent.path + "[]" : JoinPath(parent.path, parent.current);
        }
        f.is_array = event == json::parse_event_t::array_start;
        stack.push_back(std::move(f));
        break;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& f = stack.back();
        f.current = parsed.get<std::string>();
        if (!f.keys.insert(f.current).second) {
          errors.push_back({JoinPath(f.path, f.current),
                            "duplicate key (JSON readers disagree on which value wins; keep "
                            "one)"});
        }
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    auto [line, column] = LineColumn(text, e.byte);
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error ..."
    size_t col = what.find("column ");
    size_t colon = col == std::string::npos ? std::string::npos : what.find(": ", col);
    std::string detail = colon == std::string::npos ? what : what.substr(colon + 2);
    errors.push_back({"", "JSON syntax error: " + detail, line, column});
    return std::nullopt;
  } catch (const json::exception& e) {
    // out_of_range.406 "number overflow parsing '1e400'" carries no position: point at
    // the first occurrence of the number in the text.
    std::string what = e.what();
    if (size_t bracket = what.find("] "); bracket != std::string::npos) {
      what = what.substr(bracket + 2);
    }
    int line = 0, column = 0;
    const size_t open = what.find('\'');
    const size_t close = open == std::string::npos ? open : what.find('\'', open + 1);
    if (close != std::string::npos && close > open + 1) {
      const size_t at = text.find(what.substr(open + 1, close - open - 1));
      if (at != std::string_view::npos) std::tie(line, column) = LineColumn(text, at + 1);
    }
    errors.push_back({"", "JSON error: " + what, line, column});
    return std::nullopt;
  }
}

// ---------------------------------------------------------------------------
// Typed view.

template <typename T>
T Get(const ojson& doc, std::string_view path) {
  return doc.at(Pointer(path)).get<T>();
}

OffloadConfig ReadOffload(const ojson& doc, const std::string& base) {
  OffloadConfig o;
  const std::string device = Get<std::string>(doc, base + ".device");
  o.device = device == "cpu"    ? OffloadDevice::kCpu
             : device == "nvme" ? OffloadDevice::kNvme
                                : OffloadDevice::kNone;
  if (doc.contains(Pointer(base + ".nvme_path"))) {
    o.nvme_path = Get<std::vector<std::string>>(doc, base + ".nvme_path");
  }
  o.pin_memory = Get<bool>(doc, base + ".pin_memory");
  o.buffer_count = Get<int>(doc, base + ".buffer_count");
  if (base.ends_with("offload_param")) {
    o.buffer_size = Get<int64_t>(doc, base + ".buffer_size");
    o.max_in_cpu = Get<int64_t>(doc, base + ".max_in_cpu");
  } else {
    o.pipeline_read = Get<bool>(doc, base + ".pipeline_read");
    o.pipeline_write = Get<bool>(doc, base + ".pipeline_write");
    o.fast_init = Get<bool>(doc, base + ".fast_init");
  }
  return o;
}

Config BuildConfig(const ojson& doc, int world_size) {
  Config c;
  c.world_size = world_size;
  c.normalized = doc;
  c.train_batch_size = Get<int64_t>(doc, "train_batch_size");
  c.train_micro_batch_size_per_gpu = Get<int64_t>(doc, "train_micro_batch_size_per_gpu");
  c.gradient_accumulation_steps = Get<int64_t>(doc, "gradient_accumulation_steps");
  c.gradient_clipping = Get<double>(doc, "gradient_clipping");
  c.steps_per_print = Get<int64_t>(doc, "steps_per_print");
  c.seed = Get<int64_t>(doc, "seed");

  OptimizerConfig& o = c.optimizer;
  const std::string optimizer_type = Get<std::string>(doc, "optimizer.type");
  o.type = optimizer_type == "AdamW"  ? OptimizerType::kAdamW
           : optimizer_type == "Lamb" ? OptimizerType::kLamb
                                      : OptimizerType::kAdam;
  o.lr = Get<double>(doc, "optimizer.params.lr");
  const auto betas = Get<std::vector<double>>(doc, "optimizer.params.betas");
  o.beta1 = betas[0];
  o.beta2 = betas[1];
  o.eps = Get<double>(doc, "optimizer.params.eps");
  o.weight_decay = Get<double>(doc, "optimizer.params.weight_decay");
  o.bias_correction = Get<bool>(doc, "optimizer.params.bias_correction");
  if (o.type == OptimizerType::kLamb) {
    o.max_coeff = Get<double>(doc, "optimizer.params.max_coeff");
    o.min_coeff = Get<double>(doc, "optimizer.params.min_coeff");
    o.eps_inside_sqrt = Get<bool>(doc, "optimizer.params.eps_inside_sqrt");
  } else {
    o.adam_w_mode = Get<bool>(doc, "optimizer.params.adam_w_mode");
  }

  if (doc.contains("scheduler")) {
    SchedulerConfig& s = c.scheduler;
    const std::string type = Get<std::string>(doc, "scheduler.type");
    s.type = type == "WarmupLR"         ? SchedulerType::kWarmupLR
             : type == "WarmupDecayLR"  ? SchedulerType::kWarmupDecayLR
             : type == "WarmupCosineLR" ? SchedulerType::kWarmupCosineLR
             : type == "OneCycle"       ? SchedulerType::kOneCycle
                                        : SchedulerType::kLRRangeTest;
    auto opt = [&](std::string_view key, auto& field) {
      const std::string p = "scheduler.params." + std::string(key);
      if (doc.contains(Pointer(p))) field = Get<std::decay_t<decltype(field)>>(doc, p);
    };
    opt("warmup_min_lr", s.warmup_min_lr);
    opt("warmup_max_lr", s.warmup_max_lr);
    opt("warmup_num_steps", s.warmup_num_steps);
    opt("total_num_steps", s.total_num_steps);
    opt("warmup_min_ratio", s.warmup_min_ratio);
    opt("cos_min_ratio", s.cos_min_ratio);
    opt("last_batch_iteration", s.last_batch_iteration);
    opt("cycle_min_lr", s.cycle_min_lr);
    opt("cycle_max_lr", s.cycle_max_lr);
    opt("decay_lr_rate", s.decay_lr_rate);
    opt("cycle_first_step_size", s.cycle_first_step_size);
    opt("cycle_second_step_size", s.cycle_second_step_size);
    opt("cycle_first_stair_count", s.cycle_first_stair_count);
    opt("cycle_second_stair_count", s.cycle_second_stair_count);
    opt("decay_step_size", s.decay_step_size);
    opt("cycle_momentum", s.cycle_momentum);
    opt("cycle_min_mom", s.cycle_min_mom);
    opt("cycle_max_mom", s.cycle_max_mom);
    opt("decay_mom_rate", s.decay_mom_rate);
    opt("lr_range_test_min_lr", s.lr_range_test_min_lr);
    opt("lr_range_test_step_size", s.lr_range_test_step_size);
    opt("lr_range_test_step_rate", s.lr_range_test_step_rate);
    opt("lr_range_test_staircase", s.lr_range_test_staircase);
    std::string wt = "log";
    opt("warmup_type", wt);
    s.warmup_type = wt == "linear" ? WarmupType::kLinear : WarmupType::kLog;
  }

  Fp16Config& f = c.fp16;
  f.enabled = Get<bool>(doc, "fp16.enabled");
  f.loss_scale = Get<double>(doc, "fp16.loss_scale");
  f.initial_scale_power = Get<int>(doc, "fp16.initial_scale_power");
  f.loss_scale_window = Get<int64_t>(doc, "fp16.loss_scale_window");
  f.hysteresis = Get<int>(doc, "fp16.hysteresis");
  f.consecutive_hysteresis = Get<bool>(doc, "fp16.consecutive_hysteresis");
  f.min_loss_scale = Get<double>(doc, "fp16.min_loss_scale");
  c.bf16 = Get<bool>(doc, "bf16.enabled");

  ZeroConfig& z = c.zero;
  const std::string zo = "zero_optimization.";
  z.stage = Get<int>(doc, zo + "stage");
  z.contiguous_gradients = Get<bool>(doc, zo + "contiguous_gradients");
  z.overlap_comm = Get<bool>(doc, zo + "overlap_comm");
  z.reduce_scatter = Get<bool>(doc, zo + "reduce_scatter");
  z.reduce_bucket_size = Get<int64_t>(doc, zo + "reduce_bucket_size");
  z.allgather_bucket_size = Get<int64_t>(doc, zo + "allgather_bucket_size");
  z.sub_group_size = Get<int64_t>(doc, zo + "sub_group_size");
  z.stage3_prefetch_bucket_size = Get<int64_t>(doc, zo + "stage3_prefetch_bucket_size");
  z.stage3_param_persistence_threshold =
      Get<int64_t>(doc, zo + "stage3_param_persistence_threshold");
  z.stage3_model_persistence_threshold =
      Get<int64_t>(doc, zo + "stage3_model_persistence_threshold");
  z.stage3_max_live_parameters = Get<int64_t>(doc, zo + "stage3_max_live_parameters");
  z.stage3_max_reuse_distance = Get<int64_t>(doc, zo + "stage3_max_reuse_distance");
  z.stage3_gather_16bit_weights_on_model_save =
      Get<bool>(doc, zo + "stage3_gather_16bit_weights_on_model_save");
  z.offload_optimizer = ReadOffload(doc, zo + "offload_optimizer");
  z.offload_param = ReadOffload(doc, zo + "offload_param");

  AioConfig& a = c.aio;
  a.block_size = Get<uint64_t>(doc, "aio.block_size");
  a.queue_depth = Get<int>(doc, "aio.queue_depth");
  a.intra_op_parallelism = Get<int>(doc, "aio.intra_op_parallelism");
  a.single_submit = Get<bool>(doc, "aio.single_submit");
  a.overlap_events = Get<bool>(doc, "aio.overlap_events");

  StrataConfig& s = c.strata;
  const std::string device = Get<std::string>(doc, "strata.device");
  s.device = device == "cpu"    ? ComputeDevice::kCpu
             : device == "cuda" ? ComputeDevice::kCuda
                                : ComputeDevice::kAuto;
  s.device_budget = Get<uint64_t>(doc, "strata.device_budget");
  s.host_budget = Get<uint64_t>(doc, "strata.host_budget");
  s.memory_reserve = Get<uint64_t>(doc, "strata.memory_reserve");
  s.allow_unpinned = Get<bool>(doc, "strata.allow_unpinned");
  s.numa_node = Get<int>(doc, "strata.numa_node");
  s.cpu_adam_threads = Get<int>(doc, "strata.cpu_adam_threads");
  s.swap_checksums = Get<bool>(doc, "strata.swap_checksums");
  s.pipeline_step = Get<bool>(doc, "strata.pipeline_step");
  s.early_step = Get<bool>(doc, "strata.early_step");
  s.norm_in_backward = Get<bool>(doc, "strata.norm_in_backward");
  s.accumulate_in_background = Get<bool>(doc, "strata.accumulate_in_background");
  s.accumulate_on_device = Get<bool>(doc, "strata.accumulate_on_device");
  s.delayed_update = Get<bool>(doc, "strata.delayed_update");
  s.delayed_update_warmup = Get<int>(doc, "strata.delayed_update_warmup");
  s.nccl_lanes = Get<bool>(doc, "strata.nccl_lanes");
  s.skip_inf_nan_steps = Get<bool>(doc, "strata.skip_inf_nan_steps");
  s.swap_pipeline_depth = Get<int>(doc, "strata.swap_pipeline_depth");
  s.nvme_read_bandwidth = Get<double>(doc, "strata.nvme_read_bandwidth");
  s.nvme_write_bandwidth = Get<double>(doc, "strata.nvme_write_bandwidth");
  s.log_level = ParseLogLevel(Get<std::string>(doc, "strata.log_level")).value();

  // Present only when the section was given.
  if (doc.contains(Pointer("activation_checkpointing.cpu_checkpointing"))) {
    c.activation_checkpointing.cpu_checkpointing =
        Get<bool>(doc, "activation_checkpointing.cpu_checkpointing");
  }
  return c;
}

Result<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open config file " + path);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "cannot stat config file " + path);
  if (S_ISDIR(st.st_mode)) return ErrnoError(EISDIR, "cannot read config file " + path);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "cannot read config file " + path);
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  return text;
}

}  // namespace

const KeySpec* FindConfigKey(std::string_view path) {
  const Index& index = GetIndex();
  if (auto it = index.by_path.find(path); it != index.by_path.end()) return it->second;
  if (auto it = index.by_alias_path.find(path); it != index.by_alias_path.end()) {
    return it->second;
  }
  return nullptr;
}

namespace {
// Every path `node` sets under `prefix`, objects and leaves, each as the key it names.
void CollectGiven(const json& node, const std::string& prefix, std::set<std::string>& out) {
  if (!node.is_object()) return;
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string path = prefix + it.key();
    const KeySpec* spec = FindConfigKey(path);
    out.insert(spec != nullptr ? std::string(spec->path) : path);
    CollectGiven(it.value(), path + ".", out);
  }
}
}  // namespace

ValidationResult ValidateConfigJson(std::string_view json_text, const ValidateOptions& options) {
  ValidationResult result;
  std::optional<json> doc = ParseJson(json_text, result.errors);
  if (!doc) return result;
  CollectGiven(*doc, "", result.given);
  // Duplicate keys were reported by the parser; report the rest as well.
  result.normalized = ValidateDocument(*doc, options, result.errors);
  if (!result.errors.empty()) result.normalized = nullptr;
  return result;
}

ValidationResult ValidateConfigFile(const std::string& path, const ValidateOptions& options) {
  auto text = ReadFile(path);
  if (!text.ok()) {
    ValidationResult r;
    r.errors.push_back({"", text.status().message()});
    return r;
  }
  return ValidateConfigJson(*text, options);
}

Result<Config> ParseConfig(std::string_view json_text, const ValidateOptions& options) {
  ValidationResult r = ValidateConfigJson(json_text, options);
  if (!r.ok()) {
    std::string msg = "invalid configuration (" + std::to_string(r.errors.size()) + " error" +
                      (r.errors.size() == 1 ? "" : "s") + "):\n" + r.ErrorsToString();
    msg.pop_back();
    return InvalidArgumentError(std::move(msg));
  }
  Config c = BuildConfig(r.normalized, options.world_size);
  c.given = std::move(r.given);
  return c;
}

Result<Config> LoadConfigFile(const std::string& path, const ValidateOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  auto config = ParseConfig(text, options);
  if (!config.ok()) return config.status().WithContext(path);
  return config;
}

}  // namespace strata

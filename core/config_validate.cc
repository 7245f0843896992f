// The validation of one configuration document (config_internal.h, ValidateDocument): the
// Validator walks the given keys against the table (config_keys.cc), converts each leaf to
// its normalized form, builds the normalized document in table order with the defaults, and
// then checks the keys against each other.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/config_internal.h"

namespace strata::config_internal {

namespace {

class Validator {
 public:
  Validator(const json& doc, const ValidateOptions& options, std::vector<ConfigError>& errors)
      : doc_(doc), options_(options), errors_(errors), index_(GetIndex()) {}

  ojson Run() {
    if (!doc_.is_object()) {
      Error("", "the configuration must be a JSON object ({...}), got " + DescribeValue(doc_));
      return nullptr;
    }
    present_objects_.insert("");
    CheckObject(doc_, "");
    ojson out = Normalize();
    CrossChecks(out);
    if (!errors_.empty()) return nullptr;
    return out;
  }

 private:
  void Error(std::string path, std::string message) {
    errors_.push_back({std::move(path), std::move(message)});
  }

  // Looks up a key given at `path`; resolves aliases.
  const KeySpec* Lookup(const std::string& path) const {
    if (auto it = index_.by_path.find(path); it != index_.by_path.end()) return it->second;
    if (auto it = index_.by_alias_path.find(path); it != index_.by_alias_path.end()) {
      return it->second;
    }
    return nullptr;
  }

  std::string Suggest(const std::string& prefix, const std::string& key) const {
    if (key.find('.') != std::string::npos) {
      // {"zero_optimization.stage": 3}: a dotted path written as one key.
      const size_t dot = key.find('.');
      return "unknown key; a JSON key is one name, not a dotted path: write {\"" +
             key.substr(0, dot) + "\": {\"" + key.substr(dot + 1) + "\": ...}}";
    }
    const std::string squashed = Squash(key);
    const KeySpec* best = nullptr;
    size_t best_d = std::string::npos;
    std::vector<std::string_view> siblings;
    if (auto it = index_.children.find(prefix); it != index_.children.end()) {
      for (const KeySpec* k : it->second) {
        if (!k->not_supported.empty()) continue;
        siblings.push_back(LastComponent(k->path));
        for (std::string_view name : {LastComponent(k->path), k->alias}) {
          if (name.empty()) continue;
          size_t d = EditDistance(squashed, Squash(name));
          if (d < best_d) {
            best_d = d;
            best = k;
          }
        }
      }
    }
    // The same spelling up to case, '_' and '-': surely that key.
    if (best && best_d == 0) {
      return "unknown key; did you mean " + std::string(LastComponent(best->path)) + "?";
    }
    // The same name (up to case, '_' and '-') elsewhere in the table: probably put at the
    // wrong level.
    std::vector<std::string_view> elsewhere;
    std::vector<std::string> elsewhere_alias;
    for (const KeySpec& k : ConfigKeys()) {
      if (!k.not_supported.empty()) continue;
      if (Squash(LastComponent(k.path)) == squashed) elsewhere.push_back(k.path);
      if (!k.alias.empty() && Squash(k.alias) == squashed) {
        elsewhere_alias.push_back(JoinPath(Parent(k.path), k.alias));
      }
    }
    for (const std::string& a : elsewhere_alias) {
      elsewhere.push_back(a);
    }
    if (!elsewhere.empty()) {
      return "unknown key here; did you mean " + Join(elsewhere, " or ") + "?";
    }
    const size_t threshold = std::max<size_t>(2, squashed.size() / 3);
    if (best && best_d <= threshold) {
      return "unknown key; did you mean " + std::string(LastComponent(best->path)) + "?";
    }
    if (siblings.empty()) return "unknown key";
    return "unknown key; known keys here: " + Join(siblings, ", ");
  }

  bool Inert(const KeySpec& spec, const json& value) const {
    if (spec.inert_json.empty()) return false;
    const json inert = json::parse(spec.inert_json);
    if (inert.is_object() && inert.contains("enabled")) {
      // {"enabled": false} and any other settings of a disabled feature ask for nothing.
      return value.is_object() && value.contains("enabled") && value["enabled"] == false;
    }
    return value == inert;
  }

  // Whether a `when` condition holds in the raw document. kUnknown when the condition's
  // key is absent or invalid (reported on its own): the parameters are then neither
  // refused nor required nor defaulted, so a bad scheduler.type is reported once.
  enum class When { kHolds, kFails, kUnknown };
  When WhenHolds(const KeySpec& spec) const {
    if (spec.when_key.empty()) return When::kHolds;
    const std::string_view canonical = WhenValue(spec);
    if (canonical.empty()) return When::kUnknown;
    for (std::string_view w : Split(spec.when_values, '|')) {
      if (w == canonical) return When::kHolds;
    }
    return When::kFails;
  }
  // The canonical value of the key spec.when_key: as given, else its default (an absent
  // optimizer.type is "Adam"); empty when absent without a default, or invalid.
  std::string_view WhenValue(const KeySpec& spec) const {
    const KeySpec* cond = index_.by_path.at(std::string(spec.when_key));
    const json* v = RawAt(spec.when_key);
    json default_value;
    if (v == nullptr && !cond->default_json.empty()) {
      default_value = json::parse(cond->default_json);
      v = &default_value;
    }
    if (v == nullptr || !v->is_string()) return {};
    return MatchChoice(*cond, v->get<std::string>());
  }

  const json* RawAt(std::string_view path) const {
    const json* cur = &doc_;
    for (std::string_view part : Split(path, '.')) {
      if (!cur->is_object()) return nullptr;
      auto it = cur->find(std::string(part));
      if (it == cur->end()) return nullptr;
      cur = &*it;
    }
    return cur;
  }

  void CheckObject(const json& obj, const std::string& prefix) {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      const std::string path = JoinPath(prefix, it.key());
      // A key is one path component; "offload_param.device" is not a path here.
      const KeySpec* spec = it.key().find('.') == std::string::npos ? Lookup(path) : nullptr;
      if (spec == nullptr) {
        Error(path, Suggest(prefix, it.key()));
        continue;
      }
      const std::string canonical(spec->path);
      if (canonical != path && obj.contains(std::string(LastComponent(canonical)))) {
        Error(path, "both " + std::string(LastComponent(canonical)) + " and its alias " + it.key() +
                        " are given; keep one");
        continue;
      }
      if (!spec->not_supported.empty()) {
        if (!Inert(*spec, it.value())) {
          Error(path, "not supported by Strata: " + std::string(spec->not_supported) +
                          "; remove the key");
        }
        continue;
      }
      if (WhenHolds(*spec) == When::kFails) {
        const std::string_view value = WhenValue(*spec);
        Error(path, "not a parameter of " + std::string(spec->when_key) + " " + std::string(value) +
                        " (it applies to " + Join(Split(spec->when_values, '|'), ", ") + ")");
        continue;
      }
      if (spec->type == KeyType::kObject) {
        if (!it.value().is_object()) {
          Error(path, "expected an object ({...}), got " + DescribeValue(it.value()));
          continue;
        }
        // An object whose every key is refused unless inert (activation_checkpointing)
        // asks for nothing once accepted: the normalized document leaves it out.
        if (HasSupportedKeyUnder(canonical)) present_objects_.insert(canonical);
        CheckObject(it.value(), canonical);
        continue;
      }
      if (auto v = Convert(*spec, it.value(), path)) leaves_[canonical] = std::move(*v);
    }
  }

  static bool HasSupportedKeyUnder(const std::string& object) {
    const std::string prefix = object + ".";
    for (const KeySpec& k : ConfigKeys()) {
      if (k.path.substr(0, prefix.size()) == prefix && k.not_supported.empty()) return true;
    }
    return false;
  }

  std::string AutoHint(const json& value) const {
    if (value.is_string() && value.get<std::string>() == "auto") {
      return "; \"auto\" is a placeholder that the Hugging Face Trainer fills in, Strata needs "
             "the value itself";
    }
    return "";
  }

  bool CheckRange(const KeySpec& spec, double v, const std::string& path,
                  const std::string& shown) {
    const bool low = spec.min_exclusive ? v <= spec.min : v < spec.min;
    const bool high = v > spec.max;
    if (!low && !high) return true;
    std::string expect;
    const std::string lo = FormatNumber(spec.min), hi = FormatNumber(spec.max);
    if (std::isinf(spec.max)) {
      expect = (spec.min_exclusive ? "> " : ">= ") + lo;
    } else if (std::isinf(spec.min)) {
      expect = "<= " + hi;
    } else {
      expect = "between " + lo + " and " + hi;
    }
    Error(path, shown + " is out of range; expected a value " + expect);
    return false;
  }

  // Validates one leaf and returns its normalized form.
  std::optional<ojson> Convert(const KeySpec& spec, const json& v, const std::string& path) {
    auto type_error = [&](std::string_view expected) {
      Error(path, "expected " + std::string(expected) + ", got " + DescribeValue(v) + AutoHint(v));
      return std::nullopt;
    };
    switch (spec.type) {
      case KeyType::kObject:
        break;  // handled by the caller
      case KeyType::kBool:
        if (!v.is_boolean()) return type_error("true or false");
        return ojson(v.get<bool>());
      case KeyType::kInt:
      case KeyType::kCount: {
        const bool count = spec.type == KeyType::kCount;
        if (!v.is_number())
          return type_error(count ? "a non-negative whole number" : "a whole number");
        const double d = v.get<double>();
        if (v.is_number_float() && d != std::floor(d)) {
          return type_error(count ? "a non-negative whole number" : "a whole number");
        }
        if (count && d < 0) return type_error("a non-negative whole number");
        // Beyond int64: 2^63 and up as a float, or an unsigned integer above INT64_MAX.
        if ((v.is_number_float() && std::fabs(d) >= 9223372036854775808.0) ||
            (v.is_number_unsigned() &&
             v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
          Error(path, v.dump() + " is out of range; expected a whole number below 2^63");
          return std::nullopt;
        }
        if (!CheckRange(spec, d, path, v.dump())) return std::nullopt;
        const int64_t i = v.is_number_float() ? static_cast<int64_t>(d) : v.get<int64_t>();
        return ojson(i);
      }
      case KeyType::kFloat: {
        if (!v.is_number()) return type_error("a number");
        const double d = v.get<double>();
        if (!CheckRange(spec, d, path, v.dump())) return std::nullopt;
        return ojson(d);
      }
      case KeyType::kBytes: {
        if (!v.is_number() && !v.is_string()) {
          return type_error("a byte size (a number or a string like \"512MiB\")");
        }
        // Integers are taken exactly (a double holds only 53 bits).
        Result<uint64_t> bytes = v.is_number_unsigned() ? Result<uint64_t>(v.get<uint64_t>())
                                 : v.is_number()        ? BytesFromDouble(v.get<double>())
                                                        : ParseBytes(v.get<std::string>());
        if (!bytes.ok()) {
          Error(path, bytes.status().message() + AutoHint(v));
          return std::nullopt;
        }
        if (!CheckRange(spec, static_cast<double>(*bytes), path,
                        v.dump() + " (" + FormatBytes(*bytes) + ")")) {
          return std::nullopt;
        }
        return ojson(*bytes);
      }
      case KeyType::kBandwidth: {
        double rate = 0;
        if (v.is_number()) {
          rate = v.get<double>();
          if (rate < 0) {
            Error(path, v.dump() + ": a bandwidth cannot be negative");
            return std::nullopt;
          }
        } else if (v.is_string()) {
          auto parsed = ParseByteRate(v.get<std::string>());
          if (!parsed.ok()) {
            Error(path, parsed.status().message() + AutoHint(v));
            return std::nullopt;
          }
          rate = *parsed;
        } else {
          return type_error("bytes per second (a number or \"6.5GB/s\")");
        }
        if (!CheckRange(spec, rate, path, v.dump())) return std::nullopt;
        return ojson(rate);
      }
      case KeyType::kString:
        if (!v.is_string()) return type_error("a string");
        return ojson(v.get<std::string>());
      case KeyType::kEnum: {
        const std::vector<std::string_view> choices = Split(spec.choices, '|');
        if (!v.is_string()) return type_error("one of " + Join(choices, ", "));
        std::string_view canonical = MatchChoice(spec, v.get<std::string>());
        if (canonical.empty()) {
          Error(path, v.dump() + " is not one of " + Join(choices, ", ") + AutoHint(v));
          return std::nullopt;
        }
        return ojson(std::string(canonical));
      }
      case KeyType::kPaths: {
        ojson list = ojson::array();
        if (v.is_string()) {
          list.push_back(v.get<std::string>());
        } else if (v.is_array()) {
          for (const json& p : v) {
            if (!p.is_string()) return type_error("a path or a list of paths (strings)");
            list.push_back(p.get<std::string>());
          }
        } else {
          return type_error("a path or a list of paths");
        }
        if (list.empty()) {
          Error(path, "an empty list; give at least one directory");
          return std::nullopt;
        }
        // "/a/b", "/a//b/" and "/a/./b" are one directory; swap files would collide.
        std::map<std::string, std::string> seen;  // lexically normal form -> as written
        for (const ojson& p : list) {
          const std::string s = p.get<std::string>();
          if (s.empty()) {
            Error(path, "an empty path");
            return std::nullopt;
          }
          std::string normal = std::filesystem::path(s).lexically_normal().string();
          while (normal.size() > 1 && normal.back() == '/')
            normal.pop_back();
          auto [it, inserted] = seen.emplace(normal, s);
          if (!inserted) {
            Error(path, it->second == s ? "\"" + s + "\" is listed twice"
                                        : "\"" + it->second + "\" and \"" + s +
                                              "\" are the same directory, listed twice");
            return std::nullopt;
          }
        }
        return list;
      }
      case KeyType::kFloatPair: {
        if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) {
          return type_error("a list of two numbers");
        }
        ojson out = ojson::array();
        for (int i = 0; i < 2; ++i) {
          const double d = v[i].get<double>();
          if (d < spec.min || d >= spec.max) {
            Error(path, "element " + std::to_string(i) + " = " + v[i].dump() +
                            " is out of range; expected a value in [" + FormatNumber(spec.min) +
                            ", " + FormatNumber(spec.max) + ")");
            return std::nullopt;
          }
          out.push_back(d);
        }
        return out;
      }
    }
    return std::nullopt;
  }

  // Builds the normalized document in table order: given values, else defaults.
  ojson Normalize() {
    ojson out = ojson::object();
    for (const KeySpec& spec : ConfigKeys()) {
      if (!spec.not_supported.empty()) continue;
      const std::string path(spec.path);
      const std::string_view parent = Parent(spec.path);
      if (!parent.empty() && !out.contains(Pointer(parent))) continue;
      if (WhenHolds(spec) != When::kHolds) continue;
      if (spec.type == KeyType::kObject) {
        if (present_objects_.count(path) || !spec.default_json.empty()) {
          out[Pointer(path)] = ojson::object();
        }
        continue;
      }
      if (auto it = leaves_.find(path); it != leaves_.end()) {
        out[Pointer(path)] = it->second;
      } else if (RawAt(path) != nullptr || RawAliasAt(spec) != nullptr) {
        // Given but invalid (already reported): leave it out.
      } else if (!spec.default_json.empty()) {
        // Through Convert, so a default has the same JSON type as a given value (a
        // bandwidth default 0 becomes 0.0) and the output re-validates to itself.
        if (auto v = Convert(spec, json::parse(spec.default_json), path)) {
          out[Pointer(path)] = std::move(*v);
        }
      } else if (spec.required) {
        std::string why = spec.when_key.empty()
                              ? "required in " + std::string(parent)
                              : "required when " + std::string(spec.when_key) + " is " +
                                    Join(Split(spec.when_values, '|'), " or ");
        Error(path, why);
      }
    }
    return out;
  }

  const json* RawAliasAt(const KeySpec& spec) const {
    if (spec.alias.empty()) return nullptr;
    return RawAt(JoinPath(Parent(spec.path), spec.alias));
  }

  static const ojson* At(const ojson& doc, std::string_view path) {
    const auto ptr = Pointer(path);
    return doc.contains(ptr) ? &doc.at(ptr) : nullptr;
  }

  void CrossChecks(ojson& out) {
    CheckBatch(out);
    const ojson* fp16 = At(out, "fp16.enabled");
    const ojson* bf16 = At(out, "bf16.enabled");
    if (fp16 && bf16 && fp16->get<bool>() && bf16->get<bool>()) {
      Error("bf16.enabled", "fp16 and bf16 are both enabled; enable one");
    }
    const ojson* stage = At(out, "zero_optimization.stage");
    if (stage && *stage == 0) {
      Error("zero_optimization.stage",
            "stage 0 (plain data parallelism, nothing partitioned) is not offered: Strata's "
            "optimizer always runs on the partitioned states; set 1 (optimizer states), 2 "
            "(and gradients) or 3 (and parameters)");
    }
    if (const ojson* pd = At(out, "zero_optimization.offload_param.device");
        stage && *stage != 3 && pd && *pd != "none") {
      Error("zero_optimization.offload_param.device",
            pd->dump() + " with stage " + stage->dump() +
                ": stages 1 and 2 keep every parameter on each rank's device (only the "
                "optimizer states are offloaded); use stage 3 to offload parameters");
    }
    for (const char* which : {"offload_optimizer", "offload_param"}) {
      const std::string base = std::string("zero_optimization.") + which;
      const ojson* device = At(out, base + ".device");
      const ojson* paths = At(out, base + ".nvme_path");
      if (!device) continue;
      if (*device == "nvme" && !paths && !RawAt(base + ".nvme_path")) {
        Error(base + ".nvme_path", "required when " + base + ".device is nvme");
      }
      if (*device != "nvme" && paths) {
        Error(base + ".nvme_path", "set, but " + base + ".device is " + device->dump() +
                                       " so it would be ignored; set device to \"nvme\" or "
                                       "remove nvme_path");
      }
    }
    if (const ojson* type = At(out, "optimizer.type"); type && *type == "AdamW") {
      if (const ojson* w = At(out, "optimizer.params.adam_w_mode"); w && !w->get<bool>()) {
        Error("optimizer.params.adam_w_mode",
              "false contradicts optimizer.type AdamW (decoupled weight decay); use type "
              "Adam for L2 weight decay");
      }
    }
    const ojson* min_coeff = At(out, "optimizer.params.min_coeff");
    const ojson* max_coeff = At(out, "optimizer.params.max_coeff");
    if (min_coeff && max_coeff && min_coeff->get<double>() > max_coeff->get<double>()) {
      Error("optimizer.params.min_coeff", min_coeff->dump() + " is above max_coeff " +
                                              max_coeff->dump() +
                                              "; the trust ratio's clamp needs min <= max");
    }
    if (const ojson* bs = At(out, "aio.block_size"); bs && !IsAligned(bs->get<uint64_t>(), 4096)) {
      Error("aio.block_size", bs->dump() + " is not a multiple of 4096 (O_DIRECT alignment)");
    }
    CheckEarlyStep(out);
    CheckDelayedUpdate(out);
    const ojson* total = At(out, "scheduler.params.total_num_steps");
    const ojson* warm = At(out, "scheduler.params.warmup_num_steps");
    if (total && warm && total->get<int64_t>() < warm->get<int64_t>()) {
      const bool warm_given = RawAt("scheduler.params.warmup_num_steps") != nullptr;
      Error("scheduler.params.total_num_steps",
            total->dump() + " is less than warmup_num_steps " + warm->dump() +
                (warm_given ? "" : " (the default)") + "; the schedule must end after warm-up");
    }
  }

  // strata.skip_inf_nan_steps and strata.early_step against the settings they need.
  void CheckEarlyStep(const ojson& out) {
    auto flag = [&](const char* path) {
      const ojson* v = At(out, path);
      return v != nullptr && v->is_boolean() && v->get<bool>();
    };
    const ojson* skip = At(out, "strata.skip_inf_nan_steps");
    const bool no_skip = skip != nullptr && skip->is_boolean() && !skip->get<bool>();
    if (no_skip && flag("fp16.enabled")) {
      Error("strata.skip_inf_nan_steps",
            "false with fp16.enabled: fp16's dynamic loss scale lowers the scale by skipping "
            "the steps whose gradients overflowed; keep it true with fp16 (or use bf16)");
    }
    if (!flag("strata.early_step")) return;
    const char* kEarly = "strata.early_step";
    if (const ojson* p = At(out, "strata.pipeline_step"); p && p->is_boolean() && !p->get<bool>()) {
      Error(kEarly,
            "true with strata.pipeline_step false: the early step is the pipelined step "
            "started during the backward; set pipeline_step true or early_step false");
    }
    if (const ojson* clip = At(out, "gradient_clipping");
        clip && clip->is_number() && clip->get<double>() > 0) {
      Error(kEarly, "true with gradient_clipping " + clip->dump() +
                        ": clipping needs the global norm, known only after the whole "
                        "backward; set gradient_clipping 0 or early_step false");
    }
    if (flag("fp16.enabled")) {
      Error(kEarly,
            "true with fp16.enabled: the loss scale's overflow check needs the whole "
            "gradient before any update; use bf16 or fp32, or set early_step false");
    } else if (!no_skip) {
      Error(kEarly,
            "true with strata.skip_inf_nan_steps true: skipping a step on an inf/NaN gradient "
            "needs the whole gradient before any update; set strata.skip_inf_nan_steps false "
            "(such a step is then applied) or early_step false");
    }
    if (const ojson* type = At(out, "optimizer.type"); type && *type == "Lamb") {
      Error(kEarly,
            "true with optimizer.type Lamb: LAMB's trust ratios need norms over every rank's "
            "update; use Adam or AdamW, or set early_step false");
    }
    RefuseNvmeTiers(out, kEarly,
                    " nvme: the NVMe tiers step inside step(); use cpu (or none), or set "
                    "early_step false");
  }

  // strata.delayed_update against the settings it needs.
  void CheckDelayedUpdate(const ojson& out) {
    const ojson* d = At(out, "strata.delayed_update");
    if (d == nullptr || !d->is_boolean() || !d->get<bool>()) return;
    const char* kDelayed = "strata.delayed_update";
    if (const ojson* p = At(out, "strata.pipeline_step"); p && p->is_boolean() && !p->get<bool>()) {
      Error(kDelayed,
            "true with strata.pipeline_step false: the delayed update is a pipelined step whose "
            "forward does not wait for it; set pipeline_step true or delayed_update false");
    }
    if (const ojson* e = At(out, "strata.early_step"); e && e->is_boolean() && e->get<bool>()) {
      Error(kDelayed,
            "true with strata.early_step true: the early step starts the update during the "
            "backward, the delayed one after step(); set one of them false");
    }
    if (const ojson* type = At(out, "optimizer.type"); type && *type == "Lamb") {
      Error(kDelayed,
            "true with optimizer.type Lamb: LAMB steps inside step(); use Adam or AdamW, or "
            "set delayed_update false");
    }
    RefuseNvmeTiers(out, kDelayed,
                    " nvme: the delayed update copies the master parameters out at the next "
                    "step, from host memory only; use cpu, or set delayed_update false");
  }

  // An error at `path` ("true with zero_optimization.<tier>.device" + why) for each tier
  // (optimizer states, parameters) on NVMe.
  void RefuseNvmeTiers(const ojson& out, const char* path, const char* why) {
    for (const char* which : {"offload_optimizer", "offload_param"}) {
      const std::string key = std::string("zero_optimization.") + which + ".device";
      if (const ojson* d = At(out, key); d && *d == "nvme") Error(path, "true with " + key + why);
    }
  }

  void CheckBatch(ojson& out) {
    const char* kTbs = "train_batch_size";
    const char* kMbs = "train_micro_batch_size_per_gpu";
    const char* kGas = "gradient_accumulation_steps";
    // A given-but-invalid value was reported already; don't derive from it.
    for (const char* k : {kTbs, kMbs, kGas}) {
      if (RawAt(k) && !leaves_.count(k)) return;
    }
    const int64_t w = options_.world_size;
    if (w < 1) {
      Error("", "world size must be at least 1, got " + std::to_string(w));
      return;
    }
    auto get = [&](const char* k) -> std::optional<int64_t> {
      auto it = leaves_.find(k);
      if (it == leaves_.end()) return std::nullopt;
      return it->second.get<int64_t>();
    };
    std::optional<int64_t> tbs = get(kTbs), mbs = get(kMbs), gas = get(kGas);
    const std::string ws = " x world size " + std::to_string(w);
    // The products below must not wrap: micro x accumulation x world size < 2^63.
    {
      int64_t product = w;
      for (const auto& [value, name] : {std::pair{mbs, kMbs}, std::pair{gas, kGas}}) {
        if (value && __builtin_mul_overflow(product, *value, &product)) {
          Error(name,
                std::to_string(*value) +
                    " is too large: the global batch size "
                    "(micro batch x accumulation steps x world size) does not fit in 64 bits");
          return;
        }
      }
    }
    if (tbs && mbs && gas) {
      if (*tbs != *mbs * *gas * w) {
        Error(kTbs, std::to_string(*tbs) + " != train_micro_batch_size_per_gpu " +
                        std::to_string(*mbs) + " x gradient_accumulation_steps " +
                        std::to_string(*gas) + ws + " = " + std::to_string(*mbs * *gas * w));
        return;
      }
    } else if (tbs && mbs) {
      if (*tbs % (*mbs * w) != 0) {
        Error(kTbs, std::to_string(*tbs) + " is not divisible by train_micro_batch_size_per_gpu " +
                        std::to_string(*mbs) + ws);
        return;
      }
      gas = *tbs / (*mbs * w);
    } else if (tbs && gas) {
      if (*tbs % (*gas * w) != 0) {
        Error(kTbs, std::to_string(*tbs) + " is not divisible by gradient_accumulation_steps " +
                        std::to_string(*gas) + ws);
        return;
      }
      mbs = *tbs / (*gas * w);
    } else if (mbs) {
      gas = gas.value_or(1);
      tbs = *mbs * *gas * w;
    } else if (tbs) {
      gas = 1;
      if (*tbs % w != 0) {
        Error(kTbs,
              std::to_string(*tbs) + " is not divisible by the world size " + std::to_string(w));
        return;
      }
      mbs = *tbs / w;
    } else {
      Error(kTbs,
            "set train_batch_size or train_micro_batch_size_per_gpu (or both); the "
            "other is derived");
      return;
    }
    // Batch keys first, in table order.
    ojson ordered = ojson::object();
    ordered[kTbs] = *tbs;
    ordered[kMbs] = *mbs;
    ordered[kGas] = *gas;
    for (auto it = out.begin(); it != out.end(); ++it) {
      if (!ordered.contains(it.key())) ordered[it.key()] = it.value();
    }
    out = std::move(ordered);
  }

  const json& doc_;
  const ValidateOptions& options_;
  std::vector<ConfigError>& errors_;
  const Index& index_;
  std::set<std::string> present_objects_;
  std::map<std::string, ojson> leaves_;
};

}  // namespace

ojson ValidateDocument(const json& doc, const ValidateOptions& options,
                       std::vector<ConfigError>& errors) {
  return Validator(doc, options, errors).Run();
}

}  // namespace strata::config_internal

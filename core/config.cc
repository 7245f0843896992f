// Validation, normalization and the typed view of the configuration. The keys
// themselves are in config_keys.cc.
#include "strata/core/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "strata/core/bytes.h"
#include "strata/core/check.h"

namespace strata {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

std::string_view KeyTypeName(KeyType type) {
  switch (type) {
    case KeyType::kObject: return "object";
    case KeyType::kBool: return "boolean";
    case KeyType::kInt: return "integer";
    case KeyType::kCount: return "count";
    case KeyType::kFloat: return "number";
    case KeyType::kBytes: return "bytes";
    case KeyType::kBandwidth: return "bytes/s";
    case KeyType::kString: return "string";
    case KeyType::kEnum: return "enum";
    case KeyType::kPaths: return "path or [paths]";
    case KeyType::kFloatPair: return "[number, number]";
  }
  return "?";
}

std::string_view OffloadDeviceName(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
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
  for (const ConfigError& e : errors) out += e.ToString() + "\n";
  return out;
}

namespace {

// ---------------------------------------------------------------------------
// Small helpers.

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
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
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
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

struct Index {
  std::map<std::string, const KeySpec*, std::less<>> by_path;
  std::map<std::string, const KeySpec*, std::less<>> by_alias_path;  // parent.alias
  std::map<std::string, std::vector<const KeySpec*>, std::less<>> children;

  Index() {
    for (const KeySpec& k : ConfigKeys()) {
      STRATA_CHECK(by_path.emplace(std::string(k.path), &k).second) << "duplicate key " << k.path;
      const std::string_view parent = Parent(k.path);
      STRATA_CHECK(parent.empty() || by_path.count(parent)) << k.path << " before its parent";
      children[std::string(parent)].push_back(&k);
      if (!k.alias.empty()) by_alias_path.emplace(JoinPath(parent, k.alias), &k);
    }
  }
};

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
      case json::parse_event_t::value: break;
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
  }
}

// ---------------------------------------------------------------------------
// Validation of one document.

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
    const std::string squashed = Squash(key);
    const KeySpec* best = nullptr;
    size_t best_d = std::string::npos;
    std::vector<std::string_view> siblings;
    if (auto it = index_.children.find(prefix); it != index_.children.end()) {
      for (const KeySpec* k : it->second) {
        if (!k->not_supported.empty()) continue;
        siblings.push_back(LastComponent(k->path));
        size_t d = EditDistance(squashed, Squash(LastComponent(k->path)));
        if (d < best_d) {
          best_d = d;
          best = k;
        }
      }
    }
    const size_t threshold = std::max<size_t>(2, squashed.size() / 3);
    if (best && best_d <= threshold) {
      return "unknown key; did you mean " + std::string(LastComponent(best->path)) + "?";
    }
    // The same name somewhere else in the table: probably put at the wrong level.
    for (const KeySpec& k : ConfigKeys()) {
      if (k.not_supported.empty() && LastComponent(k.path) == key) {
        return "unknown key here; did you mean " + std::string(k.path) + "?";
      }
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

  // Whether a `when` condition holds in the raw document (unknown -> true, so that a
  // bad scheduler.type is reported once, not once per parameter).
  bool WhenHolds(const KeySpec& spec) const {
    if (spec.when_key.empty()) return true;
    const KeySpec* cond = index_.by_path.at(std::string(spec.when_key));
    const json* v = RawAt(spec.when_key);
    if (v == nullptr || !v->is_string()) return true;
    std::string_view canonical = MatchChoice(*cond, v->get<std::string>());
    if (canonical.empty()) return true;
    for (std::string_view w : Split(spec.when_values, '|')) {
      if (w == canonical) return true;
    }
    return false;
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
      const KeySpec* spec = Lookup(path);
      if (spec == nullptr) {
        Error(path, Suggest(prefix, it.key()));
        continue;
      }
      const std::string canonical(spec->path);
      if (canonical != path && obj.contains(std::string(LastComponent(canonical)))) {
        Error(path, "both " + std::string(LastComponent(canonical)) + " and its alias " +
                        it.key() + " are given; keep one");
        continue;
      }
      if (!spec->not_supported.empty()) {
        if (!Inert(*spec, it.value())) {
          Error(path, "not supported by Strata: " + std::string(spec->not_supported) +
                          "; remove the key");
        }
        continue;
      }
      if (!WhenHolds(*spec)) {
        const json* w = RawAt(spec->when_key);
        Error(path, "not a parameter of " + std::string(spec->when_key) + " " +
                        (w ? w->get<std::string>() : "?") + " (it applies to " +
                        Join(Split(spec->when_values, '|'), ", ") + ")");
        continue;
      }
      if (spec->type == KeyType::kObject) {
        if (!it.value().is_object()) {
          Error(path, "expected an object ({...}), got " + DescribeValue(it.value()));
          continue;
        }
        present_objects_.insert(canonical);
        CheckObject(it.value(), canonical);
        continue;
      }
      if (auto v = Convert(*spec, it.value(), path)) leaves_[canonical] = std::move(*v);
    }
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
      case KeyType::kObject: break;  // handled by the caller
      case KeyType::kBool:
        if (!v.is_boolean()) return type_error("true or false");
        return ojson(v.get<bool>());
      case KeyType::kInt:
      case KeyType::kCount: {
        const bool count = spec.type == KeyType::kCount;
        if (!v.is_number()) return type_error(count ? "a non-negative whole number" : "a whole number");
        const double d = v.get<double>();
        if (v.is_number_float() && (d != std::floor(d) || std::fabs(d) >= 9.2233720368547758e18)) {
          return type_error(count ? "a non-negative whole number" : "a whole number");
        }
        if (count && d < 0) return type_error("a non-negative whole number");
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
        Result<uint64_t> bytes = v.is_number() ? BytesFromDouble(v.get<double>())
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
        if (v.is_number()) {
          if (v.get<double>() < 0) {
            Error(path, v.dump() + ": a bandwidth cannot be negative");
            return std::nullopt;
          }
          return ojson(v.get<double>());
        }
        if (!v.is_string()) return type_error("bytes per second (a number or \"6.5GB/s\")");
        auto rate = ParseByteRate(v.get<std::string>());
        if (!rate.ok()) {
          Error(path, rate.status().message() + AutoHint(v));
          return std::nullopt;
        }
        return ojson(*rate);
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
        std::set<std::string> seen;
        for (const ojson& p : list) {
          const std::string s = p.get<std::string>();
          if (s.empty()) {
            Error(path, "an empty path");
            return std::nullopt;
          }
          if (!seen.insert(s).second) {
            Error(path, "\"" + s + "\" is listed twice");
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
      if (!WhenHolds(spec)) continue;
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
        out[Pointer(path)] = ojson::parse(spec.default_json);
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
    if (const ojson* stage = At(out, "zero_optimization.stage"); stage && *stage != 3) {
      Error("zero_optimization.stage",
            "stage " + stage->dump() + " is not supported by Strata, which implements ZeRO "
            "stage 3 only; set it to 3");
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
    if (const ojson* bs = At(out, "aio.block_size"); bs && !IsAligned(bs->get<uint64_t>(), 4096)) {
      Error("aio.block_size", bs->dump() + " is not a multiple of 4096 (O_DIRECT alignment)");
    }
    const ojson* total = At(out, "scheduler.params.total_num_steps");
    const ojson* warm = At(out, "scheduler.params.warmup_num_steps");
    if (total && warm && total->get<int64_t>() < warm->get<int64_t>()) {
      Error("scheduler.params.total_num_steps",
            total->dump() + " is less than warmup_num_steps " + warm->dump());
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
        Error(kTbs, std::to_string(*tbs) + " is not divisible by the world size " +
                        std::to_string(w));
        return;
      }
      mbs = *tbs / w;
    } else {
      Error(kTbs, "set train_batch_size or train_micro_batch_size_per_gpu (or both); the "
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
  o.type = Get<std::string>(doc, "optimizer.type") == "AdamW" ? OptimizerType::kAdamW
                                                               : OptimizerType::kAdam;
  o.lr = Get<double>(doc, "optimizer.params.lr");
  const auto betas = Get<std::vector<double>>(doc, "optimizer.params.betas");
  o.beta1 = betas[0];
  o.beta2 = betas[1];
  o.eps = Get<double>(doc, "optimizer.params.eps");
  o.weight_decay = Get<double>(doc, "optimizer.params.weight_decay");
  o.bias_correction = Get<bool>(doc, "optimizer.params.bias_correction");
  o.adam_w_mode = Get<bool>(doc, "optimizer.params.adam_w_mode");

  if (doc.contains("scheduler")) {
    SchedulerConfig& s = c.scheduler;
    const std::string type = Get<std::string>(doc, "scheduler.type");
    s.type = type == "WarmupLR"        ? SchedulerType::kWarmupLR
             : type == "WarmupDecayLR" ? SchedulerType::kWarmupDecayLR
                                       : SchedulerType::kWarmupCosineLR;
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
  s.device_budget = Get<uint64_t>(doc, "strata.device_budget");
  s.host_budget = Get<uint64_t>(doc, "strata.host_budget");
  s.allow_unpinned = Get<bool>(doc, "strata.allow_unpinned");
  s.numa_node = Get<int>(doc, "strata.numa_node");
  s.swap_checksums = Get<bool>(doc, "strata.swap_checksums");
  s.swap_pipeline_depth = Get<int>(doc, "strata.swap_pipeline_depth");
  s.nvme_read_bandwidth = Get<double>(doc, "strata.nvme_read_bandwidth");
  s.nvme_write_bandwidth = Get<double>(doc, "strata.nvme_write_bandwidth");
  s.log_level = ParseLogLevel(Get<std::string>(doc, "strata.log_level")).value();
  return c;
}

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoError(errno ? errno : ENOENT, "cannot open config file " + path);
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) return ErrnoError(errno ? errno : EIO, "cannot read config file " + path);
  return os.str();
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

ValidationResult ValidateConfigJson(std::string_view json_text, const ValidateOptions& options) {
  ValidationResult result;
  std::optional<json> doc = ParseJson(json_text, result.errors);
  if (!doc) return result;
  // Duplicate keys were reported by the parser; report the rest as well.
  result.normalized = Validator(*doc, options, result.errors).Run();
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
  return BuildConfig(r.normalized, options.world_size);
}

Result<Config> LoadConfigFile(const std::string& path, const ValidateOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  auto config = ParseConfig(text, options);
  if (!config.ok()) return config.status().WithContext(path);
  return config;
}

}  // namespace strata

// Reading a checkpoint's manifest, and what strata-ckpt and the load ask of a checkpoint
// directory: its tags, `latest`, a tensor's CRC (checkpoint.h describes the files).
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>

#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/files.h"
#include "strata/engine/checkpoint/format.h"

namespace strata::engine {
namespace {

// or of an out-of-range integer, is undefined behaviour or a silent wrap).
template <typename T>
bool FitsInteger(const Json& v) {
  if (v.is_number_unsigned()) {
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if constexpr (std::is_unsigned_v<T>) {
      return x >= 0 && static_cast<uint64_t>(x) <= std::numeric_limits<T>::max();
    } else {
      return x >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
             x <= static_cast<int64_t>(std::numeric_limits<T>::max());
    }
  }
  return false;
}

// Reads a JSON value of the expected kind; errors name the key.
template <typename T>
Status Get(const Json& j, const char* key, T& out, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) {
    return InvalidArgumentError(where + ": the key '" + key + "' is missing");
  }
  const Json& v = j.at(key);
  auto wrong = [&](const char* want) {
    return InvalidArgumentError(where + ": the key '" + key + "' must be " + want + ", not " +
                                v.dump().substr(0, 60));
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return wrong("true or false");
    out = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!FitsInteger<T>(v)) return wrong("an integer in range");
    out = v.get<T>();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return wrong("a number");
    out = v.get<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return wrong("a string");
    out = v.get<std::string>();
  } else {  // std::vector<uint64_t>: shapes
    if (!v.is_array()) return wrong("a list of integers");
    out.clear();
    for (const Json& e : v) {
      if (!FitsInteger<uint64_t>(e)) return wrong("a list of non-negative integers");
      out.push_back(e.get<uint64_t>());
    }
  }
  return Status::Ok();
}

Result<CheckpointRankPart> ParsePart(const Json& j, const std::string& where) {
  CheckpointRankPart p;
  STRATA_RETURN_IF_ERROR(Get(j, "rank", p.rank, where));
  STRATA_RETURN_IF_ERROR(Get(j, "file", p.file, where));
  STRATA_RETURN_IF_ERROR(Get(j, "file_bytes", p.file_bytes, where));
  if (p.file != RankFileName(p.rank)) {
    return InvalidArgumentError(where + ": rank " + std::to_string(p.rank) + "'s file is '" +
                                p.file + "', expected " + RankFileName(p.rank));
  }
  if (!j.contains("tensors") || !j["tensors"].is_array()) {
    return InvalidArgumentError(where + ": rank " + std::to_string(p.rank) + " lists no tensors");
  }
  uint64_t end = 0;
  for (const Json& tj : j["tensors"]) {
    CheckpointTensor t;
    const std::string tw = where + ", rank " + std::to_string(p.rank) + " tensor";
    STRATA_RETURN_IF_ERROR(Get(tj, "name", t.name, tw));
    std::vector<uint64_t> shape;
    STRATA_RETURN_IF_ERROR(Get(tj, "dtype", t.dtype, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "shape", shape, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "offset", t.offset, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "bytes", t.bytes, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "crc32c", t.crc32c, tw + " " + t.name));
    const uint64_t elem = CheckpointDTypeSize(t.dtype);
    uint64_t numel = 1;
    bool overflow = shape.size() > 8;
    for (const uint64_t d : shape) {
      if (d != 0 && numel > (UINT64_MAX / 16) / d) overflow = true;
      numel *= d;
    }
    if (elem == 0 || overflow || numel * elem != t.bytes || t.offset < end ||
        t.offset > p.file_bytes || t.bytes > p.file_bytes - t.offset) {
      return InvalidArgumentError(tw + " " + t.name +
                                  ": dtype, shape, offset or size out of place (the manifest is "
                                  "damaged)");
    }
    t.shape = std::move(shape);
    t.numel = numel;
    end = t.offset + t.bytes;
    p.tensors.push_back(std::move(t));
  }
  return p;
}

// The manifest's scalar keys: format, version, tag, world size, dtype, counters, loss scaler.
Status ParseManifestHeader(const Json& j, const std::string& path, CheckpointManifest& m) {
  std::string format;
  STRATA_RETURN_IF_ERROR(Get(j, "format", format, path));
  if (format != kFormatName) {
    return InvalidArgumentError(path + ": format '" + format + "' is not a Strata checkpoint");
  }
  STRATA_RETURN_IF_ERROR(Get(j, "version", m.version, path));
  if (m.version < 1 || m.version > kCheckpointFormatVersion) {
    return InvalidArgumentError(path + ": format version " + std::to_string(m.version) +
                                "; this build reads versions 1 to " +
                                std::to_string(kCheckpointFormatVersion) +
                                " (a newer Strata wrote it: load it with that version)");
  }
  STRATA_RETURN_IF_ERROR(Get(j, "tag", m.tag, path));
  STRATA_RETURN_IF_ERROR(Get(j, "world_size", m.world_size, path));
  STRATA_RETURN_IF_ERROR(Get(j, "dtype", m.dtype, path));
  {
    bool known = false;
    for (const DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      if (m.dtype == DTypeName(t)) {
        m.working_dtype = t;
        known = true;
      }
    }
    if (!known) {
      return InvalidArgumentError(path + ": dtype '" + m.dtype.substr(0, 40) +
                                  "' is not fp32, bf16 or fp16");
    }
  }
  STRATA_RETURN_IF_ERROR(Get(j, "global_steps", m.global_steps, path));
  STRATA_RETURN_IF_ERROR(Get(j, "micro_steps", m.micro_steps, path));
  STRATA_RETURN_IF_ERROR(Get(j, "adam_step", m.adam_step, path));
  STRATA_RETURN_IF_ERROR(Get(j, "lr_iteration", m.lr_iteration, path));
  if (!j.contains("loss_scaler")) {
    return InvalidArgumentError(path + ": the key 'loss_scaler' is missing");
  }
  const Json& ls = j["loss_scaler"];
  const std::string lw = path + ", loss_scaler";
  STRATA_RETURN_IF_ERROR(Get(ls, "enabled", m.loss_scaler_enabled, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "scale", m.loss_scale, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "hysteresis_left", m.hysteresis_left, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "iteration", m.scaler_iteration, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "last_overflow_iteration", m.last_overflow_iteration, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "skipped_steps", m.skipped_steps, lw));
  m.config_json = j.contains("config") ? j["config"].dump() : "null";
  if (j.contains("frozen_parameters_saved")) {
    STRATA_RETURN_IF_ERROR(Get(j, "frozen_parameters_saved", m.frozen_saved, path));
    if (!m.frozen_saved && m.version < 2) {
      return InvalidArgumentError(path + ": 'frozen_parameters_saved' false in format version " +
                                  std::to_string(m.version) + " (it needs version 2)");
    }
  }
  if (m.world_size < 1 || m.world_size > (1 << 20)) {
    return InvalidArgumentError(path + ": world_size " + std::to_string(m.world_size));
  }
  return Status::Ok();
}

// One group of the manifest (m's header and the groups before it read).
Result<CheckpointGroup> ParseManifestGroup(const Json& gj, const std::string& path,
                                           const CheckpointManifest& m) {
  CheckpointGroup g;
  STRATA_RETURN_IF_ERROR(Get(gj, "name", g.name, path + ", group"));
  const std::string gw = path + ", group " + g.name;
  STRATA_RETURN_IF_ERROR(Get(gj, "used_numel", g.used_numel, gw));
  STRATA_RETURN_IF_ERROR(Get(gj, "shard_numel", g.shard_numel, gw));
  if (gj.contains("frozen")) STRATA_RETURN_IF_ERROR(Get(gj, "frozen", g.frozen, gw));
  if (!g.frozen && !m.groups.empty() && m.groups.back().frozen) {
    return InvalidArgumentError(gw + ": a trainable group after a frozen one");
  }
  if (gj.contains("frozen_fingerprint")) {
    std::string text;
    STRATA_RETURN_IF_ERROR(Get(gj, "frozen_fingerprint", text, gw));
    const std::optional<uint64_t> v = ParseFingerprintHex(text);
    if (!v) {
      return InvalidArgumentError(gw + ": 'frozen_fingerprint' must be 16 hex digits, not '" +
                                  text.substr(0, 40) + "'");
    }
    if (!g.frozen || m.frozen_saved) {
      return InvalidArgumentError(gw + ": 'frozen_fingerprint' belongs to a frozen group of a " +
                                  "checkpoint saved without the frozen values");
    }
    g.has_fingerprint = true;
    g.frozen_fingerprint = *v;
  }
  if (!gj.contains("params") || !gj["params"].is_array()) {
    return InvalidArgumentError(gw + ": the key 'params' is missing");
  }
  for (const Json& pj : gj["params"]) {
    CheckpointParam p;
    STRATA_RETURN_IF_ERROR(Get(pj, "name", p.name, gw + ", parameter"));
    STRATA_RETURN_IF_ERROR(Get(pj, "numel", p.numel, gw + ", parameter " + p.name));
    STRATA_RETURN_IF_ERROR(Get(pj, "offset", p.offset, gw + ", parameter " + p.name));
    if (p.offset > g.used_numel || p.numel > g.used_numel - p.offset) {
      return InvalidArgumentError(gw + ", parameter " + p.name + ": outside the group");
    }
    p.shape = {p.numel};
    if (pj.contains("shape")) {
      STRATA_RETURN_IF_ERROR(Get(pj, "shape", p.shape, gw + ", parameter " + p.name));
      uint64_t n = 1;
      for (const uint64_t d : p.shape)
        n = d != 0 && n > UINT64_MAX / d ? UINT64_MAX : n * d;
      if (n != p.numel || p.shape.size() > 16) {
        return InvalidArgumentError(gw + ", parameter " + p.name +
                                    ": its shape does not hold its numel");
      }
    }
    g.params.push_back(std::move(p));
  }
  if (g.used_numel > g.shard_numel * static_cast<uint64_t>(m.world_size)) {
    return InvalidArgumentError(gw + ": the shards do not cover the group");
  }
  return g;
}

// The ranks' parts, each against the groups: the states' sizes, the frozen tensor.
Status ParseManifestRanks(const Json& j, const std::string& path, CheckpointManifest& m) {
  if (!j.contains("ranks") || !j["ranks"].is_array() ||
      j["ranks"].size() != static_cast<size_t>(m.world_size)) {
    return InvalidArgumentError(path + ": 'ranks' must list one part per rank (" +
                                std::to_string(m.world_size) + ")");
  }
  uint64_t partition = 0, trainable = 0;
  for (const CheckpointGroup& g : m.groups) {
    partition += g.shard_numel;
    if (!g.frozen) trainable += g.shard_numel;
  }
  m.partition_numel = partition;
  m.trainable_numel = trainable;
  for (size_t r = 0; r < j["ranks"].size(); ++r) {
    STRATA_ASSIGN_OR_RETURN(CheckpointRankPart p, ParsePart(j["ranks"][r], path));
    if (p.rank != static_cast<int>(r)) {
      return InvalidArgumentError(path + ": part " + std::to_string(r) + " is rank " +
                                  std::to_string(p.rank));
    }
    for (const char* name : kStateTensors) {
      const CheckpointTensor* t = p.Find(name);
      const bool whole = name == kStateTensors[0] && m.frozen_in_master();
      const uint64_t want = whole ? partition : trainable;
      if (t == nullptr || t->dtype != "F32" || t->numel != want) {
        return InvalidArgumentError(path + ": rank " + std::to_string(r) + "'s " + name +
                                    " is missing or not the " + std::to_string(want) +
                                    " fp32 elements of the " +
                                    (whole ? "partition" : "trainable groups"));
      }
    }
    if (!m.frozen_in_master() && m.frozen_saved && partition > trainable) {
      const CheckpointTensor* t = p.Find(kFrozenTensor);
      if (t == nullptr || !WorkingDTypeOfName(t->dtype) || t->numel != partition - trainable) {
        return InvalidArgumentError(path + ": rank " + std::to_string(r) + "'s " + kFrozenTensor +
                                    " is missing or not the " +
                                    std::to_string(partition - trainable) +
                                    " F32, BF16 or F16 elements of the frozen groups");
      }
    }
    m.ranks.push_back(std::move(p));
  }
  return Status::Ok();
}

}  // namespace

const std::vector<std::string>& CheckpointCrashPoints() {
  static const std::vector<std::string> points = {
      "rank_file_written", "rank_file_synced", "part_written",   "manifest_written",
      "manifest_synced",   "parts_removed",    "tmp_dir_synced", "tag_renamed",
      "save_dir_synced",   "latest_written",   "latest_synced",  "latest_renamed"};
  return points;
}

uint64_t CheckpointDTypeSize(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"I16", 2}, {"U16", 2}, {"F16", 2}, {"BF16", 2},
      {"I32", 4},  {"U32", 4}, {"F32", 4}, {"I64", 8}, {"U64", 8}, {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

const CheckpointTensor* CheckpointRankPart::Find(const std::string& name) const {
  for (const CheckpointTensor& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

uint64_t CheckpointManifest::total_bytes() const {
  uint64_t total = 0;
  for (const CheckpointRankPart& p : ranks)
    total += p.file_bytes;
  return total;
}

Result<std::string> ResolveCheckpointTag(const std::string& dir, const std::string& tag) {
  if (!tag.empty()) {
    STRATA_RETURN_IF_ERROR(CheckTag(tag));
    return tag;
  }
  const std::string latest = dir + "/latest";
  if (!Exists(latest)) {
    return NotFoundError("no checkpoint in " + dir +
                         ": it has no 'latest' file (pass a tag, or "
                         "a directory a save wrote to)");
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(latest, 4096));
  std::string name = TrimLine(std::move(text));
  Status ok = CheckTag(name);
  if (!ok.ok()) return InvalidArgumentError(latest + " is damaged: " + ok.message());
  return name;
}

Result<CheckpointManifest> ReadCheckpointManifest(const std::string& tag_dir) {
  const std::string path = tag_dir + "/manifest.json";
  if (!Exists(tag_dir)) return NotFoundError("checkpoint " + tag_dir + " does not exist");
  if (!Exists(path)) {
    return NotFoundError("checkpoint " + tag_dir +
                         " has no manifest.json: not a complete Strata checkpoint");
  }
  STRATA_ASSIGN_OR_RETURN(Json j, ReadJsonFile(path, StatusCode::kInvalidArgument));
  CheckpointManifest m;
  STRATA_RETURN_IF_ERROR(ParseManifestHeader(j, path, m));
  if (!j.contains("groups") || !j["groups"].is_array()) {
    return InvalidArgumentError(path + ": the key 'groups' is missing");
  }
  for (const Json& gj : j["groups"]) {
    STRATA_ASSIGN_OR_RETURN(CheckpointGroup g, ParseManifestGroup(gj, path, m));
    m.groups.push_back(std::move(g));
  }
  STRATA_RETURN_IF_ERROR(ParseManifestRanks(j, path, m));
  return m;
}

Status VerifyCheckpointTensor(const std::string& tag_dir, const CheckpointManifest& m,
                              const CheckpointRankPart& part, const CheckpointTensor& t) {
  const std::string path = tag_dir + "/" + part.file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "checkpoint " + m.tag + ": opening " + path);
  struct stat st {};
  Status s;
  if (::fstat(fd, &st) != 0) {
    s = ErrnoError(errno, "stat of " + path);
  } else if (static_cast<uint64_t>(st.st_size) != part.file_bytes) {
    s = DataLossError("checkpoint " + m.tag + ", file " + path + " is " +
                      std::to_string(st.st_size) + " bytes, the manifest says " +
                      std::to_string(part.file_bytes) + ": truncated or replaced (tensor " +
                      t.name + ")");
  } else {
    s = VerifyTensor(fd, path, m.tag, t);
  }
  ::close(fd);
  return s;
}

Result<std::vector<CheckpointTagEntry>> ListCheckpointTags(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoError(errno, "listing " + dir);
  std::vector<CheckpointTagEntry> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::stat((dir + "/" + name).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (name.rfind(".tmp-", 0) == 0) {
      out.push_back({name, false});
    } else if (name[0] != '.' && Exists(dir + "/" + name + "/manifest.json")) {
      out.push_back({name, true});
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const CheckpointTagEntry& a, const CheckpointTagEntry& b) {
    return a.name < b.name;
  });
  return out;
}

}  // namespace strata::engine

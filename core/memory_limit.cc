#include "strata/core/memory_limit.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>

#include "strata/core/bytes.h"

namespace strata {

namespace {

// A v1 limit at or above this is the kernel's "unlimited" (PAGE_COUNTER_MAX pages, 2^63
// bytes less a page on 4 KiB pages).
constexpr uint64_t kV1Unlimited = uint64_t{1} << 62;

std::optional<uint64_t> ParseCount(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' '))
    text.remove_suffix(1);
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return v;
}

std::optional<std::string> ReadLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  return line;
}

// The number after `key` on the line that starts with it ("MemAvailable:  123 kB",
// "inactive_file 4096"), times `unit`.
std::optional<uint64_t> Field(const std::string& path, std::string_view key, uint64_t unit) {
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    std::istringstream in(line);
    std::string k, value;
    if (!(in >> k >> value) || k != key) continue;
    const std::optional<uint64_t> v = ParseCount(value);
    if (!v) return std::nullopt;
    return *v * unit;
  }
  return std::nullopt;
}

bool Exists(const std::string& path) {
  return std::ifstream(path).good();
}

// The process's cgroup paths from <proc>/self/cgroup: the v2 one ("0::/path") and the v1
// memory controller's ("4:memory:/path").
struct CgroupPaths {
  std::optional<std::string> v2;
  std::optional<std::string> v1_memory;
};

CgroupPaths ReadCgroupPaths(const std::string& proc_root) {
  CgroupPaths paths;
  std::ifstream f(proc_root + "/self/cgroup");
  for (std::string line; std::getline(f, line);) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a);
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) {
      paths.v2 = std::move(path);
      continue;
    }
    std::istringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c == "memory") paths.v1_memory = path;
    }
  }
  return paths;
}

// "/a/b" -> "/a/b", "/a", "/": the cgroup and its ancestors up to the hierarchy's root.
// None for a path outside the mounted hierarchy (a ".." of a cgroup namespace).
std::vector<std::string> SelfAndAncestors(const std::string& path) {
  std::vector<std::string> out;
  if (path.empty() || path[0] != '/' || path.find("/..") != std::string::npos) return out;
  std::string p = path;
  while (p.size() > 1 && p.back() == '/')
    p.pop_back();
  for (;;) {
    out.push_back(p);
    if (p == "/") break;
    const size_t slash = p.rfind('/');
    p = slash == 0 ? "/" : p.substr(0, slash);
  }
  return out;
}

// One cgroup hierarchy's memory controller: where it is mounted and its files.
struct Hierarchy {
  std::string root;
  const char* name;        // "cgroup v2 memory.max"
  const char* limit_file;  // memory.max
  const char* usage_file;  // memory.current
  const char* inactive;    // the memory.stat key of the inactive file pages
  bool v1 = false;
};

// Of the cgroup at `path` and its ancestors, the limit that leaves the least.
std::optional<MemoryLimit> ReadCgroupLimit(const Hierarchy& h, const std::string& path) {
  std::optional<MemoryLimit> best;
  for (const std::string& cg : SelfAndAncestors(path)) {
    const std::string dir = h.root + (cg == "/" ? "" : cg) + "/";
    const std::optional<std::string> text = ReadLine(dir + h.limit_file);
    if (!text || *text == "max") continue;
    const std::optional<uint64_t> limit = ParseCount(*text);
    if (!limit || (h.v1 && *limit >= kV1Unlimited)) continue;
    const std::optional<std::string> usage_text = ReadLine(dir + h.usage_file);
    const uint64_t usage = usage_text ? ParseCount(*usage_text).value_or(0) : 0;
    const uint64_t inactive = Field(dir + "memory.stat", h.inactive, 1).value_or(0);
    MemoryLimit m{.source = std::string(h.name) + " of " + cg,
                  .scope = MemoryScope::kCgroup,
                  .limit = *limit,
                  .used = usage > inactive ? usage - inactive : 0,
                  .used_by = std::string(h.usage_file) + " less " + h.inactive,
                  .raise_by =
                      "raise the cgroup's limit (docker run --memory, Kubernetes "
                      "resources.limits.memory, systemd MemoryMax=)"};
    if (!best || m.available() < best->available()) best = std::move(m);
  }
  return best;
}

uint64_t SoftRlimit(int resource) {
  struct rlimit rl {};
  if (getrlimit(resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
  return static_cast<uint64_t>(rl.rlim_cur);
}

}  // namespace

uint64_t MemoryLimit::PerRank(uint64_t ranks) const {
  if (scope == MemoryScope::kProcess) return available();
  return available() / std::max<uint64_t>(1, ranks);
}

std::string MemoryLimit::ToString() const {
  if (scope == MemoryScope::kMachine) return source;
  std::string s = source + " = " + FormatBytes(limit);
  if (!used_by.empty()) s += ", " + FormatBytes(used) + " of it in use (" + used_by + ")";
  return s;
}

namespace {

// A limit nothing is counted against yet: all of it is available.
MemoryLimit WholeLimit(const char* source, MemoryScope scope, uint64_t bytes,
                       const char* raise_by) {
  return {.source = source,
          .scope = scope,
          .limit = bytes,
          .used = 0,
          .used_by = "",
          .raise_by = raise_by};
}

}  // namespace

MemoryLimit MemAvailableLimit(uint64_t bytes) {
  return WholeLimit("MemAvailable", MemoryScope::kMachine, bytes, "free memory on this machine");
}

MemoryLimit HostBudgetLimit(uint64_t bytes) {
  return WholeLimit("strata.host_budget", MemoryScope::kProcess, bytes, "raise strata.host_budget");
}

Result<std::vector<MemoryLimit>> ReadMemoryLimits(const MemoryLimitOptions& options) {
  std::vector<MemoryLimit> out;
  const std::string meminfo = options.proc_root + "/meminfo";
  const std::optional<uint64_t> available = Field(meminfo, "MemAvailable:", 1024);
  if (!available) return UnavailableError(meminfo + " has no MemAvailable line");
  out.push_back(MemAvailableLimit(*available));
  const CgroupPaths paths = ReadCgroupPaths(options.proc_root);
  if (paths.v2) {
    std::string root = options.cgroup_root;
    if (!Exists(root + "/cgroup.controllers")) root += "/unified";
    const Hierarchy v2{
        root, "cgroup v2 memory.max", "memory.max", "memory.current", "inactive_file", false};
    if (std::optional<MemoryLimit> m = ReadCgroupLimit(v2, *paths.v2)) out.push_back(*m);
  }
  if (paths.v1_memory) {
    const Hierarchy v1{options.cgroup_root + "/memory", "cgroup v1 memory.limit_in_bytes",
                       "memory.limit_in_bytes",         "memory.usage_in_bytes",
                       "total_inactive_file",           true};
    if (std::optional<MemoryLimit> m = ReadCgroupLimit(v1, *paths.v1_memory)) out.push_back(*m);
  }
  const std::function<uint64_t(int)> soft =
      options.soft_rlimit ? options.soft_rlimit : std::function<uint64_t(int)>(SoftRlimit);
  const std::string status = options.proc_root + "/self/status";
  struct Rlimit {
    int resource;
    const char *name, *field, *used_by, *raise_by;
  };
  for (const Rlimit& r : {Rlimit{RLIMIT_AS, "RLIMIT_AS", "VmSize:", "VmSize", "ulimit -v"},
                          Rlimit{RLIMIT_DATA, "RLIMIT_DATA", "VmData:", "VmData", "ulimit -d"}}) {
    const uint64_t limit = soft(r.resource);
    if (limit == UINT64_MAX) continue;
    out.push_back({.source = r.name,
                   .scope = MemoryScope::kProcess,
                   .limit = limit,
                   .used = Field(status, r.field, 1024).value_or(0),
                   .used_by = r.used_by,
                   .raise_by = std::string("raise the soft limit (") + r.raise_by + ")"});
  }
  if (options.host_budget > 0) {
    out.push_back(HostBudgetLimit(options.host_budget));
  }
  return out;
}

const MemoryLimit* BindingLimit(const std::vector<MemoryLimit>& limits, uint64_t ranks) {
  const MemoryLimit* best = nullptr;
  for (const MemoryLimit& m : limits) {
    if (best == nullptr || m.PerRank(ranks) < best->PerRank(ranks)) best = &m;
  }
  return best;
}

bool TrimHeap() {
#if defined(__GLIBC__)
  return malloc_trim(0) != 0;
#else
  return false;
#endif
}

}  // namespace strata

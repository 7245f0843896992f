#include "strata/offload/cpu/host_memory_info.h"

#include <linux/capability.h>
#include <numa.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>

#include "strata/core/bytes.h"

namespace strata {
namespace {

// Reads a small text file whole (sysfs, procfs).
Result<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return ErrnoError(errno, "opening " + path);
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) return ErrnoError(errno, "reading " + path);
  return os.str();
}

// The bracketed choice of a sysfs mode file: "always [madvise] never" -> "madvise".
std::string SelectedMode(const std::string& text) {
  const size_t open = text.find('[');
  const size_t close = text.find(']', open == std::string::npos ? 0 : open);
  if (open == std::string::npos || close == std::string::npos) {
    // Some files hold just the value.
    std::string s = text;
    while (!s.empty() && (s.back() == '\n' || s.back() == ' '))
      s.pop_back();
    return s;
  }
  return text.substr(open + 1, close - open - 1);
}

bool ParseU64(std::string_view text, uint64_t* out) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t'))
    text.remove_prefix(1);
  if (text.empty() || text.front() < '0' || text.front() > '9') return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') break;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

// "Name:   1234 kB" -> value of the field `name` in bytes (kB scaled), or false.
bool FieldValue(std::string_view line, std::string_view name, uint64_t* bytes) {
  if (line.size() <= name.size() || line.substr(0, name.size()) != name ||
      line[name.size()] != ':') {
    return false;
  }
  std::string_view rest = line.substr(name.size() + 1);
  uint64_t v = 0;
  if (!ParseU64(rest, &v)) return false;
  if (rest.find("kB") != std::string_view::npos) v *= kKiB;
  *bytes = v;
  return true;
}

// A smaps header line: "7f12a0000000-7f12a4000000 rw-p 00000000 00:00 0   [heap]".
bool ParseVmaHeader(const std::string& line, uint64_t* start, uint64_t* end) {
  unsigned long long s = 0;
  unsigned long long e = 0;
  int consumed = 0;
  if (std::sscanf(line.c_str(), "%llx-%llx %n", &s, &e, &consumed) != 2 || consumed == 0) {
    return false;
  }
  *start = s;
  *end = e;
  return true;
}

}  // namespace

Result<HugePageSupport> QueryHugePageSupport() {
  HugePageSupport s;
  constexpr const char* kThp = "/sys/kernel/mm/transparent_hugepage/";
  if (auto enabled = ReadSmallFile(std::string(kThp) + "enabled"); enabled.ok()) {
    s.thp_enabled = SelectedMode(*enabled);
  }
  if (auto defrag = ReadSmallFile(std::string(kThp) + "defrag"); defrag.ok()) {
    s.thp_defrag = SelectedMode(*defrag);
  }
  if (auto size = ReadSmallFile(std::string(kThp) + "hpage_pmd_size"); size.ok()) {
    uint64_t v = 0;
    if (ParseU64(*size, &v)) s.thp_size = v;
  }
  if (s.thp_size == 0) s.thp_size = 2 * kMiB;

  STRATA_ASSIGN_OR_RETURN(const std::string meminfo, ReadSmallFile("/proc/meminfo"));
  uint64_t free_pages = 0;
  uint64_t reserved_pages = 0;
  std::istringstream lines(meminfo);
  std::string line;
  while (std::getline(lines, line)) {
    uint64_t v = 0;
    if (FieldValue(line, "HugePages_Total", &v)) s.hugetlb_pages_total = v;
    if (FieldValue(line, "HugePages_Free", &v)) free_pages = v;
    if (FieldValue(line, "HugePages_Rsvd", &v)) reserved_pages = v;
    if (FieldValue(line, "Hugepagesize", &v)) s.hugetlb_page_size = v;
  }
  s.hugetlb_pages_free = free_pages > reserved_pages ? free_pages - reserved_pages : 0;
  return s;
}

Result<uint64_t> HugetlbFreePagesOnNode(int numa_node, uint64_t page_size) {
  const std::string path = "/sys/devices/system/node/node" + std::to_string(numa_node) +
                           "/hugepages/hugepages-" + std::to_string(page_size / kKiB) +
                           "kB/free_hugepages";
  STRATA_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path));
  uint64_t v = 0;
  if (!ParseU64(text, &v)) return InternalError("unexpected contents of " + path + ": " + text);
  return v;
}

std::string FormatLimit(uint64_t bytes) {
  return bytes == MemlockLimit::kUnlimited ? std::string("unlimited") : FormatBytes(bytes);
}

std::string MemlockLimit::ToString() const {
  std::string s = "RLIMIT_MEMLOCK " + FormatLimit(soft) + " (soft) / " + FormatLimit(hard) +
                  " (hard), " + FormatBytes(locked_bytes) + " locked now, ";
  s += has_cap_ipc_lock ? "CAP_IPC_LOCK held (the limit does not apply)" : "no CAP_IPC_LOCK";
  return s;
}

Result<MemlockLimit> QueryMemlockLimit() {
  MemlockLimit m;
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return ErrnoError(errno, "getrlimit(RLIMIT_MEMLOCK)");
  m.soft = rl.rlim_cur == RLIM_INFINITY ? MemlockLimit::kUnlimited : rl.rlim_cur;
  m.hard = rl.rlim_max == RLIM_INFINITY ? MemlockLimit::kUnlimited : rl.rlim_max;

  __user_cap_header_struct header{};
  header.version = _LINUX_CAPABILITY_VERSION_3;
  header.pid = 0;  // the calling thread: capabilities are per thread
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (syscall(SYS_capget, &header, data) != 0) return ErrnoError(errno, "capget");
  m.has_cap_ipc_lock = (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;

  auto locked = LockedBytesOfProcess();
  if (locked.ok()) m.locked_bytes = *locked;
  return m;
}

Result<uint64_t> LockedBytesOfProcess() {
  STRATA_ASSIGN_OR_RETURN(const std::string status, ReadSmallFile("/proc/self/status"));
  std::istringstream lines(status);
  std::string line;
  while (std::getline(lines, line)) {
    uint64_t v = 0;
    if (FieldValue(line, "VmLck", &v)) return v;
  }
  return NotFoundError("no VmLck line in /proc/self/status");
}

bool NumaNodes::IsAllowed(int node) const {
  return std::find(allowed.begin(), allowed.end(), node) != allowed.end();
}

std::string NumaNodes::AllowedString() const {
  if (allowed.empty()) return "none";
  // Contiguous runs as "a-b".
  std::string s;
  size_t i = 0;
  while (i < allowed.size()) {
    size_t j = i;
    while (j + 1 < allowed.size() && allowed[j + 1] == allowed[j] + 1)
      ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(allowed[i]);
    if (j > i) s += (j == i + 1 ? ", " : "-") + std::to_string(allowed[j]);
    i = j + 1;
  }
  return s;
}

NumaNodes QueryNumaNodes() {
  NumaNodes n;
  if (numa_available() < 0) {
    n.configured = {0};
    n.allowed = {0};
    return n;
  }
  n.numa = true;
  const int max_node = numa_max_possible_node();
  bitmask* mems = numa_get_mems_allowed();
  for (int i = 0; i <= max_node; ++i) {
    const auto bit = static_cast<unsigned int>(i);
    const bool configured = numa_nodes_ptr != nullptr && numa_bitmask_isbitset(numa_nodes_ptr, bit);
    if (configured) n.configured.push_back(i);
    if (configured && mems != nullptr && numa_bitmask_isbitset(mems, bit)) n.allowed.push_back(i);
  }
  if (mems != nullptr) numa_bitmask_free(mems);
  return n;
}

Result<RangeMemory> MeasureRange(const void* begin, uint64_t bytes) {
  STRATA_ASSIGN_OR_RETURN(std::vector<RangeMemory> r, MeasureRanges({MemoryRange{begin, bytes}}));
  return r[0];
}

Result<std::vector<RangeMemory>> MeasureRanges(const std::vector<MemoryRange>& ranges) {
  std::vector<RangeMemory> out(ranges.size());
  if (ranges.empty()) return out;
  struct Span {
    uint64_t begin;
    uint64_t end;
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(ranges.size());
  uint64_t max_end = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const auto b = reinterpret_cast<uintptr_t>(ranges[i].begin);
    out[i].bytes = ranges[i].bytes;
    if (ranges[i].bytes == 0) continue;
    spans.push_back({b, b + ranges[i].bytes, i});
    max_end = std::max<uint64_t>(max_end, b + ranges[i].bytes);
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  if (spans.empty()) return out;

  std::FILE* f = std::fopen("/proc/self/smaps", "re");
  if (f == nullptr) return ErrnoError(errno, "opening /proc/self/smaps");
  // For the current VMA: the spans it overlaps, with the fraction of the VMA in each.
  struct Hit {
    size_t index;
    double fraction;
  };
  std::vector<Hit> hits;
  std::string line;
  char buf[512];
  bool done = false;
  while (!done && std::fgets(buf, sizeof buf, f) != nullptr) {
    line.assign(buf);
    // Long lines (paths) arrive in pieces; only the first piece matters.
    while (!line.empty() && line.back() != '\n') {
      if (std::fgets(buf, sizeof buf, f) == nullptr) break;
      if (std::strchr(buf, '\n') != nullptr) line.push_back('\n');
    }
    uint64_t vs = 0;
    uint64_t ve = 0;
    if (!line.empty() && line[0] != ' ' && std::strchr(line.c_str(), ':') != nullptr &&
        line.find('-') < line.find(' ') && ParseVmaHeader(line, &vs, &ve)) {
      hits.clear();
      if (vs >= max_end) {
        done = true;  // smaps is in address order: nothing further can overlap
        break;
      }
      // First span whose end is beyond vs.
      auto it = std::lower_bound(spans.begin(), spans.end(), vs,
                                 [](const Span& s, uint64_t v) { return s.end <= v; });
      for (; it != spans.end() && it->begin < ve; ++it) {
        const uint64_t lo = std::max(vs, it->begin);
        const uint64_t hi = std::min(ve, it->end);
        if (hi <= lo) continue;
        RangeMemory& r = out[it->index];
        ++r.vmas;
        const bool inside = vs >= it->begin && ve <= it->end;
        if (!inside) r.exact = false;
        hits.push_back(
            {it->index,
             inside ? 1.0 : static_cast<double>(hi - lo) / static_cast<double>(ve - vs)});
      }
      continue;
    }
    if (hits.empty()) continue;
    uint64_t v = 0;
    uint64_t RangeMemory::*field = nullptr;
    if (FieldValue(line, "Rss", &v)) {
      field = &RangeMemory::rss_bytes;
    } else if (FieldValue(line, "AnonHugePages", &v)) {
      field = &RangeMemory::anon_huge_bytes;
    } else if (FieldValue(line, "Private_Hugetlb", &v) || FieldValue(line, "Shared_Hugetlb", &v)) {
      field = &RangeMemory::hugetlb_bytes;
    } else if (FieldValue(line, "Locked", &v)) {
      field = &RangeMemory::locked_bytes;
    }
    if (field == nullptr) continue;
    for (const Hit& h : hits) {
      out[h.index].*field +=
          h.fraction == 1.0 ? v : static_cast<uint64_t>(static_cast<double>(v) * h.fraction);
    }
  }
  const bool read_error = std::ferror(f) != 0;
  const int saved_errno = errno;
  std::fclose(f);
  if (read_error) return ErrnoError(saved_errno, "reading /proc/self/smaps");
  return out;
}

}  // namespace strata

// The host memory this process may use, and which limit decides it: what the machine has
// available (MemAvailable), what the process's cgroup leaves (cgroup v2 memory.max or v1
// memory.limit_in_bytes of its own cgroup and of every ancestor, less what the cgroup
// already uses), the soft RLIMIT_AS and RLIMIT_DATA (less the process's VmSize and VmData),
// and strata.host_budget when set. Each limit keeps its name and numbers, so a refusal can
// say which one binds and what to change.
//
// A cgroup's use is its memory.current (v2) or memory.usage_in_bytes (v1) less its inactive
// file pages (memory.stat: inactive_file, v1 total_inactive_file): page cache the kernel
// reclaims before it kills anything, as MemAvailable counts it available. The memory
// controller of a v1 hierarchy is read at <cgroup root>/memory; a v2 hierarchy at the root,
// or at <root>/unified (the hybrid layout) when the root is not a cgroup2 mount. A file that
// is missing or does not hold a number is no limit; a v1 limit of 2^62 bytes or more is the
// kernel's "unlimited".
//
// The roots are injectable (MemoryLimitOptions) so tests can give fake trees.
//
// Thread-safety: plain functions and values.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata {

// Who shares a limit: the whole machine (MemAvailable: every rank on it), one cgroup (every
// process in it: the ranks a launcher starts in one container share its limit), or this
// process alone (an rlimit, strata.host_budget, which bounds each rank's host tier).
enum class MemoryScope : uint8_t { kMachine, kCgroup, kProcess };

struct MemoryLimit {
  // "MemAvailable", "cgroup v2 memory.max of /user.slice/x", "cgroup v1
  // memory.limit_in_bytes of /docker/abc", "RLIMIT_AS", "RLIMIT_DATA", "strata.host_budget".
  std::string source;
  MemoryScope scope = MemoryScope::kProcess;
  uint64_t limit = 0;    // the limit itself (MemAvailable: the bytes available)
  uint64_t used = 0;     // already in use under it
  std::string used_by;   // what `used` is ("VmSize", ...); empty when nothing is counted
  std::string raise_by;  // how to raise the limit ("ulimit -v", ...)

  uint64_t available() const { return limit > used ? limit - used : 0; }
  // What each of `ranks` processes like this one on the machine may use under it: a shared
  // limit (machine, cgroup) divided among them, a process's own whole.
  uint64_t PerRank(uint64_t ranks) const;
  // "MemAvailable", "RLIMIT_AS = 8 GiB, 1.2 GiB of it in use (VmSize)", ...
  std::string ToString() const;
};

struct MemoryLimitOptions {
  std::string proc_root = "/proc";
  std::string cgroup_root = "/sys/fs/cgroup";
  // The soft limit of RLIMIT_AS or RLIMIT_DATA (the resource), UINT64_MAX for none; null:
  // getrlimit.
  std::function<uint64_t(int resource)> soft_rlimit = nullptr;
  uint64_t host_budget = 0;  // strata.host_budget; 0: not set
};

// MemAvailable's bytes as a limit of the machine; strata.host_budget's as a rank's.
MemoryLimit MemAvailableLimit(uint64_t bytes);
MemoryLimit HostBudgetLimit(uint64_t bytes);

// Every limit that is set: MemAvailable first, then the cgroup's (v2, then v1: of each
// hierarchy the level that leaves the least), RLIMIT_AS, RLIMIT_DATA and strata.host_budget.
// Unavailable when <proc_root>/meminfo has no MemAvailable line.
Result<std::vector<MemoryLimit>> ReadMemoryLimits(const MemoryLimitOptions& options = {});

// Of `limits`, the one that leaves each of `ranks` ranks on the machine the least
// (MemoryLimit::PerRank; the first such on a tie); nullptr when `limits` is empty.
const MemoryLimit* BindingLimit(const std::vector<MemoryLimit>& limits, uint64_t ranks = 1);

// Hands the malloc heap's free memory back to the system (glibc's malloc_trim; nothing
// elsewhere): glibc keeps freed chunks resident, and its dynamic mmap threshold (raised by
// the first large free) serves later large tensors from the heap too, so a process that
// freed a model's tensors keeps their pages until this runs. Returns whether any were given
// back.
bool TrimHeap();

}  // namespace strata

// What the kernel offers the host tier, read from /proc and /sys: transparent and
// hugetlbfs huge pages, the locked-memory limit (RLIMIT_MEMLOCK and CAP_IPC_LOCK), the
// NUMA nodes this process may allocate on, and how much of an address range is backed
// by huge pages or locked (from /proc/self/smaps).
//
// The host pool (host_pool.h) uses these to choose what to allocate and to explain
// every fallback; tests and tools use them to decide what the machine can do.
//
// Thread-safety: all functions are thread-safe; each reads the kernel's current state
// (nothing is cached), so two calls may disagree when the system changes in between.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata {

// Huge-page facilities of this machine.
struct HugePageSupport {
  // Transparent huge pages: the selected mode of
  // /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise", "never"), or ""
  // when the kernel has no THP.
  std::string thp_enabled;
  // The selected mode of .../transparent_hugepage/defrag ("always", "defer",
  // "defer+madvise", "madvise", "never"), or "".
  std::string thp_defrag;
  // The PMD huge-page size (.../transparent_hugepage/hpage_pmd_size), 2 MiB on x86-64.
  uint64_t thp_size = 0;

  // hugetlbfs (MAP_HUGETLB) pages of the default size, from /proc/meminfo.
  uint64_t hugetlb_page_size = 0;    // Hugepagesize
  uint64_t hugetlb_pages_total = 0;  // HugePages_Total (= /proc/sys/vm/nr_hugepages)
  uint64_t hugetlb_pages_free = 0;   // HugePages_Free - HugePages_Rsvd: not yet promised

  // True when madvise(MADV_HUGEPAGE) can give huge pages (mode always or madvise).
  bool thp_available() const { return !thp_enabled.empty() && thp_enabled != "never"; }
};

// Reads the current huge-page state. Missing THP files (a kernel without THP) are not
// an error: thp_enabled stays empty. An unreadable /proc/meminfo is.
Result<HugePageSupport> QueryHugePageSupport();

// Free (not yet reserved) default-size hugetlbfs pages on one NUMA node, from
// /sys/devices/system/node/node<N>/hugepages/hugepages-<size>kB/free_hugepages.
Result<uint64_t> HugetlbFreePagesOnNode(int numa_node, uint64_t page_size);

// The locked-memory limit of this process.
struct MemlockLimit {
  uint64_t soft = 0;              // RLIMIT_MEMLOCK rlim_cur in bytes; kUnlimited for RLIM_INFINITY
  uint64_t hard = 0;              // rlim_max
  bool has_cap_ipc_lock = false;  // CAP_IPC_LOCK in the calling thread's effective set
  uint64_t locked_bytes = 0;      // VmLck of /proc/self/status: already locked
  static constexpr uint64_t kUnlimited = ~uint64_t{0};

  // "64 KiB (soft) / 8 MiB (hard)", "unlimited" where so; plus whether the process
  // holds CAP_IPC_LOCK (which makes the limit irrelevant).
  std::string ToString() const;
};
Result<MemlockLimit> QueryMemlockLimit();
// FormatBytes, or "unlimited" for MemlockLimit::kUnlimited.
std::string FormatLimit(uint64_t bytes);

// The NUMA nodes of this machine and those this process may allocate on (its cpuset's
// mems_allowed). A kernel without NUMA support reports one node, 0, with numa=false.
struct NumaNodes {
  bool numa = false;            // the kernel supports NUMA policies (libnuma available)
  std::vector<int> configured;  // every node the kernel knows
  std::vector<int> allowed;     // nodes this process may allocate on
  bool IsAllowed(int node) const;
  // "0, 1" or "0-3": the allowed nodes, for error messages.
  std::string AllowedString() const;
};
NumaNodes QueryNumaNodes();

// Memory of the VMAs inside [begin, begin + bytes), from /proc/self/smaps.
struct RangeMemory {
  uint64_t bytes = 0;            // the range's size
  uint64_t rss_bytes = 0;        // Rss: resident
  uint64_t anon_huge_bytes = 0;  // AnonHugePages: on transparent huge pages
  uint64_t hugetlb_bytes = 0;    // Private_Hugetlb + Shared_Hugetlb
  uint64_t locked_bytes = 0;     // Locked: mlocked
  uint64_t vmas = 0;             // VMAs counted
  // False when a VMA reached outside the range (the kernel merged it with a
  // neighbour); its counts were then scaled to the overlap, an estimate.
  bool exact = true;
};
// REQUIRES: begin and bytes are page aligned.
Result<RangeMemory> MeasureRange(const void* begin, uint64_t bytes);

// One pass over /proc/self/smaps for several ranges (sorted or not); result i belongs to
// ranges[i]. Cheaper than one MeasureRange per range: smaps walks every mapping.
struct MemoryRange {
  const void* begin = nullptr;
  uint64_t bytes = 0;
};
Result<std::vector<RangeMemory>> MeasureRanges(const std::vector<MemoryRange>& ranges);

// VmLck of /proc/self/status: bytes this process has locked.
Result<uint64_t> LockedBytesOfProcess();

}  // namespace strata

#include "strata/offload/cpu/host_pool.h"

#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "strata/core/budget.h"
#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/config.h"
#include "strata/core/logging.h"
#include "strata/offload/cpu/host_memory_info.h"

#ifdef STRATA_HAVE_CUDA
#include "strata/core/cuda/cuda.h"
#endif

// Linux 5.14; older C libraries do not name it.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace strata {

// ---------------------------------------------------------------------------
// Names and options.

std::string_view HugePagePolicyName(HugePagePolicy policy) {
  switch (policy) {
    case HugePagePolicy::kNone:
      return "none";
    case HugePagePolicy::kTransparent:
      return "transparent";
    case HugePagePolicy::kHugetlbfsPreferred:
      return "hugetlbfs-preferred";
  }
  return "?";
}

Result<HugePagePolicy> ParseHugePagePolicy(std::string_view name) {
  if (name == "none") return HugePagePolicy::kNone;
  if (name == "transparent" || name == "thp") return HugePagePolicy::kTransparent;
  if (name == "hugetlbfs-preferred" || name == "hugetlbfs") {
    return HugePagePolicy::kHugetlbfsPreferred;
  }
  return InvalidArgumentError("unknown huge-page policy \"" + std::string(name) +
                              "\"; expected none, transparent or hugetlbfs-preferred");
}

std::string_view HugePageKindName(HugePageKind kind) {
  switch (kind) {
    case HugePageKind::kNone:
      return "small pages";
    case HugePageKind::kTransparent:
      return "transparent huge pages";
    case HugePageKind::kHugetlbfs:
      return "hugetlbfs pages";
  }
  return "?";
}

std::string_view PinKindName(PinKind kind) {
  switch (kind) {
    case PinKind::kNone:
      return "pageable";
    case PinKind::kMlock:
      return "mlock";
    case PinKind::kCudaRegistered:
      return "cudaHostRegister";
    case PinKind::kHugetlbfs:
      return "hugetlbfs (resident)";
  }
  return "?";
}

HostPoolOptions HostPoolOptions::FromConfig(const StrataConfig& config, bool pin_memory) {
  HostPoolOptions o;
  o.numa_node = config.numa_node;
  o.pin = pin_memory;
  o.allow_unpinned = config.allow_unpinned;
  o.budget_bytes = config.host_budget;
  o.huge_pages = HugePagePolicy::kTransparent;
  o.huge_pages_required = false;
  return o;
}

std::string HostPoolOptions::ToString() const {
  std::string s =
      name + ": numa_node=" + std::to_string(numa_node) + " pin=" + (pin ? "true" : "false") +
      " allow_unpinned=" + (allow_unpinned ? "true" : "false") +
      " huge_pages=" + std::string(HugePagePolicyName(huge_pages)) +
      (huge_pages_required ? " (required)" : "") +
      " budget=" + (budget_bytes == 0 ? std::string("unlimited") : FormatBytes(budget_bytes));
  return s;
}

std::string HostPoolStats::ToString() const {
  char cov[32];
  std::snprintf(cov, sizeof cov, "%.1f%%", 100.0 * huge_page_coverage());
  std::string s = "in use " + FormatBytes(bytes_in_use) + " (" + std::to_string(live_allocations) +
                  " buffers, peak " + FormatBytes(peak_bytes) + ", budget " +
                  (budget_limit == 0 ? std::string("unlimited") : FormatBytes(budget_limit)) +
                  "), pinned " + FormatBytes(pinned_bytes) + " via " + pin_method +
                  ", huge pages " + FormatBytes(huge_page_bytes) + " (" + cov +
                  (huge_pages_measured_now ? ", measured now" : ", at allocation") + ")";
  if (unpinned_fallbacks + huge_page_fallbacks > 0) {
    s += ", fallbacks: " + std::to_string(unpinned_fallbacks) + " unpinned, " +
         std::to_string(huge_page_fallbacks) + " huge pages (latest: " + last_fallback + ")";
  }
  return s;
}

// ---------------------------------------------------------------------------
// Shared pool state.

namespace internal {

struct LiveBuffer {
  uint64_t mapped = 0;
  uint64_t requested = 0;
  PinKind pin = PinKind::kNone;
  HugePageKind huge = HugePageKind::kNone;
  uint64_t huge_bytes_at_allocation = 0;
};

struct HostPoolShared {
  HostPoolShared(HostPoolOptions o, uint64_t limit)
      : options(std::move(o)), budget(options.name + " budget", limit) {}

  const HostPoolOptions options;
  ByteBudget budget;  // thread-safe by itself
  NumaNodes nodes;
  size_t page_size = 4096;
  bool use_cuda_register = false;
  std::string pin_method;

  mutable std::mutex mu;
  // Everything below is guarded by mu.
  std::map<uintptr_t, LiveBuffer> live;  // by data address
  HostPoolStats counters;                // bytes/peak/live/... (pin_method filled on read)
  uint64_t recorded_huge_bytes = 0;      // hugetlbfs bytes + THP bytes at allocation

  Status CheckNode(int node) const;
  Result<HostBuffer> Allocate(std::shared_ptr<HostPoolShared> self, size_t bytes, int node);
  // Unmaps a buffer's memory and updates the accounting.
  Status Release(HostBuffer& buffer);

  // Allocate's phases, in order, over one allocation's state (defined with Allocate).
  struct Allocation;
  Status ChoosePages(Allocation& a) const;
  Status MapWithinBudget(Allocation& a);
  Status PlaceAndAdvise(Allocation& a) const;
  Status PinOrPopulate(Allocation& a) const;
  void MeasureHugePages(Allocation& a) const;
  HostBuffer HandOut(std::shared_ptr<HostPoolShared> self, Allocation& a);
  // Their parts.
  Status PlanTransparent(Allocation& a) const;
  std::string HugetlbShortage(const Allocation& a) const;
  void NoteHugePageFallback(Allocation& a, const std::string& note) const;
  void NoteUnpinned(Allocation& a, const std::string& why) const;
};

}  // namespace internal

using internal::HostPoolShared;

namespace {

// A mapping being built; unmapped unless released.
struct PendingMapping {
  void* base = nullptr;
  size_t length = 0;
  PendingMapping() = default;
  PendingMapping(const PendingMapping&) = delete;
  PendingMapping& operator=(const PendingMapping&) = delete;
  ~PendingMapping() {
    if (base != nullptr) ::munmap(base, length);
  }
};

// Maps `data_len` bytes at an address aligned to `alignment`, with one PROT_NONE guard
// page on each side. The guards catch overruns and keep the kernel from merging the
// buffer's VMA with a neighbour, so /proc/self/smaps reports it alone.
Status MapAligned(size_t data_len, size_t alignment, size_t page, bool hugetlb, PendingMapping* out,
                  void** data) {
  const size_t guard = page;
  const size_t total = data_len + alignment + 2 * guard;
  void* reserve =
      ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) {
    return ErrnoError(errno, "mmap reserving " + FormatBytes(total) + " of address space");
  }
  const auto base = reinterpret_cast<uintptr_t>(reserve);
  const uintptr_t aligned = AlignUp(base + guard, alignment);
  const uintptr_t keep_begin = aligned - guard;
  const uintptr_t keep_end = aligned + data_len + guard;
  // Trim the slack before and after (page-aligned, as all the values above are).
  if (keep_begin > base) ::munmap(reserve, keep_begin - base);
  if (base + total > keep_end) ::munmap(reinterpret_cast<void*>(keep_end), base + total - keep_end);
  out->base = reinterpret_cast<void*>(keep_begin);
  out->length = keep_end - keep_begin;

  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | (hugetlb ? MAP_HUGETLB : 0);
  void* p =
      ::mmap(reinterpret_cast<void*>(aligned), data_len, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    // A failed MAP_FIXED may have removed part of the reservation: drop it all.
    ::munmap(out->base, out->length);
    out->base = nullptr;
    out->length = 0;
    return ErrnoError(
        err, std::string(hugetlb ? "mmap(MAP_HUGETLB) of " : "mmap of ") + FormatBytes(data_len));
  }
  STRATA_CHECK(p == reinterpret_cast<void*>(aligned)) << "MAP_FIXED moved the mapping";
  *data = p;
  return Status::Ok();
}

// Faults every page in (writing, so private pages are really allocated).
Status Populate(void* data, size_t len, size_t page) {
  if (::madvise(data, len, MADV_POPULATE_WRITE) == 0) return Status::Ok();
  const int err = errno;
  if (err != EINVAL) {
    if (err == ENOMEM || err == EFAULT) {
      return Status(StatusCode::kResourceExhausted,
                    "populating " + FormatBytes(len) +
                        ": madvise(MADV_POPULATE_WRITE): not enough memory (on the chosen "
                        "NUMA node, or hugetlbfs pages)",
                    err);
    }
    return ErrnoError(err, "populating " + FormatBytes(len) + ": madvise(MADV_POPULATE_WRITE)");
  }
  // Kernel before 5.14: touch every page.
  auto* bytes = static_cast<volatile unsigned char*>(data);
  for (size_t off = 0; off < len; off += page)
    bytes[off] = 0;
  return Status::Ok();
}

Status BindToNode(void* data, size_t len, int node) {
  bitmask* mask = numa_allocate_nodemask();
  if (mask == nullptr) return ResourceExhaustedError("numa_allocate_nodemask failed");
  numa_bitmask_setbit(mask, static_cast<unsigned int>(node));
  const long rc = ::mbind(data, len, MPOL_BIND, mask->maskp, mask->size + 1, 0);
  const int err = errno;
  numa_bitmask_free(mask);
  if (rc != 0) {
    return ErrnoError(
        err, "mbind(MPOL_BIND) of " + FormatBytes(len) + " to NUMA node " + std::to_string(node));
  }
  return Status::Ok();
}

std::string RaiseMemlockAdvice() {
  return "Raise the limit: `ulimit -l unlimited` in the shell that starts the job (up to the "
         "hard limit; raising that needs root), LimitMEMLOCK=infinity in a systemd service, a "
         "`memlock` line in /etc/security/limits.conf (e.g. `* - memlock unlimited`, then log "
         "in again), `--ulimit memlock=-1` for `docker run`; or grant the process "
         "CAP_IPC_LOCK (`setcap cap_ipc_lock+ep`, `docker run --cap-add IPC_LOCK`)";
}

// "RLIMIT_MEMLOCK is 64 KiB (soft) / 8 MiB (hard) with 1 MiB locked already, and the
// process lacks CAP_IPC_LOCK"
std::string MemlockLimitText() {
  auto limit = QueryMemlockLimit();
  if (!limit.ok()) {
    return "RLIMIT_MEMLOCK could not be read (" + limit.status().ToString() + ")";
  }
  std::string s = "RLIMIT_MEMLOCK is " + FormatLimit(limit->soft) + " (soft) / " +
                  FormatLimit(limit->hard) + " (hard) with " + FormatBytes(limit->locked_bytes) +
                  " locked already";
  s += limit->has_cap_ipc_lock
           ? "; the process holds CAP_IPC_LOCK, so the limit does not apply and the machine "
             "is short of memory that can be locked"
           : ", and the process lacks CAP_IPC_LOCK";
  return s;
}

// The error for a failed mlock of `bytes`: names RLIMIT_MEMLOCK, its values, and how to
// raise it or go on without pinning.
Status MemlockError(int err, size_t bytes) {
  std::string msg = "cannot page-lock " + FormatBytes(bytes) +
                    " of host memory: mlock: " + std::strerror(err) + " (errno " +
                    std::to_string(err) + "). The locked-memory limit " + MemlockLimitText() +
                    ". " + RaiseMemlockAdvice() +
                    ". Or set strata.allow_unpinned=true to continue with pageable (unpinned) "
                    "memory: slower device copies, and the pages may be swapped out.";
  const StatusCode code =
      err == EPERM ? StatusCode::kPermissionDenied : StatusCode::kResourceExhausted;
  return Status(code, std::move(msg), err);
}

// The same, short, for the warning and the fallback record when allow_unpinned is set.
std::string MemlockFallbackNote(int err, size_t bytes) {
  return "could not page-lock " + FormatBytes(bytes) + " (mlock: " + std::strerror(err) + "); " +
         MemlockLimitText() +
         ". Raise it with `ulimit -l unlimited`, LimitMEMLOCK=infinity (systemd), memlock in "
         "/etc/security/limits.conf, `--ulimit memlock=-1` (docker) or CAP_IPC_LOCK";
}

// mlock/munlock as raw system calls: AddressSanitizer intercepts the libc functions and
// makes them no-ops (nothing locked, nothing populated, and success returned).
int SysMlock(const void* addr, size_t len) {
  return static_cast<int>(::syscall(SYS_mlock, addr, len));
}
int SysMunlock(const void* addr, size_t len) {
  return static_cast<int>(::syscall(SYS_munlock, addr, len));
}

void AddFallback(std::string* fallback, std::string_view note) {
  if (!fallback->empty()) *fallback += "; ";
  *fallback += note;
}

std::string Where(size_t bytes, int node) {
  return "allocating " + FormatBytes(bytes) + " of host memory" +
         (node >= 0 ? " on NUMA node " + std::to_string(node) : std::string());
}

}  // namespace

// ---------------------------------------------------------------------------
// HostPoolShared.

namespace internal {

Status HostPoolShared::CheckNode(int node) const {
  if (node == -1) return Status::Ok();
  if (node < -1) {
    return InvalidArgumentError("NUMA node " + std::to_string(node) +
                                " is not valid; use -1 (no binding) or a node number (" +
                                nodes.AllowedString() + ")");
  }
  if (nodes.IsAllowed(node)) return Status::Ok();
  const bool exists =
      std::find(nodes.configured.begin(), nodes.configured.end(), node) != nodes.configured.end();
  std::string configured;
  for (int n : nodes.configured)
    configured += (configured.empty() ? "" : ", ") + std::to_string(n);
  if (!nodes.numa) {
    return InvalidArgumentError("NUMA node " + std::to_string(node) +
                                " does not exist: the kernel has no NUMA support (one node, 0)");
  }
  if (exists) {
    return InvalidArgumentError("NUMA node " + std::to_string(node) +
                                " exists but this process may not allocate on it (its cpuset "
                                "allows node(s) " +
                                nodes.AllowedString() + ")");
  }
  return InvalidArgumentError("NUMA node " + std::to_string(node) +
                              " does not exist; this machine has node(s) " + configured +
                              " (this process may use " + nodes.AllowedString() + ")");
}

// One allocation's choices and what it holds as it goes through Allocate's phases. What is
// not handed out is given back when it goes: the budget released (the destructor), then the
// mapping unmapped (PendingMapping).
struct HostPoolShared::Allocation {
  size_t bytes;
  int node;
  std::string where;  // "allocating 1 GiB of host memory on NUMA node 0", for errors
  HugePageSupport hp{};
  HugePageKind kind = HugePageKind::kNone;
  std::string fallback{};  // the fallbacks taken, for the buffer and the counters
  bool huge_fallback = false;
  bool unpinned_fallback = false;
  PendingMapping mapping{};
  void* data = nullptr;
  size_t mapped = 0;
  size_t alignment = 0;
  ByteBudget* reserved = nullptr;  // holds `mapped` bytes of this budget while set
  PinKind pin = PinKind::kNone;
  uint64_t huge_bytes = 0;  // huge-page bytes at allocation

  ~Allocation() {
    if (reserved != nullptr) reserved->Release(mapped);
  }
};

// Allocates in phases: the pages chosen, the memory mapped within the budget, placed and
// advised, pinned (which populates) or populated, its huge-page coverage measured, and the
// buffer handed out.
Result<HostBuffer> HostPoolShared::Allocate(std::shared_ptr<HostPoolShared> self, size_t bytes,
                                            int node) {
  STRATA_RETURN_IF_ERROR(CheckNode(node));
  if (bytes == 0) return HostBuffer();
  Allocation a{.bytes = bytes, .node = node, .where = Where(bytes, node)};
  if (bytes > std::numeric_limits<size_t>::max() / 4) {
    return ResourceExhaustedError(a.where + ": larger than the address space");
  }
  STRATA_ASSIGN_OR_RETURN(a.hp, QueryHugePageSupport().WithContext(a.where));
  STRATA_RETURN_IF_ERROR(ChoosePages(a));
  STRATA_RETURN_IF_ERROR(MapWithinBudget(a));
  STRATA_RETURN_IF_ERROR(PlaceAndAdvise(a));
  STRATA_RETURN_IF_ERROR(PinOrPopulate(a));
  MeasureHugePages(a);
  return HandOut(std::move(self), a);
}

// A huge-page fallback: warned about and recorded.
void HostPoolShared::NoteHugePageFallback(Allocation& a, const std::string& note) const {
  a.huge_fallback = true;
  STRATA_LOG(kWarn) << options.name << ": " << a.where << ": " << note;
  AddFallback(&a.fallback, note);
}

// Transparent huge pages, falling back to small pages (or failing when huge pages are
// required).
Status HostPoolShared::PlanTransparent(Allocation& a) const {
  if (a.hp.thp_available()) {
    a.kind = HugePageKind::kTransparent;
    return Status::Ok();
  }
  const std::string why =
      a.hp.thp_enabled.empty()
          ? "the kernel has no transparent huge pages (no /sys/kernel/mm/transparent_hugepage)"
          : "transparent huge pages are disabled (/sys/kernel/mm/transparent_hugepage/enabled "
            "is [never]; set it to madvise or always)";
  if (options.huge_pages_required) {
    return FailedPreconditionError(a.where + ": huge pages are required but " + why);
  }
  a.kind = HugePageKind::kNone;
  NoteHugePageFallback(a, "huge pages: transparent -> small 4 KiB pages: " + why);
  return Status::Ok();
}

// Why hugetlbfs pages cannot hold the allocation (none, too few free on the node), or
// empty when they can.
std::string HostPoolShared::HugetlbShortage(const Allocation& a) const {
  const HugePageSupport& hp = a.hp;
  if (hp.hugetlb_page_size == 0) return "the kernel has no hugetlbfs pages";
  const uint64_t need = AlignUp(a.bytes, hp.hugetlb_page_size) / hp.hugetlb_page_size;
  const std::string size = FormatBytes(hp.hugetlb_page_size);
  if (hp.hugetlb_pages_total == 0) {
    return "no hugetlbfs pages are reserved (vm.nr_hugepages is 0; reserve " +
           std::to_string(need) + " or more " + size +
           " pages with `sysctl vm.nr_hugepages=N`, or hugepages=N on the kernel command "
           "line)";
  }
  uint64_t free_pages = hp.hugetlb_pages_free;
  std::string on_node;
  if (a.node >= 0) {
    auto per_node = HugetlbFreePagesOnNode(a.node, hp.hugetlb_page_size);
    if (per_node.ok() && *per_node < free_pages) {
      free_pages = *per_node;
      on_node = " on NUMA node " + std::to_string(a.node);
    }
  }
  if (free_pages < need) {
    return "need " + std::to_string(need) + " free " + size + " hugetlbfs pages" + on_node +
           ", only " + std::to_string(free_pages) + " of " +
           std::to_string(hp.hugetlb_pages_total) + " reserved are free (raise vm.nr_hugepages)";
  }
  return {};
}

// Allocate's first phase: which pages the policy asks for and the machine has.
Status HostPoolShared::ChoosePages(Allocation& a) const {
  switch (options.huge_pages) {
    case HugePagePolicy::kNone:
      a.kind = HugePageKind::kNone;
      return Status::Ok();
    case HugePagePolicy::kTransparent:
      return PlanTransparent(a);
    case HugePagePolicy::kHugetlbfsPreferred: {
      const std::string shortage = HugetlbShortage(a);
      if (shortage.empty()) {
        a.kind = HugePageKind::kHugetlbfs;
        return Status::Ok();
      }
      if (options.huge_pages_required) {
        return ResourceExhaustedError(a.where + ": hugetlbfs pages are required but " + shortage);
      }
      NoteHugePageFallback(a, "huge pages: hugetlbfs -> transparent: " + shortage);
      return PlanTransparent(a);
    }
  }
  return Status::Ok();
}

// The mapping, its bytes reserved in the budget first; a failed hugetlbfs mapping falls back
// to transparent huge pages.
Status HostPoolShared::MapWithinBudget(Allocation& a) {
  for (;;) {
    switch (a.kind) {
      case HugePageKind::kNone:
        a.alignment = page_size;
        a.mapped = AlignUp(a.bytes, page_size);
        break;
      case HugePageKind::kTransparent:
        a.alignment = a.hp.thp_size;
        a.mapped = AlignUp(a.bytes, page_size);
        break;
      case HugePageKind::kHugetlbfs:
        a.alignment = a.hp.hugetlb_page_size;
        a.mapped = AlignUp(a.bytes, a.hp.hugetlb_page_size);
        break;
    }
    STRATA_RETURN_IF_ERROR_CTX(budget.Reserve(a.mapped), a.where);
    Status st = MapAligned(a.mapped, a.alignment, page_size, a.kind == HugePageKind::kHugetlbfs,
                           &a.mapping, &a.data);
    if (st.ok()) break;
    budget.Release(a.mapped);
    if (a.kind == HugePageKind::kHugetlbfs) {
      if (options.huge_pages_required) {
        return Status(StatusCode::kResourceExhausted,
                      a.where + ": hugetlbfs pages are required but " + st.message(),
                      st.errno_value());
      }
      NoteHugePageFallback(a, "huge pages: hugetlbfs -> transparent: " + st.message());
      STRATA_RETURN_IF_ERROR(PlanTransparent(a));
      continue;
    }
    return st.WithContext(a.where);
  }
  // From here on a failure unmaps (PendingMapping) and returns the budget.
  a.reserved = &budget;
  return Status::Ok();
}

// The memory bound to the NUMA node, and advised to take transparent huge pages (or, asking
// for none, kept from THP's "always" mode).
Status HostPoolShared::PlaceAndAdvise(Allocation& a) const {
  if (a.node >= 0 && nodes.numa) {
    STRATA_RETURN_IF_ERROR_CTX(BindToNode(a.data, a.mapped, a.node), a.where);
  }
  if (a.kind == HugePageKind::kTransparent) {
    if (::madvise(a.data, a.mapped, MADV_HUGEPAGE) != 0) {
      const Status st = ErrnoError(errno, "madvise(MADV_HUGEPAGE)");
      if (options.huge_pages_required) return st.WithContext(a.where);
      a.kind = HugePageKind::kNone;
      NoteHugePageFallback(a, "huge pages: transparent -> small 4 KiB pages: " + st.message());
    }
  } else if (a.kind == HugePageKind::kNone) {
    // Keep THP "always" mode from giving huge pages to a buffer that asked for none.
    // EINVAL means a kernel without THP: nothing to turn off.
    if (::madvise(a.data, a.mapped, MADV_NOHUGEPAGE) != 0 && errno != EINVAL) {
      return ErrnoError(errno, "madvise(MADV_NOHUGEPAGE)").WithContext(a.where);
    }
  }
  return Status::Ok();
}

// Going on with pageable memory (strata.allow_unpinned): warned about and recorded.
void HostPoolShared::NoteUnpinned(Allocation& a, const std::string& why) const {
  a.unpinned_fallback = true;
  const std::string note = "pinning: " + why +
                           " -> continuing with pageable (unpinned) memory because "
                           "strata.allow_unpinned is set";
  STRATA_LOG(kWarn) << options.name << ": " << a.where << ": " << note;
  AddFallback(&a.fallback, note);
}

// The memory pinned (hugetlbfs pages as they are, registered with CUDA, or mlock-ed: both
// populate it), or populated.
Status HostPoolShared::PinOrPopulate(Allocation& a) const {
  bool populated = false;
  if (options.pin) {
    if (a.kind == HugePageKind::kHugetlbfs && !use_cuda_register) {
      a.pin = PinKind::kHugetlbfs;  // never swapped; the kernel does not mlock hugetlb VMAs
    } else if (use_cuda_register) {
#ifdef STRATA_HAVE_CUDA
      STRATA_RETURN_IF_ERROR_CTX(Populate(a.data, a.mapped, page_size), a.where);
      populated = true;
      Status st = cuda::RegisterHost(a.data, a.mapped);
      if (st.ok()) {
        a.pin = PinKind::kCudaRegistered;
      } else if (options.allow_unpinned) {
        NoteUnpinned(a, st.ToString());
      } else {
        return st.WithContext(a.where +
                              " (set strata.allow_unpinned=true to continue with "
                              "pageable memory)");
      }
#endif
    } else if (SysMlock(a.data, a.mapped) == 0) {
      a.pin = PinKind::kMlock;
      populated = true;
    } else {
      const int err = errno;
      if (!options.allow_unpinned) return MemlockError(err, a.mapped).WithContext(a.where);
      NoteUnpinned(a, MemlockFallbackNote(err, a.mapped));
    }
  }
  if (!populated) STRATA_RETURN_IF_ERROR_CTX(Populate(a.data, a.mapped, page_size), a.where);
  return Status::Ok();
}

// The huge-page bytes at allocation: all of a hugetlbfs mapping; with verify_huge_pages, what
// THP delivered (a shortfall noted as a fallback).
void HostPoolShared::MeasureHugePages(Allocation& a) const {
  a.huge_bytes = a.kind == HugePageKind::kHugetlbfs ? a.mapped : 0;
  if (a.kind != HugePageKind::kTransparent || !options.verify_huge_pages) return;
  auto measured = MeasureRange(a.data, a.mapped);
  if (!measured.ok()) {
    STRATA_LOG(kWarn) << options.name << ": " << a.where
                      << ": cannot measure huge-page coverage: " << measured.status();
    return;
  }
  a.huge_bytes = std::min<uint64_t>(measured->anon_huge_bytes, a.mapped);
  const uint64_t eligible = a.mapped / a.hp.thp_size * a.hp.thp_size;
  if (a.huge_bytes < eligible) {
    NoteHugePageFallback(a, "huge pages: only " + FormatBytes(a.huge_bytes) + " of " +
                                FormatBytes(eligible) +
                                " got transparent huge pages, the rest small pages (memory "
                                "fragmented? THP defrag is [" +
                                a.hp.thp_defrag + "])");
  }
}

// Allocate's last phase: the buffer takes the mapping and the budget's bytes, and the pool
// records it.
HostBuffer HostPoolShared::HandOut(std::shared_ptr<HostPoolShared> self, Allocation& a) {
  HostBuffer buf;
  buf.pool_ = std::move(self);
  buf.data_ = a.data;
  buf.size_ = a.bytes;
  buf.mapped_size_ = a.mapped;
  buf.alignment_ = a.alignment;
  buf.map_base_ = a.mapping.base;
  buf.map_length_ = a.mapping.length;
  buf.numa_node_ = a.node;
  buf.pin_kind_ = a.pin;
  buf.huge_page_kind_ = a.kind;
  buf.fallback_ = a.fallback;
  buf.unpinned_fallback_ = a.unpinned_fallback;
  buf.huge_page_fallback_ = a.huge_fallback;
  buf.huge_bytes_at_allocation_ = a.huge_bytes;
  a.mapping.base = nullptr;
  a.reserved = nullptr;

  std::lock_guard<std::mutex> lock(mu);
  live[reinterpret_cast<uintptr_t>(a.data)] = {a.mapped, a.bytes, a.pin, a.kind, a.huge_bytes};
  HostPoolStats& c = counters;
  c.bytes_in_use += a.mapped;
  c.requested_bytes_in_use += a.bytes;
  c.peak_bytes = std::max(c.peak_bytes, c.bytes_in_use);
  ++c.live_allocations;
  ++c.total_allocations;
  if (a.pin != PinKind::kNone) c.pinned_bytes += a.mapped;
  if (a.kind == HugePageKind::kHugetlbfs) c.hugetlbfs_bytes += a.mapped;
  if (a.kind == HugePageKind::kTransparent) c.transparent_bytes += a.mapped;
  if (a.unpinned_fallback) ++c.unpinned_fallbacks;
  if (a.huge_fallback) ++c.huge_page_fallbacks;
  if (!a.fallback.empty()) c.last_fallback = a.where + ": " + a.fallback;
  recorded_huge_bytes += a.huge_bytes;
  return buf;
}

Status HostPoolShared::Release(HostBuffer& b) {
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(reinterpret_cast<uintptr_t>(b.data_));
    STRATA_CHECK(it != live.end()) << "freeing a host buffer the pool does not know";
    const LiveBuffer& l = it->second;
    HostPoolStats& c = counters;
    c.bytes_in_use -= l.mapped;
    c.requested_bytes_in_use -= l.requested;
    --c.live_allocations;
    if (l.pin != PinKind::kNone) c.pinned_bytes -= l.mapped;
    if (l.huge == HugePageKind::kHugetlbfs) c.hugetlbfs_bytes -= l.mapped;
    if (l.huge == HugePageKind::kTransparent) c.transparent_bytes -= l.mapped;
    recorded_huge_bytes -= l.huge_bytes_at_allocation;
    live.erase(it);
  }
  Status result;
  if (b.pin_kind_ == PinKind::kCudaRegistered) {
#ifdef STRATA_HAVE_CUDA
    Status st = cuda::UnregisterHost(b.data_);
    if (!st.ok() && result.ok()) result = std::move(st);
#endif
  } else if (b.pin_kind_ == PinKind::kMlock) {
    if (SysMunlock(b.data_, b.mapped_size_) != 0 && result.ok()) {
      result = ErrnoError(errno, "munlock");
    }
  }
  if (::munmap(b.map_base_, b.map_length_) != 0 && result.ok()) {
    result = ErrnoError(errno, "munmap");
  }
  budget.Release(b.mapped_size_);
  return result.WithContext("freeing " + FormatBytes(b.size_) + " of host memory");
}

}  // namespace internal

// ---------------------------------------------------------------------------
// HostBuffer.

HostBuffer::HostBuffer(HostBuffer&& other) noexcept {
  *this = std::move(other);
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this == &other) return *this;
  if (Status st = Free(); !st.ok()) STRATA_LOG(kError) << st;
  pool_ = std::move(other.pool_);
  data_ = other.data_;
  size_ = other.size_;
  mapped_size_ = other.mapped_size_;
  alignment_ = other.alignment_;
  map_base_ = other.map_base_;
  map_length_ = other.map_length_;
  numa_node_ = other.numa_node_;
  pin_kind_ = other.pin_kind_;
  huge_page_kind_ = other.huge_page_kind_;
  fallback_ = std::move(other.fallback_);
  unpinned_fallback_ = other.unpinned_fallback_;
  huge_page_fallback_ = other.huge_page_fallback_;
  huge_bytes_at_allocation_ = other.huge_bytes_at_allocation_;
  other.Reset();
  return *this;
}

HostBuffer::~HostBuffer() {
  if (Status st = Free(); !st.ok()) STRATA_LOG(kError) << st;
}

void HostBuffer::Reset() noexcept {
  pool_.reset();
  data_ = nullptr;
  size_ = 0;
  mapped_size_ = 0;
  alignment_ = 0;
  map_base_ = nullptr;
  map_length_ = 0;
  numa_node_ = -1;
  pin_kind_ = PinKind::kNone;
  huge_page_kind_ = HugePageKind::kNone;
  fallback_.clear();
  unpinned_fallback_ = false;
  huge_page_fallback_ = false;
  huge_bytes_at_allocation_ = 0;
}

Status HostBuffer::Free() {
  if (pool_ == nullptr) {
    Reset();
    return Status::Ok();
  }
  Status st = pool_->Release(*this);
  Reset();
  return st;
}

Result<HugePageCoverage> HostBuffer::MeasureHugePages() const {
  HugePageCoverage c;
  c.bytes = mapped_size_;
  if (data_ == nullptr) return c;
  if (huge_page_kind_ == HugePageKind::kHugetlbfs) {
    c.huge_bytes = mapped_size_;
    return c;
  }
  STRATA_ASSIGN_OR_RETURN(const RangeMemory m, MeasureRange(data_, mapped_size_));
  c.huge_bytes = std::min<uint64_t>(m.anon_huge_bytes + m.hugetlb_bytes, mapped_size_);
  c.exact = m.exact;
  return c;
}

std::string HostBuffer::ToString() const {
  if (data_ == nullptr) return "empty host buffer";
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", data_);
  std::string s = FormatBytes(size_) + " host buffer at " + addr + ", " +
                  (numa_node_ >= 0 ? "on NUMA node " + std::to_string(numa_node_)
                                   : std::string("not NUMA-bound")) +
                  ", " +
                  (pinned() ? "pinned (" + std::string(PinKindName(pin_kind_)) + ")"
                            : std::string("pageable")) +
                  ", " + std::string(HugePageKindName(huge_page_kind_)) + ", aligned to " +
                  FormatBytes(alignment_);
  if (!fallback_.empty()) s += ", fallback: " + fallback_;
  return s;
}

// ---------------------------------------------------------------------------
// HostPool.

HostPool::HostPool(std::shared_ptr<internal::HostPoolShared> shared) : shared_(std::move(shared)) {}

Result<HostPool> HostPool::Create(HostPoolOptions options) {
  if (options.name.empty()) options.name = "host pool";
  const uint64_t limit = options.budget_bytes == 0 ? ByteBudget::kUnlimited : options.budget_bytes;
  auto shared = std::make_shared<HostPoolShared>(std::move(options), limit);
  shared->nodes = QueryNumaNodes();
  const long page = ::sysconf(_SC_PAGESIZE);
  shared->page_size = page > 0 ? static_cast<size_t>(page) : 4096;
  STRATA_RETURN_IF_ERROR_CTX(shared->CheckNode(shared->options.numa_node),
                             "creating " + shared->options.name);

  if (!shared->options.pin) {
    shared->pin_method = "none (pin=false)";
  } else {
    shared->pin_method = "mlock";
#ifdef STRATA_HAVE_CUDA
    std::string reason;
    if (cuda::DeviceCount(&reason) > 0) {
      shared->use_cuda_register = true;
      shared->pin_method = "cudaHostRegister";
    } else {
      shared->pin_method = "mlock (built with CUDA, but no CUDA device: " + reason + ")";
      static std::once_flag once;
      std::call_once(once, [&] {
        STRATA_LOG(kInfo) << shared->options.name
                          << ": built with CUDA but no CUDA device is usable (" << reason
                          << "); pinning host memory with mlock instead of cudaHostRegister";
      });
    }
#endif
  }
  shared->counters.budget_limit = shared->options.budget_bytes;
  return HostPool(std::move(shared));
}

Result<HostBuffer> HostPool::Allocate(size_t bytes) {
  STRATA_CHECK(shared_ != nullptr) << "Allocate on a moved-from HostPool";
  return AllocateOnNode(bytes, shared_->options.numa_node);
}

Result<HostBuffer> HostPool::AllocateOnNode(size_t bytes, int numa_node) {
  STRATA_CHECK(shared_ != nullptr) << "Allocate on a moved-from HostPool";
  Result<HostBuffer> r = shared_->Allocate(shared_, bytes, numa_node);
  if (!r.ok()) {
    std::lock_guard<std::mutex> lock(shared_->mu);
    ++shared_->counters.failed_allocations;
  }
  return r;
}

HostPoolStats HostPool::Stats() const {
  STRATA_CHECK(shared_ != nullptr) << "Stats on a moved-from HostPool";
  std::lock_guard<std::mutex> lock(shared_->mu);
  HostPoolStats s = shared_->counters;
  s.huge_page_bytes = shared_->recorded_huge_bytes;
  s.huge_pages_measured_now = false;
  s.pin_method = shared_->pin_method;
  return s;
}

Result<HostPoolStats> HostPool::MeasureStats() const {
  STRATA_CHECK(shared_ != nullptr) << "MeasureStats on a moved-from HostPool";
  // Held across the smaps read so no buffer is unmapped while it is measured.
  std::lock_guard<std::mutex> lock(shared_->mu);
  HostPoolStats s = shared_->counters;
  s.pin_method = shared_->pin_method;
  std::vector<MemoryRange> ranges;
  uint64_t huge = 0;
  for (const auto& [addr, l] : shared_->live) {
    if (l.huge == HugePageKind::kHugetlbfs) {
      huge += l.mapped;
    } else {
      ranges.push_back({reinterpret_cast<const void*>(addr), l.mapped});
    }
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<RangeMemory> measured,
                          MeasureRanges(ranges).WithContext("measuring huge pages"));
  for (size_t i = 0; i < measured.size(); ++i) {
    huge += std::min<uint64_t>(measured[i].anon_huge_bytes, ranges[i].bytes);
  }
  s.huge_page_bytes = huge;
  s.huge_pages_measured_now = true;
  return s;
}

const HostPoolOptions& HostPool::options() const {
  STRATA_CHECK(shared_ != nullptr) << "options() on a moved-from HostPool";
  return shared_->options;
}

}  // namespace strata

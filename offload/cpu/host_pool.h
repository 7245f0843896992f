// HostPool: the host tier's memory. Hands out owning, move-only HostBuffers that are
//   - placed on a chosen NUMA node (mbind MPOL_BIND; -1 = no binding, first touch),
//   - page-locked: mlock, or cudaHostRegister when this library was built with CUDA and a
//     device is present (so device copies run at full PCIe speed),
//   - aligned for O_DIRECT: 4 KiB at least, 2 MiB (the huge-page size) with huge pages,
//   - backed by transparent huge pages (madvise(MADV_HUGEPAGE) on a 2 MiB aligned
//     mapping) or hugetlbfs pages (MAP_HUGETLB) when asked for and reserved,
//   - populated at allocation (every page faulted in, zero-filled), so NUMA placement
//     and huge pages take effect before first use and first use does not fault,
//   - counted against an enforced byte budget.
//
// Nothing falls back silently. When the pool gives less than was asked for (pageable
// memory because RLIMIT_MEMLOCK forbids locking, THP instead of hugetlbfs pages, small
// pages because THP is off or memory is fragmented) it logs a warning (STRATA_LOG kWarn)
// and records it in the buffer (HostBuffer::fallback()) and the pool's statistics; where
// the options forbid the fallback, the allocation fails with a Status instead.
//
//   STRATA_ASSIGN_OR_RETURN(HostPool pool,
//                           HostPool::Create(HostPoolOptions::FromConfig(cfg.strata, true)));
//   STRATA_ASSIGN_OR_RETURN(HostBuffer buf, pool.Allocate(256 * kMiB));
//   std::span<std::byte> bytes = buf.span();
//
// Ownership and lifetime: a HostBuffer owns its mapping and frees it (unregister or
// munlock, munmap, budget release) in its destructor or in Free(). Buffers keep the
// pool's shared accounting alive, so a buffer may outlive the HostPool it came from.
//
// Thread-safety: HostPool is thread-safe: Allocate, AllocateOnNode, Stats and
// MeasureStats may be called from any thread at once, and buffers may be freed from any
// thread. A single HostBuffer object is not synchronized (like any value); its memory is
// the user's to synchronize.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

struct StrataConfig;  // strata/core/config.h

// Which huge pages the pool asks for.
enum class HugePagePolicy {
  kNone,                // small (4 KiB) pages only; THP disabled for the range (MADV_NOHUGEPAGE)
  kTransparent,         // transparent huge pages (MADV_HUGEPAGE), 2 MiB aligned
  kHugetlbfsPreferred,  // reserved hugetlbfs pages (MAP_HUGETLB) when enough are free,
                        // else transparent huge pages (a reported fallback)
};
std::string_view HugePagePolicyName(HugePagePolicy policy);  // "none", "transparent", ...
// Accepts "none", "transparent" (or "thp"), "hugetlbfs-preferred" (or "hugetlbfs").
Result<HugePagePolicy> ParseHugePagePolicy(std::string_view name);

// What a buffer got.
enum class HugePageKind { kNone, kTransparent, kHugetlbfs };
std::string_view HugePageKindName(HugePageKind kind);  // "small pages", "transparent", ...

enum class PinKind {
  kNone,            // pageable: may be swapped; device copies go through a bounce buffer
  kMlock,           // mlock(2)
  kCudaRegistered,  // cudaHostRegister (page-locked and mapped for the device)
  kHugetlbfs,       // hugetlbfs pages: resident, never swapped; mlock not needed
};
std::string_view PinKindName(PinKind kind);  // "pageable", "mlock", ...

struct HostPoolOptions {
  // NUMA node for the pages; -1 = no binding (pages land where they are first touched,
  // normally the allocating thread's node). A node that does not exist or that this
  // process may not use is an InvalidArgument error.
  int numa_node = -1;
  // Page-lock the memory (mlock or cudaHostRegister).
  bool pin = true;
  // When locking fails (RLIMIT_MEMLOCK without CAP_IPC_LOCK, or cudaHostRegister
  // failing), return pageable memory and log a warning instead of failing.
  bool allow_unpinned = false;
  HugePagePolicy huge_pages = HugePagePolicy::kTransparent;
  // Fail instead of falling back when the huge-page policy cannot be honoured
  // (kTransparent: THP is "never" or absent; kHugetlbfsPreferred: not enough free
  // reserved hugetlbfs pages). A THP range that the kernel backs only partly (memory
  // fragmented) is still only a warning.
  bool huge_pages_required = false;
  // After allocating a THP buffer, read /proc/self/smaps to measure how much of it got
  // huge pages, and warn when less than all of its whole 2 MiB pages did. Costs one
  // smaps read (it walks every mapping of the process) per allocation.
  bool verify_huge_pages = true;
  // Bytes the pool may hold at once (mapped bytes, see HostBuffer::mapped_size());
  // 0 = unlimited.
  uint64_t budget_bytes = 0;
  // Names the budget in errors.
  std::string name = "host pool";

  // From the config: strata.numa_node -> numa_node, strata.host_budget -> budget_bytes,
  // strata.allow_unpinned -> allow_unpinned; `pin_memory` (the offload section's
  // pin_memory) -> pin. Huge pages: transparent, not required. Note that the config's
  // numa_node -1 means "the GPU's node, or local": the engine resolves the GPU's node
  // (Topology::NumaNodeOfPci) and overrides numa_node; the pool itself treats -1 as
  // "no binding".
  static HostPoolOptions FromConfig(const StrataConfig& config, bool pin_memory);

  std::string ToString() const;
};

namespace internal {
struct HostPoolShared;
}

// Huge-page coverage of a buffer or of the whole pool.
struct HugePageCoverage {
  uint64_t bytes = 0;       // bytes considered (mapped)
  uint64_t huge_bytes = 0;  // of them on huge pages (THP AnonHugePages, or hugetlbfs)
  bool exact = true;        // false when smaps merged a VMA with a neighbour (estimate)
  double fraction() const {
    return bytes == 0 ? 0.0 : static_cast<double>(huge_bytes) / static_cast<double>(bytes);
  }
};

// An owning, move-only buffer of host memory from a HostPool. Empty when
// default-constructed, moved from, freed, or allocated with size 0.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  // Frees the memory (see Free); a failure there is logged as an error.
  ~HostBuffer();

  // Frees the memory now and leaves the buffer empty. Returns the first error of
  // cudaHostUnregister / munlock / munmap (the memory is accounted as freed anyway).
  // REQUIRES: no I/O or device copy is still using the memory.
  Status Free();

  void* data() const { return data_; }
  // Bytes asked for.
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() const { return {static_cast<std::byte*>(data_), size_}; }
  // Bytes mapped for it: size rounded up to the page size (4 KiB, or the hugetlbfs page
  // size); what the budget and the statistics count. Usable, and zero-filled too.
  size_t mapped_size() const { return mapped_size_; }
  // Alignment of data(): 2 MiB with huge pages, else the base page size (4 KiB).
  size_t alignment() const { return alignment_; }

  // The tier is always "host"; the kind:
  int numa_node() const { return numa_node_; }  // -1 = not bound
  bool pinned() const { return pin_kind_ != PinKind::kNone; }
  PinKind pin_kind() const { return pin_kind_; }
  HugePageKind huge_page_kind() const { return huge_page_kind_; }

  // Fallbacks this allocation took, e.g. "pinning: ... RLIMIT_MEMLOCK ...; huge pages:
  // hugetlbfs -> transparent (nr_hugepages is 0)"; empty when it got what was asked.
  const std::string& fallback() const { return fallback_; }
  bool unpinned_fallback() const { return unpinned_fallback_; }
  bool huge_page_fallback() const { return huge_page_fallback_; }

  // Huge-page coverage measured now from /proc/self/smaps (hugetlbfs: the whole buffer,
  // without reading smaps). The kernel may split or collapse THPs later, so this can
  // change over a buffer's life.
  Result<HugePageCoverage> MeasureHugePages() const;
  // Huge-page bytes measured when the buffer was allocated (0 when not measured).
  uint64_t huge_bytes_at_allocation() const { return huge_bytes_at_allocation_; }

  // "64 MiB on node 0, pinned (mlock), transparent huge pages, at 0x7f..."
  std::string ToString() const;

 private:
  friend class HostPool;
  friend struct internal::HostPoolShared;
  void Reset() noexcept;

  std::shared_ptr<internal::HostPoolShared> pool_;
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_size_ = 0;
  size_t alignment_ = 0;
  void* map_base_ = nullptr;  // the whole mapping, guard pages included
  size_t map_length_ = 0;
  int numa_node_ = -1;
  PinKind pin_kind_ = PinKind::kNone;
  HugePageKind huge_page_kind_ = HugePageKind::kNone;
  std::string fallback_;
  bool unpinned_fallback_ = false;
  bool huge_page_fallback_ = false;
  uint64_t huge_bytes_at_allocation_ = 0;
};

struct HostPoolStats {
  uint64_t bytes_in_use = 0;            // mapped bytes of live buffers (the budget's count)
  uint64_t requested_bytes_in_use = 0;  // bytes asked for by live buffers
  uint64_t peak_bytes = 0;              // highest bytes_in_use so far
  uint64_t live_allocations = 0;        // live non-empty buffers
  uint64_t total_allocations = 0;       // non-empty buffers ever handed out
  uint64_t failed_allocations = 0;      // Allocate calls that returned an error
  uint64_t pinned_bytes = 0;            // mapped bytes of live pinned buffers
  uint64_t hugetlbfs_bytes = 0;         // mapped bytes of live hugetlbfs buffers
  uint64_t transparent_bytes = 0;       // mapped bytes of live THP-advised buffers
  uint64_t unpinned_fallbacks = 0;      // allocations that wanted pinning and got pageable
  uint64_t huge_page_fallbacks = 0;     // allocations that got less huge-page backing
  uint64_t budget_limit = 0;            // 0 = unlimited
  // Huge-page coverage of the live buffers: hugetlbfs bytes plus THP bytes as measured
  // (at allocation by Stats(), now by MeasureStats()).
  uint64_t huge_page_bytes = 0;
  bool huge_pages_measured_now = false;  // true when from MeasureStats()
  // How the pool pins: "mlock", "cudaHostRegister", "mlock (built with CUDA, no device:
  // ...)", "none (pin=false)".
  std::string pin_method;
  std::string last_fallback;  // the latest fallback message, empty if none happened

  double huge_page_coverage() const {
    return bytes_in_use == 0
               ? 0.0
               : static_cast<double>(huge_page_bytes) / static_cast<double>(bytes_in_use);
  }
  std::string ToString() const;
};

class HostPool {
 public:
  // Checks the options (the NUMA node must exist and be allowed) and decides how to pin.
  static Result<HostPool> Create(HostPoolOptions options);

  // A moved-from pool may only be destroyed or assigned to.
  HostPool(HostPool&&) noexcept = default;
  HostPool& operator=(HostPool&&) noexcept = default;
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;
  ~HostPool() = default;

  // A buffer of `bytes` on the pool's NUMA node. Size 0 gives an empty buffer (no
  // memory, not counted). Errors: ResourceExhausted (budget, RLIMIT_MEMLOCK, no memory
  // on the node, required hugetlbfs pages missing), PermissionDenied (locking not
  // permitted), InvalidArgument (a node that does not exist).
  Result<HostBuffer> Allocate(size_t bytes);
  // The same on another node (-1 = no binding).
  Result<HostBuffer> AllocateOnNode(size_t bytes, int numa_node);

  // Counters, with THP coverage as measured at allocation. Never reads /proc.
  HostPoolStats Stats() const;
  // Counters with the huge-page coverage of all live buffers measured now, in one
  // /proc/self/smaps pass.
  Result<HostPoolStats> MeasureStats() const;

  const HostPoolOptions& options() const;

 private:
  explicit HostPool(std::shared_ptr<internal::HostPoolShared> shared);
  std::shared_ptr<internal::HostPoolShared> shared_;
};

}  // namespace strata

// Tests of the host tier's memory pool (offload/cpu/host_pool.h).
//
// What the machine cannot show (a second NUMA node, reserved hugetlbfs pages, THP
// turned on, permission to change RLIMIT_MEMLOCK) makes the test SKIP with the reason.
#include "strata/offload/cpu/host_pool.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/logging.h"
#include "strata/offload/cpu/host_memory_info.h"

namespace strata {
namespace {

// gmock is not linked: a substring check that prints both strings when it fails.
::testing::AssertionResult ContainsSubstr(const char* hay_expr, const char* needle_expr,
                                          const std::string& hay, const std::string& needle) {
  if (hay.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << hay_expr << " does not contain " << needle_expr
                                       << "\n  text:   " << hay << "\n  wanted: " << needle;
}
#define EXPECT_CONTAINS(hay, needle) EXPECT_PRED_FORMAT2(ContainsSubstr, hay, needle)

static_assert(!std::is_copy_constructible_v<HostBuffer>);
static_assert(!std::is_copy_assignable_v<HostBuffer>);
static_assert(std::is_nothrow_move_constructible_v<HostBuffer>);
static_assert(std::is_nothrow_move_assignable_v<HostBuffer>);

// Captures log lines for the life of the object (at every level, whatever
// STRATA_LOG_LEVEL says).
class LogCapture {
 public:
  LogCapture() : saved_level_(GetLogLevel()) {
    SetLogLevel(LogLevel::kTrace);
    SetLogSink([this](LogLevel level, std::string_view line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.push_back({level, std::string(line)});
    });
  }
  ~LogCapture() {
    SetLogSink({});
    SetLogLevel(saved_level_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  // True when a line of `level` contains every one of `parts`.
  bool Has(LogLevel level, std::initializer_list<std::string_view> parts) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [l, line] : lines_) {
      if (l != level) continue;
      bool all = true;
      for (std::string_view p : parts)
        all = all && line.find(p) != std::string::npos;
      if (all) return true;
    }
    return false;
  }
  std::string All() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string s;
    for (const auto& entry : lines_)
      s += entry.second + "\n";
    return s;
  }

 private:
  LogLevel saved_level_;
  mutable std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
};

HostPoolOptions Opts(HugePagePolicy huge, bool pin) {
  HostPoolOptions o;
  o.huge_pages = huge;
  o.pin = pin;
  return o;
}

HostPool MakePool(const HostPoolOptions& o) {
  auto pool = HostPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

bool IsAlignedPtr(const void* p, uint64_t alignment) {
  return IsAligned(reinterpret_cast<uintptr_t>(p), alignment);
}

// The NUMA node of every page of [p, p + bytes) (negative errno for a page not present).
std::vector<int> NodesOfPages(void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<void*> pages;
  for (size_t off = 0; off < bytes; off += page)
    pages.push_back(static_cast<char*>(p) + off);
  std::vector<int> status(pages.size(), -1);
  // nodes == NULL: move nothing, report where each page is.
  const long rc =
      ::syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0);
  EXPECT_EQ(rc, 0) << "move_pages: " << std::strerror(errno);
  return status;
}

void ExpectAllOnNode(const HostBuffer& buf, int node) {
  const std::vector<int> nodes = NodesOfPages(buf.data(), buf.mapped_size());
  size_t wrong = 0;
  int first_wrong = 0;
  for (int n : nodes) {
    if (n != node && wrong++ == 0) first_wrong = n;
  }
  EXPECT_EQ(wrong, 0u) << wrong << " of " << nodes.size() << " pages are not on node " << node
                       << " (first: " << first_wrong << ")";
}

// ---------------------------------------------------------------------------

TEST(HostPoolTest, AllocateWriteReadFree) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kTransparent, /*pin=*/true));
  const size_t n = 8 * kMiB + 123;
  auto buf = pool.Allocate(n);
  ASSERT_TRUE(buf.ok()) << buf.status();
  ASSERT_NE(buf->data(), nullptr);
  EXPECT_EQ(buf->size(), n);
  EXPECT_FALSE(buf->empty());
  EXPECT_EQ(buf->mapped_size(), AlignUp(n, 4 * kKiB));
  EXPECT_EQ(buf->span().size(), n);

  // Zero-filled at allocation, then a pattern written and read back (including the tail
  // beyond size() up to mapped_size()).
  auto* bytes = static_cast<unsigned char*>(buf->data());
  for (size_t i = 0; i < buf->mapped_size(); i += 4096)
    ASSERT_EQ(bytes[i], 0) << i;
  for (size_t i = 0; i < buf->mapped_size(); ++i)
    bytes[i] = static_cast<unsigned char>(i * 31 + 7);
  for (size_t i = 0; i < buf->mapped_size(); ++i) {
    ASSERT_EQ(bytes[i], static_cast<unsigned char>(i * 31 + 7)) << "at " << i;
  }

  HostPoolStats s = pool.Stats();
  EXPECT_EQ(s.live_allocations, 1u);
  EXPECT_EQ(s.bytes_in_use, buf->mapped_size());
  EXPECT_EQ(s.requested_bytes_in_use, n);
  EXPECT_EQ(s.total_allocations, 1u);

  ASSERT_TRUE(buf->Free().ok());
  EXPECT_TRUE(buf->empty());
  EXPECT_EQ(buf->data(), nullptr);
  EXPECT_TRUE(buf->Free().ok()) << "a second Free is a no-op";
  s = pool.Stats();
  EXPECT_EQ(s.live_allocations, 0u);
  EXPECT_EQ(s.bytes_in_use, 0u);
  EXPECT_EQ(s.requested_bytes_in_use, 0u);
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(s.peak_bytes, AlignUp(n, 4 * kKiB));
}

TEST(HostPoolTest, AlignmentHugeAndSmallPages) {
  auto hp = QueryHugePageSupport();
  ASSERT_TRUE(hp.ok()) << hp.status();
  {
    HostPool pool = MakePool(Opts(HugePagePolicy::kTransparent, /*pin=*/false));
    for (size_t n : {size_t{1}, size_t{4096}, 3 * kMiB, 5 * kMiB + 1}) {
      auto buf = pool.Allocate(n);
      ASSERT_TRUE(buf.ok()) << buf.status();
      if (hp->thp_available()) {
        EXPECT_EQ(buf->alignment(), 2 * kMiB);
        EXPECT_TRUE(IsAlignedPtr(buf->data(), 2 * kMiB)) << buf->ToString();
      }
      EXPECT_TRUE(IsAlignedPtr(buf->data(), 4 * kKiB)) << buf->ToString();
      EXPECT_TRUE(IsAligned(buf->mapped_size(), 4 * kKiB));
    }
  }
  {
    HostPool pool = MakePool(Opts(HugePagePolicy::kNone, /*pin=*/false));
    auto buf = pool.Allocate(12345);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(buf->alignment(), 4 * kKiB);
    EXPECT_TRUE(IsAlignedPtr(buf->data(), 4 * kKiB));
    EXPECT_EQ(buf->mapped_size(), 16 * kKiB);
    EXPECT_EQ(buf->huge_page_kind(), HugePageKind::kNone);
    EXPECT_FALSE(buf->pinned());
    EXPECT_EQ(buf->pin_kind(), PinKind::kNone);
  }
}

TEST(HostPoolTest, SizeZeroGivesAnEmptyBuffer) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kTransparent, true));
  auto buf = pool.Allocate(0);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_TRUE(buf->empty());
  EXPECT_EQ(buf->data(), nullptr);
  EXPECT_EQ(buf->span().size(), 0u);
  EXPECT_EQ(pool.Stats().live_allocations, 0u);
  EXPECT_EQ(pool.Stats().total_allocations, 0u);
}

TEST(HostPoolTest, MoveSemanticsTransferOwnership) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kNone, true));
  auto a = pool.Allocate(64 * kKiB);
  ASSERT_TRUE(a.ok()) << a.status();
  void* const pa = a->data();
  static_cast<char*>(pa)[0] = 42;

  HostBuffer b(std::move(*a));
  EXPECT_TRUE(a->empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a->data(), nullptr);
  EXPECT_EQ(b.data(), pa);
  EXPECT_EQ(b.size(), 64 * kKiB);
  EXPECT_TRUE(b.pinned());
  EXPECT_EQ(static_cast<char*>(b.data())[0], 42);
  EXPECT_EQ(pool.Stats().live_allocations, 1u);

  // Move-assigning over a live buffer frees what it held.
  auto c = pool.Allocate(128 * kKiB);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(pool.Stats().live_allocations, 2u);
  b = std::move(*c);
  EXPECT_EQ(pool.Stats().live_allocations, 1u);
  EXPECT_EQ(pool.Stats().bytes_in_use, 128 * kKiB);
  EXPECT_EQ(b.size(), 128 * kKiB);

  {
    HostBuffer scoped = std::move(b);
    EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move)
  }                          // destructor frees
  EXPECT_EQ(pool.Stats().live_allocations, 0u);
  EXPECT_EQ(pool.Stats().bytes_in_use, 0u);
}

TEST(HostPoolTest, StatsGoUpAndDownPeakStays) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kNone, true));
  auto a = pool.Allocate(1 * kMiB);
  auto b = pool.Allocate(2 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  HostPoolStats s = pool.Stats();
  EXPECT_EQ(s.live_allocations, 2u);
  EXPECT_EQ(s.bytes_in_use, 3 * kMiB);
  EXPECT_EQ(s.peak_bytes, 3 * kMiB);
  EXPECT_EQ(s.pinned_bytes, 3 * kMiB);
  EXPECT_EQ(s.budget_limit, 0u);
  EXPECT_FALSE(s.pin_method.empty());

  ASSERT_TRUE(b->Free().ok());
  s = pool.Stats();
  EXPECT_EQ(s.live_allocations, 1u);
  EXPECT_EQ(s.bytes_in_use, 1 * kMiB);
  EXPECT_EQ(s.peak_bytes, 3 * kMiB);
  EXPECT_EQ(s.total_allocations, 2u);
  EXPECT_CONTAINS(s.ToString(), "1 MiB");
}

TEST(HostPoolTest, BuffersMayOutliveThePool) {
  HostBuffer buf;
  {
    HostPool pool = MakePool(Opts(HugePagePolicy::kNone, true));
    auto r = pool.Allocate(256 * kKiB);
    ASSERT_TRUE(r.ok()) << r.status();
    buf = std::move(*r);
  }
  std::memset(buf.data(), 0xab, buf.size());
  EXPECT_TRUE(buf.Free().ok());
}

TEST(HostPoolTest, BudgetIsEnforced) {
  HostPoolOptions o = Opts(HugePagePolicy::kNone, true);
  o.budget_bytes = 8 * kMiB;
  HostPool pool = MakePool(o);
  auto a = pool.Allocate(6 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();

  auto b = pool.Allocate(4 * kMiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
  const std::string msg = b.status().message();
  EXPECT_CONTAINS(msg, "host pool budget");  // the budget
  EXPECT_CONTAINS(msg, "4 MiB");             // the request
  EXPECT_CONTAINS(msg, "6 MiB");             // in use
  EXPECT_CONTAINS(msg, "8 MiB");             // the limit
  HostPoolStats s = pool.Stats();
  EXPECT_EQ(s.failed_allocations, 1u);
  EXPECT_EQ(s.bytes_in_use, 6 * kMiB);
  EXPECT_EQ(s.budget_limit, 8 * kMiB);

  ASSERT_TRUE(a->Free().ok());
  auto c = pool.Allocate(4 * kMiB);
  EXPECT_TRUE(c.ok()) << c.status();
  auto d = pool.Allocate(4 * kMiB);
  EXPECT_TRUE(d.ok()) << d.status() << ": exactly at the limit fits";
  auto e = pool.Allocate(1);
  EXPECT_FALSE(e.ok()) << "one more byte (a page) is over";
}

TEST(HostPoolTest, TransparentHugePageCoverageIsMeasured) {
  auto hp = QueryHugePageSupport();
  ASSERT_TRUE(hp.ok()) << hp.status();
  if (!hp->thp_available()) {
    GTEST_SKIP() << "transparent huge pages are not available (/sys/kernel/mm/"
                    "transparent_hugepage/enabled is ["
                 << hp->thp_enabled << "])";
  }
  HostPool pool = MakePool(Opts(HugePagePolicy::kTransparent, /*pin=*/false));
  auto buf = pool.Allocate(64 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(buf->huge_page_kind(), HugePageKind::kTransparent);
  auto cov = buf->MeasureHugePages();
  ASSERT_TRUE(cov.ok()) << cov.status();
  EXPECT_EQ(cov->bytes, 64 * kMiB);
  EXPECT_TRUE(cov->exact);
  EXPECT_GT(cov->huge_bytes, 0u) << "no huge pages in a 64 MiB MADV_HUGEPAGE buffer; "
                                 << buf->ToString();
  EXPECT_LE(cov->huge_bytes, 64 * kMiB);
  EXPECT_GT(buf->huge_bytes_at_allocation(), 0u);

  EXPECT_GT(pool.Stats().huge_page_bytes, 0u);
  EXPECT_FALSE(pool.Stats().huge_pages_measured_now);
  auto measured = pool.MeasureStats();
  ASSERT_TRUE(measured.ok()) << measured.status();
  EXPECT_TRUE(measured->huge_pages_measured_now);
  EXPECT_GT(measured->huge_page_bytes, 0u);
  EXPECT_GT(measured->huge_page_coverage(), 0.0);
  EXPECT_EQ(measured->transparent_bytes, 64 * kMiB);
}

TEST(HostPoolTest, NoHugePagesReportsZeroCoverage) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kNone, /*pin=*/false));
  auto buf = pool.Allocate(16 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(buf->huge_page_kind(), HugePageKind::kNone);
  EXPECT_FALSE(buf->huge_page_fallback()) << "asking for none is not a fallback";
  auto cov = buf->MeasureHugePages();
  ASSERT_TRUE(cov.ok()) << cov.status();
  EXPECT_EQ(cov->huge_bytes, 0u);
  EXPECT_EQ(cov->fraction(), 0.0);
  auto stats = pool.MeasureStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->huge_page_bytes, 0u);
  EXPECT_EQ(stats->huge_page_coverage(), 0.0);
}

TEST(HostPoolTest, HugetlbfsWithoutReservedPagesFallsBackAndSaysSo) {
  auto hp = QueryHugePageSupport();
  ASSERT_TRUE(hp.ok()) << hp.status();
  // Ask for more hugetlbfs pages than are free (none are reserved on most machines).
  const uint64_t bytes =
      hp->hugetlb_page_size == 0
          ? 4 * kMiB
          : std::max<uint64_t>(4 * kMiB, (hp->hugetlb_pages_free + 1) * hp->hugetlb_page_size);
  if (bytes > 256 * kMiB) {
    GTEST_SKIP() << hp->hugetlb_pages_free << " hugetlbfs pages of "
                 << FormatBytes(hp->hugetlb_page_size)
                 << " are free: exhausting them would take more than 256 MiB";
  }
  LogCapture log;
  HostPool pool = MakePool(Opts(HugePagePolicy::kHugetlbfsPreferred, /*pin=*/true));
  auto buf = pool.Allocate(bytes);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_NE(buf->huge_page_kind(), HugePageKind::kHugetlbfs);
  EXPECT_EQ(buf->huge_page_kind(),
            hp->thp_available() ? HugePageKind::kTransparent : HugePageKind::kNone);
  EXPECT_TRUE(buf->huge_page_fallback());
  EXPECT_CONTAINS(buf->fallback(), "hugetlbfs -> transparent");
  if (hp->hugetlb_pages_total == 0) {
    EXPECT_CONTAINS(buf->fallback(), "nr_hugepages");
  }
  EXPECT_TRUE(log.Has(LogLevel::kWarn, {"hugetlbfs", FormatBytes(bytes)})) << log.All();
  HostPoolStats s = pool.Stats();
  EXPECT_EQ(s.huge_page_fallbacks, 1u);
  EXPECT_CONTAINS(s.last_fallback, "hugetlbfs");
  EXPECT_EQ(s.hugetlbfs_bytes, 0u);

  // Required: an error instead, naming the shortage.
  HostPoolOptions o = Opts(HugePagePolicy::kHugetlbfsPreferred, true);
  o.huge_pages_required = true;
  HostPool strict = MakePool(o);
  auto r = strict.Allocate(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  EXPECT_CONTAINS(r.status().message(), "hugetlbfs pages are required");
  EXPECT_EQ(strict.Stats().bytes_in_use, 0u);
}

TEST(HostPoolTest, HugetlbfsPagesWhenReserved) {
  auto hp = QueryHugePageSupport();
  ASSERT_TRUE(hp.ok()) << hp.status();
  if (hp->hugetlb_page_size == 0 || hp->hugetlb_pages_free * hp->hugetlb_page_size < 4 * kMiB) {
    GTEST_SKIP() << "needs 4 MiB of free hugetlbfs pages; this machine has "
                 << hp->hugetlb_pages_free << " free of " << hp->hugetlb_pages_total
                 << " reserved (vm.nr_hugepages)";
  }
  HostPool pool = MakePool(Opts(HugePagePolicy::kHugetlbfsPreferred, /*pin=*/true));
  auto buf = pool.Allocate(3 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(buf->huge_page_kind(), HugePageKind::kHugetlbfs);
  EXPECT_FALSE(buf->huge_page_fallback()) << buf->fallback();
  EXPECT_TRUE(IsAlignedPtr(buf->data(), hp->hugetlb_page_size));
  std::memset(buf->data(), 1, buf->mapped_size());
  auto cov = buf->MeasureHugePages();
  ASSERT_TRUE(cov.ok());
  EXPECT_EQ(cov->huge_bytes, buf->mapped_size());
  auto m = MeasureRange(buf->data(), buf->mapped_size());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->hugetlb_bytes, buf->mapped_size()) << "smaps Private_Hugetlb";
}

TEST(HostPoolTest, PinnedPagesAreLocked) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kTransparent, /*pin=*/true));
  auto before = LockedBytesOfProcess();
  ASSERT_TRUE(before.ok()) << before.status();
  auto buf = pool.Allocate(8 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  if (buf->pin_kind() != PinKind::kMlock) {
    GTEST_SKIP() << "the pool pins with " << PinKindName(buf->pin_kind())
                 << ", which VmLck does not show";
  }
  EXPECT_TRUE(buf->pinned());
  EXPECT_FALSE(buf->unpinned_fallback());
  auto after = LockedBytesOfProcess();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(*after, *before + 8 * kMiB) << "VmLck did not grow by the buffer's size";
  auto range = MeasureRange(buf->data(), buf->mapped_size());
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->locked_bytes, 8 * kMiB) << "smaps Locked: of the buffer's range";
  EXPECT_EQ(range->rss_bytes, 8 * kMiB) << "every page resident";
  EXPECT_EQ(pool.Stats().pinned_bytes, 8 * kMiB);

  ASSERT_TRUE(buf->Free().ok());
  auto freed = LockedBytesOfProcess();
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, *before);
}

TEST(HostPoolTest, UnpinnedMemoryIsPopulatedButNotLocked) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kNone, /*pin=*/false));
  auto buf = pool.Allocate(4 * kMiB);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_FALSE(buf->pinned());
  EXPECT_FALSE(buf->unpinned_fallback()) << "pin=false is not a fallback";
  EXPECT_TRUE(buf->fallback().empty()) << buf->fallback();
  auto range = MeasureRange(buf->data(), buf->mapped_size());
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->rss_bytes, 4 * kMiB) << "populated at allocation";
  EXPECT_EQ(range->locked_bytes, 0u);
  EXPECT_EQ(pool.Stats().pinned_bytes, 0u);
}

// Lowers RLIMIT_MEMLOCK and drops CAP_IPC_LOCK from this thread's effective set;
// restores both when destroyed, so a failing assertion cannot leak the change.
class MemlockRestriction {
 public:
  MemlockRestriction() = default;
  MemlockRestriction(const MemlockRestriction&) = delete;
  MemlockRestriction& operator=(const MemlockRestriction&) = delete;

  // Empty string on success, else why it cannot be done.
  std::string Apply(rlim_t soft) {
    if (::getrlimit(RLIMIT_MEMLOCK, &saved_limit_) != 0) {
      return std::string("getrlimit(RLIMIT_MEMLOCK): ") + std::strerror(errno);
    }
    rlimit lowered = saved_limit_;
    lowered.rlim_cur = soft;
    if (saved_limit_.rlim_max != RLIM_INFINITY && saved_limit_.rlim_max < soft) {
      lowered.rlim_cur = saved_limit_.rlim_max;
    }
    if (::setrlimit(RLIMIT_MEMLOCK, &lowered) != 0) {
      return std::string("setrlimit(RLIMIT_MEMLOCK) not permitted: ") + std::strerror(errno);
    }
    limit_changed_ = true;

    header_.version = _LINUX_CAPABILITY_VERSION_3;
    header_.pid = 0;
    if (::syscall(SYS_capget, &header_, saved_caps_) != 0) {
      return std::string("capget: ") + std::strerror(errno);
    }
    if ((saved_caps_[CAP_IPC_LOCK / 32].effective & kIpcLockBit) == 0) return {};
    __user_cap_data_struct dropped[_LINUX_CAPABILITY_U32S_3];
    std::memcpy(dropped, saved_caps_, sizeof dropped);
    dropped[CAP_IPC_LOCK / 32].effective &= ~kIpcLockBit;
    if (::syscall(SYS_capset, &header_, dropped) != 0) {
      return std::string("capset dropping CAP_IPC_LOCK not permitted: ") + std::strerror(errno);
    }
    caps_changed_ = true;
    return {};
  }

  ~MemlockRestriction() {
    if (caps_changed_) {
      EXPECT_EQ(::syscall(SYS_capset, &header_, saved_caps_), 0)
          << "restoring CAP_IPC_LOCK: " << std::strerror(errno);
    }
    if (limit_changed_) {
      EXPECT_EQ(::setrlimit(RLIMIT_MEMLOCK, &saved_limit_), 0)
          << "restoring RLIMIT_MEMLOCK: " << std::strerror(errno);
    }
  }

 private:
  static constexpr uint32_t kIpcLockBit = 1u << (CAP_IPC_LOCK % 32);
  rlimit saved_limit_{};
  bool limit_changed_ = false;
  __user_cap_header_struct header_{};
  __user_cap_data_struct saved_caps_[_LINUX_CAPABILITY_U32S_3] = {};
  bool caps_changed_ = false;
};

TEST(HostPoolTest, MemlockLimitFailureExplainsAndAllowUnpinnedFallsBack) {
  {
    HostPool probe = MakePool(Opts(HugePagePolicy::kNone, true));
    if (probe.Stats().pin_method == "cudaHostRegister") {
      GTEST_SKIP() << "the pool pins with cudaHostRegister, not mlock, so the RLIMIT_MEMLOCK path "
                      "is not taken";
    }
  }
  const auto before = QueryMemlockLimit();
  ASSERT_TRUE(before.ok()) << before.status();
  {
    MemlockRestriction restriction;
    if (std::string why = restriction.Apply(64 * 1024); !why.empty()) GTEST_SKIP() << why;
    auto limit = QueryMemlockLimit();
    ASSERT_TRUE(limit.ok()) << limit.status();
    if (limit->has_cap_ipc_lock) GTEST_SKIP() << "CAP_IPC_LOCK could not be dropped";
    if (limit->soft == MemlockLimit::kUnlimited || limit->soft >= 4 * kMiB) {
      GTEST_SKIP() << "could not lower RLIMIT_MEMLOCK below 4 MiB: " << limit->ToString();
    }

    HostPool strict = MakePool(Opts(HugePagePolicy::kNone, /*pin=*/true));
    auto r = strict.Allocate(4 * kMiB);
    ASSERT_FALSE(r.ok()) << "mlock of 4 MiB succeeded under " << limit->ToString();
    EXPECT_TRUE(r.status().code() == StatusCode::kResourceExhausted ||
                r.status().code() == StatusCode::kPermissionDenied)
        << r.status();
    const std::string msg = r.status().message();
    EXPECT_CONTAINS(msg, "RLIMIT_MEMLOCK");
    EXPECT_CONTAINS(msg, "ulimit -l");
    EXPECT_CONTAINS(msg, "allow_unpinned");
    EXPECT_CONTAINS(msg, FormatLimit(limit->soft) + " (soft)");
    EXPECT_CONTAINS(msg, "4 MiB");
    EXPECT_CONTAINS(msg, "LimitMEMLOCK=infinity");
    EXPECT_CONTAINS(msg, "CAP_IPC_LOCK");
    EXPECT_EQ(strict.Stats().failed_allocations, 1u);
    EXPECT_EQ(strict.Stats().bytes_in_use, 0u) << "the budget was given back";

    LogCapture log;
    HostPoolOptions o = Opts(HugePagePolicy::kNone, /*pin=*/true);
    o.allow_unpinned = true;
    HostPool lenient = MakePool(o);
    auto buf = lenient.Allocate(4 * kMiB);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_FALSE(buf->pinned());
    EXPECT_TRUE(buf->unpinned_fallback());
    EXPECT_CONTAINS(buf->fallback(), "RLIMIT_MEMLOCK");
    EXPECT_TRUE(log.Has(LogLevel::kWarn, {"RLIMIT_MEMLOCK", "allow_unpinned"})) << log.All();
    HostPoolStats s = lenient.Stats();
    EXPECT_EQ(s.unpinned_fallbacks, 1u);
    EXPECT_EQ(s.pinned_bytes, 0u);
    EXPECT_EQ(s.live_allocations, 1u);
    static_cast<char*>(buf->data())[4 * kMiB - 1] = 1;  // usable
  }
  // Restored.
  const auto after = QueryMemlockLimit();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->soft, before->soft);
  EXPECT_EQ(after->hard, before->hard);
  EXPECT_EQ(after->has_cap_ipc_lock, before->has_cap_ipc_lock);
}

TEST(HostPoolTest, PlacedOnNodeZero) {
  const NumaNodes nodes = QueryNumaNodes();
  if (!nodes.numa) GTEST_SKIP() << "the kernel has no NUMA support (libnuma unavailable)";
  if (!nodes.IsAllowed(0)) GTEST_SKIP() << "node 0 is not usable by this process";
  for (bool pin : {false, true}) {
    HostPoolOptions o = Opts(HugePagePolicy::kTransparent, pin);
    o.numa_node = 0;
    HostPool pool = MakePool(o);
    auto buf = pool.Allocate(8 * kMiB);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(buf->numa_node(), 0);
    ExpectAllOnNode(*buf, 0);
  }
}

TEST(HostPoolTest, PlacedOnSecondNode) {
  const NumaNodes nodes = QueryNumaNodes();
  if (!nodes.numa || nodes.allowed.size() < 2) {
    GTEST_SKIP() << "needs two NUMA nodes; this machine has "
                 << (nodes.numa ? std::to_string(nodes.configured.size()) : "no NUMA support, one")
                 << " (usable: " << nodes.AllowedString() << ")";
  }
  const int node = nodes.allowed[1];
  HostPool pool = MakePool(Opts(HugePagePolicy::kTransparent, true));
  auto buf = pool.AllocateOnNode(8 * kMiB, node);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(buf->numa_node(), node);
  ExpectAllOnNode(*buf, node);
}

TEST(HostPoolTest, NonexistentNumaNodeIsInvalidArgument) {
  const NumaNodes nodes = QueryNumaNodes();
  const int missing = nodes.configured.empty() ? 1 : nodes.configured.back() + 1;
  HostPoolOptions o = Opts(HugePagePolicy::kNone, false);
  o.numa_node = missing;
  auto pool = HostPool::Create(o);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument) << pool.status();
  EXPECT_CONTAINS(pool.status().message(), "NUMA node " + std::to_string(missing));
  EXPECT_CONTAINS(pool.status().message(), nodes.AllowedString());

  HostPool ok = MakePool(Opts(HugePagePolicy::kNone, false));
  auto buf = ok.AllocateOnNode(4096, missing);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(buf.status().message(), "NUMA node " + std::to_string(missing));
  auto zero = ok.AllocateOnNode(0, missing);
  EXPECT_FALSE(zero.ok()) << "the node is checked even for an empty buffer";
  auto negative = ok.AllocateOnNode(4096, -2);
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
}

TEST(HostPoolTest, ConcurrentAllocateAndFreeKeepStatsConsistent) {
  HostPoolOptions o = Opts(HugePagePolicy::kNone, /*pin=*/true);
  o.budget_bytes = 6 * kMiB;
  HostPool pool = MakePool(o);
  constexpr int kThreads = 4;
  constexpr int kIters = 60;
  std::atomic<uint64_t> ok{0};
  std::atomic<uint64_t> over_budget{0};
  std::atomic<uint64_t> other_errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<HostBuffer> held;
      for (int i = 0; i < kIters; ++i) {
        const size_t n = (static_cast<size_t>((t * 7 + i * 13) % 16) + 1) * 64 * kKiB;
        auto r = pool.Allocate(n);
        if (r.ok()) {
          ++ok;
          auto* p = static_cast<unsigned char*>(r->data());
          p[0] = static_cast<unsigned char>(t);
          p[n - 1] = static_cast<unsigned char>(i);
          held.push_back(std::move(*r));
        } else if (r.status().code() == StatusCode::kResourceExhausted) {
          ++over_budget;
        } else {
          ++other_errors;
        }
        if (held.size() > 2 || (i % 3 == 0 && !held.empty())) {
          const HostBuffer& b = held.front();
          if (static_cast<const unsigned char*>(b.data())[0] != t) ++other_errors;
          held.erase(held.begin());
        }
        const HostPoolStats s = pool.Stats();
        if (s.bytes_in_use > 6 * kMiB || s.peak_bytes > 6 * kMiB) ++other_errors;
      }
    });
  }
  for (auto& th : threads)
    th.join();
  EXPECT_EQ(other_errors.load(), 0u);
  const HostPoolStats s = pool.Stats();
  EXPECT_EQ(s.live_allocations, 0u);
  EXPECT_EQ(s.bytes_in_use, 0u);
  EXPECT_EQ(s.requested_bytes_in_use, 0u);
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(s.total_allocations, ok.load());
  EXPECT_EQ(s.failed_allocations, over_budget.load());
  EXPECT_EQ(ok.load() + over_budget.load(), uint64_t{kThreads * kIters});
  EXPECT_GT(ok.load(), 0u);
  EXPECT_LE(s.peak_bytes, 6 * kMiB);
  EXPECT_GT(s.peak_bytes, 0u);
}

TEST(HostPoolTest, OptionsFromConfig) {
  StrataConfig cfg;
  cfg.numa_node = 0;
  cfg.host_budget = 3 * kGiB;
  cfg.allow_unpinned = true;
  HostPoolOptions o = HostPoolOptions::FromConfig(cfg, /*pin_memory=*/true);
  EXPECT_EQ(o.numa_node, 0);
  EXPECT_EQ(o.budget_bytes, 3 * kGiB);
  EXPECT_TRUE(o.allow_unpinned);
  EXPECT_TRUE(o.pin);
  EXPECT_EQ(o.huge_pages, HugePagePolicy::kTransparent);
  EXPECT_FALSE(o.huge_pages_required);
  EXPECT_CONTAINS(o.ToString(), "3 GiB");

  const StrataConfig defaults;
  o = HostPoolOptions::FromConfig(defaults, /*pin_memory=*/false);
  EXPECT_EQ(o.numa_node, -1);
  EXPECT_EQ(o.budget_bytes, 0u);
  EXPECT_FALSE(o.allow_unpinned);
  EXPECT_FALSE(o.pin);
}

TEST(HostPoolTest, HugePagePolicyNames) {
  for (HugePagePolicy p :
       {HugePagePolicy::kNone, HugePagePolicy::kTransparent, HugePagePolicy::kHugetlbfsPreferred}) {
    auto parsed = ParseHugePagePolicy(HugePagePolicyName(p));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, p);
  }
  auto bad = ParseHugePagePolicy("gigantic");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(bad.status().message(), "hugetlbfs-preferred");
}

TEST(HostPoolTest, PinMethodIsReported) {
  HostPool pool = MakePool(Opts(HugePagePolicy::kNone, true));
  const std::string method = pool.Stats().pin_method;
  EXPECT_TRUE(method.find("mlock") != std::string::npos ||
              method.find("cudaHostRegister") != std::string::npos)
      << method;
  HostPool unpinned = MakePool(Opts(HugePagePolicy::kNone, false));
  EXPECT_CONTAINS(unpinned.Stats().pin_method, "pin=false");
}

}  // namespace
}  // namespace strata

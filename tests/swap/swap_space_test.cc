// SwapSpace: round trips, striping, CRC32C, fault surfacing, space exhaustion, cleanup,
// the O_DIRECT fallback and concurrent use.
#include "strata/swap/swap_space.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/logging.h"
#include "strata/offload/cpu/host_pool.h"
#include "strata/swap/crc32c.h"
#include "strata/swap/fault_injection.h"
#include "test_util.h"

namespace strata::swap {
namespace {

using testing::CountOpenFilesUnder;
using testing::FillRandom;
using testing::ListDir;
using testing::MakePool;
using testing::ScratchDir;

constexpr uint64_t kBlock = 64 * 1024;

std::span<const std::byte> CSpan(const std::vector<std::byte>& v) {
  return {v.data(), v.size()};
}

SwapSpaceOptions SmallOptions(std::vector<std::string> dirs,
                              IoEngineKind kind = IoEngineKind::kAuto) {
  SwapSpaceOptions o;
  o.directories = std::move(dirs);
  o.block_size = kBlock;
  o.grow_bytes = 1 << 20;
  o.io.kind = kind;
  o.io.queue_depth = 8;
  o.io.threads = 2;
  return o;
}

std::unique_ptr<SwapSpace> MakeSpace(SwapSpaceOptions o) {
  Result<std::unique_ptr<SwapSpace>> s = SwapSpace::Create(std::move(o));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(s).value() : nullptr;
}

// Reads bytes of a swap file straight from the disk, through /proc/self/fd (the file has
// no name), without O_DIRECT.
std::vector<std::byte> ReadOnDisk(const SwapDirectoryInfo& d, uint64_t offset, size_t n) {
  const std::string link = "/proc/self/fd/" + std::to_string(d.fd);
  int fd = open(link.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << strerror(errno);
  std::vector<std::byte> out(n);
  EXPECT_EQ(pread(fd, out.data(), n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  close(fd);
  return out;
}

void CorruptOnDisk(const SwapDirectoryInfo& d, uint64_t offset) {
  const std::string link = "/proc/self/fd/" + std::to_string(d.fd);
  int fd = open(link.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << strerror(errno);
  std::byte b;
  ASSERT_EQ(pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= std::byte{0xff};
  ASSERT_EQ(pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ASSERT_EQ(fsync(fd), 0);
  close(fd);
}

class SwapSpaceEngineTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(a_.ok() && b_.ok());
    if (GetParam() == IoEngineKind::kIoUring && !IoUringAvailable().ok())
      GTEST_SKIP() << "io_uring is not available here: " << IoUringAvailable();
  }
  ScratchDir a_, b_;
  HostPool pool_ = MakePool();
};

TEST_P(SwapSpaceEngineTest, RoundTripsRandomDataAtOddSizesAndAddresses) {
  auto space = MakeSpace(SmallOptions({a_.path(), b_.path()}, GetParam()));
  ASSERT_NE(space, nullptr);
  EXPECT_TRUE(space->direct_io());  // ext4 under /tmp
  EXPECT_EQ(space->fallback(), "");
  EXPECT_EQ(space->engine().name(), GetParam() == IoEngineKind::kIoUring ? "io_uring" : "sync");
  const uint64_t sizes[] = {1,          4095,
                            4096,       4097,
                            kBlock - 1, kBlock,
                            kBlock + 1, 3 * kBlock + 7,
                            1 << 20,    (1 << 20) + 4096,
                            2500000,    5 * kBlock + 4096};
  uint64_t seed = 10;
  for (uint64_t n : sizes) {
    for (size_t misalign : {size_t{0}, size_t{3}}) {
      SCOPED_TRACE("size " + std::to_string(n) + " misaligned by " + std::to_string(misalign));
      Result<SwapHandle> h = space->Allocate(n);
      ASSERT_TRUE(h.ok()) << h.status();
      Result<HostBuffer> src = pool_.Allocate(n + misalign);
      Result<HostBuffer> dst = pool_.Allocate(n + misalign + 64);
      ASSERT_TRUE(src.ok() && dst.ok());
      std::span<std::byte> in = src->span().subspan(misalign, n);
      std::span<std::byte> out = dst->span().subspan(misalign, n);
      FillRandom(in, ++seed);
      // Guard bytes after the output must stay untouched.
      std::memset(dst->span().data() + misalign + n, 0xab, 64);
      ASSERT_TRUE(space->Write(*h, in).ok());
      Status s = space->Read(*h, out);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(std::memcmp(in.data(), out.data(), n), 0);
      for (size_t k = 0; k < 64; ++k)
        ASSERT_EQ(dst->span()[misalign + n + k], std::byte{0xab}) << "guard byte " << k;
      EXPECT_EQ(*space->Size(*h), n);
      ASSERT_TRUE(space->Free(*h).ok());
    }
  }
  SwapSpaceStats st = space->stats();
  EXPECT_EQ(st.tensors, 0u);
  EXPECT_EQ(st.crc_mismatches, 0u);
  EXPECT_GT(st.blocks_verified, 24u);
  EXPECT_GT(st.bounced_bytes, 0u);  // misaligned buffers and odd tails went through bounce
}

TEST_P(SwapSpaceEngineTest, ManyLiveTensorsKeepTheirDataAcrossFreesAndReuse) {
  auto space = MakeSpace(SmallOptions({a_.path(), b_.path()}, GetParam()));
  ASSERT_NE(space, nullptr);
  struct T {
    SwapHandle h;
    std::vector<std::byte> data;
  };
  std::vector<T> live;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 10; ++i) {
      const uint64_t n = 1000 + static_cast<uint64_t>(i) * 37000 + round * 5;
      T t;
      Result<SwapHandle> h = space->Allocate(n);
      ASSERT_TRUE(h.ok()) << h.status();
      t.h = *h;
      t.data.resize(n);
      FillRandom(t.data, 100 * round + i);
      ASSERT_TRUE(space->Write(t.h, CSpan(t.data)).ok());
      live.push_back(std::move(t));
    }
    // Free every other tensor; the next round reuses the holes.
    std::vector<T> kept;
    for (size_t i = 0; i < live.size(); ++i) {
      if (i % 2 == 0) {
        ASSERT_TRUE(space->Free(live[i].h).ok());
      } else {
        kept.push_back(std::move(live[i]));
      }
    }
    live = std::move(kept);
  }
  for (const T& t : live) {
    std::vector<std::byte> back(t.data.size());
    ASSERT_TRUE(space->Read(t.h, back).ok());
    EXPECT_EQ(back, t.data);
  }
}

TEST_P(SwapSpaceEngineTest, PipelinedAsyncOperationsFromSeveralThreads) {
  auto space = MakeSpace(SmallOptions({a_.path(), b_.path()}, GetParam()));
  ASSERT_NE(space, nullptr);
  constexpr int kThreads = 4, kTensors = 6;
  std::atomic<int> errors{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      std::vector<SwapHandle> hs;
      std::vector<std::vector<std::byte>> data(kTensors), back(kTensors);
      std::vector<SwapFuture> fs;
      for (int i = 0; i < kTensors; ++i) {
        const uint64_t n = 3 * kBlock + 1000 * (t + 1) + i;
        Result<SwapHandle> h = space->Allocate(n);
        if (!h.ok()) {
          errors++;
          return;
        }
        hs.push_back(*h);
        data[i].resize(n);
        back[i].resize(n);
        FillRandom(data[i], 1000 + t * 10 + i);
        Result<SwapFuture> f = space->WriteAsync(*h, CSpan(data[i]));
        if (!f.ok()) {
          errors++;
          return;
        }
        fs.push_back(std::move(*f));
      }
      // Wait in reverse order.
      for (int i = kTensors - 1; i >= 0; --i)
        if (!fs[i].Wait().ok()) errors++;
      fs.clear();
      for (int i = 0; i < kTensors; ++i) {
        Result<SwapFuture> f = space->ReadAsync(hs[i], back[i]);
        if (!f.ok()) {
          errors++;
          return;
        }
        fs.push_back(std::move(*f));
      }
      for (int i = 0; i < kTensors; ++i) {
        while (!fs[i].Ready())
          std::this_thread::yield();
        if (!fs[i].Wait().ok() || back[i] != data[i]) errors++;
      }
    });
  }
  for (auto& th : ts)
    th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(space->stats().tensors, static_cast<uint64_t>(kThreads * kTensors));
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapSpaceEngineTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kSync),
                         [](const auto& p) {
                           return p.param == IoEngineKind::kIoUring ? std::string("IoUring")
                                                                    : std::string("Sync");
                         });

TEST(SwapSpaceTest, BlocksAreStripedRoundRobinAcrossThreeDirectories) {
  ScratchDir d0, d1, d2;
  auto space = MakeSpace(SmallOptions({d0.path(), d1.path(), d2.path()}));
  ASSERT_NE(space, nullptr);
  const uint64_t n = 10 * kBlock + 123;  // 11 blocks
  std::vector<std::byte> data(n);
  FillRandom(data, 77);
  Result<SwapHandle> h = space->Allocate(n);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  Result<std::vector<SwapBlockLocation>> loc = space->Locate(*h);
  ASSERT_TRUE(loc.ok());
  ASSERT_EQ(loc->size(), 11u);
  const size_t start = (*loc)[0].directory;
  std::vector<int> per_dir(3, 0);
  std::vector<SwapDirectoryInfo> dirs = space->directories();
  ASSERT_EQ(dirs.size(), 3u);
  for (const SwapBlockLocation& b : *loc) {
    EXPECT_EQ(b.directory, (start + b.block) % 3) << "block " << b.block;
    EXPECT_EQ(b.length, b.block == 10 ? 123u : kBlock);
    per_dir[b.directory]++;
    // The bytes really are in that directory's file at that offset.
    std::vector<std::byte> disk = ReadOnDisk(dirs[b.directory], b.offset, b.length);
    EXPECT_EQ(std::memcmp(disk.data(), data.data() + b.block * kBlock, b.length), 0)
        << "block " << b.block << " not found in " << dirs[b.directory].directory;
  }
  // 11 blocks over 3 directories: 4, 4, 3.
  std::vector<int> sorted = per_dir;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int>{3, 4, 4}));
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(dirs[i].reserved, per_dir[i] * kBlock);
  // The next tensor continues the rotation where this one ended.
  Result<SwapHandle> h2 = space->Allocate(kBlock);
  ASSERT_TRUE(h2.ok());
  EXPECT_EQ((*space->Locate(*h2))[0].directory, (start + 11) % 3);
}

TEST(SwapSpaceTest, BlockSizesThatAreNotPowersOfTwoWork) {
  ScratchDir d0, d1, d2;
  SwapSpaceOptions o = SmallOptions({d0.path(), d1.path(), d2.path()});
  o.block_size = 3 * 4096;
  o.grow_bytes = 100000;  // rounded up to whole blocks
  auto space = MakeSpace(o);
  ASSERT_NE(space, nullptr);
  for (uint64_t n : {uint64_t{1}, uint64_t{12288}, uint64_t{12289}, uint64_t{200001}}) {
    std::vector<std::byte> data(n), back(n);
    FillRandom(data, n);
    Result<SwapHandle> h = space->Allocate(n);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
    ASSERT_TRUE(space->Read(*h, back).ok());
    EXPECT_EQ(back, data) << n;
    Result<std::vector<SwapBlockLocation>> loc = space->Locate(*h);
    ASSERT_TRUE(loc.ok());
    for (const SwapBlockLocation& b : *loc)
      EXPECT_EQ(b.offset % 12288, 0u);
  }
  for (const SwapDirectoryInfo& d : space->directories())
    EXPECT_EQ(d.capacity % 12288, 0u);
}

TEST(SwapSpaceTest, CorruptBytesOnDiskAreDataLoss) {
  ScratchDir d0, d1;
  auto space = MakeSpace(SmallOptions({d0.path(), d1.path()}));
  ASSERT_NE(space, nullptr);
  const uint64_t n = 4 * kBlock;
  std::vector<std::byte> data(n), back(n);
  FillRandom(data, 5);
  Result<SwapHandle> h = space->Allocate(n);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  const SwapBlockLocation blk = (*space->Locate(*h))[2];
  const SwapDirectoryInfo dir = space->directories()[blk.directory];
  CorruptOnDisk(dir, blk.offset + 1000);
  Status s = space->Read(*h, back);
  ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_TRUE(s.IsDataLoss());
  EXPECT_NE(s.message().find("CRC32C mismatch"), std::string::npos) << s;
  EXPECT_NE(s.message().find(dir.file), std::string::npos) << s;
  EXPECT_NE(s.message().find(dir.private_dir), std::string::npos) << s;
  EXPECT_NE(s.message().find("offset " + std::to_string(blk.offset)), std::string::npos) << s;
  EXPECT_NE(s.message().find("block 2"), std::string::npos) << s;
  EXPECT_NE(s.message().find("stored 0x"), std::string::npos) << s;
  EXPECT_NE(s.message().find("read 0x"), std::string::npos) << s;
  EXPECT_EQ(space->stats().crc_mismatches, 1u);
  // Rewriting repairs it.
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(back, data);
}

// The caller's block CRCs (computed elsewhere, e.g. on the optimizer's threads) are the ones
// kept and checked: right ones read back, a wrong one is the read's DataLoss, a misaligned
// buffer (bounced) and an odd tail are covered, and a wrong count or checksums off are
// refused without touching the tensor.
TEST(SwapSpaceTest, TheCallersBlockCrcsAreKeptAndCheckedByTheRead) {
  ScratchDir d0, d1;
  auto space = MakeSpace(SmallOptions({d0.path(), d1.path()}));
  ASSERT_NE(space, nullptr);
  const uint64_t n = 3 * kBlock + 5000;
  ASSERT_EQ(space->NumBlocks(n), 4u);
  std::vector<std::byte> data(n + 3), back(n);
  FillRandom(data, 17);
  Result<SwapHandle> h = space->Allocate(n);
  ASSERT_TRUE(h.ok());
  for (size_t misalign : {size_t{0}, size_t{3}}) {
    SCOPED_TRACE("misaligned by " + std::to_string(misalign));
    const std::span<const std::byte> in = CSpan(data).subspan(misalign, n);
    std::vector<uint32_t> crcs;
    for (uint64_t b = 0; b < n; b += kBlock)
      crcs.push_back(Crc32c(in.subspan(b, std::min(kBlock, n - b))));
    const uint64_t verified = space->stats().blocks_verified;
    Result<SwapFuture> f = space->WriteAsync(*h, in, crcs);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(f->Wait().ok());
    Status s = space->Read(*h, back);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(std::memcmp(back.data(), in.data(), n), 0);
    EXPECT_EQ(space->stats().blocks_verified, verified + 4);
    // One wrong CRC (the tail block's): the bytes are on disk, the read names the block.
    crcs[3] ^= 1;
    ASSERT_TRUE(space->WriteAsync(*h, in, crcs)->Wait().ok());
    s = space->Read(*h, back);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("block 3"), std::string::npos) << s;
  }
  // Refused before anything is written: the last good contents stay readable.
  std::vector<uint32_t> three(3, 0);
  Result<SwapFuture> bad = space->WriteAsync(*h, CSpan(data).first(n), three);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("3 block CRCs"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("expected 4"), std::string::npos) << bad.status();
  ASSERT_TRUE(space->Write(*h, CSpan(data).first(n)).ok());
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), n), 0);
  EXPECT_EQ(space->WriteAsync(*h, CSpan(data).first(n), three).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(space->Read(*h, back).ok());  // still valid

  SwapSpaceOptions off = SmallOptions({d0.path()});
  off.checksums = false;
  auto unchecked = MakeSpace(off);
  ASSERT_NE(unchecked, nullptr);
  Result<SwapHandle> u = unchecked->Allocate(n);
  ASSERT_TRUE(u.ok());
  std::vector<uint32_t> four(4, 0);
  Result<SwapFuture> refused = unchecked->WriteAsync(*u, CSpan(data).first(n), four);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("no checksums"), std::string::npos) << refused.status();
}

TEST(SwapSpaceTest, WithChecksumsOffCorruptionIsNotDetected) {
  ScratchDir d0;
  SwapSpaceOptions o = SmallOptions({d0.path()});
  o.checksums = false;
  auto space = MakeSpace(o);
  ASSERT_NE(space, nullptr);
  EXPECT_FALSE(space->checksums());
  std::vector<std::byte> data(2 * kBlock), back(2 * kBlock);
  FillRandom(data, 6);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  const SwapBlockLocation blk = (*space->Locate(*h))[1];
  CorruptOnDisk(space->directories()[0], blk.offset + 7);
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_NE(back[kBlock + 7], data[kBlock + 7]);
  EXPECT_EQ(space->stats().blocks_verified, 0u);
}

// A space whose engine is a FaultInjectingIoEngine; `faults` points at it.
std::unique_ptr<SwapSpace> MakeFaultySpace(SwapSpaceOptions o, FaultInjectingIoEngine** faults,
                                           uint64_t seed = 1) {
  o.engine_factory = [faults,
                      seed](const IoEngineOptions& io) -> Result<std::unique_ptr<IoEngine>> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<FaultInjectingIoEngine> e,
                            FaultInjectingIoEngine::Create(io, seed));
    *faults = e.get();
    return std::unique_ptr<IoEngine>(std::move(e));
  };
  return MakeSpace(std::move(o));
}

// An engine that loses or mislabels completions (what the I/O engine must never
// do, and what the space must survive without aborting the process). Mode kRenameNext
// gives the next completion an unknown tag; kDropNext takes it away silently.
class TamperingEngine final : public IoEngine {
 public:
  enum class Mode { kNone, kRenameNext, kDropNext };
  explicit TamperingEngine(std::unique_ptr<IoEngine> inner) : inner_(std::move(inner)) {}
  void set_mode(Mode m) { mode_.store(m); }

  std::string name() const override { return "tampering(" + inner_->name() + ")"; }
  std::string fallback() const override { return inner_->fallback(); }
  const IoEngineOptions& options() const override { return inner_->options(); }
  Result<FileId> RegisterFile(int fd, std::string path) override {
    return inner_->RegisterFile(fd, std::move(path));
  }
  Status UnregisterFile(FileId file) override { return inner_->UnregisterFile(file); }
  Result<int> RegisterBuffer(std::span<std::byte> memory) override {
    return inner_->RegisterBuffer(memory);
  }
  Status UnregisterBuffer(int buffer_id) override { return inner_->UnregisterBuffer(buffer_id); }
  Status Submit(std::span<const IoRequest> batch) override { return inner_->Submit(batch); }
  Result<IoCompletion> WaitOne(std::optional<std::chrono::milliseconds> timeout) override {
    while (true) {
      Result<IoCompletion> c = inner_->WaitOne(timeout);
      if (!c.ok() || !Tamper(*c)) return c;  // kept (renamed or not)
    }
  }
  size_t Poll(std::vector<IoCompletion>* out) override {
    const size_t first = out->size();
    inner_->Poll(out);
    size_t kept = first;
    for (size_t k = first; k < out->size(); ++k) {
      if (!Tamper((*out)[k])) (*out)[kept++] = (*out)[k];
    }
    out->resize(kept);
    return kept - first;
  }
  Status WaitAll(std::vector<IoCompletion>* out,
                 std::optional<std::chrono::milliseconds> timeout) override {
    return inner_->WaitAll(out, timeout);
  }
  size_t Cancel(uint64_t tag) override { return inner_->Cancel(tag); }
  size_t CancelAll() override { return inner_->CancelAll(); }
  size_t in_flight() const override { return inner_->in_flight(); }
  IoEngineStats stats() const override { return inner_->stats(); }

 private:
  // Renames or drops `c` as the mode says (once); true: dropped.
  bool Tamper(IoCompletion& c) {
    Mode m = mode_.load();
    if (m == Mode::kNone || !mode_.compare_exchange_strong(m, Mode::kNone)) return false;
    if (m == Mode::kRenameNext) {
      c.tag = 0xdead0000ull;
      return false;
    }
    return true;
  }
  std::unique_ptr<IoEngine> inner_;
  std::atomic<Mode> mode_{Mode::kNone};
};

// A completion lost by the engine, or one that names no operation, fails the read
// waiting for it with an error naming what happened (no abort), and the space goes on.
TEST(SwapSpaceFaultTest, ALostOrUnknownCompletionFailsTheTransferNotTheProcess) {
  ScratchDir d0;
  TamperingEngine* tampering = nullptr;
  SwapSpaceOptions o = SmallOptions({d0.path()});
  o.engine_factory = [&tampering](const IoEngineOptions& io) -> Result<std::unique_ptr<IoEngine>> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> inner, CreateIoEngine(io));
    auto e = std::make_unique<TamperingEngine>(std::move(inner));
    tampering = e.get();
    return std::unique_ptr<IoEngine>(std::move(e));
  };
  auto space = MakeSpace(std::move(o));
  ASSERT_NE(space, nullptr);
  ASSERT_NE(tampering, nullptr);
  std::vector<std::byte> data(3 * kBlock), back(3 * kBlock);
  FillRandom(data, 21);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());

  tampering->set_mode(TamperingEngine::Mode::kDropNext);
  Status lost = space->Read(*h, back);
  EXPECT_EQ(lost.code(), StatusCode::kInternal) << lost;
  EXPECT_NE(lost.message().find("waiting for I/O that the engine does not have"), std::string::npos)
      << lost;
  EXPECT_NE(lost.message().find("a completion of this transfer was lost"), std::string::npos)
      << lost;
  ASSERT_TRUE(space->Read(*h, back).ok());  // the space goes on
  EXPECT_EQ(back, data);

  tampering->set_mode(TamperingEngine::Mode::kRenameNext);
  Status unknown = space->Read(*h, back);
  EXPECT_EQ(unknown.code(), StatusCode::kInternal) << unknown;
  EXPECT_NE(unknown.message().find("a completion for unknown operation 3735879680"),
            std::string::npos)
      << unknown;
  std::fill(back.begin(), back.end(), std::byte{0});
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(back, data);
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
}

TEST(SwapSpaceFaultTest, CorruptedReadIsDataLoss) {
  ScratchDir d0, d1;
  FaultInjectingIoEngine* faults = nullptr;
  auto space = MakeFaultySpace(SmallOptions({d0.path(), d1.path()}), &faults);
  ASSERT_NE(space, nullptr);
  ASSERT_NE(faults, nullptr);
  EXPECT_EQ(space->engine().name(), "faulty(io_uring)");
  std::vector<std::byte> data(3 * kBlock + 5), back(3 * kBlock + 5);
  FillRandom(data, 8);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  ASSERT_TRUE(faults->AddRule(FaultRule::CorruptRead(3).Nth(2)).ok());
  Status s = space->Read(*h, back);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_EQ(faults->injected(), 1u);
  // Only the second transfer was corrupted: a second read is clean.
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(back, data);
}

TEST(SwapSpaceFaultTest, EveryInjectedErrorSurfacesAsAStatus) {
  ScratchDir d0, d1;
  FaultInjectingIoEngine* faults = nullptr;
  auto space = MakeFaultySpace(SmallOptions({d0.path(), d1.path()}), &faults);
  ASSERT_NE(space, nullptr);
  std::vector<std::byte> data(4 * kBlock), back(4 * kBlock);
  FillRandom(data, 9);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(h.ok());

  struct Case {
    FaultRule rule;
    IoOp op;
    StatusCode code;
    const char* word;
  };
  const Case cases[] = {
      {FaultRule::Error(EIO).OnOp(IoOp::kWrite).Nth(3), IoOp::kWrite, StatusCode::kIOError,
       "Input/output error"},
      {FaultRule::Error(ENOSPC).OnOp(IoOp::kWrite), IoOp::kWrite, StatusCode::kResourceExhausted,
       "No space left"},
      {FaultRule::Error(EIO).OnOp(IoOp::kRead).Nth(4), IoOp::kRead, StatusCode::kIOError,
       "reading block"},
      {FaultRule::ShortTransfer(0).OnOp(IoOp::kRead).EveryAttempt(), IoOp::kRead,
       StatusCode::kIOError, "end of file"},
      {FaultRule::ShortTransfer(0).OnOp(IoOp::kWrite).EveryAttempt(), IoOp::kWrite,
       StatusCode::kIOError, "no progress"},
      {FaultRule::Error(EBADMSG).OnOp(IoOp::kRead), IoOp::kRead, StatusCode::kDataLoss, "swap"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.rule.ToString());
    faults->ClearRules();
    ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
    Result<int> id = faults->AddRule(c.rule);
    ASSERT_TRUE(id.ok());
    Status s = c.op == IoOp::kWrite ? space->Write(*h, CSpan(data)) : space->Read(*h, back);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(c.word), std::string::npos) << s;
    EXPECT_NE(s.message().find("swap tensor #" + std::to_string(h->id)), std::string::npos) << s;
    EXPECT_GE(faults->injected(*id), 1u);
    if (c.op == IoOp::kWrite) {
      // A failed write leaves nothing valid to read.
      faults->ClearRules();
      Status r = space->Read(*h, back);
      EXPECT_EQ(r.code(), StatusCode::kFailedPrecondition) << r;
      EXPECT_NE(r.message().find("last write failed"), std::string::npos) << r;
    }
  }
}

TEST(SwapSpaceFaultTest, ShortTransfersDelaysAndEagainStillDeliverTheData) {
  ScratchDir d0, d1;
  FaultInjectingIoEngine* faults = nullptr;
  auto space = MakeFaultySpace(SmallOptions({d0.path(), d1.path()}), &faults);
  ASSERT_NE(space, nullptr);
  ASSERT_TRUE(faults->AddRule(FaultRule::ShortTransfer(4096)).ok());
  ASSERT_TRUE(faults->AddRule(FaultRule::Error(EAGAIN).Nth(2, 3)).ok());
  ASSERT_TRUE(faults->AddRule(FaultRule::Delay(std::chrono::milliseconds(5)).Nth(5)).ok());
  std::vector<std::byte> data(6 * kBlock + 4096), back(6 * kBlock + 4096);
  FillRandom(data, 10);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(back, data);
  const IoEngineStats st = space->engine().stats();
  EXPECT_GE(st.short_resubmits, 9u);  // 12 full blocks shortened, up to 3 of them EAGAIN instead
  EXPECT_EQ(st.requeued, 3u);
  EXPECT_EQ(st.failed, 0u);
}

TEST(SwapSpaceFaultTest, RandomFaultsWithASeedAreNeverSilent) {
  ScratchDir d0, d1;
  FaultInjectingIoEngine* faults = nullptr;
  auto space = MakeFaultySpace(SmallOptions({d0.path(), d1.path()}), &faults, /*seed=*/42);
  ASSERT_NE(space, nullptr);
  constexpr int kN = 24;
  std::vector<SwapHandle> hs;
  std::vector<std::vector<std::byte>> data(kN);
  for (int i = 0; i < kN; ++i) {
    data[i].resize(2 * kBlock + i);
    FillRandom(data[i], 200 + i);
    Result<SwapHandle> h = space->Allocate(data[i].size());
    ASSERT_TRUE(h.ok());
    hs.push_back(*h);
    ASSERT_TRUE(space->Write(*h, CSpan(data[i])).ok());
  }
  ASSERT_TRUE(faults->AddRule(FaultRule::Error(EIO).OnOp(IoOp::kRead).WithProbability(0.1)).ok());
  ASSERT_TRUE(faults->AddRule(FaultRule::CorruptRead(3).WithProbability(0.1)).ok());
  int failed = 0;
  for (int i = 0; i < kN; ++i) {
    std::vector<std::byte> back(data[i].size());
    Status s = space->Read(hs[i], back);
    if (s.ok()) {
      EXPECT_EQ(back, data[i]) << "tensor " << i << " read OK with wrong bytes";
    } else {
      ++failed;
      EXPECT_TRUE(s.code() == StatusCode::kIOError || s.code() == StatusCode::kDataLoss) << s;
    }
  }
  EXPECT_GT(faults->injected(), 0u);
  EXPECT_GT(failed, 0);
  EXPECT_LE(static_cast<uint64_t>(failed), faults->injected());
}

TEST(SwapSpaceTest, SpaceExhaustionIsReportedWithTheNumbers) {
  ScratchDir d0;
  auto space = MakeSpace(SmallOptions({d0.path()}));
  ASSERT_NE(space, nullptr);
  Result<SwapHandle> h = space->Allocate(uint64_t{1} << 55);  // 32 PiB
  ASSERT_EQ(h.status().code(), StatusCode::kResourceExhausted) << h.status();
  const std::string& m = h.status().message();
  EXPECT_NE(m.find("swap directory " + d0.path()), std::string::npos) << m;
  EXPECT_NE(m.find("not enough free disk space"), std::string::npos) << m;
  EXPECT_NE(m.find("available"), std::string::npos) << m;
  EXPECT_NE(m.find("32 PiB"), std::string::npos) << m;
  // Nothing was reserved, and the space still works.
  EXPECT_EQ(space->stats().tensors, 0u);
  Result<SwapHandle> ok = space->Allocate(1000);
  EXPECT_TRUE(ok.ok()) << ok.status();

  SwapSpaceOptions capped = SmallOptions({d0.path()});
  capped.max_bytes_per_directory = 4 * kBlock;
  auto small = MakeSpace(capped);
  ASSERT_NE(small, nullptr);
  ASSERT_TRUE(small->Allocate(3 * kBlock).ok());
  Result<SwapHandle> over = small->Allocate(2 * kBlock);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("max_bytes_per_directory"), std::string::npos)
      << over.status();
  EXPECT_TRUE(small->Allocate(kBlock).ok());  // exactly fills the cap
  EXPECT_EQ(small->directories()[0].capacity, 4 * kBlock);
}

TEST(SwapSpaceTest, NothingIsLeftBehindAfterClose) {
  ScratchDir d0, d1;
  {
    SwapSpaceOptions o = SmallOptions({d0.path(), d1.path()});
    o.initial_bytes_per_directory = 1 << 20;
    auto space = MakeSpace(o);
    ASSERT_NE(space, nullptr);
    for (const SwapDirectoryInfo& d : space->directories()) {
      EXPECT_TRUE(d.tmpfile);
      EXPECT_EQ(d.capacity, 1u << 20);
      // The swap file has no name and its private subdirectory is gone already: nothing
      // of the space is named on disk while it is open.
      EXPECT_TRUE(ListDir(d.directory).empty());
      EXPECT_EQ(
          d.private_dir.rfind(d.directory + "/strata-swap-" + std::to_string(getpid()) + "-", 0),
          0u);
      struct stat st;
      EXPECT_NE(stat(d.private_dir.c_str(), &st), 0);
      ASSERT_EQ(fstat(d.fd, &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0600u);
      EXPECT_EQ(st.st_nlink, 0u);                                      // unlinked
      EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 1u << 20);  // preallocated
      EXPECT_EQ(CountOpenFilesUnder(d.directory), 1);
    }
    std::vector<std::byte> data(300000);
    FillRandom(data, 11);
    Result<SwapHandle> h = space->Allocate(data.size());
    ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
    // An unwaited future: the space finishes it before closing.
    Result<SwapFuture> f = space->WriteAsync(*space->Allocate(5000), CSpan(data).first(5000));
    ASSERT_TRUE(f.ok());
    SwapFuture dropped = std::move(*f);
    (void)dropped;
  }
  EXPECT_TRUE(ListDir(d0.path()).empty());
  EXPECT_TRUE(ListDir(d1.path()).empty());
  EXPECT_EQ(CountOpenFilesUnder(d0.path()), 0);
  EXPECT_EQ(CountOpenFilesUnder(d1.path()), 0);
}

// A process killed with SIGKILL while its swap space holds data leaves nothing in the
// directory: no file, no private subdirectory (and the kernel frees the blocks).
TEST(SwapSpaceTest, NothingIsLeftBehindAfterKill9) {
  ScratchDir d0, d1;
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(ready[0]);
    SwapSpaceOptions o = SmallOptions({d0.path(), d1.path()});
    Result<std::unique_ptr<SwapSpace>> space = SwapSpace::Create(o);
    if (!space.ok()) _exit(2);
    std::vector<std::byte> data(3 * kBlock + 5);
    FillRandom(data, 3);
    Result<SwapHandle> h = (*space)->Allocate(data.size());
    if (!h.ok() || !(*space)->Write(*h, CSpan(data)).ok()) _exit(3);
    // Writes possibly still in flight when the signal comes.
    std::vector<SwapFuture> in_flight;
    for (int i = 0; i < 4; ++i) {
      Result<SwapHandle> more = (*space)->Allocate(data.size());
      if (!more.ok()) _exit(4);
      Result<SwapFuture> f = (*space)->WriteAsync(*more, CSpan(data));
      if (!f.ok()) _exit(5);
      in_flight.push_back(std::move(*f));
    }
    const char c = 1;
    if (write(ready[1], &c, 1) != 1) _exit(6);
    for (;;)
      pause();
  }
  close(ready[1]);
  char c = 0;
  const ssize_t got = read(ready[0], &c, 1);
  close(ready[0]);
  // Whether the child got ready or failed, it is killed and reaped before the checks.
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_EQ(got, 1) << "the child failed before it was killed, exit status "
                    << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(ListDir(d0.path()).empty()) << ListDir(d0.path())[0];
  EXPECT_TRUE(ListDir(d1.path()).empty()) << ListDir(d1.path())[0];
}

TEST(SwapSpaceTest, StaleDirectoriesOfEndedProcessesAreRemoved) {
  ScratchDir d0;
  // A pid that cannot be alive: above the kernel's pid_max limit (4194304).
  const std::string stale = d0.path() + "/strata-swap-4194399-abcdef";
  ASSERT_EQ(mkdir(stale.c_str(), 0700), 0);
  const std::string left = stale + "/swap.0";
  int fd = open(left.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string other = d0.path() + "/not-ours";
  ASSERT_EQ(mkdir(other.c_str(), 0700), 0);
  {
    auto space = MakeSpace(SmallOptions({d0.path()}));
    ASSERT_NE(space, nullptr);
  }
  std::vector<std::string> names = ListDir(d0.path());
  EXPECT_EQ(names, std::vector<std::string>{"not-ours"});
}

TEST(SwapSpaceTest, BadDirectoriesAndOptionsAreClearErrors) {
  ScratchDir d0;
  Result<std::unique_ptr<SwapSpace>> s = SwapSpace::Create(SmallOptions({}));
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("nvme_path"), std::string::npos) << s.status();

  s = SwapSpace::Create(SmallOptions({d0.path() + "/missing"}));
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find(d0.path() + "/missing does not exist"), std::string::npos)
      << s.status();

  const std::string file = d0.path() + "/plain-file";
  int fd = open(file.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  s = SwapSpace::Create(SmallOptions({file}));
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("is not a directory"), std::string::npos) << s.status();

  s = SwapSpace::Create(SmallOptions({d0.path(), d0.path() + "/."}));
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("listed twice"), std::string::npos) << s.status();

  SwapSpaceOptions o = SmallOptions({d0.path()});
  o.block_size = 1000;
  s = SwapSpace::Create(o);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("block size 1000"), std::string::npos) << s.status();

  o = SmallOptions({d0.path()});
  o.io.queue_depth = 0;
  s = SwapSpace::Create(o);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);

  if (geteuid() != 0) {
    const std::string ro = d0.path() + "/read-only";
    ASSERT_EQ(mkdir(ro.c_str(), 0500), 0);
    s = SwapSpace::Create(SmallOptions({ro}));
    EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied);
    EXPECT_NE(s.status().message().find("not writable"), std::string::npos) << s.status();
  }
  // Failed creations leave nothing behind.
  EXPECT_EQ(ListDir(d0.path()), std::vector<std::string>{"plain-file"});
}

TEST(SwapSpaceTest, MisuseOfHandlesIsRejected) {
  ScratchDir d0;
  auto space = MakeSpace(SmallOptions({d0.path()}));
  ASSERT_NE(space, nullptr);
  EXPECT_EQ(space->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  Result<SwapHandle> h = space->Allocate(10000);
  ASSERT_TRUE(h.ok());
  std::vector<std::byte> data(10000), small(9999);
  Status s = space->Read(*h, data);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("not been written"), std::string::npos) << s;
  s = space->Write(*h, CSpan(small));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("9999"), std::string::npos) << s;
  EXPECT_EQ(space->Write(SwapHandle{999}, CSpan(data)).code(), StatusCode::kNotFound);
  EXPECT_EQ(space->Free(SwapHandle{999}).code(), StatusCode::kNotFound);

  // While a write is in flight: no second write, no read, no free.
  Result<SwapFuture> w = space->WriteAsync(*h, CSpan(data));
  ASSERT_TRUE(w.ok());
  if (!w->Ready()) {
    EXPECT_EQ(space->Write(*h, CSpan(data)).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(space->Read(*h, data).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(space->Free(*h).code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(w->Wait().ok());
  EXPECT_TRUE(w->Wait().ok());  // idempotent
  EXPECT_TRUE(space->Free(*h).ok());
  EXPECT_EQ(space->Free(*h).code(), StatusCode::kNotFound);
}

TEST(SwapSpaceTest, WithoutODirectItFallsBackToBufferedSyncIOWithAWarning) {
  ScratchDir d0;
  std::vector<std::string> warnings;
  std::mutex mu;
  SetLogSink([&](LogLevel level, std::string_view line) {
    std::lock_guard lock(mu);
    if (level == LogLevel::kWarn) warnings.emplace_back(line);
  });
  SwapSpaceOptions o = SmallOptions({d0.path()});
  o.assume_no_direct_io = true;
  auto space = MakeSpace(o);
  SetLogSink({});
  ASSERT_NE(space, nullptr);
  EXPECT_FALSE(space->direct_io());
  EXPECT_FALSE(space->directories()[0].direct);
  EXPECT_EQ(space->engine().name(), "sync");
  EXPECT_NE(space->fallback().find("O_DIRECT is not available in " + d0.path()), std::string::npos)
      << space->fallback();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("O_DIRECT"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find(d0.path()), std::string::npos) << warnings[0];
  // Odd sizes and addresses need no bounce buffer without O_DIRECT.
  std::vector<std::byte> data(3 * kBlock + 11), back(3 * kBlock + 11);
  FillRandom(data, 12);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ(space->stats().bounced_bytes, 0u);
}

TEST(SwapSpaceTest, WorksInTmpfs) {
  struct stat st;
  if (stat("/dev/shm", &st) != 0) GTEST_SKIP() << "no /dev/shm here";
  ScratchDir shm("/dev/shm");
  ASSERT_TRUE(shm.ok());
  auto space = MakeSpace(SmallOptions({shm.path()}));
  ASSERT_NE(space, nullptr);
  // Linux >= 6.6 tmpfs accepts O_DIRECT; older kernels refuse it and the space falls back.
  EXPECT_EQ(space->direct_io(), space->fallback().empty()) << space->fallback();
  std::vector<std::byte> data(kBlock + 99), back(kBlock + 99);
  FillRandom(data, 13);
  Result<SwapHandle> h = space->Allocate(data.size());
  ASSERT_TRUE(space->Write(*h, CSpan(data)).ok());
  ASSERT_TRUE(space->Read(*h, back).ok());
  EXPECT_EQ(back, data);
  space.reset();
  EXPECT_TRUE(ListDir(shm.path()).empty());
}

TEST(SwapSpaceTest, RegisteredBuffersAreUsedForAlignedTensors) {
  if (!IoUringAvailable().ok()) GTEST_SKIP() << "io_uring is not available here";
  ScratchDir d0, d1;
  auto space = MakeSpace(SmallOptions({d0.path(), d1.path()}, IoEngineKind::kIoUring));
  ASSERT_NE(space, nullptr);
  HostPool pool = MakePool();
  Result<HostBuffer> buf = pool.Allocate(8 * kBlock);
  ASSERT_TRUE(buf.ok());
  FillRandom(buf->span(), 14);
  std::vector<std::byte> copy(buf->span().begin(), buf->span().end());
  Result<int> id = space->RegisterBuffer(buf->span());
  ASSERT_TRUE(id.ok()) << id.status();
  Result<SwapHandle> h = space->Allocate(8 * kBlock);
  ASSERT_TRUE(space->Write(*h, buf->span()).ok());
  std::memset(buf->data(), 0, buf->size());
  ASSERT_TRUE(space->Read(*h, buf->span()).ok());
  EXPECT_EQ(std::memcmp(buf->data(), copy.data(), copy.size()), 0);
  EXPECT_EQ(space->engine().stats().fixed_buffer_ops, 16u);
  EXPECT_TRUE(space->UnregisterBuffer(*id).ok());
}

TEST(SwapSpaceTest, OptionsFromConfig) {
  AioConfig aio;
  aio.block_size = 2 << 20;
  aio.queue_depth = 32;
  aio.intra_op_parallelism = 2;
  StrataConfig strata;
  strata.swap_checksums = false;
  OffloadConfig offload;
  offload.nvme_path = {"/nvme0", "/nvme1"};
  SwapSpaceOptions o = SwapSpaceOptions::FromConfig(aio, strata, offload);
  EXPECT_EQ(o.block_size, 2u << 20);
  EXPECT_EQ(o.io.queue_depth, 32);
  EXPECT_EQ(o.io.threads, 2);
  EXPECT_FALSE(o.checksums);
  EXPECT_EQ(o.directories, (std::vector<std::string>{"/nvme0", "/nvme1"}));
  EXPECT_NE(o.ToString().find("/nvme0, /nvme1"), std::string::npos) << o.ToString();
  EXPECT_NE(o.ToString().find("checksums off"), std::string::npos) << o.ToString();
}

}  // namespace
}  // namespace strata::swap

// The IoEngine implementations (io_uring and sync): round trips, validation, the result
// rules (requeue, short transfers, EOF), cancellation, timeouts, registered buffers.
#include "strata/swap/io_engine.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/offload/cpu/host_pool.h"
#include "test_util.h"

namespace strata::swap {
namespace {

using testing::FillRandom;
using testing::MakePool;
using testing::ScratchDir;

constexpr size_t kA = IoEngine::kDirectAlignment;

// An open scratch file, closed at the end.
class TestFile {
 public:
  TestFile(const std::string& dir, bool direct, uint64_t size = 0) {
    path_ = dir + "/data";
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
    if (fd_ >= 0 && size > 0) {
      EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0);
    }
  }
  ~TestFile() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

std::unique_ptr<IoEngine> MakeEngine(IoEngineOptions o) {
  Result<std::unique_ptr<IoEngine>> e = CreateIoEngine(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

class IoEngineTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    if (GetParam() == IoEngineKind::kIoUring) {
      Status s = IoUringAvailable();
      if (!s.ok()) GTEST_SKIP() << "io_uring is not available here: " << s;
    }
  }
  IoEngineOptions Options(int qd = 8, int threads = 2) const {
    IoEngineOptions o;
    o.kind = GetParam();
    o.queue_depth = qd;
    o.threads = threads;
    return o;
  }
  ScratchDir dir_;
  HostPool pool_ = MakePool();
};

TEST_P(IoEngineTest, NameAndNoFallback) {
  auto e = MakeEngine(Options());
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->name(), GetParam() == IoEngineKind::kIoUring ? "io_uring" : "sync");
  EXPECT_EQ(e->fallback(), "");
  EXPECT_EQ(e->options().queue_depth, 8);
  EXPECT_EQ(e->in_flight(), 0u);
}

TEST_P(IoEngineTest, DirectRoundTripOfManyBlocks) {
  auto e = MakeEngine(Options());
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/true);
  ASSERT_GE(f.fd(), 0) << strerror(errno);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok()) << id.status();

  // 40 requests of different aligned sizes, laid out back to back.
  const size_t n = 40;
  std::vector<size_t> sizes, offsets;
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    sizes.push_back(kA * (1 + (i * 7) % 13));
    offsets.push_back(total);
    total += sizes.back();
  }
  Result<HostBuffer> src = pool_.Allocate(total);
  Result<HostBuffer> dst = pool_.Allocate(total);
  ASSERT_TRUE(src.ok() && dst.ok());
  FillRandom(src->span(), 1);
  std::vector<IoRequest> writes, reads;
  for (size_t i = 0; i < n; ++i) {
    writes.push_back({IoOp::kWrite, *id, offsets[i], sizes[i],
                      static_cast<std::byte*>(src->data()) + offsets[i], i});
    reads.push_back({IoOp::kRead, *id, offsets[i], sizes[i],
                     static_cast<std::byte*>(dst->data()) + offsets[i], 1000 + i});
  }
  std::vector<IoCompletion> done;
  ASSERT_TRUE(e->Submit(writes).ok());
  Status s = e->WaitAll(&done);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(done.size(), n);
  std::map<uint64_t, IoCompletion> by_tag;
  for (IoCompletion& c : done)
    by_tag[c.tag] = c;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(by_tag.count(i));
    EXPECT_EQ(by_tag[i].bytes_done, sizes[i]);
    EXPECT_EQ(by_tag[i].offset, offsets[i]);
    EXPECT_EQ(by_tag[i].op, IoOp::kWrite);
    EXPECT_EQ(by_tag[i].file, *id);
    EXPECT_GT(by_tag[i].latency.count(), 0);
  }
  ASSERT_TRUE(SubmitAndWait(*e, reads).ok());
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), total), 0);
  IoEngineStats st = e->stats();
  EXPECT_EQ(st.submitted, 2 * n);
  EXPECT_EQ(st.completed, 2 * n);
  EXPECT_EQ(st.failed, 0u);
  EXPECT_EQ(st.bytes_written, total);
  EXPECT_EQ(st.bytes_read, total);
  EXPECT_EQ(e->in_flight(), 0u);
  EXPECT_TRUE(e->UnregisterFile(*id).ok());
}

TEST_P(IoEngineTest, SingleSubmitAndNoOverlapStillMoveEverything) {
  for (int variant = 0; variant < 2; ++variant) {
    IoEngineOptions o = Options(4, 1);
    o.single_submit = variant == 0;
    o.overlap_events = variant != 1;
    auto e = MakeEngine(o);
    ASSERT_NE(e, nullptr);
    TestFile f(dir_.path(), /*direct=*/false);
    Result<FileId> id = e->RegisterFile(f.fd(), f.path());
    ASSERT_TRUE(id.ok());
    std::vector<std::byte> src(64 * 1000), dst(64 * 1000);
    FillRandom(src, 20 + variant);
    std::vector<IoRequest> w, r;
    for (size_t i = 0; i < 64; ++i) {
      w.push_back({IoOp::kWrite, *id, i * 1000, 1000, src.data() + i * 1000, i});
      r.push_back({IoOp::kRead, *id, i * 1000, 1000, dst.data() + i * 1000, i});
    }
    ASSERT_TRUE(SubmitAndWait(*e, w).ok());
    ASSERT_TRUE(SubmitAndWait(*e, r).ok());
    EXPECT_EQ(src, dst) << "variant " << variant;
  }
}

TEST_P(IoEngineTest, BufferedRoundTripAtOddSizesOffsetsAndAddresses) {
  auto e = MakeEngine(Options(4, 3));
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  ASSERT_GE(f.fd(), 0);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  std::vector<std::byte> src(300001), dst(300001 + 3);
  FillRandom(src, 2);
  // Odd pieces: lengths 1, 7, 4095, 4097, ... at odd offsets and odd buffer addresses.
  std::vector<std::pair<size_t, size_t>> pieces;  // offset, length
  size_t pos = 0;
  const size_t lens[] = {1, 7, 4095, 4097, 12345, 65537, 3};
  for (size_t i = 0; pos < src.size(); ++i) {
    const size_t len = std::min(lens[i % 7], src.size() - pos);
    pieces.emplace_back(pos, len);
    pos += len;
  }
  std::vector<IoRequest> w, r;
  for (size_t i = 0; i < pieces.size(); ++i) {
    auto [off, len] = pieces[i];
    w.push_back({IoOp::kWrite, *id, off + 13, len, src.data() + off, i});
    r.push_back({IoOp::kRead, *id, off + 13, len, dst.data() + 3 + off, i});
  }
  ASSERT_TRUE(SubmitAndWait(*e, w).ok());
  ASSERT_TRUE(SubmitAndWait(*e, r).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data() + 3, src.size()), 0);
}

TEST_P(IoEngineTest, MisalignedDirectRequestsRejectTheWholeBatch) {
  auto e = MakeEngine(Options());
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/true);
  ASSERT_GE(f.fd(), 0);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  Result<HostBuffer> buf = pool_.Allocate(4 * kA);
  ASSERT_TRUE(buf.ok());
  std::byte* p = static_cast<std::byte*>(buf->data());

  struct Case {
    IoRequest bad;
    std::vector<std::string> named;
    std::vector<std::string> not_named;
  };
  const Case cases[] = {
      {{IoOp::kRead, *id, 0, kA, p + 1, 9}, {"buffer address 0x", "1 bytes past"}, {"offset 0 ("}},
      {{IoOp::kWrite, *id, 512, kA, p, 9},
       {"misaligned: offset 512", "512 bytes past"},
       {"buffer address 0x"}},
      {{IoOp::kRead, *id, 0, 1000, p, 9},
       {"misaligned: length 1000"},
       {"buffer address 0x", "offset 0 ("}},
      {{IoOp::kRead, *id, 100, 1000, p + 7, 9},
       {"buffer address", "offset 100", "length 1000"},
       {}},
  };
  for (const Case& c : cases) {
    // A good request before the bad one: nothing of the batch may be queued.
    IoRequest good{IoOp::kWrite, *id, 0, kA, p, 1};
    IoRequest batch[] = {good, c.bad};
    Status s = e->Submit(batch);
    ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("O_DIRECT"), std::string::npos) << s;
    EXPECT_NE(s.message().find("request 1 of a batch of 2"), std::string::npos) << s;
    EXPECT_NE(s.message().find(f.path()), std::string::npos) << s;
    for (const std::string& w : c.named)
      EXPECT_NE(s.message().find(w), std::string::npos) << w << " in " << s;
    for (const std::string& w : c.not_named)
      EXPECT_EQ(s.message().find(w), std::string::npos) << w << " in " << s;
  }
  EXPECT_EQ(e->in_flight(), 0u);
  EXPECT_EQ(e->stats().submitted, 0u);
  Result<IoCompletion> none = e->WaitOne(std::chrono::milliseconds(1));
  EXPECT_EQ(none.status().code(), StatusCode::kFailedPrecondition);
}

TEST_P(IoEngineTest, BadRequestsAreInvalidArguments) {
  auto e = MakeEngine(Options());
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  char b[16];
  const IoRequest bad[] = {
      {IoOp::kRead, 7, 0, 16, b, 0},          // unknown file
      {IoOp::kRead, *id, 0, 16, nullptr, 0},  // null buffer
      {IoOp::kRead, *id, 0, 0, b, 0},         // zero length
  };
  const char* words[] = {"unknown file id 7", "null buffer", "zero length"};
  for (int i = 0; i < 3; ++i) {
    Status s = e->Submit({&bad[i], 1});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(words[i]), std::string::npos) << s;
  }
  EXPECT_EQ(e->RegisterFile(-1, "x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->UnregisterFile(42).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->UnregisterBuffer(42).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(e->Submit({}).ok());
}

TEST_P(IoEngineTest, ReadingPastTheEndOfTheFileIsAnIOError) {
  auto e = MakeEngine(Options());
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/true, /*size=*/2 * kA);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  Result<HostBuffer> buf = pool_.Allocate(4 * kA);
  ASSERT_TRUE(buf.ok());
  // Starts inside the file, ends beyond it: a short read, then EOF.
  IoRequest r{IoOp::kRead, *id, kA, 3 * kA, buf->data(), 5};
  ASSERT_TRUE(e->Submit({&r, 1}).ok());
  Result<IoCompletion> c = e->WaitOne();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->status.code(), StatusCode::kIOError) << c->status;
  EXPECT_NE(c->status.message().find("end of file"), std::string::npos) << c->status;
  EXPECT_NE(c->status.message().find(f.path()), std::string::npos) << c->status;
  EXPECT_EQ(c->bytes_done, kA);
  EXPECT_EQ(c->tag, 5u);
  EXPECT_EQ(e->stats().failed, 1u);
}

TEST_P(IoEngineTest, ManyConcurrentRequestsFromManyThreads) {
  IoEngineOptions o = Options(/*qd=*/4, /*threads=*/4);
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/true);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  constexpr int kThreads = 4, kPerThread = 64;
  const size_t block = 2 * kA;
  Result<HostBuffer> src = pool_.Allocate(kThreads * kPerThread * block);
  Result<HostBuffer> dst = pool_.Allocate(kThreads * kPerThread * block);
  ASSERT_TRUE(src.ok() && dst.ok());
  FillRandom(src->span(), 3);
  std::atomic<int> failures{0};
  auto run = [&](IoOp op, HostBuffer& buf) {
    std::vector<std::thread> ts;
    for (int t = 0; t < kThreads; ++t) {
      ts.emplace_back([&, t] {
        std::vector<IoRequest> reqs;
        for (int i = 0; i < kPerThread; ++i) {
          const size_t k = static_cast<size_t>(t * kPerThread + i);
          reqs.push_back(
              {op, *id, k * block, block, static_cast<std::byte*>(buf.data()) + k * block, k});
        }
        // Submit in small batches, as a pipeline would.
        for (size_t i = 0; i < reqs.size(); i += 8)
          if (!e->Submit({reqs.data() + i, 8}).ok()) failures++;
      });
    }
    for (auto& th : ts)
      th.join();
    std::vector<IoCompletion> done;
    Status s = e->WaitAll(&done);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(done.size(), static_cast<size_t>(kThreads * kPerThread));
  };
  run(IoOp::kWrite, *src);
  run(IoOp::kRead, *dst);
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), src->size()), 0);
  EXPECT_EQ(e->stats().completed, 2u * kThreads * kPerThread);
}

TEST_P(IoEngineTest, RegisteredBuffersUseFixedOperations) {
  auto e = MakeEngine(Options(8, 2));
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/true);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  Result<HostBuffer> buf = pool_.Allocate(64 * kA);
  Result<HostBuffer> other = pool_.Allocate(64 * kA);
  ASSERT_TRUE(buf.ok() && other.ok());
  FillRandom(buf->span(), 4);
  Result<int> bid = e->RegisterBuffer(buf->span());
  ASSERT_TRUE(bid.ok()) << bid.status();
  EXPECT_EQ(e->RegisterBuffer(buf->span().subspan(kA, kA)).status().code(),
            StatusCode::kInvalidArgument);  // overlaps
  std::vector<IoRequest> w;
  for (size_t i = 0; i < 16; ++i)
    w.push_back({IoOp::kWrite, *id, i * 4 * kA, 4 * kA,
                 static_cast<std::byte*>(buf->data()) + i * 4 * kA, i});
  ASSERT_TRUE(SubmitAndWait(*e, w).ok());
  IoRequest r{IoOp::kRead, *id, 0, 64 * kA, other->data(), 99};
  ASSERT_TRUE(SubmitAndWait(*e, {&r, 1}).ok());
  EXPECT_EQ(std::memcmp(buf->data(), other->data(), 64 * kA), 0);
  const uint64_t fixed = e->stats().fixed_buffer_ops;
  if (GetParam() == IoEngineKind::kIoUring) {
    EXPECT_EQ(fixed, 16u);  // the writes from the registered buffer; not the read
  } else {
    EXPECT_EQ(fixed, 0u);
  }
  ASSERT_TRUE(e->UnregisterBuffer(*bid).ok());
  ASSERT_TRUE(SubmitAndWait(*e, {w.data(), 1}).ok());
  EXPECT_EQ(e->stats().fixed_buffer_ops, fixed);
}

// The result hook turns real results into the failures the engine must handle.
TEST_P(IoEngineTest, ShortTransfersAreCompletedByResubmittingTheRemainder) {
  IoEngineOptions o = Options(4, 1);
  std::atomic<int> shortened{0};
  o.result_hook = [&](const IoResultEvent& ev) -> int64_t {
    // Every first transfer moves only one aligned 4 KiB chunk (when it moved more).
    if (ev.attempt == 0 && ev.result > static_cast<int64_t>(kA)) {
      shortened++;
      return static_cast<int64_t>(kA);
    }
    return ev.result;
  };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/true);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  Result<HostBuffer> src = pool_.Allocate(32 * kA);
  Result<HostBuffer> dst = pool_.Allocate(32 * kA);
  ASSERT_TRUE(id.ok() && src.ok() && dst.ok());
  FillRandom(src->span(), 5);
  std::vector<IoRequest> w, r;
  for (size_t i = 0; i < 8; ++i) {
    w.push_back({IoOp::kWrite, *id, i * 4 * kA, 4 * kA,
                 static_cast<std::byte*>(src->data()) + i * 4 * kA, i});
    r.push_back({IoOp::kRead, *id, i * 4 * kA, 4 * kA,
                 static_cast<std::byte*>(dst->data()) + i * 4 * kA, i});
  }
  ASSERT_TRUE(SubmitAndWait(*e, w).ok());
  ASSERT_TRUE(SubmitAndWait(*e, r).ok());
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), 32 * kA), 0);
  EXPECT_EQ(shortened.load(), 16);
  EXPECT_EQ(e->stats().short_resubmits, 16u);
  EXPECT_EQ(e->stats().failed, 0u);
}

TEST_P(IoEngineTest, EagainAndEintrAreRequeued) {
  IoEngineOptions o = Options(4, 2);
  o.result_hook = [&](const IoResultEvent& ev) -> int64_t {
    if (ev.attempt == 0) return ev.request.tag % 2 ? -EAGAIN : -EINTR;
    if (ev.attempt == 1 && ev.request.tag % 3 == 0) return -EAGAIN;
    return ev.result;
  };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  std::vector<std::byte> src(12 * 1000), dst(12 * 1000);
  FillRandom(src, 6);
  std::vector<IoRequest> w, r;
  for (size_t i = 0; i < 12; ++i) {
    w.push_back({IoOp::kWrite, *id, i * 1000, 1000, src.data() + i * 1000, i});
    r.push_back({IoOp::kRead, *id, i * 1000, 1000, dst.data() + i * 1000, i});
  }
  ASSERT_TRUE(SubmitAndWait(*e, w).ok());
  ASSERT_TRUE(SubmitAndWait(*e, r).ok());
  EXPECT_EQ(src, dst);
  // Each of 24 requests requeued once, and the 8 with tag % 3 == 0 twice.
  EXPECT_EQ(e->stats().requeued, 24u + 8u);
  EXPECT_EQ(e->stats().failed, 0u);
}

TEST_P(IoEngineTest, EndlessEagainFailsAsUnavailable) {
  IoEngineOptions o = Options(2, 1);
  o.result_hook = [](const IoResultEvent&) -> int64_t { return -EAGAIN; };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  char b[100] = {};
  IoRequest w{IoOp::kWrite, *id, 0, sizeof b, b, 1};
  Status s = SubmitAndWait(*e, {&w, 1});
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("resubmissions"), std::string::npos) << s;
}

TEST_P(IoEngineTest, ErrnoResultsBecomeStatusesNamingTheRequest) {
  IoEngineOptions o = Options(4, 1);
  o.result_hook = [](const IoResultEvent& ev) -> int64_t {
    switch (ev.request.tag) {
      case 1:
        return -EIO;
      case 2:
        return -ENOSPC;
      case 3:
        return 0;  // a write that makes no progress
      default:
        return ev.result;
    }
  };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  char b[64] = {};
  const IoRequest w[] = {{IoOp::kWrite, *id, 0, 64, b, 1},
                         {IoOp::kWrite, *id, 4096, 64, b, 2},
                         {IoOp::kWrite, *id, 8192, 64, b, 3},
                         {IoOp::kWrite, *id, 12288, 64, b, 4}};
  ASSERT_TRUE(e->Submit(w).ok());
  std::vector<IoCompletion> done;
  Status first = e->WaitAll(&done);
  EXPECT_FALSE(first.ok());
  ASSERT_EQ(done.size(), 4u);
  for (const IoCompletion& c : done) {
    switch (c.tag) {
      case 1:
        EXPECT_EQ(c.status.code(), StatusCode::kIOError) << c.status;
        EXPECT_EQ(c.status.errno_value(), EIO);
        EXPECT_NE(c.status.message().find("write of " + f.path() + " at offset 0, length 64"),
                  std::string::npos)
            << c.status;
        break;
      case 2:
        EXPECT_EQ(c.status.code(), StatusCode::kResourceExhausted) << c.status;
        EXPECT_NE(c.status.message().find("offset 4096"), std::string::npos) << c.status;
        break;
      case 3:
        EXPECT_EQ(c.status.code(), StatusCode::kIOError) << c.status;
        EXPECT_NE(c.status.message().find("no progress"), std::string::npos) << c.status;
        break;
      default:
        EXPECT_TRUE(c.status.ok()) << c.status;
        EXPECT_EQ(c.bytes_done, 64u);
    }
  }
  EXPECT_EQ(e->stats().failed, 3u);
}

TEST_P(IoEngineTest, WaitOneTimesOutThenDelivers) {
  IoEngineOptions o = Options(2, 1);
  o.result_hook = [](const IoResultEvent& ev) -> int64_t {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return ev.result;
  };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  char b[64] = {};
  IoRequest w{IoOp::kWrite, *id, 0, 64, b, 1};
  ASSERT_TRUE(e->Submit({&w, 1}).ok());
  EXPECT_EQ(e->in_flight(), 1u);
  // The request cannot be unregistered while in flight.
  EXPECT_EQ(e->UnregisterFile(*id).code(), StatusCode::kFailedPrecondition);
  Result<IoCompletion> c = e->WaitOne(std::chrono::milliseconds(5));
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status();
  std::vector<IoCompletion> none;
  EXPECT_EQ(e->WaitAll(&none, std::chrono::milliseconds(5)).code(), StatusCode::kDeadlineExceeded);
  c = e->WaitOne();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->status.ok());
  EXPECT_GE(c->latency, std::chrono::milliseconds(300));
  EXPECT_EQ(e->in_flight(), 0u);
  EXPECT_TRUE(e->UnregisterFile(*id).ok());
}

TEST_P(IoEngineTest, CancelEndsQueuedRequestsWithCancelled) {
  IoEngineOptions o = Options(/*qd=*/1, /*threads=*/1);
  std::atomic<bool> slow{true};
  o.result_hook = [&](const IoResultEvent& ev) -> int64_t {
    if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return ev.result;
  };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  std::vector<char> b(64 * 100);
  std::vector<IoRequest> w;
  for (size_t i = 0; i < 100; ++i)
    w.push_back({IoOp::kWrite, *id, i * 64, 64, b.data() + i * 64, i % 2});
  ASSERT_TRUE(e->Submit(w).ok());
  const size_t cancelled = e->Cancel(1);
  // One queue-depth slot: at most a couple of tag-1 requests can be past the queue.
  EXPECT_GE(cancelled, 47u);
  EXPECT_LE(cancelled, 50u);
  EXPECT_EQ(e->Cancel(12345), 0u);
  slow = false;
  std::vector<IoCompletion> done;
  Status s = e->WaitAll(&done);
  EXPECT_EQ(s.code(), StatusCode::kCancelled);
  ASSERT_EQ(done.size(), 100u);
  size_t n_cancelled = 0;
  for (const IoCompletion& c : done) {
    if (c.status.code() == StatusCode::kCancelled) {
      ++n_cancelled;
      EXPECT_EQ(c.tag, 1u);
      EXPECT_EQ(c.bytes_done, 0u);
    } else {
      EXPECT_TRUE(c.status.ok()) << c.status;
    }
  }
  EXPECT_EQ(n_cancelled, cancelled);

  // CancelAll
  slow = true;
  ASSERT_TRUE(e->Submit(w).ok());
  const size_t all = e->CancelAll();
  slow = false;
  done.clear();
  (void)e->WaitAll(&done);
  ASSERT_EQ(done.size(), 100u);
  n_cancelled = 0;
  for (const IoCompletion& c : done)
    n_cancelled += c.status.code() == StatusCode::kCancelled;
  EXPECT_EQ(n_cancelled, all);
  EXPECT_GE(all, 97u);
}

TEST_P(IoEngineTest, DestroyingWithRequestsInFlightEndsThem) {
  IoEngineOptions o = Options(1, 1);
  o.result_hook = [](const IoResultEvent& ev) -> int64_t {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return ev.result;
  };
  auto e = MakeEngine(o);
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  std::vector<char> b(64 * 50);
  std::vector<IoRequest> w;
  for (size_t i = 0; i < 50; ++i)
    w.push_back({IoOp::kWrite, *id, i * 64, 64, b.data() + i * 64, i});
  ASSERT_TRUE(e->Submit(w).ok());
  e.reset();  // must not hang or crash
  SUCCEED();
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kSync),
                         [](const auto& p) {
                           return p.param == IoEngineKind::kIoUring ? std::string("IoUring")
                                                                    : std::string("Sync");
                         });

TEST(IoEngineOptionsTest, NamesParseAndValidate) {
  EXPECT_EQ(IoOpName(IoOp::kRead), "read");
  EXPECT_EQ(IoOpName(IoOp::kWrite), "write");
  EXPECT_EQ(IoEngineKindName(IoEngineKind::kAuto), "auto");
  EXPECT_EQ(*ParseIoEngineKind("io_uring"), IoEngineKind::kIoUring);
  EXPECT_EQ(*ParseIoEngineKind("sync"), IoEngineKind::kSync);
  EXPECT_EQ(*ParseIoEngineKind("auto"), IoEngineKind::kAuto);
  Result<IoEngineKind> bad = ParseIoEngineKind("libaio");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("libaio"), std::string::npos);

  IoEngineOptions o;
  o.queue_depth = 0;
  Result<std::unique_ptr<IoEngine>> e = CreateIoEngine(o);
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("queue_depth 0"), std::string::npos) << e.status();
  o.queue_depth = 4;
  o.threads = 0;
  e = CreateIoEngine(o);
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);

  AioConfig aio;
  aio.queue_depth = 32;
  aio.intra_op_parallelism = 3;
  aio.single_submit = true;
  aio.overlap_events = false;
  IoEngineOptions from = IoEngineOptions::FromConfig(aio);
  EXPECT_TRUE(from.single_submit);
  EXPECT_FALSE(from.overlap_events);
  EXPECT_EQ(from.queue_depth, 32);
  EXPECT_EQ(from.threads, 3);
  EXPECT_EQ(from.kind, IoEngineKind::kAuto);
  EXPECT_NE(from.ToString().find("queue depth 32"), std::string::npos) << from.ToString();
}

TEST(IoEngineAutoTest, AutoPicksIoUringWhenAvailable) {
  IoEngineOptions o;
  Result<std::unique_ptr<IoEngine>> e = CreateIoEngine(o);
  ASSERT_TRUE(e.ok()) << e.status();
  if (IoUringAvailable().ok()) {
    EXPECT_EQ((*e)->name(), "io_uring");
    EXPECT_EQ((*e)->fallback(), "");
  } else {
    EXPECT_EQ((*e)->name(), "sync");
    EXPECT_NE((*e)->fallback().find("io_uring"), std::string::npos);
  }
}

// A ring whose io_uring_enter fails (the process must not abort): every
// request ends with the failure, those never submitted at once, the engine stays usable for
// its callers (WaitAll returns, in_flight() reaches 0), later requests are refused with the
// failure and what to do, and the engine shuts down. Enter fails at its `fail_at`-th call.
// A one-ring io_uring engine of depth 4 whose ring_hook is `hook`.
std::unique_ptr<IoEngine> HookedRing(IoRingHook hook, std::chrono::milliseconds drain) {
  IoEngineOptions o;
  o.kind = IoEngineKind::kIoUring;
  o.queue_depth = 4;
  o.threads = 1;
  o.failed_ring_drain = drain;
  o.ring_hook = std::move(hook);
  return MakeEngine(o);
}

// Writes of 4 KiB each, all of `b`, to consecutive offsets of `file`.
std::vector<IoRequest> Writes4K(FileId file, std::vector<char>& b) {
  std::vector<IoRequest> w;
  for (size_t i = 0; i < b.size() / 4096; ++i)
    w.push_back({IoOp::kWrite, file, i * 4096, 4096, b.data() + i * 4096, i});
  return w;
}

class FailedRingTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    Status s = IoUringAvailable();
    if (!s.ok()) GTEST_SKIP() << "io_uring is not available here: " << s;
  }
  ScratchDir dir_;
};

TEST_P(FailedRingTest, AFailedEnterFailsEveryRequestAndLaterOnesAreRefused) {
  const int fail_at = GetParam();
  std::atomic<bool> armed{false};  // counts only the enters after the Submit below
  std::atomic<int> enters{0};
  auto e = HookedRing(
      [&](IoRingCall call, int) {
        if (call != IoRingCall::kEnter || !armed) return 0;
        return ++enters >= fail_at ? -EBADF : 0;
      },
      std::chrono::milliseconds(2000));
  ASSERT_NE(e, nullptr);
  TestFile f(dir_.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  std::vector<char> b(4096 * 32);
  const std::vector<IoRequest> w = Writes4K(*id, b);
  armed = true;
  ASSERT_TRUE(e->Submit(w).ok());
  std::vector<IoCompletion> done;
  Status all = e->WaitAll(&done, std::chrono::seconds(30));
  EXPECT_EQ(done.size(), 32u) << all;  // every request ended, none twice
  EXPECT_EQ(e->in_flight(), 0u);
  size_t failed = 0;
  for (const IoCompletion& c : done) {
    if (c.status.ok()) continue;
    ++failed;
    EXPECT_NE(c.status.message().find("io_uring_enter"), std::string::npos) << c.status;
    EXPECT_NE(c.status.message().find("write of "), std::string::npos) << c.status;  // which
  }
  EXPECT_GT(failed, 0u);
  if (fail_at == 1) {
    EXPECT_EQ(failed, 32u);  // nothing reached the kernel
  }
  EXPECT_FALSE(all.ok());
  // A later request is refused with the failure and what to do.
  IoRequest more{IoOp::kWrite, *id, 0, 4096, b.data(), 99};
  ASSERT_TRUE(e->Submit({&more, 1}).ok());
  Result<IoCompletion> refused = e->WaitOne(std::chrono::seconds(10));
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(refused->status.code(), StatusCode::kFailedPrecondition) << refused->status;
  EXPECT_NE(refused->status.message().find("io_uring_enter"), std::string::npos) << refused->status;
  EXPECT_NE(refused->status.message().find("resume from the last checkpoint"), std::string::npos)
      << refused->status;
  EXPECT_EQ(e->CancelAll(), 0u);  // returns: the failed ring takes no cancel
  e.reset();                      // and the engine shuts down
}

// 1: the first submission fails (nothing reached the kernel); 3: a later one, with
// requests in the kernel whose completions come during the drain.
INSTANTIATE_TEST_SUITE_P(FirstAndLater, FailedRingTest, ::testing::Values(1, 3));

// A completion that names no request of the ring (here: the hook disowns the third one)
// fails the ring the same way: the requests end with an Internal error naming the slot, the
// one whose completion was disowned after the drain deadline; nothing aborts.
TEST(FailedRingUnknownCompletionTest, AnUnknownCompletionFailsTheRingNotTheProcess) {
  Status s = IoUringAvailable();
  if (!s.ok()) GTEST_SKIP() << "io_uring is not available here: " << s;
  ScratchDir dir;
  ASSERT_TRUE(dir.ok());
  std::atomic<int> completions{0};
  auto e =
      HookedRing([&](IoRingCall call,
                     int) { return call == IoRingCall::kCompletion && ++completions == 3 ? 1 : 0; },
                 std::chrono::milliseconds(300));
  ASSERT_NE(e, nullptr);
  TestFile f(dir.path(), /*direct=*/false);
  Result<FileId> id = e->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  std::vector<char> b(4096 * 16);
  const std::vector<IoRequest> w = Writes4K(*id, b);
  ASSERT_TRUE(e->Submit(w).ok());
  std::vector<IoCompletion> done;
  Status all = e->WaitAll(&done, std::chrono::seconds(30));
  EXPECT_EQ(done.size(), 16u) << all;
  EXPECT_EQ(e->in_flight(), 0u);
  size_t unknown = 0;
  size_t in_kernel = 0;
  for (const IoCompletion& c : done) {
    if (c.status.ok()) continue;
    EXPECT_EQ(c.status.code(), StatusCode::kInternal) << c.status;
    unknown +=
        c.status.message().find("a completion for no request of the ring") != std::string::npos;
    in_kernel += c.status.message().find("may still be in the kernel") != std::string::npos;
  }
  EXPECT_GE(unknown, 1u);
  EXPECT_EQ(in_kernel, 1u);  // the disowned one: its completion was taken
  e.reset();
}

TEST(IoEngineSqpollTest, SqpollRingRoundTrip) {
  if (!IoUringAvailable().ok()) GTEST_SKIP() << "io_uring is not available here";
  IoEngineOptions o;
  o.kind = IoEngineKind::kIoUring;
  o.sqpoll = true;
  Result<std::unique_ptr<IoEngine>> e = CreateIoEngine(o);
  if (!e.ok()) GTEST_SKIP() << "the kernel refuses SQPOLL here: " << e.status();
  ScratchDir dir;
  TestFile f(dir.path(), /*direct=*/false);
  Result<FileId> id = (*e)->RegisterFile(f.fd(), f.path());
  ASSERT_TRUE(id.ok());
  std::vector<char> src(10000, 'x'), dst(10000);
  IoRequest w{IoOp::kWrite, *id, 0, src.size(), src.data(), 1};
  IoRequest r{IoOp::kRead, *id, 0, dst.size(), dst.data(), 2};
  ASSERT_TRUE(SubmitAndWait(**e, {&w, 1}).ok());
  ASSERT_TRUE(SubmitAndWait(**e, {&r, 1}).ok());
  EXPECT_EQ(src, dst);
}

}  // namespace
}  // namespace strata::swap

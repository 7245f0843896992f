// FaultInjectingIoEngine: rule matching, determinism, and that each fault reaches the
// caller as the engine's own Status.
#include "strata/swap/fault_injection.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "test_util.h"

namespace strata::swap {
namespace {

using testing::ScratchDir;

class FaultInjectionTest : public ::testing::TestWithParam<IoEngineKind> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    if (GetParam() == IoEngineKind::kIoUring && !IoUringAvailable().ok())
      GTEST_SKIP() << "io_uring is not available here";
    path_ = dir_.path() + "/f";
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    ASSERT_GE(fd_, 0);
  }
  void TearDown() override {
    if (fd_ >= 0) close(fd_);
  }
  std::unique_ptr<FaultInjectingIoEngine> Make(uint64_t seed = 1) {
    IoEngineOptions o;
    o.kind = GetParam();
    o.queue_depth = 4;
    o.threads = 1;
    Result<std::unique_ptr<FaultInjectingIoEngine>> e = FaultInjectingIoEngine::Create(o, seed);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  }
  // Runs `n` writes of 100 bytes (tag i, offset 100 i) and returns status per tag.
  std::map<uint64_t, Status> Writes(IoEngine& e, FileId f, int n) {
    buf_.assign(100 * n, 'x');
    std::vector<IoRequest> reqs;
    for (int i = 0; i < n; ++i)
      reqs.push_back(
          {IoOp::kWrite, f, 100u * i, 100, buf_.data() + 100 * i, static_cast<uint64_t>(i)});
    std::map<uint64_t, Status> out;
    // One request at a time, so "the nth" is well defined.
    for (const IoRequest& r : reqs) {
      EXPECT_TRUE(e.Submit({&r, 1}).ok());
      Result<IoCompletion> c = e.WaitOne();
      EXPECT_TRUE(c.ok());
      out[c->tag] = c->status;
    }
    return out;
  }
  ScratchDir dir_;
  std::string path_;
  int fd_ = -1;
  std::vector<char> buf_;
};

TEST_P(FaultInjectionTest, NthAndCountSelectTheRequests) {
  auto e = Make();
  EXPECT_EQ(e->name(), std::string("faulty(") +
                           (GetParam() == IoEngineKind::kSync ? "sync" : "io_uring") + ")");
  Result<FileId> f = e->RegisterFile(fd_, path_);
  ASSERT_TRUE(f.ok());
  Result<int> r = e->AddRule(FaultRule::Error(EIO).Nth(3, 2));
  ASSERT_TRUE(r.ok());
  std::map<uint64_t, Status> s = Writes(*e, *f, 8);
  for (uint64_t i = 0; i < 8; ++i) {
    if (i == 2 || i == 3) {
      EXPECT_EQ(s[i].code(), StatusCode::kIOError) << i;
      EXPECT_EQ(s[i].errno_value(), EIO);
      EXPECT_NE(s[i].message().find(path_), std::string::npos) << s[i];
    } else {
      EXPECT_TRUE(s[i].ok()) << i << ": " << s[i];
    }
  }
  EXPECT_EQ(e->injected(*r), 2u);
  EXPECT_EQ(e->stats().failed, 2u);
}

TEST_P(FaultInjectionTest, TagOffsetAndOpConditions) {
  auto e = Make();
  Result<FileId> f = e->RegisterFile(fd_, path_);
  ASSERT_TRUE(e->AddRule(FaultRule::Error(ENOSPC).WithTag(5)).ok());
  ASSERT_TRUE(e->AddRule(FaultRule::Error(EIO).AtOffset(750)).ok());  // inside request 7
  ASSERT_TRUE(e->AddRule(FaultRule::Error(EIO).OnOp(IoOp::kRead)).ok());
  ASSERT_TRUE(e->AddRule(FaultRule::Error(EIO).OnFile(*f + 1)).ok());  // another file
  std::map<uint64_t, Status> s = Writes(*e, *f, 10);
  for (uint64_t i = 0; i < 10; ++i) {
    if (i == 5) {
      EXPECT_EQ(s[i].code(), StatusCode::kResourceExhausted) << s[i];
    } else if (i == 7) {
      EXPECT_EQ(s[i].code(), StatusCode::kIOError) << s[i];
    } else {
      EXPECT_TRUE(s[i].ok()) << i << ": " << s[i];
    }
  }
  char b[100];
  IoRequest r{IoOp::kRead, *f, 0, 100, b, 99};
  EXPECT_EQ(SubmitAndWait(*e, {&r, 1}).code(), StatusCode::kIOError);
}

TEST_P(FaultInjectionTest, ProbabilityIsDeterministicForASeed) {
  auto pattern = [&](uint64_t seed) {
    auto e = Make(seed);
    Result<FileId> f = e->RegisterFile(fd_, path_);
    EXPECT_TRUE(e->AddRule(FaultRule::Error(EIO).WithProbability(0.3)).ok());
    std::string p;
    for (auto& [tag, st] : Writes(*e, *f, 40))
      p += st.ok() ? '.' : 'X';
    return p;
  };
  const std::string a = pattern(7), b = pattern(7), c = pattern(8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a.find('X'), std::string::npos);
  EXPECT_NE(a.find('.'), std::string::npos);
}

TEST_P(FaultInjectionTest, RemovingRulesStopsFaults) {
  auto e = Make();
  Result<FileId> f = e->RegisterFile(fd_, path_);
  Result<int> r = e->AddRule(FaultRule::Error(EIO));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(Writes(*e, *f, 1)[0].ok());
  e->RemoveRule(*r);
  EXPECT_TRUE(Writes(*e, *f, 1)[0].ok());
  EXPECT_EQ(e->injected(), 1u);
}

TEST_P(FaultInjectionTest, DelayedCompletionsArriveLate) {
  auto e = Make();
  Result<FileId> f = e->RegisterFile(fd_, path_);
  ASSERT_TRUE(e->AddRule(FaultRule::Delay(std::chrono::milliseconds(200))).ok());
  char b[100] = {};
  IoRequest w{IoOp::kWrite, *f, 0, 100, b, 1};
  ASSERT_TRUE(e->Submit({&w, 1}).ok());
  EXPECT_EQ(e->WaitOne(std::chrono::milliseconds(10)).status().code(),
            StatusCode::kDeadlineExceeded);
  Result<IoCompletion> c = e->WaitOne();
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->status.ok());
  EXPECT_GE(c->latency, std::chrono::milliseconds(200));
}

TEST_P(FaultInjectionTest, BadRulesAreRejected) {
  auto e = Make();
  EXPECT_EQ(e->AddRule(FaultRule::Error(0)).status().code(), StatusCode::kInvalidArgument);
  Result<int> r = e->AddRule(FaultRule::Error(EIO).WithProbability(1.5));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("probability"), std::string::npos);
  EXPECT_NE(FaultRule::ShortTransfer(4096).OnOp(IoOp::kRead).Nth(2).ToString().find("short"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Engines, FaultInjectionTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kSync),
                         [](const auto& p) {
                           return p.param == IoEngineKind::kIoUring ? std::string("IoUring")
                                                                    : std::string("Sync");
                         });

}  // namespace
}  // namespace strata::swap

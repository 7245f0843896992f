// Status, Result<T>, the error macros, the errno mapping and STRATA_CHECK.
#include "strata/core/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/check.h"

namespace strata {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.errno_value(), 0);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_EQ(Status::Ok(), Status());
  EXPECT_FALSE(s.IsRetryable());
  EXPECT_FALSE(s.IsDataLoss());
}

TEST(StatusTest, CodeNames) {
  const std::vector<std::pair<StatusCode, std::string>> names = {
      {StatusCode::kOk, "OK"},
      {StatusCode::kInvalidArgument, "InvalidArgument"},
      {StatusCode::kNotFound, "NotFound"},
      {StatusCode::kAlreadyExists, "AlreadyExists"},
      {StatusCode::kPermissionDenied, "PermissionDenied"},
      {StatusCode::kIOError, "IOError"},
      {StatusCode::kDataLoss, "DataLoss"},
      {StatusCode::kResourceExhausted, "ResourceExhausted"},
      {StatusCode::kUnavailable, "Unavailable"},
      {StatusCode::kDeadlineExceeded, "DeadlineExceeded"},
      {StatusCode::kCancelled, "Cancelled"},
      {StatusCode::kFailedPrecondition, "FailedPrecondition"},
      {StatusCode::kOutOfRange, "OutOfRange"},
      {StatusCode::kUnimplemented, "Unimplemented"},
      {StatusCode::kInternal, "Internal"},
  };
  for (const auto& [code, name] : names)
    EXPECT_EQ(StatusCodeName(code), name);
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(999)), "Unknown");
}

TEST(StatusTest, ConvenienceConstructorsSetCodeAndMessage) {
  using Maker = Status (*)(std::string);
  const std::vector<std::pair<Maker, StatusCode>> makers = {
      {InvalidArgumentError, StatusCode::kInvalidArgument},
      {NotFoundError, StatusCode::kNotFound},
      {AlreadyExistsError, StatusCode::kAlreadyExists},
      {PermissionDeniedError, StatusCode::kPermissionDenied},
      {IOError, StatusCode::kIOError},
      {DataLossError, StatusCode::kDataLoss},
      {ResourceExhaustedError, StatusCode::kResourceExhausted},
      {UnavailableError, StatusCode::kUnavailable},
      {DeadlineExceededError, StatusCode::kDeadlineExceeded},
      {CancelledError, StatusCode::kCancelled},
      {FailedPreconditionError, StatusCode::kFailedPrecondition},
      {OutOfRangeError, StatusCode::kOutOfRange},
      {UnimplementedError, StatusCode::kUnimplemented},
      {InternalError, StatusCode::kInternal},
  };
  for (const auto& [make, code] : makers) {
    Status s = make("what happened");
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), code);
    EXPECT_EQ(s.message(), "what happened");
    EXPECT_EQ(s.errno_value(), 0);
    EXPECT_EQ(s.ToString(), std::string(StatusCodeName(code)) + ": what happened");
  }
}

TEST(StatusTest, RetryableAndDataLossFlags) {
  EXPECT_TRUE(UnavailableError("x").IsRetryable());
  EXPECT_TRUE(DeadlineExceededError("x").IsRetryable());
  EXPECT_FALSE(IOError("x").IsRetryable());
  EXPECT_FALSE(InvalidArgumentError("x").IsRetryable());
  EXPECT_TRUE(DataLossError("x").IsDataLoss());
  EXPECT_FALSE(IOError("x").IsDataLoss());
}

TEST(StatusTest, StreamsAsToString) {
  std::ostringstream os;
  os << NotFoundError("no such file") << " | " << Status();
  EXPECT_EQ(os.str(), "NotFound: no such file | OK");
}

TEST(StatusTest, WithContextChainsOutward) {
  Status s = IOError("c").WithContext("b").WithContext("a");
  EXPECT_EQ(s.message(), "a: b: c");
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_EQ(s.ToString(), "IOError: a: b: c");

  // The const& overload leaves the original alone.
  const Status base = DataLossError("crc mismatch");
  Status wrapped = base.WithContext("reading swap block 7");
  EXPECT_EQ(base.message(), "crc mismatch");
  EXPECT_EQ(wrapped.message(), "reading swap block 7: crc mismatch");
  EXPECT_EQ(wrapped.code(), StatusCode::kDataLoss);

  // Empty context adds nothing; OK stays OK.
  EXPECT_EQ(IOError("x").WithContext("").message(), "x");
  EXPECT_TRUE(Status().WithContext("anything").ok());
  EXPECT_EQ(Status().WithContext("anything").message(), "");
}

TEST(StatusTest, WithContextKeepsErrno) {
  Status s = ErrnoError(EIO, "pread").WithContext("reading swap block 7");
  EXPECT_EQ(s.errno_value(), EIO);
  EXPECT_EQ(s.message().rfind("reading swap block 7: pread: ", 0), 0u) << s.message();
}

TEST(StatusTest, CopyAndMove) {
  Status a(StatusCode::kUnavailable, "peer not up", EAGAIN);
  Status b(a);  // copy
  EXPECT_EQ(b, a);
  EXPECT_EQ(b.errno_value(), EAGAIN);
  b = b.WithContext("ctx");  // copies are independent
  EXPECT_EQ(a.message(), "peer not up");
  EXPECT_EQ(b.message(), "ctx: peer not up");

  Status c;
  c = a;  // copy-assign
  EXPECT_EQ(c, a);
  c = c;  // self-assignment is harmless
  EXPECT_EQ(c, a);
  c = Status();  // assign OK
  EXPECT_TRUE(c.ok());

  Status d(std::move(a));  // move
  EXPECT_EQ(d.code(), StatusCode::kUnavailable);
  EXPECT_EQ(d.message(), "peer not up");
  Status e;
  e = std::move(d);
  EXPECT_EQ(e.message(), "peer not up");
  EXPECT_EQ(e.errno_value(), EAGAIN);
}

TEST(StatusTest, EqualityComparesCodeAndMessage) {
  EXPECT_EQ(IOError("x"), IOError("x"));
  EXPECT_NE(IOError("x"), IOError("y"));
  EXPECT_NE(IOError("x"), DataLossError("x"));
  EXPECT_NE(IOError("x"), Status());
}

TEST(StatusDeathTest, OkCodeWithMessageIsABug) {
  EXPECT_DEATH(Status(StatusCode::kOk, "oops"), "an OK Status carries no message: oops");
}

// ---------------------------------------------------------------------------
// errno

TEST(ErrnoTest, MapsTheMainValues) {
  const std::vector<std::pair<int, StatusCode>> cases = {
      {ENOENT, StatusCode::kNotFound},
      {ENODEV, StatusCode::kNotFound},
      {EACCES, StatusCode::kPermissionDenied},
      {EPERM, StatusCode::kPermissionDenied},
      {EROFS, StatusCode::kPermissionDenied},
      {ENOSPC, StatusCode::kResourceExhausted},
      {ENOMEM, StatusCode::kResourceExhausted},
      {EDQUOT, StatusCode::kResourceExhausted},
      {EMFILE, StatusCode::kResourceExhausted},
      {EAGAIN, StatusCode::kUnavailable},
      {EBUSY, StatusCode::kUnavailable},
      {EINTR, StatusCode::kUnavailable},
      {EINVAL, StatusCode::kInvalidArgument},
      {EBADF, StatusCode::kInvalidArgument},
      {ETIMEDOUT, StatusCode::kDeadlineExceeded},
      {ECANCELED, StatusCode::kCancelled},
      {EEXIST, StatusCode::kAlreadyExists},
      {EOPNOTSUPP, StatusCode::kUnimplemented},
      {ENOSYS, StatusCode::kUnimplemented},
      {EBADMSG, StatusCode::kDataLoss},
      {EOVERFLOW, StatusCode::kOutOfRange},
      {EIO, StatusCode::kIOError},
      {ENXIO, StatusCode::kNotFound},
      {EREMOTEIO, StatusCode::kIOError},
  };
  for (const auto& [e, code] : cases) {
    EXPECT_EQ(StatusCodeFromErrno(e), code) << "errno " << e << " (" << std::strerror(e) << ")";
    Status s = ErrnoError(e, "op");
    EXPECT_EQ(s.code(), code) << "errno " << e;
    EXPECT_EQ(s.errno_value(), e);
  }
  EXPECT_EQ(StatusCodeFromErrno(0), StatusCode::kOk);
}

TEST(ErrnoTest, MessageHasContextTextAndNumber) {
  Status s = ErrnoError(ENOENT, "open /nvme0/swap.0");
  EXPECT_EQ(s.message(), "open /nvme0/swap.0: " + std::string(std::strerror(ENOENT)) + " (errno " +
                             std::to_string(ENOENT) + ")");
  EXPECT_EQ(s.ToString(), "NotFound: " + s.message());

  Status io = ErrnoError(EIO, "pwrite");
  EXPECT_NE(io.message().find("(errno 5)"), std::string::npos) << io.message();
  EXPECT_NE(io.message().find(std::strerror(EIO)), std::string::npos) << io.message();

  // No context: no leading ": ".
  Status bare = ErrnoError(ENOSPC, "");
  EXPECT_EQ(bare.message(),
            std::string(std::strerror(ENOSPC)) + " (errno " + std::to_string(ENOSPC) + ")");
}

TEST(ErrnoDeathTest, ZeroIsABug) {
  EXPECT_DEATH((void)ErrnoError(0, "nothing failed"), "nothing failed");
}

// ---------------------------------------------------------------------------
// Result<T>

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError(std::to_string(x) + " is odd");
  return x / 2;
}

TEST(ResultTest, HoldsAValue) {
  Result<int> r = Half(8);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.status().ok());
  EXPECT_EQ(r.value(), 4);
  EXPECT_EQ(*r, 4);
  EXPECT_EQ(r.value_or(-1), 4);
  *r = 7;
  EXPECT_EQ(r.value(), 7);
}

TEST(ResultTest, HoldsAnError) {
  Result<int> r = Half(3);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "3 is odd");
  EXPECT_EQ(r.value_or(-1), -1);
}

TEST(ResultTest, ArrowAndMoveOnlyValues) {
  Result<std::string> s = std::string("hello");
  EXPECT_EQ(s->size(), 5u);
  Result<std::unique_ptr<int>> p = std::make_unique<int>(42);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> owned = std::move(p).value();
  ASSERT_NE(owned, nullptr);
  EXPECT_EQ(*owned, 42);
}

TEST(ResultTest, CopyAndMove) {
  Result<std::string> a = std::string("value");
  Result<std::string> b = a;
  EXPECT_EQ(*b, "value");
  EXPECT_EQ(*a, "value");
  Result<std::string> c = std::move(b);
  EXPECT_EQ(*c, "value");

  Result<std::string> e = NotFoundError("gone");
  Result<std::string> f = e;
  EXPECT_EQ(f.status(), NotFoundError("gone"));
  Result<std::string> g = std::move(f);
  EXPECT_EQ(g.status(), NotFoundError("gone"));
}

TEST(ResultTest, WithContext) {
  Result<int> err = Result<int>(IOError("pread")).WithContext("block 3");
  EXPECT_EQ(err.status().message(), "block 3: pread");
  Result<int> fine = Result<int>(5).WithContext("block 3");
  ASSERT_TRUE(fine.ok());
  EXPECT_EQ(*fine, 5);
}

TEST(ResultDeathTest, ValueOfAnErrorDies) {
  Result<int> r = NotFoundError("no such swap file");
  EXPECT_DEATH((void)r.value(),
               "Result::value\\(\\) called on an error: NotFound: no such swap file");
  EXPECT_DEATH((void)*r, "no such swap file");
}

TEST(ResultDeathTest, FromOkStatusDies) {
  EXPECT_DEATH(
      {
        Result<int> r{Status()};
        (void)r;
      },
      "Result constructed from an OK Status");
}

// ---------------------------------------------------------------------------
// Macros

Status Step(bool fail, int* reached) {
  ++*reached;
  if (fail) return IOError("step failed");
  return Status::Ok();
}

Status TwoSteps(bool fail_first, bool fail_second, int* reached) {
  STRATA_RETURN_IF_ERROR(Step(fail_first, reached));
  STRATA_RETURN_IF_ERROR(Step(fail_second, reached));
  return Status::Ok();
}

TEST(MacroTest, ReturnIfError) {
  int reached = 0;
  EXPECT_TRUE(TwoSteps(false, false, &reached).ok());
  EXPECT_EQ(reached, 2);
  reached = 0;
  Status s = TwoSteps(true, false, &reached);
  EXPECT_EQ(s, IOError("step failed"));
  EXPECT_EQ(reached, 1);  // the second step never ran
  reached = 0;
  EXPECT_EQ(TwoSteps(false, true, &reached), IOError("step failed"));
  EXPECT_EQ(reached, 2);
}

Status WithCtx(bool fail) {
  int reached = 0;
  STRATA_RETURN_IF_ERROR_CTX(Step(fail, &reached), "preparing swap");
  return Status::Ok();
}

TEST(MacroTest, ReturnIfErrorWithContext) {
  EXPECT_TRUE(WithCtx(false).ok());
  EXPECT_EQ(WithCtx(true).message(), "preparing swap: step failed");
}

Result<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(auto q, Half(h));
  return q;
}

Status AssignExisting(int x, int* out) {
  STRATA_ASSIGN_OR_RETURN(*out, Half(x));
  return Status::Ok();
}

TEST(MacroTest, AssignOrReturn) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().message(), "3 is odd");  // second call fails
  EXPECT_EQ(Quarter(5).status().message(), "5 is odd");  // first call fails
  int out = -1;
  EXPECT_TRUE(AssignExisting(10, &out).ok());
  EXPECT_EQ(out, 5);
  out = -1;
  EXPECT_FALSE(AssignExisting(7, &out).ok());
  EXPECT_EQ(out, -1);
}

Result<std::unique_ptr<int>> MakeBox(int v) {
  return std::make_unique<int>(v);
}
Result<int> Unbox() {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<int> box, MakeBox(9));
  return *box;
}

TEST(MacroTest, AssignOrReturnMovesMoveOnlyValues) {
  EXPECT_EQ(*Unbox(), 9);
}

// ---------------------------------------------------------------------------
// STRATA_CHECK

TEST(CheckTest, PassingCheckDoesNothing) {
  int evaluated = 0;
  STRATA_CHECK(++evaluated == 1) << "never printed";
  EXPECT_EQ(evaluated, 1);  // the condition is evaluated exactly once
  STRATA_CHECK_OK(Status::Ok());
}

TEST(CheckDeathTest, FailingCheckAbortsWithFileLineAndMessage) {
  const int offset = 13;
  EXPECT_DEATH(STRATA_CHECK(offset % 4 == 0) << "offset " << offset,
               "internal check failed at .*status_test\\.cc:[0-9]+: offset % 4 == 0: offset 13");
}

TEST(CheckDeathTest, FailingCheckWithoutMessage) {
  EXPECT_DEATH(STRATA_CHECK(1 + 1 == 3), "status_test\\.cc:[0-9]+: 1 \\+ 1 == 3\n");
}

TEST(CheckDeathTest, CheckOkPrintsTheStatus) {
  EXPECT_DEATH(STRATA_CHECK_OK(DataLossError("crc mismatch in block 4")),
               "status_test\\.cc:[0-9]+: .*DataLoss: crc mismatch in block 4");
}

TEST(CheckDeathTest, CheckInsideIfElseBindsCorrectly) {
  // The macro is an expression, so it nests in an unbraced if/else.
  auto f = [](bool a) {
    if (a)
      STRATA_CHECK(false) << "then-branch";
    else
      STRATA_CHECK(true) << "else-branch";
  };
  f(false);
  EXPECT_DEATH(f(true), "then-branch");
}

}  // namespace
}  // namespace strata

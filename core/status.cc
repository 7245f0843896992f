#include "strata/core/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "strata/core/check.h"

namespace strata {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kIOError:
      return "IOError";
    case StatusCode::kDataLoss:
      return "DataLoss";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kDeadlineExceeded:
      return "DeadlineExceeded";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kOutOfRange:
      return "OutOfRange";
    case StatusCode::kUnimplemented:
      return "Unimplemented";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message, int errno_value) {
  STRATA_CHECK(code != StatusCode::kOk) << "an OK Status carries no message: " << message;
  rep_ = std::make_unique<Rep>(Rep{code, std::move(message), errno_value});
}

Status::Status(const Status& other)
    : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

Status Status::WithContext(std::string_view context) const& {
  Status copy(*this);
  return std::move(copy).WithContext(context);
}

Status Status::WithContext(std::string_view context) && {
  if (rep_ && !context.empty()) {
    std::string m;
    m.reserve(context.size() + 2 + rep_->message.size());
    m.append(context).append(": ").append(rep_->message);
    rep_->message = std::move(m);
  }
  return std::move(*this);
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(rep_->code));
  s.append(": ").append(rep_->message);
  return s;
}

std::ostream& operator<<(std::ostream& os, const Status& s) {
  return os << s.ToString();
}

#define STRATA_DEFINE_ERROR(Name, Code)                  \
  Status Name(std::string message) {                     \
    return Status(StatusCode::Code, std::move(message)); \
  }
STRATA_DEFINE_ERROR(InvalidArgumentError, kInvalidArgument)
STRATA_DEFINE_ERROR(NotFoundError, kNotFound)
STRATA_DEFINE_ERROR(AlreadyExistsError, kAlreadyExists)
STRATA_DEFINE_ERROR(PermissionDeniedError, kPermissionDenied)
STRATA_DEFINE_ERROR(IOError, kIOError)
STRATA_DEFINE_ERROR(DataLossError, kDataLoss)
STRATA_DEFINE_ERROR(ResourceExhaustedError, kResourceExhausted)
STRATA_DEFINE_ERROR(UnavailableError, kUnavailable)
STRATA_DEFINE_ERROR(DeadlineExceededError, kDeadlineExceeded)
STRATA_DEFINE_ERROR(CancelledError, kCancelled)
STRATA_DEFINE_ERROR(FailedPreconditionError, kFailedPrecondition)
STRATA_DEFINE_ERROR(OutOfRangeError, kOutOfRange)
STRATA_DEFINE_ERROR(UnimplementedError, kUnimplemented)
STRATA_DEFINE_ERROR(InternalError, kInternal)
#undef STRATA_DEFINE_ERROR

StatusCode StatusCodeFromErrno(int e) {
  switch (e) {
    case 0:
      return StatusCode::kOk;
    case ENOENT:
    case ENXIO:
    case ENODEV:
      return StatusCode::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS:
      return StatusCode::kPermissionDenied;
    case ENOSPC:
    case ENOMEM:
    case EDQUOT:
    case EMFILE:
    case ENFILE:
    case EFBIG:
      return StatusCode::kResourceExhausted;
    case EAGAIN:
    case EBUSY:
    case EINTR:
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      return StatusCode::kUnavailable;
    case EINVAL:
    case EBADF:
    case ENAMETOOLONG:
    case ENOTDIR:
    case EISDIR:
      return StatusCode::kInvalidArgument;
    case ETIMEDOUT:
      return StatusCode::kDeadlineExceeded;
    case ECANCELED:
      return StatusCode::kCancelled;
    case EEXIST:
      return StatusCode::kAlreadyExists;
    case EOPNOTSUPP:
    case ENOSYS:
      return StatusCode::kUnimplemented;
    case EBADMSG:
      return StatusCode::kDataLoss;
    case ERANGE:
    case EOVERFLOW:
      return StatusCode::kOutOfRange;
    default:
      return StatusCode::kIOError;
  }
}

Status ErrnoError(int errno_value, std::string_view context) {
  STRATA_CHECK(errno_value != 0) << "ErrnoError(0) for " << context;
  char buf[256];
  // GNU strerror_r returns the message pointer (which may or may not be buf).
  const char* text = strerror_r(errno_value, buf, sizeof buf);
  std::string m(context);
  if (!m.empty()) m.append(": ");
  m.append(text).append(" (errno ").append(std::to_string(errno_value)).append(")");
  return Status(StatusCodeFromErrno(errno_value), std::move(m), errno_value);
}

namespace internal {

void ResultValueOfError(const Status& status) {
  std::fprintf(stderr, "strata: Result::value() called on an error: %s\n",
               status.ToString().c_str());
  std::abort();
}

void ResultFromOkStatus() {
  std::fprintf(stderr, "strata: Result constructed from an OK Status (it needs a value)\n");
  std::abort();
}

CheckFailure::CheckFailure(const char* file, int line, const char* condition)
    : file_(file), line_(line), condition_(condition) {}

CheckFailure::~CheckFailure() {
  const std::string extra = os_.str();
  std::fprintf(stderr, "strata: internal check failed at %s:%d: %s%s%s\n", file_, line_, condition_,
               extra.empty() ? "" : ": ", extra.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal
}  // namespace strata

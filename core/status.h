// Status and Result<T>: the error model below engine/.
//
// Functions that can fail at run time (I/O, allocation, bad configuration,
// communication) return a Status or a Result<T>. A Status is cheap when OK (one null
// pointer) and carries a code, a message and, for system errors, the errno value.
// Context is chained outward: WithContext("reading swap block 7") turns
// "pread: Input/output error" into "reading swap block 7: pread: Input/output error".
//
// Invariants (programming errors) use STRATA_CHECK from check.h, which stays on in
// release builds. The C assert macro is never used for run-time errors.
//
// Thread-safety: Status and Result are values; distinct objects may be used from
// distinct threads freely, one object needs external synchronization to be mutated.
#pragma once

#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     // the caller passed something wrong (config, sizes, alignment)
  kNotFound,            // a file, key, device or node does not exist
  kAlreadyExists,       // creating something that is already there
  kPermissionDenied,    // EACCES/EPERM, missing capability
  kIOError,             // an I/O operation failed (EIO, short transfer that cannot finish)
  kDataLoss,            // stored bytes are corrupt (checksum mismatch, truncated file)
  kResourceExhausted,   // memory, disk space, a budget, a locked-memory limit
  kUnavailable,         // transient: retry may succeed (EAGAIN, peer not yet up)
  kDeadlineExceeded,    // a timeout expired
  kCancelled,           // the operation was cancelled by the caller
  kFailedPrecondition,  // the system is not in a state that allows the operation
  kOutOfRange,          // an index or offset beyond the end
  kUnimplemented,       // a known feature that Strata does not implement
  kInternal,            // a bug: an invariant that should hold did not
};

// "InvalidArgument", "IOError", ...
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, int errno_value = 0);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The message without the code name; empty when OK.
  const std::string& message() const;
  // errno of the system call that failed, 0 if none.
  int errno_value() const { return rep_ ? rep_->errno_value : 0; }

  // Transient failures that a retry may cure.
  bool IsRetryable() const {
    return code() == StatusCode::kUnavailable || code() == StatusCode::kDeadlineExceeded;
  }
  bool IsDataLoss() const { return code() == StatusCode::kDataLoss; }

  // Prefixes the message with context ("context: message"); OK stays OK.
  Status WithContext(std::string_view context) const&;
  Status WithContext(std::string_view context) &&;

  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
    int errno_value;
  };
  std::unique_ptr<Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

// Convenience constructors.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status PermissionDeniedError(std::string message);
Status IOError(std::string message);
Status DataLossError(std::string message);
Status ResourceExhaustedError(std::string message);
Status UnavailableError(std::string message);
Status DeadlineExceededError(std::string message);
Status CancelledError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);

// The one place errno values become Status codes: "<context>: <strerror> (errno N)".
// ENOENT->NotFound, EACCES/EPERM->PermissionDenied, ENOSPC/ENOMEM/EDQUOT->
// ResourceExhausted, EAGAIN/EBUSY/EINTR->Unavailable, EINVAL->InvalidArgument,
// ETIMEDOUT->DeadlineExceeded, ECANCELED->Cancelled, EEXIST->AlreadyExists,
// EOPNOTSUPP/ENOSYS->Unimplemented, EBADMSG->DataLoss, everything else->IOError.
StatusCode StatusCodeFromErrno(int errno_value);
Status ErrnoError(int errno_value, std::string_view context);

// Result<T>: a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> makes no sense");

 public:
  // NOLINTNEXTLINE(google-explicit-constructor): implicit from a value, like absl::StatusOr.
  Result(T value) : v_(std::move(value)) {}
  // NOLINTNEXTLINE(google-explicit-constructor): implicit from an error Status.
  Result(Status status) : v_(std::move(status)) { CheckNotOk(); }

  bool ok() const { return v_.index() == 0; }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<1>(v_);
  }

  T& value() & {
    CheckOk();
    return std::get<0>(v_);
  }
  const T& value() const& {
    CheckOk();
    return std::get<0>(v_);
  }
  T&& value() && {
    CheckOk();
    return std::get<0>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? std::get<0>(v_) : static_cast<T>(std::forward<U>(fallback));
  }

  Result WithContext(std::string_view context) && {
    if (ok()) return std::move(*this);
    return Result(std::get<1>(std::move(v_)).WithContext(context));
  }

 private:
  void CheckOk() const;
  void CheckNotOk() const;
  std::variant<T, Status> v_;
};

namespace internal {
[[noreturn]] void ResultValueOfError(const Status& status);
[[noreturn]] void ResultFromOkStatus();
}  // namespace internal

template <typename T>
void Result<T>::CheckOk() const {
  if (!ok()) internal::ResultValueOfError(std::get<1>(v_));
}
template <typename T>
void Result<T>::CheckNotOk() const {
  if (ok() || std::get<1>(v_).ok()) internal::ResultFromOkStatus();
}

}  // namespace strata

#define STRATA_INTERNAL_CONCAT2(a, b) a##b
#define STRATA_INTERNAL_CONCAT(a, b) STRATA_INTERNAL_CONCAT2(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

// Like STRATA_RETURN_IF_ERROR, adding context to the returned Status.
#define STRATA_RETURN_IF_ERROR_CTX(expr, context)                         \
  do {                                                                    \
    ::strata::Status strata_status_ = (expr);                             \
    if (!strata_status_.ok()) return strata_status_.WithContext(context); \
  } while (0)

// `lhs = value of expr`, or returns its Status. lhs may declare: `auto x`.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_INTERNAL_ASSIGN_OR_RETURN(STRATA_INTERNAL_CONCAT(strata_result_, __LINE__), lhs, expr)
#define STRATA_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return tmp.status();                    \
  lhs = std::move(tmp).value()

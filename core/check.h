// STRATA_CHECK: an always-on check for invariants (programming errors), on in release
// builds too. A failed check prints file, line, the condition and any streamed
// message to stderr, then aborts. Run-time errors (I/O, bad input) return a Status
// instead; see status.h.
//
//   STRATA_CHECK(offset % kAlign == 0) << "offset " << offset;
//   STRATA_CHECK_OK(status);   // for a Status that cannot fail unless there is a bug
#pragma once

#include <sstream>

#include "strata/core/status.h"

namespace strata::internal {

// Collects the streamed message of a failed check and aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;
  std::ostream& stream() { return os_; }

 private:
  const char* file_;
  int line_;
  const char* condition_;
  std::ostringstream os_;
};

// Lets `cond ? (void)0 : Voidify() & stream` type-check with a streamed message.
struct CheckVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace strata::internal

#define STRATA_CHECK(cond)                       \
  (__builtin_expect(static_cast<bool>(cond), 1)) \
      ? (void)0                                  \
      : ::strata::internal::CheckVoidify() &     \
            ::strata::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()

#define STRATA_CHECK_OK(expr)                                                   \
  do {                                                                          \
    const ::strata::Status strata_check_status_ = (expr);                       \
    STRATA_CHECK(strata_check_status_.ok()) << strata_check_status_.ToString(); \
  } while (0)

#include "strata/core/budget.h"

#include "strata/core/bytes.h"
#include "strata/core/check.h"

namespace strata {

ByteBudget::ByteBudget(std::string name, uint64_t limit) : name_(std::move(name)), limit_(limit) {}

Status ByteBudget::Reserve(uint64_t bytes) {
  uint64_t cur = in_use_.load(std::memory_order_relaxed);
  for (;;) {
    if (bytes > limit_ || cur > limit_ - bytes) {
      return ResourceExhaustedError(name_ + " exhausted: asked for " + FormatBytes(bytes) +
                                    " with " + FormatBytes(cur) + " in use of a limit of " +
                                    FormatBytes(limit_) + " (" + std::to_string(bytes) +
                                    " bytes requested)");
    }
    if (in_use_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed)) break;
  }
  const uint64_t now = cur + bytes;
  uint64_t p = peak_.load(std::memory_order_relaxed);
  while (now > p && !peak_.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
  return Status::Ok();
}

void ByteBudget::Release(uint64_t bytes) {
  const uint64_t before = in_use_.fetch_sub(bytes, std::memory_order_relaxed);
  STRATA_CHECK(before >= bytes) << name_ << ": released " << bytes << " bytes with only " << before
                                << " reserved";
}

uint64_t ByteBudget::available() const {
  const uint64_t used = in_use();
  return used >= limit_ ? 0 : limit_ - used;
}

}  // namespace strata

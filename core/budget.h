// ByteBudget: an enforced limit on a scarce resource (device bytes, host bytes, locked
// bytes, in-flight I/O). Reservations either fit or fail with ResourceExhausted naming
// the budget, what was asked, what is in use and the limit; nothing is over-committed.
//
// Thread-safety: all member functions are thread-safe (lock-free).
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>

#include "strata/core/status.h"

namespace strata {

class ByteBudget {
 public:
  static constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

  // `name` appears in errors ("host tier budget"); limit kUnlimited means no limit.
  explicit ByteBudget(std::string name, uint64_t limit = kUnlimited);
  ByteBudget(const ByteBudget&) = delete;
  ByteBudget& operator=(const ByteBudget&) = delete;

  // Reserves `bytes` or fails with ResourceExhausted; never blocks.
  Status Reserve(uint64_t bytes);
  // Returns bytes reserved earlier. Releasing more than is reserved is a bug (checked).
  void Release(uint64_t bytes);

  const std::string& name() const { return name_; }
  uint64_t limit() const { return limit_; }
  uint64_t in_use() const { return in_use_.load(std::memory_order_relaxed); }
  uint64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  uint64_t available() const;
  void ResetPeak() { peak_.store(in_use(), std::memory_order_relaxed); }

 private:
  std::string name_;
  uint64_t limit_;
  std::atomic<uint64_t> in_use_{0};
  std::atomic<uint64_t> peak_{0};
};

}  // namespace strata

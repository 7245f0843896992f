// A test device allocator over a host arena whose n-th allocation fails, as a machine short
// of memory on one rank would (the budget, Fits, says yes all the same). Counting starts at
// construction, or at Arm() when constructed disarmed; fail_at 0: none fails.
#pragma once

#include <cstdint>
#include <string>

#include "strata/engine/device/tier.h"

namespace strata::engine::testing {

class FailingAllocator final : public DeviceAllocator {
 public:
  FailingAllocator(uint64_t budget, int fail_at, bool armed = true)
      : inner_(budget), fail_at_(fail_at), armed_(armed) {}
  std::string name() const override { return "failing arena"; }
  Result<void*> Allocate(size_t bytes) override {
    if (armed_ && ++count_ == fail_at_) return ResourceExhaustedError("injected: out of memory");
    return inner_.Allocate(bytes);
  }
  void Free(void* ptr, size_t bytes) override { inner_.Free(ptr, bytes); }
  Status Zero(void* ptr, size_t bytes) override { return inner_.Zero(ptr, bytes); }
  TierUsage usage() const override { return inner_.usage(); }
  bool Fits(size_t bytes) const override { return inner_.Fits(bytes); }
  bool host_addressable() const override { return true; }
  comm::Device comm_device() const override { return comm::Device::Cpu(); }
  void Arm() { armed_ = true; }
  int count() const { return count_; }  // allocations since armed

 private:
  HostArenaAllocator inner_;
  int fail_at_;
  bool armed_;
  int count_ = 0;
};

}  // namespace strata::engine::testing

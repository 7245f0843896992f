#include "strata/engine/device/tier.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/logging.h"

namespace strata::engine {

std::string_view TierKindName(TierKind kind) {
  switch (kind) {
    case TierKind::kDevice:
      return "device";
    case TierKind::kHost:
      return "host";
    case TierKind::kNvme:
      return "nvme";
  }
  return "?";
}

TierBuffer::TierBuffer(TierBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      kind_(other.kind_),
      releaser_(std::move(other.releaser_)) {}

TierBuffer& TierBuffer::operator=(TierBuffer&& other) noexcept {
  if (this != &other) {
    releaser_.reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    kind_ = other.kind_;
    releaser_ = std::move(other.releaser_);
  }
  return *this;
}

void TierBuffer::ResetAfter(EventId after) {
  if (releaser_) releaser_->SetReleaseAfter(after);
  Reset();
}

void TierBuffer::Reset() {
  releaser_.reset();
  data_ = nullptr;
  size_ = 0;
}

// ---------------------------------------------------------------------------

namespace {
constexpr size_t kArenaAlign = 64;
size_t RoundUp64(size_t n) {
  return (n + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
}
}  // namespace

HostArenaAllocator::HostArenaAllocator(uint64_t budget_bytes)
    : budget_bytes_(budget_bytes),
      budget_("device tier budget (strata.device_budget, host arena)",
              budget_bytes == 0 ? ByteBudget::kUnlimited : budget_bytes) {}

HostArenaAllocator::~HostArenaAllocator() {
  if (live_.load() != 0) {
    STRATA_LOG(kError) << "host arena destroyed with " << live_.load() << " live allocations ("
                       << budget_.in_use() << " bytes)";
  }
}

Result<void*> HostArenaAllocator::Allocate(size_t bytes) {
  const size_t rounded = RoundUp64(bytes);
  STRATA_RETURN_IF_ERROR(budget_.Reserve(rounded));
  void* p = std::aligned_alloc(kArenaAlign, rounded == 0 ? kArenaAlign : rounded);
  if (p == nullptr) {
    budget_.Release(rounded);
    return ResourceExhaustedError("host arena: out of memory allocating " + FormatBytes(rounded));
  }
  live_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void HostArenaAllocator::Free(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  std::free(ptr);
  budget_.Release(RoundUp64(bytes));
  live_.fetch_sub(1, std::memory_order_relaxed);
}

Status HostArenaAllocator::Zero(void* ptr, size_t bytes) {
  if (bytes != 0) std::memset(ptr, 0, bytes);
  return Status::Ok();
}

bool HostArenaAllocator::Fits(size_t bytes) const {
  return RoundUp64(bytes) <= budget_.available();
}

TierUsage HostArenaAllocator::usage() const {
  return {budget_.in_use(), budget_.peak(), budget_bytes_, live_.load(std::memory_order_relaxed)};
}

// ---------------------------------------------------------------------------

namespace {

class DeviceReleaser final : public TierBuffer::Releaser {
 public:
  DeviceReleaser(std::shared_ptr<DeviceAllocator> alloc, void* ptr, size_t bytes)
      : alloc_(std::move(alloc)), ptr_(ptr), bytes_(bytes) {}
  ~DeviceReleaser() override { alloc_->FreeAfter(ptr_, bytes_, after_); }
  void SetReleaseAfter(EventId after) override { after_ = after; }

 private:
  std::shared_ptr<DeviceAllocator> alloc_;
  void* ptr_;
  size_t bytes_;
  EventId after_;  // none: free at once
};

class DeviceTier final : public Tier {
 public:
  explicit DeviceTier(std::shared_ptr<DeviceAllocator> alloc) : alloc_(std::move(alloc)) {}
  TierKind kind() const override { return TierKind::kDevice; }
  std::string name() const override { return "device (" + alloc_->name() + ")"; }
  Result<TierBuffer> Allocate(size_t bytes, std::string_view purpose) override {
    return AllocateFor(bytes, purpose, FirstUse{});
  }
  Result<TierBuffer> AllocateFor(size_t bytes, std::string_view purpose,
                                 const FirstUse& use) override {
    if (bytes == 0) return TierBuffer();
    Result<void*> p = use.stream ? alloc_->AllocateOn(bytes, *use.stream) : alloc_->Allocate(bytes);
    if (!p.ok()) {
      return p.status().WithContext("allocating " + std::string(purpose) + " on the device tier");
    }
    if (use.zero) {
      Status zeroed = alloc_->Zero(*p, bytes);
      if (!zeroed.ok()) {
        alloc_->Free(*p, bytes);
        return zeroed.WithContext("zeroing " + std::string(purpose) + " on the device tier");
      }
    }
    return TierBuffer(static_cast<std::byte*>(*p), bytes, TierKind::kDevice,
                      std::make_unique<DeviceReleaser>(alloc_, *p, bytes));
  }
  TierUsage usage() const override { return alloc_->usage(); }
  bool Fits(size_t bytes) const override { return alloc_->Fits(bytes); }
  bool host_addressable() const override { return alloc_->host_addressable(); }
  comm::Device comm_device() const override { return alloc_->comm_device(); }

 private:
  std::shared_ptr<DeviceAllocator> alloc_;
};

class HostReleaser final : public TierBuffer::Releaser {
 public:
  explicit HostReleaser(HostBuffer buffer) : buffer_(std::move(buffer)) {}

 private:
  HostBuffer buffer_;  // its destructor returns the memory to the pool
};

class HostTier final : public Tier {
 public:
  explicit HostTier(std::shared_ptr<HostPool> pool) : pool_(std::move(pool)) {}
  TierKind kind() const override { return TierKind::kHost; }
  std::string name() const override { return "host (" + pool_->options().name + ")"; }
  Result<TierBuffer> Allocate(size_t bytes, std::string_view purpose) override {
    if (bytes == 0) return TierBuffer();
    Result<HostBuffer> b = pool_->Allocate(bytes);
    if (!b.ok()) {
      return b.status().WithContext("allocating " + std::string(purpose) + " on the host tier");
    }
    std::byte* data = static_cast<std::byte*>(b->data());
    return TierBuffer(data, bytes, TierKind::kHost, std::make_unique<HostReleaser>(*std::move(b)));
  }
  TierUsage usage() const override {
    const HostPoolStats s = pool_->Stats();
    return {s.bytes_in_use, s.peak_bytes, s.budget_limit, s.live_allocations};
  }
  bool Fits(size_t bytes) const override {
    const HostPoolStats s = pool_->Stats();
    constexpr uint64_t kPage = 4096;  // at least; huge-page mappings round further
    return s.budget_limit == 0 ||
           s.bytes_in_use + (bytes + kPage - 1) / kPage * kPage <= s.budget_limit;
  }
  bool host_addressable() const override { return true; }
  comm::Device comm_device() const override { return comm::Device::Cpu(); }

 private:
  std::shared_ptr<HostPool> pool_;
};

}  // namespace

std::unique_ptr<Tier> MakeDeviceTier(std::shared_ptr<DeviceAllocator> allocator) {
  return std::make_unique<DeviceTier>(std::move(allocator));
}

std::unique_ptr<Tier> MakeHostTier(std::shared_ptr<HostPool> pool) {
  return std::make_unique<HostTier>(std::move(pool));
}

Result<Tier*> SelectOffloadTier(OffloadDevice device, std::string_view key, Tier* device_tier,
                                Tier* host_tier) {
  switch (device) {
    case OffloadDevice::kNone:
      return device_tier;
    case OffloadDevice::kCpu:
      return host_tier;
    case OffloadDevice::kNvme:
      break;
  }
  return UnimplementedError(std::string(key) +
                            " = nvme: NVMe tier not implemented yet (use none or cpu)");
}

}  // namespace strata::engine

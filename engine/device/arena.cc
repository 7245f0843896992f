// The device arena (arena.h).
#include "strata/engine/device/arena.h"

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/check.h"

namespace strata::engine {
namespace {
// The bytes an allocation of `bytes` takes in the arena (at least one alignment unit).
size_t Counted(size_t bytes) {
  return AlignUp(std::max<size_t>(bytes, 1), Arena::kAlign);
}
}  // namespace

Result<std::shared_ptr<Arena>> Arena::Create(uint64_t budget,
                                             std::unique_ptr<ArenaBackend> backend) {
  auto a = std::shared_ptr<Arena>(new Arena(budget, std::move(backend)));
  if (budget > 0) {
    const size_t bytes = AlignUp(budget, kAlign);
    Result<void*> p = a->backend_->Reserve(bytes);
    if (!p.ok()) {
      return p.status().WithContext(
          a->backend_->name() +
          " device: reserving the arena of strata.device_budget = " + FormatBytes(budget));
    }
    a->base_ = static_cast<std::byte*>(*p);
    a->reserved_ = bytes;
    a->free_[0] = bytes;
  }
  return a;
}

Arena::~Arena() {
  if (base_ != nullptr) backend_->Release(base_, reserved_);
}

void Arena::SetSync(SyncFn sync) {
  std::lock_guard<std::mutex> lock(mu_);
  sync_ = std::move(sync);
}

void Arena::SetStreamWait(StreamWaitFn wait) {
  std::lock_guard<std::mutex> lock(mu_);
  stream_wait_ = std::move(wait);
}

void Arena::SetSkipReuseWaitForTest(bool skip) {
  std::lock_guard<std::mutex> lock(mu_);
  skip_wait_ = skip;
}

std::string Arena::name() const {
  return budget_ > 0 ? backend_->name() + " arena of " + FormatBytes(budget_)
                     : backend_->name() + " (no arena, unbounded)";
}

Result<void*> Arena::Allocate(size_t bytes) {
  return AllocateImpl(bytes, std::nullopt);
}

Result<void*> Arena::AllocateOn(size_t bytes, StreamId stream) {
  return AllocateImpl(bytes, std::optional<StreamId>(stream));
}

Result<void*> Arena::AllocateImpl(size_t bytes, std::optional<StreamId> stream) {
  const size_t n = Counted(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  if (budget_ == 0) {
    // No arena: a freed block goes back to the backend once its event completed.
    STRATA_RETURN_IF_ERROR(DrainLocked(lock));
    STRATA_ASSIGN_OR_RETURN(void* p, backend_->Reserve(n));
    Count(n);
    return p;
  }
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= n && (best == free_.end() || it->second < best->second)) best = it;
  }
  if (best == free_.end()) {
    return ResourceExhaustedError("device arena: no block of " + FormatBytes(n) + " (in use " +
                                  FormatBytes(in_use_) +
                                  " of strata.device_budget = " + FormatBytes(budget_) +
                                  ", largest free block " + FormatBytes(LargestFreeLocked()) + ")");
  }
  const size_t off = best->first;
  const size_t left = best->second - n;
  free_.erase(best);
  if (left > 0) free_[off + n] = left;
  used_[off] = n;
  Count(n);
  // The blocks given to FreeAfter that this one reuses: their last readers first (the
  // others wait until an allocation reuses them).
  std::vector<Pending> reused;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const size_t p_off = static_cast<size_t>(static_cast<std::byte*>(it->ptr) - base_);
    if (p_off < off + n && off < p_off + Counted(it->bytes)) {
      reused.push_back(*it);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  if (sync_ && !skip_wait_ && !reused.empty()) {
    // The first user waits: its stream on the device, or else the host.
    SyncFn wait = sync_;
    if (stream.has_value() && stream_wait_) {
      wait = [w = stream_wait_, s = *stream](EventId e) { return w(s, e); };
    }
    lock.unlock();
    Status waited;
    for (const Pending& p : reused) {
      waited = wait(p.after);
      if (!waited.ok()) break;
    }
    lock.lock();
    if (!waited.ok()) {
      // Nothing changes: the block goes back, and its earlier owners' events stay pending.
      FreeLocked(base_ + off, n);
      pending_.insert(pending_.end(), reused.begin(), reused.end());
      return waited.WithContext("device arena: waiting to reuse a freed block");
    }
  }
  return static_cast<void*>(base_ + off);
}

void Arena::Free(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  FreeLocked(ptr, bytes);
}

void Arena::FreeAfter(void* ptr, size_t bytes, EventId after) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!after.valid()) {
    FreeLocked(ptr, bytes);
    return;
  }
  pending_.push_back({ptr, bytes, after});
  // With an arena the block is free for placement at once (every rank places alike); an
  // allocation that reuses it waits for `after` first.
  if (budget_ > 0) FreeLocked(ptr, bytes);
}

TierUsage Arena::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return TierUsage{in_use_, peak_, budget_, live_};
}

bool Arena::Fits(size_t bytes) const {
  if (budget_ == 0) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_ + Counted(bytes) <= reserved_;  // blocks given to FreeAfter are free
}

uint64_t Arena::LargestFree() const {
  std::lock_guard<std::mutex> lock(mu_);
  return LargestFreeLocked();
}

Status Arena::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  return DrainLocked(lock);
}

void Arena::Count(size_t n) {
  in_use_ += n;
  peak_ = std::max(peak_, in_use_);
  ++live_;
}

uint64_t Arena::LargestFreeLocked() const {
  uint64_t m = 0;
  for (const auto& [off, size] : free_)
    m = std::max<uint64_t>(m, size);
  return m;
}

Status Arena::DrainLocked(std::unique_lock<std::mutex>& lock) {
  while (!pending_.empty()) {
    Pending p = pending_.front();
    pending_.pop_front();
    if (sync_ && !skip_wait_) {
      SyncFn sync = sync_;
      lock.unlock();
      Status s = sync(p.after);
      lock.lock();
      if (!s.ok()) return s.WithContext("device arena: waiting to reuse a freed block");
    }
    if (budget_ == 0) FreeLocked(p.ptr, p.bytes);  // (with an arena: freed at FreeAfter)
  }
  return Status::Ok();
}

void Arena::FreeLocked(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  const size_t n = Counted(bytes);
  STRATA_CHECK(in_use_ >= n && live_ > 0);
  in_use_ -= n;
  --live_;
  if (budget_ == 0) {
    backend_->Release(ptr, n);
    return;
  }
  const size_t off = static_cast<size_t>(static_cast<std::byte*>(ptr) - base_);
  auto u = used_.find(off);
  STRATA_CHECK(u != used_.end() && u->second == n);
  used_.erase(u);
  auto next = free_.lower_bound(off);
  size_t start = off, size = n;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + n) {
    size += next->second;
    free_.erase(next);
  }
  free_[start] = size;
}

}  // namespace strata::engine

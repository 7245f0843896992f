// The gradient accumulators in device memory, read by CPU-Adam through leases
// (device_sums.h).
#include "strata/engine/step/device_sums.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "strata/core/logging.h"
#include "strata/engine/timeline/elapsed.h"

namespace strata::engine {

using offload::Access;
using offload::StateId;
using offload::StateLease;
using offload::StateRange;

Result<std::unique_ptr<DeviceSumsStore>> DeviceSumsStore::Create(size_t numel,
                                                                 const DeviceSumsOptions& options) {
  if (options.device == nullptr || options.device_tier == nullptr || !options.host_buffers) {
    return InvalidArgumentError("DeviceSumsStore: null device, device tier or host allocator");
  }
  if (options.tile_elems == 0) return InvalidArgumentError("DeviceSumsStore: tile_elems 0");
  std::unique_ptr<DeviceSumsStore> s(new DeviceSumsStore(options));
  s->numel_ = numel;
  if (numel > 0) {
    STRATA_ASSIGN_OR_RETURN(
        s->sums_, options.device_tier->Allocate(
                      numel * sizeof(float),
                      "device gradient accumulators (" + std::to_string(numel) + " elements)"));
    STRATA_RETURN_IF_ERROR(
        options.device->ZeroAsync(s->sums_.data(), numel * sizeof(float), options.stream));
    s->stats_.device_bytes = s->sums_.size();
  }
  return s;
}

DeviceSumsStore::~DeviceSumsStore() {
  // No fetch, write-back or zeroing may still touch the buffers or the sums when they go.
  Result<EventId> done = options_.device->Record(options_.stream);
  Status s = done.ok() ? options_.device->Synchronize(*done, HostWait::kShutdown) : done.status();
  if (!s.ok()) STRATA_LOG(kWarn) << "device gradient sums: waiting for the copies: " << s;
}

Result<StateId> DeviceSumsStore::Register(std::string name, size_t bytes, size_t chunk_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!states_.empty()) {
    return FailedPreconditionError("DeviceSumsStore holds one state; \"" + name +
                                   "\" would be a second");
  }
  if (bytes != numel_ * sizeof(float)) {
    return InvalidArgumentError("DeviceSumsStore: state \"" + name + "\" of " +
                                std::to_string(bytes) + " bytes, the sums hold " +
                                std::to_string(numel_ * sizeof(float)));
  }
  if (chunk_bytes % sizeof(float) != 0) {
    return InvalidArgumentError("DeviceSumsStore: chunks of whole floats only");
  }
  STRATA_ASSIGN_OR_RETURN(StateId id, AddState(std::move(name), bytes, chunk_bytes));
  ++base_.states;
  base_.chunks += info(id).chunks;
  base_.state_bytes += bytes;
  if (bytes > 0) {
    const size_t chunk_elems = std::min(numel_, chunk_bytes / sizeof(float));
    const size_t tiles = (chunk_elems + options_.tile_elems - 1) / options_.tile_elems;
    STRATA_ASSIGN_OR_RETURN(
        tile_sums_, options_.device_tier->Allocate(std::max<size_t>(1, tiles) * sizeof(double),
                                                   "gradient-norm tile sums"));
    STRATA_ASSIGN_OR_RETURN(host_tile_sums_,
                            options_.host_buffers(std::max<size_t>(1, tiles) * sizeof(double),
                                                  "gradient-norm tile sums (host copy)"));
    stats_.device_bytes += tile_sums_.size();
    base_.memory_bytes += host_tile_sums_.size;
  }
  return id;
}

std::byte* DeviceSumsStore::device_chunk(size_t chunk) const {
  return sums_.data() + chunk * states_.front().chunk_bytes;
}

DeviceSumsStore::Buffer* DeviceSumsStore::BufferOf(size_t chunk) {
  for (const std::unique_ptr<Buffer>& b : buffers_) {
    if (b->chunk == static_cast<long>(chunk)) return b.get();
  }
  return nullptr;
}

Result<DeviceSumsStore::Buffer*> DeviceSumsStore::FreeBuffer() {
  for (const std::unique_ptr<Buffer>& b : buffers_) {
    if (b->chunk < 0) return b.get();
  }
  const size_t bytes = std::max<size_t>(1, states_.front().chunk_bytes);
  auto b = std::make_unique<Buffer>();
  STRATA_ASSIGN_OR_RETURN(b->mem,
                          options_.host_buffers(bytes, "host buffer of the device gradient sums"));
  ++stats_.buffers;
  stats_.buffer_bytes += b->mem.size;
  base_.memory_bytes += b->mem.size;
  buffers_.push_back(std::move(b));
  return buffers_.back().get();
}

Status DeviceSumsStore::Fetch(Buffer& b, StateRange range) {
  const size_t bytes = chunk_bytes(range);
  b.chunk = static_cast<long>(range.chunk);
  STRATA_RETURN_IF_ERROR(options_.device->CopyAsync(b.mem.data, device_chunk(range.chunk), bytes,
                                                    CopyKind::kDeviceToHost, options_.stream));
  STRATA_ASSIGN_OR_RETURN(b.copied, options_.device->Record(options_.stream));
  ++stats_.fetches;
  stats_.fetch_bytes += bytes;
  return Status::Ok();
}

Status DeviceSumsStore::WaitFetch(Buffer& b) {
  if (!b.copied.valid()) return Status::Ok();
  if (options_.skip_fetch_wait) {
    b.copied = EventId{};
    return Status::Ok();
  }
  AddElapsed waited(stats_.fetch_wait_s);
  STRATA_RETURN_IF_ERROR(options_.device->Synchronize(b.copied, HostWait::kGradientFetch));
  b.copied = EventId{};
  return Status::Ok();
}

Result<StateLease> DeviceSumsStore::Acquire(StateRange range, Access access) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckRange(range));
  Buffer* b = BufferOf(range.chunk);
  if (b != nullptr && b->held) {
    return FailedPreconditionError("state " + info(range.state).name + ": chunk " +
                                   std::to_string(range.chunk) + " is already held");
  }
  if (b != nullptr) {
    ++base_.prefetch_hits;
    ++stats_.fetches_ahead;
  } else {
    STRATA_ASSIGN_OR_RETURN(b, FreeBuffer());
    if (access == Access::kWrite) {
      b->chunk = static_cast<long>(range.chunk);  // every byte is written: nothing to read
    } else {
      STRATA_RETURN_IF_ERROR(Fetch(*b, range));
    }
  }
  Status waited = WaitFetch(*b);
  if (!waited.ok()) {
    b->chunk = -1;
    return waited.WithContext("copying the gradient sums of sub-group " +
                              std::to_string(range.chunk) + " to the host");
  }
  b->held = true;
  b->access = access;
  ++base_.acquires;
  return MakeLease(this, range, access, b->mem.data, chunk_bytes(range));
}

Status DeviceSumsStore::Release(StateRange range, Access access) {
  std::lock_guard<std::mutex> lock(mu_);
  Buffer* b = BufferOf(range.chunk);
  if (b == nullptr || !b->held)
    return InternalError("device gradient sums: release of a free chunk");
  b->held = false;
  Status st;
  if (access != Access::kRead) {
    // Written on the host: back to the device before the buffer is reused.
    const size_t bytes = chunk_bytes(range);
    st = options_.device->CopyAsync(device_chunk(range.chunk), b->mem.data, bytes,
                                    CopyKind::kHostToDevice, options_.stream);
    Result<EventId> copied = st.ok() ? options_.device->Record(options_.stream) : st;
    if (copied.ok()) {
      AddElapsed waited(stats_.fetch_wait_s);
      st = options_.device->Synchronize(*copied, HostWait::kGradientFetch);
    } else {
      st = copied.status();
    }
    ++stats_.write_backs;
  }
  b->chunk = -1;
  return st;
}

Status DeviceSumsStore::Prefetch(StateRange range) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckRange(range));
  if (BufferOf(range.chunk) != nullptr) return Status::Ok();  // held or already coming
  STRATA_ASSIGN_OR_RETURN(Buffer * b, FreeBuffer());
  ++base_.prefetches;
  return Fetch(*b, range);
}

Status DeviceSumsStore::ZeroChunk(StateRange range) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckRange(range));
  if (Buffer* b = BufferOf(range.chunk); b != nullptr) {
    if (b->held && b->access != Access::kRead) {
      return FailedPreconditionError("state " + info(range.state).name + ": Zero while chunk " +
                                     std::to_string(range.chunk) + " is held for writing");
    }
    if (!b->held) b->chunk = -1;  // a read ahead of sums now spent
  }
  ++stats_.zeroed_chunks;
  return options_.device->ZeroAsync(device_chunk(range.chunk), chunk_bytes(range), options_.stream);
}

Status DeviceSumsStore::NormTiles(StateRange range, std::span<double> tile_sums) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckRange(range));
  const size_t n = chunk_bytes(range) / sizeof(float);
  const size_t tiles = (n + options_.tile_elems - 1) / options_.tile_elems;
  if (tile_sums.size() != tiles) {
    return InvalidArgumentError("device gradient sums: " + std::to_string(tile_sums.size()) +
                                " tile sums for a chunk of " + std::to_string(tiles) + " tiles");
  }
  if (Buffer* b = BufferOf(range.chunk); b != nullptr && b->held) {
    return FailedPreconditionError("device gradient sums: the norm of chunk " +
                                   std::to_string(range.chunk) + " while it is leased");
  }
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(options_.device->SquaredNormTilesAsync(
      reinterpret_cast<const float*>(device_chunk(range.chunk)), n, options_.tile_elems,
      reinterpret_cast<double*>(tile_sums_.data()), options_.stream));
  STRATA_RETURN_IF_ERROR(options_.device->CopyAsync(host_tile_sums_.data, tile_sums_.data(),
                                                    tiles * sizeof(double), CopyKind::kDeviceToHost,
                                                    options_.stream));
  STRATA_ASSIGN_OR_RETURN(EventId copied, options_.device->Record(options_.stream));
  {
    AddElapsed waited(stats_.fetch_wait_s);
    STRATA_RETURN_IF_ERROR(options_.device->Synchronize(copied, HostWait::kGradientFetch));
  }
  std::memcpy(tile_sums.data(), host_tile_sums_.data, tiles * sizeof(double));
  ++stats_.norm_passes;
  return Status::Ok();
}

void DeviceSumsStore::ForgetReadAhead() {
  for (const std::unique_ptr<Buffer>& b : buffers_) {
    if (!b->held) b->chunk = -1;
  }
}

Status DeviceSumsStore::Flush() {
  return Status::Ok();
}

Status DeviceSumsStore::Commit() {
  std::lock_guard<std::mutex> lock(mu_);
  ForgetReadAhead();
  ++base_.commits;
  return Status::Ok();
}

Status DeviceSumsStore::Rollback() {
  std::lock_guard<std::mutex> lock(mu_);
  ForgetReadAhead();
  ++base_.rollbacks;
  if (numel_ == 0) return Status::Ok();
  return options_.device->ZeroAsync(sums_.data(), numel_ * sizeof(float), options_.stream);
}

Status DeviceSumsStore::SetWriteHook(StateId state, WriteHook /*hook*/) {
  return CheckState(state);  // never writes to swap: never called
}

offload::StateStoreStats DeviceSumsStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return base_;
}

DeviceSumsStats DeviceSumsStore::sums_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace strata::engine

// The CUDA device (device.h) over core/cuda. It has no logic the CPU device lacks: the
// arena is the shared Arena (arena.h) over one cudaMalloc of the budget, and every other
// method is one core/cuda call plus its error mapping. Built only when CUDA is found.
//
// Events: each stream keeps a ring of kRing CUDA events; event (stream, seq) lives in slot
// seq % kRing until a later Record of that stream reuses the slot. A reused slot holds a
// later point of the same stream, so waiting for it (or querying it) waits for at least
// as much: never too little.
//
// Streams: record 0 is the compute stream of creation, the others CreateStream's or
// borrowed compute streams (SetComputeStream adds a record for a native stream it has not
// seen). StreamId 0 names the current compute record; a change of compute stream makes the
// new one wait on the device for the old one, so stream 0 stays one sequence.
//
// KeepAlive: an event on the stream and the owner go into a list; each later KeepAlive or
// Synchronize drops the owners whose events completed (on the calling thread, never in a
// CUDA callback), the destructor waits for the rest.
#include <algorithm>
#include <cstddef>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/cuda/cuda.h"
#include "strata/core/logging.h"
#include "strata/engine/device/arena.h"
#include "strata/engine/device/device.h"

namespace strata::engine {
namespace {

constexpr int kStreamShift = 48;
constexpr uint64_t kSeqMask = (uint64_t{1} << kStreamShift) - 1;
constexpr size_t kRing = 64;

// HBM: the arena is one allocation of the budget; zeroing runs on its own stream and the
// host waits for that stream's event (not a device-wide synchronize).
class CudaBackend final : public ArenaBackend {
 public:
  CudaBackend(int device, cuda::Stream zero_stream, cuda::Event zeroed)
      : device_(device), zero_stream_(std::move(zero_stream)), zeroed_(std::move(zeroed)) {}
  Result<void*> Reserve(size_t bytes) override {
    STRATA_ASSIGN_OR_RETURN(buffer_, cuda::DeviceBuffer::Allocate(device_, bytes));
    return buffer_.data();
  }
  void Release(void* /*ptr*/, size_t /*bytes*/) override { buffer_ = cuda::DeviceBuffer(); }
  Status Zero(void* ptr, size_t bytes) override {
    STRATA_RETURN_IF_ERROR(cuda::MemsetAsync(ptr, 0, bytes, zero_stream_));
    STRATA_RETURN_IF_ERROR(zeroed_.Record(zero_stream_));
    return zeroed_.Synchronize();
  }
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  bool host_addressable() const override { return false; }
  comm::Device comm_device() const override { return comm::Device::Cuda(device_); }

 private:
  const int device_;
  cuda::Stream zero_stream_;
  cuda::Event zeroed_;
  cuda::DeviceBuffer buffer_;
};

cuda::ElementType Element(DType t) {
  switch (t) {
    case DType::kFloat32:
      return cuda::ElementType::kFloat32;
    case DType::kBFloat16:
      return cuda::ElementType::kBFloat16;
    case DType::kFloat16:
      return cuda::ElementType::kFloat16;
  }
  return cuda::ElementType::kFloat32;
}

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> Create(const CudaDeviceOptions& o) {
    STRATA_ASSIGN_OR_RETURN(cuda::DeviceInfo info, cuda::GetDeviceInfo(o.device));
    // Kernels launch on the calling thread's current device: the engine's thread uses
    // this one from here on.
    STRATA_RETURN_IF_ERROR(cuda::SetDevice(o.device));
    uint64_t budget = o.budget_bytes;
    if (budget == 0) {
      // No budget named: half the free HBM, reserved now; the other half is LibTorch's
      // (activations, its caching allocator).
      STRATA_ASSIGN_OR_RETURN(cuda::MemInfo mem, cuda::GetMemInfo(o.device));
      budget = mem.free / 2 / Arena::kAlign * Arena::kAlign;
    }
    STRATA_ASSIGN_OR_RETURN(cuda::Stream zero_stream, cuda::Stream::Create(o.device));
    STRATA_ASSIGN_OR_RETURN(cuda::Event zeroed, cuda::Event::Create());
    STRATA_ASSIGN_OR_RETURN(
        std::shared_ptr<Arena> arena,
        Arena::Create(budget, std::make_unique<CudaBackend>(o.device, std::move(zero_stream),
                                                            std::move(zeroed))));
    auto d = std::unique_ptr<CudaDevice>(
        new CudaDevice(o.device, info.name, info.pci_bus_id, std::move(arena)));
    // Stream 0, the compute stream: borrowed (LibTorch's current stream, or the default).
    d->creation_stream_ = static_cast<CUstream_st*>(o.compute_stream);
    STRATA_RETURN_IF_ERROR(d->AddStream(cuda::Stream::Borrow(d->creation_stream_)));
    d->arena_->SetSync(
        [dev = d.get()](EventId e) { return dev->Synchronize(e, HostWait::kArenaReuse); });
    d->arena_->SetStreamWait([dev = d.get()](StreamId s, EventId e) { return dev->Wait(s, e); });
    return std::unique_ptr<Device>(std::move(d));
  }

  ~CudaDevice() override {
    (void)arena_->Drain();
    arena_->SetSync(nullptr);
    arena_->SetStreamWait(nullptr);
    std::vector<Kept> kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept.swap(kept_);
    }
    for (Kept& k : kept) {
      if (Status s = Synchronize(k.after, HostWait::kShutdown); !s.ok()) {
        STRATA_LOG(kWarn) << name() << ": waiting for work that reads kept memory: " << s;
      }
    }
  }

  std::string name() const override {
    return "cuda:" + std::to_string(device_) + " (" + device_name_ + ")";
  }
  std::string pci_bus_id() const override { return pci_bus_id_; }
  std::shared_ptr<DeviceAllocator> allocator() override { return arena_; }
  void FreeAfter(void* ptr, size_t bytes, EventId after) override {
    arena_->FreeAfter(ptr, bytes, after);
  }

  Result<StreamId> CreateStream(const std::string& /*name*/) override {
    STRATA_ASSIGN_OR_RETURN(cuda::Stream s, cuda::Stream::Create(device_));
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_RETURN_IF_ERROR(AddStreamLocked(std::move(s)));
    return StreamId{static_cast<int>(streams_.size()) - 1};
  }

  Result<EventId> Record(StreamId stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    return RecordLocked(index);
  }

  Status Wait(StreamId stream, EventId event) override {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(Stream * s, StreamLocked(stream));
    STRATA_ASSIGN_OR_RETURN(cuda::Event * e, EventLocked(event));
    ++stats_.stream_waits;
    return cuda::StreamWaitEvent(s->stream, *e);
  }

  Status Synchronize(EventId event, HostWait why) override {
    cuda::Event* e = nullptr;
    std::vector<Kept> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      STRATA_ASSIGN_OR_RETURN(e, EventLocked(event));
      STRATA_ASSIGN_OR_RETURN(const bool ready, e->Query());
      if (!ready) {
        ++stats_.host_synchronizes;
        ++stats_.host_waits[static_cast<size_t>(why)];
      }
      STRATA_RETURN_IF_ERROR(TakeDoneLocked(done));
    }
    done.clear();  // the owners go outside the lock
    return e->Synchronize();
  }

  Status KeepAlive(StreamId stream, std::shared_ptr<const void> owner) override {
    std::vector<Kept> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
      STRATA_ASSIGN_OR_RETURN(const EventId after, RecordLocked(index));
      ++stats_.keep_alives;
      kept_.push_back(Kept{after, std::move(owner)});
      STRATA_RETURN_IF_ERROR(TakeDoneLocked(done));
    }
    return Status::Ok();
  }

  bool torch_on_compute_stream() const override { return true; }

  Result<void*> NativeStream(StreamId stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    return static_cast<void*>(streams_[index]->stream.get());
  }

  Status SetComputeStream(void* native) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto* want = static_cast<CUstream_st*>(native == nullptr ? creation_stream_ : native);
    if (streams_[compute_]->stream.get() == want) return Status::Ok();
    size_t next = streams_.size();
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i]->stream.get() == want) next = i;
    }
    if (next == streams_.size()) {
      STRATA_RETURN_IF_ERROR(AddStreamLocked(cuda::Stream::Borrow(want)));
    }
    // The new compute stream goes on after the old one's work, on the device.
    STRATA_ASSIGN_OR_RETURN(const EventId last, RecordLocked(compute_));
    STRATA_ASSIGN_OR_RETURN(cuda::Event * e, EventLocked(last));
    STRATA_RETURN_IF_ERROR(cuda::StreamWaitEvent(streams_[next]->stream, *e));
    ++stats_.stream_waits;
    compute_ = next;
    return Status::Ok();
  }

  Result<StreamId> AdoptStream(void* native) override {
    if (native == nullptr) return InvalidArgumentError("cuda device: AdoptStream of a null stream");
    std::lock_guard<std::mutex> lock(mu_);
    auto* want = static_cast<CUstream_st*>(native);
    if (want == creation_stream_) {
      return InvalidArgumentError(
          "cuda device: AdoptStream of the compute stream of creation (it is kComputeStream)");
    }
    for (size_t i = 1; i < streams_.size(); ++i) {
      if (streams_[i]->stream.get() == want) return StreamId{static_cast<int>(i)};
    }
    STRATA_RETURN_IF_ERROR(AddStreamLocked(cuda::Stream::Borrow(want)));
    return StreamId{static_cast<int>(streams_.size()) - 1};
  }

  Status LaunchHostFunc(StreamId stream, std::function<void()> fn) override {
    if (!fn) return InvalidArgumentError("cuda device: LaunchHostFunc of an empty function");
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(Stream * s, StreamLocked(stream));
    return cuda::LaunchHostFunc(s->stream, std::move(fn));
  }

  Status BindThread() override { return cuda::SetDevice(device_); }

  Result<bool> Query(EventId event) override {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(cuda::Event * e, EventLocked(event));
    return e->Query();
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamId stream) override {
    if (bytes == 0) return Status::Ok();
    if (kind != CopyKind::kDeviceToDevice) {
      const void* host = kind == CopyKind::kHostToDevice ? src : dst;
      STRATA_ASSIGN_OR_RETURN(bool pinned, cuda::IsPinnedHost(host));
      if (!pinned) {
        return InvalidArgumentError(
            "cuda device: copy of " + std::to_string(bytes) + " bytes " +
            (kind == CopyKind::kHostToDevice ? "from" : "into") +
            " host memory that is not pinned (register it, or take it from the host tier's "
            "pinned pool)");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(Stream * s, StreamLocked(stream));
    ++stats_.copies;
    stats_.copy_bytes += bytes;
    switch (kind) {
      case CopyKind::kHostToDevice:
        return cuda::CopyHostToDevice(dst, src, bytes, s->stream);
      case CopyKind::kDeviceToHost:
        return cuda::CopyDeviceToHost(dst, src, bytes, s->stream);
      case CopyKind::kDeviceToDevice:
        return cuda::CopyDeviceToDevice(dst, src, bytes, s->stream);
    }
    return InvalidArgumentError("cuda device: unknown copy kind");
  }

  Status ZeroAsync(void* ptr, size_t bytes, StreamId stream) override {
    if (bytes == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(Stream * s, StreamLocked(stream));
    ++stats_.kernels;
    return cuda::MemsetAsync(ptr, 0, bytes, s->stream);
  }

  Status ConvertAsync(void* dst, DType dst_type, const void* src, DType src_type, size_t n,
                      bool accumulate, StreamId stream) override {
    if (n == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(Stream * s, StreamLocked(stream));
    ++stats_.kernels;
    return cuda::ConvertAsync(dst, Element(dst_type), src, Element(src_type), n, accumulate,
                              s->stream);
  }

  Status SquaredNormTilesAsync(const float* src, size_t n, size_t tile_elems, double* tile_sums,
                               StreamId stream) override {
    if (n == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(Stream * s, StreamLocked(stream));
    ++stats_.kernels;
    return cuda::SquaredNormTilesAsync(src, n, tile_elems, tile_sums, s->stream);
  }

  // Memory the process has already page-locked with the runtime (the host pool pins its
  // arenas with cudaHostRegister; cudaHostAlloc'd memory) is used as it is: registering a
  // block inside it again fails (cudaErrorHostMemoryAlreadyRegistered, seen on an H200 for
  // the working shards carved from the host tier), and unregistering it would unpin the
  // owner's whole range. Only what this device registered itself is unregistered by it.
  Status RegisterHost(void* ptr, size_t bytes) override {
    if (ptr == nullptr || bytes == 0) {
      return InvalidArgumentError("cuda device: RegisterHost of a null or empty range");
    }
    STRATA_ASSIGN_OR_RETURN(const bool first, cuda::IsPinnedHost(ptr));
    STRATA_ASSIGN_OR_RETURN(const bool last,
                            cuda::IsPinnedHost(static_cast<const std::byte*>(ptr) + bytes - 1));
    std::lock_guard<std::mutex> lock(mu_);
    if (first && last) {
      borrowed_.push_back(ptr);
      return Status::Ok();
    }
    if (first || last) {
      return FailedPreconditionError(
          "cuda device: RegisterHost of " + std::to_string(bytes) +
          " bytes that are only partly page-locked already (another registration covers one "
          "end): allocate the block whole inside pinned memory or wholly outside it");
    }
    return cuda::RegisterHost(ptr, bytes);
  }
  Status UnregisterHost(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = std::find(borrowed_.begin(), borrowed_.end(), ptr); it != borrowed_.end()) {
      borrowed_.erase(it);
      return Status::Ok();
    }
    return cuda::UnregisterHost(ptr);
  }

  DeviceStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceStats s = stats_;
    s.arena_bytes = arena_->reserved();
    s.largest_free_block = arena_->LargestFree();
    return s;
  }

 private:
  struct Kept {
    EventId after;
    std::shared_ptr<const void> owner;
  };
  struct Stream {
    cuda::Stream stream;
    std::vector<cuda::Event> ring;  // kRing events
    std::vector<uint64_t> ring_seq;
    uint64_t recorded = 0;
  };

  CudaDevice(int device, std::string name, std::string pci_bus_id, std::shared_ptr<Arena> arena)
      : device_(device),
        device_name_(std::move(name)),
        pci_bus_id_(std::move(pci_bus_id)),
        arena_(std::move(arena)) {}

  Status AddStream(cuda::Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    return AddStreamLocked(std::move(s));
  }
  Status AddStreamLocked(cuda::Stream s) {
    auto rec = std::make_unique<Stream>();
    rec->stream = std::move(s);
    for (size_t i = 0; i < kRing; ++i) {
      STRATA_ASSIGN_OR_RETURN(cuda::Event e, cuda::Event::Create());
      rec->ring.push_back(std::move(e));
    }
    rec->ring_seq.assign(kRing, 0);
    streams_.push_back(std::move(rec));
    return Status::Ok();
  }

  // The record a StreamId names (0: the current compute stream).
  Result<size_t> IndexLocked(StreamId id) const {
    if (id.value == 0) return compute_;
    if (id.value < 0 || static_cast<size_t>(id.value) >= streams_.size()) {
      return InvalidArgumentError("cuda device: no stream " + std::to_string(id.value));
    }
    return static_cast<size_t>(id.value);
  }
  Result<Stream*> StreamLocked(StreamId id) {
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(id));
    return streams_[index].get();
  }

  Result<EventId> RecordLocked(size_t index) {
    Stream* s = streams_[index].get();
    const uint64_t seq = ++s->recorded;
    const size_t slot = seq % kRing;
    STRATA_RETURN_IF_ERROR(s->ring[slot].Record(s->stream));
    s->ring_seq[slot] = seq;
    ++stats_.events_recorded;
    return EventId{(static_cast<uint64_t>(index + 1) << kStreamShift) | seq};
  }

  // Moves the kept owners whose events completed into `done` (dropped by the caller
  // outside the lock).
  Status TakeDoneLocked(std::vector<Kept>& done) {
    size_t kept = 0;
    for (size_t i = 0; i < kept_.size(); ++i) {
      STRATA_ASSIGN_OR_RETURN(cuda::Event * e, EventLocked(kept_[i].after));
      STRATA_ASSIGN_OR_RETURN(const bool ready, e->Query());
      if (ready) {
        done.push_back(std::move(kept_[i]));
      } else {
        kept_[kept++] = std::move(kept_[i]);
      }
    }
    kept_.resize(kept);
    return Status::Ok();
  }

  Result<cuda::Event*> EventLocked(EventId e) {
    const uint64_t prefix = e.value >> kStreamShift;
    const uint64_t seq = e.value & kSeqMask;
    if (!e.valid() || prefix == 0 || prefix > streams_.size() || seq == 0 ||
        seq > streams_[prefix - 1]->recorded) {
      return InvalidArgumentError("cuda device: event " + std::to_string(e.value) +
                                  " was not recorded on this device");
    }
    return &streams_[prefix - 1]->ring[seq % kRing];
  }

  const int device_;
  const std::string device_name_;
  const std::string pci_bus_id_;
  std::shared_ptr<Arena> arena_;
  mutable std::mutex mu_;
  std::vector<void*> borrowed_;  // RegisterHost ranges the process had pinned already
  std::vector<std::unique_ptr<Stream>> streams_;  // guarded by mu_; 0 = compute at creation
  size_t compute_ = 0;                            // guarded by mu_: the record stream 0 names
  CUstream_st* creation_stream_ = nullptr;        // stream 0 at creation (SetComputeStream(null))
  std::vector<Kept> kept_;                        // guarded by mu_
  DeviceStats stats_;                             // guarded by mu_
};

}  // namespace

Result<std::unique_ptr<Device>> MakeCudaDevice(const CudaDeviceOptions& options) {
  return CudaDevice::Create(options);
}

}  // namespace strata::engine

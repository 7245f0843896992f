// The CPU device (device.h): an arena reserved once, streams run by worker threads (the
// compute stream's queued work too), events that complete when their stream reaches them,
// and a delaying mode.
//
// Streams: record 0 is the compute stream of creation, record i the i-th CreateStream;
// StreamId 0 names the current compute record (SetComputeStream), StreamId i record i. An
// event is (record + 1) << 48 | the record's sequence number.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/engine/device/arena.h"
#include "strata/engine/device/device.h"

namespace strata::engine {
namespace {

constexpr int kStreamShift = 48;
constexpr uint64_t kSeqMask = (uint64_t{1} << kStreamShift) - 1;

// The CPU's memory: the arena is an anonymous mapping; without a budget each block is an
// aligned allocation.
class CpuBackend final : public ArenaBackend {
 public:
  explicit CpuBackend(uint64_t budget) : arena_(budget > 0) {}
  Result<void*> Reserve(size_t bytes) override {
    if (arena_) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return ErrnoError(errno, "mmap of " + FormatBytes(bytes));
      return p;
    }
    void* p = std::aligned_alloc(Arena::kAlign, bytes);
    if (p == nullptr)
      return ResourceExhaustedError("cpu device: out of memory for " + FormatBytes(bytes));
    return p;
  }
  void Release(void* ptr, size_t bytes) override {
    if (arena_) {
      munmap(ptr, bytes);
    } else {
      std::free(ptr);
    }
  }
  Status Zero(void* ptr, size_t bytes) override {
    std::memset(ptr, 0, bytes);
    return Status::Ok();
  }
  std::string name() const override { return "cpu"; }
  bool host_addressable() const override { return true; }
  comm::Device comm_device() const override { return comm::Device::Cpu(); }

 private:
  const bool arena_;
};

// ---------------------------------------------------------------------------
// The device.
class CpuDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> Create(const CpuDeviceOptions& o) {
    STRATA_ASSIGN_OR_RETURN(
        std::shared_ptr<Arena> arena,
        Arena::Create(o.budget_bytes, std::make_unique<CpuBackend>(o.budget_bytes)));
    auto d = std::unique_ptr<CpuDevice>(new CpuDevice(o, std::move(arena)));
    {
      std::lock_guard<std::mutex> lock(d->mu_);
      d->AddStreamLocked("compute");
    }
    d->arena_->SetSync(
        [dev = d.get()](EventId e) { return dev->Synchronize(e, HostWait::kArenaReuse); });
    d->arena_->SetStreamWait([dev = d.get()](StreamId s, EventId e) { return dev->Wait(s, e); });
    if (o.delaying) {
      STRATA_LOG(kInfo) << "cpu device: delaying mode, seed " << o.seed << ", delays up to "
                        << o.max_delay_us << " us";
    }
    return std::unique_ptr<Device>(std::move(d));
  }

  ~CpuDevice() override {
    (void)arena_->Drain();
    arena_->SetSync(nullptr);
    arena_->SetStreamWait(nullptr);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& s : streams_) {
      if (s->thread.joinable()) s->thread.join();
    }
  }

  std::string name() const override {
    std::string n = "cpu";
    if (options_.delaying) n += " (delaying, seed " + std::to_string(options_.seed) + ")";
    return n;
  }

  std::shared_ptr<DeviceAllocator> allocator() override { return arena_; }

  void FreeAfter(void* ptr, size_t bytes, EventId after) override {
    arena_->FreeAfter(ptr, bytes, after);
  }

  Result<StreamId> CreateStream(const std::string& stream_name) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (streams_.size() >= 1000) return ResourceExhaustedError("cpu device: too many streams");
    return StreamId{AddStreamLocked(stream_name)};
  }

  Result<EventId> Record(StreamId stream) override {
    stats_.events.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    return RecordLocked(index);
  }

  Status Wait(StreamId stream, EventId event) override {
    STRATA_RETURN_IF_ERROR(CheckEvent(event));
    stats_.waits.fetch_add(1, std::memory_order_relaxed);
    std::unique_lock<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    streams_[index]->ops.push_back(Op{Op::kWait, event, 0, {}});
    cv_.notify_all();
    if (!(stream == kComputeStream)) return Status::Ok();
    // LibTorch computes on the calling thread: what it runs next must see the event's work
    // too, so the thread waits as well (on a GPU LibTorch's kernels queue behind the wait).
    cv_.wait(lock, [&] { return DoneLocked(event) || stopping_; });
    return DoneLocked(event) ? Status::Ok()
                             : CancelledError("cpu device: destroyed while an event was awaited");
  }

  Status Synchronize(EventId event, HostWait why) override {
    STRATA_RETURN_IF_ERROR(CheckEvent(event));
    std::unique_lock<std::mutex> lock(mu_);
    if (DoneLocked(event)) return Status::Ok();
    stats_.syncs.fetch_add(1, std::memory_order_relaxed);
    stats_.by_why[static_cast<size_t>(why)].fetch_add(1, std::memory_order_relaxed);
    cv_.wait(lock, [&] { return DoneLocked(event) || stopping_; });
    return DoneLocked(event) ? Status::Ok()
                             : CancelledError("cpu device: destroyed while an event was awaited");
  }

  Status KeepAlive(StreamId stream, std::shared_ptr<const void> owner) override {
    stats_.keep_alives.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    // The worker drops the op (and with it the owner) once it has passed it.
    streams_[index]->ops.push_back(Op{Op::kWork, EventId{}, 0, [held = std::move(owner)] {}});
    cv_.notify_all();
    return Status::Ok();
  }

  bool torch_on_compute_stream() const override { return false; }

  Result<void*> NativeStream(StreamId stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    return static_cast<void*>(streams_[index].get());
  }

  Status SetComputeStream(void* native) override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t next = 0;
    if (native != nullptr) {
      auto it = std::find_if(streams_.begin(), streams_.end(),
                             [&](const auto& s) { return s.get() == native; });
      if (it == streams_.end()) {
        return InvalidArgumentError(
            "cpu device: SetComputeStream of a stream that is not this device's (take it "
            "from NativeStream)");
      }
      next = static_cast<size_t>(it - streams_.begin());
    }
    if (next == compute_) return Status::Ok();
    // The new compute stream goes on after the old one's work (one sequence).
    const EventId last = RecordLocked(compute_);
    if (!options_.test_skip_compute_switch_wait) {
      streams_[next]->ops.push_back(Op{Op::kWait, last, 0, {}});
    }
    compute_ = next;
    cv_.notify_all();
    return Status::Ok();
  }

  Result<StreamId> AdoptStream(void* native) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 1; i < streams_.size(); ++i) {
      if (streams_[i].get() == native) return StreamId{static_cast<int>(i)};
    }
    if (native == streams_[0].get()) {
      return InvalidArgumentError(
          "cpu device: AdoptStream of the compute stream of creation (it is kComputeStream)");
    }
    return InvalidArgumentError(
        "cpu device: AdoptStream of a stream that is not this device's (take it from "
        "NativeStream)");
  }

  Status LaunchHostFunc(StreamId stream, std::function<void()> fn) override {
    if (!fn) return InvalidArgumentError("cpu device: LaunchHostFunc of an empty function");
    return Queue(stream, std::move(fn));
  }

  Status BindThread() override { return Status::Ok(); }

  Result<bool> Query(EventId event) override {
    STRATA_RETURN_IF_ERROR(CheckEvent(event));
    std::lock_guard<std::mutex> lock(mu_);
    return DoneLocked(event);
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamId stream) override {
    if (bytes == 0) return Status::Ok();
    if (dst == nullptr || src == nullptr) {
      return InvalidArgumentError("cpu device: copy of " + std::to_string(bytes) +
                                  " bytes with a null pointer");
    }
    {
      std::lock_guard<std::mutex> lock(pinned_mu_);
      if (kind == CopyKind::kHostToDevice && !PinnedLocked(src, bytes)) {
        return InvalidArgumentError(
            "cpu device: host-to-device copy of " + std::to_string(bytes) +
            " bytes from host memory that is not pinned (register it, or take it from the "
            "host tier's pinned pool)");
      }
      if (kind == CopyKind::kDeviceToHost && !PinnedLocked(dst, bytes)) {
        return InvalidArgumentError(
            "cpu device: device-to-host copy of " + std::to_string(bytes) +
            " bytes into host memory that is not pinned (register it, or take it from the "
            "host tier's pinned pool)");
      }
    }
    stats_.copies.fetch_add(1, std::memory_order_relaxed);
    stats_.copy_bytes.fetch_add(bytes, std::memory_order_relaxed);
    return Queue(stream, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
  }

  Status ZeroAsync(void* ptr, size_t bytes, StreamId stream) override {
    if (bytes == 0) return Status::Ok();
    if (ptr == nullptr) return InvalidArgumentError("cpu device: ZeroAsync of a null pointer");
    stats_.kernels.fetch_add(1, std::memory_order_relaxed);
    return Queue(stream, [ptr, bytes] { std::memset(ptr, 0, bytes); });
  }

  Status ConvertAsync(void* dst, DType dst_type, const void* src, DType src_type, size_t n,
                      bool accumulate, StreamId stream) override {
    if (n == 0) return Status::Ok();
    if (dst == nullptr || src == nullptr) {
      return InvalidArgumentError("cpu device: ConvertAsync of " + std::to_string(n) +
                                  " elements with a null pointer");
    }
    stats_.kernels.fetch_add(1, std::memory_order_relaxed);
    return Queue(stream, [=] {
      if (accumulate) {
        AddInto(src, src_type, dst, dst_type, n);
      } else {
        Convert(src, src_type, dst, dst_type, n);
      }
    });
  }

  Status SquaredNormTilesAsync(const float* src, size_t n, size_t tile_elems, double* tile_sums,
                               StreamId stream) override {
    if (n == 0) return Status::Ok();
    if (src == nullptr || tile_sums == nullptr || tile_elems == 0) {
      return InvalidArgumentError("cpu device: SquaredNormTilesAsync of " + std::to_string(n) +
                                  " elements with a null pointer or an empty tile");
    }
    stats_.kernels.fetch_add(1, std::memory_order_relaxed);
    return Queue(stream, [=] {
      // CpuAdam's order (cuda::SquaredNormTilesAsync): lane i % 16 of each tile, then the
      // lanes in order. x * x is exact in double, so a contraction into an fma changes
      // nothing.
      for (size_t b = 0, k = 0; b < n; b += tile_elems, ++k) {
        const size_t e = std::min(n, b + tile_elems);
        double lanes[16] = {};
        for (size_t i = b; i < e; ++i) {
          const double x = src[i];
          lanes[(i - b) % 16] += x * x;
        }
        double sum = 0.0;
        for (double lane : lanes)
          sum += lane;
        tile_sums[k] = sum;
      }
    });
  }

  Status RegisterHost(void* ptr, size_t bytes) override {
    if (ptr == nullptr || bytes == 0) {
      return InvalidArgumentError("cpu device: RegisterHost of a null or empty range");
    }
    std::lock_guard<std::mutex> lock(pinned_mu_);
    const auto start = reinterpret_cast<uintptr_t>(ptr);
    auto next = pinned_.upper_bound(start);
    if ((next != pinned_.end() && next->first < start + bytes) ||
        (next != pinned_.begin() && std::prev(next)->first + std::prev(next)->second > start)) {
      return AlreadyExistsError(
          "cpu device: RegisterHost of a range that overlaps a registered one");
    }
    pinned_[start] = bytes;
    return Status::Ok();
  }

  Status UnregisterHost(void* ptr) override {
    std::lock_guard<std::mutex> lock(pinned_mu_);
    if (pinned_.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
      return NotFoundError("cpu device: UnregisterHost of memory that was not registered");
    }
    return Status::Ok();
  }

  DeviceStats stats() const override {
    DeviceStats s;
    s.copies = stats_.copies.load();
    s.copy_bytes = stats_.copy_bytes.load();
    s.events_recorded = stats_.events.load();
    s.stream_waits = stats_.waits.load();
    s.host_synchronizes = stats_.syncs.load();
    for (size_t i = 0; i < s.host_waits.size(); ++i)
      s.host_waits[i] = stats_.by_why[i].load();
    s.keep_alives = stats_.keep_alives.load();
    s.kernels = stats_.kernels.load();
    s.arena_bytes = arena_->reserved();
    s.largest_free_block = arena_->LargestFree();
    return s;
  }

 private:
  struct Op {
    enum Kind : uint8_t { kRecord, kWait, kWork } kind;
    EventId event;               // kWait
    uint64_t seq;                // kRecord
    std::function<void()> work;  // kWork: a copy or a kernel
  };

  // Queues `kernel` (a copy or a kernel) on the stream's worker.
  Status Queue(StreamId stream, std::function<void()> kernel) {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_ASSIGN_OR_RETURN(const size_t index, IndexLocked(stream));
    streams_[index]->ops.push_back(Op{Op::kWork, EventId{}, 0, std::move(kernel)});
    cv_.notify_all();
    return Status::Ok();
  }

  int AddStreamLocked(const std::string& stream_name) {
    auto s = std::make_unique<Stream>();
    s->name = stream_name;
    s->rng.seed(options_.seed + streams_.size() + 1);
    const int index = static_cast<int>(streams_.size());
    Stream* raw = s.get();
    streams_.push_back(std::move(s));
    raw->thread = std::thread([this, raw] { Run(*raw); });
    return index;
  }

  EventId RecordLocked(size_t index) {
    Stream& s = *streams_[index];
    const uint64_t seq = ++s.recorded;
    s.ops.push_back(Op{Op::kRecord, EventId{}, seq, {}});
    cv_.notify_all();
    return EventId{(static_cast<uint64_t>(index + 1) << kStreamShift) | seq};
  }
  struct Stream {
    std::string name;
    std::thread thread;
    std::deque<Op> ops;      // guarded by mu_
    uint64_t recorded = 0;   // guarded by mu_
    uint64_t completed = 0;  // guarded by mu_: events up to here are done
    std::mt19937_64 rng;     // the worker's only
  };

  CpuDevice(const CpuDeviceOptions& o, std::shared_ptr<Arena> arena)
      : options_(o), arena_(std::move(arena)) {}

  Status CheckEvent(EventId e) {
    if (!e.valid()) return InvalidArgumentError("cpu device: an invalid (empty) event");
    const uint64_t stream = e.value >> kStreamShift;
    const uint64_t seq = e.value & kSeqMask;
    std::lock_guard<std::mutex> lock(mu_);
    if (stream == 0 || stream > streams_.size() || seq == 0 ||
        seq > streams_[stream - 1]->recorded) {
      return InvalidArgumentError("cpu device: event " + std::to_string(e.value) +
                                  " of no stream of this device");
    }
    return Status::Ok();
  }

  // The record a StreamId names (0: the current compute stream).
  Result<size_t> IndexLocked(StreamId id) const {
    if (id.value == 0) return compute_;
    if (id.value < 0 || static_cast<size_t>(id.value) >= streams_.size()) {
      return InvalidArgumentError("cpu device: no stream " + std::to_string(id.value));
    }
    return static_cast<size_t>(id.value);
  }

  bool DoneLocked(EventId e) const {
    const uint64_t stream = e.value >> kStreamShift;
    return streams_[stream - 1]->completed >= (e.value & kSeqMask);
  }

  bool PinnedLocked(const void* p, size_t bytes) const {
    const auto start = reinterpret_cast<uintptr_t>(p);
    auto it = pinned_.upper_bound(start);
    if (it == pinned_.begin()) return false;
    --it;
    return start >= it->first && start + bytes <= it->first + it->second;
  }

  void Delay(Stream& s) {
    if (!options_.delaying || options_.max_delay_us == 0) return;
    std::uniform_int_distribution<uint32_t> d(0, options_.max_delay_us);
    std::this_thread::sleep_for(std::chrono::microseconds(d(s.rng)));
  }

  void Run(Stream& s) {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !s.ops.empty(); });
        if (s.ops.empty()) return;  // stopping, nothing left
        op = s.ops.front();
        if (op.kind == Op::kWait) {
          cv_.wait(lock, [&] { return DoneLocked(op.event) || stopping_; });
        }
      }
      if (op.kind != Op::kWait) Delay(s);
      if (op.kind == Op::kWork) op.work();
      {
        std::lock_guard<std::mutex> lock(mu_);
        s.ops.pop_front();
        if (op.kind == Op::kRecord) s.completed = op.seq;
      }
      cv_.notify_all();
    }
  }

  const CpuDeviceOptions options_;
  std::shared_ptr<Arena> arena_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Stream>> streams_;  // guarded by mu_ (growth)
  size_t compute_ = 0;                            // guarded by mu_: the record stream 0 names
  bool stopping_ = false;                         // guarded by mu_
  std::mutex pinned_mu_;
  std::map<uintptr_t, size_t> pinned_;  // start -> bytes, guarded by pinned_mu_
  struct {
    std::atomic<uint64_t> copies{0}, copy_bytes{0}, events{0}, waits{0}, syncs{0}, kernels{0},
        keep_alives{0};
    std::array<std::atomic<uint64_t>, kHostWaitKinds> by_why{};
  } stats_;
};

}  // namespace

Result<std::unique_ptr<Device>> MakeCpuDevice(const CpuDeviceOptions& options) {
  return CpuDevice::Create(options);
}

#ifndef STRATA_HAVE_CUDA
Result<std::unique_ptr<Device>> MakeCudaDevice(const CudaDeviceOptions& /*options*/) {
  return UnimplementedError(
      "the CUDA device: this build of Strata has no CUDA (configure with the CUDA toolkit "
      "found, -DSTRATA_CUDA=ON)");
}
#endif

}  // namespace strata::engine

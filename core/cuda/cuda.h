// The torch-free CUDA layer (target strata_cuda, built only when the CUDA toolkit is
// found): device queries, streams, events, device memory and host registration, all
// returning Status. Headers do not include the CUDA headers, so layers above can use
// them without the toolkit's include paths.
//
// Thread-safety: free functions are thread-safe (the CUDA runtime is); a Stream, Event
// or DeviceBuffer object needs external synchronization to be mutated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "strata/core/status.h"

struct CUstream_st;
struct CUevent_st;

namespace strata::cuda {

// Number of usable devices. 0 when there is no driver or no device: `reason` then says
// why (e.g. "CUDA driver version is insufficient", "no CUDA-capable device").
int DeviceCount(std::string* reason = nullptr);

struct DeviceInfo {
  int index = 0;
  std::string name;
  std::string pci_bus_id;  // "0000:3b:00.0", for the topology's NUMA lookup
  uint64_t total_memory = 0;
  int compute_major = 0;
  int compute_minor = 0;
  int multiprocessors = 0;
};
Result<DeviceInfo> GetDeviceInfo(int device);

Status SetDevice(int device);

// A non-blocking stream: owned (Create), or borrowed (Borrow: a stream someone else
// made, such as LibTorch's current stream; null is the default stream), never destroyed.
class Stream {
 public:
  static Result<Stream> Create(int device);
  static Stream Borrow(CUstream_st* stream) {
    Stream s;
    s.s_ = stream;
    s.owned_ = false;
    return s;
  }
  Stream() = default;
  Stream(Stream&& o) noexcept : s_(o.s_), owned_(o.owned_) { o.s_ = nullptr; }
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();
  CUstream_st* get() const { return s_; }
  Status Synchronize() const;

 private:
  CUstream_st* s_ = nullptr;
  bool owned_ = true;
};

// An owned event without timing (cheapest to record).
class Event {
 public:
  static Result<Event> Create(bool timing = false);
  Event() = default;
  Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();
  Status Record(const Stream& stream);
  Status Synchronize() const;
  // True when the work before the recorded point is done.
  Result<bool> Query() const;
  // Milliseconds between two timing events.
  static Result<float> ElapsedMs(const Event& start, const Event& end);
  CUevent_st* get() const { return e_; }

 private:
  CUevent_st* e_ = nullptr;
};

// Owned device memory.
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> Allocate(int device, size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  int device() const { return device_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int device_ = -1;
};

// Asynchronous copies on a stream (host memory should be registered or pinned).
Status CopyHostToDevice(void* dst, const void* src, size_t bytes, const Stream& stream);
Status CopyDeviceToHost(void* dst, const void* src, size_t bytes, const Stream& stream);

Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, const Stream& stream);
Status MemsetAsync(void* ptr, int value, size_t bytes, const Stream& stream);
// Later work on `stream` waits for `event` (cudaStreamWaitEvent: the host does not wait).
Status StreamWaitEvent(const Stream& stream, const Event& event);
// Runs `fn` on a CUDA-owned host thread once the work queued on `stream` before it is done;
// later work on the stream waits for it (cudaLaunchHostFunc). `fn` must not call CUDA.
Status LaunchHostFunc(const Stream& stream, std::function<void()> fn);
// Whether `ptr` is page-locked host memory the driver knows (cudaHostAlloc'd or
// registered): copies from anything else are staged through a pageable bounce buffer.
Result<bool> IsPinnedHost(const void* ptr);
// Free and total memory of the current device (cudaMemGetInfo).
struct MemInfo {
  uint64_t free = 0;
  uint64_t total = 0;
};
Result<MemInfo> GetMemInfo(int device);

// Page-locks existing host memory for the CUDA driver (cudaHostRegister), so copies
// from it run at full PCIe speed. Unregister with UnregisterHost before freeing it.
Status RegisterHost(void* ptr, size_t bytes);
Status UnregisterHost(void* ptr);

// Blocks the host until all work on the device is done (cudaDeviceSynchronize). Counted:
// Strata's engine makes none in a step (tests check SyncCounts).
Status DeviceSynchronize();

// Host waits issued through this layer since the process started. device_wide counts
// DeviceSynchronize and Stream::Synchronize of the default (legacy) stream, which waits
// for every blocking stream too; the others count waits on one stream or one event.
struct SyncCounts {
  uint64_t device_wide = 0;
  uint64_t stream = 0;
  uint64_t event = 0;
};
SyncCounts GetSyncCounts();

// The element types of the conversion kernels (the engine's working dtypes).
enum class ElementType : uint8_t { kFloat32, kBFloat16, kFloat16 };

// On `stream`: dst[i] = src[i] converted to dst's type (round to nearest even), or with
// `accumulate` dst[i] = dst[i] + src[i] computed in fp32 and rounded once (the same
// arithmetic as the engine's host conversions, so results are bit-identical). Both
// pointers are device memory; n may be 0.
Status ConvertAsync(void* dst, ElementType dst_type, const void* src, ElementType src_type,
                    size_t n, bool accumulate, const Stream& stream);

// On `stream`: the squared norm of the fp32 device array src[0, n) in tiles of
// `tile_elems` elements (the last may be short), tile k's sum into tile_sums[k] (device
// memory, ceil(n / tile_elems) doubles), bit-identical to CpuAdam::GradSquaredNormTiles
// with tile_elems = CpuAdam::kTileElems: within a tile, element i's square (in double) is
// added into lane i % 16 in element order, and the tile's sum is 0.0 + lane 0 + ... +
// lane 15. An inf or NaN element makes its tile's sum inf or NaN. n may be 0.
Status SquaredNormTilesAsync(const float* src, size_t n, size_t tile_elems, double* tile_sums,
                             const Stream& stream);

// The Status of a cudaError_t (its code mapped, its name and text in the message) after
// clearing CUDA's sticky last error; `what` names the call.
Status StatusFromCudaError(int error, std::string_view what);

// Runs a kernel on `device` that writes a pattern, copies it back and checks it: proves
// that this build's device code (its CUDA architectures) runs on that GPU.
Status SelfTest(int device);

}  // namespace strata::cuda

// The device seam (docs/engine.md, "The device seam"): the compute device as the engine's core
// sees it, torch-free. One interface, two implementations: the CPU device here
// (cpu_device.cc) and the CUDA device over core/cuda (cuda_device.cc, CUDA builds).
//
//   memory   an arena of strata.device_budget bytes, reserved once when the device is
//            made (failing to reserve it is an error there); allocations are carved out
//            of it (best fit, 64-byte aligned, neighbours coalesced on free) and never
//            exceed it. A budget of 0 means no arena: each allocation is its own block,
//            unbounded. FreeAfter(block, event) returns a block only once the event
//            completed, so a buffer outlives the asynchronous work that uses it.
//   streams  ordered queues of asynchronous work. Stream 0 is the compute stream (the
//            stream LibTorch computes on: on the CPU, the calling thread itself); side
//            streams come from CreateStream. SetComputeStream(native) makes another
//            native stream the compute stream from now on (LibTorch's current stream at a
//            forward or backward): it first waits on the device for the previous one, so
//            the compute stream's work stays one sequence.
//   events   Record(stream) marks the point after everything queued on the stream so far
//            (on the compute stream also after what LibTorch computed before the call);
//            Wait(stream, event) makes later work of the stream wait for it on the device;
//            Synchronize(event, why) blocks the host, and says why (HostWait: every host
//            wait is named and counted); Query(event) asks without blocking.
//   host     LaunchHostFunc(stream, fn) runs host work in the stream's order (a gloo
//            collective on a lane of its own: CollectiveLane, lane.h); AdoptStream names a
//            native stream someone else owns (an NCCL communicator's) as a StreamId.
//   lifetime KeepAlive(stream, owner) holds `owner` until the work queued on the stream so
//            far has run: memory that is not the arena's (a gradient LibTorch frees after
//            its hook) stays valid for the queued work that reads it (PyTorch's
//            recordStream).
//   copies   CopyAsync between pinned host memory and the device (or within the device),
//            queued on a stream. A copy from or to host memory that is not pinned is
//            refused (InvalidArgument): on a GPU it would silently serialize.
//   kernels  the element work the engine does in device memory, queued on a stream:
//            ZeroAsync, ConvertAsync (dtype conversion, or accumulation computed in fp32
//            and rounded once; bit-identical on both devices), and SquaredNormTilesAsync
//            (CPU-Adam's gradient-norm tiles, bit-identical to its host sums). The engine writes
//            device memory only through these and CopyAsync, so what it does on a GPU is
//            what the CPU tests run.
//
// The CPU device is no fake: copies, kernels and events complete on the device's own
// worker threads — the compute stream's queued work too (LibTorch itself computes on the
// calling thread, so a Record on stream 0 covers it at once; torch_on_compute_stream() is
// false) — and in its delaying mode every operation waits a random 0-2 ms (seeded, the
// seed printed) before it runs, so streams complete out of order. A wait the engine
// forgot shows up in CI's CPU tests as wrong numbers, not months later on a GPU.
//
// Thread-safety: every method may be called from any thread. Work queued on one stream
// runs in queue order; work on different streams runs concurrently unless ordered by
// events.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "strata/core/status.h"
#include "strata/engine/device/tier.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine {

// StreamId (a small copyable handle; kComputeStream, 0, is the compute stream) and EventId
// (0 = none; events are never reused) are in tier.h.

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// Why the host waits on device work: every Synchronize names one. The design allows the
// host to wait only where it reads or writes the memory itself or where a result decides
// control flow (docs/engine.md, "Every wait of a step", lists them and the tests that fail
// without each).
enum class HostWait : uint8_t {
  kOther,             // tests and tools
  kBucketInputs,      // a bucket's gradients written, before a host (gloo) collective reads it
  kGradientRead,      // a gradient given without an owner, read before AddGradient returns
  kGradientShards,    // reduced shards copied to pinned host memory, before they are added
  kShardStaging,      // a working shard staged into the device, before its lease goes back
  kShardZeroFill,     // a failed shard read's zeros, before the collective reads them
  kWorkingShardPush,  // updated working shards copied to the device, before their leases go
  kEndOfBackward,     // the backward's compute, before the step re-gathers persistent groups
  kArenaReuse,        // a freed block's last reader, before the arena hands the block out
  kShutdown,          // copies in flight when a component is destroyed
  kGradientFetch,     // the device's gradient sums (or their norm tiles) copied for CPU-Adam
};
inline constexpr int kHostWaitKinds = 11;
std::string_view HostWaitName(HostWait why);  // "bucket inputs", "arena reuse", ...

// Counters of a device (what tests and statistics read).
struct DeviceStats {
  uint64_t copies = 0;
  uint64_t copy_bytes = 0;
  uint64_t events_recorded = 0;
  uint64_t stream_waits = 0;
  uint64_t host_synchronizes = 0;  // Synchronize(event) calls that had to block
  // Of those, by HostWait (index: the enumerator's value).
  std::array<uint64_t, kHostWaitKinds> host_waits{};
  uint64_t keep_alives = 0;  // KeepAlive calls
  uint64_t kernels = 0;      // ZeroAsync, ConvertAsync and SquaredNormTilesAsync calls
  uint64_t arena_bytes = 0;  // reserved at creation (0: no arena)
  uint64_t largest_free_block = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  // "cpu (delaying, seed 42)", "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string name() const = 0;
  // The device's PCI bus id ("0000:3b:00.0"), for the NUMA node it hangs off; empty where
  // it has none (the CPU device).
  virtual std::string pci_bus_id() const { return {}; }

  // ---- memory: the device's allocator (a DeviceAllocator, so it backs the device tier).
  virtual std::shared_ptr<DeviceAllocator> allocator() = 0;
  // Frees `ptr` (bytes as allocated) once `after` completed (at once when it already has
  // or is invalid). REQUIRES: `ptr` came from allocator()->Allocate(bytes).
  virtual void FreeAfter(void* ptr, size_t bytes, EventId after) = 0;

  // ---- streams and events.
  virtual Result<StreamId> CreateStream(const std::string& name) = 0;
  virtual Result<EventId> Record(StreamId stream) = 0;
  virtual Status Wait(StreamId stream, EventId event) = 0;
  virtual Status Synchronize(EventId event, HostWait why) = 0;
  virtual Result<bool> Query(EventId event) = 0;
  // Holds `owner` until the work queued on `stream` so far has run (then drops it, on
  // whatever thread notices: its destructor must be thread-safe).
  virtual Status KeepAlive(StreamId stream, std::shared_ptr<const void> owner) = 0;
  // Whether LibTorch's own kernels run in order with the compute stream's queued work
  // (CUDA: both are queued on one CUDA stream) or at once on the calling thread (the CPU
  // device). Where not, memory LibTorch frees after a call (a gradient) needs KeepAlive,
  // and a Wait on the compute stream also blocks the calling thread (LibTorch runs there).
  virtual bool torch_on_compute_stream() const = 0;
  // The native handle of a stream (CUDA: its cudaStream_t; CPU: an opaque pointer of the
  // device's own), for SetComputeStream and for a communicator that issues on it.
  virtual Result<void*> NativeStream(StreamId stream) = 0;
  // From now on stream 0 is `native` (LibTorch's current stream at this forward or
  // backward; a CPU device's: NativeStream of one of its streams). A change makes the new
  // stream wait on the device for everything queued on the previous one. Null: the stream
  // of creation.
  virtual Status SetComputeStream(void* native) = 0;
  // A StreamId for `native`, a stream someone else owns (a communicator's: CUDA, a
  // cudaStream_t of this device; CPU, NativeStream of one of this device's streams): borrowed,
  // never destroyed, so its owner must outlive every use of the id. The same native stream
  // gives the same id.
  virtual Result<StreamId> AdoptStream(void* native) = 0;
  // Runs `fn` on the host once the work queued on `stream` before it ran; the stream's later
  // work waits for `fn` to return (CUDA: cudaLaunchHostFunc, on a thread of the driver's;
  // CPU: the stream's worker). `fn` must not call the device.
  virtual Status LaunchHostFunc(StreamId stream, std::function<void()> fn) = 0;
  // Makes the calling thread's device calls go to this device (CUDA: cudaSetDevice, so a
  // rank's engine thread never creates a context on GPU 0). Every engine thread that may
  // touch the device calls it first.
  virtual Status BindThread() = 0;

  // ---- copies. The host side must lie inside memory registered with RegisterHost (the
  // host tier's pinned pool registers its chunks). The CUDA device takes a range the
  // process already page-locked (the host pool pins with cudaHostRegister) as it is and
  // leaves it pinned at UnregisterHost; a range only partly pinned is FailedPrecondition.
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                           StreamId stream) = 0;
  virtual Status RegisterHost(void* ptr, size_t bytes) = 0;

  // ---- kernels, on `stream`, over device memory.
  virtual Status ZeroAsync(void* ptr, size_t bytes, StreamId stream) = 0;
  // dst[i] = src[i] converted to dst_type (round to nearest even); with `accumulate`,
  // dst[i] = dst[i] + src[i] in fp32, rounded once to dst_type.
  virtual Status ConvertAsync(void* dst, DType dst_type, const void* src, DType src_type, size_t n,
                              bool accumulate, StreamId stream) = 0;
  // tile_sums[k] = the squared norm (in double) of src's tile k, tiles of `tile_elems`
  // elements from src (the last may be short): bit-identical to CpuAdam::
  // GradSquaredNormTiles with tile_elems = CpuAdam::kTileElems (cuda::SquaredNormTilesAsync
  // says the order), so a norm summed from the device's copy of the gradients is the one the
  // host would sum from its own. src (n floats) and tile_sums (ceil(n / tile_elems) doubles)
  // are device memory; n may be 0.
  virtual Status SquaredNormTilesAsync(const float* src, size_t n, size_t tile_elems,
                                       double* tile_sums, StreamId stream) = 0;
  virtual Status UnregisterHost(void* ptr) = 0;

  virtual DeviceStats stats() const = 0;
};

struct CpuDeviceOptions {
  uint64_t budget_bytes = 0;  // strata.device_budget; 0: no arena, unbounded
  bool delaying = false;      // each queued operation waits a random 0..max_delay first
  uint64_t seed = 0;          // for the delays; printed in name() and the log
  uint32_t max_delay_us = 2000;
  // Tests: SetComputeStream switches without the new stream's wait for the old one.
  bool test_skip_compute_switch_wait = false;
};

// The CPU device. ResourceExhausted when the arena cannot be reserved.
Result<std::unique_ptr<Device>> MakeCpuDevice(const CpuDeviceOptions& options);

struct CudaDeviceOptions {
  int device = 0;             // CUDA device index (LOCAL_RANK under torchrun)
  uint64_t budget_bytes = 0;  // strata.device_budget; 0: half the free memory
  // The compute stream (stream 0): a cudaStream_t someone else owns, such as LibTorch's
  // current stream (borrowed, never destroyed); null: the legacy default stream.
  void* compute_stream = nullptr;
};

// The CUDA device over core/cuda (cuda_device.cc): the arena is one cudaMalloc of the
// budget, streams are non-blocking CUDA streams (stream 0: CudaDeviceOptions::
// compute_stream, LibTorch's current stream when a front end names it), events are CUDA
// events, kernels are core/cuda's. Unimplemented in a
// build without CUDA; the CUDA error (Unavailable without a GPU) when it fails.
Result<std::unique_ptr<Device>> MakeCudaDevice(const CudaDeviceOptions& options);

}  // namespace strata::engine

#include "strata/core/cuda/cuda.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <utility>

namespace strata::cuda {
namespace {

Status CudaError(cudaError_t err, std::string_view what);

}  // namespace

Status StatusFromCudaError(int error, std::string_view what) {
  return CudaError(static_cast<cudaError_t>(error), what);
}

namespace {

Status CudaError(cudaError_t err, std::string_view what) {
  (void)cudaGetLastError();  // the error is reported here: clear the runtime's last error
  std::string msg(what);
  msg += ": ";
  msg += cudaGetErrorName(err);
  msg += " (";
  msg += cudaGetErrorString(err);
  msg += ")";
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case cudaErrorMemoryAllocation:
      code = StatusCode::kResourceExhausted;
      break;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
      code = StatusCode::kInvalidArgument;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      code = StatusCode::kUnavailable;
      break;
    case cudaErrorHostMemoryAlreadyRegistered:
      code = StatusCode::kAlreadyExists;
      break;
    case cudaErrorHostMemoryNotRegistered:
      code = StatusCode::kNotFound;
      break;
    default:
      break;
  }
  return Status(code, std::move(msg));
}

#define STRATA_CUDA_RETURN(expr, what)           \
  do {                                           \
    const cudaError_t strata_cuda_err_ = (expr); \
    if (strata_cuda_err_ != cudaSuccess) {       \
      return CudaError(strata_cuda_err_, what);  \
    }                                            \
  } while (0)

}  // namespace

int DeviceCount(std::string* reason) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (reason) *reason = cudaGetErrorString(err);
    (void)cudaGetLastError();  // clear the sticky-free error state
    return 0;
  }
  if (n == 0 && reason) *reason = "no CUDA-capable device";
  return n;
}

Result<DeviceInfo> GetDeviceInfo(int device) {
  cudaDeviceProp prop{};
  STRATA_CUDA_RETURN(cudaGetDeviceProperties(&prop, device),
                     "cudaGetDeviceProperties(" + std::to_string(device) + ")");
  DeviceInfo info;
  info.index = device;
  info.name = prop.name;
  info.total_memory = prop.totalGlobalMem;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  char bus[32];
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess) info.pci_bus_id = bus;
  for (char& c : info.pci_bus_id)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return info;
}

Status SetDevice(int device) {
  STRATA_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  return Status::Ok();
}

Result<Stream> Stream::Create(int device) {
  STRATA_RETURN_IF_ERROR(SetDevice(device));
  Stream s;
  cudaStream_t raw = nullptr;
  STRATA_CUDA_RETURN(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreate");
  s.s_ = raw;
  return s;
}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (s_ && owned_) cudaStreamDestroy(s_);
    s_ = std::exchange(o.s_, nullptr);
    owned_ = o.owned_;
  }
  return *this;
}

Stream::~Stream() {
  if (s_ && owned_) cudaStreamDestroy(s_);
}

namespace {
std::atomic<uint64_t> g_device_wide_syncs{0};
std::atomic<uint64_t> g_stream_syncs{0};
std::atomic<uint64_t> g_event_syncs{0};
}  // namespace

Status DeviceSynchronize() {
  g_device_wide_syncs.fetch_add(1, std::memory_order_relaxed);
  STRATA_CUDA_RETURN(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return Status::Ok();
}

SyncCounts GetSyncCounts() {
  return {g_device_wide_syncs.load(), g_stream_syncs.load(), g_event_syncs.load()};
}

Status Stream::Synchronize() const {
  // The legacy default stream synchronizes with every blocking stream: device-wide.
  (s_ == nullptr ? g_device_wide_syncs : g_stream_syncs).fetch_add(1, std::memory_order_relaxed);
  STRATA_CUDA_RETURN(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
  return Status::Ok();
}

Result<Event> Event::Create(bool timing) {
  Event e;
  cudaEvent_t raw = nullptr;
  STRATA_CUDA_RETURN(
      cudaEventCreateWithFlags(&raw, timing ? cudaEventDefault : cudaEventDisableTiming),
      "cudaEventCreate");
  e.e_ = raw;
  return e;
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (e_) cudaEventDestroy(e_);
    e_ = std::exchange(o.e_, nullptr);
  }
  return *this;
}

Event::~Event() {
  if (e_) cudaEventDestroy(e_);
}

Status Event::Record(const Stream& stream) {
  STRATA_CUDA_RETURN(cudaEventRecord(e_, stream.get()), "cudaEventRecord");
  return Status::Ok();
}

Status Event::Synchronize() const {
  g_event_syncs.fetch_add(1, std::memory_order_relaxed);
  STRATA_CUDA_RETURN(cudaEventSynchronize(e_), "cudaEventSynchronize");
  return Status::Ok();
}

Result<bool> Event::Query() const {
  const cudaError_t err = cudaEventQuery(e_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  return CudaError(err, "cudaEventQuery");
}

Result<float> Event::ElapsedMs(const Event& start, const Event& end) {
  float ms = 0;
  STRATA_CUDA_RETURN(cudaEventElapsedTime(&ms, start.e_, end.e_), "cudaEventElapsedTime");
  return ms;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(int device, size_t bytes) {
  STRATA_RETURN_IF_ERROR(SetDevice(device));
  DeviceBuffer b;
  if (bytes > 0) {
    STRATA_CUDA_RETURN(cudaMalloc(&b.ptr_, bytes), "cudaMalloc(" + std::to_string(bytes) + ")");
  }
  b.bytes_ = bytes;
  b.device_ = device;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      device_(std::exchange(o.device_, -1)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = std::exchange(o.device_, -1);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

Status CopyHostToDevice(void* dst, const void* src, size_t bytes, const Stream& stream) {
  STRATA_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream.get()),
                     "cudaMemcpyAsync host to device");
  return Status::Ok();
}

Status CopyDeviceToHost(void* dst, const void* src, size_t bytes, const Stream& stream) {
  STRATA_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream.get()),
                     "cudaMemcpyAsync device to host");
  return Status::Ok();
}

Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, const Stream& stream) {
  STRATA_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream.get()),
                     "cudaMemcpyAsync device to device");
  return Status::Ok();
}

Status MemsetAsync(void* ptr, int value, size_t bytes, const Stream& stream) {
  STRATA_CUDA_RETURN(cudaMemsetAsync(ptr, value, bytes, stream.get()), "cudaMemsetAsync");
  return Status::Ok();
}

Status StreamWaitEvent(const Stream& stream, const Event& event) {
  STRATA_CUDA_RETURN(cudaStreamWaitEvent(stream.get(), event.get(), 0), "cudaStreamWaitEvent");
  return Status::Ok();
}

namespace {
void CUDART_CB RunHostFunc(void* data) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(data));
  (*fn)();
}
}  // namespace

Status LaunchHostFunc(const Stream& stream, std::function<void()> fn) {
  auto held = std::make_unique<std::function<void()>>(std::move(fn));
  STRATA_CUDA_RETURN(cudaLaunchHostFunc(stream.get(), &RunHostFunc, held.get()),
                     "cudaLaunchHostFunc");
  (void)held.release();  // RunHostFunc owns it now
  return Status::Ok();
}

Result<bool> IsPinnedHost(const void* ptr) {
  cudaPointerAttributes attr{};
  STRATA_CUDA_RETURN(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  return attr.type == cudaMemoryTypeHost;
}

Result<MemInfo> GetMemInfo(int device) {
  STRATA_CUDA_RETURN(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  size_t free_bytes = 0, total = 0;
  STRATA_CUDA_RETURN(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return MemInfo{free_bytes, total};
}

Status RegisterHost(void* ptr, size_t bytes) {
  STRATA_CUDA_RETURN(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable),
                     "cudaHostRegister(" + std::to_string(bytes) + " bytes)");
  return Status::Ok();
}

Status UnregisterHost(void* ptr) {
  STRATA_CUDA_RETURN(cudaHostUnregister(ptr), "cudaHostUnregister");
  return Status::Ok();
}

}  // namespace strata::cuda

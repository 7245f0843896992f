// Device code of strata_cuda: the self-test kernel that proves this build's
// architectures run on the GPU at hand ("no kernel image is available" otherwise).
#include <cuda_runtime.h>

#include <vector>

#include "strata/core/cuda/cuda.h"

namespace strata::cuda {
namespace {

__global__ void FillPattern(unsigned* out, unsigned n, unsigned seed) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i * 2654435761u + seed;
}

}  // namespace

Status SelfTest(int device) {
  constexpr unsigned kN = 1u << 16;
  constexpr unsigned kSeed = 0x5eed;
  auto stream = Stream::Create(device);
  if (!stream.ok()) return stream.status().WithContext("CUDA self-test");
  auto buf = DeviceBuffer::Allocate(device, kN * sizeof(unsigned));
  if (!buf.ok()) return buf.status().WithContext("CUDA self-test");
  FillPattern<<<(kN + 255) / 256, 256, 0, stream->get()>>>(static_cast<unsigned*>(buf->data()), kN,
                                                           kSeed);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return InternalError(std::string("CUDA self-test: kernel launch failed: ") +
                         cudaGetErrorString(err) +
                         " (is the GPU's architecture in CMAKE_CUDA_ARCHITECTURES?)");
  }
  std::vector<unsigned> host(kN);
  STRATA_RETURN_IF_ERROR(
      CopyDeviceToHost(host.data(), buf->data(), kN * sizeof(unsigned), *stream));
  STRATA_RETURN_IF_ERROR(stream->Synchronize());
  for (unsigned i = 0; i < kN; ++i) {
    if (host[i] != i * 2654435761u + kSeed) {
      return DataLossError("CUDA self-test: element " + std::to_string(i) + " is " +
                           std::to_string(host[i]) + ", expected " +
                           std::to_string(i * 2654435761u + kSeed));
    }
  }
  return Status::Ok();
}

}  // namespace strata::cuda

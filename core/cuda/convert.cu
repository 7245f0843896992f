// Device code of strata_cuda: element conversion and accumulation between fp32, bf16 and
// fp16 (the engine's gradient buckets and working shards). fp32 arithmetic, one rounding
// to nearest even: the same results as the engine's host conversions (engine/layout/dtype.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "strata/core/cuda/cuda.h"

namespace strata::cuda {
namespace {

__device__ __forceinline__ float Load(const void* p, size_t i, ElementType t) {
  switch (t) {
    case ElementType::kFloat32:
      return static_cast<const float*>(p)[i];
    case ElementType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case ElementType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
  }
  return 0.0f;
}

__device__ __forceinline__ void Store(void* p, size_t i, ElementType t, float v) {
  switch (t) {
    case ElementType::kFloat32:
      static_cast<float*>(p)[i] = v;
      break;
    case ElementType::kBFloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case ElementType::kFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
  }
}

__global__ void ConvertKernel(void* dst, ElementType dt, const void* src, ElementType st, size_t n,
                              bool accumulate) {
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    // __fadd_rn: no contraction into anything else; one fp32 sum, then one rounding.
    const float v = accumulate ? __fadd_rn(Load(dst, i, dt), Load(src, i, st)) : Load(src, i, st);
    Store(dst, i, dt, v);
  }
}

}  // namespace

Status ConvertAsync(void* dst, ElementType dst_type, const void* src, ElementType src_type,
                    size_t n, bool accumulate, const Stream& stream) {
  if (n == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) {
    return InvalidArgumentError("cuda ConvertAsync: null pointer for " + std::to_string(n) +
                                " elements");
  }
  constexpr unsigned kThreads = 256;
  const size_t want = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);
  ConvertKernel<<<blocks, kThreads, 0, stream.get()>>>(dst, dst_type, src, src_type, n, accumulate);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return StatusFromCudaError(err, "launching the conversion kernel");
  return Status::Ok();
}

}  // namespace strata::cuda

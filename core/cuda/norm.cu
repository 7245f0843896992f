// Device code of strata_cuda: the squared norm of an fp32 array in CPU-Adam's tiles, bit for
// bit as CpuAdam::GradSquaredNormTiles sums them on the host (optim/cpu_adam/cpu_adam.h).
#include <cuda_runtime.h>

#include <string>

#include "strata/core/cuda/cuda.h"

namespace strata::cuda {
namespace {

// The host's order: tile k's element i (from the tile's start) goes into lane i % 16, each
// lane a double sum from 0.0 in element order (x * x is exact in double, so an fma of it is
// the host's product-then-add), and the tile's sum is 0.0 + lane 0 + ... + lane 15.
constexpr unsigned kLanes = 16;
constexpr unsigned kTilesPerBlock = 16;

__global__ void SquaredNormTilesKernel(const float* src, size_t n, size_t tile_elems, size_t tiles,
                                       double* tile_sums) {
  __shared__ double lanes[kTilesPerBlock * kLanes];
  const unsigned lane = threadIdx.x % kLanes;
  const size_t tile = static_cast<size_t>(blockIdx.x) * kTilesPerBlock + threadIdx.x / kLanes;
  double acc = 0.0;
  if (tile < tiles) {
    const size_t b = tile * tile_elems;
    const size_t e = b + tile_elems < n ? b + tile_elems : n;
    for (size_t i = b + lane; i < e; i += kLanes) {
      const double x = static_cast<double>(src[i]);
      acc = __fma_rn(x, x, acc);
    }
  }
  lanes[threadIdx.x] = acc;
  __syncthreads();
  if (tile < tiles && lane == 0) {
    double s = 0.0;
    for (unsigned j = 0; j < kLanes; ++j)
      s = __dadd_rn(s, lanes[threadIdx.x + j]);
    tile_sums[tile] = s;
  }
}

}  // namespace

Status SquaredNormTilesAsync(const float* src, size_t n, size_t tile_elems, double* tile_sums,
                             const Stream& stream) {
  if (n == 0) return Status::Ok();
  if (src == nullptr || tile_sums == nullptr || tile_elems == 0) {
    return InvalidArgumentError("cuda SquaredNormTilesAsync: a null pointer or an empty tile (" +
                                std::to_string(n) + " elements, tiles of " +
                                std::to_string(tile_elems) + ")");
  }
  const size_t tiles = (n + tile_elems - 1) / tile_elems;
  const size_t blocks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  if (blocks > 0x7fffffffu) {
    return InvalidArgumentError("cuda SquaredNormTilesAsync: " + std::to_string(tiles) +
                                " tiles are more than one launch takes; use larger tiles");
  }
  SquaredNormTilesKernel<<<static_cast<unsigned>(blocks), kTilesPerBlock * kLanes, 0,
                           stream.get()>>>(src, n, tile_elems, tiles, tile_sums);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return StatusFromCudaError(err, "launching the squared-norm kernel");
  return Status::Ok();
}

}  // namespace strata::cuda

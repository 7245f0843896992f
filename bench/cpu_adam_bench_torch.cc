// LibTorch's torch::optim::Adam on the benchmark's tensors (see cpu_adam_bench_torch.h).
#include "cpu_adam_bench_torch.h"

#include <chrono>

#ifdef STRATA_BENCH_HAVE_TORCH
#include <torch/torch.h>
#endif

namespace strata::bench {

#ifdef STRATA_BENCH_HAVE_TORCH
bool HaveLibTorch() {
  return true;
}

std::vector<double> TimeLibTorchAdam(float* param, float* grad, size_t n, int threads, int reps) {
  at::set_num_threads(threads);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor p = torch::from_blob(param, {static_cast<int64_t>(n)}, opts);
  p.set_requires_grad(true);
  p.mutable_grad() = torch::from_blob(grad, {static_cast<int64_t>(n)}, opts);
  torch::optim::Adam adam({p}, torch::optim::AdamOptions(1e-3));
  std::vector<double> seconds;
  torch::NoGradGuard no_grad;
  adam.step();  // warm-up: allocates the state
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    adam.step();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return seconds;
}
#else
bool HaveLibTorch() {
  return false;
}
std::vector<double> TimeLibTorchAdam(float*, float*, size_t, int, int) {
  return {};
}
#endif

}  // namespace strata::bench

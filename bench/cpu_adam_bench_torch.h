// The LibTorch peer of cpu_adam_bench, in its own translation unit so only it pays for
// <torch/torch.h>.
#pragma once

#include <cstddef>
#include <vector>

namespace strata::bench {

// Whether the benchmark was built with LibTorch.
bool HaveLibTorch();

// Times torch::optim::Adam (fp32, one parameter of n elements wrapping `param` and `grad`
// without copies, torch's own exp_avg/exp_avg_sq) with `threads` intra-op threads.
// Returns the seconds of each of `reps` steps after one warm-up step; empty without torch.
std::vector<double> TimeLibTorchAdam(float* param, float* grad, size_t n, int threads, int reps);

}  // namespace strata::bench

// strata-quickstart: the README's C++ quick start, built and run by the tests so that it
// stays true. A residual MLP whose blocks are wrapped with strata::zero3, trained with
// ZeRO-3 and the optimizer offloaded to the host tier on a synthetic regression task.
//
//   build/bin/strata-quickstart [steps]                      one process
//   torchrun --nproc_per_node 2 --no_python build/bin/strata-quickstart
//
// Exit status: 0 when the loss (mean of the last 10 steps) fell below half of the first, 1
// otherwise, 2 on a bad argument.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "strata/core/config.h"
#include "strata/engine/libtorch/zero3.h"

// [quickstart-model]
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int n_blocks) {
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < n_blocks; ++i)
      blocks->push_back(strata::zero3(Block(d)));             // one ZeRO-3 group per block
    head = register_module("head", torch::nn::Linear(d, 1));  // the root group
  }
  torch::Tensor forward(torch::Tensor x) { return head(blocks->forward(x)); }
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);
// [quickstart-model]

int main(int argc, char** argv) {
  long steps = 60;
  if (argc > 1) {
    char* end = nullptr;
    steps = std::strtol(argv[1], &end, 10);
    if (end == argv[1] || *end != '\0' || steps < 1) {
      std::fprintf(stderr, "strata-quickstart: steps must be a positive integer, got '%s'\n",
                   argv[1]);
      return 2;
    }
  }
  try {
    // [quickstart-train]
    const char* world = std::getenv("WORLD_SIZE");  // set by torchrun
    strata::Result<strata::Config> config = strata::ParseConfig(
        R"({
      "train_micro_batch_size_per_gpu": 16,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "stage3_param_persistence_threshold": 0}
    })",
        {.world_size = world != nullptr ? std::atoi(world) : 1});
    if (!config.ok()) {
      std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
      return 2;
    }
    torch::manual_seed(0);
    Net net(32, 4);
    strata::Engine engine = strata::initialize(net.ptr(), *config);  // torchrun's ranks, if any

    const torch::Tensor w = torch::randn({32, 1}) / std::sqrt(32.0);  // the target function
    torch::manual_seed(1 + engine.rank());  // each rank draws its own batches
    double first = 0, last = 0;
    for (long step = 0; step < steps; ++step) {
      torch::Tensor x = torch::randn({16, 32});
      torch::Tensor loss = torch::mse_loss(net->forward(x), torch::tanh(x.matmul(w)));
      engine.backward(loss);
      engine.step();
      if (step == 0) first = loss.item<double>();
      if (step >= steps - 10)
        last += loss.item<double>() / static_cast<double>(std::min(10L, steps));
    }
    // [quickstart-train]
    if (engine.rank() == 0) {
      std::printf("strata-quickstart: %d rank(s), %ld steps, loss %.4f -> %.4f\n%s\n",
                  engine.world_size(), steps, first, last, engine.statistics().ToString().c_str());
    }
    return steps > 1 && last < 0.5 * first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-quickstart: %s\n", e.what());
    return 1;
  }
}

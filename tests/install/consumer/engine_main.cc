// A downstream LibTorch project: find_package(Strata) and link Strata::engine (which brings
// the LibTorch Strata was built against), then train a small model for a few steps.
#include <strata/core/config.h>
#include <strata/engine/libtorch/zero3.h>
#include <torch/torch.h>

#include <cstdio>

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

int main() {
  auto config = strata::ParseConfig(
      R"({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})",
      {.world_size = 1});
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  torch::manual_seed(0);
  torch::nn::Sequential net(strata::zero3(Block()), strata::zero3(Block()));
  strata::Engine engine = strata::initialize(net.ptr(), *config);
  const torch::Tensor x = torch::randn({4, 8});
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    torch::Tensor loss = net->forward(x).square().mean();
    engine.backward(loss);
    engine.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("engine consumer: loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}

// Frozen parameters: a LoRA-style model (this test's own low-rank adapters on
// frozen Linear layers) whose frozen base is more than 4x the device budget trains through
// strata::initialize and matches plain LibTorch (AdamW over the adapters and the trainable
// norms), on 1 and 2 Gloo ranks; the frozen base stays exactly as built, has no optimizer
// state, and the device tier's peak stays within the budget.
//
// The parent process never touches LibTorch before it forks (tests/comm/multiprocess.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "strata/core/check.h"
#include "strata/engine/libtorch/zero3.h"
#include "torch_ranks.h"

namespace strata {
namespace {

using torch_testing::OneThreadOptions;
using torch_testing::RunTorchRanks;
using torch_testing::SmallZero3Config;

constexpr int64_t kDim = 32;
constexpr int64_t kHidden = 128;
constexpr int64_t kRank = 4;
constexpr int64_t kVocab = 48;
constexpr int64_t kBatch = 4;  // global rows, divisible by 1 and 2
constexpr int64_t kSeq = 8;
constexpr int kBlocks = 12;
constexpr int kSteps = 4;

// A frozen Linear plus a trainable low-rank update: y = base(x) + (x A^T) B^T * alpha / r.
struct LoraLinearImpl : torch::nn::Module {
  LoraLinearImpl(int64_t in, int64_t out)
      : base(register_module("base", torch::nn::Linear(in, out))),
        a(register_parameter("lora_a", torch::randn({kRank, in}) * 0.1)),
        b(register_parameter("lora_b", torch::randn({out, kRank}) * 0.1)) {
    for (auto& p : base->parameters())
      p.requires_grad_(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // The base first, then the adapter (C++ leaves the order of a + b's operands open):
    // autograd runs the later-made adapter branch first in the backward.
    torch::Tensor y = base(x);
    torch::Tensor update = torch::matmul(torch::matmul(x, a.t()), b.t()) * (2.0 / kRank);
    return y + update;
  }
  torch::nn::Linear base;
  torch::Tensor a, b;
};
TORCH_MODULE(LoraLinear);

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", LoraLinear(kDim, kHidden))),
        fc2(register_module("fc2", LoraLinear(kHidden, kDim))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln;  // trainable
  LoraLinear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool wrap) {
    torch::manual_seed(5);
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    emb->weight.requires_grad_(false);  // a frozen root parameter
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < kBlocks; ++i) {
      if (wrap) {
        blocks->push_back(zero3(Block()));
      } else {
        blocks->push_back(Block());
      }
    }
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return head(blocks->forward(emb(tokens))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor tokens, targets;
};
Batch MakeBatch(int step) {
  torch::Generator g = at::detail::createCPUGenerator(100 + static_cast<uint64_t>(step));
  Batch b;
  b.tokens = torch::randint(kVocab, {kBatch, kSeq}, g);
  b.targets = torch::randint(kVocab, {kBatch, kSeq}, g);
  return b;
}

torch::Tensor LossOf(Net& net, const torch::Tensor& tokens, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(net->forward(tokens).reshape({-1, kVocab}),
                                              targets.reshape(-1));
}

// The frozen base's bytes (fp32) and the names of its tensors, plain model's names.
uint64_t FrozenBytes(Net& net) {
  uint64_t n = 0;
  for (const auto& p : net->parameters())
    if (!p.requires_grad()) n += static_cast<uint64_t>(p.numel()) * 4;
  return n;
}

// "blocks.3.inner.fc1.base.weight" -> "blocks.3.fc1.base.weight".
std::string Unwrapped(std::string name) {
  const size_t at = name.find(".inner.");
  if (at != std::string::npos) name.erase(at, 6);
  return name;
}

TEST(LoraTest, FrozenBaseFourTimesTheDeviceBudgetTrainsAsLibTorch) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    RunTorchRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
      // Plain LibTorch: AdamW over the trainable parameters only.
      Net ref(/*wrap=*/false);
      const uint64_t frozen_bytes = FrozenBytes(ref);
      std::map<std::string, torch::Tensor> initial;
      for (const auto& item : ref->named_parameters())
        initial[item.key()] = item.value().detach().clone();
      std::vector<torch::Tensor> trainable;
      for (const auto& p : ref->parameters())
        if (p.requires_grad()) trainable.push_back(p);
      torch::optim::AdamW opt(
          trainable,
          torch::optim::AdamWOptions(0.01).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01));
      std::vector<double> ref_losses;
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        const Batch b = MakeBatch(step);
        torch::Tensor loss = LossOf(ref, b.tokens, b.targets);
        loss.backward();
        opt.step();
        ref_losses.push_back(loss.item<double>());
      }

      // Strata, the device budget a quarter of the frozen base.
      Config c = SmallZero3Config();
      c.zero.offload_param.device = OffloadDevice::kCpu;  // the shards in host memory
      c.zero.reduce_bucket_size = 1500;
      c.strata.device_budget = frozen_bytes / 4;
      Net net(/*wrap=*/true);
      Engine e = initialize(net.ptr(), c, comm, OneThreadOptions());
      const int64_t rows = kBatch / world;
      std::vector<double> losses;
      for (int step = 0; step < kSteps; ++step) {
        const Batch b = MakeBatch(step);
        torch::Tensor loss = LossOf(net, b.tokens.narrow(0, rank * rows, rows),
                                    b.targets.narrow(0, rank * rows, rows));
        losses.push_back(loss.item<double>());
        e.backward(loss);
        e.step();
      }
      // The global loss is the mean of the ranks' (equal row counts).
      for (int step = 0; step < kSteps; ++step) {
        float v = static_cast<float>(losses[static_cast<size_t>(step)]);
        RK_OK(comm->AllReduce(&v, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
        const double global = static_cast<double>(v) / world;
        const double want = ref_losses[static_cast<size_t>(step)];
        RK_CHECK(std::abs(global - want) <= 1e-5 * std::abs(want),
                 "step " << step << ": loss " << global << " vs LibTorch " << want);
      }
      const auto params = e.gather_parameters();
      for (const auto& item : params) {
        const std::string name = Unwrapped(item.key());
        const auto ref_params = ref->named_parameters();
        const torch::Tensor* found = ref_params.find(name);
        RK_CHECK(found != nullptr, "no " << name << " in the plain model");
        const torch::Tensor want = *found;
        if (!want.requires_grad()) {
          RK_CHECK(torch::equal(item.value(), initial.at(name)), name << " (frozen) changed");
          continue;
        }
        const double d = (item.value() - want).abs().max().item<double>();
        RK_CHECK(d <= 1e-5, name << " differs from LibTorch by " << d);
        RK_CHECK(!torch::equal(item.value(), initial.at(name)), name << " did not train");
      }
      // The frozen base is partitioned without optimizer state; the device stayed within
      // its budget, a quarter of the frozen base.
      const engine::EngineStats st = e.statistics();
      uint64_t trainable_numel = 0;
      for (const torch::Tensor& p : trainable)
        trainable_numel += static_cast<uint64_t>(p.numel());
      RK_CHECK(st.optimizer.master_bytes * static_cast<uint64_t>(world) <
                   trainable_numel * 4 + 64 * 4 * 2 * (kBlocks + 1) * static_cast<uint64_t>(world),
               "master " << st.optimizer.master_bytes << " bytes per rank for " << trainable_numel
                         << " trainable parameters");
      RK_CHECK(st.working_shard_bytes * static_cast<uint64_t>(world) >= frozen_bytes,
               "working shards " << st.working_shard_bytes << " per rank");
      RK_CHECK(
          st.device.usage.peak_bytes <= c.strata.device_budget,
          "device peak " << st.device.usage.peak_bytes << " > budget " << c.strata.device_budget);
      RK_CHECK(frozen_bytes >= 4 * c.strata.device_budget, "the frozen base is " << frozen_bytes);
      return Status::Ok();
    });
  }
}

// A holder whose parameters are all frozen has no gradient to say its backward is over: the
// gradient reaching its input does (it is released then, not at the end of the backward).
// Checked from the earlier holder's weight gradient hook.
TEST(LoraTest, AHolderOfFrozenParametersOnlyIsReleasedAfterItsBackward) {
  RunTorchRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    torch::manual_seed(0);
    auto model = std::make_shared<torch::nn::Module>();
    auto a = model->register_module("a", zero3(torch::nn::Linear(kDim, kDim)));
    auto f = model->register_module("f", zero3(torch::nn::Linear(kDim, kDim)));
    auto b = model->register_module("b", zero3(torch::nn::Linear(kDim, kDim)));
    for (auto& p : f->inner()->parameters())
      p.requires_grad_(false);
    Engine e = initialize(model, SmallZero3Config(), comm, OneThreadOptions());
    std::vector<int64_t> seen;
    a->inner()->weight.register_hook([&](const torch::Tensor& grad) {
      seen.push_back(f->inner()->weight.numel());
      return grad;
    });
    for (int step = 0; step < 2; ++step) {
      torch::Tensor x = torch::randn({4, kDim});
      torch::Tensor loss =
          b->forward(torch::tanh(f->forward(torch::tanh(a->forward(x))))).square().mean();
      e.backward(loss);
      e.step();
    }
    RK_CHECK(seen == std::vector<int64_t>({0, 0}),
             "f's weight held " << (seen.empty() ? -1 : seen[0])
                                << " elements when a's gradient was computed");
    return Status::Ok();
  });
}

// Adapters only, no trainable norm in front: the first adapter's gradient is the
// holder's last, and it arrives before autograd has used the frozen fc1.base for the
// input's gradient. The holder's backward ends when its input's gradient is computed too
// (HookProtocol::ExpectInputs); before, the backward met fc1.base already released
// ("setStorage: ... out of bounds for storage of size 0"). It trains as LibTorch, and each
// holder's frozen base is released at the end of its own backward: checked from the first
// holder's adapter gradient hook.
struct BareBlockImpl : torch::nn::Module {
  BareBlockImpl()
      : fc1(register_module("fc1", LoraLinear(kDim, kHidden))),
        fc2(register_module("fc2", LoraLinear(kHidden, kDim))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::tanh(fc1(x))); }
  LoraLinear fc1, fc2;
};
TORCH_MODULE(BareBlock);

struct BareNet : torch::nn::Module {
  explicit BareNet(bool wrap) {
    torch::manual_seed(9);
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    emb->weight.requires_grad_(false);  // the first block's input requires no grad
    for (int i = 0; i < 3; ++i) {
      BareBlock b;
      blocks.push_back(b);
      const std::string name = "b" + std::to_string(i);
      if (wrap) {
        holders.push_back(register_module(name, zero3(b)));
      } else {
        register_module(name, b);
      }
    }
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    torch::Tensor h = emb(tokens);
    for (size_t i = 0; i < blocks.size(); ++i)
      h = holders.empty() ? blocks[i]->forward(h) : holders[i]->forward(h);
    return head(h);
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<BareBlock> blocks;
  std::vector<Zero3<BareBlockImpl>> holders;
  torch::nn::Linear head{nullptr};
};

TEST(LoraTest, FrozenWeightsBesideAdaptersOnlyTrainAsLibTorch) {
  RunTorchRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    auto ref = std::make_shared<BareNet>(/*wrap=*/false);
    std::vector<torch::Tensor> trainable;
    for (const auto& p : ref->parameters())
      if (p.requires_grad()) trainable.push_back(p);
    torch::optim::AdamW opt(
        trainable,
        torch::optim::AdamWOptions(0.01).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01));
    auto net = std::make_shared<BareNet>(/*wrap=*/true);
    Engine e = initialize(net, SmallZero3Config(), comm, OneThreadOptions());
    std::vector<std::vector<int64_t>> seen;
    net->blocks[0]->fc1->a.register_hook([&](const torch::Tensor& grad) {
      seen.push_back(
          {net->blocks[1]->fc1->base->weight.numel(), net->blocks[2]->fc1->base->weight.numel()});
      return grad;
    });
    auto loss_of = [](BareNet& m, const Batch& b) {
      return torch::nn::functional::cross_entropy(m.forward(b.tokens).reshape({-1, kVocab}),
                                                  b.targets.reshape(-1));
    };
    for (int step = 0; step < 3; ++step) {
      const Batch b = MakeBatch(step);
      torch::Tensor loss = loss_of(*net, b);
      e.backward(loss);
      e.step();
      opt.zero_grad();
      torch::Tensor want = loss_of(*ref, b);
      want.backward();
      opt.step();
      RK_CHECK(std::abs(loss.item<double>() - want.item<double>()) <=
                   1e-5 * std::abs(want.item<double>()),
               "step " << step << ": loss " << loss.item<double>() << " vs LibTorch "
                       << want.item<double>());
    }
    RK_CHECK(seen == std::vector<std::vector<int64_t>>(3, {0, 0}),
             "a later holder's frozen base was still gathered when the first adapter's "
             "gradient was computed");
    return Status::Ok();
  });
}

}  // namespace
}  // namespace strata

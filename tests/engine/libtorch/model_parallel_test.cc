// Strata under tensor parallelism: the data-parallel group is the communicator
// the caller gives strata::initialize. Four ranks = 2-way tensor parallel x 2-way data
// parallel; the test's own column- and row-parallel Linear layers (Megatron's split: the
// first MLP layer's rows, the second's columns, an all-reduce of the partial outputs in the
// forward and of the input gradient in the backward) run over a tensor-parallel Gloo
// communicator, and each rank's Strata engine partitions its tensor-parallel shard over its
// data-parallel pair. The trained shards must match the same model trained whole by
// torch::optim::AdamW on one process over the global batch.
//
// The parent process never touches LibTorch before it forks (tests/comm/multiprocess.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "../../comm/multiprocess.h"
#include "strata/core/check.h"
#include "strata/engine/libtorch/zero3.h"
#include "torch_ranks.h"

namespace strata {
namespace {

using comm::testing::AllExitedZero;
using comm::testing::Describe;
using comm::testing::MakeGloo;
using comm::testing::PortChannel;
using comm::testing::RunProcesses;

constexpr int64_t kDim = 8;
constexpr int64_t kHidden = 32;  // split in two by the tensor-parallel ranks
constexpr int64_t kRows = 8;     // global batch, split in two by the data-parallel ranks
constexpr int kBlocks = 2;
constexpr int kSteps = 6;
constexpr int kTp = 2, kDp = 2;

// The tensor-parallel communicator of this rank process (set before the model runs).
comm::Communicator* g_tp = nullptr;

torch::Tensor AllReduceTp(const torch::Tensor& t) {
  torch::Tensor out = t.contiguous().clone();
  const Status s = g_tp->AllReduce(out.data_ptr(), static_cast<size_t>(out.numel()),
                                   comm::DType::kFloat32, comm::ReduceOp::kSum);
  TORCH_CHECK(s.ok(), "tensor-parallel all-reduce: ", s.ToString());
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity forward, all-reduce of the gradient backward (the input of a column-parallel layer).
struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x) {
    return x.clone();
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list g) {
    return {AllReduceTp(g[0])};
  }
};
// All-reduce forward, identity backward (the output of a row-parallel layer).
struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x) {
    return AllReduceTp(x);
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list g) { return {g[0]}; }
};

// x + W2 gelu(W1 x + b1) + b2. `tp` < 0: whole; else this tensor-parallel rank's shard
// (W1's and b1's rows, W2's columns; b2 replicated).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int tp_rank) : tp(tp_rank) {
    const int64_t h = tp_rank < 0 ? kHidden : kHidden / kTp;
    w1 = register_parameter("w1", torch::empty({h, kDim}));
    b1 = register_parameter("b1", torch::empty({h}));
    w2 = register_parameter("w2", torch::empty({kDim, h}));
    b2 = register_parameter("b2", torch::empty({kDim}));
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor in = tp < 0 ? x : CopyToTp::apply(x);
    torch::Tensor partial = torch::matmul(torch::gelu(torch::matmul(in, w1.t()) + b1), w2.t());
    torch::Tensor y = tp < 0 ? partial : ReduceFromTp::apply(partial);
    return x + y + b2;
  }
  int tp;
  torch::Tensor w1, b1, w2, b2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int tp, bool wrap) {
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < kBlocks; ++i) {
      if (wrap) {
        blocks->push_back(zero3(Block(tp)));
      } else {
        blocks->push_back(Block(tp));
      }
    }
    head = register_module("head", torch::nn::Linear(kDim, kDim));  // replicated
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(x)); }
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

// The whole model's initial values, the same in every process.
std::map<std::string, torch::Tensor> WholeInit() {
  torch::manual_seed(21);
  std::map<std::string, torch::Tensor> v;
  for (int i = 0; i < kBlocks; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    v[b + "w1"] = torch::randn({kHidden, kDim}) * 0.3;
    v[b + "b1"] = torch::randn({kHidden}) * 0.1;
    v[b + "w2"] = torch::randn({kDim, kHidden}) * 0.2;
    v[b + "b2"] = torch::randn({kDim}) * 0.1;
  }
  v["head.weight"] = torch::randn({kDim, kDim}) * 0.3;
  v["head.bias"] = torch::randn({kDim}) * 0.1;
  return v;
}

// Tensor-parallel rank `tp`'s part of a whole parameter.
torch::Tensor Shard(const std::string& name, const torch::Tensor& whole, int tp) {
  const int64_t h = kHidden / kTp;
  if (name.ends_with(".w1") || name.ends_with(".b1")) return whole.narrow(0, tp * h, h);
  if (name.ends_with(".w2")) return whole.narrow(1, tp * h, h);
  return whole;
}

std::string Canonical(const std::string& name) {
  return std::regex_replace(name, std::regex("\\.inner\\."), ".");
}

void SetFrom(Net& net, const std::map<std::string, torch::Tensor>& whole, int tp) {
  torch::NoGradGuard no_grad;
  for (auto& item : net->named_parameters()) {
    const std::string name = Canonical(item.key());
    item.value().copy_(tp < 0 ? whole.at(name) : Shard(name, whole.at(name), tp));
  }
}

struct Data {
  torch::Tensor x, y;
};
Data Batch(int step) {
  torch::Generator gen = at::detail::createCPUGenerator(300 + static_cast<uint64_t>(step));
  return {torch::randn({kRows, kDim}, gen), torch::randn({kRows, kDim}, gen)};
}

Config MakeConfig() {
  return torch_testing::SmallZero3Config();
}

TEST(ModelParallelTest, TwoWayTensorTimesTwoWayDataParallelMatchesTheWholeModel) {
  // One channel per group: tensor-parallel pairs {0,1} and {2,3}, data-parallel pairs
  // {0,2} and {1,3} (rank = 2 * dp + tp).
  PortChannel tp_ports[kDp], dp_ports[kTp];
  const auto results = RunProcesses(
      kTp * kDp,
      [&](int rank) -> Status {
        torch::set_num_threads(1);
        const int tp = rank % kTp, dp = rank / kTp;
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> tp_comm,
                                MakeGloo(tp, kTp, tp_ports[dp]));
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> dp_comm_u,
                                MakeGloo(dp, kDp, dp_ports[tp]));
        std::shared_ptr<comm::Communicator> dp_comm(std::move(dp_comm_u));
        g_tp = tp_comm.get();
        const std::map<std::string, torch::Tensor> init = WholeInit();

        // The reference: the whole model, one process, the global batch.
        Net ref(-1, /*wrap=*/false);
        SetFrom(ref, init, -1);
        torch::optim::AdamW opt(
            ref->parameters(),
            torch::optim::AdamWOptions(0.01).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01));
        std::vector<double> ref_losses;
        for (int step = 0; step < kSteps; ++step) {
          const Data d = Batch(step);
          opt.zero_grad();
          torch::Tensor loss = torch::mse_loss(ref->forward(d.x), d.y);
          loss.backward();
          opt.step();
          ref_losses.push_back(loss.item<double>());
        }

        // Strata: this rank's tensor-parallel shard, partitioned over its data-parallel pair.
        Net net(tp, /*wrap=*/true);
        SetFrom(net, init, tp);
        Engine e = initialize(net.ptr(), MakeConfig(), dp_comm, torch_testing::OneThreadOptions());
        RK_CHECK(e.world_size() == kDp && e.rank() == dp, e.rank() << " of " << e.world_size());
        const int64_t rows = kRows / kDp;
        for (int step = 0; step < kSteps; ++step) {
          const Data d = Batch(step);
          torch::Tensor loss = torch::mse_loss(net->forward(d.x.narrow(0, dp * rows, rows)),
                                               d.y.narrow(0, dp * rows, rows));
          float global = loss.item<float>();
          RK_OK(dp_comm->AllReduce(&global, 1, comm::DType::kFloat32, comm::ReduceOp::kAvg));
          RK_CHECK(std::abs(global - ref_losses[step]) <= 1e-5 * std::abs(ref_losses[step]),
                   "step " << step << ": loss " << global << " vs " << ref_losses[step]);
          e.backward(loss);
          e.step();
        }
        double num = 0, den = 0;
        int compared = 0;
        std::map<std::string, torch::Tensor> trained;
        for (const auto& item : ref->named_parameters())
          trained[item.key()] = item.value().detach();
        for (const auto& item : e.gather_parameters()) {
          const std::string name = Canonical(item.key());
          const torch::Tensor want = Shard(name, trained.at(name), tp);
          RK_CHECK(want.sizes() == item.value().sizes(), name);
          num += (item.value() - want).pow(2).sum().item<double>();
          den += want.pow(2).sum().item<double>();
          ++compared;
        }
        RK_CHECK(compared == 4 * kBlocks + 2, compared << " parameters");
        RK_CHECK(std::sqrt(num / den) <= 1e-5, "parameters differ by " << std::sqrt(num / den));
        RK_CHECK(e.statistics().optimizer.params_updated > 0, "no update");
        g_tp = nullptr;
        return Status::Ok();
      },
      std::chrono::seconds(120));
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

}  // namespace
}  // namespace strata

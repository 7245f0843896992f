// strata::checkpoint (engine/libtorch/activation_checkpoint.h) with the LibTorch front end:
// blocks wrapped by strata::zero3 and run through strata::checkpoint train exactly as
// without it (1 and 2 Gloo ranks, dropout inside the blocks, so the recompute must replay
// the random state), and the memory the graph keeps is the blocks' inputs, measured by a
// counting CPU allocator (every tensor LibTorch allocates on the CPU goes through it).
//
// The parent process never touches LibTorch before it forks: every torch call happens in
// the rank processes (tests/comm/multiprocess.h).
#include "strata/engine/libtorch/activation_checkpoint.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/core/check.h"
#include "strata/engine/libtorch/zero3.h"
#include "torch_ranks.h"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace strata {
namespace {

constexpr int64_t kDim = 16;
constexpr int64_t kBatch = 8;  // global rows, divisible by 1 and 2
constexpr int64_t kSeq = 64;
constexpr int kBlocks = 6;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", torch::nn::Linear(kDim, 4 * kDim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kDim, kDim))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(torch::Tensor x) { return x + drop(fc2(torch::gelu(fc1(ln(x))))); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool wrap) {
    torch::manual_seed(11);
    in = register_module("in", torch::nn::Linear(kDim, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < kBlocks; ++i) {
      if (wrap) {
        blocks->push_back(zero3(Block()));
      } else {
        blocks->push_back(Block());
      }
    }
  }
  // `ck`: every block through strata::checkpoint. `inputs` (if given) collects each
  // block's input.
  torch::Tensor forward(const torch::Tensor& x, bool ck) {
    torch::Tensor h = in(x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      std::shared_ptr<torch::nn::Module> m = blocks->ptr(i);
      auto run = [m](const torch::Tensor& t) {
        if (auto z = std::dynamic_pointer_cast<Zero3Impl<BlockImpl>>(m)) return z->forward(t);
        return std::dynamic_pointer_cast<BlockImpl>(m)->forward(t);
      };
      h = ck ? checkpoint(run, h) : run(h);
    }
    return h;
  }
  torch::nn::Linear in{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

torch::Tensor Rows(int step) {
  torch::Generator gen = at::detail::createCPUGenerator(500 + static_cast<uint64_t>(step));
  return torch::randn({kBatch, kSeq, kDim}, gen);
}

Config MakeConfig() {
  return torch_testing::SmallZero3Config();
}

engine::EngineOptions Options() {
  return torch_testing::OneThreadOptions();
}

struct Trained {
  std::vector<float> losses;  // this rank's
  torch::OrderedDict<std::string, torch::Tensor> params;
};

// Trains `steps` steps on this rank's rows; each rank seeds its dropout by its rank.
Status Train(std::shared_ptr<comm::Communicator> comm, bool ck, int steps, Trained& out) {
  Net net(/*wrap=*/true);
  Engine e = initialize(net.ptr(), MakeConfig(), comm, Options());
  const int64_t rows = kBatch / e.world_size();
  torch::manual_seed(100 + static_cast<uint64_t>(e.rank()));
  for (int step = 0; step < steps; ++step) {
    const torch::Tensor x = Rows(step).narrow(0, e.rank() * rows, rows);
    torch::Tensor loss = net->forward(x, ck).pow(2).mean();
    out.losses.push_back(loss.item<float>());
    e.backward(loss);
    e.step();
  }
  out.params = e.gather_parameters();
  return Status::Ok();
}

template <typename Body>
void RunRanks(int world, Body body) {
  torch_testing::RunTorchRanks(world, std::move(body));
}

class CheckpointRanksTest : public ::testing::TestWithParam<int> {};

// Checkpointed and plain runs are bit for bit the same: the recompute replays the dropout
// masks and re-gathers each block for its backward. Without replaying the random state the
// recompute draws other masks and the parameters differ (checked by hand when writing this).
TEST_P(CheckpointRanksTest, CheckpointedBlocksTrainBitForBitAsPlainOnes) {
  RunRanks(GetParam(), [](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Trained plain, ck;
    RK_OK(Train(comm, /*ck=*/false, 4, plain));
    RK_OK(Train(comm, /*ck=*/true, 4, ck));
    RK_CHECK(plain.losses == ck.losses,
             "losses differ: " << plain.losses[3] << " vs " << ck.losses[3]);
    RK_CHECK(plain.losses.front() != plain.losses.back(), "the model did not train");
    RK_CHECK(plain.params.size() == ck.params.size(), plain.params.size());
    for (const auto& item : plain.params) {
      RK_CHECK(torch::equal(item.value(), ck.params[item.key()]), item.key() << " differs");
    }
    return Status::Ok();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, CheckpointRanksTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "Rank" + (i.param > 1 ? "s" : "");
                         });

// Counts the bytes of live CPU tensors, and their peak, over LibTorch's default allocator.
// Data and context are the same pointer (LibTorch's raw_allocate needs that): the sizes
// are kept in a map.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) { instance_ = this; }
  c10::DataPtr allocate(size_t n) override {
    void* p = base_->raw_allocate(n);
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = n;
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_, live_);
    return {p, p, &Delete, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dst, const void* src, size_t n) const override { std::memcpy(dst, src, n); }
  int64_t live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void ResetPeak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
  }

 private:
  static void Delete(void* p) {
    if (p == nullptr) return;
    CountingAllocator* self = instance_;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->sizes_.find(p);
      if (it != self->sizes_.end()) {
        self->live_ -= static_cast<int64_t>(it->second);
        self->sizes_.erase(it);
      }
    }
    self->base_->raw_deallocate(p);
  }
  static inline CountingAllocator* instance_ = nullptr;
  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t live_ = 0, peak_ = 0;
};

struct Memory {
  int64_t kept = 0;           // live after the forward minus before it (the output included)
  int64_t backward_peak = 0;  // peak during the backward minus live before the forward
  int64_t no_grad_kept = 0;   // the same forward under torch::NoGradGuard
};

Status Measure(std::shared_ptr<comm::Communicator> comm, CountingAllocator& counter, bool ck,
               Memory& out) {
  Net net(/*wrap=*/true);
  Engine e = initialize(net.ptr(), MakeConfig(), comm, Options());
  const torch::Tensor x = Rows(0);
  for (int step = 0; step < 2; ++step) {  // the second step is measured (buffers warm)
    {
      // What a forward keeps without any activation: its output and the engine's own
      // buffers (a group gathered ahead for the backward).
      torch::NoGradGuard no_grad;
      const int64_t before = counter.live();
      torch::Tensor y = net->forward(x, ck);
      out.no_grad_kept = counter.live() - before;
    }
    const int64_t before = counter.live();
    torch::Tensor out_h = net->forward(x, ck);
    out.kept = counter.live() - before;
    torch::Tensor loss = out_h.pow(2).mean();
    counter.ResetPeak();
    e.backward(loss);
    out.backward_peak = counter.peak() - before;
    e.step();
  }
  return Status::Ok();
}

// With N blocks checkpointed the forward keeps N block inputs (and the output); the
// backward adds one block's activations at a time (plus the gradients in flight).
TEST(CheckpointMemoryTest, TheGraphKeepsTheBlockInputsAndOneBlockAtATime) {
  RunRanks(1, [](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    static CountingAllocator counter(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&counter, /*priority=*/100);
    Memory plain, ck;
    RK_OK(Measure(comm, counter, /*ck=*/false, plain));
    RK_OK(Measure(comm, counter, /*ck=*/true, ck));
    const int64_t act = kBatch * kSeq * kDim * 4;  // one block input (and the output)
    const int64_t block = plain.kept / kBlocks;    // one block's saved activations, about
    std::printf(
        "block input %lld B; kept without grad %lld B; kept: plain %lld B, checkpointed %lld "
        "B; backward peak: plain %lld B, checkpointed %lld B\n",
        static_cast<long long>(act), static_cast<long long>(ck.no_grad_kept),
        static_cast<long long>(plain.kept), static_cast<long long>(ck.kept),
        static_cast<long long>(plain.backward_peak), static_cast<long long>(ck.backward_peak));
    RK_CHECK(block > 4 * act, "the plain run kept only " << plain.kept
                                                         << " bytes: the counter "
                                                            "does not see the activations");
    // Each checkpoint keeps its input and the CPU generator's state (to replay dropout);
    // the input layer's output is the first block's input; the final output is kept too.
    const int64_t rng =
        static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
    RK_CHECK(ck.kept <= kBlocks * (act + rng) + act,
             "checkpointed forward kept " << ck.kept << " bytes, more than " << kBlocks
                                          << " block inputs, their RNG states and the output");
    // The backward recomputes one block at a time: beyond what the forward kept, one
    // block's activations and the gradients in flight (what the plain backward adds to its
    // forward's, measured), with one block input of slack.
    const int64_t in_flight = plain.backward_peak - plain.kept;
    RK_CHECK(ck.backward_peak <= ck.kept + block + in_flight + act,
             "checkpointed backward peaked at " << ck.backward_peak << " bytes (kept " << ck.kept
                                                << ", one block " << block << ", in flight "
                                                << in_flight << ")");
    RK_CHECK(ck.kept * 3 < plain.kept, ck.kept << " vs " << plain.kept);
    return Status::Ok();
  });
}

// The config's activation_checkpointing.cpu_checkpointing reaches strata::checkpoint through
// Engine::checkpoint_options(); on the CPU the inputs are host memory already and the run
// is the same as without it.
TEST(CheckpointOptionsTest, TheConfigsCpuCheckpointingReachesTheOptions) {
  RunRanks(1, [](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    {
      Net net(/*wrap=*/true);
      Engine e = initialize(net.ptr(), MakeConfig(), comm, Options());
      RK_CHECK(!e.checkpoint_options().inputs_in_host_memory, "on by default");
    }
    Config c = MakeConfig();
    c.activation_checkpointing.cpu_checkpointing = true;
    std::vector<float> losses[2];
    for (int on = 0; on < 2; ++on) {
      Net net(/*wrap=*/true);
      Engine e = initialize(net.ptr(), on ? c : MakeConfig(), comm, Options());
      RK_CHECK(e.checkpoint_options().inputs_in_host_memory == (on == 1), on);
      CheckpointOptions o;
      o.inputs_in_host_memory = on == 1;
      torch::manual_seed(100);
      for (int step = 0; step < 3; ++step) {
        torch::Tensor h = net->in(Rows(step));
        for (size_t i = 0; i < net->blocks->size(); ++i) {
          auto z = std::dynamic_pointer_cast<Zero3Impl<BlockImpl>>(net->blocks->ptr(i));
          h = checkpoint([z](const torch::Tensor& t) { return z->forward(t); }, h, o);
        }
        torch::Tensor loss = h.pow(2).mean();
        losses[on].push_back(loss.item<float>());
        e.backward(loss);
        e.step();
      }
    }
    RK_CHECK(losses[0] == losses[1], losses[0][2] << " vs " << losses[1][2]);
    return Status::Ok();
  });
}

// On a GPU the saved inputs leave the device between the forward and the backward, and
// the gradients are the same (SKIPPED without one).
TEST(CheckpointOptionsTest, CudaInputsInHostMemoryLeaveTheGpu) {
#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
  if (!torch_testing::TorchCudaUsableInAChild())
    GTEST_SKIP() << "no usable CUDA device (torch::cuda::is_available() is false)";
  RunRanks(1, [](int /*rank*/, std::shared_ptr<comm::Communicator> /*comm*/) -> Status {
    const torch::Device dev(torch::kCUDA, 0);
    torch::manual_seed(3);
    const torch::Tensor w = torch::randn({256, 256}, dev).requires_grad_();
    auto fn = [w](const torch::Tensor& t) { return torch::tanh(torch::matmul(t, w)); };
    // The same input for both runs (drawn inside the loop, the second run's differed and
    // so did its gradients: seen on the first GPU run).
    const torch::Tensor x0 = torch::randn({4096, 256}, dev);
    int64_t kept[2] = {0, 0};
    torch::Tensor grads[2];
    for (int on = 0; on < 2; ++on) {
      CheckpointOptions o;
      o.inputs_in_host_memory = on == 1;
      torch::Tensor x = x0.clone().requires_grad_();
      torch::cuda::synchronize();
      const int64_t before =
          c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
      torch::Tensor h = x;
      for (int i = 0; i < 4; ++i)
        h = checkpoint(fn, h, o);
      torch::cuda::synchronize();
      kept[on] =
          c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current - before;
      h.sum().backward();
      grads[on] = w.grad().clone();
      w.mutable_grad() = torch::Tensor();
    }
    const int64_t input = 4096 * 256 * 4;
    RK_CHECK(kept[1] <= kept[0] - 3 * input, kept[1] << " vs " << kept[0]);
    RK_CHECK(torch::allclose(grads[0], grads[1]), "gradients differ");
    return Status::Ok();
  });
#else
  GTEST_SKIP() << "LibTorch without CUDA";
#endif
}

// Outside grad mode the function simply runs; misuse is a clear error.
TEST(CheckpointMisuseTest, NoGradRunsTheFunctionAndAnEmptyFunctionIsRefused) {
  RunRanks(1, [](int /*rank*/, std::shared_ptr<comm::Communicator> /*comm*/) -> Status {
    int calls = 0;
    const torch::Tensor x = torch::ones({3}, torch::requires_grad());
    {
      torch::NoGradGuard no_grad;
      torch::Tensor y = checkpoint(
          [&calls](const torch::Tensor& t) {
            ++calls;
            return t * 2;
          },
          x);
      RK_CHECK(!y.requires_grad() && calls == 1, calls);
    }
    torch::Tensor y = checkpoint(
        [&calls](const torch::Tensor& t) {
          ++calls;
          return t * t;
        },
        x);
    RK_CHECK(calls == 2, calls);
    y.sum().backward();
    RK_CHECK(calls == 3, "the backward did not recompute: " << calls);
    RK_CHECK(torch::equal(x.grad(), 2 * x.detach()), x.grad());
    std::string what;
    try {
      checkpoint(std::function<torch::Tensor(const torch::Tensor&)>(), x);
    } catch (const c10::Error& e) {
      what = e.what();
    }
    RK_CHECK(what.find("the function is empty") != std::string::npos, what);
    return Status::Ok();
  });
}

}  // namespace
}  // namespace strata

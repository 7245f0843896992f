// The LibTorch layer under both front ends (engine/libtorch/tensor_engine.h), on plain
// tensors: the parameters bound to the engine's buffers, the gradient hook, what Close leaves,
// the device and dtype checks, and the initial values read without an fp32 copy of a 16-bit
// model (on the CPU here; on a GPU when one is present, else SKIPPED).
//
// Each case runs in a forked process of its own (torch_ranks.h): its peak resident set is its
// own, and the parent never touches LibTorch.
#include "strata/engine/libtorch/tensor_engine.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <string>
#include <vector>

#include "strata/core/check.h"
#include "torch_ranks.h"

namespace strata {
namespace {

using torch_testing::RunTorchRanks;

#define TE_CHECK(cond, what)                                             \
  do {                                                                   \
    if (!(cond)) return InternalError(std::string("failed: ") + (what)); \
  } while (0)

// The process's peak resident set since the last ResetPeak, in bytes (VmHWM).
uint64_t PeakRss() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}
void ResetPeak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

Config SmallConfig() {
  Config c = torch_testing::SmallZero3Config();
  c.strata.device_budget = 64ull << 20;
  return c;
}

TensorEngineOptions Options(std::shared_ptr<comm::Communicator> comm) {
  TensorEngineOptions o;
  o.engine = torch_testing::OneThreadOptions();
  o.comm = std::move(comm);
  return o;
}

// A root group of one parameter and a block of two.
std::vector<TensorGroup> TwoGroups(const torch::Tensor& r, const torch::Tensor& w,
                                   const torch::Tensor& b) {
  std::vector<TensorGroup> g(2);
  g[0].name = "root";
  g[0].params.push_back({"r", r, std::nullopt, 0, {}});
  g[1].name = "block";
  g[1].params.push_back({"block.w", w, std::nullopt, 0, {}});
  g[1].params.push_back({"block.b", b, std::nullopt, 0, {}});
  return g;
}

TEST(TensorEngineTest, ParametersPointAtTheGatheredBufferWhileTheirGroupIsHeld) {
  RunTorchRanks(1, [](int, std::shared_ptr<comm::Communicator> comm) -> Status {
    torch::manual_seed(3);
    torch::Tensor r = torch::randn({5}).requires_grad_();
    torch::Tensor w = torch::randn({4, 3}).requires_grad_();
    torch::Tensor b = torch::randn({3}).requires_grad_();
    const torch::Tensor w0 = w.detach().clone(), b0 = b.detach().clone();
    STRATA_ASSIGN_OR_RETURN(
        std::shared_ptr<TensorEngine> e,
        TensorEngine::Create(TwoGroups(r, w, b), {}, SmallConfig(), Options(std::move(comm))));
    // Outside a forward the block's parameters hold nothing; the root is held from Create.
    TE_CHECK(w.numel() == 0 && b.numel() == 0, "the block's parameters are empty at rest");
    TE_CHECK(r.numel() == 5, "the root group is held");
    STRATA_RETURN_IF_ERROR(e->BeginForward(1));
    STRATA_ASSIGN_OR_RETURN(engine::EngineCore * core, e->core());
    STRATA_ASSIGN_OR_RETURN(engine::GatheredGroup full, core->FullBuffer(1));
    TE_CHECK(w.data_ptr() == static_cast<void*>(full.param_data(0)), "w points at the buffer");
    TE_CHECK(b.data_ptr() == static_cast<void*>(full.param_data(1)), "b points at the buffer");
    TE_CHECK(torch::equal(w.detach(), w0) && torch::equal(b.detach(), b0), "the initial values");
    // A backward through the block: the gradient hook hands the gradients over and frees them.
    torch::Tensor out = (torch::matmul(torch::ones({2, 4}), w) + b).sum() * r.sum();
    const std::vector<torch::Tensor> wrapped = e->WrapOutputs(1, {out});
    STRATA_RETURN_IF_ERROR(e->EndForward(1, false));
    TE_CHECK(w.numel() == 0, "released after the forward");
    STRATA_ASSIGN_OR_RETURN(torch::Tensor scaled, e->BeginBackward(wrapped[0]));
    scaled.backward();
    STRATA_RETURN_IF_ERROR(e->FinishBackward());
    TE_CHECK(!w.grad().defined() && !b.grad().defined() && !r.grad().defined(),
             "every gradient handed to the engine and freed");
    STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, e->protocol());
    STRATA_ASSIGN_OR_RETURN(engine::StepOutcome step, hooks->Step());
    TE_CHECK(step.applied, "the step applied");
    STRATA_ASSIGN_OR_RETURN(std::vector<torch::Tensor> now, e->GatherParameters({w, b}));
    TE_CHECK(!torch::equal(now[0], w0) && !torch::equal(now[1], b0), "the step moved them");
    return Status::Ok();
  });
}

TEST(TensorEngineTest, CloseLeavesPlainEmptyTensorsWithoutTheGradientHook) {
  RunTorchRanks(1, [](int, std::shared_ptr<comm::Communicator> comm) -> Status {
    torch::Tensor r = torch::randn({5}).requires_grad_();
    torch::Tensor w = torch::randn({4, 3}).requires_grad_();
    torch::Tensor b = torch::randn({3}).requires_grad_();
    const size_t hooks_before = torch::autograd::impl::grad_accumulator(w)->post_hooks().size();
    STRATA_ASSIGN_OR_RETURN(
        std::shared_ptr<TensorEngine> e,
        TensorEngine::Create(TwoGroups(r, w, b), {}, SmallConfig(), Options(std::move(comm))));
    TE_CHECK(torch::autograd::impl::grad_accumulator(w)->post_hooks().size() == hooks_before + 1,
             "a hook on the gradient accumulator");
    e->Close();
    TE_CHECK(torch::autograd::impl::grad_accumulator(w)->post_hooks().size() == hooks_before,
             "the hook removed at Close");
    TE_CHECK(w.numel() == 0 && r.numel() == 0, "empty after Close");
    TE_CHECK(!e->core().ok(), "the core is gone");
    // The tensors are usable again as ordinary ones.
    w.set_data(torch::ones({2}));
    (w * 2).sum().backward();
    TE_CHECK(w.grad().defined() && w.grad()[0].item<float>() == 2.0f, "an ordinary gradient");
    return Status::Ok();
  });
}

TEST(TensorEngineTest, AFailedCreateLeavesTheTensorsAsItFoundThem) {
  RunTorchRanks(1, [](int, std::shared_ptr<comm::Communicator> comm) -> Status {
    torch::manual_seed(4);
    torch::Tensor r = torch::randn({5}).requires_grad_();
    torch::Tensor w = torch::randn({4, 3}).requires_grad_();
    torch::Tensor b = torch::randn({3}).requires_grad_();
    w.mutable_grad() = torch::ones({4, 3});
    const torch::Tensor w0 = w.detach().clone(), r0 = r.detach().clone();
    void* const w_data = w.data_ptr();
    const size_t hooks_before = torch::autograd::impl::grad_accumulator(w)->post_hooks().size();
    TensorEngineOptions o = Options(std::move(comm));
    o.test_after_binding = [] { return UnavailableError("failing on purpose"); };
    Result<std::shared_ptr<TensorEngine>> e =
        TensorEngine::Create(TwoGroups(r, w, b), {}, SmallConfig(), std::move(o));
    TE_CHECK(!e.ok() && e.status().message() == "failing on purpose", e.status().ToString());
    TE_CHECK(w.data_ptr() == w_data && torch::equal(w.detach(), w0) &&
                 torch::equal(r.detach(), r0) && b.numel() == 3,
             "the tensors' own memory and values back");
    TE_CHECK(w.grad().defined() && torch::equal(w.grad(), torch::ones({4, 3})),
             "the gradient back");
    TE_CHECK(torch::autograd::impl::grad_accumulator(w)->post_hooks().size() == hooks_before,
             "no hook left");
    // A parameter to train that does not require grad is refused before anything changes.
    torch::Tensor frozen = torch::randn({3});
    std::vector<TensorGroup> g = TwoGroups(r, w, frozen);
    Result<std::shared_ptr<TensorEngine>> refused =
        TensorEngine::Create(g, {}, SmallConfig(), Options(nullptr));
    TE_CHECK(!refused.ok() && refused.status().message().find(
                                  "parameter block.b is to be trained but does not require "
                                  "grad") != std::string::npos,
             refused.status().ToString());
    TE_CHECK(w.data_ptr() == w_data, "nothing changed");
    return Status::Ok();
  });
}

TEST(TensorEngineTest, RefusesADTypeItCannotTrainAndAModelOnAnotherDevice) {
  RunTorchRanks(1, [](int, std::shared_ptr<comm::Communicator> comm) -> Status {
    std::vector<TensorGroup> g(1);
    g[0].name = "root";
    g[0].params.push_back(
        {"x", torch::zeros({3}, torch::kFloat64).requires_grad_(), std::nullopt, 0, {}});
    Result<std::shared_ptr<TensorEngine>> e =
        TensorEngine::Create(g, {}, SmallConfig(), Options(comm));
    TE_CHECK(!e.ok() && e.status().code() == StatusCode::kInvalidArgument &&
                 e.status().message().find("parameter x is torch.float64; the engine trains fp32, "
                                           "bf16 and fp16") != std::string::npos,
             "a float64 parameter refused: " + e.status().ToString());
    g[0].params[0].tensor =
        torch::zeros({3}, torch::TensorOptions().device(torch::kMeta)).requires_grad_();
    e = TensorEngine::Create(g, {}, SmallConfig(), Options(comm));
    TE_CHECK(!e.ok() && e.status().message().find("the model is on meta; Strata computes on the "
                                                  "CPU or on CUDA") != std::string::npos,
             "a model on the meta device refused: " + e.status().ToString());
    return Status::Ok();
  });
}

// A bf16 model of `blocks` frozen groups of `per_block` elements on `device`, through Create:
// the growth of the process's peak resident set over the model's bytes. The engine's own
// memory for a frozen group is its bf16 working shard (and, on a GPU, its pinned host
// mirror); a front end that made an fp32 copy of the model would add 2x the model.
Result<double> PeakGrowthOverModel(std::shared_ptr<comm::Communicator> comm,
                                   const torch::Device& device) {
  constexpr int kBlocks = 16;
  constexpr int64_t kPerBlock = int64_t{4} << 20;  // 8 MiB of bf16: 128 MiB in all
  std::vector<TensorGroup> groups(1 + 2 * kBlocks);
  groups[0].name = "root";
  for (int k = 0; k < kBlocks; ++k) {
    groups[1 + k].name = "block" + std::to_string(k);
    groups[1 + k].companion = 1 + kBlocks + k;
    TensorGroup& f = groups[1 + kBlocks + k];
    f.name = groups[1 + k].name + " (frozen)";
    f.frozen = true;
    f.params.push_back({"w" + std::to_string(k),
                        torch::full({kPerBlock}, 0.5,
                                    torch::TensorOptions().dtype(torch::kBFloat16).device(device)),
                        std::nullopt,
                        0,
                        {}});
  }
  Config c = SmallConfig();
  c.bf16 = true;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.strata.device_budget = 64ull << 20;
  const double model = static_cast<double>(kBlocks * kPerBlock * 2);
  ResetPeak();
  const uint64_t before = PeakRss();
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<TensorEngine> e,
                          TensorEngine::Create(std::move(groups), {}, c, Options(std::move(comm))));
  const uint64_t after = PeakRss();
  return (static_cast<double>(after) - static_cast<double>(before)) / model;
}

TEST(TensorEngineTest, InitialValuesOfABf16CpuModelAreReadWithoutAnFp32Copy) {
  RunTorchRanks(1, [](int, std::shared_ptr<comm::Communicator> comm) -> Status {
    STRATA_ASSIGN_OR_RETURN(const double growth, PeakGrowthOverModel(std::move(comm), torch::kCPU));
    // The working shards (1x, on the host tier) and a group's worth of temporaries; an fp32
    // copy of the model would be 2x more.
    TE_CHECK(growth < 1.5,
             "initialize raised the peak by " + std::to_string(growth) + "x the model's bytes");
    return Status::Ok();
  });
}

TEST(TensorEngineTest, InitialValuesOfABf16CudaModelAreCopiedAParameterAtATime) {
  if (!torch_testing::TorchCudaUsableInAChild()) {
    GTEST_SKIP() << "needs a CUDA device (LibTorch sees none)";
  }
  RunTorchRanks(1, [](int, std::shared_ptr<comm::Communicator>) -> Status {
    // A CUDA model needs NCCL beside gloo: both from the environment (one process).
    STRATA_ASSIGN_OR_RETURN(const double growth,
                            PeakGrowthOverModel(nullptr, torch::Device(torch::kCUDA, 0)));
    // The host tier's working shards (1x) and one parameter's host copy at a time; a host
    // copy of the whole model would be 1x more, an fp32 one 2x.
    TE_CHECK(growth < 1.5, "initialize raised the host's peak by " + std::to_string(growth) +
                               "x the model's bytes");
    return Status::Ok();
  });
}

}  // namespace
}  // namespace strata

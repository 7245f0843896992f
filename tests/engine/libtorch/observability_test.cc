// What a LibTorch front-end user sees of a run besides the results: the engine's
// phases and waits as profiler ranges (at::RecordFunction callbacks, as torch.profiler and
// the C++ autograd profiler install them), and DeepSpeed's monitors refused by name (the
// Python engine writes them).
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "strata/core/check.h"
#include "strata/core/config.h"
#include "strata/engine/libtorch/zero3.h"
#include "torch_ranks.h"

namespace strata {
namespace {

using torch_testing::OneThreadOptions;
using torch_testing::RunTorchRanks;
using torch_testing::SmallZero3Config;

constexpr int64_t kDim = 16;

// DeepSpeed's monitors are written by the Python engine; the C++ one refuses an
// enabled monitor by name before it binds anything (the model then trains under an engine
// without it).
TEST(MonitorTest, TheCppEngineRefusesAnEnabledMonitorBeforeBindingAnything) {
  RunTorchRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    auto model = std::make_shared<torch::nn::Module>();
    auto a = model->register_module("a", zero3(torch::nn::Linear(kDim, kDim)));
    for (const std::string monitor : {"csv_monitor", "tensorboard", "wandb"}) {
      Result<Config> c =
          ParseConfig(R"({"train_batch_size": 4, ")" + monitor + R"(": {"enabled": true}})");
      RK_CHECK(c.ok(), c.status());
      try {
        Engine e = initialize(model, *c, comm, OneThreadOptions());
        return InternalError(monitor + " was accepted");
      } catch (const std::exception& ex) {
        const std::string what = ex.what();
        RK_CHECK(what.find(monitor + ".enabled: the monitors are written by the Python engine") !=
                     std::string::npos,
                 what);
      }
    }
    // wall_clock_breakdown's lines too (Engine::timeline() has the phases).
    Result<Config> timings =
        ParseConfig(R"({"train_batch_size": 4, "wall_clock_breakdown": true})");
    RK_CHECK(timings.ok(), timings.status());
    try {
      Engine e = initialize(model, *timings, comm, OneThreadOptions());
      return InternalError("wall_clock_breakdown was accepted");
    } catch (const std::exception& ex) {
      const std::string what = ex.what();
      RK_CHECK(what.find("wall_clock_breakdown: the per-phase timing lines are written by the "
                         "Python engine") != std::string::npos,
               what);
    }
    Result<Config> off =
        ParseConfig(R"({"train_batch_size": 4, "csv_monitor": {"enabled": false}})");
    RK_CHECK(off.ok(), off.status());
    Engine e = initialize(model, *off, comm, OneThreadOptions());
    torch::Tensor loss = a->forward(torch::randn({4, kDim})).square().mean();
    e.backward(loss);
    e.step();
    return Status::Ok();
  });
}

// Under a RecordFunction callback of the user scope (what a profiler installs on its
// thread), backward and step are ranges "strata::backward" and "strata::step", and the
// engine's waits inside them ranges named as their timeline spans; none without one.
struct Seen {
  std::mutex mu;
  std::map<std::string, int> begun;
  std::map<std::string, int> ended;
};
Seen* seen = nullptr;

std::unique_ptr<at::ObserverContext> OnEnter(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(seen->mu);
  ++seen->begun[fn.name()];
  return nullptr;
}

void OnExit(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  std::lock_guard<std::mutex> lock(seen->mu);
  ++seen->ended[fn.name()];
}

TEST(ProfilerRangesTest, PhasesAndWaitsAreUserScopeRangesWhileObserved) {
  RunTorchRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    torch::manual_seed(0);
    auto model = std::make_shared<torch::nn::Module>();
    auto a = model->register_module("a", zero3(torch::nn::Linear(kDim, kDim)));
    auto b = model->register_module("b", zero3(torch::nn::Linear(kDim, kDim)));
    Engine e = initialize(model, SmallZero3Config(), comm, OneThreadOptions());
    auto train = [&](int steps) {
      for (int s = 0; s < steps; ++s) {
        torch::Tensor loss =
            b->forward(torch::tanh(a->forward(torch::randn({4, kDim})))).square().mean();
        e.backward(loss);
        e.step();
      }
    };
    train(1);
    Seen ranges;
    seen = &ranges;
    const at::CallbackHandle handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&OnEnter, &OnExit).scopes({at::RecordScope::USER_SCOPE}));
    train(2);
    at::removeCallback(handle);
    train(1);  // not observed
    seen = nullptr;
    RK_CHECK(ranges.begun["strata::backward"] == 2,
             "strata::backward x" << ranges.begun["strata::backward"]);
    RK_CHECK(ranges.begun["strata::step"] == 2, "strata::step x" << ranges.begun["strata::step"]);
    RK_CHECK(ranges.begun["strata::all-gather wait"] > 0, "no strata::all-gather wait range");
    for (const auto& [name, n] : ranges.begun) {
      RK_CHECK(name.rfind("strata::", 0) == 0, "a user-scope range not Strata's: " << name);
      RK_CHECK(ranges.ended[name] == n,
               name << ": " << n << " begun, " << ranges.ended[name] << " ended");
    }
    return Status::Ok();
  });
}

}  // namespace
}  // namespace strata

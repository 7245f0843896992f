// The native half of strata.initialize: the TensorEngine (engine/libtorch/tensor_engine.h),
// the one LibTorch layer both front ends share, bound for Python. Tensors cross as
// torch.Tensor through LibTorch's pybind11 caster; every call into the engine runs without
// the GIL (a collective may wait for other ranks; the engine calls no Python but the
// torch.distributed store, which takes the GIL itself). What Python keeps — the module
// hooks, the torch.compile guard, its own RNG and pickles, monitors, the Hugging Face path —
// is bindings/python/strata/.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "errors.h"
#include "strata/engine/libtorch/tensor_engine.h"

namespace strata_py {

struct TestFault;  // py_engine.cc: STRATA_TEST_FAIL_UPDATE_READ

// (name, tensor, shape or None when the tensor holds the values, optimizer group, aliases)
using PyParam = std::tuple<std::string, torch::Tensor, std::optional<std::vector<int64_t>>, int,
                           std::vector<std::string>>;
// (name, frozen, companion, parameters)
using PyGroup = std::tuple<std::string, bool, int, std::vector<PyParam>>;
// (name, tensor, is a parameter the engine does not manage, aliases): a tensor kept whole
using PyWhole = std::tuple<std::string, torch::Tensor, bool, std::vector<std::string>>;

// What the Python engine needs to meet its ranks: a torch.distributed store (None:
// torchrun's environment), the prefix of its keys, and the ranks.
struct PyRendezvous {
  pybind11::object store;
  std::string prefix;
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
};

class PyEngine {
 public:
  PyEngine(const std::string& config_json, const std::vector<PyGroup>& groups,
           const std::vector<torch::Tensor>& follow_device, const PyRendezvous& rendezvous,
           bool prefetch, double timeout_s,
           const std::vector<std::map<std::string, std::optional<double>>>& param_groups,
           const std::string& front_end_check);
  ~PyEngine();
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  strata::TensorEngine& engine();
  strata::engine::EngineCore& core();
  strata::engine::HookProtocol& hooks();
  void CheckGroup(int g);

  // f() without the GIL; its Status (or Result) raised as a Python exception.
  template <typename F>
  auto Call(F&& f) {
    using R = decltype(f());
    if constexpr (std::is_same_v<R, strata::Status>) {
      strata::Status s;
      {
        pybind11::gil_scoped_release release;
        s = f();
      }
      Check(s);
    } else {
      std::optional<R> r;
      {
        pybind11::gil_scoped_release release;
        r.emplace(f());
      }
      return ValueOrThrow(std::move(*r));
    }
  }

  pybind11::dict Step();
  std::string SaveCheckpoint(const std::string& dir, const std::string& tag,
                             const std::vector<std::pair<std::string, pybind11::bytes>>& blobs,
                             const std::vector<PyWhole>& whole, bool exclude_frozen_parameters);
  pybind11::dict LoadCheckpoint(const std::string& dir, const std::string& tag,
                                bool load_optimizer_states, bool load_lr_scheduler_states,
                                bool load_module_only, bool check_frozen_parameters,
                                const std::vector<PyWhole>& whole);
  pybind11::dict SaveModel(const std::string& dir, const std::string& filename,
                           uint64_t max_file_bytes,
                           const std::vector<std::vector<std::string>>& names,
                           const std::vector<std::pair<std::string, torch::Tensor>>& whole,
                           const std::vector<std::pair<std::string, std::string>>& files);
  pybind11::dict Layout(int g);
  // Also the destructor's (idempotent). Called with the GIL.
  void Close();

 private:
  strata::Status ArmTestFault(strata::engine::EngineOptions& options, int rank);

  std::shared_ptr<strata::TensorEngine> engine_;
  std::shared_ptr<TestFault> test_fault_;
};

std::vector<strata::WholeTensor> ToWhole(const std::vector<PyWhole>& whole);

}  // namespace strata_py

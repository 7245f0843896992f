// The LibTorch front end's state behind strata::Engine (internal to engine/libtorch/): the
// model, its strata::zero3 holders and the groups they form, over the TensorEngine
// (tensor_engine.h), which binds the parameter tensors and drives the hook protocol for both
// front ends. zero3.h is the public contract.
//
// Files: engine_state.cc (the holders' hooks, the Engine handle and its calls), build.cc
// (initialize's phases: holders, groups, partitioned shapes), zero_init.cc (partitioned
// construction).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine/libtorch/tensor_engine.h"
#include "strata/engine/libtorch/zero3.h"

namespace strata::detail {

[[noreturn]] void Throw(Status s);
inline void Check(Status s) {
  if (!s.ok()) Throw(std::move(s));
}
template <typename T>
T Value(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(r).value();
}
// A gloo communicator from torchrun's environment (world size 1 without it; build.cc);
// errors name `who`.
std::unique_ptr<comm::Communicator> GlooFromEnvironment(const char* who);

// Floats in pages of their own (anonymous mmap), returned to the system when freed: the
// broadcast buffer and the shards of partitioned construction stay off the malloc heap, so
// what the heap holds between blocks is the blocks' own freed tensors, which malloc_trim
// gives back (zero_init.cc).
class MappedFloats {
 public:
  MappedFloats() = default;
  explicit MappedFloats(size_t n);
  ~MappedFloats();
  MappedFloats(const MappedFloats&) = delete;
  MappedFloats& operator=(const MappedFloats&) = delete;
  MappedFloats(MappedFloats&& o) noexcept : data_(std::exchange(o.data_, nullptr)), n_(o.n_) {}
  MappedFloats& operator=(MappedFloats&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(n_, o.n_);
    return *this;
  }
  float* data() { return data_; }
  size_t size() const { return n_; }
  std::span<const float> span() const { return {data_, data_ == nullptr ? 0 : n_}; }

 private:
  float* data_ = nullptr;
  size_t n_ = 0;
};

// A holder's parameters as partitioned construction left them (ZeroInit): their names,
// shapes and this rank's shard of the padded flat group.
struct PartitionedParams {
  std::vector<std::string> names;  // as holder->named_parameters() gives them
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> numels;
  MappedFloats shard;
};

struct PartitionedGroup {
  PartitionedParams trainable;
  PartitionedParams frozen;  // the holder's frozen group (requires_grad false)
  std::shared_ptr<comm::Communicator> comm;
  size_t align_elems = 0;
  int world_size = 1;
  int rank = 0;
};

class EngineState {
 public:
  EngineState() = default;
  EngineState(const EngineState&) = delete;
  EngineState& operator=(const EngineState&) = delete;

  // initialize (build.cc).
  static std::shared_ptr<EngineState> Build(std::shared_ptr<torch::nn::Module> model,
                                            const Config& config,
                                            std::shared_ptr<comm::Communicator> comm,
                                            const engine::EngineOptions& options);

  TensorEngine& engine() { return *engine_; }
  engine::EngineCore& core() { return *Value(engine_->core()); }

  // The holders' calls (engine_state.cc).
  void HolderBeginForward(int g);
  void HolderEndForward(int g, bool throw_errors);

  void Backward(const torch::Tensor& loss);
  engine::StepOutcome Step();
  void BeginEval();
  void EndEval();

  void LoadSafetensors(const std::string& path);
  std::string SaveCheckpoint(const std::string& dir, const std::string& tag,
                             const std::string& client_state, const SaveCheckpointOptions& options);
  LoadedCheckpoint LoadCheckpoint(const std::string& dir, const std::string& tag,
                                  const LoadCheckpointOptions& options);
  torch::OrderedDict<std::string, torch::Tensor> GatherParameters();
  engine::SaveModelResult SaveModel(const std::string& dir, const std::string& filename,
                                    uint64_t max_shard_bytes);

 private:
  // build.cc: initialize's phases, in order.
  void FindHolders();
  std::vector<TensorGroup> PlanGroups(const engine::EngineOptions& options);
  std::shared_ptr<comm::Communicator> TakePartitionedShapes(std::vector<TensorGroup>& groups,
                                                            const engine::EngineOptions& options);
  void CheckPartitionedRanks(const std::shared_ptr<comm::Communicator>& comm) const;

  // The name a file saved from the plain model (without strata::zero3) gives a tensor
  // inside a holder ("" outside holders).
  std::string Unwrapped(const std::string& name) const;
  // The buffers, which every rank keeps whole.
  std::vector<WholeTensor> Buffers() const;

  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<TensorEngine> engine_;
  std::vector<std::pair<std::string, std::shared_ptr<Zero3ModuleBase>>> holders_;
};

}  // namespace strata::detail

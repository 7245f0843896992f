// The LibTorch front end's state behind strata::Engine (internal to engine/libtorch/): the
// model's parameter tensors bound to the engine, the hook protocol they are driven by
// (engine/protocol/hook_protocol.h) and the core. zero3.h is the public contract.
//
// How parameter tensors follow the gathered buffers: every managed parameter gets its own
// c10::Storage, created at initialize and kept for the engine's life. The parameter tensor is
// set (set_data, which does not bump the version counter) onto that storage. Pointing the
// parameter at a gathered buffer swaps the storage's data pointer (no copy); emptying it
// sets the data pointer to null and the tensor's sizes to {0}. Views that autograd saved in
// the forward (weight.t() of a linear, say) share the storage object, so after the
// pre-backward re-gather they see the re-gathered values too, wherever the buffer landed.
//
// Files: engine_state.cc (the hooks, the autograd functions, the Engine handle), build.cc
// (initialize's phases), zero_init.cc (partitioned construction), torch_checkpoint.cc
// (checkpoints, safetensors, gathering the parameters).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine/libtorch/zero3.h"
#include "strata/engine/protocol/hook_protocol.h"

namespace strata::detail {

[[noreturn]] void Throw(Status s);
inline void Check(Status s) {
  if (!s.ok()) Throw(std::move(s));
}
engine::DType DTypeOf(c10::ScalarType t);
// A tensor of `dtype` and `shape` on `storage` (its data pointer as it is).
torch::Tensor OnStorage(const c10::Storage& storage, c10::ScalarType dtype, c10::IntArrayRef shape);
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

struct ParamBinding {
  std::string name;  // as in model->named_parameters()
  torch::Tensor param;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  c10::ScalarType compute = c10::ScalarType::Float;
  c10::Storage storage;
  std::shared_ptr<torch::autograd::Node> accumulator;
};

struct GroupBinding {
  std::string name;
  std::vector<ParamBinding> params;
  bool frozen = false;
  int companion = -1;  // the frozen group gathered with this one
  int owner = -1;      // a frozen group: the group it is gathered with
};

class EngineState : public std::enable_shared_from_this<EngineState>,
                    private engine::ParameterTensors {
 public:
  EngineState();
  ~EngineState() override;
  EngineState(const EngineState&) = delete;
  EngineState& operator=(const EngineState&) = delete;

  // initialize (build.cc).
  static std::shared_ptr<EngineState> Build(std::shared_ptr<torch::nn::Module> model,
                                            const Config& config,
                                            std::shared_ptr<comm::Communicator> comm,
                                            const engine::EngineOptions& options);

  int64_t id() const { return id_; }
  engine::EngineCore& core() { return *core_; }
  bool ExpectInputs(int g, bool recompute) { return hooks_->ExpectInputs(g, recompute); }

  // The holders' and the autograd functions' calls (engine_state.cc).
  void HolderBeginForward(int g);
  void HolderEndForward(int g, bool throw_errors);
  void OnPreBackward(int g);
  void OnGradient(int g, int i);
  // The gradient reached the inputs of group g, which has frozen parameters.
  void OnPostBackward(int g);

  void Backward(const torch::Tensor& loss);
  engine::StepOutcome Step();
  void BeginEval();
  void EndEval();

  // torch_checkpoint.cc.
  void LoadSafetensors(const std::string& path);
  std::string SaveCheckpoint(const std::string& dir, const std::string& tag,
                             const std::string& client_state, const SaveCheckpointOptions& options);
  LoadedCheckpoint LoadCheckpoint(const std::string& dir, const std::string& tag,
                                  const LoadCheckpointOptions& options);
  torch::OrderedDict<std::string, torch::Tensor> GatherParameters();
  engine::SaveModelResult SaveModel(const std::string& dir, const std::string& filename,
                                    uint64_t max_shard_bytes);
  // strata::GatheredParameters (torch_checkpoint.cc): the parameters made whole, returning
  // those this call gathered as (group, param); and given back, `modifier`'s changes
  // written into every rank's master and shards. Collective.
  std::vector<std::pair<int, int>> GatherWhole(const std::vector<torch::Tensor>& params);
  void ReleaseWhole(const std::vector<std::pair<int, int>>& held, std::optional<int> modifier);

 private:
  // engine::ParameterTensors, for the protocol.
  Status Point(int group, std::span<std::byte* const> data) override;
  Status Empty(int group) override;
  Status DropGradients() override;

  // build.cc: initialize's phases, in order.
  void FindHolders();
  void PlanGroups();
  std::shared_ptr<comm::Communicator> TakePartitionedShapes(const engine::EngineOptions& options);
  void MakeCommunicators(const Config& config, std::shared_ptr<comm::Communicator>& comm,
                         engine::EngineOptions& options);
  void PrepareCuda(const Config& config, std::shared_ptr<comm::Communicator>& comm,
                   engine::EngineOptions& options);
  void CreateCore(const Config& config, std::shared_ptr<comm::Communicator> comm,
                  const engine::EngineOptions& options);
  void BindTensors();
  // Makes the engine reachable from autograd nodes by id (LookupEngine).
  void Register();
  // On CUDA: LibTorch's current stream on the engine's device becomes its compute stream
  // (build.cc; called at each forward hook, backward hook and gradient).
  Status FollowComputeStream();

  // The tensors this front end keeps whole (the buffers), by the blob name a checkpoint
  // keeps them under (torch_checkpoint.cc).
  std::vector<std::pair<std::string, torch::Tensor>> WholeTensors() const;

  int64_t id_;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<engine::EngineCore> core_;
  std::unique_ptr<engine::HookProtocol> hooks_;
  std::vector<GroupBinding> groups_;
  std::vector<std::pair<std::string, std::shared_ptr<Zero3ModuleBase>>> holders_;
  // Parameters a strata::GatheredParameters holds whole: what they held before, the values
  // given (a copy, to see what changed) and their fp32 master.
  struct Whole {
    torch::Tensor saved, given, master;
  };
  std::map<std::pair<int, int>, Whole> whole_;
  c10::Device device_{c10::kCPU};
};

// The engine with id `id`, if it still exists (autograd nodes may outlive it).
std::shared_ptr<EngineState> LookupEngine(int64_t id);

// The post-hook on parameter (g, i)'s gradient accumulator (engine_state.cc).
std::unique_ptr<torch::autograd::FunctionPostHook> MakeGradHook(std::weak_ptr<EngineState> state,
                                                                int group, int param);

}  // namespace strata::detail

// TensorEngine: the one LibTorch layer under both front ends. It takes plain torch::Tensors
// with their names and groups — not modules — and does, for the C++ front end
// (strata::initialize, zero3.h) and the Python one (strata.initialize, through _strata) alike:
//
//   - the compute device (strata.device against where the parameters are) and the
//     communicators for it (gloo, or NCCL and gloo on CUDA; the lanes on several ranks);
//   - the initial values, read from the tensors' own memory (no fp32 copy of a 16-bit model;
//     a CUDA model's copied to the host one parameter at a time), or a partitioned shard,
//     or zeros until a load;
//   - the parameters bound to the engine: each gets a storage of its own whose data pointer
//     the hook protocol (engine/protocol/hook_protocol.h) points at the gathered buffer and
//     empties again (views autograd saved in the forward share that storage, so they see the
//     buffer re-gathered for the backward); a hook on each trainable parameter's gradient
//     accumulator hands the gradient to the engine and frees it;
//   - the autograd functions around a block's outputs (re-gather before its backward) and
//     the inputs of a block with frozen parameters (its backward is over);
//   - checkpoints: the whole tensors (buffers, parameters the engine does not manage) as
//     blobs, torch's CPU and CUDA generators, the front end's own blobs beside them;
//     safetensors loading, gathering the parameters, the model in Hugging Face's layout,
//     parameters made whole for a while (GatheredParameters).
//
// What stays in a front end: which tensors form which group (modules, holders, the
// construction under ZeroInit / zero.Init), the module hooks that call BeginForward and
// EndForward, its own exceptions, and what is its language's (Python's RNG, monitors).
//
// Errors: Status/Result, with the front end's names in the messages (TensorEngineOptions);
// the autograd functions' backward throws strata::Error (autograd needs an exception).
// Thread-safety: the hooks may be called from several autograd threads (the protocol
// serializes them); everything else from one thread at a time. No Python is called: the
// Python bindings release the GIL around every call.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/protocol/hook_protocol.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/runtime/save_model.h"

namespace strata {

// A parameter the engine manages. After Create, `tensor` is bound to the engine (its original
// memory is freed; it computes in the working dtype on the compute device).
struct TensorParam {
  std::string name;  // as the model names it (messages, checkpoints, files)
  torch::Tensor tensor;
  // The parameter's shape when `tensor` holds no values (built partitioned, or on the meta
  // device): its initial values are then the group's `init_shard`, or zeros until a load.
  // Empty: `tensor` holds the values and its sizes are the shape.
  std::optional<std::vector<int64_t>> shape;
  int param_group = 0;  // index into EngineOptions::param_groups
  // Other names a file may give it (tied weights, a name without a holder's ".inner").
  std::vector<std::string> aliases;
};

// One of the engine's groups (engine/protocol/groups.h plans them).
struct TensorGroup {
  std::string name;
  bool frozen = false;
  int companion = -1;  // the frozen group gathered with this one
  std::vector<TensorParam> params;
  // Partitioned construction (strata::ZeroInit): this rank's shard of the padded flat group,
  // read during Create only; the parameters then give `shape`.
  std::optional<std::span<const float>> init_shard;
};

// A tensor every rank keeps whole, by the name the model gives it: a buffer, or a parameter
// the engine does not manage (Python: requires grad but left out of model_parameters).
struct WholeTensor {
  std::string name;
  torch::Tensor tensor;
  bool parameter = false;
  std::vector<std::string> aliases;  // other names in a safetensors file
};

struct TensorEngineOptions {
  // The engine's options; the device and the communicators left null are made here.
  engine::EngineOptions engine;
  // The engine's communicator (null: made from `rendezvous`). A CUDA model needs NCCL (with
  // engine.host_comm a gloo one), the CPU device gloo.
  std::shared_ptr<comm::Communicator> comm;
  // The ranks to meet when `comm` is null (a torch.distributed store, say); nullopt:
  // torchrun's environment (one process without it).
  std::optional<comm::Rendezvous> rendezvous;
  std::chrono::milliseconds comm_timeout{std::chrono::minutes(5)};
  // How messages name the front end: the protocol's names, the initialize call and the
  // GatheredParameters object.
  engine::FrontEndNames names{"", "Engine::"};
  std::string caller = "strata::initialize";
  std::string gathered = "strata::GatheredParameters";
  // A check the front end made on this rank alone before Create (Python: opening the
  // monitors): agreed on as soon as the communicators are made, before any tensor is taken; a
  // failure on any rank fails Create on every rank, each naming it.
  Status front_end_check = Status::Ok();
  // Tests: called once the tensors are bound, before the root group is taken; its error fails
  // Create there (what Create leaves behind when it fails late).
  std::function<Status()> test_after_binding = nullptr;
};

class TensorEngine : public std::enable_shared_from_this<TensorEngine>,
                     private engine::ParameterTensors {
 public:
  // Every rank calls it with the same groups. `follow_device`: tensors that move to the
  // compute device when it is a GPU (the buffers, parameters the engine does not manage).
  // The root group is held from here on (HookProtocol::Start). A trainable group's tensors
  // must require grad. When it fails, every tensor is as it was (its data, gradient and
  // device; no hook left). The tensors' original memory is freed when it returns.
  static Result<std::shared_ptr<TensorEngine>> Create(
      std::vector<TensorGroup> groups, const std::vector<torch::Tensor>& follow_device,
      const Config& config, TensorEngineOptions options);
  ~TensorEngine() override;
  TensorEngine(const TensorEngine&) = delete;
  TensorEngine& operator=(const TensorEngine&) = delete;

  // FailedPrecondition after Close().
  Result<engine::EngineCore*> core();
  Result<engine::HookProtocol*> protocol();
  int64_t id() const { return id_; }
  c10::Device device() const { return device_; }
  c10::ScalarType compute_dtype() const { return compute_; }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  const TensorGroup& group(int g) const { return groups_[static_cast<size_t>(g)]; }
  // The shape of parameter (g, i).
  const std::vector<int64_t>& shape(int g, int i) const;
  // (group, index) of a managed parameter, by its TensorImpl.
  std::optional<std::pair<int, int>> Find(const torch::Tensor& t) const;

  // --- hooks (tensor_hooks.cc)
  // A block's forward: before it and after it (`unwinding`: it raised). Recompute (a forward
  // inside a backward: activation checkpointing) is recognized here.
  Status BeginForward(int g);
  Status EndForward(int g, bool unwinding);
  // The block's outputs that require grad through the function that re-gathers g before
  // its gradient functions run (identity without grad mode or in a recompute).
  std::vector<torch::Tensor> WrapOutputs(int g, std::vector<torch::Tensor> outputs);
  // A block with frozen parameters: its inputs that require grad through the function that
  // tells the protocol when their gradients are computed, when the protocol expects it.
  std::vector<torch::Tensor> WrapInputs(int g, std::vector<torch::Tensor> inputs);
  // engine.backward(loss): checks the loss and returns it times the loss multiplier; the
  // front end runs autograd on that, then FinishBackward, or AutogradFailed if it threw.
  Result<torch::Tensor> BeginBackward(const torch::Tensor& loss);
  Status FinishBackward();
  Status AutogradFailed(const std::string& what);
  // On CUDA: LibTorch's current stream on the compute device is the engine's compute stream.
  Status FollowComputeStream();

  // --- between steps (tensor_io.cc); collective
  Result<std::string> SaveCheckpoint(engine::CheckpointSaveRequest request,
                                     const std::vector<WholeTensor>& whole);
  // Restores the whole tensors and (unless load_module_only) torch's generators; the result's
  // blobs hold the rest (the client state, the front end's own).
  Result<engine::CheckpointLoadResult> LoadCheckpoint(engine::CheckpointLoadRequest request,
                                                      const std::vector<WholeTensor>& whole);
  // Parameters from safetensors files; `whole`: the parameters are required, the
  // floating-point buffers optional, the others left alone. `optional`: names of managed
  // parameters the files may lack (kept as they are then).
  Status LoadSafetensors(const std::string& path, const std::vector<WholeTensor>& whole,
                         const std::vector<std::string>& optional = {});
  // The fp32 master values of `params` (named, in the model's order): a managed one
  // gathered, another one as it is on the host, in fp32.
  Result<std::vector<torch::Tensor>> GatherParameters(const std::vector<torch::Tensor>& params);
  // The model in Hugging Face's layout: `names[g][i]`, parameter (g, i)'s name in the files
  // ("" leaves it out); `whole`, what rank 0 writes as it is.
  Result<engine::SaveModelResult> SaveModel(
      engine::SaveModelRequest request, const std::vector<std::vector<std::string>>& names,
      const std::vector<std::pair<std::string, torch::Tensor>>& whole);
  // GatheredParameters: `params` made whole (the managed ones no other call holds), in the
  // working dtype on the compute device; returns those this call gathered. Given back, the
  // modifier rank's changes are written into every rank's master and shards (elements it left
  // unchanged keep their fp32 master); without one, changes are dropped.
  Result<std::vector<std::pair<int, int>>> GatherWhole(const std::vector<torch::Tensor>& params);
  Status ReleaseWhole(const std::vector<std::pair<int, int>>& held, std::optional<int> modifier);
  bool holds_whole() const { return !whole_.empty(); }
  // A model built partitioned (Python's zero.Init): the engine's shards from every rank's
  // parts, `parts[k]` this rank's part of parameter which[k] (any floating dtype).
  Status AssembleParameters(const Status& local_check,
                            const std::vector<std::pair<int, size_t>>& which,
                            const std::vector<torch::Tensor>& parts);

  // Empties the parameters (their storage leaves the engine's), removes the gradient hooks
  // and destroys the protocol, the core and the communicators. Idempotent.
  void Close();

 private:
  struct Bound {
    std::vector<int64_t> shape;
    int64_t numel = 0;
    c10::Storage storage;
    std::shared_ptr<torch::autograd::Node> accumulator;
    torch::autograd::FunctionPostHook* hook = nullptr;
  };
  // A tensor as Create found it (its data and gradient), put back when Create fails.
  struct Found {
    torch::Tensor tensor, data, grad;
  };
  // GatheredParameters' parameters: what they held, the values given (to see what changed)
  // and their fp32 master.
  struct Whole {
    torch::Tensor saved, given, master;
  };
  friend struct TensorEngineAccess;  // tensor_hooks.cc: the autograd functions and the hook

  TensorEngine(std::vector<TensorGroup> groups, TensorEngineOptions options);
  // tensor_engine.cc: Create's phases.
  Status ChooseDevice(const Config& config);
  Status MakeCommunicators(const Config& config);
  Status AgreeOnFrontEndCheck();
  Status PrepareCuda(const Config& config, const std::vector<torch::Tensor>& follow_device);
  Status CreateCore(const Config& config);
  Status BindTensors();
  // Create failed: every tensor it changed as it found it, the gradient hooks removed.
  void Restore();
  // Out of the registry, the gradient hooks removed, the protocol, the core and the
  // communicators gone (Close and Restore; the tensors are theirs to leave).
  void Unbind();
  void Register();

  // engine::ParameterTensors, for the protocol.
  Status Point(int group, std::span<std::byte* const> data) override;
  Status Empty(int group) override;
  Status DropGradients() override;

  // tensor_hooks.cc: the gradient hook of parameter (g, i), and what the autograd functions
  // and that hook call.
  std::unique_ptr<torch::autograd::FunctionPostHook> MakeGradHook(int g, int i);
  void OnPreBackward(int g);
  void OnPostBackward(int g);
  void OnGradient(int g, int i);

  const int64_t id_;
  TensorEngineOptions options_;
  std::vector<TensorGroup> groups_;
  std::vector<std::vector<Bound>> bound_;
  c10::Device device_{c10::kCPU};
  c10::ScalarType compute_ = c10::ScalarType::Float;
  std::shared_ptr<comm::Communicator> comm_;
  std::unique_ptr<engine::EngineCore> core_;
  std::unique_ptr<engine::HookProtocol> hooks_;
  std::map<std::pair<int, int>, Whole> whole_;
  std::vector<Found> found_;  // during Create only
};

// The engine with id `id`, if it still exists (autograd nodes may outlive it).
std::shared_ptr<TensorEngine> LookupTensorEngine(int64_t id);

// A dtype as torch names it: "torch.float64", "torch.bfloat16", ...
std::string TorchDTypeName(c10::ScalarType t);
// The engine's working dtype as LibTorch's.
c10::ScalarType TorchDTypeOf(engine::DType t);
engine::DType EngineDTypeOf(c10::ScalarType t);

}  // namespace strata

// The LibTorch front end's hooks and autograd functions over the hook protocol, and the
// strata::Engine handle (engine_state.h says how the tensors follow the buffers).
#include "strata/engine/libtorch/engine_state.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include <atomic>
#include <unordered_map>

#include "strata/core/logging.h"
#include "strata/engine/libtorch/torch_internal.h"

namespace strata {

Error::Error(Status status) : std::runtime_error(status.message()), status_(std::move(status)) {}

namespace detail {

void Throw(Status s) {
  throw Error(std::move(s));
}

engine::DType DTypeOf(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16:
      return engine::DType::kBFloat16;
    case c10::ScalarType::Half:
      return engine::DType::kFloat16;
    default:
      return engine::DType::kFloat32;
  }
}

namespace {

using torch::autograd::variable_list;

// Engines reachable from autograd nodes (which may outlive them): id -> engine.
std::mutex g_registry_mu;
std::unordered_map<int64_t, std::weak_ptr<EngineState>>& Registry() {
  static auto* registry = new std::unordered_map<int64_t, std::weak_ptr<EngineState>>();
  return *registry;
}
std::atomic<int64_t> g_next_id{1};

// Whether autograd is running a backward pass on this thread: a holder's forward then is
// activation checkpointing's recompute.
bool InRecompute() {
  return torch::autograd::get_current_graph_task_id() != -1;
}

// The identity on tensors around a holder whose backward calls `Hook` on the engine with
// the group: on its outputs, OnPreBackward (re-gather the group before the holder's
// gradient functions run); on the inputs of a holder with frozen parameters,
// OnPostBackward (its backward is over once the inputs' gradients are computed).
template <void (EngineState::*Hook)(int)>
struct GroupIdentityFunction : public torch::autograd::Function<GroupIdentityFunction<Hook>> {
  static variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                               int64_t engine_id, int64_t group) {
    ctx->saved_data["engine"] = engine_id;
    ctx->saved_data["group"] = group;
    return tensors.vec();
  }
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    std::shared_ptr<EngineState> state = LookupEngine(ctx->saved_data["engine"].toInt());
    if (state == nullptr) {
      Throw(FailedPreconditionError(
          "strata::zero3: backward through a wrapped module whose engine was destroyed"));
    }
    ((*state).*Hook)(static_cast<int>(ctx->saved_data["group"].toInt()));
    grads.emplace_back();  // engine_id
    grads.emplace_back();  // group
    return grads;
  }
};
using PreBackwardFunction = GroupIdentityFunction<&EngineState::OnPreBackward>;
using PostBackwardFunction = GroupIdentityFunction<&EngineState::OnPostBackward>;

class GradHook final : public torch::autograd::FunctionPostHook {
 public:
  GradHook(std::weak_ptr<EngineState> state, int group, int param)
      : state_(std::move(state)), group_(group), param_(param) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (auto s = state_.lock()) s->OnGradient(group_, param_);
    return outputs;
  }

 private:
  std::weak_ptr<EngineState> state_;
  int group_;
  int param_;
};

}  // namespace

torch::Tensor OnStorage(const c10::Storage& storage, c10::ScalarType dtype,
                        c10::IntArrayRef shape) {
  torch::NoGradGuard no_grad;
  return torch::empty({0}, torch::TensorOptions().dtype(dtype).device(storage.device()))
      .set_(storage, 0, shape, {});
}

std::shared_ptr<EngineState> LookupEngine(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second.lock();
}

std::unique_ptr<torch::autograd::FunctionPostHook> MakeGradHook(std::weak_ptr<EngineState> state,
                                                                int group, int param) {
  return std::make_unique<GradHook>(std::move(state), group, param);
}

EngineState::EngineState() : id_(g_next_id.fetch_add(1)) {}

EngineState::~EngineState() {
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    Registry().erase(id_);
  }
  // The tensors outlive the engine: leave none pointing into its buffers.
  for (size_t g = 0; g < groups_.size(); ++g)
    (void)Empty(static_cast<int>(g));  // cannot fail: only pointers and sizes change
}

void EngineState::Register() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry()[id_] = weak_from_this();
}

// ---------------------------------------------------------------------------
// The tensors (engine::ParameterTensors)

Status EngineState::Point(int g, std::span<std::byte* const> data) {
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  try {
    for (size_t i = 0; i < gb.params.size(); ++i) {
      ParamBinding& p = gb.params[i];
      torch_internal::PointStorage(p.storage.unsafeGetStorageImpl(), data[i],
                                   static_cast<size_t>(p.numel) * c10::elementSize(p.compute));
      p.param.set_data(OnStorage(p.storage, p.compute, p.shape));
    }
  } catch (const std::exception& e) {
    return InternalError("pointing " + gb.name +
                         "'s parameters at the gathered buffer: " + e.what());
  }
  return Status::Ok();
}

Status EngineState::Empty(int g) {
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  try {
    for (ParamBinding& p : gb.params) {
      if (!p.storage) continue;  // initialize failed before the storage was made
      torch_internal::PointStorage(p.storage.unsafeGetStorageImpl(), nullptr, 0);
      p.param.set_data(OnStorage(p.storage, p.compute, {0}));
    }
  } catch (const std::exception& e) {
    return InternalError("emptying " + gb.name + "'s parameters: " + e.what());
  }
  return Status::Ok();
}

Status EngineState::DropGradients() {
  for (GroupBinding& gb : groups_) {
    for (ParamBinding& p : gb.params)
      if (p.param.grad().defined()) p.param.mutable_grad() = torch::Tensor();
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Hooks

void EngineState::HolderBeginForward(int g) {
  if (!whole_.empty()) {
    Throw(FailedPreconditionError(
        "strata: a forward while a strata::GatheredParameters lives: release it first (the "
        "engine gathers what a forward uses by itself)"));
  }
  Check(FollowComputeStream());
  Check(hooks_->BeginForward(g, InRecompute()));
}

void EngineState::HolderEndForward(int g, bool throw_errors) {
  Status s = hooks_->EndForward(g, InRecompute(), /*unwinding=*/!throw_errors);
  if (throw_errors) Check(std::move(s));
}

void EngineState::OnPreBackward(int g) {
  Check(FollowComputeStream());
  Check(hooks_->PreBackward(g));
}

void EngineState::OnPostBackward(int g) {
  (void)hooks_->PostBackward(g);  // kept by the protocol, thrown by the backward
}

void EngineState::OnGradient(int g, int i) {
  ParamBinding& p = groups_[static_cast<size_t>(g)].params[static_cast<size_t>(i)];
  torch::Tensor grad = p.param.grad();
  if (!grad.defined()) return;
  if (grad.is_sparse()) {
    hooks_->Keep(UnimplementedError("strata: sparse gradient of parameter " + p.name +
                                    " (use a dense embedding)"));
    return;
  }
  grad = grad.contiguous();
  if (Status followed = FollowComputeStream(); !followed.ok()) {
    hooks_->Keep(followed);
    return;
  }
  // The engine reads the gradient on its compute stream. A CUDA gradient is LibTorch's
  // caching allocator's, which reuses it only in the order of the stream it was made on
  // (the compute stream); a CPU gradient is kept alive until the read ran.
  std::shared_ptr<const void> owner;
  if (!grad.is_cuda()) owner = std::make_shared<const torch::Tensor>(grad);
  // An error is kept by the protocol and thrown by Backward (autograd's post-hooks do not
  // throw into the autograd engine here).
  (void)hooks_->Gradient(g, i, grad.data_ptr(), DTypeOf(grad.scalar_type()), std::move(owner));
  p.param.mutable_grad() = torch::Tensor();
}

void EngineState::Backward(const torch::Tensor& loss) {
  Check(FollowComputeStream());
  Check(hooks_->BeginBackward());
  if (!loss.defined() || loss.numel() != 1) {
    Throw(InvalidArgumentError("Engine::backward: the loss must be a tensor of one element"));
  }
  if (!loss.requires_grad()) {
    Throw(InvalidArgumentError(
        "Engine::backward: the loss does not require grad (computed under NoGradGuard, or "
        "from no parameter)"));
  }
  const torch::Tensor scaled = loss * core_->LossMultiplier();
  try {
    scaled.backward();
  } catch (const std::exception& e) {
    Check(hooks_->AutogradFailed(e.what()));  // a hook's error is the first
    throw;
  }
  Check(hooks_->FinishBackward());
}

engine::StepOutcome EngineState::Step() {
  Result<engine::StepOutcome> r = hooks_->Step();
  if (!r.ok()) Throw(r.status());
  return *r;
}

void EngineState::BeginEval() {
  Check(hooks_->BeginEval());
}

void EngineState::EndEval() {
  Check(hooks_->EndEval());
}

}  // namespace detail

// ---------------------------------------------------------------------------
// The holder

namespace detail {

Zero3ModuleBase::Zero3ModuleBase(std::string inner_name)
    : torch::nn::Module("strata::Zero3"), inner_name_(std::move(inner_name)) {}

void Zero3ModuleBase::BeginForward() {
  std::shared_ptr<EngineState> state = state_.lock();
  if (state == nullptr) {
    Throw(FailedPreconditionError(
        "strata::zero3(" + inner_name_ +
        "): wrapped module used outside the engine: its parameters belong to a ZeRO-3 "
        "engine; call strata::initialize(model, config) on the model that holds it (and "
        "keep the strata::Engine alive) before its forward"));
  }
  state->HolderBeginForward(group_);
}

void Zero3ModuleBase::EndForward(bool throw_errors) {
  if (std::shared_ptr<EngineState> state = state_.lock()) {
    state->HolderEndForward(group_, throw_errors);
  }
}

torch::Tensor Zero3ModuleBase::WrapInput(const torch::Tensor& input) {
  if (!input.defined() || !input.requires_grad() || !torch::GradMode::is_enabled()) return input;
  std::shared_ptr<EngineState> state = state_.lock();
  if (state == nullptr || !state->ExpectInputs(group_, InRecompute())) return input;
  return PostBackwardFunction::apply(at::TensorList(input), state->id(), int64_t{group_})[0];
}

std::vector<torch::Tensor> Zero3ModuleBase::WrapOutputs(std::vector<torch::Tensor> outputs) {
  // A recompute's outputs need no re-gather in their backward: the group is gathered.
  if (!torch::GradMode::is_enabled() || InRecompute()) return outputs;
  std::shared_ptr<EngineState> state = state_.lock();
  if (state == nullptr) return outputs;
  std::vector<size_t> index;
  std::vector<torch::Tensor> diff;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      index.push_back(i);
      diff.push_back(outputs[i]);
    }
  }
  if (diff.empty()) return outputs;
  variable_list wrapped =
      PreBackwardFunction::apply(at::TensorList(diff), state->id(), int64_t{group_});
  for (size_t k = 0; k < index.size(); ++k)
    outputs[index[k]] = wrapped[k];
  return outputs;
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Engine

namespace {
detail::EngineState& Get(const std::shared_ptr<detail::EngineState>& s) {
  if (s == nullptr) {
    detail::Throw(FailedPreconditionError(
        "strata::Engine: empty handle (use the one strata::initialize returned)"));
  }
  return *s;
}
}  // namespace

// Under a profiler the phases are ranges named as in the Python front end and the timeline.
void Engine::backward(const torch::Tensor& loss) {
  RECORD_USER_SCOPE("strata::backward");
  Get(state_).Backward(loss);
}
engine::StepOutcome Engine::step() {
  RECORD_USER_SCOPE("strata::step");
  return Get(state_).Step();
}
double Engine::get_lr() const {
  return Get(state_).core().lr();
}
void Engine::set_lr(double lr) {
  detail::Check(Get(state_).core().set_lr(lr));
}
double Engine::loss_scale() const {
  return Get(state_).core().loss_scale();
}
bool Engine::is_gradient_accumulation_boundary() const {
  return Get(state_).core().IsGradientAccumulationBoundary();
}
int Engine::rank() const {
  return Get(state_).core().rank();
}
int Engine::world_size() const {
  return Get(state_).core().world_size();
}
engine::EngineStats Engine::statistics() const {
  return Get(state_).core().stats();
}
engine::EngineCore& Engine::core() {
  return Get(state_).core();
}
CheckpointOptions Engine::checkpoint_options() const {
  CheckpointOptions o;
  o.inputs_in_host_memory = Get(state_).core().config().activation_checkpointing.cpu_checkpointing;
  return o;
}
void Engine::begin_eval() {
  Get(state_).BeginEval();
}
void Engine::end_eval() {
  Get(state_).EndEval();
}
void Engine::load_safetensors(const std::string& path) {
  Get(state_).LoadSafetensors(path);
}
std::string Engine::save_checkpoint(const std::string& save_dir, const std::string& tag,
                                    const std::string& client_state,
                                    const SaveCheckpointOptions& options) {
  return Get(state_).SaveCheckpoint(save_dir, tag, client_state, options);
}
LoadedCheckpoint Engine::load_checkpoint(const std::string& load_dir, const std::string& tag,
                                         const LoadCheckpointOptions& options) {
  return Get(state_).LoadCheckpoint(load_dir, tag, options);
}
torch::OrderedDict<std::string, torch::Tensor> Engine::gather_parameters() {
  return Get(state_).GatherParameters();
}

engine::SaveModelResult Engine::save_16bit_model(const std::string& save_dir,
                                                 const std::string& filename,
                                                 uint64_t max_shard_bytes) {
  return Get(state_).SaveModel(save_dir, filename, max_shard_bytes);
}

GatheredParameters::GatheredParameters(Engine engine, const std::vector<torch::Tensor>& params,
                                       std::optional<int> modifier_rank)
    : engine_(std::move(engine)), modifier_(modifier_rank) {
  detail::EngineState& s = Get(engine_.state_);
  if (modifier_ && (*modifier_ < 0 || *modifier_ >= s.core().world_size())) {
    detail::Throw(InvalidArgumentError("strata::GatheredParameters: modifier_rank " +
                                       std::to_string(*modifier_) + " is not a rank of the " +
                                       std::to_string(s.core().world_size())));
  }
  held_ = s.GatherWhole(params);
}

GatheredParameters::~GatheredParameters() {
  if (released_) return;
  try {
    release();
  } catch (const std::exception& e) {
    STRATA_LOG(kError) << "strata::GatheredParameters: releasing in the destructor failed: "
                       << e.what();
  }
}

void GatheredParameters::release() {
  if (released_) return;
  released_ = true;
  Get(engine_.state_).ReleaseWhole(held_, modifier_);
}

void load_safetensors(Engine& engine, const std::string& path) {
  engine.load_safetensors(path);
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, const Config& config,
                  std::shared_ptr<comm::Communicator> comm, const engine::EngineOptions& options) {
  return Engine(detail::EngineState::Build(std::move(model), config, std::move(comm), options));
}

}  // namespace strata

// The LibTorch front end's hooks (its holders' forward over the TensorEngine: tensor_engine.h),
// the strata::Engine handle and the calls it makes between steps.
#include "strata/engine/libtorch/engine_state.h"

#include <ATen/record_function.h>

#include <cstring>
#include <unordered_map>

#include "strata/core/logging.h"
#include "strata/engine/checkpoint/blobs.h"

namespace strata {

namespace detail {

void Throw(Status s) {
  throw Error(std::move(s));
}

// ---------------------------------------------------------------------------
// Hooks

void EngineState::HolderBeginForward(int g) {
  Check(engine_->BeginForward(g));
}

void EngineState::HolderEndForward(int g, bool throw_errors) {
  Status s = engine_->EndForward(g, /*unwinding=*/!throw_errors);
  if (throw_errors) Check(std::move(s));
}

void EngineState::Backward(const torch::Tensor& loss) {
  const torch::Tensor scaled = Value(engine_->BeginBackward(loss));
  try {
    scaled.backward();
  } catch (const std::exception& e) {
    Check(engine_->AutogradFailed(e.what()));  // a hook's error is the first
    throw;
  }
  Check(engine_->FinishBackward());
}

engine::StepOutcome EngineState::Step() {
  return Value(Value(engine_->protocol())->Step());
}

void EngineState::BeginEval() {
  Check(Value(engine_->protocol())->BeginEval());
}

void EngineState::EndEval() {
  Check(Value(engine_->protocol())->EndEval());
}

// ---------------------------------------------------------------------------
// Between steps

std::vector<WholeTensor> EngineState::Buffers() const {
  std::vector<WholeTensor> out;
  for (const auto& item : model_->named_buffers()) {
    if (!item.value().defined()) continue;
    WholeTensor w{item.key(), item.value(), false, {}};
    if (const std::string u = Unwrapped(item.key()); !u.empty()) w.aliases.push_back(u);
    out.push_back(std::move(w));
  }
  return out;
}

void EngineState::LoadSafetensors(const std::string& path) {
  Check(engine_->LoadSafetensors(path, Buffers()));
}

std::string EngineState::SaveCheckpoint(const std::string& dir, const std::string& tag,
                                        const std::string& client_state,
                                        const SaveCheckpointOptions& options) {
  engine::CheckpointSaveRequest r;
  r.dir = dir;
  r.tag = tag;
  r.exclude_frozen_parameters = options.exclude_frozen_parameters;
  engine::CheckpointBlob client;
  client.name = std::string(engine::blob::kClientState);
  client.bytes.resize(client_state.size());
  std::memcpy(client.bytes.data(), client_state.data(), client_state.size());
  r.blobs.push_back(std::move(client));
  return Value(engine_->SaveCheckpoint(std::move(r), Buffers()));
}

LoadedCheckpoint EngineState::LoadCheckpoint(const std::string& dir, const std::string& tag,
                                             const LoadCheckpointOptions& options) {
  engine::CheckpointLoadRequest r;
  r.dir = dir;
  r.tag = tag;
  r.load_optimizer_states = options.load_optimizer_states;
  r.load_lr_scheduler_states = options.load_lr_scheduler_states;
  r.load_module_only = options.load_module_only;
  r.check_frozen_parameters = options.check_frozen_parameters;
  const engine::CheckpointLoadResult loaded = Value(engine_->LoadCheckpoint(r, Buffers()));
  LoadedCheckpoint out;
  out.path = loaded.path;
  out.tag = loaded.tag;
  out.global_steps = loaded.global_steps;
  out.frozen_parameters_loaded = loaded.frozen_parameters_loaded;
  out.frozen_base_checked = loaded.frozen_base_checked;
  for (const engine::CheckpointBlob& b : loaded.blobs) {
    if (b.name == engine::blob::kClientState) {
      out.client_state.assign(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size());
    }
  }
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> EngineState::GatherParameters() {
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  for (const auto& item : model_->named_parameters()) {
    names.push_back(item.key());
    params.push_back(item.value());
  }
  std::vector<torch::Tensor> values = Value(engine_->GatherParameters(params));
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (size_t k = 0; k < names.size(); ++k)
    out.insert(names[k], std::move(values[k]));
  return out;
}

engine::SaveModelResult EngineState::SaveModel(const std::string& dir, const std::string& filename,
                                               uint64_t max_shard_bytes) {
  engine::SaveModelRequest r;
  r.dir = dir;
  r.filename = filename;
  r.max_file_bytes = max_shard_bytes;
  std::vector<std::vector<std::string>> names;
  for (int g = 0; g < engine_->num_groups(); ++g) {
    names.emplace_back();
    for (const TensorParam& p : engine_->group(g).params)
      names.back().push_back(p.name);
  }
  std::vector<std::pair<std::string, torch::Tensor>> whole;
  for (const auto& item : model_->named_buffers())
    whole.emplace_back(item.key(), item.value());
  return Value(engine_->SaveModel(std::move(r), names, whole));
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
  std::shared_ptr<EngineState> state = state_.lock();
  if (state == nullptr) return input;
  return state->engine().WrapInputs(group_, {input})[0];
}

std::vector<torch::Tensor> Zero3ModuleBase::WrapOutputs(std::vector<torch::Tensor> outputs) {
  std::shared_ptr<EngineState> state = state_.lock();
  if (state == nullptr) return outputs;
  return state->engine().WrapOutputs(group_, std::move(outputs));
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
  held_ = detail::Value(s.engine().GatherWhole(params));
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
  detail::Check(Get(engine_.state_).engine().ReleaseWhole(held_, modifier_));
}

void load_safetensors(Engine& engine, const std::string& path) {
  engine.load_safetensors(path);
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, const Config& config,
                  std::shared_ptr<comm::Communicator> comm, const engine::EngineOptions& options) {
  return Engine(detail::EngineState::Build(std::move(model), config, std::move(comm), options));
}

}  // namespace strata

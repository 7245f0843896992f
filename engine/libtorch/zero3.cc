// The LibTorch front end of the ZeRO-3 engine: strata::initialize, strata::zero3 and the
// Engine handle, over the torch-free EngineCore (docs/engine.md, "The LibTorch front end").
//
// How parameter tensors follow the gathered buffers: every managed parameter gets its own
// c10::Storage, created here and kept for the engine's life. The parameter tensor is set
// (set_data, which does not bump the version counter) onto that storage. Pointing the
// parameter at a gathered buffer swaps the storage's data pointer (no copy); emptying it
// sets the data pointer to null and the tensor's sizes to {0}. Views that autograd saved
// in the forward (weight.t() of a linear, say) share the storage object, so after the
// pre-backward re-gather they see the re-gathered values too, wherever the buffer landed.
#include "strata/engine/libtorch/zero3.h"

#include <malloc.h>
#include <sys/mman.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "strata/comm/rendezvous.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/libtorch/torch_internal.h"

#if defined(STRATA_TORCH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata {

Error::Error(Status status) : std::runtime_error(status.message()), status_(std::move(status)) {}

namespace detail {
namespace {

using torch::autograd::variable_list;

[[noreturn]] void Throw(Status s) {
  throw Error(std::move(s));
}
void Check(Status s) {
  if (!s.ok()) Throw(std::move(s));
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

// Engines reachable from autograd nodes (which may outlive them): id -> engine.
std::mutex g_registry_mu;
std::unordered_map<int64_t, std::weak_ptr<EngineState>>& Registry() {
  static auto* registry = new std::unordered_map<int64_t, std::weak_ptr<EngineState>>();
  return *registry;
}
std::atomic<int64_t> g_next_id{1};

std::shared_ptr<EngineState> Lookup(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second.lock();
}

}  // namespace

// A holder's parameters as partitioned construction left them (ZeroInit): their names,
// shapes and this rank's shard of the padded flat group.
// Floats in pages of their own (anonymous mmap), returned to the system when freed: the
// broadcast buffer and the shards of partitioned construction stay off the malloc heap, so
// what the heap holds between blocks is the blocks' own freed tensors, which malloc_trim
// gives back (PartitionIfInitializing).
class MappedFloats {
 public:
  MappedFloats() = default;
  explicit MappedFloats(size_t n) : n_(n) {
    if (n == 0) return;
    void* p = mmap(nullptr, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) {
      throw Error(ResourceExhaustedError("strata::ZeroInit: cannot map " +
                                         std::to_string(n * sizeof(float)) + " bytes"));
    }
    data_ = static_cast<float*>(p);  // zero-filled
  }
  ~MappedFloats() {
    if (data_ != nullptr) munmap(data_, n_ * sizeof(float));
  }
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

namespace {
thread_local ZeroInit* g_zero_init = nullptr;
}  // namespace

struct ParamBinding {
  std::string name;  // as in model->named_parameters()
  torch::Tensor param;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  c10::ScalarType compute = c10::ScalarType::Float;
  c10::Storage storage;
  std::shared_ptr<torch::autograd::Node> accumulator;
  bool grad_arrived = false;
};

struct GroupBinding {
  std::string name;
  std::vector<ParamBinding> params;
  // The frozen group gathered with this one (its module's requires_grad-false parameters),
  // -1 if none; `frozen`: this group is such a companion.
  int companion = -1;
  bool frozen = false;
  int owner = -1;         // a companion: the group it is gathered with
  int open = 0;           // Pre* calls without their Post* (this front end's count)
  int open_backward = 0;  // PreBackward calls without PostBackward
  size_t grads_arrived = 0;
};

class EngineState : public std::enable_shared_from_this<EngineState> {
 public:
  EngineState() : id_(g_next_id.fetch_add(1)) {}
  ~EngineState() {
    {
      std::lock_guard<std::mutex> lock(g_registry_mu);
      Registry().erase(id_);
    }
    // The tensors outlive the engine: leave none pointing into its buffers.
    for (size_t g = 0; g < groups_.size(); ++g) {
      try {
        Empty(static_cast<int>(g));
      } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): best effort
      }
    }
  }
  EngineState(const EngineState&) = delete;
  EngineState& operator=(const EngineState&) = delete;

  static std::shared_ptr<EngineState> Build(std::shared_ptr<torch::nn::Module> model,
                                            const Config& config,
                                            std::shared_ptr<comm::Communicator> comm,
                                            const engine::EngineOptions& options);

  int64_t id() const { return id_; }
  engine::EngineCore& core() { return *core_; }

  // Front-end Pre/Post: the core's call plus pointing / emptying the tensors.
  // `holds`: the root group taken for the iterations to come (after a step, at start),
  // not the start of a forward (EngineCore::PreForward's begins_phase).
  Status Acquire(int g, engine::Phase phase, bool holds = false);
  Status Release(int g, engine::Phase phase);

  void HolderBeginForward(int g);
  void HolderEndForward(int g, bool throw_errors);
  void OnPreBackward(int g);
  void OnGradient(int g, int i);
  // The gradient reached the inputs of group g, whose parameters are all frozen.
  void OnPostBackward(int g);
  bool HasTrainable(int g) const { return !groups_[static_cast<size_t>(g)].params.empty(); }

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
  void ThrowDeferred();
  // After a core call failed: when the core voided the iteration (EngineCore::
  // iteration_void: a pipelined optimizer step failed and the forward since read partly
  // updated parameters), forgets this front end's holds, views and gradients, takes the
  // root group again and clears the kept error, so that the caller can start the iteration
  // again with a new forward; returns false (and changes nothing) otherwise. Once per
  // void (until the next forward begins): a later call in that window only drops the
  // gradients and the kept error (the core refused everything; the root is held again).
  bool RecoverVoidIteration();
  // Check(s) for a core call that may complete a failed pipelined update: recovers first
  // (RecoverVoidIteration) when the core voided the iteration.
  void CheckRecovering(Status s) {
    if (s.ok()) return;
    RecoverVoidIteration();
    Throw(std::move(s));
  }
  // Throws the error a hook kept (none: returns): as it is when the core voided the
  // iteration (RecoverVoidIteration), else as one that left the engine unusable.
  void ThrowKept();
  std::vector<std::pair<std::string, torch::Tensor>> WholeTensors() const;
  // A CUDA compute device: moves what the engine does not manage (buffers, frozen
  // parameters) there, and makes the CUDA device and the communicators (NCCL for device
  // buffers, gloo for the host's) that `options` and `comm` do not name.
  void PrepareCuda(const std::shared_ptr<torch::nn::Module>& model, const Config& config,
                   std::shared_ptr<comm::Communicator>& comm, engine::EngineOptions& options);

 private:
  Status Point(int g);
  void Empty(int g);
  void Note(const Status& s) {
    if (deferred_.ok() && !s.ok()) deferred_ = s;
  }
  Status CloseBackward(int g);

  int64_t id_;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<engine::EngineCore> core_;
  std::vector<GroupBinding> groups_;
  std::vector<std::pair<std::string, std::shared_ptr<Zero3ModuleBase>>> holders_;
  std::mutex mu_;  // autograd callbacks
  c10::Device device_{c10::kCPU};
  Status deferred_;
  bool backward_pending_ = false;
  bool eval_ = false;
  bool void_recovered_ = false;  // RecoverVoidIteration ran since the last forward began
};

namespace {

// Whether autograd is running a backward pass on this thread: a holder's forward then is
// activation checkpointing's recompute.
bool InRecompute() {
  return torch::autograd::get_current_graph_task_id() != -1;
}

// The identity on tensors around a holder whose backward calls `Hook` on the engine with
// the group: on its outputs, OnPreBackward (re-gather the group before the holder's
// gradient functions run); on the inputs of a holder whose parameters are all frozen,
// OnPostBackward (release it once the inputs' gradients are computed).
template <void (EngineState::*Hook)(int)>
struct GroupIdentityFunction : public torch::autograd::Function<GroupIdentityFunction<Hook>> {
  static variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                               int64_t engine_id, int64_t group) {
    ctx->saved_data["engine"] = engine_id;
    ctx->saved_data["group"] = group;
    return tensors.vec();
  }
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    std::shared_ptr<EngineState> state = Lookup(ctx->saved_data["engine"].toInt());
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

torch::Tensor OnStorage(const c10::Storage& storage, c10::ScalarType dtype,
                        c10::IntArrayRef shape) {
  torch::NoGradGuard no_grad;
  return torch::empty({0}, torch::TensorOptions().dtype(dtype).device(storage.device()))
      .set_(storage, 0, shape, {});
}

// The device the engine computes on: strata.device, or where the model's trainable
// parameters are (all on one device).
c10::Device ComputeDeviceOf(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                            ComputeDevice wanted) {
  std::optional<c10::Device> seen;
  std::string seen_name;
  for (const auto& [name, t] : params) {
    if (!seen) {
      seen = t.device();
      seen_name = name;
    } else if (t.device() != *seen) {
      Throw(InvalidArgumentError("strata::initialize: parameter " + name + " is on " +
                                 t.device().str() + " but " + seen_name + " is on " + seen->str() +
                                 "; put the whole model on one device"));
    }
  }
  const c10::Device model = seen.value_or(c10::Device(c10::kCPU));
  if (!model.is_cpu() && !model.is_cuda()) {
    Throw(InvalidArgumentError("strata::initialize: the model is on " + model.str() +
                               "; Strata computes on the CPU or on CUDA"));
  }
  if (wanted == ComputeDevice::kCpu) {
    if (!model.is_cpu()) {
      Throw(InvalidArgumentError("strata::initialize: strata.device = cpu but the model is on " +
                                 model.str() +
                                 " (move it to the CPU, or set strata.device to "
                                 "auto or cuda)"));
    }
    return model;
  }
  if (wanted == ComputeDevice::kAuto) return model;
  // cuda: cuda:LOCAL_RANK (0 without torchrun).
  int local_rank = 0;
  if (const char* lr = std::getenv("LOCAL_RANK"); lr != nullptr && *lr != '\0') {
    char* end = nullptr;
    const long v = std::strtol(lr, &end, 10);
    if (*end != '\0' || v < 0 || v > 1023) {
      Throw(InvalidArgumentError("strata::initialize: LOCAL_RANK='" + std::string(lr) +
                                 "' is not a device index"));
    }
    local_rank = static_cast<int>(v);
  }
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  if (model.is_cuda() && model != target) {
    Throw(InvalidArgumentError("strata::initialize: strata.device = cuda means " + target.str() +
                               " (LOCAL_RANK) on this rank, but the model is on " + model.str()));
  }
  return target;
}

}  // namespace

Status EngineState::Point(int g) {
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  STRATA_ASSIGN_OR_RETURN(engine::GatheredGroup full, core_->FullBuffer(g));
  const engine::GroupLayout& layout = core_->layout(g);
  std::byte* base = full.data;
  const size_t elem = engine::DTypeSize(full.dtype);
  for (size_t i = 0; i < gb.params.size(); ++i) {
    ParamBinding& p = gb.params[i];
    void* ptr = base == nullptr ? nullptr : base + layout.params[i].offset * elem;
    torch_internal::PointStorage(p.storage.unsafeGetStorageImpl(), ptr,
                                 static_cast<size_t>(p.numel) * c10::elementSize(p.compute));
    p.param.set_data(OnStorage(p.storage, p.compute, p.shape));
  }
  return Status::Ok();
}

void EngineState::Empty(int g) {
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  for (ParamBinding& p : gb.params) {
    if (!p.storage) continue;  // initialize failed before the storage was made
    torch_internal::PointStorage(p.storage.unsafeGetStorageImpl(), nullptr, 0);
    p.param.set_data(OnStorage(p.storage, p.compute, {0}));
  }
}

Status EngineState::Acquire(int g, engine::Phase phase, bool holds) {
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  auto pre = [&](int x) {
    return phase == engine::Phase::kForward ? core_->PreForward(x, /*begins_phase=*/!holds)
                                            : core_->PreBackward(x);
  };
  STRATA_RETURN_IF_ERROR(pre(g));
  if (gb.companion >= 0) STRATA_RETURN_IF_ERROR(pre(gb.companion));
  if (++gb.open == 1) {
    STRATA_RETURN_IF_ERROR(Point(g));
    if (gb.companion >= 0) STRATA_RETURN_IF_ERROR(Point(gb.companion));
  }
  if (phase == engine::Phase::kBackward) ++gb.open_backward;
  return Status::Ok();
}

Status EngineState::Release(int g, engine::Phase phase) {
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  if (phase == engine::Phase::kBackward) --gb.open_backward;
  if (--gb.open == 0) {
    Empty(g);
    if (gb.companion >= 0) Empty(gb.companion);
  }
  auto post = [&](int x) {
    return phase == engine::Phase::kForward ? core_->PostForward(x) : core_->PostBackward(x);
  };
  Status first = gb.companion >= 0 ? post(gb.companion) : Status::Ok();
  Status own = post(g);
  return first.ok() ? own : first;
}

Status EngineState::CloseBackward(int g) {
  Status first;
  while (groups_[static_cast<size_t>(g)].open_backward > 0) {
    Status s = Release(g, engine::Phase::kBackward);
    if (first.ok()) first = s;
  }
  return first;
}

bool EngineState::RecoverVoidIteration() {
  if (!core_->iteration_void()) return false;
  for (GroupBinding& gb : groups_) {
    gb.grads_arrived = 0;
    for (ParamBinding& p : gb.params) {
      p.grad_arrived = false;
      if (p.param.grad().defined()) p.param.mutable_grad() = torch::Tensor();
    }
  }
  backward_pending_ = false;
  eval_ = false;
  if (void_recovered_) {
    // A call after the recovery (the voided loss's backward again): the core refused it
    // before anything was taken, and the root is held since the recovery.
    deferred_ = Status::Ok();
    return true;
  }
  void_recovered_ = true;
  for (size_t g = 0; g < groups_.size(); ++g) {
    Empty(static_cast<int>(g));
    groups_[g].open = 0;
    groups_[g].open_backward = 0;
  }
  deferred_ = Acquire(0, engine::Phase::kForward, /*holds=*/true);
  return true;
}

void EngineState::ThrowKept() {
  if (deferred_.ok()) return;
  if (core_->iteration_void()) {
    Status kept = deferred_;
    RecoverVoidIteration();
    Throw(std::move(kept));
  }
  ThrowDeferred();
}

void EngineState::ThrowDeferred() {
  if (!deferred_.ok()) {
    Status s = deferred_;
    Throw(s.WithContext("an earlier error left the engine unusable"));
  }
}

void EngineState::HolderBeginForward(int g) {
  ThrowDeferred();
  if (InRecompute()) {
    // Activation checkpointing's recompute (strata::checkpoint, or any function that runs
    // the block again inside the backward): the block is gathered as for its backward,
    // which follows at once; its release is the backward's (all its gradients arrived, or
    // the backward ends).
    OnPreBackward(g);
    return;
  }
  if (backward_pending_) {
    Throw(FailedPreconditionError(
        "forward after backward() without step(): call engine.step() after every "
        "engine.backward()"));
  }
  void_recovered_ = false;  // a new forward: the core's iteration_void() ends here too
  Check(Acquire(g, engine::Phase::kForward));
}

void EngineState::HolderEndForward(int g, bool throw_errors) {
  if (InRecompute()) return;  // released with the backward (HolderBeginForward)
  Status s = Release(g, engine::Phase::kForward);
  if (throw_errors) {
    Check(std::move(s));
  } else {
    Note(s);
  }
}

void EngineState::OnPreBackward(int g) {
  std::lock_guard<std::mutex> lock(mu_);
  Status s = Acquire(g, engine::Phase::kBackward);
  if (!s.ok()) {
    Note(s);
    Throw(std::move(s));
  }
}

void EngineState::OnPostBackward(int g) {
  std::lock_guard<std::mutex> lock(mu_);
  if (groups_[static_cast<size_t>(g)].open_backward > 0) Note(CloseBackward(g));
}

void EngineState::OnGradient(int g, int i) {
  std::lock_guard<std::mutex> lock(mu_);
  GroupBinding& gb = groups_[static_cast<size_t>(g)];
  ParamBinding& p = gb.params[static_cast<size_t>(i)];
  torch::Tensor grad = p.param.grad();
  if (!grad.defined()) return;
  if (grad.is_sparse()) {
    Note(UnimplementedError("strata: sparse gradient of parameter " + p.name +
                            " (use a dense embedding)"));
    return;
  }
  grad = grad.contiguous();
  Note(core_->AddGradient(g, i, grad.data_ptr(), DTypeOf(grad.scalar_type())));
  p.param.mutable_grad() = torch::Tensor();
  if (!p.grad_arrived) {
    p.grad_arrived = true;
    ++gb.grads_arrived;
  }
  // Every gradient of the group arrived: its backward is over (post-backward).
  if (g != 0 && gb.grads_arrived == gb.params.size() && gb.open_backward > 0) {
    Note(CloseBackward(g));
  }
}

void EngineState::Backward(const torch::Tensor& loss) {
  ThrowDeferred();
  if (!loss.defined() || loss.numel() != 1) {
    Throw(InvalidArgumentError("Engine::backward: the loss must be a tensor of one element"));
  }
  if (!loss.requires_grad()) {
    Throw(InvalidArgumentError(
        "Engine::backward: the loss does not require grad (computed under NoGradGuard, or "
        "from no parameter)"));
  }
  if (backward_pending_) {
    Throw(FailedPreconditionError(
        "Engine::backward called twice without step(): call engine.step() after every "
        "engine.backward()"));
  }
  if (eval_) Throw(FailedPreconditionError("Engine::backward between begin_eval() and end_eval()"));
  const torch::Tensor scaled = loss * core_->LossMultiplier();
  try {
    scaled.backward();
  } catch (const std::exception& e) {
    ThrowKept();
    // Autograd's own error in a voided iteration (the voided loss's graph, partly freed by
    // the backward that failed): the engine refused everything and stays usable.
    if (RecoverVoidIteration()) throw;
    Note(InternalError(std::string("autograd failed: ") + e.what()));
    throw;
  }
  ThrowKept();
  Status first;
  for (size_t g = 1; g < groups_.size(); ++g) {
    Status s = CloseBackward(static_cast<int>(g));
    if (first.ok()) first = s;
  }
  for (GroupBinding& gb : groups_) {
    gb.grads_arrived = 0;
    for (ParamBinding& p : gb.params)
      p.grad_arrived = false;
  }
  Check(first);
  // The root group stays gathered from step() to the end of the next backward.
  Check(Release(0, engine::Phase::kForward));
  CheckRecovering(core_->EndBackward());
  backward_pending_ = true;
}

engine::StepOutcome EngineState::Step() {
  ThrowDeferred();
  if (eval_) Throw(FailedPreconditionError("Engine::step between begin_eval() and end_eval()"));
  if (!backward_pending_) {
    Result<engine::StepOutcome> r = core_->Step();  // the core's message for the misuse
    if (!r.ok()) Throw(r.status().WithContext("Engine::step"));
    Throw(InternalError("Engine::step: the core stepped without a backward"));
  }
  Result<engine::StepOutcome> r = core_->Step();
  if (!r.ok()) Throw(r.status());
  backward_pending_ = false;
  Check(Acquire(0, engine::Phase::kForward, /*holds=*/true));
  return *r;
}

void EngineState::BeginEval() {
  ThrowDeferred();
  if (backward_pending_) {
    Throw(FailedPreconditionError("Engine::begin_eval between backward() and step()"));
  }
  if (eval_) Throw(FailedPreconditionError("Engine::begin_eval called twice"));
  core_->BeginForwardOnly();
  eval_ = true;
}

void EngineState::EndEval() {
  ThrowDeferred();
  if (!eval_) Throw(FailedPreconditionError("Engine::end_eval without begin_eval"));
  eval_ = false;
  Check(Release(0, engine::Phase::kForward));
  CheckRecovering(core_->EndForwardOnly());
  Check(Acquire(0, engine::Phase::kForward, /*holds=*/true));
}

void EngineState::LoadSafetensors(const std::string& path) {
  ThrowDeferred();
  if (eval_) {
    Throw(FailedPreconditionError("Engine::load_safetensors between begin_eval() and end_eval()"));
  }
  if (backward_pending_) {
    Throw(FailedPreconditionError("Engine::load_safetensors between backward() and step()"));
  }
  // Every name of every parameter tensor (a tied one has several).
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names;
  for (const auto& item : model_->named_parameters())
    names[item.value().unsafeGetTensorImpl()].push_back(item.key());
  // A name inside a holder also without the holder's "inner": the name the model has
  // without strata::zero3 (a file saved from the plain LibTorch model).
  auto unwrapped = [&](const std::string& name) -> std::string {
    for (const auto& [at, holder] : holders_) {
      const std::string prefix = at.empty() ? "inner." : at + ".inner.";
      if (name.rfind(prefix, 0) == 0) {
        return (at.empty() ? "" : at + ".") + name.substr(prefix.size());
      }
    }
    return "";
  };
  auto expect = [&](const std::string& name, const torch::Tensor& t,
                    const std::vector<int64_t>& shape) {
    engine::ExpectedTensor e;
    e.name = name;
    for (const std::string& n : names[t.unsafeGetTensorImpl()]) {
      if (n != name) e.aliases.push_back(n);
      if (const std::string u = unwrapped(n); !u.empty()) e.aliases.push_back(u);
    }
    e.shape = shape;
    return e;
  };
  std::vector<std::vector<engine::ExpectedTensor>> params;
  for (const GroupBinding& gb : groups_) {
    params.emplace_back();
    for (const ParamBinding& p : gb.params)
      params.back().push_back(expect(p.name, p.param, p.shape));
  }
  // The tensors this front end keeps whole: the floating-point buffers (optional). The
  // frozen parameters are in their groups.
  std::vector<engine::ExpectedTensor> others;
  std::vector<torch::Tensor> targets;
  for (const auto& item : model_->named_buffers()) {
    if (!item.value().defined() || !item.value().is_floating_point()) continue;
    engine::ExpectedTensor e;
    e.name = item.key();
    if (const std::string u = unwrapped(item.key()); !u.empty()) e.aliases.push_back(u);
    e.shape = item.value().sizes().vec();
    e.optional = true;
    others.push_back(std::move(e));
    targets.push_back(item.value());
  }
  auto fill = [&](size_t k, std::span<const float> values) -> Status {
    try {
      torch::NoGradGuard no_grad;
      torch::Tensor& t = targets[k];
      t.copy_(torch::from_blob(const_cast<float*>(values.data()), t.sizes(), torch::kFloat32));
      return Status::Ok();
    } catch (const std::exception& e) {
      return InternalError("copying " + others[k].name + " into the model: " + e.what());
    }
  };
  // The engine's pass ends inside the load (nothing gathered while the master changes);
  // the root group is gathered again after it, as after a step.
  Check(Release(0, engine::Phase::kForward));
  const Status loaded = engine::LoadSafetensors(*core_, path, params, others, fill);
  Check(Acquire(0, engine::Phase::kForward, /*holds=*/true));
  if (!loaded.ok()) Throw(loaded.WithContext("Engine::load_safetensors(" + path + ")"));
}

namespace {

// Buffers are each rank's own (a forward may update them from the rank's data). Frozen
// parameters were blobs too (the same on every rank: rank 0's) before they were
// partitioned in frozen groups; a checkpoint holding them is refused (its groups differ).
constexpr char kFrozenBlob[] = "shared:module:";
constexpr char kBufferBlob[] = "module:";

// The model's name of a tensor kept under blob name `blob`.
std::string ModuleName(const std::string& blob) {
  return blob.substr(blob.rfind("module:", 0) == 0 ? sizeof(kBufferBlob) - 1
                                                   : sizeof(kFrozenBlob) - 1);
}

// The safetensors dtype name of a tensor type ("" for one the format has no name for).
std::string SafetensorsDType(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return "F32";
    case c10::kBFloat16:
      return "BF16";
    case c10::kHalf:
      return "F16";
    case c10::kDouble:
      return "F64";
    case c10::kLong:
      return "I64";
    case c10::kInt:
      return "I32";
    case c10::kShort:
      return "I16";
    case c10::kChar:
      return "I8";
    case c10::kByte:
      return "U8";
    case c10::kBool:
      return "BOOL";
    default:
      return "";
  }
}

std::vector<uint64_t> ShapeOf(const torch::Tensor& t) {
  std::vector<uint64_t> shape;
  for (const int64_t d : t.sizes())
    shape.push_back(static_cast<uint64_t>(d));
  return shape;
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

engine::CheckpointBlob TensorBlob(const std::string& name, const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  engine::CheckpointBlob b;
  b.name = name;
  b.dtype = SafetensorsDType(c.scalar_type());
  b.shape = ShapeOf(c);
  b.bytes.resize(static_cast<size_t>(c.nbytes()));
  if (!b.bytes.empty()) std::memcpy(b.bytes.data(), c.data_ptr(), b.bytes.size());
  return b;
}

engine::CheckpointBlob BytesBlob(const std::string& name, const void* data, size_t n) {
  engine::CheckpointBlob b;
  b.name = name;
  b.bytes.resize(n);
  if (n > 0) std::memcpy(b.bytes.data(), data, n);
  return b;
}

}  // namespace

// The tensors this front end keeps whole (the buffers; frozen parameters are in the
// engine's frozen groups), by the blob name a checkpoint keeps them under.
std::vector<std::pair<std::string, torch::Tensor>> EngineState::WholeTensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model_->named_buffers()) {
    if (item.value().defined()) out.emplace_back(kBufferBlob + item.key(), item.value());
  }
  return out;
}

std::string EngineState::SaveCheckpoint(const std::string& dir, const std::string& tag,
                                        const std::string& client_state,
                                        const SaveCheckpointOptions& options) {
  ThrowDeferred();
  if (eval_) {
    Throw(FailedPreconditionError("Engine::save_checkpoint between begin_eval() and end_eval()"));
  }
  if (backward_pending_) {
    Throw(FailedPreconditionError("Engine::save_checkpoint between backward() and step()"));
  }
  engine::SaveCheckpointOptions o;
  o.dir = dir;
  o.tag = tag;
  o.exclude_frozen_parameters = options.exclude_frozen_parameters;
  for (const GroupBinding& gb : groups_) {
    o.param_shapes.emplace_back();
    for (const ParamBinding& p : gb.params)
      o.param_shapes.back().push_back(p.shape);
  }
  for (const auto& [name, t] : WholeTensors()) {
    if (SafetensorsDType(t.scalar_type()).empty()) {
      Throw(InvalidArgumentError("Engine::save_checkpoint: " + ModuleName(name) + " is of type " +
                                 std::string(c10::toString(t.scalar_type())) +
                                 ", which a checkpoint cannot hold"));
    }
    o.blobs.push_back(TensorBlob(name, t));
  }
  const torch::Tensor cpu_rng = at::detail::getDefaultCPUGenerator().get_state();
  o.blobs.push_back(
      BytesBlob("rng:cpu", cpu_rng.data_ptr(), static_cast<size_t>(cpu_rng.nbytes())));
  if (device_.is_cuda()) {
    const torch::Tensor rng = at::globalContext().defaultGenerator(device_).get_state();
    o.blobs.push_back(BytesBlob("rng:cuda", rng.data_ptr(), static_cast<size_t>(rng.nbytes())));
  }
  o.blobs.push_back(BytesBlob("client_state", client_state.data(), client_state.size()));
  Result<std::string> saved = core_->SaveCheckpoint(o);
  if (!saved.ok())
    CheckRecovering(saved.status().WithContext("Engine::save_checkpoint(" + dir + ")"));
  return *saved;
}

LoadedCheckpoint EngineState::LoadCheckpoint(const std::string& dir, const std::string& tag,
                                             const LoadCheckpointOptions& options) {
  ThrowDeferred();
  if (eval_) {
    Throw(FailedPreconditionError("Engine::load_checkpoint between begin_eval() and end_eval()"));
  }
  if (backward_pending_) {
    Throw(FailedPreconditionError("Engine::load_checkpoint between backward() and step()"));
  }
  const std::vector<std::pair<std::string, torch::Tensor>> whole = WholeTensors();
  engine::LoadCheckpointOptions o;
  o.dir = dir;
  o.tag = tag;
  o.load_optimizer_states = options.load_optimizer_states;
  o.load_lr_scheduler_states = options.load_lr_scheduler_states;
  o.load_module_only = options.load_module_only;
  o.check_frozen_parameters = options.check_frozen_parameters;
  // The model's frozen parameters and buffers against the checkpoint's.
  o.check_blobs = [&](const std::vector<engine::CheckpointTensor>& blobs) -> Status {
    std::unordered_map<std::string, const engine::CheckpointTensor*> saved;
    for (const engine::CheckpointTensor& t : blobs)
      if (t.name.rfind(kFrozenBlob, 0) == 0 || t.name.rfind(kBufferBlob, 0) == 0)
        saved[t.name] = &t;
    std::vector<std::string> missing, mismatched;
    for (const auto& [name, t] : whole) {
      const auto it = saved.find(name);
      if (it == saved.end()) {
        missing.push_back(ModuleName(name));
        continue;
      }
      const engine::CheckpointTensor& c = *it->second;
      if (c.dtype != SafetensorsDType(t.scalar_type()) || c.shape != ShapeOf(t)) {
        mismatched.push_back(ModuleName(name) + " (checkpoint " + c.dtype + " " +
                             ShapeText(c.shape) + ", model " + SafetensorsDType(t.scalar_type()) +
                             " " + ShapeText(ShapeOf(t)) + ")");
      }
      saved.erase(it);
    }
    if (missing.empty() && mismatched.empty() && saved.empty()) return Status::Ok();
    std::string msg = "the frozen parameters and buffers differ from the model's";
    auto list = [&](const char* what, const std::vector<std::string>& names) {
      if (names.empty()) return;
      msg += std::string("; ") + what + ": ";
      for (size_t i = 0; i < names.size() && i < 20; ++i)
        msg += (i ? ", " : "") + names[i];
      if (names.size() > 20) msg += ", ...";
    };
    std::vector<std::string> extra;
    for (const auto& [name, t] : saved)
      extra.push_back(ModuleName(name));
    std::sort(extra.begin(), extra.end());
    list("missing from the checkpoint", missing);
    list("in the checkpoint but not the model", extra);
    list("of another type or shape", mismatched);
    return InvalidArgumentError(msg);
  };
  // As load_safetensors: the root group is released for the load and gathered again.
  Check(Release(0, engine::Phase::kForward));
  Result<engine::LoadedCheckpoint> loaded = core_->LoadCheckpoint(o);
  Check(Acquire(0, engine::Phase::kForward, /*holds=*/true));
  if (!loaded.ok()) {
    Throw(loaded.status().WithContext("Engine::load_checkpoint(" + dir + ")"));
  }
  LoadedCheckpoint out;
  out.path = loaded->path;
  out.tag = loaded->tag;
  out.global_steps = loaded->global_steps;
  out.frozen_parameters_loaded = loaded->frozen_parameters_loaded;
  out.frozen_base_checked = loaded->frozen_base_checked;
  std::unordered_map<std::string, const engine::CheckpointBlob*> blobs;
  for (const engine::CheckpointBlob& b : loaded->blobs)
    blobs[b.name] = &b;
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, t] : whole) {
      const engine::CheckpointBlob& b = *blobs.at(name);
      torch::Tensor src = torch::from_blob(const_cast<std::byte*>(b.bytes.data()), t.sizes(),
                                           torch::TensorOptions().dtype(t.scalar_type()));
      torch::Tensor dst = t;
      dst.copy_(src);
    }
  }
  if (const auto it = blobs.find("client_state"); it != blobs.end()) {
    out.client_state.assign(reinterpret_cast<const char*>(it->second->bytes.data()),
                            it->second->bytes.size());
  }
  if (!options.load_module_only) {
    auto restore = [&](const char* name, at::Generator gen) {
      const auto it = blobs.find(name);
      if (it == blobs.end()) return;
      torch::Tensor state =
          torch::empty({static_cast<int64_t>(it->second->bytes.size())}, torch::kUInt8);
      std::memcpy(state.data_ptr(), it->second->bytes.data(), it->second->bytes.size());
      gen.set_state(state);
    };
    restore("rng:cpu", at::detail::getDefaultCPUGenerator());
    if (device_.is_cuda()) restore("rng:cuda", at::globalContext().defaultGenerator(device_));
  }
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> EngineState::GatherParameters() {
  ThrowDeferred();
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> values;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const engine::GroupLayout& layout = core_->layout(static_cast<int>(g));
    torch::Tensor flat = torch::empty({static_cast<int64_t>(layout.numel)}, torch::kFloat32);
    CheckRecovering(core_->GatherMasterParams(
        static_cast<int>(g), std::span<float>(flat.data_ptr<float>(), layout.numel)));
    int64_t pos = 0;
    for (ParamBinding& p : groups_[g].params) {
      values[p.param.unsafeGetTensorImpl()] = flat.narrow(0, pos, p.numel).view(p.shape).clone();
      pos += p.numel;
    }
  }
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& item : model_->named_parameters()) {
    auto it = values.find(item.value().unsafeGetTensorImpl());
    if (it != values.end()) {
      out.insert(item.key(), it->second);
    } else {  // not managed (requires_grad false): as it is, on the host like the rest
      out.insert(item.key(), item.value().detach().to(torch::kCPU, torch::kFloat32).clone());
    }
  }
  return out;
}

std::shared_ptr<EngineState> EngineState::Build(std::shared_ptr<torch::nn::Module> model,
                                                const Config& config,
                                                std::shared_ptr<comm::Communicator> comm,
                                                const engine::EngineOptions& options) {
  if (model == nullptr) Throw(InvalidArgumentError("strata::initialize: null model"));
  auto state = std::make_shared<EngineState>();
  state->model_ = model;

  // The holders, in registration order (depth first); no holder inside another.
  for (const auto& item : model->named_modules()) {
    auto holder = std::dynamic_pointer_cast<Zero3ModuleBase>(item.value());
    if (holder == nullptr) continue;
    for (const auto& [path, outer] : state->holders_) {
      if (outer == holder) {
        Throw(InvalidArgumentError("strata::initialize: the strata::zero3 module '" + item.key() +
                                   "' is registered twice (also as '" + path + "')"));
      }
      if (path.empty() || item.key().rfind(path + ".", 0) == 0) {
        Throw(InvalidArgumentError("strata::initialize: strata::zero3 module '" + item.key() +
                                   "' is nested inside strata::zero3 module '" + path +
                                   "'; wrap either the outer or the inner modules"));
      }
    }
    if (holder->bound()) {
      Throw(FailedPreconditionError("strata::initialize: the strata::zero3 module '" + item.key() +
                                    "' is already managed by another engine"));
    }
    state->holders_.emplace_back(item.key(), holder);
  }

  // Groups: 0 = root (parameters outside holders), 1.. = holders.
  std::unordered_map<const c10::TensorImpl*, int> where;
  state->groups_.resize(state->holders_.size() + 1);
  state->groups_[0].name = "root";
  auto add = [&](int g, const std::string& name, const torch::Tensor& t) {
    where[t.unsafeGetTensorImpl()] = g;
    ParamBinding p;
    p.name = name;
    p.param = t;
    p.shape = t.sizes().vec();
    p.numel = t.numel();
    state->groups_[static_cast<size_t>(g)].params.push_back(std::move(p));
  };
  // Frozen parameters (requires_grad false) of group g: they form g's companion group,
  // partitioned and gathered with g, after every trainable group (the core's order).
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> frozen(state->groups_.size());
  auto place = [&](int g, const std::string& name, const torch::Tensor& t) {
    if (t.requires_grad()) {
      add(g, name, t);
    } else {
      where[t.unsafeGetTensorImpl()] = g;
      frozen[static_cast<size_t>(g)].emplace_back(name, t);
    }
  };
  for (size_t k = 0; k < state->holders_.size(); ++k) {
    const auto& [path, holder] = state->holders_[k];
    const int g = static_cast<int>(k + 1);
    state->groups_[static_cast<size_t>(g)].name = path.empty() ? "model" : path;
    for (const auto& item : holder->named_parameters()) {
      const auto it = where.find(item.value().unsafeGetTensorImpl());
      if (it != where.end()) {
        if (it->second == g) continue;  // tied inside the holder
        Throw(InvalidArgumentError("strata::initialize: parameter '" + path + "." + item.key() +
                                   "' is shared between strata::zero3 modules"));
      }
      place(g, path.empty() ? item.key() : path + "." + item.key(), item.value());
    }
  }
  for (const auto& item : model->named_parameters()) {
    const auto it = where.find(item.value().unsafeGetTensorImpl());
    if (it != where.end()) {
      if (it->second == 0) continue;  // tied in the root group
      const std::string& path = state->holders_[static_cast<size_t>(it->second - 1)].first;
      if (path.empty() || item.key().rfind(path + ".", 0) == 0) continue;
      Throw(InvalidArgumentError("strata::initialize: parameter '" + item.key() +
                                 "' is used both inside strata::zero3 module '" + path +
                                 "' and outside it; a wrapped module's parameters must be "
                                 "its own"));
    }
    place(0, item.key(), item.value());
  }
  for (size_t g = 0; g < frozen.size(); ++g) {
    if (frozen[g].empty()) continue;
    const int c = static_cast<int>(state->groups_.size());
    state->groups_[g].companion = c;
    state->groups_.emplace_back();
    state->groups_.back().name = state->groups_[g].name + ":frozen";
    state->groups_.back().frozen = true;
    state->groups_.back().owner = static_cast<int>(g);
    for (const auto& [name, t] : frozen[g])
      add(c, name, t);
  }

  // Holders partitioned at construction (ZeroInit): their parameters are empty tensors
  // now; the shapes and the rank's shard come from the construction.
  std::shared_ptr<comm::Communicator> init_comm;
  for (size_t k = 0; k < state->holders_.size(); ++k) {
    const auto& [path, holder] = state->holders_[k];
    const std::shared_ptr<PartitionedGroup>& pg = holder->partitioned_;
    if (pg == nullptr) continue;
    GroupBinding& gb = state->groups_[k + 1];
    static const std::vector<ParamBinding> kNone;
    const std::vector<ParamBinding>& frozen_now =
        gb.companion < 0 ? kNone : state->groups_[static_cast<size_t>(gb.companion)].params;
    auto same = [&](const std::vector<ParamBinding>& now, const PartitionedParams& then) {
      bool ok = now.size() == then.names.size();
      for (size_t i = 0; ok && i < now.size(); ++i)
        ok = now[i].name == (path.empty() ? then.names[i] : path + "." + then.names[i]);
      return ok;
    };
    if (!same(gb.params, pg->trainable) || !same(frozen_now, pg->frozen)) {
      Throw(FailedPreconditionError(
          "strata::initialize: the strata::zero3 module '" + path +
          "' was partitioned at construction (strata::ZeroInit) with " +
          std::to_string(pg->trainable.names.size()) + " trainable and " +
          std::to_string(pg->frozen.names.size()) + " frozen parameters and now has " +
          std::to_string(gb.params.size()) + " and " + std::to_string(frozen_now.size()) +
          " (requires_grad or the parameters changed after construction)"));
    }
    if (pg->align_elems != options.align_elems) {
      Throw(InvalidArgumentError("strata::initialize: EngineOptions::align_elems = " +
                                 std::to_string(options.align_elems) +
                                 ", the strata::ZeroInit partitioned with " +
                                 std::to_string(pg->align_elems) + ": give both the same options"));
    }
    auto take = [](std::vector<ParamBinding>& now, const PartitionedParams& then) {
      for (size_t i = 0; i < now.size(); ++i) {
        now[i].shape = then.shapes[i];
        now[i].numel = then.numels[i];
      }
    };
    take(gb.params, pg->trainable);
    if (gb.companion >= 0)
      take(state->groups_[static_cast<size_t>(gb.companion)].params, pg->frozen);
    if (init_comm == nullptr) init_comm = pg->comm;
  }
  if (comm == nullptr && init_comm != nullptr) comm = init_comm;  // the ZeroInit's
  if (init_comm != nullptr) {
    const comm::Communicator& c = comm != nullptr ? *comm : *init_comm;
    for (const auto& [path, holder] : state->holders_) {
      const std::shared_ptr<PartitionedGroup>& pg = holder->partitioned_;
      if (pg != nullptr && (pg->world_size != c.world_size() || pg->rank != c.rank())) {
        Throw(InvalidArgumentError(
            "strata::initialize: the strata::zero3 module '" + path +
            "' was partitioned for rank " + std::to_string(pg->rank) + " of " +
            std::to_string(pg->world_size) + ", the engine's communicator is rank " +
            std::to_string(c.rank()) + " of " + std::to_string(c.world_size())));
      }
    }
  }

  // The compute device, and the engine's device and communicators for it.
  std::vector<std::pair<std::string, torch::Tensor>> managed;
  for (const GroupBinding& gb : state->groups_) {
    for (const ParamBinding& p : gb.params)
      managed.emplace_back(p.name, p.param);
  }
  const c10::Device device = ComputeDeviceOf(managed, config.strata.device);
  state->device_ = device;
  engine::EngineOptions eopts = options;
  if (device.is_cuda()) state->PrepareCuda(model, config, comm, eopts);
  if (comm == nullptr) {
    Result<comm::Rendezvous> rv = comm::RendezvousFromEnvironment({});
    if (!rv.ok()) Throw(rv.status().WithContext("strata::initialize: rendezvous"));
    comm::CommOptions co;
    if (rv->world_size == 1) co.interface = "127.0.0.1";  // nothing leaves the process
    Result<std::unique_ptr<comm::Communicator>> c =
        comm::CreateCommunicator(comm::Backend::kGloo, *rv, co);
    if (!c.ok()) Throw(c.status().WithContext("strata::initialize: communicator"));
    comm = std::move(*c);
  }
  if (comm->world_size() > 1 && comm->backend() == comm::Backend::kGloo) {
    // The lanes (docs/engine.md, "Lanes"), unless given: the gradient reductions and the
    // parameter all-gathers each on a duplicate of `comm`, which then carries only the
    // collectives the engine issues inside its calls (the caller's may go between any two).
    // Every rank makes them in this order. (NCCL: one lane; two are untried on two GPUs.)
    auto lane = [&](std::shared_ptr<comm::Communicator>& slot, const char* what,
                    const char* option) {
      if (slot != nullptr) return;
      Result<std::unique_ptr<comm::Communicator>> d = comm->Duplicate();
      if (!d.ok()) {
        Throw(d.status().WithContext(std::string("strata::initialize: ") + what +
                                     " (a duplicate of the communicator; or give one as "
                                     "EngineOptions::" +
                                     option + ")"));
      }
      slot = std::move(*d);
    };
    lane(eopts.reduce_comm, "the gradient reductions' communicator", "reduce_comm");
    lane(eopts.gather_comm, "the all-gathers' communicator", "gather_comm");
  }

  // The core, from fp32 copies of the initial values (on the host).
  std::vector<torch::Tensor> inits;
  std::vector<engine::GroupDesc> descs;
  for (size_t g = 0; g < state->groups_.size(); ++g) {
    const GroupBinding& gb = state->groups_[g];
    // The holder whose construction partitioned this group (its companion too), if any.
    const size_t holder_group = gb.frozen ? static_cast<size_t>(gb.owner) : g;
    const std::shared_ptr<PartitionedGroup> pg =
        holder_group == 0 ? nullptr : state->holders_[holder_group - 1].second->partitioned_;
    engine::GroupDesc d;
    d.name = gb.name;
    d.frozen = gb.frozen;
    if (pg != nullptr) {
      d.init_is_shard = true;
      d.init_shard = (gb.frozen ? pg->frozen : pg->trainable).shard.span();
    }
    for (const ParamBinding& p : gb.params) {
      const int group = options.param_group_of ? options.param_group_of(p.name) : 0;
      if (pg != nullptr) {
        d.params.push_back(
            {p.name, static_cast<size_t>(p.numel), nullptr, engine::DType::kFloat32, group});
        continue;
      }
      // The parameter's own memory when the core can read it (CPU, contiguous, fp32 / bf16 /
      // fp16: it converts), else an fp32 host copy (a CUDA model, another dtype).
      torch::Tensor init = p.param.detach();
      const c10::ScalarType t = init.scalar_type();
      if (!init.is_cpu() || !init.is_contiguous() ||
          (t != c10::kFloat && t != c10::kBFloat16 && t != c10::kHalf)) {
        init = init.to(torch::kCPU, torch::kFloat32).contiguous();
        inits.push_back(init);
      }
      d.params.push_back({p.name, static_cast<size_t>(p.numel), init.data_ptr(),
                          DTypeOf(init.scalar_type()), group});
    }
    descs.push_back(std::move(d));
  }
  Result<std::unique_ptr<engine::EngineCore>> core =
      engine::EngineCore::Create(config, comm, descs, eopts);
  if (!core.ok()) Throw(core.status());
  state->core_ = std::move(*core);
  inits.clear();
  for (const auto& [path, holder] : state->holders_)
    holder->partitioned_.reset();  // the shards are in the engine now
  // Parameters compute in the working dtype (on the CPU too: LibTorch 2.x has fp16 and
  // bf16 CPU kernels), pointing straight at the gathered buffer on the compute device.
  const c10::ScalarType compute =
      state->core_->dtype() == engine::DType::kBFloat16  ? c10::ScalarType::BFloat16
      : state->core_->dtype() == engine::DType::kFloat16 ? c10::ScalarType::Half
                                                         : c10::ScalarType::Float;

  // Free the original storage; every parameter gets its engine-side storage and a hook.
  for (size_t g = 0; g < state->groups_.size(); ++g) {
    GroupBinding& gb = state->groups_[g];
    for (size_t i = 0; i < gb.params.size(); ++i) {
      ParamBinding& p = gb.params[i];
      p.compute = compute;
      p.storage = c10::Storage(c10::Storage::use_byte_size_t(), 0,
                               c10::DataPtr(nullptr, state->device_), nullptr, false);
      {
        // The accumulator records the shape, dtype and device the gradients must have:
        // the parameter takes them on its engine storage, with no memory behind it yet.
        torch_internal::PointStorage(p.storage.unsafeGetStorageImpl(), nullptr, 0);
        p.storage.unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(p.numel) *
                                                     c10::elementSize(compute));
        p.param.set_data(OnStorage(p.storage, compute, p.shape));
      }
      p.param.mutable_grad() = torch::Tensor();
      if (gb.frozen) continue;  // no gradient
      p.accumulator = torch_internal::AddGradAccumulatorPostHook(
          p.param, std::make_unique<GradHook>(state, static_cast<int>(g), static_cast<int>(i)));
      if (p.accumulator == nullptr) {
        Throw(InternalError("strata::initialize: no gradient accumulator for " + p.name));
      }
    }
    state->Empty(static_cast<int>(g));
  }
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    Registry()[state->id_] = state;
  }
  for (size_t k = 0; k < state->holders_.size(); ++k) {
    state->holders_[k].second->state_ = state;
    state->holders_[k].second->group_ = static_cast<int>(k + 1);
  }
  // The root group is gathered from here (and after every step) to the end of backward.
  Check(state->Acquire(0, engine::Phase::kForward, /*holds=*/true));
  return state;
}

void EngineState::PrepareCuda(const std::shared_ptr<torch::nn::Module>& model, const Config& config,
                              std::shared_ptr<comm::Communicator>& comm,
                              engine::EngineOptions& options) {
#if !defined(STRATA_TORCH_CUDA)
  (void)model;
  (void)config;
  (void)comm;
  (void)options;
  Throw(UnimplementedError("strata::initialize: the compute device is " + device_.str() +
                           " but this build of Strata has no CUDA (configure it with the CUDA "
                           "toolkit found and a CUDA build of LibTorch)"));
#else
  const int count = c10::cuda::device_count();
  const int index = device_.has_index() ? device_.index() : c10::cuda::current_device();
  if (index >= count) {
    Throw(InvalidArgumentError(
        "strata::initialize: the compute device is cuda:" + std::to_string(index) +
        " but this process sees " + std::to_string(count) + " CUDA devices"));
  }
  device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  {
    // What the engine does not manage (the buffers) follows the model to the device.
    torch::NoGradGuard no_grad;
    for (torch::Tensor& b : model->buffers()) {
      if (b.defined() && b.device() != device_) b.set_data(b.to(device_));
    }
  }
  if (options.device == nullptr) {
    engine::CudaDeviceOptions o;
    o.device = index;
    o.budget_bytes = config.strata.device_budget;
    // LibTorch's current stream on this device is the engine's compute stream.
    o.compute_stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)).stream();
    Result<std::unique_ptr<engine::Device>> d = engine::MakeCudaDevice(o);
    if (!d.ok()) Throw(d.status().WithContext("strata::initialize: the CUDA device"));
    options.device = std::shared_ptr<engine::Device>(std::move(*d));
  }
  if (comm == nullptr) {
    // NCCL for the device buffers, gloo for the host's, both from torchrun's environment.
    Result<comm::Rendezvous> rv = comm::RendezvousFromEnvironment({});
    if (!rv.ok()) Throw(rv.status().WithContext("strata::initialize: rendezvous"));
    comm::CommOptions nco;
    nco.device = comm::Device::Cuda(index);
    Result<std::unique_ptr<comm::Communicator>> nccl =
        comm::CreateCommunicator(comm::Backend::kNccl, *rv, nco);
    if (!nccl.ok()) Throw(nccl.status().WithContext("strata::initialize: NCCL communicator"));
    comm = std::move(*nccl);
    if (options.host_comm == nullptr) {
      comm::CommOptions gco;
      if (rv->world_size == 1) gco.interface = "127.0.0.1";
      Result<std::unique_ptr<comm::Communicator>> gloo =
          comm::CreateCommunicator(comm::Backend::kGloo, *rv, gco);
      if (!gloo.ok()) Throw(gloo.status().WithContext("strata::initialize: gloo communicator"));
      options.host_comm = std::move(*gloo);
    }
  } else if (comm->backend() != comm::Backend::kNccl) {
    Throw(InvalidArgumentError(
        "strata::initialize: the compute device is " + device_.str() + " but the communicator is " +
        std::string(comm::BackendName(comm->backend())) +
        ": the engine's communicator carries device buffers and must be NCCL (pass an NCCL "
        "communicator and a gloo one as EngineOptions::host_comm, or none: both are then made "
        "from torchrun's environment)"));
  }
#endif
}

// ---------------------------------------------------------------------------
// Zero3ModuleBase

Zero3ModuleBase::Zero3ModuleBase(std::string inner_name)
    : torch::nn::Module("strata::Zero3"), inner_name_(std::move(inner_name)) {}

void Zero3ModuleBase::PartitionIfInitializing() {
  ZeroInit* init = g_zero_init;
  if (init == nullptr) return;
  torch::NoGradGuard no_grad;
  auto pg = std::make_shared<PartitionedGroup>();
  pg->comm = init->comm_;
  pg->align_elems = init->align_elems_;
  pg->world_size = init->comm_->world_size();
  pg->rank = init->comm_->rank();
  // The groups initialize will make: the trainable parameters in registration order (a
  // parameter tied inside the module once), and the frozen ones (its companion group).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<torch::Tensor> tensors[2];
  std::vector<engine::ParamSpec> specs[2];
  for (const auto& item : named_parameters()) {
    const torch::Tensor& t = item.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
    const int f = t.requires_grad() ? 0 : 1;
    PartitionedParams& pp = f == 0 ? pg->trainable : pg->frozen;
    tensors[f].push_back(t);
    specs[f].push_back({item.key(), static_cast<size_t>(t.numel())});
    pp.names.push_back(item.key());
    pp.shapes.push_back(t.sizes().vec());
    pp.numels.push_back(t.numel());
  }
  uint64_t shard_bytes = 0;
  for (int f = 0; f < 2; ++f) {
    PartitionedParams& pp = f == 0 ? pg->trainable : pg->frozen;
    const std::string what = inner_name_ + (f == 0 ? "" : " (frozen parameters)");
    Result<engine::GroupLayout> layout =
        engine::LayoutGroup(what, specs[f], pg->world_size, pg->align_elems);
    Check(layout.status().WithContext("strata::ZeroInit: partitioning " + what));
    // Rank 0's values, flattened and padded as the engine's group buffer, to every rank
    // (one block at a time: the peak while building).
    MappedFloats full(layout->padded_numel);
    if (!init->broadcast_ || pg->rank == 0) {
      for (size_t i = 0; i < tensors[f].size(); ++i) {
        torch::Tensor v = tensors[f][i].detach().to(torch::kCPU, torch::kFloat32).contiguous();
        std::copy_n(v.data_ptr<float>(), v.numel(), full.data() + layout->params[i].offset);
      }
    }
    if (init->broadcast_ && pg->world_size > 1 && full.size() > 0) {
      // Every rank at the broadcast before rank 0 sends: a receiver still building its
      // block would otherwise take the block's bytes into its transport's holding buffers
      // (a second copy of the block on the heap of another thread).
      Check(init->comm_->Barrier().WithContext("strata::ZeroInit: barrier before " + what +
                                               "'s broadcast"));
      Check(init->comm_->Broadcast(full.data(), full.size(), comm::DType::kFloat32, 0)
                .WithContext("strata::ZeroInit: broadcasting the initial values of " + what));
    }
    pp.shard = MappedFloats(layout->shard_numel);
    std::copy_n(full.data() + layout->shard_begin(pg->rank), layout->shard_numel, pp.shard.data());
    shard_bytes += layout->shard_numel * sizeof(float);
  }
  for (const std::vector<torch::Tensor>& ts : tensors)
    for (torch::Tensor t : ts)
      t.set_data(torch::empty({0}, t.options()));  // the module's memory goes back
#if defined(__GLIBC__)
  // ... to the system too: glibc keeps freed chunks of the heap resident (and, with its
  // dynamic mmap threshold, serves the next block's tensors from fresh pages), so without
  // this the process's resident set grows by a block per block built (measured).
  malloc_trim(0);
#endif
  ++init->holders_;
  init->shard_bytes_ += shard_bytes;
  partitioned_ = std::move(pg);
}

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
  if (state == nullptr || state->HasTrainable(group_)) return input;
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

// ---------------------------------------------------------------------------
// ZeroInit

ZeroInit::ZeroInit(const Config& config, std::shared_ptr<comm::Communicator> comm,
                   const engine::EngineOptions& options)
    : comm_(std::move(comm)),
      align_elems_(options.align_elems),
      broadcast_(options.broadcast_initial_values) {
  if (detail::g_zero_init != nullptr) {
    detail::Throw(FailedPreconditionError(
        "strata::ZeroInit: another ZeroInit is active on this thread (one at a time)"));
  }
  if (config.zero.stage != 3) {
    detail::Throw(InvalidArgumentError(
        "strata::ZeroInit: zero_optimization.stage = " + std::to_string(config.zero.stage) +
        ": partitioned construction is ZeRO stage 3's"));
  }
  if (comm_ == nullptr) {
    Result<comm::Rendezvous> rv = comm::RendezvousFromEnvironment({});
    if (!rv.ok()) detail::Throw(rv.status().WithContext("strata::ZeroInit: rendezvous"));
    comm::CommOptions co;
    if (rv->world_size == 1) co.interface = "127.0.0.1";
    Result<std::unique_ptr<comm::Communicator>> c =
        comm::CreateCommunicator(comm::Backend::kGloo, *rv, co);
    if (!c.ok()) detail::Throw(c.status().WithContext("strata::ZeroInit: communicator"));
    comm_ = std::move(*c);
  } else if (comm_->backend() != comm::Backend::kGloo) {
    detail::Throw(InvalidArgumentError(
        "strata::ZeroInit: the communicator is " +
        std::string(comm::BackendName(comm_->backend())) +
        "; partitioned construction moves host buffers and needs a gloo communicator"));
  }
  detail::g_zero_init = this;
}

ZeroInit::~ZeroInit() {
  if (detail::g_zero_init == this) detail::g_zero_init = nullptr;
}

namespace {
detail::EngineState& Get(const std::shared_ptr<detail::EngineState>& s) {
  if (s == nullptr) {
    detail::Throw(FailedPreconditionError(
        "strata::Engine: empty handle (use the one strata::initialize returned)"));
  }
  return *s;
}
}  // namespace

void Engine::backward(const torch::Tensor& loss) {
  Get(state_).Backward(loss);
}
engine::StepOutcome Engine::step() {
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
  state_->LoadSafetensors(path);
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

void load_safetensors(Engine& engine, const std::string& path) {
  engine.load_safetensors(path);
}

torch::OrderedDict<std::string, torch::Tensor> Engine::gather_parameters() {
  return Get(state_).GatherParameters();
}

Engine initialize(std::shared_ptr<torch::nn::Module> model, const Config& config,
                  std::shared_ptr<comm::Communicator> comm, const engine::EngineOptions& options) {
  return Engine(detail::EngineState::Build(std::move(model), config, std::move(comm), options));
}

}  // namespace strata

// TensorEngine's hooks over the hook protocol: a block's forward, the autograd functions
// around its outputs and inputs, the gradient hook, and engine.backward's checks
// (tensor_engine.h).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include "strata/engine/libtorch/error.h"
#include "strata/engine/libtorch/tensor_engine.h"

#if defined(STRATA_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata {

struct TensorEngineAccess {
  static void PreBackward(TensorEngine& e, int g) { e.OnPreBackward(g); }
  static void PostBackward(TensorEngine& e, int g) { e.OnPostBackward(g); }
  static void Gradient(TensorEngine& e, int g, int i) { e.OnGradient(g, i); }
};

namespace {

using torch::autograd::variable_list;

// Whether autograd is running a backward pass on this thread: a block's forward then is
// activation checkpointing's recompute.
bool InRecompute() {
  return torch::autograd::get_current_graph_task_id() != -1;
}

// The identity on tensors around a block whose backward calls `Hook` with the group: on its
// outputs, PreBackward (re-gather the group before the block's gradient functions run); on
// the inputs of a block with frozen parameters, PostBackward (its backward is over once the
// inputs' gradients are computed).
template <void (*Hook)(TensorEngine&, int)>
struct GroupIdentityFunction : public torch::autograd::Function<GroupIdentityFunction<Hook>> {
  static variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                               int64_t engine_id, int64_t group) {
    ctx->saved_data["engine"] = engine_id;
    ctx->saved_data["group"] = group;
    return tensors.vec();
  }
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    std::shared_ptr<TensorEngine> e = LookupTensorEngine(ctx->saved_data["engine"].toInt());
    if (e == nullptr) {
      throw Error(FailedPreconditionError(
          "strata: backward through a block whose engine was destroyed or closed"));
    }
    Hook(*e, static_cast<int>(ctx->saved_data["group"].toInt()));
    grads.emplace_back();  // engine_id
    grads.emplace_back();  // group
    return grads;
  }
};
using PreBackwardFunction = GroupIdentityFunction<&TensorEngineAccess::PreBackward>;
using PostBackwardFunction = GroupIdentityFunction<&TensorEngineAccess::PostBackward>;

class GradHook final : public torch::autograd::FunctionPostHook {
 public:
  GradHook(std::weak_ptr<TensorEngine> engine, int group, int param)
      : engine_(std::move(engine)), group_(group), param_(param) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    if (auto e = engine_.lock()) TensorEngineAccess::Gradient(*e, group_, param_);
    return outputs;
  }

 private:
  std::weak_ptr<TensorEngine> engine_;
  int group_;
  int param_;
};

// `tensors` through `Function` where `wrap(t)` says so; the others as they are.
template <typename Function, typename Wrap>
std::vector<torch::Tensor> WrapSome(std::vector<torch::Tensor> tensors, int64_t id, int g,
                                    Wrap&& wrap) {
  std::vector<size_t> index;
  std::vector<torch::Tensor> some;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && tensors[i].requires_grad() && wrap(tensors[i])) {
      index.push_back(i);
      some.push_back(tensors[i]);
    }
  }
  if (some.empty()) return tensors;
  variable_list wrapped = Function::apply(at::TensorList(some), id, int64_t{g});
  for (size_t k = 0; k < index.size(); ++k)
    tensors[index[k]] = wrapped[k];
  return tensors;
}

}  // namespace

std::unique_ptr<torch::autograd::FunctionPostHook> TensorEngine::MakeGradHook(int g, int i) {
  return std::make_unique<GradHook>(weak_from_this(), g, i);
}

Status TensorEngine::FollowComputeStream() {
#if defined(STRATA_TORCH_CUDA)
  if (!device_.is_cuda() || core_ == nullptr) return Status::Ok();
  return core_->UseComputeStream(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
#else
  return Status::Ok();
#endif
}

Status TensorEngine::BeginForward(int g) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  if (!whole_.empty()) {
    return FailedPreconditionError(
        options_.names.prefix + "a forward while a " + options_.gathered +
        " lives: release it first (the engine gathers what a forward uses by itself)");
  }
  STRATA_RETURN_IF_ERROR(FollowComputeStream());
  return hooks->BeginForward(g, InRecompute());
}

Status TensorEngine::EndForward(int g, bool unwinding) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  return hooks->EndForward(g, InRecompute(), unwinding);
}

std::vector<torch::Tensor> TensorEngine::WrapOutputs(int g, std::vector<torch::Tensor> outputs) {
  // A recompute's outputs need no re-gather in their backward: the group is gathered.
  if (!torch::GradMode::is_enabled() || InRecompute() || hooks_ == nullptr) return outputs;
  return WrapSome<PreBackwardFunction>(std::move(outputs), id_, g,
                                       [](const torch::Tensor&) { return true; });
}

std::vector<torch::Tensor> TensorEngine::WrapInputs(int g, std::vector<torch::Tensor> inputs) {
  if (!torch::GradMode::is_enabled() || hooks_ == nullptr) return inputs;
  bool any = false;
  for (const torch::Tensor& t : inputs)
    any = any || (t.defined() && t.requires_grad());
  // The protocol counts the PostBackward calls it expects: ask only when some input needs one.
  if (!any || !hooks_->ExpectInputs(g, InRecompute())) return inputs;
  return WrapSome<PostBackwardFunction>(std::move(inputs), id_, g,
                                        [](const torch::Tensor&) { return true; });
}

void TensorEngine::OnPreBackward(int g) {
  if (hooks_ == nullptr) throw Error(FailedPreconditionError("strata: the engine was closed"));
  Status s = FollowComputeStream();
  if (s.ok()) s = hooks_->PreBackward(g);
  if (!s.ok()) throw Error(std::move(s));
}

void TensorEngine::OnPostBackward(int g) {
  if (hooks_ != nullptr) (void)hooks_->PostBackward(g);  // kept by the protocol, thrown after
}

void TensorEngine::OnGradient(int g, int i) {
  if (hooks_ == nullptr) return;
  TensorParam& p = groups_[static_cast<size_t>(g)].params[static_cast<size_t>(i)];
  torch::Tensor grad = p.tensor.grad();
  if (!grad.defined()) return;
  if (grad.is_sparse()) {
    hooks_->Keep(UnimplementedError(options_.names.prefix + "sparse gradient of parameter " +
                                    p.name + " (use a dense embedding)"));
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
  // An error is kept by the protocol and reported by the backward (autograd's post-hooks do
  // not throw into the autograd engine here).
  (void)hooks_->Gradient(g, i, grad.data_ptr(), EngineDTypeOf(grad.scalar_type()),
                         std::move(owner));
  p.tensor.mutable_grad() = torch::Tensor();
}

Result<torch::Tensor> TensorEngine::BeginBackward(const torch::Tensor& loss) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  STRATA_RETURN_IF_ERROR(FollowComputeStream());
  STRATA_RETURN_IF_ERROR(hooks->BeginBackward());
  const std::string& api = options_.names.api;
  if (!loss.defined() || loss.numel() != 1) {
    return InvalidArgumentError(api + "backward: the loss must be a tensor of one element");
  }
  if (!loss.requires_grad()) {
    return InvalidArgumentError(api +
                                "backward: the loss does not require grad (computed under "
                                "no_grad, or from no parameter)");
  }
  try {
    return loss * core_->LossMultiplier();
  } catch (const std::exception& e) {
    return InternalError(api + "backward: scaling the loss: " + e.what());
  }
}

Status TensorEngine::FinishBackward() {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  return hooks->FinishBackward();
}

Status TensorEngine::AutogradFailed(const std::string& what) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  return hooks->AutogradFailed(what);
}

}  // namespace strata

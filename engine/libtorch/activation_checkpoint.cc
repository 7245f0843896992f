// strata::checkpoint (activation_checkpoint.h): a custom autograd function that runs its
// function without grad in the forward, saves only the inputs, and in the backward runs
// the function again with grad, then differentiates the recomputed outputs (a reentrant
// backward, as torch.utils.checkpoint's use_reentrant=True). The Strata engine sees the
// recompute as a forward inside a backward pass (engine_state.cc, InRecompute) and gathers the
// wrapped blocks for their backward there.
#include "strata/engine/libtorch/activation_checkpoint.h"

#include <ATen/Context.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <utility>

namespace strata {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs: the function, how many of the saved tensors are the caller's
// inputs (a dummy follows them), and the random-number state at the forward.
struct Recompute : torch::CustomClassHolder {
  CheckpointFunction fn;
  CheckpointOptions options;
  size_t num_inputs = 0;
  // inputs_in_host_memory: the pinned host copies of the CUDA inputs (undefined for the
  // others, which are saved as they are), with each one's device and requires_grad.
  std::vector<torch::Tensor> host;
  std::vector<c10::Device> devices;
  std::vector<bool> requires_grad;
  torch::Tensor cpu_rng;
  std::vector<std::pair<c10::Device, torch::Tensor>> device_rng;  // each CUDA device used
};

std::vector<c10::Device> CudaDevicesOf(const std::vector<torch::Tensor>& inputs) {
  std::vector<c10::Device> out;
  for (const torch::Tensor& t : inputs) {
    if (!t.defined() || !t.is_cuda()) continue;
    if (std::find(out.begin(), out.end(), t.device()) == out.end()) out.push_back(t.device());
  }
  return out;
}

// Sets the generators to the forward's states for the recompute and puts the current
// states back afterwards (also when the recompute throws).
class RngFork {
 public:
  explicit RngFork(const Recompute& r) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    saved_.emplace_back(cpu, cpu.get_state());
    cpu.set_state(r.cpu_rng);
    for (const auto& [device, state] : r.device_rng) {
      at::Generator g = at::globalContext().defaultGenerator(device);
      saved_.emplace_back(g, g.get_state());
      g.set_state(state);
    }
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;
  ~RngFork() {
    for (auto& [gen, state] : saved_)
      gen.set_state(state);
  }

 private:
  std::vector<std::pair<at::Generator, torch::Tensor>> saved_;
};

struct CheckpointNode : public torch::autograd::Function<CheckpointNode> {
  // `all`: the caller's inputs, then a dummy that requires grad (so the node is recorded
  // even when no input requires grad: the block's parameters still need their gradients).
  static variable_list forward(AutogradContext* ctx, at::TensorList all,
                               c10::intrusive_ptr<Recompute> r) {
    std::vector<torch::Tensor> inputs(all.begin(),
                                      all.begin() + static_cast<int64_t>(r->num_inputs));
    r->cpu_rng = at::detail::getDefaultCPUGenerator().get_state();
    for (const c10::Device& d : CudaDevicesOf(inputs))
      r->device_rng.emplace_back(d, at::globalContext().defaultGenerator(d).get_state());
    if (r->options.inputs_in_host_memory) {
      std::vector<torch::Tensor> keep;
      for (const torch::Tensor& t : inputs) {
        r->devices.push_back(t.defined() ? t.device() : c10::Device(c10::kCPU));
        r->requires_grad.push_back(t.defined() && t.requires_grad());
        if (t.defined() && t.is_cuda()) {
          torch::Tensor h =
              torch::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
          // A blocking copy (as torch's save_on_cpu): the backward may run on another
          // stream, and its copy back must not read the host buffer before this one lands.
          h.copy_(t);
          r->host.push_back(std::move(h));
          keep.emplace_back();
        } else {
          r->host.emplace_back();
          keep.push_back(t);
        }
      }
      ctx->save_for_backward(keep);
    } else {
      ctx->save_for_backward(inputs);
    }
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(r);
    // Autograd runs this with grad mode off: the function keeps no activations.
    std::vector<torch::Tensor> outputs = r->fn(inputs);
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK(outputs[i].defined(), "strata::checkpoint: the function's output ", i,
                  " is an undefined tensor");
    }
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto r =
        c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> detached;
    detached.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      const bool from_host = r->options.inputs_in_host_memory && r->host[i].defined();
      torch::Tensor d =
          from_host ? r->host[i].to(r->devices[i], /*non_blocking=*/true) : saved[i].detach();
      const bool grad =
          r->options.inputs_in_host_memory ? r->requires_grad[i] : saved[i].requires_grad();
      if (grad) d.requires_grad_(true);
      detached.push_back(std::move(d));
    }
    std::vector<torch::Tensor> outputs;
    {
      RngFork fork(*r);
      torch::AutoGradMode grad(true);
      outputs = r->fn(detached);
    }
    TORCH_CHECK(outputs.size() == grads.size(), "strata::checkpoint: the function returned ",
                outputs.size(), " tensors in the backward's recompute but ", grads.size(),
                " in the forward: it must compute the same function both times");
    std::vector<torch::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    variable_list out;
    out.reserve(detached.size() + 2);
    for (const torch::Tensor& d : detached)
      out.push_back(d.requires_grad() ? d.grad() : torch::Tensor());
    out.emplace_back();  // the dummy
    out.emplace_back();  // the Recompute (not a tensor)
    return out;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint(const CheckpointFunction& fn,
                                      const std::vector<torch::Tensor>& inputs,
                                      const CheckpointOptions& options) {
  TORCH_CHECK(fn, "strata::checkpoint: the function is empty");
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  auto r = c10::make_intrusive<Recompute>();
  r->fn = fn;
  r->options = options;
  r->num_inputs = inputs.size();
  std::vector<torch::Tensor> all = inputs;
  all.push_back(torch::empty({0}, torch::TensorOptions().requires_grad(true)));
  return CheckpointNode::apply(at::TensorList(all), r);
}

torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& input, const CheckpointOptions& options) {
  TORCH_CHECK(fn, "strata::checkpoint: the function is empty");
  std::vector<torch::Tensor> out = checkpoint(
      [fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; },
      std::vector<torch::Tensor>{input}, options);
  return out[0];
}

}  // namespace strata

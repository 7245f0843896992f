// Activation checkpointing for the LibTorch front end: the C++ counterpart of
// torch.utils.checkpoint.
//
//   torch::Tensor h = emb(tokens);
//   for (auto& block : blocks)   // strata::zero3(Block(...)) holders
//     h = strata::checkpoint([block](const torch::Tensor& x) mutable { return block->forward(x); },
//     h);
//
// The forward runs `fn` without keeping its activations (only the inputs are saved); the
// backward runs `fn` again on the saved inputs, with the random-number state the forward
// had (dropout draws the same masks), and differentiates that. Inside a Strata engine the
// recompute re-gathers the wrapped blocks' parameters as for their backward, and releases
// them when their gradients have arrived (docs/engine.md, "Activation checkpointing").
//
// Memory: with N blocks checkpointed the graph keeps N block inputs; the backward adds one
// block's activations at a time. Outside grad mode (evaluation, torch::NoGradGuard) `fn`
// simply runs.
//
// `fn` is called twice (forward and backward) and must compute the same function of its
// inputs both times: capture modules by value (holders share their module) and nothing
// that changes between the forward and the backward.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace strata {

using CheckpointFunction =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& inputs)>;

struct CheckpointOptions {
  // DeepSpeed's activation_checkpointing.cpu_checkpointing: the saved inputs of a CUDA
  // device live in pinned host memory between the forward and the backward (copied out
  // in the forward, waiting for the copy, as torch's save_on_cpu; copied back before the
  // recompute); the device keeps none of them. Inputs on the CPU are kept as they are.
  // Engine::checkpoint_options() gives the config's value.
  bool inputs_in_host_memory = false;
};

// fn(inputs) with its activations recomputed in the backward. Inputs may be of any dtype
// (only floating-point ones that require grad get gradients) and on any device.
std::vector<torch::Tensor> checkpoint(const CheckpointFunction& fn,
                                      const std::vector<torch::Tensor>& inputs,
                                      const CheckpointOptions& options = {});

// One tensor in, one out.
torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& input, const CheckpointOptions& options = {});

}  // namespace strata

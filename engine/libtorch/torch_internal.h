// The LibTorch internals Strata's front ends use, each in one place. No public API of
// PyTorch covers them; each was checked against the LibTorch versions named below, and
// STRATA_MIN_TORCH_VERSION (CMakeLists.txt) refuses older ones at configure time.
//
// - PointStorage: a parameter's storage is pointed at engine-owned memory (the gathered
//   group, or nothing) without a copy, so the views autograd saved in the forward see the
//   buffer re-gathered for the backward. c10::StorageImpl::set_data_ptr_noswap and
//   set_nbytes; checked on 2.11.0.
// - AddGradAccumulatorPostHook: a hook that runs after a parameter's gradient was
//   accumulated into .grad, for both front ends (tensor_engine.h). Python's public
//   Tensor.register_post_accumulate_grad_hook has no C++ counterpart, so the hook goes on the
//   gradient accumulator node (torch::autograd::impl::grad_accumulator, Node::add_post_hook,
//   removed again with Node::del_post_hook); checked on 2.11.0.
// - The Python front end refuses torch.compile by finding Dynamo's OptimizeContext or
//   OptimizedModule on the stack (torch/_dynamo/eval_frame.py; strata/_hooks.py,
//   under_torch_compile), and a compiled module by Module._compiled_call_impl; checked on
//   2.11.0. If the names change, the check stops firing (Dynamo would then run the model
//   eagerly); tests/python/test_engine.py notices.
// - c10d's TCPStore (comm/rendezvous.cc) is the store torchrun's agent runs; its C++ header
//   is public in the wheel but not a documented API; checked on 2.11.0.
//
// Header-only, included by engine/libtorch/ only.
#pragma once

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

namespace strata::torch_internal {

// Points `impl` (a storage of the CPU or of a CUDA device, which it keeps) at `data`
// (nullptr: nothing) of `nbytes` bytes without copying or freeing anything: the previous
// memory is released by its owner.
inline void PointStorage(c10::StorageImpl* impl, void* data, size_t nbytes) {
  impl->set_data_ptr_noswap(c10::DataPtr(data, impl->device()));
  impl->set_nbytes(data == nullptr ? 0 : nbytes);
}

// Adds `hook` to the gradient accumulator of leaf `param` and returns the accumulator
// (hold it: the node lives as long as someone holds it or the parameter's autograd meta).
inline std::shared_ptr<torch::autograd::Node> AddGradAccumulatorPostHook(
    const at::Tensor& param, std::unique_ptr<torch::autograd::FunctionPostHook> hook) {
  std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(param);
  if (acc == nullptr) return nullptr;
  acc->add_post_hook(std::move(hook));
  return acc;
}

}  // namespace strata::torch_internal

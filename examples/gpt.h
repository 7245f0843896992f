// The model of strata-train: a GPT-style byte-level decoder in LibTorch.
//
//   x = wte(idx) + wpe(pos)                      token and position embeddings
//   x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))  N pre-norm blocks (causal self-attention)
//   logits = ln_f(x) @ wte^T                     the head tied to the token embedding
//   loss = cross_entropy(logits, next bytes)
//
// The blocks are held by a `BlockPolicy::Holder`: `Block` itself for plain LibTorch (the
// baseline), or `strata::Zero3<BlockImpl>` under the engine (a module holder whose forward
// has BlockImpl::forward's signature, so the model code is the same). Parameters outside
// the blocks (embeddings, ln_f) form the engine's root group.
//
// Initialization (GPT-2's): Linear and Embedding weights ~ N(0, 0.02), the residual
// projections ~ N(0, 0.02 / sqrt(2 N)), biases 0, LayerNorm 1 and 0. Drawn from LibTorch's
// global generator in construction order (wte, wpe, block 0 .. N-1, ln_f), so the same
// seed builds the same model whichever holder wraps the blocks.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/model_shapes.h"

namespace strata::train {

// The model's shape: core's (strata/core/model_shapes.h), where the planner and
// strata-config find strata-train's presets and their parameter counts.
using GptOptions = strata::GptShape;

// One pre-norm transformer block.
class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptOptions& options);
  // x: [B, T, d_model] -> [B, T, d_model].
  torch::Tensor forward(torch::Tensor x);

 private:
  int64_t n_heads_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, attn_proj_{nullptr}, fc_{nullptr}, mlp_proj_{nullptr};
  torch::Tensor causal_mask_;  // [T, T] bool, true above the diagonal; not a parameter
};
TORCH_MODULE(Block);

// Plain LibTorch blocks.
struct PlainBlocks {
  using Holder = Block;
  static Holder Make(const GptOptions& options) { return Block(options); }
};

// The embeddings, final norm and tied head: shared by every instantiation of GptImpl.
class GptBase : public torch::nn::Module {
 public:
  const GptOptions& options() const { return options_; }

 protected:
  explicit GptBase(const GptOptions& options);
  void BuildFinal();  // ln_f, after the blocks (construction order fixes the init order)
  torch::Tensor Embed(const torch::Tensor& idx);
  torch::Tensor Loss(const torch::Tensor& x, const torch::Tensor& targets);

  GptOptions options_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
};

template <typename BlockPolicy>
class GptImpl : public GptBase {
 public:
  explicit GptImpl(const GptOptions& options) : GptBase(options) {
    for (int64_t i = 0; i < options.n_layers; ++i) {
      blocks_.push_back(BlockPolicy::Make(options));
      register_module("h" + std::to_string(i), blocks_.back());
    }
    BuildFinal();
  }

  // idx, targets: [B, T] int64 bytes -> the mean cross-entropy (a scalar).
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets) {
    torch::Tensor x = Embed(idx);
    for (auto& block : blocks_)
      x = block(x);
    return Loss(x, targets);
  }

 private:
  std::vector<typename BlockPolicy::Holder> blocks_;
};

}  // namespace strata::train

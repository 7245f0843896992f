#include "strata/examples/gpt.h"

#include <cmath>
#include <stdexcept>

namespace strata::train {

namespace {

void InitLinear(torch::nn::Linear& layer, double std) {
  torch::nn::init::normal_(layer->weight, 0.0, std);
  torch::nn::init::zeros_(layer->bias);
}

}  // namespace

BlockImpl::BlockImpl(const GptOptions& o) : n_heads_(o.n_heads) {
  if (o.d_model % o.n_heads != 0)
    throw std::invalid_argument("d_model (" + std::to_string(o.d_model) +
                                ") must be a multiple of heads (" + std::to_string(o.n_heads) +
                                ")");
  ln_1_ = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(o.d_model, 3 * o.d_model));
  attn_proj_ = register_module("attn_proj", torch::nn::Linear(o.d_model, o.d_model));
  ln_2_ = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})));
  fc_ = register_module("fc", torch::nn::Linear(o.d_model, o.d_mlp));
  mlp_proj_ = register_module("mlp_proj", torch::nn::Linear(o.d_mlp, o.d_model));
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(o.n_layers));
  InitLinear(qkv_, 0.02);
  InitLinear(attn_proj_, residual_std);
  InitLinear(fc_, 0.02);
  InitLinear(mlp_proj_, residual_std);
  causal_mask_ = torch::ones({o.seq_len, o.seq_len}, torch::kBool).triu(1);
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  const int64_t hd = C / n_heads_;
  // Attention.
  std::vector<torch::Tensor> qkv = qkv_(ln_1_(x)).split(C, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_heads_, hd}).transpose(1, 2); };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  torch::Tensor att =
      torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  using torch::indexing::Slice;
  att = att.masked_fill(causal_mask_.index({Slice(0, T), Slice(0, T)}),
                        -std::numeric_limits<float>::infinity());
  att = torch::softmax(att, -1);
  torch::Tensor y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
  x = x + attn_proj_(y);
  // MLP.
  x = x + mlp_proj_(torch::gelu(fc_(ln_2_(x))));
  return x;
}

GptBase::GptBase(const GptOptions& o) : options_(o) {
  wte_ = register_module("wte", torch::nn::Embedding(o.vocab, o.d_model));
  wpe_ = register_module("wpe", torch::nn::Embedding(o.seq_len, o.d_model));
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(wte_->weight, 0.0, 0.02);
  torch::nn::init::normal_(wpe_->weight, 0.0, 0.02);
}

void GptBase::BuildFinal() {
  ln_f_ = register_module("ln_f",
                          torch::nn::LayerNorm(torch::nn::LayerNormOptions({options_.d_model})));
}

torch::Tensor GptBase::Embed(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  torch::Tensor pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong));
  return wte_(idx) + wpe_(pos).unsqueeze(0);
}

torch::Tensor GptBase::Loss(const torch::Tensor& x, const torch::Tensor& targets) {
  torch::Tensor logits = torch::matmul(ln_f_(x), wte_->weight.t());
  return torch::nn::functional::cross_entropy(logits.view({-1, options_.vocab}),
                                              targets.reshape({-1}));
}

}  // namespace strata::train

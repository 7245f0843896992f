// The model shapes the planner knows by name: strata-train's GPT-style presets as plain
// numbers. examples/gpt.h builds these shapes in LibTorch (its GptOptions is this struct);
// `strata-config plan --model NAME` and `strata-train --model NAME --plan` take their
// parameter count and largest group from here, so both print the same plan.
//
// Thread-safety: plain values; the preset table is immutable.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace strata {

// A GPT-style byte-level decoder: token and position embeddings, n_layers pre-norm blocks
// (LayerNorm, causal self-attention with a fused qkv projection, LayerNorm, a 2-layer MLP,
// every Linear with a bias), a final LayerNorm and the head tied to the token embedding.
struct GptShape {
  int64_t vocab = 256;  // bytes
  int64_t seq_len = 128;
  int64_t d_model = 128;
  int64_t n_layers = 8;
  int64_t n_heads = 4;
  int64_t d_mlp = 512;  // hidden width of the MLP

  std::string ToString() const;  // "8 layers, d_model 128, 4 heads, d_mlp 512, ..."
  // Parameter counts, without building the model: one block, the rest (embeddings, ln_f).
  int64_t BlockParams() const;
  int64_t RootParams() const;
  int64_t TotalParams() const { return RootParams() + n_layers * BlockParams(); }
  // The largest wrapped module under strata-train: a block, or the root group.
  int64_t LargestGroupParams() const;
};

struct ModelPreset {
  const char* name;
  GptShape shape;
  const char* what;  // "0.62M parameters, the default"
};

// strata-train's presets, smallest first ("small" is strata-train's default).
std::span<const ModelPreset> ModelPresets();
// nullptr when `name` is not a preset.
const ModelPreset* FindModelPreset(std::string_view name);
// "tiny|small|medium|large".
std::string ModelPresetNames();

}  // namespace strata

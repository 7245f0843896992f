#include "strata/core/model_shapes.h"

#include <algorithm>
#include <sstream>

namespace strata {

std::string GptShape::ToString() const {
  std::ostringstream s;
  s << n_layers << " layers, d_model " << d_model << ", " << n_heads << " heads, d_mlp " << d_mlp
    << ", seq_len " << seq_len << ", vocab " << vocab;
  return s.str();
}

int64_t GptShape::BlockParams() const {
  const int64_t d = d_model;
  return 2 * 2 * d            // ln_1, ln_2
         + d * 3 * d + 3 * d  // qkv
         + d * d + d          // attention projection
         + d * d_mlp + d_mlp  // fc
         + d_mlp * d + d;     // mlp projection
}

int64_t GptShape::RootParams() const {
  return vocab * d_model + seq_len * d_model + 2 * d_model;  // wte, wpe, ln_f
}

int64_t GptShape::LargestGroupParams() const {
  return std::max(BlockParams(), RootParams());
}

namespace {

constexpr GptShape Shape(int64_t layers, int64_t d, int64_t heads, int64_t seq) {
  GptShape o;
  o.n_layers = layers;
  o.d_model = d;
  o.n_heads = heads;
  o.d_mlp = 4 * d;
  o.seq_len = seq;
  return o;
}

constexpr ModelPreset kPresets[] = {
    {"tiny", Shape(4, 32, 2, 32), "60k parameters, for tests"},
    {"small", Shape(12, 64, 4, 64), "0.62M parameters, the default"},
    {"medium", Shape(8, 128, 4, 128), "1.6M parameters"},
    {"large", Shape(12, 512, 8, 256), "38M parameters"},
};

}  // namespace

std::span<const ModelPreset> ModelPresets() {
  return kPresets;
}

const ModelPreset* FindModelPreset(std::string_view name) {
  for (const ModelPreset& p : kPresets)
    if (name == p.name) return &p;
  return nullptr;
}

std::string ModelPresetNames() {
  std::string s;
  for (const ModelPreset& p : kPresets)
    s += (s.empty() ? "" : "|") + std::string(p.name);
  return s;
}

}  // namespace strata

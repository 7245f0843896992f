// The LibTorch front end's checkpoints (its blobs beside the engine's states:
// engine/checkpoint/blobs.h), initial weights from safetensors files, and the gathered
// parameters.
#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include "strata/engine/checkpoint/blobs.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/libtorch/engine_state.h"

namespace strata::detail {

namespace {

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

engine::CheckpointBlob BytesBlob(std::string_view name, const void* data, size_t n) {
  engine::CheckpointBlob b;
  b.name = std::string(name);
  b.bytes.resize(n);
  if (n > 0) std::memcpy(b.bytes.data(), data, n);
  return b;
}

}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> EngineState::WholeTensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model_->named_buffers()) {
    if (item.value().defined()) {
      out.emplace_back(std::string(engine::blob::kBuffer) + item.key(), item.value());
    }
  }
  return out;
}

void EngineState::LoadSafetensors(const std::string& path) {
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
  std::vector<std::vector<engine::ExpectedTensor>> params;
  for (const GroupBinding& gb : groups_) {
    params.emplace_back();
    for (const ParamBinding& p : gb.params) {
      engine::ExpectedTensor e;
      e.name = p.name;
      for (const std::string& n : names[p.param.unsafeGetTensorImpl()]) {
        if (n != p.name) e.aliases.push_back(n);
        if (const std::string u = unwrapped(n); !u.empty()) e.aliases.push_back(u);
      }
      e.shape = p.shape;
      params.back().push_back(std::move(e));
    }
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
  Check(hooks_->LoadSafetensors(path, params, others, fill));
}

std::string EngineState::SaveCheckpoint(const std::string& dir, const std::string& tag,
                                        const std::string& client_state,
                                        const SaveCheckpointOptions& options) {
  engine::CheckpointSaveRequest o;
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
      Throw(InvalidArgumentError("Engine::save_checkpoint: " + engine::blob::ModuleName(name) +
                                 " is of type " + std::string(c10::toString(t.scalar_type())) +
                                 ", which a checkpoint cannot hold"));
    }
    o.blobs.push_back(TensorBlob(name, t));
  }
  const torch::Tensor cpu_rng = at::detail::getDefaultCPUGenerator().get_state();
  o.blobs.push_back(BytesBlob(engine::blob::kTorchCpuRng, cpu_rng.data_ptr(),
                              static_cast<size_t>(cpu_rng.nbytes())));
  if (device_.is_cuda()) {
    const torch::Tensor rng = at::globalContext().defaultGenerator(device_).get_state();
    o.blobs.push_back(
        BytesBlob(engine::blob::kTorchCudaRng, rng.data_ptr(), static_cast<size_t>(rng.nbytes())));
  }
  o.blobs.push_back(
      BytesBlob(engine::blob::kClientState, client_state.data(), client_state.size()));
  Result<std::string> saved = hooks_->SaveCheckpoint(o);
  if (!saved.ok()) Throw(saved.status());
  return *saved;
}

LoadedCheckpoint EngineState::LoadCheckpoint(const std::string& dir, const std::string& tag,
                                             const LoadCheckpointOptions& options) {
  const std::vector<std::pair<std::string, torch::Tensor>> whole = WholeTensors();
  engine::CheckpointLoadRequest o;
  o.dir = dir;
  o.tag = tag;
  o.load_optimizer_states = options.load_optimizer_states;
  o.load_lr_scheduler_states = options.load_lr_scheduler_states;
  o.load_module_only = options.load_module_only;
  o.check_frozen_parameters = options.check_frozen_parameters;
  // The model's buffers against the checkpoint's.
  std::vector<engine::blob::WholeTensor> expected;
  for (const auto& [name, t] : whole)
    expected.push_back({name, SafetensorsDType(t.scalar_type()), ShapeOf(t)});
  o.check_blobs = [&](const std::vector<engine::CheckpointTensor>& saved) {
    return engine::blob::CheckWholeTensors(saved, expected);
  };
  Result<engine::CheckpointLoadResult> loaded = hooks_->LoadCheckpoint(o);
  if (!loaded.ok()) Throw(loaded.status());
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
  if (const auto it = blobs.find(std::string(engine::blob::kClientState)); it != blobs.end()) {
    out.client_state.assign(reinterpret_cast<const char*>(it->second->bytes.data()),
                            it->second->bytes.size());
  }
  if (!options.load_module_only) {
    auto restore = [&](std::string_view name, at::Generator gen) {
      const auto it = blobs.find(std::string(name));
      if (it == blobs.end()) return;
      torch::Tensor state =
          torch::empty({static_cast<int64_t>(it->second->bytes.size())}, torch::kUInt8);
      std::memcpy(state.data_ptr(), it->second->bytes.data(), it->second->bytes.size());
      gen.set_state(state);
    };
    restore(engine::blob::kTorchCpuRng, at::detail::getDefaultCPUGenerator());
    if (device_.is_cuda()) {
      restore(engine::blob::kTorchCudaRng, at::globalContext().defaultGenerator(device_));
    }
  }
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> EngineState::GatherParameters() {
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> values;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const engine::GroupLayout& layout = core_->layout(static_cast<int>(g));
    torch::Tensor flat = torch::empty({static_cast<int64_t>(layout.numel)}, torch::kFloat32);
    Check(hooks_->GatherMasterParams(static_cast<int>(g),
                                     std::span<float>(flat.data_ptr<float>(), layout.numel)));
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

engine::SaveModelResult EngineState::SaveModel(const std::string& dir, const std::string& filename,
                                               uint64_t max_shard_bytes) {
  engine::SaveModelRequest r;
  r.dir = dir;
  r.filename = filename;
  r.max_file_bytes = max_shard_bytes;
  for (const GroupBinding& gb : groups_) {
    r.params.emplace_back();
    for (const ParamBinding& p : gb.params)
      r.params.back().push_back({p.name, p.shape});
  }
  // The buffers, rank 0's memory, contiguous on the host while the save runs.
  std::vector<torch::Tensor> keep;
  for (const auto& item : model_->named_buffers()) {
    const torch::Tensor& t = item.value();
    if (!t.defined()) continue;
    const std::string dtype = SafetensorsDType(t.scalar_type());
    if (dtype.empty()) {
      Throw(InvalidArgumentError("Engine::save_16bit_model: buffer " + item.key() + " is of type " +
                                 std::string(c10::toString(t.scalar_type())) +
                                 ", which safetensors cannot hold"));
    }
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    keep.push_back(c);
    std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
    r.whole.push_back({item.key(), dtype, shape, c.data_ptr()});
  }
  Result<engine::SaveModelResult> saved = hooks_->SaveModel(r);
  if (!saved.ok()) Throw(saved.status());
  return *saved;
}

std::vector<std::pair<int, int>> EngineState::GatherWhole(
    const std::vector<torch::Tensor>& params) {
  std::map<int, std::vector<int>> wanted;  // group -> parameters, in order
  for (const torch::Tensor& t : params) {
    if (!t.defined()) continue;
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (size_t i = 0; i < groups_[g].params.size(); ++i) {
        const ParamBinding& p = groups_[g].params[i];
        const std::pair<int, int> key{static_cast<int>(g), static_cast<int>(i)};
        if (p.param.unsafeGetTensorImpl() != t.unsafeGetTensorImpl() || whole_.count(key) != 0) {
          continue;
        }
        std::vector<int>& in = wanted[key.first];
        if (std::find(in.begin(), in.end(), key.second) == in.end()) in.push_back(key.second);
      }
    }
  }
  std::vector<std::pair<int, int>> held;
  for (auto& [g, members] : wanted) {
    std::sort(members.begin(), members.end());
    const engine::GroupLayout& layout = core_->layout(g);
    torch::Tensor flat = torch::empty({static_cast<int64_t>(layout.numel)}, torch::kFloat32);
    Check(hooks_->GatherMasterParams(g, std::span<float>(flat.data_ptr<float>(), layout.numel)));
    int64_t pos = 0;
    size_t next = 0;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < groups_[static_cast<size_t>(g)].params.size(); ++i) {
      ParamBinding& p = groups_[static_cast<size_t>(g)].params[i];
      if (next < members.size() && members[next] == static_cast<int>(i)) {
        ++next;
        Whole w;
        w.master = flat.narrow(0, pos, p.numel).view(p.shape).clone();
        torch::Tensor given = w.master.to(device_, p.compute);
        w.given = given.clone();
        w.saved = p.param.variable_data();
        p.param.set_data(given);
        whole_[{g, static_cast<int>(i)}] = std::move(w);
        held.emplace_back(g, static_cast<int>(i));
      }
      pos += p.numel;
    }
  }
  return held;
}

void EngineState::ReleaseWhole(const std::vector<std::pair<int, int>>& held,
                               std::optional<int> modifier) {
  std::vector<std::pair<int, size_t>> which;
  std::vector<torch::Tensor> values;
  Status check;
  const bool mine = modifier && *modifier == core_->rank();
  {
    torch::NoGradGuard no_grad;
    for (const auto& key : held) {
      Whole w = std::move(whole_.at(key));
      whole_.erase(key);
      ParamBinding& p =
          groups_[static_cast<size_t>(key.first)].params[static_cast<size_t>(key.second)];
      torch::Tensor now = p.param.variable_data();
      p.param.set_data(w.saved);
      if (!modifier) continue;
      which.emplace_back(key.first, static_cast<size_t>(key.second));
      if (!mine) {
        values.push_back(torch::empty({p.numel}, torch::kFloat32));
        continue;
      }
      if (now.sizes() != w.master.sizes()) {
        if (check.ok()) {
          check = InvalidArgumentError("parameter " + p.name +
                                       " changed shape inside strata::GatheredParameters; the "
                                       "engine's layout is fixed");
        }
        values.push_back(torch::empty({p.numel}, torch::kFloat32));
        continue;
      }
      now = now.to(torch::kCPU);
      // Unchanged elements keep their fp32 master exactly.
      torch::Tensor merged =
          torch::where(now != w.given.to(torch::kCPU), now.to(torch::kFloat32), w.master);
      values.push_back(merged.reshape({-1}).contiguous());
    }
  }
  if (!modifier) return;
  std::vector<std::span<float>> spans;
  for (torch::Tensor& v : values)
    spans.emplace_back(v.data_ptr<float>(), static_cast<size_t>(v.numel()));
  Check(hooks_->SetParameters(check, *modifier, which, spans));
}

}  // namespace strata::detail

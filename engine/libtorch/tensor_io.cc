// TensorEngine's calls between steps: checkpoints (the whole tensors and torch's generators
// as blobs beside the engine's states: engine/checkpoint/blobs.h), safetensors loading,
// gathering the parameters, the model in Hugging Face's layout, parameters made whole for a
// while and a partitioned model assembled (tensor_engine.h).
#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_map>

#include "strata/engine/checkpoint/blobs.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/libtorch/tensor_engine.h"

namespace strata {

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

std::string BlobName(const WholeTensor& w) {
  return std::string(w.parameter ? engine::blob::kUnmanaged : engine::blob::kBuffer) + w.name;
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

// Runs `f`, turning LibTorch's exceptions into an Internal error about `what`.
template <typename F>
Status Guarded(const std::string& what, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return InternalError(what + ": " + e.what());
  }
}

}  // namespace

Result<std::string> TensorEngine::SaveCheckpoint(engine::CheckpointSaveRequest request,
                                                 const std::vector<WholeTensor>& whole) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  const Status done = Guarded("saving the checkpoint's blobs", [&]() -> Status {
    for (const WholeTensor& w : whole) {
      if (!w.tensor.defined()) continue;
      if (SafetensorsDType(w.tensor.scalar_type()).empty()) {
        return InvalidArgumentError(options_.names.api + "save_checkpoint: " + w.name + " is " +
                                    TorchDTypeName(w.tensor.scalar_type()) +
                                    ", which a checkpoint cannot hold");
      }
      request.blobs.push_back(TensorBlob(BlobName(w), w.tensor));
    }
    const torch::Tensor cpu_rng = at::detail::getDefaultCPUGenerator().get_state();
    request.blobs.push_back(BytesBlob(engine::blob::kTorchCpuRng, cpu_rng.data_ptr(),
                                      static_cast<size_t>(cpu_rng.nbytes())));
    if (device_.is_cuda()) {
      const torch::Tensor rng = at::globalContext().defaultGenerator(device_).get_state();
      request.blobs.push_back(BytesBlob(engine::blob::kTorchCudaRng, rng.data_ptr(),
                                        static_cast<size_t>(rng.nbytes())));
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(done);
  request.param_shapes.clear();
  for (const std::vector<Bound>& group : bound_) {
    request.param_shapes.emplace_back();
    for (const Bound& b : group)
      request.param_shapes.back().push_back(b.shape);
  }
  return hooks->SaveCheckpoint(request);
}

Result<engine::CheckpointLoadResult> TensorEngine::LoadCheckpoint(
    engine::CheckpointLoadRequest request, const std::vector<WholeTensor>& whole) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  // The model's whole tensors against the checkpoint's, before anything changes.
  std::vector<engine::blob::WholeTensor> expected;
  for (const WholeTensor& w : whole) {
    if (w.tensor.defined()) {
      expected.push_back(
          {BlobName(w), SafetensorsDType(w.tensor.scalar_type()), ShapeOf(w.tensor)});
    }
  }
  request.check_blobs = [&](const std::vector<engine::CheckpointTensor>& saved) {
    return engine::blob::CheckWholeTensors(saved, expected);
  };
  STRATA_ASSIGN_OR_RETURN(engine::CheckpointLoadResult loaded, hooks->LoadCheckpoint(request));
  std::unordered_map<std::string, const engine::CheckpointBlob*> blobs;
  for (const engine::CheckpointBlob& b : loaded.blobs)
    blobs[b.name] = &b;
  const Status done = Guarded("restoring the checkpoint's blobs", [&]() -> Status {
    torch::NoGradGuard no_grad;
    for (const WholeTensor& w : whole) {
      if (!w.tensor.defined() || w.tensor.numel() == 0) continue;
      const engine::CheckpointBlob& b = *blobs.at(BlobName(w));
      torch::Tensor src = torch::from_blob(const_cast<std::byte*>(b.bytes.data()), w.tensor.sizes(),
                                           torch::TensorOptions().dtype(w.tensor.scalar_type()));
      torch::Tensor dst = w.tensor;
      dst.copy_(src);
    }
    if (request.load_module_only) return Status::Ok();
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
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(done);
  return loaded;
}

Status TensorEngine::LoadSafetensors(const std::string& path, const std::vector<WholeTensor>& whole,
                                     const std::vector<std::string>& optional) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  const std::set<std::string> may_lack(optional.begin(), optional.end());
  std::vector<std::vector<engine::ExpectedTensor>> params;
  for (size_t g = 0; g < groups_.size(); ++g) {
    params.emplace_back();
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const TensorParam& p = groups_[g].params[i];
      params.back().push_back({p.name, p.aliases, bound_[g][i].shape, may_lack.count(p.name) > 0});
    }
  }
  // What this front end keeps whole: the parameters it does not manage (required) and the
  // floating-point buffers (optional). The frozen parameters are in their groups.
  std::vector<engine::ExpectedTensor> others;
  std::vector<torch::Tensor> targets;
  for (const WholeTensor& w : whole) {
    if (!w.tensor.defined() || (!w.parameter && !w.tensor.is_floating_point())) continue;
    others.push_back({w.name, w.aliases, w.tensor.sizes().vec(), !w.parameter});
    targets.push_back(w.tensor);
  }
  auto fill = [&](size_t k, std::span<const float> values) -> Status {
    return Guarded("copying " + others[k].name + " into the model", [&]() -> Status {
      if (values.empty()) return Status::Ok();
      torch::NoGradGuard no_grad;
      torch::Tensor& t = targets[k];
      t.copy_(torch::from_blob(const_cast<float*>(values.data()), t.sizes(), torch::kFloat32));
      return Status::Ok();
    });
  };
  return hooks->LoadSafetensors(path, params, others, fill);
}

Result<std::vector<torch::Tensor>> TensorEngine::GatherParameters(
    const std::vector<torch::Tensor>& params) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> values;
  std::vector<torch::Tensor> out;
  const Status done = Guarded("gathering the parameters", [&]() -> Status {
    for (size_t g = 0; g < groups_.size(); ++g) {
      const engine::GroupLayout& layout = core_->layout(static_cast<int>(g));
      torch::Tensor flat = torch::empty({static_cast<int64_t>(layout.numel)}, torch::kFloat32);
      STRATA_RETURN_IF_ERROR(hooks->GatherMasterParams(
          static_cast<int>(g), std::span<float>(flat.data_ptr<float>(), layout.numel)));
      int64_t pos = 0;
      for (size_t i = 0; i < groups_[g].params.size(); ++i) {
        const Bound& b = bound_[g][i];
        values[groups_[g].params[i].tensor.unsafeGetTensorImpl()] =
            flat.narrow(0, pos, b.numel).view(b.shape).clone();
        pos += b.numel;
      }
    }
    for (const torch::Tensor& t : params) {
      auto it = values.find(t.unsafeGetTensorImpl());
      // Not managed: as it is, on the host in fp32 like the rest.
      out.push_back(it != values.end() ? it->second
                                       : t.detach().to(torch::kCPU, torch::kFloat32).clone());
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(done);
  return out;
}

Result<engine::SaveModelResult> TensorEngine::SaveModel(
    engine::SaveModelRequest request, const std::vector<std::vector<std::string>>& names,
    const std::vector<std::pair<std::string, torch::Tensor>>& whole) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  request.params.clear();
  for (size_t g = 0; g < groups_.size(); ++g) {
    request.params.emplace_back();
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      const std::string& name = g < names.size() && i < names[g].size() ? names[g][i] : "";
      request.params.back().push_back({name, bound_[g][i].shape});
    }
  }
  // The whole tensors, rank 0's memory, contiguous on the host while the save runs.
  std::vector<torch::Tensor> keep;
  const Status done = Guarded("saving the model", [&]() -> Status {
    for (const auto& [name, t] : whole) {
      if (!t.defined()) continue;
      const std::string dtype = SafetensorsDType(t.scalar_type());
      if (dtype.empty()) {
        return InvalidArgumentError(options_.names.api + "save_16bit_model: " + name + " is " +
                                    TorchDTypeName(t.scalar_type()) +
                                    ", which safetensors cannot hold");
      }
      torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
      keep.push_back(c);
      request.whole.push_back(
          {name, dtype, c.sizes().vec(), c.numel() == 0 ? nullptr : c.data_ptr()});
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(done);
  return hooks->SaveModel(request);
}

Result<std::vector<std::pair<int, int>>> TensorEngine::GatherWhole(
    const std::vector<torch::Tensor>& params) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  std::map<int, std::vector<int>> wanted;  // group -> parameters, in order
  for (const torch::Tensor& t : params) {
    const std::optional<std::pair<int, int>> at = Find(t);
    if (!at || whole_.count(*at) != 0) continue;
    std::vector<int>& in = wanted[at->first];
    if (std::find(in.begin(), in.end(), at->second) == in.end()) in.push_back(at->second);
  }
  std::vector<std::pair<int, int>> held;
  const Status done = Guarded("gathering parameters whole", [&]() -> Status {
    for (auto& [g, members] : wanted) {
      std::sort(members.begin(), members.end());
      const engine::GroupLayout& layout = core_->layout(g);
      torch::Tensor flat = torch::empty({static_cast<int64_t>(layout.numel)}, torch::kFloat32);
      STRATA_RETURN_IF_ERROR(
          hooks->GatherMasterParams(g, std::span<float>(flat.data_ptr<float>(), layout.numel)));
      torch::NoGradGuard no_grad;
      int64_t pos = 0;
      size_t next = 0;
      for (size_t i = 0; i < groups_[static_cast<size_t>(g)].params.size(); ++i) {
        const Bound& b = bound_[static_cast<size_t>(g)][i];
        if (next < members.size() && members[next] == static_cast<int>(i)) {
          ++next;
          torch::Tensor& param = groups_[static_cast<size_t>(g)].params[i].tensor;
          Whole w;
          w.master = flat.narrow(0, pos, b.numel).view(b.shape).clone();
          torch::Tensor given = w.master.to(device_, compute_);
          w.given = given.clone();
          w.saved = param.variable_data();
          param.set_data(given);
          whole_[{g, static_cast<int>(i)}] = std::move(w);
          held.emplace_back(g, static_cast<int>(i));
        }
        pos += b.numel;
      }
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(done);
  return held;
}

Status TensorEngine::ReleaseWhole(const std::vector<std::pair<int, int>>& held,
                                  std::optional<int> modifier) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  std::vector<std::pair<int, size_t>> which;
  std::vector<torch::Tensor> values;
  Status check;
  const bool mine = modifier && *modifier == core_->rank();
  const Status done = Guarded("giving parameters back", [&]() -> Status {
    torch::NoGradGuard no_grad;
    for (const auto& key : held) {
      auto it = whole_.find(key);
      if (it == whole_.end()) continue;
      Whole w = std::move(it->second);
      whole_.erase(it);
      const TensorParam& p =
          groups_[static_cast<size_t>(key.first)].params[static_cast<size_t>(key.second)];
      torch::Tensor param = p.tensor;
      torch::Tensor now = param.variable_data();
      param.set_data(w.saved);
      if (!modifier) continue;
      which.emplace_back(key.first, static_cast<size_t>(key.second));
      const int64_t numel = w.master.numel();
      if (!mine) {
        values.push_back(torch::empty({numel}, torch::kFloat32));
        continue;
      }
      if (now.sizes() != w.master.sizes()) {
        if (check.ok()) {
          check = InvalidArgumentError(
              "parameter " + p.name + " changed shape inside " + options_.gathered + " (" +
              c10::str(w.master.sizes()) + " -> " + c10::str(now.sizes()) +
              "); the engine's layout is fixed: resize (resize_token_embeddings, say) before " +
              options_.caller);
        }
        values.push_back(torch::empty({numel}, torch::kFloat32));
        continue;
      }
      now = now.to(torch::kCPU);
      // Unchanged elements keep their fp32 master exactly.
      torch::Tensor merged =
          torch::where(now != w.given.to(torch::kCPU), now.to(torch::kFloat32), w.master);
      values.push_back(merged.reshape({-1}).contiguous());
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(done);
  if (!modifier) return Status::Ok();
  std::vector<std::span<float>> spans;
  for (torch::Tensor& v : values)
    spans.emplace_back(v.data_ptr<float>(), static_cast<size_t>(v.numel()));
  return hooks->SetParameters(check, *modifier, which, spans);
}

Status TensorEngine::AssembleParameters(const Status& local_check,
                                        const std::vector<std::pair<int, size_t>>& which,
                                        const std::vector<torch::Tensor>& parts) {
  STRATA_ASSIGN_OR_RETURN(engine::HookProtocol * hooks, protocol());
  // Each part stays in its own dtype (and device): the core reads it a chunk at a time,
  // converted into its buffer, so no fp32 copy of the parts is ever made.
  std::vector<torch::Tensor> flat;
  engine::EngineCore::AssembleParts in;
  const Status viewed = Guarded("assembling the parameters", [&]() -> Status {
    for (const torch::Tensor& part : parts) {
      flat.push_back(part.detach().reshape({-1}));
      in.sizes.push_back(static_cast<size_t>(flat.back().numel()));
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(viewed);
  in.read = [&](size_t k, size_t first, std::span<float> out) {
    return Guarded("reading a part to assemble", [&]() -> Status {
      torch::NoGradGuard no_grad;
      torch::Tensor into = torch::from_blob(out.data(), {static_cast<int64_t>(out.size())},
                                            torch::TensorOptions().dtype(torch::kFloat32));
      into.copy_(flat[k].narrow(0, static_cast<int64_t>(first), static_cast<int64_t>(out.size())));
      return Status::Ok();
    });
  };
  return hooks->AssembleParameters(local_check, which, in);
}

}  // namespace strata

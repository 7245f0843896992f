#include "strata/engine/checkpoint/blobs.h"

#include <algorithm>
#include <unordered_map>

namespace strata::engine::blob {

namespace {

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

bool IsModuleBlob(std::string_view name) {
  return StartsWith(name, kBuffer) || StartsWith(name, kUnmanaged);
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string CurrentName(std::string_view saved) {
  if (saved == "rng:cpu") return std::string(kTorchCpuRng);
  if (saved == "rng:cuda") return std::string(kTorchCudaRng);
  return std::string(saved);
}

std::string ModuleName(std::string_view blob) {
  if (StartsWith(blob, kUnmanaged)) return std::string(blob.substr(kUnmanaged.size()));
  if (StartsWith(blob, kBuffer)) return std::string(blob.substr(kBuffer.size()));
  return std::string(blob);
}

Status CheckWholeTensors(const std::vector<CheckpointTensor>& saved,
                         const std::vector<WholeTensor>& model) {
  std::unordered_map<std::string, const CheckpointTensor*> left;
  for (const CheckpointTensor& t : saved)
    if (IsModuleBlob(t.name)) left[t.name] = &t;
  std::vector<std::string> missing, mismatched, extra;
  for (const WholeTensor& w : model) {
    const auto it = left.find(w.blob);
    if (it == left.end()) {
      missing.push_back(ModuleName(w.blob));
      continue;
    }
    const CheckpointTensor& c = *it->second;
    if (c.dtype != w.dtype || c.shape != w.shape) {
      mismatched.push_back(ModuleName(w.blob) + " (checkpoint " + c.dtype + " " +
                           ShapeText(c.shape) + ", model " + w.dtype + " " + ShapeText(w.shape) +
                           ")");
    }
    left.erase(it);
  }
  if (missing.empty() && mismatched.empty() && left.empty()) return Status::Ok();
  for (const auto& [name, t] : left)
    extra.push_back(ModuleName(name));
  std::sort(extra.begin(), extra.end());
  std::string msg = "the frozen parameters and buffers differ from the model's";
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    msg += std::string("; ") + what + ": ";
    for (size_t i = 0; i < names.size() && i < 20; ++i)
      msg += (i ? ", " : "") + names[i];
    if (names.size() > 20) msg += ", ...";
  };
  list("missing from the checkpoint", missing);
  list("in the checkpoint but not the model", extra);
  list("of another type or shape", mismatched);
  return InvalidArgumentError(msg);
}

}  // namespace strata::engine::blob

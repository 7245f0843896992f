// The blobs a front end keeps in a checkpoint beside the engine's states (checkpoint.h's
// CheckpointBlob): their names, the same for both front ends (docs/checkpoints.md, "What is
// saved"), and the check of the tensors a front end keeps whole against a checkpoint's.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/checkpoint.h"

namespace strata::engine::blob {

// + a buffer's name: each rank's own (a forward may update it from the rank's data).
inline constexpr std::string_view kBuffer = "module:";
// + the name of a parameter the engine does not manage (Python: requiring grad but left out
// of model_parameters): the same on every rank (rank 0's is saved).
inline constexpr std::string_view kUnmanaged = "shared:module:";
// The caller's own state (C++: its bytes; Python: torch.save of its dict).
inline constexpr std::string_view kClientState = "client_state";
// The rank's generators: torch's CPU one, the CUDA device's, Python's `random`, NumPy's.
inline constexpr std::string_view kTorchCpuRng = "rng:torch_cpu";
inline constexpr std::string_view kTorchCudaRng = "rng:torch_cuda";
inline constexpr std::string_view kPythonRng = "rng:python";
inline constexpr std::string_view kNumpyRng = "rng:numpy";

// The name a saved blob has now: the LibTorch front end's "rng:cpu" and "rng:cuda" (builds
// before 2026-12-01) are kTorchCpuRng and kTorchCudaRng; any other name is its own.
std::string CurrentName(std::string_view saved);

// The model's name of a module blob (kBuffer or kUnmanaged + name): the name.
std::string ModuleName(std::string_view blob);

// A tensor the front end keeps whole, as a checkpoint holds it.
struct WholeTensor {
  std::string blob;   // kBuffer or kUnmanaged + its name in the model
  std::string dtype;  // the safetensors dtype name ("F32", "BF16", ...)
  std::vector<uint64_t> shape;
};

// The checkpoint's module blobs (`saved`: names without "blob:") against the model's whole
// tensors: Ok, or InvalidArgument listing those missing from the checkpoint, those in it but
// not in the model, and those of another type or shape (by their names in the model, at most
// 20 of each).
Status CheckWholeTensors(const std::vector<CheckpointTensor>& saved,
                         const std::vector<WholeTensor>& model);

}  // namespace strata::engine::blob

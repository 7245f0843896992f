// Initial weights from safetensors files into a model under the engine (checkpoint/
// safetensors.h reads the files; this puts them in the engine's shards).
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/runtime/engine_core.h"

namespace strata::engine {

// Collective (every rank calls it): loads `path` (a file or an index JSON) into a model
// under `core`. `params[g][i]` describes the engine's group g parameter i (its name, its
// tied names, its shape; an optional one the files lack keeps its value); `others` the
// tensors the front end keeps whole (frozen
// parameters, required; buffers, optional), which `fill(k, values)` receives (fp32, the
// whole tensor) after the engine's parameters are loaded. Each rank reads only its slices
// of the engine's parameters (EngineCore::LoadParameters) and all of `others`. Every rank
// checks the files against the model first and the ranks agree: a mismatch anywhere (the
// missing, mismatched and extra names listed), or a file a rank cannot open, fails the
// load on every rank with nothing changed. Failures while reading are agreed on too.
Status LoadSafetensors(EngineCore& core, const std::string& path,
                       const std::vector<std::vector<ExpectedTensor>>& params,
                       const std::vector<ExpectedTensor>& others,
                       const std::function<Status(size_t other, std::span<const float>)>& fill);

}  // namespace strata::engine

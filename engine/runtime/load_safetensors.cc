// LoadSafetensors: safetensors files into the engine's shards (load_safetensors.h).
#include "strata/engine/runtime/load_safetensors.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>

#include "strata/engine/agreement/agreement.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine {

Status LoadSafetensors(EngineCore& core, const std::string& path,
                       const std::vector<std::vector<ExpectedTensor>>& params,
                       const std::vector<ExpectedTensor>& others,
                       const std::function<Status(size_t other, std::span<const float>)>& fill) {
  if (params.size() != static_cast<size_t>(core.num_groups())) {
    return InvalidArgumentError("LoadSafetensors: " + std::to_string(params.size()) +
                                " groups described, the engine has " +
                                std::to_string(core.num_groups()));
  }
  std::vector<ExpectedTensor> all;
  std::vector<size_t> group_start;
  for (size_t g = 0; g < params.size(); ++g) {
    if (params[g].size() != core.layout(static_cast<int>(g)).params.size()) {
      return InvalidArgumentError("LoadSafetensors: group " + std::to_string(g) +
                                  " described with " + std::to_string(params[g].size()) +
                                  " parameters, the engine's has " +
                                  std::to_string(core.layout(static_cast<int>(g)).params.size()));
    }
    group_start.push_back(all.size());
    all.insert(all.end(), params[g].begin(), params[g].end());
  }
  const size_t first_other = all.size();
  all.insert(all.end(), others.begin(), others.end());

  // This rank's verdict on the files; the engine makes the ranks agree on it.
  std::unique_ptr<SafetensorsReader> reader;
  std::vector<std::string> source;
  Status check;
  Result<std::unique_ptr<SafetensorsReader>> opened = SafetensorsReader::Open(path);
  if (opened.ok()) {
    reader = *std::move(opened);
    Result<std::vector<std::string>> matched = MatchSafetensors(*reader, all);
    if (matched.ok()) {
      source = *std::move(matched);
    } else {
      check = matched.status();
    }
  } else {
    check = opened.status();
  }
  // An optional parameter the files lack keeps its value (a new head a checkpoint of the base
  // model has no weights for).
  auto in_files = [&](int g, size_t i) {
    const size_t k = group_start[static_cast<size_t>(g)] + i;
    return k >= source.size() || !source[k].empty();
  };
  STRATA_RETURN_IF_ERROR(core.LoadParameters(
      check,
      [&](int g, size_t i, uint64_t first, std::span<float> out) {
        return reader->ReadFloat(source[group_start[static_cast<size_t>(g)] + i], first, out);
      },
      in_files));
  // The tensors the front end keeps whole: every rank reads all of each.
  Status local;
  std::vector<float> values;
  for (size_t k = 0; k < others.size() && local.ok(); ++k) {
    const std::string& name = source[first_other + k];
    if (name.empty()) continue;  // an optional one the files lack
    values.resize(reader->Find(name)->numel);
    local = reader->ReadFloat(name, 0, values);
    if (local.ok()) local = fill(k, values);
  }
  STRATA_ASSIGN_OR_RETURN(Outcomes o, AgreeOnOutcomes(core.host_comm(), local));
  if (o.any_failed) {
    return Status(o.code, OutcomeStatus(o, "loading the frozen parameters and buffers").message() +
                              "; the trained parameters are loaded, the others partly: load again");
  }
  return Status::Ok();
}

}  // namespace strata::engine

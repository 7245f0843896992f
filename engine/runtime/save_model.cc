// SaveModel: the engine's parameters in Hugging Face's layout (save_model.h).
#include "strata/engine/runtime/save_model.h"

#include <unistd.h>

#include <algorithm>
#include <memory>

#include "strata/engine/agreement/agreement.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/files.h"
#include "strata/engine/checkpoint/format.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine {

Result<SaveModelResult> SaveModel(EngineCore& core, const SaveModelRequest& r) {
  const int groups = core.num_groups();
  if (r.params.size() != static_cast<size_t>(groups)) {
    return InvalidArgumentError("SaveModel: " + std::to_string(r.params.size()) +
                                " groups described, the engine has " + std::to_string(groups));
  }
  for (int g = 0; g < groups; ++g) {
    const GroupLayout& l = core.layout(g);
    const std::vector<SaveModelRequest::Param>& ps = r.params[static_cast<size_t>(g)];
    if (ps.size() != l.params.size()) {
      return InvalidArgumentError("SaveModel: group " + l.name + " described with " +
                                  std::to_string(ps.size()) + " parameters, the engine's has " +
                                  std::to_string(l.params.size()));
    }
    for (size_t i = 0; i < ps.size(); ++i) {
      uint64_t numel = 1;
      for (int64_t d : ps[i].shape)
        numel *= d < 0 ? 0 : static_cast<uint64_t>(d);
      if (numel != l.params[i].numel) {
        return InvalidArgumentError("SaveModel: parameter " + l.params[i].name + " has " +
                                    std::to_string(l.params[i].numel) +
                                    " elements, its shape given holds " + std::to_string(numel));
      }
    }
  }
  const DType dtype = r.dtype.value_or(core.dtype());
  const bool writer_rank = core.rank() == 0;
  std::vector<ModelTensorSpec> specs;
  for (int g = 0; g < groups; ++g) {
    const GroupLayout& l = core.layout(g);
    for (size_t i = 0; i < l.params.size(); ++i) {
      const SaveModelRequest::Param& p = r.params[static_cast<size_t>(g)][i];
      if (p.name.empty()) continue;
      specs.push_back({p.name, SafetensorsName(dtype), p.shape});
    }
  }
  for (const SaveModelRequest::Whole& w : r.whole)
    specs.push_back({w.name, w.dtype, w.shape});

  // The front ends' checks agreed on first; then rank 0 makes the directory and the writer,
  // agreed on before any collective of the save.
  STRATA_ASSIGN_OR_RETURN(Outcomes checked, AgreeOnOutcomes(core.host_comm(), r.local_check));
  if (checked.any_failed) return OutcomeStatus(checked, "saving the model to " + r.dir);
  std::unique_ptr<ModelWriter> writer;
  Status local;
  const bool made_dir = writer_rank && !Exists(r.dir);
  // A failed save leaves no directory it made (when nothing else was put there since).
  auto unmake = [&] {
    if (made_dir) ::rmdir(r.dir.c_str());
  };
  if (writer_rank) {
    local = MakeDirs(r.dir);
    if (local.ok()) {
      Result<std::unique_ptr<ModelWriter>> made =
          ModelWriter::Create(r.dir, r.filename, specs, r.max_file_bytes,
                              {{"source", "strata " + std::string(DTypeName(dtype))}});
      if (made.ok()) {
        writer = *std::move(made);
      } else {
        local = made.status();
      }
    }
  }
  STRATA_ASSIGN_OR_RETURN(Outcomes begun, AgreeOnOutcomes(core.host_comm(), local));
  if (begun.any_failed) {
    writer.reset();
    unmake();
    return OutcomeStatus(begun, "saving the model to " + r.dir);
  }

  SaveModelResult result;
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<std::byte> converted;
  for (int g = 0; g < groups; ++g) {
    const GroupLayout& l = core.layout(g);
    const std::vector<SaveModelRequest::Param>& ps = r.params[static_cast<size_t>(g)];
    if (std::all_of(ps.begin(), ps.end(), [](const auto& p) { return p.name.empty(); })) {
      continue;
    }
    std::vector<float> full(l.numel);
    result.gather_bytes =
        std::max<uint64_t>(result.gather_bytes, (l.numel + l.padded_numel + l.shard_numel) * 4 +
                                                    kPiece * DTypeSize(dtype));
    if (const Status gathered = core.GatherMasterParams(g, full); !gathered.ok()) {
      writer.reset();
      unmake();
      return gathered.WithContext("saving the model: gathering group " + l.name);
    }
    if (!writer_rank || !local.ok()) continue;
    // GatherMasterParams concatenates the parameters without gaps.
    size_t at = 0;
    for (size_t i = 0; i < l.params.size() && local.ok(); ++i) {
      const size_t numel = l.params[i].numel;
      if (!ps[i].name.empty()) {
        for (size_t done = 0; done < numel && local.ok(); done += kPiece) {
          const size_t count = std::min(kPiece, numel - done);
          converted.resize(count * DTypeSize(dtype));
          ConvertFromFloat(full.data() + at + done, count, converted.data(), dtype);
          local = writer->Append(converted.data(), converted.size());
        }
      }
      at += numel;
    }
  }
  if (writer_rank && local.ok()) {
    for (const SaveModelRequest::Whole& w : r.whole) {
      uint64_t bytes = CheckpointDTypeSize(w.dtype);
      for (int64_t d : w.shape)
        bytes *= static_cast<uint64_t>(d);
      if (bytes > 0) local = writer->Append(w.data, bytes);
      if (!local.ok()) break;
    }
  }
  if (writer_rank && local.ok()) {
    Result<ModelWriteStats> committed = writer->Commit(r.small_files);
    if (committed.ok()) {
      result.files = *std::move(committed);
    } else {
      local = committed.status();
    }
  }
  writer.reset();  // a failed save's temporary files go before the ranks hear of it
  if (!local.ok()) unmake();
  STRATA_ASSIGN_OR_RETURN(Outcomes done, AgreeOnOutcomes(core.host_comm(), local));
  if (done.any_failed) return OutcomeStatus(done, "saving the model to " + r.dir);
  return result;
}

}  // namespace strata::engine

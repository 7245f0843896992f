// The model out in Hugging Face's layout: the engine's parameters gathered
// group by group and streamed by rank 0 into safetensors files (checkpoint/model_writer.h),
// with the tensors the front end keeps whole; what engine.save_16bit_model and
// save_pretrained call in both front ends.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/model_writer.h"
#include "strata/engine/runtime/engine_core.h"

namespace strata::engine {

struct SaveModelRequest {
  std::string dir;  // made when missing (rank 0's file system)
  std::string filename = "model.safetensors";
  uint64_t max_file_bytes = 5'000'000'000;  // Hugging Face's default "5GB"
  // params[g][i]: the name group g's parameter i is saved under ("" leaves it out: a tied
  // parameter's other name, a frozen one left out) and its shape (the engine keeps only its
  // numel). One entry per group of the engine.
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<std::vector<Param>> params;
  // Tensors the front end keeps whole (parameters it does not manage, buffers): rank 0's
  // memory is written as it is. Only rank 0's entries are read; every rank lists the same
  // names in the same order.
  struct Whole {
    std::string name;
    std::string dtype;  // safetensors name
    std::vector<int64_t> shape;
    const void* data = nullptr;  // shape's bytes
  };
  std::vector<Whole> whole;
  // Small files rank 0 writes beside the model, committed with it: (name, text), e.g.
  // config.json and generation_config.json.
  std::vector<std::pair<std::string, std::string>> small_files;
  // The front end's outcome before the save (e.g. rank 0 wrote config.json): agreed on
  // with the writer's creation, so any rank's failure fails the save on every rank.
  Status local_check;
  // The dtype of the engine's parameters in the files; default the working dtype.
  std::optional<DType> dtype;
};

struct SaveModelResult {
  ModelWriteStats files;
  // The largest memory the save held on a rank for the gathered values: the group being
  // written gathered in fp32 (its layout numel) plus EngineCore::GatherMasterParams's own
  // buffers (the padded group and this rank's shard) and a conversion piece.
  uint64_t gather_bytes = 0;
};

// Collective (every rank calls it, at a step boundary): writes the model into `dir` (made
// when missing, after the ranks agreed on their checks; removed again when the save fails
// and it is empty). Every
// rank gathers each group that has a saved parameter (EngineCore::GatherMasterParams, in
// group order) and rank 0 converts and appends its values; a failure on any rank (the
// directory, a write, the disk full) fails the save on every rank, and the directory keeps
// what it held (ModelWriter's temporary files are removed).
Result<SaveModelResult> SaveModel(EngineCore& core, const SaveModelRequest& request);

}  // namespace strata::engine

// Writing a model in Hugging Face's layout, torch-free: safetensors files of at
// most a given size, "model.safetensors" when one file holds it all, else
// "model-00001-of-0000N.safetensors" ... with "model.safetensors.index.json" (its
// "metadata": {"total_size"} and "weight_map": name -> file), as transformers'
// save_pretrained writes them and from_pretrained, the safetensors package and
// strata.load_safetensors read them.
//
// The tensors are given up front (names, dtypes, shapes) and their bytes are then appended
// in that order, in pieces of any size: the writer never holds a tensor. Each file is
// written as NAME.tmp-strata and fsynced; Commit renames them into place, writes the index
// (or removes a stale one), removes the shard files of an earlier save under the same
// name that this one does not use, and fsyncs the directory. A writer destroyed without
// Commit (an error, a failed append) removes its temporary files: the directory keeps
// whatever complete model it held before.
//
// Thread-safety: one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/status.h"

namespace strata::engine {

struct ModelTensorSpec {
  std::string name;
  std::string dtype;  // a safetensors dtype name: "F32", "BF16", "F16", "I64", ...
  std::vector<int64_t> shape;
};

struct ModelWriteStats {
  std::vector<std::string> files;  // the safetensors files written, in order (names in dir)
  std::string index;               // the index's name, "" when one file holds the model
  uint64_t tensors = 0;
  uint64_t tensor_bytes = 0;  // the index's total_size
  uint64_t file_bytes = 0;    // headers included
};

class ModelWriter {
 public:
  // `dir`: an existing directory. `filename`: the single file's name, ending in
  // ".safetensors" (the shards' and the index's names derive from it). `max_file_bytes`:
  // a file's tensor bytes at most (a tensor larger than that gets a file of its own), > 0.
  // InvalidArgument for an empty or duplicate name, an unknown dtype, a negative dimension,
  // a bad filename; the error of creating the first file.
  static Result<std::unique_ptr<ModelWriter>> Create(const std::string& dir,
                                                     const std::string& filename,
                                                     std::vector<ModelTensorSpec> tensors,
                                                     uint64_t max_file_bytes,
                                                     std::map<std::string, std::string> metadata);
  ~ModelWriter();
  ModelWriter(const ModelWriter&) = delete;
  ModelWriter& operator=(const ModelWriter&) = delete;

  // The next `bytes` of the tensors' data, in their order. FailedPrecondition past the last
  // tensor's end or after a failure (the first error is kept).
  Status Append(const void* data, size_t bytes);
  // The tensor whose bytes the next Append continues (tensors().size() when all are written).
  size_t next_tensor() const { return tensor_; }
  const std::vector<ModelTensorSpec>& tensors() const { return specs_; }
  // FailedPrecondition unless every tensor's bytes were appended. `small_files` ((name,
  // text), e.g. config.json) are written beside the model, each as a temporary file renamed
  // with the safetensors files: a failure before the renames leaves none of them.
  Result<ModelWriteStats> Commit(
      const std::vector<std::pair<std::string, std::string>>& small_files = {});

 private:
  ModelWriter() = default;
  Status OpenFile(size_t file);
  Status CloseFile();
  void RemoveTemporaries();

  struct File {
    std::string name;
    size_t first = 0, end = 0;  // its tensors [first, end)
  };
  std::string dir_, filename_;
  std::vector<ModelTensorSpec> specs_;
  std::vector<uint64_t> bytes_;  // each tensor's
  std::vector<File> files_;
  std::map<std::string, std::string> metadata_;
  size_t file_ = 0;  // the file being written
  int fd_ = -1;
  size_t tensor_ = 0;  // the tensor being appended to
  uint64_t done_ = 0;  // its bytes written
  uint64_t file_bytes_ = 0;
  Status failed_;
  bool committed_ = false;
};

}  // namespace strata::engine

// Reading initial weights from safetensors files, torch-free.
//
// The format (Hugging Face's safetensors): 8 bytes, a little-endian u64 N; N bytes of a
// UTF-8 JSON object mapping each tensor's name to {"dtype", "shape", "data_offsets":
// [begin, end]} (byte offsets into the data that follows the header), plus an optional
// "__metadata__" object of strings; then the tensors' raw little-endian bytes, row-major.
// A model saved in several files comes with an index JSON ("model.safetensors.index.json")
// whose "weight_map" names each tensor's file, relative to the index's directory.
//
// The reader treats a file as untrusted: the header size against the file size (and a
// 100 MiB cap), every tensor's byte range against the data and its dtype and shape (with
// overflow checks), the ranges against each other. Reads are positioned (pread) ranges of
// one tensor, so a rank reads only the slices its shards hold.
//
// Thread-safety: Open is thread-safe; a reader is used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::engine {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as in the header: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  size_t file = 0;      // index into SafetensorsReader::files()
  uint64_t offset = 0;  // of the first byte in the file (header included)
  uint64_t bytes = 0;
};

class SafetensorsReader {
 public:
  // `path`: a .safetensors file, or an index JSON (a name ending in ".json") whose
  // "weight_map" names the files. InvalidArgument (naming the file and what is wrong) for
  // anything that is not a well-formed file; NotFound / IOError when a file cannot be read.
  static Result<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::vector<std::string>& files() const { return paths_; }
  // Every tensor of every file, by name.
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(const std::string& name) const;

  // Whether a tensor of this dtype loads into fp32 parameters: F32, F16, BF16, F64.
  static bool IsFloatDType(const std::string& dtype);

  // out[k] = float(element first + k of the tensor), k < out.size(). InvalidArgument for an
  // unknown name, a range past the tensor or a non-float dtype; DataLoss when the file ends
  // early (it was truncated after Open); IOError for a failed read. Each names the file,
  // the tensor and the offset.
  Status ReadFloat(const std::string& name, uint64_t first, std::span<float> out);

  uint64_t bytes_read() const { return bytes_read_; }

 private:
  SafetensorsReader() = default;
  Status AddFile(const std::string& path);

  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::map<std::string, SafetensorsTensor> tensors_;
  std::vector<std::byte> staging_;
  uint64_t bytes_read_ = 0;
};

// What a model expects from a file, for MatchSafetensors: a tensor's name, the other names
// it is known by (tied parameters), its shape, and whether it may be absent (a buffer).
struct ExpectedTensor {
  std::string name;
  std::vector<std::string> aliases;
  std::vector<int64_t> shape;
  bool optional = false;
};

// For each expected tensor, the name of the file tensor it loads from (its own name first,
// then its aliases; "" for an absent optional one). InvalidArgument listing every required
// tensor the files lack, every shape or dtype that does not match (a non-float dtype), and
// every file tensor nothing expects, with the files named.
Result<std::vector<std::string>> MatchSafetensors(const SafetensorsReader& reader,
                                                  std::span<const ExpectedTensor> expected);

}  // namespace strata::engine

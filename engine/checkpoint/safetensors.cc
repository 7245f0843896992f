#include "strata/engine/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "strata/engine/agreement/agreement.h"
#include "strata/engine/checkpoint/file_read.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine {
namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // as the reference reader's
constexpr size_t kStagingBytes = size_t{4} << 20;

// Bytes per element of the format's dtypes; 0 for a name it does not define.
uint64_t ElementBytes(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

SafetensorsReader::~SafetensorsReader() {
  for (int fd : fds_)
    ::close(fd);
}

bool SafetensorsReader::IsFloatDType(const std::string& dtype) {
  return dtype == "F32" || dtype == "F16" || dtype == "BF16" || dtype == "F64";
}

const SafetensorsTensor* SafetensorsReader::Find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Result<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(const std::string& path) {
  std::unique_ptr<SafetensorsReader> r(new SafetensorsReader());
  if (!EndsWith(path, ".json")) {
    STRATA_RETURN_IF_ERROR(r->AddFile(path));
    return r;
  }
  // An index: {"metadata": {...}, "weight_map": {"tensor": "file", ...}}.
  std::ifstream in(path);
  if (!in) return ErrnoError(errno, "opening the safetensors index " + path);
  const nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return InvalidArgumentError(path +
                                ": not a safetensors index (a JSON object with a \"weight_map\" "
                                "object of tensor name -> file)");
  }
  std::map<std::string, std::string> file_of;
  std::vector<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().empty() ||
        file.get<std::string>().find('/') != std::string::npos) {
      return InvalidArgumentError(path + ": weight_map[\"" + name +
                                  "\"] is not a file name in the index's directory");
    }
    file_of[name] = file.get<std::string>();
    if (std::find(files.begin(), files.end(), file.get<std::string>()) == files.end())
      files.push_back(file.get<std::string>());
  }
  for (const std::string& f : files)
    STRATA_RETURN_IF_ERROR(r->AddFile(DirOf(path) + f).WithContext("the index " + path));
  for (const auto& [name, file] : file_of) {
    const SafetensorsTensor* t = r->Find(name);
    if (t == nullptr || r->paths_[t->file] != DirOf(path) + file) {
      return InvalidArgumentError(path + ": weight_map puts tensor '" + name + "' in " + file +
                                  ", which does not hold it");
    }
  }
  return r;
}

Status SafetensorsReader::AddFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "opening the safetensors file " + path);
  fds_.push_back(fd);
  paths_.push_back(path);
  const size_t file = paths_.size() - 1;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "stat of " + path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError(path + ": not a valid safetensors file: " + what);
  };
  if (size < 8)
    return bad("it has " + std::to_string(size) + " bytes, fewer than the 8 of the header size");
  unsigned char le[8];
  STRATA_RETURN_IF_ERROR(ReadExactly(fd, le, 8, 0, path));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | le[i];
  if (n > kMaxHeaderBytes || n > size - 8) {
    return bad("its header size " + std::to_string(n) + " exceeds " +
               (n > kMaxHeaderBytes ? "the 100 MiB limit"
                                    : "the file's " + std::to_string(size) + " bytes"));
  }
  std::string text(n, '\0');
  STRATA_RETURN_IF_ERROR(ReadExactly(fd, text.data(), n, 8, path));
  const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return bad("its header is not a JSON object");
  const uint64_t data_begin = 8 + n;
  const uint64_t data_bytes = size - data_begin;
  std::vector<std::pair<uint64_t, std::string>> ranges;  // begin -> name, for the overlap check
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2 ||
        !entry["data_offsets"][0].is_number_unsigned() ||
        !entry["data_offsets"][1].is_number_unsigned()) {
      return bad(where + " lacks a string dtype, a shape array or two unsigned data_offsets");
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = entry["dtype"].get<std::string>();
    t.file = file;
    const uint64_t esize = ElementBytes(t.dtype);
    if (esize == 0) return bad(where + " has the unknown dtype '" + t.dtype + "'");
    uint64_t numel = 1;
    for (const nlohmann::json& d : entry["shape"]) {
      if (!d.is_number_unsigned()) return bad(where + "'s shape holds " + d.dump());
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > UINT64_MAX / dim) return bad(where + "'s shape overflows");
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    t.numel = numel;
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    if (begin > end || end > data_bytes) {
      return bad(where + "'s data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                 "] are not inside the " + std::to_string(data_bytes) + " bytes of data");
    }
    if (numel > UINT64_MAX / esize || end - begin != numel * esize) {
      return bad(where + "'s data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                 "] hold " + std::to_string(end - begin) + " bytes, its " + t.dtype +
                 " shape needs " + std::to_string(numel) + " x " + std::to_string(esize));
    }
    t.offset = data_begin + begin;
    t.bytes = end - begin;
    if (t.bytes > 0) ranges.emplace_back(begin, name);
    if (tensors_.count(name) != 0) {
      return bad(where + " is also in " + paths_[tensors_[name].file]);
    }
    tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    const SafetensorsTensor& prev = tensors_[ranges[i - 1].second];
    if (prev.offset - data_begin + prev.bytes > ranges[i].first) {
      return bad("tensors '" + prev.name + "' and '" + ranges[i].second + "' overlap");
    }
  }
  return Status::Ok();
}

Status SafetensorsReader::ReadFloat(const std::string& name, uint64_t first, std::span<float> out) {
  const SafetensorsTensor* t = Find(name);
  if (t == nullptr)
    return InvalidArgumentError("no tensor '" + name + "' in the safetensors files");
  const std::string& path = paths_[t->file];
  if (!IsFloatDType(t->dtype)) {
    return InvalidArgumentError(path + ": tensor '" + name + "' is " + t->dtype +
                                "; parameters load from F32, F16, BF16 or F64");
  }
  if (first > t->numel || out.size() > t->numel - first) {
    return InvalidArgumentError(path + ": tensor '" + name + "' has " + std::to_string(t->numel) +
                                " elements; asked for " + std::to_string(out.size()) + " from " +
                                std::to_string(first));
  }
  const uint64_t esize = ElementBytes(t->dtype);
  if (staging_.size() < kStagingBytes) staging_.resize(kStagingBytes);
  const size_t per_read = kStagingBytes / esize;
  for (size_t done = 0; done < out.size();) {
    const size_t count = std::min(per_read, out.size() - done);
    const uint64_t offset = t->offset + (first + done) * esize;
    STRATA_RETURN_IF_ERROR(ReadExactly(fds_[t->file], staging_.data(), count * esize, offset,
                                       path + " (tensor '" + name + "')"));
    bytes_read_ += count * esize;
    float* dst = out.data() + done;
    if (t->dtype == "F32") {
      std::memcpy(dst, staging_.data(), count * 4);
    } else if (t->dtype == "F16") {
      ConvertToFloat(staging_.data(), DType::kFloat16, count, dst);
    } else if (t->dtype == "BF16") {
      ConvertToFloat(staging_.data(), DType::kBFloat16, count, dst);
    } else {
      for (size_t k = 0; k < count; ++k) {
        double v;
        std::memcpy(&v, staging_.data() + k * 8, 8);
        dst[k] = static_cast<float>(v);
      }
    }
    done += count;
  }
  return Status::Ok();
}

namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

Result<std::vector<std::string>> MatchSafetensors(const SafetensorsReader& reader,
                                                  std::span<const ExpectedTensor> expected) {
  std::vector<std::string> source(expected.size());
  std::vector<std::string> missing, mismatched;
  std::map<std::string, bool> used;
  for (const auto& [name, t] : reader.tensors())
    used[name] = false;
  for (size_t i = 0; i < expected.size(); ++i) {
    const ExpectedTensor& e = expected[i];
    std::vector<std::string> names{e.name};
    names.insert(names.end(), e.aliases.begin(), e.aliases.end());
    const SafetensorsTensor* found = nullptr;
    for (const std::string& n : names) {
      const SafetensorsTensor* t = reader.Find(n);
      if (t == nullptr) continue;
      used[n] = true;  // every name of a tied tensor is accounted for
      if (found == nullptr) found = t;
    }
    if (found == nullptr) {
      if (!e.optional) missing.push_back(e.name + " " + ShapeString(e.shape));
      continue;
    }
    if (found->shape != e.shape || !SafetensorsReader::IsFloatDType(found->dtype)) {
      mismatched.push_back(
          found->name + ": the model has " + ShapeString(e.shape) + ", " +
          (reader.files().size() == 1 ? std::string("the file") : reader.files()[found->file]) +
          " has " + found->dtype + " " + ShapeString(found->shape));
      continue;
    }
    source[i] = found->name;
  }
  std::vector<std::string> extra;
  for (const auto& [name, is_used] : used) {
    if (!is_used) extra.push_back(name);
  }
  if (missing.empty() && mismatched.empty() && extra.empty()) return source;
  std::string msg = "the safetensors file";
  msg += reader.files().size() == 1 ? " " + reader.files()[0] : "s";
  msg += " do" + std::string(reader.files().size() == 1 ? "es" : "") + " not match the model:";
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    msg += std::string("\n  ") + what + " (" + std::to_string(names.size()) + "):";
    for (size_t k = 0; k < names.size() && k < 20; ++k)
      msg += "\n    " + names[k];
    if (names.size() > 20) msg += "\n    ... and " + std::to_string(names.size() - 20) + " more";
  };
  list("missing from the file", missing);
  list("mismatched (shape or dtype)", mismatched);
  list("in the file but not in the model", extra);
  return InvalidArgumentError(msg);
}

}  // namespace strata::engine

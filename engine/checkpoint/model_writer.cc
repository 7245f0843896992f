// ModelWriter: a model in Hugging Face's safetensors layout (model_writer.h).
#include "strata/engine/checkpoint/model_writer.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/checkpoint/files.h"
#include "strata/engine/checkpoint/format.h"

namespace strata::engine {
namespace {

constexpr char kTmpSuffix[] = ".tmp-strata";

Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const auto* p = static_cast<const std::byte*>(data);
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "writing " + path);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// "<stem>-NNNNN-of-NNNNN.safetensors" (five digits each), as ShardName writes them.
bool IsShardName(const std::string& name, const std::string& stem) {
  const std::string tail = ".safetensors";
  // stem, "-", 5 digits, "-of-", 5 digits, tail.
  if (name.size() != stem.size() + 1 + 5 + 4 + 5 + tail.size()) return false;
  if (name.compare(0, stem.size(), stem) != 0) return false;
  size_t at = stem.size();
  auto digits = [&](size_t from) {
    for (size_t k = from; k < from + 5; ++k)
      if (name[k] < '0' || name[k] > '9') return false;
    return true;
  };
  return name.compare(at, 1, "-") == 0 && digits(at + 1) && name.compare(at + 6, 4, "-of-") == 0 &&
         digits(at + 10) && name.compare(at + 15, tail.size(), tail) == 0;
}

std::string ShardName(const std::string& stem, size_t k, size_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu", k + 1, n);
  return stem + buf + ".safetensors";
}

}  // namespace

Result<std::unique_ptr<ModelWriter>> ModelWriter::Create(
    const std::string& dir, const std::string& filename, std::vector<ModelTensorSpec> tensors,
    uint64_t max_file_bytes, std::map<std::string, std::string> metadata) {
  const std::string ext = ".safetensors";
  if (filename.size() <= ext.size() ||
      filename.compare(filename.size() - ext.size(), ext.size(), ext) != 0 ||
      filename.find('/') != std::string::npos) {
    return InvalidArgumentError("the model's file name " + filename +
                                " must be a file name ending in .safetensors (model.safetensors)");
  }
  if (max_file_bytes == 0) {
    return InvalidArgumentError("the largest file size must be positive");
  }
  auto w = std::unique_ptr<ModelWriter>(new ModelWriter());
  w->dir_ = dir;
  w->filename_ = filename;
  w->metadata_ = std::move(metadata);
  std::set<std::string> names;
  for (const ModelTensorSpec& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return InvalidArgumentError("a tensor of the model is named '" + t.name + "'");
    }
    if (!names.insert(t.name).second) {
      return InvalidArgumentError("two tensors of the model are named " + t.name);
    }
    const uint64_t esize = CheckpointDTypeSize(t.dtype);
    if (esize == 0) {
      return InvalidArgumentError("tensor " + t.name + " has dtype " + t.dtype +
                                  ", which a safetensors file cannot hold");
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return InvalidArgumentError("tensor " + t.name + " has a negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    w->bytes_.push_back(numel * esize);
  }
  w->specs_ = std::move(tensors);
  // Files in the tensors' order: the next tensor starts a new file when it would take the
  // current one past the limit (Hugging Face's rule: a larger tensor gets a file alone).
  uint64_t in_file = 0;
  for (size_t i = 0; i < w->specs_.size(); ++i) {
    if (w->files_.empty() || (in_file > 0 && in_file + w->bytes_[i] > max_file_bytes)) {
      w->files_.push_back({"", i, i});
      in_file = 0;
    }
    w->files_.back().end = i + 1;
    in_file += w->bytes_[i];
  }
  if (w->files_.empty()) w->files_.push_back({"", 0, 0});
  const std::string stem = filename.substr(0, filename.size() - ext.size());
  for (size_t k = 0; k < w->files_.size(); ++k) {
    w->files_[k].name = w->files_.size() == 1 ? filename : ShardName(stem, k, w->files_.size());
  }
  STRATA_RETURN_IF_ERROR(w->OpenFile(0));
  return w;
}

ModelWriter::~ModelWriter() {
  if (!committed_) RemoveTemporaries();
}

void ModelWriter::RemoveTemporaries() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  for (const File& f : files_) {
    const std::string tmp = dir_ + "/" + f.name + kTmpSuffix;
    ::unlink(tmp.c_str());
  }
}

Status ModelWriter::OpenFile(size_t k) {
  file_ = k;
  const File& f = files_[k];
  const std::string path = dir_ + "/" + f.name + kTmpSuffix;
  if (Exists(path) && ::unlink(path.c_str()) != 0) return ErrnoError(errno, "removing " + path);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) return ErrnoError(errno, "creating " + path);
  Json header = Json::object();
  Json meta = Json::object();
  meta["format"] = "pt";
  for (const auto& [key, value] : metadata_)
    meta[key] = value;
  header["__metadata__"] = meta;
  uint64_t at = 0;
  for (size_t i = f.first; i < f.end; ++i) {
    header[specs_[i].name] = {{"dtype", specs_[i].dtype},
                              {"shape", specs_[i].shape},
                              {"data_offsets", {at, at + bytes_[i]}}};
    at += bytes_[i];
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t size_le[8];
  for (int b = 0; b < 8; ++b)
    size_le[b] = static_cast<uint8_t>((text.size() >> (8 * b)) & 0xff);
  STRATA_RETURN_IF_ERROR(WriteAll(fd_, size_le, 8, path));
  STRATA_RETURN_IF_ERROR(WriteAll(fd_, text.data(), text.size(), path));
  file_bytes_ += 8 + text.size() + at;
  return Status::Ok();
}

Status ModelWriter::CloseFile() {
  const std::string path = dir_ + "/" + files_[file_].name + kTmpSuffix;
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, "fsync of " + path);
  }
  if (::close(fd) != 0) return ErrnoError(errno, "closing " + path);
  return Status::Ok();
}

Status ModelWriter::Append(const void* data, size_t bytes) {
  if (!failed_.ok()) return failed_;
  const auto* p = static_cast<const std::byte*>(data);
  Status s;
  while (bytes > 0 && s.ok()) {
    // Zero-sized tensors hold nothing: step over them.
    while (tensor_ < specs_.size() && done_ == bytes_[tensor_]) {
      ++tensor_;
      done_ = 0;
    }
    if (tensor_ == specs_.size()) {
      s = FailedPreconditionError("more bytes appended than the model's tensors hold");
      break;
    }
    if (tensor_ >= files_[file_].end) {
      s = CloseFile();
      if (s.ok()) s = OpenFile(file_ + 1);
      if (!s.ok()) break;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, bytes_[tensor_] - done_));
    s = WriteAll(fd_, p, n, dir_ + "/" + files_[file_].name + kTmpSuffix);
    p += n;
    bytes -= n;
    done_ += n;
  }
  while (s.ok() && tensor_ < specs_.size() && done_ == bytes_[tensor_]) {
    ++tensor_;
    done_ = 0;
  }
  if (!s.ok()) failed_ = s;
  return s;
}

Result<ModelWriteStats> ModelWriter::Commit(
    const std::vector<std::pair<std::string, std::string>>& small_files) {
  if (!failed_.ok()) return failed_;
  while (tensor_ < specs_.size() && bytes_[tensor_] == 0)
    ++tensor_;
  if (tensor_ != specs_.size()) {
    return FailedPreconditionError("the model's tensors are not all written (tensor " +
                                   specs_[tensor_].name + " and after)");
  }
  // The last files may hold only zero-sized tensors, not opened yet.
  while (file_ + 1 < files_.size()) {
    STRATA_RETURN_IF_ERROR(CloseFile());
    STRATA_RETURN_IF_ERROR(OpenFile(file_ + 1));
  }
  STRATA_RETURN_IF_ERROR(CloseFile());
  for (const auto& [name, text] : small_files) {
    if (name.empty() || name.find('/') != std::string::npos) {
      return InvalidArgumentError("a file beside the model is named '" + name + "'");
    }
    const std::string tmp = dir_ + "/" + name + kTmpSuffix;
    ::unlink(tmp.c_str());
    const Status written = WriteSmallFile(tmp, text, /*sync=*/true);
    if (!written.ok()) {
      ::unlink(tmp.c_str());
      for (const auto& [other, unused] : small_files)
        ::unlink((dir_ + "/" + other + kTmpSuffix).c_str());
      return written;
    }
  }
  for (const auto& [name, text] : small_files) {
    const std::string tmp = dir_ + "/" + name + kTmpSuffix;
    const std::string path = dir_ + "/" + name;
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + tmp + " to " + path);
    }
  }
  ModelWriteStats stats;
  const std::string ext = ".safetensors";
  const std::string stem = filename_.substr(0, filename_.size() - ext.size());
  const std::string index = filename_ + ".index.json";
  std::set<std::string> ours;
  for (const File& f : files_) {
    const std::string tmp = dir_ + "/" + f.name + kTmpSuffix;
    const std::string path = dir_ + "/" + f.name;
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + tmp + " to " + path);
    }
    ours.insert(f.name);
    stats.files.push_back(f.name);
  }
  committed_ = true;  // the files are in place: nothing to remove any more
  for (size_t i = 0; i < specs_.size(); ++i)
    stats.tensor_bytes += bytes_[i];
  stats.tensors = specs_.size();
  stats.file_bytes = file_bytes_;
  if (files_.size() > 1) {
    Json map = Json::object();
    for (const File& f : files_)
      for (size_t i = f.first; i < f.end; ++i)
        map[specs_[i].name] = f.name;
    Json j = {{"metadata", {{"total_size", stats.tensor_bytes}}}, {"weight_map", map}};
    const std::string tmp = dir_ + "/" + index + kTmpSuffix;
    ::unlink(tmp.c_str());
    STRATA_RETURN_IF_ERROR(WriteSmallFile(tmp, j.dump(2) + "\n", /*sync=*/true));
    const std::string path = dir_ + "/" + index;
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + tmp + " to " + path);
    }
    stats.index = index;
  } else if (Exists(dir_ + "/" + index)) {
    // An earlier sharded save's index would name files that are gone.
    if (::unlink((dir_ + "/" + index).c_str()) != 0) {
      return ErrnoError(errno, "removing the earlier save's " + dir_ + "/" + index);
    }
  }
  // An earlier save's files under this name that this one does not use.
  if (DIR* d = ::opendir(dir_.c_str()); d != nullptr) {
    std::vector<std::string> stale;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (ours.count(name) != 0) continue;
      if (IsShardName(name, stem) || (files_.size() > 1 && name == filename_)) {
        stale.push_back(name);
      }
    }
    ::closedir(d);
    for (const std::string& name : stale) {
      const std::string path = dir_ + "/" + name;
      if (::unlink(path.c_str()) != 0) {
        return ErrnoError(errno, "removing the earlier save's " + path);
      }
    }
  }
  STRATA_RETURN_IF_ERROR(FsyncPath(dir_));
  return stats;
}

}  // namespace strata::engine

// Files and atomic writes for checkpoints (files.h).
#include "strata/engine/checkpoint/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>

#include "strata/core/logging.h"
#include "strata/swap/crc32c.h"

namespace strata::engine {

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

Status MakeDirs(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("checkpoint: the save directory is empty");
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string prefix = path.substr(0, at);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError(errno, "creating directory " + prefix);
    }
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return ErrnoError(errno, "checkpoint directory " + path);
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgumentError("checkpoint directory " + path + " exists and is not a directory");
  }
  return Status::Ok();
}

namespace {
int RemoveEntry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*ftw*/) {
  return (type == FTW_DP ? ::rmdir(path) : ::unlink(path)) == 0 ? 0 : -1;
}
}  // namespace

// The directory and everything in it (POSIX calls: see tests/engine/temp_dir.h on why not
// std::filesystem in binaries that link LibTorch).
Status RemoveTree(const std::string& path) {
  if (!Exists(path)) return Status::Ok();
  if (::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return ErrnoError(errno, "removing " + path);
  }
  return Status::Ok();
}

Status FsyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "opening " + path + " to fsync it");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(err, "fsync of " + path);
  return Status::Ok();
}

Status WriteSmallFile(const std::string& path, const std::string& text, bool sync,
                      const std::function<void()>& before_sync) {
  FileWriter w;
  STRATA_RETURN_IF_ERROR(w.Open(path));
  STRATA_RETURN_IF_ERROR(w.Write(text.data(), text.size()));
  if (before_sync) before_sync();
  if (sync) STRATA_RETURN_IF_ERROR(w.Sync());
  return w.Close();
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "opening " + path);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoError(err, "reading " + path);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      ::close(fd);
      return InvalidArgumentError(path + " is larger than " + std::to_string(max_bytes) +
                                  " bytes: not a checkpoint file");
    }
  }
  ::close(fd);
  return text;
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status FileWriter::Open(const std::string& path) {
  path_ = path;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) return ErrnoError(errno, "creating " + path);
  return Status::Ok();
}

Status FileWriter::Write(const void* data, size_t bytes) {
  const auto* p = static_cast<const std::byte*>(data);
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd_, p + done, bytes - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "writing " + path_ + " at offset " + std::to_string(offset_));
    }
    done += static_cast<size_t>(n);
    offset_ += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status FileWriter::PadTo(uint64_t alignment) {
  static const std::byte zeros[kAlign] = {};
  const uint64_t pad = (alignment - offset_ % alignment) % alignment;
  return pad == 0 ? Status::Ok() : Write(zeros, static_cast<size_t>(pad));
}

Status FileWriter::Sync() {
  if (::fsync(fd_) != 0) return ErrnoError(errno, "fsync of " + path_);
  return Status::Ok();
}

void FileWriter::StartWriteBack() {
  if (offset_ - started_ < (uint64_t{32} << 20)) return;
  ::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(offset_ - started_),
                    SYNC_FILE_RANGE_WRITE);
  started_ = offset_;
}

Status FileWriter::Close() {
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return ErrnoError(errno, "closing " + path_);
  return Status::Ok();
}

RankFileWriter::~RankFileWriter() {
  if (io_ != nullptr) {
    (void)io_->WaitAll(nullptr);  // the buffers must outlive their requests
    (void)io_->UnregisterFile(file_);
  }
  if (fd_ >= 0) ::close(fd_);
}

Status RankFileWriter::Open(const std::string& path, bool direct) {
  path_ = path;
  if (!direct) return buffered_.Open(path);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0644);
  if (fd_ < 0 && errno == EINVAL) {
    static std::once_flag logged;
    std::call_once(logged, [&] {
      STRATA_LOG(kInfo) << "checkpoint: " << path
                        << ": the filesystem does not take O_DIRECT; writing through the "
                           "page cache";
    });
    return buffered_.Open(path);
  }
  if (fd_ < 0) return ErrnoError(errno, "creating " + path);
  swap::IoEngineOptions io;
  io.queue_depth = kBuffers;
  io.threads = 1;
  io.fixed_buffers = false;
  STRATA_ASSIGN_OR_RETURN(io_, swap::CreateIoEngine(io));
  STRATA_ASSIGN_OR_RETURN(file_, io_->RegisterFile(fd_, path));
  for (int i = 0; i < kBuffers; ++i) {
    void* p = nullptr;
    if (::posix_memalign(&p, swap::IoEngine::kDirectAlignment, kBuffer) != 0) {
      return ResourceExhaustedError("checkpoint: 4 MiB write buffers for " + path);
    }
    buffers_.emplace_back(static_cast<std::byte*>(p), &std::free);
    free_.push_back(i);
  }
  return Next();
}

Status RankFileWriter::Write(const void* data, size_t bytes, uint32_t* crc) {
  if (io_ == nullptr) {
    if (crc != nullptr) {
      *crc = swap::Crc32cExtend(
          *crc, std::span<const std::byte>(static_cast<const std::byte*>(data), bytes));
    }
    return buffered_.Write(data, bytes);
  }
  const auto* p = static_cast<const std::byte*>(data);
  while (bytes > 0) {
    const size_t n = std::min({bytes, kBuffer - fill_, size_t{64} << 10});
    std::byte* dst = buffers_[static_cast<size_t>(cur_)].get() + fill_;
    std::memcpy(dst, p, n);
    if (crc != nullptr) *crc = swap::Crc32cExtend(*crc, std::span<const std::byte>(dst, n));
    fill_ += n;
    p += n;
    bytes -= n;
    offset_ += n;
    if (fill_ == kBuffer) STRATA_RETURN_IF_ERROR(Flush());
  }
  return Status::Ok();
}

Status RankFileWriter::PadTo(uint64_t alignment) {
  static const std::byte zeros[kAlign] = {};
  const uint64_t pad = (alignment - offset() % alignment) % alignment;
  return pad == 0 ? Status::Ok() : Write(zeros, static_cast<size_t>(pad));
}

void RankFileWriter::StartWriteBack() {
  if (io_ == nullptr) buffered_.StartWriteBack();
}

Status RankFileWriter::Sync() {
  if (io_ == nullptr) return buffered_.Sync();
  if (fill_ > 0) {
    const size_t padded = (fill_ + kAlign - 1) / kAlign * kAlign;
    std::memset(buffers_[static_cast<size_t>(cur_)].get() + fill_, 0, padded - fill_);
    fill_ = padded;
    STRATA_RETURN_IF_ERROR(Flush());
  }
  STRATA_RETURN_IF_ERROR(io_->WaitAll(nullptr));
  if (::ftruncate(fd_, static_cast<off_t>(offset_)) != 0) {
    return ErrnoError(errno, "setting the length of " + path_);
  }
  if (::fsync(fd_) != 0) return ErrnoError(errno, "fsync of " + path_);
  return Status::Ok();
}

Status RankFileWriter::Close() {
  if (io_ == nullptr) return buffered_.Close();
  STRATA_RETURN_IF_ERROR(io_->UnregisterFile(file_));
  io_.reset();
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return ErrnoError(errno, "closing " + path_);
  return Status::Ok();
}

Status RankFileWriter::Flush() {
  swap::IoRequest r{swap::IoOp::kWrite,
                    file_,
                    file_offset_,
                    fill_,
                    buffers_[static_cast<size_t>(cur_)].get(),
                    static_cast<uint64_t>(cur_)};
  STRATA_RETURN_IF_ERROR(io_->Submit({&r, 1}));
  file_offset_ += fill_;
  fill_ = 0;
  return Next();
}

Status RankFileWriter::Next() {
  if (free_.empty()) {
    STRATA_ASSIGN_OR_RETURN(swap::IoCompletion c, io_->WaitOne());
    STRATA_RETURN_IF_ERROR(c.status);
    free_.push_back(static_cast<int>(c.tag));
  }
  cur_ = free_.back();
  free_.pop_back();
  return Status::Ok();
}

}  // namespace strata::engine

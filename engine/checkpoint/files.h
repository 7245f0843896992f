// Files and atomic writes for checkpoints: plain POSIX calls (see tests/engine/temp_dir.h on
// why not std::filesystem in binaries that link LibTorch), a front-to-back writer, and the
// rank file's O_DIRECT writer over an io_uring engine. Internal to the engine.
//
// Thread-safety: a writer is used by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/format.h"
#include "strata/swap/io_engine.h"

namespace strata::engine {

bool Exists(const std::string& path);
// mkdir -p; InvalidArgument when the path is something else than a directory.
Status MakeDirs(const std::string& path);
// The directory and everything in it (Ok when it does not exist).
Status RemoveTree(const std::string& path);
Status FsyncPath(const std::string& path);
// `before_sync` runs between the write and the fsync (a save's crash point).
Status WriteSmallFile(const std::string& path, const std::string& text, bool sync,
                      const std::function<void()>& before_sync = {});
Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes);

// A file written front to back; Close() reports the first error.
class FileWriter {
 public:
  FileWriter() = default;
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  Status Open(const std::string& path);
  Status Write(const void* data, size_t bytes);
  Status PadTo(uint64_t alignment);
  Status Sync();
  // Starts writing what was written so far to the disk without waiting (a hint: the
  // fsync at the end is what counts), so the disk works while the caller computes.
  void StartWriteBack();
  Status Close();
  uint64_t offset() const { return offset_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
  uint64_t started_ = 0;  // write-back started up to here
};

// A rank file written front to back with O_DIRECT through an io_uring engine (several
// 4 MiB writes in flight, the copy into the next buffer overlapping them), or through the
// page cache where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6), said once in the
// log (or where `direct` is false: CheckpointSaveRequest::test_buffered_writes).
class RankFileWriter {
 public:
  static constexpr size_t kBuffer = size_t{4} << 20;
  static constexpr int kBuffers = 8;

  RankFileWriter() = default;
  ~RankFileWriter();
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;
  Status Open(const std::string& path, bool direct = true);
  // Appends `bytes`; with `crc`, extends *crc over them (computed on the copy, in small
  // pieces while they are in cache).
  Status Write(const void* data, size_t bytes, uint32_t* crc = nullptr);
  Status PadTo(uint64_t alignment);
  void StartWriteBack();
  // Everything written, then the file cut to its length and fsynced.
  Status Sync();
  Status Close();
  uint64_t offset() const { return io_ == nullptr ? buffered_.offset() : offset_; }
  bool direct() const { return io_ != nullptr; }

 private:
  // Submits the current buffer (fill_ bytes, a multiple of 4 KiB) and takes the next one.
  Status Flush();
  Status Next();

  std::string path_;
  FileWriter buffered_;
  int fd_ = -1;
  std::unique_ptr<swap::IoEngine> io_;
  swap::FileId file_ = -1;
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> buffers_;
  std::vector<int> free_;
  int cur_ = -1;
  size_t fill_ = 0;           // bytes in the current buffer
  uint64_t file_offset_ = 0;  // where the current buffer goes
  uint64_t offset_ = 0;       // bytes written by the caller
};

}  // namespace strata::engine

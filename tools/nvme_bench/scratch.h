// ScratchSpace: nvme_bench's private directories and data files, removed when done.
//
// For each parent directory (a --path, or the current directory) it creates a private
// directory "<parent>/nvme_bench.XXXXXX" (mkdtemp: mode 0700) and in it one data file
// "data" (mode 0600, O_EXCL), preallocated with fallocate. The files are opened with
// O_DIRECT when asked; a filesystem that refuses O_DIRECT is a clear InvalidArgument
// error that suggests --buffered (never a silent fallback).
//
// Removal: Remove() or the destructor closes the files, unlinks them and removes the
// private directories, so the parents are left as they were. Every path is also
// recorded in a process-wide, fixed-size registry that RemoveScratchFromSignalHandler()
// reads: it is async-signal-safe (unlink and rmdir only) and lets a signal handler
// remove everything when the process must die at once. A process killed with SIGKILL
// leaves its files behind (there is nothing to run); they are named nvme_bench.*.
//
// Thread-safety: a ScratchSpace is used by one thread. The registry may be read by a
// signal handler at any time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::nvme_bench {

struct ScratchFile {
  std::string path;       // "<parent>/nvme_bench.XXXXXX/data"
  std::string directory;  // "<parent>/nvme_bench.XXXXXX"
  std::string parent;     // as given
  int fd = -1;            // owned; O_RDWR (| O_DIRECT)
  uint64_t size = 0;      // preallocated bytes
};

class ScratchSpace {
 public:
  // Creates one private directory and one preallocated file of `bytes_per_file` bytes in
  // each of `parents` (which must be existing, distinct directories). Checks free space
  // first (statvfs): ResourceExhausted naming the directory, the need and what is free.
  // On error nothing is left behind.
  static Result<ScratchSpace> Create(const std::vector<std::string>& parents,
                                     uint64_t bytes_per_file, bool direct);

  ScratchSpace() = default;
  ScratchSpace(ScratchSpace&& other) noexcept;
  ScratchSpace& operator=(ScratchSpace&& other) noexcept;
  ScratchSpace(const ScratchSpace&) = delete;
  ScratchSpace& operator=(const ScratchSpace&) = delete;
  // Removes everything (errors are logged).
  ~ScratchSpace();

  const std::vector<ScratchFile>& files() const { return files_; }
  bool direct() const { return direct_; }

  // Closes and unlinks the files and removes the private directories. Returns the first
  // error (ENOENT is not one: a signal handler may have been first).
  Status Remove();

 private:
  std::vector<ScratchFile> files_;
  std::vector<std::string> directories_;
  std::vector<int> registry_slots_;
  bool direct_ = false;
};

// Async-signal-safe: unlinks every registered scratch file, then removes the registered
// directories. Safe to call from a signal handler, also while another thread creates or
// removes scratch space (each entry is published atomically).
void RemoveScratchFromSignalHandler() noexcept;

// Human-readable description of the filesystem and block device under `path`, e.g.
// "ext4 on /dev/vda (Virtio disk)", best effort ("unknown filesystem" when unknown).
std::string DescribeFilesystem(const std::string& path);

}  // namespace strata::nvme_bench

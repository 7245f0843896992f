// SwapSpace: verified swap storage for "tensors" (byte arrays) striped across one or more
// directories, typically one per NVMe drive.
//
//   SwapSpaceOptions o = SwapSpaceOptions::FromConfig(cfg.aio, cfg.strata,
//                                                     cfg.zero_optimization.offload_optimizer);
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SwapSpace> swap, SwapSpace::Create(o));
//   STRATA_ASSIGN_OR_RETURN(SwapHandle h, swap->Allocate(state.size()));
//   STRATA_RETURN_IF_ERROR(swap->Write(h, state));          // or WriteAsync(...) + Wait()
//   STRATA_ASSIGN_OR_RETURN(SwapFuture f, swap->ReadAsync(h, state));
//   ... overlap other work ...
//   STRATA_RETURN_IF_ERROR(f.Wait());                       // DataLoss on a CRC mismatch
//
// Layout. In each directory the space creates a private subdirectory
// "strata-swap-<pid>-XXXXXX" (mode 0700) and in it one swap file (mode 0600) that never
// has a name (O_TMPFILE) or is unlinked right after creation where the filesystem has
// no O_TMPFILE; then it removes the (empty) subdirectory. From then on nothing of the
// space has a name on disk, so a process killed with SIGKILL leaves nothing behind: the
// kernel frees the file when its last descriptor closes. Only a process killed inside
// Create can leave an empty subdirectory (or, without O_TMPFILE, a swap.0 of at most the
// probe block), which the next SwapSpace created in that directory removes once that
// process is gone. Files are preallocated with fallocate and grow in steps as tensors
// are allocated (after a statvfs free-space check). A tensor of N bytes is cut into
// blocks of block_size bytes; block i lives in directory (s + i) mod D, where D is the
// number of directories and s rotates with every allocation, so reads and writes of one
// tensor use all drives at once. Each directory's blocks of a tensor are one contiguous
// range of that directory's file (reserved from a best-fit slot allocator).
//
// Integrity. With checksums on (strata.swap_checksums, the default) a CRC32C of every
// block is computed before it is written, kept in memory, and checked after every read;
// a mismatch fails the read with DataLoss naming the file, offset and both CRCs.
//
// I/O goes through an IoEngine owned by the space: io_uring with O_DIRECT where the
// filesystem supports O_DIRECT. Where it does not (tmpfs before Linux 6.6, some network
// filesystems) the files are opened without O_DIRECT and, with engine kind "auto", the
// synchronous engine is used — with a logged warning and fallback() saying why, never
// silently. Buffers need no alignment: a misaligned buffer, or a tensor whose size is not
// a multiple of 4 KiB, goes through an aligned bounce buffer where O_DIRECT needs one.
// Buffers from a HostPool (4 KiB aligned) and sizes that are multiples of 4 KiB go
// straight to the device, and use registered buffers when passed to RegisterBuffer.
//
// Thread-safety: all methods may be called from any thread at once. Operations on one
// tensor: several reads may run at once; a write excludes other reads and writes of the
// same tensor (FailedPrecondition otherwise). Buffers passed to an async call must stay
// valid and untouched until its future's Wait() returned. Futures must not outlive
// the space; the destructor waits for all outstanding I/O and then closes and removes
// everything it created.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/core/status.h"
#include "strata/swap/io_engine.h"

namespace strata {
struct AioConfig;      // strata/core/config.h
struct StrataConfig;   // strata/core/config.h
struct OffloadConfig;  // strata/core/config.h
}  // namespace strata

namespace strata::swap {

struct SwapSpaceOptions {
  // Where the swap files go; one per drive for bandwidth. Must exist and be writable.
  std::vector<std::string> directories;
  // Striping unit and checksum unit: a multiple of 4 KiB, at most 1 GiB (aio.block_size).
  uint64_t block_size = uint64_t{1} << 20;
  // CRC32C per block, checked on every read (strata.swap_checksums).
  bool checksums = true;
  // Open the files with O_DIRECT where the filesystem allows it (bypasses the page
  // cache). false: buffered I/O, chosen by the caller (no warning).
  bool direct_io = true;
  // Bytes preallocated per directory at Create (rounded up to block_size); 0 = none.
  uint64_t initial_bytes_per_directory = 0;
  // A file grows by at least this much when a tensor does not fit (rounded up to
  // block_size), fewer bytes only when the disk has less free.
  uint64_t grow_bytes = uint64_t{256} << 20;
  // Upper bound of each file; 0 = only the free space of the disk.
  uint64_t max_bytes_per_directory = 0;
  // The engine: kind, queue depth, rings/threads, ... (aio.queue_depth,
  // aio.intra_op_parallelism).
  IoEngineOptions io;
  // Creates the engine from `io` (after the kind was adjusted for O_DIRECT); empty =
  // CreateIoEngine. Tests pass one that builds a FaultInjectingIoEngine.
  std::function<Result<std::unique_ptr<IoEngine>>(const IoEngineOptions&)> engine_factory;
  // For tests: behave as if every directory refused O_DIRECT (as tmpfs did before
  // Linux 6.6), to exercise that fallback on filesystems that accept it.
  bool assume_no_direct_io = false;

  // aio.block_size -> block_size, aio.queue_depth/intra_op_parallelism -> io,
  // strata.swap_checksums -> checksums, offload.nvme_path -> directories.
  static SwapSpaceOptions FromConfig(const AioConfig& aio, const StrataConfig& strata,
                                     const OffloadConfig& offload);
  std::string ToString() const;
};

// A tensor allocated in a SwapSpace. A plain value; 0 is never a valid id.
struct SwapHandle {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
  friend bool operator==(SwapHandle a, SwapHandle b) { return a.id == b.id; }
};

// Where one block of a tensor is stored.
struct SwapBlockLocation {
  size_t block = 0;      // index within the tensor
  size_t directory = 0;  // index into SwapSpaceOptions::directories
  uint64_t offset = 0;   // in that directory's swap file
  uint64_t length = 0;   // bytes of the tensor in this block (the last may be shorter)
};

struct SwapDirectoryInfo {
  std::string directory;    // as given in the options
  std::string private_dir;  // <directory>/strata-swap-<pid>-XXXXXX (removed by Create)
  std::string file;         // how errors name the swap file
  bool tmpfile = false;     // O_TMPFILE (never named) rather than create + unlink
  bool direct = false;      // opened with O_DIRECT
  int fd = -1;              // owned by the space: for diagnostics and tests only
  uint64_t capacity = 0;    // bytes preallocated
  uint64_t reserved = 0;    // bytes reserved by live tensors (whole blocks)
};

struct SwapSpaceStats {
  uint64_t tensors = 0;          // live allocations
  uint64_t bytes_allocated = 0;  // sum of their sizes
  uint64_t capacity = 0;         // preallocated bytes, all directories
  uint64_t bytes_written = 0;    // tensor bytes written by successful writes
  uint64_t bytes_read = 0;       // tensor bytes read by successful reads
  uint64_t blocks_verified = 0;  // blocks whose CRC32C was checked after a read
  uint64_t crc_mismatches = 0;
  uint64_t bounced_bytes = 0;  // bytes copied through bounce buffers
};

class SwapSpace;

namespace internal {
struct SwapOp;
}

// The result of an asynchronous swap read or write. Move-only. Destroying a future that
// was not waited for waits (the buffer may not be released under running I/O) and logs
// the status if it is an error.
class SwapFuture {
 public:
  SwapFuture() = default;
  SwapFuture(SwapFuture&& other) noexcept;
  SwapFuture& operator=(SwapFuture&& other) noexcept;
  SwapFuture(const SwapFuture&) = delete;
  SwapFuture& operator=(const SwapFuture&) = delete;
  ~SwapFuture();

  // Blocks until every block of the operation has ended. Ok, or the first error: the
  // engine's (IOError, ResourceExhausted, ...) or DataLoss for a CRC mismatch. Later
  // calls return the same status.
  Status Wait();
  // Makes progress without blocking; true when Wait() would not block.
  bool Ready();
  bool valid() const { return op_ != nullptr; }

 private:
  friend class SwapSpace;
  SwapFuture(SwapSpace* space, std::shared_ptr<internal::SwapOp> op);
  void Release();

  SwapSpace* space_ = nullptr;
  std::shared_ptr<internal::SwapOp> op_;
  bool waited_ = false;
  Status status_;
};

class SwapSpace {
 public:
  // Checks and prepares every directory (see the layout above) and creates the engine.
  // Errors: InvalidArgument (no directory, bad block size, a directory listed twice, a
  // path that is not a directory), NotFound (a directory that does not exist),
  // PermissionDenied (not writable), ResourceExhausted (initial preallocation does not
  // fit), Unimplemented (the filesystem has no fallocate), or the engine's error.
  static Result<std::unique_ptr<SwapSpace>> Create(SwapSpaceOptions options);
  // Waits for outstanding I/O and closes the files (which frees their blocks).
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Reserves space for a tensor of `bytes` bytes (> 0), growing files as needed.
  // ResourceExhausted naming the directory, the bytes needed and the bytes available
  // when the disk (statvfs) or max_bytes_per_directory does not allow it.
  Result<SwapHandle> Allocate(uint64_t bytes);
  // Frees the tensor's space for reuse (the files keep their size).
  // FailedPrecondition while I/O on it is in flight; NotFound for an unknown handle.
  Status Free(SwapHandle handle);

  // Writes the whole tensor: data.size() must equal its size. Computes the block CRCs
  // (checksums on) and submits the blocks; the future ends when all are on disk.
  Result<SwapFuture> WriteAsync(SwapHandle handle, std::span<const std::byte> data);
  // The same with the blocks' CRC32Cs computed by the caller (e.g. on other threads, while
  // the bytes were still in cache), or none (empty: computed here): block_crcs[i] = Crc32c
  // of data's block i (block_size() bytes from i * block_size(), the last what is left;
  // NumBlocks). They are kept and checked by every read like computed ones, so a wrong one
  // fails the read back with DataLoss. InvalidArgument when checksums are off or the count
  // is not NumBlocks(size).
  Result<SwapFuture> WriteAsync(SwapHandle handle, std::span<const std::byte> data,
                                std::span<const uint32_t> block_crcs);
  // Reads the whole tensor into `out` (out.size() == its size), checking every block's
  // CRC. FailedPrecondition when the tensor was never written or its last write failed.
  Result<SwapFuture> ReadAsync(SwapHandle handle, std::span<std::byte> out);
  Status Write(SwapHandle handle, std::span<const std::byte> data);
  Status Read(SwapHandle handle, std::span<std::byte> out);

  // Size in bytes of a live tensor; NotFound otherwise.
  Result<uint64_t> Size(SwapHandle handle) const;
  // Where each block of the tensor is stored.
  Result<std::vector<SwapBlockLocation>> Locate(SwapHandle handle) const;

  // Registers memory with the engine for fixed-buffer I/O (see IoEngine::RegisterBuffer).
  Result<int> RegisterBuffer(std::span<std::byte> memory) {
    return engine_->RegisterBuffer(memory);
  }
  Status UnregisterBuffer(int id) { return engine_->UnregisterBuffer(id); }

  const SwapSpaceOptions& options() const { return options_; }
  uint64_t block_size() const { return options_.block_size; }
  // Blocks of a tensor of `bytes` bytes (its CRCs' count).
  uint64_t NumBlocks(uint64_t bytes) const {
    return (bytes + options_.block_size - 1) / options_.block_size;
  }
  bool checksums() const { return options_.checksums; }
  // Whether all files use O_DIRECT.
  bool direct_io() const { return direct_io_; }
  // Why this space runs without O_DIRECT or without io_uring; empty when it does not.
  const std::string& fallback() const { return fallback_; }
  const IoEngine& engine() const { return *engine_; }
  std::vector<SwapDirectoryInfo> directories() const;
  SwapSpaceStats stats() const;

 private:
  friend class SwapFuture;
  struct Directory;
  struct Allocation;

  explicit SwapSpace(SwapSpaceOptions options);
  Status Init();
  Status GrowDirectory(Directory& d, uint64_t needed);  // REQUIRES alloc_mu_ held
  Status WaitOp(internal::SwapOp* op);
  bool PollOp(internal::SwapOp* op);
  // Takes completions (blocking for one when `waiting` is given) and accounts for them.
  // REQUIRES: this thread set reaping_. A completion no operation owns is skipped and kept in
  // anomaly_; when the engine has nothing in flight while `waiting` still waits, its
  // completion was lost: it fails with the reason (nothing of it is in the kernel).
  void ReapOnce(internal::SwapOp* waiting);
  Status ProcessCompletion(internal::SwapOp& op, const IoCompletion& c);
  void FinishOp(internal::SwapOp& op);  // REQUIRES dispatch_mu_ held
  Status SubmitBlocks(const std::shared_ptr<internal::SwapOp>& op, size_t first, size_t count);
  void AbandonBlocks(internal::SwapOp& op, size_t count, Status status);

  SwapSpaceOptions options_;
  std::vector<std::unique_ptr<Directory>> dirs_;
  std::vector<size_t> dir_of_file_;  // FileId -> directory index
  std::unique_ptr<IoEngine> engine_;
  bool direct_io_ = false;
  std::string fallback_;

  mutable std::shared_mutex alloc_mu_;
  std::unordered_map<uint64_t, std::unique_ptr<Allocation>> allocations_;
  uint64_t next_handle_ = 1;
  size_t next_start_dir_ = 0;

  std::mutex ops_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<internal::SwapOp>> ops_;  // in flight
  Status anomaly_;  // the first completion no operation owned (guarded by ops_mu_)
  std::atomic<uint64_t> next_op_{1};

  std::mutex dispatch_mu_;
  std::condition_variable dispatch_cv_;
  bool reaping_ = false;
  std::vector<IoCompletion> reap_batch_;  // the reaping thread's
  std::vector<Status> reap_status_;

  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> blocks_verified_{0};
  std::atomic<uint64_t> crc_mismatches_{0};
  std::atomic<uint64_t> bounced_bytes_{0};
};

}  // namespace strata::swap

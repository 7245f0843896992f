// Internal to strata_swap (not installed): what SwapSpace's two files share. The bounce
// buffers, an operation's state behind a SwapFuture (SwapOp), a directory's swap file
// (SwapSpace::Directory) and a handle's blocks (SwapSpace::Allocation); swap_space.cc has the
// allocation, the I/O and the completions, swap_files.cc makes the swap files and closes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/swap/io_engine.h"
#include "strata/swap/slot_allocator.h"
#include "strata/swap/swap_space.h"

namespace strata::swap {

namespace internal {

// O_DIRECT's alignment of offsets, lengths and memory.
inline constexpr size_t kAlign = IoEngine::kDirectAlignment;

// `n` rounded up to a multiple of `unit` (any unit, not only powers of two).
inline uint64_t RoundUp(uint64_t n, uint64_t unit) {
  return (n + unit - 1) / unit * unit;
}

// Aligned heap memory for bounce buffers.
struct AlignedBuffer {
  std::byte* data = nullptr;
  size_t size = 0;
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data); }
  // `bytes` rounded up to kAlign; ResourceExhausted when the heap has none.
  Status Allocate(size_t bytes);
};

struct SwapExtent {
  uint64_t offset = 0;
  uint64_t blocks = 0;
};

struct SwapOp {
  uint64_t id = 0;
  IoOp op = IoOp::kRead;
  uint64_t handle = 0;
  uint64_t bytes = 0;
  uint64_t nblocks = 0;
  uint64_t block_size = 0;
  size_t start_dir = 0;
  size_t ndirs = 0;
  bool direct = false;
  bool checksums = false;
  std::vector<SwapExtent> extents;
  std::byte* user = nullptr;
  std::byte* target = nullptr;  // user, or bounce.data
  AlignedBuffer bounce;         // the whole tensor, when the user buffer is misaligned
  AlignedBuffer tail;           // the last block, when its length is not 4 KiB aligned
  bool use_tail = false;
  std::vector<uint32_t> crcs;  // write: computed; read: expected
  // Guarded by SwapSpace::dispatch_mu_.
  uint64_t remaining = 0;
  Status status;
  bool finished = false;

  size_t DirOf(size_t i) const { return (start_dir + i) % ndirs; }
  uint64_t OffsetOf(size_t i) const { return extents[DirOf(i)].offset + (i / ndirs) * block_size; }
  uint64_t LogicalLength(size_t i) const { return std::min(block_size, bytes - i * block_size); }
  uint64_t IoLength(size_t i) const {
    return direct ? AlignUp(LogicalLength(i), kAlign) : LogicalLength(i);
  }
  std::byte* Memory(size_t i) const {
    return use_tail && i + 1 == nblocks ? tail.data : target + i * block_size;
  }
};

}  // namespace internal

// One directory's swap file and its slots.
struct SwapSpace::Directory {
  std::string path;
  std::string private_dir;
  bool private_dir_removed = false;  // removed once the file had no name
  std::string file_name;
  bool tmpfile = false;
  bool direct = false;
  std::string no_direct_reason;
  int fd = -1;
  FileId file = -1;
  SlotAllocator slots;
  explicit Directory(uint64_t block_size) : slots(block_size) {}
};

// One handle's blocks: where they are in each directory, and their state.
struct SwapSpace::Allocation {
  uint64_t bytes = 0;
  uint64_t nblocks = 0;
  size_t start_dir = 0;
  std::vector<internal::SwapExtent> extents;  // per directory
  std::vector<uint32_t> crcs;
  bool valid = false;  // written, and the last write succeeded
  bool writing = false;
  int readers = 0;
};

}  // namespace strata::swap

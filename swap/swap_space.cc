// SwapSpace: block striping over the directories' swap files, slot allocation, CRC32C per
// block, and the completion dispatch behind SwapFuture. The files themselves are made and
// closed in swap_files.cc.
#include "strata/swap/swap_space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/config.h"
#include "strata/core/logging.h"
#include "strata/swap/crc32c.h"
#include "strata/swap/engine_internal.h"
#include "strata/swap/slot_allocator.h"
#include "strata/swap/swap_space_internal.h"

namespace strata::swap {

namespace {

// Blocks whose CRCs are computed before they are submitted together: the device starts on
// the first blocks while the CRCs of the next ones are computed.
constexpr size_t kWriteChunkBlocks = 8;

std::string Bytes(uint64_t n) {
  return std::to_string(n) + " bytes (" + FormatBytes(n) + ")";
}

std::string Hex32(uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex;
  os.width(8);
  os.fill('0');
  os << v;
  return os.str();
}

}  // namespace

namespace internal {

Status AlignedBuffer::Allocate(size_t bytes) {
  size = AlignUp(bytes, kAlign);
  data = static_cast<std::byte*>(std::aligned_alloc(kAlign, size));
  if (data == nullptr)
    return ResourceExhaustedError("swap: cannot allocate a bounce buffer of " + Bytes(size));
  return Status::Ok();
}

}  // namespace internal

using internal::kAlign;
using internal::RoundUp;
using internal::SwapExtent;
using internal::SwapOp;

// ---------------------------------------------------------------------------
// Options

SwapSpaceOptions SwapSpaceOptions::FromConfig(const AioConfig& aio, const StrataConfig& strata,
                                              const OffloadConfig& offload) {
  SwapSpaceOptions o;
  o.directories = offload.nvme_path;
  o.block_size = aio.block_size;
  o.checksums = strata.swap_checksums;
  o.io = IoEngineOptions::FromConfig(aio);
  return o;
}

std::string SwapSpaceOptions::ToString() const {
  std::ostringstream os;
  os << directories.size() << " director" << (directories.size() == 1 ? "y" : "ies") << " (";
  for (size_t i = 0; i < directories.size(); ++i)
    os << (i ? ", " : "") << directories[i];
  os << "), block " << FormatBytes(block_size) << ", checksums " << (checksums ? "on" : "off")
     << ", O_DIRECT " << (direct_io ? "where supported" : "off") << ", grow by "
     << FormatBytes(grow_bytes);
  if (max_bytes_per_directory)
    os << ", at most " << FormatBytes(max_bytes_per_directory) << " each";
  os << ", engine: " << io.ToString();
  return os.str();
}

// ---------------------------------------------------------------------------
// SwapFuture

SwapFuture::SwapFuture(SwapSpace* space, std::shared_ptr<SwapOp> op)
    : space_(space), op_(std::move(op)) {}

SwapFuture::SwapFuture(SwapFuture&& other) noexcept
    : space_(other.space_),
      op_(std::move(other.op_)),
      waited_(other.waited_),
      status_(std::move(other.status_)) {
  other.space_ = nullptr;
  other.waited_ = false;
}

SwapFuture& SwapFuture::operator=(SwapFuture&& other) noexcept {
  if (this != &other) {
    Release();
    space_ = other.space_;
    op_ = std::move(other.op_);
    waited_ = other.waited_;
    status_ = std::move(other.status_);
    other.space_ = nullptr;
    other.waited_ = false;
  }
  return *this;
}

SwapFuture::~SwapFuture() {
  Release();
}

void SwapFuture::Release() {
  if (op_ && !waited_ && space_ != nullptr) {
    Status s = space_->WaitOp(op_.get());
    if (!s.ok())
      STRATA_LOG(kError) << "swap: an I/O whose future was dropped without Wait() failed: " << s;
  }
  op_.reset();
}

Status SwapFuture::Wait() {
  if (waited_) return status_;
  if (!op_ || space_ == nullptr)
    return FailedPreconditionError("SwapFuture::Wait on an empty future");
  status_ = space_->WaitOp(op_.get());
  waited_ = true;
  op_.reset();  // frees bounce buffers now
  return status_;
}

bool SwapFuture::Ready() {
  if (waited_) return true;
  if (!op_ || space_ == nullptr) return true;
  return space_->PollOp(op_.get());
}

// ---------------------------------------------------------------------------
// Allocation

Status SwapSpace::GrowDirectory(Directory& d, uint64_t needed) {
  const uint64_t bs = options_.block_size;
  const uint64_t cap = d.slots.capacity();
  const uint64_t tail = d.slots.tail_free();
  const uint64_t need = RoundUp(needed, bs) - std::min(tail, RoundUp(needed, bs));
  if (need == 0) return Status::Ok();
  uint64_t grow = std::max(need, RoundUp(options_.grow_bytes, bs));
  if (options_.max_bytes_per_directory > 0) {
    const uint64_t max = options_.max_bytes_per_directory;
    if (cap + need > max)
      return ResourceExhaustedError(
          "swap directory " + d.path + ": " + Bytes(need) +
          " more are needed, but max_bytes_per_directory caps the swap file at " + Bytes(max) +
          " (now " + Bytes(cap) + "); raise the cap or add swap directories");
    grow = std::min(grow, max - cap);
  }
  struct statvfs vfs;
  if (fstatvfs(d.fd, &vfs) != 0) return ErrnoError(errno, "statvfs of swap directory " + d.path);
  const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (need > avail)
    return ResourceExhaustedError("swap directory " + d.path + ": not enough free disk space: " +
                                  Bytes(need) + " more are needed, only " + Bytes(avail) +
                                  " available; free space or add swap directories on other drives");
  if (grow > avail) grow = need;
  if (fallocate(d.fd, 0, static_cast<off_t>(cap), static_cast<off_t>(grow)) != 0) {
    const int err = errno;
    if (err == EOPNOTSUPP || err == ENOSYS)
      return Status(StatusCode::kUnimplemented,
                    "swap directory " + d.path +
                        ": the filesystem does not support fallocate, which swap files need to "
                        "be preallocated; use a directory on ext4, xfs or btrfs",
                    err);
    if (err == ENOSPC || err == EDQUOT)
      return Status(StatusCode::kResourceExhausted,
                    "swap directory " + d.path + ": the disk is full: preallocating " +
                        Bytes(grow) + " at offset " + std::to_string(cap) + " of " + d.file_name +
                        " failed (" + std::strerror(err) + "; statvfs said " + Bytes(avail) +
                        " available)",
                    err);
    return ErrnoError(err, "swap directory " + d.path + ": fallocate of " + Bytes(grow));
  }
  d.slots.Grow(cap + grow);
  return Status::Ok();
}

Result<SwapHandle> SwapSpace::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("swap space: cannot allocate a tensor of 0 bytes");
  const uint64_t bs = options_.block_size;
  if (bytes > (uint64_t{1} << 60))
    return InvalidArgumentError("swap space: tensor size " + std::to_string(bytes) +
                                " is beyond any disk");
  const uint64_t nblocks = (bytes + bs - 1) / bs;
  const size_t ndirs = dirs_.size();
  auto a = std::make_unique<Allocation>();
  a->bytes = bytes;
  a->nblocks = nblocks;
  a->extents.resize(ndirs);
  std::unique_lock lock(alloc_mu_);
  a->start_dir = next_start_dir_;
  for (size_t d = 0; d < ndirs; ++d) {
    const size_t k = (d + ndirs - a->start_dir) % ndirs;  // first block index in dir d
    a->extents[d].blocks = nblocks / ndirs + (k < nblocks % ndirs ? 1 : 0);
  }
  auto rollback = [&](size_t upto) {
    for (size_t d = 0; d < upto; ++d)
      if (a->extents[d].blocks > 0)
        STRATA_CHECK_OK(dirs_[d]->slots.Free(a->extents[d].offset, a->extents[d].blocks * bs));
  };
  for (size_t d = 0; d < ndirs; ++d) {
    const uint64_t n = a->extents[d].blocks * bs;
    if (n == 0) continue;
    std::optional<uint64_t> off = dirs_[d]->slots.Reserve(n);
    if (!off) {
      Status s = GrowDirectory(*dirs_[d], n);
      if (!s.ok()) {
        rollback(d);
        return s.WithContext("allocating a swap tensor of " + Bytes(bytes));
      }
      off = dirs_[d]->slots.Reserve(n);
      STRATA_CHECK(off.has_value()) << "no room after growing " << dirs_[d]->path;
    }
    a->extents[d].offset = *off;
  }
  next_start_dir_ = (a->start_dir + nblocks) % ndirs;
  const uint64_t id = next_handle_++;
  allocations_.emplace(id, std::move(a));
  return SwapHandle{id};
}

Status SwapSpace::Free(SwapHandle handle) {
  std::unique_lock lock(alloc_mu_);
  auto it = allocations_.find(handle.id);
  if (it == allocations_.end())
    return NotFoundError("swap space: unknown tensor #" + std::to_string(handle.id) +
                         " (freed already, or from another swap space)");
  Allocation& a = *it->second;
  if (a.writing || a.readers > 0)
    return FailedPreconditionError("swap space: tensor #" + std::to_string(handle.id) +
                                   " has I/O in flight; Wait() for it before Free");
  for (size_t d = 0; d < dirs_.size(); ++d)
    if (a.extents[d].blocks > 0)
      STRATA_RETURN_IF_ERROR(
          dirs_[d]->slots.Free(a.extents[d].offset, a.extents[d].blocks * options_.block_size));
  allocations_.erase(it);
  return Status::Ok();
}

Result<uint64_t> SwapSpace::Size(SwapHandle handle) const {
  std::shared_lock lock(alloc_mu_);
  auto it = allocations_.find(handle.id);
  if (it == allocations_.end())
    return NotFoundError("swap space: unknown tensor #" + std::to_string(handle.id));
  return it->second->bytes;
}

Result<std::vector<SwapBlockLocation>> SwapSpace::Locate(SwapHandle handle) const {
  std::shared_lock lock(alloc_mu_);
  auto it = allocations_.find(handle.id);
  if (it == allocations_.end())
    return NotFoundError("swap space: unknown tensor #" + std::to_string(handle.id));
  const Allocation& a = *it->second;
  const uint64_t bs = options_.block_size;
  const size_t nd = dirs_.size();
  std::vector<SwapBlockLocation> out;
  out.reserve(a.nblocks);
  for (size_t i = 0; i < a.nblocks; ++i) {
    const size_t d = (a.start_dir + i) % nd;
    out.push_back({i, d, a.extents[d].offset + (i / nd) * bs, std::min(bs, a.bytes - i * bs)});
  }
  return out;
}

std::vector<SwapDirectoryInfo> SwapSpace::directories() const {
  std::shared_lock lock(alloc_mu_);
  std::vector<SwapDirectoryInfo> out;
  for (const auto& d : dirs_) {
    out.push_back({d->path, d->private_dir, d->file_name, d->tmpfile, d->direct, d->fd,
                   d->slots.capacity(), d->slots.used_bytes()});
  }
  return out;
}

SwapSpaceStats SwapSpace::stats() const {
  SwapSpaceStats s;
  {
    std::shared_lock lock(alloc_mu_);
    s.tensors = allocations_.size();
    for (const auto& [id, a] : allocations_)
      s.bytes_allocated += a->bytes;
    for (const auto& d : dirs_)
      s.capacity += d->slots.capacity();
  }
  s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.blocks_verified = blocks_verified_.load(std::memory_order_relaxed);
  s.crc_mismatches = crc_mismatches_.load(std::memory_order_relaxed);
  s.bounced_bytes = bounced_bytes_.load(std::memory_order_relaxed);
  return s;
}

// ---------------------------------------------------------------------------
// I/O

Status SwapSpace::SubmitBlocks(const std::shared_ptr<SwapOp>& op, size_t first, size_t count) {
  std::vector<IoRequest> reqs;
  reqs.reserve(count);
  for (size_t i = first; i < first + count; ++i) {
    reqs.push_back({op->op, dirs_[op->DirOf(i)]->file, op->OffsetOf(i), op->IoLength(i),
                    op->Memory(i), op->id});
  }
  return engine_->Submit(reqs);
}

void SwapSpace::AbandonBlocks(SwapOp& op, size_t count, Status status) {
  {
    std::lock_guard lock(dispatch_mu_);
    if (op.status.ok()) op.status = std::move(status);
    op.remaining -= count;
    if (op.remaining == 0) FinishOp(op);
  }
  dispatch_cv_.notify_all();
}

Result<SwapFuture> SwapSpace::WriteAsync(SwapHandle handle, std::span<const std::byte> data) {
  return WriteAsync(handle, data, {});
}

Result<SwapFuture> SwapSpace::WriteAsync(SwapHandle handle, std::span<const std::byte> data,
                                         std::span<const uint32_t> block_crcs) {
  const bool given = !block_crcs.empty();
  if (given && !options_.checksums) {
    return InvalidArgumentError("swap write of tensor #" + std::to_string(handle.id) +
                                ": block CRCs given but this swap space keeps no checksums "
                                "(strata.swap_checksums is off); write without them");
  }
  if (given && block_crcs.size() != NumBlocks(data.size())) {
    return InvalidArgumentError(
        "swap write of tensor #" + std::to_string(handle.id) + ": " +
        std::to_string(block_crcs.size()) + " block CRCs for " + std::to_string(data.size()) +
        " bytes in blocks of " + std::to_string(options_.block_size) + " bytes; expected " +
        std::to_string(NumBlocks(data.size())) + " (one per block, the last what is left)");
  }
  auto op = std::make_shared<SwapOp>();
  {
    std::unique_lock lock(alloc_mu_);
    auto it = allocations_.find(handle.id);
    if (it == allocations_.end())
      return NotFoundError("swap write: unknown tensor #" + std::to_string(handle.id) +
                           " (freed already, or from another swap space)");
    Allocation& a = *it->second;
    if (data.size() != a.bytes)
      return InvalidArgumentError("swap write: a buffer of " + std::to_string(data.size()) +
                                  " bytes for tensor #" + std::to_string(handle.id) + " of " +
                                  std::to_string(a.bytes) + " bytes; pass exactly the tensor");
    if (a.writing || a.readers > 0)
      return FailedPreconditionError("swap write: tensor #" + std::to_string(handle.id) +
                                     " has I/O in flight; Wait() for it first");
    a.writing = true;
    a.valid = false;
    op->extents = a.extents;
    op->nblocks = a.nblocks;
    op->start_dir = a.start_dir;
    op->bytes = a.bytes;
  }
  op->id = next_op_.fetch_add(1, std::memory_order_relaxed);
  op->op = IoOp::kWrite;
  op->handle = handle.id;
  op->block_size = options_.block_size;
  op->ndirs = dirs_.size();
  op->direct = direct_io_;
  op->checksums = options_.checksums;
  op->user = const_cast<std::byte*>(data.data());
  op->target = op->user;
  op->remaining = op->nblocks;
  auto fail_all = [&](Status s) -> Status {
    {
      std::lock_guard lock(ops_mu_);
      ops_.emplace(op->id, op);
    }
    AbandonBlocks(*op, op->nblocks, s);
    return s;
  };
  if (op->direct) {
    const size_t last = op->nblocks - 1;
    if (!IsAligned(reinterpret_cast<uintptr_t>(op->user), kAlign)) {
      Status s = op->bounce.Allocate(op->bytes);
      if (!s.ok()) return fail_all(s);
      std::memcpy(op->bounce.data, op->user, op->bytes);
      std::memset(op->bounce.data + op->bytes, 0, op->bounce.size - op->bytes);
      op->target = op->bounce.data;
      bounced_bytes_.fetch_add(op->bytes, std::memory_order_relaxed);
    } else if (op->IoLength(last) != op->LogicalLength(last)) {
      Status s = op->tail.Allocate(op->LogicalLength(last));
      if (!s.ok()) return fail_all(s);
      std::memcpy(op->tail.data, op->user + last * op->block_size, op->LogicalLength(last));
      std::memset(op->tail.data + op->LogicalLength(last), 0,
                  op->tail.size - op->LogicalLength(last));
      op->use_tail = true;
      bounced_bytes_.fetch_add(op->LogicalLength(last), std::memory_order_relaxed);
    }
  }
  if (op->checksums) {
    if (given) {
      op->crcs.assign(block_crcs.begin(), block_crcs.end());
    } else {
      op->crcs.resize(op->nblocks);
    }
  }
  {
    std::lock_guard lock(ops_mu_);
    ops_.emplace(op->id, op);
  }
  for (size_t first = 0; first < op->nblocks; first += kWriteChunkBlocks) {
    const size_t count = std::min<size_t>(kWriteChunkBlocks, op->nblocks - first);
    if (op->checksums && !given)
      for (size_t i = first; i < first + count; ++i)
        op->crcs[i] = Crc32c({op->Memory(i), op->LogicalLength(i)});
    Status s = SubmitBlocks(op, first, count);
    if (!s.ok()) {
      s = std::move(s).WithContext("swap write of tensor #" + std::to_string(handle.id));
      AbandonBlocks(*op, op->nblocks - first, s);
      if (first == 0) return s;  // nothing is in flight
      break;
    }
  }
  return SwapFuture(this, op);
}

Result<SwapFuture> SwapSpace::ReadAsync(SwapHandle handle, std::span<std::byte> out) {
  auto op = std::make_shared<SwapOp>();
  {
    std::unique_lock lock(alloc_mu_);
    auto it = allocations_.find(handle.id);
    if (it == allocations_.end())
      return NotFoundError("swap read: unknown tensor #" + std::to_string(handle.id) +
                           " (freed already, or from another swap space)");
    Allocation& a = *it->second;
    if (out.size() != a.bytes)
      return InvalidArgumentError("swap read: a buffer of " + std::to_string(out.size()) +
                                  " bytes for tensor #" + std::to_string(handle.id) + " of " +
                                  std::to_string(a.bytes) + " bytes; pass exactly the tensor");
    if (a.writing)
      return FailedPreconditionError("swap read: tensor #" + std::to_string(handle.id) +
                                     " is being written; Wait() for the write first");
    if (!a.valid)
      return FailedPreconditionError("swap read: tensor #" + std::to_string(handle.id) +
                                     " has not been written, or its last write failed; there is "
                                     "nothing valid to read");
    a.readers++;
    op->extents = a.extents;
    op->nblocks = a.nblocks;
    op->start_dir = a.start_dir;
    op->bytes = a.bytes;
    if (options_.checksums) op->crcs = a.crcs;
  }
  op->id = next_op_.fetch_add(1, std::memory_order_relaxed);
  op->op = IoOp::kRead;
  op->handle = handle.id;
  op->block_size = options_.block_size;
  op->ndirs = dirs_.size();
  op->direct = direct_io_;
  op->checksums = options_.checksums;
  op->user = out.data();
  op->target = op->user;
  op->remaining = op->nblocks;
  {
    std::lock_guard lock(ops_mu_);
    ops_.emplace(op->id, op);
  }
  if (op->direct) {
    const size_t last = op->nblocks - 1;
    Status s;
    if (!IsAligned(reinterpret_cast<uintptr_t>(op->user), kAlign)) {
      s = op->bounce.Allocate(op->bytes);
      op->target = op->bounce.data;
    } else if (op->IoLength(last) != op->LogicalLength(last)) {
      s = op->tail.Allocate(op->LogicalLength(last));
      op->use_tail = true;
    }
    if (!s.ok()) {
      AbandonBlocks(*op, op->nblocks, s);
      return s;
    }
  }
  Status s = SubmitBlocks(op, 0, op->nblocks);
  if (!s.ok()) {
    s = std::move(s).WithContext("swap read of tensor #" + std::to_string(handle.id));
    AbandonBlocks(*op, op->nblocks, s);
    return s;
  }
  return SwapFuture(this, op);
}

Status SwapSpace::Write(SwapHandle handle, std::span<const std::byte> data) {
  STRATA_ASSIGN_OR_RETURN(SwapFuture f, WriteAsync(handle, data));
  return f.Wait();
}

Status SwapSpace::Read(SwapHandle handle, std::span<std::byte> out) {
  STRATA_ASSIGN_OR_RETURN(SwapFuture f, ReadAsync(handle, out));
  return f.Wait();
}

// ---------------------------------------------------------------------------
// Completion dispatch: whoever waits takes the reaper role (one thread at a time), takes
// completions from the engine, checks them outside the lock, then accounts for them.

Status SwapSpace::WaitOp(SwapOp* op) {
  std::unique_lock lk(dispatch_mu_);
  while (op->remaining > 0) {
    if (reaping_) {
      dispatch_cv_.wait(lk);
      continue;
    }
    reaping_ = true;
    lk.unlock();
    ReapOnce(op);
    lk.lock();
  }
  return op->status;
}

bool SwapSpace::PollOp(SwapOp* op) {
  std::unique_lock lk(dispatch_mu_);
  if (op->remaining == 0) return true;
  if (reaping_) return false;
  reaping_ = true;
  lk.unlock();
  ReapOnce(nullptr);
  lk.lock();
  return op->remaining == 0;
}

void SwapSpace::ReapOnce(SwapOp* waiting) {
  reap_batch_.clear();
  if (waiting != nullptr) {
    Result<IoCompletion> c = engine_->WaitOne();
    if (!c.ok()) {
      // The engine has nothing in flight (WaitOne without a timeout fails only so), yet
      // `waiting` still waits: a completion of it was lost. None of its transfers is in the
      // kernel, so it can end, with the reason; the space stays usable.
      Status why;
      {
        std::lock_guard lock(ops_mu_);
        why = std::exchange(anomaly_, Status());  // reported once
      }
      why = InternalError("swap: waiting for I/O that the engine does not have (" +
                          c.status().message() + "): a completion of this transfer was lost" +
                          (why.ok() ? std::string() : "; earlier: " + why.message()));
      STRATA_LOG(kError) << why.message();
      {
        std::lock_guard lock(dispatch_mu_);
        if (waiting->remaining > 0) {
          if (waiting->status.ok()) waiting->status = why;
          waiting->remaining = 0;
          FinishOp(*waiting);
        }
        reaping_ = false;
      }
      dispatch_cv_.notify_all();
      return;
    }
    reap_batch_.push_back(std::move(c).value());
  }
  engine_->Poll(&reap_batch_);
  std::vector<std::shared_ptr<SwapOp>> ops;
  ops.reserve(reap_batch_.size());
  {
    std::lock_guard lock(ops_mu_);
    size_t kept = 0;
    for (IoCompletion& c : reap_batch_) {
      auto it = ops_.find(c.tag);
      if (it == ops_.end()) {
        // Not an abort: the transfer it belonged to (if any) fails when its waiter finds the
        // engine empty, naming this.
        Status unknown = InternalError("swap: a completion for unknown operation " +
                                       std::to_string(c.tag) + " (file " + std::to_string(c.file) +
                                       ", offset " + std::to_string(c.offset) + "); skipped");
        STRATA_LOG(kError) << unknown.message();
        if (anomaly_.ok()) anomaly_ = std::move(unknown);
        continue;
      }
      ops.push_back(it->second);
      reap_batch_[kept++] = std::move(c);
    }
    reap_batch_.resize(kept);
  }
  reap_status_.clear();
  for (size_t k = 0; k < reap_batch_.size(); ++k)
    reap_status_.push_back(ProcessCompletion(*ops[k], reap_batch_[k]));
  {
    std::lock_guard lock(dispatch_mu_);
    for (size_t k = 0; k < ops.size(); ++k) {
      SwapOp& op = *ops[k];
      if (op.remaining == 0) continue;  // ended already (its waiter found a completion lost)
      if (!reap_status_[k].ok() && op.status.ok()) op.status = std::move(reap_status_[k]);
      if (--op.remaining == 0) FinishOp(op);
    }
    reaping_ = false;
  }
  dispatch_cv_.notify_all();
}

Status SwapSpace::ProcessCompletion(SwapOp& op, const IoCompletion& c) {
  if (c.file < 0 || static_cast<size_t>(c.file) >= dir_of_file_.size()) {
    return InternalError("swap: a completion of swap tensor #" + std::to_string(op.handle) +
                         " names file " + std::to_string(c.file) + ", not one of this space's");
  }
  const size_t d = dir_of_file_[c.file];
  const uint64_t j = (c.offset - op.extents[d].offset) / op.block_size;
  const size_t i = j * op.ndirs + (d + op.ndirs - op.start_dir) % op.ndirs;
  if (c.offset < op.extents[d].offset || i >= op.nblocks || op.OffsetOf(i) != c.offset) {
    return InternalError("swap: a completion of swap tensor #" + std::to_string(op.handle) +
                         " at offset " + std::to_string(c.offset) + " of " + dirs_[d]->file_name +
                         " maps to none of its blocks");
  }
  const std::string what = std::string(op.op == IoOp::kRead ? "reading" : "writing") + " block " +
                           std::to_string(i) + " of swap tensor #" + std::to_string(op.handle);
  if (!c.status.ok()) return c.status.WithContext(what);
  if (op.op == IoOp::kWrite) return Status::Ok();
  const uint64_t len = op.LogicalLength(i);
  std::byte* mem = op.Memory(i);
  if (op.checksums) {
    const uint32_t got = Crc32c({mem, len});
    blocks_verified_.fetch_add(1, std::memory_order_relaxed);
    if (got != op.crcs[i]) {
      crc_mismatches_.fetch_add(1, std::memory_order_relaxed);
      return DataLossError(what + ": CRC32C mismatch in " + dirs_[d]->file_name + " at offset " +
                           std::to_string(c.offset) + ", length " + std::to_string(len) +
                           ": stored " + Hex32(op.crcs[i]) + ", read " + Hex32(got) +
                           "; the bytes on disk are corrupt");
    }
  }
  if (mem != op.user + i * op.block_size) {
    std::memcpy(op.user + i * op.block_size, mem, len);
    bounced_bytes_.fetch_add(len, std::memory_order_relaxed);
  }
  return Status::Ok();
}

void SwapSpace::FinishOp(SwapOp& op) {
  op.finished = true;
  {
    std::unique_lock lock(alloc_mu_);
    auto it = allocations_.find(op.handle);
    STRATA_CHECK(it != allocations_.end()) << "swap: tensor #" << op.handle << " freed under I/O";
    Allocation& a = *it->second;
    if (op.op == IoOp::kWrite) {
      a.writing = false;
      if (op.status.ok()) {
        a.crcs = std::move(op.crcs);
        a.valid = true;
        bytes_written_.fetch_add(op.bytes, std::memory_order_relaxed);
      }
    } else {
      a.readers--;
      if (op.status.ok()) bytes_read_.fetch_add(op.bytes, std::memory_order_relaxed);
    }
  }
  std::lock_guard lock(ops_mu_);
  ops_.erase(op.id);
}

}  // namespace strata::swap

// IoEngine: names, options, the shared engine bookkeeping (EngineBase), CreateIoEngine.
#include "strata/swap/io_engine.h"

#include <fcntl.h>
#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/config.h"
#include "strata/core/logging.h"
#include "strata/swap/engine_internal.h"

namespace strata::swap {

std::string_view IoOpName(IoOp op) {
  return op == IoOp::kRead ? "read" : "write";
}

std::string_view IoEngineKindName(IoEngineKind kind) {
  switch (kind) {
    case IoEngineKind::kAuto:
      return "auto";
    case IoEngineKind::kIoUring:
      return "io_uring";
    case IoEngineKind::kSync:
      return "sync";
  }
  return "unknown";
}

Result<IoEngineKind> ParseIoEngineKind(std::string_view name) {
  if (name == "auto") return IoEngineKind::kAuto;
  if (name == "io_uring" || name == "uring") return IoEngineKind::kIoUring;
  if (name == "sync" || name == "psync") return IoEngineKind::kSync;
  return InvalidArgumentError("unknown I/O engine '" + std::string(name) +
                              "': expected auto, io_uring or sync");
}

IoEngineOptions IoEngineOptions::FromConfig(const AioConfig& aio) {
  IoEngineOptions o;
  o.queue_depth = aio.queue_depth;
  o.threads = aio.intra_op_parallelism;
  o.single_submit = aio.single_submit;
  o.overlap_events = aio.overlap_events;
  return o;
}

std::string IoEngineOptions::ToString() const {
  std::ostringstream os;
  os << IoEngineKindName(kind) << ", queue depth " << queue_depth << ", " << threads
     << (kind == IoEngineKind::kSync ? " thread(s)" : " ring(s)/thread(s)") << ", sqpoll "
     << (sqpoll ? "on" : "off") << ", fixed buffers " << (fixed_buffers ? "on" : "off")
     << ", fixed files " << (fixed_files ? "on" : "off");
  if (single_submit) os << ", single submit";
  if (!overlap_events) os << ", no overlap of events";
  if (result_hook) os << ", result hook set";
  if (ring_hook) os << ", ring hook set";
  return os.str();
}

namespace internal {

std::string DescribeRequest(const IoRequest& req, const std::string& path) {
  std::ostringstream os;
  os << IoOpName(req.op) << " of " << (path.empty() ? "<unknown file>" : path) << " at offset "
     << req.offset << ", length " << req.length << " (tag " << req.tag << ")";
  return os.str();
}

Status ValidateIoEngineOptions(const IoEngineOptions& o) {
  if (o.queue_depth < 1 || o.queue_depth > 4096)
    return InvalidArgumentError("I/O engine queue_depth " + std::to_string(o.queue_depth) +
                                " is out of range: expected 1..4096 (aio.queue_depth)");
  if (o.threads < 1 || o.threads > 256)
    return InvalidArgumentError("I/O engine threads " + std::to_string(o.threads) +
                                " is out of range: expected 1..256 (aio.intra_op_parallelism)");
  return Status::Ok();
}

TransferAction ApplyTransferResult(const QueuedRequest& q, size_t piece_length, int64_t result,
                                   bool cancel_requested, TransferState* state, Status* status,
                                   std::atomic<uint64_t>* requeued,
                                   std::atomic<uint64_t>* short_resubmits) {
  state->attempts++;
  auto describe = [&] {
    std::string d = DescribeRequest(q.req, q.file ? q.file->path : std::string());
    if (state->done > 0) d += " after " + std::to_string(state->done) + " bytes";
    return d;
  };
  if (result == -EAGAIN || result == -EINTR) {
    if (cancel_requested) {
      *status = CancelledError(describe() + ": cancelled");
      return TransferAction::kComplete;
    }
    if (state->requeues >= kMaxRequeues) {
      *status = ErrnoError(
          static_cast<int>(-result),
          describe() + ": still failing after " + std::to_string(kMaxRequeues) + " resubmissions");
      return TransferAction::kComplete;
    }
    state->requeues++;
    requeued->fetch_add(1, std::memory_order_relaxed);
    return TransferAction::kRequeue;
  }
  if (result == -ECANCELED) {
    *status = CancelledError(describe() + ": cancelled");
    return TransferAction::kComplete;
  }
  if (result < 0) {
    *status = ErrnoError(static_cast<int>(-result), describe());
    return TransferAction::kComplete;
  }
  if (static_cast<uint64_t>(result) > piece_length) {
    *status = InternalError(describe() + ": the kernel reported " + std::to_string(result) +
                            " bytes for a transfer of " + std::to_string(piece_length));
    return TransferAction::kComplete;
  }
  if (result == 0) {
    if (q.req.op == IoOp::kRead) {
      *status = IOError(describe() + ": unexpected end of file at offset " +
                        std::to_string(q.req.offset + state->done) +
                        " (the file ends inside the requested range)");
    } else {
      *status = IOError(describe() + ": the write made no progress at offset " +
                        std::to_string(q.req.offset + state->done));
    }
    return TransferAction::kComplete;
  }
  state->done += static_cast<size_t>(result);
  if (state->done == q.req.length) {
    *status = Status::Ok();
    return TransferAction::kComplete;
  }
  if (cancel_requested) {
    *status = CancelledError(describe() + ": cancelled");
    return TransferAction::kComplete;
  }
  if (static_cast<size_t>(result) < piece_length) {
    if (q.direct && !IsAligned(state->done, IoEngine::kDirectAlignment)) {
      *status = IOError(describe() + ": a short O_DIRECT transfer left the remainder at offset " +
                        std::to_string(q.req.offset + state->done) +
                        ", which is not 4096-byte aligned (does the file end inside the range?)");
      return TransferAction::kComplete;
    }
    short_resubmits->fetch_add(1, std::memory_order_relaxed);
  }
  return TransferAction::kContinue;
}

// ---------------------------------------------------------------------------
// EngineBase

EngineBase::EngineBase(IoEngineOptions options)
    : options_(std::move(options)), fixed_used_(kMaxFixedBuffers, false) {}

EngineBase::~EngineBase() = default;

std::string EngineBase::fallback() const {
  std::lock_guard lock(fallback_mu_);
  return fallback_;
}

void EngineBase::set_fallback(std::string why) {
  std::lock_guard lock(fallback_mu_);
  fallback_ = std::move(why);
}

Result<FileId> EngineBase::RegisterFile(int fd, std::string path) {
  if (fd < 0)
    return InvalidArgumentError("RegisterFile(" + path + "): invalid file descriptor " +
                                std::to_string(fd));
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return ErrnoError(errno, "RegisterFile(" + path + "): fcntl(F_GETFL)");
  if ((flags & O_ACCMODE) != O_RDWR && (flags & O_ACCMODE) != O_RDONLY &&
      (flags & O_ACCMODE) != O_WRONLY)
    return InvalidArgumentError("RegisterFile(" + path + "): unexpected access mode");
  std::lock_guard registration(registration_mu_);
  FileId id;
  {
    std::unique_lock lock(files_mu_);
    size_t i = 0;
    while (i < files_.size() && files_[i]->in_use)
      ++i;
    if (i == files_.size()) files_.push_back(std::make_unique<FileEntry>());
    FileEntry& e = *files_[i];
    e.fd = fd;
    e.path = std::move(path);
    e.direct = (flags & O_DIRECT) != 0;
    e.in_use = true;
    id = static_cast<FileId>(i);
  }
  OnFileRegistered(id, fd);
  return id;
}

Status EngineBase::UnregisterFile(FileId file) {
  std::lock_guard registration(registration_mu_);
  {
    std::unique_lock lock(files_mu_);
    if (file < 0 || static_cast<size_t>(file) >= files_.size() || !files_[file]->in_use)
      return InvalidArgumentError("UnregisterFile: unknown file id " + std::to_string(file));
    FileEntry& e = *files_[file];
    const uint64_t busy = e.in_flight.load(std::memory_order_acquire);
    if (busy != 0)
      return FailedPreconditionError("UnregisterFile(" + e.path + "): " + std::to_string(busy) +
                                     " request(s) on it are still in flight; wait for them");
    e.in_use = false;
    e.fd = -1;
  }
  OnFileUnregistered(file);
  return Status::Ok();
}

Result<int> EngineBase::RegisterBuffer(std::span<std::byte> memory) {
  if (memory.empty() || memory.data() == nullptr)
    return InvalidArgumentError("RegisterBuffer: empty memory range");
  const uintptr_t base = reinterpret_cast<uintptr_t>(memory.data());
  std::unique_lock lock(buffers_mu_);
  for (const BufferRegion& r : buffers_) {
    if (base < r.base + r.length && r.base < base + memory.size())
      return InvalidArgumentError("RegisterBuffer: memory at " + std::to_string(base) +
                                  " overlaps buffer " + std::to_string(r.id) +
                                  " registered before; unregister it first");
  }
  BufferRegion region;
  region.base = base;
  region.length = memory.size();
  region.id = next_buffer_id_++;
  if (options_.fixed_buffers) {
    const int chunks = static_cast<int>((memory.size() + kFixedChunk - 1) / kFixedChunk);
    // First fit of `chunks` consecutive free indexes.
    int first = -1;
    for (int i = 0, run = 0; i < kMaxFixedBuffers; ++i) {
      run = fixed_used_[i] ? 0 : run + 1;
      if (run == chunks) {
        first = i - chunks + 1;
        break;
      }
    }
    if (first >= 0) {
      std::vector<std::pair<void*, size_t>> pieces;
      for (int c = 0; c < chunks; ++c) {
        const size_t off = static_cast<size_t>(c) * kFixedChunk;
        pieces.emplace_back(memory.data() + off, std::min(kFixedChunk, memory.size() - off));
      }
      if (OnBufferRegistered(first, pieces)) {
        for (int c = 0; c < chunks; ++c)
          fixed_used_[first + c] = true;
        region.first_index = first;
        region.chunks = chunks;
      }
    } else {
      STRATA_LOG(kWarn) << name() << ": all " << kMaxFixedBuffers
                        << " registered-buffer slots are taken; buffer " << region.id
                        << " is used without registration (slower)";
    }
  }
  auto pos = std::lower_bound(buffers_.begin(), buffers_.end(), base,
                              [](const BufferRegion& r, uintptr_t b) { return r.base < b; });
  buffers_.insert(pos, region);
  return region.id;
}

Status EngineBase::UnregisterBuffer(int buffer_id) {
  BufferRegion region;
  {
    std::unique_lock lock(buffers_mu_);
    auto it = std::find_if(buffers_.begin(), buffers_.end(),
                           [&](const BufferRegion& r) { return r.id == buffer_id; });
    if (it == buffers_.end())
      return InvalidArgumentError("UnregisterBuffer: unknown buffer id " +
                                  std::to_string(buffer_id));
    region = *it;
    buffers_.erase(it);
    if (region.first_index >= 0) {
      OnBufferUnregistered(region.first_index, region.chunks);
      for (int c = 0; c < region.chunks; ++c)
        fixed_used_[region.first_index + c] = false;
    }
  }
  return Status::Ok();
}

int32_t EngineBase::FindFixedBuffer(const void* buffer, size_t length) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(buffer);
  auto it = std::upper_bound(buffers_.begin(), buffers_.end(), a,
                             [](uintptr_t b, const BufferRegion& r) { return b < r.base; });
  if (it == buffers_.begin()) return -1;
  --it;
  if (it->first_index < 0 || a + length > it->base + it->length) return -1;
  const size_t chunk = (a - it->base) / kFixedChunk;
  const uintptr_t chunk_end = it->base + (chunk + 1) * kFixedChunk;
  if (a + length > chunk_end) return -1;  // spans two registered chunks
  return it->first_index + static_cast<int32_t>(chunk);
}

Status EngineBase::Submit(std::span<const IoRequest> batch) {
  if (stopped_.load(std::memory_order_acquire))
    return FailedPreconditionError(name() + ": Submit after the engine was shut down");
  if (batch.empty()) return Status::Ok();
  thread_local std::vector<QueuedRequest> queued;
  queued.clear();
  const auto now = std::chrono::steady_clock::now();
  {
    std::shared_lock files_lock(files_mu_);
    std::shared_lock buffers_lock(buffers_mu_, std::defer_lock);
    const bool lookup_fixed = options_.fixed_buffers;
    if (lookup_fixed) buffers_lock.lock();
    for (size_t i = 0; i < batch.size(); ++i) {
      const IoRequest& r = batch[i];
      auto reject = [&](const std::string& what) {
        return InvalidArgumentError(name() + ": request " + std::to_string(i) + " of a batch of " +
                                    std::to_string(batch.size()) +
                                    " rejected (nothing queued): " + what);
      };
      if (r.file < 0 || static_cast<size_t>(r.file) >= files_.size() || !files_[r.file]->in_use)
        return reject("unknown file id " + std::to_string(r.file) + " (RegisterFile it first)");
      FileEntry* f = files_[r.file].get();
      if (r.op != IoOp::kRead && r.op != IoOp::kWrite)
        return reject("invalid operation " + std::to_string(static_cast<int>(r.op)));
      if (r.buffer == nullptr) return reject(DescribeRequest(r, f->path) + ": null buffer");
      if (r.length == 0) return reject(DescribeRequest(r, f->path) + ": zero length");
      if (r.offset > (uint64_t{1} << 62))
        return reject(DescribeRequest(r, f->path) + ": offset beyond any file size");
      if (f->direct) {
        const uintptr_t addr = reinterpret_cast<uintptr_t>(r.buffer);
        constexpr size_t kA = kDirectAlignment;
        std::string bad;
        auto note = [&](const std::string& what, uint64_t value) {
          if (!bad.empty()) bad += ", ";
          bad += what + " (" + std::to_string(value % kA) + " bytes past a " + std::to_string(kA) +
                 "-byte boundary)";
        };
        if (!IsAligned(addr, kA)) {
          std::ostringstream os;
          os << "buffer address 0x" << std::hex << addr;
          note(os.str(), addr);
        }
        if (!IsAligned(r.offset, kA)) note("offset " + std::to_string(r.offset), r.offset);
        if (!IsAligned(r.length, kA)) note("length " + std::to_string(r.length), r.length);
        if (!bad.empty())
          return reject(DescribeRequest(r, f->path) +
                        ": the file is open with O_DIRECT, which needs buffer address, offset "
                        "and length aligned to " +
                        std::to_string(kA) + " bytes; misaligned: " + bad +
                        ". Use aligned buffers (HostPool) and sizes, or open the file without "
                        "O_DIRECT");
      }
      QueuedRequest q;
      q.req = r;
      q.file = f;
      q.fd = f->fd;
      q.direct = f->direct;
      q.fixed_buffer = lookup_fixed ? FindFixedBuffer(r.buffer, r.length) : -1;
      q.submitted = now;
      queued.push_back(q);
    }
    for (const QueuedRequest& q : queued)
      q.file->in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  in_flight_.fetch_add(queued.size(), std::memory_order_acq_rel);
  submitted_.fetch_add(queued.size(), std::memory_order_relaxed);
  Enqueue(queued);
  return Status::Ok();
}

IoCompletion EngineBase::MakeCompletion(const QueuedRequest& q, size_t done, Status status,
                                        std::chrono::steady_clock::time_point now) {
  IoCompletion c;
  c.tag = q.req.tag;
  c.op = q.req.op;
  c.file = q.req.file;
  c.offset = q.req.offset;
  c.length = q.req.length;
  c.bytes_done = done;
  c.latency = std::chrono::duration_cast<std::chrono::nanoseconds>(now - q.submitted);
  if (status.ok()) {
    (q.req.op == IoOp::kRead ? bytes_read_ : bytes_written_)
        .fetch_add(done, std::memory_order_relaxed);
    if (q.fixed_buffer >= 0) fixed_buffer_ops_.fetch_add(1, std::memory_order_relaxed);
  } else {
    failed_.fetch_add(1, std::memory_order_relaxed);
  }
  c.status = std::move(status);
  completed_.fetch_add(1, std::memory_order_relaxed);
  q.file->in_flight.fetch_sub(1, std::memory_order_acq_rel);
  return c;
}

void EngineBase::Deliver(std::vector<IoCompletion>* batch) {
  if (batch->empty()) return;
  const size_t n = batch->size();
  {
    std::lock_guard lock(done_mu_);
    for (IoCompletion& c : *batch)
      done_.push_back(std::move(c));
  }
  batch->clear();
  if (n == 1) {
    done_cv_.notify_one();
  } else {
    done_cv_.notify_all();
  }
}

int64_t EngineBase::CallResultHook(const QueuedRequest& q, uint64_t offset, size_t length,
                                   void* buffer, uint32_t attempt, int64_t result) const {
  if (!options_.result_hook) return result;
  IoResultEvent e{q.req, offset, length, buffer, attempt, result};
  return options_.result_hook(e);
}

Result<IoCompletion> EngineBase::WaitOne(std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock lock(done_mu_);
  const auto deadline = timeout ? std::chrono::steady_clock::now() + *timeout
                                : std::chrono::steady_clock::time_point{};
  while (done_.empty()) {
    if (in_flight_.load(std::memory_order_acquire) == 0)
      return FailedPreconditionError(name() +
                                     ": WaitOne with nothing in flight and no completion waiting");
    if (timeout) {
      if (done_cv_.wait_until(lock, deadline) == std::cv_status::timeout && done_.empty())
        return DeadlineExceededError(name() + ": no completion within " +
                                     std::to_string(timeout->count()) + " ms (" +
                                     std::to_string(in_flight()) + " request(s) in flight)");
    } else {
      done_cv_.wait(lock);
    }
  }
  IoCompletion c = done_.pop_front();
  if (in_flight_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv_.notify_all();
  return c;
}

size_t EngineBase::Poll(std::vector<IoCompletion>* out) {
  std::lock_guard lock(done_mu_);
  const size_t n = done_.size();
  while (!done_.empty())
    out->push_back(done_.pop_front());
  if (n > 0 && in_flight_.fetch_sub(n, std::memory_order_acq_rel) == n) done_cv_.notify_all();
  return n;
}

Status EngineBase::WaitAll(std::vector<IoCompletion>* out,
                           std::optional<std::chrono::milliseconds> timeout) {
  const auto deadline = timeout ? std::chrono::steady_clock::now() + *timeout
                                : std::chrono::steady_clock::time_point{};
  Status first;
  std::unique_lock lock(done_mu_);
  while (true) {
    while (!done_.empty()) {
      IoCompletion c = done_.pop_front();
      in_flight_.fetch_sub(1, std::memory_order_acq_rel);
      if (first.ok() && !c.status.ok()) first = c.status;
      if (out) out->push_back(std::move(c));
    }
    if (in_flight_.load(std::memory_order_acquire) == 0) break;
    if (timeout) {
      if (done_cv_.wait_until(lock, deadline) == std::cv_status::timeout && done_.empty()) {
        std::string m = name() + ": WaitAll: " + std::to_string(in_flight()) +
                        " request(s) still in flight after " + std::to_string(timeout->count()) +
                        " ms";
        if (!first.ok()) m += "; a completion before that failed: " + first.ToString();
        return DeadlineExceededError(std::move(m));
      }
    } else {
      done_cv_.wait(lock);
    }
  }
  done_cv_.notify_all();
  return first;
}

IoEngineStats EngineBase::stats() const {
  IoEngineStats s;
  s.submitted = submitted_.load(std::memory_order_relaxed);
  s.completed = completed_.load(std::memory_order_relaxed);
  s.failed = failed_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  s.requeued = requeued_.load(std::memory_order_relaxed);
  s.short_resubmits = short_resubmits_.load(std::memory_order_relaxed);
  s.fixed_buffer_ops = fixed_buffer_ops_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace internal

// ---------------------------------------------------------------------------

Status IoUringAvailable() {
  io_uring ring;
  const int rc = io_uring_queue_init(4, &ring, 0);
  if (rc < 0) {
    const int err = -rc;
    std::string hint;
    if (err == EPERM)
      hint = " (seccomp, or kernel.io_uring_disabled=2, or io_uring_group excludes this user)";
    if (err == ENOSYS) hint = " (the kernel is built without io_uring)";
    if (err == ENOMEM) hint = " (RLIMIT_MEMLOCK too small for the ring on this kernel)";
    return ErrnoError(err, "io_uring_setup" + hint);
  }
  io_uring_queue_exit(&ring);
  return Status::Ok();
}

Result<std::unique_ptr<IoEngine>> CreateIoEngine(const IoEngineOptions& options) {
  STRATA_RETURN_IF_ERROR(internal::ValidateIoEngineOptions(options));
  switch (options.kind) {
    case IoEngineKind::kSync:
      return internal::CreateSyncEngine(options);
    case IoEngineKind::kIoUring:
      return internal::CreateIoUringEngine(options);
    case IoEngineKind::kAuto: {
      Status avail = IoUringAvailable();
      if (avail.ok()) {
        Result<std::unique_ptr<IoEngine>> uring = internal::CreateIoUringEngine(options);
        if (uring.ok()) return uring;
        avail = uring.status();
      }
      std::string why = "io_uring unavailable: " + avail.ToString();
      STRATA_LOG(kWarn) << "I/O engine: " << why
                        << "; using the synchronous pread/pwrite engine (slower)";
      std::unique_ptr<IoEngine> sync = internal::CreateSyncEngine(options);
      static_cast<internal::EngineBase*>(sync.get())->set_fallback(std::move(why));
      return sync;
    }
  }
  return InvalidArgumentError("CreateIoEngine: unknown engine kind");
}

Status SubmitAndWait(IoEngine& engine, std::span<const IoRequest> batch,
                     std::optional<std::chrono::milliseconds> timeout) {
  STRATA_RETURN_IF_ERROR(engine.Submit(batch));
  Status s = engine.WaitAll(nullptr, timeout);
  if (s.code() == StatusCode::kDeadlineExceeded) {
    // Every request ends before we return: cancel what is left of the batch and wait
    // for it (requests the device is executing finish normally).
    for (const IoRequest& r : batch)
      engine.Cancel(r.tag);
    Status rest = engine.WaitAll(nullptr, std::nullopt);
    if (!rest.ok() && rest.code() != StatusCode::kCancelled)
      return Status(StatusCode::kDeadlineExceeded, s.message() + "; after it: " + rest.ToString());
  }
  return s;
}

}  // namespace strata::swap

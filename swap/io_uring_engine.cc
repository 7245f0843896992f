// The io_uring engine: one or more rings, each owned by one thread.
//
// Submit() puts requests on a ring's pending queue (one lock per ring per batch) and
// wakes the ring's thread through an eventfd only when that thread is blocked in the
// kernel with room for more work. The thread keeps at most queue_depth requests in the
// kernel, reaps completions in batches, requeues -EAGAIN/-EINTR, resubmits the remainder
// of short transfers, prepares all new SQEs of an iteration and submits them with one
// io_uring_enter. An IORING_OP_READ of the eventfd is always armed in the ring, so the
// thread sleeps in exactly one place (io_uring_submit_and_wait) and wakes for either a
// completion or new work.
//
// Op slots are preallocated (queue_depth per ring); user_data carries the slot index and
// a generation, so an asynchronous cancel can never hit a later request that reused the
// slot. Nothing on the per-request path allocates once the queues have grown.
//
// A ring fails (FailRing) when io_uring_enter fails with an error that is not retryable, or
// when a completion names no request of the ring. Nothing aborts: the ring's thread
// stops submitting, completes the requests the kernel never took at once (queued ones, and
// those whose SQEs the kernel had not consumed), waits up to failed_ring_drain for the
// completions of those it did take, and completes every one with the failure; later
// Submits are refused with it (FailedPrecondition). The thread then waits for shutdown.
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/swap/engine_internal.h"

#if defined(__SANITIZE_THREAD__)
#define STRATA_TSAN_RINGS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STRATA_TSAN_RINGS 1
#endif
#endif
#if defined(STRATA_TSAN_RINGS)
#include <sanitizer/tsan_interface.h>
#endif

namespace strata::swap::internal {
namespace {

// liburing maps and unmaps its rings with raw system calls, which ThreadSanitizer does not
// intercept: a ring mapped where an earlier engine's ring was (freed by another thread)
// looked like a race with that engine's finished ring thread (seen in the TSan stage:
// io_uring_prep_rw on the same SQE address from two engines' threads). The kernel's
// munmap-then-mmap orders them; these annotations tell TSan so. No-ops otherwise.
void RingMapped([[maybe_unused]] io_uring* ring) {
#if defined(STRATA_TSAN_RINGS)
  __tsan_acquire(ring->sq.sqes);
  __tsan_acquire(ring->sq.ring_ptr);
  __tsan_acquire(ring->cq.ring_ptr);
#endif
}
void RingUnmapping([[maybe_unused]] io_uring* ring) {
#if defined(STRATA_TSAN_RINGS)
  __tsan_release(ring->sq.sqes);
  __tsan_release(ring->sq.ring_ptr);
  __tsan_release(ring->cq.ring_ptr);
#endif
}

constexpr uint64_t kEventData = ~uint64_t{0};
constexpr uint64_t kCancelFlag = uint64_t{1} << 63;
constexpr unsigned kReapBatch = 64;

// One Cancel/CancelAll call as seen by one ring.
struct CancelRequest {
  bool all = false;
  uint64_t tag = 0;
  int outstanding = 0;  // async-cancel SQEs whose CQE has not been seen (ring thread)
  size_t cancelled = 0;
  bool done = false;  // guarded by Ring::mu
};

struct Op {
  QueuedRequest q;
  TransferState state;
  uint32_t generation = 0;
  uint32_t piece = 0;  // bytes of the transfer now in the kernel
  bool in_use = false;
  bool in_kernel = false;
  bool cancel_requested = false;
};

struct InKernelCancel {
  CancelRequest* request = nullptr;
  bool in_use = false;
};

struct Ring {
  int index = 0;
  io_uring ring{};
  bool ring_ok = false;
  int event_fd = -1;
  bool fixed_files = false;
  bool fixed_buffers = false;
  std::unique_ptr<std::atomic<bool>[]> file_registered;  // kMaxFixedFiles
  std::thread thread;

  std::mutex mu;  // guards pending, cancels, stop, failed, failure, CancelRequest::done
  std::condition_variable cancel_cv;
  std::condition_variable stop_cv;  // a failed ring's thread waits here for stop
  RingQueue<QueuedRequest> pending;
  std::vector<CancelRequest*> cancels;
  bool stop = false;
  bool exited = false;
  bool failed = false;  // the ring failed: new requests are refused with `failure`
  Status failure;
  // Set by the thread before it blocks with free op slots; a submitter that finds it set
  // clears it and writes the eventfd.
  std::atomic<bool> wants_wake{false};

  // Owned by the ring thread.
  std::vector<Op> ops;
  std::vector<uint32_t> free_ops;
  RingQueue<uint32_t> ready;  // op slots to (re)submit: requeues and remainders
  std::vector<QueuedRequest> taken;
  std::vector<CancelRequest*> new_cancels;
  std::vector<InKernelCancel> kernel_cancels;
  std::vector<IoCompletion> done;
  unsigned ops_in_kernel = 0;
  unsigned cancels_in_kernel = 0;
  bool event_armed = false;
  uint64_t event_value = 0;
  // Set by FailRing on the thread; the loop then drains and stops (FailAndDrain).
  bool failing = false;
  Status fail_status;
};

// What a failed ring answers a new request with.
Status Refusal(const Status& failure) {
  return FailedPreconditionError(failure.message() +
                                 " (the ring has stopped: the engine refuses new requests; "
                                 "restart the process and resume from the last checkpoint)");
}

// `s` with the request it ends named first.
Status Named(const QueuedRequest& q, const Status& s) {
  return Status(s.code(), DescribeRequest(q.req, q.file->path) + ": " + s.message());
}

void Wake(Ring& r) {
  const uint64_t one = 1;
  // A full counter (EAGAIN) still wakes the reader; nothing else can fail here.
  ssize_t n = write(r.event_fd, &one, sizeof one);
  (void)n;
}

class IoUringEngine final : public EngineBase {
 public:
  explicit IoUringEngine(const IoEngineOptions& options) : EngineBase(options) {}
  ~IoUringEngine() override;

  Status Init();

  std::string name() const override { return "io_uring"; }
  size_t Cancel(uint64_t tag) override { return DoCancel(false, tag); }
  size_t CancelAll() override { return DoCancel(true, 0); }

 protected:
  void Enqueue(std::span<QueuedRequest> requests) override;
  void OnFileRegistered(FileId id, int fd) override;
  void OnFileUnregistered(FileId id) override;
  bool OnBufferRegistered(int first_index,
                          std::span<const std::pair<void*, size_t>> chunks) override;
  void OnBufferUnregistered(int first_index, int count) override;

 private:
  size_t DoCancel(bool all, uint64_t tag);
  void Loop(Ring& r);
  void HandleCqe(Ring& r, const io_uring_cqe* cqe, std::chrono::steady_clock::time_point now);
  io_uring_sqe* GetSqe(Ring& r);
  void PrepOp(Ring& r, uint32_t idx);
  void FreeOp(Ring& r, uint32_t idx);
  void ProcessCancel(Ring& r, CancelRequest* cr, std::chrono::steady_clock::time_point now);
  void FinishCancelIfDone(Ring& r, CancelRequest* cr);
  void SubmitAndMaybeWait(Ring& r, bool wait);
  // io_uring_submit[_and_wait], or what the test hook makes it return.
  int Enter(Ring& r, bool wait);
  // Marks the ring failed (the first failure is kept); the loop drains it next.
  void FailRing(Ring& r, Status why);
  // The failed ring's requests all end with its failure (see the top of the file).
  void FailAndDrain(Ring& r);
  // A request's completion with the ring's failure (`done` bytes moved); `note` is appended.
  IoCompletion FailedCompletion(const Ring& r, const QueuedRequest& q, size_t done,
                                const std::string& note, std::chrono::steady_clock::time_point now);
  // An async-cancel SQE of the ring ended (its CQE came, or it never reached the kernel).
  void EndKernelCancel(Ring& r, InKernelCancel& kc, bool cancelled);
  // Whether the ring may take new requests now: a free slot, and with overlap_events off
  // nothing of the ring in the kernel.
  bool CanTakeNew(const Ring& r) const {
    return !r.free_ops.empty() && (options_.overlap_events || r.ops_in_kernel == 0);
  }

  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<uint64_t> next_ring_{0};
};

Status IoUringEngine::Init() {
  const int qd = options_.queue_depth;
  unsigned entries = 1;
  while (entries < static_cast<unsigned>(2 * qd + 4))
    entries <<= 1;
  for (int i = 0; i < options_.threads; ++i) {
    auto r = std::make_unique<Ring>();
    r->index = i;
    io_uring_params p{};
    if (options_.sqpoll) {
      p.flags |= IORING_SETUP_SQPOLL;
      p.sq_thread_idle = 100;  // ms of idleness before the kernel thread sleeps
    }
    p.flags |= IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN;
    int rc = io_uring_queue_init_params(entries, &r->ring, &p);
    if (rc == -EINVAL) {  // a kernel older than 5.19 does not know the last two flags
      p = io_uring_params{};
      if (options_.sqpoll) {
        p.flags |= IORING_SETUP_SQPOLL;
        p.sq_thread_idle = 100;
      }
      rc = io_uring_queue_init_params(entries, &r->ring, &p);
    }
    if (rc < 0) {
      std::string what = "io_uring_queue_init(" + std::to_string(entries) + " entries" +
                         (options_.sqpoll ? ", SQPOLL" : "") + ") for ring " + std::to_string(i);
      if (options_.sqpoll && (rc == -EPERM || rc == -EINVAL))
        what += " (the kernel refused SQPOLL; run without sqpoll)";
      return ErrnoError(-rc, what);
    }
    r->ring_ok = true;
    RingMapped(&r->ring);
    r->event_fd = eventfd(0, EFD_CLOEXEC);
    if (r->event_fd < 0) return ErrnoError(errno, "eventfd for io_uring ring");
    r->file_registered = std::make_unique<std::atomic<bool>[]>(kMaxFixedFiles);
    for (int f = 0; f < kMaxFixedFiles; ++f)
      r->file_registered[f].store(false);
    if (options_.fixed_files) {
      rc = io_uring_register_files_sparse(&r->ring, kMaxFixedFiles);
      if (rc < 0) {
        STRATA_LOG(kWarn) << "io_uring: registering a file table failed ("
                          << ErrnoError(-rc, "io_uring_register_files_sparse").message()
                          << "); using plain file descriptors";
      } else {
        r->fixed_files = true;
      }
    }
    if (options_.fixed_buffers) {
      rc = io_uring_register_buffers_sparse(&r->ring, kMaxFixedBuffers);
      if (rc < 0) {
        STRATA_LOG(kWarn) << "io_uring: registering a buffer table failed ("
                          << ErrnoError(-rc, "io_uring_register_buffers_sparse").message()
                          << "); registered buffers are used as ordinary memory";
      } else {
        r->fixed_buffers = true;
      }
    }
    r->ops.resize(qd);
    for (int k = qd - 1; k >= 0; --k)
      r->free_ops.push_back(static_cast<uint32_t>(k));
    r->kernel_cancels.resize(qd);
    r->done.reserve(kReapBatch);
    rings_.push_back(std::move(r));
  }
  for (auto& r : rings_) {
    Ring* rp = r.get();
    rp->thread = std::thread([this, rp] { Loop(*rp); });
    const std::string tname = "strata-uring" + std::to_string(rp->index);
    pthread_setname_np(rp->thread.native_handle(), tname.substr(0, 15).c_str());
  }
  return Status::Ok();
}

IoUringEngine::~IoUringEngine() {
  StopAccepting();
  bool running = false;
  for (auto& r : rings_)
    running |= r->thread.joinable();
  if (running) CancelAll();
  for (auto& r : rings_) {
    {
      std::lock_guard lock(r->mu);
      r->stop = true;
    }
    r->stop_cv.notify_all();
    if (r->event_fd >= 0) Wake(*r);
  }
  for (auto& r : rings_) {
    if (r->thread.joinable()) r->thread.join();
    if (r->ring_ok) {
      RingUnmapping(&r->ring);
      io_uring_queue_exit(&r->ring);
    }
    if (r->event_fd >= 0) close(r->event_fd);
  }
}

void IoUringEngine::Enqueue(std::span<QueuedRequest> requests) {
  const size_t n = rings_.size();
  if (n == 1) {
    Ring& r = *rings_[0];
    bool stopped;
    Status refusal;
    {
      std::lock_guard lock(r.mu);
      stopped = r.stop || r.failed;
      refusal = r.failed ? Refusal(r.failure) : CancelledError("io_uring engine shut down");
      if (!stopped)
        for (QueuedRequest& q : requests)
          r.pending.push_back(q);
    }
    if (stopped) {
      std::vector<IoCompletion> out;
      const auto now = std::chrono::steady_clock::now();
      for (QueuedRequest& q : requests)
        out.push_back(MakeCompletion(q, 0, Named(q, refusal), now));
      Deliver(&out);
      return;
    }
    if (r.wants_wake.exchange(false)) Wake(r);
    return;
  }
  // Round-robin per request across rings; one lock per ring for the batch.
  const uint64_t first = next_ring_.fetch_add(requests.size(), std::memory_order_relaxed);
  std::vector<IoCompletion> refused;
  for (size_t k = 0; k < n && k < requests.size(); ++k) {
    const size_t ring_index = (first + k) % n;
    Ring& r = *rings_[ring_index];
    bool stopped;
    Status refusal;
    {
      std::lock_guard lock(r.mu);
      stopped = r.stop || r.failed;
      refusal = r.failed ? Refusal(r.failure) : CancelledError("io_uring engine shut down");
      if (!stopped)
        for (size_t i = k; i < requests.size(); i += n)
          r.pending.push_back(requests[i]);
    }
    if (stopped) {
      const auto now = std::chrono::steady_clock::now();
      for (size_t i = k; i < requests.size(); i += n)
        refused.push_back(MakeCompletion(requests[i], 0, Named(requests[i], refusal), now));
      continue;
    }
    if (r.wants_wake.exchange(false)) Wake(r);
  }
  Deliver(&refused);
}

size_t IoUringEngine::DoCancel(bool all, uint64_t tag) {
  size_t count = 0;
  std::vector<IoCompletion> out;
  std::vector<std::unique_ptr<CancelRequest>> crs(rings_.size());
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < rings_.size(); ++i) {
    Ring& r = *rings_[i];
    std::lock_guard lock(r.mu);
    count += r.pending.RemoveIf(
        [&](const QueuedRequest& q) { return all || q.req.tag == tag; },
        [&](QueuedRequest&& q) {
          out.push_back(MakeCompletion(
              q, 0, CancelledError(DescribeRequest(q.req, q.file->path) + ": cancelled"), now));
        });
    if (!r.stop && !r.exited && !r.failed) {
      crs[i] = std::make_unique<CancelRequest>();
      crs[i]->all = all;
      crs[i]->tag = tag;
      r.cancels.push_back(crs[i].get());
    }
  }
  Deliver(&out);
  for (size_t i = 0; i < rings_.size(); ++i)
    if (crs[i]) Wake(*rings_[i]);
  for (size_t i = 0; i < rings_.size(); ++i) {
    if (!crs[i]) continue;
    Ring& r = *rings_[i];
    std::unique_lock lock(r.mu);
    r.cancel_cv.wait(lock, [&] { return crs[i]->done; });
    count += crs[i]->cancelled;
  }
  return count;
}

void IoUringEngine::OnFileRegistered(FileId id, int fd) {
  if (id >= kMaxFixedFiles) return;
  for (auto& r : rings_) {
    if (!r->fixed_files) continue;
    int f = fd;
    const int rc = io_uring_register_files_update(&r->ring, static_cast<unsigned>(id), &f, 1);
    if (rc < 0) {
      STRATA_LOG(kWarn) << "io_uring: registering file " << id << " with ring " << r->index
                        << " failed ("
                        << ErrnoError(-rc, "io_uring_register_files_update").message()
                        << "); it is used through its plain descriptor";
      r->file_registered[id].store(false, std::memory_order_release);
    } else {
      r->file_registered[id].store(true, std::memory_order_release);
    }
  }
}

void IoUringEngine::OnFileUnregistered(FileId id) {
  if (id >= kMaxFixedFiles) return;
  for (auto& r : rings_) {
    if (!r->fixed_files || !r->file_registered[id].load()) continue;
    r->file_registered[id].store(false, std::memory_order_release);
    int f = -1;
    const int rc = io_uring_register_files_update(&r->ring, static_cast<unsigned>(id), &f, 1);
    if (rc < 0)
      STRATA_LOG(kWarn) << "io_uring: unregistering file " << id << " from ring " << r->index
                        << " failed ("
                        << ErrnoError(-rc, "io_uring_register_files_update").message()
                        << "); the slot is reused on the next RegisterFile";
  }
}

bool IoUringEngine::OnBufferRegistered(int first_index,
                                       std::span<const std::pair<void*, size_t>> chunks) {
  std::vector<iovec> iovs;
  for (const auto& [p, n] : chunks)
    iovs.push_back(iovec{p, n});
  std::vector<__u64> tags(chunks.size(), 0);
  size_t ok_rings = 0;
  for (auto& r : rings_) {
    if (!r->fixed_buffers) break;
    const int rc = io_uring_register_buffers_update_tag(
        &r->ring, static_cast<unsigned>(first_index), iovs.data(), tags.data(),
        static_cast<unsigned>(iovs.size()));
    if (rc < 0) {
      STRATA_LOG(kWarn) << "io_uring: registering a buffer of " << chunks.size()
                        << " GiB-chunk(s) failed ("
                        << ErrnoError(-rc, "io_uring_register_buffers_update_tag").message()
                        << "; RLIMIT_MEMLOCK too small?); it is used without registration";
      break;
    }
    ++ok_rings;
  }
  if (ok_rings == rings_.size()) return true;
  std::vector<iovec> empty(chunks.size(), iovec{nullptr, 0});
  for (size_t i = 0; i < ok_rings; ++i)
    io_uring_register_buffers_update_tag(&rings_[i]->ring, static_cast<unsigned>(first_index),
                                         empty.data(), tags.data(),
                                         static_cast<unsigned>(empty.size()));
  return false;
}

void IoUringEngine::OnBufferUnregistered(int first_index, int count) {
  std::vector<iovec> empty(count, iovec{nullptr, 0});
  std::vector<__u64> tags(count, 0);
  for (auto& r : rings_) {
    if (!r->fixed_buffers) continue;
    const int rc = io_uring_register_buffers_update_tag(
        &r->ring, static_cast<unsigned>(first_index), empty.data(), tags.data(),
        static_cast<unsigned>(count));
    if (rc < 0)
      STRATA_LOG(kWarn) << "io_uring: unregistering buffer slots " << first_index << ".."
                        << first_index + count - 1 << " from ring " << r->index << " failed ("
                        << ErrnoError(-rc, "io_uring_register_buffers_update_tag").message() << ")";
  }
}

io_uring_sqe* IoUringEngine::GetSqe(Ring& r) {
  if (r.failing) return nullptr;  // a failed ring submits nothing more
  io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
  while (sqe == nullptr) {
    // The submission queue is full: hand what is prepared to the kernel first.
    const int rc = Enter(r, /*wait=*/false);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      FailRing(r, ErrnoError(-rc, "io_uring ring " + std::to_string(r.index) +
                                      ": io_uring_enter (submitting a full queue)"));
      return nullptr;
    }
    sqe = io_uring_get_sqe(&r.ring);
    if (sqe == nullptr) std::this_thread::yield();
  }
  return sqe;
}

int IoUringEngine::Enter(Ring& r, bool wait) {
  if (options_.ring_hook) {
    const int injected = options_.ring_hook(IoRingCall::kEnter, r.index);
    if (injected != 0) return injected;
  }
  return wait ? io_uring_submit_and_wait(&r.ring, 1) : io_uring_submit(&r.ring);
}

void IoUringEngine::FailRing(Ring& r, Status why) {
  if (r.failing) return;
  r.failing = true;
  r.fail_status = std::move(why);
  STRATA_LOG(kError) << r.fail_status << "; the ring stops: its requests fail, and so will "
                     << "every later one";
}

IoCompletion IoUringEngine::FailedCompletion(const Ring& r, const QueuedRequest& q, size_t done,
                                             const std::string& note,
                                             std::chrono::steady_clock::time_point now) {
  return MakeCompletion(
      q, done, Named(q, Status(r.fail_status.code(), r.fail_status.message() + note)), now);
}

void IoUringEngine::EndKernelCancel(Ring& r, InKernelCancel& kc, bool cancelled) {
  CancelRequest* cr = kc.request;
  kc = InKernelCancel{};
  --r.cancels_in_kernel;
  if (cancelled) cr->cancelled++;
  cr->outstanding--;
  FinishCancelIfDone(r, cr);
}

void IoUringEngine::FailAndDrain(Ring& r) {
  auto now = std::chrono::steady_clock::now();
  std::vector<CancelRequest*> queued_cancels;
  {
    std::lock_guard lock(r.mu);
    r.failed = true;
    r.failure = r.fail_status;
    while (!r.pending.empty()) {
      const QueuedRequest q = r.pending.pop_front();
      r.done.push_back(FailedCompletion(r, q, 0, " (not submitted)", now));
    }
    queued_cancels.swap(r.cancels);
  }
  for (CancelRequest* cr : queued_cancels)
    FinishCancelIfDone(r, cr);
  // SQEs the kernel never consumed (prepared, not submitted): their requests never reached it.
  const unsigned head = io_uring_smp_load_acquire(r.ring.sq.khead);
  for (unsigned pos = head; pos != r.ring.sq.sqe_tail; ++pos) {
    const uint64_t ud = r.ring.sq.sqes[pos & r.ring.sq.ring_mask].user_data;
    if (ud == kEventData) {
      r.event_armed = false;
    } else if (ud & kCancelFlag) {
      InKernelCancel& kc = r.kernel_cancels[ud & 0xffffffffu];
      if (kc.in_use && kc.request != nullptr) EndKernelCancel(r, kc, /*cancelled=*/false);
    } else {
      const uint32_t idx = static_cast<uint32_t>(ud & 0xffffffffu);
      if (idx < r.ops.size() && r.ops[idx].in_kernel) {
        r.ops[idx].in_kernel = false;
        --r.ops_in_kernel;
      }
    }
  }
  r.ring.sq.sqe_head = r.ring.sq.sqe_tail = head;  // nothing of them is ever submitted
  // Requests the ring held outside the kernel end now.
  for (uint32_t idx = 0; idx < r.ops.size(); ++idx) {
    if (r.ops[idx].in_use && !r.ops[idx].in_kernel) {
      r.done.push_back(
          FailedCompletion(r, r.ops[idx].q, r.ops[idx].state.done, " (not submitted)", now));
      FreeOp(r, idx);
    }
  }
  r.ready.RemoveIf([](uint32_t) { return true; }, [](uint32_t&&) {});
  Deliver(&r.done);
  // Those in the kernel end with their completions, within the deadline.
  const auto deadline = now + options_.failed_ring_drain;
  io_uring_cqe* cqes[kReapBatch];
  while (r.ops_in_kernel + r.cancels_in_kernel > 0 && now < deadline) {
    const unsigned n = io_uring_peek_batch_cqe(&r.ring, cqes, kReapBatch);
    if (n == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // (runs deferred task work)
      now = std::chrono::steady_clock::now();
      continue;
    }
    now = std::chrono::steady_clock::now();
    for (unsigned i = 0; i < n; ++i)
      HandleCqe(r, cqes[i], now);  // failing: each op ends with the failure
    io_uring_cq_advance(&r.ring, n);
    Deliver(&r.done);
  }
  for (uint32_t idx = 0; idx < r.ops.size(); ++idx) {
    if (!r.ops[idx].in_use) continue;
    r.done.push_back(FailedCompletion(r, r.ops[idx].q, r.ops[idx].state.done,
                                      " (no completion within " +
                                          std::to_string(options_.failed_ring_drain.count()) +
                                          " ms: the transfer may still be in the kernel)",
                                      now));
    FreeOp(r, idx);
  }
  r.ops_in_kernel = 0;
  for (InKernelCancel& kc : r.kernel_cancels) {
    if (kc.in_use && kc.request != nullptr) EndKernelCancel(r, kc, /*cancelled=*/false);
  }
  Deliver(&r.done);
}

void IoUringEngine::PrepOp(Ring& r, uint32_t idx) {
  Op& op = r.ops[idx];
  const QueuedRequest& q = op.q;
  const size_t remaining = q.req.length - op.state.done;
  op.piece = static_cast<uint32_t>(std::min(remaining, kMaxTransfer));
  char* buf = static_cast<char*>(q.req.buffer) + op.state.done;
  const uint64_t off = q.req.offset + op.state.done;
  int fd = q.fd;
  const bool fixed_file = r.fixed_files && q.req.file < kMaxFixedFiles &&
                          r.file_registered[q.req.file].load(std::memory_order_acquire);
  if (fixed_file) fd = q.req.file;
  io_uring_sqe* sqe = GetSqe(r);
  if (sqe == nullptr) return;  // the ring failed: the op ends in FailAndDrain
  if (q.fixed_buffer >= 0 && r.fixed_buffers) {
    if (q.req.op == IoOp::kRead) {
      io_uring_prep_read_fixed(sqe, fd, buf, op.piece, off, q.fixed_buffer);
    } else {
      io_uring_prep_write_fixed(sqe, fd, buf, op.piece, off, q.fixed_buffer);
    }
  } else if (q.req.op == IoOp::kRead) {
    io_uring_prep_read(sqe, fd, buf, op.piece, off);
  } else {
    io_uring_prep_write(sqe, fd, buf, op.piece, off);
  }
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(op.generation & 0x7fffffffu) << 32) | idx);
  op.in_kernel = true;
  ++r.ops_in_kernel;
  if (options_.single_submit) SubmitAndMaybeWait(r, /*wait=*/false);
}

void IoUringEngine::FreeOp(Ring& r, uint32_t idx) {
  Op& op = r.ops[idx];
  op.in_use = false;
  op.in_kernel = false;
  op.cancel_requested = false;
  op.generation++;
  r.free_ops.push_back(idx);
}

void IoUringEngine::FinishCancelIfDone(Ring& r, CancelRequest* cr) {
  if (cr->outstanding > 0) return;
  {
    std::lock_guard lock(r.mu);
    cr->done = true;
  }
  r.cancel_cv.notify_all();
}

void IoUringEngine::ProcessCancel(Ring& r, CancelRequest* cr,
                                  std::chrono::steady_clock::time_point now) {
  for (uint32_t idx = 0; idx < r.ops.size(); ++idx) {
    Op& op = r.ops[idx];
    if (!op.in_use || (!cr->all && op.q.req.tag != cr->tag)) continue;
    if (!op.in_kernel) {
      // Waiting in the ready queue for a requeue or its remainder: it ends here; the
      // ready queue skips slots that are no longer in use.
      r.done.push_back(MakeCompletion(
          op.q, op.state.done,
          CancelledError(DescribeRequest(op.q.req, op.q.file->path) + ": cancelled after " +
                         std::to_string(op.state.done) + " bytes"),
          now));
      FreeOp(r, idx);
      cr->cancelled++;
      continue;
    }
    if (op.cancel_requested) continue;
    io_uring_sqe* sqe = GetSqe(r);
    if (sqe == nullptr) break;  // the ring failed: FailAndDrain ends its ops
    size_t slot = 0;
    while (slot < r.kernel_cancels.size() && r.kernel_cancels[slot].in_use)
      ++slot;
    if (slot == r.kernel_cancels.size()) r.kernel_cancels.emplace_back();
    r.kernel_cancels[slot] = InKernelCancel{cr, true};
    op.cancel_requested = true;
    const uint64_t target = (static_cast<uint64_t>(op.generation & 0x7fffffffu) << 32) | idx;
    io_uring_prep_cancel64(sqe, target, 0);
    io_uring_sqe_set_data64(sqe, kCancelFlag | slot);
    cr->outstanding++;
    ++r.cancels_in_kernel;
  }
  FinishCancelIfDone(r, cr);
}

void IoUringEngine::HandleCqe(Ring& r, const io_uring_cqe* cqe,
                              std::chrono::steady_clock::time_point now) {
  const uint64_t ud = io_uring_cqe_get_data64(cqe);
  const int res = cqe->res;
  if (ud == kEventData) {
    r.event_armed = false;
    if (res < 0 && res != -ECANCELED && res != -EINTR && res != -EAGAIN)
      STRATA_LOG(kError) << "io_uring ring " << r.index << ": reading its wake-up eventfd failed ("
                         << ErrnoError(-res, "read").message() << "); re-arming";
    return;
  }
  if (ud & kCancelFlag) {
    // 0: the target was cancelled and completes with -ECANCELED. -EALREADY (running) or
    // -ENOENT (already done): it completes normally.
    EndKernelCancel(r, r.kernel_cancels[ud & 0xffffffffu], /*cancelled=*/res == 0);
    return;
  }
  const uint32_t idx = static_cast<uint32_t>(ud & 0xffffffffu);
  const uint32_t generation = static_cast<uint32_t>(ud >> 32);
  const bool known = idx < r.ops.size() && r.ops[idx].in_use && r.ops[idx].in_kernel &&
                     generation == (r.ops[idx].generation & 0x7fffffffu);
  if (!known || (options_.ring_hook && options_.ring_hook(IoRingCall::kCompletion, r.index))) {
    // Our books and the kernel's disagree: nothing this ring tracks can be trusted.
    if (!r.failing) {
      FailRing(r, InternalError("io_uring ring " + std::to_string(r.index) +
                                ": a completion for no request of the ring (op slot " +
                                std::to_string(idx) + ", generation " + std::to_string(generation) +
                                ", result " + std::to_string(res) + ")"));
    }
    return;
  }
  Op& op = r.ops[idx];
  op.in_kernel = false;
  --r.ops_in_kernel;
  if (r.failing) {  // FailAndDrain: every request of a failed ring ends with the failure
    r.done.push_back(FailedCompletion(r, op.q, op.state.done, "", now));
    FreeOp(r, idx);
    return;
  }
  const int64_t result =
      CallResultHook(op.q, op.q.req.offset + op.state.done, op.piece,
                     static_cast<char*>(op.q.req.buffer) + op.state.done, op.state.attempts, res);
  if (options_.result_hook) now = std::chrono::steady_clock::now();  // the hook may sleep
  Status status;
  const TransferAction action =
      ApplyTransferResult(op.q, op.piece, result, /*cancel_requested=*/false, &op.state, &status,
                          &requeued_, &short_resubmits_);
  if (action == TransferAction::kComplete) {
    r.done.push_back(MakeCompletion(op.q, op.state.done, std::move(status), now));
    FreeOp(r, idx);
  } else {
    r.ready.push_back(idx);
  }
}

void IoUringEngine::SubmitAndMaybeWait(Ring& r, bool wait) {
  while (true) {
    const int rc = Enter(r, wait);
    if (rc >= 0 || rc == -ETIME) return;
    if (rc == -EINTR) continue;
    if (rc == -EAGAIN || rc == -EBUSY || rc == -ENOMEM) {
      // Out of kernel resources or the completion queue is full: let completions drain.
      if (r.ops_in_kernel + r.cancels_in_kernel > 0) {
        io_uring_cqe* cqe = nullptr;
        const int w = io_uring_wait_cqe(&r.ring, &cqe);
        if (w < 0 && w != -EINTR && w != -EAGAIN && w != -ETIME) {
          FailRing(r, ErrnoError(-w, "io_uring ring " + std::to_string(r.index) +
                                         ": io_uring_wait_cqe (waiting for room)"));
        }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return;
    }
    FailRing(r, ErrnoError(-rc, "io_uring ring " + std::to_string(r.index) + ": io_uring_enter"));
    return;
  }
}

void IoUringEngine::Loop(Ring& r) {
  io_uring_cqe* cqes[kReapBatch];
  bool stopping = false;
  while (true) {
    // 1. Reap everything the kernel has finished.
    auto now = std::chrono::steady_clock::now();
    unsigned n;
    while ((n = io_uring_peek_batch_cqe(&r.ring, cqes, kReapBatch)) > 0) {
      for (unsigned i = 0; i < n; ++i)
        HandleCqe(r, cqes[i], now);
      io_uring_cq_advance(&r.ring, n);
    }
    if (r.failing) break;
    // 2. Take control messages and as much new work as there are free slots.
    r.taken.clear();
    r.new_cancels.clear();
    {
      std::lock_guard lock(r.mu);
      r.new_cancels.swap(r.cancels);
      if (r.stop) stopping = true;
      size_t room = CanTakeNew(r) ? r.free_ops.size() : 0;
      // Slots in the ready queue are not free; the rest can take new requests.
      while (room > 0 && !r.pending.empty()) {
        r.taken.push_back(r.pending.pop_front());
        --room;
      }
      if (stopping && r.pending.empty() && r.free_ops.size() == r.ops.size() &&
          r.ops_in_kernel == 0 && r.cancels_in_kernel == 0 && r.new_cancels.empty() &&
          r.taken.empty()) {
        r.exited = true;
      }
    }
    if (r.exited) break;
    now = std::chrono::steady_clock::now();
    for (CancelRequest* cr : r.new_cancels)
      ProcessCancel(r, cr, now);
    // 3. Prepare SQEs: requeues and remainders first, then new requests.
    size_t ready_n = r.ready.size();
    while (ready_n-- > 0) {
      const uint32_t idx = r.ready.pop_front();
      Op& op = r.ops[idx];
      if (!op.in_use) continue;  // cancelled while waiting here
      if (stopping) {
        r.done.push_back(MakeCompletion(op.q, op.state.done,
                                        CancelledError(DescribeRequest(op.q.req, op.q.file->path) +
                                                       ": cancelled (engine shut down) after " +
                                                       std::to_string(op.state.done) + " bytes"),
                                        now));
        FreeOp(r, idx);
        continue;
      }
      PrepOp(r, idx);
    }
    for (QueuedRequest& q : r.taken) {
      STRATA_CHECK(!r.free_ops.empty());
      const uint32_t idx = r.free_ops.back();
      r.free_ops.pop_back();
      Op& op = r.ops[idx];
      op.q = q;
      op.state = TransferState{};
      op.in_use = true;
      op.cancel_requested = false;
      PrepOp(r, idx);
    }
    Deliver(&r.done);
    if (!r.event_armed) {
      io_uring_sqe* sqe = GetSqe(r);
      if (sqe != nullptr) {
        io_uring_prep_read(sqe, r.event_fd, &r.event_value, sizeof r.event_value, 0);
        io_uring_sqe_set_data64(sqe, kEventData);
        r.event_armed = true;
      }
    }
    if (r.failing) break;
    // 4. Submit everything prepared with one system call and sleep until something
    //    happens. Before sleeping with free slots, ask submitters for a wake-up and look
    //    at the pending queue once more (they push, then test wants_wake).
    bool wait = true;
    if (stopping) {
      wait = r.ops_in_kernel + r.cancels_in_kernel > 0;
    } else if (CanTakeNew(r)) {
      r.wants_wake.store(true, std::memory_order_seq_cst);
      std::lock_guard lock(r.mu);
      if (!r.pending.empty() || !r.cancels.empty() || r.stop) wait = false;
    }
    SubmitAndMaybeWait(r, wait);
    r.wants_wake.store(false, std::memory_order_relaxed);
    if (r.failing) break;
  }
  if (r.failing) {
    FailAndDrain(r);
    // Nothing more to do but to wait for the engine's end (Enqueue refuses new requests,
    // DoCancel skips the ring).
    std::unique_lock lock(r.mu);
    r.stop_cv.wait(lock, [&] { return r.stop; });
    r.exited = true;
  }
  // Leaving: the eventfd read may still be armed; io_uring_queue_exit cancels it.
}

}  // namespace

Result<std::unique_ptr<IoEngine>> CreateIoUringEngine(const IoEngineOptions& options) {
  auto engine = std::make_unique<IoUringEngine>(options);
  STRATA_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace strata::swap::internal

// The synchronous engine: `threads` workers take requests from one queue and move them
// with pread/pwrite, applying the same result rules as the io_uring engine (requeue on
// EAGAIN/EINTR, continue after short transfers, EOF inside the range is an IOError).
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "strata/swap/engine_internal.h"

namespace strata::swap::internal {
namespace {

class SyncEngine final : public EngineBase {
 public:
  explicit SyncEngine(const IoEngineOptions& options) : EngineBase(options) {
    for (int i = 0; i < options_.threads; ++i) {
      threads_.emplace_back([this] { Worker(); });
      const std::string tname = "strata-pio" + std::to_string(i);
      pthread_setname_np(threads_.back().native_handle(), tname.substr(0, 15).c_str());
    }
  }

  ~SyncEngine() override {
    StopAccepting();
    CancelAll();
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_)
      t.join();
  }

  std::string name() const override { return "sync"; }

  size_t Cancel(uint64_t tag) override { return DoCancel(false, tag); }
  size_t CancelAll() override { return DoCancel(true, 0); }

 protected:
  void Enqueue(std::span<QueuedRequest> requests) override {
    {
      std::lock_guard lock(mu_);
      for (QueuedRequest& q : requests)
        pending_.push_back(q);
    }
    if (requests.size() == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
  }

 private:
  size_t DoCancel(bool all, uint64_t tag) {
    std::vector<IoCompletion> out;
    const auto now = std::chrono::steady_clock::now();
    size_t n;
    {
      std::lock_guard lock(mu_);
      n = pending_.RemoveIf(
          [&](const QueuedRequest& q) { return all || q.req.tag == tag; },
          [&](QueuedRequest&& q) {
            out.push_back(MakeCompletion(
                q, 0, CancelledError(DescribeRequest(q.req, q.file->path) + ": cancelled"), now));
          });
    }
    Deliver(&out);
    return n;
  }

  void Worker() {
    std::vector<IoCompletion> out;
    out.reserve(1);
    while (true) {
      QueuedRequest q;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stop_ and nothing left
        q = pending_.pop_front();
      }
      out.push_back(Execute(q));
      Deliver(&out);
    }
  }

  IoCompletion Execute(const QueuedRequest& q) {
    TransferState state;
    Status status;
    while (true) {
      const size_t piece = std::min(q.req.length - state.done, kMaxTransfer);
      char* buf = static_cast<char*>(q.req.buffer) + state.done;
      const uint64_t off = q.req.offset + state.done;
      const ssize_t n = q.req.op == IoOp::kRead ? pread(q.fd, buf, piece, static_cast<off_t>(off))
                                                : pwrite(q.fd, buf, piece, static_cast<off_t>(off));
      int64_t result = n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
      result = CallResultHook(q, off, piece, buf, state.attempts, result);
      const TransferAction action = ApplyTransferResult(q, piece, result, false, &state, &status,
                                                        &requeued_, &short_resubmits_);
      if (action == TransferAction::kComplete) break;
      if (action == TransferAction::kRequeue) std::this_thread::yield();
    }
    return MakeCompletion(q, state.done, std::move(status), std::chrono::steady_clock::now());
  }

  std::mutex mu_;
  std::condition_variable cv_;
  RingQueue<QueuedRequest> pending_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<IoEngine> CreateSyncEngine(const IoEngineOptions& options) {
  return std::make_unique<SyncEngine>(options);
}

}  // namespace strata::swap::internal

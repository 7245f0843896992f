// A test-only Communicator for W ranks that are threads of one process (or W = 1).
//
// Every collective runs synchronously inside the *Async call: each rank publishes its
// buffers, waits for the others at a barrier, computes its own result from everyone's
// buffers, and waits at a second barrier before returning an already completed Work. The
// ranks must issue the same sequence of collectives (as with any communicator). Reductions
// of 16-bit types are done in fp32 and rounded back, sums in rank order, kAvg divides in
// fp32: the semantics comm/communicator.h specifies.
//
// It stands in for comm's Gloo backend until that exists, so the engine's multi-rank
// logic can be tested with threads.
#pragma once

#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world_size)
      : world_size_(world_size), in_(static_cast<size_t>(world_size)) {}
  int world_size() const { return world_size_; }

  void Barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == world_size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }
  // Per-rank published pointers of the current collective.
  std::vector<std::vector<const void*>>& inputs() { return in_; }

 private:
  int world_size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<std::vector<const void*>> in_;
};

class DoneWork final : public comm::Work {
 public:
  explicit DoneWork(Status s) : status_(std::move(s)) {}
  Status Wait(std::optional<std::chrono::milliseconds> = std::nullopt) override { return status_; }
  bool IsCompleted() const override { return true; }

 private:
  Status status_;
};

class ThreadCommunicator final : public comm::Communicator {
 public:
  // `backend`: what it reports (an "nccl" one stands for a device communicator in tests
  // of which communicator carries what; it moves host memory all the same).
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank,
                     comm::Backend backend = comm::Backend::kGloo)
      : group_(std::move(group)), rank_(rank), backend_(backend) {}

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }
  comm::Backend backend() const override { return backend_; }
  const comm::CommOptions& options() const override { return options_; }
  comm::CommStats stats() const override { return stats_; }
  // Tests of the lane kinds: the stream it says it issues on (it still runs on the host).
  void* native_stream() const override { return native_stream_; }
  void set_native_stream(void* stream) { native_stream_ = stream; }

  comm::WorkPtr AllGatherAsync(const void* shard, void* full, size_t total,
                               comm::DType dtype) override {
    comm::GatherItem item{shard, full, total};
    return AllGatherCoalescedAsync({&item, 1}, dtype);
  }
  comm::WorkPtr ReduceScatterAsync(const void* full, void* shard, size_t total, comm::DType dtype,
                                   comm::ReduceOp op) override {
    comm::ScatterItem item{full, shard, total};
    return ReduceScatterCoalescedAsync({&item, 1}, dtype, op);
  }
  comm::WorkPtr AllReduceAsync(void* data, size_t count, comm::DType dtype,
                               comm::ReduceOp op) override {
    comm::ReduceItem item{data, count};
    return AllReduceCoalescedAsync({&item, 1}, dtype, op);
  }
  comm::WorkPtr BroadcastAsync(void* data, size_t count, comm::DType dtype, int root) override {
    Publish({data});
    if (rank_ != root) {
      std::memcpy(data, group_->inputs()[static_cast<size_t>(root)][0], count * Size(dtype));
    }
    Finish(count * Size(dtype));
    return Done();
  }
  comm::WorkPtr BarrierAsync() override {
    group_->Barrier();
    return Done();
  }

  comm::WorkPtr AllGatherCoalescedAsync(std::span<const comm::GatherItem> items,
                                        comm::DType dtype) override {
    std::vector<const void*> mine;
    for (const auto& it : items)
      mine.push_back(it.shard);
    Publish(mine);
    size_t bytes = 0;
    const size_t es = Size(dtype);
    for (size_t k = 0; k < items.size(); ++k) {
      for (int r = 0; r < world_size(); ++r) {
        const auto [off, cnt] = Part(items[k].total, r);
        std::byte* dst = static_cast<std::byte*>(items[k].full) + off * es;
        const void* src = group_->inputs()[static_cast<size_t>(r)][k];
        // In place (the shard already lies at its offset of `full`): nothing to copy, and
        // a copy onto itself would write bytes the other ranks are reading (TSan).
        if (dst != src && cnt > 0) std::memcpy(dst, src, cnt * es);
      }
      bytes += items[k].total * es;
    }
    Finish(bytes);
    return Done();
  }

  comm::WorkPtr ReduceScatterCoalescedAsync(std::span<const comm::ScatterItem> items,
                                            comm::DType dtype, comm::ReduceOp op) override {
    std::vector<const void*> mine;
    for (const auto& it : items)
      mine.push_back(it.full);
    Publish(mine);
    size_t bytes = 0;
    for (size_t k = 0; k < items.size(); ++k) {
      const auto [off, cnt] = Part(items[k].total, rank_);
      Reduce(k, off, cnt, items[k].shard, dtype, op);
      bytes += items[k].total * Size(dtype);
    }
    Finish(bytes);
    return Done();
  }

  comm::WorkPtr AllReduceCoalescedAsync(std::span<const comm::ReduceItem> items, comm::DType dtype,
                                        comm::ReduceOp op) override {
    // Reduce into scratch first: the inputs are the outputs.
    std::vector<const void*> mine;
    for (const auto& it : items)
      mine.push_back(it.data);
    Publish(mine);
    std::vector<std::vector<std::byte>> results(items.size());
    size_t bytes = 0;
    for (size_t k = 0; k < items.size(); ++k) {
      results[k].resize(items[k].count * Size(dtype));
      Reduce(k, 0, items[k].count, results[k].data(), dtype, op);
      bytes += results[k].size();
    }
    group_->Barrier();  // everyone has read the inputs
    for (size_t k = 0; k < items.size(); ++k) {
      if (!results[k].empty()) std::memcpy(items[k].data, results[k].data(), results[k].size());
    }
    Finish(bytes);
    return Done();
  }

  // Collectives issued so far.
  uint64_t operations() const { return stats_.operations; }

 private:
  static size_t Size(comm::DType t) {
    return t == comm::DType::kFloat32 ? 4 : t == comm::DType::kInt64 ? 8 : 2;
  }
  static DType Engine(comm::DType t) {
    return t == comm::DType::kBFloat16  ? DType::kBFloat16
           : t == comm::DType::kFloat16 ? DType::kFloat16
                                        : DType::kFloat32;
  }
  std::pair<size_t, size_t> Part(size_t total, int r) const {
    const size_t w = static_cast<size_t>(world_size());
    const size_t base = total / w, extra = total % w, ur = static_cast<size_t>(r);
    return {ur * base + std::min(ur, extra), base + (ur < extra ? 1 : 0)};
  }
  void Publish(std::vector<const void*> mine) {
    group_->inputs()[static_cast<size_t>(rank_)] = std::move(mine);
    group_->Barrier();
  }
  void Finish(size_t bytes) {
    group_->Barrier();  // nobody overwrites the published pointers before all are done
    ++stats_.operations;
    stats_.bytes_sent += bytes;
    stats_.bytes_received += bytes;
  }
  void Reduce(size_t k, size_t off, size_t cnt, void* out, comm::DType dtype, comm::ReduceOp op) {
    const DType t = Engine(dtype);
    const size_t es = Size(dtype);
    std::vector<float> acc(cnt, 0.0f), tmp(cnt);
    for (int r = 0; r < world_size(); ++r) {
      const auto* src = static_cast<const std::byte*>(group_->inputs()[static_cast<size_t>(r)][k]);
      ConvertToFloat(src + off * es, t, cnt, tmp.data());
      for (size_t i = 0; i < cnt; ++i)
        acc[i] += tmp[i];
    }
    if (op == comm::ReduceOp::kAvg) {
      for (float& x : acc)
        x /= static_cast<float>(world_size());
    }
    ConvertFromFloat(acc.data(), cnt, out, t);
  }
  static comm::WorkPtr Done() { return std::make_shared<DoneWork>(Status::Ok()); }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
  comm::CommOptions options_;
  comm::Backend backend_;
  void* native_stream_ = nullptr;
  comm::CommStats stats_;
};

}  // namespace strata::engine::testing

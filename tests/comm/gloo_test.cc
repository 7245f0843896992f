// Multi-process tests of the Gloo backend on loopback: 2 and 4 ranks, each a process this
// test forks (tests/comm/multiprocess.h). Every collective is checked against a reference
// computed in the test; values are small integers, exact in every dtype, so 16-bit results
// compare exactly.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "multiprocess.h"
#include "strata/comm/common.h"
#include "strata/comm/communicator.h"

namespace strata::comm {
namespace {

using testing::AllExitedZero;
using testing::Describe;
using testing::MakeGloo;
using testing::PortChannel;
using testing::RunProcesses;

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64};

// Rank q's value at flat index i: an integer in [-8, 8].
int64_t Value(int q, size_t i, int seed) {
  return static_cast<int64_t>(
             (i * 7 + static_cast<size_t>(q) * 13 + static_cast<size_t>(seed) * 5) % 17) -
         8;
}

// A host buffer of `dtype` elements, written and read as doubles.
class Buf {
 public:
  Buf(DType dtype, size_t n) : dtype_(dtype), n_(n), bytes_(n * DTypeSize(dtype) + 8, 0xAB) {}
  void* data() { return bytes_.data(); }
  size_t size() const { return n_; }
  void Set(size_t i, double v) {
    uint8_t* p = bytes_.data() + i * DTypeSize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::kBFloat16: {
        const uint16_t h = internal::FloatToBf16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kFloat16: {
        const uint16_t h = internal::FloatToHalf(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kInt64: {
        const int64_t x = static_cast<int64_t>(v);
        std::memcpy(p, &x, 8);
        break;
      }
    }
  }
  double Get(size_t i) const {
    const uint8_t* p = bytes_.data() + i * DTypeSize(dtype_);
    switch (dtype_) {
      case DType::kFloat32: {
        float f;
        std::memcpy(&f, p, 4);
        return f;
      }
      case DType::kBFloat16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return internal::Bf16ToFloat(h);
      }
      case DType::kFloat16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return internal::HalfToFloat(h);
      }
      case DType::kInt64: {
        int64_t x;
        std::memcpy(&x, p, 8);
        return static_cast<double>(x);
      }
    }
    return 0;
  }
  // The guard bytes after the last element are untouched.
  bool GuardIntact() const {
    for (size_t i = n_ * DTypeSize(dtype_); i < bytes_.size(); ++i) {
      if (bytes_[i] != 0xAB) return false;
    }
    return true;
  }

 private:
  DType dtype_;
  size_t n_;
  std::vector<uint8_t> bytes_;
};

// The reduction of index i over `world` ranks, as the collectives define it.
double Reduced(DType dtype, int world, size_t i, int seed, ReduceOp op) {
  int64_t sum = 0;
  for (int q = 0; q < world; ++q)
    sum += Value(q, i, seed);
  if (op == ReduceOp::kSum) return static_cast<double>(sum);
  if (dtype == DType::kInt64) return static_cast<double>(sum / world);  // toward zero
  // kAvg divides in fp32 and rounds once to the type (exact for W = 2 and 4, not for 3).
  const float avg = static_cast<float>(sum) / static_cast<float>(world);
  if (dtype == DType::kBFloat16) return internal::Bf16ToFloat(internal::FloatToBf16(avg));
  if (dtype == DType::kFloat16) return internal::HalfToFloat(internal::FloatToHalf(avg));
  return avg;
}

Status CheckAllGather(Communicator& comm, DType dtype, size_t total, int seed) {
  const int W = comm.world_size();
  const Shard mine = Partition(total, W, comm.rank());
  Buf shard(dtype, mine.count);
  for (size_t j = 0; j < mine.count; ++j)
    shard.Set(j, Value(comm.rank(), mine.offset + j, seed));
  Buf full(dtype, total);
  RK_OK(comm.AllGather(shard.data(), full.data(), total, dtype));
  for (int q = 0; q < W; ++q) {
    const Shard s = Partition(total, W, q);
    for (size_t j = 0; j < s.count; ++j) {
      const size_t i = s.offset + j;
      RK_CHECK(full.Get(i) == Value(q, i, seed), "all_gather " << DTypeName(dtype) << " total "
                                                               << total << " index " << i << ": "
                                                               << full.Get(i));
    }
  }
  RK_CHECK(full.GuardIntact(), "all_gather wrote past the output");
  return Status::Ok();
}

Status CheckReduceScatter(Communicator& comm, DType dtype, size_t total, int seed, ReduceOp op) {
  const int W = comm.world_size();
  Buf full(dtype, total);
  for (size_t i = 0; i < total; ++i)
    full.Set(i, Value(comm.rank(), i, seed));
  const Shard mine = Partition(total, W, comm.rank());
  Buf shard(dtype, mine.count);
  RK_OK(comm.ReduceScatter(full.data(), shard.data(), total, dtype, op));
  for (size_t j = 0; j < mine.count; ++j) {
    const double want = Reduced(dtype, W, mine.offset + j, seed, op);
    RK_CHECK(shard.Get(j) == want, "reduce_scatter " << DTypeName(dtype) << " " << ReduceOpName(op)
                                                     << " total " << total << " shard index " << j
                                                     << ": got " << shard.Get(j) << " want "
                                                     << want);
  }
  RK_CHECK(shard.GuardIntact(), "reduce_scatter wrote past the shard");
  for (size_t i = 0; i < total; ++i) {
    RK_CHECK(full.Get(i) == Value(comm.rank(), i, seed), "reduce_scatter modified its input");
  }
  return Status::Ok();
}

Status CheckAllReduce(Communicator& comm, DType dtype, size_t total, int seed, ReduceOp op) {
  Buf data(dtype, total);
  for (size_t i = 0; i < total; ++i)
    data.Set(i, Value(comm.rank(), i, seed));
  RK_OK(comm.AllReduce(data.data(), total, dtype, op));
  for (size_t i = 0; i < total; ++i) {
    const double want = Reduced(dtype, comm.world_size(), i, seed, op);
    RK_CHECK(data.Get(i) == want, "all_reduce " << DTypeName(dtype) << " " << ReduceOpName(op)
                                                << " total " << total << " index " << i << ": got "
                                                << data.Get(i) << " want " << want);
  }
  RK_CHECK(data.GuardIntact(), "all_reduce wrote past the buffer");
  return Status::Ok();
}

Status CheckBroadcast(Communicator& comm, DType dtype, size_t total, int seed, int root) {
  Buf data(dtype, total);
  for (size_t i = 0; i < total; ++i) {
    data.Set(i, comm.rank() == root ? static_cast<double>(Value(root, i, seed)) : 100.0);
  }
  RK_OK(comm.Broadcast(data.data(), total, dtype, root));
  for (size_t i = 0; i < total; ++i) {
    RK_CHECK(data.Get(i) == Value(root, i, seed),
             "broadcast " << DTypeName(dtype) << " root " << root << " index " << i);
  }
  return Status::Ok();
}

// In-place forms: all-gather from this rank's slice of the output, reduce-scatter into
// this rank's slice of the input, and into the start of the input.
Status CheckInPlace(Communicator& comm, DType dtype, size_t total, int seed) {
  const int W = comm.world_size();
  const int r = comm.rank();
  const Shard mine = Partition(total, W, r);
  const size_t es = DTypeSize(dtype);
  Buf full(dtype, total);
  for (size_t i = 0; i < total; ++i)
    full.Set(i, 100.0);
  for (size_t j = 0; j < mine.count; ++j)
    full.Set(mine.offset + j, Value(r, mine.offset + j, seed));
  auto* base = static_cast<uint8_t*>(full.data());
  RK_OK(comm.AllGather(base + mine.offset * es, base, total, dtype));
  for (int q = 0; q < W; ++q) {
    const Shard sq = Partition(total, W, q);
    for (size_t j = 0; j < sq.count; ++j) {
      RK_CHECK(full.Get(sq.offset + j) == Value(q, sq.offset + j, seed),
               "in-place all_gather " << DTypeName(dtype) << " total " << total);
    }
  }
  for (int where = 0; where < 2; ++where) {
    for (size_t i = 0; i < total; ++i)
      full.Set(i, Value(r, i, seed));
    uint8_t* out = where == 0 ? base + mine.offset * es : base;
    RK_OK(comm.ReduceScatter(base, out, total, dtype, ReduceOp::kSum));
    const size_t first = where == 0 ? mine.offset : 0;
    for (size_t j = 0; j < mine.count; ++j) {
      const double want = Reduced(dtype, W, mine.offset + j, seed, ReduceOp::kSum);
      RK_CHECK(full.Get(first + j) == want, "in-place reduce_scatter "
                                                << (where == 0 ? "at its slice " : "at the start ")
                                                << DTypeName(dtype) << " total " << total
                                                << " index " << j << ": got " << full.Get(first + j)
                                                << " want " << want);
    }
  }
  return Status::Ok();
}

// Every collective, dtype and op on sizes that do not divide by W, are smaller than W, are
// empty, and span several pipeline chunks.
Status CollectivesBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port));
  int seed = 0;
  for (DType dtype : kAllDTypes) {
    const size_t large = (size_t{3} << 20) / DTypeSize(dtype) + 3;  // 3 MiB + a bit
    const size_t sizes[] = {
        0, 1, static_cast<size_t>(world) - 1, static_cast<size_t>(world) + 1, 1000, large};
    for (size_t total : sizes) {
      ++seed;
      RK_OK(CheckAllGather(*comm, dtype, total, seed));
      RK_OK(CheckReduceScatter(*comm, dtype, total, seed, ReduceOp::kSum));
      RK_OK(CheckReduceScatter(*comm, dtype, total, seed, ReduceOp::kAvg));
      RK_OK(CheckAllReduce(*comm, dtype, total, seed, ReduceOp::kSum));
      RK_OK(CheckAllReduce(*comm, dtype, total, seed, ReduceOp::kAvg));
      RK_OK(CheckBroadcast(*comm, dtype, total, seed, static_cast<int>(seed % world)));
      RK_OK(CheckInPlace(*comm, dtype, total, seed));
    }
  }
  RK_OK(comm->Barrier());
  return Status::Ok();
}

void RunWorld(int world, const std::function<Status(int, int, PortChannel&)>& body) {
#if !defined(STRATA_TEST_HAVE_TORCH)
  GTEST_SKIP() << "several ranks need the TCP store (c10d's TCPStore): this build has "
                  "STRATA_TORCH=OFF";
#endif
  PortChannel ports;
  auto results = RunProcesses(world, [&](int rank) { return body(rank, world, ports); });
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

// The ranks as threads of this process, meeting through an in-process store: runs in a
// build without LibTorch too, and under ThreadSanitizer (scripts/sanitize.sh), which sees
// the transport's threads, the operation queue and the farewells of every rank at once.
void RunThreads(int world, const std::function<Status(int, int, PortChannel&)>& body) {
  PortChannel ports;
  ports.UseInProcessStore();
  std::vector<Status> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { results[static_cast<size_t>(r)] = body(r, world, ports); });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)];
  }
}

TEST(GlooThreads, MatchReferenceThreeRanks) {
  RunThreads(3, CollectivesBody);
}

TEST(GlooCollectives, MatchReferenceTwoRanks) {
  RunWorld(2, CollectivesBody);
}
TEST(GlooCollectives, MatchReferenceFourRanks) {
  RunWorld(4, CollectivesBody);
}

// Many async operations in flight complete in issue order with correct results. The
// all-gather reads `x` before the all-reduce that follows overwrites it in place.
Status AsyncBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port));
  constexpr int kOps = 48;
  const DType dt = DType::kFloat32;
  std::vector<Buf> bufs;
  std::vector<Buf> outs;
  std::vector<size_t> totals;
  bufs.reserve(kOps);
  outs.reserve(kOps);
  std::vector<WorkPtr> works;
  for (int k = 0; k < kOps; ++k) {
    const size_t total = 37 * static_cast<size_t>(k) + 5;
    totals.push_back(total);
    bufs.emplace_back(dt, total);
    outs.emplace_back(dt, total);
    for (size_t i = 0; i < total; ++i)
      bufs.back().Set(i, Value(rank, i, k));
    const Shard mine = Partition(total, world, rank);
    if (k % 3 == 0) {
      // all-gather of this rank's slice of x into out, then all-reduce x in place.
      works.push_back(comm->AllGatherAsync(static_cast<uint8_t*>(bufs[k].data()) + mine.offset * 4,
                                           outs[k].data(), total, dt));
      works.push_back(comm->AllReduceAsync(bufs[k].data(), total, dt, ReduceOp::kSum));
    } else if (k % 3 == 1) {
      works.push_back(
          comm->ReduceScatterAsync(bufs[k].data(), outs[k].data(), total, dt, ReduceOp::kAvg));
    } else {
      works.push_back(comm->AllReduceAsync(bufs[k].data(), total, dt, ReduceOp::kAvg));
    }
  }
  for (size_t w = 0; w < works.size(); ++w) {
    RK_OK(works[w]->Wait());
    for (size_t v = 0; v < w; ++v) {
      RK_CHECK(works[v]->IsCompleted(), "work " << v << " incomplete after work " << w);
    }
  }
  for (int k = 0; k < kOps; ++k) {
    const size_t total = totals[k];
    const Shard mine = Partition(total, world, rank);
    if (k % 3 == 0) {
      for (size_t i = 0; i < total; ++i) {
        int owner = 0;
        while (i >= Partition(total, world, owner).offset + Partition(total, world, owner).count) {
          ++owner;
        }
        RK_CHECK(outs[k].Get(i) == Value(owner, i, k), "async all_gather " << k << " index " << i);
        RK_CHECK(bufs[k].Get(i) == Reduced(dt, world, i, k, ReduceOp::kSum),
                 "async all_reduce " << k << " index " << i);
      }
    } else if (k % 3 == 1) {
      for (size_t j = 0; j < mine.count; ++j) {
        RK_CHECK(outs[k].Get(j) == Reduced(dt, world, mine.offset + j, k, ReduceOp::kAvg),
                 "async reduce_scatter " << k << " index " << j);
      }
    } else {
      for (size_t i = 0; i < total; ++i) {
        RK_CHECK(bufs[k].Get(i) == Reduced(dt, world, i, k, ReduceOp::kAvg),
                 "async all_reduce avg " << k << " index " << i);
      }
    }
  }
  return Status::Ok();
}

TEST(GlooAsync, ManyOpsInOrderTwoRanks) {
  RunWorld(2, AsyncBody);
}
TEST(GlooAsync, ManyOpsInOrderFourRanks) {
  RunWorld(4, AsyncBody);
}

// Coalesced calls: correct results, and exactly one collective per call.
Status CoalescedBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port));
  const size_t totals[] = {0, 1, static_cast<size_t>(world) - 1, 5, 1000, 3333};
  constexpr size_t kN = sizeof(totals) / sizeof(totals[0]);
  for (DType dt : kAllDTypes) {
    // All-gather.
    std::vector<Buf> shards, fulls;
    std::vector<GatherItem> gi;
    for (size_t t = 0; t < kN; ++t) {
      const Shard mine = Partition(totals[t], world, rank);
      shards.emplace_back(dt, mine.count);
      fulls.emplace_back(dt, totals[t]);
    }
    for (size_t t = 0; t < kN; ++t) {
      const Shard mine = Partition(totals[t], world, rank);
      for (size_t j = 0; j < mine.count; ++j) {
        shards[t].Set(j, Value(rank, mine.offset + j, static_cast<int>(t)));
      }
      gi.push_back({shards[t].data(), fulls[t].data(), totals[t]});
    }
    CommStats before = comm->stats();
    RK_OK(comm->AllGatherCoalescedAsync(gi, dt)->Wait());
    CommStats after = comm->stats();
    RK_CHECK(after.operations == before.operations + 1, "all_gather_coalesced issued "
                                                            << after.operations - before.operations
                                                            << " collectives");
    for (size_t t = 0; t < kN; ++t) {
      for (int q = 0; q < world; ++q) {
        const Shard s = Partition(totals[t], world, q);
        for (size_t j = 0; j < s.count; ++j) {
          RK_CHECK(fulls[t].Get(s.offset + j) == Value(q, s.offset + j, static_cast<int>(t)),
                   "all_gather_coalesced " << DTypeName(dt) << " item " << t);
        }
      }
      RK_CHECK(fulls[t].GuardIntact(), "all_gather_coalesced overran item " << t);
    }

    // Reduce-scatter (sum and avg).
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<Buf> ins, outs;
      std::vector<ScatterItem> si;
      for (size_t t = 0; t < kN; ++t) {
        ins.emplace_back(dt, totals[t]);
        outs.emplace_back(dt, Partition(totals[t], world, rank).count);
      }
      for (size_t t = 0; t < kN; ++t) {
        for (size_t i = 0; i < totals[t]; ++i)
          ins[t].Set(i, Value(rank, i, static_cast<int>(t)));
        si.push_back({ins[t].data(), outs[t].data(), totals[t]});
      }
      before = comm->stats();
      RK_OK(comm->ReduceScatterCoalescedAsync(si, dt, op)->Wait());
      after = comm->stats();
      RK_CHECK(after.operations == before.operations + 1, "reduce_scatter_coalesced ops");
      for (size_t t = 0; t < kN; ++t) {
        const Shard mine = Partition(totals[t], world, rank);
        for (size_t j = 0; j < mine.count; ++j) {
          const double want = Reduced(dt, world, mine.offset + j, static_cast<int>(t), op);
          RK_CHECK(outs[t].Get(j) == want, "reduce_scatter_coalesced "
                                               << DTypeName(dt) << " " << ReduceOpName(op)
                                               << " item " << t << " index " << j << ": got "
                                               << outs[t].Get(j) << " want " << want);
        }
        RK_CHECK(outs[t].GuardIntact(), "reduce_scatter_coalesced overran item " << t);
      }
    }

    // All-reduce.
    std::vector<Buf> data;
    std::vector<ReduceItem> ri;
    for (size_t t = 0; t < kN; ++t)
      data.emplace_back(dt, totals[t]);
    for (size_t t = 0; t < kN; ++t) {
      for (size_t i = 0; i < totals[t]; ++i)
        data[t].Set(i, Value(rank, i, static_cast<int>(t)));
      ri.push_back({data[t].data(), totals[t]});
    }
    before = comm->stats();
    RK_OK(comm->AllReduceCoalescedAsync(ri, dt, ReduceOp::kSum)->Wait());
    after = comm->stats();
    RK_CHECK(after.operations == before.operations + 1, "all_reduce_coalesced ops");
    for (size_t t = 0; t < kN; ++t) {
      for (size_t i = 0; i < totals[t]; ++i) {
        RK_CHECK(data[t].Get(i) == Reduced(dt, world, i, static_cast<int>(t), ReduceOp::kSum),
                 "all_reduce_coalesced " << DTypeName(dt) << " item " << t);
      }
    }
  }
  // An empty list is one (empty) operation too.
  RK_OK(comm->AllReduceCoalescedAsync({}, DType::kFloat32, ReduceOp::kSum)->Wait());
  return Status::Ok();
}

TEST(GlooCoalesced, OneCollectivePerCallTwoRanks) {
  RunWorld(2, CoalescedBody);
}
TEST(GlooCoalesced, OneCollectivePerCallFourRanks) {
  RunWorld(4, CoalescedBody);
}

// A real reduce-scatter: each rank sends and receives (W-1)/W of the buffer (exactly: every
// block but its own), and an all-gather moves the same.
Status TrafficBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port));
  const size_t n = (size_t{1} << 20) + 3;
  const size_t bytes = n * 4;
  std::vector<float> full(n, 1.0f);
  std::vector<float> shard(Partition(n, world, rank).count);
  const CommStats s0 = comm->stats();
  RK_OK(comm->ReduceScatter(full.data(), shard.data(), n, DType::kFloat32, ReduceOp::kSum));
  const CommStats s1 = comm->stats();
  const uint64_t sent = s1.bytes_sent - s0.bytes_sent;
  const uint64_t received = s1.bytes_received - s0.bytes_received;
  const auto count = [&](int q) { return Partition(n, world, (q + world) % world).count; };
  RK_CHECK(sent == (n - count(rank)) * 4, "reduce_scatter sent " << sent);
  RK_CHECK(received == (n - count(rank - 1)) * 4, "reduce_scatter received " << received);
  const double ratio = static_cast<double>(sent) / static_cast<double>(bytes);
  const double ideal = static_cast<double>(world - 1) / world;
  RK_CHECK(ratio > ideal * 0.999 && ratio < ideal * 1.001, "ratio " << ratio);
  std::printf(
      "[rank %d of %d] reduce_scatter of %zu bytes: sent %llu (%.4f of the buffer, ideal "
      "%.4f), received %llu\n",
      rank, world, bytes, static_cast<unsigned long long>(sent), ratio, ideal,
      static_cast<unsigned long long>(received));
  RK_CHECK(s1.operations == s0.operations + 1, "operations");

  const CommStats s2 = comm->stats();
  RK_OK(comm->AllGather(shard.data(), full.data(), n, DType::kFloat32));
  const CommStats s3 = comm->stats();
  RK_CHECK(s3.bytes_sent - s2.bytes_sent == (n - count(rank + 1)) * 4, "all_gather sent");
  RK_CHECK(s3.bytes_received - s2.bytes_received == (n - count(rank)) * 4, "all_gather received");
  for (size_t i = 0; i < n; ++i) {
    RK_CHECK(full[i] == static_cast<float>(world), "all_gather after reduce_scatter " << i);
  }
  return Status::Ok();
}

TEST(GlooTraffic, ReduceScatterMovesWMinusOneOverWTwoRanks) {
  RunWorld(2, TrafficBody);
}
TEST(GlooTraffic, ReduceScatterMovesWMinusOneOverWFourRanks) {
  RunWorld(4, TrafficBody);
}

// The last rank dies in the middle of an all-reduce (it issues its part asynchronously and
// exits at once). Every surviving rank gets an error that names itself and the operation
// instead of hanging; the communicator is broken afterwards.
Status PeerDiesBody(int rank, int world, PortChannel& port, bool exit_mid_op) {
  // Stopping to answer is found by the timeout; keep it short.
  const std::chrono::milliseconds timeout(exit_mid_op ? 10000 : 2000);
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port, timeout));
  RK_OK(comm->Barrier());
  const size_t n = size_t{4} << 20;  // 16 MiB of fp32
  std::vector<float> data(n, 1.0f);
  if (rank == world - 1) {
    if (exit_mid_op) {
      WorkPtr w = comm->AllReduceAsync(data.data(), n, DType::kFloat32, ReduceOp::kSum);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::fflush(stdout);
      _exit(0);  // dies with the operation in flight
    }
    // Stops answering: never joins the collective, outlives the others' timeout.
    std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
    _exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  Status s = comm->AllReduce(data.data(), n, DType::kFloat32, ReduceOp::kSum);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[rank %d of %d] after %.2f s: %s\n", rank, world, secs, s.ToString().c_str());
  RK_CHECK(!s.ok(), "all_reduce succeeded without the last rank");
  RK_CHECK(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded,
           s.ToString());
  const std::string me = "gloo rank " + std::to_string(rank) + " of " + std::to_string(world);
  RK_CHECK(s.message().find(me) != std::string::npos, "error does not name this rank: " << s);
  RK_CHECK(s.message().find("all_reduce") != std::string::npos,
           "error does not name the operation: " << s);
  RK_CHECK(s.message().find("rank ") != std::string::npos, s);
  if (exit_mid_op) {
    // Every survivor names the lost rank: those waiting on it directly, the others through
    // the abort farewell of the first rank that saw it go.
    const std::string lost = "lost rank " + std::to_string(world - 1);
    RK_CHECK(s.message().find(lost) != std::string::npos,
             "error does not say '" << lost << "': " << s);
  }
  Status later = comm->Barrier();
  RK_CHECK(later.code() == StatusCode::kFailedPrecondition, later.ToString());
  RK_CHECK(later.message().find("all_reduce") != std::string::npos,
           "the broken state does not carry the first error: " << later);
  return Status::Ok();
}

TEST(GlooFailure, PeerExitsMidCollectiveTwoRanks) {
  RunWorld(2, [](int r, int w, PortChannel& p) { return PeerDiesBody(r, w, p, true); });
}
TEST(GlooFailure, PeerExitsMidCollectiveFourRanks) {
  RunWorld(4, [](int r, int w, PortChannel& p) { return PeerDiesBody(r, w, p, true); });
}
TEST(GlooFailure, PeerStopsAnsweringFourRanks) {
  RunWorld(4, [](int r, int w, PortChannel& p) { return PeerDiesBody(r, w, p, false); });
}

// The last rank joins the all-reduce only after the others timed out: its data arrives
// for transfers the others gave up on. Every rank fails cleanly (no crash of Gloo's event
// loop on late data), the late one too.
Status LatePeerBody(int rank, int world, PortChannel& port) {
  const std::chrono::milliseconds timeout(2000);
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port, timeout));
  RK_OK(comm->Barrier());
  if (rank == world - 1) std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
  const size_t n = size_t{1} << 20;
  std::vector<float> data(n, 1.0f);
  Status s = comm->AllReduce(data.data(), n, DType::kFloat32, ReduceOp::kSum);
  std::printf("[rank %d of %d] %s\n", rank, world, s.ToString().c_str());
  RK_CHECK(!s.ok(), "all_reduce succeeded although the others gave up");
  RK_CHECK(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded,
           s.ToString());
  // Give late traffic time to arrive while this process is still alive.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  return Status::Ok();
}

TEST(GlooFailure, LatePeerAfterTimeoutFourRanks) {
  RunWorld(4, LatePeerBody);
}

TEST(GlooThreads, ManyOpsInOrderThreeRanks) {
  RunThreads(3, AsyncBody);
}
TEST(GlooThreads, OneCollectivePerCallThreeRanks) {
  RunThreads(3, CoalescedBody);
}
TEST(GlooThreads, ReduceScatterMovesWMinusOneOverWThreeRanks) {
  RunThreads(3, TrafficBody);
}
TEST(GlooThreads, LatePeerAfterTimeoutThreeRanks) {
  RunThreads(3, LatePeerBody);
}

// Communicator::Duplicate: a second communicator over the same ranks with its own issue
// order. Rank 0 has an all-reduce in flight on the original while the ranks duplicate it
// (they meet through the store, not the queue); then rank 0 waits on the duplicate with
// the original's all-reduce still queued, the others go the other way round. Were the
// two one queue, the all-reduces would pair up crosswise and sum the wrong values (or
// hang until the timeout).
Status DuplicateBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port));
  const size_t n = 1000;
  std::vector<float> x(n, static_cast<float>(rank + 1));
  std::vector<float> y(n, 100.0f * static_cast<float>(rank + 1));
  const uint64_t before = comm->stats().operations;
  WorkPtr wx;
  if (rank == 0) wx = comm->AllReduceAsync(x.data(), n, DType::kFloat32, ReduceOp::kSum);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> dup, comm->Duplicate());
  RK_CHECK(dup->rank() == rank && dup->world_size() == world,
           "duplicate is rank " << dup->rank() << " of " << dup->world_size());
  RK_CHECK(dup->backend() == Backend::kGloo, "duplicate's backend");
  RK_CHECK(dup->options().timeout == comm->options().timeout, "duplicate's options");
  if (rank == 0) {
    RK_OK(dup->AllReduce(y.data(), n, DType::kFloat32, ReduceOp::kSum));
    RK_OK(wx->Wait());
  } else {
    RK_OK(dup->AllReduce(y.data(), n, DType::kFloat32, ReduceOp::kSum));
    RK_OK(comm->AllReduce(x.data(), n, DType::kFloat32, ReduceOp::kSum));
  }
  const float sum = static_cast<float>(world * (world + 1) / 2);
  for (size_t i = 0; i < n; ++i) {
    RK_CHECK(x[i] == sum, "original's all_reduce index " << i << ": " << x[i]);
    RK_CHECK(y[i] == 100.0f * sum, "duplicate's all_reduce index " << i << ": " << y[i]);
  }
  RK_CHECK(dup->stats().operations == 1, "duplicate ran " << dup->stats().operations);
  RK_CHECK(comm->stats().operations == before + 1,
           "original ran " << comm->stats().operations << " after " << before);
  // A second duplicate of the original, and one of the duplicate: three more lanes.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> second, comm->Duplicate());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nested, dup->Duplicate());
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  WorkPtr wa = second->AllReduceAsync(a.data(), n, DType::kFloat32, ReduceOp::kSum);
  RK_OK(nested->AllReduce(b.data(), n, DType::kFloat32, ReduceOp::kSum));
  RK_OK(wa->Wait());
  RK_CHECK(a[0] == static_cast<float>(world) && b[n - 1] == 2.0f * static_cast<float>(world),
           "second/nested duplicate: " << a[0] << " " << b[n - 1]);
  return Status::Ok();
}

TEST(GlooDuplicate, OwnIssueOrderTwoRanks) {
  RunWorld(2, DuplicateBody);
}
TEST(GlooDuplicate, OwnIssueOrderFourRanks) {
  RunWorld(4, DuplicateBody);
}
TEST(GlooThreads, DuplicateOwnIssueOrderThreeRanks) {
  RunThreads(3, DuplicateBody);
}

TEST(GlooDuplicate, OneRank) {
  Rendezvous rv;
  CommOptions co;
  co.interface = "127.0.0.1";
  Result<std::unique_ptr<Communicator>> comm = CreateCommunicator(Backend::kGloo, rv, co);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Result<std::unique_ptr<Communicator>> dup = (*comm)->Duplicate();
  ASSERT_TRUE(dup.ok()) << dup.status();
  std::vector<float> v(10, 3.0f);
  ASSERT_TRUE((*dup)->AllReduce(v.data(), v.size(), DType::kFloat32, ReduceOp::kSum).ok());
  EXPECT_EQ(v[9], 3.0f);
  EXPECT_EQ((*dup)->world_size(), 1);
}

// A rank that never duplicates: the others' Duplicate fails within the timeout, naming
// the rank, and the original communicator still works.
Status LonelyDuplicateBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port, std::chrono::seconds(2)));
  if (rank == 0) {
    Result<std::unique_ptr<Communicator>> dup = comm->Duplicate();
    std::printf("[rank %d of %d] %s\n", rank, world, dup.status().ToString().c_str());
    RK_CHECK(!dup.ok(), "duplicated without the other rank");
    RK_CHECK(dup.status().code() == StatusCode::kDeadlineExceeded, dup.status().ToString());
    RK_CHECK(dup.status().message().find("rank 0 of 2") != std::string::npos,
             dup.status().ToString());
    RK_CHECK(dup.status().message().find("every rank must call Duplicate") != std::string::npos,
             dup.status().ToString());
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past rank 0's timeout
  }
  RK_OK(comm->Barrier());
  return Status::Ok();
}

TEST(GlooDuplicate, ARankThatNeverDuplicatesIsATimeout) {
  RunWorld(2, LonelyDuplicateBody);
}

// A peer that dies while this rank streams data to it: the next write fails with EPIPE,
// which must be an error, not a SIGPIPE that kills the process (Gloo writes without
// MSG_NOSIGNAL; the communicator blocks SIGPIPE in the threads that write).
Status SendToGoneBody(int rank, int world, PortChannel& port) {
  STRATA_ASSIGN_OR_RETURN(auto comm, MakeGloo(rank, world, port, std::chrono::seconds(10)));
  RK_OK(comm->Barrier());
  std::vector<float> data(size_t{16} << 20, 1.0f);  // 64 MiB
  if (rank == 1) {
    WorkPtr w = comm->BroadcastAsync(data.data(), data.size(), DType::kFloat32, /*root=*/0);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    _exit(0);  // with data still arriving: the kernel answers with a reset
  }
  Status s = comm->Broadcast(data.data(), data.size(), DType::kFloat32, /*root=*/0);
  RK_CHECK(!s.ok(), "broadcast to a dead rank succeeded");
  RK_CHECK(s.code() == StatusCode::kUnavailable, s.ToString());
  RK_CHECK(s.message().find("broadcast") != std::string::npos, s.ToString());
  return Status::Ok();
}

TEST(GlooFailure, SendToExitedPeerIsAnErrorNotSigpipe) {
  RunWorld(2, SendToGoneBody);
}

}  // namespace
}  // namespace strata::comm

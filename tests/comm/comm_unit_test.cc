// Single-process tests of comm/: Partition, dtype names and kernels (16-bit conversion and
// reduction in fp32), the stores, the work queue, and a world of one rank.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/comm/store.h"
#include "strata/comm/tcp_transport.h"

namespace strata::comm {
namespace {

using internal::Bf16ToFloat;
using internal::FloatToBf16;
using internal::FloatToHalf;
using internal::HalfToFloat;
using std::chrono::milliseconds;

void PartitionIsBalancedAndCovering() {
  for (size_t total : {0, 1, 3, 4, 5, 7, 1000, 1001}) {
    for (int w : {1, 2, 3, 4, 7}) {
      size_t next = 0;
      for (int r = 0; r < w; ++r) {
        const Shard s = Partition(total, w, r);
        EXPECT_EQ(s.offset, next) << total << " " << w << " " << r;
        EXPECT_EQ(s.count, total / w + (static_cast<size_t>(r) < total % w ? 1 : 0));
        next += s.count;
      }
      EXPECT_EQ(next, total);
    }
  }
}

void NamesOfDTypesAndBackends() {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  auto bad = ParseDType("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fp8"), std::string::npos);
  EXPECT_EQ(*ParseBackend("gloo"), Backend::kGloo);
  EXPECT_EQ(*ParseBackend("nccl"), Backend::kNccl);
  EXPECT_FALSE(ParseBackend("mpi").ok());
  EXPECT_EQ(ReduceOpName(ReduceOp::kAvg), "avg");
}

void Bf16RoundsToNearestEven() {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3F80);             // tie -> even (down)
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3F82);         // tie -> even (up)
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // above the tie
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_EQ(FloatToBf16(INFINITY), 0x7F80);
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBf16(f), b);
  }
}

void HalfRoundsToNearestEven() {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie between max and inf -> inf
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3C00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3C02);
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);             // tie -> even (zero)
  EXPECT_EQ(FloatToHalf(3 * 0x1p-25f), 0x0002);         // tie -> even
  EXPECT_EQ(FloatToHalf(0x1p-14f - 0x1p-26f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

// The vector paths (F16C where the CPU has it) agree with the scalar reference bit for bit.
void BulkConversionMatchesScalar() {
  std::vector<uint16_t> all(0x10000);
  for (uint32_t i = 0; i < all.size(); ++i)
    all[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(all.size());
  internal::ConvertToFloat(DType::kFloat16, all.data(), wide.data(), all.size());
  for (uint32_t i = 0; i < all.size(); ++i) {
    const float ref = HalfToFloat(all[i]);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(wide[i]));
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(ref)) << i;
    }
  }
  std::mt19937 gen(7);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> src(100003);
  for (auto& f : src) {
    f = std::bit_cast<float>(bits(gen));
    if (std::isnan(f)) f = 1.0f;
  }
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> out(src.size());
    internal::ConvertFromFloat(d, src.data(), out.data(), src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      const uint16_t ref = d == DType::kFloat16 ? FloatToHalf(src[i]) : FloatToBf16(src[i]);
      ASSERT_EQ(out[i], ref) << DTypeName(d) << " " << src[i];
    }
  }
}

void ReduceInFp32AndRoundOnce() {
  // bf16: 256 + 1 is not representable; (256 + 1 + 1) is. Reducing pairwise in fp32 and
  // rounding once gives the exact sum of two values.
  std::vector<uint16_t> a = {FloatToBf16(256.0f), FloatToBf16(1.5f), FloatToBf16(-3.0f)};
  std::vector<uint16_t> b = {FloatToBf16(2.0f), FloatToBf16(2.25f), FloatToBf16(1.0f)};
  std::vector<uint16_t> d(3);
  internal::ReduceSum(DType::kBFloat16, a.data(), b.data(), d.data(), 3);
  EXPECT_EQ(Bf16ToFloat(d[0]), 258.0f);
  EXPECT_EQ(Bf16ToFloat(d[1]), 3.75f);
  EXPECT_EQ(Bf16ToFloat(d[2]), -2.0f);
  internal::ReduceSumDivide(DType::kBFloat16, a.data(), b.data(), d.data(), 3, 2);
  EXPECT_EQ(Bf16ToFloat(d[0]), 129.0f);
  EXPECT_EQ(Bf16ToFloat(d[2]), -1.0f);

  std::vector<uint16_t> ha(2000), hb(2000), hd(2000);
  for (size_t i = 0; i < ha.size(); ++i) {
    ha[i] = FloatToHalf(static_cast<float>(i % 50) - 25.0f);
    hb[i] = FloatToHalf(0.5f * static_cast<float>(i % 7));
  }
  internal::ReduceSumDivide(DType::kFloat16, ha.data(), hb.data(), hd.data(), ha.size(), 4);
  for (size_t i = 0; i < ha.size(); ++i) {
    const float want = ((static_cast<float>(i % 50) - 25.0f) + 0.5f * (i % 7)) / 4;
    ASSERT_EQ(HalfToFloat(hd[i]), want) << i;
  }

  std::vector<int64_t> ia = {7, -7, 1LL << 40};
  std::vector<int64_t> ib = {0, 0, 1};
  std::vector<int64_t> id(3);
  internal::ReduceSumDivide(DType::kInt64, ia.data(), ib.data(), id.data(), 3, 2);
  EXPECT_EQ(id[0], 3);   // toward zero
  EXPECT_EQ(id[1], -3);  // toward zero
  EXPECT_EQ(id[2], ((1LL << 40) + 1) / 2);
  std::vector<float> fa = {1.5f, 2.0f};
  internal::DivideInPlace(DType::kFloat32, fa.data(), 2, 2);
  EXPECT_EQ(fa[0], 0.75f);
}

void InProcessSetGetAddWait() {
  auto store = InProcessStore();
  ASSERT_TRUE(store->Set("a", {1, 2, 3}).ok());
  auto got = store->Get("a", milliseconds(10));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(*store->Add("n", 5), 5);
  EXPECT_EQ(*store->Add("n", -2), 3);
  auto missing = store->Get("nope", milliseconds(20));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  Status w = store->Wait({"a", "late"}, milliseconds(20));
  EXPECT_EQ(w.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(w.message().find("late"), std::string::npos);
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(20));
    (void)store->Set("late", {9});
  });
  EXPECT_TRUE(store->Wait({"a", "late"}, milliseconds(5000)).ok());
  setter.join();
}

void PrefixStoreNamespacesKeys() {
  auto base = InProcessStore();
  auto p = PrefixStore("/worker/attempt_0", base);
  ASSERT_TRUE(p->Set("k", {7}).ok());
  auto raw = base->Get("/worker/attempt_0/k", milliseconds(10));
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ((*raw)[0], 7);
  EXPECT_EQ(*p->Add("c", 2), 2);
  EXPECT_EQ(*base->Add("/worker/attempt_0/c", 1), 3);
  EXPECT_FALSE(base->Get("k", milliseconds(5)).ok());
  EXPECT_TRUE(p->Wait({"k", "c"}, milliseconds(10)).ok());
}

void WorkWaitWithTimeoutAndCompletion() {
  auto work = std::make_shared<internal::CompletionWork>("gloo rank 0 of 1: test op");
  EXPECT_FALSE(work->IsCompleted());
  Status early = work->Wait(milliseconds(10));
  EXPECT_EQ(early.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(early.message().find("test op"), std::string::npos);
  std::thread t([&] { work->Complete(UnavailableError("peer gone")); });
  Status s = work->Wait();
  t.join();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(work->IsCompleted());
  EXPECT_EQ(work->Wait(milliseconds(1)), s);  // same result again
}

void OpQueueRunsInOrderAndBreaksOnFirstError() {
  std::atomic<int> errors_seen{0};
  std::vector<int> order;
  std::mutex mu;
  std::vector<WorkPtr> works;
  {
    internal::OpQueue q("test-queue", [&](const Status&) { errors_seen++; });
    for (int i = 0; i < 5; ++i) {
      works.push_back(q.Submit("op " + std::to_string(i), [&, i]() -> Status {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(i);
        if (i == 2) return UnavailableError("rank 1 went away");
        return Status::Ok();
      }));
    }
    EXPECT_TRUE(works[0]->Wait().ok());
    EXPECT_TRUE(works[1]->Wait().ok());
    EXPECT_EQ(works[2]->Wait().code(), StatusCode::kUnavailable);
    for (int i = 3; i < 5; ++i) {
      Status s = works[i]->Wait();
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
      EXPECT_NE(s.message().find("rank 1 went away"), std::string::npos) << s;
    }
    Status later = q.Submit("later", [] { return Status::Ok(); })->Wait();
    EXPECT_EQ(later.code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(q.first_error().code(), StatusCode::kUnavailable);
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(errors_seen.load(), 1);
}

void CreateRejectsBadArguments() {
  Rendezvous rv;
  rv.store = InProcessStore();
  CommOptions bad_timeout;
  bad_timeout.timeout = milliseconds(0);
  auto r1 = CreateCommunicator(Backend::kGloo, rv, bad_timeout);
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), StatusCode::kInvalidArgument);

  CommOptions cuda;
  cuda.device = Device::Cuda(0);
  auto r2 = CreateCommunicator(Backend::kGloo, rv, cuda);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r2.status().message().find("CPU"), std::string::npos);

  Rendezvous no_store;
  no_store.world_size = 2;
  auto r3 = CreateCommunicator(Backend::kGloo, no_store, {});
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), StatusCode::kInvalidArgument);
}

TEST(CreateCommunicator, BadArgumentsAndNcclWithoutCuda) {
  CreateRejectsBadArguments();
#if defined(STRATA_TEST_HAVE_CUDA)
  GTEST_SKIP() << "this build has CUDA: the NCCL backend is tested in nccl_test.cc";
#else
  Rendezvous rv;
  rv.store = InProcessStore();
  auto r = CreateCommunicator(Backend::kNccl, rv, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(r.status().message().find("without CUDA"), std::string::npos) << r.status();
#endif
}

// World of one: every collective is a local copy; bad arguments fail without breaking it.
TEST(GlooSingleRank, CollectivesAndArguments) {
  Rendezvous rv;
  rv.store = InProcessStore();
  auto made = CreateCommunicator(Backend::kGloo, rv, {});
  ASSERT_TRUE(made.ok()) << made.status();
  Communicator& comm = **made;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.world_size(), 1);
  EXPECT_EQ(comm.backend(), Backend::kGloo);

  std::vector<float> shard = {1, 2, 3};
  std::vector<float> full(3, 0);
  ASSERT_TRUE(comm.AllGather(shard.data(), full.data(), 3, DType::kFloat32).ok());
  EXPECT_EQ(full, shard);
  std::vector<float> out(3, 0);
  ASSERT_TRUE(comm.ReduceScatter(full.data(), out.data(), 3, DType::kFloat32, ReduceOp::kAvg).ok());
  EXPECT_EQ(out, shard);
  ASSERT_TRUE(comm.AllReduce(out.data(), 3, DType::kFloat32, ReduceOp::kSum).ok());
  EXPECT_EQ(out, shard);
  ASSERT_TRUE(comm.Broadcast(out.data(), 3, DType::kFloat32, 0).ok());
  ASSERT_TRUE(comm.Barrier().ok());
  ASSERT_TRUE(comm.AllGather(nullptr, nullptr, 0, DType::kBFloat16).ok());

  Status null_buf = comm.AllGather(nullptr, full.data(), 3, DType::kFloat32);
  EXPECT_EQ(null_buf.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(null_buf.message().find("all_gather"), std::string::npos) << null_buf;
  EXPECT_EQ(comm.Broadcast(out.data(), 3, DType::kFloat32, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(comm.Barrier().ok());  // still healthy

  std::vector<int64_t> a = {1, 2}, b = {3};
  std::vector<ReduceItem> items = {{a.data(), 2}, {b.data(), 1}, {nullptr, 0}};
  const uint64_t ops_before = comm.stats().operations;
  ASSERT_TRUE(comm.AllReduceCoalescedAsync(items, DType::kInt64, ReduceOp::kSum)->Wait().ok());
  EXPECT_EQ(comm.stats().operations, ops_before + 1);
  EXPECT_EQ(a, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(comm.stats().bytes_sent, 0u);
}

void RendezvousToStringNamesRankAndStore() {
  Rendezvous rv;
  rv.rank = 1;
  rv.world_size = 4;
  rv.local_rank = 1;
  rv.local_world_size = 4;
  rv.master_addr = "127.0.0.1";
  rv.master_port = 29500;
  rv.torchrun = true;
  const std::string s = rv.ToString();
  EXPECT_NE(s.find("rank 1 of 4"), std::string::npos) << s;
  EXPECT_NE(s.find("127.0.0.1:29500"), std::string::npos) << s;
}

// Several small checks per case: every case is one ctest entry and one process start.
// What a rank reads from the store before it connects: numeric hosts and ports
// in range only; the rest refused with the text named.
TEST(CommBasics, PeerAddressesAreCheckedBeforeAnyConnect) {
  using internal::ParsePeerAddress;
  for (const char* good : {"127.0.0.1 29500", "10.1.2.3 1", "::1 65535", "fe80::1%eth0 4242"}) {
    Result<internal::PeerAddress> a = ParsePeerAddress(good);
    ASSERT_TRUE(a.ok()) << good << ": " << a.status();
  }
  Result<internal::PeerAddress> a = ParsePeerAddress("192.168.0.7 8080");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "192.168.0.7");
  EXPECT_EQ(a->port, 8080);
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1 ", " 29500", "127.0.0.1 0", "127.0.0.1 65536",
                          "127.0.0.1 70000", "127.0.0.1 -1", "127.0.0.1 29500 x",
                          "127.0.0.1  29500", "localhost 29500", "example.com 80", "256.1.1.1 80",
                          "fe80::1% 80", "fe80::1%a/b 80", "127.0.0.1 +80", "127.0.0.1 0x50"}) {
    Result<internal::PeerAddress> r = ParsePeerAddress(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(r.status().message().find("malformed address"), std::string::npos) << bad;
  }
}

TEST(CommBasics, PartitionNamesToString) {
  PartitionIsBalancedAndCovering();
  NamesOfDTypesAndBackends();
  RendezvousToStringNamesRankAndStore();
}
TEST(Kernels, RoundToNearestEven) {
  Bf16RoundsToNearestEven();
  HalfRoundsToNearestEven();
}
TEST(Kernels, BulkConversionAndReduction) {
  BulkConversionMatchesScalar();
  ReduceInFp32AndRoundOnce();
}
TEST(Stores, InProcessAndPrefix) {
  InProcessSetGetAddWait();
  PrefixStoreNamespacesKeys();
}
// A peer may send its last message and exit (end of stream) before the receive for that
// message is posted, as rank 0 does after the last all-gather step of an all-reduce of one
// element: the message, read whole before the end of stream, is still received. A receive
// of anything else fails at once with the end of stream.
TEST(TcpTransport, AMessageReadBeforeThePeerClosedIsStillReceived) {
  using internal::TcpTransport;
  auto store = InProcessStore();
  std::optional<Result<std::unique_ptr<TcpTransport>>> a;
  std::thread t0(
      [&] { a = TcpTransport::Connect(0, 2, "127.0.0.1", *store, milliseconds(10000)); });
  Result<std::unique_ptr<TcpTransport>> b =
      TcpTransport::Connect(1, 2, "127.0.0.1", *store, milliseconds(10000));
  t0.join();
  ASSERT_TRUE(a->ok()) << a->status();
  ASSERT_TRUE(b.ok()) << b.status();
  const float sent = 2.5f;
  auto send = (**a)->Send(1, 7, &sent, sizeof(sent));
  auto send9 = (**a)->Send(1, 9, &sent, sizeof(sent));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  ASSERT_TRUE((**a)->Wait(*send, deadline).ok());
  ASSERT_TRUE((**a)->Wait(*send9, deadline).ok());
  (**a)->Close();
  // A receive on another slot fails once rank 1 has read the end of stream, which it reads
  // after the message.
  char other = 0;
  auto never = (*b)->Recv(0, 8, &other, 1);
  Status s = (*b)->Wait(*never, deadline);
  ASSERT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 0 closed its communicator"), std::string::npos) << s;
  float got = 0.0f;
  auto late = (*b)->Recv(0, 7, &got, sizeof(got));
  EXPECT_TRUE((*b)->Wait(*late, deadline).ok());
  EXPECT_EQ(got, sent);
  // A held message of another size than the receive is the peers' disagreement: it fails.
  double wrong = 0.0;
  auto mismatch = (*b)->Recv(0, 9, &wrong, sizeof(wrong));
  EXPECT_FALSE((*b)->Wait(*mismatch, deadline).ok());
}

// A rank that closes its transport with an error sends it to every peer (the abort
// farewell): a peer's pending and later transfers with every rank fail with that error, so
// its own error names the root cause; the peers' connections with each other still carry
// their own farewells.
TEST(TcpTransport, AnAbortFailsEveryPeerWithItsReason) {
  using internal::TcpTransport;
  auto store = InProcessStore();
  constexpr int kWorld = 3;
  std::vector<std::optional<Result<std::unique_ptr<TcpTransport>>>> slots(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      slots[static_cast<size_t>(r)] =
          TcpTransport::Connect(r, kWorld, "127.0.0.1", *store, milliseconds(10000));
    });
  }
  for (auto& th : threads)
    th.join();
  std::vector<std::unique_ptr<TcpTransport>> t;
  for (auto& x : slots) {
    ASSERT_TRUE(x->ok()) << x->status();
    t.push_back(std::move(*x).value());
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  // Rank 1 waits for rank 2, which never sends: only rank 0's abort ends the wait.
  char byte = 0;
  auto pending = t[1]->Recv(2, 5, &byte, 1);
  t[0]->Close(UnavailableError("lost rank 7: a test"));
  Status s = t[1]->Wait(*pending, deadline);
  ASSERT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 0 gave up: Unavailable: lost rank 7: a test"), std::string::npos)
      << s;
  // Rank 2 hears the abort too: its transfers with every peer fail (a wait on rank 1, which
  // sends nothing, ends with rank 0's error), and later ones fail at once.
  char other = 0;
  auto pending2 = t[2]->Recv(1, 8, &other, 1);
  Status s2 = t[2]->Wait(*pending2, deadline);
  EXPECT_NE(s2.message().find("rank 0 gave up"), std::string::npos) << s2;
  auto later = t[2]->Send(1, 6, &byte, 1);
  Status l = t[2]->Wait(*later, deadline);
  EXPECT_NE(l.message().find("rank 0 gave up"), std::string::npos) << l;
  // Rank 1 closes normally: rank 2 hears a goodbye from it, not a lost rank.
  t[1]->Close();
  auto after = t[2]->Recv(1, 9, &byte, 1);
  Status a = t[2]->Wait(*after, deadline);
  EXPECT_FALSE(a.ok());
  EXPECT_EQ(a.message().find("lost rank 1"), std::string::npos) << a;
}

TEST(WorkQueue, CompletionOrderAndBreakage) {
  WorkWaitWithTimeoutAndCompletion();
  OpQueueRunsInOrderAndBreaksOnFirstError();
}

}  // namespace
}  // namespace strata::comm

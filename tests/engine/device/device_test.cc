// The CPU device (engine/device/device.h): arena, streams, events, copies, the pinned-memory
// check, and the delaying mode that makes a missing wait visible. "AsyncDevice" tests run
// with delays on.
#include "strata/engine/device/device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine/device/arena.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

#ifdef STRATA_HAVE_CUDA
#include "strata/core/cuda/cuda.h"
#endif

namespace strata::engine {
namespace {

std::unique_ptr<Device> MakeDevice(uint64_t budget, bool delaying, uint64_t seed = 7) {
  CpuDeviceOptions o;
  o.budget_bytes = budget;
  o.delaying = delaying;
  o.seed = seed;
  Result<std::unique_ptr<Device>> d = MakeCpuDevice(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// Pinned host memory for the tests: ordinary memory registered with the device.
struct Pinned {
  Pinned(Device& d, size_t n) : dev(d), v(n) { EXPECT_TRUE(dev.RegisterHost(v.data(), n).ok()); }
  ~Pinned() { EXPECT_TRUE(dev.UnregisterHost(v.data()).ok()); }
  Device& dev;
  std::vector<uint8_t> v;
};

void* Alloc(Device& d, size_t n) {
  Result<void*> p = d.allocator()->Allocate(n);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : nullptr;
}

TEST(AsyncDeviceTest, CopiesRunInStreamOrderAndEventsTrackThem) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true);
  ASSERT_NE(dev, nullptr);
  const size_t n = 64 << 10;
  Pinned src(*dev, n), back(*dev, n);
  std::iota(src.v.begin(), src.v.end(), 3);
  void* d = Alloc(*dev, n);
  Result<StreamId> s = dev->CreateStream("copy");
  ASSERT_TRUE(s.ok()) << s.status();
  for (int round = 0; round < 10; ++round) {
    src.v[0] = static_cast<uint8_t>(round);
    std::fill(back.v.begin(), back.v.end(), 0);
    ASSERT_TRUE(dev->CopyAsync(d, src.v.data(), n, CopyKind::kHostToDevice, *s).ok());
    ASSERT_TRUE(dev->CopyAsync(back.v.data(), d, n, CopyKind::kDeviceToHost, *s).ok());
    Result<EventId> e = dev->Record(*s);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE(dev->Synchronize(*e, HostWait::kOther).ok());
    EXPECT_TRUE(*dev->Query(*e));
    EXPECT_EQ(back.v, src.v) << "round " << round;
  }
  dev->allocator()->Free(d, n);
  EXPECT_GE(dev->stats().copies, 20u);
}

// Stream B waits for stream A's event before copying what A wrote: always right, however
// the delays fall.
TEST(AsyncDeviceTest, AStreamWaitsForAnotherStreamsEvent) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true, /*seed=*/11);
  ASSERT_NE(dev, nullptr);
  const size_t n = 16 << 10;
  Pinned src(*dev, n), out(*dev, n);
  void* d1 = Alloc(*dev, n);
  void* d2 = Alloc(*dev, n);
  StreamId a = *dev->CreateStream("a"), b = *dev->CreateStream("b");
  for (int round = 0; round < 20; ++round) {
    std::fill(src.v.begin(), src.v.end(), static_cast<uint8_t>(round + 1));
    ASSERT_TRUE(dev->CopyAsync(d1, src.v.data(), n, CopyKind::kHostToDevice, a).ok());
    EventId ea = *dev->Record(a);
    ASSERT_TRUE(dev->Wait(b, ea).ok());
    ASSERT_TRUE(dev->CopyAsync(d2, d1, n, CopyKind::kDeviceToDevice, b).ok());
    ASSERT_TRUE(dev->CopyAsync(out.v.data(), d2, n, CopyKind::kDeviceToHost, b).ok());
    ASSERT_TRUE(dev->Synchronize(*dev->Record(b), HostWait::kOther).ok());
    EXPECT_EQ(out.v, src.v) << "round " << round;
  }
}

// The same without the wait: the delaying device lets B run ahead of A, so a missing wait
// is caught as wrong data (each round has about even odds; 20 rounds all lucky would be
// one in a million).
TEST(AsyncDeviceTest, AMissingWaitShowsUpAsWrongData) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true, /*seed=*/12);
  ASSERT_NE(dev, nullptr);
  const size_t n = 4 << 10;
  Pinned src(*dev, n), out(*dev, n);
  void* d1 = Alloc(*dev, n);
  StreamId a = *dev->CreateStream("a"), b = *dev->CreateStream("b");
  int stale = 0;
  for (int round = 0; round < 20; ++round) {
    std::fill(src.v.begin(), src.v.end(), static_cast<uint8_t>(round + 1));
    ASSERT_TRUE(dev->CopyAsync(d1, src.v.data(), n, CopyKind::kHostToDevice, a).ok());
    EventId ea = *dev->Record(a);
    ASSERT_TRUE(dev->CopyAsync(out.v.data(), d1, n, CopyKind::kDeviceToHost, b).ok());  // no Wait
    ASSERT_TRUE(dev->Synchronize(*dev->Record(b), HostWait::kOther).ok());
    ASSERT_TRUE(dev->Synchronize(ea, HostWait::kOther).ok());
    if (out.v != src.v) ++stale;
  }
  EXPECT_GT(stale, 0) << "the delaying device never reordered the two streams";
}

// The compute stream's queued work runs on the device's worker, after LibTorch's (the
// calling thread's) work before it; a wait on the compute stream also holds the calling
// thread, where LibTorch computes next.
TEST(AsyncDeviceTest, TheComputeStreamRunsOnAWorker) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true);
  ASSERT_NE(dev, nullptr);
  EXPECT_FALSE(dev->torch_on_compute_stream());
  const size_t n = 8 << 10;
  Pinned src(*dev, n);
  std::fill(src.v.begin(), src.v.end(), 9);
  void* d = Alloc(*dev, n);
  StreamId s = *dev->CreateStream("copy");
  ASSERT_TRUE(dev->CopyAsync(d, src.v.data(), n, CopyKind::kHostToDevice, s).ok());
  // The compute stream waits for the side stream: the host too.
  ASSERT_TRUE(dev->Wait(kComputeStream, *dev->Record(s)).ok());
  EXPECT_EQ(std::memcmp(d, src.v.data(), n), 0);
  // Work queued on the compute stream is not done at once: 20 delayed kernels, then an
  // event, which completes only after them.
  void* z = Alloc(*dev, n);
  std::memset(z, 1, n);
  for (int i = 0; i < 20; ++i)
    ASSERT_TRUE(dev->ZeroAsync(z, n, kComputeStream).ok());
  EventId c = *dev->Record(kComputeStream);
  EXPECT_FALSE(*dev->Query(c)) << "the compute stream's kernels ran on the calling thread";
  const uint64_t before = dev->stats().host_waits[static_cast<size_t>(HostWait::kEndOfBackward)];
  ASSERT_TRUE(dev->Synchronize(c, HostWait::kEndOfBackward).ok());
  EXPECT_TRUE(*dev->Query(c));
  EXPECT_EQ(static_cast<uint8_t*>(z)[n - 1], 0);
  EXPECT_EQ(dev->stats().host_waits[static_cast<size_t>(HostWait::kEndOfBackward)], before + 1);
  EXPECT_EQ(HostWaitName(HostWait::kEndOfBackward), "end of backward");
}

// Host work in a stream's order (a queued lane's collectives): it runs after the stream's
// earlier work, and the stream's later work waits for it.
TEST(AsyncDeviceTest, LaunchHostFuncRunsInTheStreamsOrder) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true);
  ASSERT_NE(dev, nullptr);
  const size_t n = 4 << 10;
  Pinned src(*dev, n);
  std::fill(src.v.begin(), src.v.end(), 5);
  auto* d = static_cast<uint8_t*>(Alloc(*dev, n));
  std::memset(d, 0, n);
  StreamId s = *dev->CreateStream("lane");
  std::vector<int> order;
  std::mutex mu;
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(dev->CopyAsync(d, src.v.data(), n, CopyKind::kHostToDevice, s).ok());
    // The host function sees the copy done, then changes the bytes the next copy restores.
    ASSERT_TRUE(dev->LaunchHostFunc(s,
                                    [&, i] {
                                      std::lock_guard<std::mutex> lock(mu);
                                      order.push_back(d[n - 1] == 5 ? i : -1);
                                      std::memset(d, 0, n);
                                    })
                    .ok());
  }
  ASSERT_TRUE(dev->Synchronize(*dev->Record(s), HostWait::kOther).ok());
  std::vector<int> want(10);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(order, want);
  EXPECT_EQ(d[0], 0);
  EXPECT_FALSE(dev->LaunchHostFunc(s, {}).ok());
}

// AdoptStream names a native stream (on the CPU device, one of its own) with a StreamId;
// the compute stream of creation and foreign pointers are refused.
TEST(AsyncDeviceTest, AdoptStreamNamesANativeStream) {
  auto dev = MakeDevice(0, /*delaying=*/false);
  ASSERT_NE(dev, nullptr);
  StreamId s = *dev->CreateStream("a communicator's");
  void* native = *dev->NativeStream(s);
  Result<StreamId> adopted = dev->AdoptStream(native);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->value, s.value);
  EXPECT_EQ(dev->AdoptStream(*dev->NativeStream(kComputeStream)).status().code(),
            StatusCode::kInvalidArgument);
  int foreign = 0;
  Result<StreamId> bad = dev->AdoptStream(&foreign);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("NativeStream"), std::string::npos) << bad.status();
}

// KeepAlive holds its owner until the stream passed the point of the call, then drops it.
TEST(AsyncDeviceTest, KeepAliveHoldsTheOwnerUntilTheStreamPassedIt) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true);
  ASSERT_NE(dev, nullptr);
  const size_t n = 4 << 10;
  void* a = Alloc(*dev, n);
  void* b = Alloc(*dev, n);
  // A "gradient" outside the arena, read by a kernel queued behind delayed ones.
  auto grad = std::make_shared<std::vector<float>>(n / 4, 2.0f);
  std::weak_ptr<std::vector<float>> watch = grad;
  for (int i = 0; i < 10; ++i)
    ASSERT_TRUE(dev->ZeroAsync(a, n, kComputeStream).ok());
  ASSERT_TRUE(dev->ConvertAsync(b, DType::kFloat32, grad->data(), DType::kFloat32, n / 4, false,
                                kComputeStream)
                  .ok());
  ASSERT_TRUE(dev->KeepAlive(kComputeStream, grad).ok());
  grad.reset();
  EXPECT_FALSE(watch.expired()) << "dropped before the stream read it";
  ASSERT_TRUE(dev->Synchronize(*dev->Record(kComputeStream), HostWait::kOther).ok());
  EXPECT_TRUE(watch.expired()) << "kept after the stream passed it";
  EXPECT_EQ(static_cast<float*>(b)[n / 4 - 1], 2.0f);
  EXPECT_EQ(dev->stats().keep_alives, 1u);
}

// SetComputeStream: the engine's compute work from then on goes to the new stream, which
// first waits for the old one (one sequence). Without that wait (the test switch) the
// delaying device runs the two out of order.
int ComputeSwitchesOutOfOrder(bool skip_wait) {
  CpuDeviceOptions o;
  o.budget_bytes = 1 << 20;
  o.delaying = true;
  o.seed = 11;
  o.test_skip_compute_switch_wait = skip_wait;
  std::unique_ptr<Device> dev = *MakeCpuDevice(o);
  StreamId user = *dev->CreateStream("a user's stream");
  void* first = *dev->NativeStream(user);
  const size_t n = 256;
  float* x = static_cast<float*>(Alloc(*dev, n * 4));
  float* y = static_cast<float*>(Alloc(*dev, n * 4));
  float* one = static_cast<float*>(Alloc(*dev, n * 4));
  std::fill(one, one + n, 1.0f);
  int wrong = 0;
  for (int round = 0; round < 20; ++round) {
    // On the stream of creation: x = 0, then x += 1 three times; then on the user's
    // stream: y = x. In order, y is 3.
    EXPECT_TRUE(dev->SetComputeStream(nullptr).ok());
    EXPECT_TRUE(dev->ZeroAsync(x, n * 4, kComputeStream).ok());
    for (int k = 0; k < 3; ++k) {
      EXPECT_TRUE(
          dev->ConvertAsync(x, DType::kFloat32, one, DType::kFloat32, n, true, kComputeStream)
              .ok());
    }
    EXPECT_TRUE(dev->SetComputeStream(first).ok());
    EXPECT_TRUE(
        dev->ConvertAsync(y, DType::kFloat32, x, DType::kFloat32, n, false, kComputeStream).ok());
    EXPECT_TRUE(dev->Synchronize(*dev->Record(kComputeStream), HostWait::kOther).ok());
    if (y[n - 1] != 3.0f) ++wrong;
  }
  EXPECT_TRUE(dev->SetComputeStream(nullptr).ok());
  EXPECT_TRUE(dev->Synchronize(*dev->Record(kComputeStream), HostWait::kOther).ok());
  return wrong;
}

TEST(AsyncDeviceTest, AComputeStreamSwitchWaitsForThePreviousOne) {
  EXPECT_EQ(ComputeSwitchesOutOfOrder(false), 0);
}

TEST(AsyncDeviceTest, AsyncDeviceWithoutTheComputeSwitchWaitGoesWrong) {
  EXPECT_GT(ComputeSwitchesOutOfOrder(true), 0)
      << "without the wait the delaying device still ran the two streams in order";
}

TEST(AsyncDeviceTest, SetComputeStreamRefusesAStreamOfAnotherDevice) {
  auto dev = MakeDevice(0, false);
  auto other = MakeDevice(0, false);
  ASSERT_NE(dev, nullptr);
  void* foreign = *other->NativeStream(*other->CreateStream("x"));
  const Status st = dev->SetComputeStream(foreign);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("NativeStream"), std::string::npos) << st;
}

// The arena hands a block given to FreeAfter out again only after its event: a kernel
// still queued on the compute stream reads the old bytes. Without the wait (the test
// switch) the new owner's writes reach the kernel. `on_stream`: the new owner is work on a
// side stream (AllocateOn, the arena's stream order): that stream, not the host, waits for
// the block's last reader, so the allocation returns at once and no host wait is counted;
// its write, queued on the stream, still lands after the read. Else the host writes.
int ArenaReuseReadsWrong(bool skip_wait, bool on_stream) {
  std::unique_ptr<Device> dev = MakeDevice(1 << 20, /*delaying=*/true, on_stream ? 14 : 13);
  auto* arena = dynamic_cast<Arena*>(dev->allocator().get());
  EXPECT_NE(arena, nullptr);
  arena->SetSkipReuseWaitForTest(skip_wait);
  const size_t n = 1024;
  float* out = static_cast<float*>(Alloc(*dev, n * 4));
  float* pad = static_cast<float*>(Alloc(*dev, n * 4));
  const StreamId lane = *dev->CreateStream("a lane");
  const uint64_t host_waits_before = dev->stats().host_synchronizes;
  int wrong = 0;
  for (int round = 0; round < 10; ++round) {
    float* block = static_cast<float*>(Alloc(*dev, n * 4));
    std::fill(block, block + n, 5.0f);
    for (int i = 0; i < 5; ++i)  // delays before the read
      EXPECT_TRUE(dev->ZeroAsync(pad, n * 4, kComputeStream).ok());
    EXPECT_TRUE(
        dev->ConvertAsync(out, DType::kFloat32, block, DType::kFloat32, n, false, kComputeStream)
            .ok());
    dev->FreeAfter(block, n * 4, *dev->Record(kComputeStream));
    // The next allocation of that size takes the same block (best fit) and writes it.
    float* again = nullptr;
    if (on_stream) {
      Result<void*> p = dev->allocator()->AllocateOn(n * 4, lane);
      EXPECT_TRUE(p.ok()) << p.status();
      again = static_cast<float*>(p.ok() ? *p : nullptr);
      EXPECT_EQ(again, block);
      EXPECT_TRUE(dev->ZeroAsync(again, n * 4, lane).ok());
      EXPECT_TRUE(dev->Synchronize(*dev->Record(lane), HostWait::kOther).ok());
    } else {
      again = static_cast<float*>(Alloc(*dev, n * 4));
      EXPECT_EQ(again, block);
      std::fill(again, again + n, -1.0f);
    }
    EXPECT_TRUE(dev->Synchronize(*dev->Record(kComputeStream), HostWait::kOther).ok());
    if (out[0] != 5.0f) ++wrong;
    dev->allocator()->Free(again, n * 4);
  }
  if (on_stream) {
    // The test's own Synchronize calls only (two a round, when they had to block).
    EXPECT_EQ(dev->stats().host_waits[static_cast<size_t>(HostWait::kArenaReuse)], 0u);
    EXPECT_LE(dev->stats().host_synchronizes - host_waits_before, 20u);
  }
  return wrong;
}

TEST(AsyncDeviceTest, TheArenaReusesABlockOnlyAfterItsLastReader) {
  EXPECT_EQ(ArenaReuseReadsWrong(false, /*on_stream=*/false), 0);
}

TEST(AsyncDeviceTest, AsyncDeviceWithoutTheArenaReuseWaitGoesWrong) {
  EXPECT_GT(ArenaReuseReadsWrong(true, /*on_stream=*/false), 0)
      << "without the wait the delaying device still read the old bytes";
}

TEST(AsyncDeviceTest, TheArenaReusesABlockOnAStreamAfterItsLastReaderOnTheDevice) {
  EXPECT_EQ(ArenaReuseReadsWrong(false, /*on_stream=*/true), 0);
}

TEST(AsyncDeviceTest, AsyncDeviceWithoutTheArenaStreamReuseWaitGoesWrong) {
  EXPECT_GT(ArenaReuseReadsWrong(true, /*on_stream=*/true), 0)
      << "without the wait the delaying device still read the old bytes";
}

// The kernels on a side stream, between the copies that feed and read them: for every
// pair of dtypes, conversion and accumulation are bit-identical to the host's Convert and
// AddInto (the engine relies on it: a GPU run matches a CPU run). ZeroAsync zeroes.
void KernelsMatchTheHostConversions(Device& dev) {
  const size_t n = 3000;
  const size_t bytes = n * 4;
  Pinned src(dev, bytes), init(dev, bytes), out(dev, bytes);
  void* dsrc = Alloc(dev, bytes);
  void* ddst = Alloc(dev, bytes);
  StreamId s = *dev.CreateStream("kernels");
  // Values with bits below every 16-bit format's precision, ties, and large magnitudes.
  std::vector<float> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = (static_cast<float>(i) - 1500.0f) * 1.000123f / 7.0f + (i % 7 == 0 ? 1.0f / 512 : 0);
    b[i] = std::ldexp(static_cast<float>(i % 97) - 48.0f, static_cast<int>(i % 11) - 5) + 0.3f;
  }
  for (DType st : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (bool acc : {false, true}) {
        ConvertFromFloat(a.data(), n, src.v.data(), st);
        ConvertFromFloat(b.data(), n, init.v.data(), dt);
        std::vector<uint8_t> want(init.v.begin(), init.v.begin() + n * DTypeSize(dt));
        if (acc) {
          AddInto(src.v.data(), st, want.data(), dt, n);
        } else {
          Convert(src.v.data(), st, want.data(), dt, n);
        }
        ASSERT_TRUE(
            dev.CopyAsync(dsrc, src.v.data(), n * DTypeSize(st), CopyKind::kHostToDevice, s).ok());
        ASSERT_TRUE(
            dev.CopyAsync(ddst, init.v.data(), n * DTypeSize(dt), CopyKind::kHostToDevice, s).ok());
        ASSERT_TRUE(dev.ConvertAsync(ddst, dt, dsrc, st, n, acc, s).ok());
        ASSERT_TRUE(
            dev.CopyAsync(out.v.data(), ddst, n * DTypeSize(dt), CopyKind::kDeviceToHost, s).ok());
        ASSERT_TRUE(dev.Synchronize(*dev.Record(s), HostWait::kOther).ok());
        EXPECT_EQ(std::memcmp(out.v.data(), want.data(), want.size()), 0)
            << DTypeName(st) << " -> " << DTypeName(dt) << (acc ? " accumulated" : " converted");
      }
    }
  }
  ASSERT_TRUE(dev.ZeroAsync(ddst, bytes, s).ok());
  ASSERT_TRUE(dev.CopyAsync(out.v.data(), ddst, bytes, CopyKind::kDeviceToHost, s).ok());
  ASSERT_TRUE(dev.Synchronize(*dev.Record(s), HostWait::kOther).ok());
  EXPECT_EQ(std::count(out.v.begin(), out.v.end(), 0), static_cast<long>(bytes));
  EXPECT_GE(dev.stats().kernels, 19u);
  dev.allocator()->Free(dsrc, bytes);
  dev.allocator()->Free(ddst, bytes);
}

TEST(AsyncDeviceTest, KernelsMatchTheHostConversionsBitForBit) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true, /*seed=*/5);
  ASSERT_NE(dev, nullptr);
  KernelsMatchTheHostConversions(*dev);
}

// SquaredNormTilesAsync on a side stream, fed and read by copies: CPU-Adam's tile sums of
// the same floats bit for bit (a norm summed from the device's gradients is the host's):
// whole tiles and a short last one, values over many binades (their squares' low bits
// decide the sums' rounding), an inf in one tile and a NaN in another, and an array shorter
// than the 16 lanes.
void NormTilesMatchCpuAdam(Device& dev) {
  constexpr size_t T = CpuAdam::kTileElems;
  Result<std::unique_ptr<CpuAdam>> adam = CpuAdam::Create();
  ASSERT_TRUE(adam.ok()) << adam.status();
  const size_t most = 3 * T + 1001;
  Pinned host(dev, most * sizeof(float)), sums_back(dev, 8 * sizeof(double));
  auto* src = reinterpret_cast<float*>(Alloc(dev, most * sizeof(float)));
  auto* dsums = reinterpret_cast<double*>(Alloc(dev, 8 * sizeof(double)));
  ASSERT_NE(src, nullptr);
  ASSERT_NE(dsums, nullptr);
  StreamId s = *dev.CreateStream("norm");
  const uint64_t kernels_before = dev.stats().kernels;
  struct Case {
    size_t n;
    bool specials;
  };
  for (const Case c : {Case{most, false}, Case{most, true}, Case{2 * T, false}, Case{11, false}}) {
    std::vector<float> x(c.n);
    uint64_t r = 88172645463325252ull + c.n;
    for (size_t i = 0; i < c.n; ++i) {
      r ^= r << 13;
      r ^= r >> 7;
      r ^= r << 17;
      const float m = static_cast<float>(r % 2000001) / 1000000.0f - 1.0f;
      x[i] = std::ldexp(m, static_cast<int>((r >> 24) % 41) - 20);
    }
    if (c.specials) {
      x[T + 5] = std::numeric_limits<float>::infinity();
      x[2 * T + 77] = std::numeric_limits<float>::quiet_NaN();
    }
    const size_t tiles = CpuAdam::NumTiles(c.n);
    std::vector<double> want(tiles);
    ASSERT_TRUE(
        (*adam)->GradSquaredNormTiles(GradSpan::Fp32(std::span<const float>(x)), want).ok());
    std::memcpy(host.v.data(), x.data(), c.n * sizeof(float));
    ASSERT_TRUE(
        dev.CopyAsync(src, host.v.data(), c.n * sizeof(float), CopyKind::kHostToDevice, s).ok());
    ASSERT_TRUE(dev.SquaredNormTilesAsync(src, c.n, T, dsums, s).ok());
    ASSERT_TRUE(
        dev.CopyAsync(sums_back.v.data(), dsums, tiles * sizeof(double), CopyKind::kDeviceToHost, s)
            .ok());
    ASSERT_TRUE(dev.Synchronize(*dev.Record(s), HostWait::kOther).ok());
    std::vector<double> got(tiles);
    std::memcpy(got.data(), sums_back.v.data(), tiles * sizeof(double));
    for (size_t k = 0; k < tiles; ++k) {
      if (std::isnan(want[k])) {
        EXPECT_TRUE(std::isnan(got[k])) << c.n << " elements, tile " << k << ": " << got[k];
      } else {
        EXPECT_EQ(std::memcmp(&got[k], &want[k], sizeof(double)), 0)
            << c.n << " elements, tile " << k << ": " << got[k] << " against CPU-Adam's "
            << want[k];
      }
    }
    if (c.specials) {
      EXPECT_TRUE(std::isinf(got[1])) << got[1];
      EXPECT_TRUE(std::isnan(got[2])) << got[2];
    } else {
      EXPECT_GT(got[0], 0.0);
    }
  }
  EXPECT_EQ(dev.stats().kernels - kernels_before, 4u);
  EXPECT_TRUE(dev.SquaredNormTilesAsync(src, 0, T, dsums, s).ok());  // nothing to do
  const Status bad = dev.SquaredNormTilesAsync(src, 5, 0, dsums, s);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  dev.allocator()->Free(src, most * sizeof(float));
  dev.allocator()->Free(dsums, 8 * sizeof(double));
}

TEST(AsyncDeviceTest, NormTilesMatchCpuAdamBitForBit) {
  auto dev = MakeDevice(2 << 20, /*delaying=*/true, /*seed=*/9);
  ASSERT_NE(dev, nullptr);
  NormTilesMatchCpuAdam(*dev);
}

TEST(AsyncDeviceTest, CopiesFromOrToUnpinnedHostMemoryAreRefused) {
  auto dev = MakeDevice(1 << 20, /*delaying=*/true);
  ASSERT_NE(dev, nullptr);
  std::vector<uint8_t> pageable(4096, 1);
  void* d = Alloc(*dev, 4096);
  StreamId s = *dev->CreateStream("copy");
  Status st = dev->CopyAsync(d, pageable.data(), 4096, CopyKind::kHostToDevice, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("not pinned"), std::string::npos) << st;
  st = dev->CopyAsync(pageable.data(), d, 4096, CopyKind::kDeviceToHost, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  // A range that runs past the registered one is not pinned either.
  Pinned part(*dev, 1024);
  st = dev->CopyAsync(d, part.v.data(), 2048, CopyKind::kHostToDevice, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(dev->RegisterHost(part.v.data() + 100, 10).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(dev->Wait(s, EventId{}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->Record(StreamId{99}).status().code(), StatusCode::kInvalidArgument);
}

TEST(DeviceArenaTest, ReservedOnceBestFitAndCoalescedOnFree) {
  auto dev = MakeDevice(4096, /*delaying=*/false);
  ASSERT_NE(dev, nullptr);
  auto a = dev->allocator();
  EXPECT_EQ(dev->stats().arena_bytes, 4096u);
  void* p1 = Alloc(*dev, 1000);  // 1024 with alignment
  void* p2 = Alloc(*dev, 1024);
  void* p3 = Alloc(*dev, 2048);
  EXPECT_FALSE(a->Fits(1));
  Result<void*> over = a->Allocate(1);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("strata.device_budget"), std::string::npos)
      << over.status();
  a->Free(p2, 1024);
  EXPECT_EQ(dev->stats().largest_free_block, 1024u);
  void* p4 = Alloc(*dev, 512);  // best fit: the hole p2 left
  EXPECT_EQ(p4, p2);
  a->Free(p4, 512);
  a->Free(p1, 1000);
  EXPECT_EQ(dev->stats().largest_free_block, 2048u);  // p1 and p2's blocks joined
  a->Free(p3, 2048);
  EXPECT_EQ(dev->stats().largest_free_block, 4096u);
  EXPECT_EQ(a->usage().bytes_in_use, 0u);
  EXPECT_EQ(a->usage().peak_bytes, 4096u);
}

TEST(DeviceArenaTest, AnArenaThatCannotBeReservedIsAnErrorAtCreation) {
  CpuDeviceOptions o;
  o.budget_bytes = uint64_t{1} << 62;
  Result<std::unique_ptr<Device>> d = MakeCpuDevice(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("strata.device_budget"), std::string::npos) << d.status();
}

// A block freed after an event counts as free for Fits at once (the count is the same on
// every rank) but is handed out again only after the event completed.
TEST(AsyncDeviceTest, FreeAfterReusesABlockOnlyAfterItsEvent) {
  auto dev = MakeDevice(8192, /*delaying=*/true, /*seed=*/3);
  ASSERT_NE(dev, nullptr);
  auto a = dev->allocator();
  Pinned host(*dev, 8192);
  void* d = Alloc(*dev, 8192);
  StreamId s = *dev->CreateStream("copy");
  for (int i = 0; i < 8; ++i)
    ASSERT_TRUE(dev->CopyAsync(host.v.data(), d, 8192, CopyKind::kDeviceToHost, s).ok());
  EventId done = *dev->Record(s);
  dev->FreeAfter(d, 8192, done);
  EXPECT_TRUE(a->Fits(8192));
  void* again = Alloc(*dev, 8192);
  EXPECT_TRUE(*dev->Query(done)) << "the block was handed out before the copies reading it ended";
  EXPECT_EQ(again, d);
  a->Free(again, 8192);
}

// The host waits for a freed block's event only when an allocation reuses its bytes: one
// placed elsewhere returns at once (the host runs ahead of the device), the next one that
// lands on the block waits (HostWait::kArenaReuse).
TEST(AsyncDeviceTest, OnlyAnAllocationThatReusesAFreedBlockWaitsForIt) {
  auto dev = MakeDevice(64 << 10, /*delaying=*/true, /*seed=*/4);
  ASSERT_NE(dev, nullptr);
  const auto reuse_waits = [&] {
    return dev->stats().host_waits[static_cast<size_t>(HostWait::kArenaReuse)];
  };
  void* a = Alloc(*dev, 8 << 10);
  void* b = Alloc(*dev, 8 << 10);
  void* pad = Alloc(*dev, 4 << 10);
  for (int i = 0; i < 20; ++i)  // a reader of `a` behind delayed kernels
    ASSERT_TRUE(dev->ZeroAsync(pad, 4 << 10, kComputeStream).ok());
  ASSERT_TRUE(
      dev->ConvertAsync(pad, DType::kFloat32, a, DType::kFloat32, 1024, false, kComputeStream)
          .ok());
  const EventId read = *dev->Record(kComputeStream);
  dev->FreeAfter(a, 8 << 10, read);
  const uint64_t before = reuse_waits();
  void* c = Alloc(*dev, 16 << 10);  // larger than a's block: placed after the others
  EXPECT_NE(c, a);
  EXPECT_FALSE(*dev->Query(read)) << "an allocation elsewhere waited for the reader";
  EXPECT_EQ(reuse_waits(), before);
  void* d = Alloc(*dev, 8 << 10);  // best fit: a's block
  EXPECT_EQ(d, a);
  EXPECT_TRUE(*dev->Query(read)) << "a's block was handed out before its reader ran";
  EXPECT_EQ(reuse_waits(), before + 1);
  for (auto [p, n] : {std::pair{b, 8 << 10}, {pad, 4 << 10}, {c, 16 << 10}, {d, 8 << 10}})
    dev->allocator()->Free(p, static_cast<size_t>(n));
}

TEST(DeviceArenaTest, NoBudgetMeansNoArena) {
  auto dev = MakeDevice(0, /*delaying=*/false);
  ASSERT_NE(dev, nullptr);
  EXPECT_EQ(dev->stats().arena_bytes, 0u);
  EXPECT_TRUE(dev->allocator()->Fits(size_t{1} << 40));
  void* p = Alloc(*dev, 1 << 20);
  dev->allocator()->Free(p, 1 << 20);
  EXPECT_EQ(dev->allocator()->usage().bytes_in_use, 0u);
}

// ---- The CUDA device: the same semantics on a GPU (SKIPPED without one).

std::unique_ptr<Device> CudaDeviceOrSkip(uint64_t budget, std::string* skip) {
#ifdef STRATA_HAVE_CUDA
  std::string reason;
  if (cuda::DeviceCount(&reason) == 0) {
    *skip = "no usable CUDA device: " + reason;
    return nullptr;
  }
  CudaDeviceOptions o;
  o.budget_bytes = budget;
  Result<std::unique_ptr<Device>> d = MakeCudaDevice(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
#else
  (void)budget;
  *skip = "this build has no CUDA";
  return nullptr;
#endif
}

// Both branches return, so the compiler sees `dev` non-null after it (GCC's -Wnonnull in
// the TSan build of a CUDA-less build otherwise warns about the unreachable uses).
#define CUDA_DEVICE_OR_SKIP(dev, budget)                   \
  std::string skip_reason;                                 \
  auto dev = CudaDeviceOrSkip((budget), &skip_reason);     \
  if (dev == nullptr) {                                    \
    if (!skip_reason.empty()) GTEST_SKIP() << skip_reason; \
    FAIL() << "the CUDA device could not be made";         \
  }                                                        \
  static_assert(true)

TEST(CudaDeviceTest, CopiesAndEventsRoundTripThroughHbm) {
  CUDA_DEVICE_OR_SKIP(dev, 1 << 20);
  const size_t n = 256 << 10;
  Pinned src(*dev, n), back(*dev, n);
  std::iota(src.v.begin(), src.v.end(), 5);
  void* d = Alloc(*dev, n);
  StreamId a = *dev->CreateStream("a"), b = *dev->CreateStream("b");
  void* d2 = Alloc(*dev, n);
  for (int round = 0; round < 100; ++round) {  // 100 > the event ring: slots are reused
    src.v[0] = static_cast<uint8_t>(round);
    ASSERT_TRUE(dev->CopyAsync(d, src.v.data(), n, CopyKind::kHostToDevice, a).ok());
    ASSERT_TRUE(dev->Wait(b, *dev->Record(a)).ok());
    ASSERT_TRUE(dev->CopyAsync(d2, d, n, CopyKind::kDeviceToDevice, b).ok());
    ASSERT_TRUE(dev->CopyAsync(back.v.data(), d2, n, CopyKind::kDeviceToHost, b).ok());
    EventId e = *dev->Record(b);
    ASSERT_TRUE(dev->Synchronize(e, HostWait::kOther).ok());
    EXPECT_TRUE(*dev->Query(e));
    ASSERT_EQ(back.v, src.v) << "round " << round;
  }
  EXPECT_EQ(dev->stats().arena_bytes, 1u << 20);
}

TEST(CudaDeviceTest, KernelsMatchTheHostConversionsBitForBit) {
  CUDA_DEVICE_OR_SKIP(dev, 1 << 20);
  KernelsMatchTheHostConversions(*dev);
}

TEST(CudaDeviceTest, NormTilesMatchCpuAdamBitForBit) {
  CUDA_DEVICE_OR_SKIP(dev, 2 << 20);
  NormTilesMatchCpuAdam(*dev);
}

TEST(CudaDeviceTest, CopiesFromUnpinnedHostMemoryAreRefused) {
  CUDA_DEVICE_OR_SKIP(dev, 1 << 20);
  std::vector<uint8_t> pageable(4096, 1);
  void* d = Alloc(*dev, 4096);
  StreamId s = *dev->CreateStream("copy");
  Status st = dev->CopyAsync(d, pageable.data(), 4096, CopyKind::kHostToDevice, s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("not pinned"), std::string::npos) << st;
}

// The host pool pins its arenas with cudaHostRegister; the engine registers blocks carved
// from them again. Those are used as they are (a second cudaHostRegister of the same pages
// fails), and unregistering them leaves the owner's registration in place.
TEST(CudaDeviceTest, BlocksInsideMemoryPinnedAlreadyAreBorrowed) {
#ifndef STRATA_HAVE_CUDA
  GTEST_SKIP() << "this build has no CUDA";
#else
  CUDA_DEVICE_OR_SKIP(dev, 1 << 20);
  const size_t n = 64 << 10;
  std::vector<uint8_t> owner(n, 7);
  ASSERT_TRUE(cuda::RegisterHost(owner.data(), n).ok());
  uint8_t* block = owner.data() + 1000;  // not page-aligned, shares pages with its neighbours
  ASSERT_TRUE(dev->RegisterHost(block, 1088).ok());
  ASSERT_TRUE(dev->RegisterHost(block + 2000, 1088).ok());
  void* d = Alloc(*dev, 1088);
  StreamId s = *dev->CreateStream("copy");
  ASSERT_TRUE(dev->CopyAsync(d, block, 1088, CopyKind::kHostToDevice, s).ok());
  ASSERT_TRUE(dev->CopyAsync(block + 2000, d, 1088, CopyKind::kDeviceToHost, s).ok());
  ASSERT_TRUE(dev->Synchronize(*dev->Record(s), HostWait::kOther).ok());
  EXPECT_EQ(block[2000], 7);
  ASSERT_TRUE(dev->UnregisterHost(block).ok());
  ASSERT_TRUE(dev->UnregisterHost(block + 2000).ok());
  EXPECT_TRUE(*cuda::IsPinnedHost(owner.data())) << "the owner's registration was undone";
  // A range with one end inside the pinned memory and one outside is refused, not half-used.
  std::vector<uint8_t> other(2 * n);
  ASSERT_TRUE(cuda::RegisterHost(other.data(), n).ok());
  const Status st = dev->RegisterHost(other.data() + n - 100, 4096);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
  EXPECT_TRUE(cuda::UnregisterHost(other.data()).ok());
  EXPECT_TRUE(cuda::UnregisterHost(owner.data()).ok());
  // Memory nobody pinned is registered and unregistered by the device itself.
  std::vector<uint8_t> plain(n);
  ASSERT_TRUE(dev->RegisterHost(plain.data(), n).ok());
  EXPECT_TRUE(*cuda::IsPinnedHost(plain.data()));
  ASSERT_TRUE(dev->UnregisterHost(plain.data()).ok());
  EXPECT_FALSE(*cuda::IsPinnedHost(plain.data()));
#endif
}

TEST(CudaDeviceTest, ArenaRefusesPastTheBudget) {
  CUDA_DEVICE_OR_SKIP(dev, 4096);
  void* p = Alloc(*dev, 4096);
  EXPECT_FALSE(dev->allocator()->Fits(1));
  EXPECT_EQ(dev->allocator()->Allocate(1).status().code(), StatusCode::kResourceExhausted);
  dev->allocator()->Free(p, 4096);
  EXPECT_EQ(dev->stats().largest_free_block, 4096u);
}

}  // namespace
}  // namespace strata::engine

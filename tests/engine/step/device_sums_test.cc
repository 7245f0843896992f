// DeviceSumsStore (engine/step/device_sums.h): the gradient accumulators in device memory
// as a state store. On the delaying CPU device (copies complete late and out of order): a
// lease holds the chunk's device values (fetched, or read ahead), a lease that writes goes
// back to the device, zeroing and rollback act on the device, the norm's tiles are the
// host's bits, and misuse is refused with a message.
#include "strata/engine/step/device_sums.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/engine/device/device.h"
#include "strata/engine/device/tier.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {
namespace {

using offload::Access;
using offload::StateLease;
using offload::StateRange;

constexpr size_t T = CpuAdam::kTileElems;

// Host memory registered with the device, freed (and unregistered) by its owner.
offload::StateAllocator PinnedAllocator(Device* dev) {
  return [dev](size_t bytes, std::string_view) -> Result<offload::StateMemory> {
    std::shared_ptr<std::byte[]> heap(new std::byte[bytes]());
    STRATA_RETURN_IF_ERROR(dev->RegisterHost(heap.get(), bytes));
    std::byte* p = heap.get();
    std::shared_ptr<void> owner(p, [dev, heap](void* q) { (void)dev->UnregisterHost(q); });
    return offload::StateMemory{p, bytes, std::move(owner)};
  };
}

struct DeviceSumsFixture {
  static constexpr size_t kNumel = 3 * T + 100;  // chunks of 2T: one whole, one short
  static constexpr size_t kChunk = 2 * T;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Tier> tier;
  StreamId stream;
  std::unique_ptr<DeviceSumsStore> store;
  offload::StateId id;
  std::vector<float> values;  // what the device holds

  void SetUp(uint64_t seed) {
    CpuDeviceOptions o;
    o.budget_bytes = 4 << 20;
    o.delaying = true;
    o.seed = seed;
    dev = *MakeCpuDevice(o);
    tier = MakeDeviceTier(dev->allocator());
    stream = *dev->CreateStream("gradient shards");
    DeviceSumsOptions so;
    so.device = dev.get();
    so.stream = stream;
    so.device_tier = tier.get();
    so.host_buffers = PinnedAllocator(dev.get());
    so.tile_elems = T;
    Result<std::unique_ptr<DeviceSumsStore>> s = DeviceSumsStore::Create(kNumel, so);
    ASSERT_TRUE(s.ok()) << s.status();
    store = *std::move(s);
    Result<offload::StateId> r =
        store->Register("fp32 gradient accumulators", kNumel * 4, kChunk * 4);
    ASSERT_TRUE(r.ok()) << r.status();
    id = *r;
    // The reducer's additions: values written on the store's stream.
    values.resize(kNumel);
    for (size_t i = 0; i < kNumel; ++i)
      values[i] = std::ldexp(static_cast<float>(i % 977) - 488.0f, static_cast<int>(i % 9) - 4);
    Result<offload::StateMemory> staged = PinnedAllocator(dev.get())(kNumel * 4, "test values");
    ASSERT_TRUE(staged.ok());
    std::memcpy(staged->data, values.data(), kNumel * 4);
    ASSERT_TRUE(dev->CopyAsync(store->device_sums(), staged->data, kNumel * 4,
                               CopyKind::kHostToDevice, stream)
                    .ok());
    EventId e = *dev->Record(stream);
    ASSERT_TRUE(dev->Synchronize(e, HostWait::kOther).ok());
  }
  // Chunk i's elements as the lease shows them.
  std::vector<float> Read(size_t i) {
    Result<StateLease> l = store->Acquire(StateRange{id, i}, Access::kRead);
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return {};
    std::vector<float> out(l->as<float>().begin(), l->as<float>().end());
    EXPECT_TRUE(l->Release().ok());
    return out;
  }
  std::vector<float> Expected(size_t i) const {
    const size_t b = i * kChunk, e = std::min(kNumel, b + kChunk);
    return std::vector<float>(values.begin() + static_cast<long>(b),
                              values.begin() + static_cast<long>(e));
  }
};

TEST(DeviceSumsStoreTest, LeasesHoldTheDevicesValuesAndWritesGoBack) {
  DeviceSumsFixture f;
  f.SetUp(3);
  ASSERT_NE(f.store, nullptr);
  EXPECT_EQ(f.store->num_chunks(f.id), 2u);
  EXPECT_EQ(f.Read(0), f.Expected(0));
  // Read ahead, then leased: the same values, counted as a fetch ahead.
  ASSERT_TRUE(f.store->Prefetch(StateRange{f.id, 1}).ok());
  EXPECT_EQ(f.Read(1), f.Expected(1));
  DeviceSumsStats st = f.store->sums_stats();
  EXPECT_EQ(st.fetches, 2u);
  EXPECT_EQ(st.fetches_ahead, 1u);
  EXPECT_EQ(st.fetch_bytes, f.kNumel * 4);
  EXPECT_EQ(st.buffers, 1u) << "a released buffer is used again";
  // A chunk is held by one lease at a time.
  {
    Result<StateLease> a = f.store->Acquire(StateRange{f.id, 0}, Access::kRead);
    ASSERT_TRUE(a.ok());
    Result<StateLease> b = f.store->Acquire(StateRange{f.id, 0}, Access::kRead);
    EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition) << b.status();
    // Zeroing a chunk leased for reading is allowed: the lease keeps its copy.
    ASSERT_TRUE(f.store->ZeroChunk(StateRange{f.id, 0}).ok());
    std::vector<float> kept(a->as<float>().begin(), a->as<float>().end());
    EXPECT_EQ(kept, f.Expected(0));
  }
  EXPECT_EQ(f.Read(0), std::vector<float>(f.kChunk, 0.0f));
  EXPECT_EQ(f.Read(1), f.Expected(1)) << "zeroing chunk 0 left chunk 1";
  // A lease that writes: back on the device at its release.
  {
    Result<StateLease> w = f.store->Acquire(StateRange{f.id, 1}, Access::kReadWrite);
    ASSERT_TRUE(w.ok());
    w->as<float>()[5] += 1.0f;
    Status z = f.store->ZeroChunk(StateRange{f.id, 1});
    EXPECT_EQ(z.code(), StatusCode::kFailedPrecondition) << z;
    ASSERT_TRUE(w->Release().ok());
  }
  std::vector<float> changed = f.Expected(1);
  changed[5] += 1.0f;
  EXPECT_EQ(f.Read(1), changed);
  EXPECT_EQ(f.store->sums_stats().write_backs, 1u);
  // Rollback: every sum zero (the committed contents are a completed step's).
  ASSERT_TRUE(f.store->Rollback().ok());
  EXPECT_EQ(f.Read(1), std::vector<float>(f.kNumel - f.kChunk, 0.0f));
}

TEST(DeviceSumsStoreTest, NormTilesAreTheHostsBits) {
  DeviceSumsFixture f;
  f.SetUp(11);
  ASSERT_NE(f.store, nullptr);
  Result<std::unique_ptr<CpuAdam>> adam = CpuAdam::Create();
  ASSERT_TRUE(adam.ok()) << adam.status();
  for (size_t i = 0; i < 2; ++i) {
    const std::vector<float> host = f.Expected(i);
    std::vector<double> want(CpuAdam::NumTiles(host.size()));
    ASSERT_TRUE((*adam)->GradSquaredNormTiles(GradSpan::Fp32(host), want).ok());
    std::vector<double> got(want.size(), -1.0);
    ASSERT_TRUE(f.store->NormTiles(StateRange{f.id, i}, got).ok());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(double)), 0)
        << "chunk " << i;
  }
  EXPECT_EQ(f.store->sums_stats().norm_passes, 2u);
  EXPECT_EQ(f.store->sums_stats().fetches, 0u) << "the norm copies no sums to the host";
  std::vector<double> wrong(1);
  EXPECT_EQ(f.store->NormTiles(StateRange{f.id, 0}, wrong).code(), StatusCode::kInvalidArgument);
}

TEST(DeviceSumsStoreTest, OneStateOfTheSumsSizeOnly) {
  DeviceSumsFixture f;
  f.SetUp(5);
  ASSERT_NE(f.store, nullptr);
  Result<offload::StateId> again = f.store->Register("Adam m", f.kNumel * 4, f.kChunk * 4);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition) << again.status();
  EXPECT_NE(again.status().message().find("one state"), std::string::npos) << again.status();
  EXPECT_FALSE(f.store->can_fail());
  EXPECT_EQ(f.store->Acquire(StateRange{f.id, 2}, Access::kRead).status().code(),
            StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace strata::engine

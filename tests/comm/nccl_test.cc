// The NCCL backend.
//
// NcclLayoutTest runs everywhere (host only): the staging layouts that let ncclAllGather /
// ncclReduceScatter serve partitions whose total is not divisible by the world size, and
// the coalesced packing, replayed on host memory against Partition() for W = 1..9.
//
// NcclTest needs a GPU: a world-size-1 NCCL communicator, every collective against the
// reference (with one rank, the all-gather/reduce-scatter/all-reduce/broadcast of a
// buffer is the buffer itself; outputs go to separate, poisoned buffers wherever the
// operation has one), all dtypes, sums and averages, coalesced calls through the staging
// path, async operations, argument errors. Without a GPU every case reports SKIPPED with
// the runtime's reason, and NcclWithoutGpu checks the error CreateCommunicator gives.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/communicator.h"
#include "strata/comm/nccl_layout.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/cuda/cuda.h"

namespace strata::comm {
namespace {

using internal::FlatToSlotsCopies;
using internal::PackedLayout;
using internal::PackItems;
using internal::SlotsToFlatCopies;
using internal::Split;
using internal::StridedCopy;

// ---------------------------------------------------------------------------
// Layouts, on the host.

void Apply(const std::vector<StridedCopy>& copies, uint8_t* dst, const uint8_t* src) {
  for (const StridedCopy& c : copies) {
    ASSERT_GT(c.width, 0u);
    ASSERT_GT(c.rows, 0u);
    ASSERT_GE(c.dst_pitch, c.width);
    ASSERT_GE(c.src_pitch, c.width);
    for (size_t i = 0; i < c.rows; ++i)
      std::memcpy(dst + c.dst_offset + i * c.dst_pitch, src + c.src_offset + i * c.src_pitch,
                  c.width);
  }
}

std::vector<uint8_t> Pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i)
    v[i] = static_cast<uint8_t>(i * 131 + seed * 7 + (i >> 8));
  return v;
}

TEST(NcclLayoutTest, SlotsRoundTripEveryPartition) {
  for (int w = 1; w <= 9; ++w) {
    for (size_t total : {size_t{0}, size_t{1}, size_t{2}, size_t(w - 1), size_t(w), size_t(w + 1),
                         size_t(7 * w + 3), size_t{100}, size_t{1001}}) {
      for (size_t es : {size_t{2}, size_t{4}, size_t{8}}) {
        SCOPED_TRACE("W=" + std::to_string(w) + " total=" + std::to_string(total) +
                     " es=" + std::to_string(es));
        const Split split(total, w);
        EXPECT_EQ(split.chunk, (total + size_t(w) - 1) / size_t(w));
        // A slot pitch wider than the chunk, as in the coalesced packing.
        const size_t pitch = split.chunk * es + 3 * es;
        const std::vector<uint8_t> flat = Pattern(total * es, static_cast<uint8_t>(w));
        std::vector<uint8_t> slots(pitch * size_t(w), 0xEE);
        Apply(FlatToSlotsCopies(split, pitch, es), slots.data(), flat.data());
        for (int q = 0; q < w; ++q) {
          const Shard s = Partition(total, w, q);
          ASSERT_EQ(split.count(q), s.count);
          ASSERT_EQ(0, std::memcmp(slots.data() + size_t(q) * pitch, flat.data() + s.offset * es,
                                   s.count * es))
              << "rank " << q;
          // Nothing beyond the rank's elements was written into its slot.
          for (size_t b = s.count * es; b < pitch; ++b)
            ASSERT_EQ(slots[size_t(q) * pitch + b], 0xEE) << "rank " << q << " byte " << b;
        }
        std::vector<uint8_t> back(total * es, 0x11);
        Apply(SlotsToFlatCopies(split, pitch, es), back.data(), slots.data());
        EXPECT_EQ(back, flat);
        EXPECT_LE(SlotsToFlatCopies(split, pitch, es).size(), 2u);
      }
    }
  }
}

TEST(NcclLayoutTest, CoalescedPackingGathersAndScattersEveryItem) {
  const std::vector<size_t> totals = {5, 0, 1, 64, 13, 2, 1000};
  constexpr size_t es = 4;
  for (int w = 1; w <= 6; ++w) {
    SCOPED_TRACE("W=" + std::to_string(w));
    const PackedLayout layout = PackItems(totals, w);
    ASSERT_EQ(layout.offsets.size(), totals.size());
    size_t slot = 0;
    for (size_t i = 0; i < totals.size(); ++i) {
      EXPECT_EQ(layout.offsets[i], slot);
      slot += Split(totals[i], w).chunk;
    }
    EXPECT_EQ(layout.slot, slot);
    const size_t pitch = layout.slot * es;
    std::vector<std::vector<uint8_t>> fulls;
    for (size_t i = 0; i < totals.size(); ++i)
      fulls.push_back(Pattern(totals[i] * es, static_cast<uint8_t>(i + 1)));

    // All-gather: each rank q packs its shards into slot q; every item unpacks.
    std::vector<uint8_t> staging(pitch * size_t(w), 0);
    for (int q = 0; q < w; ++q) {
      for (size_t i = 0; i < totals.size(); ++i) {
        const Shard s = Partition(totals[i], w, q);
        if (s.count)
          std::memcpy(staging.data() + size_t(q) * pitch + layout.offsets[i] * es,
                      fulls[i].data() + s.offset * es, s.count * es);
      }
    }
    for (size_t i = 0; i < totals.size(); ++i) {
      std::vector<uint8_t> out(totals[i] * es, 0x5A);
      Apply(SlotsToFlatCopies(Split(totals[i], w), pitch, es), out.data(),
            staging.data() + layout.offsets[i] * es);
      EXPECT_EQ(out, fulls[i]) << "item " << i;
    }

    // Reduce-scatter: packing each full buffer puts rank q's slice of item i at slot q.
    std::vector<uint8_t> packed(pitch * size_t(w), 0);
    for (size_t i = 0; i < totals.size(); ++i)
      Apply(FlatToSlotsCopies(Split(totals[i], w), pitch, es),
            packed.data() + layout.offsets[i] * es, fulls[i].data());
    for (int q = 0; q < w; ++q) {
      for (size_t i = 0; i < totals.size(); ++i) {
        const Shard s = Partition(totals[i], w, q);
        EXPECT_EQ(0, std::memcmp(packed.data() + size_t(q) * pitch + layout.offsets[i] * es,
                                 fulls[i].data() + s.offset * es, s.count * es))
            << "rank " << q << " item " << i;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Without a GPU: the error, not a crash or a hang.

TEST(NcclWithoutGpu, CreateReportsFailedPrecondition) {
  std::string reason;
  if (cuda::DeviceCount(&reason) > 0) GTEST_SKIP() << "a CUDA device is present";
  Rendezvous rv;
  rv.store = InProcessStore();
  auto comm = CreateCommunicator(Backend::kNccl, rv, {});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_NE(comm.status().message().find("no CUDA device"), std::string::npos) << comm.status();
}

// ---------------------------------------------------------------------------
// With a GPU: world size 1.

constexpr DType kAllTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64};

// `n` elements of `dtype` holding small integers (exact in every dtype), varying with seed.
std::vector<uint8_t> Values(DType dtype, size_t n, int seed) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i)
    f[i] =
        static_cast<float>(static_cast<int>((i * 7 + static_cast<size_t>(seed) * 13) % 201) - 100);
  std::vector<uint8_t> out(n * DTypeSize(dtype));
  if (n) internal::ConvertFromFloat(dtype, f.data(), out.data(), n);
  return out;
}

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (cuda::DeviceCount(&reason) == 0) GTEST_SKIP() << "no CUDA device: " << reason;
    Rendezvous rv;  // rank 0 of 1
    rv.store = InProcessStore();
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    options.device = Device::Cuda(0);
    auto comm = CreateCommunicator(Backend::kNccl, rv, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(*comm);
    auto stream = cuda::Stream::Create(0);
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(*stream);
  }

  // A device buffer holding `bytes` (or `size` bytes of 0xAB poison when empty).
  cuda::DeviceBuffer Upload(const std::vector<uint8_t>& bytes, size_t size = 0) {
    const size_t n = bytes.empty() ? size : bytes.size();
    auto buf = cuda::DeviceBuffer::Allocate(0, n);
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (!buf.ok()) return {};
    const std::vector<uint8_t> poison(n, 0xAB);
    const std::vector<uint8_t>& src = bytes.empty() ? poison : bytes;
    if (n) {
      EXPECT_TRUE(cuda::CopyHostToDevice(buf->data(), src.data(), n, stream_).ok());
      EXPECT_TRUE(stream_.Synchronize().ok());
    }
    return std::move(*buf);
  }
  std::vector<uint8_t> Download(const void* p, size_t bytes) {
    std::vector<uint8_t> out(bytes);
    if (bytes) {
      EXPECT_TRUE(cuda::CopyDeviceToHost(out.data(), p, bytes, stream_).ok());
      EXPECT_TRUE(stream_.Synchronize().ok());
    }
    return out;
  }

  std::unique_ptr<Communicator> comm_;
  cuda::Stream stream_;
};

const size_t kTotals[] = {0, 1, 5, 1000, (size_t{1} << 20) + 3};

TEST_F(NcclTest, AllGatherEveryDtype) {
  for (DType dtype : kAllTypes) {
    for (size_t total : kTotals) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " total=" + std::to_string(total));
      const auto in = Values(dtype, total, 1);
      auto shard = Upload(in, in.size());
      auto full = Upload({}, in.size());
      ASSERT_TRUE(comm_->AllGather(shard.data(), full.data(), total, dtype).ok());
      EXPECT_EQ(Download(full.data(), in.size()), in);
    }
  }
}

TEST_F(NcclTest, ReduceScatterSumAndAvgEveryDtype) {
  for (DType dtype : kAllTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      for (size_t total : kTotals) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + std::string(ReduceOpName(op)) +
                     " total=" + std::to_string(total));
        const auto in = Values(dtype, total, 2);
        auto full = Upload(in, in.size());
        auto shard = Upload({}, in.size());
        ASSERT_TRUE(comm_->ReduceScatter(full.data(), shard.data(), total, dtype, op).ok());
        EXPECT_EQ(Download(shard.data(), in.size()), in);
      }
    }
  }
}

TEST_F(NcclTest, AllReduceAndBroadcastEveryDtype) {
  for (DType dtype : kAllTypes) {
    for (size_t total : kTotals) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " total=" + std::to_string(total));
      const auto in = Values(dtype, total, 3);
      auto data = Upload(in, in.size());
      ASSERT_TRUE(comm_->AllReduce(data.data(), total, dtype, ReduceOp::kSum).ok());
      EXPECT_EQ(Download(data.data(), in.size()), in);
      ASSERT_TRUE(comm_->AllReduce(data.data(), total, dtype, ReduceOp::kAvg).ok());
      EXPECT_EQ(Download(data.data(), in.size()), in);
      ASSERT_TRUE(comm_->Broadcast(data.data(), total, dtype, 0).ok());
      EXPECT_EQ(Download(data.data(), in.size()), in);
    }
  }
  EXPECT_TRUE(comm_->Barrier().ok());
}

TEST_F(NcclTest, CoalescedCallsGoThroughTheStagingBuffer) {
  const std::vector<size_t> totals = {5, 0, 1, 4096, 13};
  for (DType dtype : kAllTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t es = DTypeSize(dtype);
    std::vector<std::vector<uint8_t>> in;
    std::vector<cuda::DeviceBuffer> a, b;
    for (size_t i = 0; i < totals.size(); ++i) {
      in.push_back(Values(dtype, totals[i], static_cast<int>(i) + 4));
      a.push_back(Upload(in.back(), totals[i] * es));
      b.push_back(Upload({}, totals[i] * es));
    }
    std::vector<GatherItem> gather;
    std::vector<ScatterItem> scatter;
    std::vector<ReduceItem> reduce;
    for (size_t i = 0; i < totals.size(); ++i) {
      gather.push_back({a[i].data(), b[i].data(), totals[i]});
      scatter.push_back({a[i].data(), b[i].data(), totals[i]});
      reduce.push_back({a[i].data(), totals[i]});
    }
    {
      const Status st = comm_->AllGatherCoalescedAsync(gather, dtype)->Wait();
      ASSERT_TRUE(st.ok()) << st;
    }
    for (size_t i = 0; i < totals.size(); ++i)
      EXPECT_EQ(Download(b[i].data(), totals[i] * es), in[i]) << "all_gather item " << i;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      // Fresh (zeroed) outputs; the items must name them, not the freed ones.
      for (size_t i = 0; i < totals.size(); ++i) {
        b[i] = Upload({}, b[i].size());
        scatter[i].shard = b[i].data();
      }
      {
        const Status st = comm_->ReduceScatterCoalescedAsync(scatter, dtype, op)->Wait();
        ASSERT_TRUE(st.ok()) << st;
      }
      for (size_t i = 0; i < totals.size(); ++i)
        EXPECT_EQ(Download(b[i].data(), totals[i] * es), in[i]) << "reduce_scatter item " << i;
      // Separate allocations: packed into the staging buffer and back.
      {
        const Status st = comm_->AllReduceCoalescedAsync(reduce, dtype, op)->Wait();
        ASSERT_TRUE(st.ok()) << st;
      }
      for (size_t i = 0; i < totals.size(); ++i)
        EXPECT_EQ(Download(a[i].data(), totals[i] * es), in[i]) << "all_reduce item " << i;
    }
  }
}

TEST_F(NcclTest, AllReduceCoalescedOverOneContiguousBuffer) {
  const DType dtype = DType::kFloat32;
  const auto in = Values(dtype, 3000, 9);
  auto data = Upload(in, in.size());
  char* base = static_cast<char*>(data.data());
  const std::vector<ReduceItem> items = {{base, 1000}, {base + 4000, 0}, {base + 4000, 2000}};
  ASSERT_TRUE(comm_->AllReduceCoalescedAsync(items, dtype, ReduceOp::kSum)->Wait().ok());
  EXPECT_EQ(Download(data.data(), in.size()), in);
}

TEST_F(NcclTest, ADuplicateIsASecondCommunicatorOnTheSameDevice) {
  Result<std::unique_ptr<Communicator>> dup = comm_->Duplicate();
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_EQ((*dup)->backend(), Backend::kNccl);
  EXPECT_EQ((*dup)->rank(), 0);
  EXPECT_EQ((*dup)->options().device.index, 0);
  const auto in = Values(DType::kFloat32, 4096, 11);
  auto data = Upload(in, in.size());
  ASSERT_TRUE((*dup)->AllReduce(data.data(), 4096, DType::kFloat32, ReduceOp::kSum).ok());
  EXPECT_EQ(Download(data.data(), in.size()), in);
  EXPECT_EQ((*dup)->stats().operations, 1u);
  EXPECT_EQ(comm_->stats().operations, 0u);
}

TEST_F(NcclTest, ManyAsyncOperationsCompleteInOrder) {
  constexpr int kOps = 32;
  constexpr size_t kN = 1 << 16;
  const auto in = Values(DType::kFloat32, kN, 5);
  auto shard = Upload(in, in.size());
  std::vector<cuda::DeviceBuffer> outs;
  std::vector<WorkPtr> works;
  for (int i = 0; i < kOps; ++i) {
    outs.push_back(Upload({}, in.size()));
    works.push_back(comm_->AllGatherAsync(shard.data(), outs.back().data(), kN, DType::kFloat32));
  }
  for (int i = kOps - 1; i >= 0; --i)
    ASSERT_TRUE(works[i]->Wait().ok()) << i;
  for (int i = 0; i < kOps; ++i) {
    EXPECT_TRUE(works[i]->IsCompleted());
    EXPECT_TRUE(works[i]->Wait(std::chrono::milliseconds(1)).ok());  // same result again
    EXPECT_EQ(Download(outs[i].data(), in.size()), in) << i;
  }
  const CommStats stats = comm_->stats();
  EXPECT_EQ(stats.operations, static_cast<uint64_t>(kOps));
  EXPECT_EQ(stats.bytes_sent, 0u);  // nothing leaves a world of one
  EXPECT_EQ(stats.bytes_received, 0u);
}

TEST_F(NcclTest, HostPointersAndBadArgumentsAreInvalidArgument) {
  std::vector<float> host(64, 1.0f);
  auto dev = Upload({}, host.size() * sizeof(float));
  Status s = comm_->AllReduce(host.data(), host.size(), DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("host"), std::string::npos) << s;
  s = comm_->AllGather(host.data(), dev.data(), host.size(), DType::kFloat32);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  s = comm_->Broadcast(dev.data(), host.size(), DType::kFloat32, 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  // Argument errors do not break the communicator.
  EXPECT_TRUE(comm_->AllReduce(dev.data(), host.size(), DType::kFloat32, ReduceOp::kSum).ok());
  EXPECT_TRUE(comm_->Barrier().ok());
}

TEST_F(NcclTest, ReportsItsRankAndBackend) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->world_size(), 1);
  EXPECT_EQ(comm_->backend(), Backend::kNccl);
}

}  // namespace
}  // namespace strata::comm

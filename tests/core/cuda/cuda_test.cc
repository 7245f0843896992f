// The torch-free CUDA layer. Runs where a GPU is present; elsewhere every case reports
// SKIPPED with the reason the runtime gave (no driver, no device).
#include "strata/core/cuda/cuda.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::cuda {
namespace {

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    if (DeviceCount(&reason) == 0) GTEST_SKIP() << "no usable CUDA device: " << reason;
  }
};

TEST_F(CudaTest, DeviceInfoIsPlausible) {
  auto info = GetDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->name.empty());
  EXPECT_GT(info->total_memory, 1ull << 30);
  EXPECT_GE(info->compute_major, 7);
  EXPECT_EQ(info->pci_bus_id.size(), 12u) << info->pci_bus_id;
}

TEST_F(CudaTest, SelfTestKernelRuns) {
  ASSERT_TRUE(SelfTest(0).ok()) << SelfTest(0);
}

TEST_F(CudaTest, RoundTripThroughRegisteredHostMemory) {
  constexpr size_t kN = 1 << 20;
  std::vector<float> src(kN), dst(kN, -1.0f);
  for (size_t i = 0; i < kN; ++i)
    src[i] = static_cast<float>(i) * 0.5f;
  ASSERT_TRUE(RegisterHost(src.data(), kN * sizeof(float)).ok());
  ASSERT_TRUE(RegisterHost(dst.data(), kN * sizeof(float)).ok());
  auto stream = Stream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto buf = DeviceBuffer::Allocate(0, kN * sizeof(float));
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto start = Event::Create(true), end = Event::Create(true);
  ASSERT_TRUE(start.ok() && end.ok());
  ASSERT_TRUE(start->Record(*stream).ok());
  ASSERT_TRUE(CopyHostToDevice(buf->data(), src.data(), kN * sizeof(float), *stream).ok());
  ASSERT_TRUE(CopyDeviceToHost(dst.data(), buf->data(), kN * sizeof(float), *stream).ok());
  ASSERT_TRUE(end->Record(*stream).ok());
  ASSERT_TRUE(end->Synchronize().ok());
  EXPECT_EQ(src, dst);
  auto ms = Event::ElapsedMs(*start, *end);
  ASSERT_TRUE(ms.ok()) << ms.status();
  EXPECT_GE(*ms, 0.0f);
  EXPECT_TRUE(UnregisterHost(src.data()).ok());
  EXPECT_TRUE(UnregisterHost(dst.data()).ok());
  // Unregistering twice is an error with a clear code, not a crash.
  EXPECT_EQ(UnregisterHost(dst.data()).code(), StatusCode::kNotFound);
}

TEST_F(CudaTest, AllocationBeyondMemoryIsResourceExhausted) {
  auto info = GetDeviceInfo(0);
  ASSERT_TRUE(info.ok());
  auto buf = DeviceBuffer::Allocate(0, info->total_memory * 2);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), StatusCode::kResourceExhausted) << buf.status();
}

}  // namespace
}  // namespace strata::cuda

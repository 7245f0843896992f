#include "strata/comm/common.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <exception>
#include <sstream>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/core/topology.h"

namespace strata::comm::internal {

// ---------------------------------------------------------------------------
// CompletionWork

CompletionWork::CompletionWork(std::string description) : description_(std::move(description)) {}
CompletionWork::~CompletionWork() = default;

Status CompletionWork::Wait(std::optional<Millis> timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!timeout.has_value()) {
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }
  if (!cv_.wait_for(lock, *timeout, [&] { return done_; })) {
    return DeadlineExceededError(description_ + ": not complete after " +
                                 std::to_string(timeout->count()) +
                                 " ms of waiting (still queued or running)");
  }
  return status_;
}

bool CompletionWork::IsCompleted() const {
  return done_flag_.load(std::memory_order_acquire);
}

void CompletionWork::Complete(Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_CHECK(!done_) << description_ << " completed twice";
    status_ = std::move(status);
    done_ = true;
    done_flag_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

WorkPtr CompletedWork(Status status) {
  auto work = std::make_shared<CompletionWork>("completed");
  work->Complete(std::move(status));
  return work;
}

// ---------------------------------------------------------------------------
// ScopedBlockSigpipe

static_assert(sizeof(sigset_t) <= 128, "sigset_t larger than the reserved storage");

ScopedBlockSigpipe::ScopedBlockSigpipe() {
  sigset_t pipe_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  sigset_t pending;
  sigemptyset(&pending);
  sigpending(&pending);
  was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  sigset_t old;
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  std::memcpy(old_mask_, &old, sizeof(old));
}

ScopedBlockSigpipe::~ScopedBlockSigpipe() {
  sigset_t pipe_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  if (!was_pending_) {
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_set, nullptr, &zero) == -1 && errno == EINTR) {
      }
    }
  }
  sigset_t old;
  std::memcpy(&old, old_mask_, sizeof(old));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

// ---------------------------------------------------------------------------
// OpQueue

OpQueue::OpQueue(std::string thread_name, std::function<void(const Status&)> on_error)
    : on_error_(std::move(on_error)), thread_name_(std::move(thread_name)) {
  thread_ = std::thread([this] { Run(); });
}

OpQueue::~OpQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

WorkPtr OpQueue::Submit(std::string description, Fn fn) {
  auto work = std::make_shared<CompletionWork>(std::move(description));
  {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_CHECK(!stop_) << "OpQueue::Submit after shutdown";
    if (first_error_.ok()) {
      queue_.push_back(Item{work, std::move(fn)});
      cv_.notify_one();
      return work;
    }
  }
  work->Complete(BrokenError(work->description()));
  return work;
}

Status OpQueue::first_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_error_;
}

Status OpQueue::BrokenError(std::string_view description) const {
  Status first = first_error();
  return FailedPreconditionError(
      std::string(description) +
      ": the communicator is broken by an earlier error: " + first.ToString());
}

void OpQueue::Run() {
  pthread_setname_np(pthread_self(), thread_name_.substr(0, 15).c_str());
  // Transports write to sockets from this thread; a dead peer must be an error, not a
  // SIGPIPE that kills the process.
  const ScopedBlockSigpipe no_sigpipe;
  for (;;) {
    Item item;
    Status broken;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      broken = first_error_;
    }
    Status status;
    if (!broken.ok()) {
      status = FailedPreconditionError(
          item.work->description() +
          ": the communicator is broken by an earlier error: " + broken.ToString());
    } else {
      try {
        status = item.fn();
      } catch (const std::exception& e) {
        status = InternalError(item.work->description() + ": unexpected exception: " + e.what());
      } catch (...) {
        status = InternalError(item.work->description() + ": unexpected unknown exception");
      }
      if (!status.ok()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          first_error_ = status;
        }
        STRATA_LOG(kWarn) << "communicator broken: " << status.ToString();
        if (on_error_) on_error_(status);
      }
    }
    item.work->Complete(std::move(status));
  }
}

// ---------------------------------------------------------------------------
// dtype kernels

float Bf16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBf16(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // qNaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24.
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t FloatToHalf(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u));
  }
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (u < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 leaves the value rounded (to
    // nearest even, by the FPU) to a multiple of 2^-24 in the low mantissa bits.
    const float t = std::bit_cast<float>(u) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(t) - 0x3f000000u));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias the exponent (-112) and round to nearest even
  return static_cast<uint16_t>(sign | (u >> 13));
}

namespace {

#if defined(__x86_64__)
bool HaveF16c() {
  static const bool have = CpuHasF16c();  // F16C and AVX (core/topology.h)
  return have;
}

__attribute__((target("avx,f16c"))) void HalfToFloatF16c(const uint16_t* src, float* dst,
                                                         size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i)
    dst[i] = HalfToFloat(src[i]);
}

__attribute__((target("avx,f16c"))) void FloatToHalfF16c(const float* src, uint16_t* dst,
                                                         size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h =
        _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i)
    dst[i] = FloatToHalf(src[i]);
}
#endif

void HalfToFloatN(const uint16_t* src, float* dst, size_t n) {
#if defined(__x86_64__)
  if (HaveF16c()) return HalfToFloatF16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i)
    dst[i] = HalfToFloat(src[i]);
}

void FloatToHalfN(const float* src, uint16_t* dst, size_t n) {
#if defined(__x86_64__)
  if (HaveF16c()) return FloatToHalfF16c(src, dst, n);
#endif
  for (size_t i = 0; i < n; ++i)
    dst[i] = FloatToHalf(src[i]);
}

// Blocks of 16-bit elements are widened into stack buffers of this many floats.
constexpr size_t kBlock = 1024;

template <typename Combine>
void Reduce16(DType dtype, const void* a, const void* b, void* dst, size_t n, Combine combine) {
  alignas(64) float fa[kBlock];
  alignas(64) float fb[kBlock];
  const auto* pa = static_cast<const uint16_t*>(a);
  const auto* pb = static_cast<const uint16_t*>(b);
  auto* pd = static_cast<uint16_t*>(dst);
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t m = std::min(kBlock, n - off);
    ConvertToFloat(dtype, pa + off, fa, m);
    ConvertToFloat(dtype, pb + off, fb, m);
    for (size_t i = 0; i < m; ++i)
      fa[i] = combine(fa[i], fb[i]);
    ConvertFromFloat(dtype, fa, pd + off, m);
  }
}

}  // namespace

void ConvertToFloat(DType dtype, const void* src, float* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat32:
      if (n > 0 && src != dst) std::memmove(dst, src, n * sizeof(float));
      return;
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i)
        dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kFloat16:
      HalfToFloatN(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kInt64: {
      const auto* s = static_cast<const int64_t*>(src);
      for (size_t i = 0; i < n; ++i)
        dst[i] = static_cast<float>(s[i]);
      return;
    }
  }
  STRATA_CHECK(false) << "bad dtype " << static_cast<int>(dtype);
}

void ConvertFromFloat(DType dtype, const float* src, void* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat32:
      if (n > 0 && src != dst) std::memmove(dst, src, n * sizeof(float));
      return;
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i)
        d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFloat16:
      FloatToHalfN(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::kInt64: {
      auto* d = static_cast<int64_t*>(dst);
      for (size_t i = 0; i < n; ++i)
        d[i] = static_cast<int64_t>(src[i]);
      return;
    }
  }
  STRATA_CHECK(false) << "bad dtype " << static_cast<int>(dtype);
}

void ReduceSum(DType dtype, const void* a, const void* b, void* dst, size_t n) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto* pa = static_cast<const float*>(a);
      const auto* pb = static_cast<const float*>(b);
      auto* pd = static_cast<float*>(dst);
      for (size_t i = 0; i < n; ++i)
        pd[i] = pa[i] + pb[i];
      return;
    }
    case DType::kInt64: {
      const auto* pa = static_cast<const int64_t*>(a);
      const auto* pb = static_cast<const int64_t*>(b);
      auto* pd = static_cast<int64_t*>(dst);
      // Wrap-around on overflow, like NCCL and Gloo (no undefined behaviour).
      for (size_t i = 0; i < n; ++i) {
        pd[i] = static_cast<int64_t>(static_cast<uint64_t>(pa[i]) + static_cast<uint64_t>(pb[i]));
      }
      return;
    }
    case DType::kBFloat16:
    case DType::kFloat16:
      Reduce16(dtype, a, b, dst, n, [](float x, float y) { return x + y; });
      return;
  }
  STRATA_CHECK(false) << "bad dtype " << static_cast<int>(dtype);
}

void ReduceSumDivide(DType dtype, const void* a, const void* b, void* dst, size_t n, int divisor) {
  STRATA_CHECK(divisor >= 1) << divisor;
  switch (dtype) {
    case DType::kFloat32: {
      const auto* pa = static_cast<const float*>(a);
      const auto* pb = static_cast<const float*>(b);
      auto* pd = static_cast<float*>(dst);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i)
        pd[i] = (pa[i] + pb[i]) / d;
      return;
    }
    case DType::kInt64: {
      const auto* pa = static_cast<const int64_t*>(a);
      const auto* pb = static_cast<const int64_t*>(b);
      auto* pd = static_cast<int64_t*>(dst);
      const int64_t d = divisor;
      for (size_t i = 0; i < n; ++i) {
        pd[i] =
            static_cast<int64_t>(static_cast<uint64_t>(pa[i]) + static_cast<uint64_t>(pb[i])) / d;
      }
      return;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      const float d = static_cast<float>(divisor);
      Reduce16(dtype, a, b, dst, n, [d](float x, float y) { return (x + y) / d; });
      return;
    }
  }
  STRATA_CHECK(false) << "bad dtype " << static_cast<int>(dtype);
}

void DivideInPlace(DType dtype, void* data, size_t n, int divisor) {
  STRATA_CHECK(divisor >= 1) << divisor;
  if (divisor == 1) return;
  switch (dtype) {
    case DType::kFloat32: {
      auto* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i)
        p[i] /= d;
      return;
    }
    case DType::kInt64: {
      auto* p = static_cast<int64_t*>(data);
      const int64_t d = divisor;
      for (size_t i = 0; i < n; ++i)
        p[i] /= d;
      return;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      alignas(64) float f[kBlock];
      auto* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t off = 0; off < n; off += kBlock) {
        const size_t m = std::min(kBlock, n - off);
        ConvertToFloat(dtype, p + off, f, m);
        for (size_t i = 0; i < m; ++i)
          f[i] /= d;
        ConvertFromFloat(dtype, f, p + off, m);
      }
      return;
    }
  }
  STRATA_CHECK(false) << "bad dtype " << static_cast<int>(dtype);
}

// ---------------------------------------------------------------------------
// Errors, arguments

std::string RankLabel(Backend backend, int rank, int world_size) {
  std::ostringstream os;
  os << BackendName(backend) << " rank " << rank << " of " << world_size;
  return os.str();
}

std::string OpLabel(std::string_view op, uint64_t seq, size_t count, DType dtype,
                    std::optional<ReduceOp> reduce) {
  std::ostringstream os;
  os << op << " #" << seq << " (" << count << " x " << DTypeName(dtype);
  if (reduce.has_value()) os << ", " << ReduceOpName(*reduce);
  os << ")";
  return os.str();
}

Status ValidateOptions(const CommOptions& options) {
  if (options.timeout < Millis(1)) {
    return InvalidArgumentError("CommOptions.timeout must be at least 1 ms, got " +
                                std::to_string(options.timeout.count()) + " ms");
  }
  return Status::Ok();
}

Status CheckBuffer(const void* ptr, size_t count, std::string_view what) {
  if (count > 0 && ptr == nullptr) {
    return InvalidArgumentError(std::string(what) + " is null with " + std::to_string(count) +
                                " elements");
  }
  return Status::Ok();
}

Status CheckRoot(int root, int world_size) {
  if (root < 0 || root >= world_size) {
    return InvalidArgumentError("broadcast root " + std::to_string(root) +
                                " is not a rank of a world of " + std::to_string(world_size));
  }
  return Status::Ok();
}

std::vector<size_t> CoalescedCounts(std::span<const size_t> totals, int world_size) {
  std::vector<size_t> counts(static_cast<size_t>(world_size), 0);
  for (size_t total : totals) {
    for (int r = 0; r < world_size; ++r)
      counts[r] += Partition(total, world_size, r).count;
  }
  return counts;
}

Result<std::shared_ptr<Store>> CommunicatorStore(const Rendezvous& rendezvous, Backend backend) {
  if (rendezvous.store == nullptr) {
    return InvalidArgumentError("the rendezvous of rank " + std::to_string(rendezvous.rank) +
                                " has no store");
  }
  const std::string base = "strata/" + std::string(BackendName(backend));
  Result<int64_t> n =
      rendezvous.store->Add(base + "/created/" + std::to_string(rendezvous.rank), 1);
  if (!n.ok()) return n.status().WithContext("counting this rank's communicators in the store");
  return PrefixStore(base + "/" + std::to_string(*n - 1), rendezvous.store);
}

}  // namespace strata::comm::internal

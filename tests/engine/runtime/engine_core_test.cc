// EngineCore end to end on one rank and on several ranks as threads: the toy model of
// toy_model.h trained through the engine, compared step by step with the reference Adam.
#include "strata/engine/runtime/engine_core.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "failing_allocator.h"
#include "host_waits.h"
#include "strata/core/topology.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using testing::FailingAllocator;

// Trains `steps` optimizer steps through the engine and the reference side by side,
// expecting agreement to `tol` (loss and parameters, relative) at every step.
void TrainAndCompare(const Config& c, int steps, double tol,
                     std::function<std::vector<int>(int)> seq = Seq,
                     const EngineOptions& options = TestOptions()) {
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init, options);
  ASSERT_NE(e, nullptr);
  Reference ref(AdamParamsFromConfig(c.optimizer), c.gradient_clipping);
  const int gas = static_cast<int>(c.gradient_accumulation_steps);
  int micro = 0;
  for (int step = 0; step < steps; ++step) {
    Params acc = ZerosLike(init);
    for (int k = 0; k < gas; ++k, ++micro) {
      const Batch b = MakeBatch(micro);
      const double lr = e->lr();
      Result<double> loss = EngineMicroStep(*e, seq(micro), b);
      ASSERT_TRUE(loss.ok()) << loss.status();
      const double ref_loss = ref.MicroStep(seq(micro), b, 1.0 / gas, acc);
      EXPECT_NEAR(*loss, ref_loss, tol * std::abs(ref_loss)) << "micro-step " << micro;
      Result<StepOutcome> out = e->Step();
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->applied, k == gas - 1);
      if (k == gas - 1) {
        EXPECT_DOUBLE_EQ(out->lr, lr);
      }
    }
    ref.Step(acc, c.optimizer.lr);
    const double d = RelDiff(EngineParams(*e), ref.p);
    EXPECT_LT(d, tol) << "step " << step;
  }
  const EngineStats s = e->stats();
  EXPECT_EQ(s.optimizer.steps_applied, static_cast<uint64_t>(steps));
  EXPECT_EQ(s.micro_steps, steps * gas);
  // CPU-Adam updated every parameter element at every step (1 + 3 x 30 elements).
  EXPECT_EQ(s.optimizer.params_updated, static_cast<uint64_t>(steps) * 91u);
  EXPECT_GT(s.optimizer.adam_calls, static_cast<uint64_t>(steps));  // sub_group_size 40
  EXPECT_NE(s.ToString().find("CPU optimizer passes"), std::string::npos) << s.ToString();
}

TEST(EngineCoreTest, Fp32MatchesReferenceAdam) {
  TrainAndCompare(BaseConfig(), 12, 1e-6);
}

TEST(EngineCoreTest, GradientAccumulationMatchesReference) {
  Config c = BaseConfig();
  c.gradient_accumulation_steps = 3;
  TrainAndCompare(c, 6, 1e-6);
}

TEST(EngineCoreTest, ClippingMatchesReference) {
  Config c = BaseConfig();
  c.gradient_clipping = 0.05;
  TrainAndCompare(c, 8, 1e-6);
  // The clip actually engaged: check the coefficient on a fresh engine.
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  Result<StepOutcome> out = e->Step();
  ASSERT_TRUE(out.ok());
  EXPECT_GT(out->global_norm, 0.05);
  EXPECT_NEAR(out->clip_coef, 0.05 / (out->global_norm + 1e-6), 1e-12);
}

TEST(EngineCoreTest, OffloadToHostMatchesReference) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  TrainAndCompare(c, 4, 1e-6);
}

// The state store's relocating test mode (STRATA_TEST_RELOCATING_STORE=1): every chunk of
// the optimizer's states moves to a new address at every release and its old bytes become
// NaN, so a component that kept a pointer past its lease would train on NaN. (ctest runs the
// engine suites a second time in this mode.)
TEST(EngineCoreTest, RelocatingStateStoreMatchesReference) {
  ASSERT_EQ(setenv("STRATA_TEST_RELOCATING_STORE", "1", 1), 0);
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  TrainAndCompare(c, 4, 1e-6);
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  ASSERT_TRUE(e->Step().ok());
  EXPECT_EQ(e->stats().store_name, "host (relocating test mode)");
  EXPECT_GT(e->stats().store.relocations, 0u);
  ASSERT_EQ(setenv("STRATA_TEST_RELOCATING_STORE", "yes", 1), 0);
  Result<std::unique_ptr<EngineCore>> bad =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("STRATA_TEST_RELOCATING_STORE"), std::string::npos);
  ASSERT_EQ(unsetenv("STRATA_TEST_RELOCATING_STORE"), 0);
}

// The same on the delaying CPU device: the working shards are staged host->device on a
// copy stream whose every operation is delayed at random, and the engine waits for it.
EngineOptions DelayingOptions(uint64_t seed) {
  EngineOptions o = TestOptions();
  o.cpu_device.delaying = true;
  o.cpu_device.seed = seed;
  return o;
}

TEST(EngineCoreTest, AsyncDeviceOffloadToHostMatchesReference) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  TrainAndCompare(c, 4, 1e-6, Seq, DelayingOptions(21));
}

// Trains `steps` steps on the delaying device next to the reference; returns the worst
// relative loss difference and the final parameters' relative difference.
struct Divergence {
  double worst_loss = 0;
  double params = 0;
};
Divergence TrainBesideReference(const Config& c, const EngineOptions& o, int steps,
                                EngineStats* stats) {
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init, o);
  EXPECT_NE(e, nullptr);
  Divergence d;
  if (e == nullptr) return d;
  Reference ref(AdamParamsFromConfig(c.optimizer), c.gradient_clipping);
  for (int step = 0; step < steps; ++step) {
    const Batch b = MakeBatch(step);
    Result<double> loss = EngineMicroStep(*e, Seq(step), b);
    EXPECT_TRUE(loss.ok()) << loss.status();
    if (!loss.ok()) return d;
    Params acc = ZerosLike(init);
    const double ref_loss = ref.MicroStep(Seq(step), b, 1.0, acc);
    d.worst_loss = std::max(d.worst_loss, std::abs(*loss - ref_loss) / std::abs(ref_loss));
    EXPECT_TRUE(e->Step().ok());
    ref.Step(acc, c.optimizer.lr);
  }
  d.params = RelDiff(EngineParams(*e), ref.p);
  *stats = e->stats();
  return d;
}

// The three tests below leave out one wait each and must go wrong on the delaying device.
// In the relocating test mode the memory the unwaited copy reads or writes is moved and
// freed by the store meanwhile: the mutant then goes wrong in some runs, not in others, and
// under AddressSanitizer it is a use-after-free (what the mode exists to catch), not wrong
// numbers; the plain pass is where they are calibrated.
#define SKIP_MUTATION_TEST_WHEN_RELOCATING()                                                 \
  do {                                                                                       \
    if (RelocatingStoreMode()) {                                                             \
      GTEST_SKIP() << "a mutation test calibrated on the plain store: the relocating store " \
                      "moves and frees the memory the unwaited copy uses";                   \
    }                                                                                        \
  } while (0)

constexpr const char* kNotExposed =
    "without the wait the numbers still matched: the delaying device did not expose the "
    "missing wait";

// Every wait of the engine on a side stream of the device, removed in turn, makes a
// delaying-device test fail (waits on the compute stream cannot: on the CPU device it is
// the calling thread). The first: the shard staging copy before the all-gather.
TEST(EngineCoreTest, AsyncDeviceWithoutTheStagingWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  // An arena: the late copies land in reserved device memory, wrong but not freed memory.
  c.strata.device_budget = 1 << 20;
  EngineOptions o = DelayingOptions(22);
  o.test.coordinator.skip_staging_wait = true;
  EngineStats s;
  EXPECT_GT(TrainBesideReference(c, o, 4, &s).worst_loss, 1e-3) << kNotExposed;
  EXPECT_GT(s.coordinator.shards_staged, 0u);
}

// The second: the device->host copy of the reduced gradient shards before they are added
// into the host accumulators.
TEST(EngineCoreTest, AsyncDeviceWithoutTheGradientShardWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  EngineOptions o = DelayingOptions(23);
  o.test.reducer.skip_shard_wait = true;
  EngineStats s;
  EXPECT_GT(TrainBesideReference(c, o, 4, &s).params, 1e-3) << kNotExposed;
  EXPECT_GT(s.reducer.shard_copies, 0u);
}

// The third: the host->device copy of the updated working shards from their host mirror
// (offload_param = none) before the next all-gather reads them.
TEST(EngineCoreTest, AsyncDeviceWithoutTheWorkingShardCopyWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  EngineOptions o = DelayingOptions(24);
  o.test.skip_working_copy_wait = true;
  EngineStats s;
  EXPECT_GT(TrainBesideReference(c, o, 6, &s).worst_loss, 1e-4) << kNotExposed;
  EXPECT_EQ(s.working_shard_pushes, 7u);  // at creation and after each step
}

// The waits on the compute stream. The CPU device's compute stream is a worker,
// as a GPU's is: the reducer's kernels (a bucket zeroed, the gradients converted into it)
// run there. The fourth: before a bucket's collective reads it, the host waits for them.
TEST(EngineCoreTest, AsyncDeviceWithoutTheBucketInputsWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  EngineOptions o = DelayingOptions(26);
  o.test.reducer.skip_compute_wait = true;
  EngineStats s;
  const Divergence d = TrainBesideReference(c, o, 4, &s);
  EXPECT_FALSE(d.params <= 1e-3) << kNotExposed << " (" << d.params << ")";
  EXPECT_GT(s.reducer.buckets_reduced, 0u);
}

// The fifth: a gradient is read by those kernels after its hook returned and the front end
// freed it (the toy front end poisons a freed gradient with NaN); the engine keeps its
// owner until they ran.
TEST(EngineCoreTest, AsyncDeviceWithoutTheGradientKeepAliveGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  EngineOptions o = DelayingOptions(27);
  o.test.reducer.skip_keep_alive = true;
  EngineStats s;
  const Divergence d = TrainBesideReference(c, o, 4, &s);
  EXPECT_FALSE(d.params <= 1e-3) << kNotExposed << " (" << d.params << ")";
}

// The sixth: at the end of a backward the host waits for the compute stream before the
// step re-gathers the persistent groups into the buffers the backward's last kernels read.
// The toy front end computes on the calling thread, so the test queues what a GPU's
// backward would still have queued after its last gradient hook: a read of the root group's
// gathered (persistent) buffer behind delayed kernels.
int EndOfBackwardReadsWrong(bool skip_wait) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.stage3_param_persistence_threshold = 1;  // the root group stays gathered
  // The last bucket holds layer1 (30 elements) and the root (1), whose gradient comes last
  // and fills it exactly: it is reduced at once, so the backward's end has nothing left to
  // reduce and no bucket's wait for the compute stream comes before the step.
  c.zero.reduce_bucket_size = 31;
  c.strata.device_budget = 1 << 20;
  CpuDeviceOptions dopts;
  dopts.budget_bytes = c.strata.device_budget;
  dopts.delaying = true;
  dopts.seed = 28;
  std::shared_ptr<Device> dev = *MakeCpuDevice(dopts);
  EngineOptions o = TestOptions();
  o.device = dev;
  o.test.skip_end_of_backward_wait = skip_wait;
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), o);
  EXPECT_NE(e, nullptr);
  if (e == nullptr) return -1;
  void* pad = *dev->allocator()->Allocate(4096);
  void* seen = *dev->allocator()->Allocate(64);
  int wrong = 0;
  for (int step = 0; step < 6; ++step) {
    float used = 0;
    auto queue_read = [&] {
      Result<GatheredGroup> root = e->FullBuffer(0);
      EXPECT_TRUE(root.ok()) << root.status();
      if (!root.ok()) return;
      used = ParamValues(*root, 0)[0];
      for (int i = 0; i < 20; ++i)
        EXPECT_TRUE(dev->ZeroAsync(pad, 4096, kComputeStream).ok());
      EXPECT_TRUE(
          dev->CopyAsync(seen, root->data, 4, CopyKind::kDeviceToDevice, kComputeStream).ok());
    };
    EXPECT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step), {}, {}, queue_read).ok());
    EXPECT_TRUE(e->Step().ok());
    EXPECT_TRUE(dev->Synchronize(*dev->Record(kComputeStream), HostWait::kOther).ok());
    float got = 0;
    std::memcpy(&got, seen, 4);
    if (got != used) ++wrong;
  }
  dev->allocator()->Free(pad, 4096);
  dev->allocator()->Free(seen, 64);
  return wrong;
}

TEST(EngineCoreTest, AsyncDeviceTheBackwardsLastKernelsReadWhatTheBackwardUsed) {
  EXPECT_EQ(EndOfBackwardReadsWrong(false), 0);
}

TEST(EngineCoreTest, AsyncDeviceWithoutTheEndOfBackwardWaitGoesWrong) {
  EXPECT_GT(EndOfBackwardReadsWrong(true), 0) << kNotExposed;
}

// A front end whose compute stream changes between hooks (LibTorch's current stream under
// a user's torch.cuda.stream, or autograd's threads): every gradient goes to the engine on
// another stream of the delaying device, and training still matches the reference.
TEST(EngineCoreTest, AsyncDeviceComputeStreamChangingAtEveryGradientMatchesReference) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  CpuDeviceOptions dopts;
  dopts.budget_bytes = c.strata.device_budget;
  dopts.delaying = true;
  dopts.seed = 29;
  std::shared_ptr<Device> dev = *MakeCpuDevice(dopts);
  void* user = *dev->NativeStream(*dev->CreateStream("a user's stream"));
  EngineOptions o = TestOptions();
  o.device = dev;
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init, o);
  ASSERT_NE(e, nullptr);
  Reference ref(AdamParamsFromConfig(c.optimizer), c.gradient_clipping);
  int flips = 0;
  auto flip = [&](int, int, std::vector<float>&) {
    EXPECT_TRUE(e->UseComputeStream(++flips % 2 == 0 ? nullptr : user).ok());
  };
  for (int step = 0; step < 4; ++step) {
    const Batch b = MakeBatch(step);
    Result<double> loss = EngineMicroStep(*e, Seq(step), b, flip);
    ASSERT_TRUE(loss.ok()) << loss.status();
    Params acc = ZerosLike(init);
    const double ref_loss = ref.MicroStep(Seq(step), b, 1.0, acc);
    EXPECT_NEAR(*loss, ref_loss, 1e-6 * std::abs(ref_loss));
    ASSERT_TRUE(e->Step().ok());
    ref.Step(acc, c.optimizer.lr);
  }
  EXPECT_LT(RelDiff(EngineParams(*e), ref.p), 1e-6);
  EXPECT_GT(flips, 8);
}

// The host's waits on the device are named and counted per step: with owners for every
// gradient none is a gradient read, and each kind stays within what the step did.
TEST(EngineCoreTest, HostWaitsPerStepAreNamedAndWithinTheDesign) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), DelayingOptions(30));
  ASSERT_NE(e, nullptr);
  EngineStats before = e->stats();
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step)).ok());
    ASSERT_TRUE(e->Step().ok());
    const EngineStats s = e->stats();
    const Status within = testing::CheckHostWaitsOfAStep(before, s, e->num_groups());
    EXPECT_TRUE(within.ok()) << within;
    EXPECT_GT(s.HostWaitsLastStep(), 0u) << s.ToString();
    EXPECT_GT(s.device_ops.keep_alives, before.device_ops.keep_alives);
    EXPECT_NE(s.ToString().find("host waits on the device"), std::string::npos);
    before = s;
  }
}

// Collectives ordered on the device (lane.h): with lanes of their own (EngineOptions::
// reduce_comm and gather_comm) the host communicators' collectives run queued on device
// streams, after device-side waits for their inputs, and their consumers wait for them on
// the device (LaneOrder::kQueued, the order NCCL's streams get on a GPU). Training matches
// the reference on the delaying device, and the host no longer waits for a bucket's inputs.
EngineOptions QueuedLanes(EngineOptions o) {
  o.reduce_comm = SingleRank();
  o.gather_comm = SingleRank();
  return o;
}

TEST(EngineCoreTest, AsyncDeviceQueuedLanesMatchReference) {
  for (const bool offload_params : {false, true}) {
    SCOPED_TRACE(offload_params ? "offload_param cpu" : "offload_param none");
    Config c = BaseConfig();
    c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    if (offload_params) c.zero.offload_param.device = OffloadDevice::kCpu;
    c.strata.device_budget = 1 << 20;
    EngineStats s;
    const Divergence d = TrainBesideReference(c, QueuedLanes(DelayingOptions(31)), 4, &s);
    EXPECT_LT(d.worst_loss, 1e-6);
    EXPECT_LT(d.params, 1e-6);
    EXPECT_EQ(s.reduce_order, "queued");
    EXPECT_EQ(s.gather_order, "queued");
    EXPECT_GT(s.reducer.buckets_reduced, 0u);
    EXPECT_EQ(s.device_ops.host_waits[static_cast<size_t>(HostWait::kBucketInputs)], 0u)
        << s.ToString();
    // A gathered buffer's first user is a stream (the lane's, or the staging copy's): the
    // arena's reuse waits are on the device.
    EXPECT_EQ(s.device_ops.host_waits[static_cast<size_t>(HostWait::kArenaReuse)], 0u)
        << s.ToString();
    EXPECT_GT(s.coordinator.all_gather_calls, 0u);
    EXPECT_NE(s.ToString().find("reductions queued, all-gathers queued"), std::string::npos)
        << s.ToString();
  }
  // Without lanes the engine's communicator is the host's too: ordered by the host.
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams(), DelayingOptions(31));
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->stats().reduce_order, "host");
  EXPECT_EQ(e->stats().gather_order, "host");
}

// The waits of the device-ordered lanes, each removed in turn. First: the reductions'
// stream waits for the compute stream's writes of a bucket (on NCCL, its stream's
// cudaStreamWaitEvent before the reduce-scatter).
TEST(EngineCoreTest, AsyncDeviceWithoutTheBucketInputsStreamWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  EngineOptions o = QueuedLanes(DelayingOptions(32));
  o.test.reducer.skip_compute_wait = true;
  EngineStats s;
  const Divergence d = TrainBesideReference(c, o, 4, &s);
  EXPECT_FALSE(d.params <= 1e-3) << kNotExposed << " (" << d.params << ")";
  EXPECT_EQ(s.reduce_order, "queued");
}

// Second: the copy stream waits for the reduction before it copies the reduced shards to
// the host.
TEST(EngineCoreTest, AsyncDeviceWithoutTheReductionWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  EngineOptions o = QueuedLanes(DelayingOptions(33));
  o.test.reducer.skip_reduction_wait = true;
  EngineStats s;
  const Divergence d = TrainBesideReference(c, o, 4, &s);
  EXPECT_FALSE(d.params <= 1e-3) << kNotExposed << " (" << d.params << ")";
  EXPECT_GT(s.reducer.shard_copies, 0u);
}

// Third: the compute stream waits for a group's all-gather before the module reads the
// gathered parameters.
TEST(EngineCoreTest, AsyncDeviceWithoutTheAllGatherWaitGoesWrong) {
  SKIP_MUTATION_TEST_WHEN_RELOCATING();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.device_budget = 1 << 20;
  // On demand: a prefetched all-gather is done long before its module runs.
  c.zero.stage3_prefetch_bucket_size = 0;
  EngineOptions o = QueuedLanes(DelayingOptions(34));
  o.test.coordinator.skip_gather_wait = true;
  EngineStats s;
  const Divergence d = TrainBesideReference(c, o, 4, &s);
  EXPECT_FALSE(d.worst_loss <= 1e-3) << kNotExposed << " (" << d.worst_loss << ")";
  EXPECT_EQ(s.gather_order, "queued");
}

TEST(EngineCoreTest, AsyncDeviceWorkingShardsOnTheDeviceMatchReference) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  TrainAndCompare(c, 4, 1e-6, Seq, DelayingOptions(25));
}

// With an NCCL communicator for the device buffers (here a thread communicator that says
// it is one), the host-side collectives need a gloo communicator: refused without, and
// with one, the gradient norm and the initial broadcast go through it and only the
// all-gathers and reduce-scatters through the device communicator.
TEST(EngineCoreTest, HostCollectivesGoThroughTheHostCommunicator) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  const Params init = InitialParams();
  auto device_comm = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(1), 0,
                                                          comm::Backend::kNccl);
  Result<std::unique_ptr<EngineCore>> refused =
      EngineCore::Create(c, device_comm, Groups(init), TestOptions());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("host_comm"), std::string::npos) << refused.status();

  auto host_comm = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(1), 0);
  EngineOptions o = TestOptions();
  o.host_comm = host_comm;
  std::unique_ptr<EngineCore> e = MakeEngine(c, device_comm, init, o);
  ASSERT_NE(e, nullptr);
  const uint64_t at_create = host_comm->operations();  // no broadcast with one rank
  Reference ref(AdamParamsFromConfig(c.optimizer), c.gradient_clipping);
  for (int step = 0; step < 3; ++step) {
    const Batch b = MakeBatch(step);
    ASSERT_TRUE(EngineMicroStep(*e, Seq(step), b).ok());
    Params acc = ZerosLike(init);
    ref.MicroStep(Seq(step), b, 1.0, acc);
    ASSERT_TRUE(e->Step().ok());
    ref.Step(acc, c.optimizer.lr);
  }
  const EngineStats s = e->stats();
  EXPECT_EQ(device_comm->operations(), s.all_gather.calls + s.reduce_scatter.calls);
  EXPECT_EQ(host_comm->operations() - at_create, s.optimizer.norm_all_reduce_calls);
  EXPECT_EQ(s.optimizer.norm_all_reduce_calls, 3u);
  const uint64_t before_gather = host_comm->operations();
  EXPECT_LT(RelDiff(EngineParams(*e), ref.p), 1e-6);  // GatherMasterParams: host collectives
  EXPECT_EQ(host_comm->operations() - before_gather, static_cast<uint64_t>(e->num_groups()));
  EXPECT_EQ(device_comm->operations(), s.all_gather.calls + s.reduce_scatter.calls);
}

TEST(EngineCoreTest, ReduceWithAllReduceAndOneBucket) {
  Config c = BaseConfig();
  c.zero.reduce_scatter = false;
  c.zero.overlap_comm = false;
  c.zero.reduce_bucket_size = 1;  // every group alone in the bucket
  TrainAndCompare(c, 4, 1e-6);
}

// After a step the accumulators hold zeros, and the next gradient of each element is
// written into them without reading them (BulkAddToZeroedFloat); a second gradient of the
// same elements (the next micro-step, or a layer run twice) is added. The first step's
// accumulators were never zeroed by the engine: added. The sums are the reference's
// (TrainAndCompare runs the same configurations).
TEST(EngineCoreTest, GradientsIntoZeroedAccumulatorsAreWrittenOnlyWhereKnownZero) {
  struct Case {
    const char* name;
    int gas;
    std::vector<int> seq;
    uint64_t per_step;  // elements written into zeros per step after the first
  };
  // The partition's 160 elements: each parameter padded to 16 (the root's 16, 48 a layer;
  // the reduced padding is zeros, written too).
  for (const Case& k :
       {Case{"one micro-step", 1, {1, 2, 3}, 160}, Case{"three micro-steps", 3, {1, 2, 3}, 160},
        Case{"layer 2 run twice", 1, {3, 1, 2, 2}, 160},
        Case{"layer 3 left out", 1, {1, 2}, 160 - 48}}) {
    SCOPED_TRACE(k.name);
    Config c = BaseConfig();
    c.gradient_accumulation_steps = k.gas;
    c.zero.stage3_max_reuse_distance = 0;
    const Params init = InitialParams();
    std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init, TestOptions());
    ASSERT_NE(e, nullptr);
    const int steps = 4;
    for (int micro = 0; micro < steps * k.gas; ++micro) {
      Result<double> loss = EngineMicroStep(*e, k.seq, MakeBatch(micro));
      ASSERT_TRUE(loss.ok()) << loss.status();
      ASSERT_TRUE(e->Step().ok());
      EXPECT_EQ(e->stats().optimizer.acc_elements_added_to_zero,
                static_cast<uint64_t>(micro / k.gas) * k.per_step)
          << "micro-step " << micro;
    }
    EXPECT_EQ(e->stats().optimizer.steps_applied, static_cast<uint64_t>(steps));
    EXPECT_EQ(e->stats().optimizer.grad_accumulator_bytes, 160u * sizeof(float));
  }
}

// Lazy zeroing (on by default with the states in host memory): a step leaves its spent
// gradients in the accumulators, known zero. A read of them sees zeros (the stale elements
// are zeroed first), and the next gradient is still written, not added (above).
TEST(EngineCoreTest, SpentGradientsLeftInPlaceReadAsZero) {
  Config c = BaseConfig();
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init, TestOptions());
  ASSERT_NE(e, nullptr);
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(EngineMicroStep(*e, {1, 2, 3}, MakeBatch(step)).ok());
    ASSERT_TRUE(e->Step().ok());
    const uint64_t stale_before = e->stats().optimizer.acc_stale_elements_zeroed;
    // (optimizer() completes the pipelined update first.)
    Result<std::vector<float>> acc = e->optimizer().CopyState(OptimizerState::kGradAccumulator);
    ASSERT_TRUE(acc.ok()) << acc.status();
    EXPECT_EQ(std::count(acc->begin(), acc->end(), 0.0f), 160) << step;
    const EngineStats s = e->stats();
    // 4 chunks (sub_group_size 40) a step; the first step's accumulators were never known
    // zero: its update zeroed them.
    EXPECT_EQ(s.optimizer.acc_chunks_zeroed_lazily, 4u * static_cast<uint64_t>(step)) << step;
    // Zeroed by the read only where a gradient was left (the padding's reduced zeros too).
    EXPECT_EQ(s.optimizer.acc_stale_elements_zeroed - stale_before, step > 0 ? 160u : 0u) << step;
  }
  EXPECT_EQ(e->stats().optimizer.acc_elements_added_to_zero, 2u * 160);
}

TEST(EngineCoreTest, RepeatedAndReorderedLayersStillCorrect) {
  Config c = BaseConfig();
  c.zero.stage3_max_reuse_distance = 0;
  auto seq = [](int micro) {
    return micro % 3 == 2 ? std::vector<int>{3, 1, 2, 2} : std::vector<int>{1, 2, 3};
  };
  TrainAndCompare(c, 9, 1e-6, seq);
}

// Gradients fed late and interleaved across groups (all weights, then all biases), with a
// bucket of one group: groups are reduced in pieces, which must not change the result.
TEST(EngineCoreTest, InterleavedGradientsSplitAcrossBuckets) {
  Config c = BaseConfig();
  c.zero.reduce_bucket_size = 1;  // one group per bucket
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  Reference ref(AdamParamsFromConfig(c.optimizer), 0.0);
  for (int step = 0; step < 4; ++step) {
    const Batch b = MakeBatch(step);
    struct Grad {
      int g, i;
      std::vector<float> v;
    };
    std::vector<Grad> grads;
    Driver d;
    d.acquire = [&](int g, Phase phase) {
      EXPECT_TRUE((phase == Phase::kForward ? e->PreForward(g) : e->PreBackward(g)).ok());
      Result<GatheredGroup> gg = e->FullBuffer(g);
      EXPECT_TRUE(gg.ok());
      std::vector<std::vector<float>> vals;
      for (size_t i = 0; i < e->layout(g).params.size(); ++i)
        vals.push_back(ParamValues(*gg, i));
      return vals;
    };
    d.release = [&](int g, Phase phase) {
      EXPECT_TRUE((phase == Phase::kForward ? e->PostForward(g) : e->PostBackward(g)).ok());
    };
    d.grad = [&](int g, int i, const std::vector<float>& v) { grads.push_back({g, i, v}); };
    ForwardBackward(d, Seq(step), b, 0, kBatch, kBatch, e->LossMultiplier());
    std::stable_sort(grads.begin(), grads.end(),
                     [](const Grad& x, const Grad& y) { return x.i < y.i; });
    for (const Grad& gr : grads)
      ASSERT_TRUE(e->AddGradient(gr.g, gr.i, gr.v.data(), DType::kFloat32).ok());
    ASSERT_TRUE(e->EndBackward().ok());
    ASSERT_TRUE(e->Step().ok());
    Params acc = ZerosLike(init);
    ref.MicroStep(Seq(step), b, 1.0, acc);
    ref.Step(acc, c.optimizer.lr);
    EXPECT_LT(RelDiff(EngineParams(*e), ref.p), 1e-6) << "step " << step;
  }
  // Weights of groups 0..3 then biases of groups 1..3: 4 + 3 slots per backward, each its
  // own bucket.
  EXPECT_EQ(e->stats().reducer.reduce_scatter_calls, 4u * 7u);
}

TEST(EngineCoreTest, StableTracePrefetchesEverythingAfterFirstStep) {
  Config c = BaseConfig();
  // The step inside Step() (a pipelined one leaves each iteration's first fetch on demand:
  // PipelinedStepTest).
  c.strata.pipeline_step = false;
  c.zero.stage3_max_reuse_distance = 0;  // release after every use: every Pre must fetch
  c.zero.stage3_prefetch_bucket_size = 1000;
  c.zero.stage3_max_live_parameters = 200;        // groups are 48 elements padded (W=1)
  c.zero.stage3_param_persistence_threshold = 1;  // the root group stays gathered
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(e->partition().persistent[0]);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  EngineStats s = e->stats();
  EXPECT_EQ(s.coordinator.fetches_on_demand, 6u);  // 3 layers forward + 3 backward
  EXPECT_EQ(s.coordinator.fetches_prefetched, 0u);
  EXPECT_EQ(s.coordinator.persistent_hits, 2u);
  EXPECT_TRUE(s.coordinator.trace_valid);
  EXPECT_EQ(s.coordinator.trace_length, 8u);
  ASSERT_TRUE(e->Step().ok());
  for (int step = 1; step < 5; ++step) {
    ASSERT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step)).ok());
    ASSERT_TRUE(e->Step().ok());
    if (step == 2) {
      // An evaluation forward (no backward) in between: prefetched too, trace untouched.
      e->BeginForwardOnly();
      for (int g : {1, 2, 3, 0}) {
        ASSERT_TRUE(e->PreForward(g).ok());
        ASSERT_TRUE(e->FullBuffer(g).ok());
        ASSERT_TRUE(e->PostForward(g).ok());
      }
      ASSERT_TRUE(e->EndForwardOnly().ok());
    }
  }
  s = e->stats();
  EXPECT_EQ(s.coordinator.fetches_on_demand, 6u) << "on-demand fetches after the first step";
  EXPECT_EQ(s.coordinator.fetches_prefetched, 4u * 6u + 3u);  // + the evaluation forward
  EXPECT_EQ(s.coordinator.prefetches_wasted, 0u);
  EXPECT_EQ(s.coordinator.trace_recordings, 1u);
  EXPECT_EQ(s.coordinator.trace_invalidations, 0u);
  EXPECT_LE(s.coordinator.live_elements_peak, 200u);
  // The last Step prefetched the next iteration's three layers.
  EXPECT_EQ(s.coordinator.live_elements, 3u * 48u);
  // Persistent group: gathered at start and after each of the 5 steps; layers: 6 per step,
  // plus the 3 prefetched for a sixth step.
  EXPECT_EQ(s.all_gather.calls, 1u + 5u + 5u * 6u + 3u + 3u);  // + the evaluation forward
  // Bytes: the root group is 16 fp32 elements padded, each layer 48.
  EXPECT_EQ(s.all_gather.bytes, (1u + 5u) * 16u * 4u + (5u * 6u + 3u + 3u) * 48u * 4u);
  // Every group's gradient reduce-scattered once per backward.
  EXPECT_EQ(s.reduce_scatter.bytes, 5u * (16u + 3u * 48u) * 4u);
  EXPECT_EQ(s.reducer.gradients_received, 5u * 7u);
  EXPECT_EQ(s.all_reduce.calls, 5u);  // one [norm², overflow] all-reduce per step
  EXPECT_EQ(s.optimizer.steps_applied, 5u);
}

TEST(EngineCoreTest, OrderChangeInvalidatesTraceAndRecordsAgain) {
  Config c = BaseConfig();
  c.zero.stage3_max_reuse_distance = 0;
  c.zero.stage3_prefetch_bucket_size = 1000;
  c.strata.pipeline_step = false;  // counts on-demand fetches of the step inside Step()
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  const std::vector<int> a{1, 2, 3}, b{2, 1, 3};
  uint64_t on_demand_after_first_b = 0;
  int step = 0;
  for (const auto& seq : {a, a, b, b, b}) {
    const uint64_t before = e->stats().coordinator.fetches_on_demand;
    ASSERT_TRUE(EngineMicroStep(*e, seq, MakeBatch(step)).ok());
    ASSERT_TRUE(e->Step().ok());
    const uint64_t fetched = e->stats().coordinator.fetches_on_demand - before;
    if (step == 0) {
      EXPECT_EQ(fetched, 8u);  // 4 groups forward and backward
    } else if (step == 1) {
      EXPECT_EQ(fetched, 0u);
    } else if (step == 2) {
      EXPECT_GT(fetched, 0u);  // diverged: on demand
      on_demand_after_first_b = e->stats().coordinator.fetches_on_demand;
    }
    ++step;
  }
  const EngineStats s = e->stats();
  EXPECT_EQ(s.coordinator.trace_recordings, 2u);  // a, then b
  EXPECT_EQ(s.coordinator.trace_invalidations, 1u);
  EXPECT_EQ(s.coordinator.fetches_on_demand, on_demand_after_first_b)
      << "the re-recorded trace was not followed by prefetching";
}

TEST(EngineCoreTest, Fp16OverflowSkipsStepAndLowersScale) {
  Config c = BaseConfig();
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 8;
  c.fp16.hysteresis = 1;
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->dtype(), DType::kFloat16);
  EXPECT_DOUBLE_EQ(e->LossMultiplier(), 256.0);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  Result<StepOutcome> out = e->Step();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->applied);
  EXPECT_FALSE(out->overflow);
  const Params before = EngineParams(*e);
  // Inject an inf into one gradient.
  auto inject = [](int g, int i, std::vector<float>& grad) {
    if (g == 2 && i == 0) grad[3] = std::numeric_limits<float>::infinity();
  };
  ASSERT_TRUE(EngineMicroStep(*e, Seq(1), MakeBatch(1), inject).ok());
  out = e->Step();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->overflow);
  EXPECT_FALSE(out->applied);
  EXPECT_DOUBLE_EQ(e->loss_scale(), 128.0);
  EXPECT_EQ(e->loss_scaler().skipped_steps(), 1);
  EXPECT_EQ(RelDiff(EngineParams(*e), before), 0.0) << "a skipped step changed parameters";
  // The accumulators were cleared: the next step applies normally.
  ASSERT_TRUE(EngineMicroStep(*e, Seq(2), MakeBatch(2)).ok());
  out = e->Step();
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(out->applied);
  EXPECT_EQ(out->adam_step, 2);
  const EngineStats s = e->stats();
  EXPECT_EQ(s.optimizer.steps_skipped, 1u);
  EXPECT_EQ(s.optimizer.steps_applied, 2u);
  EXPECT_EQ(s.global_steps, 3);
}

TEST(EngineCoreTest, Fp16AndBf16TrainCloseToFp32) {
  for (bool fp16 : {true, false}) {
    Config c = BaseConfig();
    c.fp16.enabled = fp16;
    c.fp16.initial_scale_power = 8;  // 2^16 overflows fp16 gradients of this model
    c.bf16 = !fp16;
    const Params init = InitialParams();
    std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
    ASSERT_NE(e, nullptr);
    Reference ref(AdamParamsFromConfig(c.optimizer), 0.0);
    double first = 0.0, last = 0.0;
    for (int step = 0; step < 15; ++step) {
      const Batch b = MakeBatch(step);
      Result<double> loss = EngineMicroStep(*e, Seq(step), b);
      ASSERT_TRUE(loss.ok()) << loss.status();
      Result<StepOutcome> out = e->Step();
      ASSERT_TRUE(out.ok());
      EXPECT_TRUE(out->applied);
      Params acc = ZerosLike(init);
      ref.MicroStep(Seq(step), b, 1.0, acc);
      ref.Step(acc, c.optimizer.lr);
      if (step == 0) first = *loss;
      last = *loss;
    }
    EXPECT_LT(last, first) << (fp16 ? "fp16" : "bf16");
    // The master weights follow fp32 training closely (16-bit forward/backward only).
    EXPECT_LT(RelDiff(EngineParams(*e), ref.p), fp16 ? 2e-3 : 2e-2) << (fp16 ? "fp16" : "bf16");
  }
}

TEST(EngineCoreTest, DeviceBudgetBelowTwoGroupsIsRefusedWithNumbers) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.strata.device_budget = 300;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  const std::string msg = e.status().message();
  EXPECT_NE(msg.find("strata.device_budget = 300 bytes"), std::string::npos) << msg;
  // Two groups of 48 fp32 elements (192 bytes each) and two buckets.
  EXPECT_NE(msg.find("two largest groups gathered 384 bytes"), std::string::npos) << msg;
}

TEST(EngineCoreTest, SmallDeviceBudgetTrainsWithinItsHighWater) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.stage3_max_reuse_distance = 0;
  c.zero.reduce_bucket_size = 48;
  c.zero.overlap_comm = false;
  // Minimum: 2 x 192 (two groups) + 192 (one bucket, reduced in place on one rank) + 64
  // (its park) = 640, and a group's worth more for the arena's first fit (a freed group's
  // block beside the park), well below the model's 4 x 192 gathered + buckets.
  c.strata.device_budget = 832;
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  Reference ref(AdamParamsFromConfig(c.optimizer), 0.0);
  for (int step = 0; step < 4; ++step) {
    const Batch b = MakeBatch(step);
    Result<double> loss = EngineMicroStep(*e, Seq(step), b);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(e->Step().ok());
    Params acc = ZerosLike(init);
    ref.MicroStep(Seq(step), b, 1.0, acc);
    ref.Step(acc, c.optimizer.lr);
  }
  EXPECT_LT(RelDiff(EngineParams(*e), ref.p), 1e-6);
  const EngineStats s = e->stats();
  EXPECT_LE(s.device.usage.peak_bytes, 832u);
  EXPECT_GT(s.device.usage.peak_bytes, 0u);
  ASSERT_TRUE(s.host.has_value());
  EXPECT_GT(s.host->usage.bytes_in_use, 0u);
  EXPECT_EQ(s.optimizer_tier, TierKind::kHost);
}

TEST(EngineCoreTest, DeviceBudgetFullEvictsKeptGroups) {
  // Default reuse distance: every group used again in this iteration stays gathered, until
  // the device budget refuses the next fetch; then the unused group needed last goes.
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.reduce_bucket_size = 48;
  c.zero.overlap_comm = false;
  c.strata.device_budget = 768;
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  Reference ref(AdamParamsFromConfig(c.optimizer), 0.0);
  for (int step = 0; step < 4; ++step) {
    const Batch b = MakeBatch(step);
    Result<double> loss = EngineMicroStep(*e, Seq(step), b);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(e->Step().ok());
    Params acc = ZerosLike(init);
    ref.MicroStep(Seq(step), b, 1.0, acc);
    ref.Step(acc, c.optimizer.lr);
  }
  EXPECT_LT(RelDiff(EngineParams(*e), ref.p), 1e-6);
  const EngineStats s = e->stats();
  EXPECT_GT(s.coordinator.evictions, 0u);
  EXPECT_GT(s.coordinator.fetches_reused, 0u);
  EXPECT_LE(s.device.usage.peak_bytes, 832u);
}

// Every rank must issue the same collectives: a prefetch is skipped only where the device
// budget's count (the same on every rank) is full, never because an allocation failed on
// this rank. An allocation that fails although it fits is an error of the step.
TEST(EngineCoreTest, AnAllocationFailureIsAnErrorNotASkippedPrefetch) {
  Config c = BaseConfig();
  c.zero.stage3_max_reuse_distance = 0;  // release after every use: every Pre fetches
  c.zero.stage3_prefetch_bucket_size = 1000;
  c.zero.stage3_param_persistence_threshold = 1;
  const Params init = InitialParams();
  auto alloc = std::make_shared<FailingAllocator>(0, /*fail_at=*/2, /*armed=*/false);
  EngineOptions o = TestOptions();
  o.device_allocator = alloc;
  Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(c, SingleRank(), Groups(init), o);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE(EngineMicroStep(**e, Seq(0), MakeBatch(0)).ok());  // records the trace
  ASSERT_TRUE((*e)->Step().ok());  // prefetches the next iteration's first layers
  ASSERT_TRUE(EngineMicroStep(**e, Seq(1), MakeBatch(1)).ok());
  // Step's prefetch of the next iteration: its first allocation succeeds, the second fails
  // although the budget fits. Skipping that prefetch would let this rank issue its
  // all-gathers in another order than the others (the on-demand fetch later succeeds).
  alloc->Arm();
  Result<StepOutcome> out = (*e)->Step();
  Status st = out.ok() ? EngineMicroStep(**e, Seq(2), MakeBatch(2)).status() : out.status();
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.ToString().find("injected: out of memory"), std::string::npos) << st;
}

// With strata.device_budget 0 the device's own budget (the CUDA device's half of the free
// memory) is what the start-up check holds the model against, with the numbers.
TEST(EngineCoreTest, TheDevicesOwnBudgetIsCheckedWhenTheConfigNamesNone) {
  Config c = BaseConfig();
  ASSERT_EQ(c.strata.device_budget, 0u);
  const Params init = InitialParams();
  EngineOptions o = TestOptions();
  o.device_allocator = std::make_shared<FailingAllocator>(/*budget=*/256, /*fail_at=*/0);
  Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(c, SingleRank(), Groups(init), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  const std::string what = e.status().ToString();
  EXPECT_NE(what.find("strata.device_budget is 0; the budget of the failing arena (on a GPU, "
                      "half its free memory) = 256 bytes"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("or set strata.device_budget"), std::string::npos) << what;
  // A device budget that holds the model: it trains.
  o.device_allocator = std::make_shared<FailingAllocator>(/*budget=*/1 << 20, /*fail_at=*/0);
  e = EngineCore::Create(c, SingleRank(), Groups(init), o);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE(EngineMicroStep(**e, Seq(0), MakeBatch(0)).ok());
  ASSERT_TRUE((*e)->Step().ok());
}

TEST(EngineCoreTest, LearningRateFollowsScheduleAndOverride) {
  Config c = BaseConfig();
  c.scheduler.type = SchedulerType::kWarmupLR;
  c.scheduler.warmup_min_lr = 0.0;
  c.scheduler.warmup_max_lr = 0.01;
  c.scheduler.warmup_num_steps = 4;
  c.scheduler.warmup_type = WarmupType::kLinear;
  Result<LrSchedule> sched = LrSchedule::Create(c.scheduler, c.optimizer);
  ASSERT_TRUE(sched.ok());
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  std::vector<double> lrs;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      ASSERT_TRUE(e->set_lr(0.5).ok());
    }
    EXPECT_DOUBLE_EQ(e->lr(), step == 3 ? 0.5 : sched->LrAt(step));
    ASSERT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step)).ok());
    Result<StepOutcome> out = e->Step();
    ASSERT_TRUE(out.ok());
    lrs.push_back(out->lr);
  }
  EXPECT_DOUBLE_EQ(lrs[0], sched->LrAt(0));
  EXPECT_DOUBLE_EQ(lrs[1], sched->LrAt(1));
  EXPECT_DOUBLE_EQ(lrs[3], 0.5);             // the override holds for one step
  EXPECT_DOUBLE_EQ(lrs[4], sched->LrAt(4));  // then the schedule resumes
  EXPECT_DOUBLE_EQ(lrs[5], sched->LrAt(5));
}

// OneCycle from a JSON config: its learning rate and Adam betas reach CPU-Adam at every
// step (the reference Adam takes the same per-step values); the cycle crosses its top and
// returns within the run.
TEST(EngineCoreTest, OneCycleSetsTheRateAndBetasOfEveryStep) {
  Result<Config> c = ParseConfig(R"({
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02,
      "cycle_first_step_size": 3, "cycle_second_step_size": 4, "cycle_min_mom": 0.85,
      "cycle_max_mom": 0.95}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
      "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64, "sub_group_size": 40}
  })");
  ASSERT_TRUE(c.ok()) << c.status();
  Result<LrSchedule> sched = LrSchedule::Create(c->scheduler, c->optimizer);
  ASSERT_TRUE(sched.ok()) << sched.status();
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(*c, SingleRank(), init);
  ASSERT_NE(e, nullptr);
  Reference ref(AdamParamsFromConfig(c->optimizer), c->gradient_clipping);
  for (int step = 0; step < 9; ++step) {
    const Batch b = MakeBatch(step);
    ASSERT_TRUE(EngineMicroStep(*e, Seq(step), b).ok());
    Params acc = ZerosLike(init);
    ref.MicroStep(Seq(step), b, 1.0, acc);
    Result<StepOutcome> out = e->Step();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_DOUBLE_EQ(out->lr, sched->LrAt(step));
    const auto betas = sched->BetasAt(step);
    ASSERT_TRUE(betas.has_value());
    ref.hp.beta1 = betas->first;
    ref.hp.beta2 = betas->second;
    ref.Step(acc, sched->LrAt(step));
    EXPECT_LT(RelDiff(EngineParams(*e), ref.p), 1e-6) << "step " << step;
  }
  EXPECT_DOUBLE_EQ(sched->LrAt(3), 0.02);  // the top of the cycle was reached
  EXPECT_DOUBLE_EQ(sched->BetasAt(3)->first, 0.85);
}

// strata.numa_node reaches both the host tier's pages and CPU-Adam's threads; -1 on the
// CPU device (no PCI bus) binds nothing; a node this machine lacks, or a caller's CpuAdam
// node that disagrees with the config's, is refused with the key named.
TEST(EngineCoreTest, NumaNodeBindsTheHostTierAndCpuAdamsThreads) {
  Result<Topology> topo = Topology::Discover();
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_FALSE(topo->numa_nodes().empty());
  const int node = topo->numa_nodes().front().os_index;
  {
    CpuAdam::Options pinned;
    pinned.numa_node = node;
    Result<std::unique_ptr<CpuAdam>> probe = CpuAdam::Create(pinned);
    if (!probe.ok()) {
      GTEST_SKIP() << "oneTBB cannot pin CPU-Adam's threads to NUMA node " << node
                   << " in this build: " << probe.status();
    }
  }
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  {
    std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->stats().numa_node, -1);
    EXPECT_NE(e->stats().ToString().find("CPU-Adam: 1 threads, not bound to a NUMA node"),
              std::string::npos)
        << e->stats().ToString();
  }
  c.strata.numa_node = node;
  {
    std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->stats().numa_node, node);
    EXPECT_EQ(e->stats().cpu_adam_threads, 1);
    EXPECT_NE(e->stats().ToString().find("on NUMA node " + std::to_string(node)), std::string::npos)
        << e->stats().ToString();
    ASSERT_NE(e->host_tier(), nullptr);
    // It trains as before.
    Result<double> loss = EngineMicroStep(*e, Seq(0), MakeBatch(0));
    ASSERT_TRUE(loss.ok()) << loss.status();
    ASSERT_TRUE(e->Step().ok());
  }
  // A node this machine lacks.
  c.strata.numa_node = 1000;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("1000"), std::string::npos) << e.status();
  EXPECT_NE(e.status().message().find("numa_node"), std::string::npos) << e.status();
  // The caller's CpuAdam node against the config's.
  c.strata.numa_node = node;
  EngineOptions o = TestOptions();
  o.cpu_adam.numa_node = node + 1;
  e = EngineCore::Create(c, SingleRank(), Groups(InitialParams()), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find(
                "strata.numa_node = " + std::to_string(node) +
                " but EngineOptions::cpu_adam.numa_node = " + std::to_string(node + 1)),
            std::string::npos)
      << e.status();
}

TEST(EngineCoreTest, ConfigFromJsonAndWorldSizeMismatch) {
  Result<Config> c = ParseConfig(R"({
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}
  })",
                                 {.world_size = 2});
  ASSERT_TRUE(c.ok()) << c.status();
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(*c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("world size 2 but the communicator has 1"), std::string::npos)
      << e.status();
  // Parsed for one rank, it builds; AdamW maps to decoupled weight decay.
  c = ParseConfig(R"({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  e = EngineCore::Create(*c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(AdamParamsFromConfig(c->optimizer).weight_decay_mode, WeightDecayMode::kDecoupled);
  EXPECT_EQ((*e)->stats().optimizer_tier, TierKind::kHost);
  EXPECT_EQ((*e)->stats().param_tier, TierKind::kDevice);
  ASSERT_NE((*e)->host_tier(), nullptr);
  EXPECT_EQ((*e)->device_tier()->kind(), TierKind::kDevice);
  EXPECT_EQ((*e)->optimizer().CopyState(OptimizerState::kMaster)->size(),
            (*e)->partition().partition_numel);
  EXPECT_EQ((*e)->optimizer().adam_step(), 0);
}

// Every collective of two training steps fails in turn: the engine returns the error
// (with its context) from the call that waited for it, and shuts down cleanly.
class FailingCommunicator final : public comm::Communicator {
 public:
  FailingCommunicator(std::shared_ptr<comm::Communicator> inner, uint64_t fail_at)
      : inner_(std::move(inner)), fail_at_(fail_at) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  comm::Backend backend() const override { return inner_->backend(); }
  const comm::CommOptions& options() const override { return inner_->options(); }
  comm::CommStats stats() const override { return inner_->stats(); }
  comm::WorkPtr AllGatherAsync(const void* a, void* b, size_t n, comm::DType t) override {
    return Maybe(inner_->AllGatherAsync(a, b, n, t), "all-gather");
  }
  comm::WorkPtr ReduceScatterAsync(const void* a, void* b, size_t n, comm::DType t,
                                   comm::ReduceOp op) override {
    return Maybe(inner_->ReduceScatterAsync(a, b, n, t, op), "reduce-scatter");
  }
  comm::WorkPtr AllReduceAsync(void* a, size_t n, comm::DType t, comm::ReduceOp op) override {
    return Maybe(inner_->AllReduceAsync(a, n, t, op), "all-reduce");
  }
  comm::WorkPtr BroadcastAsync(void* a, size_t n, comm::DType t, int root) override {
    return Maybe(inner_->BroadcastAsync(a, n, t, root), "broadcast");
  }
  comm::WorkPtr BarrierAsync() override { return Maybe(inner_->BarrierAsync(), "barrier"); }
  comm::WorkPtr AllGatherCoalescedAsync(std::span<const comm::GatherItem> items,
                                        comm::DType t) override {
    return Maybe(inner_->AllGatherCoalescedAsync(items, t), "all-gather");
  }
  comm::WorkPtr ReduceScatterCoalescedAsync(std::span<const comm::ScatterItem> items, comm::DType t,
                                            comm::ReduceOp op) override {
    return Maybe(inner_->ReduceScatterCoalescedAsync(items, t, op), "reduce-scatter");
  }
  comm::WorkPtr AllReduceCoalescedAsync(std::span<const comm::ReduceItem> items, comm::DType t,
                                        comm::ReduceOp op) override {
    return Maybe(inner_->AllReduceCoalescedAsync(items, t, op), "all-reduce");
  }
  uint64_t issued() const { return issued_; }

 private:
  comm::WorkPtr Maybe(comm::WorkPtr work, const char* what) {
    if (issued_++ < fail_at_) return work;
    return std::make_shared<testing::DoneWork>(
        UnavailableError(std::string("injected failure of ") + what));
  }
  std::shared_ptr<comm::Communicator> inner_;
  uint64_t fail_at_;
  uint64_t issued_ = 0;
};

TEST(EngineCoreTest, CommunicationFailuresSurfaceAsErrors) {
  Config c = BaseConfig();
  c.zero.stage3_max_reuse_distance = 0;
  c.zero.stage3_param_persistence_threshold = 1;
  const Params init = InitialParams();
  // How many collectives two steps issue.
  auto counter = std::make_shared<FailingCommunicator>(SingleRank(), UINT64_MAX);
  {
    std::unique_ptr<EngineCore> e = MakeEngine(c, counter, init);
    ASSERT_NE(e, nullptr);
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(EngineMicroStep(*e, Seq(step), MakeBatch(step)).ok());
      ASSERT_TRUE(e->Step().ok());
    }
  }
  const uint64_t total = counter->issued();
  ASSERT_GT(total, 10u);
  for (uint64_t fail_at = 0; fail_at < total; ++fail_at) {
    auto comm = std::make_shared<FailingCommunicator>(SingleRank(), fail_at);
    Result<std::unique_ptr<EngineCore>> created =
        EngineCore::Create(c, comm, Groups(init), TestOptions());
    Status error = created.status();
    if (created.ok()) {
      EngineCore& e = **created;
      // A third step waits for the prefetches the second one issued.
      for (int step = 0; step < 3 && error.ok(); ++step) {
        Result<double> loss = EngineMicroStep(e, Seq(step), MakeBatch(step));
        error = loss.status();
        if (error.ok()) error = e.Step().status();
      }
    }
    // The persistent group's first all-gather is only waited for at its first use, so
    // even a failure of the very first collective surfaces from a later call.
    ASSERT_FALSE(error.ok()) << "collective " << fail_at << " failed silently";
    EXPECT_EQ(error.code(), StatusCode::kUnavailable) << error;
    EXPECT_NE(error.message().find("injected failure"), std::string::npos) << error;
    const bool has_context = error.message().find("all-gather of group") != std::string::npos ||
                             error.message().find("gradient reduction") != std::string::npos ||
                             error.message().find("gradient norm") != std::string::npos;
    EXPECT_TRUE(has_context) << error;
  }
}

TEST(EngineCoreTest, MisuseIsFailedPrecondition) {
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> e = MakeEngine(BaseConfig(), SingleRank(), init);
  ASSERT_NE(e, nullptr);
  auto expect_fp = [](const Status& s, const std::string& fragment) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s;
  };
  expect_fp(e->Step().status(), "before any backward");
  expect_fp(e->PreForward(99), "unknown group");
  expect_fp(e->PostForward(1), "without PreForward(1)");
  expect_fp(e->FullBuffer(1).status(), "not gathered");
  expect_fp(e->AddGradient(7, 0, nullptr, DType::kFloat32), "unknown group");
  expect_fp(e->AddGradient(1, 5, nullptr, DType::kFloat32), "has no parameter 5");
  ASSERT_TRUE(e->PreForward(1).ok());
  expect_fp(e->PostBackward(1), "without PreBackward(1)");
  expect_fp(e->EndBackward(), "still in use");
  ASSERT_TRUE(e->PostForward(1).ok());
  ASSERT_TRUE(e->EndBackward().ok());
  ASSERT_TRUE(e->Step().ok());
  expect_fp(e->Step().status(), "twice");
}

// CPU-Adam's threads: strata.cpu_adam_threads, else this rank's share of the cores it may
// use among the ranks with the same machine, mask and node (here: ranks as threads of one
// process, so every rank's); the caller's EngineOptions count disagreeing is refused.
TEST(EngineCoreTest, CpuAdamTakesItsRanksShareOfTheCores) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  EngineOptions automatic = TestOptions();
  automatic.cpu_adam.num_threads = 0;
  const int cores = CpuAdam::AvailableThreads(-1);
  ASSERT_GE(cores, 1);
  // What an arena of n threads has in this build (a ThreadSanitizer build runs on one).
  auto arena = [](int n) {
    CpuAdam::Options o;
    o.num_threads = n;
    Result<std::unique_ptr<CpuAdam>> a = CpuAdam::Create(o);
    return a.ok() ? (*a)->num_threads() : -1;
  };
  auto run = [&](const Config& config, const EngineOptions& o, int world) {
    auto group = std::make_shared<ThreadGroup>(world);
    std::vector<EngineStats> stats(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(
            config, std::make_shared<ThreadCommunicator>(group, r), Groups(InitialParams()), o);
        ASSERT_TRUE(e.ok()) << e.status();
        stats[static_cast<size_t>(r)] = (*e)->stats();
      });
    }
    for (auto& t : threads)
      t.join();
    return stats;
  };
  for (const EngineStats& s : run(c, automatic, 1)) {
    EXPECT_EQ(s.cpu_adam_cores, cores);
    EXPECT_EQ(s.cpu_adam_ranks_sharing, 1);
    EXPECT_EQ(s.cpu_adam_threads, arena(cores));
  }
  for (const EngineStats& s : run(c, automatic, 3)) {
    EXPECT_EQ(s.cpu_adam_ranks_sharing, 3);
    EXPECT_EQ(s.cpu_adam_threads, arena(std::max(1, cores / 3)));
    EXPECT_NE(s.ToString().find("cores this rank may use, shared by 3 ranks of this machine"),
              std::string::npos)
        << s.ToString();
  }
  // The key sets the count, whatever the ranks; the caller's agreeing count is accepted.
  c.strata.cpu_adam_threads = 3;
  for (const EngineStats& s : run(c, automatic, 2)) {
    EXPECT_EQ(s.cpu_adam_ranks_sharing, 2);
    EXPECT_EQ(s.cpu_adam_threads, arena(3));
  }
  EngineOptions three = TestOptions();
  three.cpu_adam.num_threads = 3;
  EXPECT_EQ(run(c, three, 1)[0].cpu_adam_threads, arena(3));
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find(
                "strata.cpu_adam_threads = 3 but EngineOptions::cpu_adam.num_threads = 1"),
            std::string::npos)
      << e.status();
}

// ---------------------------------------------------------------------------
// Several ranks as threads: the same results as one rank, each rank holding 1/W.

std::vector<RankResult> RunRanks(const Config& c, int world, int steps) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<RankResult> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      results[static_cast<size_t>(r)] =
          RunRank(c, std::make_shared<ThreadCommunicator>(group, r), steps);
    });
  }
  for (auto& t : threads)
    t.join();
  return results;
}

class MultiRankTest : public ::testing::TestWithParam<int> {};

TEST_P(MultiRankTest, SameResultsAsOneRankWithOneWthOfTheState) {
  const int world = GetParam();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.stage3_max_reuse_distance = 0;
  c.gradient_clipping = 0.5;
  const int steps = 6;
  const std::vector<RankResult> one = RunRanks(c, 1, steps);
  ASSERT_TRUE(one[0].status.ok()) << one[0].status;
  const std::vector<RankResult> many = RunRanks(c, world, steps);
  uint64_t master_total = 0;
  for (int r = 0; r < world; ++r) {
    const RankResult& rr = many[static_cast<size_t>(r)];
    ASSERT_TRUE(rr.status.ok()) << "rank " << r << ": " << rr.status;
    EXPECT_LT(RelDiff(rr.params, one[0].params), 1e-6) << "rank " << r;
    master_total += rr.stats.optimizer.master_bytes;
    // Each rank holds 1/W of the (padded) partition.
    EXPECT_EQ(rr.stats.optimizer.master_bytes, many[0].stats.optimizer.master_bytes);
    EXPECT_EQ(rr.stats.optimizer.exp_avg_bytes, rr.stats.optimizer.master_bytes);
    EXPECT_EQ(rr.stats.optimizer.exp_avg_sq_bytes, rr.stats.optimizer.master_bytes);
    // Padding to W shards makes groups larger, so the same bucket may hold fewer.
    EXPECT_EQ(rr.stats.reducer.reduce_scatter_calls, many[0].stats.reducer.reduce_scatter_calls);
    EXPECT_GE(rr.stats.reducer.reduce_scatter_calls, one[0].stats.reducer.reduce_scatter_calls);
    EXPECT_EQ(rr.stats.all_gather.calls, one[0].stats.all_gather.calls);
  }
  // Summed losses over ranks equal the single-rank loss at every step.
  for (int s = 0; s < steps; ++s) {
    double sum = 0.0;
    for (const RankResult& rr : many)
      sum += rr.losses[static_cast<size_t>(s)];
    EXPECT_NEAR(sum, one[0].losses[static_cast<size_t>(s)],
                1e-6 * one[0].losses[static_cast<size_t>(s)])
        << "step " << s;
  }
  // Padding aside, the partitions add up to the single rank's.
  const uint64_t single = one[0].stats.optimizer.master_bytes;
  EXPECT_GE(master_total, single);
  EXPECT_LE(master_total, single + static_cast<uint64_t>(world) * 4 * 16 * 4 * 4);
  uint64_t params_updated = 0;
  for (const RankResult& rr : many)
    params_updated += rr.stats.optimizer.params_updated;
  EXPECT_EQ(params_updated, one[0].stats.optimizer.params_updated);
}

INSTANTIATE_TEST_SUITE_P(Ranks, MultiRankTest, ::testing::Values(2, 3, 4));

// ZeRO stages 1 and 2: the numbers of stage 3 on one rank, with clipping and
// gradient accumulation, on 1 and 3 thread ranks. Every group stays gathered: no fetch
// in a forward or backward pass, all-gathers only at Create and after each applied step
// (the updated shards); the optimizer states and accumulators are 1/W as in stage 3.
// Stage 1 all-reduces the gradients, stage 2 reduce-scatters them.
class StagesTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(StagesTest, MatchStageThreeAndGatherOnlyAfterEachStep) {
  const auto [stage, world] = GetParam();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.gradient_clipping = 0.5;
  c.gradient_accumulation_steps = 2;
  const int micro_steps = 6;  // 3 applied steps
  const std::vector<RankResult> three = RunRanks(c, world, micro_steps);
  c.zero.stage = stage;
  const std::vector<RankResult> staged = RunRanks(c, world, micro_steps);
  const std::vector<RankResult> one = RunRanks(c, 1, micro_steps);
  ASSERT_TRUE(one[0].status.ok()) << one[0].status;
  for (int r = 0; r < world; ++r) {
    const RankResult& t = three[static_cast<size_t>(r)];
    const RankResult& s = staged[static_cast<size_t>(r)];
    ASSERT_TRUE(t.status.ok()) << t.status;
    ASSERT_TRUE(s.status.ok()) << "rank " << r << ": " << s.status;
    EXPECT_LT(RelDiff(s.params, t.params), 1e-6) << "rank " << r;
    EXPECT_LT(RelDiff(s.params, one[0].params), 1e-6) << "rank " << r;
    for (size_t k = 0; k < s.losses.size(); ++k)
      EXPECT_NEAR(s.losses[k], t.losses[k], 1e-6 * std::abs(t.losses[k])) << "micro-step " << k;
    // Replicated parameters: all of them gathered, never fetched in a pass.
    const CoordinatorStats& cs = s.stats.coordinator;
    EXPECT_EQ(cs.fetches_on_demand + cs.fetches_prefetched + cs.fetches_reused, 0u);
    EXPECT_EQ(cs.persistent_hits, 8u * micro_steps);  // 4 groups, forward and backward
    EXPECT_EQ(s.stats.all_gather.calls, 4u * (1 + micro_steps / 2));
    EXPECT_GT(t.stats.all_gather.calls, s.stats.all_gather.calls);
    // Partitioned as in stage 3.
    EXPECT_EQ(s.stats.optimizer.master_bytes, t.stats.optimizer.master_bytes);
    EXPECT_EQ(s.stats.optimizer.exp_avg_bytes, t.stats.optimizer.exp_avg_bytes);
    EXPECT_EQ(s.stats.optimizer.grad_accumulator_bytes, t.stats.optimizer.grad_accumulator_bytes);
    // The gradient collective of the stage.
    if (stage == 1) {
      EXPECT_EQ(s.stats.reducer.reduce_scatter_calls, 0u);
      EXPECT_EQ(s.stats.reducer.all_reduce_calls, t.stats.reducer.reduce_scatter_calls);
    } else {
      EXPECT_EQ(s.stats.reducer.reduce_scatter_calls, t.stats.reducer.reduce_scatter_calls);
      EXPECT_EQ(s.stats.reducer.all_reduce_calls, 0u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(StageAndRanks, StagesTest,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values(1, 3)));

TEST(StagesTest, ParamOffloadIsRefusedBelowStageThree) {
  Config c = BaseConfig();
  c.zero.stage = 2;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(c, SingleRank(), Groups(InitialParams()), TestOptions());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("use stage 3 to offload parameters"), std::string::npos)
      << e.status();
}

// One training run of `steps` steps on `world` thread ranks: each rank's final parameters,
// status and statistics.
struct RankRun {
  Params params;
  Status status;
  EngineStats stats;
};
std::vector<RankRun> TrainOnRanks(int world, const Config& c, const std::vector<GroupDesc>& descs,
                                  const EngineOptions& o, int steps) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<RankRun> runs(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      RankRun& run = runs[static_cast<size_t>(r)];
      auto comm = std::make_shared<ThreadCommunicator>(group, r);
      Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(c, comm, descs, o);
      if (!e.ok()) {
        run.status = e.status();
        return;
      }
      for (int step = 0; step < steps; ++step) {
        Result<double> loss = EngineMicroStep(**e, Seq(step), MakeBatch(step));
        Result<StepOutcome> out = loss.ok() ? (*e)->Step() : loss.status();
        if (!out.ok()) {
          run.status = out.status();
          return;
        }
      }
      run.params = EngineParams(**e);
      run.stats = (*e)->stats();
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

// Parameter groups, the fine-tuning recipe: biases without weight decay and at twice the
// learning rate, the rest with the config's values; against the reference on 1 and 3 ranks
// (shards cut through parameters of both groups), and a bad group index refused.
TEST(EngineCoreTest, ParamGroupsMatchTheReferenceOnOneAndSeveralRanks) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.optimizer.weight_decay = 0.1;
  c.zero.sub_group_size = 7;  // sub-groups cut across group boundaries too
  EngineOptions o = TestOptions();
  ParamGroupOptions biases;
  biases.lr = 2 * c.optimizer.lr;
  biases.weight_decay = 0.0;
  o.param_groups = {ParamGroupOptions{}, biases};
  const Params init = InitialParams();
  std::vector<GroupDesc> descs = Groups(init);
  for (size_t g = 1; g < descs.size(); ++g)
    descs[g].params[1].param_group = 1;  // the biases
  const int steps = 5;
  Reference ref(AdamParamsFromConfig(c.optimizer), c.gradient_clipping);
  ref.weight_decay_of = {{0.1}};
  ref.lr_factor_of = {{1.0}};
  for (size_t g = 1; g < init.size(); ++g) {
    ref.weight_decay_of.push_back({0.1, 0.0});
    ref.lr_factor_of.push_back({1.0, 2.0});
  }
  for (int step = 0; step < steps; ++step) {
    Params acc = ZerosLike(init);
    ref.MicroStep(Seq(step), MakeBatch(step), 1.0, acc);
    ref.Step(acc, c.optimizer.lr);
  }
  for (const int world : {1, 3}) {
    const std::vector<RankRun> runs = TrainOnRanks(world, c, descs, o, steps);
    for (int r = 0; r < world; ++r) {
      const RankRun& run = runs[static_cast<size_t>(r)];
      ASSERT_TRUE(run.status.ok()) << run.status;
      EXPECT_LT(RelDiff(run.params, ref.p), 1e-6) << world << " ranks, rank " << r;
      const OptimizerStats& os = run.stats.optimizer;
      ASSERT_EQ(os.group_lr.size(), 2u);
      EXPECT_DOUBLE_EQ(os.group_lr[1], 2 * os.group_lr[0]);
      EXPECT_NE(run.stats.ToString().find("parameter groups"), std::string::npos);
    }
  }
  // Without the switch (plain one-group training) the biases would decay: the groups
  // made a difference.
  Reference plain(AdamParamsFromConfig(c.optimizer), c.gradient_clipping);
  for (int step = 0; step < steps; ++step) {
    Params acc = ZerosLike(init);
    plain.MicroStep(Seq(step), MakeBatch(step), 1.0, acc);
    plain.Step(acc, c.optimizer.lr);
  }
  EXPECT_GT(RelDiff(plain.p, ref.p), 1e-4);
  descs[1].params[0].param_group = 2;
  Result<std::unique_ptr<EngineCore>> bad = EngineCore::Create(c, SingleRank(), descs, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("parameter group 2 of 2"), std::string::npos)
      << bad.status();
}

// LAMB through the engine against the published algorithm in float64 (with DeepSpeed's
// clamp), on 1 and 3 ranks: 3 ranks cut parameters across ranks, so each trust ratio needs
// the all-reduced norms; sub_group_size 7 cuts them within a rank as well. Biases are in a
// group without weight decay (the recipe), and the clamp is tight enough to act.
TEST(EngineCoreTest, LambMatchesTheFloat64ReferenceOnOneAndSeveralRanks) {
  Config c = BaseConfig();
  c.optimizer.type = OptimizerType::kLamb;
  c.optimizer.lr = 0.01;
  c.optimizer.weight_decay = 0.05;
  c.optimizer.max_coeff = 0.8;
  c.optimizer.min_coeff = 0.3;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.sub_group_size = 7;
  EngineOptions o = TestOptions();
  ParamGroupOptions biases;
  biases.weight_decay = 0.0;
  o.param_groups = {ParamGroupOptions{}, biases};
  const Params init = InitialParams();
  std::vector<GroupDesc> descs = Groups(init);
  for (size_t g = 1; g < descs.size(); ++g)
    descs[g].params[1].param_group = 1;
  const int steps = 5;

  // The reference: float64 moments and parameters; the toy model runs on their fp32 values.
  Reference model(AdamParamsFromConfig(c.optimizer), 0.0);
  std::vector<std::vector<std::vector<double>>> p, m, v;
  for (const auto& g : init) {
    p.emplace_back();
    for (const auto& t : g)
      p.back().emplace_back(t.begin(), t.end());
  }
  m = v = p;
  for (auto* s : {&m, &v})
    for (auto& g : *s)
      for (auto& t : g)
        std::fill(t.begin(), t.end(), 0.0);
  double ratio_lo = 1e9, ratio_hi = 0;
  for (int step = 1; step <= steps; ++step) {
    Params grads = ZerosLike(init);
    model.MicroStep(Seq(step - 1), MakeBatch(step - 1), 1.0, grads);
    const double b1 = c.optimizer.beta1, b2 = c.optimizer.beta2;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (size_t g = 0; g < p.size(); ++g) {
      for (size_t i = 0; i < p[g].size(); ++i) {
        const double wd = g > 0 && i == 1 ? 0.0 : c.optimizer.weight_decay;
        std::vector<double> u(p[g][i].size());
        double wsq = 0, usq = 0;
        for (size_t e = 0; e < u.size(); ++e) {
          const double gr = grads[g][i][e];
          m[g][i][e] = b1 * m[g][i][e] + (1 - b1) * gr;
          v[g][i][e] = b2 * v[g][i][e] + (1 - b2) * gr * gr;
          u[e] =
              m[g][i][e] / bc1 / (std::sqrt(v[g][i][e] / bc2) + c.optimizer.eps) + wd * p[g][i][e];
          wsq += p[g][i][e] * p[g][i][e];
          usq += u[e] * u[e];
        }
        const double ratio = wsq > 0 && usq > 0
                                 ? std::clamp(std::sqrt(wsq) / std::sqrt(usq),
                                              c.optimizer.min_coeff, c.optimizer.max_coeff)
                                 : 1.0;
        ratio_lo = std::min(ratio_lo, ratio);
        ratio_hi = std::max(ratio_hi, ratio);
        for (size_t e = 0; e < u.size(); ++e) {
          p[g][i][e] -= c.optimizer.lr * ratio * u[e];
          model.p[g][i][e] = static_cast<float>(p[g][i][e]);
        }
      }
    }
  }
  // Both ends of the clamp were reached (otherwise this test would not test it).
  EXPECT_EQ(ratio_lo, c.optimizer.min_coeff);
  EXPECT_EQ(ratio_hi, c.optimizer.max_coeff);

  for (const int world : {1, 3}) {
    const std::vector<RankRun> runs = TrainOnRanks(world, c, descs, o, steps);
    for (int r = 0; r < world; ++r) {
      const RankRun& run = runs[static_cast<size_t>(r)];
      ASSERT_TRUE(run.status.ok()) << run.status;
      EXPECT_LT(RelDiff(run.params, model.p), 1e-5) << world << " ranks, rank " << r;
      const OptimizerStats& os = run.stats.optimizer;
      EXPECT_EQ(os.lamb_norms_all_reduce_calls, static_cast<uint64_t>(steps));
      // 7 parameters, [w^2, u^2] each, fp32.
      EXPECT_EQ(os.lamb_norms_all_reduce_bytes, static_cast<uint64_t>(steps) * 7 * 2 * 4);
      EXPECT_GE(os.lamb_trust_ratio_min, c.optimizer.min_coeff);
      EXPECT_LE(os.lamb_trust_ratio_max, c.optimizer.max_coeff);
      EXPECT_EQ(os.adam_calls % 2, 0u);
    }
  }
  // Adam on the same config lands elsewhere: the optimizer in use is LAMB.
  Config adam = c;
  adam.optimizer.type = OptimizerType::kAdamW;
  Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(adam, SingleRank(), descs, o);
  ASSERT_TRUE(e.ok()) << e.status();
  for (int step = 0; step < steps; ++step) {
    ASSERT_TRUE(EngineMicroStep(**e, Seq(step), MakeBatch(step)).ok());
    ASSERT_TRUE((*e)->Step().ok());
  }
  EXPECT_GT(RelDiff(EngineParams(**e), model.p), 1e-3);
}

// Ranks that initialized their models differently start from rank 0's model.
TEST(MultiRankInitTest, InitialValuesComeFromRankZero) {
  const int world = 3;
  const Config c = BaseConfig();
  for (bool broadcast : {true, false}) {
    auto group = std::make_shared<ThreadGroup>(world);
    std::vector<Params> params(world);
    std::vector<Status> status(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        Params init = InitialParams();
        for (auto& g : init)
          for (auto& t : g)
            for (float& x : t)
              x += 0.25f * static_cast<float>(r);
        EngineOptions o = TestOptions();
        o.broadcast_initial_values = broadcast;
        Result<std::unique_ptr<EngineCore>> e =
            EngineCore::Create(c, std::make_shared<ThreadCommunicator>(group, r), Groups(init), o);
        status[static_cast<size_t>(r)] = e.status();
        if (e.ok()) params[static_cast<size_t>(r)] = EngineParams(**e);
      });
    }
    for (auto& t : threads)
      t.join();
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(status[static_cast<size_t>(r)].ok()) << status[static_cast<size_t>(r)];
      EXPECT_EQ(RelDiff(params[static_cast<size_t>(r)], params[0]), 0.0);
    }
    // With the broadcast the gathered model is rank 0's; without, a patchwork of shards.
    const double d = RelDiff(params[0], InitialParams());
    if (broadcast) {
      EXPECT_EQ(d, 0.0);
    } else {
      EXPECT_GT(d, 0.0);
    }
  }
}

// 16-bit working dtype over 3 ranks: the gathered views hold the initial values rounded
// to 16 bits, and training tracks the single-rank run closely (reductions round
// differently in 16 bits, so not bit for bit).
TEST(MultiRank16BitTest, GatheredViewsAndTrainingMatchOneRank) {
  for (bool fp16 : {true, false}) {
    Config c = BaseConfig();
    c.fp16.enabled = fp16;
    c.fp16.initial_scale_power = 8;
    c.bf16 = !fp16;
    c.zero.stage3_param_persistence_threshold = 1;  // the root group persistent
    c.zero.offload_param.device = OffloadDevice::kCpu;
    const int world = 3;
    const Params init = InitialParams();
    auto group = std::make_shared<ThreadGroup>(world);
    std::vector<Status> status(world);
    std::vector<Params> params(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        Status& st = status[static_cast<size_t>(r)];
        std::unique_ptr<EngineCore> e =
            MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), init);
        if (e == nullptr) {
          st = InternalError("create failed");
          return;
        }
        // The views, before any step.
        for (int g = 0; g < e->num_groups(); ++g) {
          st = e->PreForward(g);
          if (!st.ok()) return;
          Result<GatheredGroup> gg = e->FullBuffer(g);
          if (!gg.ok()) {
            st = gg.status();
            return;
          }
          for (size_t i = 0; i < e->layout(g).params.size(); ++i) {
            const std::vector<float> v = ParamValues(*gg, i);
            const auto& want = init[static_cast<size_t>(g)][i];
            for (size_t k = 0; k < v.size(); ++k) {
              std::vector<float> rounded(1);
              std::vector<uint16_t> half(1);
              ConvertFromFloat(&want[k], 1, half.data(), e->dtype());
              ConvertToFloat(half.data(), e->dtype(), 1, rounded.data());
              if (v[k] != rounded[0]) {
                st = InternalError("group " + std::to_string(g) + " param " + std::to_string(i) +
                                   " element " + std::to_string(k) + ": " + std::to_string(v[k]) +
                                   " != " + std::to_string(rounded[0]));
                return;
              }
            }
          }
          st = e->PostForward(g);
          if (!st.ok()) return;
        }
        st = e->EndForwardOnly();
        if (!st.ok()) return;
        for (int step = 0; step < 6; ++step) {
          Result<double> loss = EngineMicroStep(*e, Seq(step), MakeBatch(step));
          if (!loss.ok()) {
            st = loss.status();
            return;
          }
          Result<StepOutcome> out = e->Step();
          if (!out.ok()) {
            st = out.status();
            return;
          }
        }
        params[static_cast<size_t>(r)] = EngineParams(*e);
      });
    }
    for (auto& t : threads)
      t.join();
    for (int r = 0; r < world; ++r)
      ASSERT_TRUE(status[static_cast<size_t>(r)].ok()) << status[r];
    const std::vector<RankResult> one = RunRanks(c, 1, 6);
    ASSERT_TRUE(one[0].status.ok()) << one[0].status;
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(RelDiff(params[static_cast<size_t>(r)], params[0]), 0.0) << "ranks disagree";
      EXPECT_LT(RelDiff(params[static_cast<size_t>(r)], one[0].params), fp16 ? 2e-3 : 2e-2)
          << (fp16 ? "fp16" : "bf16");
    }
  }
}

}  // namespace
}  // namespace strata::engine

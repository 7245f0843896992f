// Frozen groups (engine_core.h's GroupDesc::frozen): the toy model of toy_model.h
// with every layer's weight frozen and its bias trained, the frozen weights in their own
// groups after the trainable ones, gathered with their layer. Against the same model with
// the weights trainable but given zero gradients and no weight decay (Adam then leaves them
// as they are): the same losses and biases, the frozen weights exactly their initial
// values although the frozen run has weight decay on, no optimizer state for them, and a
// checkpoint that restores them on another world size. On the device, with the shards in
// host memory and with them on NVMe.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "../../swap/test_util.h"
#include "strata/core/logging.h"
#include "strata/engine/runtime/engine_core.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using swap::testing::ScratchDir;

// Groups: 0 root (scale), 1..kLayers the biases, kLayers+1..2*kLayers the frozen weights.
int FrozenOf(int layer) {
  return kLayers + layer;
}

std::vector<GroupDesc> FrozenGroups(const Params& p) {
  std::vector<GroupDesc> groups;
  groups.push_back({"root", {{"scale", 1, p[0][0].data()}}});
  for (int k = 1; k <= kLayers; ++k) {
    const auto& g = p[static_cast<size_t>(k)];
    groups.push_back({"layer" + std::to_string(k), {{"bias", g[1].size(), g[1].data()}}});
  }
  for (int k = 1; k <= kLayers; ++k) {
    const auto& g = p[static_cast<size_t>(k)];
    GroupDesc d{"layer" + std::to_string(k) + ".frozen", {{"weight", g[0].size(), g[0].data()}}};
    d.frozen = true;
    groups.push_back(std::move(d));
  }
  return groups;
}

// One micro-step of the frozen layout: layer k gathers its bias group and its frozen
// weight group; only the biases and the scale get gradients.
Result<double> FrozenMicroStep(EngineCore& e, const Batch& b) {
  Status first;
  auto note = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  auto values = [&](int g, size_t i) {
    Result<GatheredGroup> gg = e.FullBuffer(g);
    note(gg.status());
    return gg.ok() ? ParamValues(*gg, i) : std::vector<float>(e.layout(g).params[i].numel, 0.0f);
  };
  Driver d;
  d.acquire = [&](int g, Phase phase) {
    std::vector<std::vector<float>> vals;
    auto pre = [&](int x) { note(phase == Phase::kForward ? e.PreForward(x) : e.PreBackward(x)); };
    pre(g);
    if (g == 0) return std::vector<std::vector<float>>{values(0, 0)};
    pre(FrozenOf(g));
    return std::vector<std::vector<float>>{values(FrozenOf(g), 0), values(g, 0)};
  };
  d.release = [&](int g, Phase phase) {
    auto post = [&](int x) {
      note(phase == Phase::kForward ? e.PostForward(x) : e.PostBackward(x));
    };
    if (g != 0) post(FrozenOf(g));
    post(g);
  };
  d.grad = [&](int g, int i, const std::vector<float>& gr) {
    if (g != 0 && i == 0) return;  // a frozen weight: no gradient
    note(e.AddGradient(g, 0, gr.data(), DType::kFloat32));
  };
  const int rows = kBatch / e.world_size();
  const double loss =
      ForwardBackward(d, Seq(0), b, e.rank() * rows, rows, kBatch, e.LossMultiplier());
  STRATA_RETURN_IF_ERROR(first);
  STRATA_RETURN_IF_ERROR(e.EndBackward());
  return loss;
}

// The frozen layout's parameters in the toy model's order.
Params FrozenParams(EngineCore& e) {
  Params out = InitialParams();
  for (int g = 0; g < e.num_groups(); ++g) {
    std::vector<float> flat(e.layout(g).numel);
    STRATA_CHECK_OK(e.GatherMasterParams(g, flat));
    if (g == 0) {
      out[0][0] = flat;
    } else if (g <= kLayers) {
      out[static_cast<size_t>(g)][1] = flat;
    } else {
      out[static_cast<size_t>(g - kLayers)][0] = flat;
    }
  }
  return out;
}

struct FrozenRun {
  std::vector<double> losses;
  Params params;
  EngineStats stats;
  int64_t trainable_numel = 0;
  int64_t partition_numel = 0;
  Status status;
};

// `world` thread ranks train `steps` steps; frozen: the frozen layout, else the toy layout
// with the weights' gradients zeroed. `between(rank, engine, step)` runs before each step.
std::vector<FrozenRun> Train(const Config& c, int world, int steps, bool frozen,
                             const std::function<Status(int, EngineCore&, int)>& between = {}) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<FrozenRun> runs(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      FrozenRun& run = runs[static_cast<size_t>(r)];
      const Params init = InitialParams();
      auto comm = std::make_shared<ThreadCommunicator>(group, r);
      Result<std::unique_ptr<EngineCore>> e =
          EngineCore::Create(c, comm, frozen ? FrozenGroups(init) : Groups(init), TestOptions());
      if (!e.ok()) {
        run.status = e.status();
        return;
      }
      for (int step = 0; step < steps; ++step) {
        if (between) {
          run.status = between(r, **e, step);
          if (!run.status.ok()) return;
        }
        Result<double> loss = frozen
                                  ? FrozenMicroStep(**e, MakeBatch(step))
                                  : EngineMicroStep(**e, Seq(step), MakeBatch(step),
                                                    [](int g, int i, std::vector<float>& grad) {
                                                      if (g != 0 && i == 0)
                                                        std::fill(grad.begin(), grad.end(), 0.0f);
                                                    });
        Result<StepOutcome> out = loss.ok() ? (*e)->Step() : loss.status();
        if (!out.ok()) {
          run.status = out.status();
          return;
        }
        run.losses.push_back(*loss);
      }
      run.params = frozen ? FrozenParams(**e) : EngineParams(**e);
      run.stats = (*e)->stats();
      run.trainable_numel = static_cast<int64_t>((*e)->partition().trainable_numel);
      run.partition_numel = static_cast<int64_t>((*e)->partition().partition_numel);
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

enum class Tier { kDevice, kHost, kNvme };

Config TierConfig(Tier tier, const std::string& dir) {
  Config c = BaseConfig();
  if (tier != Tier::kDevice) {
    c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    c.zero.offload_param.device = OffloadDevice::kCpu;
  }
  if (tier == Tier::kNvme) {
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_optimizer.nvme_path = {dir};
    c.zero.offload_optimizer.buffer_count = 8;
    c.zero.offload_param.device = OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = {dir};
    c.zero.offload_param.buffer_count = 3;
    c.zero.offload_param.max_in_cpu = 0;
    c.aio.block_size = 4096;
  }
  return c;
}

class FrozenTest : public ::testing::TestWithParam<std::tuple<Tier, int>> {};

TEST_P(FrozenTest, FrozenWeightsStayExactAndTheRestTrainsAsWithZeroGradients) {
  const auto [tier, world] = GetParam();
  ScratchDir dir;
  // No weight decay in either run, so that the biases compare (WeightDecayDoesNotReach-
  // FrozenWeights checks the decay).
  Config c = TierConfig(tier, dir.path());
  c.optimizer.weight_decay = 0.0;
  const int steps = 4;
  const std::vector<FrozenRun> ref = Train(c, world, steps, /*frozen=*/false);
  const std::vector<FrozenRun> got = Train(c, world, steps, /*frozen=*/true);
  const Params init = InitialParams();
  for (int r = 0; r < world; ++r) {
    const FrozenRun& a = ref[static_cast<size_t>(r)];
    const FrozenRun& b = got[static_cast<size_t>(r)];
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_TRUE(b.status.ok()) << b.status;
    ASSERT_EQ(a.losses.size(), b.losses.size());
    for (size_t s = 0; s < a.losses.size(); ++s)
      EXPECT_NEAR(b.losses[s], a.losses[s], 1e-6 * std::abs(a.losses[s])) << "step " << s;
    EXPECT_LT(RelDiff(b.params, a.params), 1e-6);
    for (int k = 1; k <= kLayers; ++k) {
      EXPECT_EQ(b.params[static_cast<size_t>(k)][0], init[static_cast<size_t>(k)][0])
          << "layer " << k << "'s frozen weight changed";
      EXPECT_NE(b.params[static_cast<size_t>(k)][1], init[static_cast<size_t>(k)][1])
          << "layer " << k << "'s bias did not train";
    }
    // No optimizer state for the frozen weights: master, m, v and accumulators cover the
    // trainable groups' shards only; the working shards cover every group.
    EXPECT_LT(b.trainable_numel, b.partition_numel);
    EXPECT_EQ(b.stats.optimizer.master_bytes, static_cast<uint64_t>(b.trainable_numel) * 4);
    EXPECT_EQ(b.stats.optimizer.exp_avg_bytes, static_cast<uint64_t>(b.trainable_numel) * 4);
    EXPECT_EQ(b.stats.optimizer.grad_accumulator_bytes,
              static_cast<uint64_t>(b.trainable_numel) * 4);
    EXPECT_EQ(b.stats.working_shard_bytes, static_cast<uint64_t>(b.partition_numel) * 4);
    EXPECT_LT(b.stats.optimizer.params_updated, a.stats.optimizer.params_updated);
  }
}

// Decoupled weight decay on: the frozen weights still do not move (they have no master for
// the decay to reach), while the trained ones decay.
TEST(FrozenTest, WeightDecayDoesNotReachFrozenWeights) {
  Config c = BaseConfig();
  c.optimizer.weight_decay = 0.1;
  c.optimizer.adam_w_mode = true;
  const std::vector<FrozenRun> got = Train(c, 2, 3, /*frozen=*/true);
  const Params init = InitialParams();
  for (const FrozenRun& run : got) {
    ASSERT_TRUE(run.status.ok()) << run.status;
    for (int k = 1; k <= kLayers; ++k)
      EXPECT_EQ(run.params[static_cast<size_t>(k)][0], init[static_cast<size_t>(k)][0]);
  }
}

std::string TierName(const ::testing::TestParamInfo<std::tuple<Tier, int>>& p) {
  const Tier tier = std::get<0>(p.param);
  return std::string(tier == Tier::kDevice ? "Device"
                     : tier == Tier::kHost ? "Host"
                                           : "Nvme") +
         "_" + std::to_string(std::get<1>(p.param)) + "ranks";
}

INSTANTIATE_TEST_SUITE_P(TiersAndRanks, FrozenTest,
                         ::testing::Combine(::testing::Values(Tier::kDevice, Tier::kHost,
                                                              Tier::kNvme),
                                            ::testing::Values(1, 3)),
                         TierName);

// 16-bit working dtype: a frozen weight is kept in bf16 (rounded once, at creation) and
// gathered as such.
TEST(FrozenTest, Bf16FrozenWeightsAreTheirRoundedInitialValues) {
  Config c = BaseConfig();
  c.bf16 = true;
  const std::vector<FrozenRun> got = Train(c, 2, 2, /*frozen=*/true);
  const Params init = InitialParams();
  for (const FrozenRun& run : got) {
    ASSERT_TRUE(run.status.ok()) << run.status;
    for (int k = 1; k <= kLayers; ++k) {
      const std::vector<float>& w = init[static_cast<size_t>(k)][0];
      std::vector<uint16_t> bf(w.size());
      ConvertFromFloat(w.data(), w.size(), bf.data(), DType::kBFloat16);
      std::vector<float> rounded(w.size());
      ConvertToFloat(bf.data(), DType::kBFloat16, w.size(), rounded.data());
      EXPECT_EQ(run.params[static_cast<size_t>(k)][0], rounded);
    }
    EXPECT_EQ(run.stats.working_shard_bytes, static_cast<uint64_t>(run.partition_numel) * 2);
  }
}

// Stage 2 keeps every group gathered (persistent): after each step the trainable groups
// are gathered again, the frozen ones (unchanged) are not.
TEST(FrozenTest, StageTwoRegathersOnlyTheTrainableGroupsAfterAStep) {
  Config c = BaseConfig();
  c.zero.stage = 2;
  const int steps = 3;
  const std::vector<FrozenRun> got = Train(c, 2, steps, /*frozen=*/true);
  for (const FrozenRun& run : got) {
    ASSERT_TRUE(run.status.ok()) << run.status;
    const uint64_t groups = 2 * kLayers + 1, trainable = kLayers + 1;
    EXPECT_EQ(run.stats.all_gather.calls, groups + trainable * steps);
    for (int k = 1; k <= kLayers; ++k)
      EXPECT_EQ(run.params[static_cast<size_t>(k)][0], InitialParams()[static_cast<size_t>(k)][0]);
  }
}

TEST(FrozenTest, MisuseIsRefused) {
  const Params init = InitialParams();
  // A trainable group after a frozen one.
  std::vector<GroupDesc> groups = FrozenGroups(init);
  std::swap(groups[1], groups.back());
  Result<std::unique_ptr<EngineCore>> bad =
      EngineCore::Create(BaseConfig(), SingleRank(), groups, TestOptions());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("frozen groups last"), std::string::npos) << bad.status();
  // A gradient for a frozen group.
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(BaseConfig(), SingleRank(), FrozenGroups(init), TestOptions());
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->PreForward(FrozenOf(1)).ok());
  ASSERT_TRUE((*e)->PostForward(FrozenOf(1)).ok());
  std::vector<float> grad(kD * kD, 1.0f);
  const Status s = (*e)->AddGradient(FrozenOf(1), 0, grad.data(), DType::kFloat32);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("frozen"), std::string::npos) << s;
}

// LoadParameters writes a frozen group's values into its working shards (GatherMasterParams
// reads them back), on two ranks whose shards cut through the weights.
TEST(FrozenTest, LoadParametersReplacesFrozenValues) {
  const std::vector<FrozenRun> got =
      Train(BaseConfig(), 2, 2, /*frozen=*/true, [](int, EngineCore& e, int step) -> Status {
        if (step != 1) return Status::Ok();
        return e.LoadParameters(Status::Ok(),
                                [&](int g, size_t, uint64_t first, std::span<float> out) -> Status {
                                  for (size_t i = 0; i < out.size(); ++i)
                                    out[i] = static_cast<float>(g * 1000 + first + i) * 1e-3f;
                                  return Status::Ok();
                                });
      });
  for (const FrozenRun& run : got) {
    ASSERT_TRUE(run.status.ok()) << run.status;
    for (int k = 1; k <= kLayers; ++k) {
      const std::vector<float>& w = run.params[static_cast<size_t>(k)][0];
      for (size_t i = 0; i < w.size(); ++i)
        ASSERT_EQ(w[i], static_cast<float>(FrozenOf(k) * 1000 + i) * 1e-3f) << k << " " << i;
    }
  }
}

// A checkpoint keeps the frozen weights (format 2: in the tensor "frozen", in the working
// dtype; m and v and the master cover the trainable groups only) and restores them on
// another world size; in fp32 and in bf16 (2 bytes a frozen value), and from format 1 (the
// frozen values in fp32_master, as older builds saved them).
TEST(FrozenTest, CheckpointRestoresFrozenWeightsOnAnotherWorldSize) {
  struct Case {
    const char* name;
    bool bf16;
    bool format_1;
  };
  for (const Case& k :
       {Case{"fp32", false, false}, Case{"bf16", true, false}, Case{"format 1", false, true}}) {
    SCOPED_TRACE(k.name);
    ScratchDir dir;
    const std::string ckpt = dir.path() + "/ckpt";
    Config c = BaseConfig();
    c.bf16 = k.bf16;
    // Two ranks train 2 steps and save after LoadParameters changed the frozen weights.
    const auto changed = [](int g, size_t, uint64_t first, std::span<float> out) -> Status {
      for (size_t i = 0; i < out.size(); ++i)
        out[i] = static_cast<float>(g * 1000 + first + i) * 1e-3f + 0.5f;
      return Status::Ok();
    };
    std::vector<Params> saved(2);
    const std::vector<FrozenRun> first =
        Train(c, 2, 3, /*frozen=*/true, [&](int r, EngineCore& e, int step) -> Status {
          if (step == 1) return e.LoadParameters(Status::Ok(), changed);
          if (step != 2) return Status::Ok();
          saved[static_cast<size_t>(r)] = FrozenParams(e);
          CheckpointSaveRequest o;
          o.dir = ckpt;
          o.tag = "t";
          o.test_format_1 = k.format_1;
          return e.SaveCheckpoint(o).status();
        });
    for (const FrozenRun& run : first)
      ASSERT_TRUE(run.status.ok()) << run.status;
    Result<CheckpointManifest> m = ReadCheckpointManifest(ckpt + "/t");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->version, k.format_1 ? 1 : 2);
    size_t frozen_groups = 0;
    for (const CheckpointGroup& g : m->groups)
      frozen_groups += g.frozen ? 1 : 0;
    EXPECT_EQ(frozen_groups, static_cast<size_t>(kLayers));
    for (const CheckpointRankPart& part : m->ranks) {
      const FrozenRun& run = first[static_cast<size_t>(part.rank)];
      const CheckpointTensor* master = part.Find("fp32_master");
      const CheckpointTensor* frozen = part.Find("frozen");
      EXPECT_EQ(part.Find("exp_avg")->numel, static_cast<uint64_t>(run.trainable_numel));
      if (k.format_1) {
        EXPECT_EQ(master->numel, static_cast<uint64_t>(run.partition_numel));
        EXPECT_EQ(frozen, nullptr);
        continue;
      }
      EXPECT_EQ(master->numel, static_cast<uint64_t>(run.trainable_numel));
      ASSERT_NE(frozen, nullptr);
      EXPECT_EQ(frozen->dtype, k.bf16 ? "BF16" : "F32");
      EXPECT_EQ(frozen->numel, static_cast<uint64_t>(run.partition_numel - run.trainable_numel));
      EXPECT_EQ(frozen->bytes, frozen->numel * (k.bf16 ? 2 : 4));
    }
    // One rank loads it: its parameters are the saved ones, frozen weights included.
    const std::vector<FrozenRun> second =
        Train(c, 1, 1, /*frozen=*/true, [&](int, EngineCore& e, int step) -> Status {
          if (step != 0) return Status::Ok();
          CheckpointLoadRequest o;
          o.dir = ckpt;
          STRATA_ASSIGN_OR_RETURN(CheckpointLoadResult l, e.LoadCheckpoint(o));
          if (!l.frozen_parameters_loaded) return InternalError("frozen values not loaded");
          const Params p = FrozenParams(e);
          if (p != saved[0]) return InternalError("the loaded parameters are not the saved ones");
          return Status::Ok();
        });
    ASSERT_TRUE(second[0].status.ok()) << second[0].status;
    // The toy layout (nothing frozen) does not load it: the groups differ.
    const std::vector<FrozenRun> other =
        Train(c, 1, 1, /*frozen=*/false, [&](int, EngineCore& e, int) -> Status {
          CheckpointLoadRequest o;
          o.dir = ckpt;
          return e.LoadCheckpoint(o).status();
        });
    EXPECT_EQ(other[0].status.code(), StatusCode::kInvalidArgument) << other[0].status;
  }
}

// Saved without the frozen weights (exclude_frozen_parameters, a LoRA run's checkpoint
// without its base): the manifest (format 2) still lists the frozen groups, fp32_master holds
// the trainable groups only, as m and v do. A load on another world size restores every
// trained value and keeps the frozen values the model has: the saved ones when the model was
// given them first (the base loaded before the adapters), its own otherwise.
// Group g's fingerprint computed here, from the values of its one parameter (at offset 0).
uint64_t Fingerprint(const std::vector<float>& values) {
  uint64_t sum = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &values[i], 4);
    sum += FrozenFingerprintTerm(i, bits);
  }
  return sum;
}

void EditJson(const std::string& path, const std::function<void(nlohmann::ordered_json&)>& edit) {
  nlohmann::ordered_json j;
  {
    std::ifstream in(path);
    j = nlohmann::ordered_json::parse(in);
  }
  edit(j);
  std::ofstream(path, std::ios::trunc) << j.dump(1);
}

// The base the frozen weights are given (LoadParameters' fill); `bump`: one element of group
// `bump` differs.
Status FrozenBase(int g, uint64_t first, std::span<float> out, int bump = -1) {
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<float>(g * 1000 + first + i) * 1e-3f + 0.5f;
  if (g == bump && first == 0 && out.size() > 3) out[3] = std::nextafter(out[3], 2.0f);
  return Status::Ok();
}
Status LoadFrozenBase(EngineCore& e, int bump = -1) {
  return e.LoadParameters(Status::Ok(),
                          [bump](int g, size_t, uint64_t first, std::span<float> out) {
                            return FrozenBase(g, first, out, bump);
                          });
}

// Saves tag "t" of `dir` with exclude_frozen_parameters.
Status SaveWithoutFrozen(EngineCore& e, const std::string& dir) {
  CheckpointSaveRequest o;
  o.dir = dir;
  o.tag = "t";
  o.exclude_frozen_parameters = true;
  return e.SaveCheckpoint(o).status();
}

// The warnings logged about frozen values kept unchecked while it lives (the sink replaces
// stderr meanwhile).
class UncheckedBaseWarnings {
 public:
  UncheckedBaseWarnings() {
    SetLogSink([this](LogLevel level, std::string_view line) {
      std::lock_guard lock(mu_);
      if (level == LogLevel::kWarn &&
          line.find("was saved without its frozen values; the model's own were kept without "
                    "checking") != std::string_view::npos) {
        lines_.emplace_back(line);
      }
    });
  }
  ~UncheckedBaseWarnings() { SetLogSink({}); }
  UncheckedBaseWarnings(const UncheckedBaseWarnings&) = delete;
  UncheckedBaseWarnings& operator=(const UncheckedBaseWarnings&) = delete;
  std::vector<std::string> lines() {
    std::lock_guard lock(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// Gives `e` the base (LoadFrozenBase), then loads `dir`'s latest tag, saved without the
// frozen values: the base must be checked, the frozen values kept.
Status LoadOntoTheBase(EngineCore& e, const std::string& dir) {
  STRATA_RETURN_IF_ERROR(LoadFrozenBase(e));
  CheckpointLoadRequest o;
  o.dir = dir;
  STRATA_ASSIGN_OR_RETURN(CheckpointLoadResult l, e.LoadCheckpoint(o));
  if (l.frozen_parameters_loaded) return InternalError("reported the frozen values loaded");
  if (!l.frozen_base_checked) return InternalError("the base was not checked");
  return Status::Ok();
}

TEST(FrozenTest, CheckpointWithoutFrozenWeightsKeepsTheModelsOwn) {
  ScratchDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  std::vector<Params> saved(2);
  const std::vector<FrozenRun> first =
      Train(BaseConfig(), 2, 3, /*frozen=*/true, [&](int r, EngineCore& e, int step) -> Status {
        if (step == 1) return LoadFrozenBase(e);
        if (step != 2) return Status::Ok();
        saved[static_cast<size_t>(r)] = FrozenParams(e);
        return SaveWithoutFrozen(e, ckpt);
      });
  for (const FrozenRun& run : first)
    ASSERT_TRUE(run.status.ok()) << run.status;
  ASSERT_EQ(saved[0], saved[1]);
  Result<CheckpointManifest> m = ReadCheckpointManifest(ckpt + "/t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->version, 2);
  EXPECT_FALSE(m->frozen_saved);
  size_t frozen_groups = 0;
  for (const CheckpointGroup& g : m->groups) {
    frozen_groups += g.frozen ? 1 : 0;
    EXPECT_EQ(g.has_fingerprint, g.frozen) << g.name;
  }
  EXPECT_EQ(frozen_groups, static_cast<size_t>(kLayers));
  // Each frozen group's fingerprint: the two ranks' partial sums add up to the whole weight's.
  for (int k = 1; k <= kLayers; ++k) {
    const CheckpointGroup& g = m->groups[static_cast<size_t>(FrozenOf(k))];
    EXPECT_EQ(g.frozen_fingerprint, Fingerprint(saved[0][static_cast<size_t>(k)][0])) << g.name;
  }
  for (const CheckpointRankPart& part : m->ranks) {
    EXPECT_EQ(part.Find("frozen"), nullptr);
    EXPECT_EQ(part.Find("fp32_master")->numel, part.Find("exp_avg")->numel);
    EXPECT_EQ(part.Find("fp32_master")->numel,
              static_cast<uint64_t>(first[static_cast<size_t>(part.rank)].trainable_numel));
  }

  // One rank, given the base first: every parameter is the saved one, the base checked
  // (nothing to warn about).
  std::optional<UncheckedBaseWarnings> warnings(std::in_place);
  const std::vector<FrozenRun> with_base =
      Train(BaseConfig(), 1, 1, /*frozen=*/true, [&](int, EngineCore& e, int step) -> Status {
        if (step != 0) return Status::Ok();
        STRATA_RETURN_IF_ERROR(LoadOntoTheBase(e, ckpt));
        if (FrozenParams(e) != saved[0]) return InternalError("not the saved parameters");
        return Status::Ok();
      });
  ASSERT_TRUE(with_base[0].status.ok()) << with_base[0].status;
  EXPECT_TRUE(warnings->lines().empty()) << warnings->lines()[0];

  // One rank with its own frozen weights (the initial ones): refused with nothing changed;
  // with check_frozen_parameters false those stay and the rest is loaded.
  const std::vector<FrozenRun> own =
      Train(BaseConfig(), 1, 1, /*frozen=*/true, [&](int, EngineCore& e, int step) -> Status {
        if (step != 0) return Status::Ok();
        const Params before = FrozenParams(e);
        CheckpointLoadRequest o;
        o.dir = ckpt;
        const Result<CheckpointLoadResult> refused = e.LoadCheckpoint(o);
        EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
        for (const char* part :
             {"not the base it was trained on", "the fingerprints of 3 of 3 frozen groups differ",
              "layer1.frozen, layer2.frozen, layer3.frozen", "check_frozen_parameters=false",
              "nothing was changed"}) {
          EXPECT_NE(refused.status().message().find(part), std::string::npos)
              << part << " in " << refused.status();
        }
        if (FrozenParams(e) != before) return InternalError("the refused load changed the model");
        o.check_frozen_parameters = false;
        STRATA_ASSIGN_OR_RETURN(CheckpointLoadResult l, e.LoadCheckpoint(o));
        if (l.frozen_base_checked) return InternalError("reported the base checked");
        Params want = saved[0];
        const Params init = InitialParams();
        for (int k = 1; k <= kLayers; ++k)
          want[static_cast<size_t>(k)][0] = init[static_cast<size_t>(k)][0];
        if (want == saved[0]) return InternalError("the base did not change the frozen weights");
        if (FrozenParams(e) != want) return InternalError("not the saved trained values + own");
        return Status::Ok();
      });
  ASSERT_TRUE(own[0].status.ok()) << own[0].status;
  // Said once, by the load that kept them (not the refused one), with the reason.
  ASSERT_EQ(warnings->lines().size(), 1u);
  EXPECT_NE(warnings->lines()[0].find("(check_frozen_parameters is false)"), std::string::npos)
      << warnings->lines()[0];
  warnings.reset();
  static_assert(kLayers == 3, "the messages above list three frozen groups");

  // The base with one element of one group one ulp off: that group is named, on both ranks,
  // and on the ranks' disagreement about the check both refuse.
  const std::vector<FrozenRun> bumped =
      Train(BaseConfig(), 2, 1, /*frozen=*/true, [&](int r, EngineCore& e, int step) -> Status {
        if (step != 0) return Status::Ok();
        STRATA_RETURN_IF_ERROR(LoadFrozenBase(e, /*bump=*/FrozenOf(2)));
        CheckpointLoadRequest o;
        o.dir = ckpt;
        const Result<CheckpointLoadResult> refused = e.LoadCheckpoint(o);
        const std::string msg(refused.status().message());
        if (msg.find("fingerprints of 1 of 3 frozen groups differ: layer2.frozen)") ==
            std::string::npos) {
          return InternalError("rank " + std::to_string(r) + ": " + refused.status().ToString());
        }
        o.check_frozen_parameters = r == 0;
        const Result<CheckpointLoadResult> split = e.LoadCheckpoint(o);
        if (split.status().message().find(
                "1 of 2 ranks passed check_frozen_parameters true: pass the same on every rank") ==
            std::string::npos) {
          return InternalError("rank " + std::to_string(r) + ": " + split.status().ToString());
        }
        return Status::Ok();
      });
  for (const FrozenRun& run : bumped)
    ASSERT_TRUE(run.status.ok()) << run.status;

  // A checkpoint of an older build (no fingerprints) loads onto any base, unchecked.
  EditJson(ckpt + "/t/manifest.json", [](nlohmann::ordered_json& j) {
    for (auto& g : j["groups"])
      g.erase("frozen_fingerprint");
  });
  warnings.emplace();
  const std::vector<FrozenRun> older =
      Train(BaseConfig(), 1, 1, /*frozen=*/true, [&](int, EngineCore& e, int step) -> Status {
        if (step != 0) return Status::Ok();
        CheckpointLoadRequest o;
        o.dir = ckpt;
        STRATA_ASSIGN_OR_RETURN(CheckpointLoadResult l, e.LoadCheckpoint(o));
        if (l.frozen_base_checked) return InternalError("reported the base checked");
        return Status::Ok();
      });
  ASSERT_TRUE(older[0].status.ok()) << older[0].status;
  ASSERT_EQ(warnings->lines().size(), 1u);
  EXPECT_NE(warnings->lines()[0].find("holds no fingerprint of them: saved by an older build"),
            std::string::npos)
      << warnings->lines()[0];
}

// A bf16 run's fingerprint is of its bf16 base: an fp32 model of the same base matches it
// (its values rounded to bf16 first), also with the saving run's frozen shards on NVMe.
TEST(FrozenTest, FrozenFingerprintIsOfTheBaseAsTheCheckpointsDtypeHoldsIt) {
  ScratchDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  Config bf16 = TierConfig(Tier::kNvme, dir.path());
  bf16.bf16 = true;
  const std::vector<FrozenRun> first =
      Train(bf16, 2, 2, /*frozen=*/true, [&](int, EngineCore& e, int step) -> Status {
        if (step == 0) return LoadFrozenBase(e);
        return SaveWithoutFrozen(e, ckpt);
      });
  for (const FrozenRun& run : first)
    ASSERT_TRUE(run.status.ok()) << run.status;
  const std::vector<FrozenRun> fp32 =
      Train(BaseConfig(), 1, 1, /*frozen=*/true, [&](int, EngineCore& e, int step) -> Status {
        if (step != 0) return Status::Ok();
        return LoadOntoTheBase(e, ckpt);
      });
  ASSERT_TRUE(fp32[0].status.ok()) << fp32[0].status;
  // The fp32 base is not bf16's: rounded, some element changes (else the test is vacuous).
  bool rounding_changes = false;
  std::vector<float> v(64);
  ASSERT_TRUE(FrozenBase(FrozenOf(1), 0, v).ok());
  for (const float x : v) {
    uint16_t b;
    float back;
    ConvertFromFloat(&x, 1, &b, DType::kBFloat16);
    ConvertToFloat(&b, DType::kBFloat16, 1, &back);
    rounding_changes = rounding_changes || back != x;
  }
  EXPECT_TRUE(rounding_changes);
}

// The manifest's fingerprints, damaged: refused by name.
TEST(FrozenTest, DamagedFrozenFingerprintIsRefused) {
  ScratchDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  const std::vector<FrozenRun> first =
      Train(BaseConfig(), 1, 1, /*frozen=*/true,
            [&](int, EngineCore& e, int) -> Status { return SaveWithoutFrozen(e, ckpt); });
  ASSERT_TRUE(first[0].status.ok()) << first[0].status;
  const std::string manifest = ckpt + "/t/manifest.json";
  std::string original;
  {
    std::ifstream in(manifest);
    original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  struct Damage {
    std::function<void(nlohmann::ordered_json&)> edit;
    const char* error;
  };
  for (const Damage& d : {
           Damage{[](auto& j) { j["groups"][kLayers + 1]["frozen_fingerprint"] = "12345"; },
                  "'frozen_fingerprint' must be 16 hex digits, not '12345'"},
           Damage{[](auto& j) { j["groups"][kLayers + 1]["frozen_fingerprint"] = 7; },
                  "'frozen_fingerprint' must be a string"},
           Damage{[](auto& j) { j["groups"][1]["frozen_fingerprint"] = "00000000000000ff"; },
                  "group layer1: 'frozen_fingerprint' belongs to a frozen group of a checkpoint "
                  "saved without the frozen values"},
           // The dtype the fingerprints are rounded to.
           Damage{[](auto& j) { j["dtype"] = "fp8"; }, "dtype 'fp8' is not fp32, bf16 or fp16"},
       }) {
    std::ofstream(manifest, std::ios::trunc) << original;
    EditJson(manifest, d.edit);
    const Result<CheckpointManifest> m = ReadCheckpointManifest(ckpt + "/t");
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find(d.error), std::string::npos) << m.status();
  }
}

}  // namespace
}  // namespace strata::engine

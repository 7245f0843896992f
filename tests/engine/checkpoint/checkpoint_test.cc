// Checkpoints on the toy model: a resumed run is bit-identical to an
// uninterrupted one (fp32, bf16, fp16 with its loss scaler; 1 and 2 ranks; optimizer states
// in host memory and on NVMe; with gradient accumulation); a checkpoint saved on W ranks
// loads on W' ranks with the same consolidated master, m and v; corrupt, truncated,
// foreign and newer checkpoints are refused with nothing changed; a save killed at every
// named point leaves the previous checkpoint loadable and no partial tag that looks whole.
#include "strata/engine/checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "checkpoint_util.h"
#include "temp_dir.h"

extern char** environ;

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using testing::TempDir;

enum class Precision { kFp32, kBf16, kFp16 };

Config PrecisionConfig(Precision p) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.sub_group_size = 16;
  c.gradient_clipping = 0.5;
  c.bf16 = p == Precision::kBf16;
  c.fp16.enabled = p == Precision::kFp16;
  c.fp16.initial_scale_power = 8;
  c.fp16.loss_scale_window = 2;  // the scale moves during the run: its state must resume
  c.scheduler.type = SchedulerType::kWarmupLR;
  c.scheduler.warmup_num_steps = 4;
  c.scheduler.warmup_max_lr = 0.02;
  return c;
}

Config OnNvme(Config c, const std::string& dir) {
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {dir};
  c.zero.offload_optimizer.buffer_count = 4;  // fewer than the chunks: states are read back
  c.aio.block_size = 4096;
  return c;
}

// Other starting values: a load must replace every one of them.
Params OtherParams() {
  Params p = InitialParams();
  for (auto& g : p)
    for (auto& t : g)
      for (float& x : t)
        x = x * 0.5f + 0.25f;
  return p;
}

CkptPlan Steps(int from, int to) {
  CkptPlan p;
  p.from = from;
  p.to = to;
  return p;
}

// The states of every rank, group by group, as flat buffers of used_numel elements.
std::vector<std::vector<float>> Consolidate(const std::vector<CkptRun>& runs,
                                            std::vector<float> CkptRun::*state) {
  const ModelPartition& p0 = runs[0].partition;
  std::vector<std::vector<float>> flat(p0.groups.size());
  for (size_t g = 0; g < p0.groups.size(); ++g) {
    const GroupLayout& l = p0.groups[g];
    flat[g].resize(l.used_numel);
    for (size_t e = 0; e < l.used_numel; ++e) {
      const size_t r = e / l.shard_numel;
      const CkptRun& run = runs[r];
      flat[g][e] = (run.*state)[run.partition.shard_offset[g] + e % l.shard_numel];
    }
  }
  return flat;
}

class ResumeTest : public ::testing::TestWithParam<std::tuple<int, Precision, bool>> {};

// Train 6 steps; or train 3, save, load in fresh engines built from other values, train 3:
// the same losses and final parameters, m, v, step counts and loss scale, bit for bit.
TEST_P(ResumeTest, LossesAndParametersAreBitIdentical) {
  const auto [world, precision, nvme] = GetParam();
  TempDir swap_dir, ckpt;
  ASSERT_FALSE(ckpt.path().empty());
  Config c = PrecisionConfig(precision);
  if (nvme) c = OnNvme(c, swap_dir.path());
  const std::vector<CkptRun> full = CkptTrain(c, world, InitialParams(), Steps(0, 6));
  CkptPlan first = Steps(0, 3);
  first.save.dir = ckpt.path();
  const std::vector<CkptRun> a = CkptTrain(c, world, InitialParams(), first);
  CkptPlan second = Steps(3, 6);
  second.load.dir = ckpt.path();
  const std::vector<CkptRun> b = CkptTrain(c, world, OtherParams(), second);
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const CkptRun &f = full[static_cast<size_t>(r)], &x = a[static_cast<size_t>(r)],
                  &y = b[static_cast<size_t>(r)];
    ASSERT_TRUE(f.train.ok()) << f.train;
    ASSERT_TRUE(x.save.ok()) << x.save;
    ASSERT_TRUE(y.load.ok()) << y.load;
    ASSERT_TRUE(y.train.ok()) << y.train;
    EXPECT_EQ(x.saved_path, ckpt.path() + "/global_step3");
    EXPECT_EQ(y.loaded.tag, "global_step3");
    EXPECT_EQ(y.loaded.global_steps, 3);
    ASSERT_EQ(y.loaded.blobs.size(), 2u);
    EXPECT_EQ(y.loaded.blobs[0].name, "rank");
    EXPECT_EQ(y.loaded.blobs[0].bytes, Bytes("rank " + std::to_string(r)));
    // The shared blob is rank 0's on every rank, with its dtype and shape.
    EXPECT_EQ(y.loaded.blobs[1].name, "shared:frozen");
    EXPECT_EQ(y.loaded.blobs[1].dtype, "F32");
    EXPECT_EQ(y.loaded.blobs[1].shape, (std::vector<uint64_t>{2, 3}));
    ASSERT_EQ(y.loaded.blobs[1].bytes.size(), 24u);
    float first_two[2];
    std::memcpy(first_two, y.loaded.blobs[1].bytes.data(), 8);
    EXPECT_EQ(first_two[0], 0.0f);
    EXPECT_EQ(first_two[1], 1.0f);
    std::vector<double> tail(f.losses.begin() + 3, f.losses.end());
    EXPECT_EQ(y.losses, tail);
    EXPECT_EQ(y.params, f.params);
    EXPECT_EQ(y.exp_avg, f.exp_avg);
    EXPECT_EQ(y.exp_avg_sq, f.exp_avg_sq);
    EXPECT_EQ(y.adam_step, f.adam_step);
    EXPECT_EQ(y.global_steps, f.global_steps);
    EXPECT_EQ(y.loss_scale, f.loss_scale);
    EXPECT_EQ(y.lr, f.lr);
  }
  if (precision == Precision::kFp16) {
    EXPECT_NE(full[0].loss_scale, 256.0) << "the scale never moved";
  }
}

INSTANTIATE_TEST_SUITE_P(RanksPrecisionsTiers, ResumeTest,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values(Precision::kFp32, Precision::kBf16,
                                                              Precision::kFp16),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<ResumeTest::ParamType>& p_info) {
                           const Precision p = std::get<1>(p_info.param);
                           return std::to_string(std::get<0>(p_info.param)) + "Ranks" +
                                  (p == Precision::kFp32   ? "Fp32"
                                   : p == Precision::kBf16 ? "Bf16"
                                                           : "Fp16") +
                                  (std::get<2>(p_info.param) ? "Nvme" : "Host");
                         });

// With gradient accumulation and persistent groups, and the checkpoint taken by `latest`.
TEST(CheckpointTest, ResumesWithAccumulationAndPersistentGroups) {
  TempDir ckpt;
  Config c = PrecisionConfig(Precision::kBf16);
  c.gradient_accumulation_steps = 2;
  c.zero.stage3_param_persistence_threshold = 1000;
  const std::vector<CkptRun> full = CkptTrain(c, 2, InitialParams(), Steps(0, 4));
  CkptPlan first = Steps(0, 2);
  first.save.dir = ckpt.path();
  first.save.tag = "mine";
  ASSERT_TRUE(CkptTrain(c, 2, InitialParams(), first)[0].save.ok());
  CkptPlan second = Steps(2, 4);
  second.load.dir = ckpt.path();  // tag from `latest`
  const std::vector<CkptRun> b = CkptTrain(c, 2, OtherParams(), second);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(b[static_cast<size_t>(r)].load.ok()) << b[static_cast<size_t>(r)].load;
    EXPECT_EQ(b[static_cast<size_t>(r)].loaded.tag, "mine");
    std::vector<double> tail(full[static_cast<size_t>(r)].losses.begin() + 4,
                             full[static_cast<size_t>(r)].losses.end());
    EXPECT_EQ(b[static_cast<size_t>(r)].losses, tail);
    EXPECT_EQ(b[static_cast<size_t>(r)].params, full[static_cast<size_t>(r)].params);
  }
}

// Parameters on NVMe too (offload_param.device = nvme, every shard there, fewer buffers
// than groups): the working shards rebuilt by the load are the ones the run had.
TEST(CheckpointTest, ResumesWithParametersOnNvme) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    TempDir swap_dir, ckpt;
    Config c = OnNvme(PrecisionConfig(Precision::kBf16), swap_dir.path());
    c.zero.offload_optimizer.buffer_count = 12;
    c.zero.offload_optimizer.pipeline_read = true;
    c.zero.offload_param.device = OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = {swap_dir.path()};
    c.zero.offload_param.buffer_count = 3;
    c.zero.offload_param.max_in_cpu = 0;
    const std::vector<CkptRun> full = CkptTrain(c, world, InitialParams(), Steps(0, 5));
    CkptPlan first = Steps(0, 2);
    first.save.dir = ckpt.path();
    ASSERT_TRUE(CkptTrain(c, world, InitialParams(), first)[0].save.ok());
    CkptPlan second = Steps(2, 5);
    second.load.dir = ckpt.path();
    const std::vector<CkptRun> b = CkptTrain(c, world, OtherParams(), second);
    for (int r = 0; r < world; ++r) {
      const CkptRun& y = b[static_cast<size_t>(r)];
      ASSERT_TRUE(y.load.ok()) << y.load;
      ASSERT_TRUE(y.train.ok()) << y.train;
      std::vector<double> tail(full[static_cast<size_t>(r)].losses.begin() + 2,
                               full[static_cast<size_t>(r)].losses.end());
      EXPECT_EQ(y.losses, tail);
      EXPECT_EQ(y.params, full[static_cast<size_t>(r)].params);
    }
  }
}

class ReshardTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

// Saved on W ranks, loaded on W' ranks: the consolidated master, m and v are the saved ones
// bit for bit, and training goes on.
TEST_P(ReshardTest, ConsolidatedStatesAreTheSaved) {
  const auto [from, to] = GetParam();
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kFp32);
  CkptPlan first = Steps(0, 3);
  first.save.dir = ckpt.path();
  const std::vector<CkptRun> a = CkptTrain(c, from, InitialParams(), first);
  ASSERT_TRUE(a[0].save.ok()) << a[0].save;
  CkptPlan second = Steps(3, 3);  // load only
  second.load.dir = ckpt.path();
  const std::vector<CkptRun> b = CkptTrain(c, to, OtherParams(), second);
  for (const CkptRun& run : b) {
    ASSERT_TRUE(run.load.ok()) << run.load;
    EXPECT_EQ(run.loaded.saved_world_size, from);
    EXPECT_EQ(run.adam_step, a[0].adam_step);
    EXPECT_EQ(run.params, a[0].params);  // the master, gathered
  }
  EXPECT_EQ(Consolidate(b, &CkptRun::exp_avg), Consolidate(a, &CkptRun::exp_avg));
  EXPECT_EQ(Consolidate(b, &CkptRun::exp_avg_sq), Consolidate(a, &CkptRun::exp_avg_sq));
  // Rank r gets the blobs of saving rank r % W (and rank 0's shared one).
  for (int r = 0; r < to; ++r) {
    ASSERT_EQ(b[static_cast<size_t>(r)].loaded.blobs.size(), 2u);
    EXPECT_EQ(b[static_cast<size_t>(r)].loaded.blobs[0].bytes,
              Bytes("rank " + std::to_string(r % from)));
  }
  CkptPlan third = Steps(3, 5);
  third.load.dir = ckpt.path();
  for (const CkptRun& run : CkptTrain(c, to, OtherParams(), third)) {
    ASSERT_TRUE(run.train.ok()) << run.train;
    ASSERT_EQ(run.losses.size(), 2u);
    EXPECT_TRUE(std::isfinite(run.losses[1]));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReshardTest,
                         ::testing::Values(std::make_tuple(2, 1), std::make_tuple(1, 2),
                                           std::make_tuple(2, 4), std::make_tuple(3, 2)),
                         [](const ::testing::TestParamInfo<ReshardTest::ParamType>& p_info) {
                           return std::to_string(std::get<0>(p_info.param)) + "To" +
                                  std::to_string(std::get<1>(p_info.param));
                         });

// load_optimizer_states = false: the parameters, a fresh optimizer (m = v = 0, step 0).
// load_module_only: the parameters only; counters and schedule stay.
TEST(CheckpointTest, ModuleOnlyAndWithoutOptimizerStates) {
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kFp32);
  CkptPlan first = Steps(0, 3);
  first.save.dir = ckpt.path();
  const std::vector<CkptRun> a = CkptTrain(c, 2, InitialParams(), first);
  CkptPlan fresh = Steps(0, 0);
  fresh.load.dir = ckpt.path();
  fresh.load.load_optimizer_states = false;
  for (const CkptRun& run : CkptTrain(c, 2, OtherParams(), fresh)) {
    ASSERT_TRUE(run.load.ok()) << run.load;
    EXPECT_EQ(run.params, a[0].params);
    EXPECT_EQ(run.adam_step, 0);
    EXPECT_EQ(run.global_steps, 3);
    for (float x : run.exp_avg)
      ASSERT_EQ(x, 0.0f);
    for (float x : run.exp_avg_sq)
      ASSERT_EQ(x, 0.0f);
  }
  CkptPlan module = Steps(0, 1);
  module.load.dir = ckpt.path();
  module.load.load_module_only = true;
  const std::vector<CkptRun> one = CkptTrain(c, 2, OtherParams(), Steps(0, 1));
  for (const CkptRun& run : CkptTrain(c, 2, OtherParams(), module)) {
    ASSERT_TRUE(run.load.ok()) << run.load;
    EXPECT_EQ(run.adam_step, 1);
    EXPECT_EQ(run.global_steps, 1);
    EXPECT_EQ(run.lr, one[0].lr);  // the schedule's position is this run's
    EXPECT_NE(run.params, one[0].params);
  }
}

// Loads that must fail on every rank with nothing changed.
struct Damage {
  const char* name;
  std::function<void(const std::string& tag_dir)> apply;
  StatusCode code;
  std::vector<std::string> words;  // in every rank's message
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void Spit(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

class DamagedCheckpointTest : public ::testing::TestWithParam<Damage> {};

TEST_P(DamagedCheckpointTest, EveryRankRefusesItAndNothingChanges) {
  const Damage& d = GetParam();
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kFp32);
  CkptPlan first = Steps(0, 2);
  first.save.dir = ckpt.path();
  first.save.tag = "t";
  ASSERT_TRUE(CkptTrain(c, 2, InitialParams(), first)[0].save.ok());
  d.apply(ckpt.path() + "/t");
  // A load refused before training, then two steps: as if no load was tried.
  const std::vector<CkptRun> plain = CkptTrain(c, 2, OtherParams(), Steps(0, 2));
  CkptPlan p = Steps(0, 2);
  p.load.dir = ckpt.path();
  const std::vector<CkptRun> runs = CkptTrain(c, 2, OtherParams(), p);
  for (size_t r = 0; r < runs.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(runs[r].load.code(), d.code) << runs[r].load;
    for (const std::string& w : d.words)
      EXPECT_NE(runs[r].load.message().find(w), std::string::npos) << runs[r].load;
    EXPECT_NE(runs[r].load.message().find("nothing was changed"), std::string::npos)
        << runs[r].load;
    ASSERT_TRUE(runs[r].train.ok()) << runs[r].train;
    EXPECT_EQ(runs[r].losses, plain[r].losses);
    EXPECT_EQ(runs[r].params, plain[r].params);
  }
}

void FlipBit(const std::string& path, uint64_t offset) {
  std::string s = Slurp(path);
  s[offset] = static_cast<char>(s[offset] ^ 0x10);
  Spit(path, s);
}

void EditManifest(const std::string& tag_dir,
                  const std::function<void(nlohmann::ordered_json&)>& edit) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(Slurp(tag_dir + "/manifest.json"));
  edit(j);
  Spit(tag_dir + "/manifest.json", j.dump(1));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DamagedCheckpointTest,
    ::testing::Values(
        Damage{"FlippedBitInRank1sMaster",
               [](const std::string& tag_dir) { FlipBit(tag_dir + "/rank-00001.bin", 100); },
               StatusCode::kDataLoss,
               {"rank 1", "rank-00001.bin", "fp32_master", "checkpoint t", "CRC32C"}},
        Damage{"FlippedBitInExpAvgSq",
               [](const std::string& tag_dir) {
                 Result<CheckpointManifest> m = ReadCheckpointManifest(tag_dir);
                 ASSERT_TRUE(m.ok()) << m.status();
                 FlipBit(tag_dir + "/rank-00000.bin", m->ranks[0].Find("exp_avg_sq")->offset + 8);
               },
               StatusCode::kDataLoss,
               {"rank-00000.bin", "exp_avg_sq"}},
        Damage{"TruncatedFile",
               [](const std::string& tag_dir) {
                 const std::string f = tag_dir + "/rank-00001.bin";
                 ASSERT_EQ(::truncate(f.c_str(), 4096 + 16), 0);
               },
               StatusCode::kDataLoss,
               {"rank-00001.bin", "truncated"}},
        Damage{"NewerFormat",
               [](const std::string& tag_dir) {
                 EditManifest(tag_dir,
                              [](auto& j) { j["version"] = kCheckpointFormatVersion + 1; });
               },
               StatusCode::kInvalidArgument,
               {"format version 3", "reads versions 1 to 2"}},
        Damage{"FrozenLeftOutInFormatOne",
               [](const std::string& tag_dir) {
                 EditManifest(tag_dir, [](auto& j) { j["frozen_parameters_saved"] = false; });
               },
               StatusCode::kInvalidArgument,
               {"'frozen_parameters_saved' false in format version 1 (it needs version 2)"}},
        Damage{"AnotherModel",
               [](const std::string& tag_dir) {
                 EditManifest(tag_dir, [](auto& j) {
                   j["groups"][1]["params"][0]["name"] = "kernel";
                   j["groups"][2]["params"][1]["numel"] = 4;
                   j["groups"][2]["params"][1]["shape"] = {4};
                 });
               },
               StatusCode::kInvalidArgument,
               {"another model", "missing from the checkpoint (1): layer1/weight",
                "in the checkpoint but not the model (1): layer1/kernel",
                "of another size (1): layer2/bias (checkpoint 4 elements, model 5)"}},
        Damage{"AFloatWhereAnIntegerBelongs",  // found by fuzz_checkpoint_manifest
               [](const std::string& tag_dir) {
                 EditManifest(tag_dir,
                              [](auto& j) { j["ranks"][1]["tensors"][0]["crc32c"] = 4.25e53; });
               },
               StatusCode::kInvalidArgument,
               {"'crc32c' must be an integer in range"}},
        Damage{"NoManifest",
               [](const std::string& tag_dir) {
                 ASSERT_EQ(::unlink((tag_dir + "/manifest.json").c_str()), 0);
               },
               StatusCode::kNotFound,
               {"no manifest.json"}}),
    [](const ::testing::TestParamInfo<Damage>& p_info) { return std::string(p_info.param.name); });

// The front end's check of the blobs (its whole-kept tensors) failing on rank 1: every rank
// fails with rank 1's message, nothing changed.
TEST(CheckpointTest, TheFrontEndsBlobCheckIsAgreedOn) {
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kFp32);
  CkptPlan first = Steps(0, 2);
  first.save.dir = ckpt.path();
  ASSERT_TRUE(CkptTrain(c, 2, InitialParams(), first)[0].save.ok());
  const std::vector<CkptRun> plain = CkptTrain(c, 2, OtherParams(), Steps(0, 1));
  CkptPlan p = Steps(0, 1);
  p.load.dir = ckpt.path();
  std::mutex mu;
  std::vector<std::vector<std::string>> seen;
  p.load.check_blobs = [&](const std::vector<CheckpointTensor>& blobs) {
    std::vector<std::string> names;
    for (const CheckpointTensor& t : blobs)
      names.push_back(t.name + " " + t.dtype + " " + std::to_string(t.numel));
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(names);
    return InvalidArgumentError(
        "frozen parameter w: the checkpoint's shape [2, 3], the "
        "model's [3, 2]");
  };
  const std::vector<CkptRun> runs = CkptTrain(c, 2, OtherParams(), p);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(runs[r].load.code(), StatusCode::kInvalidArgument) << runs[r].load;
    EXPECT_NE(runs[r].load.message().find("frozen parameter w"), std::string::npos);
    EXPECT_NE(runs[r].load.message().find("nothing was changed"), std::string::npos);
    EXPECT_EQ(runs[r].params, plain[r].params);
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[r], (std::vector<std::string>{"rank U8 6", "shared:frozen F32 6"}));
  }
}

TEST(CheckpointTest, MisuseIsRefusedClearly) {
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kFp32);
  // No checkpoint yet: NotFound naming `latest`.
  CkptPlan p = Steps(0, 1);
  p.load.dir = ckpt.path();
  std::vector<CkptRun> runs = CkptTrain(c, 1, InitialParams(), p);
  EXPECT_EQ(runs[0].load.code(), StatusCode::kNotFound);
  EXPECT_NE(runs[0].load.message().find("no 'latest' file"), std::string::npos) << runs[0].load;
  // A tag saved twice: AlreadyExists, the first kept.
  CkptPlan s = Steps(0, 1);
  s.save.dir = ckpt.path();
  s.save.tag = "x";
  ASSERT_TRUE(CkptTrain(c, 1, InitialParams(), s)[0].save.ok());
  runs = CkptTrain(c, 1, InitialParams(), s);
  EXPECT_EQ(runs[0].save.code(), StatusCode::kAlreadyExists) << runs[0].save;
  EXPECT_TRUE(ReadCheckpointManifest(ckpt.path() + "/x").ok());
  // Tags that are not plain directory names.
  for (const char* bad : {"../up", ".hidden", "latest", "a/b"}) {
    s.save.tag = bad;
    EXPECT_EQ(CkptTrain(c, 1, InitialParams(), s)[0].save.code(), StatusCode::kInvalidArgument)
        << bad;
  }
  // Between a backward and its step.
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  CheckpointSaveRequest so;
  so.dir = ckpt.path();
  EXPECT_EQ(e->SaveCheckpoint(so).status().code(), StatusCode::kFailedPrecondition);
  CheckpointLoadRequest lo;
  lo.dir = ckpt.path();
  EXPECT_EQ(e->LoadCheckpoint(lo).status().code(), StatusCode::kFailedPrecondition);
}

// A save that cannot write (the file size limit stands in for a full disk): a clear error
// on every rank, no partial tag left, the previous checkpoint and `latest` intact.
TEST(CheckpointTest, AFailedWriteLeavesThePreviousCheckpoint) {
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kFp32);
  CkptPlan first = Steps(0, 1);
  first.save.dir = ckpt.path();
  ASSERT_TRUE(CkptTrain(c, 2, InitialParams(), first)[0].save.ok());
  struct sigaction ignore {
  }, old{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &old), 0);
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit small = before;
  small.rlim_cur = 1000;  // under one rank file
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  CkptPlan second = Steps(0, 2);
  second.save.dir = ckpt.path();
  const std::vector<CkptRun> runs = CkptTrain(c, 2, InitialParams(), second);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &before), 0);
  ASSERT_EQ(sigaction(SIGXFSZ, &old, nullptr), 0);
  for (const CkptRun& run : runs) {
    EXPECT_FALSE(run.save.ok());
    EXPECT_NE(run.save.message().find("saving checkpoint global_step2"), std::string::npos)
        << run.save;
    EXPECT_NE(run.save.message().find("previous checkpoints are unchanged"), std::string::npos)
        << run.save;
  }
  EXPECT_FALSE(::access((ckpt.path() + "/.tmp-global_step2").c_str(), F_OK) == 0);
  EXPECT_FALSE(::access((ckpt.path() + "/global_step2").c_str(), F_OK) == 0);
  EXPECT_EQ(*ResolveCheckpointTag(ckpt.path(), ""), "global_step1");
  CkptPlan load = Steps(1, 1);
  load.load.dir = ckpt.path();
  EXPECT_TRUE(CkptTrain(c, 2, OtherParams(), load)[0].load.ok());
}

// tmpfs (O_DIRECT since Linux 6.6; on older kernels the rank files go through the page
// cache) and the read-back after the fsync: the checkpoint resumes the same.
TEST(CheckpointTest, TmpfsAndTheReadBackWork) {
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    GTEST_SKIP() << "no tmpfs at /dev/shm to save to";
  }
  char tmpl[] = "/dev/shm/strata-ckpt-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const Config c = PrecisionConfig(Precision::kBf16);
  const std::vector<CkptRun> full = CkptTrain(c, 2, InitialParams(), Steps(0, 3));
  CkptPlan first = Steps(0, 2);
  first.save.dir = dir;
  first.save.verify_read_back = true;
  ASSERT_TRUE(CkptTrain(c, 2, InitialParams(), first)[0].save.ok());
  CkptPlan second = Steps(2, 3);
  second.load.dir = dir;
  const std::vector<CkptRun> b = CkptTrain(c, 2, OtherParams(), second);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(b[r].load.ok()) << b[r].load;
    EXPECT_EQ(b[r].params, full[r].params);
  }
  ::nftw(
      dir.c_str(),
      [](const char* p, const struct stat*, int type, struct FTW*) {
        return (type == FTW_DP ? ::rmdir(p) : ::unlink(p)) == 0 ? 0 : -1;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

// The rank files written through the page cache (the fallback for a filesystem that refuses
// O_DIRECT, forced by test_buffered_writes): byte for byte the O_DIRECT writer's files of the
// same states, the same manifest, and they resume the same.
TEST(CheckpointTest, TheBufferedFallbackWritesTheSameFiles) {
  TempDir ckpt;
  const Config c = PrecisionConfig(Precision::kBf16);
  const std::vector<CkptRun> full = CkptTrain(c, 2, InitialParams(), Steps(0, 3));
  for (const bool buffered : {false, true}) {
    CkptPlan first = Steps(0, 2);
    first.save.dir = ckpt.path() + (buffered ? "/buffered" : "/direct");
    first.save.test_buffered_writes = buffered;
    const std::vector<CkptRun> saved = CkptTrain(c, 2, InitialParams(), first);
    for (const CkptRun& run : saved)
      ASSERT_TRUE(run.save.ok()) << run.save;
  }
  for (const char* file : {"rank-00000.bin", "rank-00001.bin", "manifest.json"}) {
    const std::string direct = Slurp(ckpt.path() + "/direct/global_step2/" + file);
    ASSERT_GT(direct.size(), 1000u) << file;  // read, not a missing file
    EXPECT_TRUE(direct == Slurp(ckpt.path() + "/buffered/global_step2/" + file)) << file;
  }
  CkptPlan second = Steps(2, 3);
  second.load.dir = ckpt.path() + "/buffered";
  const std::vector<CkptRun> b = CkptTrain(c, 2, OtherParams(), second);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(b[r].load.ok()) << b[r].load;
    EXPECT_EQ(b[r].params, full[r].params);
  }
}

// The entries of a directory, without . and ..
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = opendir(dir.c_str()); d != nullptr) {
    while (const dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A save killed (_exit(9)) at each named point, in a child process (tests/engine/
// checkpoint_crash_child.cc: 2 thread ranks save "first", train, save "second" with the
// crash point): the child dies there; afterwards `latest` names a complete tag that loads
// (the new one only once `latest` was renamed), every tag directory without a dot is
// complete and verifies, and a new save succeeds.
TEST(CheckpointCrashTest, APreviousCheckpointSurvivesEveryCrashPoint) {
  const std::vector<std::string>& points = CheckpointCrashPoints();
  ASSERT_EQ(points.size(), 12u);
  const Config c = PrecisionConfig(Precision::kFp32);
  for (size_t i = 0; i < points.size(); ++i) {
    const std::string& point = points[i];
    SCOPED_TRACE("crash point " + point);
    TempDir ckpt;
    std::string child = STRATA_CKPT_CRASH_CHILD;
    char* argv[] = {child.data(), const_cast<char*>(ckpt.path().c_str()),
                    const_cast<char*>(point.c_str()), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, child.c_str(), nullptr, nullptr, argv, environ), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
    ASSERT_EQ(WEXITSTATUS(status), 9) << "the child did not stop at " << point;
    const bool moved = point == "latest_renamed";
    Result<std::string> latest = ResolveCheckpointTag(ckpt.path(), "");
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, moved ? "second" : "first");
    for (const std::string& name : Entries(ckpt.path())) {
      if (name[0] == '.' || name == "latest" || name == "latest.tmp") continue;
      SCOPED_TRACE("tag " + name);
      Result<CheckpointManifest> m = ReadCheckpointManifest(ckpt.path() + "/" + name);
      ASSERT_TRUE(m.ok()) << m.status();
      for (const CheckpointRankPart& part : m->ranks)
        for (const CheckpointTensor& t : part.tensors)
          EXPECT_TRUE(VerifyCheckpointTensor(ckpt.path() + "/" + name, *m, part, t).ok());
    }
    const bool second_exists = ::access((ckpt.path() + "/second").c_str(), F_OK) == 0;
    EXPECT_EQ(second_exists, i >= 7) << "the tag appears exactly at its rename";
    CkptPlan p = Steps(moved ? 2 : 1, 3);
    p.load.dir = ckpt.path();
    p.save.dir = ckpt.path();
    p.save.tag = "third";
    const std::vector<CkptRun> runs = CkptTrain(c, 2, OtherParams(), p);
    for (const CkptRun& run : runs) {
      ASSERT_TRUE(run.load.ok()) << run.load;
      EXPECT_EQ(run.loaded.tag, moved ? "second" : "first");
      ASSERT_TRUE(run.save.ok()) << run.save;
    }
    EXPECT_EQ(*ResolveCheckpointTag(ckpt.path(), ""), "third");
  }
}

}  // namespace
}  // namespace strata::engine

// The model in and out in Hugging Face's layout, torch-free: ModelWriter's
// files read back by SafetensorsReader (sharding, the index, an earlier save's files, a
// failed save leaving the directory as it was), SaveModel on the toy model on 1-3 thread
// ranks (rank 0 writes every rank's values; a failure on rank 0 fails every rank), and
// SetParameters (one rank's values written into every rank's shards, as
// strata.zero.GatheredParameters(modifier_rank=...) does on exit), and AssembleParameters
// (the shards made from every rank's parts, as strata.zero.Init keeps them).
#include <dirent.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "strata/engine/checkpoint/model_writer.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/runtime/save_model.h"
#include "temp_dir.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using ScratchDir = testing::TempDir;

std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.insert(n);
  }
  ::closedir(d);
  return out;
}

std::vector<float> Ramp(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = start + 0.25f * static_cast<float>(i);
  return v;
}

// Three F32 tensors of 40 bytes each and one I64: `limit` bytes per file.
Result<ModelWriteStats> WriteThree(const std::string& dir, uint64_t limit, float start = 1.0f) {
  std::vector<ModelTensorSpec> specs = {{"a.weight", "F32", {2, 5}},
                                        {"b.weight", "F32", {10}},
                                        {"c", "I64", {2}},
                                        {"d", "F32", {10}}};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ModelWriter> w,
                          ModelWriter::Create(dir, "model.safetensors", specs, limit, {}));
  for (float s : {start, start + 10.0f}) {
    const std::vector<float> v = Ramp(10, s);
    // In two pieces of uneven size: a tensor's bytes may arrive in any pieces.
    STRATA_RETURN_IF_ERROR(w->Append(v.data(), 12));
    STRATA_RETURN_IF_ERROR(w->Append(reinterpret_cast<const std::byte*>(v.data()) + 12, 28));
  }
  const int64_t ints[2] = {7, -3};
  STRATA_RETURN_IF_ERROR(w->Append(ints, sizeof ints));
  const std::vector<float> d = Ramp(10, start + 20.0f);
  STRATA_RETURN_IF_ERROR(w->Append(d.data(), 40));
  return w->Commit();
}

TEST(ModelWriterTest, ShardsAndTheIndexReadBack) {
  ScratchDir dir;
  Result<ModelWriteStats> s = WriteThree(dir.path(), 80);
  ASSERT_TRUE(s.ok()) << s.status();
  // 40 + 40 fit 80; the I64 (16) starts the second file, d the second too (56 <= 80).
  EXPECT_EQ(s->files, (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                "model-00002-of-00002.safetensors"}));
  EXPECT_EQ(s->index, "model.safetensors.index.json");
  EXPECT_EQ(s->tensors, 4u);
  EXPECT_EQ(s->tensor_bytes, 136u);
  EXPECT_EQ(Listing(dir.path()), (std::set<std::string>{"model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors",
                                                        "model.safetensors.index.json"}));
  std::ifstream in(dir.File("model.safetensors.index.json"));
  const nlohmann::json index = nlohmann::json::parse(in);
  EXPECT_EQ(index["metadata"]["total_size"], 136);
  EXPECT_EQ(index["weight_map"]["c"], "model-00002-of-00002.safetensors");
  Result<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(dir.File("model.safetensors.index.json"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->Find("a.weight")->shape, (std::vector<int64_t>{2, 5}));
  std::vector<float> out(10);
  ASSERT_TRUE((*r)->ReadFloat("b.weight", 0, out).ok());
  EXPECT_EQ(out, Ramp(10, 11.0f));
  ASSERT_TRUE((*r)->ReadFloat("d", 0, out).ok());
  EXPECT_EQ(out, Ramp(10, 21.0f));
  EXPECT_EQ((*r)->Find("c")->dtype, "I64");
}

TEST(ModelWriterTest, ASaveReplacesTheEarlierSavesFiles) {
  ScratchDir dir;
  ASSERT_TRUE(WriteThree(dir.path(), 40).ok());  // four files
  EXPECT_EQ(Listing(dir.path()).size(), 5u);
  {
    std::ofstream other(dir.File("config.json"));
    other << "{}";
  }
  // One file now: the shards and the index go, what is not the model's stays.
  Result<ModelWriteStats> s = WriteThree(dir.path(), 1000, 5.0f);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->index, "");
  EXPECT_EQ(Listing(dir.path()), (std::set<std::string>{"config.json", "model.safetensors"}));
  Result<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(dir.File("model.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<float> out(10);
  ASSERT_TRUE((*r)->ReadFloat("a.weight", 0, out).ok());
  EXPECT_EQ(out, Ramp(10, 5.0f));
  // Sharded again: the single file goes.
  ASSERT_TRUE(WriteThree(dir.path(), 80).ok());
  EXPECT_EQ(Listing(dir.path()).count("model.safetensors"), 0u);
  EXPECT_EQ(Listing(dir.path()).count("model.safetensors.index.json"), 1u);
}

TEST(ModelWriterTest, AnUnfinishedWriteLeavesTheDirectoryAsItWas) {
  ScratchDir dir;
  ASSERT_TRUE(WriteThree(dir.path(), 1000).ok());
  const std::set<std::string> before = Listing(dir.path());
  {
    Result<std::unique_ptr<ModelWriter>> w =
        ModelWriter::Create(dir.path(), "model.safetensors", {{"x", "F32", {4}}}, 1000, {});
    ASSERT_TRUE(w.ok()) << w.status();
    const float v[2] = {1, 2};
    ASSERT_TRUE((*w)->Append(v, sizeof v).ok());
    Result<ModelWriteStats> early = (*w)->Commit();
    EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition) << early.status();
    EXPECT_NE(early.status().message().find("not all written (tensor x"), std::string::npos);
    const float more[4] = {};
    const Status past = (*w)->Append(more, sizeof more);
    EXPECT_EQ(past.code(), StatusCode::kFailedPrecondition) << past;
  }  // destroyed uncommitted
  EXPECT_EQ(Listing(dir.path()), before);
  Result<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(dir.File("model.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE((*r)->Find("a.weight"), nullptr);
}

TEST(ModelWriterTest, BadInputIsRefusedWithItsName) {
  ScratchDir dir;
  auto create = [&](const std::string& name, std::vector<ModelTensorSpec> specs,
                    uint64_t limit = 100) {
    return ModelWriter::Create(dir.path(), name, std::move(specs), limit, {}).status();
  };
  Status s = create("model.bin", {{"x", "F32", {1}}});
  EXPECT_NE(s.message().find("ending in .safetensors"), std::string::npos) << s;
  s = create("model.safetensors", {{"x", "F32", {1}}, {"x", "F32", {1}}});
  EXPECT_NE(s.message().find("two tensors of the model are named x"), std::string::npos) << s;
  s = create("model.safetensors", {{"x", "Q4", {1}}});
  EXPECT_NE(s.message().find("tensor x has dtype Q4"), std::string::npos) << s;
  s = create("model.safetensors", {{"x", "F32", {1}}}, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Listing(dir.path()).empty());
}

// ---------------------------------------------------------------------------
// SaveModel and SetParameters on the toy model.

const char* SafetensorsNameOf(DType t) {
  return t == DType::kBFloat16 ? "BF16" : t == DType::kFloat16 ? "F16" : "F32";
}

SaveModelRequest ToyRequest(const EngineCore& e, const std::string& dir) {
  SaveModelRequest r;
  r.dir = dir;
  r.max_file_bytes = 100;  // several files
  for (int g = 0; g < e.num_groups(); ++g) {
    r.params.emplace_back();
    for (const ParamSlot& p : e.layout(g).params)
      r.params.back().push_back({e.layout(g).name + "." + p.name, {static_cast<int64_t>(p.numel)}});
  }
  return r;
}

class SaveModelTest : public ::testing::TestWithParam<std::tuple<int, DType>> {};

// Rank 0's files hold every rank's trained values in the working dtype (the fp32 master
// rounded), under the names given; a tensor the front end keeps whole is rank 0's; a
// parameter named "" is left out.
TEST_P(SaveModelTest, TheFilesHoldTheTrainedModel) {
  const auto [world, dtype] = GetParam();
  Config c = BaseConfig();
  c.fp16.enabled = dtype == DType::kFloat16;
  c.bf16 = dtype == DType::kBFloat16;
  ScratchDir dir;
  const std::string out = dir.path() + "/saved";
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<Status> saved(static_cast<size_t>(world));
  std::vector<Params> trained(static_cast<size_t>(world));
  std::vector<SaveModelResult> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<EngineCore> e =
          MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), InitialParams());
      STRATA_CHECK(e != nullptr);
      for (int s = 0; s < 2; ++s) {
        STRATA_CHECK_OK(EngineMicroStep(*e, Seq(s), MakeBatch(s)).status());
        STRATA_CHECK_OK(e->Step().status());
      }
      SaveModelRequest req = ToyRequest(*e, out);
      req.params[1][1].name = "";                                  // layer1.bias left out
      const float extra[3] = {static_cast<float>(r), 2.0f, 3.0f};  // rank 0's is written
      req.whole.push_back({"extra", "F32", {3}, extra});
      req.small_files = {{"config.json", "{\"rank\": " + std::to_string(r) + "}\n"}};
      Result<SaveModelResult> res = SaveModel(*e, req);
      saved[static_cast<size_t>(r)] = res.status();
      if (res.ok()) results[static_cast<size_t>(r)] = *res;
      trained[static_cast<size_t>(r)] = EngineParams(*e);
    });
  }
  for (auto& t : threads)
    t.join();
  for (const Status& s : saved)
    ASSERT_TRUE(s.ok()) << s;
  ASSERT_GT(results[0].files.files.size(), 1u);
  EXPECT_GT(results[0].gather_bytes, 0u);
  Result<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::Open(out + "/model.safetensors.index.json");
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::vector<GroupDesc> groups = Groups(InitialParams());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params.size(); ++i) {
      const std::string name = groups[g].name + "." + groups[g].params[i].name;
      if (g == 1 && i == 1) {
        EXPECT_EQ((*reader)->Find(name), nullptr) << name;
        continue;
      }
      ASSERT_NE((*reader)->Find(name), nullptr) << name;
      EXPECT_EQ((*reader)->Find(name)->dtype, SafetensorsNameOf(dtype)) << name;
      const std::vector<float>& master = trained[0][g][i];
      std::vector<float> want(master.size()), got(master.size());
      std::vector<std::byte> half(master.size() * DTypeSize(dtype));
      ConvertFromFloat(master.data(), master.size(), half.data(), dtype);
      ConvertToFloat(half.data(), dtype, master.size(), want.data());
      ASSERT_TRUE((*reader)->ReadFloat(name, 0, got).ok());
      EXPECT_TRUE(BitEqual(got, want)) << name;
    }
  }
  std::ifstream config(out + "/config.json");
  std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{\"rank\": 0}\n");  // rank 0's
  std::vector<float> extra(3);
  ASSERT_TRUE((*reader)->ReadFloat("extra", 0, extra).ok());
  EXPECT_EQ(extra, (std::vector<float>{0.0f, 2.0f, 3.0f}));
}

INSTANTIATE_TEST_SUITE_P(Ranks, SaveModelTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)));

// A directory rank 0 cannot make, or a front end's check failing on rank 1: every rank
// fails naming the rank, and the engine trains on.
TEST(SaveModelFailureTest, AFailureOnOneRankFailsEveryRank) {
  for (const bool check_fails : {false, true}) {
    SCOPED_TRACE(check_fails ? "rank 1's check" : "rank 0's directory");
    ScratchDir dir;
    {
      std::ofstream file(dir.File("file"));
      file << "x";
    }
    const std::string out = check_fails ? dir.File("saved") : dir.File("file") + "/saved";
    auto group = std::make_shared<ThreadGroup>(2);
    std::vector<Status> saved(2), after(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        std::unique_ptr<EngineCore> e = MakeEngine(
            BaseConfig(), std::make_shared<ThreadCommunicator>(group, r), InitialParams());
        STRATA_CHECK(e != nullptr);
        SaveModelRequest req = ToyRequest(*e, out);
        if (check_fails && r == 1) req.local_check = InvalidArgumentError("config.json: disk full");
        saved[static_cast<size_t>(r)] = SaveModel(*e, req).status();
        after[static_cast<size_t>(r)] = EngineMicroStep(*e, Seq(0), MakeBatch(0)).status();
        if (after[static_cast<size_t>(r)].ok()) after[static_cast<size_t>(r)] = e->Step().status();
      });
    }
    for (auto& t : threads)
      t.join();
    for (int r = 0; r < 2; ++r) {
      const Status& s = saved[static_cast<size_t>(r)];
      EXPECT_FALSE(s.ok());
      EXPECT_NE(s.message().find("saving the model to " + out + " failed on rank " +
                                 std::string(check_fails ? "1" : "0")),
                std::string::npos)
          << s;
      EXPECT_TRUE(after[static_cast<size_t>(r)].ok()) << after[static_cast<size_t>(r)];
    }
    EXPECT_EQ(Listing(dir.path()), (std::set<std::string>{"file"}));
  }
}

// Rank `source`'s values for two parameters (one in the root group, one in a layer) go into
// every rank's shards: the model then computes what a model built with those values does.
TEST(SetParametersTest, OneRanksValuesTrainOnEveryRank) {
  for (const int world : {1, 2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const int source = world - 1;
    Params changed = InitialParams();
    changed[0][0][0] = 1.75f;
    for (float& v : changed[2][0])
      v *= -0.5f;
    auto group = std::make_shared<ThreadGroup>(world);
    std::vector<double> loss(static_cast<size_t>(world));
    std::vector<Status> set(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        std::unique_ptr<EngineCore> e = MakeEngine(
            BaseConfig(), std::make_shared<ThreadCommunicator>(group, r), InitialParams());
        STRATA_CHECK(e != nullptr);
        // Other ranks' buffers hold garbage: only the source's count.
        std::vector<float> a(1, -99.0f), b(changed[2][0].size(), -99.0f);
        if (r == source) {
          a = changed[0][0];
          b = changed[2][0];
        }
        set[static_cast<size_t>(r)] = e->SetParameters(Status::Ok(), source, {{0, 0}, {2, 0}},
                                                       {std::span<float>(a), std::span<float>(b)});
        Result<double> l = EngineMicroStep(*e, Seq(0), MakeBatch(0));
        STRATA_CHECK_OK(l.status());
        loss[static_cast<size_t>(r)] = *l;
        STRATA_CHECK_OK(e->Step().status());
      });
    }
    for (auto& t : threads)
      t.join();
    const std::vector<double> want = LossOfModelBuiltFrom(BaseConfig(), world, changed, 0);
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(set[static_cast<size_t>(r)].ok()) << set[static_cast<size_t>(r)];
      EXPECT_EQ(loss[static_cast<size_t>(r)], want[static_cast<size_t>(r)]) << "rank " << r;
    }
  }
}

TEST(SetParametersTest, ACheckFailingOnOneRankChangesNothing) {
  auto group = std::make_shared<ThreadGroup>(2);
  std::vector<Status> set(2);
  std::vector<double> loss(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<EngineCore> e =
          MakeEngine(BaseConfig(), std::make_shared<ThreadCommunicator>(group, r), InitialParams());
      STRATA_CHECK(e != nullptr);
      std::vector<float> a(1, 5.0f);
      const Status check = r == 0 ? InvalidArgumentError("weight changed shape") : Status::Ok();
      set[static_cast<size_t>(r)] = e->SetParameters(check, 0, {{0, 0}}, {std::span<float>(a)});
      Result<double> l = EngineMicroStep(*e, Seq(0), MakeBatch(0));
      STRATA_CHECK_OK(l.status());
      loss[static_cast<size_t>(r)] = *l;
    });
  }
  for (auto& t : threads)
    t.join();
  const std::vector<double> want = LossOfModelBuiltFrom(BaseConfig(), 2, InitialParams(), 0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(set[static_cast<size_t>(r)].code(), StatusCode::kInvalidArgument);
    EXPECT_NE(
        set[static_cast<size_t>(r)].message().find(
            "checking the parameters to set failed on rank 0; rank 0: InvalidArgument: weight "
            "changed shape"),
        std::string::npos)
        << set[static_cast<size_t>(r)];
    EXPECT_NE(set[static_cast<size_t>(r)].message().find("nothing was changed"), std::string::npos);
    EXPECT_EQ(loss[static_cast<size_t>(r)], want[static_cast<size_t>(r)]);
  }
}

// Each rank holds comm::Partition of every parameter (as strata.zero.Init keeps them); an
// engine made without values assembles its shards from them: its parameters are then the
// model's bit for bit, on every world size, whatever the chunks the parts are gathered in
// (0: the default, one chunk for these small parameters; 1 and 3 elements: many, their
// ends falling anywhere in the ranks' parts and shards).
TEST(AssembleParametersTest, EveryRanksPartsMakeTheModel) {
  for (const int world : {1, 2, 3}) {
    for (const size_t chunk : {size_t{0}, size_t{1}, size_t{3}}) {
      SCOPED_TRACE("world " + std::to_string(world) + ", chunk " + std::to_string(chunk));
      const Params want = InitialParams();
      auto group = std::make_shared<ThreadGroup>(world);
      std::vector<Params> got(static_cast<size_t>(world));
      std::vector<Status> made(static_cast<size_t>(world));
      std::vector<size_t> reads(static_cast<size_t>(world), 0);
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          std::unique_ptr<EngineCore> e = MakeEngine(
              BaseConfig(), std::make_shared<ThreadCommunicator>(group, r), ZerosLike(want));
          STRATA_CHECK(e != nullptr);
          std::vector<std::pair<int, size_t>> which;
          std::vector<std::vector<float>> parts;
          for (size_t g = 0; g < want.size(); ++g)
            for (size_t i = 0; i < want[g].size(); ++i) {
              const comm::Shard sh = comm::Partition(want[g][i].size(), world, r);
              which.emplace_back(static_cast<int>(g), i);
              parts.emplace_back(
                  want[g][i].begin() + static_cast<std::ptrdiff_t>(sh.offset),
                  want[g][i].begin() + static_cast<std::ptrdiff_t>(sh.offset + sh.count));
            }
          EngineCore::AssembleParts in;
          for (const std::vector<float>& p : parts)
            in.sizes.push_back(p.size());
          in.chunk_elems = chunk;
          in.read = [&](size_t k, size_t first, std::span<float> out) {
            STRATA_CHECK(first + out.size() <= parts[k].size());
            STRATA_CHECK(chunk == 0 || out.size() <= chunk);
            ++reads[static_cast<size_t>(r)];
            std::copy_n(parts[k].begin() + static_cast<std::ptrdiff_t>(first), out.size(),
                        out.begin());
            return Status::Ok();
          };
          made[static_cast<size_t>(r)] = e->AssembleParameters(Status::Ok(), which, in);
          got[static_cast<size_t>(r)] = EngineParams(*e);
          STRATA_CHECK_OK(EngineMicroStep(*e, Seq(0), MakeBatch(0)).status());
        });
      }
      for (auto& t : threads)
        t.join();
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(made[static_cast<size_t>(r)].ok()) << made[static_cast<size_t>(r)];
        if (chunk == 1) {  // one read per element of the rank's parts
          size_t elements = 0;
          for (const auto& group_params : want)
            for (const auto& p : group_params)
              elements += comm::Partition(p.size(), world, r).count;
          EXPECT_EQ(reads[static_cast<size_t>(r)], elements);
        }
        for (size_t g = 0; g < want.size(); ++g)
          for (size_t i = 0; i < want[g].size(); ++i)
            EXPECT_TRUE(BitEqual(got[static_cast<size_t>(r)][g][i], want[g][i])) << g << "/" << i;
      }
    }
  }
}

// A part that cannot be read on one rank (after the check): every rank takes part in every
// gather all the same, and every rank fails naming it.
TEST(AssembleParametersTest, AReadFailureOnOneRankFailsEveryRank) {
  auto group = std::make_shared<ThreadGroup>(2);
  std::vector<Status> made(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const Params want = InitialParams();
      std::unique_ptr<EngineCore> e =
          MakeEngine(BaseConfig(), std::make_shared<ThreadCommunicator>(group, r), ZerosLike(want));
      STRATA_CHECK(e != nullptr);
      std::vector<std::pair<int, size_t>> which;
      EngineCore::AssembleParts in;
      for (size_t g = 0; g < want.size(); ++g)
        for (size_t i = 0; i < want[g].size(); ++i) {
          which.emplace_back(static_cast<int>(g), i);
          in.sizes.push_back(comm::Partition(want[g][i].size(), 2, r).count);
        }
      in.read = [&](size_t k, size_t, std::span<float> out) {
        if (r == 1 && k == 1) return IOError("the part of parameter 1 is gone");
        std::fill(out.begin(), out.end(), 1.0f);
        return Status::Ok();
      };
      made[static_cast<size_t>(r)] = e->AssembleParameters(Status::Ok(), which, in);
    });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < 2; ++r) {
    const Status& s = made[static_cast<size_t>(r)];
    EXPECT_FALSE(s.ok()) << "rank " << r;
    EXPECT_NE(s.message().find("the part of parameter 1 is gone"), std::string::npos) << s;
  }
}

// A part of the wrong size (built for another world size) on one rank: every rank fails
// naming it, nothing changed.
TEST(AssembleParametersTest, APartOfTheWrongSizeChangesNothing) {
  auto group = std::make_shared<ThreadGroup>(2);
  std::vector<Status> made(2);
  std::vector<Params> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<EngineCore> e =
          MakeEngine(BaseConfig(), std::make_shared<ThreadCommunicator>(group, r), InitialParams());
      STRATA_CHECK(e != nullptr);
      const size_t n = e->layout(0).params[0].numel;
      std::vector<float> part(r == 1 ? n : comm::Partition(n, 2, r).count, 9.0f);
      made[static_cast<size_t>(r)] =
          e->AssembleParameters(Status::Ok(), {{0, 0}}, {std::span<const float>(part)});
      got[static_cast<size_t>(r)] = EngineParams(*e);
    });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < 2; ++r) {
    const Status& s = made[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("checking the parameters to assemble failed on rank 1"),
              std::string::npos)
        << s;
    EXPECT_NE(s.message().find("another world size"), std::string::npos) << s;
    EXPECT_TRUE(BitEqual(got[static_cast<size_t>(r)][0][0], InitialParams()[0][0]));
  }
}

}  // namespace
}  // namespace strata::engine

// Initial weights from safetensors files: the torch-free reader against files
// written here by the format's definition (the Python `safetensors` package checks the
// same reader in tests/python), the name matching, and EngineCore::LoadParameters on the
// toy model: each rank reads only its slices, the loaded model computes what a model built
// from those values computes, a failure on one rank fails the load on every rank.
#include "strata/engine/checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "strata/engine/layout/dtype.h"
#include "strata/engine/runtime/engine_core.h"
#include "temp_dir.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using ScratchDir = testing::TempDir;

struct FileTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

FileTensor F32(std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
  FileTensor t{std::move(name), "F32", std::move(shape), std::vector<std::byte>(v.size() * 4)};
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

FileTensor Half(std::string name, DType type, std::vector<int64_t> shape,
                const std::vector<float>& v) {
  FileTensor t{std::move(name), type == DType::kBFloat16 ? "BF16" : "F16", std::move(shape),
               std::vector<std::byte>(v.size() * 2)};
  ConvertFromFloat(v.data(), v.size(), t.bytes.data(), type);
  return t;
}

// A file as the format defines it: u64 LE header size, the JSON header, the data. `edit`
// may change the header before it is written.
void WriteFile(const std::string& path, const std::vector<FileTensor>& tensors,
               const std::function<void(nlohmann::json&)>& edit = {}) {
  nlohmann::json h = nlohmann::json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t at = 0;
  for (const FileTensor& t : tensors) {
    h[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  if (edit) edit(h);
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // padded, as writers may
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i)
    f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << text;
  for (const FileTensor& t : tensors)
    f.write(reinterpret_cast<const char*>(t.bytes.data()),
            static_cast<std::streamsize>(t.bytes.size()));
}

std::vector<float> Iota(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = scale * (static_cast<float>(i) - 3.5f);
  return v;
}

TEST(SafetensorsReaderTest, ReadsSlicesOfEveryFloatDType) {
  ScratchDir dir;
  const std::string path = dir.path() + "/m.safetensors";
  const std::vector<float> a = Iota(12, 0.25f), b = Iota(7, 0.5f), c = Iota(5, 1.0f);
  FileTensor d{"d", "F64", {3}, std::vector<std::byte>(24)};
  const double dv[3] = {1.5, -2.25, 1e-3};
  std::memcpy(d.bytes.data(), dv, 24);
  WriteFile(path, {F32("a", {3, 4}, a), Half("b", DType::kBFloat16, {7}, b),
                   Half("c", DType::kFloat16, {5}, c), d,
                   FileTensor{"ids", "I64", {2}, std::vector<std::byte>(16)}});
  Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ((*r)->tensors().size(), 5u);
  EXPECT_EQ((*r)->Find("a")->shape, (std::vector<int64_t>{3, 4}));
  std::vector<float> out(5);
  ASSERT_TRUE((*r)->ReadFloat("a", 6, out).ok());
  EXPECT_EQ(std::memcmp(out.data(), a.data() + 6, 20), 0);
  EXPECT_EQ((*r)->bytes_read(), 20u);
  std::vector<float> all(7);
  ASSERT_TRUE((*r)->ReadFloat("b", 0, all).ok());
  for (size_t i = 0; i < 7; ++i)
    EXPECT_EQ(all[i], b[i]);  // these values are exact in bf16
  std::vector<float> two(2);
  ASSERT_TRUE((*r)->ReadFloat("c", 3, two).ok());
  EXPECT_EQ(two[0], c[3]);
  EXPECT_EQ(two[1], c[4]);
  std::vector<float> three(3);
  ASSERT_TRUE((*r)->ReadFloat("d", 0, three).ok());
  EXPECT_EQ(three[1], -2.25f);
  EXPECT_EQ(three[2], 1e-3f);
  // Not float, past the end, unknown.
  Status st = (*r)->ReadFloat("ids", 0, two);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tensor 'ids' is I64"), std::string::npos) << st;
  EXPECT_EQ((*r)->ReadFloat("a", 10, three).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->ReadFloat("zz", 0, three).code(), StatusCode::kInvalidArgument);
}

TEST(SafetensorsReaderTest, AnIndexNamesTheFilesOfAShardedModel) {
  ScratchDir dir;
  WriteFile(dir.path() + "/m-00001-of-00002.safetensors", {F32("x", {4}, Iota(4, 1.0f))});
  WriteFile(dir.path() + "/m-00002-of-00002.safetensors", {F32("y", {2}, Iota(2, 2.0f))});
  const std::string index = dir.path() + "/m.safetensors.index.json";
  std::ofstream(index)
      << R"({"metadata": {"total_size": 24}, "weight_map": )"
      << R"({"x": "m-00001-of-00002.safetensors", "y": "m-00002-of-00002.safetensors"}})";
  Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(index);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->files().size(), 2u);
  std::vector<float> y(2);
  ASSERT_TRUE((*r)->ReadFloat("y", 0, y).ok());
  EXPECT_EQ(y[1], 2.0f * (1.0f - 3.5f));
  // An index that puts a tensor in the wrong file.
  std::ofstream(index, std::ios::trunc)
      << R"({"weight_map": {"x": "m-00002-of-00002.safetensors", "y": "m-00002-of-00002.safetensors"}})";
  r = SafetensorsReader::Open(index);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("puts tensor 'x' in m-00002-of-00002.safetensors"),
            std::string::npos)
      << r.status();
  std::ofstream(index, std::ios::trunc) << R"({"weight_map": {"x": "../etc/passwd"}})";
  EXPECT_EQ(SafetensorsReader::Open(index).status().code(), StatusCode::kInvalidArgument);
}

// Every malformed file is refused at Open with the file and the problem named.
TEST(SafetensorsReaderTest, MalformedFilesAreRefusedWithTheReason) {
  ScratchDir dir;
  const std::string path = dir.path() + "/bad.safetensors";
  auto expect = [&](const std::string& what) {
    Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status();
  };
  std::ofstream(path, std::ios::trunc) << "abc";
  expect("fewer than the 8 of the header size");
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const char n[8] = {static_cast<char>(0xff), 0x7f, 0, 0, 0, 0, 0, 0};
    f.write(n, 8);
    f << "{}";
  }
  expect("exceeds the file's 10 bytes");
  const std::vector<FileTensor> one = {F32("w", {2, 2}, Iota(4, 1.0f))};
  WriteFile(path, one, [](nlohmann::json& h) { h["w"]["dtype"] = "F31"; });
  expect("unknown dtype 'F31'");
  WriteFile(path, one, [](nlohmann::json& h) { h["w"]["shape"] = {2, 3}; });
  expect("shape needs 6 x 4");
  WriteFile(path, one, [](nlohmann::json& h) { h["w"]["data_offsets"] = {0, 32}; });
  expect("are not inside the 16 bytes of data");
  WriteFile(path, one, [](nlohmann::json& h) { h["w"].erase("shape"); });
  expect("lacks a string dtype");
  WriteFile(path, {F32("p", {2}, Iota(2, 1.0f)), F32("q", {2}, Iota(2, 1.0f))},
            [](nlohmann::json& h) {
              h["q"]["data_offsets"] = {4, 12};
            });
  expect("tensors 'p' and 'q' overlap");
  WriteFile(path, one, [](nlohmann::json& h) { h = nlohmann::json::array(); });
  expect("its header is not a JSON object");
  // Missing: NotFound.
  EXPECT_EQ(SafetensorsReader::Open(dir.path() + "/none.safetensors").status().code(),
            StatusCode::kNotFound);
}

TEST(SafetensorsReaderTest, AFileTruncatedAfterOpenIsDataLoss) {
  ScratchDir dir;
  const std::string path = dir.path() + "/t.safetensors";
  WriteFile(path, {F32("w", {1024}, Iota(1024, 1.0f))});
  Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status();
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  ASSERT_EQ(truncate(path.c_str(), st.st_size - 100), 0);
  std::vector<float> out(1024);
  Status s = (*r)->ReadFloat("w", 0, out);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s;
}

TEST(SafetensorsMatchTest, ListsMissingMismatchedAndExtraNames) {
  ScratchDir dir;
  const std::string path = dir.path() + "/m.safetensors";
  WriteFile(path, {F32("wte", {4, 2}, Iota(8, 1.0f)), F32("h.0.w", {3, 3}, Iota(9, 1.0f)),
                   F32("h.1.w", {3, 2}, Iota(6, 1.0f)), F32("surplus", {1}, {1.0f}),
                   FileTensor{"h.2.w", "I32", {3, 3}, std::vector<std::byte>(36)}});
  Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<ExpectedTensor> model = {
      {"lm_head", {"wte"}, {4, 2}, false}, {"h.0.w", {}, {3, 3}, false},
      {"h.1.w", {}, {3, 3}, false},        {"h.2.w", {}, {3, 3}, false},
      {"h.3.w", {}, {3, 3}, false},        {"buf", {}, {2}, true}};
  Result<std::vector<std::string>> m = MatchSafetensors(**r, model);
  ASSERT_FALSE(m.ok());
  const std::string msg = m.status().message();
  EXPECT_NE(msg.find("missing from the file (1):\n    h.3.w [3, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("h.1.w: the model has [3, 3], the file has F32 [3, 2]"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("h.2.w: the model has [3, 3], the file has I32 [3, 3]"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("in the file but not in the model (1):\n    surplus"), std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("buf"), std::string::npos) << msg;  // optional
  model.erase(model.begin() + 2, model.begin() + 5);
  WriteFile(path, {F32("wte", {4, 2}, Iota(8, 1.0f)), F32("h.0.w", {3, 3}, Iota(9, 1.0f))});
  r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status();
  m = MatchSafetensors(**r, model);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, (std::vector<std::string>{"wte", "h.0.w", ""}));  // lm_head from its alias
}

// ---------------------------------------------------------------------------
// EngineCore::LoadParameters on the toy model.

// Values unlike InitialParams'.
Params LoadedValues() {
  Params v = InitialParams();
  float x = 0.3f;
  for (auto& g : v)
    for (auto& t : g)
      for (float& e : t) {
        e = x;
        x = x * -1.07f + 0.011f;
        if (std::abs(x) > 2.0f) x *= 0.25f;
      }
  return v;
}

std::string ParamName(const EngineCore& e, int g, size_t i) {
  return e.layout(g).name + "." + e.layout(g).params[i].name;
}

void WriteModelFile(const std::string& path, const Params& v) {
  std::vector<FileTensor> t;
  const std::vector<GroupDesc> groups = Groups(v);
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].params.size(); ++i)
      t.push_back(F32(groups[g].name + "." + groups[g].params[i].name,
                      {static_cast<int64_t>(v[g][i].size())}, v[g][i]));
  WriteFile(path, t);
}

EngineCore::ParamReader ReaderOf(SafetensorsReader& r, const EngineCore& e) {
  return [&r, &e](int g, size_t i, uint64_t first, std::span<float> out) {
    return r.ReadFloat(ParamName(e, g, i), first, out);
  };
}

struct LoadRun {
  double loss_after_load = 0.0;
  uint64_t bytes_read = 0;
  Status load;
  Status after;  // training after the load
};

// What goes wrong on one rank, if anything.
struct Fault {
  int rank = -1;
  Status check;       // its verdict on the file
  Status read;        // what its reader returns from group 2 on
  bool skip = false;  // no load at all (every rank): the run to compare with
};
Fault CheckFails(int rank, Status s) {
  Fault f;
  f.rank = rank;
  f.check = std::move(s);
  return f;
}
Fault ReadFails(int rank, Status s) {
  Fault f;
  f.rank = rank;
  f.read = std::move(s);
  return f;
}
Fault NoLoad() {
  Fault f;
  f.skip = true;
  return f;
}

// `world` thread ranks: create from InitialParams, train `steps_before` steps, load the
// file, then one micro-step (its loss) and a step.
std::vector<LoadRun> LoadAndTrain(const Config& c, int world, const std::string& path,
                                  int steps_before, const Fault& fault = {}) {
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<LoadRun> runs(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      LoadRun& run = runs[static_cast<size_t>(r)];
      std::unique_ptr<EngineCore> e =
          MakeEngine(c, std::make_shared<ThreadCommunicator>(group, r), InitialParams());
      if (e == nullptr) {
        run.load = InternalError("no engine");
        return;
      }
      for (int s = 0; s < steps_before; ++s) {
        STRATA_CHECK_OK(EngineMicroStep(*e, Seq(s), MakeBatch(s)).status());
        STRATA_CHECK_OK(e->Step().status());
      }
      Result<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
      STRATA_CHECK_OK(reader.status());
      EngineCore::ParamReader read = ReaderOf(**reader, *e);
      const bool bad = r == fault.rank;
      if (!fault.skip) {
        run.load = e->LoadParameters(bad ? fault.check : Status::Ok(),
                                     [&](int g, size_t i, uint64_t first, std::span<float> out) {
                                       if (bad && g >= 2 && !fault.read.ok()) return fault.read;
                                       return read(g, i, first, out);
                                     });
      }
      run.bytes_read = (*reader)->bytes_read();
      Result<double> loss = EngineMicroStep(*e, Seq(steps_before), MakeBatch(steps_before));
      run.after = loss.status();
      if (loss.ok()) run.loss_after_load = *loss;
      if (run.after.ok()) run.after = e->Step().status();
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

class LoadParametersTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// Loaded before training and after a step (with the next iteration's prefetches in flight),
// the model computes bit for bit what a model built from the file's values computes, every
// rank read only its own slices (together: the file's data once), persistent groups included.
TEST_P(LoadParametersTest, TheModelComputesWithTheLoadedValues) {
  const auto [world, persistent] = GetParam();
  Config c = BaseConfig();
  c.zero.stage3_param_persistence_threshold = persistent ? 1000 : 0;
  ScratchDir dir;
  const std::string path = dir.path() + "/toy.safetensors";
  const Params v = LoadedValues();
  WriteModelFile(path, v);
  uint64_t data_bytes = 0;
  for (const auto& g : v)
    for (const auto& t : g)
      data_bytes += t.size() * 4;
  for (const int before : {0, 2}) {
    SCOPED_TRACE("steps before the load: " + std::to_string(before));
    std::vector<LoadRun> runs = LoadAndTrain(c, world, path, before);
    const std::vector<double> expected = LossOfModelBuiltFrom(c, world, v, before);
    uint64_t total = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      const LoadRun& run = runs[r];
      ASSERT_TRUE(run.load.ok()) << run.load;
      ASSERT_TRUE(run.after.ok()) << run.after;
      EXPECT_EQ(run.loss_after_load, expected[r]) << "rank " << r;
      total += run.bytes_read;
    }
    EXPECT_EQ(total, data_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, LoadParametersTest,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool()));

TEST(LoadParametersFailureTest, ACheckFailingOnOneRankChangesNothingOnAny) {
  Config c = BaseConfig();
  ScratchDir dir;
  const std::string path = dir.path() + "/toy.safetensors";
  WriteModelFile(path, LoadedValues());
  std::vector<LoadRun> runs =
      LoadAndTrain(c, 2, path, 1, CheckFails(1, InvalidArgumentError("tensor x: shape [3]")));
  // Unchanged: the same as training on without any load.
  const std::vector<LoadRun> plain = LoadAndTrain(c, 2, path, 1, NoLoad());
  for (size_t r = 0; r < runs.size(); ++r) {
    const LoadRun& run = runs[r];
    EXPECT_EQ(run.load.code(), StatusCode::kInvalidArgument) << run.load;
    EXPECT_NE(run.load.message().find("checking the parameters to load failed on rank 1; rank 1: "
                                      "InvalidArgument: tensor x: shape [3]"),
              std::string::npos)
        << run.load;
    EXPECT_NE(run.load.message().find("nothing was changed"), std::string::npos) << run.load;
    ASSERT_TRUE(run.after.ok()) << run.after;
    EXPECT_EQ(run.loss_after_load, plain[r].loss_after_load);
    EXPECT_EQ(run.bytes_read, 0u);
  }
  EXPECT_NE(plain[0].loss_after_load, LossOfModelBuiltFrom(c, 2, LoadedValues(), 1)[0]);
}

// A read failing on one rank after the check: every rank fails the load naming it, and
// training goes on (no rank is left in a collective). With the states on NVMe the
// parameters are those before the load; in host memory the message says they are partly
// replaced.
TEST(LoadParametersFailureTest, AReadFailingOnOneRankFailsTheLoadOnEvery) {
  for (const bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "nvme" : "host");
    ScratchDir dir;
    Config c = BaseConfig();
    if (nvme) {
      c.zero.offload_optimizer.device = OffloadDevice::kNvme;
      c.zero.offload_optimizer.nvme_path = {dir.path()};
      c.zero.offload_optimizer.buffer_count = 4;
      c.aio.block_size = 4096;
    }
    const std::string path = dir.path() + "/toy.safetensors";
    WriteModelFile(path, LoadedValues());
    std::vector<LoadRun> runs = LoadAndTrain(c, 2, path, 1, ReadFails(1, IOError("injected: EIO")));
    std::vector<LoadRun> plain = LoadAndTrain(c, 2, path, 1, NoLoad());
    for (size_t r = 0; r < runs.size(); ++r) {
      const LoadRun& run = runs[r];
      EXPECT_EQ(run.load.code(), StatusCode::kIOError) << run.load;
      EXPECT_NE(run.load.message().find("loading parameters failed on rank 1; rank 1: "),
                std::string::npos)
          << run.load;
      EXPECT_NE(run.load.message().find(nvme ? "the parameters are those before the load"
                                             : "partly replaced"),
                std::string::npos)
          << run.load;
      ASSERT_TRUE(run.after.ok()) << run.after;
      if (nvme) {
        EXPECT_EQ(run.loss_after_load, plain[r].loss_after_load);
      }
    }
  }
}

TEST(LoadParametersFailureTest, RefusedBetweenABackwardAndItsStep) {
  Config c = BaseConfig();
  ScratchDir dir;
  const std::string path = dir.path() + "/toy.safetensors";
  WriteModelFile(path, LoadedValues());
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(EngineMicroStep(*e, Seq(0), MakeBatch(0)).ok());
  Result<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
  ASSERT_TRUE(r.ok());
  Status s = e->LoadParameters(Status::Ok(), ReaderOf(**r, *e));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("between a backward and its step"), std::string::npos) << s;
  ASSERT_TRUE(e->Step().ok());
  EXPECT_TRUE(e->LoadParameters(Status::Ok(), ReaderOf(**r, *e)).ok());
  EXPECT_EQ(RelDiff(EngineParams(*e), LoadedValues()), 0.0);
}

}  // namespace
}  // namespace strata::engine

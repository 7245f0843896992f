// Tests of nvme_bench's library (tools/nvme_bench): statistics, sweep planning, option
// parsing, best settings and the config snippet (validated by the config code itself),
// the JSON and SVG writers, the scratch files and their removal, and the sweep driver
// over a fake engine (so every branch runs without io_uring) and over the real one.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/tools/nvme_bench/report.h"
#include "strata/tools/nvme_bench/scratch.h"
#include "strata/tools/nvme_bench/stats.h"
#include "strata/tools/nvme_bench/sweep.h"

namespace strata::nvme_bench {
namespace {

namespace fs = std::filesystem;
using swap::IoOp;

::testing::AssertionResult ContainsSubstr(const char* hay_expr, const char* needle_expr,
                                          const std::string& hay, const std::string& needle) {
  if (hay.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << hay_expr << " does not contain " << needle_expr
                                       << "\n  text:   " << hay << "\n  wanted: " << needle;
}
#define EXPECT_CONTAINS(hay, needle) EXPECT_PRED_FORMAT2(ContainsSubstr, hay, needle)

// A fresh directory under the system's temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir() {
    std::string t = (fs::temp_directory_path() / "nvme_bench_test.XXXXXX").string();
    EXPECT_NE(::mkdtemp(t.data()), nullptr) << std::strerror(errno);
    path_ = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  size_t Entries() const {
    return static_cast<size_t>(std::distance(fs::directory_iterator(path_), {}));
  }

 private:
  std::string path_;
};

// ---------------------------------------------------------------------------
// Statistics.

TEST(Stats, PercentileNearestRank) {
  std::vector<double> v(100);
  std::iota(v.begin(), v.end(), 1.0);
  std::shuffle(v.begin(), v.end(), std::mt19937(7));
  EXPECT_EQ(Percentile(v, 50), 50);
  EXPECT_EQ(Percentile(v, 99), 99);
  EXPECT_EQ(Percentile(v, 100), 100);
  EXPECT_EQ(Percentile(v, 0), 1);
  EXPECT_EQ(Percentile(v, 99.5), 100);
  std::vector<int64_t> w = {30, 10, 20};
  EXPECT_EQ(Percentile(std::span<int64_t>(w), 50), 20);
  EXPECT_EQ(Percentile(std::span<int64_t>(w), 99), 30);
  EXPECT_EQ(Percentile(std::span<int64_t>(w), 33), 10);
  std::vector<int64_t> one = {5};
  EXPECT_EQ(Percentile(std::span<int64_t>(one), 99), 5);
  std::vector<double> none;
  EXPECT_EQ(Percentile(none, 50), 0);
}

TEST(Stats, Median) {
  std::vector<double> odd = {3, 1, 2};
  EXPECT_EQ(Median(odd), 2);
  std::vector<double> even = {4, 1, 3, 2};
  EXPECT_EQ(Median(even), 2.5);
  std::vector<double> none;
  EXPECT_EQ(Median(none), 0);
}

TEST(Stats, SummarizeLatencies) {
  std::vector<int64_t> ns;
  for (int i = 1; i <= 1000; ++i)
    ns.push_back(i * 1000);  // 1..1000 us
  std::shuffle(ns.begin(), ns.end(), std::mt19937(1));
  LatencySummary s = SummarizeLatencies(ns);
  EXPECT_EQ(s.count, 1000u);
  EXPECT_DOUBLE_EQ(s.p50_us, 500);
  EXPECT_DOUBLE_EQ(s.p99_us, 990);
  EXPECT_DOUBLE_EQ(s.max_us, 1000);
  EXPECT_DOUBLE_EQ(s.mean_us, 500.5);
}

// ---------------------------------------------------------------------------
// Options, planning, parsing.

TEST(Sweep, PlanIsTheProductInOrder) {
  SweepOptions o;
  o.modes = {IoOp::kRead, IoOp::kWrite};
  o.block_sizes = {kMiB, 128 * kKiB};
  o.threads = {1, 2};
  o.queue_depths = {4, 16, 64};
  std::vector<SweepPoint> p = PlanSweep(o);
  ASSERT_EQ(p.size(), 2u * 2 * 2 * 3);
  EXPECT_EQ(p[0], (SweepPoint{IoOp::kRead, kMiB, 4, 1}));
  EXPECT_EQ(p[1], (SweepPoint{IoOp::kRead, kMiB, 16, 1}));
  EXPECT_EQ(p[3], (SweepPoint{IoOp::kRead, kMiB, 4, 2}));
  EXPECT_EQ(p[6], (SweepPoint{IoOp::kRead, 128 * kKiB, 4, 1}));
  EXPECT_EQ(p[12], (SweepPoint{IoOp::kWrite, kMiB, 4, 1}));
  EXPECT_EQ(p.back(), (SweepPoint{IoOp::kWrite, 128 * kKiB, 64, 2}));
  // Every combination exactly once.
  for (size_t i = 0; i < p.size(); ++i) {
    for (size_t j = i + 1; j < p.size(); ++j)
      EXPECT_FALSE(p[i] == p[j]) << i << " " << j;
  }
}

TEST(Sweep, DefaultsAndQuick) {
  SweepOptions d;
  EXPECT_EQ(PlanSweep(d).size(), 2u * 3 * 3 * 2);
  EXPECT_TRUE(d.Validate().ok());
  EXPECT_EQ(d.BytesPerFile(), kGiB);
  // The largest point: 8 MiB x (64 + a backlog of 64 / 8) x 2 threads.
  EXPECT_EQ(d.BufferBytes(), 8 * kMiB * (64 + 8) * 2);
  EXPECT_EQ(d.RequestsPerThread(4), 5);
  EXPECT_EQ(d.RequestsPerThread(16), 18);
  d.backlog = 0;
  EXPECT_EQ(d.RequestsPerThread(16), 16);
  EXPECT_EQ(d.BufferBytes(), 8 * kMiB * 64 * 2);
  d.backlog = 3;
  EXPECT_EQ(d.RequestsPerThread(16), 19);
  SweepOptions q = SweepOptions::Quick();
  EXPECT_TRUE(q.Validate().ok());
  EXPECT_LE(PlanSweep(q).size(), 8u);
  EXPECT_LE(q.size, 64 * kMiB);
}

TEST(Sweep, BytesPerFileSplitsAndRoundsUp) {
  SweepOptions o;
  o.paths = {"a", "b", "c"};
  o.size = kGiB;
  o.block_sizes = {kMiB};
  EXPECT_EQ(o.BytesPerFile(), 342 * kMiB);  // 341.33 MiB rounded up to whole blocks
  o.block_sizes = {8 * kMiB, 128 * kKiB};
  EXPECT_EQ(o.BytesPerFile(), 344 * kMiB);
}

TEST(Sweep, ValidateNamesTheOption) {
  SweepOptions o;
  o.block_sizes = {1000};
  EXPECT_CONTAINS(o.Validate().message(), "--block-size");
  o = SweepOptions();
  o.queue_depths = {0};
  EXPECT_CONTAINS(o.Validate().message(), "--queue-depth");
  o = SweepOptions();
  o.threads = {300};
  EXPECT_CONTAINS(o.Validate().message(), "--threads");
  o = SweepOptions();
  o.size = kMiB;
  EXPECT_CONTAINS(o.Validate().message(), "--size");
  o = SweepOptions();
  o.rounds = 0;
  EXPECT_CONTAINS(o.Validate().message(), "--rounds");
  o = SweepOptions();
  o.seconds = -1;
  EXPECT_CONTAINS(o.Validate().message(), "--seconds");
  o = SweepOptions();
  o.backlog = -2;
  EXPECT_CONTAINS(o.Validate().message(), "--backlog");
  o = SweepOptions();
  o.modes.clear();
  EXPECT_CONTAINS(o.Validate().message(), "--mode");
}

TEST(Parse, Lists) {
  auto sizes = ParseSizeList("128K, 1M,8MiB,4096", "--block-size");
  ASSERT_TRUE(sizes.ok()) << sizes.status();
  EXPECT_EQ(*sizes, (std::vector<uint64_t>{128 * kKiB, kMiB, 8 * kMiB, 4096}));
  auto dup = ParseSizeList("1M,1MiB", "--block-size");
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->size(), 1u);
  EXPECT_CONTAINS(ParseSizeList("1M,huge", "--block-size").status().message(), "--block-size");
  EXPECT_CONTAINS(ParseSizeList("1M,,2M", "--block-size").status().message(), "empty element");

  auto ints = ParseIntList("4,16,64", "--queue-depth");
  ASSERT_TRUE(ints.ok());
  EXPECT_EQ(*ints, (std::vector<int>{4, 16, 64}));
  EXPECT_CONTAINS(ParseIntList("4,x", "--queue-depth").status().message(),
                  "--queue-depth: \"x\" is not a whole number");
  EXPECT_FALSE(ParseIntList("1.5", "--threads").ok());
  EXPECT_FALSE(ParseIntList("", "--threads").ok());

  auto modes = ParseModeList("write,read", "--mode");
  ASSERT_TRUE(modes.ok());
  EXPECT_EQ(*modes, (std::vector<IoOp>{IoOp::kWrite, IoOp::kRead}));
  EXPECT_CONTAINS(ParseModeList("reed", "--mode").status().message(), "--mode: \"reed\"");

  EXPECT_EQ(*ParseMemoryKind("hugepage"), MemoryKind::kHugePage);
  EXPECT_EQ(*ParseMemoryKind("pinned"), MemoryKind::kPinned);
  EXPECT_EQ(*ParseMemoryKind("plain"), MemoryKind::kPlain);
  EXPECT_CONTAINS(ParseMemoryKind("gpu").status().message(), "--memory");
}

// ---------------------------------------------------------------------------
// Best settings, snippet, JSON, SVG.

PointResult Pt(IoOp mode, uint64_t bs, int qd, int threads, double gbps) {
  PointResult p;
  p.point = {mode, bs, qd, threads};
  p.bytes_per_second = gbps * 1e9;
  p.iops = p.bytes_per_second / static_cast<double>(bs);
  p.p50_us = 100;
  p.p99_us = 200;
  p.round_bytes_per_second = {p.bytes_per_second};
  return p;
}

std::vector<PointResult> SamplePoints() {
  return {
      Pt(IoOp::kRead, kMiB, 4, 1, 2.0),      Pt(IoOp::kRead, kMiB, 16, 1, 5.5),
      Pt(IoOp::kRead, 8 * kMiB, 4, 1, 5.0),  Pt(IoOp::kRead, 8 * kMiB, 16, 1, 5.6),
      Pt(IoOp::kWrite, kMiB, 4, 1, 1.5),     Pt(IoOp::kWrite, kMiB, 16, 1, 3.0),
      Pt(IoOp::kWrite, 8 * kMiB, 4, 1, 3.1), Pt(IoOp::kWrite, 8 * kMiB, 16, 1, 2.0),
  };
}

TEST(Report, ChooseBest) {
  BestSettings b = ChooseBest(SamplePoints());
  ASSERT_TRUE(b.read && b.write && b.chosen);
  EXPECT_EQ(b.read->point, (SweepPoint{IoOp::kRead, 8 * kMiB, 16, 1}));
  EXPECT_EQ(b.write->point, (SweepPoint{IoOp::kWrite, 8 * kMiB, 4, 1}));
  // 1/r + 1/w: 1M/16: 1/5.5 + 1/3.0 = 0.515; 8M/4: 1/5.0 + 1/3.1 = 0.523;
  // 8M/16: 1/5.6 + 1/2 = 0.679.
  EXPECT_EQ(b.chosen->block_size, kMiB);
  EXPECT_EQ(b.chosen->queue_depth, 16);
  EXPECT_DOUBLE_EQ(b.chosen_read_bytes_per_second, 5.5e9);
  EXPECT_DOUBLE_EQ(b.chosen_write_bytes_per_second, 3.0e9);

  std::vector<PointResult> reads = {Pt(IoOp::kRead, kMiB, 4, 1, 1), Pt(IoOp::kRead, kMiB, 8, 2, 3)};
  BestSettings r = ChooseBest(reads);
  ASSERT_TRUE(r.chosen);
  EXPECT_FALSE(r.write);
  EXPECT_EQ(r.chosen->threads, 2);
  EXPECT_EQ(r.chosen_write_bytes_per_second, 0);
  EXPECT_FALSE(ChooseBest({}).chosen);
}

TEST(Report, ConfigBandwidthRoundsDownAndParses) {
  EXPECT_EQ(ConfigBandwidth(5.2149e9), "5.21GB/s");
  EXPECT_EQ(ConfigBandwidth(5.21e9), "5.21GB/s");
  EXPECT_EQ(ConfigBandwidth(12.35e9), "12.3GB/s");
  EXPECT_EQ(ConfigBandwidth(812.7e6), "812MB/s");
  EXPECT_EQ(ConfigBandwidth(1.5e12), "1.50TB/s");
  EXPECT_EQ(ConfigBandwidth(0), "0");
  for (double v : {5.2149e9, 812.7e6, 999.99e6, 1e9, 123456.0, 7.0}) {
    auto parsed = ParseByteRate(ConfigBandwidth(v));
    ASSERT_TRUE(parsed.ok()) << ConfigBandwidth(v) << ": " << parsed.status();
    EXPECT_LE(*parsed, v);
    EXPECT_GE(*parsed, v * 0.99);
  }
}

TEST(Report, SnippetValidatesAsAConfig) {
  for (const auto& points :
       {SamplePoints(), std::vector<PointResult>{Pt(IoOp::kWrite, 128 * kKiB, 64, 2, 0.8)}}) {
    nlohmann::json snippet = ConfigSnippet(ChooseBest(points));
    ASSERT_TRUE(snippet.contains("aio"));
    nlohmann::json config = snippet;
    config["train_batch_size"] = 8;
    ValidationResult v = ValidateConfigJson(config.dump());
    EXPECT_TRUE(v.ok()) << config.dump(2) << "\n" << v.errors.front().ToString();
  }
  nlohmann::json s = ConfigSnippet(ChooseBest(SamplePoints()));
  EXPECT_EQ(s["aio"]["block_size"], kMiB);
  EXPECT_EQ(s["aio"]["queue_depth"], 16);
  EXPECT_EQ(s["aio"]["intra_op_parallelism"], 1);
  EXPECT_EQ(s["strata"]["nvme_read_bandwidth"], "5.50GB/s");
  EXPECT_EQ(s["strata"]["nvme_write_bandwidth"], "3.00GB/s");
  nlohmann::json w = ConfigSnippet(ChooseBest({Pt(IoOp::kWrite, kMiB, 4, 1, 1)}));
  EXPECT_FALSE(w["strata"].contains("nvme_read_bandwidth"));
  EXPECT_TRUE(ConfigSnippet(ChooseBest({})).empty());
}

SweepResult SampleResult() {
  SweepResult r;
  r.options.paths = {"/nvme0/<x>&y"};
  r.options.block_sizes = {kMiB, 8 * kMiB};
  r.options.queue_depths = {4, 16};
  r.options.threads = {1};
  r.filesystems = {"ext4 on /dev/nvme0n1"};
  r.bytes_per_file = kGiB;
  r.memory_obtained = "64 MiB host buffer, pinned (mlock), transparent";
  r.engine = "io_uring";
  r.fixed_buffers = true;
  r.points = SamplePoints();
  r.machine.hostname = "host";
  return r;
}

TEST(Report, JsonHasEveryKey) {
  nlohmann::json j = ToJson(SampleResult());
  for (const char* key : {"tool", "version", "units", "machine", "settings", "points", "best",
                          "config_snippet", "notes"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  ASSERT_EQ(j["points"].size(), 8u);
  for (const auto& p : j["points"]) {
    for (const char* key : {"mode", "block_size", "queue_depth", "threads", "memory", "gbps",
                            "iops", "p50_us", "p99_us"}) {
      EXPECT_TRUE(p.contains(key)) << key << " in " << p.dump();
    }
  }
  EXPECT_EQ(j["points"][1]["mode"], "read");
  EXPECT_EQ(j["points"][1]["block_size"], kMiB);
  EXPECT_EQ(j["points"][1]["gbps"], 5.5);
  EXPECT_EQ(j["points"][1]["memory"], "hugepage");
  EXPECT_EQ(j["settings"]["engine"], "io_uring");
  EXPECT_EQ(j["best"]["read"]["gbps"], 5.6);
  // Round-trips through text.
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
}

TEST(Report, TextReport) {
  SweepResult r = SampleResult();
  r.options.direct = false;
  r.notes = {"buffered I/O (--buffered): the page cache is in play"};
  const std::string text = FormatReport(r);
  EXPECT_CONTAINS(text, "GB/s = 10^9 bytes/s");
  EXPECT_CONTAINS(text, "note: buffered I/O");
  EXPECT_CONTAINS(text, "best read:   5.60 GB/s");
  EXPECT_CONTAINS(text, "best write:  3.10 GB/s");
  EXPECT_CONTAINS(text, "config snippet");
  EXPECT_CONTAINS(text, "\"nvme_write_bandwidth\": \"3.00GB/s\"");
  EXPECT_CONTAINS(text, "page cache");
  // The table has a header and one row per point.
  const std::string table = FormatTable(r.points);
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 9);
  EXPECT_CONTAINS(table, "p99 us");
}

TEST(Report, SvgStructure) {
  const std::string svg = RenderSvg(SampleResult());
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_CONTAINS(svg, "<svg xmlns=\"http://www.w3.org/2000/svg\"");
  EXPECT_CONTAINS(svg, "</svg>\n");
  EXPECT_CONTAINS(svg, ">read</text>");
  EXPECT_CONTAINS(svg, ">write</text>");
  EXPECT_CONTAINS(svg, "queue depth");
  EXPECT_CONTAINS(svg, ">1 MiB</text>");
  EXPECT_CONTAINS(svg, ">8 MiB</text>");
  // Two block sizes in two panels: four lines of two points each.
  size_t lines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 4u);
  // Paths are escaped.
  EXPECT_EQ(svg.find("<x>"), std::string::npos);
  // Every element that opens is closed (a rough well-formedness check; the shell test
  // parses the tool's SVG with an XML parser).
  auto count = [&](const std::string& s) {
    size_t n = 0;
    for (size_t at = svg.find(s); at != std::string::npos; at = svg.find(s, at + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(count("<g>"), count("</g>"));
  EXPECT_EQ(count("<text"), count("</text>"));
  EXPECT_EQ(count("<circle"), count("</circle>"));
}

TEST(Report, XmlEscape) {
  EXPECT_EQ(XmlEscape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
  EXPECT_EQ(XmlEscape(std::string("x\x01y")), "x?y");
}

// ---------------------------------------------------------------------------
// Scratch files.

TEST(Scratch, CreatesPrivateFilesAndRemovesThem) {
  TempDir a, b;
  {
    auto s = ScratchSpace::Create({a.path(), b.path()}, 4 * kMiB, /*direct=*/false);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(s->files().size(), 2u);
    for (const ScratchFile& f : s->files()) {
      struct stat st {};
      ASSERT_EQ(::stat(f.path.c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0600u);
      EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4 * kMiB);
      EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 4 * kMiB) << "not preallocated";
      ASSERT_EQ(::stat(f.directory.c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0700u);
      EXPECT_GE(f.fd, 0);
    }
    EXPECT_EQ(a.Entries(), 1u);
    // Moving keeps one owner.
    ScratchSpace moved = std::move(*s);
    EXPECT_EQ(moved.files().size(), 2u);
  }
  EXPECT_EQ(a.Entries(), 0u);
  EXPECT_EQ(b.Entries(), 0u);
}

TEST(Scratch, SignalHandlerRemovalEmptiesTheParents) {
  TempDir a;
  auto s = ScratchSpace::Create({a.path()}, kMiB, false);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(a.Entries(), 1u);
  RemoveScratchFromSignalHandler();
  EXPECT_EQ(a.Entries(), 0u);
  EXPECT_TRUE(s->Remove().ok());  // already gone: not an error
}

TEST(Scratch, Errors) {
  TempDir a;
  auto missing = ScratchSpace::Create({a.path() + "/nope"}, kMiB, false);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_CONTAINS(missing.status().message(), "--path");
  auto twice = ScratchSpace::Create({a.path(), a.path() + "/."}, kMiB, false);
  EXPECT_CONTAINS(twice.status().message(), "given twice");
  auto huge = ScratchSpace::Create({a.path()}, uint64_t{1} << 60, false);
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
  EXPECT_CONTAINS(huge.status().message(), "free");
  EXPECT_EQ(a.Entries(), 0u);
}

TEST(Scratch, DescribeFilesystem) {
  EXPECT_FALSE(DescribeFilesystem("/").empty());
  EXPECT_EQ(DescribeFilesystem("/nonexistent/dir"), "unknown filesystem");
}

// ---------------------------------------------------------------------------
// The sweep over a fake engine: synchronous pread/pwrite at Submit, completions queued.

struct FakeState {
  std::atomic<uint64_t> reads{0}, writes{0}, zero_reads{0}, engines{0}, registered_buffers{0};
  uint64_t fail_after = UINT64_MAX;  // requests before an injected EIO
  std::atomic<uint64_t> requests{0};
};

class FakeEngine final : public swap::IoEngine {
 public:
  FakeEngine(const swap::IoEngineOptions& o, FakeState* st) : options_(o), st_(st) {}
  std::string name() const override { return "fake"; }
  std::string fallback() const override { return ""; }
  const swap::IoEngineOptions& options() const override { return options_; }
  Result<swap::FileId> RegisterFile(int fd, std::string path) override {
    fds_.push_back(fd);
    paths_.push_back(std::move(path));
    return static_cast<swap::FileId>(fds_.size() - 1);
  }
  Status UnregisterFile(swap::FileId) override { return Status::Ok(); }
  Result<int> RegisterBuffer(std::span<std::byte>) override {
    ++st_->registered_buffers;
    return 0;
  }
  Status UnregisterBuffer(int) override { return Status::Ok(); }
  Status Submit(std::span<const swap::IoRequest> batch) override {
    for (const swap::IoRequest& r : batch) {
      if (r.file < 0 || static_cast<size_t>(r.file) >= fds_.size() || r.buffer == nullptr ||
          r.length == 0) {
        return InvalidArgumentError("bad request");
      }
    }
    for (const swap::IoRequest& r : batch) {
      const auto t0 = std::chrono::steady_clock::now();
      swap::IoCompletion c;
      c.tag = r.tag;
      c.op = r.op;
      c.file = r.file;
      c.offset = r.offset;
      c.length = r.length;
      if (++st_->requests > st_->fail_after) {
        c.status = ErrnoError(EIO, std::string(swap::IoOpName(r.op)) + " " + paths_[r.file]);
      } else {
        const ssize_t n =
            r.op == IoOp::kRead
                ? ::pread(fds_[r.file], r.buffer, r.length, static_cast<off_t>(r.offset))
                : ::pwrite(fds_[r.file], r.buffer, r.length, static_cast<off_t>(r.offset));
        if (n != static_cast<ssize_t>(r.length)) {
          c.status = IOError("short or failed transfer");
        } else {
          c.bytes_done = r.length;
        }
        if (r.op == IoOp::kRead) {
          ++st_->reads;
          uint64_t first = 0;
          std::memcpy(&first, r.buffer, 8);
          if (first == 0) ++st_->zero_reads;
        } else {
          ++st_->writes;
        }
      }
      c.latency = std::chrono::steady_clock::now() - t0 + std::chrono::microseconds(10);
      done_.push_back(std::move(c));
    }
    return Status::Ok();
  }
  Result<swap::IoCompletion> WaitOne(std::optional<std::chrono::milliseconds>) override {
    if (done_.empty()) return FailedPreconditionError("nothing in flight");
    swap::IoCompletion c = std::move(done_.front());
    done_.pop_front();
    return c;
  }
  size_t Poll(std::vector<swap::IoCompletion>* out) override {
    const size_t n = done_.size();
    for (auto& c : done_)
      out->push_back(std::move(c));
    done_.clear();
    return n;
  }
  Status WaitAll(std::vector<swap::IoCompletion>* out,
                 std::optional<std::chrono::milliseconds>) override {
    Status first;
    for (auto& c : done_) {
      if (first.ok()) first = c.status;
      if (out) out->push_back(std::move(c));
    }
    done_.clear();
    return first;
  }
  size_t Cancel(uint64_t) override { return 0; }
  size_t CancelAll() override { return 0; }
  size_t in_flight() const override { return done_.size(); }
  swap::IoEngineStats stats() const override {
    swap::IoEngineStats s;
    s.fixed_buffer_ops = 1;
    return s;
  }

 private:
  swap::IoEngineOptions options_;
  FakeState* st_;
  std::vector<int> fds_;
  std::vector<std::string> paths_;
  std::deque<swap::IoCompletion> done_;
};

SweepOptions FakeOptions(FakeState* st, const std::vector<std::string>& paths) {
  SweepOptions o;
  o.paths = paths;
  o.size = 8 * kMiB;
  o.block_sizes = {64 * kKiB, kMiB};
  o.queue_depths = {1, 4};
  o.threads = {1, 2};
  o.seconds = 0;
  o.rounds = 2;
  o.memory = MemoryKind::kPlain;
  o.direct = false;
  o.engine_factory =
      [st](const swap::IoEngineOptions& eo) -> Result<std::unique_ptr<swap::IoEngine>> {
    ++st->engines;
    return std::unique_ptr<swap::IoEngine>(std::make_unique<FakeEngine>(eo, st));
  };
  return o;
}

TEST(RunSweep, FakeEngineMeasuresEveryPointAndCleansUp) {
  TempDir a, b;
  FakeState st;
  SweepOptions o = FakeOptions(&st, {a.path(), b.path()});
  std::vector<SweepProgress::Phase> phases;
  size_t last_step = 0;
  o.progress = [&](const SweepProgress& p) {
    phases.push_back(p.phase);
    EXPECT_GE(p.step, last_step);
    last_step = p.step;
    EXPECT_EQ(p.steps, 2u * 2 * 2 * 2 * 2);
  };
  auto r = RunSweep(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(a.Entries(), 0u);
  EXPECT_EQ(b.Entries(), 0u);
  ASSERT_EQ(r->points.size(), 16u);
  EXPECT_EQ(r->bytes_per_file, 4 * kMiB);
  EXPECT_EQ(r->engine, "fake");
  EXPECT_TRUE(r->fixed_buffers);
  EXPECT_EQ(r->filesystems.size(), 2u);
  for (const PointResult& p : r->points) {
    EXPECT_GT(p.bytes_per_second, 0) << p.point.ToString();
    EXPECT_EQ(p.round_bytes_per_second.size(), 2u);
    // One pass per round over both files.
    EXPECT_EQ(p.bytes, 2 * 8 * kMiB) << p.point.ToString();
    EXPECT_EQ(p.requests, 2 * 8 * kMiB / p.point.block_size);
    EXPECT_GE(p.p50_us, 10);
    EXPECT_GE(p.p99_us, p.p50_us);
    EXPECT_NEAR(p.iops * static_cast<double>(p.point.block_size), p.bytes_per_second,
                p.bytes_per_second * 1e-6);
  }
  // Reads read the data written before them, never unwritten (zero) blocks.
  EXPECT_GT(st.reads.load(), 0u);
  EXPECT_EQ(st.zero_reads.load(), 0u);
  // One engine for the fill, one per point and round.
  EXPECT_EQ(st.engines.load(), 1u + 16 * 2);
  EXPECT_EQ(phases.front(), SweepProgress::Phase::kPreparing);
  EXPECT_EQ(phases.back(), SweepProgress::Phase::kDone);
  EXPECT_EQ(std::count(phases.begin(), phases.end(), SweepProgress::Phase::kPointDone), 32);
  EXPECT_CONTAINS(r->notes.front(), "page cache");
  EXPECT_EQ(r->options.paths.size(), 2u);
  EXPECT_FALSE(r->options.engine_factory);
}

TEST(RunSweep, TimedPointsRunWholePasses) {
  TempDir a;
  FakeState st;
  SweepOptions o = FakeOptions(&st, {a.path()});
  o.block_sizes = {kMiB};
  o.queue_depths = {2};
  o.threads = {1};
  o.modes = {IoOp::kRead};
  o.rounds = 1;
  o.seconds = 0.05;
  auto r = RunSweep(o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->points.size(), 1u);
  EXPECT_GE(r->points[0].seconds, 0.05);
  EXPECT_EQ(r->points[0].bytes % (8 * kMiB), 0u) << "not whole passes";
}

TEST(RunSweep, InjectedErrorSurfacesNamingThePoint) {
  TempDir a;
  FakeState st;
  st.fail_after = 8 + 20;  // the fill (8 requests of 1 MiB) passes; a point fails
  SweepOptions o = FakeOptions(&st, {a.path()});
  auto r = RunSweep(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_CONTAINS(r.status().message(), "read bs=64 KiB qd=");
  EXPECT_CONTAINS(r.status().message(), "Input/output error");
  EXPECT_EQ(a.Entries(), 0u);

  FakeState fill_fails;
  fill_fails.fail_after = 3;
  auto f = RunSweep(FakeOptions(&fill_fails, {a.path()}));
  ASSERT_FALSE(f.ok());
  EXPECT_CONTAINS(f.status().message(), "writing the data files");
  EXPECT_EQ(a.Entries(), 0u);
}

TEST(RunSweep, StopRequestCancelsAndCleansUp) {
  TempDir a;
  FakeState st;
  SweepOptions o = FakeOptions(&st, {a.path()});
  int calls = 0;
  o.should_stop = [&] { return ++calls > 3; };
  o.seconds = 0.5;  // long enough for the stop to be polled inside a point
  auto r = RunSweep(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled);
  EXPECT_EQ(a.Entries(), 0u);
}

TEST(RunSweep, ErrorsBeforeStarting) {
  TempDir a;
  FakeState st;
  SweepOptions o = FakeOptions(&st, {a.path()});
  o.block_sizes = {1000};
  EXPECT_CONTAINS(RunSweep(o).status().message(), "--block-size");
  o = FakeOptions(&st, {a.path() + "/missing"});
  EXPECT_FALSE(RunSweep(o).ok());
  EXPECT_EQ(a.Entries(), 0u);
}

// ---------------------------------------------------------------------------
// The real engine, small: io_uring where the kernel allows it, else the sync engine.

TEST(RunSweep, RealEngineRoundTrip) {
  TempDir a;
  SweepOptions o;
  o.paths = {a.path()};
  o.size = 8 * kMiB;
  o.block_sizes = {128 * kKiB, kMiB};
  o.queue_depths = {1, 8};
  o.threads = {1, 2};
  o.seconds = 0;
  o.memory = MemoryKind::kPinned;
  o.direct = true;
  auto r = RunSweep(o);
  if (!r.ok() && r.status().message().find("refuses O_DIRECT") != std::string::npos) {
    o.direct = false;
    r = RunSweep(o);
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(a.Entries(), 0u);
  ASSERT_EQ(r->points.size(), 16u);
  for (const PointResult& p : r->points) {
    EXPECT_GT(p.bytes_per_second, 0);
    EXPECT_EQ(p.bytes, 8 * kMiB);
  }
  EXPECT_FALSE(r->engine.empty());
  EXPECT_CONTAINS(r->memory_obtained, "host buffer");
  if (swap::IoUringAvailable().ok()) {
    EXPECT_CONTAINS(r->engine, "io_uring");
    EXPECT_TRUE(r->fixed_buffers) << "the pinned buffer was not used as a fixed buffer";
  } else {
    GTEST_SKIP() << "io_uring unavailable here (" << swap::IoUringAvailable() << "); measured with "
                 << r->engine;
  }
}

}  // namespace
}  // namespace strata::nvme_bench

#include "strata/tools/nvme_bench/sweep.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/offload/cpu/host_memory_info.h"
#include "strata/offload/cpu/host_pool.h"
#include "strata/tools/nvme_bench/scratch.h"
#include "strata/tools/nvme_bench/stats.h"

namespace strata::nvme_bench {

using swap::FileId;
using swap::IoCompletion;
using swap::IoEngine;
using swap::IoEngineOptions;
using swap::IoOp;
using swap::IoRequest;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(100);

std::string Quote(std::string_view s) {
  return "\"" + std::string(s) + "\"";
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t'))
    s.remove_suffix(1);
  return s;
}

// Splits on commas; rejects empty elements ("1,,2", "").
Result<std::vector<std::string_view>> SplitList(std::string_view text, std::string_view option) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    std::string_view item = Trim(text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (item.empty()) {
      return InvalidArgumentError(std::string(option) + ": " + Quote(text) +
                                  " has an empty element; give a comma-separated list");
    }
    out.push_back(item);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

template <typename T>
void AppendUnique(std::vector<T>& v, const T& x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

// xorshift64*: fills the I/O buffer with bytes that no drive or VM host can compress or
// deduplicate away.
void FillPseudoRandom(std::span<std::byte> bytes) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i)
    bytes[i] = std::byte{0x5a};
}

double SecondsSince(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

// What one run of the I/O loop did.
struct DriveResult {
  uint64_t bytes = 0;
  uint64_t requests = 0;
  double seconds = 0;  // first submission to last completion
  std::vector<int64_t> latencies_ns;
};

struct DriveSpec {
  IoOp op = IoOp::kRead;
  uint64_t block_size = 0;
  size_t slots = 0;  // requests in flight at most; slot k uses buffer + k * block_size
  uint64_t blocks_per_file = 0;
  std::vector<FileId> files;
  std::byte* buffer = nullptr;
  double min_seconds = 0;  // whole passes until this long (at least one)
  bool record_latencies = true;
};

// Keeps `slots` requests in flight over whole sequential passes of the files (block i of
// a pass on file i mod n at offset (i / n) * block_size) until a pass ends after
// min_seconds. Every completion is checked; on the first error or when `stop` says so it
// stops issuing, waits for what is in flight and returns the error (Cancelled on stop).
Result<DriveResult> Drive(IoEngine& io, const DriveSpec& spec, const std::function<bool()>& stop,
                          const std::function<void(uint64_t)>& tick) {
  STRATA_CHECK(spec.slots > 0 && !spec.files.empty() && spec.blocks_per_file > 0);
  const uint64_t nfiles = spec.files.size();
  const uint64_t blocks_per_pass = spec.blocks_per_file * nfiles;
  DriveResult r;
  if (spec.record_latencies) r.latencies_ns.reserve(blocks_per_pass);

  uint64_t issued = 0;
  uint64_t completed = 0;
  bool issuing = true;
  Status error;
  bool stopped = false;
  Clock::time_point start;
  Clock::time_point last_tick;

  auto make = [&](uint64_t slot) {
    const uint64_t b = issued % blocks_per_pass;
    IoRequest req;
    req.op = spec.op;
    req.file = spec.files[b % nfiles];
    req.offset = (b / nfiles) * spec.block_size;
    req.length = spec.block_size;
    req.buffer = spec.buffer + slot * spec.block_size;
    req.tag = slot;
    ++issued;
    return req;
  };
  // Whether another request may be issued now: inside a pass, or at a pass boundary
  // when min_seconds has not yet passed.
  auto may_issue = [&]() {
    if (!issuing) return false;
    if (issued == 0 || issued % blocks_per_pass != 0) return true;
    return SecondsSince(start, Clock::now()) < spec.min_seconds;
  };

  std::vector<IoRequest> batch;
  batch.reserve(spec.slots);
  start = Clock::now();
  last_tick = start;
  for (uint64_t slot = 0; slot < spec.slots && may_issue(); ++slot)
    batch.push_back(make(slot));
  if (Status s = io.Submit(batch); !s.ok()) return s;

  std::vector<IoCompletion> done;
  Clock::time_point end = start;
  while (completed < issued) {
    auto one = io.WaitOne(kPollInterval);
    done.clear();
    if (one.ok()) {
      done.push_back(std::move(one).value());
      io.Poll(&done);
    } else if (one.status().code() != StatusCode::kDeadlineExceeded) {
      // The engine lost track of requests: a bug in it, or it was shut down.
      return one.status().WithContext("waiting for I/O");
    }
    end = Clock::now();
    batch.clear();
    for (IoCompletion& c : done) {
      ++completed;
      if (!c.status.ok()) {
        if (error.ok()) error = c.status;
        issuing = false;
        continue;
      }
      r.bytes += c.bytes_done;
      ++r.requests;
      if (spec.record_latencies) r.latencies_ns.push_back(c.latency.count());
      if (may_issue()) batch.push_back(make(c.tag));
    }
    if (!batch.empty()) {
      if (Status s = io.Submit(batch); !s.ok()) {
        issued -= batch.size();  // nothing of a rejected batch was queued
        if (error.ok()) error = s;
        issuing = false;
      }
    }
    if (end - last_tick >= kPollInterval) {
      last_tick = end;
      if (stop && !stopped && stop()) {
        stopped = true;
        issuing = false;
      }
      if (tick) tick(r.bytes);
    }
  }
  r.seconds = SecondsSince(start, end);
  if (!error.ok()) return error;
  if (stopped) return CancelledError("interrupted");
  return r;
}

// The engine of one point, with the files and the buffer registered; unregisters in
// Close() (or the destructor, logging errors).
class PointEngine {
 public:
  static Result<PointEngine> Open(const SweepOptions& options, int queue_depth, int threads,
                                  const std::vector<ScratchFile>& files,
                                  std::span<std::byte> buffer) {
    IoEngineOptions eo;
    eo.kind = options.engine;
    eo.queue_depth = queue_depth;
    eo.threads = threads;
    std::function<Result<std::unique_ptr<IoEngine>>(const IoEngineOptions&)> factory =
        options.engine_factory;
    if (!factory) factory = swap::CreateIoEngine;
    PointEngine pe;
    STRATA_ASSIGN_OR_RETURN(pe.io_, factory(eo));
    for (const ScratchFile& f : files) {
      STRATA_ASSIGN_OR_RETURN(FileId id, pe.io_->RegisterFile(f.fd, f.path));
      pe.files_.push_back(id);
    }
    auto reg = pe.io_->RegisterBuffer(buffer);
    if (reg.ok()) {
      pe.buffer_id_ = *reg;
    } else {
      pe.register_error_ = reg.status().ToString();
    }
    return pe;
  }

  PointEngine() = default;
  PointEngine(PointEngine&&) = default;
  PointEngine& operator=(PointEngine&&) = default;
  ~PointEngine() {
    Status s = Close();
    if (!s.ok()) STRATA_LOG(kError) << "nvme_bench: closing the I/O engine: " << s;
  }

  Status Close() {
    if (!io_) return Status::Ok();
    Status first;
    if (io_->in_flight() > 0) {
      io_->CancelAll();
      first = io_->WaitAll(nullptr, std::chrono::seconds(60));
      if (first.code() == StatusCode::kCancelled) first = Status::Ok();
    }
    if (buffer_id_ >= 0) {
      Status s = io_->UnregisterBuffer(buffer_id_);
      if (first.ok()) first = s;
    }
    for (FileId f : files_) {
      Status s = io_->UnregisterFile(f);
      if (first.ok()) first = s;
    }
    io_.reset();
    files_.clear();
    buffer_id_ = -1;
    return first;
  }

  IoEngine& io() { return *io_; }
  const std::vector<FileId>& files() const { return files_; }
  // The buffer was registered and requests used it as a fixed buffer.
  bool fixed_buffer() const { return buffer_id_ >= 0 && io_ && io_->stats().fixed_buffer_ops > 0; }
  const std::string& register_error() const { return register_error_; }

 private:
  std::unique_ptr<IoEngine> io_;
  std::vector<FileId> files_;
  int buffer_id_ = -1;
  std::string register_error_;
};

Result<HostBuffer> AllocateBuffer(const SweepOptions& options, uint64_t bytes) {
  HostPoolOptions po;
  po.name = "nvme_bench buffers";
  po.allow_unpinned = true;  // reported in the result, never silent
  switch (options.memory) {
    case MemoryKind::kHugePage: {
      po.pin = true;
      po.huge_pages = HugePagePolicy::kTransparent;
      auto support = QueryHugePageSupport();
      if (support.ok() && support->hugetlb_page_size > 0 &&
          support->hugetlb_pages_free * support->hugetlb_page_size >= bytes) {
        po.huge_pages = HugePagePolicy::kHugetlbfsPreferred;
      }
      break;
    }
    case MemoryKind::kPinned:
      po.pin = true;
      po.huge_pages = HugePagePolicy::kNone;
      break;
    case MemoryKind::kPlain:
      po.pin = false;
      po.huge_pages = HugePagePolicy::kNone;
      break;
  }
  STRATA_ASSIGN_OR_RETURN(HostPool pool, HostPool::Create(po));
  return pool.Allocate(bytes);
}

Status SyncFiles(const std::vector<ScratchFile>& files) {
  for (const ScratchFile& f : files) {
    if (::fdatasync(f.fd) != 0) return ErrnoError(errno, "fdatasync " + f.path);
  }
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// Names, options, planning.

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHugePage:
      return "hugepage";
    case MemoryKind::kPinned:
      return "pinned";
    case MemoryKind::kPlain:
      return "plain";
  }
  return "?";
}

Result<MemoryKind> ParseMemoryKind(std::string_view name) {
  if (name == "hugepage" || name == "huge") return MemoryKind::kHugePage;
  if (name == "pinned") return MemoryKind::kPinned;
  if (name == "plain") return MemoryKind::kPlain;
  return InvalidArgumentError("--memory: " + Quote(name) +
                              " is not a memory kind; expected hugepage, pinned or plain");
}

std::string SweepPoint::ToString() const {
  return std::string(swap::IoOpName(mode)) + " bs=" + FormatBytes(block_size) +
         " qd=" + std::to_string(queue_depth) + " threads=" + std::to_string(threads);
}

SweepOptions SweepOptions::Quick() {
  SweepOptions o;
  o.size = 64 * kMiB;
  o.block_sizes = {128 * kKiB, kMiB};
  o.queue_depths = {4, 16};
  o.threads = {1};
  o.seconds = 0.2;
  o.rounds = 1;
  return o;
}

Status SweepOptions::Validate() const {
  if (block_sizes.empty()) return InvalidArgumentError("--block-size: the list is empty");
  if (queue_depths.empty()) return InvalidArgumentError("--queue-depth: the list is empty");
  if (threads.empty()) return InvalidArgumentError("--threads: the list is empty");
  if (modes.empty()) return InvalidArgumentError("--mode: the list is empty");
  for (uint64_t bs : block_sizes) {
    if (bs == 0 || !IsAligned(bs, IoEngine::kDirectAlignment)) {
      return InvalidArgumentError("--block-size: " + std::to_string(bs) +
                                  " bytes is not a positive multiple of 4096 (4 KiB, the "
                                  "O_DIRECT alignment)");
    }
    if (bs > kGiB) {
      return InvalidArgumentError("--block-size: " + FormatBytes(bs) + " is above 1 GiB");
    }
  }
  for (int qd : queue_depths) {
    if (qd < 1 || qd > 4096) {
      return InvalidArgumentError("--queue-depth: " + std::to_string(qd) +
                                  " is out of range [1, 4096]");
    }
  }
  for (int t : threads) {
    if (t < 1 || t > 256) {
      return InvalidArgumentError("--threads: " + std::to_string(t) + " is out of range [1, 256]");
    }
  }
  if (backlog < -1 || backlog > 4096) {
    return InvalidArgumentError("--backlog: " + std::to_string(backlog) +
                                " is out of range [0, 4096] (or auto)");
  }
  if (rounds < 1 || rounds > 1000) {
    return InvalidArgumentError("--rounds: " + std::to_string(rounds) +
                                " is out of range [1, 1000]");
  }
  if (!(seconds >= 0) || seconds > 3600) {
    return InvalidArgumentError("--seconds: " + std::to_string(seconds) +
                                " is out of range [0, 3600]");
  }
  const uint64_t nfiles = std::max<size_t>(paths.size(), 1);
  const uint64_t max_bs = *std::max_element(block_sizes.begin(), block_sizes.end());
  if (size < max_bs * nfiles) {
    return InvalidArgumentError("--size: " + FormatBytes(size) +
                                " is less than one block of the largest --block-size (" +
                                FormatBytes(max_bs) + ") per --path");
  }
  const uint64_t buffer = BufferBytes();
  if (buffer > 64 * kGiB) {
    return InvalidArgumentError(
        "--block-size x --queue-depth x --threads: the largest "
        "combination needs " +
        FormatBytes(buffer) + " of buffers (at most 64 GiB)");
  }
  return Status::Ok();
}

uint64_t SweepOptions::BytesPerFile() const {
  const uint64_t nfiles = std::max<size_t>(paths.size(), 1);
  const uint64_t max_bs =
      block_sizes.empty() ? 4096 : *std::max_element(block_sizes.begin(), block_sizes.end());
  const uint64_t per = (size + nfiles - 1) / nfiles;
  return (per + max_bs - 1) / max_bs * max_bs;
}

int SweepOptions::RequestsPerThread(int queue_depth) const {
  const int extra = backlog >= 0 ? backlog : std::max(1, queue_depth / 8);
  return queue_depth + extra;
}

uint64_t SweepOptions::BufferBytes() const {
  uint64_t most = 0;
  for (uint64_t bs : block_sizes) {
    for (int qd : queue_depths) {
      for (int t : threads) {
        most = std::max(
            most, bs * static_cast<uint64_t>(RequestsPerThread(qd)) * static_cast<uint64_t>(t));
      }
    }
  }
  return most;
}

std::vector<SweepPoint> PlanSweep(const SweepOptions& options) {
  std::vector<SweepPoint> points;
  for (IoOp mode : options.modes) {
    for (uint64_t bs : options.block_sizes) {
      for (int t : options.threads) {
        for (int qd : options.queue_depths) {
          points.push_back({.mode = mode, .block_size = bs, .queue_depth = qd, .threads = t});
        }
      }
    }
  }
  return points;
}

MachineInfo MachineInfo::Query() {
  MachineInfo m;
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0) m.hostname = host;
  struct utsname u {};
  if (::uname(&u) == 0) m.kernel = u.release;
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  m.cpus = cpus > 0 ? static_cast<int>(cpus) : 0;
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) m.memory_bytes = static_cast<uint64_t>(pages) * page;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) m.cpu_model = std::string(Trim(line.substr(colon + 1)));
      break;
    }
  }
  return m;
}

// ---------------------------------------------------------------------------
// List parsers.

Result<std::vector<uint64_t>> ParseSizeList(std::string_view text, std::string_view option) {
  STRATA_ASSIGN_OR_RETURN(auto items, SplitList(text, option));
  std::vector<uint64_t> out;
  for (std::string_view item : items) {
    auto v = ParseBytes(item);
    if (!v.ok()) {
      return InvalidArgumentError(std::string(option) + ": " + v.status().message());
    }
    AppendUnique(out, *v);
  }
  return out;
}

Result<std::vector<int>> ParseIntList(std::string_view text, std::string_view option) {
  STRATA_ASSIGN_OR_RETURN(auto items, SplitList(text, option));
  std::vector<int> out;
  for (std::string_view item : items) {
    int v = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || end != item.data() + item.size()) {
      return InvalidArgumentError(std::string(option) + ": " + Quote(item) +
                                  " is not a whole number");
    }
    AppendUnique(out, v);
  }
  return out;
}

Result<std::vector<IoOp>> ParseModeList(std::string_view text, std::string_view option) {
  STRATA_ASSIGN_OR_RETURN(auto items, SplitList(text, option));
  std::vector<IoOp> out;
  for (std::string_view item : items) {
    if (item == "read") {
      AppendUnique(out, IoOp::kRead);
    } else if (item == "write") {
      AppendUnique(out, IoOp::kWrite);
    } else {
      return InvalidArgumentError(std::string(option) + ": " + Quote(item) +
                                  " is not a mode; expected read or write");
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// The sweep.

namespace {

// The sweep's progress reports, each with the measurements done so far and in all.
struct ProgressReporter {
  std::function<void(const SweepProgress&)> progress;
  size_t step = 0;
  size_t steps = 0;

  void operator()(SweepProgress p) const {
    if (!progress) return;
    p.step = step;
    p.steps = steps;
    progress(p);
  }
};

// One point's measurements over the rounds.
struct PointSamples {
  std::vector<double> bps;
  std::vector<double> iops;
  std::vector<int64_t> latencies;
  uint64_t bytes = 0;
  uint64_t requests = 0;
  double seconds = 0;
  bool fixed = true;
};

// What the sweep's measuring phases share: the options (as run), the result so far, the
// buffer, the data files, the progress reports and the stop request.
struct SweepContext {
  const SweepOptions& opt;
  SweepResult& result;
  HostBuffer& buffer;
  const ScratchSpace& scratch;
  const std::function<bool()>& should_stop;
  ProgressReporter& report;
};

// The directories as absolute paths, for the report (they exist: Create checks them
// again); the current one when none is given.
void ResolvePaths(SweepOptions& opt) {
  if (opt.paths.empty()) opt.paths = {"."};
  for (std::string& p : opt.paths) {
    if (char* real = ::realpath(p.c_str(), nullptr)) {
      p = real;
      std::free(real);
    }
  }
}

// The machine and each directory's file system (noting tmpfs, which measures memory), and
// the bytes of each data file.
void DescribeMachine(SweepResult& result) {
  result.machine = MachineInfo::Query();
  for (const std::string& p : result.options.paths) {
    result.filesystems.push_back(DescribeFilesystem(p));
    if (result.filesystems.back().rfind("tmpfs", 0) == 0) {
      result.notes.push_back(p +
                             " is on tmpfs: its files live in memory, so these are "
                             "memory-copy speeds, not a drive's");
    }
  }
  result.bytes_per_file = result.options.BytesPerFile();
}

// The I/O buffer (the cheaper failure, so before the files), what memory it got, filled
// with pseudo-random bytes.
Result<HostBuffer> AllocateSweepBuffer(SweepResult& result) {
  const SweepOptions& opt = result.options;
  STRATA_ASSIGN_OR_RETURN(HostBuffer buffer, AllocateBuffer(opt, opt.BufferBytes()));
  result.memory_obtained = buffer.ToString();
  result.memory_fallback = buffer.fallback();
  result.memory_pinned = buffer.pinned();
  result.memory_huge_pages = buffer.huge_page_kind() != HugePageKind::kNone;
  if (!buffer.fallback().empty()) {
    result.notes.push_back("memory: asked for " + std::string(MemoryKindName(opt.memory)) +
                           ", got less: " + buffer.fallback());
  }
  if (buffer.huge_page_kind() == HugePageKind::kTransparent &&
      buffer.huge_bytes_at_allocation() < buffer.mapped_size() / (2 * kMiB) * (2 * kMiB)) {
    result.notes.push_back("memory: transparent huge pages cover " +
                           FormatBytes(buffer.huge_bytes_at_allocation()) + " of " +
                           FormatBytes(buffer.mapped_size()) + " of the buffer");
  }
  FillPseudoRandom(buffer.span());
  return buffer;
}

// The data files, one per directory (buffered I/O noted: it measures the page cache).
Result<ScratchSpace> CreateDataFiles(SweepResult& result) {
  const SweepOptions& opt = result.options;
  STRATA_ASSIGN_OR_RETURN(ScratchSpace scratch,
                          ScratchSpace::Create(opt.paths, result.bytes_per_file, opt.direct));
  if (!opt.direct) {
    result.notes.push_back(
        "buffered I/O (--buffered): the page cache is in play; reads may come from memory and "
        "writes land in the cache (flushed with fdatasync after each write measurement, not "
        "timed), so these are page-cache speeds, not the drive's");
  }
  return scratch;
}

// Drives `spec` on `pe`: `progress` reported as it starts, then with the bytes done as they
// complete.
Result<DriveResult> DriveReporting(SweepContext& s, PointEngine& pe, const DriveSpec& spec,
                                   const SweepProgress& progress) {
  s.report(progress);
  return Drive(pe.io(), spec, s.should_stop, [&](uint64_t done) {
    SweepProgress p = progress;
    p.bytes_done = done;
    s.report(p);
  });
}

// Writes every file in full (with the largest block size, 8 requests in flight), so reads
// read written data; the engine's name (and fallback) goes into the result.
Status WriteDataFiles(SweepContext& s) {
  const SweepOptions& opt = s.opt;
  SweepResult& result = s.result;
  const uint64_t max_bs = *std::max_element(opt.block_sizes.begin(), opt.block_sizes.end());
  const int fill_qd = 8;
  const uint64_t fill_slots =
      std::max<uint64_t>(1, std::min<uint64_t>(fill_qd, opt.BufferBytes() / max_bs));
  STRATA_ASSIGN_OR_RETURN(PointEngine pe,
                          PointEngine::Open(opt, static_cast<int>(fill_slots), 1, s.scratch.files(),
                                            s.buffer.span().subspan(0, fill_slots * max_bs)));
  result.engine = pe.io().name();
  result.engine_fallback = pe.io().fallback();
  if (!result.engine_fallback.empty()) {
    result.notes.push_back("engine: " + result.engine +
                           " instead of io_uring: " + result.engine_fallback);
  }
  DriveSpec spec;
  spec.op = IoOp::kWrite;
  spec.block_size = max_bs;
  spec.slots = fill_slots;
  spec.blocks_per_file = result.bytes_per_file / max_bs;
  spec.files = pe.files();
  spec.buffer = s.buffer.span().data();
  spec.min_seconds = 0;
  spec.record_latencies = false;
  const uint64_t total = result.bytes_per_file * s.scratch.files().size();
  SweepProgress prep;
  prep.phase = SweepProgress::Phase::kPreparing;
  prep.bytes_total = total;
  auto fill = DriveReporting(s, pe, spec, prep);
  if (!fill.ok()) {
    return std::move(fill).status().WithContext("writing the data files before measuring");
  }
  STRATA_RETURN_IF_ERROR(pe.Close());
  return SyncFiles(s.scratch.files());
}

// Measures point `pt` once (round `round`) into `samples`; an engine that could not
// register the buffer is counted in `unregistered` (its error kept in `register_error`,
// the first).
Status MeasurePoint(SweepContext& s, const SweepPoint& pt, int round, PointSamples& samples,
                    size_t& unregistered, std::string& register_error) {
  const SweepOptions& opt = s.opt;
  const uint64_t slots = static_cast<uint64_t>(opt.RequestsPerThread(pt.queue_depth)) *
                         static_cast<uint64_t>(pt.threads);
  STRATA_ASSIGN_OR_RETURN(PointEngine pe,
                          PointEngine::Open(opt, pt.queue_depth, pt.threads, s.scratch.files(),
                                            s.buffer.span().subspan(0, slots * pt.block_size)));
  DriveSpec spec;
  spec.op = pt.mode;
  spec.block_size = pt.block_size;
  spec.slots = slots;
  spec.blocks_per_file = s.result.bytes_per_file / pt.block_size;
  spec.files = pe.files();
  spec.buffer = s.buffer.span().data();
  spec.min_seconds = opt.seconds;
  const uint64_t pass = spec.blocks_per_file * pt.block_size * spec.files.size();
  SweepProgress base;
  base.phase = SweepProgress::Phase::kMeasuring;
  base.round = round;
  base.point = pt;
  base.bytes_total = pass;
  auto run = DriveReporting(s, pe, spec, base);
  if (!run.ok()) return std::move(run).status().WithContext(pt.ToString());
  if (!pe.fixed_buffer()) {
    samples.fixed = false;
    if (!pe.register_error().empty()) {
      ++unregistered;
      if (register_error.empty()) register_error = pe.register_error();
    }
  }
  STRATA_RETURN_IF_ERROR_CTX(pe.Close(), pt.ToString());
  if (!opt.direct && pt.mode == IoOp::kWrite) {
    STRATA_RETURN_IF_ERROR(SyncFiles(s.scratch.files()));
  }
  DriveResult& d = *run;
  const double secs = std::max(d.seconds, 1e-9);
  samples.bps.push_back(static_cast<double>(d.bytes) / secs);
  samples.iops.push_back(static_cast<double>(d.requests) / secs);
  samples.latencies.insert(samples.latencies.end(), d.latencies_ns.begin(), d.latencies_ns.end());
  samples.bytes += d.bytes;
  samples.requests += d.requests;
  samples.seconds += d.seconds;
  ++s.report.step;
  SweepProgress done = base;
  done.phase = SweepProgress::Phase::kPointDone;
  done.bytes_done = d.bytes;
  done.round_bytes_per_second = samples.bps.back();
  s.report(done);
  return Status::Ok();
}

// Measures every point, round after round (Cancelled when asked to stop between two), and
// notes whether the engines used the buffer as a fixed buffer.
Result<std::vector<PointSamples>> MeasurePoints(SweepContext& s,
                                                const std::vector<SweepPoint>& points) {
  std::vector<PointSamples> samples(points.size());
  size_t unregistered = 0;
  std::string register_error;
  for (int round = 0; round < s.opt.rounds; ++round) {
    for (size_t i = 0; i < points.size(); ++i) {
      if (s.should_stop && s.should_stop()) return CancelledError("interrupted");
      STRATA_RETURN_IF_ERROR(
          MeasurePoint(s, points[i], round, samples[i], unregistered, register_error));
    }
  }
  s.result.fixed_buffers =
      std::all_of(samples.begin(), samples.end(), [](const PointSamples& a) { return a.fixed; });
  if (unregistered > 0) {
    s.result.notes.push_back(
        "the buffer could not be registered with the engine (no fixed "
        "buffers) for " +
        std::to_string(unregistered) + " of " + std::to_string(s.report.steps) +
        " measurements: " + register_error);
  }
  return samples;
}

// Each point's result: the medians over the rounds and the latencies' summary.
void SummarizePoints(const std::vector<SweepPoint>& points, std::vector<PointSamples>& samples,
                     SweepResult& result) {
  for (size_t i = 0; i < points.size(); ++i) {
    PointSamples& a = samples[i];
    PointResult pr;
    pr.point = points[i];
    pr.round_bytes_per_second = a.bps;
    pr.bytes_per_second = Median(a.bps);
    pr.iops = Median(a.iops);
    const LatencySummary lat = SummarizeLatencies(a.latencies);
    pr.p50_us = lat.p50_us;
    pr.p99_us = lat.p99_us;
    pr.mean_us = lat.mean_us;
    pr.max_us = lat.max_us;
    pr.bytes = a.bytes;
    pr.requests = a.requests;
    pr.seconds = a.seconds;
    pr.fixed_buffers = a.fixed;
    result.points.push_back(std::move(pr));
  }
}

}  // namespace

// In phases: the machine described, the buffer and the data files made, the files written
// in full, every point measured round after round, and the points summarized.
Result<SweepResult> RunSweep(const SweepOptions& options_in) {
  STRATA_RETURN_IF_ERROR(options_in.Validate());
  SweepResult result;
  result.options = options_in;
  SweepOptions& opt = result.options;
  ResolvePaths(opt);
  ProgressReporter report{.progress = std::move(opt.progress)};
  const auto should_stop = std::move(opt.should_stop);
  opt.progress = nullptr;
  opt.should_stop = nullptr;
  opt.engine_factory = options_in.engine_factory;  // used below, cleared at the end

  DescribeMachine(result);
  const std::vector<SweepPoint> points = PlanSweep(opt);
  STRATA_ASSIGN_OR_RETURN(HostBuffer buffer, AllocateSweepBuffer(result));
  STRATA_ASSIGN_OR_RETURN(ScratchSpace scratch, CreateDataFiles(result));
  report.steps = points.size() * static_cast<size_t>(opt.rounds);
  SweepContext context{opt, result, buffer, scratch, should_stop, report};
  STRATA_RETURN_IF_ERROR(WriteDataFiles(context));
  STRATA_ASSIGN_OR_RETURN(std::vector<PointSamples> samples, MeasurePoints(context, points));
  SummarizePoints(points, samples, result);
  STRATA_RETURN_IF_ERROR_CTX(scratch.Remove(), "removing the data files");
  opt.engine_factory = nullptr;
  SweepProgress finished;
  finished.phase = SweepProgress::Phase::kDone;
  report(finished);
  return result;
}

}  // namespace strata::nvme_bench

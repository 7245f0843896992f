// nvme_bench's sweep as a library: measures the swap tier's read and write bandwidth over
// a product of block sizes, queue depths and I/O threads, through the same IoEngine the
// swap tier uses (swap/io_engine.h) and with buffers from the host pool.
//
//   nvme_bench::SweepOptions opt;            // or SweepOptions::Quick()
//   opt.paths = {"/nvme0", "/nvme1"};
//   opt.progress = [](const nvme_bench::SweepProgress& p) { ... };
//   STRATA_ASSIGN_OR_RETURN(nvme_bench::SweepResult r, nvme_bench::RunSweep(opt));
//   nvme_bench::BestSettings best = nvme_bench::ChooseBest(r.points);   // report.h
//
// What one point measures: with `queue_depth` requests in flight in the kernel per ring
// and `threads` rings (IoEngineOptions, as aio.queue_depth and aio.intra_op_parallelism
// configure the swap tier), whole sequential passes over the data set (one preallocated
// file per directory, block i of a pass on file i mod n, so requests stripe across the
// directories) until `seconds` have passed, at least one pass. The sweep keeps
// queue_depth + backlog requests per ring submitted to the engine, so the engine's ring
// thread refills the kernel queue from its own queue the moment a request completes,
// without waiting for the sweep's thread to see the completion and submit the next one;
// that is how the swap tier drives the engine (it submits a tensor's blocks as one large
// batch), and it keeps exactly queue_depth requests at the device, as fio's iodepth
// does. With backlog 0 every refill waits for a hop through the sweep's thread. Bandwidth is bytes
// moved over the time from the first submission to the last completion. The files are written in
// full before any point runs, so reads read real, written data. Each point is measured `rounds`
// times (rounds are whole sweeps, interleaved, so drift spreads over all points) and reports the
// median round; latencies are each request's submit-to-completion time (IoCompletion::latency)
// pooled over its rounds; it includes the wait behind the backlog in the engine's queue (backlog 0:
// none).
//
// Units: bytes_per_second is bytes/s; gbps() is 10^9 bytes/s (GB/s, as drive vendors and
// fio's "(MB/s)" figures count); gibps() is 2^30 bytes/s (GiB/s, fio's "MiB/s" family).
//
// Nothing is printed: progress goes to the callback, warnings (memory or engine
// fallbacks) to STRATA_LOG and into the result.
//
// Thread-safety: RunSweep may run on any thread; its callbacks run on that thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/status.h"
#include "strata/swap/io_engine.h"

namespace strata::nvme_bench {

// Which host memory the I/O buffers are.
enum class MemoryKind {
  kHugePage,  // pinned, 2 MiB pages (reserved hugetlbfs pages when enough are free, else THP)
  kPinned,    // pinned (mlock), small pages
  kPlain,     // pageable, small pages
};
std::string_view MemoryKindName(MemoryKind kind);  // "hugepage", "pinned", "plain"
Result<MemoryKind> ParseMemoryKind(std::string_view name);

// One point of the sweep.
struct SweepPoint {
  swap::IoOp mode = swap::IoOp::kRead;
  uint64_t block_size = 0;
  int queue_depth = 0;  // requests in flight per ring
  int threads = 0;      // rings (aio.intra_op_parallelism)

  // "read bs=1 MiB qd=16 threads=1"
  std::string ToString() const;
  friend bool operator==(const SweepPoint&, const SweepPoint&) = default;
};

struct SweepProgress {
  enum class Phase {
    kPreparing,  // writing the data files before the first point (bytes_done/bytes_total)
    kMeasuring,  // a point is running (bytes_done so far of this measurement)
    kPointDone,  // a point's round finished (round_bytes_per_second)
    kDone,       // the sweep finished
  };
  Phase phase = Phase::kPreparing;
  size_t step = 0;   // measurements finished so far, over all rounds
  size_t steps = 0;  // points x rounds
  int round = 0;     // 0-based
  SweepPoint point;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;  // kPreparing: all files; kMeasuring: one pass
  double round_bytes_per_second = 0;
};

struct SweepOptions {
  // Directories to measure; empty = the current directory. Each gets a private
  // directory with one data file (scratch.h); requests stripe across them.
  std::vector<std::string> paths;
  // Bytes of the data set, split evenly over the paths (each file rounded up to a
  // multiple of the largest block size).
  uint64_t size = kGiB;
  std::vector<uint64_t> block_sizes{128 * kKiB, kMiB, 8 * kMiB};  // multiples of 4 KiB
  std::vector<int> queue_depths{4, 16, 64};
  std::vector<int> threads{1, 2};
  std::vector<swap::IoOp> modes{swap::IoOp::kRead, swap::IoOp::kWrite};
  // O_DIRECT (true) or through the page cache (false).
  bool direct = true;
  MemoryKind memory = MemoryKind::kHugePage;
  swap::IoEngineKind engine = swap::IoEngineKind::kAuto;
  // Requests per thread kept queued inside the engine beyond queue_depth (see above);
  // -1 = automatic: max(1, queue_depth / 8).
  int backlog = -1;
  // Measurements per point (whole sweeps); the reported bandwidth is the median.
  int rounds = 1;
  // Each measurement runs whole passes over the data set until this long (0: one pass).
  double seconds = 1.0;

  // Called on the sweep's thread (at least every ~100 ms while measuring).
  std::function<void(const SweepProgress&)> progress;
  // Polled on the sweep's thread at least every ~100 ms; true stops the sweep: in-flight
  // requests are completed, the files removed, and RunSweep returns Cancelled.
  std::function<bool()> should_stop;
  // Creates the I/O engine for each point; default swap::CreateIoEngine. For tests.
  std::function<Result<std::unique_ptr<swap::IoEngine>>(const swap::IoEngineOptions&)>
      engine_factory;

  // The --quick settings: 64 MiB, blocks 128K and 1M, queue depths 4 and 16, one
  // thread, read and write, 0.2 s per point: a few seconds in all.
  static SweepOptions Quick();

  // InvalidArgument naming the option ("--block-size: 1000 is not a multiple of 4096").
  Status Validate() const;
  // Bytes of each data file: size / paths, rounded up to the largest block size.
  uint64_t BytesPerFile() const;
  // Requests the sweep keeps submitted per thread at queue depth qd: qd + the backlog.
  int RequestsPerThread(int queue_depth) const;
  // Bytes of the I/O buffer: the largest block_size x RequestsPerThread x threads.
  uint64_t BufferBytes() const;
};

// The product of the lists, in the order: modes (outermost), block sizes, threads, queue
// depths (innermost); each list in the order given.
std::vector<SweepPoint> PlanSweep(const SweepOptions& options);

struct PointResult {
  SweepPoint point;
  double bytes_per_second = 0;  // median over rounds
  double iops = 0;              // median over rounds
  double p50_us = 0;            // request latency percentiles, all rounds pooled
  double p99_us = 0;
  double mean_us = 0;
  double max_us = 0;
  uint64_t requests = 0;  // over all rounds
  uint64_t bytes = 0;     // over all rounds
  double seconds = 0;     // timed, over all rounds
  std::vector<double> round_bytes_per_second;
  bool fixed_buffers = false;  // every round used the buffer as a registered (fixed) buffer

  double gbps() const { return bytes_per_second / 1e9; }
  double gibps() const { return bytes_per_second / static_cast<double>(kGiB); }
};

struct MachineInfo {
  std::string hostname;
  std::string kernel;     // uname -r
  std::string cpu_model;  // /proc/cpuinfo
  int cpus = 0;           // online
  uint64_t memory_bytes = 0;
  static MachineInfo Query();
};

struct SweepResult {
  // The options the sweep ran with (callbacks cleared); paths filled in ("." when none
  // was given).
  SweepOptions options;
  MachineInfo machine;
  std::vector<std::string> filesystems;  // per path: DescribeFilesystem
  uint64_t bytes_per_file = 0;
  // Memory: what was asked for and what was obtained (HostBuffer::ToString), and the
  // fallback taken ("" when none).
  std::string memory_obtained;
  std::string memory_fallback;
  bool memory_pinned = false;
  bool memory_huge_pages = false;
  // The engine of the points (IoEngine::name), and why kAuto did not give io_uring.
  std::string engine;
  std::string engine_fallback;
  bool fixed_buffers = false;  // every measurement used registered (fixed) buffers
  // Remarks for the report (page cache in play, fallbacks).
  std::vector<std::string> notes;
  std::vector<PointResult> points;  // in PlanSweep order
};

// Runs the sweep. Errors: InvalidArgument (options, O_DIRECT refused), ResourceExhausted
// (disk space, memory), IOError and friends from the engine (the message names the point),
// Cancelled when should_stop said so. The data files are removed before it returns, on
// every path.
Result<SweepResult> RunSweep(const SweepOptions& options);

// Parsers for comma-separated lists ("128K,1M,8M", "4,16,64", "read,write"); errors name
// `option` ("--queue-depth: \"x\" is not a whole number").
Result<std::vector<uint64_t>> ParseSizeList(std::string_view text, std::string_view option);
Result<std::vector<int>> ParseIntList(std::string_view text, std::string_view option);
Result<std::vector<swap::IoOp>> ParseModeList(std::string_view text, std::string_view option);

}  // namespace strata::nvme_bench

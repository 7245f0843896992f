// comm_bench: bandwidth of all_gather, reduce_scatter and all_reduce against message size,
// with a correctness check of every result.
//
//   torchrun --nproc_per_node 2 --no_python bin/comm_bench
//       --backend gloo --min-bytes 1KiB --max-bytes 64MiB      (one command line)
//   bin/comm_bench                       (one process: world size 1, no environment needed)
//
// Ranks meet through RendezvousFromEnvironment (torchrun's agent store). For every
// collective and every size from --min-bytes to --max-bytes (doubling), each rank runs
// --warmup untimed and --iters timed operations; before each one a barrier (untimed) lines
// the ranks up. Reported per size:
//   time     the median over the timed iterations of issue-to-completion on each rank,
//            then the maximum over ranks (a collective is as slow as its slowest rank);
//            "min" is the fastest iteration, same rule
//   algbw    bytes / time, bytes = the full buffer (all_gather: the gathered output,
//            reduce_scatter: the input, all_reduce: the buffer), as nccl-tests define it
//   busbw    algbw * (W-1)/W for all_gather and reduce_scatter, algbw * 2(W-1)/W for
//            all_reduce (nccl-tests' bus bandwidth: comparable with the link's speed)
//   sent     CommStats bytes sent per rank per operation (maximum over ranks, and as a
//            fraction of the buffer: a ring reduce-scatter/all-gather sends (W-1)/W)
//   check    with --check (default), inputs are small integers that depend on the rank and
//            the index (exact in every dtype, sums too), outputs are poisoned before and
//            compared in full after every iteration (warm-up included); all_reduce gets
//            its input restored before each iteration. Restoring, poisoning and checking
//            are not timed. --no-check skips all of it (all_reduce then runs on zeros).
// Rank 0 prints one table per collective and, with --json FILE, writes every row.
// Exit status: 0 all checks passed, 1 a check failed or a collective returned an error,
// 2 usage error.
#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/core/status.h"
#if defined(STRATA_HAVE_CUDA)
#include "strata/core/cuda/cuda.h"
#endif

namespace po = boost::program_options;

namespace strata::bench {
namespace {

using comm::Communicator;
using comm::DType;
using Clock = std::chrono::steady_clock;

constexpr int kOk = 0;
constexpr int kFailed = 1;
constexpr int kUsage = 2;

enum class Op { kAllGather, kReduceScatter, kAllReduce };
const char* OpName(Op op) {
  switch (op) {
    case Op::kAllGather:
      return "all_gather";
    case Op::kReduceScatter:
      return "reduce_scatter";
    case Op::kAllReduce:
      return "all_reduce";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// Values: small integers, exact in fp32, bf16, fp16 and int64 (and so are their sums over
// up to 32 ranks, |sum| <= 256).

uint16_t FloatBits16(float v, DType dtype) {
  // Exact for the small integers used here: no rounding needed, but round to nearest even
  // anyway so that any value is converted correctly.
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (dtype == DType::kBFloat16) {
    const uint32_t lsb = (bits >> 16) & 1u;
    return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
  }
  // fp16: small integers only (|v| <= 2048), exact.
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const float a = std::abs(v);
  if (a == 0.0f) return static_cast<uint16_t>(sign);
  int exp = 0;
  const float m = std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1)
  const uint32_t e = static_cast<uint32_t>(exp - 1 + 15);
  const uint32_t frac = static_cast<uint32_t>(std::ldexp(m * 2.0f - 1.0f, 10));
  return static_cast<uint16_t>(sign | (e << 10) | frac);
}

void Store(DType dtype, uint8_t* dst, size_t i, int value) {
  switch (dtype) {
    case DType::kFloat32: {
      const float f = static_cast<float>(value);
      std::memcpy(dst + i * 4, &f, 4);
      return;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      const uint16_t h = FloatBits16(static_cast<float>(value), dtype);
      std::memcpy(dst + i * 2, &h, 2);
      return;
    }
    case DType::kInt64: {
      const int64_t v = value;
      std::memcpy(dst + i * 8, &v, 8);
      return;
    }
  }
}

// all_gather: element i of the full buffer, owned by `owner`.
int GatherValue(size_t i, int owner) {
  return static_cast<int>((i * 7 + static_cast<size_t>(owner) * 31) % 241) - 120;
}
// reduce_scatter / all_reduce: rank r's contribution to element i, in [-8, 8].
int ReduceValue(size_t i, int rank) {
  return static_cast<int>((i * 3 + static_cast<size_t>(rank) * 5) % 17) - 8;
}

// ---------------------------------------------------------------------------
// Buffers in host memory (Gloo) or device memory (NCCL), filled and read from the host.

class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      std::free(host_);
      host_ = std::exchange(o.host_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
#if defined(STRATA_HAVE_CUDA)
      device_ = std::exchange(o.device_, false);
      dev_ = std::move(o.dev_);
      stream_ = std::move(o.stream_);
#endif
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    std::free(host_);
  }

  static Result<Buffer> Make(bool device, int index, size_t bytes) {
    Buffer b;
    b.bytes_ = bytes;
    if (!device) {
      b.host_ = std::aligned_alloc(4096, std::max<size_t>(4096, AlignUp(bytes, 4096)));
      if (b.host_ == nullptr) return ResourceExhaustedError("out of host memory");
      return b;
    }
#if defined(STRATA_HAVE_CUDA)
    STRATA_ASSIGN_OR_RETURN(b.dev_, cuda::DeviceBuffer::Allocate(index, bytes));
    STRATA_ASSIGN_OR_RETURN(b.stream_, cuda::Stream::Create(index));
    b.device_ = true;
    return b;
#else
    (void)index;
    return UnimplementedError("device buffers need a CUDA build");
#endif
  }

  void* data() const {
#if defined(STRATA_HAVE_CUDA)
    if (device_) return dev_.data();
#endif
    return host_;
  }
  size_t size() const {
    return bytes_;
  }

  Status Upload(const std::vector<uint8_t>& src) {
    const size_t n = std::min(src.size(), bytes_);
    if (n == 0) return Status::Ok();
#if defined(STRATA_HAVE_CUDA)
    if (device_) {
      STRATA_RETURN_IF_ERROR(cuda::CopyHostToDevice(dev_.data(), src.data(), n, stream_));
      return stream_.Synchronize();
    }
#endif
    std::memcpy(host_, src.data(), n);
    return Status::Ok();
  }
  Status Download(std::vector<uint8_t>& dst) {
    dst.resize(bytes_);
    if (bytes_ == 0) return Status::Ok();
#if defined(STRATA_HAVE_CUDA)
    if (device_) {
      STRATA_RETURN_IF_ERROR(cuda::CopyDeviceToHost(dst.data(), dev_.data(), bytes_, stream_));
      return stream_.Synchronize();
    }
#endif
    std::memcpy(dst.data(), host_, bytes_);
    return Status::Ok();
  }

 private:
  void* host_ = nullptr;
  size_t bytes_ = 0;
#if defined(STRATA_HAVE_CUDA)
  bool device_ = false;
  cuda::DeviceBuffer dev_;
  cuda::Stream stream_;
#endif
};

struct Settings {
  comm::Backend backend = comm::Backend::kGloo;
  DType dtype = DType::kFloat32;
  uint64_t min_bytes = 1024;
  uint64_t max_bytes = 64 * kMiB;
  int iters = 20;
  int warmup = 5;
  bool check = true;
  bool corrupt = false;  // tests the checker: rank 0 flips a byte of every result
  std::vector<Op> ops;
  std::string json;
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

struct Row {
  Op op;
  uint64_t bytes = 0;  // full buffer
  size_t count = 0;    // elements of the full buffer
  double median_us = 0;
  double min_us = 0;
  double algbw = 0;  // bytes/s
  double busbw = 0;
  std::vector<int64_t> sent_per_rank;  // bytes per operation
  int64_t failures = 0;                // ranks whose check failed
  std::string first_error;             // this rank's first mismatch
};

// Every rank's value of `v`, gathered through the communicator itself.
Result<std::vector<int64_t>> AllValues(Communicator& c, bool device, int index, int64_t v) {
  const int w = c.world_size();
  STRATA_ASSIGN_OR_RETURN(Buffer shard, Buffer::Make(device, index, sizeof(int64_t)));
  STRATA_ASSIGN_OR_RETURN(Buffer full, Buffer::Make(device, index, sizeof(int64_t) * w));
  std::vector<uint8_t> bytes(sizeof v);
  std::memcpy(bytes.data(), &v, sizeof v);
  STRATA_RETURN_IF_ERROR(shard.Upload(bytes));
  STRATA_RETURN_IF_ERROR(
      c.AllGather(shard.data(), full.data(), static_cast<size_t>(w), DType::kInt64));
  std::vector<uint8_t> out;
  STRATA_RETURN_IF_ERROR(full.Download(out));
  std::vector<int64_t> values(static_cast<size_t>(w));
  std::memcpy(values.data(), out.data(), out.size());
  return values;
}

double BusFactor(Op op, int w) {
  const double f = static_cast<double>(w - 1) / w;
  return op == Op::kAllReduce ? 2 * f : f;
}

// Runs one collective at one size on this rank; gathers the cross-rank numbers.
Result<Row> Measure(Communicator& c, const Settings& s, Op op, uint64_t bytes, bool device,
                    int index) {
  const int w = c.world_size(), r = c.rank();
  const size_t es = comm::DTypeSize(s.dtype);
  Row row;
  row.op = op;
  row.count = std::max<size_t>(1, bytes / es);
  row.bytes = row.count * es;
  const size_t n = row.count;
  const comm::Shard mine = comm::Partition(n, w, r);

  // Input and expected output of this rank.
  std::vector<uint8_t> input, expected;
  size_t in_elems = 0, out_elems = 0;
  switch (op) {
    case Op::kAllGather:
      in_elems = mine.count;
      out_elems = n;
      break;
    case Op::kReduceScatter:
      in_elems = n;
      out_elems = mine.count;
      break;
    case Op::kAllReduce:
      in_elems = out_elems = n;
      break;
  }
  input.assign(in_elems * es, 0);
  if (s.check || op != Op::kAllReduce) {
    if (op == Op::kAllGather) {
      for (size_t j = 0; j < in_elems; ++j)
        Store(s.dtype, input.data(), j, GatherValue(mine.offset + j, r));
    } else {
      for (size_t j = 0; j < in_elems; ++j)
        Store(s.dtype, input.data(), j, ReduceValue(j, r));
    }
  }
  if (s.check) {
    expected.assign(out_elems * es, 0);
    if (op == Op::kAllGather) {
      for (int q = 0; q < w; ++q) {
        const comm::Shard sq = comm::Partition(n, w, q);
        for (size_t j = 0; j < sq.count; ++j)
          Store(s.dtype, expected.data(), sq.offset + j, GatherValue(sq.offset + j, q));
      }
    } else {
      const size_t base = op == Op::kReduceScatter ? mine.offset : 0;
      for (size_t j = 0; j < out_elems; ++j) {
        int sum = 0;
        for (int q = 0; q < w; ++q)
          sum += ReduceValue(base + j, q);
        Store(s.dtype, expected.data(), j, sum);
      }
    }
  }

  STRATA_ASSIGN_OR_RETURN(Buffer in, Buffer::Make(device, index, in_elems * es));
  Buffer out_buf;
  if (op != Op::kAllReduce) {
    STRATA_ASSIGN_OR_RETURN(out_buf, Buffer::Make(device, index, out_elems * es));
  }
  Buffer& out = op == Op::kAllReduce ? in : out_buf;
  STRATA_RETURN_IF_ERROR(in.Upload(input));
  const std::vector<uint8_t> poison(s.check && op != Op::kAllReduce ? out_elems * es : 0, 0xA5);

  std::vector<double> times;
  std::vector<uint8_t> got;
  uint64_t sent = 0;
  const int total_iters = s.warmup + s.iters;
  for (int it = 0; it < total_iters; ++it) {
    if (s.check) {
      if (op == Op::kAllReduce && it > 0) {
        STRATA_RETURN_IF_ERROR(in.Upload(input));
      } else if (op != Op::kAllReduce) {
        STRATA_RETURN_IF_ERROR(out.Upload(poison));
      }
    }
    STRATA_RETURN_IF_ERROR_CTX(c.Barrier(), "barrier before an iteration");
    const comm::CommStats before = c.stats();
    const auto t0 = Clock::now();
    Status st;
    switch (op) {
      case Op::kAllGather:
        st = c.AllGather(in.data(), out.data(), n, s.dtype);
        break;
      case Op::kReduceScatter:
        st = c.ReduceScatter(in.data(), out.data(), n, s.dtype, comm::ReduceOp::kSum);
        break;
      case Op::kAllReduce:
        st = c.AllReduce(in.data(), n, s.dtype, comm::ReduceOp::kSum);
        break;
    }
    const auto t1 = Clock::now();
    STRATA_RETURN_IF_ERROR_CTX(st, std::string(OpName(op)) + " of " + FormatBytes(row.bytes));
    const comm::CommStats after = c.stats();
    if (it >= s.warmup) {
      times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      sent += after.bytes_sent - before.bytes_sent;
    }
    if (s.check) {
      STRATA_RETURN_IF_ERROR(out.Download(got));
      if (s.corrupt && r == 0 && !got.empty()) got[got.size() / 2] ^= 0x10;
      if (got != expected && row.first_error.empty()) {
        size_t k = 0;
        while (k < got.size() && got[k] == expected[k])
          ++k;
        std::ostringstream os;
        os << "rank " << r << ": " << OpName(op) << " of " << FormatBytes(row.bytes)
           << " iteration " << it << ": first wrong byte " << k << " (element " << k / es
           << "): got 0x" << std::hex << int(got[k]) << ", expected 0x" << int(expected[k]);
        row.first_error = os.str();
      }
    }
  }

  std::sort(times.begin(), times.end());
  const double median = times.empty() ? 0
                        : times.size() % 2
                            ? times[times.size() / 2]
                            : (times[times.size() / 2 - 1] + times[times.size() / 2]) / 2;
  const double fastest = times.empty() ? 0 : times.front();
  // Cross-rank: the slowest rank's median and minimum (in ns), bytes sent, failures.
  STRATA_ASSIGN_OR_RETURN(auto medians,
                          AllValues(c, device, index, static_cast<int64_t>(median * 1000)));
  STRATA_ASSIGN_OR_RETURN(auto mins,
                          AllValues(c, device, index, static_cast<int64_t>(fastest * 1000)));
  STRATA_ASSIGN_OR_RETURN(
      row.sent_per_rank,
      AllValues(c, device, index, static_cast<int64_t>(sent / std::max(1, s.iters))));
  STRATA_ASSIGN_OR_RETURN(auto failed,
                          AllValues(c, device, index, row.first_error.empty() ? 0 : 1));
  row.median_us = static_cast<double>(*std::max_element(medians.begin(), medians.end())) / 1000;
  row.min_us = static_cast<double>(*std::max_element(mins.begin(), mins.end())) / 1000;
  for (int64_t f : failed)
    row.failures += f;
  row.algbw = row.median_us > 0 ? static_cast<double>(row.bytes) / (row.median_us * 1e-6) : 0;
  row.busbw = row.algbw * BusFactor(op, w);
  return row;
}

void PrintHeader(Op op, const Settings& s, int w) {
  std::printf("\n%s (%s, %d rank%s, %s): busbw = algbw * %s\n", OpName(op),
              std::string(comm::DTypeName(s.dtype)).c_str(), w, w == 1 ? "" : "s",
              std::string(comm::BackendName(s.backend)).c_str(),
              op == Op::kAllReduce ? "2(W-1)/W" : "(W-1)/W");
  std::printf("%10s %11s %11s %11s %12s %12s %11s %9s  %s\n", "size", "count", "time(us)",
              "min(us)", "algbw(GB/s)", "busbw(GB/s)", "sent/rank", "sent/size", "check");
}

void PrintRow(const Row& row, const Settings& s) {
  const int64_t sent = *std::max_element(row.sent_per_rank.begin(), row.sent_per_rank.end());
  std::printf("%10s %11zu %11.1f %11.1f %12.3f %12.3f %11s %9.3f  %s\n",
              FormatBytes(row.bytes).c_str(), row.count, row.median_us, row.min_us, row.algbw / 1e9,
              row.busbw / 1e9, FormatBytes(static_cast<uint64_t>(sent)).c_str(),
              static_cast<double>(sent) / static_cast<double>(row.bytes),
              !s.check       ? "off"
              : row.failures ? "FAILED"
                             : "ok");
  std::fflush(stdout);
}

Result<std::vector<Op>> ParseOps(const std::string& text) {
  std::vector<Op> ops;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item == "all_gather" || item == "allgather") {
      ops.push_back(Op::kAllGather);
    } else if (item == "reduce_scatter" || item == "reducescatter") {
      ops.push_back(Op::kReduceScatter);
    } else if (item == "all_reduce" || item == "allreduce") {
      ops.push_back(Op::kAllReduce);
    } else {
      return InvalidArgumentError("unknown collective '" + item +
                                  "' (expected all_gather, reduce_scatter, all_reduce)");
    }
  }
  if (ops.empty()) return InvalidArgumentError("--ops names no collective");
  return ops;
}

int Run(const Settings& s) {
  comm::RendezvousOptions ropts;
  ropts.timeout = s.timeout;
  auto rv = comm::RendezvousFromEnvironment(ropts);
  if (!rv.ok()) {
    std::cerr << "comm_bench: rendezvous: " << rv.status() << "\n";
    return kFailed;
  }
  SetLogRank(rv->rank);
  comm::CommOptions options;
  options.timeout = s.timeout;
  const bool device = s.backend == comm::Backend::kNccl;
  const int index = rv->local_rank;
  if (device) options.device = comm::Device::Cuda(index);
  auto created = comm::CreateCommunicator(s.backend, *rv, options);
  if (!created.ok()) {
    std::cerr << "comm_bench: rank " << rv->rank << ": creating the "
              << comm::BackendName(s.backend) << " communicator: " << created.status() << "\n";
    return kFailed;
  }
  Communicator& c = **created;
  const int w = c.world_size();
  const bool leader = c.rank() == 0;
  if (leader) {
    std::printf(
        "comm_bench: %s, world size %d (%s), dtype %s, sizes %s..%s, iters %d, warmup %d,"
        " check %s\n",
        std::string(comm::BackendName(s.backend)).c_str(), w, rv->ToString().c_str(),
        std::string(comm::DTypeName(s.dtype)).c_str(), FormatBytes(s.min_bytes).c_str(),
        FormatBytes(s.max_bytes).c_str(), s.iters, s.warmup, s.check ? "on" : "off");
  }

  std::vector<Row> rows;
  int64_t failures = 0;
  for (Op op : s.ops) {
    if (leader) PrintHeader(op, s, w);
    for (uint64_t bytes = s.min_bytes; bytes <= s.max_bytes; bytes *= 2) {
      auto row = Measure(c, s, op, bytes, device, index);
      if (!row.ok()) {
        std::cerr << "comm_bench: rank " << c.rank() << ": " << row.status() << "\n";
        return kFailed;
      }
      if (!row->first_error.empty()) std::cerr << "comm_bench: " << row->first_error << "\n";
      failures += row->failures;
      if (leader) PrintRow(*row, s);
      rows.push_back(std::move(*row));
      if (bytes > s.max_bytes / 2) break;  // no overflow at the top of the range
    }
    if (leader && !rows.empty()) {
      const Row& last = rows.back();
      std::printf("  bytes sent per rank per %s of %s (CommStats):", OpName(op),
                  FormatBytes(last.bytes).c_str());
      for (size_t q = 0; q < last.sent_per_rank.size(); ++q)
        std::printf(" rank %zu %s%s", q,
                    FormatBytes(static_cast<uint64_t>(last.sent_per_rank[q])).c_str(),
                    q + 1 < last.sent_per_rank.size() ? "," : "");
      std::printf("\n");
    }
  }

  if (leader && !s.json.empty()) {
    nlohmann::json doc;
    doc["backend"] = std::string(comm::BackendName(s.backend));
    doc["world_size"] = w;
    doc["dtype"] = std::string(comm::DTypeName(s.dtype));
    doc["iters"] = s.iters;
    doc["warmup"] = s.warmup;
    doc["check"] = s.check;
    nlohmann::json results = nlohmann::json::array();
    for (const Row& row : rows) {
      results.push_back({{"op", OpName(row.op)},
                         {"bytes", row.bytes},
                         {"count", row.count},
                         {"time_us_median", row.median_us},
                         {"time_us_min", row.min_us},
                         {"algbw_GBps", row.algbw / 1e9},
                         {"busbw_GBps", row.busbw / 1e9},
                         {"bytes_sent_per_rank", row.sent_per_rank},
                         {"check", !s.check       ? "off"
                                   : row.failures ? "failed"
                                                  : "ok"}});
    }
    doc["results"] = results;
    std::ofstream f(s.json);
    f << doc.dump(2) << "\n";
    if (!f) {
      std::cerr << "comm_bench: cannot write " << s.json << "\n";
      return kFailed;
    }
  }
  if (failures > 0) {
    if (leader)
      std::printf("\ncomm_bench: %lld check(s) FAILED\n", static_cast<long long>(failures));
    return kFailed;
  }
  if (leader && s.check) std::printf("\ncomm_bench: every result checked: ok\n");
  return kOk;
}

int Main(int argc, char** argv) {
  Settings s;
  std::string backend = "gloo", dtype = "fp32", min_bytes = "1KiB", max_bytes = "64MiB",
              ops = "all_gather,reduce_scatter,all_reduce";
  double timeout_s = 120;
  po::options_description desc(
      "comm_bench: collective bandwidth vs message size (run under torchrun, or alone)");
  desc.add_options()("help,h", "show help")(
      "backend", po::value<std::string>(&backend)->default_value(backend), "gloo or nccl")(
      "min-bytes", po::value<std::string>(&min_bytes)->default_value(min_bytes),
      "smallest full-buffer size (e.g. 1KiB)")(
      "max-bytes", po::value<std::string>(&max_bytes)->default_value(max_bytes),
      "largest full-buffer size; sizes double from --min-bytes")(
      "iters", po::value<int>(&s.iters)->default_value(s.iters), "timed iterations per size")(
      "warmup", po::value<int>(&s.warmup)->default_value(s.warmup), "untimed iterations first")(
      "dtype", po::value<std::string>(&dtype)->default_value(dtype), "fp32, bf16, fp16 or int64")(
      "ops", po::value<std::string>(&ops)->default_value(ops),
      "comma-separated: all_gather, reduce_scatter, all_reduce")(
      "json", po::value<std::string>(&s.json), "also write the results as JSON (rank 0)")(
      "check", "check every result (the default)")("no-check", "do not check results")(
      "corrupt",
      "test the checker: rank 0 flips one byte of every result it reads back, so "
      "every check must fail (exit status 1)")(
      "timeout", po::value<double>(&timeout_s)->default_value(timeout_s),
      "seconds: bound on every collective and the rendezvous");
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "comm_bench: " << e.what() << "\n\n" << desc;
    return kUsage;
  }
  if (vm.count("help")) {
    std::cout << desc;
    return kOk;
  }
  auto usage = [&](const std::string& msg) {
    std::cerr << "comm_bench: " << msg << "\n";
    return kUsage;
  };
  if (vm.count("check") && vm.count("no-check")) return usage("--check and --no-check conflict");
  s.check = !vm.count("no-check");
  s.corrupt = vm.count("corrupt") > 0;
  if (s.corrupt && !s.check) return usage("--corrupt needs the check");
  auto b = comm::ParseBackend(backend);
  if (!b.ok()) return usage(b.status().message());
  s.backend = *b;
  auto d = comm::ParseDType(dtype);
  if (!d.ok()) return usage(d.status().message());
  s.dtype = *d;
  auto lo = ParseBytes(min_bytes);
  if (!lo.ok()) return usage("--min-bytes: " + lo.status().message());
  auto hi = ParseBytes(max_bytes);
  if (!hi.ok()) return usage("--max-bytes: " + hi.status().message());
  s.min_bytes = *lo;
  s.max_bytes = *hi;
  if (s.min_bytes == 0 || s.min_bytes > s.max_bytes)
    return usage("need 0 < --min-bytes <= --max-bytes");
  if (s.iters < 1 || s.warmup < 0) return usage("need --iters >= 1 and --warmup >= 0");
  if (!(timeout_s >= 0.001)) return usage("--timeout must be at least 0.001 s");
  s.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  auto o = ParseOps(ops);
  if (!o.ok()) return usage(o.status().message());
  s.ops = *o;
  return Run(s);
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  return strata::bench::Main(argc, argv);
}

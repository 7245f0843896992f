// nvme_bench: measures the swap tier (one or more NVMe directories) over a sweep of block
// sizes, queue depths and I/O threads, and prints the best `aio` settings and bandwidths
// as a config snippet that `strata-config validate` accepts.
//
// Exit codes: 0 success, 2 bad options, 1 a failure while measuring, 128 + the signal
// number (130 for Ctrl-C, 143 for SIGTERM) when interrupted. The data files are removed
// in every case; a second Ctrl-C removes them from the signal handler and exits at once.
#include <sys/stat.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/tools/nvme_bench/report.h"
#include "strata/tools/nvme_bench/scratch.h"
#include "strata/tools/nvme_bench/sweep.h"
#include "strata_generated/version.h"

namespace po = boost::program_options;
namespace nb = strata::nvme_bench;

namespace {

constexpr int kOk = 0;
constexpr int kFailure = 1;
constexpr int kUsage = 2;

const char* kSynopsis =
    "usage: nvme_bench [--path DIR ...] [--size 1GiB] [--block-size 128K,1M,8M]\n"
    "                  [--queue-depth 4,16,64] [--threads 1,2] [--mode read,write]\n"
    "                  [--direct|--buffered] [--memory hugepage|pinned|plain]\n"
    "                  [--engine auto|io_uring|sync] [--backlog auto|N] [--rounds N]\n"
    "                  [--seconds S] [--json FILE] [--plot FILE.svg] [--snippet FILE]\n"
    "                  [--quick] [--no-progress]\n"
    "\n"
    "Measures read and write bandwidth of the swap tier over the product of the lists and\n"
    "prints a table, the best settings and a config snippet (aio.block_size, queue_depth,\n"
    "intra_op_parallelism, strata.nvme_read_bandwidth, strata.nvme_write_bandwidth).\n"
    "GB/s = 10^9 bytes/s, GiB/s = 2^30 bytes/s. Without --path it measures a private\n"
    "directory in the current directory. Every file it creates is removed on exit, also on\n"
    "Ctrl-C and SIGTERM.\n";

volatile std::sig_atomic_t g_signal = 0;

extern "C" void OnSignal(int sig) {
  if (g_signal != 0) {
    // Second signal: the sweep did not stop in time; remove the files from here and go.
    nb::RemoveScratchFromSignalHandler();
    static const char kMsg[] = "\nnvme_bench: interrupted again; data files removed\n";
    (void)!::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
    ::_exit(128 + sig);
  }
  g_signal = sig;
}

void InstallSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // the sweep polls the flag; system calls need not fail
  for (int sig : {SIGINT, SIGTERM, SIGHUP})
    ::sigaction(sig, &sa, nullptr);
}

int UsageError(const std::string& message) {
  std::cerr << "nvme_bench: " << message << "\n(see nvme_bench --help)\n";
  return kUsage;
}

// Joins repeated options ("--mode read --mode write") and comma lists into one list text.
std::string JoinedList(const po::variables_map& vm, const char* name) {
  std::string out;
  for (const std::string& s : vm[name].as<std::vector<std::string>>()) {
    if (!out.empty()) out += ",";
    out += s;
  }
  return out;
}

// Draws progress on stderr: a bar redrawn in place on a terminal, else a line per point.
class ProgressPrinter {
 public:
  explicit ProgressPrinter(bool enabled) : enabled_(enabled), tty_(::isatty(STDERR_FILENO)) {}

  void operator()(const nb::SweepProgress& p) {
    if (!enabled_) return;
    using Phase = nb::SweepProgress::Phase;
    if (!tty_) {
      if (p.phase == Phase::kPreparing && p.bytes_done == 0) {
        std::fprintf(stderr, "nvme_bench: writing %s of data files\n",
                     strata::FormatBytes(p.bytes_total).c_str());
      } else if (p.phase == Phase::kPointDone) {
        std::fprintf(stderr, "nvme_bench: [%zu/%zu] %s: %.3f GB/s\n", p.step, p.steps,
                     p.point.ToString().c_str(), p.round_bytes_per_second / 1e9);
      }
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (p.phase == Phase::kDone) {
      std::fputs("\r\033[K", stderr);
      std::fflush(stderr);
      return;
    }
    if (p.phase != Phase::kPointDone && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    double frac = 0;
    std::string what;
    if (p.phase == Phase::kPreparing) {
      frac = p.bytes_total ? static_cast<double>(p.bytes_done) / p.bytes_total : 0;
      what = "writing data files " + strata::FormatBytes(p.bytes_done) + " / " +
             strata::FormatBytes(p.bytes_total);
    } else {
      frac = p.steps ? static_cast<double>(p.step) / p.steps : 0;
      what = p.point.ToString();
      if (p.phase == Phase::kPointDone) {
        char bw[48];
        std::snprintf(bw, sizeof bw, ": %.2f GB/s", p.round_bytes_per_second / 1e9);
        what += bw;
      }
    }
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth + 0.5);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r\033[K[%s] %3d%% %zu/%zu %s", bar.c_str(),
                 static_cast<int>(frac * 100 + 0.5), p.step, p.steps, what.c_str());
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  bool tty_;
  std::chrono::steady_clock::time_point last_{};
};

bool WriteFile(const std::string& path, const std::string& text, const char* what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) {
    std::cerr << "nvme_bench: cannot write the " << what << " to " << path << "\n";
    return false;
  }
  return true;
}

// The command line's values that are not lists (boost fills them in).
struct CommandLine {
  std::string size_text, memory_text, engine_text, backlog_text;
  std::string json_file, plot_file, snippet_file;
  int rounds = 0;
  double seconds = 0;
};

// The options and their help.
void AddOptions(po::options_description& desc, CommandLine& cl) {
  desc.add_options()("help,h", "show this help")("version", "print the version")(
      "path", po::value<std::vector<std::string>>()->composing()->multitoken(),
      "directory to measure (repeat, or list several, to stripe across drives); default: a "
      "private directory in the current directory")(
      "size", po::value<std::string>(&cl.size_text),
      "bytes of data, split over the paths (default 1GiB; --quick: 64MiB)")(
      "block-size", po::value<std::vector<std::string>>()->composing(),
      "comma-separated request sizes, multiples of 4 KiB (default 128K,1M,8M)")(
      "queue-depth", po::value<std::vector<std::string>>()->composing(),
      "comma-separated requests in flight per thread (default 4,16,64)")(
      "threads", po::value<std::vector<std::string>>()->composing(),
      "comma-separated I/O threads (io_uring rings) (default 1,2)")(
      "mode", po::value<std::vector<std::string>>()->composing(),
      "comma-separated: read, write (default read,write)")(
      "direct", "O_DIRECT: bypass the page cache (the default)")(
      "buffered", "go through the page cache (measures the cache, not the drive)")(
      "memory", po::value<std::string>(&cl.memory_text),
      "I/O buffers: hugepage (pinned 2 MiB pages, default), pinned (pinned 4 KiB pages), "
      "plain (pageable 4 KiB pages)")(
      "engine", po::value<std::string>(&cl.engine_text),
      "auto (io_uring, else sync with a warning; default), io_uring, sync")(
      "backlog", po::value<std::string>(&cl.backlog_text),
      "requests per thread queued in the engine beyond the queue depth, so its ring refills "
      "the kernel queue without waiting for nvme_bench, as the swap tier's large batches do "
      "(auto = max(1, queue depth / 8); 0 = submit exactly the queue depth)")(
      "rounds", po::value<int>(&cl.rounds),
      "measurements per point; the median is reported (default 1)")(
      "seconds", po::value<double>(&cl.seconds),
      "each measurement repeats whole passes until this long; 0 = one pass (default 1; "
      "--quick: 0.2)")("json", po::value<std::string>(&cl.json_file),
                       "write every measurement, the settings and the machine as JSON")(
      "plot", po::value<std::string>(&cl.plot_file),
      "write an SVG of bandwidth against queue depth per block size")(
      "snippet", po::value<std::string>(&cl.snippet_file),
      "write the config snippet (JSON) to this file too")(
      "quick", "a small sweep that takes a few seconds (for tests and CI)")(
      "no-progress", "no progress output on stderr");
}

// Each --path an existing directory, none given twice (under another name too). A usage
// error's message as an InvalidArgument status.
strata::Status CheckPaths(const std::vector<std::string>& paths) {
  std::set<std::pair<dev_t, ino_t>> seen_paths;
  for (const std::string& p : paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) {
      return strata::InvalidArgumentError("--path " + p + ": " + std::strerror(errno));
    }
    if (!S_ISDIR(st.st_mode))
      return strata::InvalidArgumentError("--path " + p + ": not a directory");
    if (!seen_paths.insert({st.st_dev, st.st_ino}).second) {
      return strata::InvalidArgumentError("--path " + p + ": given twice");
    }
  }
  return strata::Status::Ok();
}

// The lists of the sweep: --block-size, --queue-depth, --threads, --mode.
strata::Status ReadLists(const po::variables_map& vm, nb::SweepOptions& opt) {
  if (vm.count("block-size")) {
    STRATA_ASSIGN_OR_RETURN(opt.block_sizes,
                            nb::ParseSizeList(JoinedList(vm, "block-size"), "--block-size"));
  }
  if (vm.count("queue-depth")) {
    STRATA_ASSIGN_OR_RETURN(opt.queue_depths,
                            nb::ParseIntList(JoinedList(vm, "queue-depth"), "--queue-depth"));
  }
  if (vm.count("threads")) {
    STRATA_ASSIGN_OR_RETURN(opt.threads, nb::ParseIntList(JoinedList(vm, "threads"), "--threads"));
  }
  if (vm.count("mode")) {
    STRATA_ASSIGN_OR_RETURN(opt.modes, nb::ParseModeList(JoinedList(vm, "mode"), "--mode"));
  }
  return strata::Status::Ok();
}

// How each measurement runs: --direct or --buffered, --memory, --engine, --rounds,
// --backlog, --seconds.
strata::Status ReadSettings(const po::variables_map& vm, const CommandLine& cl,
                            nb::SweepOptions& opt) {
  if (vm.count("direct") && vm.count("buffered")) {
    return strata::InvalidArgumentError("--direct and --buffered: give one of them");
  }
  opt.direct = !vm.count("buffered");
  if (vm.count("memory")) {
    STRATA_ASSIGN_OR_RETURN(opt.memory, nb::ParseMemoryKind(cl.memory_text));
  }
  if (vm.count("engine")) {
    auto v = strata::swap::ParseIoEngineKind(cl.engine_text);
    if (!v.ok()) return strata::InvalidArgumentError("--engine: " + v.status().message());
    opt.engine = *v;
  }
  if (vm.count("rounds")) opt.rounds = cl.rounds;
  if (vm.count("backlog")) {
    if (cl.backlog_text == "auto") {
      opt.backlog = -1;
    } else {
      auto v = nb::ParseIntList(cl.backlog_text, "--backlog");
      if (!v.ok() || v->size() != 1 || v->front() < 0) {
        return strata::InvalidArgumentError("--backlog: \"" + cl.backlog_text +
                                            "\" is not auto or a whole number >= 0");
      }
      opt.backlog = v->front();
    }
  }
  if (vm.count("seconds")) opt.seconds = cl.seconds;
  return strata::Status::Ok();
}

// The sweep's options from the command line (--quick's, or the defaults, overridden), or
// the usage error's message as an InvalidArgument status.
strata::Result<nb::SweepOptions> ReadSweepOptions(const po::variables_map& vm,
                                                  const CommandLine& cl) {
  nb::SweepOptions opt = vm.count("quick") ? nb::SweepOptions::Quick() : nb::SweepOptions();
  if (vm.count("path")) opt.paths = vm["path"].as<std::vector<std::string>>();
  STRATA_RETURN_IF_ERROR(CheckPaths(opt.paths));
  if (vm.count("size")) {
    auto v = strata::ParseBytes(cl.size_text);
    if (!v.ok()) return strata::InvalidArgumentError("--size: " + v.status().message());
    opt.size = *v;
  }
  STRATA_RETURN_IF_ERROR(ReadLists(vm, opt));
  STRATA_RETURN_IF_ERROR(ReadSettings(vm, cl, opt));
  STRATA_RETURN_IF_ERROR(opt.Validate());
  return opt;
}

// Runs the sweep (progress on stderr, stopped by a signal) and writes its report, and the
// files asked for; the exit code.
int SweepAndReport(nb::SweepOptions opt, const CommandLine& cl, bool show_progress) {
  ProgressPrinter printer(show_progress);
  opt.progress = [&printer](const nb::SweepProgress& p) { printer(p); };
  opt.should_stop = [] { return g_signal != 0; };
  InstallSignalHandlers();

  strata::Result<nb::SweepResult> result = nb::RunSweep(opt);
  nb::SweepProgress finished;
  finished.phase = nb::SweepProgress::Phase::kDone;
  printer(finished);
  if (g_signal != 0) {
    std::cerr << "nvme_bench: interrupted (signal " << static_cast<int>(g_signal)
              << "); the data files are removed\n";
    return 128 + g_signal;
  }
  if (!result.ok()) {
    std::cerr << "nvme_bench: " << result.status() << "\n";
    return kFailure;
  }

  const nb::BestSettings best = nb::ChooseBest(result->points);
  std::cout << nb::FormatReport(*result) << std::flush;
  bool ok = true;
  if (!cl.json_file.empty()) {
    ok &= WriteFile(cl.json_file, nb::ToJson(*result).dump(2) + "\n", "JSON");
  }
  if (!cl.plot_file.empty()) ok &= WriteFile(cl.plot_file, nb::RenderSvg(*result), "plot");
  if (!cl.snippet_file.empty()) {
    ok &= WriteFile(cl.snippet_file, nb::ConfigSnippet(best).dump(2) + "\n", "snippet");
  }
  return ok ? kOk : kFailure;
}

}  // namespace

int main(int argc, char** argv) {
  po::options_description desc("options");
  CommandLine cl;
  AddOptions(desc, cl);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    return UsageError(e.what());
  }
  if (vm.count("help")) {
    std::cout << kSynopsis << "\n" << desc;
    return kOk;
  }
  if (vm.count("version")) {
    std::cout << "nvme_bench (Strata) " << STRATA_VERSION_STRING << "\n";
    return kOk;
  }
  strata::Result<nb::SweepOptions> opt = ReadSweepOptions(vm, cl);
  if (!opt.ok()) return UsageError(opt.status().message());
  return SweepAndReport(std::move(*opt), cl, !vm.count("no-progress"));
}

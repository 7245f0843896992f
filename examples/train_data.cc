#include "strata/examples/train_data.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "strata/core/bytes.h"

namespace strata::train {
namespace fs = std::filesystem;

namespace {

Status ReadWhole(const fs::path& path, std::vector<uint8_t>* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgumentError("cannot read " + path.string());
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return InvalidArgumentError("error reading " + path.string());
  out->insert(out->end(), data.begin(), data.end());
  return Status::Ok();
}

std::string ExecutableDir() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  return exe.parent_path().string();
}

}  // namespace

Result<Corpus> LoadCorpusFile(const std::string& path) {
  Corpus c;
  c.name = path;
  STRATA_RETURN_IF_ERROR(ReadWhole(path, &c.bytes));
  if (c.bytes.empty()) return InvalidArgumentError("data file " + path + " is empty");
  return c;
}

Result<Corpus> LoadDefaultCorpus(const std::string& source_dir) {
  std::vector<std::string> looked;
  const std::string exe_dir = ExecutableDir();
  if (!exe_dir.empty()) {
    fs::path generated = fs::path(exe_dir) / ".." / "share" / "strata" / "strata-train-corpus.txt";
    std::error_code ec;
    if (fs::is_regular_file(generated, ec)) {
      Result<Corpus> c = LoadCorpusFile(generated.lexically_normal().string());
      if (c.ok()) return c;
    }
    looked.push_back(generated.lexically_normal().string());
  }
  if (!source_dir.empty()) {
    std::vector<fs::path> files;
    const fs::path readme = fs::path(source_dir) / "README.md";
    std::error_code ec;
    if (fs::is_regular_file(readme, ec)) files.push_back(readme);
    const fs::path docs = fs::path(source_dir) / "docs";
    std::vector<fs::path> md;
    if (fs::is_directory(docs, ec)) {
      for (const auto& entry : fs::recursive_directory_iterator(docs, ec))
        if (entry.is_regular_file(ec) && entry.path().extension() == ".md") md.push_back(entry.path());
    }
    // In the order of their paths as strings, as examples/make_corpus.cmake sorts them.
    std::sort(md.begin(), md.end(), [](const fs::path& a, const fs::path& b) {
      return a.generic_string() < b.generic_string();
    });
    files.insert(files.end(), md.begin(), md.end());
    if (!files.empty()) {
      Corpus c;
      c.name = source_dir + "/{README.md,docs/**/*.md} (" + std::to_string(files.size()) + " files)";
      for (const fs::path& f : files) {  // as examples/make_corpus.cmake writes them
        STRATA_RETURN_IF_ERROR(ReadWhole(f, &c.bytes));
        c.bytes.push_back('\n');
      }
      if (!c.bytes.empty()) return c;
    }
    looked.push_back(source_dir + "/README.md and " + source_dir + "/docs/**/*.md");
  }
  std::string msg = "the default corpus was not found; looked at:";
  for (const std::string& l : looked)
    msg += " " + l + ";";
  msg += " pass --data FILE";
  return NotFoundError(msg);
}

Sampler::Sampler(const Corpus& corpus, int64_t seq_len, uint64_t seed)
    : seq_len_(seq_len),
      positions_(static_cast<int64_t>(corpus.bytes.size()) - seq_len),
      rng_(seed) {}

std::vector<int64_t> Sampler::NextOffsets(int64_t global_rows) {
  std::vector<int64_t> offsets(static_cast<size_t>(global_rows));
  for (int64_t& o : offsets)
    o = static_cast<int64_t>(rng_() % static_cast<uint64_t>(positions_));
  return offsets;
}

std::string Sampler::State() const {
  std::ostringstream out;
  out << rng_;
  return out.str();
}

Status Sampler::SetState(const std::string& state) {
  std::istringstream in(state);
  std::mt19937_64 rng;
  in >> rng;
  if (in.fail()) return InvalidArgumentError("not a data-order generator state");
  rng_ = rng;
  return Status::Ok();
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

Status MetricsWriter::Open(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".csv") {
    jsonl_ = false;
  } else if (ext == ".jsonl") {
    jsonl_ = true;
  } else {
    return InvalidArgumentError("--metrics " + path +
                                ": the file name must end in .csv (CSV) or .jsonl (JSON lines)");
  }
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr)
    return InvalidArgumentError("--metrics " + path + ": cannot create: " + std::strerror(errno));
  path_ = path;
  if (!jsonl_) {
    std::fputs(
        "step,loss,lr,tokens_per_s,device_bytes,device_peak_bytes,host_bytes,host_peak_bytes,"
        "elapsed_s,forward_s,backward_s,step_s,waited_s,tflops,mfu\n",
        file_);
  }
  return Status::Ok();
}

Status MetricsWriter::Write(const StepMetrics& m) {
  if (file_ == nullptr) return Status::Ok();
  int n;
  if (jsonl_) {
    n = std::fprintf(file_,
                     "{\"step\":%" PRId64
                     ",\"loss\":%.9g,\"lr\":%.9g,\"tokens_per_s\":%.1f,\"device_bytes\":%" PRIu64
                     ",\"device_peak_bytes\":%" PRIu64 ",\"host_bytes\":%" PRIu64
                     ",\"host_peak_bytes\":%" PRIu64
                     ",\"elapsed_s\":%.3f,\"forward_s\":%.6f,\"backward_s\":%.6f,\"step_s\":%."
                     "6f,\"waited_s\":%.6f,\"tflops\":%.6g,\"mfu\":%.6g}\n",
                     m.step, m.loss, m.lr, m.tokens_per_s, m.device_bytes, m.device_peak_bytes,
                     m.host_bytes, m.host_peak_bytes, m.elapsed_s, m.forward_s, m.backward_s,
                     m.step_s, m.waited_s, m.tflops, m.mfu);
  } else {
    n = std::fprintf(file_,
                     "%" PRId64 ",%.9g,%.9g,%.1f,%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64
                     ",%.3f,%.6f,%.6f,%.6f,%.6f,%.6g,%.6g\n",
                     m.step, m.loss, m.lr, m.tokens_per_s, m.device_bytes, m.device_peak_bytes,
                     m.host_bytes, m.host_peak_bytes, m.elapsed_s, m.forward_s, m.backward_s,
                     m.step_s, m.waited_s, m.tflops, m.mfu);
  }
  if (n < 0 || std::fflush(file_) != 0)
    return InvalidArgumentError("--metrics " + path_ + ": write failed: " + std::strerror(errno));
  return Status::Ok();
}

Status MetricsWriter::Close() {
  if (file_ == nullptr) return Status::Ok();
  const int rc = std::fclose(file_);
  file_ = nullptr;
  if (rc != 0)
    return InvalidArgumentError("--metrics " + path_ + ": close failed: " + std::strerror(errno));
  return Status::Ok();
}

Progress::Progress(bool enabled, int64_t total_steps, int64_t every)
    : enabled_(enabled),
      tty_(::isatty(STDERR_FILENO) != 0),
      total_(total_steps),
      every_(std::max<int64_t>(1, every)) {}

void Progress::Update(const StepMetrics& m, uint64_t device_budget) {
  if (!enabled_) return;
  const bool last = m.step == total_;
  if (!tty_ && m.step % every_ != 0 && m.step != 1 && !last) return;
  char mfu[32] = "";
  if (m.mfu > 0) std::snprintf(mfu, sizeof mfu, " (MFU %.1f%%)", 100.0 * m.mfu);
  char tail[320];
  std::snprintf(tail, sizeof tail,
                "step %" PRId64 "/%" PRId64
                " loss %.4f lr %.2e %.0f tok/s %.3g TFLOPS%s | device %s (peak %s of %s) | host %s "
                "(peak %s)",
                m.step, total_, m.loss, m.lr, m.tokens_per_s, m.tflops, mfu,
                FormatBytes(m.device_bytes).c_str(), FormatBytes(m.device_peak_bytes).c_str(),
                device_budget ? FormatBytes(device_budget).c_str() : "unlimited",
                FormatBytes(m.host_bytes).c_str(), FormatBytes(m.host_peak_bytes).c_str());
  if (tty_) {
    constexpr int kWidth = 24;
    const double frac = total_ > 0 ? static_cast<double>(m.step) / static_cast<double>(total_) : 1;
    const int filled = static_cast<int>(std::lround(frac * kWidth));
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r\033[K[%s] %s", bar.c_str(), tail);
    drawn_ = true;
  } else {
    std::fprintf(stderr, "strata-train: %s\n", tail);
  }
  std::fflush(stderr);
}

void Progress::Finish() {
  if (enabled_ && tty_ && drawn_) {
    std::fputc('\n', stderr);
    std::fflush(stderr);
  }
  drawn_ = false;
}

Result<ProcessResources> ReadProcessResources(const std::vector<std::string>& swap_dirs) {
  ProcessResources r;
  std::ifstream status("/proc/self/status");
  if (!status) return ErrnoError(errno, "reading /proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    auto kib = [&](const char* key, uint64_t* out) {
      const size_t n = std::strlen(key);
      if (line.compare(0, n, key) == 0) *out = std::strtoull(line.c_str() + n, nullptr, 10) * 1024;
    };
    kib("VmRSS:", &r.rss_bytes);
    kib("VmLck:", &r.locked_bytes);
    kib("VmPin:", &r.pinned_bytes);
  }
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return ErrnoError(errno, "listing /proc/self/fd");
  const int own = ::dirfd(d);
  std::set<std::pair<dev_t, ino_t>> seen;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    if (fd == own) continue;
    ++r.open_fds;
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    char target[4096];
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string path(target, static_cast<size_t>(n));
    const bool under = std::any_of(swap_dirs.begin(), swap_dirs.end(), [&](const std::string& dir) {
      return !dir.empty() && path.compare(0, dir.size() + 1, dir + "/") == 0;
    });
    struct stat st;
    if (!under || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (seen.insert({st.st_dev, st.st_ino}).second)
      r.swap_file_bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  ::closedir(d);
  return r;
}

}  // namespace strata::train

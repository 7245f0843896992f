// checkpoint_bench: EngineCore::SaveCheckpoint and LoadCheckpoint of one rank's
// states (fp32 master, m, v: 12 bytes per parameter) against the disk measured in the same
// run, on the same directory, with the same bytes:
//   - write limits: one new file of the checkpoint's size written front to back from memory
//     in 4 MiB pieces, then fsync: through the page cache ("buffered wr"), and with O_DIRECT
//     through the swap layer's io_uring engine, 8 writes in flight ("direct wr": the I/O a
//     save does);
//   - read limit: that file read back cold (its pages dropped with
//     posix_fadvise(DONTNEED) after the fsync), front to back in 4 MiB pieces.
// The save is timed from the call to its return (files written, fsynced, read back against
// their CRCs, manifest, renames, fsyncs). The load is timed cold too (the tag's files
// dropped from the page cache first): its check pass reads and CRCs every tensor, then the
// states are read again (from the page cache unless memory is short) into the store.
// Rounds interleave limit, save and load (the limits first in even rounds, last in odd
// ones; each round's checkpoint removed after it); medians are printed. One rank, host tier,
// the states partitioned into 8 groups.
//
// With --frozen N: a LoRA-like model instead, the trained `--params` and N frozen parameters
// (8 groups of each, bf16 working dtype), saved and loaded (cold) three ways per round, in
// rotating order: the frozen values as fp32 in fp32_master (format 1, what builds before
// format 2 wrote; CheckpointSaveRequest::test_format_1), in their own bf16 tensor (format 2,
// the default), and left out (exclude_frozen_parameters); bytes, seconds, medians.
//
// Usage: checkpoint_bench --dir DIR [--params 64M] [--frozen N] [--rounds 5] [--threads 2]
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/swap/io_engine.h"

namespace {

using namespace strata;  // NOLINT(google-build-using-namespace): a program
using bench::Clock;
using bench::Median;
using bench::Seconds;

// Drops a file's clean pages from the page cache.
void DropCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// A tag directory and its files (one level).
Status RemoveDir(const std::string& dir) {
  for (const char* f : {"/manifest.json", "/rank-00000.bin"})
    ::unlink((dir + f).c_str());
  if (::rmdir(dir.c_str()) != 0) return ErrnoError(errno, "removing " + dir);
  return Status::Ok();
}

Result<double> WriteLimit(const std::string& path, uint64_t bytes) {
  std::vector<char> buf(size_t{4} << 20, 'x');
  ::unlink(path.c_str());
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return ErrnoError(errno, "creating " + path);
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), bytes - done));
    const ssize_t w = ::write(fd, buf.data(), n);
    if (w <= 0) {
      ::close(fd);
      return ErrnoError(errno, "writing " + path);
    }
    done += static_cast<uint64_t>(w);
  }
  if (::fsync(fd) != 0) return ErrnoError(errno, "fsync of " + path);
  ::close(fd);
  return Seconds(t0, Clock::now());
}

// The same bytes into a new file with O_DIRECT through the swap layer's io_uring engine
// (8 writes of 4 MiB in flight), then fsync: the I/O a save does, without the states.
Result<double> DirectWriteLimit(const std::string& path, uint64_t bytes) {
  constexpr size_t kPiece = size_t{4} << 20;
  constexpr int kDepth = 8;
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> bufs;
  for (int i = 0; i < kDepth; ++i) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, kPiece) != 0) return ResourceExhaustedError("buffers");
    std::memset(p, 'x' + i, kPiece);
    bufs.emplace_back(static_cast<std::byte*>(p), &std::free);
  }
  swap::IoEngineOptions io;
  io.queue_depth = kDepth;
  io.fixed_buffers = false;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::IoEngine> engine, swap::CreateIoEngine(io));
  ::unlink(path.c_str());
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_DIRECT, 0644);
  if (fd < 0) return ErrnoError(errno, "creating " + path + " with O_DIRECT");
  STRATA_ASSIGN_OR_RETURN(swap::FileId f, engine->RegisterFile(fd, path));
  uint64_t off = 0;
  int next = 0;
  Status st;
  while (off < bytes && st.ok()) {
    if (engine->in_flight() == kDepth) {
      Result<swap::IoCompletion> c = engine->WaitOne();
      st = c.ok() ? c->status : c.status();
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, bytes - off));
    swap::IoRequest r{swap::IoOp::kWrite,
                      f,
                      off,
                      (n + 4095) / 4096 * 4096,
                      bufs[static_cast<size_t>(next++ % kDepth)].get(),
                      0};
    if (st.ok()) st = engine->Submit({&r, 1});
    off += n;
  }
  const Status all = engine->WaitAll(nullptr);
  if (st.ok()) st = all;
  (void)engine->UnregisterFile(f);
  if (st.ok() && ::fsync(fd) != 0) st = ErrnoError(errno, "fsync of " + path);
  ::close(fd);
  STRATA_RETURN_IF_ERROR(st);
  return Seconds(t0, Clock::now());
}

Result<double> ReadLimit(const std::string& path) {
  DropCache(path);
  std::vector<char> buf(size_t{4} << 20);
  const auto t0 = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return ErrnoError(errno, "opening " + path);
  while (true) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0) {
      ::close(fd);
      return ErrnoError(errno, "reading " + path);
    }
    if (r == 0) break;
  }
  ::close(fd);
  return Seconds(t0, Clock::now());
}

// One rank's engine (CPU-Adam on `threads` threads, optimizer states in host memory) over 8
// groups of params / 8 (and, with `frozen`, 8 frozen groups of frozen / 8, bf16 working dtype),
// after one step, so that m and v hold values; null (the error printed) if it cannot be made.
std::unique_ptr<engine::EngineCore> SteppedEngine(uint64_t params, uint64_t frozen, int threads) {
  Config c;
  c.optimizer.lr = 1e-3;
  c.bf16 = frozen > 0;
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.reduce_bucket_size = static_cast<int64_t>(params / 8);
  comm::Rendezvous rv;
  rv.store = comm::InProcessStore();
  Result<std::unique_ptr<comm::Communicator>> cm =
      comm::CreateCommunicator(comm::Backend::kGloo, rv, {});
  STRATA_CHECK_OK(cm.status());
  std::vector<engine::GroupDesc> groups;
  const size_t per = params / 8, per_frozen = frozen / 8;
  for (size_t g = 0; g < 8; ++g)
    groups.push_back({"g" + std::to_string(g), {{"w", per, nullptr}}});
  for (size_t g = 0; g < 8 && frozen > 0; ++g) {
    engine::GroupDesc d{"f" + std::to_string(g), {{"base", per_frozen, nullptr}}};
    d.frozen = true;
    groups.push_back(std::move(d));
  }
  engine::EngineOptions o;
  o.cpu_adam.num_threads = threads;
  o.device_allocator = std::make_shared<engine::HostArenaAllocator>(0);
  o.broadcast_initial_values = false;
  Result<std::unique_ptr<engine::EngineCore>> made =
      engine::EngineCore::Create(c, std::move(*cm), groups, o);
  if (!made.ok()) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", made.status().ToString().c_str());
    return nullptr;
  }
  engine::EngineCore& e = **made;
  std::vector<float> grad(per);
  for (size_t i = 0; i < per; ++i)
    grad[i] = 1e-3f * static_cast<float>(i % 113) - 0.05f;
  for (int g = 0; g < 8; ++g)
    STRATA_CHECK_OK(e.PreForward(g));
  for (int g = 0; g < 8; ++g)
    STRATA_CHECK_OK(e.PostForward(g));
  for (int g = 7; g >= 0; --g) {
    STRATA_CHECK_OK(e.PreBackward(g));
    STRATA_CHECK_OK(e.AddGradient(g, 0, grad.data(), engine::DType::kFloat32));
    STRATA_CHECK_OK(e.PostBackward(g));
  }
  STRATA_CHECK_OK(e.EndBackward());
  STRATA_CHECK_OK(e.Step().status());
  return *std::move(made);
}

int Run(const std::string& dir, uint64_t params, int rounds, int threads) {
  std::unique_ptr<engine::EngineCore> made = SteppedEngine(params, 0, threads);
  if (made == nullptr) return 1;
  engine::EngineCore& e = *made;

  const uint64_t bytes = uint64_t{12} * e.partition().partition_numel;
  std::printf("checkpoint_bench: %s, %llu parameters (%s of fp32 master, m, v), %d rounds\n",
              dir.c_str(), static_cast<unsigned long long>(params), FormatBytes(bytes).c_str(),
              rounds);
  std::printf("%-6s %12s %12s %12s %8s %12s %12s %8s\n", "round", "buffered wr", "direct wr",
              "save", "ratio", "read limit", "load (cold)", "ratio");
  std::vector<double> w_lim, d_lim, saves, r_lim, loads;
  const std::string limit_file = dir + "/checkpoint_bench.limit";
  for (int r = 0; r < rounds; ++r) {
    // Odd rounds measure the limits after the save and load, even rounds before: this
    // VM's disk is much faster on some writes than others (the first writes after a delete
    // were 5x slower in a plain C loop), so neither side always goes first.
    Result<double> wl = 0.0, dl = 0.0, rl = 0.0;
    auto limits = [&] {
      dl = DirectWriteLimit(limit_file, bytes);
      STRATA_CHECK_OK(dl.status());
      wl = WriteLimit(limit_file, bytes);
      STRATA_CHECK_OK(wl.status());
      rl = ReadLimit(limit_file);
      STRATA_CHECK_OK(rl.status());
      ::unlink(limit_file.c_str());
    };
    if (r % 2 == 0) limits();
    engine::CheckpointSaveRequest so;
    so.dir = dir + "/ckpt";
    so.tag = "round" + std::to_string(r);
    const auto t0 = Clock::now();
    Result<std::string> saved = e.SaveCheckpoint(so);
    const double save_s = Seconds(t0, Clock::now());
    STRATA_CHECK_OK(saved.status());
    DropCache(*saved + "/rank-00000.bin");
    engine::CheckpointLoadRequest lo;
    lo.dir = so.dir;
    const auto t1 = Clock::now();
    Result<engine::CheckpointLoadResult> loaded = e.LoadCheckpoint(lo);
    const double load_s = Seconds(t1, Clock::now());
    STRATA_CHECK_OK(loaded.status());
    if (r % 2 == 1) limits();
    // The next round writes into as much free space as this one did.
    STRATA_CHECK_OK(RemoveDir(*saved));
    w_lim.push_back(static_cast<double>(bytes) / *wl);
    d_lim.push_back(static_cast<double>(bytes) / *dl);
    saves.push_back(static_cast<double>(bytes) / save_s);
    r_lim.push_back(static_cast<double>(bytes) / *rl);
    loads.push_back(static_cast<double>(bytes) / load_s);
    const double best = std::max(w_lim.back(), d_lim.back());
    std::printf("%-6d %12s %12s %12s %8.2f %12s %12s %8.2f\n", r,
                FormatBandwidth(w_lim.back()).c_str(), FormatBandwidth(d_lim.back()).c_str(),
                FormatBandwidth(saves.back()).c_str(), saves.back() / best,
                FormatBandwidth(r_lim.back()).c_str(), FormatBandwidth(loads.back()).c_str(),
                loads.back() / r_lim.back());
  }
  std::printf("%-6s %12s %12s %12s %8.2f %12s %12s %8.2f\n", "median",
              FormatBandwidth(Median(w_lim)).c_str(), FormatBandwidth(Median(d_lim)).c_str(),
              FormatBandwidth(Median(saves)).c_str(),
              Median(saves) / std::max(Median(w_lim), Median(d_lim)),
              FormatBandwidth(Median(r_lim)).c_str(), FormatBandwidth(Median(loads)).c_str(),
              Median(loads) / Median(r_lim));
  std::printf(
      "(bandwidth = checkpoint bytes / seconds; ratio = save / the faster write of the round "
      "(goal >= 0.8), load / the cold read)\n");
  return 0;
}

}  // namespace

// The --frozen mode (see the top of the file).
int RunFrozen(const std::string& dir, uint64_t params, uint64_t frozen, int rounds, int threads) {
  std::unique_ptr<engine::EngineCore> made = SteppedEngine(params, frozen, threads);
  if (made == nullptr) return 1;
  engine::EngineCore& e = *made;

  const char* const names[3] = {"fp32 in fp32_master (format 1)", "bf16 tensor (format 2)",
                                "left out (exclude_frozen)"};
  std::printf("checkpoint_bench: %s, %llu trained + %llu frozen parameters (bf16), %d rounds\n",
              dir.c_str(), static_cast<unsigned long long>(params),
              static_cast<unsigned long long>(frozen), rounds);
  std::printf("%-6s %-32s %12s %10s %12s %12s\n", "round", "frozen values", "file bytes", "save s",
              "save", "load (cold) s");
  std::vector<double> save_s[3], load_s[3];
  uint64_t file_bytes[3] = {};
  for (int r = 0; r < rounds; ++r) {
    for (int i = 0; i < 3; ++i) {
      const int mode = (r + i) % 3;
      engine::CheckpointSaveRequest so;
      so.dir = dir + "/ckpt";
      so.tag = "round" + std::to_string(r) + "-" + std::to_string(mode);
      so.test_format_1 = mode == 0;
      so.exclude_frozen_parameters = mode == 2;
      const auto t0 = Clock::now();
      Result<std::string> saved = e.SaveCheckpoint(so);
      const double s_save = Seconds(t0, Clock::now());
      STRATA_CHECK_OK(saved.status());
      struct stat st {};
      const std::string file = *saved + "/rank-00000.bin";
      STRATA_CHECK(::stat(file.c_str(), &st) == 0);
      file_bytes[mode] = static_cast<uint64_t>(st.st_size);
      DropCache(file);
      engine::CheckpointLoadRequest lo;
      lo.dir = so.dir;
      lo.tag = so.tag;
      const auto t1 = Clock::now();
      STRATA_CHECK_OK(e.LoadCheckpoint(lo).status());
      const double s_load = Seconds(t1, Clock::now());
      STRATA_CHECK_OK(RemoveDir(*saved));
      save_s[mode].push_back(s_save);
      load_s[mode].push_back(s_load);
      std::printf("%-6d %-32s %12s %10.3f %12s %12.3f\n", r, names[mode],
                  FormatBytes(file_bytes[mode]).c_str(), s_save,
                  FormatBandwidth(static_cast<double>(file_bytes[mode]) / s_save).c_str(), s_load);
    }
  }
  for (int mode = 0; mode < 3; ++mode) {
    std::printf(
        "%-6s %-32s %12s %10.3f %12s %12.3f\n", "median", names[mode],
        FormatBytes(file_bytes[mode]).c_str(), Median(save_s[mode]),
        FormatBandwidth(static_cast<double>(file_bytes[mode]) / Median(save_s[mode])).c_str(),
        Median(load_s[mode]));
  }
  return 0;
}

int main(int argc, char** argv) {
  std::string dir;
  uint64_t params = uint64_t{64} << 20;
  uint64_t frozen = 0;
  int rounds = 5, threads = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--dir" && has) {
      dir = argv[++i];
    } else if (k == "--params" && has) {
      Result<uint64_t> v = ParseBytes(argv[++i]);  // 64M = 64 Mi parameters
      if (!v.ok() || *v < 8) {
        std::fprintf(stderr, "checkpoint_bench: --params %s\n", argv[i]);
        return 2;
      }
      params = *v;
    } else if (k == "--frozen" && has) {
      Result<uint64_t> v = ParseBytes(argv[++i]);
      if (!v.ok() || *v < 8) {
        std::fprintf(stderr, "checkpoint_bench: --frozen %s\n", argv[i]);
        return 2;
      }
      frozen = *v;
    } else if (k == "--rounds" && has) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (k == "--threads" && has) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr,
                   "usage: checkpoint_bench --dir DIR [--params 64M] [--frozen N] [--rounds 5] "
                   "[--threads 2]\n");
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr, "checkpoint_bench: --dir DIR is needed (a directory on the drive)\n");
    return 2;
  }
  return frozen > 0 ? RunFrozen(dir, params, frozen, rounds, threads)
                    : Run(dir, params, rounds, threads);
}

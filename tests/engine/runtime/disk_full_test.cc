// A full disk under the NVMe tier and the checkpoints: a size-limited tmpfs
// the test mounts (mount(2) needs root or CAP_SYS_ADMIN; CI runs as root, and O_DIRECT
// works on tmpfs since Linux 6.6). Where the mount fails the tests say why and report
// SKIPPED: the injected ENOSPC of the swap writes is NvmeFaultTest.WriteEnospc's
// (nvme_offload_test.cc), and the checkpoint writer has no fault-injection seam.
//
// What must hold: a clear error (ResourceExhausted, naming what did not fit and where),
// nothing silently lost (the engine trains on exactly as without the failed save), the
// last good state intact (the previous checkpoint and `latest` unchanged and loadable).
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "temp_dir.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

// A tmpfs of a given size mounted on a fresh directory, unmounted (lazily, so an open
// file cannot keep it) and removed when the object goes.
class SizedTmpfs {
 public:
  explicit SizedTmpfs(uint64_t bytes) {
    char tmpl[] = "/tmp/strata-disk-full-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      why_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    path_ = tmpl;
    if (::mount("tmpfs", path_.c_str(), "tmpfs", 0, SizeOption(bytes).c_str()) != 0) {
      why_ = "mount -t tmpfs on " + path_ + ": " + std::strerror(errno) +
             (errno == EPERM ? " (needs root or CAP_SYS_ADMIN)" : "");
      return;
    }
    mounted_ = true;
  }
  ~SizedTmpfs() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    if (!path_.empty()) ::rmdir(path_.c_str());
  }
  SizedTmpfs(const SizedTmpfs&) = delete;
  SizedTmpfs& operator=(const SizedTmpfs&) = delete;

  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }
  const std::string& path() const { return path_; }
  // Bytes in use (the filesystem's blocks minus its free ones).
  uint64_t Used() const {
    struct statvfs v {};
    if (::statvfs(path_.c_str(), &v) != 0) return 0;
    return (static_cast<uint64_t>(v.f_blocks) - v.f_bfree) * v.f_frsize;
  }
  // Changes the size (a tmpfs can shrink to what it holds).
  bool Resize(uint64_t bytes) {
    return ::mount("tmpfs", path_.c_str(), "tmpfs", MS_REMOUNT, SizeOption(bytes).c_str()) == 0;
  }

 private:
  static std::string SizeOption(uint64_t bytes) {
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    return "size=" + std::to_string((bytes + page - 1) / page * page) + ",mode=0700";
  }
  std::string path_;
  std::string why_;
  bool mounted_ = false;
};

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string ReadLatest(const std::string& dir) {
  std::ifstream f(dir + "/latest");
  std::string tag;
  std::getline(f, tag);
  return tag;
}

Config NvmeConfig(const std::string& swap_dir) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {swap_dir};
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = {swap_dir};
  c.zero.offload_param.max_in_cpu = 0;  // every working shard on NVMe
  return c;
}

Status TrainStep(EngineCore& e, int step) {
  STRATA_RETURN_IF_ERROR(EngineMicroStep(e, Seq(step), MakeBatch(step)).status());
  return e.Step().status();
}

#define STRATA_SKIP_UNLESS_MOUNTED(fs)                                                         \
  if (!(fs).ok()) {                                                                            \
    std::printf("DiskFull: %s\n", (fs).why().c_str());                                         \
    GTEST_SKIP() << "no size-limited tmpfs: " << (fs).why()                                    \
                 << "; the injected ENOSPC of the swap writes is NvmeFaultTest.WriteEnospc's"; \
  }

// Two layers refuse it: the start-up check (core/planner.h) against the real free space,
// and, should the disk fill between that check and the swap files' preallocation (here:
// the check is shown a disk with room), the swap space's own statvfs before fallocate.
TEST(DiskFullTest, AnNvmeTierLargerThanTheDiskIsRefusedAtCreateAndLeavesNoFile) {
  SizedTmpfs fs(16 << 10);
  STRATA_SKIP_UNLESS_MOUNTED(fs);
  for (const bool check_sees_room : {false, true}) {
    SCOPED_TRACE(check_sees_room ? "the disk filled after the start-up check"
                                 : "the start-up check");
    EngineOptions o = TestOptions();
    if (check_sees_room) {
      o.test.machine_facts = [](const Plan& plan) -> Result<MachineFacts> {
        MachineFacts m;
        m.host_available_bytes = uint64_t{1} << 40;
        for (const auto& [path, bytes] : plan.nvme_bytes)
          m.free_disk[path] = uint64_t{1} << 40;
        return m;
      };
    }
    Result<std::unique_ptr<EngineCore>> e =
        EngineCore::Create(NvmeConfig(fs.path()), SingleRank(), Groups(InitialParams()), o);
    ASSERT_FALSE(e.ok()) << "the swap tier fit in 16 KiB: the test needs a smaller disk";
    const std::string msg = e.status().message();
    if (check_sees_room) {
      EXPECT_EQ(e.status().code(), StatusCode::kResourceExhausted) << e.status();
      EXPECT_NE(msg.find("swap directory " + fs.path() + ": not enough free disk space"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("free space or add swap directories"), std::string::npos) << msg;
    } else {
      EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status();
      EXPECT_NE(msg.find("nvme_path " + fs.path() + ": the plan needs"), std::string::npos) << msg;
      EXPECT_NE(msg.find("but 16 KiB is free; free space, or add nvme_path directories"),
                std::string::npos)
          << msg;
    }
    EXPECT_TRUE(ListDir(fs.path()).empty()) << ListDir(fs.path())[0];
  }
}

TEST(DiskFullTest, ASaveThatFillsTheDiskFailsCleanlyAndNothingIsLost) {
  SizedTmpfs fs(uint64_t{64} << 20);
  STRATA_SKIP_UNLESS_MOUNTED(fs);
  const std::string swap_dir = fs.path() + "/swap", ckpt = fs.path() + "/ckpt";
  ASSERT_EQ(::mkdir(swap_dir.c_str(), 0700), 0);
  // The engine under test (swap and checkpoints on the small disk) and the same training
  // without checkpoints, its swap on /tmp.
  testing::TempDir ref_swap;
  std::unique_ptr<EngineCore> e = MakeEngine(NvmeConfig(swap_dir), SingleRank(), InitialParams());
  std::unique_ptr<EngineCore> ref =
      MakeEngine(NvmeConfig(ref_swap.path()), SingleRank(), InitialParams());
  ASSERT_TRUE(e != nullptr && ref != nullptr);
  int step = 0;
  for (; step < 2; ++step) {
    ASSERT_TRUE(TrainStep(*e, step).ok());
    ASSERT_TRUE(TrainStep(*ref, step).ok());
  }
  const Params saved = EngineParams(*e);
  const uint64_t before = fs.Used();
  CheckpointSaveRequest so;
  so.dir = ckpt;
  Result<std::string> first = e->SaveCheckpoint(so);
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t one_save = fs.Used() - before;
  ASSERT_GT(one_save, 0u);
  // Half a checkpoint of room left: the next save cannot fit.
  ASSERT_TRUE(fs.Resize(fs.Used() + one_save / 2)) << std::strerror(errno);
  ASSERT_TRUE(TrainStep(*e, step).ok());
  ASSERT_TRUE(TrainStep(*ref, step).ok());
  ++step;
  Result<std::string> second = e->SaveCheckpoint(so);
  ASSERT_FALSE(second.ok()) << "a checkpoint of " << one_save << " bytes fit in " << one_save / 2;
  std::printf("DiskFull: the save said: %s\n", second.status().ToString().c_str());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted) << second.status();
  const std::string msg = second.status().message();
  EXPECT_NE(msg.find("saving checkpoint global_step3 in " + ckpt), std::string::npos) << msg;
  EXPECT_NE(msg.find("No space left on device"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the previous checkpoints are unchanged"), std::string::npos) << msg;
  // The last good checkpoint is untouched and the failed one left nothing behind.
  EXPECT_EQ(ReadLatest(ckpt), "global_step2");
  const std::vector<std::string> left = ListDir(ckpt);
  EXPECT_EQ(left, (std::vector<std::string>{"global_step2", "latest"}))
      << left.size() << " entries";
  // Nothing lost: the engine trains on exactly as the run that never saved.
  for (; step < 5; ++step) {
    ASSERT_TRUE(TrainStep(*e, step).ok());
    ASSERT_TRUE(TrainStep(*ref, step).ok());
  }
  EXPECT_EQ(EngineParams(*e), EngineParams(*ref));
  // The last good checkpoint loads, with the parameters it had.
  {
    testing::TempDir fresh_swap;
    std::unique_ptr<EngineCore> fresh =
        MakeEngine(NvmeConfig(fresh_swap.path()), SingleRank(), InitialParams());
    ASSERT_TRUE(fresh != nullptr);
    CheckpointLoadRequest lo;
    lo.dir = ckpt;
    Result<CheckpointLoadResult> loaded = fresh->LoadCheckpoint(lo);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->tag, "global_step2");
    EXPECT_EQ(EngineParams(*fresh), saved);
  }
  // With room again the same engine saves.
  ASSERT_TRUE(fs.Resize(uint64_t{64} << 20));
  Result<std::string> third = e->SaveCheckpoint(so);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(ReadLatest(ckpt), "global_step5");
}

}  // namespace
}  // namespace strata::engine

#include "strata/tools/nvme_bench/scratch.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <set>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"

namespace strata::nvme_bench {
namespace {

// ---------------------------------------------------------------------------
// The signal-safe registry of paths to remove.

constexpr size_t kRegistrySlots = 128;
enum SlotState : int { kFree = 0, kBusy = 1, kPublished = 2 };

struct RegistryEntry {
  std::atomic<int> state{kFree};
  bool is_directory = false;
  char path[PATH_MAX] = {};
};
static_assert(std::atomic<int>::is_always_lock_free, "the registry needs lock-free atomics");

RegistryEntry g_registry[kRegistrySlots];

// Returns the slot, or -1 when the registry is full or the path too long (then only the
// ordinary removal covers it; logged).
int Publish(const std::string& path, bool is_directory) {
  if (path.size() >= PATH_MAX) return -1;
  for (size_t i = 0; i < kRegistrySlots; ++i) {
    int expected = kFree;
    if (!g_registry[i].state.compare_exchange_strong(expected, kBusy)) continue;
    std::memcpy(g_registry[i].path, path.c_str(), path.size() + 1);
    g_registry[i].is_directory = is_directory;
    g_registry[i].state.store(kPublished, std::memory_order_release);
    return static_cast<int>(i);
  }
  STRATA_LOG(kWarn) << "nvme_bench: too many scratch paths to register " << path
                    << " for removal on a signal";
  return -1;
}

void Unpublish(int slot) {
  if (slot < 0) return;
  g_registry[slot].state.store(kFree, std::memory_order_release);
}

std::string TrimNewline(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r'))
    s.pop_back();
  return s;
}

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return TrimNewline(line);
}

std::string FilesystemName(const struct statfs& st) {
  switch (static_cast<unsigned long>(st.f_type)) {
    case EXT4_SUPER_MAGIC:
      return "ext4";  // also ext2/ext3: same magic
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case TMPFS_MAGIC:
      return "tmpfs";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    case NFS_SUPER_MAGIC:
      return "nfs";
    case F2FS_SUPER_MAGIC:
      return "f2fs";
    case 0x2fc12fc1:
      return "zfs";
    case 0x65735546:
      return "fuse";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "filesystem 0x%lx", static_cast<unsigned long>(st.f_type));
      return buf;
    }
  }
}

}  // namespace

void RemoveScratchFromSignalHandler() noexcept {
  // Files first, then the directories that held them.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < kRegistrySlots; ++i) {
      RegistryEntry& e = g_registry[i];
      if (e.state.load(std::memory_order_acquire) != kPublished) continue;
      if (e.is_directory != (pass == 1)) continue;
      if (e.is_directory) {
        (void)::rmdir(e.path);
      } else {
        (void)::unlink(e.path);
      }
    }
  }
}

std::string DescribeFilesystem(const std::string& path) {
  std::string out;
  struct statfs sfs {};
  if (::statfs(path.c_str(), &sfs) == 0) {
    out = FilesystemName(sfs);
  } else {
    out = "unknown filesystem";
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || major(st.st_dev) == 0) return out;
  const std::string sys =
      "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  char link[PATH_MAX];
  const ssize_t n = ::readlink(sys.c_str(), link, sizeof link - 1);
  if (n <= 0) return out;
  link[n] = '\0';
  std::string dev = link;
  dev = dev.substr(dev.rfind('/') + 1);
  out += " on /dev/" + dev;
  // A partition's disk is its parent in sysfs.
  std::string disk = dev;
  if (::access((sys + "/partition").c_str(), F_OK) == 0) {
    std::string parent = link;
    parent = parent.substr(0, parent.rfind('/'));
    disk = parent.substr(parent.rfind('/') + 1);
  }
  std::string model = ReadLine("/sys/block/" + disk + "/device/model");
  if (!model.empty()) out += " (" + model + ")";
  return out;
}

// ---------------------------------------------------------------------------
// ScratchSpace.

ScratchSpace::ScratchSpace(ScratchSpace&& other) noexcept
    : files_(std::move(other.files_)),
      directories_(std::move(other.directories_)),
      registry_slots_(std::move(other.registry_slots_)),
      direct_(other.direct_) {
  other.files_.clear();
  other.directories_.clear();
  other.registry_slots_.clear();
}

ScratchSpace& ScratchSpace::operator=(ScratchSpace&& other) noexcept {
  if (this != &other) {
    Status s = Remove();
    if (!s.ok()) STRATA_LOG(kError) << "nvme_bench: " << s;
    files_ = std::move(other.files_);
    directories_ = std::move(other.directories_);
    registry_slots_ = std::move(other.registry_slots_);
    direct_ = other.direct_;
    other.files_.clear();
    other.directories_.clear();
    other.registry_slots_.clear();
  }
  return *this;
}

ScratchSpace::~ScratchSpace() {
  Status s = Remove();
  if (!s.ok()) STRATA_LOG(kError) << "nvme_bench: " << s;
}

Status ScratchSpace::Remove() {
  Status first;
  auto note = [&first](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  for (ScratchFile& f : files_) {
    if (f.fd >= 0 && ::close(f.fd) != 0) note(ErrnoError(errno, "closing " + f.path));
    f.fd = -1;
    if (::unlink(f.path.c_str()) != 0 && errno != ENOENT) {
      note(ErrnoError(errno, "removing " + f.path));
    }
  }
  for (auto it = directories_.rbegin(); it != directories_.rend(); ++it) {
    if (::rmdir(it->c_str()) != 0 && errno != ENOENT) {
      note(ErrnoError(errno, "removing directory " + *it));
    }
  }
  for (int slot : registry_slots_)
    Unpublish(slot);
  files_.clear();
  directories_.clear();
  registry_slots_.clear();
  return first;
}

Result<ScratchSpace> ScratchSpace::Create(const std::vector<std::string>& parents,
                                          uint64_t bytes_per_file, bool direct) {
  if (parents.empty()) return InvalidArgumentError("no directory to measure");
  ScratchSpace space;
  space.direct_ = direct;
  std::set<std::pair<dev_t, ino_t>> seen;
  // Check every parent before creating anything.
  for (const std::string& parent : parents) {
    struct stat st {};
    if (::stat(parent.c_str(), &st) != 0) return ErrnoError(errno, "--path " + parent);
    if (!S_ISDIR(st.st_mode)) return InvalidArgumentError("--path " + parent + ": not a directory");
    if (!seen.insert({st.st_dev, st.st_ino}).second) {
      return InvalidArgumentError("--path " + parent + ": given twice");
    }
    struct statvfs vfs {};
    if (::statvfs(parent.c_str(), &vfs) != 0) return ErrnoError(errno, "statvfs " + parent);
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (avail < bytes_per_file) {
      return ResourceExhaustedError(parent + ": needs " + FormatBytes(bytes_per_file) +
                                    " for its data file, " + FormatBytes(avail) +
                                    " free; use a smaller --size");
    }
  }
  for (const std::string& parent : parents) {
    std::string templ = parent;
    if (templ.empty() || templ.back() != '/') templ += '/';
    templ += "nvme_bench.XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      return ErrnoError(errno, "creating a private directory in " + parent);
    }
    space.directories_.push_back(templ);
    space.registry_slots_.push_back(Publish(templ, /*is_directory=*/true));

    ScratchFile f;
    f.parent = parent;
    f.directory = templ;
    f.path = templ + "/data";
    f.size = bytes_per_file;
    space.registry_slots_.push_back(Publish(f.path, /*is_directory=*/false));
    f.fd = ::open(f.path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (f.fd < 0) return ErrnoError(errno, "creating " + f.path);
    space.files_.push_back(f);  // owned from here: removed on any error below
    ScratchFile& file = space.files_.back();
    if (::fallocate(file.fd, 0, 0, static_cast<off_t>(bytes_per_file)) != 0) {
      const int err = errno;
      if (err == EOPNOTSUPP) {
        STRATA_LOG(kWarn) << "nvme_bench: " << parent
                          << " does not support fallocate; the file is extended with "
                             "ftruncate and written in full before measuring";
        if (::ftruncate(file.fd, static_cast<off_t>(bytes_per_file)) != 0) {
          return ErrnoError(errno, "ftruncate " + file.path);
        }
      } else {
        return ErrnoError(err, "fallocate " + FormatBytes(bytes_per_file) + " for " + file.path);
      }
    }
    if (direct) {
      // Re-open with O_DIRECT (setting it with fcntl is silently ignored on some
      // filesystems; open refuses it clearly).
      const int dfd = ::open(file.path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
      if (dfd < 0) {
        const int err = errno;
        if (err == EINVAL || err == EOPNOTSUPP) {
          return InvalidArgumentError("the filesystem of " + parent + " (" +
                                      DescribeFilesystem(parent) +
                                      ") refuses O_DIRECT (open: " + std::strerror(err) +
                                      "); measure through the page cache with --buffered, "
                                      "or give a --path on a filesystem that supports O_DIRECT");
        }
        return ErrnoError(err, "opening " + file.path + " with O_DIRECT");
      }
      ::close(file.fd);
      file.fd = dfd;
    }
  }
  return space;
}

}  // namespace strata::nvme_bench

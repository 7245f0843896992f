// SwapSpace's creation and destruction (swap_space.h): each directory checked (it exists,
// is a directory, is writable), private directories that ended processes left behind
// removed, a private directory and in it a nameless swap file made (O_TMPFILE, else
// created and unlinked at once), O_DIRECT probed, the I/O engine chosen for all the files
// and the files registered with it; at the end, the operations still in flight finished
// and the files closed.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/swap/engine_internal.h"
#include "strata/swap/swap_space.h"
#include "strata/swap/swap_space_internal.h"

namespace strata::swap {

namespace {

using internal::kAlign;
using internal::RoundUp;
using internal::SwapOp;

constexpr const char* kPrivatePrefix = "strata-swap-";

// Removes private directories left behind by processes that no longer exist (only ours:
// "strata-swap-<pid>-XXXXXX", and in them only our "swap.*" files).
void RemoveStaleDirectories(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(kPrivatePrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::strlen(kPrivatePrefix));
    const size_t dash = rest.find('-');
    if (dash == std::string::npos || dash == 0 || rest.size() - dash - 1 != 6) continue;
    const std::string pid_text = rest.substr(0, dash);
    if (!std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || pid > INT_MAX || pid == getpid()) continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    stale.push_back(dir + "/" + name);
  }
  closedir(d);
  for (const std::string& p : stale) {
    if (DIR* sd = opendir(p.c_str())) {
      while (dirent* e = readdir(sd)) {
        const std::string n = e->d_name;
        if (n.rfind("swap.", 0) == 0) unlink((p + "/" + n).c_str());
      }
      closedir(sd);
    }
    if (rmdir(p.c_str()) == 0) {
      STRATA_LOG(kInfo) << "swap: removed " << p << ", left behind by an ended process";
    }
  }
}

}  // namespace

SwapSpace::SwapSpace(SwapSpaceOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<SwapSpace>> SwapSpace::Create(SwapSpaceOptions options) {
  if (options.directories.empty())
    return InvalidArgumentError(
        "swap space: no swap directory given; set offload_optimizer.nvme_path / "
        "offload_param.nvme_path (SwapSpaceOptions::directories)");
  const uint64_t bs = options.block_size;
  if (bs == 0 || !IsAligned(bs, kAlign) || bs > (uint64_t{1} << 30))
    return InvalidArgumentError("swap space: block size " + std::to_string(bs) +
                                " is invalid: it must be a multiple of 4096 bytes, at most 1 GiB "
                                "(aio.block_size)");
  std::vector<std::string> canonical;
  for (const std::string& d : options.directories) {
    if (d.empty()) return InvalidArgumentError("swap space: an empty directory name was given");
    char buf[PATH_MAX];
    std::string real = realpath(d.c_str(), buf) ? std::string(buf) : d;
    for (size_t i = 0; i < canonical.size(); ++i)
      if (canonical[i] == real)
        return InvalidArgumentError("swap space: directory " + d + " is listed twice (as " +
                                    options.directories[i] + " and " + d +
                                    "); give each directory once");
    canonical.push_back(real);
  }
  STRATA_RETURN_IF_ERROR(internal::ValidateIoEngineOptions(options.io));
  std::unique_ptr<SwapSpace> space(new SwapSpace(std::move(options)));
  STRATA_RETURN_IF_ERROR(space->Init());
  return space;
}

Status SwapSpace::Init() {
  const pid_t pid = getpid();
  for (const std::string& path : options_.directories) {
    auto d = std::make_unique<Directory>(options_.block_size);
    d->path = path;
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT)
        return NotFoundError(
            "swap directory " + path +
            " does not exist; create it (mkdir -p) or fix nvme_path in the config");
      return ErrnoError(err, "swap directory " + path);
    }
    if (!S_ISDIR(st.st_mode))
      return InvalidArgumentError("swap directory " + path +
                                  " is not a directory; nvme_path must name directories");
    if (access(path.c_str(), W_OK | X_OK) != 0)
      return Status(StatusCode::kPermissionDenied,
                    "swap directory " + path + " is not writable by this process (uid " +
                        std::to_string(getuid()) + "): " + std::strerror(errno) +
                        "; fix its permissions or choose another directory",
                    errno);
    RemoveStaleDirectories(path);
    std::string tmpl = path + "/" + kPrivatePrefix + std::to_string(pid) + "-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) {
      const int err = errno;
      return ErrnoError(err, "swap directory " + path + ": creating a private subdirectory" +
                                 (err == EROFS ? " (read-only filesystem)" : ""));
    }
    d->private_dir = buf.data();
    // Owned by the space from here: the destructor removes it on any later error.
    Directory& dir = *d;
    dirs_.push_back(std::move(d));
    if (chmod(dir.private_dir.c_str(), 0700) != 0)
      return ErrnoError(errno, "chmod 0700 " + dir.private_dir);

    const bool want_direct = options_.direct_io && !options_.assume_no_direct_io;
    if (options_.direct_io && options_.assume_no_direct_io)
      dir.no_direct_reason = "assume_no_direct_io is set";
    int flags = O_RDWR | O_CLOEXEC | (want_direct ? O_DIRECT : 0);
    int fd = open(dir.private_dir.c_str(), O_TMPFILE | flags, 0600);
    if (fd < 0 && errno == EINVAL && want_direct) {
      // O_DIRECT refused, or O_TMPFILE: the second attempt tells which.
      fd = open(dir.private_dir.c_str(), O_TMPFILE | (flags & ~O_DIRECT), 0600);
      if (fd >= 0) {
        dir.no_direct_reason = "open with O_DIRECT: " + std::string(std::strerror(EINVAL));
        flags &= ~O_DIRECT;
      }
    }
    if (fd >= 0) {
      dir.tmpfile = true;
      dir.file_name = dir.private_dir + "/<O_TMPFILE swap file>";
    } else if (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL) {
      // No O_TMPFILE here: create and unlink at once.
      const std::string named = dir.private_dir + "/swap.0";
      fd = open(named.c_str(), O_CREAT | O_EXCL | flags, 0600);
      if (fd < 0 && errno == EINVAL && (flags & O_DIRECT)) {
        dir.no_direct_reason = "open with O_DIRECT: " + std::string(std::strerror(EINVAL));
        flags &= ~O_DIRECT;
        fd = open(named.c_str(), O_CREAT | O_EXCL | flags, 0600);
      }
      if (fd < 0) return ErrnoError(errno, "swap directory " + path + ": creating " + named);
      if (unlink(named.c_str()) != 0) {
        const int err = errno;
        close(fd);
        return ErrnoError(err, "swap directory " + path + ": unlinking " + named);
      }
      dir.file_name = named + " (unlinked)";
    } else {
      return ErrnoError(
          errno, "swap directory " + path + ": creating the swap file in " + dir.private_dir);
    }
    dir.fd = fd;
    dir.direct = (flags & O_DIRECT) != 0;
    // The file has no name now (O_TMPFILE, or unlinked): the private directory is empty and
    // goes at once, so that a process killed with SIGKILL from here on leaves nothing on
    // disk (the kernel frees the file's blocks when its last descriptor closes).
    if (rmdir(dir.private_dir.c_str()) != 0)
      return ErrnoError(errno, "swap directory " + path + ": removing " + dir.private_dir +
                                   " once the swap file had no name");
    dir.private_dir_removed = true;
    if (dir.direct) {
      // Some filesystems accept O_DIRECT at open and refuse it on I/O: probe one block.
      internal::AlignedBuffer probe;
      STRATA_RETURN_IF_ERROR(probe.Allocate(kAlign));
      std::memset(probe.data, 0, kAlign);
      if (pwrite(fd, probe.data, kAlign, 0) != static_cast<ssize_t>(kAlign)) {
        const int err = errno;
        if (err != EINVAL) return ErrnoError(err, "swap directory " + path + ": probe write");
        dir.no_direct_reason = "O_DIRECT write: " + std::string(std::strerror(err));
        if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_DIRECT) != 0)
          return ErrnoError(errno, "swap directory " + path + ": clearing O_DIRECT");
        dir.direct = false;
      }
    }
  }

  // O_DIRECT for all files or for none: one engine serves them all.
  std::string no_direct;
  for (const auto& d : dirs_)
    if (!d->direct && options_.direct_io)
      no_direct += (no_direct.empty() ? "" : "; ") + d->path + " (" + d->no_direct_reason + ")";
  direct_io_ = options_.direct_io && no_direct.empty();
  IoEngineOptions io = options_.io;
  if (!direct_io_) {
    for (const auto& d : dirs_) {
      if (d->direct) {
        if (fcntl(d->fd, F_SETFL, fcntl(d->fd, F_GETFL) & ~O_DIRECT) != 0)
          return ErrnoError(errno, "swap directory " + d->path + ": clearing O_DIRECT");
        d->direct = false;
      }
    }
  }
  if (!no_direct.empty()) {
    if (io.kind == IoEngineKind::kAuto) io.kind = IoEngineKind::kSync;
    fallback_ = "O_DIRECT is not available in " + no_direct + "; using buffered I/O with the " +
                std::string(IoEngineKindName(io.kind)) + " engine";
    STRATA_LOG(kWarn) << "swap: " << fallback_
                      << " (the page cache sits in the way: slower, and uses host memory)";
  }
  Result<std::unique_ptr<IoEngine>> engine =
      options_.engine_factory ? options_.engine_factory(io) : CreateIoEngine(io);
  if (!engine.ok()) return engine.status().WithContext("swap space: creating the I/O engine");
  engine_ = std::move(engine).value();
  if (!engine_->fallback().empty())
    fallback_ += (fallback_.empty() ? "" : "; ") + engine_->fallback();
  for (size_t i = 0; i < dirs_.size(); ++i) {
    Directory& d = *dirs_[i];
    STRATA_ASSIGN_OR_RETURN(d.file, engine_->RegisterFile(d.fd, d.file_name));
    if (dir_of_file_.size() <= static_cast<size_t>(d.file)) dir_of_file_.resize(d.file + 1, 0);
    dir_of_file_[d.file] = i;
  }
  if (options_.initial_bytes_per_directory > 0) {
    std::unique_lock lock(alloc_mu_);
    const uint64_t want = RoundUp(options_.initial_bytes_per_directory, options_.block_size);
    for (auto& d : dirs_)
      STRATA_RETURN_IF_ERROR(GrowDirectory(*d, want));
  }
  return Status::Ok();
}

SwapSpace::~SwapSpace() {
  if (engine_) {
    // Finish every outstanding operation (its future may still be alive).
    while (true) {
      std::shared_ptr<SwapOp> some;  // one still in flight: waited for (or failed if lost)
      {
        std::lock_guard lock(ops_mu_);
        if (ops_.empty()) break;
        some = ops_.begin()->second;
      }
      std::unique_lock lk(dispatch_mu_);
      if (reaping_) {
        dispatch_cv_.wait(lk);
        continue;
      }
      if (some->remaining == 0) continue;  // finished meanwhile
      reaping_ = true;
      lk.unlock();
      ReapOnce(some.get());
    }
    for (auto& d : dirs_) {
      if (d->file < 0) continue;
      Status s = engine_->UnregisterFile(d->file);
      if (!s.ok()) STRATA_LOG(kWarn) << "swap: " << s;
    }
    engine_.reset();
  }
  for (auto& d : dirs_) {
    if (d->fd >= 0 && close(d->fd) != 0)
      STRATA_LOG(kWarn) << "swap: closing " << d->file_name << ": " << std::strerror(errno);
    if (!d->private_dir.empty() && !d->private_dir_removed && rmdir(d->private_dir.c_str()) != 0)
      STRATA_LOG(kWarn) << "swap: removing " << d->private_dir << ": " << std::strerror(errno);
  }
}

}  // namespace strata::swap

// Helpers shared by the swap tests: scratch directories, files, buffers, random bytes.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "strata/offload/cpu/host_pool.h"

namespace strata::swap::testing {

// A fresh directory under `parent` (default: /tmp), removed with its contents at the end.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& parent = "/tmp") {
    std::string tmpl = parent + "/strata-swap-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~ScratchDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Names in a directory (without . and ..).
inline std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  closedir(d);
  return names;
}

// Open file descriptors of this process that point at a deleted file under `prefix`.
inline int CountOpenFilesUnder(const std::string& prefix) {
  int n = 0;
  for (const std::string& fd : ListDir("/proc/self/fd")) {
    char target[4096];
    const std::string link = "/proc/self/fd/" + fd;
    const ssize_t len = readlink(link.c_str(), target, sizeof target - 1);
    if (len <= 0) continue;
    target[len] = '\0';
    if (std::string(target).rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

inline void FillRandom(std::span<std::byte> bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i)
    bytes[i] = static_cast<std::byte>(rng());
}

inline HostPool MakePool() {
  HostPoolOptions o;
  o.pin = false;
  o.huge_pages = HugePagePolicy::kNone;
  o.verify_huge_pages = false;
  Result<HostPool> pool = HostPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

}  // namespace strata::swap::testing

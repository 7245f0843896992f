// A fresh directory under /tmp, removed with everything in it when the object goes. (Not
// swap's ScratchDir: in the binaries that link LibTorch, std::filesystem::remove_all binds
// to the copy inside libtorch.so, which crashed; this one uses POSIX calls only.)
#pragma once

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

namespace strata::engine::testing {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/strata-engine-test-XXXXXX";
    if (mkdtemp(tmpl) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (path_.empty()) return;
    // Everything under it, depth first (subdirectories too).
    ::nftw(
        path_.c_str(),
        [](const char* p, const struct stat*, int type, struct FTW*) {
          return (type == FTW_DP ? ::rmdir(p) : ::unlink(p)) == 0 ? 0 : -1;
        },
        16, FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace strata::engine::testing

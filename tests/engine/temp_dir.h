// A fresh directory under /tmp, removed with the files in it when the object goes. (Not
// swap's ScratchDir: in the binaries that link LibTorch, std::filesystem::remove_all binds
// to the copy inside libtorch.so, which crashed; this one uses POSIX calls only.)
#pragma once

#include <dirent.h>
#include <stdlib.h>
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
    if (DIR* d = opendir(path_.c_str()); d != nullptr) {
      while (const dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") unlink((path_ + "/" + name).c_str());
      }
      closedir(d);
    }
    rmdir(path_.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace strata::engine::testing

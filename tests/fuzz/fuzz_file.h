// For the fuzz targets that read files: a private directory (made once per process) and
// the input written to a file in it.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace strata::fuzz {

inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/strata-fuzz-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) __builtin_trap();
    return std::string(tmpl);
  }();
  return dir;
}

// Writes `size` bytes to `path` (replacing it).
inline void WriteInput(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
}

}  // namespace strata::fuzz

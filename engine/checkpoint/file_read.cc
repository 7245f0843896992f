#include "strata/engine/checkpoint/file_read.h"

#include <unistd.h>

#include <cerrno>

namespace strata::engine {

Status ReadExactly(int fd, void* dst, size_t bytes, uint64_t offset, const std::string& what) {
  auto* p = static_cast<std::byte*>(dst);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "reading " + what + " at offset " + std::to_string(offset + done));
    }
    if (n == 0) {
      return DataLossError(what + ": the file ends at offset " + std::to_string(offset + done) +
                           ", before the " + std::to_string(bytes) + " bytes from offset " +
                           std::to_string(offset) + " (truncated?)");
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace strata::engine

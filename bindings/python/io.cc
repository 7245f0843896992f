// strata.io's native part: an asynchronous read/write handle over the swap tier's IoEngine
// (swap/io_engine.h), in the manner of DeepNVMe's aio handle, and aligned, page-locked
// (where the memlock limit allows) host buffers exposing the buffer protocol.
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "errors.h"
#include "strata/core/logging.h"
#include "strata/swap/io_engine.h"

namespace py = pybind11;

namespace strata_py {

namespace {

constexpr size_t kAlign = strata::swap::IoEngine::kDirectAlignment;

// Host memory aligned to 4 KiB, locked with mlock when RLIMIT_MEMLOCK allows.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t bytes, bool pin) : size_(bytes) {
    const size_t alloc = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    if (posix_memalign(&data_, kAlign, alloc) != 0) {
      data_ = nullptr;
      throw std::bad_alloc();
    }
    alloc_ = alloc;
    std::memset(data_, 0, alloc);  // touch the pages (and give defined contents)
    if (pin && mlock(data_, alloc) == 0) pinned_ = true;
  }
  ~AlignedBuffer() {
    if (pinned_) munlock(data_, alloc_);
    std::free(data_);
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t alloc_ = 0;
  bool pinned_ = false;
};

std::string Hex(uintptr_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

class AioHandle {
 public:
  AioHandle(uint64_t block_size, int queue_depth, int threads, bool direct,
            const std::string& engine)
      : block_size_(block_size), direct_(direct) {
    if (block_size == 0 || block_size % kAlign != 0) {
      Check(strata::InvalidArgumentError("strata.io.AioHandle: block_size " +
                                         std::to_string(block_size) +
                                         " is not a positive multiple of 4096"));
    }
    strata::swap::IoEngineOptions o;
    o.kind = ValueOrThrow(strata::swap::ParseIoEngineKind(engine));
    o.queue_depth = queue_depth;
    o.threads = threads;
    io_ = ValueOrThrow(strata::swap::CreateIoEngine(o));
  }
  ~AioHandle() {
    if (!files_.empty()) {
      std::vector<strata::swap::IoCompletion> done;
      (void)io_->WaitAll(&done);
      CloseFiles();
    }
  }
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  // Queues one read or write of `bytes` at `buffer`, in block_size pieces. Returns the
  // number of requests it was split into.
  size_t Submit(bool write, uintptr_t buffer, size_t bytes, const std::string& path,
                uint64_t offset) {
    const char* what = write ? "async_pwrite" : "async_pread";
    if (buffer == 0 && bytes != 0) {
      Check(strata::InvalidArgumentError(std::string("strata.io.") + what + ": null buffer"));
    }
    if (direct_ && (buffer % kAlign != 0 || offset % kAlign != 0 || bytes % kAlign != 0)) {
      std::string bad;
      if (buffer % kAlign != 0) bad += " buffer address " + Hex(buffer) + ";";
      if (offset % kAlign != 0) bad += " offset " + std::to_string(offset) + ";";
      if (bytes % kAlign != 0) bad += " length " + std::to_string(bytes) + " bytes;";
      bad.pop_back();
      Check(strata::InvalidArgumentError(
          std::string("strata.io.") + what + " of " + path +
          ": direct=True needs the buffer address, the file offset and the length aligned "
          "to 4096 bytes; misaligned:" +
          bad + " (allocate with strata.io.empty_aligned, or use direct=False)"));
    }
    if (bytes == 0) return 0;
    const int flags = (write ? O_WRONLY | O_CREAT : O_RDONLY) | O_CLOEXEC;
    int fd = -1;
    if (direct_) {
      fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
      if (fd < 0 && errno == EINVAL) {
        // The filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE mounts).
        const int err = errno;
        fd = ::open(path.c_str(), flags, 0644);
        if (fd >= 0) {
          fallback_ = "O_DIRECT is not available for " + path + " (" + std::strerror(err) +
                      "); using buffered I/O";
          STRATA_LOG(kWarn) << "strata.io: " << fallback_;
        }
      }
    } else {
      fd = ::open(path.c_str(), flags, 0644);
    }
    if (fd < 0) {
      Check(strata::ErrnoError(errno, std::string("strata.io.") + what + ": open " + path));
    }
    strata::Result<strata::swap::FileId> id = io_->RegisterFile(fd, path);
    if (!id.ok()) {
      ::close(fd);
      ThrowStatus(id.status());
    }
    files_.push_back({*id, fd});
    std::vector<strata::swap::IoRequest> batch;
    for (size_t done = 0; done < bytes; done += block_size_) {
      strata::swap::IoRequest r;
      r.op = write ? strata::swap::IoOp::kWrite : strata::swap::IoOp::kRead;
      r.file = *id;
      r.offset = offset + done;
      r.length = std::min<size_t>(block_size_, bytes - done);
      r.buffer = reinterpret_cast<std::byte*>(buffer) + done;
      r.tag = ++next_tag_;
      batch.push_back(r);
    }
    strata::Status s = io_->Submit(batch);
    if (!s.ok()) {
      // Nothing of the batch was queued; the file stays registered until wait().
      ThrowStatus(s);
    }
    ++pending_ops_;
    pending_requests_ += batch.size();
    return batch.size();
  }

  // Waits for everything submitted; returns how many operations (async_* calls) ended.
  // Raises the first failed request's error after all requests ended.
  size_t Wait() {
    std::vector<strata::swap::IoCompletion> done;
    strata::Status s;
    {
      py::gil_scoped_release release;
      if (pending_requests_ > 0) s = io_->WaitAll(&done);
    }
    CloseFiles();
    const size_t ops = pending_ops_;
    pending_ops_ = 0;
    pending_requests_ = 0;
    Check(s);
    return ops;
  }

  size_t pending() const { return pending_ops_; }
  std::string engine() const { return io_->name(); }
  std::string fallback() const {
    if (!fallback_.empty()) return fallback_;
    return io_->fallback();
  }
  uint64_t block_size() const { return block_size_; }
  int queue_depth() const { return io_->options().queue_depth; }
  int threads() const { return io_->options().threads; }
  bool direct() const { return direct_; }

 private:
  struct OpenFile {
    strata::swap::FileId id;
    int fd;
  };
  void CloseFiles() {
    for (const OpenFile& f : files_) {
      (void)io_->UnregisterFile(f.id);
      ::close(f.fd);
    }
    files_.clear();
  }

  uint64_t block_size_;
  bool direct_;
  std::unique_ptr<strata::swap::IoEngine> io_;
  std::vector<OpenFile> files_;
  uint64_t next_tag_ = 0;
  size_t pending_ops_ = 0;
  size_t pending_requests_ = 0;
  std::string fallback_;
};

}  // namespace

void BindIo(py::module_& m) {
  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol(),
                            "4 KiB aligned host bytes, mlock'ed when the limit allows.")
      .def(py::init<size_t, bool>(), py::arg("bytes"), py::arg("pin") = true)
      .def_property_readonly(
          "address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &AlignedBuffer::size)
      .def_property_readonly("pinned", &AlignedBuffer::pinned)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      });

  py::class_<AioHandle>(m, "AioHandle")
      .def(py::init<uint64_t, int, int, bool, const std::string&>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("threads"), py::arg("direct"), py::arg("engine"))
      .def(
          "submit",
          [](AioHandle& h, bool write, uintptr_t buffer, size_t bytes, const std::string& path,
             uint64_t offset) { return h.Submit(write, buffer, bytes, path, offset); },
          py::arg("write"), py::arg("buffer"), py::arg("bytes"), py::arg("path"), py::arg("offset"))
      .def("wait", &AioHandle::Wait)
      .def_property_readonly("pending", &AioHandle::pending)
      .def_property_readonly("engine", &AioHandle::engine)
      .def_property_readonly("fallback", &AioHandle::fallback)
      .def_property_readonly("block_size", &AioHandle::block_size)
      .def_property_readonly("queue_depth", &AioHandle::queue_depth)
      .def_property_readonly("threads", &AioHandle::threads)
      .def_property_readonly("direct", &AioHandle::direct);
}

}  // namespace strata_py

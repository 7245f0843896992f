// Checkpoints: see checkpoint.h for the files and the protocol.
#include "strata/engine/checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>

#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/checkpoint/blobs.h"
#include "strata/engine/checkpoint/file_read.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/swap/crc32c.h"
#include "strata/swap/io_engine.h"

namespace strata::engine {
namespace {

using Json = nlohmann::ordered_json;

constexpr uint64_t kAlign = 4096;
constexpr size_t kPieceFloats = size_t{1} << 20;   // 4 MiB of fp32 per read or write
constexpr size_t kStagingBytes = size_t{4} << 20;  // reading back
constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;
constexpr char kFormatName[] = "strata-checkpoint";

const char* const kStateTensors[3] = {"fp32_master", "exp_avg", "exp_avg_sq"};
// Format 2: the frozen groups' working values, in the working dtype.
constexpr char kFrozenTensor[] = "frozen";
// A rank's part of a save without the frozen values: its partial fingerprints of the frozen
// groups, which rank 0 adds into the manifest's groups.
constexpr char kPartFingerprints[] = "frozen_fingerprint_partials";

// The working dtypes by their safetensors names (the frozen tensor's dtype, export's --dtype).
const char* SafetensorsName(DType t) {
  return t == DType::kBFloat16 ? "BF16" : t == DType::kFloat16 ? "F16" : "F32";
}
std::optional<DType> WorkingDTypeOfName(const std::string& name) {
  for (const DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    if (name == SafetensorsName(t)) return t;
  return std::nullopt;
}
// A frozen group's fingerprint in the manifest: 16 hex digits.
std::string FingerprintHex(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
  return text;
}
// 16 hex digits (either case), or nullopt.
std::optional<uint64_t> ParseFingerprintHex(const std::string& text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (const char c : text) {
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                         : -1;
    if (d < 0) return std::nullopt;
    v = v << 4 | static_cast<uint64_t>(d);
  }
  return v;
}

const OptimizerState kStates[3] = {OptimizerState::kMaster, OptimizerState::kExpAvg,
                                   OptimizerState::kExpAvgSq};

std::string RankFileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank-%05d.bin", rank);
  return name;
}
std::string PartFileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank-%05d.json", rank);
  return name;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

Status MakeDirs(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("checkpoint: the save directory is empty");
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string prefix = path.substr(0, at);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError(errno, "creating directory " + prefix);
    }
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return ErrnoError(errno, "checkpoint directory " + path);
  if (!S_ISDIR(st.st_mode)) {
    return InvalidArgumentError("checkpoint directory " + path + " exists and is not a directory");
  }
  return Status::Ok();
}

int RemoveEntry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*ftw*/) {
  return (type == FTW_DP ? ::rmdir(path) : ::unlink(path)) == 0 ? 0 : -1;
}

// The directory and everything in it (POSIX calls: see tests/engine/temp_dir.h on why not
// std::filesystem in binaries that link LibTorch).
Status RemoveTree(const std::string& path) {
  if (!Exists(path)) return Status::Ok();
  if (::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return ErrnoError(errno, "removing " + path);
  }
  return Status::Ok();
}

Status FsyncPath(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "opening " + path + " to fsync it");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(err, "fsync of " + path);
  return Status::Ok();
}

// A file written front to back; Close() reports the first error.
class FileWriter {
 public:
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status Open(const std::string& path) {
    path_ = path;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) return ErrnoError(errno, "creating " + path);
    return Status::Ok();
  }
  Status Write(const void* data, size_t bytes) {
    const auto* p = static_cast<const std::byte*>(data);
    for (size_t done = 0; done < bytes;) {
      const ssize_t n = ::write(fd_, p + done, bytes - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, "writing " + path_ + " at offset " + std::to_string(offset_));
      }
      done += static_cast<size_t>(n);
      offset_ += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }
  Status PadTo(uint64_t alignment) {
    static const std::byte zeros[kAlign] = {};
    const uint64_t pad = (alignment - offset_ % alignment) % alignment;
    return pad == 0 ? Status::Ok() : Write(zeros, static_cast<size_t>(pad));
  }
  Status Sync() {
    if (::fsync(fd_) != 0) return ErrnoError(errno, "fsync of " + path_);
    return Status::Ok();
  }
  // Starts writing what was written so far to the disk without waiting (a hint: the
  // fsync at the end is what counts), so the disk works while the caller computes.
  void StartWriteBack() {
    if (offset_ - started_ < (uint64_t{32} << 20)) return;
    ::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(offset_ - started_),
                      SYNC_FILE_RANGE_WRITE);
    started_ = offset_;
  }
  Status Close() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoError(errno, "closing " + path_);
    return Status::Ok();
  }
  uint64_t offset() const { return offset_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
  uint64_t started_ = 0;  // write-back started up to here
};

// A rank file written front to back with O_DIRECT through an io_uring engine (several
// 4 MiB writes in flight, the copy into the next buffer overlapping them), or through the
// page cache where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6), said once in the
// log (or where `direct` is false: SaveCheckpointOptions::test_buffered_writes).
class RankFileWriter {
 public:
  static constexpr size_t kBuffer = size_t{4} << 20;
  static constexpr int kBuffers = 8;

  ~RankFileWriter() {
    if (io_ != nullptr) {
      (void)io_->WaitAll(nullptr);  // the buffers must outlive their requests
      (void)io_->UnregisterFile(file_);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  Status Open(const std::string& path, bool direct = true) {
    path_ = path;
    if (!direct) return buffered_.Open(path);
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0644);
    if (fd_ < 0 && errno == EINVAL) {
      static std::once_flag logged;
      std::call_once(logged, [&] {
        STRATA_LOG(kInfo) << "checkpoint: " << path
                          << ": the filesystem does not take O_DIRECT; writing through the "
                             "page cache";
      });
      return buffered_.Open(path);
    }
    if (fd_ < 0) return ErrnoError(errno, "creating " + path);
    swap::IoEngineOptions io;
    io.queue_depth = kBuffers;
    io.threads = 1;
    io.fixed_buffers = false;
    STRATA_ASSIGN_OR_RETURN(io_, swap::CreateIoEngine(io));
    STRATA_ASSIGN_OR_RETURN(file_, io_->RegisterFile(fd_, path));
    for (int i = 0; i < kBuffers; ++i) {
      void* p = nullptr;
      if (::posix_memalign(&p, swap::IoEngine::kDirectAlignment, kBuffer) != 0) {
        return ResourceExhaustedError("checkpoint: 4 MiB write buffers for " + path);
      }
      buffers_.emplace_back(static_cast<std::byte*>(p), &std::free);
      free_.push_back(i);
    }
    return Next();
  }
  // Appends `bytes`; with `crc`, extends *crc over them (computed on the copy, in small
  // pieces while they are in cache).
  Status Write(const void* data, size_t bytes, uint32_t* crc = nullptr) {
    if (io_ == nullptr) {
      if (crc != nullptr) {
        *crc = swap::Crc32cExtend(
            *crc, std::span<const std::byte>(static_cast<const std::byte*>(data), bytes));
      }
      return buffered_.Write(data, bytes);
    }
    const auto* p = static_cast<const std::byte*>(data);
    while (bytes > 0) {
      const size_t n = std::min({bytes, kBuffer - fill_, size_t{64} << 10});
      std::byte* dst = buffers_[static_cast<size_t>(cur_)].get() + fill_;
      std::memcpy(dst, p, n);
      if (crc != nullptr) *crc = swap::Crc32cExtend(*crc, std::span<const std::byte>(dst, n));
      fill_ += n;
      p += n;
      bytes -= n;
      offset_ += n;
      if (fill_ == kBuffer) STRATA_RETURN_IF_ERROR(Flush());
    }
    return Status::Ok();
  }
  Status PadTo(uint64_t alignment) {
    static const std::byte zeros[kAlign] = {};
    const uint64_t pad = (alignment - offset() % alignment) % alignment;
    return pad == 0 ? Status::Ok() : Write(zeros, static_cast<size_t>(pad));
  }
  void StartWriteBack() {
    if (io_ == nullptr) buffered_.StartWriteBack();
  }
  // Everything written, then the file cut to its length and fsynced.
  Status Sync() {
    if (io_ == nullptr) return buffered_.Sync();
    if (fill_ > 0) {
      const size_t padded = (fill_ + kAlign - 1) / kAlign * kAlign;
      std::memset(buffers_[static_cast<size_t>(cur_)].get() + fill_, 0, padded - fill_);
      fill_ = padded;
      STRATA_RETURN_IF_ERROR(Flush());
    }
    STRATA_RETURN_IF_ERROR(io_->WaitAll(nullptr));
    if (::ftruncate(fd_, static_cast<off_t>(offset_)) != 0) {
      return ErrnoError(errno, "setting the length of " + path_);
    }
    if (::fsync(fd_) != 0) return ErrnoError(errno, "fsync of " + path_);
    return Status::Ok();
  }
  Status Close() {
    if (io_ == nullptr) return buffered_.Close();
    STRATA_RETURN_IF_ERROR(io_->UnregisterFile(file_));
    io_.reset();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoError(errno, "closing " + path_);
    return Status::Ok();
  }
  uint64_t offset() const { return io_ == nullptr ? buffered_.offset() : offset_; }
  bool direct() const { return io_ != nullptr; }

 private:
  // Submits the current buffer (fill_ bytes, a multiple of 4 KiB) and takes the next one.
  Status Flush() {
    swap::IoRequest r{swap::IoOp::kWrite,
                      file_,
                      file_offset_,
                      fill_,
                      buffers_[static_cast<size_t>(cur_)].get(),
                      static_cast<uint64_t>(cur_)};
    STRATA_RETURN_IF_ERROR(io_->Submit({&r, 1}));
    file_offset_ += fill_;
    fill_ = 0;
    return Next();
  }
  Status Next() {
    if (free_.empty()) {
      STRATA_ASSIGN_OR_RETURN(swap::IoCompletion c, io_->WaitOne());
      STRATA_RETURN_IF_ERROR(c.status);
      free_.push_back(static_cast<int>(c.tag));
    }
    cur_ = free_.back();
    free_.pop_back();
    return Status::Ok();
  }

  std::string path_;
  FileWriter buffered_;
  int fd_ = -1;
  std::unique_ptr<swap::IoEngine> io_;
  swap::FileId file_ = -1;
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> buffers_;
  std::vector<int> free_;
  int cur_ = -1;
  size_t fill_ = 0;           // bytes in the current buffer
  uint64_t file_offset_ = 0;  // where the current buffer goes
  uint64_t offset_ = 0;       // bytes written by the caller
};

// `before_sync` runs between the write and the fsync (a save's crash point).
Status WriteSmallFile(const std::string& path, const std::string& text, bool sync,
                      const std::function<void()>& before_sync = {}) {
  FileWriter w;
  STRATA_RETURN_IF_ERROR(w.Open(path));
  STRATA_RETURN_IF_ERROR(w.Write(text.data(), text.size()));
  if (before_sync) before_sync();
  if (sync) STRATA_RETURN_IF_ERROR(w.Sync());
  return w.Close();
}

Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "opening " + path);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoError(err, "reading " + path);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      ::close(fd);
      return InvalidArgumentError(path + " is larger than " + std::to_string(max_bytes) +
                                  " bytes: not a checkpoint file");
    }
  }
  ::close(fd);
  return text;
}

// A manifest or a rank's part of one; text that is not JSON is `bad` (InvalidArgument for
// a file a user handed over, DataLoss for one this save wrote).
Result<Json> ReadJsonFile(const std::string& path, StatusCode bad) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxManifestBytes));
  try {
    return Json::parse(text);
  } catch (const std::exception& e) {
    return Status(bad, path + " is not valid JSON (" + e.what() + ")");
  }
}

Status CheckTag(const std::string& tag) {
  if (tag.empty() || tag.size() > 200 || tag[0] == '.' || tag == "latest" ||
      tag.find('/') != std::string::npos || tag.find('\0') != std::string::npos) {
    return InvalidArgumentError("checkpoint tag '" + tag +
                                "' is not usable: a tag is a directory name of 1 to 200 "
                                "characters without '/', not starting with '.', not 'latest'");
  }
  return Status::Ok();
}

std::string TrimLine(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' '))
    s.pop_back();
  return s;
}

// The tensor's bytes, read back from the file, against its CRC.
Status VerifyTensor(int fd, const std::string& file, const std::string& tag,
                    const CheckpointTensor& t) {
  std::vector<std::byte> buf(std::min<uint64_t>(kStagingBytes, std::max<uint64_t>(t.bytes, 1)));
  uint32_t crc = 0;
  for (uint64_t done = 0; done < t.bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), t.bytes - done));
    STRATA_RETURN_IF_ERROR(
        ReadExactly(fd, buf.data(), n, t.offset + done,
                    "checkpoint " + tag + ", file " + file + ", tensor " + t.name));
    crc = swap::Crc32cExtend(crc, std::span<const std::byte>(buf.data(), n));
    done += n;
  }
  if (crc != t.crc32c) {
    return DataLossError("checkpoint " + tag + ", file " + file + ", tensor " + t.name +
                         ": CRC32C mismatch (stored " + std::to_string(t.crc32c) + ", read " +
                         std::to_string(crc) + "): the file is corrupt");
  }
  return Status::Ok();
}

Json TensorJson(const CheckpointTensor& t) {
  return Json{{"name", t.name},     {"dtype", t.dtype}, {"shape", t.shape},
              {"offset", t.offset}, {"bytes", t.bytes}, {"crc32c", t.crc32c}};
}

Json PartJson(const CheckpointRankPart& p) {
  Json tensors = Json::array();
  for (const CheckpointTensor& t : p.tensors)
    tensors.push_back(TensorJson(t));
  return Json{{"rank", p.rank},
              {"file", p.file},
              {"file_bytes", p.file_bytes},
              {"tensors", std::move(tensors)}};
}

// Reads a JSON value of the expected kind; errors name the key.
// Whether `v` is an integer JSON number that T holds exactly (nlohmann's get<T> of a float,
// or of an out-of-range integer, is undefined behaviour or a silent wrap).
template <typename T>
bool FitsInteger(const Json& v) {
  if (v.is_number_unsigned()) {
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if constexpr (std::is_unsigned_v<T>) {
      return x >= 0 && static_cast<uint64_t>(x) <= std::numeric_limits<T>::max();
    } else {
      return x >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
             x <= static_cast<int64_t>(std::numeric_limits<T>::max());
    }
  }
  return false;
}

// Reads a JSON value of the expected kind; errors name the key.
template <typename T>
Status Get(const Json& j, const char* key, T& out, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) {
    return InvalidArgumentError(where + ": the key '" + key + "' is missing");
  }
  const Json& v = j.at(key);
  auto wrong = [&](const char* want) {
    return InvalidArgumentError(where + ": the key '" + key + "' must be " + want + ", not " +
                                v.dump().substr(0, 60));
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return wrong("true or false");
    out = v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!FitsInteger<T>(v)) return wrong("an integer in range");
    out = v.get<T>();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return wrong("a number");
    out = v.get<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return wrong("a string");
    out = v.get<std::string>();
  } else {  // std::vector<uint64_t>: shapes
    if (!v.is_array()) return wrong("a list of integers");
    out.clear();
    for (const Json& e : v) {
      if (!FitsInteger<uint64_t>(e)) return wrong("a list of non-negative integers");
      out.push_back(e.get<uint64_t>());
    }
  }
  return Status::Ok();
}

Result<CheckpointRankPart> ParsePart(const Json& j, const std::string& where) {
  CheckpointRankPart p;
  STRATA_RETURN_IF_ERROR(Get(j, "rank", p.rank, where));
  STRATA_RETURN_IF_ERROR(Get(j, "file", p.file, where));
  STRATA_RETURN_IF_ERROR(Get(j, "file_bytes", p.file_bytes, where));
  if (p.file != RankFileName(p.rank)) {
    return InvalidArgumentError(where + ": rank " + std::to_string(p.rank) + "'s file is '" +
                                p.file + "', expected " + RankFileName(p.rank));
  }
  if (!j.contains("tensors") || !j["tensors"].is_array()) {
    return InvalidArgumentError(where + ": rank " + std::to_string(p.rank) + " lists no tensors");
  }
  uint64_t end = 0;
  for (const Json& tj : j["tensors"]) {
    CheckpointTensor t;
    const std::string tw = where + ", rank " + std::to_string(p.rank) + " tensor";
    STRATA_RETURN_IF_ERROR(Get(tj, "name", t.name, tw));
    std::vector<uint64_t> shape;
    STRATA_RETURN_IF_ERROR(Get(tj, "dtype", t.dtype, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "shape", shape, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "offset", t.offset, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "bytes", t.bytes, tw + " " + t.name));
    STRATA_RETURN_IF_ERROR(Get(tj, "crc32c", t.crc32c, tw + " " + t.name));
    const uint64_t elem = CheckpointDTypeSize(t.dtype);
    uint64_t numel = 1;
    bool overflow = shape.size() > 8;
    for (const uint64_t d : shape) {
      if (d != 0 && numel > (UINT64_MAX / 16) / d) overflow = true;
      numel *= d;
    }
    if (elem == 0 || overflow || numel * elem != t.bytes || t.offset < end ||
        t.offset > p.file_bytes || t.bytes > p.file_bytes - t.offset) {
      return InvalidArgumentError(tw + " " + t.name +
                                  ": dtype, shape, offset or size out of place (the manifest is "
                                  "damaged)");
    }
    t.shape = std::move(shape);
    t.numel = numel;
    end = t.offset + t.bytes;
    p.tensors.push_back(std::move(t));
  }
  return p;
}

}  // namespace

const std::vector<std::string>& CheckpointCrashPoints() {
  static const std::vector<std::string> points = {
      "rank_file_written", "rank_file_synced", "part_written",   "manifest_written",
      "manifest_synced",   "parts_removed",    "tmp_dir_synced", "tag_renamed",
      "save_dir_synced",   "latest_written",   "latest_synced",  "latest_renamed"};
  return points;
}

uint64_t CheckpointDTypeSize(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"I16", 2}, {"U16", 2}, {"F16", 2}, {"BF16", 2},
      {"I32", 4},  {"U32", 4}, {"F32", 4}, {"I64", 8}, {"U64", 8}, {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

const CheckpointTensor* CheckpointRankPart::Find(const std::string& name) const {
  for (const CheckpointTensor& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

uint64_t CheckpointManifest::total_bytes() const {
  uint64_t total = 0;
  for (const CheckpointRankPart& p : ranks)
    total += p.file_bytes;
  return total;
}

Result<std::string> ResolveCheckpointTag(const std::string& dir, const std::string& tag) {
  if (!tag.empty()) {
    STRATA_RETURN_IF_ERROR(CheckTag(tag));
    return tag;
  }
  const std::string latest = dir + "/latest";
  if (!Exists(latest)) {
    return NotFoundError("no checkpoint in " + dir +
                         ": it has no 'latest' file (pass a tag, or "
                         "a directory a save wrote to)");
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(latest, 4096));
  std::string name = TrimLine(std::move(text));
  Status ok = CheckTag(name);
  if (!ok.ok()) return InvalidArgumentError(latest + " is damaged: " + ok.message());
  return name;
}

Result<CheckpointManifest> ReadCheckpointManifest(const std::string& tag_dir) {
  const std::string path = tag_dir + "/manifest.json";
  if (!Exists(tag_dir)) return NotFoundError("checkpoint " + tag_dir + " does not exist");
  if (!Exists(path)) {
    return NotFoundError("checkpoint " + tag_dir +
                         " has no manifest.json: not a complete Strata checkpoint");
  }
  STRATA_ASSIGN_OR_RETURN(Json j, ReadJsonFile(path, StatusCode::kInvalidArgument));
  CheckpointManifest m;
  std::string format;
  STRATA_RETURN_IF_ERROR(Get(j, "format", format, path));
  if (format != kFormatName) {
    return InvalidArgumentError(path + ": format '" + format + "' is not a Strata checkpoint");
  }
  STRATA_RETURN_IF_ERROR(Get(j, "version", m.version, path));
  if (m.version < 1 || m.version > kCheckpointFormatVersion) {
    return InvalidArgumentError(path + ": format version " + std::to_string(m.version) +
                                "; this build reads versions 1 to " +
                                std::to_string(kCheckpointFormatVersion) +
                                " (a newer Strata wrote it: load it with that version)");
  }
  STRATA_RETURN_IF_ERROR(Get(j, "tag", m.tag, path));
  STRATA_RETURN_IF_ERROR(Get(j, "world_size", m.world_size, path));
  STRATA_RETURN_IF_ERROR(Get(j, "dtype", m.dtype, path));
  {
    bool known = false;
    for (const DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      if (m.dtype == DTypeName(t)) {
        m.working_dtype = t;
        known = true;
      }
    }
    if (!known) {
      return InvalidArgumentError(path + ": dtype '" + m.dtype.substr(0, 40) +
                                  "' is not fp32, bf16 or fp16");
    }
  }
  STRATA_RETURN_IF_ERROR(Get(j, "global_steps", m.global_steps, path));
  STRATA_RETURN_IF_ERROR(Get(j, "micro_steps", m.micro_steps, path));
  STRATA_RETURN_IF_ERROR(Get(j, "adam_step", m.adam_step, path));
  STRATA_RETURN_IF_ERROR(Get(j, "lr_iteration", m.lr_iteration, path));
  if (!j.contains("loss_scaler")) {
    return InvalidArgumentError(path + ": the key 'loss_scaler' is missing");
  }
  const Json& ls = j["loss_scaler"];
  const std::string lw = path + ", loss_scaler";
  STRATA_RETURN_IF_ERROR(Get(ls, "enabled", m.loss_scaler_enabled, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "scale", m.loss_scale, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "hysteresis_left", m.hysteresis_left, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "iteration", m.scaler_iteration, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "last_overflow_iteration", m.last_overflow_iteration, lw));
  STRATA_RETURN_IF_ERROR(Get(ls, "skipped_steps", m.skipped_steps, lw));
  m.config_json = j.contains("config") ? j["config"].dump() : "null";
  if (j.contains("frozen_parameters_saved")) {
    STRATA_RETURN_IF_ERROR(Get(j, "frozen_parameters_saved", m.frozen_saved, path));
    if (!m.frozen_saved && m.version < 2) {
      return InvalidArgumentError(path + ": 'frozen_parameters_saved' false in format version " +
                                  std::to_string(m.version) + " (it needs version 2)");
    }
  }
  if (m.world_size < 1 || m.world_size > (1 << 20)) {
    return InvalidArgumentError(path + ": world_size " + std::to_string(m.world_size));
  }
  if (!j.contains("groups") || !j["groups"].is_array()) {
    return InvalidArgumentError(path + ": the key 'groups' is missing");
  }
  for (const Json& gj : j["groups"]) {
    CheckpointGroup g;
    STRATA_RETURN_IF_ERROR(Get(gj, "name", g.name, path + ", group"));
    const std::string gw = path + ", group " + g.name;
    STRATA_RETURN_IF_ERROR(Get(gj, "used_numel", g.used_numel, gw));
    STRATA_RETURN_IF_ERROR(Get(gj, "shard_numel", g.shard_numel, gw));
    if (gj.contains("frozen")) STRATA_RETURN_IF_ERROR(Get(gj, "frozen", g.frozen, gw));
    if (!g.frozen && !m.groups.empty() && m.groups.back().frozen) {
      return InvalidArgumentError(gw + ": a trainable group after a frozen one");
    }
    if (gj.contains("frozen_fingerprint")) {
      std::string text;
      STRATA_RETURN_IF_ERROR(Get(gj, "frozen_fingerprint", text, gw));
      const std::optional<uint64_t> v = ParseFingerprintHex(text);
      if (!v) {
        return InvalidArgumentError(gw + ": 'frozen_fingerprint' must be 16 hex digits, not '" +
                                    text.substr(0, 40) + "'");
      }
      if (!g.frozen || m.frozen_saved) {
        return InvalidArgumentError(gw + ": 'frozen_fingerprint' belongs to a frozen group of a " +
                                    "checkpoint saved without the frozen values");
      }
      g.has_fingerprint = true;
      g.frozen_fingerprint = *v;
    }
    if (!gj.contains("params") || !gj["params"].is_array()) {
      return InvalidArgumentError(gw + ": the key 'params' is missing");
    }
    for (const Json& pj : gj["params"]) {
      CheckpointParam p;
      STRATA_RETURN_IF_ERROR(Get(pj, "name", p.name, gw + ", parameter"));
      STRATA_RETURN_IF_ERROR(Get(pj, "numel", p.numel, gw + ", parameter " + p.name));
      STRATA_RETURN_IF_ERROR(Get(pj, "offset", p.offset, gw + ", parameter " + p.name));
      if (p.offset > g.used_numel || p.numel > g.used_numel - p.offset) {
        return InvalidArgumentError(gw + ", parameter " + p.name + ": outside the group");
      }
      p.shape = {p.numel};
      if (pj.contains("shape")) {
        STRATA_RETURN_IF_ERROR(Get(pj, "shape", p.shape, gw + ", parameter " + p.name));
        uint64_t n = 1;
        for (const uint64_t d : p.shape)
          n = d != 0 && n > UINT64_MAX / d ? UINT64_MAX : n * d;
        if (n != p.numel || p.shape.size() > 16) {
          return InvalidArgumentError(gw + ", parameter " + p.name +
                                      ": its shape does not hold its numel");
        }
      }
      g.params.push_back(std::move(p));
    }
    if (g.used_numel > g.shard_numel * static_cast<uint64_t>(m.world_size)) {
      return InvalidArgumentError(gw + ": the shards do not cover the group");
    }
    m.groups.push_back(std::move(g));
  }
  if (!j.contains("ranks") || !j["ranks"].is_array() ||
      j["ranks"].size() != static_cast<size_t>(m.world_size)) {
    return InvalidArgumentError(path + ": 'ranks' must list one part per rank (" +
                                std::to_string(m.world_size) + ")");
  }
  uint64_t partition = 0, trainable = 0;
  for (const CheckpointGroup& g : m.groups) {
    partition += g.shard_numel;
    if (!g.frozen) trainable += g.shard_numel;
  }
  m.partition_numel = partition;
  m.trainable_numel = trainable;
  for (size_t r = 0; r < j["ranks"].size(); ++r) {
    STRATA_ASSIGN_OR_RETURN(CheckpointRankPart p, ParsePart(j["ranks"][r], path));
    if (p.rank != static_cast<int>(r)) {
      return InvalidArgumentError(path + ": part " + std::to_string(r) + " is rank " +
                                  std::to_string(p.rank));
    }
    for (const char* name : kStateTensors) {
      const CheckpointTensor* t = p.Find(name);
      const bool whole = name == kStateTensors[0] && m.frozen_in_master();
      const uint64_t want = whole ? partition : trainable;
      if (t == nullptr || t->dtype != "F32" || t->numel != want) {
        return InvalidArgumentError(path + ": rank " + std::to_string(r) + "'s " + name +
                                    " is missing or not the " + std::to_string(want) +
                                    " fp32 elements of the " +
                                    (whole ? "partition" : "trainable groups"));
      }
    }
    if (!m.frozen_in_master() && m.frozen_saved && partition > trainable) {
      const CheckpointTensor* t = p.Find(kFrozenTensor);
      if (t == nullptr || !WorkingDTypeOfName(t->dtype) || t->numel != partition - trainable) {
        return InvalidArgumentError(path + ": rank " + std::to_string(r) + "'s " + kFrozenTensor +
                                    " is missing or not the " +
                                    std::to_string(partition - trainable) +
                                    " F32, BF16 or F16 elements of the frozen groups");
      }
    }
    m.ranks.push_back(std::move(p));
  }
  return m;
}

Status VerifyCheckpointTensor(const std::string& tag_dir, const CheckpointManifest& m,
                              const CheckpointRankPart& part, const CheckpointTensor& t) {
  const std::string path = tag_dir + "/" + part.file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "checkpoint " + m.tag + ": opening " + path);
  struct stat st {};
  Status s;
  if (::fstat(fd, &st) != 0) {
    s = ErrnoError(errno, "stat of " + path);
  } else if (static_cast<uint64_t>(st.st_size) != part.file_bytes) {
    s = DataLossError("checkpoint " + m.tag + ", file " + path + " is " +
                      std::to_string(st.st_size) + " bytes, the manifest says " +
                      std::to_string(part.file_bytes) + ": truncated or replaced (tensor " +
                      t.name + ")");
  } else {
    s = VerifyTensor(fd, path, m.tag, t);
  }
  ::close(fd);
  return s;
}

Result<std::vector<CheckpointTagEntry>> ListCheckpointTags(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoError(errno, "listing " + dir);
  std::vector<CheckpointTagEntry> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::stat((dir + "/" + name).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (name.rfind(".tmp-", 0) == 0) {
      out.push_back({name, false});
    } else if (name[0] != '.' && Exists(dir + "/" + name + "/manifest.json")) {
      out.push_back({name, true});
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const CheckpointTagEntry& a, const CheckpointTagEntry& b) {
    return a.name < b.name;
  });
  return out;
}

namespace {

// A tensor of the exported file and where its values come from.
struct ExportItem {
  std::string name;
  std::string dtype;  // in the file
  std::vector<uint64_t> shape;
  uint64_t numel = 0;
  uint64_t bytes = 0;
  // A trained parameter: group and parameter index; a frozen one: its blob.
  size_t group = 0, param = 0;
  const CheckpointTensor* blob = nullptr;
};

bool IsFloatName(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64";
}

// Converts n elements of a safetensors float dtype to fp32.
void ToFloat(const std::byte* src, const std::string& dtype, size_t n, float* dst) {
  if (dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, src + i * 8, 8);
      dst[i] = static_cast<float>(v);
    }
    return;
  }
  ConvertToFloat(src, *WorkingDTypeOfName(dtype), n, dst);
}

// Reads `n` values of group `g` that saving rank `part` holds, from element `at` of its
// partition, into `out` as fp32: from fp32_master, or from the tensor "frozen" in its dtype
// (format 2, a frozen group). `raw`: scratch.
Status ReadSavedValues(int fd, const CheckpointManifest& m, const CheckpointRankPart& part,
                       size_t g, uint64_t at, uint64_t n, float* out, std::vector<std::byte>& raw,
                       const std::string& what) {
  if (!m.groups[g].frozen || m.frozen_in_master()) {
    return ReadExactly(fd, out, n * 4, part.Find(kStateTensors[0])->offset + at * 4,
                       what + ", tensor fp32_master");
  }
  const CheckpointTensor* t = part.Find(kFrozenTensor);
  const uint64_t esize = CheckpointDTypeSize(t->dtype);
  const uint64_t offset = t->offset + (at - m.trainable_numel) * esize;
  if (t->dtype == "F32") return ReadExactly(fd, out, n * 4, offset, what + ", tensor frozen");
  raw.resize(n * esize);
  STRATA_RETURN_IF_ERROR(ReadExactly(fd, raw.data(), raw.size(), offset, what + ", tensor frozen"));
  ToFloat(raw.data(), t->dtype, n, out);
  return Status::Ok();
}

}  // namespace

Result<CheckpointExportStats> ExportCheckpointSafetensors(const std::string& tag_dir,
                                                          const CheckpointManifest& m,
                                                          const std::string& out,
                                                          const std::string& dtype) {
  const std::optional<DType> out_dtype = WorkingDTypeOfName(dtype);
  if (!out_dtype)
    return InvalidArgumentError("export: dtype " + dtype + " (one of F32, BF16, F16)");
  const DType out_type = *out_dtype;
  // What goes in, and a check of every tensor it reads.
  std::vector<ExportItem> items;
  std::set<std::string> names;
  CheckpointExportStats stats;
  for (size_t g = 0; g < m.groups.size(); ++g) {
    if (m.groups[g].frozen && !m.frozen_saved) {
      stats.frozen_left_out += m.groups[g].params.size();
      continue;
    }
    for (size_t i = 0; i < m.groups[g].params.size(); ++i) {
      const CheckpointParam& p = m.groups[g].params[i];
      ExportItem it;
      it.name = p.name;
      it.dtype = dtype;
      it.shape = p.shape;
      it.numel = p.numel;
      it.bytes = p.numel * DTypeSize(out_type);
      it.group = g;
      it.param = i;
      items.push_back(std::move(it));
    }
  }
  const std::string frozen = std::string("blob:") + kSharedBlobPrefix + "module:";
  for (const CheckpointTensor& t : m.ranks[0].tensors) {
    if (t.name.rfind(frozen, 0) != 0) continue;
    ExportItem it;
    it.name = t.name.substr(frozen.size());
    it.dtype = IsFloatName(t.dtype) ? dtype : t.dtype;
    it.shape = t.shape;
    it.numel = t.numel;
    it.bytes = t.numel * CheckpointDTypeSize(it.dtype);
    it.blob = &t;
    items.push_back(std::move(it));
  }
  for (const ExportItem& it : items) {
    if (!names.insert(it.name).second) {
      return InvalidArgumentError("export: two tensors are named " + it.name);
    }
  }
  for (const CheckpointRankPart& part : m.ranks) {
    STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *part.Find(kStateTensors[0])));
    if (const CheckpointTensor* t = part.Find(kFrozenTensor); t != nullptr) {
      STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *t));
    }
  }
  for (const ExportItem& it : items)
    if (it.blob != nullptr)
      STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, m.ranks[0], *it.blob));

  // The header: names, dtypes, shapes, offsets; padded with spaces to 8 bytes.
  Json header = Json::object();
  header["__metadata__"] = {{"format", "pt"}, {"source", "strata checkpoint " + m.tag}};
  uint64_t at = 0;
  for (const ExportItem& it : items) {
    header[it.name] = {
        {"dtype", it.dtype}, {"shape", it.shape}, {"data_offsets", {at, at + it.bytes}}};
    at += it.bytes;
    stats.largest_tensor_bytes = std::max(stats.largest_tensor_bytes, it.bytes);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  stats.tensors = items.size();
  stats.bytes_written = 8 + text.size() + at;

  std::vector<uint64_t> shard_offset;
  uint64_t so = 0;
  for (const CheckpointGroup& g : m.groups) {
    shard_offset.push_back(so);
    so += g.shard_numel;
  }
  std::map<int, int> fds;
  auto fd_of = [&](int q) -> Result<int> {
    if (const auto f = fds.find(q); f != fds.end()) return f->second;
    const std::string path = tag_dir + "/" + m.ranks[static_cast<size_t>(q)].file;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "opening " + path);
    fds[q] = fd;
    return fd;
  };
  const std::string tmp = out + ".tmp";
  auto write = [&]() -> Status {
    if (Exists(tmp) && ::unlink(tmp.c_str()) != 0) return ErrnoError(errno, "removing " + tmp);
    FileWriter w;
    STRATA_RETURN_IF_ERROR(w.Open(tmp));
    uint8_t size_le[8];
    for (int b = 0; b < 8; ++b)
      size_le[b] = static_cast<uint8_t>((text.size() >> (8 * b)) & 0xff);
    STRATA_RETURN_IF_ERROR(w.Write(size_le, 8));
    STRATA_RETURN_IF_ERROR(w.Write(text.data(), text.size()));
    std::vector<float> values;
    std::vector<std::byte> raw, converted;
    for (const ExportItem& it : items) {
      for (uint64_t done = 0; done < it.numel;) {
        const uint64_t count = std::min<uint64_t>(kPieceFloats, it.numel - done);
        if (it.blob == nullptr) {
          values.assign(count, 0.0f);
          const CheckpointGroup& g = m.groups[it.group];
          const uint64_t first = g.params[it.param].offset + done;
          for (uint64_t e = first; e < first + count;) {
            const uint64_t q = e / g.shard_numel;
            const uint64_t within = e - q * g.shard_numel;
            const uint64_t n = std::min(first + count - e, g.shard_numel - within);
            const CheckpointRankPart& part = m.ranks[q];
            STRATA_ASSIGN_OR_RETURN(const int fd, fd_of(static_cast<int>(q)));
            STRATA_RETURN_IF_ERROR(ReadSavedValues(
                fd, m, part, it.group, shard_offset[it.group] + within, n,
                values.data() + (e - first), raw, "checkpoint " + m.tag + ", file " + part.file));
            e += n;
          }
        } else {
          const uint64_t esize = CheckpointDTypeSize(it.blob->dtype);
          raw.resize(count * esize);
          STRATA_ASSIGN_OR_RETURN(const int fd, fd_of(0));
          STRATA_RETURN_IF_ERROR(ReadExactly(fd, raw.data(), raw.size(),
                                             it.blob->offset + done * esize,
                                             "checkpoint " + m.tag + ", file " + m.ranks[0].file));
          if (!IsFloatName(it.blob->dtype)) {
            STRATA_RETURN_IF_ERROR(w.Write(raw.data(), raw.size()));
            done += count;
            continue;
          }
          values.resize(count);
          ToFloat(raw.data(), it.blob->dtype, count, values.data());
        }
        converted.resize(count * DTypeSize(out_type));
        ConvertFromFloat(values.data(), count, converted.data(), out_type);
        STRATA_RETURN_IF_ERROR(w.Write(converted.data(), converted.size()));
        done += count;
      }
    }
    STRATA_RETURN_IF_ERROR(w.Sync());
    STRATA_RETURN_IF_ERROR(w.Close());
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + tmp + " to " + out);
    }
    return Status::Ok();
  };
  const Status written = write();
  for (const auto& [q, fd] : fds)
    ::close(fd);
  if (!written.ok()) {
    ::unlink(tmp.c_str());
    return written;
  }
  return stats;
}

// ---------------------------------------------------------------------------
// EngineCore's calls.

namespace {

// Why a checkpoint cannot be taken or loaded now (every rank sees the same).
Status AtStepBoundary(bool backward_since_step, bool reducer_pending, int64_t micro_steps,
                      int64_t accumulation, const char* what) {
  if (backward_since_step || reducer_pending || micro_steps % accumulation != 0) {
    return FailedPreconditionError(std::string(what) +
                                   " between a backward and its step: call it before "
                                   "training or right after step()");
  }
  return Status::Ok();
}

// The crash points of a test save.
void MaybeCrash(const std::string& crash_at, const char* point) {
  if (crash_at == point) ::_exit(9);
}

// This rank's partial fingerprints of the frozen groups (FrozenFingerprintTerm; index
// g - num_trainable, 0 where it holds none of the group's parameters), the values rounded to
// `as` (the checkpoint's dtype) first. One read of the frozen shards, on CPU-Adam's threads.
Result<std::vector<uint64_t>> FrozenFingerprintPartials(const ModelPartition& partition,
                                                        WorkingShards& shards, DType as,
                                                        const CpuAdam& adam) {
  const int first = partition.num_trainable;
  const DType dtype = shards.dtype();
  const size_t elem = DTypeSize(dtype);
  // Working values are exact in their own dtype and in fp32.
  const std::optional<DType> round_to =
      as != DType::kFloat32 && as != dtype ? std::optional<DType>(as) : std::nullopt;
  std::vector<uint64_t> out(partition.groups.size() - static_cast<size_t>(first), 0);
  for (int g = first; g < static_cast<int>(partition.groups.size()); ++g) {
    if (!shards.has(g)) continue;
    const GroupLayout& l = partition.groups[static_cast<size_t>(g)];
    const uint64_t s0 = l.shard_begin(partition.rank);
    // The parameters' elements in the shard, as ranges of the shard (padding left out).
    std::vector<std::pair<uint64_t, uint64_t>> runs;
    for (const ParamSlot& p : l.params) {
      const uint64_t b = std::max<uint64_t>(p.offset, s0);
      const uint64_t e = std::min<uint64_t>(p.offset + p.numel, s0 + l.shard_numel);
      if (b < e) runs.emplace_back(b - s0, e - s0);
    }
    if (runs.empty()) continue;
    STRATA_ASSIGN_OR_RETURN(offload::StateLease lease, shards.Acquire(g, offload::Access::kRead));
    const std::byte* data = lease.data();
    std::atomic<uint64_t> sum{0};
    adam.ForEachTile(l.shard_numel, [&](size_t tb, size_t te) {
      constexpr size_t kBlock = 1024;
      float values[kBlock];
      uint64_t local = 0;  // mod 2^64, as the sum of the ranks' partials
      for (const auto& [rb, re] : runs) {
        const uint64_t end = std::min<uint64_t>(re, te);
        for (uint64_t at = std::max<uint64_t>(rb, tb); at < end; at += kBlock) {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(kBlock, end - at));
          ConvertToFloat(data + at * elem, dtype, n, values);
          local += FrozenFingerprintSum(std::span<float>(values, n), s0 + at, round_to);
        }
      }
      sum.fetch_add(local, std::memory_order_relaxed);
    });
    out[static_cast<size_t>(g - first)] = sum.load();
    STRATA_RETURN_IF_ERROR(lease.Release());
  }
  return out;
}

}  // namespace

Result<std::string> EngineCore::SaveCheckpoint(const SaveCheckpointOptions& o) {
  STRATA_RETURN_IF_ERROR(AtStepBoundary(backward_since_step_ || early_open(), reducer_->pending(),
                                        micro_steps_, config_.gradient_accumulation_steps,
                                        "saving a checkpoint"));
  STRATA_RETURN_IF_ERROR(JoinStep());
  const std::string tag = o.tag.empty() ? "global_step" + std::to_string(global_steps_) : o.tag;
  STRATA_RETURN_IF_ERROR(CheckTag(tag));
  if (o.dir.empty()) return InvalidArgumentError("save_checkpoint: the save directory is empty");
  if (!o.crash_at.empty()) {
    const auto& points = CheckpointCrashPoints();
    if (std::find(points.begin(), points.end(), o.crash_at) == points.end()) {
      return InvalidArgumentError("save_checkpoint: unknown crash point '" + o.crash_at + "'");
    }
  }
  if (!o.param_shapes.empty()) {
    bool fits = o.param_shapes.size() == partition_.groups.size();
    for (size_t g = 0; fits && g < o.param_shapes.size(); ++g) {
      const GroupLayout& l = partition_.groups[g];
      fits = o.param_shapes[g].size() == l.params.size();
      for (size_t i = 0; fits && i < l.params.size(); ++i) {
        uint64_t n = 1;
        for (const int64_t d : o.param_shapes[g][i])
          n *= d < 0 ? 0 : static_cast<uint64_t>(d);
        fits = n == l.params[i].numel;
      }
    }
    if (!fits) {
      return InvalidArgumentError(
          "save_checkpoint: param_shapes do not describe the engine's parameters");
    }
  }
  for (const CheckpointBlob& b : o.blobs) {
    if (b.name.empty() || b.name.size() > 1000) {
      return InvalidArgumentError("save_checkpoint: a blob name must have 1 to 1000 characters");
    }
    const uint64_t elem = CheckpointDTypeSize(b.dtype);
    uint64_t numel = b.shape.empty() ? b.bytes.size() : 1;
    for (const uint64_t d : b.shape)
      numel *= d;
    if (elem == 0 || numel * elem != b.bytes.size()) {
      return InvalidArgumentError("save_checkpoint: blob " + b.name + " of dtype " + b.dtype +
                                  " holds " + std::to_string(b.bytes.size()) +
                                  " bytes, which its shape does not describe");
    }
  }
  const std::string dir = o.dir;
  const std::string tmp = dir + "/.tmp-" + tag;
  const std::string final_dir = dir + "/" + tag;
  const std::string what = "saving checkpoint " + tag + " in " + dir;
  const int rank = partition_.rank;
  const int world = partition_.world_size;
  // Format 1 without frozen groups; with them, format 2: their values in the tensor "frozen"
  // (in the working dtype: exact, 2 bytes per parameter in bf16 and fp16), or left out.
  const bool has_frozen = partition_.num_trainable < num_groups();
  const bool exclude_frozen = o.exclude_frozen_parameters && has_frozen;
  const bool format_1 = !has_frozen || o.test_format_1;
  if (o.test_format_1 && exclude_frozen) {
    return InvalidArgumentError("save_checkpoint: format 1 cannot leave the frozen values out");
  }

  // 1. Rank 0 makes the directory and an empty .tmp-<tag> (a stale one from a save that
  //    crashed is removed).
  Status prep;
  if (rank == 0) {
    prep = MakeDirs(dir);
    if (prep.ok() && Exists(final_dir)) {
      prep = AlreadyExistsError("checkpoint " + final_dir +
                                " already exists: choose another tag or remove it");
    }
    if (prep.ok()) prep = RemoveTree(tmp);
    if (prep.ok() && ::mkdir(tmp.c_str(), 0755) != 0) prep = ErrnoError(errno, "creating " + tmp);
  }
  {
    STRATA_ASSIGN_OR_RETURN(Outcomes agreed,
                            AgreeOnOutcomes(*host_comm_, prep, {}, 4096).WithContext(what));
    if (agreed.any_failed) {
      return Status(agreed.code, OutcomeStatus(agreed, what).message() +
                                     "; the previous checkpoints are unchanged");
    }
  }

  // 2. Every rank writes its file (the CRCs computed from the states as they are written),
  //    fsyncs it (verify_read_back: reads it back against the CRCs), and writes its part
  //    of the manifest.
  auto write_part = [&]() -> Status {
    if (!Exists(tmp)) {
      return FailedPreconditionError("save_dir " + dir +
                                     " is not one filesystem for every rank: "
                                     "rank " +
                                     std::to_string(rank) + " cannot see " + tmp +
                                     ", which rank 0 created; put save_dir on a filesystem "
                                     "every rank sees");
    }
    CheckpointRankPart part;
    part.rank = rank;
    part.file = RankFileName(rank);
    const std::string path = tmp + "/" + part.file;
    RankFileWriter w;
    STRATA_RETURN_IF_ERROR(w.Open(path, !o.test_buffered_writes));
    for (int k = 0; k < 3; ++k) {
      // The master, m and v cover the trainable groups (format 1: the master is followed by
      // the frozen groups' working values, as fp32).
      const size_t n = k == 0 && format_1 ? partition_.partition_numel : trainable_.partition_numel;
      STRATA_RETURN_IF_ERROR(w.PadTo(kAlign));
      CheckpointTensor t{kStateTensors[k], "F32", {n}, n, w.offset(), uint64_t{n} * 4, 0};
      // Straight from the store's chunks, in pieces whose write-back starts at once.
      const Status visited =
          driver_->VisitState(kStates[k], [&](size_t, std::span<const float> chunk) -> Status {
            for (size_t at = 0; at < chunk.size(); at += kPieceFloats) {
              const std::span<const std::byte> bytes =
                  std::as_bytes(chunk.subspan(at, std::min(kPieceFloats, chunk.size() - at)));
              STRATA_RETURN_IF_ERROR(w.Write(bytes.data(), bytes.size(), &t.crc32c));
              w.StartWriteBack();
            }
            return Status::Ok();
          });
      STRATA_RETURN_IF_ERROR(visited);
      for (int g = partition_.num_trainable; k == 0 && format_1 && g < num_groups(); ++g) {
        if (!shards_->has(g)) continue;
        std::vector<float> values(layout(g).shard_numel);
        {
          STRATA_ASSIGN_OR_RETURN(offload::StateLease l,
                                  shards_->Acquire(g, offload::Access::kRead));
          ConvertToFloat(l.data(), dtype_, values.size(), values.data());
          STRATA_RETURN_IF_ERROR(l.Release());
        }
        const std::span<const std::byte> bytes = std::as_bytes(std::span<const float>(values));
        STRATA_RETURN_IF_ERROR(w.Write(bytes.data(), bytes.size(), &t.crc32c));
        w.StartWriteBack();
      }
      part.tensors.push_back(std::move(t));
    }
    if (!format_1 && !exclude_frozen) {
      // The frozen groups' working shards as they are (no conversion).
      const size_t n = partition_.partition_numel - trainable_.partition_numel;
      const size_t elem = DTypeSize(dtype_);
      STRATA_RETURN_IF_ERROR(w.PadTo(kAlign));
      CheckpointTensor t{kFrozenTensor, SafetensorsName(dtype_), {n}, n, w.offset(), n * elem, 0};
      for (int g = partition_.num_trainable; g < num_groups(); ++g) {
        if (!shards_->has(g)) continue;
        STRATA_ASSIGN_OR_RETURN(offload::StateLease l, shards_->Acquire(g, offload::Access::kRead));
        STRATA_RETURN_IF_ERROR(w.Write(l.data(), shards_->bytes(g), &t.crc32c));
        STRATA_RETURN_IF_ERROR(l.Release());
        w.StartWriteBack();
      }
      part.tensors.push_back(std::move(t));
    }
    // Left out: the fingerprints of the base instead (rank 0 adds the ranks' partial sums).
    std::vector<uint64_t> fingerprints;
    if (exclude_frozen) {
      STRATA_ASSIGN_OR_RETURN(fingerprints,
                              FrozenFingerprintPartials(partition_, *shards_, dtype_, *cpu_adam_));
    }
    for (const CheckpointBlob& b : o.blobs) {
      if (rank != 0 && b.name.rfind(kSharedBlobPrefix, 0) == 0) continue;  // rank 0's is kept
      STRATA_RETURN_IF_ERROR(w.PadTo(kAlign));
      CheckpointTensor t;
      t.name = "blob:" + b.name;
      t.dtype = b.dtype;
      t.shape = b.shape.empty() ? std::vector<uint64_t>{b.bytes.size()} : b.shape;
      t.numel = b.bytes.size() / CheckpointDTypeSize(b.dtype);
      t.offset = w.offset();
      t.bytes = b.bytes.size();
      t.crc32c = swap::Crc32c(b.bytes);
      STRATA_RETURN_IF_ERROR(w.Write(b.bytes.data(), b.bytes.size()));
      part.tensors.push_back(std::move(t));
    }
    part.file_bytes = w.offset();
    MaybeCrash(o.crash_at, "rank_file_written");
    STRATA_RETURN_IF_ERROR(w.Sync());
    STRATA_RETURN_IF_ERROR(w.Close());
    MaybeCrash(o.crash_at, "rank_file_synced");
    if (o.verify_read_back) {
      CheckpointManifest self;
      self.tag = tag;
      for (const CheckpointTensor& t : part.tensors)
        STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tmp, self, part, t));
    }
    Json part_json = PartJson(part);
    if (exclude_frozen) {
      Json partials = Json::array();
      for (const uint64_t v : fingerprints)
        partials.push_back(FingerprintHex(v));
      part_json[kPartFingerprints] = std::move(partials);
    }
    STRATA_RETURN_IF_ERROR(
        WriteSmallFile(tmp + "/" + PartFileName(rank), part_json.dump(), /*sync=*/true));
    MaybeCrash(o.crash_at, "part_written");
    return Status::Ok();
  };
  const Status written = write_part();
  {
    STRATA_ASSIGN_OR_RETURN(Outcomes agreed,
                            AgreeOnOutcomes(*host_comm_, written, {}, 4096).WithContext(what));
    if (agreed.any_failed) {
      if (rank == 0) {
        const Status removed = RemoveTree(tmp);
        if (!removed.ok()) STRATA_LOG(kWarn) << "after a failed save: " << removed;
      }
      return Status(agreed.code, OutcomeStatus(agreed, what).message() +
                                     "; the partial save was removed, the previous checkpoints "
                                     "are unchanged");
    }
  }

  // 3. Rank 0 collects the parts, writes the manifest and publishes the tag.
  auto publish = [&]() -> Status {
    Json ranks = Json::array();
    std::vector<uint64_t> fingerprint_sums(
        exclude_frozen ? partition_.groups.size() - static_cast<size_t>(partition_.num_trainable)
                       : 0,
        0);
    for (int q = 0; q < world; ++q) {
      const std::string part_path = tmp + "/" + PartFileName(q);
      if (!Exists(part_path)) {
        return FailedPreconditionError("save_dir " + dir +
                                       " is not one filesystem for every "
                                       "rank: rank 0 cannot see rank " +
                                       std::to_string(q) + "'s part " + part_path +
                                       "; put save_dir on a filesystem every rank sees");
      }
      STRATA_ASSIGN_OR_RETURN(Json pj, ReadJsonFile(part_path, StatusCode::kDataLoss));
      if (exclude_frozen) {
        // The rank's partial fingerprints (mod 2^64), added; not kept in its part.
        const Json* partials = pj.contains(kPartFingerprints) ? &pj[kPartFingerprints] : nullptr;
        if (partials == nullptr || !partials->is_array() ||
            partials->size() != fingerprint_sums.size()) {
          return DataLossError(part_path + ": the frozen groups' fingerprints are missing");
        }
        for (size_t i = 0; i < fingerprint_sums.size(); ++i) {
          const std::optional<uint64_t> v =
              (*partials)[i].is_string() ? ParseFingerprintHex((*partials)[i].get<std::string>())
                                         : std::nullopt;
          if (!v) return DataLossError(part_path + ": a frozen group's fingerprint is damaged");
          fingerprint_sums[i] += *v;
        }
        pj.erase(kPartFingerprints);
      }
      ranks.push_back(std::move(pj));
    }
    const LossScaler::State ls = scaler_.state();
    Json groups = Json::array();
    for (size_t gi = 0; gi < partition_.groups.size(); ++gi) {
      const GroupLayout& g = partition_.groups[gi];
      Json params = Json::array();
      for (size_t i = 0; i < g.params.size(); ++i) {
        const ParamSlot& p = g.params[i];
        const Json shape =
            o.param_shapes.empty() ? Json::array({p.numel}) : Json(o.param_shapes[gi][i]);
        params.push_back(
            Json{{"name", p.name}, {"shape", shape}, {"numel", p.numel}, {"offset", p.offset}});
      }
      Json gj{{"name", g.name},
              {"used_numel", g.used_numel},
              {"shard_numel", g.shard_numel},
              {"params", std::move(params)}};
      if (partition_.frozen(static_cast<int>(gi))) {
        gj["frozen"] = true;
        if (exclude_frozen) {
          gj["frozen_fingerprint"] =
              FingerprintHex(fingerprint_sums[gi - static_cast<size_t>(partition_.num_trainable)]);
        }
      }
      groups.push_back(std::move(gj));
    }
    Json m{{"format", kFormatName},
           {"version", format_1 ? 1 : 2},
           {"tag", tag},
           {"world_size", world},
           {"dtype", std::string(DTypeName(dtype_))},
           {"global_steps", global_steps_},
           {"micro_steps", micro_steps_},
           {"adam_step", driver_->adam_step()},
           {"lr_iteration", lr_iteration_},
           {"loss_scaler",
            {{"enabled", scaler_.enabled()},
             {"scale", ls.scale},
             {"hysteresis_left", ls.hysteresis_left},
             {"iteration", ls.iteration},
             {"last_overflow_iteration", ls.last_overflow_iteration},
             {"skipped_steps", ls.skipped_steps}}},
           {"config", config_.normalized},
           {"frozen_parameters_saved", !exclude_frozen},
           {"groups", std::move(groups)},
           {"ranks", std::move(ranks)}};
    const std::string manifest = tmp + "/manifest.json";
    STRATA_RETURN_IF_ERROR(WriteSmallFile(manifest, m.dump(1), /*sync=*/true,
                                          [&] { MaybeCrash(o.crash_at, "manifest_written"); }));
    MaybeCrash(o.crash_at, "manifest_synced");
    for (int q = 0; q < world; ++q) {
      const std::string part_path = tmp + "/" + PartFileName(q);
      if (::unlink(part_path.c_str()) != 0) return ErrnoError(errno, "removing " + part_path);
    }
    MaybeCrash(o.crash_at, "parts_removed");
    STRATA_RETURN_IF_ERROR(FsyncPath(tmp));
    MaybeCrash(o.crash_at, "tmp_dir_synced");
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + tmp + " to " + final_dir);
    }
    MaybeCrash(o.crash_at, "tag_renamed");
    STRATA_RETURN_IF_ERROR(FsyncPath(dir));
    MaybeCrash(o.crash_at, "save_dir_synced");
    const std::string latest_tmp = dir + "/latest.tmp";
    if (Exists(latest_tmp) && ::unlink(latest_tmp.c_str()) != 0) {
      return ErrnoError(errno, "removing the stale " + latest_tmp);
    }
    STRATA_RETURN_IF_ERROR(WriteSmallFile(latest_tmp, tag + "\n", /*sync=*/true,
                                          [&] { MaybeCrash(o.crash_at, "latest_written"); }));
    MaybeCrash(o.crash_at, "latest_synced");
    const std::string latest = dir + "/latest";
    if (::rename(latest_tmp.c_str(), latest.c_str()) != 0) {
      return ErrnoError(errno, "renaming " + latest_tmp + " to " + latest);
    }
    MaybeCrash(o.crash_at, "latest_renamed");
    return FsyncPath(dir);
  };
  Status published = rank == 0 ? publish() : Status::Ok();
  if (!published.ok() && rank == 0 && Exists(tmp)) {
    const Status removed = RemoveTree(tmp);
    if (!removed.ok()) STRATA_LOG(kWarn) << "after a failed save: " << removed;
  }
  STRATA_ASSIGN_OR_RETURN(Outcomes agreed,
                          AgreeOnOutcomes(*host_comm_, published, {}, 4096).WithContext(what));
  if (agreed.any_failed) return Status(agreed.code, OutcomeStatus(agreed, what).message());
  return final_dir;
}

namespace {

// Where the saved elements [first, first + count) of group g's flat buffer are: pieces of
// the saving ranks' partitions.
struct SavedPiece {
  int rank;
  uint64_t partition_offset;  // in that rank's partition (elements)
  uint64_t count;
  uint64_t flat_offset;  // in the group's flat buffer
};

std::vector<SavedPiece> SavedPieces(const CheckpointManifest& m,
                                    const std::vector<uint64_t>& saved_shard_offset, size_t g,
                                    uint64_t first, uint64_t count) {
  std::vector<SavedPiece> pieces;
  const CheckpointGroup& group = m.groups[g];
  const uint64_t end = std::min(first + count, group.used_numel);
  for (uint64_t e = first; e < end;) {
    const uint64_t q = e / group.shard_numel;
    const uint64_t within = e - q * group.shard_numel;
    const uint64_t n = std::min(end - e, group.shard_numel - within);
    pieces.push_back(SavedPiece{static_cast<int>(q), saved_shard_offset[g] + within, n, e});
    e += n;
  }
  return pieces;
}

// The blobs rank `rank` loads, with the saving rank whose file holds each: that of saving
// rank rank % W (not shared), and rank 0's shared ones.
std::vector<std::pair<int, const CheckpointTensor*>> BlobsFor(const CheckpointManifest& m,
                                                              int rank) {
  std::vector<std::pair<int, const CheckpointTensor*>> out;
  const std::string shared = std::string("blob:") + kSharedBlobPrefix;
  const int own = rank % m.world_size;
  for (const CheckpointTensor& t : m.ranks[static_cast<size_t>(own)].tensors)
    if (t.name.rfind("blob:", 0) == 0 && t.name.rfind(shared, 0) != 0) out.emplace_back(own, &t);
  for (const CheckpointTensor& t : m.ranks[0].tensors)
    if (t.name.rfind(shared, 0) == 0) out.emplace_back(0, &t);
  return out;
}

// The model against the manifest: InvalidArgument listing what differs.
Status MatchModel(const ModelPartition& partition, const CheckpointManifest& m,
                  const std::string& tag_dir) {
  std::map<std::string, std::pair<uint64_t, uint64_t>> saved;  // group/param -> numel, offset
  std::map<std::string, std::pair<uint64_t, uint64_t>> model;
  for (const CheckpointGroup& g : m.groups)
    for (const CheckpointParam& p : g.params)
      saved[g.name + "/" + p.name] = {p.numel, p.offset};
  for (const GroupLayout& g : partition.groups)
    for (const ParamSlot& p : g.params)
      model[g.name + "/" + p.name] = {p.numel, p.offset};
  std::vector<std::string> missing, extra, mismatched;
  for (const auto& [name, v] : model) {
    const auto it = saved.find(name);
    if (it == saved.end()) {
      missing.push_back(name);
    } else if (it->second.first != v.first) {
      mismatched.push_back(name + " (checkpoint " + std::to_string(it->second.first) +
                           " elements, model " + std::to_string(v.first) + ")");
    }
  }
  for (const auto& [name, v] : saved)
    if (!model.count(name)) extra.push_back(name);
  bool layout_differs = m.groups.size() != partition.groups.size();
  for (size_t g = 0; !layout_differs && g < m.groups.size(); ++g) {
    const CheckpointGroup& cg = m.groups[g];
    const GroupLayout& mg = partition.groups[g];
    layout_differs = cg.name != mg.name || cg.params.size() != mg.params.size() ||
                     cg.used_numel != mg.used_numel;
    for (size_t i = 0; !layout_differs && i < cg.params.size(); ++i) {
      layout_differs = cg.params[i].name != mg.params[i].name ||
                       cg.params[i].offset != mg.params[i].offset ||
                       cg.params[i].numel != mg.params[i].numel;
    }
  }
  std::vector<std::string> frozen_differs;
  for (size_t g = 0; !layout_differs && g < m.groups.size(); ++g) {
    if (m.groups[g].frozen != partition.frozen(static_cast<int>(g))) {
      frozen_differs.push_back(m.groups[g].name + (m.groups[g].frozen
                                                       ? " (frozen in the checkpoint)"
                                                       : " (frozen in the model)"));
    }
  }
  if (missing.empty() && extra.empty() && mismatched.empty() && !layout_differs) {
    if (frozen_differs.empty()) return Status::Ok();
    std::string msg =
        "checkpoint " + tag_dir + " froze other parameters than the model does: groups ";
    for (size_t i = 0; i < frozen_differs.size() && i < 20; ++i)
      msg += (i ? ", " : "") + frozen_differs[i];
    return InvalidArgumentError(msg +
                                "; to start from its weights with other parameters frozen, "
                                "export them (strata-ckpt export) and load_safetensors");
  }
  auto list = [](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return std::string();
    std::string s = std::string("; ") + what + " (" + std::to_string(names.size()) + "): ";
    for (size_t i = 0; i < names.size() && i < 20; ++i)
      s += (i ? ", " : "") + names[i];
    if (names.size() > 20) s += ", ...";
    return s;
  };
  std::string msg = "checkpoint " + tag_dir + " is of another model" +
                    list("missing from the checkpoint", missing) +
                    list("in the checkpoint but not the model", extra) +
                    list("of another size", mismatched);
  if (missing.empty() && extra.empty() && mismatched.empty()) {
    msg += ": the same parameters in other groups, another order or another alignment";
  }
  return InvalidArgumentError(msg);
}

}  // namespace

Result<LoadedCheckpoint> EngineCore::LoadCheckpoint(const LoadCheckpointOptions& o) {
  STRATA_RETURN_IF_ERROR(AtStepBoundary(backward_since_step_ || early_open(), reducer_->pending(),
                                        micro_steps_, config_.gradient_accumulation_steps,
                                        "loading a checkpoint"));
  STRATA_RETURN_IF_ERROR(JoinStep());
  if (o.dir.empty()) return InvalidArgumentError("load_checkpoint: the directory is empty");
  const int rank = partition_.rank;
  const bool states = o.load_optimizer_states && !o.load_module_only;

  // Rank 0 resolves the tag (`latest` may move while the ranks read it) and sends it.
  std::string tag;
  {
    Status resolved;
    if (rank == 0) {
      Result<std::string> t = ResolveCheckpointTag(o.dir, o.tag);
      if (t.ok()) {
        tag = *t;
      } else {
        resolved = t.status();
      }
    }
    STRATA_ASSIGN_OR_RETURN(Outcomes agreed, AgreeOnOutcomes(*host_comm_, resolved, {}, 4096));
    if (agreed.any_failed) {
      return Status(agreed.code,
                    OutcomeStatus(agreed, "loading a checkpoint from " + o.dir).message() +
                        "; nothing was changed");
    }
    std::vector<int64_t> words(32, 0);  // 256 bytes: CheckTag's 200 characters fit
    if (rank == 0) std::memcpy(words.data(), tag.data(), tag.size());
    STRATA_RETURN_IF_ERROR(
        host_comm_->Broadcast(words.data(), words.size(), comm::DType::kInt64, 0));
    tag.assign(reinterpret_cast<const char*>(words.data()),
               strnlen(reinterpret_cast<const char*>(words.data()), 256));
  }
  const std::string tag_dir = o.dir + "/" + tag;

  // Every rank checks what it will read before anything changes.
  CheckpointManifest m;
  std::vector<uint64_t> saved_shard_offset;
  std::set<int> sources;  // the saving ranks this rank reads from
  // Saved without the frozen values, with their fingerprints: the model's partial sums.
  bool fingerprinted = false;
  std::vector<uint64_t> fingerprints(static_cast<size_t>(num_groups() - partition_.num_trainable),
                                     0);
  auto check = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(m, ReadCheckpointManifest(tag_dir));
    STRATA_RETURN_IF_ERROR(MatchModel(partition_, m, tag_dir));
    for (const CheckpointGroup& g : m.groups)
      fingerprinted = fingerprinted || g.has_fingerprint;
    if (fingerprinted && o.check_frozen_parameters) {
      STRATA_ASSIGN_OR_RETURN(fingerprints, FrozenFingerprintPartials(partition_, *shards_,
                                                                      m.working_dtype, *cpu_adam_));
    }
    uint64_t at = 0;
    for (const CheckpointGroup& g : m.groups) {
      saved_shard_offset.push_back(at);
      at += g.shard_numel;
    }
    for (int g = 0; g < num_groups(); ++g) {
      const GroupLayout& l = layout(g);
      for (const SavedPiece& p : SavedPieces(m, saved_shard_offset, static_cast<size_t>(g),
                                             l.shard_begin(rank), l.shard_numel))
        sources.insert(p.rank);
    }
    for (const int q : sources) {
      const CheckpointRankPart& part = m.ranks[static_cast<size_t>(q)];
      for (const char* name : kStateTensors) {
        if (!states && name != kStateTensors[0]) continue;
        STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *part.Find(name)));
      }
      if (const CheckpointTensor* t = part.Find(kFrozenTensor); t != nullptr) {
        STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *t));
      }
    }
    std::vector<CheckpointTensor> blobs;
    for (const auto& [q, t] : BlobsFor(m, rank)) {
      STRATA_RETURN_IF_ERROR(
          VerifyCheckpointTensor(tag_dir, m, m.ranks[static_cast<size_t>(q)], *t));
      blobs.push_back(*t);
      blobs.back().name = blob::CurrentName(t->name.substr(5));
      sources.insert(q);
    }
    if (o.check_blobs) STRATA_RETURN_IF_ERROR(o.check_blobs(blobs));
    return Status::Ok();
  };
  const Status local_check = check();
  STRATA_ASSIGN_OR_RETURN(Outcomes checked,
                          AgreeOnOutcomes(*host_comm_, local_check, {}, size_t{16} << 10));
  // As in LoadParameters: the pass ends here on every rank, whatever the outcome.
  STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  if (checked.any_failed) {
    STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
    return Status(checked.code, OutcomeStatus(checked, "checking checkpoint " + tag_dir).message() +
                                    "; nothing was changed");
  }
  // The model's frozen base against the saving run's (the same manifest on every rank, so the
  // same decision): the ranks' partial sums gathered and added mod 2^64, with the ranks that
  // asked for the check counted.
  bool base_checked = false;
  if (fingerprinted) {
    const size_t nf = fingerprints.size();
    const size_t world = static_cast<size_t>(partition_.world_size);
    std::vector<int64_t> mine(nf + 1, 0), all((nf + 1) * world, 0);
    for (size_t i = 0; i < nf; ++i)
      mine[i] = static_cast<int64_t>(fingerprints[i]);
    mine[nf] = o.check_frozen_parameters ? 1 : 0;
    STRATA_RETURN_IF_ERROR(
        host_comm_->AllGather(mine.data(), all.data(), all.size(), comm::DType::kInt64));
    std::vector<uint64_t> sums(nf, 0);
    int64_t checking = 0;
    for (size_t q = 0; q < world; ++q) {
      for (size_t i = 0; i < nf; ++i)
        sums[i] += static_cast<uint64_t>(all[q * (nf + 1) + i]);
      checking += all[q * (nf + 1) + nf];
    }
    std::string refused;
    if (checking != 0 && checking != partition_.world_size) {
      refused = std::to_string(checking) + " of " + std::to_string(partition_.world_size) +
                " ranks passed check_frozen_parameters true: pass the same on every rank";
    } else if (checking != 0) {
      std::vector<std::string> differ;
      for (size_t i = 0; i < nf; ++i) {
        const CheckpointGroup& g = m.groups[static_cast<size_t>(partition_.num_trainable) + i];
        if (g.has_fingerprint && sums[i] != g.frozen_fingerprint) differ.push_back(g.name);
      }
      if (differ.empty()) {
        base_checked = true;
      } else {
        refused =
            "it was saved without its frozen values, and the model's frozen values are "
            "not the base it was trained on (the fingerprints of " +
            std::to_string(differ.size()) + " of " + std::to_string(nf) + " frozen groups differ: ";
        for (size_t i = 0; i < differ.size() && i < 20; ++i)
          refused += (i ? ", " : "") + differ[i];
        if (differ.size() > 20) refused += ", ...";
        refused +=
            "); build the model with the saving run's base weights (the same "
            "pretrained model, or load_safetensors) before loading, or pass "
            "check_frozen_parameters=false to load it onto this base";
      }
    }
    if (!refused.empty()) {
      STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
      return InvalidArgumentError("checking checkpoint " + tag_dir + ": " + refused +
                                  "; nothing was changed");
    }
  }

  // The states: each of this rank's shards, read from the saving ranks' files.
  LoadedCheckpoint out;
  out.path = tag_dir;
  out.tag = tag;
  out.saved_world_size = m.world_size;
  out.global_steps = m.global_steps;
  out.frozen_parameters_loaded = m.frozen_saved || partition_.num_trainable == num_groups();
  out.frozen_base_checked = base_checked;
  std::map<int, int> fds;
  auto load = [&]() -> Status {
    for (const int q : sources) {
      const std::string path = tag_dir + "/" + m.ranks[static_cast<size_t>(q)].file;
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return ErrnoError(errno, "checkpoint " + tag + ": opening " + path);
      fds[q] = fd;
    }
    std::vector<float> buf;
    std::vector<std::byte> raw;
    for (int k = 0; k < 3; ++k) {
      if (k > 0 && !states && o.load_module_only) break;  // m, v left as they are
      const bool zeros = k > 0 && !states;                // a fresh optimizer
      // m and v: the trainable groups only (frozen groups have none); with the master the
      // frozen groups' values (from fp32_master in format 1, "frozen" in format 2), unless
      // the save left them out (the model's are kept).
      const int groups = k == 0 && m.frozen_saved ? num_groups() : partition_.num_trainable;
      for (int g = 0; g < groups; ++g) {
        const GroupLayout& l = layout(g);
        const size_t base = partition_.shard_offset[static_cast<size_t>(g)];
        for (uint64_t done = 0; done < l.shard_numel;) {
          const uint64_t count = std::min<uint64_t>(kPieceFloats, l.shard_numel - done);
          buf.assign(count, 0.0f);
          const uint64_t first = l.shard_begin(rank) + done;
          if (!zeros) {
            for (const SavedPiece& p :
                 SavedPieces(m, saved_shard_offset, static_cast<size_t>(g), first, count)) {
              const CheckpointRankPart& part = m.ranks[static_cast<size_t>(p.rank)];
              const std::string what = "checkpoint " + tag + ", file " + part.file;
              float* into = buf.data() + (p.flat_offset - first);
              if (k == 0) {
                // The master's values, or a frozen group's (format 2: its own tensor).
                STRATA_RETURN_IF_ERROR(ReadSavedValues(fds[p.rank], m, part, static_cast<size_t>(g),
                                                       p.partition_offset, p.count, into, raw,
                                                       what));
                continue;
              }
              const CheckpointTensor* t = part.Find(kStateTensors[k]);
              STRATA_RETURN_IF_ERROR(ReadExactly(fds[p.rank], into, p.count * 4,
                                                 t->offset + p.partition_offset * 4,
                                                 what + ", tensor " + t->name));
            }
          }
          if (frozen(g)) {
            STRATA_RETURN_IF_ERROR(WriteFrozen(g, done, buf));
          } else {
            STRATA_RETURN_IF_ERROR(driver_->WriteState(kStates[k], base + done, buf));
          }
          done += count;
        }
      }
    }
    for (const auto& [q, t] : BlobsFor(m, rank)) {
      const CheckpointRankPart& part = m.ranks[static_cast<size_t>(q)];
      CheckpointBlob b{blob::CurrentName(t->name.substr(5)), std::vector<std::byte>(t->bytes),
                       t->dtype, t->shape};
      STRATA_RETURN_IF_ERROR(
          ReadExactly(fds[q], b.bytes.data(), b.bytes.size(), t->offset,
                      "checkpoint " + tag + ", file " + part.file + ", " + t->name));
      if (swap::Crc32c(b.bytes) != t->crc32c) {
        return DataLossError("checkpoint " + tag + ", file " + part.file + ", tensor " + t->name +
                             ": CRC32C mismatch: the file changed while it was loaded");
      }
      out.blobs.push_back(std::move(b));
    }
    return Status::Ok();
  };
  const Status local = load();
  for (const auto& [q, fd] : fds)
    ::close(fd);
  const Status committed = driver_->CommitMasterAgreed(local, "loading checkpoint " + tag_dir);
  // The frozen values kept without a check are said once, never silently.
  if (committed.ok() && rank == 0 && !out.frozen_parameters_loaded && !base_checked) {
    STRATA_LOG(kWarn) << "checkpoint " << tag_dir
                      << " was saved without its frozen values; the model's own were kept "
                         "without checking that they are the base it was trained on ("
                      << (fingerprinted ? "check_frozen_parameters is false"
                                        : "it holds no fingerprint of them: saved by an older "
                                          "build")
                      << ")";
  }
  if (committed.ok() && !o.load_module_only) {
    STRATA_RETURN_IF_ERROR(driver_->set_adam_step(states ? m.adam_step : 0));
    global_steps_ = m.global_steps;
    // At a boundary of this run's accumulation (another gradient_accumulation_steps than
    // the saving run's: as many micro-steps as its global steps need).
    micro_steps_ = m.micro_steps % config_.gradient_accumulation_steps == 0
                       ? m.micro_steps
                       : m.global_steps * config_.gradient_accumulation_steps;
    if (o.load_lr_scheduler_states) {
      lr_iteration_ = m.lr_iteration;
      lr_override_.reset();
    }
    if (scaler_.enabled() && m.loss_scaler_enabled) {
      scaler_.set_state(LossScaler::State{m.loss_scale, m.hysteresis_left, m.scaler_iteration,
                                          m.last_overflow_iteration, m.skipped_steps});
    }
  }
  STRATA_RETURN_IF_ERROR(PushWorkingShards());
  STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent());
  STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
  STRATA_RETURN_IF_ERROR(committed);
  return out;
}

uint64_t FrozenFingerprintSum(std::span<float> values, uint64_t first_index,
                              std::optional<DType> round_to) {
  constexpr size_t kBlock = 1024;
  uint16_t rounded[kBlock];
  uint64_t sum = 0;
  for (size_t at = 0; at < values.size(); at += kBlock) {
    const size_t n = std::min(kBlock, values.size() - at);
    float* v = values.data() + at;
    if (round_to && *round_to != DType::kFloat32) {
      ConvertFromFloat(v, n, rounded, *round_to);
      ConvertToFloat(rounded, *round_to, n, v);
    }
    sum += BulkIndexedBitsSum(std::span<const float>(v, n), first_index + at);
  }
  return sum;
}

}  // namespace strata::engine

// The checkpoint format's shared pieces (format.h).
#include "strata/engine/checkpoint/format.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>

#include "strata/engine/checkpoint/file_read.h"
#include "strata/engine/checkpoint/files.h"
#include "strata/swap/crc32c.h"

namespace strata::engine {

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

}  // namespace strata::engine

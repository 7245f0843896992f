// The checkpoint format's pieces shared by the files of engine/checkpoint/ and the save and
// the load (engine/runtime/checkpoint_*.cc): names, constants, the JSON of a rank's part, and
// reading the saved values back. Internal to the engine (checkpoint.h is the public face).
//
// Thread-safety: functions over their arguments; constants.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/checkpoint.h"
#include "strata/engine/layout/dtype.h"

namespace strata::engine {

using Json = nlohmann::ordered_json;

inline constexpr uint64_t kAlign = 4096;
inline constexpr size_t kPieceFloats = size_t{1} << 20;   // 4 MiB of fp32 per read or write
inline constexpr size_t kStagingBytes = size_t{4} << 20;  // reading back
inline constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;
inline constexpr char kFormatName[] = "strata-checkpoint";

inline constexpr const char* kStateTensors[3] = {"fp32_master", "exp_avg", "exp_avg_sq"};
// Format 2: the frozen groups' working values, in the working dtype.
inline constexpr char kFrozenTensor[] = "frozen";
// A rank's part of a save without the frozen values: its partial fingerprints of the frozen
// groups, which rank 0 adds into the manifest's groups.
inline constexpr char kPartFingerprints[] = "frozen_fingerprint_partials";

// The working dtypes by their safetensors names (the frozen tensor's dtype, export's --dtype).
const char* SafetensorsName(DType t);
std::optional<DType> WorkingDTypeOfName(const std::string& name);
// A frozen group's fingerprint in the manifest: 16 hex digits; and back (either case).
std::string FingerprintHex(uint64_t v);
std::optional<uint64_t> ParseFingerprintHex(const std::string& text);
// rank-NNNNN.bin, a rank's file; rank-NNNNN.json, its part of the manifest while saving.
std::string RankFileName(int rank);
std::string PartFileName(int rank);
// InvalidArgument for a tag that is not a usable directory name.
Status CheckTag(const std::string& tag);
std::string TrimLine(std::string s);

// A manifest or a rank's part of one; text that is not JSON is `bad` (InvalidArgument for
// a file a user handed over, DataLoss for one this save wrote).
Result<Json> ReadJsonFile(const std::string& path, StatusCode bad);
// The tensor's bytes, read back from the open file, against its CRC.
Status VerifyTensor(int fd, const std::string& file, const std::string& tag,
                    const CheckpointTensor& t);
Json TensorJson(const CheckpointTensor& t);
Json PartJson(const CheckpointRankPart& p);

bool IsFloatName(const std::string& dtype);
// Converts n elements of a safetensors float dtype to fp32.
void ToFloat(const std::byte* src, const std::string& dtype, size_t n, float* dst);
// Reads `n` values of group `g` that saving rank `part` holds, from element `at` of its
// partition, into `out` as fp32: from fp32_master, or from the tensor "frozen" in its dtype
// (format 2, a frozen group). `raw`: scratch.
Status ReadSavedValues(int fd, const CheckpointManifest& m, const CheckpointRankPart& part,
                       size_t g, uint64_t at, uint64_t n, float* out, std::vector<std::byte>& raw,
                       const std::string& what);

}  // namespace strata::engine

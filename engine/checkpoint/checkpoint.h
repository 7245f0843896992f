// Checkpoints: the files, the manifest, and the options of
// EngineCore::SaveCheckpoint / LoadCheckpoint (implemented in engine/runtime/checkpoint_save.cc and
// checkpoint_load.cc).
//
// Layout of a save directory:
//   <dir>/<tag>/manifest.json          what is in the tag (below)
//   <dir>/<tag>/rank-00000.bin ...     one file per rank: that rank's fp32 master and
//                                      Adam m and v (its shards of the trainable groups,
//                                      engine/layout/partition.h), the frozen groups' working
//                                      values in the working dtype (unless left out),
//                                      then the front end's blobs (RNG states, client
//                                      state)
//   <dir>/latest                       the name of the last complete tag
//   <dir>/.tmp-<tag>/                  a save in progress (never read by a load)
// Every tensor starts at a 4096-byte boundary of its file; the manifest gives its name,
// dtype, shape, owner rank, byte range and CRC32C.
// The 16-bit working shards are not stored: a load rebuilds them from the master with the
// rounding the step's copy-out uses (bit-identical resume is tested), which keeps a save to
// 12 bytes per parameter.
//
// A save is atomic: every rank writes its file into <dir>/.tmp-<tag> (O_DIRECT through an
// io_uring engine, the CRCs computed as it writes) and fsyncs it; the ranks agree; rank 0
// writes the manifest, fsyncs it and the directory, renames .tmp-<tag> to <tag>, fsyncs
// <dir>, writes latest.tmp, fsyncs it and renames it to latest. A crash at any point leaves the
// previous checkpoint and `latest` as they were, or the new tag complete (`latest` then names it or
// the previous one); a tag directory without a dot never holds a partial save.
//
// A load verifies before it changes anything: each rank checks the manifest against the
// model (missing, extra and mismatched names and sizes listed) and the CRC of every tensor
// it will read, the ranks agree, and only then are the states replaced. A checkpoint saved
// on W ranks loads on W' ranks: a group's flat buffer (parameters at the same aligned
// offsets on any world size) is cut into shards again.
//
// Thread-safety: collectives over the engine's host communicator, from the engine's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/engine/checkpoint/model_writer.h"
#include "strata/engine/layout/dtype.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

// The newest manifest format version this build reads. It writes version 1 for a model
// without frozen groups, and version 2 for one with them: the frozen groups' values in a
// tensor "frozen" of the working dtype (format 1 kept them in fp32_master, as fp32), or left
// out (CheckpointSaveRequest::exclude_frozen_parameters). An older build refuses version 2
// by its number rather than misreading its shorter fp32_master.
inline constexpr int kCheckpointFormatVersion = 2;

// Bytes a front end keeps with a rank's part: opaque ("rng", "client_state": dtype U8, shape
// {bytes}) or a tensor the front end keeps whole (a frozen parameter or a buffer: its
// safetensors dtype name and shape, little-endian data), which strata-ckpt export can read.
// A blob whose name starts with kSharedBlobPrefix is the same on every rank: rank 0's is
// saved (the other ranks' are dropped) and every rank loads rank 0's.
inline constexpr char kSharedBlobPrefix[] = "shared:";
struct CheckpointBlob {
  std::string name;
  std::vector<std::byte> bytes;
  std::string dtype = "U8";     // "F32", "BF16", "F16", "F64", "I64", "I32", "U8", "BOOL", ...
  std::vector<uint64_t> shape;  // empty: {bytes.size()} (U8)
};
// Bytes per element of a dtype name above; 0 for an unknown one.
uint64_t CheckpointDTypeSize(const std::string& dtype);

struct CheckpointSaveRequest {
  std::string dir;                    // created if missing; must be on a filesystem every rank sees
  std::string tag;                    // empty: "global_step<N>" (N = the engine's global steps)
  std::vector<CheckpointBlob> blobs;  // this rank's
  // [group][parameter]: each parameter's shape as the front end has it (the manifest keeps
  // it for strata-ckpt export); empty: each is one dimension of its numel.
  std::vector<std::vector<std::vector<int64_t>>> param_shapes;
  // Read each rank file back after its fsync and check every CRC (a second pass over the
  // data; off: the CRCs are computed from the states as they are written, every write's
  // completion and the fsync are checked, and loads and `strata-ckpt verify` read them).
  bool verify_read_back = false;
  // Leave the frozen groups' values out (DeepSpeed's exclude_frozen_parameters): fp32_master
  // then covers the trainable groups only, as m and v do, and a load keeps the frozen values
  // the model has (a LoRA run's checkpoint without its base). The manifest still lists the
  // frozen groups, so a load checks the model's layout against them, and keeps each one's
  // fingerprint (CheckpointGroup::frozen_fingerprint), so a load checks the model's base too.
  bool exclude_frozen_parameters = false;
  // Tests: write format 1 (the frozen values in fp32_master, as fp32), so that a test can
  // load what older builds saved.
  bool test_format_1 = false;
  // Tests: _exit(9) at the named point of the save (CheckpointCrashPoints).
  std::string crash_at;
  // Tests: write the rank files through the page cache, as on a filesystem that refuses
  // O_DIRECT (the fallback a test cannot otherwise reach where every filesystem takes it).
  bool test_buffered_writes = false;
};

// The points a test can stop a save at (CheckpointSaveRequest::crash_at), in save order.
const std::vector<std::string>& CheckpointCrashPoints();

// One tensor of a rank's file, as the manifest lists it.
struct CheckpointTensor {
  std::string name;   // "fp32_master", "exp_avg", "exp_avg_sq", "frozen", "blob:<name>"
  std::string dtype;  // F32 for the states; the working dtype for "frozen"; a blob's dtype
  std::vector<uint64_t> shape;
  uint64_t numel = 0;   // the product of shape
  uint64_t offset = 0;  // bytes from the start of the file
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

struct CheckpointLoadRequest {
  std::string dir;
  std::string tag;  // empty: the tag `latest` names
  // false: m and v start at zero and the Adam step count at 0 (a fresh optimizer).
  bool load_optimizer_states = true;
  // false: the learning-rate schedule keeps its position.
  bool load_lr_scheduler_states = true;
  // true: only the parameters (master and working shards); every counter, the loss scale,
  // the schedule and m, v are left as they are.
  bool load_module_only = false;
  // A checkpoint saved without the frozen values (and with their fingerprints): false loads
  // it onto a model whose frozen values are not the saving run's base (another base on
  // purpose); true refuses that, naming the groups. Must be the same on every rank.
  bool check_frozen_parameters = true;
  // The front end's verdict on the blobs this rank will receive (names without "blob:",
  // dtypes, shapes of the tensors it keeps whole), taken with the other checks before
  // anything changes.
  std::function<Status(const std::vector<CheckpointTensor>& blobs)> check_blobs;
};

struct CheckpointLoadResult {
  std::string path;  // <dir>/<tag>
  std::string tag;
  int saved_world_size = 1;
  int64_t global_steps = 0;
  // false: the checkpoint left the frozen groups' values out, and the model's were kept.
  bool frozen_parameters_loaded = true;
  // Such a checkpoint's frozen fingerprints matched the model's frozen values (false: none
  // to check, an older build saved it, or check_frozen_parameters was false).
  bool frozen_base_checked = false;
  // The blobs of saving rank rank % saved_world_size, and rank 0's shared blobs.
  std::vector<CheckpointBlob> blobs;
};

struct CheckpointRankPart {
  int rank = 0;
  std::string file;  // relative to the tag directory
  uint64_t file_bytes = 0;
  std::vector<CheckpointTensor> tensors;
  const CheckpointTensor* Find(const std::string& name) const;
};

struct CheckpointParam {
  std::string name;
  std::vector<uint64_t> shape;  // its product is numel
  uint64_t numel = 0;
  uint64_t offset = 0;  // in the group's flat buffer
};

struct CheckpointGroup {
  std::string name;
  uint64_t used_numel = 0;
  uint64_t shard_numel = 0;  // on the saving world size
  // Frozen (engine_core.h's GroupDesc::frozen): its working values in the tensor "frozen"
  // (format 2; in fp32_master in format 1), unless the save left them out
  // (CheckpointManifest::frozen_saved); no exp_avg / exp_avg_sq. Frozen groups come last.
  bool frozen = false;
  // A frozen group of a checkpoint saved without the frozen values ("frozen_fingerprint",
  // 16 hex digits; older builds wrote none): FrozenFingerprintTerm summed mod 2^64 over the
  // group's parameter elements (padding left out) as the checkpoint's dtype holds them.
  bool has_fingerprint = false;
  uint64_t frozen_fingerprint = 0;
  std::vector<CheckpointParam> params;
};

// A frozen group's fingerprint is the sum mod 2^64 of this term over its parameters'
// elements: `index` the element's offset in the group's flat buffer (the same on any world
// size), `bits` the fp32 bit pattern of its value in the checkpoint's dtype. A sum, so each
// rank adds its shard's terms and the ranks' partial sums add up to the group's.
inline uint64_t FrozenFingerprintTerm(uint64_t index, uint32_t bits) {
  // splitmix64's finalizer over the index's multiple of the golden ratio mixed with the bits
  // (optim/cpu_adam's IndexedBitsTerm, whose SIMD kernels sum it: BulkIndexedBitsSum). For a
  // given index the term is a bijection of the bits, so one value changed always changes the
  // sum; several leave it equal with odds of about 2^-64 (no cryptographic hash: it catches
  // another base, not a forged one).
  return IndexedBitsTerm(index, bits);
}

// The sum of FrozenFingerprintTerm over `values` (fp32), the elements first_index, ... of a
// frozen group's flat buffer, each value first rounded to `round_to` (the checkpoint's
// dtype, when the values may not be exact in it; nullopt: as they are). `values` is
// overwritten with the rounded values.
uint64_t FrozenFingerprintSum(std::span<float> values, uint64_t first_index,
                              std::optional<DType> round_to);

// manifest.json, parsed and checked for consistency (every range inside its file and
// exactly numel × dtype size, one part per rank, shards that cover each group).
struct CheckpointManifest {
  int version = kCheckpointFormatVersion;
  std::string tag;
  int world_size = 1;
  std::string dtype;                      // the training dtype ("fp32", "bf16", "fp16")
  DType working_dtype = DType::kFloat32;  // the same, parsed
  int64_t global_steps = 0;
  int64_t micro_steps = 0;
  int64_t adam_step = 0;
  int64_t lr_iteration = 0;
  bool loss_scaler_enabled = false;
  double loss_scale = 1.0;
  int hysteresis_left = 0;
  int64_t scaler_iteration = 0;
  int64_t last_overflow_iteration = -1;
  int64_t skipped_steps = 0;
  std::string config_json;  // the normalized config the run had ("null" if none)
  // false (version 2, "frozen_parameters_saved": false): the frozen groups' values are not
  // in the checkpoint.
  bool frozen_saved = true;
  // Elements of a rank's partition (the saving world size's): every group's shard, and the
  // trainable groups' (what fp32_master holds in format 2, and m and v in both); the frozen
  // groups' part, partition_numel - trainable_numel, is the tensor "frozen" in format 2.
  uint64_t partition_numel = 0;
  uint64_t trainable_numel = 0;
  bool frozen_in_master() const { return version < 2; }
  std::vector<CheckpointGroup> groups;
  std::vector<CheckpointRankPart> ranks;
  uint64_t total_bytes() const;
};

// "<dir>/latest"'s tag when `tag` is empty, else `tag` (checked: a plain directory name).
Result<std::string> ResolveCheckpointTag(const std::string& dir, const std::string& tag);
// Reads and checks <dir>/<tag>/manifest.json; errors name the file.
Result<CheckpointManifest> ReadCheckpointManifest(const std::string& tag_dir);
// Reads the tensor from the tag directory's rank file and checks its size and CRC32C
// (DataLoss naming the file, tensor and tag on a mismatch).
Status VerifyCheckpointTensor(const std::string& tag_dir, const CheckpointManifest& m,
                              const CheckpointRankPart& part, const CheckpointTensor& t);

// The directories of a save directory that hold a checkpoint: complete tags (a
// manifest.json) and saves in progress or interrupted (.tmp-<tag>), sorted by name.
struct CheckpointTagEntry {
  std::string name;
  bool complete = false;
};
Result<std::vector<CheckpointTagEntry>> ListCheckpointTags(const std::string& dir);

// Writes the model in a checkpoint as one safetensors file: every trained parameter (the
// fp32 master consolidated from the ranks' files), every frozen one (the frozen groups'
// values, unless the save left them out: `frozen_left_out` counts those) and rank 0's
// parameters the front end keeps whole, under its name and shape, floating-point values in
// `dtype` ("F32", "BF16" or "F16"), other types as saved. The rank files' tensors it reads are
// CRC-checked first; then it streams in pieces of at most 1 Mi elements (memory stays near 8 MiB
// whatever the model) into OUT.tmp, fsyncs it and renames it to `out`: a failure leaves no file at
// `out`.
struct CheckpointExportStats {
  uint64_t tensors = 0;
  uint64_t bytes_written = 0;  // the whole file
  uint64_t largest_tensor_bytes = 0;
  uint64_t frozen_left_out = 0;  // frozen parameters the checkpoint does not hold
};
Result<CheckpointExportStats> ExportCheckpointSafetensors(const std::string& tag_dir,
                                                          const CheckpointManifest& m,
                                                          const std::string& out,
                                                          const std::string& dtype);

// The same model in Hugging Face's layout (checkpoint/model_writer.h) in `out_dir` (made
// when missing): "model.safetensors", or shards of at most `max_file_bytes` with
// "model.safetensors.index.json", and `small_files` ((name, text): the model's config.json,
// say) committed with them; a failure leaves the directory's earlier files as they were.
struct CheckpointModelExportStats {
  CheckpointExportStats base;  // tensors, bytes written (all files), largest tensor, left out
  ModelWriteStats files;
};
Result<CheckpointModelExportStats> ExportCheckpointModel(
    const std::string& tag_dir, const CheckpointManifest& m, const std::string& out_dir,
    const std::string& dtype, uint64_t max_file_bytes,
    const std::vector<std::pair<std::string, std::string>>& small_files);

}  // namespace strata::engine

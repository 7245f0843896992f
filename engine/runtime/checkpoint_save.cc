// CheckpointIo::Save, the protocol of EngineCore::SaveCheckpoint (checkpoint_io.h;
// engine/checkpoint/checkpoint.h describes the files and the protocol).
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

#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/checkpoint/blobs.h"
#include "strata/engine/checkpoint/file_read.h"
#include "strata/engine/checkpoint/files.h"
#include "strata/engine/checkpoint/format.h"
#include "strata/engine/runtime/checkpoint_io.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"
#include "strata/swap/crc32c.h"

namespace strata::engine {

// A save as its phases see it: what it writes where.
struct CheckpointIo::SavePlan {
  explicit SavePlan(const CheckpointSaveRequest& options) : o(options) {}
  const CheckpointSaveRequest& o;
  std::string tag;
  std::string dir;        // the save directory
  std::string tmp;        // dir/.tmp-<tag>, renamed to
  std::string final_dir;  // dir/<tag> once every part is in
  std::string what;       // "saving checkpoint <tag> in <dir>", for errors
  // Format 1 without frozen groups; with them, format 2: their values in the tensor "frozen"
  // (in the working dtype: exact, 2 bytes per parameter in bf16 and fp16), or left out.
  bool exclude_frozen = false;
  bool format_1 = false;
};

Result<std::string> CheckpointIo::Save(const CheckpointSaveRequest& o) {
  STRATA_RETURN_IF_ERROR(AtStepBoundary(
      io_.step.between_backward_and_step(), io_.reducer.pending(), io_.step.micro_steps(),
      io_.config.gradient_accumulation_steps, "saving a checkpoint"));
  // A delayed update's parameters are copied out too.
  STRATA_RETURN_IF_ERROR(io_.step.JoinStep(true, StepControl::Join::kDrain));
  SavePlan s(o);
  s.tag = o.tag.empty() ? "global_step" + std::to_string(io_.step.global_steps()) : o.tag;
  STRATA_RETURN_IF_ERROR(CheckTag(s.tag));
  STRATA_RETURN_IF_ERROR(CheckSaveOptions(o));
  s.dir = o.dir;
  s.tmp = s.dir + "/.tmp-" + s.tag;
  s.final_dir = s.dir + "/" + s.tag;
  s.what = "saving checkpoint " + s.tag + " in " + s.dir;
  const bool has_frozen = io_.partition.num_trainable < num_groups();
  s.exclude_frozen = o.exclude_frozen_parameters && has_frozen;
  s.format_1 = !has_frozen || o.test_format_1;
  if (o.test_format_1 && s.exclude_frozen) {
    return InvalidArgumentError("save_checkpoint: format 1 cannot leave the frozen values out");
  }
  // 1. Rank 0 makes the directory and an empty .tmp-<tag>.
  STRATA_RETURN_IF_ERROR(MakeSaveDirectory(s));
  // 2. Every rank writes its file and its part of the manifest.
  STRATA_RETURN_IF_ERROR(AgreeOnRankParts(s, WriteRankPart(s)));
  // 3. Rank 0 collects the parts, writes the manifest and publishes the tag.
  Status published = io_.partition.rank == 0 ? PublishCheckpoint(s) : Status::Ok();
  if (!published.ok() && io_.partition.rank == 0 && Exists(s.tmp)) {
    const Status removed = RemoveTree(s.tmp);
    if (!removed.ok()) STRATA_LOG(kWarn) << "after a failed save: " << removed;
  }
  STRATA_ASSIGN_OR_RETURN(Outcomes agreed,
                          AgreeOnOutcomes(io_.host, published, {}, 4096).WithContext(s.what));
  if (agreed.any_failed) return Status(agreed.code, OutcomeStatus(agreed, s.what).message());
  return s.final_dir;
}

// The options' crash point, parameter shapes and blobs.
Status CheckpointIo::CheckSaveOptions(const CheckpointSaveRequest& o) const {
  if (o.dir.empty()) return InvalidArgumentError("save_checkpoint: the save directory is empty");
  if (!o.crash_at.empty()) {
    const auto& points = CheckpointCrashPoints();
    if (std::find(points.begin(), points.end(), o.crash_at) == points.end()) {
      return InvalidArgumentError("save_checkpoint: unknown crash point '" + o.crash_at + "'");
    }
  }
  if (!o.param_shapes.empty()) {
    bool fits = o.param_shapes.size() == io_.partition.groups.size();
    for (size_t g = 0; fits && g < o.param_shapes.size(); ++g) {
      const GroupLayout& l = io_.partition.groups[g];
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
  return Status::Ok();
}

// Rank 0 makes the directory and an empty .tmp-<tag> (a stale one from a save that crashed is
// removed); the ranks agree on the outcome.
Status CheckpointIo::MakeSaveDirectory(const SavePlan& s) {
  const std::string& dir = s.dir;
  const std::string& tmp = s.tmp;
  const std::string& final_dir = s.final_dir;
  const std::string& what = s.what;
  const int rank = io_.partition.rank;
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
                            AgreeOnOutcomes(io_.host, prep, {}, 4096).WithContext(what));
    if (agreed.any_failed) {
      return Status(agreed.code, OutcomeStatus(agreed, what).message() +
                                     "; the previous checkpoints are unchanged");
    }
  }

  return Status::Ok();
}

// This rank's file (the CRCs computed from the states as they are written), fsynced
// (verify_read_back: read back against the CRCs), and its part of the manifest.
Status CheckpointIo::WriteRankPart(const SavePlan& s) {
  const CheckpointSaveRequest& o = s.o;
  const std::string& tmp = s.tmp;
  const int rank = io_.partition.rank;
  if (!Exists(tmp)) {
    return FailedPreconditionError("save_dir " + s.dir +
                                   " is not one filesystem for every rank: "
                                   "rank " +
                                   std::to_string(rank) + " cannot see " + tmp +
                                   ", which rank 0 created; put save_dir on a filesystem "
                                   "every rank sees");
  }
  CheckpointRankPart part;
  part.rank = rank;
  part.file = RankFileName(rank);
  RankFileWriter w;
  STRATA_RETURN_IF_ERROR(w.Open(tmp + "/" + part.file, !o.test_buffered_writes));
  STRATA_RETURN_IF_ERROR(WriteStateTensors(s, w, part));
  if (!s.format_1 && !s.exclude_frozen) STRATA_RETURN_IF_ERROR(WriteFrozenTensor(w, part));
  // Left out: the fingerprints of the base instead (rank 0 adds the ranks' partial sums).
  std::vector<uint64_t> fingerprints;
  if (s.exclude_frozen) {
    STRATA_ASSIGN_OR_RETURN(fingerprints,
                            FrozenFingerprintPartials(io_.partition, io_.placement.shards(), dtype_,
                                                      io_.placement.cpu_adam()));
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
    self.tag = s.tag;
    for (const CheckpointTensor& t : part.tensors)
      STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tmp, self, part, t));
  }
  Json part_json = PartJson(part);
  if (s.exclude_frozen) {
    Json partials = Json::array();
    for (const uint64_t v : fingerprints)
      partials.push_back(FingerprintHex(v));
    part_json[kPartFingerprints] = std::move(partials);
  }
  STRATA_RETURN_IF_ERROR(
      WriteSmallFile(tmp + "/" + PartFileName(rank), part_json.dump(), /*sync=*/true));
  MaybeCrash(o.crash_at, "part_written");
  return Status::Ok();
}

// The master, m and v, which cover the trainable groups (format 1: the master is followed by
// the frozen groups' working values, as fp32), straight from the store's chunks, in pieces
// whose write-back starts at once.
Status CheckpointIo::WriteStateTensors(const SavePlan& s, RankFileWriter& w,
                                       CheckpointRankPart& part) {
  const bool format_1 = s.format_1;
  for (int k = 0; k < 3; ++k) {
    // The master, m and v cover the trainable groups (format 1: the master is followed by
    // the frozen groups' working values, as fp32).
    const size_t n =
        k == 0 && format_1 ? io_.partition.partition_numel : trainable_.partition_numel;
    STRATA_RETURN_IF_ERROR(w.PadTo(kAlign));
    CheckpointTensor t{kStateTensors[k], "F32", {n}, n, w.offset(), uint64_t{n} * 4, 0};
    // Straight from the store's chunks, in pieces whose write-back starts at once.
    const Status visited =
        io_.driver.VisitState(kStates[k], [&](size_t, std::span<const float> chunk) -> Status {
          for (size_t at = 0; at < chunk.size(); at += kPieceFloats) {
            const std::span<const std::byte> bytes =
                std::as_bytes(chunk.subspan(at, std::min(kPieceFloats, chunk.size() - at)));
            STRATA_RETURN_IF_ERROR(w.Write(bytes.data(), bytes.size(), &t.crc32c));
            w.StartWriteBack();
          }
          return Status::Ok();
        });
    STRATA_RETURN_IF_ERROR(visited);
    for (int g = io_.partition.num_trainable; k == 0 && format_1 && g < num_groups(); ++g) {
      if (!io_.placement.shards().has(g)) continue;
      std::vector<float> values(layout(g).shard_numel);
      {
        STRATA_ASSIGN_OR_RETURN(offload::StateLease l,
                                io_.placement.shards().Acquire(g, offload::Access::kRead));
        ConvertToFloat(l.data(), dtype_, values.size(), values.data());
        STRATA_RETURN_IF_ERROR(l.Release());
      }
      const std::span<const std::byte> bytes = std::as_bytes(std::span<const float>(values));
      STRATA_RETURN_IF_ERROR(w.Write(bytes.data(), bytes.size(), &t.crc32c));
      w.StartWriteBack();
    }
    part.tensors.push_back(std::move(t));
  }
  return Status::Ok();
}

// The frozen groups' working shards as they are (no conversion): the tensor "frozen".
Status CheckpointIo::WriteFrozenTensor(RankFileWriter& w, CheckpointRankPart& part) {
  const size_t n = io_.partition.partition_numel - trainable_.partition_numel;
  const size_t elem = DTypeSize(dtype_);
  STRATA_RETURN_IF_ERROR(w.PadTo(kAlign));
  CheckpointTensor t{kFrozenTensor, SafetensorsName(dtype_), {n}, n, w.offset(), n * elem, 0};
  for (int g = io_.partition.num_trainable; g < num_groups(); ++g) {
    if (!io_.placement.shards().has(g)) continue;
    STRATA_ASSIGN_OR_RETURN(offload::StateLease l,
                            io_.placement.shards().Acquire(g, offload::Access::kRead));
    STRATA_RETURN_IF_ERROR(w.Write(l.data(), io_.placement.shards().bytes(g), &t.crc32c));
    STRATA_RETURN_IF_ERROR(l.Release());
    w.StartWriteBack();
  }
  part.tensors.push_back(std::move(t));
  return Status::Ok();
}

// Every rank's write agreed on; a failure anywhere removes the partial save.
Status CheckpointIo::AgreeOnRankParts(const SavePlan& s, const Status& written) {
  const std::string& what = s.what;
  {
    STRATA_ASSIGN_OR_RETURN(Outcomes agreed,
                            AgreeOnOutcomes(io_.host, written, {}, 4096).WithContext(what));
    if (agreed.any_failed) {
      if (io_.partition.rank == 0) {
        const Status removed = RemoveTree(s.tmp);
        if (!removed.ok()) STRATA_LOG(kWarn) << "after a failed save: " << removed;
      }
      return Status(agreed.code, OutcomeStatus(agreed, what).message() +
                                     "; the partial save was removed, the previous checkpoints "
                                     "are unchanged");
    }
  }

  return Status::Ok();
}

// Rank 0: the ranks' parts collected (and their partial fingerprints added), the manifest
// written, then the tag and `latest` published, each step synced, in an order a crash at any
// point leaves the previous checkpoints and `latest` as they were.
Status CheckpointIo::PublishCheckpoint(const SavePlan& s) {
  const CheckpointSaveRequest& o = s.o;
  const std::string& tmp = s.tmp;
  const std::string& dir = s.dir;
  const std::string& final_dir = s.final_dir;
  const std::string& tag = s.tag;
  const int world = io_.partition.world_size;
  std::vector<uint64_t> fingerprint_sums;
  STRATA_ASSIGN_OR_RETURN(Json ranks, CollectRankParts(s, fingerprint_sums));
  const LossScaler& scaler = io_.step.loss_scaler();
  const LossScaler::State ls = scaler.state();
  Json groups = Json::array();
  for (size_t gi = 0; gi < io_.partition.groups.size(); ++gi) {
    const GroupLayout& g = io_.partition.groups[gi];
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
    if (io_.partition.frozen(static_cast<int>(gi))) {
      gj["frozen"] = true;
      if (s.exclude_frozen) {
        gj["frozen_fingerprint"] =
            FingerprintHex(fingerprint_sums[gi - static_cast<size_t>(io_.partition.num_trainable)]);
      }
    }
    groups.push_back(std::move(gj));
  }
  Json m{{"format", kFormatName},
         {"version", s.format_1 ? 1 : 2},
         {"tag", tag},
         {"world_size", world},
         {"dtype", std::string(DTypeName(dtype_))},
         {"global_steps", io_.step.global_steps()},
         {"micro_steps", io_.step.micro_steps()},
         {"adam_step", io_.driver.adam_step()},
         {"lr_iteration", io_.step.lr_iteration()},
         {"loss_scaler",
          {{"enabled", scaler.enabled()},
           {"scale", ls.scale},
           {"hysteresis_left", ls.hysteresis_left},
           {"iteration", ls.iteration},
           {"last_overflow_iteration", ls.last_overflow_iteration},
           {"skipped_steps", ls.skipped_steps}}},
         {"config", io_.config.normalized},
         {"frozen_parameters_saved", !s.exclude_frozen},
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
}

// The ranks' parts of the manifest, read back by rank 0; with the frozen values left out, the
// ranks' partial fingerprints added (mod 2^64) into `fingerprint_sums`.
Result<Json> CheckpointIo::CollectRankParts(const SavePlan& s,
                                            std::vector<uint64_t>& fingerprint_sums) {
  const std::string& tmp = s.tmp;
  const std::string& dir = s.dir;
  const bool exclude_frozen = s.exclude_frozen;
  const int world = io_.partition.world_size;
  Json ranks = Json::array();
  fingerprint_sums.assign(exclude_frozen ? io_.partition.groups.size() -
                                               static_cast<size_t>(io_.partition.num_trainable)
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
  return ranks;
}

}  // namespace strata::engine

// CheckpointIo::Load, the protocol of EngineCore::LoadCheckpoint (checkpoint_io.h;
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
#include "strata/engine/runtime/model_io.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"
#include "strata/swap/crc32c.h"

namespace strata::engine {
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

// A load as its phases see it: the checkpoint, what this rank reads of it, and what the
// checks found.
struct CheckpointIo::LoadPlan {
  explicit LoadPlan(const CheckpointLoadRequest& options) : o(options) {}
  const CheckpointLoadRequest& o;
  std::string tag;
  std::string tag_dir;  // <dir>/<tag>
  bool states = true;   // m and v are loaded (not a fresh optimizer, not the module only)
  CheckpointManifest m;
  std::vector<uint64_t> saved_shard_offset;  // each group's in the saving ranks' partitions
  std::set<int> sources;                     // the saving ranks this rank reads from
  // Saved without the frozen values, with their fingerprints: the model's partial sums.
  bool fingerprinted = false;
  std::vector<uint64_t> fingerprints;
};

Result<CheckpointLoadResult> CheckpointIo::Load(const CheckpointLoadRequest& o) {
  STRATA_RETURN_IF_ERROR(AtStepBoundary(
      io_.step.between_backward_and_step(), io_.reducer.pending(), io_.step.micro_steps(),
      io_.config.gradient_accumulation_steps, "loading a checkpoint"));
  // A delayed update's parameters are copied out too.
  STRATA_RETURN_IF_ERROR(io_.step.JoinStep(true, StepControl::Join::kDrain));
  if (o.dir.empty()) return InvalidArgumentError("load_checkpoint: the directory is empty");
  LoadPlan l(o);
  l.states = o.load_optimizer_states && !o.load_module_only;
  l.fingerprints.assign(static_cast<size_t>(num_groups() - io_.partition.num_trainable), 0);
  STRATA_ASSIGN_OR_RETURN(l.tag, AgreeOnCheckpointTag(o.dir, o.tag));
  l.tag_dir = o.dir + "/" + l.tag;
  // Every rank checks what it will read before anything changes; the ranks agree.
  STRATA_RETURN_IF_ERROR(AgreeOnLoadCheck(io_.host, io_.coordinator, CheckCheckpoint(l),
                                          "checking checkpoint " + l.tag_dir));
  STRATA_ASSIGN_OR_RETURN(const bool base_checked, CheckFrozenBase(l));
  // The states: each of this rank's shards, read from the saving ranks' files.
  CheckpointLoadResult out;
  out.path = l.tag_dir;
  out.tag = l.tag;
  out.saved_world_size = l.m.world_size;
  out.global_steps = l.m.global_steps;
  out.frozen_parameters_loaded = l.m.frozen_saved || io_.partition.num_trainable == num_groups();
  out.frozen_base_checked = base_checked;
  const Status local = ReadCheckpointStates(l, out);
  return CommitLoad(l, local, std::move(out));
}

// Rank 0 resolves the tag (`latest` may move while the ranks read it) and sends it.
Result<std::string> CheckpointIo::AgreeOnCheckpointTag(const std::string& dir,
                                                       const std::string& wanted) {
  const int rank = io_.partition.rank;
  std::string tag;
  Status resolved;
  if (rank == 0) {
    Result<std::string> t = ResolveCheckpointTag(dir, wanted);
    if (t.ok()) {
      tag = *t;
    } else {
      resolved = t.status();
    }
  }
  STRATA_ASSIGN_OR_RETURN(Outcomes agreed, AgreeOnOutcomes(io_.host, resolved, {}, 4096));
  if (agreed.any_failed) {
    return Status(agreed.code, OutcomeStatus(agreed, "loading a checkpoint from " + dir).message() +
                                   "; nothing was changed");
  }
  std::vector<int64_t> words(32, 0);  // 256 bytes: CheckTag's 200 characters fit
  if (rank == 0) std::memcpy(words.data(), tag.data(), tag.size());
  STRATA_RETURN_IF_ERROR(io_.host.Broadcast(words.data(), words.size(), comm::DType::kInt64, 0));
  tag.assign(reinterpret_cast<const char*>(words.data()),
             strnlen(reinterpret_cast<const char*>(words.data()), 256));
  return tag;
}

// What this rank will read, checked: the manifest against the model, the frozen base's
// fingerprint summed, the CRC of every tensor it reads, the front end's verdict on the blobs.
Status CheckpointIo::CheckCheckpoint(LoadPlan& l) {
  const CheckpointLoadRequest& o = l.o;
  const std::string& tag_dir = l.tag_dir;
  CheckpointManifest& m = l.m;
  const int rank = io_.partition.rank;
  STRATA_ASSIGN_OR_RETURN(m, ReadCheckpointManifest(tag_dir));
  STRATA_RETURN_IF_ERROR(MatchModel(io_.partition, m, tag_dir));
  for (const CheckpointGroup& g : m.groups)
    l.fingerprinted = l.fingerprinted || g.has_fingerprint;
  if (l.fingerprinted && o.check_frozen_parameters) {
    STRATA_ASSIGN_OR_RETURN(l.fingerprints,
                            FrozenFingerprintPartials(io_.partition, io_.placement.shards(),
                                                      m.working_dtype, io_.placement.cpu_adam()));
  }
  uint64_t at = 0;
  for (const CheckpointGroup& g : m.groups) {
    l.saved_shard_offset.push_back(at);
    at += g.shard_numel;
  }
  for (int g = 0; g < num_groups(); ++g) {
    const GroupLayout& group = layout(g);
    for (const SavedPiece& p : SavedPieces(m, l.saved_shard_offset, static_cast<size_t>(g),
                                           group.shard_begin(rank), group.shard_numel))
      l.sources.insert(p.rank);
  }
  for (const int q : l.sources) {
    const CheckpointRankPart& part = m.ranks[static_cast<size_t>(q)];
    for (const char* name : kStateTensors) {
      if (!l.states && name != kStateTensors[0]) continue;
      STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *part.Find(name)));
    }
    if (const CheckpointTensor* t = part.Find(kFrozenTensor); t != nullptr) {
      STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, part, *t));
    }
  }
  std::vector<CheckpointTensor> blobs;
  for (const auto& [q, t] : BlobsFor(m, rank)) {
    STRATA_RETURN_IF_ERROR(VerifyCheckpointTensor(tag_dir, m, m.ranks[static_cast<size_t>(q)], *t));
    blobs.push_back(*t);
    blobs.back().name = blob::CurrentName(t->name.substr(5));
    l.sources.insert(q);
  }
  if (o.check_blobs) STRATA_RETURN_IF_ERROR(o.check_blobs(blobs));
  return Status::Ok();
}

// The model's frozen base against the saving run's (the same manifest on every rank, so the
// same decision): the ranks' partial sums gathered and added mod 2^64, with the ranks that
// asked for the check counted. Whether the base was checked and matched; a refusal leaves
// nothing changed.
Result<bool> CheckpointIo::CheckFrozenBase(const LoadPlan& l) {
  const CheckpointLoadRequest& o = l.o;
  const CheckpointManifest& m = l.m;
  if (!l.fingerprinted) return false;
  bool base_checked = false;
  const size_t nf = l.fingerprints.size();
  const size_t world = static_cast<size_t>(io_.partition.world_size);
  std::vector<int64_t> mine(nf + 1, 0), all((nf + 1) * world, 0);
  for (size_t i = 0; i < nf; ++i)
    mine[i] = static_cast<int64_t>(l.fingerprints[i]);
  mine[nf] = o.check_frozen_parameters ? 1 : 0;
  STRATA_RETURN_IF_ERROR(
      io_.host.AllGather(mine.data(), all.data(), all.size(), comm::DType::kInt64));
  std::vector<uint64_t> sums(nf, 0);
  int64_t checking = 0;
  for (size_t q = 0; q < world; ++q) {
    for (size_t i = 0; i < nf; ++i)
      sums[i] += static_cast<uint64_t>(all[q * (nf + 1) + i]);
    checking += all[q * (nf + 1) + nf];
  }
  std::string refused;
  if (checking != 0 && checking != io_.partition.world_size) {
    refused = std::to_string(checking) + " of " + std::to_string(io_.partition.world_size) +
              " ranks passed check_frozen_parameters true: pass the same on every rank";
  } else if (checking != 0) {
    std::vector<std::string> differ;
    for (size_t i = 0; i < nf; ++i) {
      const CheckpointGroup& g = m.groups[static_cast<size_t>(io_.partition.num_trainable) + i];
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
    STRATA_RETURN_IF_ERROR(io_.coordinator.BeginIteration());
    return InvalidArgumentError("checking checkpoint " + l.tag_dir + ": " + refused +
                                "; nothing was changed");
  }
  return base_checked;
}

// Every state of this rank's shards from the saving ranks' files (m and v zeros for a fresh
// optimizer), and the blobs this rank gets.
Status CheckpointIo::ReadCheckpointStates(const LoadPlan& l, CheckpointLoadResult& out) {
  const CheckpointLoadRequest& o = l.o;
  const CheckpointManifest& m = l.m;
  const std::string& tag = l.tag;
  const std::string& tag_dir = l.tag_dir;
  const bool states = l.states;
  const int rank = io_.partition.rank;
  std::map<int, int> fds;
  const Status read = [&]() -> Status {
    for (const int q : l.sources) {
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
      const int groups = k == 0 && m.frozen_saved ? num_groups() : io_.partition.num_trainable;
      for (int g = 0; g < groups; ++g) {
        const GroupLayout& group = layout(g);
        const size_t base = io_.partition.shard_offset[static_cast<size_t>(g)];
        for (uint64_t done = 0; done < group.shard_numel;) {
          const uint64_t count = std::min<uint64_t>(kPieceFloats, group.shard_numel - done);
          buf.assign(count, 0.0f);
          const uint64_t first = group.shard_begin(rank) + done;
          if (!zeros) {
            for (const SavedPiece& p :
                 SavedPieces(m, l.saved_shard_offset, static_cast<size_t>(g), first, count)) {
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
          if (io_.partition.frozen(g)) {
            STRATA_RETURN_IF_ERROR(io_.placement.WriteFrozen(g, done, buf));
          } else {
            STRATA_RETURN_IF_ERROR(io_.driver.WriteState(kStates[k], base + done, buf));
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
  }();
  for (const auto& [q, fd] : fds)
    ::close(fd);
  return read;
}

// The ranks agree on the reads (the driver rolls back on a failure anywhere); the counters,
// schedule and loss scale taken; the working shards pushed and the persistent groups gathered
// again.
Result<CheckpointLoadResult> CheckpointIo::CommitLoad(const LoadPlan& l, const Status& local,
                                                      CheckpointLoadResult out) {
  const CheckpointLoadRequest& o = l.o;
  const CheckpointManifest& m = l.m;
  const int rank = io_.partition.rank;
  const Status committed = io_.driver.CommitMasterAgreed(local, "loading checkpoint " + l.tag_dir);
  // The frozen values kept without a check are said once, never silently.
  if (committed.ok() && rank == 0 && !out.frozen_parameters_loaded && !out.frozen_base_checked) {
    STRATA_LOG(kWarn) << "checkpoint " << l.tag_dir
                      << " was saved without its frozen values; the model's own were kept "
                         "without checking that they are the base it was trained on ("
                      << (l.fingerprinted ? "check_frozen_parameters is false"
                                          : "it holds no fingerprint of them: saved by an older "
                                            "build")
                      << ")";
  }
  if (committed.ok() && !o.load_module_only) {
    STRATA_RETURN_IF_ERROR(io_.driver.set_adam_step(l.states ? m.adam_step : 0));
    // At a boundary of this run's accumulation (another gradient_accumulation_steps than
    // the saving run's: as many micro-steps as its global steps need).
    const int64_t micro_steps = m.micro_steps % io_.config.gradient_accumulation_steps == 0
                                    ? m.micro_steps
                                    : m.global_steps * io_.config.gradient_accumulation_steps;
    std::optional<LossScaler::State> scaler;
    if (io_.step.loss_scaler().enabled() && m.loss_scaler_enabled) {
      scaler = LossScaler::State{m.loss_scale, m.hysteresis_left, m.scaler_iteration,
                                 m.last_overflow_iteration, m.skipped_steps};
    }
    io_.step.Restore(
        m.global_steps, micro_steps,
        o.load_lr_scheduler_states ? std::optional<int64_t>(m.lr_iteration) : std::nullopt, scaler);
  }
  STRATA_RETURN_IF_ERROR(io_.placement.PushWorkingShards());
  STRATA_RETURN_IF_ERROR(io_.coordinator.RegatherPersistent());
  STRATA_RETURN_IF_ERROR(io_.coordinator.BeginIteration());
  STRATA_RETURN_IF_ERROR(committed);
  return out;
}

}  // namespace strata::engine

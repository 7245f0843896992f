// ModelIo (model_io.h): the parameters loaded, set, assembled and gathered, collectively.
#include "strata/engine/runtime/model_io.h"

#include <algorithm>
#include <map>
#include <optional>

#include "strata/engine/agreement/agreement.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"

namespace strata::engine {

Status AgreeOnLoadCheck(comm::Communicator& host, ParameterCoordinator& coordinator,
                        const Status& local_check, const std::string& what) {
  // 16 KiB per rank: a check lists names (up to 20 of each kind).
  STRATA_ASSIGN_OR_RETURN(Outcomes checked,
                          AgreeOnOutcomes(host, local_check, {}, size_t{16} << 10));
  // Nothing stays gathered (prefetches in flight are waited for): the groups gathered
  // after the load see the new values. This ends the pass the front end's calls began, on
  // the failed path too, so the next iteration starts the same way on every rank.
  STRATA_RETURN_IF_ERROR(coordinator.EndForwardOnly());
  if (checked.any_failed) {
    STRATA_RETURN_IF_ERROR(coordinator.BeginIteration());
    return Status(checked.code, OutcomeStatus(checked, what).message() + "; nothing was changed");
  }
  return Status::Ok();
}

namespace {
// "loading" -> "load": WriteParameters' messages.
std::string Infinitive(const std::string& verb) {
  if (verb == "setting") return "set";
  if (verb == "assembling") return "assemble";
  return "load";
}
}  // namespace

Status ModelIo::LoadParameters(const Status& local_check, const ParamReader& read,
                               const ParamFilter& only) {
  return WriteParameters("loading", local_check, nullptr, read, only);
}

Status ModelIo::WriteParameters(const std::string& verb, const Status& local_check,
                                const std::function<Status(Status& local)>& prepare,
                                const ParamReader& read, const ParamFilter& only) {
  if (io_.step.between_backward_and_step() || io_.reducer.pending() ||
      io_.step.micro_steps() % io_.config.gradient_accumulation_steps != 0) {
    return FailedPreconditionError(
        verb + " parameters between a backward and its step: " + Infinitive(verb) +
        " them before training or right after step()");
  }
  STRATA_RETURN_IF_ERROR(io_.step.JoinStep(true, StepControl::Join::kDrain));
  STRATA_RETURN_IF_ERROR(AgreeOnLoadCheck(io_.host, io_.coordinator, local_check,
                                          "checking the parameters to " + Infinitive(verb)));
  Status local;
  if (prepare) STRATA_RETURN_IF_ERROR(prepare(local));
  std::vector<float> buffer;
  constexpr size_t kPiece = size_t{1} << 20;
  for (int g = 0; g < io_.partition.num_groups() && local.ok(); ++g) {
    const GroupLayout& l = layout(g);
    const size_t shard = io_.partition.shard_offset[static_cast<size_t>(g)];
    for (size_t i = 0; i < l.params.size() && local.ok(); ++i) {
      if (only && !only(g, i)) continue;
      const std::optional<ShardSlice> s = l.Slice(i, io_.partition.rank);
      if (!s) continue;
      for (size_t done = 0; done < s->count && local.ok();) {
        const size_t count = std::min(kPiece, s->count - done);
        buffer.resize(count);
        local = read(g, i, s->param_offset + done, buffer);
        if (local.ok()) {
          // A frozen group's values go straight to its working shard.
          local = io_.partition.frozen(g)
                      ? io_.placement.WriteFrozen(g, s->shard_offset + done, buffer)
                      : io_.driver.WriteMaster(shard + s->shard_offset + done, buffer);
        }
        done += count;
      }
    }
  }
  // Agreed on every rank, so every rank goes on into the collectives below either way: the
  // groups gathered again hold what the master holds now.
  const Status committed = io_.driver.CommitMasterAgreed(local, verb + " parameters");
  STRATA_RETURN_IF_ERROR(io_.placement.PushWorkingShards());
  STRATA_RETURN_IF_ERROR(io_.coordinator.RegatherPersistent());
  STRATA_RETURN_IF_ERROR(io_.coordinator.BeginIteration());
  return committed;
}

Status ModelIo::SetParameters(const Status& local_check, int source, const ParamList& which,
                              const std::vector<std::span<float>>& values) {
  Status check = local_check;
  if (check.ok() && (source < 0 || source >= io_.partition.world_size)) {
    check = InvalidArgumentError("SetParameters: source rank " + std::to_string(source) + " of " +
                                 std::to_string(io_.partition.world_size));
  }
  if (check.ok() && which.size() != values.size()) {
    check = InvalidArgumentError("SetParameters: " + std::to_string(which.size()) +
                                 " parameters, " + std::to_string(values.size()) + " values");
  }
  std::map<std::pair<int, size_t>, size_t> index;
  for (size_t k = 0; k < which.size() && check.ok(); ++k) {
    const auto [g, i] = which[k];
    if (g < 0 || g >= io_.partition.num_groups() || i >= layout(g).params.size()) {
      check = InvalidArgumentError("SetParameters: no parameter " + std::to_string(i) +
                                   " in group " + std::to_string(g));
    } else if (values[k].size() != layout(g).params[i].numel) {
      check = InvalidArgumentError("SetParameters: parameter " + layout(g).params[i].name +
                                   " has " + std::to_string(layout(g).params[i].numel) +
                                   " elements, " + std::to_string(values[k].size()) + " given");
    } else if (!index.emplace(which[k], k).second) {
      check = InvalidArgumentError("SetParameters: parameter " + layout(g).params[i].name +
                                   " given twice");
    }
  }
  // Checked and agreed on before the broadcasts (WriteParameters), which are collective.
  return WriteParameters(
      "setting", check,
      [&](Status&) -> Status {
        for (size_t k = 0; k < which.size(); ++k) {
          if (values[k].empty()) continue;
          STRATA_RETURN_IF_ERROR_CTX(
              io_.host.Broadcast(values[k].data(), values[k].size(), comm::DType::kFloat32, source),
              "broadcasting parameter " + layout(which[k].first).params[which[k].second].name);
        }
        return Status::Ok();
      },
      [&](int g, size_t i, uint64_t first, std::span<float> out) -> Status {
        const std::span<float> v = values[index.at({g, i})];
        std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(first), out.size(), out.begin());
        return Status::Ok();
      },
      [&](int g, size_t i) {
        return index.count({g, i}) != 0;
      });
}

Status ModelIo::AssembleParameters(const Status& local_check, const ParamList& which,
                                   const EngineCore::AssembleParts& parts) {
  Status check = local_check;
  if (check.ok() && (which.size() != parts.sizes.size() || !parts.read)) {
    check = InvalidArgumentError("AssembleParameters: " + std::to_string(which.size()) +
                                 " parameters, " + std::to_string(parts.sizes.size()) + " parts" +
                                 (parts.read ? "" : ", no reader"));
  }
  for (size_t k = 0; k < which.size() && check.ok(); ++k) {
    const auto [g, i] = which[k];
    if (g < 0 || g >= io_.partition.num_groups() || i >= layout(g).params.size()) {
      check = InvalidArgumentError("AssembleParameters: no parameter " + std::to_string(i) +
                                   " in group " + std::to_string(g));
      break;
    }
    const comm::Shard part =
        comm::Partition(layout(g).params[i].numel, io_.partition.world_size, io_.partition.rank);
    if (parts.sizes[k] != part.count) {
      check = InvalidArgumentError(
          "parameter " + layout(g).params[i].name + ": this rank's part holds " +
          std::to_string(parts.sizes[k]) + " elements, its share of " +
          std::to_string(layout(g).params[i].numel) + " over " +
          std::to_string(io_.partition.world_size) + " ranks is " + std::to_string(part.count) +
          " (built under strata.zero.Init with another world size?)");
    }
  }
  // The same gate as a load: at a step boundary, the check agreed on (nothing changed when
  // it fails), nothing gathered while the master changes.
  return WriteParameters(
      "assembling", check,
      [&](Status& local) -> Status {
        for (size_t k = 0; k < which.size(); ++k)
          STRATA_RETURN_IF_ERROR(AssembleOne(which, k, parts, local));
        return Status::Ok();
      },
      [](int, size_t, uint64_t, std::span<float>) { return Status::Ok(); },
      [](int, size_t) { return false; });  // written above
}

namespace {
// The most bytes one chunk of AssembleParameters holds (what this rank sends and every
// rank's piece it receives): a parameter is never held whole in fp32, whatever its size (a
// 128k x 2k embedding is 1 GiB in fp32).
constexpr size_t kAssembleChunkBytes = size_t{64} << 20;
}  // namespace

Status ModelIo::AssembleOne(const ParamList& which, size_t k,
                            const EngineCore::AssembleParts& parts, Status& local) {
  const auto [g, i] = which[k];
  const GroupLayout& l = layout(g);
  const size_t numel = l.params[i].numel;
  const int world = io_.partition.world_size;
  const size_t w = static_cast<size_t>(world);
  // Rank 0's part is the largest (comm::Partition); every rank sends `len` elements per
  // chunk, zeros past its part's end: a gather of len * W elements, rank r's at r * len.
  const size_t largest = comm::Partition(numel, world, 0).count;
  // One rank holds its part whole: it reads each chunk straight into the buffer it writes
  // from (no gather, no second buffer). Several send one chunk and receive W.
  const size_t buffers = world == 1 ? 1 : w + 1;
  const size_t chunk = parts.chunk_elems != 0
                           ? parts.chunk_elems
                           : std::max<size_t>(size_t{1} << 16, kAssembleChunkBytes / 4 / buffers);
  const comm::Shard mine = comm::Partition(numel, world, io_.partition.rank);
  const std::optional<ShardSlice> sl = l.Slice(i, io_.partition.rank);
  std::vector<float> send;
  std::vector<float> received;
  for (size_t first = 0; first < largest; first += chunk) {
    const size_t len = std::min(chunk, largest - first);
    std::vector<float>& own_piece = world == 1 ? received : send;
    own_piece.assign(len, 0.0f);
    if (world > 1) received.resize(len * w);
    const size_t own = first < mine.count ? std::min(len, mine.count - first) : 0;
    // A read failure is this rank's (agreed on after the writes); it still sends zeros, so
    // every rank takes part in every gather.
    if (own > 0 && local.ok()) {
      local = parts.read(k, first, std::span<float>(own_piece.data(), own));
    }
    if (!local.ok()) std::fill(own_piece.begin(), own_piece.end(), 0.0f);
    if (world > 1) {
      STRATA_RETURN_IF_ERROR_CTX(
          io_.host
              .AllGatherAsync(send.data(), received.data(), received.size(), comm::DType::kFloat32)
              ->Wait(),
          "gathering parameter " + l.params[i].name);
    }
    if (!sl || !local.ok()) continue;
    // Rank r's piece holds elements [r's offset + first, + its valid count) of the
    // parameter; this rank writes those inside its shard's slice.
    for (int r = 0; r < world && local.ok(); ++r) {
      const comm::Shard theirs = comm::Partition(numel, world, r);
      const size_t valid = first < theirs.count ? std::min(len, theirs.count - first) : 0;
      const size_t lo = std::max<size_t>(theirs.offset + first, sl->param_offset);
      const size_t hi =
          std::min<size_t>(theirs.offset + first + valid, sl->param_offset + sl->count);
      if (lo >= hi) continue;
      const std::span<const float> piece(
          received.data() + static_cast<size_t>(r) * len + (lo - theirs.offset - first), hi - lo);
      const size_t within = sl->shard_offset + (lo - sl->param_offset);
      local = io_.partition.frozen(g)
                  ? io_.placement.WriteFrozen(g, within, piece)
                  : io_.driver.WriteMaster(
                        io_.partition.shard_offset[static_cast<size_t>(g)] + within, piece);
    }
  }
  return Status::Ok();
}

Status ModelIo::GatherMasterParams(int group, std::span<float> out) {
  if (group < 0 || group >= io_.partition.num_groups()) {
    return FailedPreconditionError("GatherMasterParams: unknown group " + std::to_string(group));
  }
  if (io_.step.early_open()) {
    return FailedPreconditionError(
        "GatherMasterParams between a backward and its step() with strata.early_step (the "
        "master parameters are being updated): call it before the backward or after step()");
  }
  // The reducer's thread may be adding gradients through the driver (in a backward not
  // ended yet).
  STRATA_RETURN_IF_ERROR(io_.reducer.WaitAccumulations());
  STRATA_RETURN_IF_ERROR(io_.step.JoinStep());
  const GroupLayout& l = layout(group);
  if (out.size() != l.numel) {
    return InvalidArgumentError("GatherMasterParams: output holds " + std::to_string(out.size()) +
                                " floats, group " + l.name + " has " + std::to_string(l.numel));
  }
  if (l.padded_numel == 0) return Status::Ok();
  std::vector<float> full(l.padded_numel);
  std::vector<float> shard(l.shard_numel);
  // A read error must not leave the other ranks in the all-gather: every rank sends its
  // shard (zeros after a failure) and the ranks agree on the outcome first.
  Status read;
  if (!io_.partition.frozen(group)) {
    read = io_.driver.ReadMaster(io_.partition.shard_offset[static_cast<size_t>(group)], shard);
  } else if (io_.placement.shards().has(group)) {
    // A frozen group's values are its working shard's.
    Result<offload::StateLease> lease =
        io_.placement.shards().Acquire(group, offload::Access::kRead);
    read = lease.status();
    if (lease.ok()) {
      ConvertToFloat(lease->data(), io_.placement.shards().dtype(), shard.size(), shard.data());
      read = lease->Release();
    }
    if (!read.ok()) std::fill(shard.begin(), shard.end(), 0.0f);
  }
  if (io_.driver.store()->can_fail() || io_.placement.shards().can_fail()) {
    float failed = read.ok() ? 0.0f : 1.0f;
    STRATA_RETURN_IF_ERROR(
        io_.host.AllReduce(&failed, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
    if (!read.ok()) return read;
    if (failed > 0.0f) {
      return IOError("GatherMasterParams: reading the master parameters failed on " +
                     std::to_string(static_cast<int>(failed)) + " other rank(s)");
    }
  }
  STRATA_RETURN_IF_ERROR(read);
  STRATA_RETURN_IF_ERROR(
      io_.host.AllGather(shard.data(), full.data(), l.padded_numel, comm::DType::kFloat32));
  size_t pos = 0;
  for (const ParamSlot& p : l.params) {
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(p.offset), p.numel,
                out.begin() + static_cast<std::ptrdiff_t>(pos));
    pos += p.numel;
  }
  return Status::Ok();
}

}  // namespace strata::engine

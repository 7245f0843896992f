#include "strata/engine/agreement/agreement.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace strata::engine {

Result<Outcomes> AgreeOnOutcomes(comm::Communicator& comm, const Status& local,
                                 std::vector<float> flags, size_t message_bytes) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  if (flags.empty()) {
    flags.assign(static_cast<size_t>(world), 0.0f);
    flags[static_cast<size_t>(rank)] = local.ok() ? 0.0f : 1.0f;
    STRATA_RETURN_IF_ERROR_CTX(
        comm.AllReduce(flags.data(), flags.size(), comm::DType::kFloat32, comm::ReduceOp::kSum),
        "all-reduce of the ranks' outcomes");
  }
  Outcomes o;
  for (float f : flags)
    o.any_failed = o.any_failed || f > 0.0f;
  if (!o.any_failed) return o;
  // Per rank: its status code, then its message (cut to fit).
  const size_t kMsg = std::max<size_t>(64, (message_bytes + 7) / 8 * 8);
  std::vector<int64_t> mine(kMsg / sizeof(int64_t), 0);
  if (!local.ok()) {
    mine[0] = static_cast<int64_t>(local.code());
    const std::string m = local.ToString().substr(0, kMsg - sizeof(int64_t) - 1);
    std::memcpy(mine.data() + 1, m.data(), m.size());
  }
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(world));
  Status gathered = comm.AllGather(mine.data(), all.data(), all.size(), comm::DType::kInt64);
  o.code = StatusCode::kIOError;
  for (int r = 0; r < world; ++r) {
    if (flags[static_cast<size_t>(r)] <= 0.0f) continue;
    const int64_t* slot = all.data() + static_cast<size_t>(r) * mine.size();
    if (o.ranks.empty() && gathered.ok() && slot[0] != 0) {
      o.code = static_cast<StatusCode>(slot[0]);  // the lowest failing rank's
    }
    o.ranks += (o.ranks.empty() ? "" : ", ") + std::to_string(r);
    const char* p = reinterpret_cast<const char*>(slot + 1);
    o.messages += "; rank " + std::to_string(r) + ": " +
                  (gathered.ok() ? std::string(p, strnlen(p, kMsg - sizeof(int64_t)))
                                 : "(message not gathered)");
  }
  return o;
}

Status OutcomeStatus(const Outcomes& o, const std::string& what) {
  if (!o.any_failed) return Status::Ok();
  return Status(o.code, what + " failed on rank" +
                            (o.ranks.find(',') == std::string::npos ? " " : "s ") + o.ranks +
                            o.messages);
}

}  // namespace strata::engine

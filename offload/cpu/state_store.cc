#include "strata/offload/cpu/state_store.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "strata/core/logging.h"

namespace strata::offload {

// ---------------------------------------------------------------------------
// StateLease

StateLease::StateLease(StateLease&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      range_(other.range_),
      access_(other.access_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

StateLease& StateLease::operator=(StateLease&& other) noexcept {
  if (this != &other) {
    Status s = Release();
    if (!s.ok()) STRATA_LOG(kError) << "releasing a state lease: " << s.ToString();
    store_ = std::exchange(other.store_, nullptr);
    range_ = other.range_;
    access_ = other.access_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

StateLease::~StateLease() {
  // The store keeps the error (first_error()); the caller sees it at its next call.
  Status s = Release();
  if (!s.ok()) STRATA_LOG(kDebug) << "releasing a state lease: " << s.ToString();
}

Status StateLease::Release() {
  if (store_ == nullptr) return Status::Ok();
  StateStore* store = std::exchange(store_, nullptr);
  data_ = nullptr;
  size_ = 0;
  return store->Release(range_, access_);
}

// ---------------------------------------------------------------------------
// StateStore

Status StateStore::Exchange(StateRange range, StateMemory& /*buffer*/,
                            std::span<const uint32_t> /*block_crcs*/) {
  STRATA_RETURN_IF_ERROR(CheckRange(range));
  return UnimplementedError("the " + name() + " state store has no buffers to exchange (" +
                            state_name(range.state) +
                            "): write it through an Access::kWrite lease");
}

Result<StateId> StateStore::AddState(std::string name, size_t bytes, size_t chunk_bytes) {
  if (bytes > 0 && chunk_bytes == 0) {
    return InvalidArgumentError("state " + name + ": chunk size 0");
  }
  if (states_.size() >= std::numeric_limits<uint32_t>::max() - 1) {
    return ResourceExhaustedError("state store: too many states");
  }
  StateInfo s;
  s.name = std::move(name);
  s.bytes = bytes;
  s.chunk_bytes = bytes == 0 ? 0 : std::min(chunk_bytes, bytes);
  s.chunks = bytes == 0 ? 0 : (bytes + s.chunk_bytes - 1) / s.chunk_bytes;
  states_.push_back(std::move(s));
  return StateId{static_cast<uint32_t>(states_.size())};
}

Status StateStore::CheckState(StateId state) const {
  if (!state.valid() || state.value > states_.size()) {
    return InvalidArgumentError("state store " + name() + ": unknown state id " +
                                std::to_string(state.value));
  }
  return Status::Ok();
}

Status StateStore::CheckRange(StateRange range) const {
  STRATA_RETURN_IF_ERROR(CheckState(range.state));
  const StateInfo& s = info(range.state);
  if (range.chunk >= s.chunks) {
    return OutOfRangeError("state " + s.name + ": chunk " + std::to_string(range.chunk) + " of " +
                           std::to_string(s.chunks));
  }
  return Status::Ok();
}

size_t StateStore::num_chunks(StateId state) const {
  return state.valid() && state.value <= states_.size() ? info(state).chunks : 0;
}

size_t StateStore::chunk_bytes(StateRange range) const {
  if (!CheckRange(range).ok()) return 0;
  const StateInfo& s = info(range.state);
  return std::min(s.chunk_bytes, s.bytes - range.chunk * s.chunk_bytes);
}

Status StateStore::Zero(StateId state) {
  STRATA_RETURN_IF_ERROR(CheckState(state));
  for (size_t i = 0; i < info(state).chunks; ++i) {
    STRATA_RETURN_IF_ERROR(ZeroChunk({state, i}));
  }
  return Status::Ok();
}

const std::string& StateStore::state_name(StateId state) const {
  static const std::string kUnknown = "(unknown state)";
  return state.valid() && state.value <= states_.size() ? info(state).name : kUnknown;
}

StateLease StateStore::MakeLease(StateStore* store, StateRange range, Access access,
                                 std::byte* data, size_t size) {
  StateLease l;
  l.store_ = store;
  l.range_ = range;
  l.access_ = access;
  l.data_ = data;
  l.size_ = size;
  return l;
}

void FillNaN(std::span<std::byte> bytes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  size_t i = 0;
  for (; i + sizeof(float) <= bytes.size(); i += sizeof(float))
    std::memcpy(bytes.data() + i, &nan, sizeof(float));
  for (; i < bytes.size(); ++i)
    bytes[i] = std::byte{0xff};
}

}  // namespace strata::offload

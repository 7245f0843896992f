#include "strata/offload/nvme/state_store.h"

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

// ---------------------------------------------------------------------------
// HostStateStore

namespace {

void FillNaN(std::byte* p, size_t bytes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  size_t i = 0;
  for (; i + sizeof(float) <= bytes; i += sizeof(float))
    std::memcpy(p + i, &nan, sizeof(float));
  for (; i < bytes; ++i)
    p[i] = std::byte{0xff};
}

class HostStateStore final : public StateStore {
 public:
  HostStateStore(StateAllocator allocator, HostStateStoreOptions options)
      : allocator_(std::move(allocator)), options_(options) {}

  std::string name() const override {
    return options_.relocate ? "host (relocating test mode)" : "host";
  }

  Result<StateId> Register(std::string name, size_t bytes, size_t chunk_bytes) override {
    StateMemory mem;
    if (bytes > 0) {
      STRATA_ASSIGN_OR_RETURN(mem, allocator_(bytes, name));
    }
    STRATA_ASSIGN_OR_RETURN(StateId id, AddState(std::move(name), bytes, chunk_bytes));
    State s;
    s.memory = std::move(mem);
    s.chunks.resize(info(id).chunks);
    stats_.memory_bytes += s.memory.size;
    stats_.states++;
    stats_.chunks += s.chunks.size();
    stats_.state_bytes += bytes;
    // The memory must be zero-filled (allocators promise it; cheap to trust, costly to redo).
    mem_.push_back(std::move(s));
    return id;
  }

  Result<StateLease> Acquire(StateRange range, Access access) override {
    STRATA_RETURN_IF_ERROR(CheckRange(range));
    Chunk& c = chunk(range);
    if (c.held) {
      return FailedPreconditionError("state " + info(range.state).name + ": chunk " +
                                     std::to_string(range.chunk) + " is already held");
    }
    c.held = true;
    ++stats_.acquires;
    return MakeLease(this, range, access, address(range), chunk_bytes(range));
  }

  Status Prefetch(StateRange range) override { return CheckRange(range); }

  Status ZeroChunk(StateRange r) override {
    STRATA_RETURN_IF_ERROR(CheckRange(r));
    if (chunk(r).held) {
      return FailedPreconditionError("state " + info(r.state).name + ": Zero while chunk " +
                                     std::to_string(r.chunk) + " is held");
    }
    std::memset(address(r), 0, chunk_bytes(r));
    return Status::Ok();
  }

  Status Flush() override { return Status::Ok(); }
  // Never writes: the hook is never called.
  Status SetWriteHook(StateId state, WriteHook /*hook*/) override { return CheckState(state); }
  Status Commit() override {
    ++stats_.commits;
    return Status::Ok();
  }
  Status Rollback() override {
    ++stats_.rollbacks;
    return Status::Ok();
  }
  bool can_fail() const override { return false; }
  Status first_error() const override { return Status::Ok(); }
  StateStoreStats stats() const override { return stats_; }

 protected:
  Status Release(StateRange range, Access /*access*/) override {
    Chunk& c = chunk(range);
    c.held = false;
    if (!options_.relocate) return Status::Ok();
    // Move the chunk: copy to a new heap block, poison the old bytes.
    const size_t n = chunk_bytes(range);
    std::byte* old = address(range);
    StateMemory moved;
    if (options_.relocate_allocator) {
      STRATA_ASSIGN_OR_RETURN(moved, options_.relocate_allocator(
                                         n == 0 ? 1 : n, "relocated " + info(range.state).name));
    } else {
      std::shared_ptr<std::byte[]> heap(new std::byte[n == 0 ? 1 : n]);
      moved = StateMemory{heap.get(), n, heap};
    }
    std::memcpy(moved.data, old, n);
    FillNaN(old, n);
    c.moved = std::move(moved);  // frees the previous block, if any
    ++stats_.relocations;
    return Status::Ok();
  }

 private:
  struct Chunk {
    bool held = false;
    StateMemory moved;  // relocate mode: where the chunk lives now (data null: not moved)
  };
  struct State {
    StateMemory memory;
    std::vector<Chunk> chunks;
  };
  Chunk& chunk(StateRange r) { return mem_[r.state.value - 1].chunks[r.chunk]; }
  std::byte* address(StateRange r) {
    Chunk& c = chunk(r);
    if (c.moved.data != nullptr) return c.moved.data;
    return mem_[r.state.value - 1].memory.data + r.chunk * info(r.state).chunk_bytes;
  }

  StateAllocator allocator_;
  HostStateStoreOptions options_;
  std::vector<State> mem_;
  StateStoreStats stats_;
};

}  // namespace

std::unique_ptr<StateStore> MakeHostStateStore(StateAllocator allocator,
                                               HostStateStoreOptions options) {
  return std::make_unique<HostStateStore>(std::move(allocator), options);
}

}  // namespace strata::offload

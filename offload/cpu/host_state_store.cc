#include "strata/offload/cpu/host_state_store.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "strata/core/logging.h"

namespace strata::offload {

namespace {

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
    FillNaN({old, n});
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

#include "strata/offload/nvme/nvme_state_store.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"

namespace strata::offload {

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class NvmeStateStore final : public StateStore {
 public:
  explicit NvmeStateStore(NvmeStateStoreOptions options) : o_(std::move(options)) {}

  ~NvmeStateStore() override {
    // No read or write may run into a buffer that goes away (the futures would wait too).
    Status waited = ForEachChunk([](StateRange, Chunk& c) {
      if (c.io != Io::kNone) Status st = c.future.Wait();
      c.io = Io::kNone;
      return Status::Ok();
    });
    // Buffers the caller still holds (exchanged) outlive the swap space: closing its engine
    // drops their registration, so their owners have nothing left to unregister.
    buffers_.clear();
    std::lock_guard<std::mutex> lock(registry_->mu);
    registry_->swap = nullptr;
  }

  Status Init() {
    if (o_.swap == nullptr) return InvalidArgumentError("NvmeStateStore: no swap space");
    if (o_.buffer_count < 1) {
      return InvalidArgumentError("NvmeStateStore: buffer_count " +
                                  std::to_string(o_.buffer_count) + " must be at least 1");
    }
    if (!o_.allocator) return InvalidArgumentError("NvmeStateStore: no allocator");
    registry_->swap = o_.swap.get();
    for (int i = 0; i < o_.buffer_count; ++i) {
      Buffer b;
      if (o_.max_chunk_bytes > 0) {
        STRATA_ASSIGN_OR_RETURN(b.mem, o_.allocator(IoBytes(o_.max_chunk_bytes),
                                                    "NVMe state buffer " + std::to_string(i) +
                                                        " of " + std::to_string(o_.buffer_count)));
        RegisterWithEngine(b.mem);
      }
      stats_.memory_bytes += b.mem.size;
      buffers_.push_back(std::move(b));
    }
    if (o_.relocate && o_.max_chunk_bytes > 0) {
      // The poison a replaced slot is overwritten with (a test mode: not in the host budget).
      const size_t n = IoBytes(o_.max_chunk_bytes);
      nan_.reset(static_cast<std::byte*>(std::aligned_alloc(4096, n)));
      if (nan_ == nullptr) return ResourceExhaustedError("NvmeStateStore: poison buffer");
      FillNaN({nan_.get(), n});
    }
    return Status::Ok();
  }

  std::string name() const override { return o_.relocate ? "nvme (relocating test mode)" : "nvme"; }

  Result<StateId> Register(std::string name, size_t bytes, size_t chunk_bytes) override {
    if (std::min(chunk_bytes, bytes) > o_.max_chunk_bytes) {
      return InvalidArgumentError("state " + name + ": chunks of " + std::to_string(chunk_bytes) +
                                  " bytes exceed the store's buffers of " +
                                  std::to_string(o_.max_chunk_bytes) + " bytes");
    }
    const std::string label = name;
    STRATA_ASSIGN_OR_RETURN(StateId id, AddState(std::move(name), bytes, chunk_bytes));
    std::vector<Chunk> cs(info(id).chunks);
    for (size_t i = 0; i < cs.size(); ++i) {
      const size_t n = chunk_bytes_of(id, i);
      for (int k = 0; k < 2; ++k) {
        Result<swap::SwapHandle> h = o_.swap->Allocate(IoBytes(n));
        if (!h.ok()) {
          for (size_t j = 0; j <= i; ++j) {
            for (int q = 0; q < 2; ++q) {
              if (cs[j].slot[q].valid()) Status st = o_.swap->Free(cs[j].slot[q]);
            }
          }
          states_.pop_back();
          return h.status().WithContext("swap slots for state " + label + " (" +
                                        FormatBytes(2 * bytes) + " in two slots per chunk)");
        }
        cs[i].slot[k] = *h;
      }
    }
    stats_.states++;
    stats_.chunks += cs.size();
    stats_.state_bytes += bytes;
    chunks_.push_back(std::move(cs));
    return id;
  }

  Result<StateLease> Acquire(StateRange r, Access access) override {
    STRATA_RETURN_IF_ERROR(CheckRange(r));
    STRATA_RETURN_IF_ERROR(error_);
    Chunk& c = chunk(r);
    if (c.held) {
      return FailedPreconditionError(Where(r) + " is already held");
    }
    ++stats_.acquires;
    if (c.read_ahead && access == Access::kWrite) ++stats_.reads_ahead_overwritten;
    c.read_ahead = false;
    if (c.buffer >= 0) {
      if (c.io == Io::kReading && c.prefetched) ++stats_.prefetch_hits;
      // A reader need not wait for the chunk's write: the buffer holds the contents being
      // written, and neither the write nor the reader changes them. (A failed write leaves
      // them in the buffer, dirty.)
      if (access != Access::kRead || c.io != Io::kWriting) {
        STRATA_RETURN_IF_ERROR(WaitIo(r));
      } else {
        ++stats_.reads_beside_write;
      }
    }
    if (c.buffer < 0) {
      STRATA_ASSIGN_OR_RETURN(int b, TakeBuffer());
      // Every buffer held or being read: a read ahead that nobody holds yet gives its buffer
      // up once it ends (the chunk is read again when wanted).
      if (b < 0) {
        STRATA_ASSIGN_OR_RETURN(b, TakeReadAheadBuffer());
      }
      if (b < 0) {
        return ResourceExhaustedError(
            Where(r) + ": all " + std::to_string(o_.buffer_count) +
            " NVMe state buffers are held (raise offload_optimizer.buffer_count)");
      }
      if (access != Access::kWrite) {
        STRATA_RETURN_IF_ERROR(Load(r, b));
        STRATA_RETURN_IF_ERROR(WaitIo(r));
      } else {
        Attach(r, b);
      }
    }
    if (access != Access::kRead) c.crcs.clear();  // the contents may change
    c.held = true;
    c.prefetched = false;
    c.last_use = ++clock_;
    return MakeLease(this, r, access, buffers_[static_cast<size_t>(c.buffer)].mem.data,
                     chunk_bytes(r));
  }

  size_t buffer_bytes() const override {
    return o_.max_chunk_bytes > 0 ? IoBytes(o_.max_chunk_bytes) : 0;
  }

  using StateStore::Exchange;
  Status Exchange(StateRange r, StateMemory& buffer,
                  std::span<const uint32_t> block_crcs) override {
    STRATA_RETURN_IF_ERROR(CheckRange(r));
    if (!block_crcs.empty()) {
      const WriteChecksums w = write_checksums(r);
      if (w.block_bytes == 0) {
        return InvalidArgumentError(Where(r) +
                                    ": block CRCs given but the swap space keeps no checksums "
                                    "(strata.swap_checksums is off); exchange without them");
      }
      if (block_crcs.size() != w.blocks()) {
        return InvalidArgumentError(
            Where(r) + ": " + std::to_string(block_crcs.size()) + " block CRCs for a write of " +
            std::to_string(w.io_bytes) + " bytes in blocks of " + std::to_string(w.block_bytes) +
            " bytes; expected " + std::to_string(w.blocks()) + " (write_checksums)");
      }
    }
    const auto addr = reinterpret_cast<uintptr_t>(buffer.data);
    if (buffer.data == nullptr || buffer.size < buffer_bytes() || !IsAligned(addr, 4096)) {
      return InvalidArgumentError(Where(r) + ": a buffer to exchange must be 4096-byte aligned " +
                                  "and at least " + std::to_string(buffer_bytes()) +
                                  " bytes (the store's buffers); got " +
                                  std::to_string(buffer.size) + " bytes, " +
                                  std::to_string(addr % 4096) + " past a 4096-byte boundary");
    }
    // A whole-chunk write's lease (its read or write ended: the old buffer goes to the
    // caller, who will write into it), with the caller's memory put in its buffer's place.
    STRATA_ASSIGN_OR_RETURN(StateLease lease, Acquire(r, Access::kWrite));
    RegisterWithEngine(buffer);
    std::swap(buffers_[static_cast<size_t>(chunk(r).buffer)].mem, buffer);
    chunk(r).crcs.assign(block_crcs.begin(), block_crcs.end());
    ++stats_.exchanges;
    return lease.Release();
  }

  WriteChecksums write_checksums(StateRange r) const override {
    if (!o_.swap->checksums() || !CheckRange(r).ok()) return {};
    return {o_.swap->block_size(), IoBytes(chunk_bytes(r))};
  }

  Status Prefetch(StateRange r) override {
    STRATA_RETURN_IF_ERROR(CheckRange(r));
    STRATA_RETURN_IF_ERROR(error_);
    Chunk& c = chunk(r);
    if (c.held) return Status::Ok();
    if (c.buffer >= 0) {
      // Resident: its user is next, so it is evicted last (as if brought in now).
      c.prefetched = true;
      c.last_use = ++clock_;
      return Status::Ok();
    }
    STRATA_ASSIGN_OR_RETURN(int b, TakeBuffer());
    if (b < 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(Load(r, b));
    c.prefetched = c.io == Io::kReading;
    c.read_ahead = c.prefetched;
    if (c.prefetched) ++stats_.prefetches;
    c.last_use = ++clock_;
    return Status::Ok();
  }

  Status ZeroChunk(StateRange r) override {
    STRATA_RETURN_IF_ERROR(CheckRange(r));
    Chunk& c = chunk(r);
    if (c.held) return FailedPreconditionError("Zero of " + Where(r) + " while it is held");
    // A read or write of the old contents may still use the buffer: let it end (an error
    // of it is kept; zeros need neither).
    Status st = WaitIo(r);
    Detach(r);
    c.modified = true;
    c.pending_zero = true;
    c.pending_written = false;
    c.dirty = false;
    return Status::Ok();
  }

  Status Flush() override {
    // Write what is modified and not yet written, then wait for every write.
    STRATA_RETURN_IF_ERROR(ForEachChunk([&](StateRange r, Chunk& c) -> Status {
      if (c.held) return FailedPreconditionError("Commit while " + Where(r) + " is held");
      if (c.dirty && c.io == Io::kNone) StartWrite(r);
      return Status::Ok();
    }));
    const double t0 = Now();
    Status waited = ForEachChunk([&](StateRange r, Chunk&) -> Status {
      Status st = WaitIo(r);  // kept in error_
      return Status::Ok();
    });
    stats_.write_wait_s += Now() - t0;
    return error_;
  }

  Status Commit() override {
    STRATA_RETURN_IF_ERROR(Flush());
    STRATA_RETURN_IF_ERROR(ForEachChunk([&](StateRange r, Chunk& c) -> Status {
      if (!c.modified) return Status::Ok();
      const int replaced = c.committed;
      if (c.pending_zero) {
        c.committed_zero = true;
      } else if (c.pending_written) {
        c.committed = 1 - c.committed;
        c.committed_zero = false;
      } else {
        return InternalError(Where(r) + ": modified but neither written nor zero at Commit");
      }
      c.modified = c.pending_zero = c.pending_written = false;
      // The relocating test mode: the contents this commit replaced are gone from disk too.
      if (o_.relocate) Poison(r, c.slot[replaced], "the committed slot it replaced");
      return Status::Ok();
    }));
    ++stats_.commits;
    return Status::Ok();
  }

  Status Rollback() override {
    STRATA_RETURN_IF_ERROR(ForEachChunk([&](StateRange r, Chunk& c) -> Status {
      if (c.held) return FailedPreconditionError("Rollback while " + Where(r) + " is held");
      Status st = WaitIo(r);
      if (c.modified) {
        Detach(r);
        const bool written = c.pending_written;
        c.modified = c.pending_zero = c.pending_written = c.dirty = false;
        if (o_.relocate && written) Poison(r, c.slot[1 - c.committed], "the rolled back slot");
      }
      return Status::Ok();
    }));
    error_ = Status::Ok();
    ++stats_.rollbacks;
    return Status::Ok();
  }

  void SetWriteBehind(bool on) override { write_behind_enabled_ = on; }
  Status SetWriteHook(StateId state, WriteHook hook) override {
    STRATA_RETURN_IF_ERROR(CheckState(state));
    hooks_.resize(chunks_.size());
    hooks_[state.value - 1] = std::move(hook);
    return Status::Ok();
  }
  bool can_fail() const override { return true; }
  Status first_error() const override { return error_; }
  StateStoreStats stats() const override {
    StateStoreStats s = stats_;
    const swap::SwapSpaceStats space = o_.swap->stats();
    s.bounced_bytes = space.bounced_bytes;
    s.swap_bytes = space.capacity;
    s.fixed_buffer_ios = o_.swap->engine().stats().fixed_buffer_ops;
    {
      std::lock_guard<std::mutex> lock(registry_->mu);
      s.registered_buffers = registry_->bases.size();
    }
    return s;
  }

 protected:
  Status Release(StateRange r, Access access) override {
    Chunk& c = chunk(r);
    c.held = false;
    if (access != Access::kRead) {
      c.modified = true;
      c.pending_zero = false;
      c.pending_written = false;
      c.dirty = true;
      if (o_.relocate || (o_.write_behind && write_behind_enabled_)) StartWrite(r);
    }
    if (o_.relocate) {
      // The relocating test mode: the chunk goes to disk now (a fresh slot), and its buffer
      // is poisoned and given up, so the next lease reads it back. A failed write keeps the
      // buffer (the contents are only there; the error is kept).
      if (Status st = WaitIo(r); !st.ok()) return st;
      if (c.buffer >= 0 && !c.dirty) {
        FillNaN({buffers_[static_cast<size_t>(c.buffer)].mem.data,
                 buffers_[static_cast<size_t>(c.buffer)].mem.size});
        Detach(r);
      }
    }
    return error_;
  }

 private:
  enum class Io : uint8_t { kNone, kReading, kWriting };
  struct Chunk {
    swap::SwapHandle slot[2];
    // Committed contents: zeros, or slot[committed].
    int committed = 0;
    bool committed_zero = true;
    // The epoch's contents (modified): zeros, or in the buffer (dirty) and/or written to
    // slot[1 - committed] (pending_written).
    bool modified = false;
    bool pending_zero = false;
    bool pending_written = false;
    // The relocating test mode: the fresh slot the write in flight goes to; it replaces
    // slot[1 - committed] when the write succeeds.
    swap::SwapHandle relocating_to;
    // Residency: the buffer holds the current contents once io ended (a read done).
    int buffer = -1;
    bool dirty = false;  // the buffer holds contents not yet written anywhere
    bool held = false;
    Io io = Io::kNone;
    swap::SwapFuture future;
    bool prefetched = false;
    bool read_ahead = false;  // a Prefetch read it, and no lease has held it since
    uint64_t last_use = 0;
    // The buffer's block CRCs for its next write, from Exchange (empty: the write computes
    // them); dropped by a lease that may modify the chunk and when the buffer goes.
    std::vector<uint32_t> crcs;
  };
  struct Buffer {
    StateMemory mem;
    StateRange owner;  // owner.state invalid: free
  };

  Chunk& chunk(StateRange r) { return chunks_[r.state.value - 1][r.chunk]; }
  // fn(range, chunk) for every chunk of every state; stops at the first error.
  template <typename Fn>
  Status ForEachChunk(Fn fn) {
    for (size_t s = 0; s < chunks_.size(); ++s) {
      for (size_t i = 0; i < chunks_[s].size(); ++i) {
        const StateRange r{StateId{static_cast<uint32_t>(s + 1)}, i};
        STRATA_RETURN_IF_ERROR(fn(r, chunks_[s][i]));
      }
    }
    return Status::Ok();
  }
  size_t chunk_bytes_of(StateId id, size_t i) const {
    const StateInfo& s = info(id);
    return std::min(s.chunk_bytes, s.bytes - i * s.chunk_bytes);
  }
  std::string Where(StateRange r) const {
    return "state " + info(r.state).name + " chunk " + std::to_string(r.chunk);
  }
  void Fail(Status s) {
    if (error_.ok()) error_ = std::move(s);
  }
  void Notify(StateEvent::Kind k, StateRange r) {
    if (o_.observer) o_.observer(StateEvent{k, r});
  }
  std::span<std::byte> BufferSpan(StateRange r) {
    return {buffers_[static_cast<size_t>(chunk(r).buffer)].mem.data, chunk_bytes(r)};
  }
  // What a chunk's I/O moves: its bytes rounded up to 4 KiB, so O_DIRECT transfers go
  // straight from the (4 KiB aligned) buffers without a bounce buffer outside the host
  // budget. The tail past the chunk is the buffer's own bytes; nobody reads it.
  static size_t IoBytes(size_t n) { return (n + 4095) / 4096 * 4096; }
  std::span<std::byte> IoSpan(StateRange r) {
    return {buffers_[static_cast<size_t>(chunk(r).buffer)].mem.data, IoBytes(chunk_bytes(r))};
  }

  void Attach(StateRange r, int b) {
    chunk(r).buffer = b;
    buffers_[static_cast<size_t>(b)].owner = r;
  }
  // REQUIRES: no I/O of the chunk in flight.
  void Detach(StateRange r) {
    Chunk& c = chunk(r);
    if (c.buffer >= 0) buffers_[static_cast<size_t>(c.buffer)].owner = StateRange{};
    c.buffer = -1;
    c.prefetched = false;
    c.read_ahead = false;
    c.crcs.clear();
  }

  // Ends the chunk's read or write. A failed read drops the buffer; a failed write leaves
  // the contents dirty. Errors are kept (Fail) and returned.
  Status WaitIo(StateRange r) {
    Chunk& c = chunk(r);
    if (c.io == Io::kNone) return Status::Ok();
    const Io io = c.io;
    const double t0 = Now();
    Status st = c.future.Wait();
    c.future = swap::SwapFuture();
    c.io = Io::kNone;
    if (io == Io::kReading) {
      stats_.read_wait_s += Now() - t0;
      Notify(StateEvent::kReadDone, r);
      if (!st.ok()) {
        Detach(r);
        st = st.WithContext("reading " + Where(r));
        if (st.code() == StatusCode::kDataLoss) {
          // A block that fails its CRC32C is corrupt on disk, not in flight: reading it again
          // gives the same bytes, and nothing in this process holds another copy.
          st = Status(StatusCode::kDataLoss,
                      st.message() +
                          " (persistent corruption of the swap file: resume from the "
                          "last checkpoint)");
        }
        Fail(st);
        return st;
      }
      ++stats_.reads;
      stats_.read_bytes += IoBytes(chunk_bytes(r));
      return Status::Ok();
    }
    stats_.write_wait_s += Now() - t0;
    Notify(StateEvent::kWriteDone, r);
    const swap::SwapHandle fresh = std::exchange(c.relocating_to, {});
    if (!st.ok()) {
      c.dirty = true;
      if (fresh.valid()) Status freed = o_.swap->Free(fresh);
      st = st.WithContext("writing " + Where(r) + " (its committed contents are intact)");
      Fail(st);
      return st;
    }
    if (fresh.valid()) {
      // The relocating test mode: the chunk's epoch contents now live in `fresh`; the slot
      // it replaces (an earlier write of this epoch, or stale) is poisoned and freed.
      const swap::SwapHandle replaced = std::exchange(c.slot[1 - c.committed], fresh);
      Poison(r, replaced, "the slot it was moved from");
      if (Status freed = o_.swap->Free(replaced); !freed.ok()) {
        Fail(freed.WithContext("freeing the slot " + Where(r) + " was moved from"));
        return error_;
      }
      ++stats_.relocations;
    }
    c.pending_written = true;
    ++stats_.writes;
    stats_.write_bytes += IoBytes(chunk_bytes(r));
    return Status::Ok();
  }

  // Submits the write of a dirty resident chunk to its other slot.
  void StartWrite(StateRange r) {
    Chunk& c = chunk(r);
    if (!c.dirty || c.buffer < 0 || c.io != Io::kNone) return;
    if (r.state.value <= hooks_.size() && hooks_[r.state.value - 1]) {
      hooks_[r.state.value - 1](r.chunk, BufferSpan(r));
    }
    // The caller's CRCs are for this write only: a failed write leaves the chunk dirty, and
    // writing it again computes them from the buffer.
    const std::vector<uint32_t> crcs = std::exchange(c.crcs, {});
    swap::SwapHandle target = c.slot[1 - c.committed];
    if (o_.relocate) {
      // The relocating test mode: a fresh slot, which is never one the chunk had.
      Result<swap::SwapHandle> fresh = o_.swap->Allocate(IoBytes(chunk_bytes(r)));
      if (!fresh.ok()) {
        Fail(
            fresh.status().WithContext("a fresh slot for " + Where(r) + " (relocating test mode)"));
        return;
      }
      target = c.relocating_to = *fresh;
    }
    Result<swap::SwapFuture> f = o_.swap->WriteAsync(target, IoSpan(r), crcs);
    if (!crcs.empty() && f.ok()) ++stats_.writes_with_given_crcs;
    if (!f.ok()) {
      if (c.relocating_to.valid()) {
        Status freed = o_.swap->Free(std::exchange(c.relocating_to, {}));
      }
      Fail(f.status().WithContext("writing " + Where(r) + " (its committed contents are intact)"));
      return;
    }
    c.future = std::move(*f);
    c.io = Io::kWriting;
    c.dirty = false;
    Notify(StateEvent::kWriteSubmitted, r);
  }

  // Brings the chunk's current contents into buffer b: zeros at once, else a read is
  // submitted (io = kReading).
  Status Load(StateRange r, int b) {
    Chunk& c = chunk(r);
    Attach(r, b);
    const bool zero = c.modified ? c.pending_zero : c.committed_zero;
    if (zero) {
      std::memset(BufferSpan(r).data(), 0, chunk_bytes(r));
      ++stats_.zero_fills;
      return Status::Ok();
    }
    if (c.modified && !c.pending_written) {
      Detach(r);
      Status st = DataLossError(Where(r) +
                                ": its contents of this step were lost with a failed "
                                "write (roll back to the last step)");
      Fail(st);
      return st;
    }
    const int slot = c.modified ? 1 - c.committed : c.committed;
    Result<swap::SwapFuture> f = o_.swap->ReadAsync(c.slot[slot], IoSpan(r));
    if (!f.ok()) {
      Detach(r);
      Status st = f.status().WithContext("reading " + Where(r));
      Fail(st);
      return st;
    }
    c.future = std::move(*f);
    c.io = Io::kReading;
    Notify(StateEvent::kReadSubmitted, r);
    return Status::Ok();
  }

  // A buffer being read ahead (Prefetch) and not held, once its read ended: the one wanted
  // last (the latest prefetch). -1: none (every buffer is held).
  Result<int> TakeReadAheadBuffer() {
    int best = -1;
    uint64_t best_use = 0;
    for (size_t b = 0; b < buffers_.size(); ++b) {
      const Chunk& c = chunk(buffers_[b].owner);
      if (c.held || c.io != Io::kReading) continue;
      if (best < 0 || c.last_use > best_use) {
        best = static_cast<int>(b);
        best_use = c.last_use;
      }
    }
    if (best < 0) return -1;
    const StateRange victim = buffers_[static_cast<size_t>(best)].owner;
    STRATA_RETURN_IF_ERROR(WaitIo(victim));
    Detach(victim);
    ++stats_.evictions;
    ++stats_.reads_ahead_given_up;
    return best;
  }

  // A buffer for a chunk: a free one, else the least recently used chunk's that is not held
  // or being read, clean ones first (then waiting for a write to end, then writing a
  // modified one first, then a prefetched one). -1: none (every buffer held or being read).
  Result<int> TakeBuffer() {
    for (size_t b = 0; b < buffers_.size(); ++b) {
      if (!buffers_[b].owner.state.valid()) return static_cast<int>(b);
    }
    int best = -1;
    int best_rank = 4;
    uint64_t best_use = 0;
    for (size_t b = 0; b < buffers_.size(); ++b) {
      const StateRange owner = buffers_[b].owner;
      const Chunk& c = chunk(owner);
      if (c.held || c.io == Io::kReading) continue;
      // 0: clean and idle, 1: being written (the oldest write first), 2: modified (needs a
      // write first), 3: brought in by a Prefetch and not acquired yet (its user is next).
      const int rank = c.prefetched ? 3 : c.io == Io::kWriting ? 1 : c.dirty ? 2 : 0;
      if (rank < best_rank || (rank == best_rank && c.last_use < best_use)) {
        best = static_cast<int>(b);
        best_rank = rank;
        best_use = c.last_use;
      }
    }
    if (best < 0) return -1;
    const StateRange victim = buffers_[static_cast<size_t>(best)].owner;
    StartWrite(victim);  // a modified chunk (any rank) is written before its buffer goes
    STRATA_RETURN_IF_ERROR(WaitIo(victim));
    STRATA_RETURN_IF_ERROR(error_);
    Detach(victim);
    ++stats_.evictions;
    return best;
  }

  // The relocating test mode: overwrites slot `h` (a slot of chunk r that no longer holds
  // its contents) with NaN bytes, waiting for the write. Nothing depends on it: a failure
  // (an injected fault, a full disk) is logged and the stale bytes stay.
  void Poison(StateRange r, swap::SwapHandle h, std::string_view which) {
    Result<uint64_t> n = o_.swap->Size(h);
    Status st = n.ok() ? o_.swap->Write(h, {nan_.get(), *n}) : n.status();
    if (!st.ok()) {
      STRATA_LOG(kWarn) << "NVMe state store (relocating test mode): poisoning " << which << " of "
                        << Where(r) << " failed (its stale bytes stay): " << st;
    }
  }

  // Registered memory, shared with the owners of registered buffers (which may outlive the
  // store: Exchange hands them to the caller).
  struct Registry {
    std::mutex mu;
    swap::SwapSpace* swap = nullptr;  // null once the store is gone
    std::set<const std::byte*> bases;
  };
  // Registers `m` with the swap space's engine for fixed-buffer transfers, once: its owner
  // becomes one that unregisters it before freeing the memory. A refusal is logged.
  void RegisterWithEngine(StateMemory& m) {
    if (m.data == nullptr || m.size == 0 || !o_.swap->engine().options().fixed_buffers) return;
    std::lock_guard<std::mutex> lock(registry_->mu);
    if (registry_->bases.count(m.data) != 0) return;
    Result<int> id = o_.swap->RegisterBuffer({m.data, m.size});
    if (!id.ok()) {
      STRATA_LOG(kWarn) << "NVMe state store: a buffer of " << FormatBytes(m.size)
                        << " is used without registration: " << id.status();
      return;
    }
    registry_->bases.insert(m.data);
    m.owner = std::shared_ptr<void>(
        m.data, [registry = registry_, id = *id, inner = std::move(m.owner)](void* p) mutable {
          {
            std::lock_guard<std::mutex> held(registry->mu);
            registry->bases.erase(static_cast<const std::byte*>(p));
            if (registry->swap != nullptr) {
              Status st = registry->swap->UnregisterBuffer(id);
              if (!st.ok()) STRATA_LOG(kWarn) << "NVMe state store: " << st;
            }
          }
          inner.reset();  // frees the memory, after its registration
        });
  }

  NvmeStateStoreOptions o_;
  std::shared_ptr<Registry> registry_ = std::make_shared<Registry>();
  struct FreeDeleter {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, FreeDeleter> nan_;  // relocating test mode: the poison
  std::vector<Buffer> buffers_;
  std::vector<std::vector<Chunk>> chunks_;  // [state][chunk]
  uint64_t clock_ = 0;
  bool write_behind_enabled_ = true;
  std::vector<WriteHook> hooks_;  // [state]
  Status error_;
  StateStoreStats stats_;
};

}  // namespace

Result<std::unique_ptr<StateStore>> MakeNvmeStateStore(NvmeStateStoreOptions options) {
  auto store = std::make_unique<NvmeStateStore>(std::move(options));
  STRATA_RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<StateStore>(std::move(store));
}

}  // namespace strata::offload

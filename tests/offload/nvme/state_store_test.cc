// The state stores (offload/cpu/state_store.h and host_state_store.h,
// offload/nvme/nvme_state_store.h): contents survive eviction and commits, zeros need no I/O,
// the relocating test mode moves chunks and poisons the old bytes, the pipeline's reads and
// writes come in the promised order, and every fault is an error that leaves the committed
// contents intact.
#include "strata/offload/cpu/state_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../../swap/test_util.h"
#include "strata/offload/cpu/host_pool.h"
#include "strata/offload/cpu/host_state_store.h"
#include "strata/offload/nvme/nvme_state_store.h"
#include "strata/swap/crc32c.h"
#include "strata/swap/fault_injection.h"
#include "strata/swap/swap_space.h"

namespace strata::offload {
namespace {

using swap::testing::ScratchDir;

// Zero-filled, 4 KiB aligned heap memory.
StateAllocator HeapAllocator(uint64_t* allocated = nullptr) {
  return [allocated](size_t bytes, std::string_view) -> Result<StateMemory> {
    const size_t n = (bytes + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, n);
    if (p == nullptr) return ResourceExhaustedError("aligned_alloc");
    std::memset(p, 0, n);
    if (allocated != nullptr) *allocated += n;
    return StateMemory{static_cast<std::byte*>(p), bytes,
                       std::shared_ptr<void>(p, [](void* q) { std::free(q); })};
  };
}

// Chunk `c` of state `s`: float values no other chunk has.
float Value(int s, size_t c, size_t i, int version) {
  return static_cast<float>(s * 100000 + static_cast<int>(c) * 1000 + static_cast<int>(i)) +
         0.25f * static_cast<float>(version);
}

void Fill(StateStore& store, StateId id, int s, int version) {
  for (size_t c = 0; c < store.num_chunks(id); ++c) {
    Result<StateLease> l = store.Acquire({id, c}, Access::kWrite);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    std::span<float> f = l->as<float>();
    for (size_t i = 0; i < f.size(); ++i)
      f[i] = Value(s, c, i, version);
    ASSERT_TRUE(l->Release().ok());
  }
}

void Expect(StateStore& store, StateId id, int s, int version) {
  for (size_t c = 0; c < store.num_chunks(id); ++c) {
    Result<StateLease> l = store.Acquire({id, c}, Access::kRead);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    std::span<float> f = l->as<float>();
    for (size_t i = 0; i < f.size(); ++i) {
      const float want = version < 0 ? 0.0f : Value(s, c, i, version);
      ASSERT_EQ(f[i], want) << store.state_name(id) << " chunk " << c << " element " << i;
    }
  }
}

struct Nvme {
  ScratchDir dir;
  swap::FaultInjectingIoEngine* faults = nullptr;
  std::vector<StateEvent> events;
  std::unique_ptr<StateStore> store;
};

std::unique_ptr<Nvme> MakeNvme(int buffers, size_t max_chunk, bool write_behind,
                               uint64_t* allocated = nullptr, bool checksums = true,
                               bool relocate = false) {
  auto n = std::make_unique<Nvme>();
  EXPECT_TRUE(n->dir.ok());
  swap::SwapSpaceOptions so;
  so.directories = {n->dir.path()};
  so.block_size = 4096;
  so.checksums = checksums;
  if (relocate) so.grow_bytes = 1 << 20;  // small files: the test reads them whole
  swap::FaultInjectingIoEngine** faults = &n->faults;
  so.engine_factory =
      [faults](const swap::IoEngineOptions& io) -> Result<std::unique_ptr<swap::IoEngine>> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::FaultInjectingIoEngine> e,
                            swap::FaultInjectingIoEngine::Create(io, 1));
    *faults = e.get();
    return std::unique_ptr<swap::IoEngine>(std::move(e));
  };
  Result<std::unique_ptr<swap::SwapSpace>> space = swap::SwapSpace::Create(so);
  EXPECT_TRUE(space.ok()) << space.status().ToString();
  if (!space.ok()) return nullptr;
  NvmeStateStoreOptions o;
  o.swap = std::move(*space);
  o.buffer_count = buffers;
  o.max_chunk_bytes = max_chunk;
  o.allocator = HeapAllocator(allocated);
  o.write_behind = write_behind;
  std::vector<StateEvent>* events = &n->events;
  o.observer = [events](const StateEvent& e) { events->push_back(e); };
  o.relocate = relocate;
  Result<std::unique_ptr<StateStore>> store = MakeNvmeStateStore(std::move(o));
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  if (!store.ok()) return nullptr;
  n->store = std::move(*store);
  return n;
}

TEST(HostStateStoreTest, ChunksKeepTheirContentsAndZeroClearsThem) {
  auto store = MakeHostStateStore(HeapAllocator());
  Result<StateId> a = store->Register("a", 10 * 4096 + 8, 4096);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(store->num_chunks(*a), 11u);
  EXPECT_EQ(store->chunk_bytes({*a, 10}), 8u);
  Expect(*store, *a, 1, -1);  // registered zero-filled
  Fill(*store, *a, 1, 0);
  Expect(*store, *a, 1, 0);
  ASSERT_TRUE(store->Zero(*a).ok());
  Expect(*store, *a, 1, -1);
  EXPECT_FALSE(store->can_fail());
}

TEST(HostStateStoreTest, AChunkIsHeldOnceAndRangesAreChecked) {
  auto store = MakeHostStateStore(HeapAllocator());
  Result<StateId> a = store->Register("master", 4096, 1024);
  ASSERT_TRUE(a.ok());
  Result<StateLease> l = store->Acquire({*a, 1}, Access::kReadWrite);
  ASSERT_TRUE(l.ok());
  Result<StateLease> again = store->Acquire({*a, 1}, Access::kRead);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("master"), std::string::npos);
  EXPECT_EQ(store->Zero(*a).code(), StatusCode::kFailedPrecondition);
  Result<StateLease> out = store->Acquire({*a, 4}, Access::kRead);
  EXPECT_EQ(out.status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(store->Acquire({StateId{9}, 0}, Access::kRead).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(HostStateStoreTest, RelocateModeMovesEveryChunkAndPoisonsTheOldBytes) {
  auto store = MakeHostStateStore(HeapAllocator(), {.relocate = true, .relocate_allocator = {}});
  Result<StateId> a = store->Register("m", 3 * 1024, 1024);
  ASSERT_TRUE(a.ok());
  // The first lease of a chunk points into the state's own allocation, which stays mapped:
  // a pointer kept past its lease reads NaN there.
  Result<StateLease> l = store->Acquire({*a, 1}, Access::kWrite);
  ASSERT_TRUE(l.ok());
  float* before = l->as<float>().data();
  for (size_t i = 0; i < l->as<float>().size(); ++i)
    l->as<float>()[i] = Value(2, 1, i, 0);
  ASSERT_TRUE(l->Release().ok());
  EXPECT_TRUE(std::isnan(before[0]));
  EXPECT_TRUE(std::isnan(before[255]));
  Result<StateLease> l2 = store->Acquire({*a, 1}, Access::kRead);
  ASSERT_TRUE(l2.ok());
  EXPECT_NE(l2->as<float>().data(), before);
  EXPECT_EQ(l2->as<float>()[5], Value(2, 1, 5, 0));
  ASSERT_TRUE(l2->Release().ok());
  Fill(*store, *a, 2, 0);
  Expect(*store, *a, 2, 0);
  EXPECT_GE(store->stats().relocations, 6u);
}

TEST(NvmeStateStoreTest, ContentsSurviveEvictionAndCommit) {
  uint64_t allocated = 0;
  auto n = MakeNvme(/*buffers=*/4, 16384, /*write_behind=*/false, &allocated);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  std::vector<StateId> ids;
  for (int k = 0; k < 3; ++k) {
    Result<StateId> id = s.Register("state" + std::to_string(k), 5 * 16384, 16384);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(*id);
  }
  // 15 chunks of 16 KiB through 4 buffers: the host memory is the buffers, whatever the
  // size of the states.
  EXPECT_EQ(allocated, 4u * 16384);
  for (int k = 0; k < 3; ++k)
    Expect(s, ids[static_cast<size_t>(k)], k, -1);
  EXPECT_EQ(s.stats().reads, 0u);  // zeros were never read
  for (int k = 0; k < 3; ++k)
    Fill(s, ids[static_cast<size_t>(k)], k, 1);
  ASSERT_TRUE(s.Commit().ok());
  for (int k = 0; k < 3; ++k)
    Expect(s, ids[static_cast<size_t>(k)], k, 1);
  const StateStoreStats st = s.stats();
  EXPECT_EQ(st.writes, 15u);
  EXPECT_GE(st.reads, 11u);  // at most the 4 last written stayed in their buffers
  EXPECT_GT(st.evictions, 0u);
  // A second epoch, then zeros for one state: no I/O for them.
  Fill(s, ids[0], 0, 2);
  ASSERT_TRUE(s.Zero(ids[1]).ok());
  ASSERT_TRUE(s.Commit().ok());
  const uint64_t reads = s.stats().reads;
  Expect(s, ids[1], 1, -1);
  EXPECT_EQ(s.stats().reads, reads);
  Expect(s, ids[0], 0, 2);
  Expect(s, ids[2], 2, 1);
}

TEST(NvmeStateStoreTest, RollbackReturnsToTheCommittedContents) {
  auto n = MakeNvme(4, 4096, false);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("master", 6 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  Fill(s, *id, 0, 2);
  ASSERT_TRUE(s.Rollback().ok());
  Expect(s, *id, 0, 1);
}

TEST(NvmeStateStoreTest, AFailedWriteIsKeptAndLeavesTheCommittedContents) {
  auto n = MakeNvme(2, 4096, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store && n->faults);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("exp_avg", 4 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  // The next write fails with ENOSPC: every later call reports it, naming the state.
  ASSERT_TRUE(n->faults->AddRule(swap::FaultRule::Error(ENOSPC).OnOp(swap::IoOp::kWrite)).ok());
  for (size_t c = 0; c < s.num_chunks(*id); ++c) {
    Result<StateLease> l = s.Acquire({*id, c}, Access::kWrite);
    if (!l.ok()) break;
    std::span<float> f = l->as<float>();
    for (size_t i = 0; i < f.size(); ++i)
      f[i] = -1.0f;
    Status r = l->Release();
  }
  Status commit = s.Commit();
  ASSERT_FALSE(commit.ok());
  EXPECT_NE(commit.message().find("exp_avg"), std::string::npos) << commit.ToString();
  EXPECT_NE(commit.message().find("intact"), std::string::npos) << commit.ToString();
  EXPECT_FALSE(s.first_error().ok());
  EXPECT_FALSE(s.Acquire({*id, 0}, Access::kRead).ok());
  n->faults->ClearRules();
  ASSERT_TRUE(s.Rollback().ok());
  EXPECT_TRUE(s.first_error().ok());
  Expect(s, *id, 0, 1);
}

TEST(NvmeStateStoreTest, AFlippedBitIsDataLossNamingTheStateAndFile) {
  auto n = MakeNvme(1, 4096, false);
  ASSERT_TRUE(n && n->store && n->faults);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("fp32 master", 2 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  ASSERT_TRUE(n->faults->AddRule(swap::FaultRule::CorruptRead(17).OnOp(swap::IoOp::kRead)).ok());
  // One buffer: chunk 1 is resident, chunk 0 must be read.
  Result<StateLease> l = s.Acquire({*id, 0}, Access::kRead);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kDataLoss) << l.status().ToString();
  EXPECT_NE(l.status().message().find("fp32 master chunk 0"), std::string::npos);
  EXPECT_NE(l.status().message().find("strata-swap-"), std::string::npos);
  n->faults->ClearRules();
  ASSERT_TRUE(s.Rollback().ok());
  Expect(s, *id, 0, 1);
}

TEST(NvmeStateStoreTest, PrefetchReadsAheadAndWriteBehindOverlapsTheNextChunk) {
  auto n = MakeNvme(3, 4096, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("v", 6 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  n->events.clear();
  // The pipeline: prefetch(i+1), update(i), release(i) (its write starts at once).
  ASSERT_TRUE(s.Prefetch({*id, 0}).ok());
  std::vector<size_t> events_at_update;
  for (size_t i = 0; i < 6; ++i) {
    Result<StateLease> l = s.Acquire({*id, i}, Access::kReadWrite);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    if (i + 1 < 6) {
      ASSERT_TRUE(s.Prefetch({*id, i + 1}).ok());
    }
    events_at_update.push_back(n->events.size());
    for (float& x : l->as<float>())
      x += 1.0f;
    ASSERT_TRUE(l->Release().ok());
  }
  ASSERT_TRUE(s.Commit().ok());
  // Before update(i): read(i+1) submitted; write(i-1) submitted and not yet waited for.
  for (size_t i = 1; i + 1 < 6; ++i) {
    bool read_next = false, write_prev = false, write_prev_done = false;
    for (size_t e = 0; e < events_at_update[i]; ++e) {
      const StateEvent& ev = n->events[e];
      if (ev.kind == StateEvent::kReadSubmitted && ev.range.chunk == i + 1) read_next = true;
      if (ev.kind == StateEvent::kWriteSubmitted && ev.range.chunk == i - 1) write_prev = true;
      if (ev.kind == StateEvent::kWriteDone && ev.range.chunk == i - 1) write_prev_done = true;
    }
    EXPECT_TRUE(read_next) << "update " << i;
    EXPECT_TRUE(write_prev) << "update " << i;
    EXPECT_FALSE(write_prev_done) << "update " << i;
  }
  EXPECT_GE(s.stats().prefetch_hits, 5u);
  Expect(s, *id, 0, 5);  // version 1 + 1.0 = Value(..., 1) + 1 == Value(..., 5)
}

TEST(NvmeStateStoreTest, WriteBehindOffKeepsModifiedChunksAndTheHookSeesWhatIsWritten) {
  auto n = MakeNvme(2, 4096, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("acc", 3 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  std::vector<std::pair<size_t, float>> hooked;
  ASSERT_TRUE(s.SetWriteHook(*id, [&](size_t chunk, std::span<const std::byte> bytes) {
                 float first;
                 std::memcpy(&first, bytes.data(), sizeof first);
                 hooked.emplace_back(chunk, first);
               }).ok());
  EXPECT_EQ(s.SetWriteHook(StateId{7}, {}).code(), StatusCode::kInvalidArgument);
  s.SetWriteBehind(false);
  // Chunk 0 modified twice while it stays in its buffer: no write.
  for (int k = 1; k <= 2; ++k) {
    Result<StateLease> l = s.Acquire({*id, 0}, Access::kReadWrite);
    ASSERT_TRUE(l.ok());
    l->as<float>()[0] += 1.0f;
    ASSERT_TRUE(l->Release().ok());
  }
  EXPECT_EQ(s.stats().writes, 0u);
  EXPECT_TRUE(hooked.empty());
  // Two more chunks through two buffers: chunk 0 is written out to make room, and the hook
  // sees its contents as written.
  Fill(s, *id, 0, 1);
  ASSERT_EQ(hooked.size(), 1u);  // chunk 0, for chunk 2's buffer
  EXPECT_EQ(hooked[0].first, 0u);
  EXPECT_EQ(hooked[0].second, Value(0, 0, 0, 1));  // what Fill left in it
  s.SetWriteBehind(true);
  Result<StateLease> l = s.Acquire({*id, 2}, Access::kReadWrite);
  ASSERT_TRUE(l.ok());
  ASSERT_TRUE(l->Release().ok());
  EXPECT_EQ(hooked.back().first, 2u);  // written at release
  ASSERT_TRUE(s.Commit().ok());
  ASSERT_EQ(hooked.size(), 3u);  // chunk 1 at the commit
  EXPECT_EQ(hooked.back().first, 1u);
  Expect(s, *id, 0, 1);
}

// A chunk read right after it was modified (the pipelined step's new working shard, read
// by the forward as soon as it is handed over) is read beside its write, not after it:
// the buffer holds what is being written. Modifying it waits for the write; a write that
// fails meanwhile leaves the reader's bytes as they were and is reported as ever.
TEST(NvmeStateStoreTest, AReaderOfAChunkBeingWrittenDoesNotWaitForTheWrite) {
  auto n = MakeNvme(2, 4096, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store && n->faults);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("working shard", 2 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  // Every write takes at least 100 ms, so "not waited for" is also "still in flight".
  ASSERT_TRUE(
      n->faults
          ->AddRule(swap::FaultRule::Delay(std::chrono::milliseconds(100)).OnOp(swap::IoOp::kWrite))
          .ok());
  auto waited = [&](size_t chunk) {
    for (const StateEvent& ev : n->events)
      if (ev.kind == StateEvent::kWriteDone && ev.range.chunk == chunk) return true;
    return false;
  };
  n->events.clear();
  Fill(s, *id, 0, 1);  // both chunks written behind at their release
  ASSERT_FALSE(waited(0));
  {
    Result<StateLease> l = s.Acquire({*id, 0}, Access::kRead);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_FALSE(waited(0)) << "the read waited for the chunk's write";
    std::span<float> f = l->as<float>();
    for (size_t i = 0; i < f.size(); ++i)
      ASSERT_EQ(f[i], Value(0, 0, i, 1)) << i;
    ASSERT_TRUE(l->Release().ok());
  }
  EXPECT_EQ(s.stats().reads_beside_write, 1u);
  {
    // To modify it, the write must have ended (else the disk could get the new bytes).
    Result<StateLease> l = s.Acquire({*id, 0}, Access::kReadWrite);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_TRUE(waited(0));
    ASSERT_TRUE(l->Release().ok());
  }
  ASSERT_TRUE(s.Rollback().ok());
  Fill(s, *id, 0, 2);
  ASSERT_TRUE(s.Commit().ok());
  // A failing write under a reader: the reader still sees the chunk's contents; the error
  // comes with the next call that waits (here Commit), naming the state.
  n->faults->ClearRules();
  ASSERT_TRUE(
      n->faults
          ->AddRule(swap::FaultRule::Delay(std::chrono::milliseconds(100)).OnOp(swap::IoOp::kWrite))
          .ok());
  ASSERT_TRUE(n->faults->AddRule(swap::FaultRule::Error(EIO).OnOp(swap::IoOp::kWrite)).ok());
  n->events.clear();
  Fill(s, *id, 0, 3);
  {
    Result<StateLease> l = s.Acquire({*id, 1}, Access::kRead);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_FALSE(waited(1));
    std::span<float> f = l->as<float>();
    for (size_t i = 0; i < f.size(); ++i)
      ASSERT_EQ(f[i], Value(0, 1, i, 3)) << i;
    ASSERT_TRUE(l->Release().ok());
  }
  const Status commit = s.Commit();
  ASSERT_FALSE(commit.ok());
  EXPECT_NE(commit.message().find("working shard"), std::string::npos) << commit.ToString();
  n->faults->ClearRules();
  ASSERT_TRUE(s.Rollback().ok());
  Expect(s, *id, 0, 2);
}

// Bytes the kernel pins for this process (VmPin: io_uring's registered buffers), -1 unknown.
long long PinnedBytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kb = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "VmPin: %lld kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

// Registered buffers: the store's buffers are registered with io_uring at
// creation and every transfer uses them; a caller's buffer is registered when Exchange takes
// it, stays registered in the caller's hands, and is unregistered when its memory is freed
// (also after the store is gone).
TEST(NvmeStateStoreTest, BuffersAreRegisteredAndEveryTransferUsesThem) {
  auto n = MakeNvme(2, 4096, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store && n->faults);
  if (n->faults->name().find("io_uring") == std::string::npos) {
    GTEST_SKIP() << "the swap engine is " << n->faults->name()
                 << " (io_uring unavailable here): no registered buffers";
  }
  StateStore& s = *n->store;
  EXPECT_EQ(s.stats().registered_buffers, 2u);
  EXPECT_GT(PinnedBytes(), 0) << "VmPin: io_uring pinned nothing";
  Result<StateId> id = s.Register("exp_avg", 3 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  Expect(s, *id, 0, 1);
  const swap::IoEngineStats io = n->faults->stats();
  EXPECT_GT(io.submitted, 0u);
  EXPECT_EQ(s.stats().fixed_buffer_ios, io.fixed_buffer_ops);
  EXPECT_EQ(io.fixed_buffer_ops, io.submitted) << "a transfer went without a registered buffer";

  StateAllocator alloc = HeapAllocator();
  Result<StateMemory> m = alloc(4096, "staging");
  ASSERT_TRUE(m.ok());
  StateMemory buf = *std::move(m);
  std::span<float> f{reinterpret_cast<float*>(buf.data), 4096 / sizeof(float)};
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = Value(0, 0, i, 2);
  ASSERT_TRUE(s.Exchange({*id, 0}, buf).ok());
  EXPECT_EQ(s.stats().registered_buffers, 3u);  // the caller's, now the store's
  ASSERT_TRUE(s.Commit().ok());
  Fill(s, *id, 0, 2);
  Expect(s, *id, 0, 2);
  EXPECT_EQ(n->faults->stats().fixed_buffer_ops, n->faults->stats().submitted);
  buf = StateMemory{};  // the store's buffer that came back: unregistered, then freed
  EXPECT_EQ(s.stats().registered_buffers, 2u);
  // A registered buffer the caller holds when the store goes: its owner outlives both.
  Result<StateMemory> m2 = alloc(4096, "staging");
  ASSERT_TRUE(m2.ok());
  buf = *std::move(m2);
  ASSERT_TRUE(s.Exchange({*id, 1}, buf).ok());
  n->store.reset();
  buf = StateMemory{};
}

// Exchange: the caller's buffer becomes the chunk's (no copy), one of the store's comes
// back; what it held is written from the caller's memory and reads back after eviction.
// Wrong buffers and held chunks are clear errors that leave the caller's buffer as it was;
// a store without buffers says to copy.
TEST(NvmeStateStoreTest, AnExchangedBufferBecomesTheChunksAndOneOfTheStoresComesBack) {
  auto n = MakeNvme(2, 4096, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  ASSERT_EQ(s.buffer_bytes(), 4096u);
  Result<StateId> id = s.Register("working shard", 3 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  StateAllocator alloc = HeapAllocator();
  std::vector<std::byte*> mine;  // the caller's blocks, in the order given
  for (size_t c = 0; c < 3; ++c) {
    Result<StateMemory> m = alloc(4096, "staging");
    ASSERT_TRUE(m.ok());
    StateMemory buf = *std::move(m);
    std::span<float> f{reinterpret_cast<float*>(buf.data), 4096 / sizeof(float)};
    for (size_t i = 0; i < f.size(); ++i)
      f[i] = Value(0, c, i, 2);
    std::byte* given = buf.data;
    mine.push_back(given);
    ASSERT_TRUE(s.Exchange({*id, c}, buf).ok());
    EXPECT_NE(buf.data, given) << "chunk " << c << ": no buffer came back";
    EXPECT_EQ(buf.size, 4096u);
    ASSERT_NE(buf.data, nullptr);
    // The chunk is read from the caller's memory now: no copy was made.
    Result<StateLease> l = s.Acquire({*id, c}, Access::kRead);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_EQ(l->data(), given);
    ASSERT_TRUE(l->Release().ok());
    // What came back is the caller's to write (no I/O of the store uses it any more).
    std::memset(buf.data, 0xff, buf.size);
  }
  EXPECT_EQ(s.stats().exchanges, 3u);
  ASSERT_TRUE(s.Commit().ok());
  // Two buffers for three chunks: they were evicted and come back from their slots.
  Expect(s, *id, 0, 2);

  // Errors leave the caller's buffer where it was.
  Result<StateMemory> m = alloc(8192, "staging");
  ASSERT_TRUE(m.ok());
  StateMemory good = *std::move(m);
  StateMemory small{good.data, 2048, good.owner};
  Status st = s.Exchange({*id, 0}, small);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("4096"), std::string::npos) << st;
  EXPECT_EQ(small.data, good.data);
  StateMemory skewed{good.data + 64, 4096, good.owner};
  EXPECT_EQ(s.Exchange({*id, 0}, skewed).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(skewed.data, good.data + 64);
  {
    Result<StateLease> held = s.Acquire({*id, 1}, Access::kRead);
    ASSERT_TRUE(held.ok());
    EXPECT_EQ(s.Exchange({*id, 1}, good).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(good.size, 8192u);
  }
  EXPECT_EQ(s.Exchange({*id, 7}, good).code(), StatusCode::kOutOfRange);
  Expect(s, *id, 0, 2);

  std::unique_ptr<StateStore> host = MakeHostStateStore(HeapAllocator());
  Result<StateId> h = host->Register("working shard", 4096, 4096);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(host->buffer_bytes(), 0u);
  const Status no = host->Exchange({*h, 0}, good);
  EXPECT_EQ(no.code(), StatusCode::kUnimplemented) << no;
  EXPECT_NE(no.message().find("kWrite"), std::string::npos) << no;
}

// The swap files under `dir` as /proc/self/fd links: they are unlinked, and the process's
// descriptors still reach them.
std::vector<std::string> SwapFileLinks(const std::string& dir) {
  std::vector<std::string> links;
  for (int fd = 0; fd < 4096; ++fd) {
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    char target[4096];
    const ssize_t len = ::readlink(link.c_str(), target, sizeof target - 1);
    if (len <= 0) continue;
    target[len] = '\0';
    if (std::string(target).rfind(dir + "/", 0) == 0) links.push_back(link);
  }
  return links;
}

// A committed chunk whose bytes are corrupted in the swap file itself (not in
// flight: every swap file the process holds open under the directory overwritten through
// /proc/self/fd) fails its read with DataLoss naming the state, the chunk, the file and
// the offset, and saying to resume from the last checkpoint.
TEST(NvmeStateStoreTest, ACommittedChunkCorruptOnDiskNamesWhereAndSaysToResume) {
  const size_t chunk = 2 * 4096;
  auto n = MakeNvme(1, chunk, /*write_behind=*/false);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("exp_avg", 2 * chunk, chunk);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  ASSERT_TRUE(s.Acquire({*id, 1}, Access::kRead).ok());  // chunk 0 leaves the one buffer
  int corrupted = 0;
  for (const std::string& link : SwapFileLinks(n->dir.path())) {
    const int w = ::open(link.c_str(), O_WRONLY);
    ASSERT_GE(w, 0) << link;
    const std::vector<char> junk(16 * chunk, 0x5a);
    ASSERT_EQ(::pwrite(w, junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
    ASSERT_EQ(::fsync(w), 0);
    ::close(w);
    ++corrupted;
  }
  ASSERT_GE(corrupted, 1) << "no swap file open under " << n->dir.path();
  Result<StateLease> bad = s.Acquire({*id, 0}, Access::kRead);
  ASSERT_FALSE(bad.ok());
  const Status& st = bad.status();
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st;
  for (const char* part : {"state exp_avg chunk 0", "CRC32C mismatch in ", " at offset ",
                           "resume from the last checkpoint"}) {
    EXPECT_NE(st.message().find(part), std::string::npos) << "no '" << part << "' in: " << st;
  }
}

// Calls fn(float) for every float of the swap files under `dir`.
template <typename Fn>
void ForEachSwapFileFloat(const std::string& dir, Fn fn) {
  for (const std::string& link : SwapFileLinks(dir)) {
    const int r = ::open(link.c_str(), O_RDONLY);
    EXPECT_GE(r, 0) << link;
    if (r < 0) continue;
    std::vector<float> buf(1 << 16);
    for (off_t off = 0;;) {
      const ssize_t got = ::pread(r, buf.data(), buf.size() * sizeof(float), off);
      if (got <= 0) break;
      for (ssize_t k = 0; k < got / static_cast<ssize_t>(sizeof(float)); ++k)
        fn(buf[static_cast<size_t>(k)]);
      off += got;
    }
    ::close(r);
  }
}

// How many floats of state s's `chunks` chunks at `version` the swap files hold, and how
// many NaNs.
std::pair<size_t, size_t> OnDisk(const std::string& dir, int s, size_t chunks, size_t floats,
                                 int version) {
  std::set<float> want;
  for (size_t c = 0; c < chunks; ++c) {
    for (size_t i = 0; i < floats; ++i)
      want.insert(Value(s, c, i, version));
  }
  size_t found = 0;
  size_t nans = 0;
  ForEachSwapFileFloat(dir, [&](float f) {
    if (std::isnan(f)) {
      ++nans;  // (a set's ordering does not hold NaN)
    } else if (want.count(f) != 0) {
      ++found;
    }
  });
  return {found, nans};
}

// The relocating test mode on disk: every write of a chunk goes to a fresh slot and
// the slot it replaces becomes NaN; Commit poisons the committed slots it replaced, Rollback
// the abandoned ones; every release poisons the buffer and gives it up, so a pointer kept
// past its lease reads NaN and every lease reads the chunk back from disk.
TEST(NvmeStateStoreTest, RelocateModeMovesEveryWriteAndPoisonsTheReplacedSlotsOnDisk) {
  const size_t chunk = 4096;
  const size_t floats = chunk / sizeof(float);
  auto n = MakeNvme(4, chunk, /*write_behind=*/true, nullptr, true, /*relocate=*/true);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  EXPECT_EQ(s.name(), "nvme (relocating test mode)");
  Result<StateId> id = s.Register("exp_avg", 3 * chunk, chunk);
  ASSERT_TRUE(id.ok());

  Result<StateLease> l = s.Acquire({*id, 1}, Access::kWrite);
  ASSERT_TRUE(l.ok());
  float* kept = l->as<float>().data();
  for (size_t i = 0; i < floats; ++i)
    l->as<float>()[i] = Value(1, 1, i, 0);
  ASSERT_TRUE(l->Release().ok());
  EXPECT_TRUE(std::isnan(kept[0]) && std::isnan(kept[floats - 1]));  // the buffer, poisoned

  Fill(s, *id, 1, 0);
  ASSERT_TRUE(s.Commit().ok());
  EXPECT_EQ(OnDisk(n->dir.path(), 1, 3, floats, 0).first, 3 * floats);  // exactly one copy

  // A second epoch: both versions on disk until its Commit, then only the new one.
  Fill(s, *id, 1, 1);
  Fill(s, *id, 1, 1);  // written twice: the first slot of this epoch is replaced too
  EXPECT_EQ(OnDisk(n->dir.path(), 1, 3, floats, 0).first, 3 * floats);
  EXPECT_EQ(OnDisk(n->dir.path(), 1, 3, floats, 1).first, 3 * floats);
  ASSERT_TRUE(s.Commit().ok());
  auto [old_found, nans] = OnDisk(n->dir.path(), 1, 3, floats, 0);
  EXPECT_EQ(old_found, 0u) << "a replaced committed slot still holds its contents";
  EXPECT_GE(nans, 3 * floats);
  const uint64_t reads = s.stats().reads;
  Expect(s, *id, 1, 1);
  EXPECT_EQ(s.stats().reads, reads + 3) << "every lease reads its chunk back from disk";

  // A rolled back epoch leaves nothing of itself on disk.
  Fill(s, *id, 1, 2);
  EXPECT_EQ(OnDisk(n->dir.path(), 1, 3, floats, 2).first, 3 * floats);
  ASSERT_TRUE(s.Rollback().ok());
  EXPECT_EQ(OnDisk(n->dir.path(), 1, 3, floats, 2).first, 0u);
  Expect(s, *id, 1, 1);

  // Zeroed and committed: the last contents are gone from disk too.
  ASSERT_TRUE(s.Zero(*id).ok());
  ASSERT_TRUE(s.Commit().ok());
  EXPECT_EQ(OnDisk(n->dir.path(), 1, 3, floats, 1).first, 0u);
  Expect(s, *id, 1, -1);
  EXPECT_GE(s.stats().relocations, 10u);
}

// Exchange's block CRCs (computed by the caller) are its write's: right ones read back, a
// wrong one is the read back's DataLoss (they are used, not recomputed); a read-only lease
// keeps them, a lease that may modify the chunk drops them (its write computes its own); a
// wrong count, or CRCs for a store without checksums, are refused and leave the caller's
// buffer as it was.
TEST(NvmeStateStoreTest, AnExchangesBlockCrcsAreItsWriteAndALeaseThatMayModifyDropsThem) {
  const size_t chunk = 3 * 4096 + 1000;  // its write: 16384 bytes, 4 blocks of 4096
  auto n = MakeNvme(1, chunk, /*write_behind=*/true);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("working shard", 2 * chunk, chunk);
  ASSERT_TRUE(id.ok());
  const StateRange c0{*id, 0};
  const StateStore::WriteChecksums w = s.write_checksums(c0);
  EXPECT_EQ(w.block_bytes, 4096u);
  EXPECT_EQ(w.io_bytes, 16384u);
  ASSERT_EQ(w.blocks(), 4u);
  ASSERT_EQ(s.buffer_bytes(), 16384u);
  StateAllocator alloc = HeapAllocator();
  Result<StateMemory> m = alloc(s.buffer_bytes(), "staging");
  ASSERT_TRUE(m.ok());
  StateMemory buf = *std::move(m);
  // The caller's buffer holding version v of chunk 0, and its write's CRCs.
  auto fill = [&](int version) {
    std::span<float> f{reinterpret_cast<float*>(buf.data), chunk / sizeof(float)};
    for (size_t i = 0; i < f.size(); ++i)
      f[i] = Value(0, 0, i, version);
    std::vector<uint32_t> crcs;
    for (size_t b = 0; b < w.blocks(); ++b)
      crcs.push_back(swap::Crc32c({buf.data + b * w.block_bytes, w.block_bytes}));
    return crcs;
  };
  // Evicts chunk 0 (one buffer) and reads it back through its CRCs.
  auto read_back = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(s.Acquire({*id, 1}, Access::kRead).status());
    STRATA_ASSIGN_OR_RETURN(StateLease l, s.Acquire(c0, Access::kRead));
    return l.as<float>()[7] == Value(0, 0, 7, 1) ? Status::Ok() : InternalError("contents");
  };

  ASSERT_TRUE(s.Exchange(c0, buf, fill(1)).ok());
  EXPECT_EQ(s.stats().writes_with_given_crcs, 1u);
  ASSERT_TRUE(s.Commit().ok());
  EXPECT_TRUE(read_back().ok());

  std::vector<uint32_t> wrong = fill(1);
  wrong[2] ^= 0x10;
  ASSERT_TRUE(s.Exchange(c0, buf, wrong).ok());
  EXPECT_EQ(s.stats().writes_with_given_crcs, 2u);
  ASSERT_TRUE(s.Commit().ok());
  Status bad = read_back();
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad;
  EXPECT_NE(bad.message().find("CRC32C mismatch"), std::string::npos) << bad;
  ASSERT_TRUE(s.Rollback().ok());

  // Without write-behind the chunk waits in its buffer with its CRCs: a read-only lease
  // keeps them, a read-write lease drops them (it wrote to the buffer).
  s.SetWriteBehind(false);
  ASSERT_TRUE(s.Exchange(c0, buf, fill(1)).ok());
  ASSERT_TRUE(s.Acquire(c0, Access::kRead).ok());
  ASSERT_TRUE(s.Commit().ok());
  EXPECT_EQ(s.stats().writes_with_given_crcs, 3u);
  EXPECT_TRUE(read_back().ok());
  fill(1);  // the buffer that came back holds version 1 again
  ASSERT_TRUE(s.Exchange(c0, buf, wrong).ok());
  {
    Result<StateLease> l = s.Acquire(c0, Access::kReadWrite);
    ASSERT_TRUE(l.ok());
    l->as<float>()[0] = -1.0f;  // the wrong CRC's block is not this one: only the drop helps
  }
  ASSERT_TRUE(s.Commit().ok());
  EXPECT_EQ(s.stats().writes_with_given_crcs, 3u);
  Status kept = read_back();
  EXPECT_TRUE(kept.ok()) << kept;

  // Refused, the caller's buffer unchanged.
  std::byte* mine = buf.data;
  Status count = s.Exchange(c0, buf, std::vector<uint32_t>(3, 0));
  EXPECT_EQ(count.code(), StatusCode::kInvalidArgument) << count;
  EXPECT_NE(count.message().find("expected 4"), std::string::npos) << count;
  EXPECT_EQ(buf.data, mine);
  auto off = MakeNvme(1, chunk, true, nullptr, /*checksums=*/false);
  ASSERT_TRUE(off && off->store);
  Result<StateId> oid = off->store->Register("working shard", chunk, chunk);
  ASSERT_TRUE(oid.ok());
  EXPECT_EQ(off->store->write_checksums({*oid, 0}).block_bytes, 0u);
  Status unchecked = off->store->Exchange({*oid, 0}, buf, fill(1));
  EXPECT_EQ(unchecked.code(), StatusCode::kInvalidArgument) << unchecked;
  EXPECT_NE(unchecked.message().find("no checksums"), std::string::npos) << unchecked;
  EXPECT_EQ(buf.data, mine);
  EXPECT_TRUE(off->store->Exchange({*oid, 0}, buf).ok());
}

TEST(NvmeStateStoreTest, HeldBuffersAndOversizedChunksAreClearErrors) {
  auto n = MakeNvme(2, 4096, false);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  EXPECT_EQ(s.Register("big", 3 * 8192, 8192).status().code(), StatusCode::kInvalidArgument);
  Result<StateId> id = s.Register("acc", 3 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Result<StateLease> a = s.Acquire({*id, 0}, Access::kWrite);
  Result<StateLease> b = s.Acquire({*id, 1}, Access::kWrite);
  ASSERT_TRUE(a.ok() && b.ok());
  Result<StateLease> c = s.Acquire({*id, 2}, Access::kWrite);
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("buffer_count"), std::string::npos);
}

// Every buffer held or being read ahead (what bench/soak.py met with every working shard on
// NVMe: the pipelined step's hand-over of a new working shard while the coordinator held one
// shard and read the others ahead failed with "all 5 NVMe state buffers are held"): an Acquire
// takes the buffer of the read ahead wanted last once its read ends; that chunk is read again
// when wanted.
TEST(NvmeStateStoreTest, AnAcquireTakesAReadAheadsBufferWhenTheOthersAreHeld) {
  auto n = MakeNvme(3, 4096, false);
  ASSERT_TRUE(n && n->store);
  StateStore& s = *n->store;
  Result<StateId> id = s.Register("working shard", 4 * 4096, 4096);
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 0, 1);
  ASSERT_TRUE(s.Commit().ok());
  // Chunk 0 held; 1 and 2 read ahead (2 last, so wanted last).
  Result<StateLease> held = s.Acquire({*id, 0}, Access::kRead);
  ASSERT_TRUE(held.ok());
  // The reads are still in flight when chunk 3 wants a buffer.
  ASSERT_TRUE(
      n->faults
          ->AddRule(swap::FaultRule::Delay(std::chrono::milliseconds(50)).OnOp(swap::IoOp::kRead))
          .ok());
  ASSERT_TRUE(s.Prefetch({*id, 1}).ok());
  ASSERT_TRUE(s.Prefetch({*id, 2}).ok());
  Result<StateLease> w = s.Acquire({*id, 3}, Access::kWrite);
  ASSERT_TRUE(w.ok()) << w.status();
  n->faults->ClearRules();
  EXPECT_EQ(s.stats().reads_ahead_given_up, 1u);
  for (size_t i = 0; i < 1024; ++i)
    w->as<float>()[i] = Value(0, 3, i, 2);
  ASSERT_TRUE(w->Release().ok());
  ASSERT_TRUE(held->Release().ok());
  const uint64_t hits = s.stats().prefetch_hits;
  Result<StateLease> one = s.Acquire({*id, 1}, Access::kRead);  // still read ahead
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->as<float>()[7], Value(0, 1, 7, 1));
  EXPECT_EQ(s.stats().prefetch_hits, hits + 1);
  ASSERT_TRUE(one->Release().ok());
  Result<StateLease> two = s.Acquire({*id, 2}, Access::kRead);  // given up: read again
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->as<float>()[7], Value(0, 2, 7, 1));
  ASSERT_TRUE(two->Release().ok());
}

}  // namespace
}  // namespace strata::offload

// NvmeStateStore: the state store over swap slots (offload_optimizer.device = nvme).
//
// Every chunk has two slots in a SwapSpace (CRC32C on every block). Its committed contents
// are in one of them, or are all zeros (never written, or Zero()ed); an epoch's changes are
// written to the other slot, and Commit() switches to it only after every write of the epoch
// succeeded. A failed write therefore leaves the committed contents intact, and Rollback()
// returns to them.
//
// Chunks are brought into `buffer_count` host buffers of the largest chunk's size, allocated
// once at Create from `allocator` (pinned buffers from the host pool): the store never holds
// more host memory than that, whatever the size of the states. A chunk stays in its buffer
// until the buffer is needed for another chunk (least recently used first, clean before
// modified), so a chunk used twice in a row is read once.
//   - Prefetch starts a read into a free or clean buffer; it may wait for a write to end
//     to free one, and does nothing when every buffer is held or being read. A chunk
//     already resident is marked as wanted next instead: it is evicted last. An Acquire
//     that finds every buffer held or being read takes the buffer of the read ahead wanted
//     last once its read ends (stats().reads_ahead_given_up; that chunk is read again).
//   - With write_behind (offload_optimizer.pipeline_write), releasing a modified chunk
//     submits its write at once, so it overlaps the caller's next work; without, a modified
//     chunk is written when its buffer is needed or at Commit.
//   - A read-only Acquire of a chunk still being written does not wait for the write
//     (the buffer holds what is being written; neither changes it), so a chunk handed
//     over and read at once (the pipelined step's new working shards) is read beside its
//     write. Modifying it, or evicting it, waits.
//   - Exchange() takes the caller's buffer as a chunk's new contents and gives back one of
//     the store's (the one the chunk had, or the one it would have evicted): a whole-chunk
//     write without a copy (the pipelined step's new working shards). With the write's
//     block CRCs computed by the caller (write_checksums), its write computes none: the
//     pipelined step computes them on CPU-Adam's threads, not on the engine's thread.
//   - Zero() needs no I/O: zero chunks are filled in memory when acquired.
//   - Registered buffers: the store's buffers are registered with the swap space's I/O
//     engine at Create, and a caller's buffer the first time Exchange() takes it, so
//     transfers use io_uring's fixed buffers (no page pinning per request). A buffer stays
//     registered wherever it goes (Exchange hands registered buffers to the caller); its
//     memory's owner unregisters it before the memory is freed. Where the kernel refuses
//     (RLIMIT_MEMLOCK, the engine's table full, or the sync engine) the engine logs it and
//     transfers go without; stats() counts registered buffers and fixed-buffer transfers.
//
// The relocating test mode (relocate; STRATA_TEST_RELOCATING_STORE=1 in the engine), the
// host store's counterpart on disk: every release of a modified chunk writes it at once to
// a freshly allocated slot (never the one it was read from or last written to) and then
// overwrites the slot it replaces with NaN bytes; Commit() overwrites the replaced
// committed slots, Rollback() the abandoned ones. Every release (read-only too) fills the
// chunk's buffer with NaN and gives the buffer up, so the next lease reads the chunk back
// from disk. A pointer kept past its lease, a read of a stale slot, or a write that never
// reached disk shows as NaN or as wrong values instead of yesterday's plausible bytes.
// Slow (a synchronous write per release): for tests only.
//
// A chunk's reads and writes move its bytes rounded up to 4 KiB (slots and buffers are
// sized so), so O_DIRECT needs no bounce buffer. Errors name the state, the chunk, and
// (from SwapSpace) the file and offset.
#pragma once

#include <memory>

#include "strata/offload/cpu/state_store.h"
#include "strata/swap/swap_space.h"

namespace strata::offload {

struct NvmeStateStoreOptions {
  // The swap space the slots are in (owned by the store).
  std::unique_ptr<swap::SwapSpace> swap;
  // Host buffers (offload_optimizer.buffer_count): at least the chunks the caller holds at
  // once, plus those it prefetches.
  int buffer_count = 4;
  // The largest chunk any state will have (each buffer's size).
  size_t max_chunk_bytes = 0;
  StateAllocator allocator;
  bool write_behind = false;  // offload_optimizer.pipeline_write
  StateObserver observer;     // tests: the order of reads and writes
  bool relocate = false;      // the relocating test mode (above)
};

Result<std::unique_ptr<StateStore>> MakeNvmeStateStore(NvmeStateStoreOptions options);

}  // namespace strata::offload

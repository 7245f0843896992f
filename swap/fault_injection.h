// FaultInjectingIoEngine: an IoEngine for tests that makes chosen transfers fail.
//
// It creates a real engine (io_uring or sync, from the options) and installs a result
// hook (IoEngineOptions::result_hook) through which every raw transfer result passes.
// A fault rewrites that result *inside* the engine, so what a test sees is what the
// engine's own error handling makes of it: an injected -EIO becomes an IOError
// completion naming the file and offset, an injected short transfer is completed by the
// engine resubmitting the remainder, an injected -EAGAIN is requeued, corrupted read bytes
// reach the caller as if the disk had returned them (the swap space's CRC32C must catch
// them).
//
//   STRATA_ASSIGN_OR_RETURN(auto io, FaultInjectingIoEngine::Create(options, /*seed=*/7));
//   io->AddRule(FaultRule::Error(EIO).OnOp(IoOp::kWrite).Nth(3));  // the 3rd write fails
//   io->AddRule(FaultRule::CorruptRead(100).OnFile(f));            // every read of f
//
// Which transfers a rule hits: all conditions that are set must hold (op, file, a byte
// offset inside the request's range, tag); by default only the first transfer of a
// request counts (not its requeues or remainders). Of the matching transfers, the rule
// fires on every one, or from the nth on for `count` transfers, each time with
// `probability` drawn from a generator seeded at Create — deterministic for one thread
// of submissions on one engine thread.
//
// Thread-safety: like any IoEngine; rules may be added and removed while I/O runs.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"
#include "strata/swap/io_engine.h"

namespace strata::swap {

enum class FaultKind {
  kError,          // the transfer fails with -error (EIO, ENOSPC, EAGAIN, EINTR, ...)
  kShortTransfer,  // the transfer moves at most short_bytes (0: none, i.e. EOF/no progress)
  kDelay,          // the engine thread stalls for `delay` before handling the result
  kCorruptRead,    // a read's byte at corrupt_offset (within the transfer) is flipped
};
std::string_view FaultKindName(FaultKind kind);  // "error", "short", "delay", "corrupt"

struct FaultRule {
  FaultKind kind = FaultKind::kError;

  // Conditions (unset = any).
  std::optional<IoOp> op;
  std::optional<FileId> file;
  std::optional<uint64_t> offset;  // the request covers this byte of the file
  std::optional<uint64_t> tag;
  bool first_attempt_only = true;  // ignore requeues and resubmitted remainders

  // Which matching transfers: nth == 0: every one; else the nth (1-based) and the
  // following count-1 (count == 0: all from the nth on). Then `probability`.
  uint64_t nth = 0;
  uint64_t count = 1;
  double probability = 1.0;

  // Parameters of the fault.
  int error = EIO;
  size_t short_bytes = 0;
  std::chrono::milliseconds delay{50};
  size_t corrupt_offset = 0;

  static FaultRule Error(int errno_value);
  static FaultRule ShortTransfer(size_t bytes);
  static FaultRule Delay(std::chrono::milliseconds delay);
  static FaultRule CorruptRead(size_t offset_in_transfer);

  FaultRule& OnOp(IoOp o) {
    op = o;
    return *this;
  }
  FaultRule& OnFile(FileId f) {
    file = f;
    return *this;
  }
  FaultRule& AtOffset(uint64_t o) {
    offset = o;
    return *this;
  }
  FaultRule& WithTag(uint64_t t) {
    tag = t;
    return *this;
  }
  FaultRule& Nth(uint64_t n, uint64_t how_many = 1) {
    nth = n;
    count = how_many;
    return *this;
  }
  FaultRule& WithProbability(double p) {
    probability = p;
    return *this;
  }
  FaultRule& EveryAttempt() {
    first_attempt_only = false;
    return *this;
  }

  std::string ToString() const;
};

class FaultInjectingIoEngine final : public IoEngine {
 public:
  // Creates the inner engine from `options` (any result_hook there runs first).
  // InvalidArgument for a bad option, or what CreateIoEngine returns.
  static Result<std::unique_ptr<FaultInjectingIoEngine>> Create(IoEngineOptions options,
                                                                uint64_t seed = 1);
  ~FaultInjectingIoEngine() override;

  // Returns an id for RemoveRule/injected. InvalidArgument for a probability outside
  // [0, 1] or a kError rule with error <= 0.
  Result<int> AddRule(const FaultRule& rule);
  void RemoveRule(int rule_id);
  void ClearRules();
  // Faults injected so far: by one rule, or by all.
  uint64_t injected(int rule_id) const;
  uint64_t injected() const;

  IoEngine& inner() { return *inner_; }

  // IoEngine, forwarded to the inner engine.
  std::string name() const override;  // "faulty(io_uring)"
  std::string fallback() const override { return inner_->fallback(); }
  const IoEngineOptions& options() const override { return inner_->options(); }
  Result<FileId> RegisterFile(int fd, std::string path) override {
    return inner_->RegisterFile(fd, std::move(path));
  }
  Status UnregisterFile(FileId file) override { return inner_->UnregisterFile(file); }
  Result<int> RegisterBuffer(std::span<std::byte> memory) override {
    return inner_->RegisterBuffer(memory);
  }
  Status UnregisterBuffer(int buffer_id) override { return inner_->UnregisterBuffer(buffer_id); }
  Status Submit(std::span<const IoRequest> batch) override { return inner_->Submit(batch); }
  Result<IoCompletion> WaitOne(
      std::optional<std::chrono::milliseconds> timeout = std::nullopt) override {
    return inner_->WaitOne(timeout);
  }
  size_t Poll(std::vector<IoCompletion>* out) override { return inner_->Poll(out); }
  Status WaitAll(std::vector<IoCompletion>* out,
                 std::optional<std::chrono::milliseconds> timeout = std::nullopt) override {
    return inner_->WaitAll(out, timeout);
  }
  size_t Cancel(uint64_t tag) override { return inner_->Cancel(tag); }
  size_t CancelAll() override { return inner_->CancelAll(); }
  size_t in_flight() const override { return inner_->in_flight(); }
  IoEngineStats stats() const override { return inner_->stats(); }

  struct State;  // shared with the hook

 private:
  FaultInjectingIoEngine() = default;
  std::shared_ptr<State> state_;
  std::unique_ptr<IoEngine> inner_;
};

}  // namespace strata::swap

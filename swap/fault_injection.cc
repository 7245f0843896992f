// FaultInjectingIoEngine: rules applied to raw transfer results through the engine's
// result hook.
#include "strata/swap/fault_injection.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

namespace strata::swap {

std::string_view FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kError:
      return "error";
    case FaultKind::kShortTransfer:
      return "short";
    case FaultKind::kDelay:
      return "delay";
    case FaultKind::kCorruptRead:
      return "corrupt";
  }
  return "unknown";
}

FaultRule FaultRule::Error(int errno_value) {
  FaultRule r;
  r.kind = FaultKind::kError;
  r.error = errno_value;
  return r;
}

FaultRule FaultRule::ShortTransfer(size_t bytes) {
  FaultRule r;
  r.kind = FaultKind::kShortTransfer;
  r.short_bytes = bytes;
  return r;
}

FaultRule FaultRule::Delay(std::chrono::milliseconds d) {
  FaultRule r;
  r.kind = FaultKind::kDelay;
  r.delay = d;
  return r;
}

FaultRule FaultRule::CorruptRead(size_t offset_in_transfer) {
  FaultRule r;
  r.kind = FaultKind::kCorruptRead;
  r.op = IoOp::kRead;
  r.corrupt_offset = offset_in_transfer;
  return r;
}

std::string FaultRule::ToString() const {
  std::ostringstream os;
  os << FaultKindName(kind);
  if (kind == FaultKind::kError) os << " errno " << error;
  if (kind == FaultKind::kShortTransfer) os << " to " << short_bytes << " bytes";
  if (kind == FaultKind::kDelay) os << " " << delay.count() << " ms";
  if (kind == FaultKind::kCorruptRead) os << " at byte " << corrupt_offset;
  if (op) os << " on " << IoOpName(*op) << "s";
  if (file) os << " of file " << *file;
  if (offset) os << " covering offset " << *offset;
  if (tag) os << " with tag " << *tag;
  if (nth) os << ", from match " << nth << (count ? " for " + std::to_string(count) : " on");
  if (probability < 1.0) os << ", probability " << probability;
  if (!first_attempt_only) os << ", every attempt";
  return os.str();
}

struct FaultInjectingIoEngine::State {
  struct Active {
    FaultRule rule;
    uint64_t matches = 0;
    uint64_t injected = 0;
  };
  mutable std::mutex mu;
  std::map<int, Active> rules;
  int next_id = 1;
  uint64_t total = 0;
  std::mt19937_64 rng;

  int64_t Apply(const IoResultEvent& ev) {
    int64_t result = ev.result;
    std::chrono::milliseconds sleep{0};
    {
      std::lock_guard lock(mu);
      for (auto& [id, a] : rules) {
        const FaultRule& r = a.rule;
        if (r.first_attempt_only && ev.attempt != 0) continue;
        if (r.op && *r.op != ev.request.op) continue;
        if (r.file && *r.file != ev.request.file) continue;
        if (r.tag && *r.tag != ev.request.tag) continue;
        if (r.offset &&
            (*r.offset < ev.request.offset || *r.offset >= ev.request.offset + ev.request.length))
          continue;
        const uint64_t m = ++a.matches;
        if (r.nth != 0 && (m < r.nth || (r.count != 0 && m >= r.nth + r.count))) continue;
        if (r.probability < 1.0) {
          const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
          if (u >= r.probability) continue;
        }
        bool hit = false;
        switch (r.kind) {
          case FaultKind::kError:
            result = -static_cast<int64_t>(r.error);
            hit = true;
            break;
          case FaultKind::kShortTransfer:
            if (result > static_cast<int64_t>(r.short_bytes)) {
              result = static_cast<int64_t>(r.short_bytes);
              hit = true;
            }
            break;
          case FaultKind::kDelay:
            sleep += r.delay;
            hit = true;
            break;
          case FaultKind::kCorruptRead:
            if (ev.request.op == IoOp::kRead && result > static_cast<int64_t>(r.corrupt_offset)) {
              static_cast<std::byte*>(ev.buffer)[r.corrupt_offset] ^= std::byte{0x5a};
              hit = true;
            }
            break;
        }
        if (hit) {
          a.injected++;
          total++;
        }
      }
    }
    if (sleep.count() > 0) std::this_thread::sleep_for(sleep);
    return result;
  }
};

Result<std::unique_ptr<FaultInjectingIoEngine>> FaultInjectingIoEngine::Create(
    IoEngineOptions options, uint64_t seed) {
  auto state = std::make_shared<State>();
  state->rng.seed(seed);
  IoResultHook user = std::move(options.result_hook);
  options.result_hook = [state, user](const IoResultEvent& ev) -> int64_t {
    if (!user) return state->Apply(ev);
    IoResultEvent first = ev;
    first.result = user(ev);
    return state->Apply(first);
  };
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> inner, CreateIoEngine(options));
  std::unique_ptr<FaultInjectingIoEngine> e(new FaultInjectingIoEngine());
  e->state_ = std::move(state);
  e->inner_ = std::move(inner);
  return e;
}

FaultInjectingIoEngine::~FaultInjectingIoEngine() {
  inner_.reset();
}

std::string FaultInjectingIoEngine::name() const {
  return "faulty(" + inner_->name() + ")";
}

Result<int> FaultInjectingIoEngine::AddRule(const FaultRule& rule) {
  if (!(rule.probability >= 0.0 && rule.probability <= 1.0))
    return InvalidArgumentError("fault rule '" + rule.ToString() +
                                "': probability must be within [0, 1]");
  if (rule.kind == FaultKind::kError && rule.error <= 0)
    return InvalidArgumentError("fault rule '" + rule.ToString() +
                                "': error must be a positive errno value (EIO, ENOSPC, ...)");
  std::lock_guard lock(state_->mu);
  const int id = state_->next_id++;
  state_->rules[id] = State::Active{rule, 0, 0};
  return id;
}

void FaultInjectingIoEngine::RemoveRule(int rule_id) {
  std::lock_guard lock(state_->mu);
  state_->rules.erase(rule_id);
}

void FaultInjectingIoEngine::ClearRules() {
  std::lock_guard lock(state_->mu);
  state_->rules.clear();
}

uint64_t FaultInjectingIoEngine::injected(int rule_id) const {
  std::lock_guard lock(state_->mu);
  auto it = state_->rules.find(rule_id);
  return it == state_->rules.end() ? 0 : it->second.injected;
}

uint64_t FaultInjectingIoEngine::injected() const {
  std::lock_guard lock(state_->mu);
  return state_->total;
}

}  // namespace strata::swap

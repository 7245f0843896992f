#include "strata/engine/libtorch/profiler_ranges.h"

#include <ATen/record_function.h>

#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "strata/engine/timeline/timeline.h"

#if defined(STRATA_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace strata {
namespace {

// "strata::" + name, cached per thread (the names are the scopes' string literals: a few
// dozen), so the every-scope NVTX path takes no lock; a range's name is copied by the
// profiler when the range begins and ends before its thread does.
std::string_view Named(const char* name) {
  thread_local std::unordered_map<const char*, std::string> names;
  auto [it, inserted] = names.try_emplace(name);
  if (inserted) it->second = std::string("strata::") + name;
  return it->second;
}

struct Range {
  explicit Range(at::StepCallbacks&& callbacks) : rf(std::move(callbacks)) {}
  at::RecordFunction rf;
};

#if defined(STRATA_NVTX)
char nvtx_only;  // the token of a scope with an NVTX range and no profiler range
#endif

void* Begin(const char* name) {
#if defined(STRATA_NVTX)
  const std::string_view full = Named(name);
  nvtxRangePushA(full.data());
#endif
  // Nothing is allocated unless a profiler records this thread.
  std::optional<at::StepCallbacks> callbacks =
      at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE);
  if (!callbacks) {
#if defined(STRATA_NVTX)
    return &nvtx_only;
#else
    return nullptr;
#endif
  }
#if !defined(STRATA_NVTX)
  const std::string_view full = Named(name);
#endif
  auto* range = new Range(std::move(*callbacks));
  if (range->rf.isActive()) range->rf.before(full, c10::ArrayRef<const c10::IValue>{});
  return range;
}

void End(void* token) {
#if defined(STRATA_NVTX)
  if (token != &nvtx_only) delete static_cast<Range*>(token);
  nvtxRangePop();
#else
  delete static_cast<Range*>(token);  // its RecordFunction's end
#endif
}

constexpr engine::ScopeObserver kObserver{&Begin, &End};

}  // namespace

void InstallProfilerRanges() {
  static std::once_flag once;
  std::call_once(once, [] { engine::SetScopeObserver(&kObserver); });
}

}  // namespace strata

// The engine's timed scopes as profiler ranges: while torch.profiler (or the
// C++ autograd profiler) records a thread, every TimedScope that thread runs (the all-gather
// and staging waits, the waits before and for a reduction, the wait for the CPU update, the
// working-shard push) is a range named "strata::" plus the span's name in Strata's own
// timeline ("strata::all-gather wait"). In a build with CUDA they are NVTX ranges as well
// (Nsight Systems shows them; free when no tool is attached).
#pragma once

namespace strata {

// Installs the observer (engine/timeline/timeline.h, SetScopeObserver) once per process;
// strata::initialize and the Python module call it. Idempotent, thread-safe.
void InstallProfilerRanges();

}  // namespace strata
